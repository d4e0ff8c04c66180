"""DeepSeek-V2 (DeepseekV2ForCausalLM): multi-head latent attention (MLA) and a mixture of
experts with shared experts (runtime/model/families/moe.py), the first layers dense.

MLA. Each token's keys and values come from one latent: kv_a projects x to
c = kv_lora_rank latent columns (RMS-normed) plus r = qk_rope_head_dim key columns shared
by every head (RoPE applied); kv_b [c, H (dn + dv)] expands the latent into each head's
non-rotary key (dn = qk_nope_head_dim) and value (dv = v_head_dim). The cache keeps only
that c + r row per token and layer (one "KV head" of c + r: ModelConfig.head_dim), a
H (dn + r + dv) / (c + r)-fold smaller cache than the expanded K/V.

Attention runs in the latent space ("absorbed", as DeepSeek's inference code and vLLM's MLA
decode do): q_nope . k_nope = q_nope . (latent kv_b_k) = (q_nope kv_b_k^T) . latent, so each
head's query becomes [q_nope kv_b_k^T | q_rope] (c + r wide) against the cached rows
[latent | k_rope], and the attention-weighted sum of the cached rows' first c columns, times
kv_b_v, is the head's output. A step reads c + r numbers per cached token and layer, for
every head at once (one KV head, H query heads: the paged attention's GQA path). Prefill uses
the same form (wider per-head products than the expanded K/V, the same numbers).

RoPE: DeepSeek rotates interleaved pairs (x[2i], x[2i+1]); q_rope and k_rope are reordered
to rotate-half's (x[i], x[i + r/2]) before llama.apply_rope. Their dot product is the same.
The latent norms (q_a_layernorm, kv_a_layernorm) use eps 1e-6 whatever the model's
rms_norm_eps (transformers' DeepseekV2RMSNorm default).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import runtime.model.families.llama as llama
import runtime.model.families.moe as moe
from runtime.config import ModelConfig
from runtime.model.families.llama import lm_head  # noqa: F401  (the family's API)
from runtime.model.linear import Norm, rms_norm

Params = dict[str, Any]
SWIGLU_TAIL = False
LATENT_NORM_EPS = 1e-6
hold_weights = moe.hold_weights


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    L, d, v, H = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_heads
    c, r, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    layers: dict[str, Any] = {"attn_norm": (L, d), "mlp_norm": (L, d), "wkv_a": (L, d, c + r), "kv_a_norm": (L, c),
                              "wkv_b": (L, c, H * (dn + dv)), "wo": (L, H * dv, d)}
    if cfg.q_lora_rank:
        layers.update(wq_a=(L, d, cfg.q_lora_rank), q_a_norm=(L, cfg.q_lora_rank), wq_b=(L, cfg.q_lora_rank, H * (dn + r)))
    else:
        layers.update(wq=(L, d, H * (dn + r)))
    layers.update(moe.mlp_shapes(cfg))
    shapes: dict[str, Any] = {"embed": (v, d), "layers": layers, "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def _rotate_half_order(x: jax.Array) -> jax.Array:
    """[..., r] interleaved pairs (x0, x1), (x2, x3), ... -> rotate-half order (x0, x2, ..., x1, x3, ...)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _kv_b(cfg: ModelConfig, lp: Params) -> tuple[jax.Array, jax.Array]:
    """kv_b split per head: the key part [c, H, dn] and the value part [c, H, dv]."""
    w = lp["wkv_b"].reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    return w[..., :cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]


def latent_projection(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, table: jax.Array,
                      norm: Norm | None = None, made: jax.Array | None = None) -> tuple[jax.Array, jax.Array, None]:
    """The absorbed query [T, H, c + r] and the token's cache row [T, 1, c + r] (latent | rotated
    key); no separate values (None: the rows are the values)."""
    T, H, dn = x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim
    c = cfg.kv_lora_rank
    y = x if norm is None else rms_norm(x, *norm)
    if "wq_a" in lp:
        q = lp["wq_b"].apply(lp["wq_a"].apply(y), norm=(lp["q_a_norm"], LATENT_NORM_EPS))
    else:
        q = lp["wq"].apply(y)
    q = q.reshape(T, H, -1)
    kv = lp["wkv_a"].apply(y)                                          # [T, c + r]
    latent = rms_norm(kv[:, :c], lp["kv_a_norm"], LATENT_NORM_EPS)
    k_rope = llama.apply_rope(_rotate_half_order(kv[:, None, c:]), positions, table)  # [T, 1, r]
    q_rope = llama.apply_rope(_rotate_half_order(q[..., dn:]), positions, table)      # [T, H, r]
    w_k, _ = _kv_b(cfg, lp)
    q_latent = jnp.einsum("thn,chn->thc", q[..., :dn], w_k.astype(q.dtype))          # [T, H, c]
    return (jnp.concatenate([q_latent, q_rope], -1),
            jnp.concatenate([latent[:, None, :], k_rope.astype(latent.dtype)], -1), None)


def after_attention(cfg: ModelConfig, lp: Params, a: jax.Array, h: jax.Array, norm: Norm, layer: jax.Array,
                    cache: Any) -> tuple[jax.Array, None, Any]:
    """a [T, H (c + r)]: each head's weighted sum of cached rows; its latent columns times
    kv_b's value part are the head's output, then o_proj and the MLP (moe.after_attention)."""
    T, H, c = a.shape[0], cfg.num_heads, cfg.kv_lora_rank
    _, w_v = _kv_b(cfg, lp)
    out = jnp.einsum("thc,chv->thv", a.reshape(T, H, -1)[..., :c], w_v.astype(a.dtype))
    return moe.after_attention(cfg, lp, out.reshape(T, -1), h, norm, layer, cache)


def forward_hidden(cfg: ModelConfig, params: Params, token_ids: jax.Array, positions: jax.Array,
                   attention: llama.AttentionFn, cache: Any) -> tuple[jax.Array, Any]:
    params = hold_weights(cfg, params)
    return moe.with_routing(cfg, lambda att, c: llama.forward_hidden(
        cfg, params, token_ids, positions, att, c, attention_inputs=latent_projection, after_attention=after_attention),
        token_ids, attention, cache)


def dense_logits(cfg: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    return llama.dense_logits(cfg, params, token_ids, forward=forward_hidden)
