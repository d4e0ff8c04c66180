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

from runtime.config import ModelConfig, RopeScaling
from runtime.model.linear import HeldPerLayer, Norm, rms_norm, typed

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


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = np.float32, shapes: Any = None) -> Params:
    """Random weights (numpy) with the checkpoint's exact tree (`shapes`: a family's
    param_shapes(cfg), this family's by default): tiny test models use it."""
    rng = np.random.default_rng(seed)

    def make(path: str, shape: tuple[int, ...]) -> np.ndarray:
        if path.endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(dtype)
        fan_in = shape[-2] if len(shape) >= 2 and not path == "embed" else shape[-1]
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(dtype)

    return jax.tree_util.tree_map_with_path(
        lambda p, s: make(jax.tree_util.keystr(p, simple=True, separator="/"), s),
        param_shapes(cfg) if shapes is None else shapes, is_leaf=lambda x: isinstance(x, tuple))


# --- the family's math ------------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """The rotary table apply_rope takes, float32 [2, D/2]: the inverse frequencies, then the
    amplitude cos and sin are multiplied by (yarn's and longrope's attention_factor, else 1).
    One array of one shape, so every family passes it through (and picks between tables, as
    Gemma's sliding and full layers do) without knowing which scaling the model has."""
    s = cfg.rope_scaling
    inv = _scaled_inv_freq(cfg.qk_rope_head_dim if cfg.mla else cfg.head_dim, cfg.rope_theta, s)
    return np.stack([inv, np.full_like(inv, 1.0 if s is None else s.attention_factor)]).astype(np.float32)


def _scaled_inv_freq(dim: int, theta: float, s: RopeScaling | None) -> np.ndarray:
    """float64 [dim/2] inverse frequencies of `theta`, scaled by `s` (RopeScaling's types)."""
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if s is None or s.rope_type == "dynamic":  # NTK's base only grows past original_max_position_embeddings
        return inv
    if s.rope_type == "linear":  # positions / factor: the same angles
        return inv / s.factor
    if s.rope_type in ("freq_factors", "longrope"):  # a divisor per frequency (longrope: its short factors)
        return inv / np.asarray(s.freq_factors, np.float64)
    if s.rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, s, inv)
    # llama3 (Llama 3.1): long wavelengths slowed by `factor`, short ones kept, smooth between.
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    wl = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wl > low_wl, inv / s.factor, inv)
    mid = (wl <= low_wl) & (wl >= high_wl)
    return np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling, inv: np.ndarray) -> np.ndarray:
    """YaRN as transformers' _compute_yarn_parameters: the dimension index where a frequency
    turns `r` times over original_max_position_embeddings is dim ln(L / 2 pi r) / 2 ln(theta);
    below beta_fast's index frequencies are kept, above beta_slow's divided by factor, with a
    linear ramp between (ends rounded outwards when `truncate`, clipped to [0, dim - 1])."""
    def index(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(s.beta_fast), index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv / s.factor * ramp + inv * (1 - ramp)


def apply_rope(x: jax.Array, positions: jax.Array, table: jax.Array) -> jax.Array:
    """x [T, H, D], positions [T], table rope_inv_freq's [2, D/2]; rotate-half convention.
    cos and sin are multiplied by the table's amplitude, as transformers does."""
    inv_freq, amplitude = table[0], table[1]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = (jnp.cos(angles) * amplitude)[:, None, :]
    sin = (jnp.sin(angles) * amplitude)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def qkv_projection(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array,
                   inv_freq: jax.Array, norm: Norm | None = None,
                   made: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v of rms_norm(x) (x without `norm`), RoPE applied to q and k. `made`: the
    layer's q|k|v product already computed (a fused layer tail makes it for the next layer)."""
    T = x.shape[0]
    q, k, v = qkv_linear(cfg, lp, x, norm) if made is None else split_qkv(cfg, made)
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def qkv_linear(cfg: ModelConfig, lp: Params, x: jax.Array,
               norm: Norm | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The three projections of rms_norm(x) (x without `norm`); one product when the runner
    holds them as one ("qkv")."""
    if "qkv" in lp:
        return split_qkv(cfg, lp["qkv"].apply(x, norm=norm))
    y = x if norm is None else rms_norm(x, *norm)
    return lp["wq"].apply(y), lp["wk"].apply(y), lp["wv"].apply(y)


def split_qkv(cfg: ModelConfig, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused q|k|v product [T, (Hq + 2 Hkv) D] split into q, k, v."""
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return tuple(jnp.split(qkv, [nq, nq + nkv], axis=-1))


def mlp(lp: Params, x: jax.Array, residual: jax.Array | None = None, norm: Norm | None = None) -> jax.Array:
    """The SwiGLU MLP of rms_norm(x) (x without `norm`), plus `residual` if given."""
    if "gate_up" in lp:  # gate and up held as one product
        act = lp["gate_up"].glu(x, norm)
    else:
        y = x if norm is None else rms_norm(x, *norm)
        act = jax.nn.silu(lp["w_gate"].apply(y)) * lp["w_up"].apply(y)
    return lp["w_down"].apply(act, residual)


def post_attention(lp: Params, a: jax.Array, h: jax.Array, norm: Norm) -> tuple[jax.Array, jax.Array | None]:
    """h1 = h + a @ wo; h1 + mlp(rms_norm(h1)). Returns (output, the next layer's q|k|v when
    the backend fused this tail with it, else None)."""
    if "tail" in lp:  # the backend holds wo, the MLP and w_down as one fused object (same numbers)
        return lp["tail"].apply(a, h, norm)
    h = lp["wo"].apply(a, residual=h)
    return mlp(lp, h, residual=h, norm=norm), None


def forward_hidden(cfg: ModelConfig, params: Params, token_ids: jax.Array, positions: jax.Array,
                   attention: AttentionFn, cache: Any, attention_inputs: Callable = qkv_projection,
                   after_attention: Callable | None = None) -> tuple[jax.Array, Any]:
    """Run the decoder over flattened tokens [T]; returns final-normed hidden [T, d] and the
    cache as threaded through `attention(q, k, v, layer, cache) -> (out, cache)`. A family
    that differs only in how q, k, v are made passes its own `attention_inputs` (the
    signature of qkv_projection; it may return v None: the keys are the values, as a latent
    cache's rows are), one that differs after attention its own `after_attention(cfg, lp, a,
    h, norm, layer, cache) -> (h, made, cache)` (post_attention's, with the config first and
    the scanned layer and the threaded cache last: a mixture of experts records its routing
    there). A family's forward_hidden may return a third value, a dict of the step's own
    device statistics (moe.py: "expert_ids")."""
    params = typed(params)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    x = params["embed"][token_ids]
    T = token_ids.shape[0]
    eps, layers = cfg.rms_norm_eps, params["layers"]
    made = first_made_qkv(layers, x, eps)

    def layer_step(carry, scanned):
        h, cache, made = carry
        lp, layer = scanned
        q, k, v = attention_inputs(cfg, lp, h, positions, inv_freq, norm=(lp["attn_norm"], eps), made=made)
        attn, cache = attention(q, k, v, layer, cache)
        if after_attention is None:
            h, made = post_attention(lp, attn.reshape(T, -1), h, (lp["mlp_norm"], eps))
        else:
            h, made, cache = after_attention(cfg, lp, attn.reshape(T, -1), h, (lp["mlp_norm"], eps), layer, cache)
        return (h, cache, made), None

    (x, cache, _), _ = scan_layers(layer_step, (x, cache, made), layers, cfg.num_layers)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def first_made_qkv(layers: Params, x: jax.Array, eps: float) -> jax.Array | None:
    """Layer 0's q|k|v product where a fused tail chains the layers (each tail then makes the
    next layer's), else None: the scan's carry starts with it."""
    tail = layers.get("tail")
    return tail.first_qkv(x, eps) if tail is not None and tail.chains else None


def scan_layers(body: Callable, carry: Any, layers: Params, num_layers: int) -> tuple[Any, Any]:
    """lax.scan of body(carry, (layer params, layer index)) over the stacked layer tree. A
    weight held per layer (HeldPerLayer: PerLayer, a fused tail) is not scanned
    but reaches the body picked at the scan's layer."""
    stacked = {k: v for k, v in layers.items() if not isinstance(v, HeldPerLayer)}
    split = {k: v for k, v in layers.items() if isinstance(v, HeldPerLayer)}

    def step(c: Any, xs: Any) -> Any:
        lp, layer = xs
        return body(c, ({**lp, **{k: v.at(layer) for k, v in split.items()}}, layer))

    return jax.lax.scan(step, carry, (stacked, jnp.arange(num_layers, dtype=jnp.int32)))


def unstack_weights(params: Params, names: Sequence[str]) -> Params:
    """The layer weights in `names` (float arrays [L, in, out]) as tuples of L separate arrays.
    Why: XLA:CPU copies a layer's slice out of a stacked weight before each product, and at
    a few rows the product only reads its weight once, so the copy doubles the memory
    traffic of the step: 30 layers of 576x3072 float32 at one row read at 15-18 GB/s
    stacked against 23-25 GB/s per layer with lax.switch picking the array (2-core EPYC).
    Weights packed for the C++ kernels (dicts with "p", "f" or "fg", runtime/kernels/cpu/matmul.py, fused
    names "qkv" / "gate_up" included) become tuples of per-layer dicts for the same reason:
    a custom call's operand is a whole buffer, so a scanned slice is always copied first."""
    from runtime.kernels.cpu import matmul as cpu_matmul
    from runtime.kernels.cpu.matmul import FUSED

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
    """hidden [N, d] -> float32 logits [N, V] (the head object picks its product)."""
    return typed(params)["head"].apply(hidden)


def attention_scale(cfg: ModelConfig) -> float:
    """The factor on q.k: query_pre_attn_scalar ** -0.5 where the model sets it (Gemma), else
    head_dim ** -0.5 (latent attention: the query-key width, qk_nope + qk_rope, ** -0.5)."""
    width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.mla else cfg.head_dim
    return 1.0 / math.sqrt(cfg.query_pre_attn_scalar or width)


def causal_mask(T: int, window: jax.Array | int = 0) -> jax.Array:
    """[T, T] bool: query i sees key j when i - window < j <= i (window 0: every j <= i)."""
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    return (j <= i) & ((window <= 0) | (j > i - window))


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, num_segments_mask: jax.Array,
                           sm_scale: float | None = None, soft_cap: float | None = None) -> jax.Array:
    """Plain softmax attention for one sequence: q [T,Hq,D], k/v [T,Hkv,D]; scores scaled by
    `sm_scale` (default head_dim ** -0.5), soft-capped (cap * tanh(s / cap)) when `soft_cap`,
    then masked by num_segments_mask [T, T] (causal_mask: causal, optionally windowed).
    v None: the keys are the values (a latent cache's rows)."""
    v = k if v is None else v
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(num_segments_mask[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hts,shd->thd", p, v.astype(jnp.float32)).astype(q.dtype)


def dense_logits(cfg: ModelConfig, params: Params, token_ids: jax.Array, forward: Callable | None = None,
                 head: Callable | None = None) -> jax.Array:
    """Reference forward without any cache: token_ids [T] -> logits [T, V] (float32), through
    `forward` and `head` (a family's forward_hidden and lm_head; this one's by default), with
    each layer's window and the model's attention scale and soft-cap. Used by parity tests and
    the dense (non-paged) greedy baseline."""
    T = token_ids.shape[0]
    windows = jnp.asarray(cfg.layer_windows(), jnp.int32)  # each layer's window (0: full)

    def attention(q, k, v, layer, cache):
        return dense_causal_attention(q, k, v, causal_mask(T, windows[layer]), attention_scale(cfg),
                                      cfg.attn_logit_softcapping), cache

    hidden, *_ = (forward or forward_hidden)(cfg, params, token_ids, jnp.arange(T, dtype=jnp.int32), attention, None)
    return (head or lm_head)(cfg, params, hidden)


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
