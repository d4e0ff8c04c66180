"""Gemma 2 and Gemma 3 (Gemma2ForCausalLM, Gemma3ForCausalLM): Llama's attention and gated MLP
with Gemma's differences, in one module for both ("gemma2" / "gemma3" in FAMILIES):

* embeddings multiplied by sqrt(hidden_size) (the factor cast to the hidden dtype first, as
  transformers does);
* a norm after attention and after the MLP as well as before each: h + post_attn_norm(attn),
  then h + post_mlp_norm(mlp(mlp_norm(h)));
* a GeGLU MLP (tanh-approximated GELU; cfg.hidden_activation);
* scores scaled by query_pre_attn_scalar ** -0.5, sliding-window layers (cfg.layer_types),
  both applied by the attention backend (runtime/model/attention_backend.paged_attention);
* Gemma 2: attention logit soft-cap (the backend) and final logit soft-cap (lm_head here);
* Gemma 3: per-head RMS norms on q and k before RoPE (as Qwen3), and RoPE base
  rope_local_theta on sliding layers (unscaled) against rope_theta with its scaling on full ones.

Norm weights are stored as the EFFECTIVE multipliers: Gemma's RMSNorm computes x * (1 + w) in
float32, and the converter stores 1 + w (runtime/checkpoint/mapping.py), so the shared
rms_norm applies them unchanged.

The layer differs from Llama's after attention (post-norms, GeGLU), so the C++ float
kernel's fused layer tail and SwiGLU gate|up pair do not apply: SWIGLU_TAIL = False tells the
runner to pack each projection on its own (runtime/model/runner.pack_float_for).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import runtime.model.families.llama as llama
from runtime.config import ModelConfig
from runtime.model.families.llama import AttentionFn, apply_rope, qkv_linear, rope_inv_freq, scan_layers
from runtime.model.linear import Norm, rms_norm, typed

Params = dict[str, Any]
SWIGLU_TAIL = False  # the runner must not build the float kernel's SwiGLU pair or fused layer tail


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    shapes = llama.param_shapes(cfg)
    L, d, D = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    shapes["layers"].update(post_attn_norm=(L, d), post_mlp_norm=(L, d))
    if cfg.architecture == "gemma3":
        shapes["layers"].update(q_norm=(L, D), k_norm=(L, D))
    return shapes


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(full layers' inverse frequencies, sliding layers'): Gemma 3's sliding layers use
    rope_local_theta without the scaling; otherwise both are the model's one RoPE."""
    full = rope_inv_freq(cfg)
    if cfg.rope_local_theta is None:
        return full, full
    return full, rope_inv_freq(dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None))


def activation(cfg: ModelConfig) -> Callable[[jax.Array], jax.Array]:
    """The gated MLP's activation: tanh-approximated GELU (transformers' gelu_pytorch_tanh) or SiLU."""
    return partial(jax.nn.gelu, approximate=True) if cfg.hidden_activation == "gelu_tanh" else jax.nn.silu


def qkv_projection(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                   norm: Norm | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v of rms_norm(x); Gemma 3's per-head q/k norms, then RoPE on q and k."""
    T, eps = x.shape[0], cfg.rms_norm_eps
    q, k, v = qkv_linear(cfg, lp, x, norm)
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.architecture == "gemma3":
        q, k = rms_norm(q, lp["q_norm"], eps), rms_norm(k, lp["k_norm"], eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def mlp(cfg: ModelConfig, lp: Params, x: jax.Array, norm: Norm) -> jax.Array:
    """act(rms_norm(x) @ w_gate) * (rms_norm(x) @ w_up) @ w_down (one gate|up product where
    the runner holds them as one)."""
    act = activation(cfg)
    if "gate_up" in lp:
        g = lp["gate_up"].glu(x, norm, act)
    else:
        y = rms_norm(x, *norm)
        g = act(lp["w_gate"].apply(y)) * lp["w_up"].apply(y)
    return lp["w_down"].apply(g)


def forward_hidden(cfg: ModelConfig, params: Params, token_ids: jax.Array, positions: jax.Array,
                   attention: AttentionFn, cache: Any) -> tuple[jax.Array, Any]:
    """The decoder over flattened tokens [T] -> (final-normed hidden [T, d], cache), with
    `attention(q, k, v, layer, cache) -> (out, cache)` as in llama.forward_hidden."""
    params = typed(params)
    eps, layers, T = cfg.rms_norm_eps, params["layers"], token_ids.shape[0]
    x = params["embed"][token_ids]
    x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)  # transformers casts the normalizer first
    full, local = (jnp.asarray(f) for f in rope_tables(cfg))
    sliding = jnp.asarray([t == "sliding_attention" for t in cfg.layer_types] or [False] * cfg.num_layers)

    def layer_step(carry, scanned):
        h, cache = carry
        lp, layer = scanned
        inv_freq = jnp.where(sliding[layer], local, full)
        q, k, v = qkv_projection(cfg, lp, h, positions, inv_freq, norm=(lp["attn_norm"], eps))
        attn, cache = attention(q, k, v, layer, cache)
        h = h + rms_norm(lp["wo"].apply(attn.reshape(T, -1)), lp["post_attn_norm"], eps)
        h = h + rms_norm(mlp(cfg, lp, h, (lp["mlp_norm"], eps)), lp["post_mlp_norm"], eps)
        return (h, cache), None

    (x, cache), _ = scan_layers(layer_step, (x, cache), layers, cfg.num_layers)
    return rms_norm(x, params["final_norm"], eps), cache


def lm_head(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [N, d] -> float32 logits [N, V], Gemma 2's final soft-cap applied."""
    logits = llama.lm_head(cfg, params, hidden)
    cap = cfg.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


dense_logits = partial(llama.dense_logits, forward=forward_hidden, head=lm_head)
