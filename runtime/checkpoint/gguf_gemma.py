"""Gemma 3 in a llama.cpp GGUF (general.architecture "gemma3"): tensor names and the model
config that llama.cpp derives from the metadata (llama-model.cpp, LLM_ARCH_GEMMA3).

What llama.cpp's converter (convert_hf_to_gguf.py, Gemma3Model) did to the weights, and so
what reading them back must (not) undo:
- every `*norm.weight` was stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w): that is
  already the effective multiplier our parameter tree stores, so norms are copied as they are
  (transformers' GGUF loader subtracts the 1 again for its own Gemma3RMSNorm);
- Q and K rows were NOT permuted (llama.cpp runs Gemma with NEOX, i.e. rotate-half, RoPE), so
  unlike llama's attn_q/attn_k they are only transposed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from runtime.checkpoint.mapping import GGUF_ARCH_KEYS, GGUF_RULES, Rule

def _gemma_rule(r: Rule) -> Rule:
    """Llama's GGUF rule as Gemma 3 reads it: q and k only transposed (see above)."""
    return dataclasses.replace(r, transform="t") if r.transform.startswith("unpermute_") else r


# Llama's tensors without the q/k/v biases, plus Gemma 3's q/k norms and post-norms.
GEMMA3_RULES = tuple(_gemma_rule(r) for r in GGUF_RULES if not r.source.endswith(".bias")) + (
    Rule("blk.{i}.attn_q_norm.weight", "layers/q_norm"),
    Rule("blk.{i}.attn_k_norm.weight", "layers/k_norm"),
    Rule("blk.{i}.post_attention_norm.weight", "layers/post_attn_norm"),
    Rule("blk.{i}.post_ffw_norm.weight", "layers/post_mlp_norm"),
)

# `gemma3.` metadata keys read (or checked) below or by GGUFSource.model_config; any other is
# refused by name: llama's less the expert counts, plus the local RoPE base and the final
# soft-cap. attn_logit_softcapping is deliberately absent: llama.cpp ignores it for Gemma 3,
# transformers would apply it, so a file carrying it is ambiguous.
GEMMA3_KEYS = (GGUF_ARCH_KEYS - {"expert_count", "expert_used_count"}) | {"rope.freq_base_swa",
                                                                          "final_logit_softcapping"}

SWA_PATTERN = 6             # llama.cpp set_swa_pattern(6): 5 sliding layers, then 1 global
LOCAL_ROPE_BASE = 10000.0   # llama.cpp rope_freq_base_train_swa for Gemma 3 (no key in older files)
LAYERS_27B = 62             # llama.cpp's LLM_TYPE_27B, the one size scaled by d / heads


def gemma3_layer_types(num_layers: int, window: int | None) -> tuple[str, ...]:
    """Which layers slide: every SWA_PATTERN-th layer (5, 11, 17, ...) is global; with no
    window (embedding variants) every layer is."""
    if not window:
        return ("full_attention",) * num_layers
    return tuple("full_attention" if (i + 1) % SWA_PATTERN == 0 else "sliding_attention"
                 for i in range(num_layers))


def gemma3_query_scalar(num_layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """Attention scores are scaled by this ** -0.5: head_dim, except on the 27B (hidden / heads,
    as gemma_pytorch's config and llama.cpp's f_attention_scale have it)."""
    return float(hidden // heads if num_layers == LAYERS_27B else head_dim)


def gemma3_fields(field: Callable[[str], Any], num_layers: int, hidden: int, heads: int,
                  head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields Gemma 3 adds to the generic GGUF ones; `field(key)` reads
    `gemma3.{key}` (None when absent)."""
    window = field("attention.sliding_window")
    window = None if window is None or int(window) == 0 else int(window)
    local = field("rope.freq_base_swa")
    cap = field("final_logit_softcapping")
    return {
        "sliding_window": window,
        "layer_types": gemma3_layer_types(num_layers, window),
        "rope_local_theta": (LOCAL_ROPE_BASE if local is None else float(local)) if window else None,
        "query_pre_attn_scalar": gemma3_query_scalar(num_layers, hidden, heads, head_dim),
        "hidden_activation": "gelu_tanh",
        "final_logit_softcapping": None if cap is None or float(cap) == 0.0 else float(cap),
    }
