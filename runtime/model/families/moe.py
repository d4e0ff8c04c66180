"""Mixture-of-experts decoders: Mixtral (MixtralForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM).

Attention is Llama's (Mixtral) or Qwen3's (per-head q/k norms); each layer's MLP is a router
and `num_experts` SwiGLU experts. Per token: probabilities = softmax(x @ router) over all
experts, the top `num_experts_per_tok` kept, renormalised to sum 1 when `norm_topk_prob`
(Mixtral always; Qwen3-MoE as its config says), and the token's output is the weighted sum
of its experts' outputs.

The experts run as grouped products over the (token, expert) pairs sorted by expert
(linear.expert_products: `jax.lax.ragged_dot`, on CPU a loop over the experts that have
rows): each expert multiplies only the rows routed to it, so the work is the active
experts', not E dense products. On the engine's CPU path (the C++ kernel) each row's numbers
depend only on its own token and experts (batch invariance: tests/runtime/test_families_moe.py).

Stored per layer: router [d, E], experts_gate and experts_up [E, d, f], experts_down [E, f, d]
(f = moe_intermediate_size); no dense w_gate / w_up / w_down.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import runtime.model.families.llama as llama
import runtime.model.families.qwen3 as qwen3
from runtime.config import ModelConfig
from runtime.model.families.llama import lm_head  # noqa: F401  (the family's API)
from runtime.model.linear import Norm, StackedExperts, rms_norm

Params = dict[str, Any]
SWIGLU_TAIL = False  # no dense MLP for the C++ kernels' fused layer tail
EXPERT_WEIGHTS = ("router", "experts_gate", "experts_up", "experts_down")


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    shapes = (qwen3 if cfg.architecture == "qwen3_moe" else llama).param_shapes(cfg)
    L, d, E, f = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    layers = {k: v for k, v in shapes["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
    layers.update(router=(L, d, E), experts_gate=(L, E, d, f), experts_up=(L, E, d, f), experts_down=(L, E, f, d))
    return {**shapes, "layers": layers}


def route(cfg: ModelConfig, router: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, d] -> (weights [T, k] float32, expert ids [T, k] int32) of each token's top k."""
    probs = jax.nn.softmax((x @ router.astype(x.dtype)).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def experts_mlp(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
    """The MoE MLP of x [T, d] (already normed) -> [T, d]."""
    T, k, E = x.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    weights, experts = route(cfg, lp["router"], x)
    flat = experts.reshape(-1)                       # [T*k] (token t's picks at t*k .. t*k+k-1)
    order = jnp.argsort(flat, stable=True)           # (token, expert) pairs grouped by expert
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    rows = x[order // k]                             # [T*k, d]
    dt = x.dtype
    gate = lp["experts_gate"].product(rows, sizes)
    up = lp["experts_up"].product(rows, sizes)
    out = lp["experts_down"].product((jax.nn.silu(gate) * up).astype(dt), sizes)  # [T*k, d]
    per_pick = jnp.zeros_like(out).at[order].set(out).reshape(T, k, -1)  # back to (token, pick) order
    return jnp.einsum("tkd,tk->td", per_pick.astype(jnp.float32), weights).astype(dt)


def after_attention(cfg: ModelConfig, lp: Params, a: jax.Array, h: jax.Array, norm: Norm
                    ) -> tuple[jax.Array, None]:
    """h1 = h + a @ wo; h1 + experts_mlp(rms_norm(h1))."""
    h = lp["wo"].apply(a, residual=h)
    return h + experts_mlp(cfg, lp, rms_norm(h, *norm)), None


def hold_weights(params: Params) -> Params:
    """The experts' stacked weights as StackedExperts: the layer scan then leaves them whole
    (a backend may hold them in its own form: runtime/kernels/cpu/experts.py)."""
    layers = dict(params["layers"])
    for k in EXPERT_WEIGHTS[1:]:
        if not isinstance(layers[k], StackedExperts):
            layers[k] = StackedExperts(layers[k])
    return {**params, "layers": layers}


def forward_hidden(cfg: ModelConfig, params: Params, token_ids: jax.Array, positions: jax.Array,
                   attention: llama.AttentionFn, cache: Any) -> tuple[jax.Array, Any]:
    params = hold_weights(params)  # (a tree the runner already held keeps its choice)
    inputs = qwen3.qkv_projection if cfg.architecture == "qwen3_moe" else llama.qkv_projection
    return llama.forward_hidden(cfg, params, token_ids, positions, attention, cache, attention_inputs=inputs,
                                after_attention=after_attention)


def dense_logits(cfg: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    return llama.dense_logits(cfg, params, token_ids, forward=forward_hidden)
