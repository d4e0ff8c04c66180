"""Model families: each module says one architecture's math in plain JAX over the Linear
and AttentionBackend seams (runtime/model/) and gives the same functions:

    param_shapes(cfg)                         the stored tree's shapes (checkpoint layout)
    forward_hidden(cfg, params, ids, positions, attention, cache) -> (hidden [T, d], cache)
    lm_head(cfg, params, hidden)              -> float32 logits
    dense_logits(cfg, params, ids)            a cache-free reference forward

`family(cfg)` picks the module from the config's architecture; nothing else in the engine
names a family.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from runtime.config import ModelConfig
from runtime.model.families import deepseek, gemma, llama, moe, qwen3

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": llama, "qwen3": qwen3, "gemma2": gemma, "gemma3": gemma,
                                   "phi3": llama,  # Phi-3: Llama's math (fused weights split at convert)
                                   "mixtral": moe, "qwen3_moe": moe, "deepseek_v2": deepseek}


def family(cfg: ModelConfig) -> ModuleType:
    try:
        return FAMILIES[cfg.architecture]
    except KeyError:
        raise ValueError(f"architecture: no model family {cfg.architecture!r} "
                         f"(supported: {', '.join(FAMILIES)})") from None


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    return family(cfg).param_shapes(cfg)


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = np.float32) -> dict[str, Any]:
    """Random weights (numpy) with the family's exact stored tree: tiny test models use it."""
    return llama.init_params(cfg, seed, dtype, shapes=param_shapes(cfg))


def dense_logits(cfg: ModelConfig, params: dict[str, Any], token_ids: Any) -> Any:
    return family(cfg).dense_logits(cfg, params, token_ids)
