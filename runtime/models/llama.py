"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2) as Flax NNX + pure functions.

Parameters are one pytree with the layers stacked on a leading axis, so the decoder runs
under `jax.lax.scan` and compile time does not grow with depth. The math lives in pure
functions over that pytree (what the jitted engine step calls); `Llama` is the NNX module
that owns the parameters for construction, random init and inspection.

Weight layout is [in, out]; Q/K rows follow the Hugging Face (rotate-half) RoPE order.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from runtime.config import ModelConfig
from runtime.quant import LayerPick, Norm, chains_qkv, layer_tail, linear, swiglu

Params = dict[str, Any]
# attention(q [T,Hq,D], k_new [T,Hkv,D], v_new [T,Hkv,D], layer) -> out [T,Hq,D]; it also
# receives and returns whatever cache state it carries through the layer scan.
AttentionFn = Callable[..., tuple[jax.Array, Any]]


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    L, d, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": (L, d), "wq": (L, d, q), "wk": (L, d, kv), "wv": (L, d, kv), "wo": (L, q, d),
        "mlp_norm": (L, d), "w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d),
    }
    if cfg.attention_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    shapes: dict[str, Any] = {"embed": (v, d), "layers": layers, "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = np.float32) -> Params:
    """Random weights (numpy) with the checkpoint's exact tree: tiny test models use it."""
    rng = np.random.default_rng(seed)

    def make(path: str, shape: tuple[int, ...]) -> np.ndarray:
        if path.endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(dtype)
        fan_in = shape[-2] if len(shape) >= 2 and not path == "embed" else shape[-1]
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(dtype)

    return jax.tree_util.tree_map_with_path(
        lambda p, s: make(jax.tree_util.keystr(p, simple=True, separator="/"), s),
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


# --- building blocks ---------------------------------------------------------------

def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = cfg.rope_scaling
    if s is not None:  # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, smooth between.
        low_wl = s.original_max_position_embeddings / s.low_freq_factor
        high_wl = s.original_max_position_embeddings / s.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        scaled = np.where(wl > low_wl, inv / s.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        inv = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [T, H, D], positions [T]; rotate-half convention."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def qkv_projection(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array,
                   inv_freq: jax.Array, norm: Norm | None = None,
                   fused: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v of rms_norm(x) (x without `norm`), RoPE applied to q and k; `fused`: the
    layer's q|k|v product already made (by the layer before's tail call)."""
    T = x.shape[0]
    q, k, v = qkv_linear(cfg, lp, x, norm) if fused is None else split_qkv(cfg, fused)
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def qkv_linear(cfg: ModelConfig, lp: Params, x: jax.Array,
               norm: Norm | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The three projections of rms_norm(x) (x without `norm`); one product when they are
    packed as one ("qkv", the C++ kernels' layout: runtime/cpu_matmul.py)."""
    if "qkv" in lp:
        return split_qkv(cfg, linear(x, lp["qkv"], norm=norm))
    y = x if norm is None else rms_norm(x, *norm)
    return linear(y, lp["wq"]), linear(y, lp["wk"]), linear(y, lp["wv"])


def split_qkv(cfg: ModelConfig, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused q|k|v product [T, (Hq + 2 Hkv) D] split into q, k, v."""
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return tuple(jnp.split(qkv, [nq, nq + nkv], axis=-1))


def mlp(lp: Params, x: jax.Array, residual: jax.Array | None = None, norm: Norm | None = None) -> jax.Array:
    """The SwiGLU MLP of rms_norm(x) (x without `norm`), plus `residual` if given (the float
    kernel normalizes and adds in the products' calls)."""
    if "gate_up" in lp:  # gate and up packed as one product (as "qkv")
        act = swiglu(x, lp["gate_up"], norm)
    else:
        y = x if norm is None else rms_norm(x, *norm)
        act = jax.nn.silu(linear(y, lp["w_gate"])) * linear(y, lp["w_up"])
    return linear(act, lp["w_down"], residual)


def forward_hidden(cfg: ModelConfig, params: Params, token_ids: jax.Array, positions: jax.Array,
                   attention: AttentionFn, cache: Any) -> tuple[jax.Array, Any]:
    """Run the decoder over flattened tokens [T]; returns final-normed hidden [T, d] and the
    cache as threaded through `attention(q, k, v, layer, cache) -> (out, cache)`."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    x = params["embed"][token_ids]
    T = token_ids.shape[0]
    eps, layers = cfg.rms_norm_eps, params["layers"]
    fused = first_qkv(cfg, layers, x)

    def layer_step(carry, scanned):
        h, cache, fused = carry
        lp, layer = scanned
        q, k, v = qkv_projection(cfg, lp, h, positions, inv_freq, norm=(lp["attn_norm"], eps), fused=fused)
        attn, cache = attention(q, k, v, layer, cache)
        h, fused = layer_tail(attn.reshape(T, -1), h, lp, (lp["mlp_norm"], eps), next_attn_norm(cfg, layers, layer))
        return (h, cache, fused), None

    (x, cache, _), _ = scan_layers(layer_step, (x, cache, fused), layers, cfg.num_layers)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


# With the float32 kernel, layer l's tail call also makes layer l + 1's qkv product (one
# product call per layer): the layer scan carries it, and layer 0's is made before the scan.
def first_qkv(cfg: ModelConfig, layers: Params, x: jax.Array) -> jax.Array | None:
    """Layer 0's fused q|k|v of rms_norm(x) where the layer tails chain (chains_qkv), else None."""
    if not chains_qkv(layers):
        return None
    return linear(x, layers["qkv"][0], norm=(layers["attn_norm"][0], cfg.rms_norm_eps))


def next_attn_norm(cfg: ModelConfig, layers: Params, layer: jax.Array) -> jax.Array | None:
    """Inside the scan: layer + 1's attention-norm weight for the chained tail, else None."""
    if not chains_qkv(layers):
        return None
    return layers["attn_norm"][jnp.minimum(layer + 1, cfg.num_layers - 1)]


def scan_layers(body: Callable, carry: Any, layers: Params, num_layers: int) -> tuple[Any, Any]:
    """lax.scan of body(carry, (layer params, layer index)) over the stacked layer tree. A
    weight held per layer (a tuple of arrays: `unstack_weights`) is not scanned but reaches
    the body as a LayerPick."""
    stacked = {k: v for k, v in layers.items() if not isinstance(v, tuple)}
    split = {k: v for k, v in layers.items() if isinstance(v, tuple)}

    def step(c: Any, xs: Any) -> Any:
        lp, layer = xs
        return body(c, ({**lp, **{k: LayerPick(v, layer) for k, v in split.items()}}, layer))

    return jax.lax.scan(step, carry, (stacked, jnp.arange(num_layers, dtype=jnp.int32)))


def unstack_weights(params: Params, names: Sequence[str]) -> Params:
    """The layer weights in `names` (float arrays [L, in, out]) as tuples of L separate arrays.
    Why: XLA:CPU copies a layer's slice out of a stacked weight before each product, and at
    a few rows the product only reads its weight once, so the copy doubles the memory
    traffic of the step: 30 layers of 576x3072 float32 at one row read at 15-18 GB/s
    stacked against 23-25 GB/s per layer with lax.switch picking the array (2-core EPYC).
    Weights packed for the C++ kernels (dicts with "p", "f" or "fg", runtime/cpu_matmul.py, fused
    names "qkv" / "gate_up" included) become tuples of per-layer dicts for the same reason:
    a custom call's operand is a whole buffer, so a scanned slice is always copied first."""
    from runtime import cpu_matmul
    from runtime.cpu_matmul import FUSED

    layers = dict(params["layers"])
    for k in (*names, *FUSED):
        a = layers.get(k)
        if cpu_matmul.packed_array(a) is not None:
            n = cpu_matmul.packed_array(a).shape[0]
            layers[k] = tuple({kk: vv[i] for kk, vv in a.items()} for i in range(n))
        elif a is not None and not isinstance(a, (dict, tuple)):
            layers[k] = tuple(a[i] for i in range(a.shape[0]))
    return {**params, "layers": layers}


def lm_head(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [N, d] -> float32 logits [N, V]. A w8a8 tree carries an int8 copy of the head
    ("head"): it serves every step of 2+ rows (64 rows: 14 ms against 23 ms float32 on a
    2-core EPYC); XLA's int8 dot is slow for one row (40 ms against 4 ms), which keeps the
    float head."""
    if "head" in params and (hidden.shape[0] > 1 or "p" in params["head"]):  # (the C++ kernel: any rows)
        return linear(hidden.astype(jnp.float32), params["head"])
    if "head_f32" in params and hidden.shape[0] <= 64:
        # the float kernel's packed copy of the head (model_runner): 1.1-2x XLA's product at
        # 2-64 rows on a 2-core Zen 3 EPYC, and at 1 row since it prefetches its next strips
        # (2.2 ms against 3.0 on a 2-core AMX Xeon); above 64 XLA's is as fast or faster
        from runtime import cpu_matmul

        return cpu_matmul.linear_f32(hidden.astype(jnp.float32), params["head_f32"])
    # A tied head contracts the embedding's model axis in place (no transposed copy).
    w, axis = (params["embed"], 1) if cfg.tie_word_embeddings else (params["lm_head"], 0)
    return jax.lax.dot_general(hidden, w, (((1,), (axis,)), ((), ())), preferred_element_type=jnp.float32)


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, num_segments_mask: jax.Array
                           ) -> jax.Array:
    """Plain softmax attention for one sequence: q [T,Hq,D], k/v [T,Hkv,D]."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)) / math.sqrt(D)
    s = jnp.where(num_segments_mask[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hts,shd->thd", p, v.astype(jnp.float32)).astype(q.dtype)


def dense_logits(cfg: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    """Reference forward without any cache: token_ids [T] -> logits [T, V] (float32).
    Used by parity tests and the dense (non-paged) greedy baseline."""
    T = token_ids.shape[0]
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))

    def attention(q, k, v, layer, cache):
        return dense_causal_attention(q, k, v, mask), cache

    hidden, _ = forward_hidden(cfg, params, token_ids, jnp.arange(T, dtype=jnp.int32), attention, None)
    return lm_head(cfg, params, hidden)


class Llama(nnx.Module):
    """NNX owner of the stacked parameters. `params()` gives the pure pytree the engine jits."""

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, seed: int = 0):
        self.cfg = cfg
        tree = params if params is not None else init_params(cfg, seed)
        self.weights = nnx.data(jax.tree_util.tree_map(lambda a: nnx.Param(jnp.asarray(a)), tree))

    def params(self) -> Params:
        return jax.tree_util.tree_map(lambda p: p[...], self.weights,
                                      is_leaf=lambda x: isinstance(x, nnx.Param))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return dense_logits(self.cfg, self.params(), token_ids)
