"""Qwen3 (Qwen3ForCausalLM): Llama's decoder with an RMS norm over each head's query and key
(weights [head_dim] shared by the heads, the model's eps) before RoPE; no q/k/v biases.
Everything else (GQA, SwiGLU, the fused layer tail a backend may make) is Llama's."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from runtime.config import ModelConfig
from runtime.model.linear import Norm, rms_norm
import runtime.model.families.llama as llama
from runtime.model.families.llama import apply_rope, lm_head, qkv_linear, split_qkv  # noqa: F401  (the family's API)

Params = dict[str, Any]


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    shapes = llama.param_shapes(cfg)
    L, D = cfg.num_layers, cfg.head_dim
    shapes["layers"].update(q_norm=(L, D), k_norm=(L, D))
    return shapes


def qkv_projection(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                   norm: Norm | None = None, made: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """llama.qkv_projection with the per-head q/k norms between the projection and RoPE."""
    T, eps = x.shape[0], cfg.rms_norm_eps
    q, k, v = qkv_linear(cfg, lp, x, norm) if made is None else split_qkv(cfg, made)
    q = rms_norm(q.reshape(T, cfg.num_heads, cfg.head_dim), lp["q_norm"], eps)
    k = rms_norm(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), lp["k_norm"], eps)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


forward_hidden = partial(llama.forward_hidden, attention_inputs=qkv_projection)
dense_logits = partial(llama.dense_logits, forward=forward_hidden)
