"""Mixture-of-experts decoders: Mixtral (MixtralForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM),
and the MLP half of DeepSeek-V2 (runtime/model/families/deepseek.py).

Attention is Llama's (Mixtral) or Qwen3's (per-head q/k norms); a layer's MLP is a router and
`num_experts` SwiGLU experts, or in `dense_layers` a dense SwiGLU of intermediate_size.
Per token: probabilities = softmax(x @ router) over all experts; DeepSeek-V2's
group_limited_greedy first keeps only the topk_group of n_group expert groups whose best
expert scores highest; the top `num_experts_per_tok` are kept, renormalised to sum 1 when
`norm_topk_prob` (Mixtral always; Qwen3-MoE as its config says), multiplied by
routed_scaling_factor, and the token's output is the weighted sum of its experts' outputs,
plus the shared experts' SwiGLU (DeepSeek-V2) which every token runs.

The experts run as grouped products over the (token, expert) pairs sorted by expert
(linear.expert_products: `jax.lax.ragged_dot`, on CPU a loop over the experts that have
rows): each expert multiplies only the rows routed to it, so the work is the active
experts', not E dense products. On the engine's CPU path (the C++ kernel) each row's numbers
depend only on its own token and experts (batch invariance: tests/runtime/test_families_moe.py).

Stored per expert layer (stacked over moe_layers()): router [d, E], experts_gate and
experts_up [E, d, f], experts_down [E, f, d] (f = moe_intermediate_size), shared_gate /
shared_up [d, S f] and shared_down [S f, d] (S shared experts); per dense layer (stacked
over dense_layers): dense_gate / dense_up [d, F], dense_down [F, d]. A model with both kinds
picks a layer's MLP with lax.cond, the weights held whole outside the layer scan
(linear.LayerSubset, StackedExperts rows).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import runtime.model.families.llama as llama
import runtime.model.families.qwen3 as qwen3
from runtime.config import ModelConfig
from runtime.model.families.llama import lm_head  # noqa: F401  (the family's API)
from runtime.model.linear import LayerSubset, Norm, StackedExperts, rms_norm, subset_rows

Params = dict[str, Any]
SWIGLU_TAIL = False  # no dense MLP for the C++ kernels' fused layer tail
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")
MOE_LAYER_WEIGHTS = ("router", "shared_gate", "shared_up", "shared_down")  # per expert layer, beside the experts
DENSE_WEIGHTS = ("dense_gate", "dense_up", "dense_down")


def mlp_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The MLP part of a layer tree: experts, router and shared experts over the expert layers,
    the dense MLP over dense_layers."""
    d, E, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    Ls, Ld, fs, F = len(cfg.moe_layers()), len(cfg.dense_layers), cfg.num_shared_experts * f, cfg.intermediate_size
    out: dict[str, Any] = dict(router=(Ls, d, E), experts_gate=(Ls, E, d, f), experts_up=(Ls, E, d, f),
                               experts_down=(Ls, E, f, d))
    if fs:
        out.update(shared_gate=(Ls, d, fs), shared_up=(Ls, d, fs), shared_down=(Ls, fs, d))
    if Ld:
        out.update(dense_gate=(Ld, d, F), dense_up=(Ld, d, F), dense_down=(Ld, F, d))
    return out


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    shapes = (qwen3 if cfg.architecture == "qwen3_moe" else llama).param_shapes(cfg)
    layers = {k: v for k, v in shapes["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
    return {**shapes, "layers": {**layers, **mlp_shapes(cfg)}}


def route(cfg: ModelConfig, router: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, d] -> (weights [T, k] float32, expert ids [T, k] int32) of each token's top k."""
    probs = jax.nn.softmax(x.astype(jnp.float32) @ router.astype(jnp.float32), axis=-1)  # (float32, as transformers)
    if cfg.topk_method == "group_limited_greedy":  # experts outside the best topk_group groups score 0
        T, G = x.shape[0], cfg.n_group
        best = probs.reshape(T, G, -1).max(-1)                       # [T, G]
        _, groups = jax.lax.top_k(best, cfg.topk_group)
        keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], groups].set(True)
        probs = jnp.where(jnp.repeat(keep, cfg.num_experts // G, axis=1), probs, 0.0)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * cfg.routed_scaling_factor, experts


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """A dense SwiGLU MLP over plain [in, out] arrays."""
    dt = x.dtype
    return (jax.nn.silu(x @ gate.astype(dt)) * (x @ up.astype(dt))) @ down.astype(dt)


def routed_products(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: StackedExperts,
                    up: StackedExperts, down: StackedExperts, first: Any = 0) -> jax.Array:
    """sum over each token's picks of weight x expert(x), for the picks whose expert is one of
    the E' experts `gate` / `up` / `down` hold (ids first .. first + E' - 1; the others add 0):
    all of them on one device, a device's share under expert parallelism."""
    T, k = experts.shape
    E = gate.w.shape[1]  # ([L, E, ...], also the C++ kernel's packed form)
    local = experts.reshape(-1) - first              # [T*k] (token t's picks at t*k .. t*k+k-1)
    mine = (local >= 0) & (local < E)
    local = jnp.where(mine, local, E)                # others sort last, in no expert's rows
    order = jnp.argsort(local, stable=True)          # (token, expert) pairs grouped by expert
    sizes = jnp.bincount(jnp.where(mine, local, 0), weights=mine.astype(jnp.int32), length=E).astype(jnp.int32)
    rows = x[order // k]                             # [T*k, d]
    dt = x.dtype
    g = gate.product(rows, sizes)
    u = up.product(rows, sizes)
    out = down.product((jax.nn.silu(g) * u).astype(dt), sizes)  # [T*k, d]; rows past sum(sizes) unused
    per_pick = jnp.zeros_like(out).at[order].set(out).reshape(T, k, -1)  # back to (token, pick) order
    w = jnp.where(mine.reshape(T, k), weights, 0.0)
    return jnp.einsum("tkd,tk->td", jnp.where(mine.reshape(T, k, 1), per_pick, 0).astype(jnp.float32), w)


def experts_mlp(cfg: ModelConfig, lp: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MoE MLP of x [T, d] (already normed) -> ([T, d], each token's experts [T, k])."""
    weights, experts = route(cfg, lp["router"], x)
    held = (lp["experts_gate"], lp["experts_up"], lp["experts_down"])
    if held[0].mesh is not None:  # expert parallelism: each device its experts' picks, summed across devices
        from runtime.model.tp import expert_parallel

        y = expert_parallel(routed_products, x, weights, experts, *held)
    else:
        y = routed_products(x, weights, experts, *held)
    y = y.astype(x.dtype)
    if "shared_gate" in lp:
        y = y + swiglu(x, lp["shared_gate"], lp["shared_up"], lp["shared_down"])
    return y, experts


def mlp(cfg: ModelConfig, lp: Params, x: jax.Array, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer's MLP of x [T, d] (normed): the experts, or on dense_layers the dense SwiGLU
    (its tokens' experts then num_experts: none)."""
    if not cfg.dense_layers:
        return experts_mlp(cfg, lp, x)
    is_moe = jnp.asarray([i not in cfg.dense_layers for i in range(cfg.num_layers)])[layer]
    none = jnp.full((x.shape[0], cfg.num_experts_per_tok), cfg.num_experts, jnp.int32)
    return jax.lax.cond(is_moe, lambda x: experts_mlp(cfg, lp, x),
                        lambda x: (swiglu(x, lp["dense_gate"], lp["dense_up"], lp["dense_down"]), none), x)


def after_attention(cfg: ModelConfig, lp: Params, a: jax.Array, h: jax.Array, norm: Norm, layer: jax.Array,
                    cache: tuple[Any, jax.Array]) -> tuple[jax.Array, None, tuple[Any, jax.Array]]:
    """h1 = h + a @ wo; h1 + mlp(rms_norm(h1)). `cache` is (the attention's, every layer's
    tokens' experts [L, T, k]): this layer's routing goes into the second."""
    h = lp["wo"].apply(a, residual=h)
    y, experts = mlp(cfg, lp, rms_norm(h, *norm), layer)
    inner, ids = cache
    return h + y, None, (inner, ids.at[layer].set(experts.astype(jnp.int32)))


def with_routing(cfg: ModelConfig, forward: Any, token_ids: jax.Array, attention: llama.AttentionFn,
                 cache: Any) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """forward(attention', cache') with the cache threaded as (cache, experts [L, T, k]) so each
    layer's after_attention records its tokens' experts; returns (hidden, cache, {"expert_ids":
    [L, T, k] int32}), num_experts where a dense layer or none picked: the runner counts the
    expert load from it (runtime/model/runner.py expert_load)."""
    def attend(q, k, v, layer, c):
        out, inner = attention(q, k, v, layer, c[0])
        return out, (inner, c[1])

    ids = jnp.full((cfg.num_layers, token_ids.shape[0], cfg.num_experts_per_tok), cfg.num_experts, jnp.int32)
    hidden, (cache, ids) = forward(attend, (cache, ids))
    return hidden, cache, {"expert_ids": ids}


def hold_weights(cfg: ModelConfig, params: Params) -> Params:
    """The experts' stacked weights as StackedExperts, and where only some layers have them the
    routers, shared experts and dense MLPs as LayerSubset: the layer scan then leaves them
    whole (a backend may hold the experts in its own form: runtime/kernels/cpu/experts.py)."""
    layers = dict(params["layers"])
    moe_rows = subset_rows(cfg.moe_layers(), cfg.num_layers)
    for k in EXPERT_WEIGHTS:
        w = layers[k]
        if isinstance(w, dict):  # int8 experts (runtime/model/quant.py quantize_experts): w8a16 {"w8", "s"}, w8a8 {"q", "s"}
            layers[k] = StackedExperts(w.get("w8", w.get("q")), rows=moe_rows, s=w["s"], int8_acts="q" in w)
        elif not isinstance(w, StackedExperts):
            layers[k] = StackedExperts(w, rows=moe_rows)
    for names, rows in ((MOE_LAYER_WEIGHTS, moe_rows), (DENSE_WEIGHTS, subset_rows(cfg.dense_layers, cfg.num_layers))):
        for k in names:
            if rows and k in layers and not isinstance(layers[k], LayerSubset):
                layers[k] = LayerSubset(layers[k], rows=rows)
    return {**params, "layers": layers}


def forward_hidden(cfg: ModelConfig, params: Params, token_ids: jax.Array, positions: jax.Array,
                   attention: llama.AttentionFn, cache: Any) -> tuple[jax.Array, Any]:
    params = hold_weights(cfg, params)  # (a tree the runner already held keeps its choice)
    inputs = qwen3.qkv_projection if cfg.architecture == "qwen3_moe" else llama.qkv_projection
    return with_routing(cfg, lambda att, c: llama.forward_hidden(
        cfg, params, token_ids, positions, att, c, attention_inputs=inputs, after_attention=after_attention),
        token_ids, attention, cache)


def dense_logits(cfg: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    return llama.dense_logits(cfg, params, token_ids, forward=forward_hidden)
