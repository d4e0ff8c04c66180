"""W8A8 linear layers: int8 weights with per-output-channel scales, activations quantized
per token on the fly, one int8 x int8 -> int32 dot and one rescale. The LM head and the
embeddings stay float (the embedding is a gather; the head's logits feed sampling and
logprobs directly).

(A bfloat16-weights mode was measured and left out: its isolated dot is 1.8x float32 at 64
rows on an AVX512-BF16 EPYC, but inside the layer scan XLA:CPU made the whole step 1.4x
slower at batch 64 and 7x at batch 1.)

A quantized weight is a pytree in place of the float array, so the stacked-layer scan and
the checkpoint tree keep their shape:
  w8a8   {"q": int8 [..., in, out], "s": float32 [..., out] (, "in": float32 [..., in])}
  w8a8, grouped  {"q": int8 [..., in, out], "g": float32 [..., in/32, out]}: a GGUF Q8_0
         checkpoint's own values and block scales (one per 32 inputs of each column), never
         requantized; activations get a scale per token and group of 32 (llama.cpp's Q8_0 dot).
  w8a16  {"w8": int8 [..., in, out], "s": float32 [..., out]}: weight-only, dequantized in
         the graph and multiplied in the compute dtype (halves the weight bytes a
         bandwidth-bound GPU decode reads; on a 2-core EPYC 1.47x float32 at batch 1 and
         1.08x at 64, but slower than w8a8 from 2 rows on).
  packed {"p", "s", "c" (, "in")}: w8a8 repacked at start for the C++ kernel on CPUs with
         AVX512-VNNI (runtime/cpu_matmul.py), q|k|v and gate|up fused.
`linear(x, w)` is the one matmul of the decoder: float weights take the plain product.

Why hand-written and not qwix (Google's JAX quantization library): qwix quantizes a Flax
Linen / NNX model by intercepting its dot_general / einsum calls, and its products are
XLA's. The paged step is plain functions (no Flax module) whose CPU products are C++ custom
calls (the VNNI / AMX kernel, 2-3x XLA's int8 dot here) over weights packed once at start,
with q|k|v and gate|up fused, and a GGUF Q8_0 checkpoint's own block scales: none of that
is a dot_general for qwix to rewrite. What it would add (per-channel absmax int8, dynamic
per-token activations) is the dozen lines of `quantize_weight` and `linear` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZATIONS = ("none", "w8a8", "w8a16")
Q8_0_GROUP = 32  # inputs per scale in a grouped (GGUF Q8_0) weight
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def is_quantized(w: Any) -> bool:
    return isinstance(w, dict) and ("q" in w or "w8" in w or "p" in w)


def quantization_of(params: dict[str, Any]) -> str:
    """Which method a parameter tree was quantized with ("none" for float weights)."""
    w = params["layers"].get("wq", params["layers"].get("qkv"))
    if isinstance(w, tuple):  # held per layer (models/llama.py unstack_weights)
        w = w[0]
    if not is_quantized(w):
        return "none"
    return "w8a16" if "w8" in w else "w8a8"


def cast_params(params: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Device arrays in the compute dtype, except integer weights (int8 values, int32 kernel
    compensations) and float32 scales."""
    def place(path, a):
        key = jax.tree_util.keystr(path)
        keep = np.issubdtype(np.asarray(a).dtype, np.integer) or key.endswith(("['s']", "['g']", "['gs']"))
        return jnp.asarray(a) if keep else jnp.asarray(a, dtype)
    return jax.tree_util.tree_map_with_path(place, params)


def quantized_shapes(shapes: dict[str, Any], method: str, lm_head: bool = False,
                     group_size: int | None = None) -> dict[str, Any]:
    """param_shapes(cfg) as a checkpoint quantized by `method` stores them (w8a8 as
    `convert --quantize` writes it: smoothed, so wo and w_down carry an input scale; with
    `group_size`, GGUF Q8_0's values and block scales)."""
    if method == "none":
        return shapes
    layers = dict(shapes["layers"])
    for k in LINEAR_WEIGHTS:
        shp = tuple(layers[k])
        if group_size:
            layers[k] = {"q": shp, "g": shp[:-2] + (shp[-2] // group_size, shp[-1])}
            continue
        q = {"q" if method == "w8a8" else "w8": shp, "s": shp[:-2] + shp[-1:]}
        if method == "w8a8" and k in ("wo", "w_down"):
            q["in"] = shp[:-1]
        layers[k] = q
    out = {**shapes, "layers": layers}
    if method == "w8a8" and lm_head:
        d, v = shapes["embed"][1], shapes["embed"][0]
        out["head"] = ({"q": (d, v), "g": (d // group_size, v)} if group_size else
                       {"q": (d, v), "s": (v,), "in": (d,)})
    return out


def is_grouped(params: dict[str, Any]) -> bool:
    """A w8a8 tree holding GGUF Q8_0 values and block scales (see the module docstring)."""
    w = params["layers"].get("wq", params["layers"].get("qkv"))
    if isinstance(w, tuple):
        w = w[0]
    return isinstance(w, dict) and ("g" in w or "gs" in w)


def quantize_weight(w: np.ndarray) -> dict[str, np.ndarray]:
    """[..., in, out] float -> symmetric int8 per output channel (absmax / 127)."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=-2) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    return {"q": q, "s": scale}


SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength: half the outlier range moves to the weights


def quantize_params(params: dict[str, Any], method: str, act_absmax: dict[str, np.ndarray] | None = None,
                    lm_head: bool = False) -> dict[str, Any]:
    """The checkpoint tree with every decoder projection quantized (host side, numpy).
    With `act_absmax` (per-layer, per-input-channel maxima of each projection's input, from
    `activation_absmax` on calibration text) the activation outliers are smoothed first
    (SmoothQuant): x W = (x / s)(s W), s = max|x|^a / max|W|^(1-a) per input channel. For
    the projections after a norm, 1/s folds into the norm's weight; wo and w_down carry
    1/s as an input scale (`"in"`) applied before quantizing the activations."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    if method == "none":
        return params
    if method == "w8a16":  # weight-only: activations stay float, nothing to smooth
        layers = {k: ({"w8": (qw := quantize_weight(v))["q"], "s": qw["s"]} if k in LINEAR_WEIGHTS else v)
                  for k, v in params["layers"].items()}
        return {**params, "layers": layers}
    lay = {k: np.asarray(v, np.float32) if (k in LINEAR_WEIGHTS or k.endswith("norm")) and not is_quantized(v)
           else v for k, v in params["layers"].items()}
    in_scale: dict[str, np.ndarray] = {}
    if act_absmax is not None:
        def smooth(x_max: np.ndarray, ws: list[str]) -> np.ndarray:  # [L, in]
            sc = smoothing_scale(x_max, np.max([np.abs(lay[w]).max(axis=-1) for w in ws], axis=0))
            for w in ws:
                lay[w] = lay[w] * sc[..., :, None]
            return sc
        for norm, key, ws in (("attn_norm", "attn_in", ["wq", "wk", "wv"]), ("mlp_norm", "mlp_in", ["w_gate", "w_up"])):
            lay[norm] = lay[norm] / smooth(act_absmax[key], ws)
        for key, w in (("o_in", "wo"), ("down_in", "w_down")):
            in_scale[w] = 1.0 / smooth(act_absmax[key], [w])
    layers = {}
    for k, v in lay.items():
        if k in LINEAR_WEIGHTS and not is_quantized(v):
            v = quantize_weight(v)
            if k in in_scale:
                v["in"] = in_scale[k]
        layers[k] = v
    out = {**params, "layers": layers}
    if lm_head and act_absmax is not None:
        out["head"] = quantize_head(params, act_absmax["head_in"])
    return out


def smoothing_scale(x_max: np.ndarray, w_max: np.ndarray) -> np.ndarray:
    """SmoothQuant's per-input-channel s = max|x|^a / max|W|^(1-a), clipped to [1e-2, 1e2]."""
    sc = np.maximum(x_max, 1e-5) ** SMOOTH_ALPHA / np.maximum(w_max, 1e-5) ** (1 - SMOOTH_ALPHA)
    return np.clip(sc, 1e-2, 1e2).astype(np.float32)


# Measured (SmolLM2, 4,095 tokens of the seed chapters): w8a8 perplexity +1.55% with the float
# head, +1.87% with this one, for a 64-row decode step 10% faster (172 -> 154 ms, 2-core EPYC);
# on a 224-token narrative +2.77% -> +3.64%. Smoothing strengths 0.3-0.85 were no better than
# the layers' 0.5. Hence opt-in: --quantize-lm-head.
def quantize_head(params: dict[str, Any], x_max: np.ndarray) -> dict[str, np.ndarray]:
    """An int8 copy of the LM head [d, V] (per vocabulary column), smoothed like wo: the
    float head (the tied embedding) stays for the embedding gather and 1-row steps."""
    w = np.asarray(params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T, np.float32)
    sc = smoothing_scale(x_max, np.abs(w).max(axis=-1))
    q = quantize_weight(w * sc[:, None])
    return {"q": np.ascontiguousarray(q["q"]), "s": q["s"], "in": (1.0 / sc).astype(np.float32)}


CALIBRATION_TOKENS = 1024


def calibration_ids(tokenizer: Any, max_positions: int) -> list[int]:
    """Calibration text for SmoothQuant: support-chat traffic (the load generator's system
    prompt and questions through the chat template), never the accuracy evaluation's text."""
    from runtime.bench.loadgen import shared_prefix_messages

    ids: list[int] = []
    for messages in shared_prefix_messages(8, seed=3):
        text = tokenizer.apply_chat_template(messages) if tokenizer.chat else " ".join(m["content"] for m in messages)
        ids += tokenizer.encode(text)
    return ids[:min(CALIBRATION_TOKENS, max_positions)]


def prepare(params: dict[str, Any], method: str, cfg: Any, tokenizer: Any, lm_head: bool = False) -> dict[str, Any]:
    """quantize_params with the activation maxima measured on the calibration text (w8a8;
    `lm_head` adds the int8 head). A tree that is already quantized by `method` (a `convert
    --quantize` checkpoint) is returned as it is: start-up never requantizes; one quantized
    otherwise is an error."""
    have = quantization_of(params)
    if have == method:
        if lm_head and "head" not in params:
            raise ValueError("quantize_lm_head: this w8a8 checkpoint was stored without the int8 LM head "
                             "(convert it again with --quantize-lm-head)")
        return params
    if have != "none":
        raise ValueError(f"quantization: the checkpoint stores {have} weights and cannot be served as {method} "
                         f"(serve it with --quantization {have} or auto, or convert the float source again)")
    if lm_head and method != "w8a8":
        raise ValueError(f"quantize_lm_head: needs --quantization w8a8 (got {method})")
    if method in ("none", "w8a16"):
        return quantize_params(params, method)
    return quantize_params(params, method,
                           activation_absmax(cfg, params, calibration_ids(tokenizer, cfg.max_position_embeddings)),
                           lm_head=lm_head)


def activation_absmax(cfg: Any, params: dict[str, Any], token_ids: list[int]) -> dict[str, np.ndarray]:
    """Per layer, the largest |value| of each input channel of the four projection groups
    (attention in, attention out, MLP in, MLP down) over `token_ids`, float model, dense."""
    from runtime.models.llama import dense_causal_attention, qkv_projection, rms_norm, rope_inv_freq

    p = jax.tree_util.tree_map(jnp.asarray, params)
    T = len(token_ids)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    pos = jnp.arange(T, dtype=jnp.int32)

    @jax.jit
    def run(p, ids):
        inv = jnp.asarray(rope_inv_freq(cfg))

        def layer(h, lp):
            y = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
            q, k, v = qkv_projection(cfg, lp, y, pos, inv)
            a = dense_causal_attention(q, k, v, mask).reshape(T, -1)
            h = h + a @ lp["wo"]
            z = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
            u = jax.nn.silu(z @ lp["w_gate"]) * (z @ lp["w_up"])
            h = h + u @ lp["w_down"]
            amax = lambda t: jnp.max(jnp.abs(t), axis=0)
            return h, (amax(y), amax(a), amax(z), amax(u))

        h, (ai, oi, mi, di) = jax.lax.scan(layer, p["embed"][ids], p["layers"])
        head = jnp.max(jnp.abs(rms_norm(h, p["final_norm"], cfg.rms_norm_eps)), axis=0)
        return ai, oi, mi, di, head

    ai, oi, mi, di, head = run(p, jnp.asarray(token_ids, jnp.int32))
    return {"attn_in": np.asarray(ai), "o_in": np.asarray(oi), "mlp_in": np.asarray(mi), "down_in": np.asarray(di),
            "head_in": np.asarray(head)}


# A 1-row step (one stream decoding) is a matrix-vector product, bound by the weight read:
# there the int8 weights dequantized into a float product beat the int8 dot (SmolLM2 batch-1
# step on a 2-core EPYC: 20.8 ms against 23.2 ms); from 2 rows on the int8 dot wins (2: 29
# vs 33 ms, 8: 37 vs 43, 64: 172 vs 199). Rows are a compiled bucket size, so each bucket
# compiles one path and the switch costs nothing per step.
WEIGHT_ONLY_MAX_ROWS = 1


Norm = tuple  # (weight [in], eps): an RMS norm a product applies to its input first


@dataclass(frozen=True)
class LayerPick:
    """Inside the layer scan: a weight held as separate per-layer arrays, and the layer the
    scan is at (runtime/models/llama.py scan_layers); `linear` multiplies by arrays[index]."""
    arrays: tuple
    index: jax.Array


def linear(x: jax.Array, w: Any, residual: jax.Array | None = None, norm: Norm | None = None) -> jax.Array:
    """rms_norm(x) @ w [in, out] (x itself without `norm`), plus `residual` [T, out] if given.
    The float32 kernel does both in the same call (prologue, epilogue) in place of separate
    ops. Quantized w: each row of x gets its own scale (absmax/127), so one outlier token
    never costs the others their precision."""
    if isinstance(w, LayerPick):  # per-layer arrays inside the layer scan (models/llama.py)
        def branch(a):
            return lambda x, r, nw: linear(x, a, r, None if nw is None else (nw, norm[1]))
        return jax.lax.switch(w.index, [branch(a) for a in w.arrays], x, residual,
                              None if norm is None else norm[0])
    if isinstance(w, dict) and "f" in w:  # float32 packed for the C++ kernel (runtime/cpu_matmul.py)
        from runtime import cpu_matmul

        return cpu_matmul.linear_f32(x, w, residual, norm).astype(x.dtype)
    if norm is not None:
        x = _rms_norm(x, norm)
    if residual is not None:
        return residual + linear(x, w)
    if not is_quantized(w):
        return x @ w
    if "p" in w:  # packed for the C++ kernel (runtime/cpu_matmul.py)
        from runtime import cpu_matmul

        return cpu_matmul.linear(x, w).astype(x.dtype)
    if "w8" in w:  # weight-only: dequantize, multiply in the compute dtype
        return x @ (w["w8"].astype(x.dtype) * w["s"].astype(x.dtype)[..., None, :])
    if "g" in w:
        return grouped_linear(x, w).astype(x.dtype)
    x32 = x.astype(jnp.float32)
    if "in" in w:  # SmoothQuant's per-channel input scale (see quantize_params)
        x32 = x32 * w["in"]
    if x.shape[0] <= WEIGHT_ONLY_MAX_ROWS:  # same int8 weights, float activations
        return (x32 @ (w["q"].astype(jnp.float32) * w["s"][..., None, :])).astype(x.dtype)
    sx = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
    sx = jnp.where(sx > 0, sx, 1.0)
    xq = jnp.clip(jnp.round(x32 / sx), -127, 127).astype(jnp.int8)
    acc = jax.lax.dot(xq, w["q"], preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * sx * w["s"]).astype(x.dtype)


def _float_packed(w: Any, key: str = "f") -> bool:
    """w (a weight, or a layer scan's per-layer arrays) is packed for the float32 kernel."""
    w = w.arrays[0] if isinstance(w, LayerPick) else w[0] if isinstance(w, tuple) and w else w
    return isinstance(w, dict) and key in w


def tail_fuses(layers: dict[str, Any]) -> bool:
    """A layer's wo, gate|up and w_down run as one float32 kernel call (`layer_tail`)."""
    return (_float_packed(layers.get("wo")) and _float_packed(layers.get("gate_up"), "fg")
            and _float_packed(layers.get("w_down")))


def chains_qkv(layers: dict[str, Any]) -> bool:
    """`layer_tail`'s call also computes the next layer's qkv: the tail fuses and the layers'
    qkv is held per layer, packed for the float32 kernel (models/llama.py forward_hidden)."""
    return tail_fuses(layers) and isinstance(layers.get("qkv"), tuple) and _float_packed(layers["qkv"])


def layer_tail(a: jax.Array, h: jax.Array, lp: dict[str, Any], norm: Norm,
               next_norm: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """A decoder layer after attention: h1 = h + a @ wo; out = h1 + the SwiGLU MLP of
    rms_norm(h1). Returns (out, the next layer's fused qkv of rms_norm(out, next_norm) or
    None). Where wo, gate|up and w_down are packed for the float32 kernel they run as one
    kernel call (cpu_matmul.layer_tail_f32), which inside the layer scan also computes the
    next layer's qkv when `next_norm` is given (zeros after the last layer): a 1-row step
    then makes one product call per layer instead of four."""
    wo, gu, down = lp["wo"], lp.get("gate_up"), lp["w_down"]
    if not tail_fuses(lp):
        from runtime.models.llama import mlp

        h = linear(a, wo, residual=h)
        return mlp(lp, h, residual=h, norm=norm), None
    from runtime import cpu_matmul

    if not isinstance(wo, LayerPick):
        return cpu_matmul.layer_tail_f32(a, h, wo, norm, gu, down)[0].astype(h.dtype), None
    qkv = lp.get("qkv") if next_norm is not None else None
    n = len(wo.arrays)

    def branch(i):
        def run(a, h, nw, nn):
            nxt = qkv.arrays[i + 1] if qkv is not None and i + 1 < n else None
            out, q = cpu_matmul.layer_tail_f32(a, h, wo.arrays[i], (nw, norm[1]), gu.arrays[i], down.arrays[i],
                                               nxt, nn)
            if qkv is not None and q is None:  # the last layer: no next qkv
                q = jnp.zeros((a.shape[0], qkv.arrays[0]["f"].shape[-3] * cpu_matmul.F32_STRIP), jnp.float32)
            return out.astype(h.dtype), (None if q is None else q.astype(h.dtype))
        return run
    return jax.lax.switch(wo.index, [branch(i) for i in range(n)], a, h, norm[0], next_norm)


def swiglu(x: jax.Array, w: Any, norm: Norm | None = None) -> jax.Array:
    """silu(gate) * up of rms_norm(x) (x without `norm`) for a fused gate|up weight [in, 2I]
    -> [T, I]. A float32 weight packed as SwiGLU pairs ({"fg"}, runtime/cpu_matmul.pack_swiglu)
    gets it from the kernel's prologue and epilogue; any other is one product, split."""
    if isinstance(w, LayerPick):
        def branch(a):
            return lambda x, nw: swiglu(x, a, None if nw is None else (nw, norm[1]))
        return jax.lax.switch(w.index, [branch(a) for a in w.arrays], x, None if norm is None else norm[0])
    if isinstance(w, dict) and "fg" in w:
        from runtime import cpu_matmul

        return cpu_matmul.linear_f32(x, w, norm=norm).astype(x.dtype)
    gate, up = jnp.split(linear(x, w, norm=norm), 2, axis=-1)
    return jax.nn.silu(gate) * up


def _rms_norm(x: jax.Array, norm: Norm) -> jax.Array:
    from runtime.models.llama import rms_norm

    return rms_norm(x, *norm)


def grouped_linear(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """x [T, K] @ a grouped weight (GGUF Q8_0) -> float32 [T, N]: each row's groups of 32
    inputs quantized with their own scale, one int8 dot per group, summed with both scales."""
    q, g = w["q"], w["g"].astype(jnp.float32)
    (K, N), G = q.shape, g.shape[0]
    x32 = x.astype(jnp.float32)
    if x.shape[0] <= WEIGHT_ONLY_MAX_ROWS:  # a matrix-vector product: the weights' read decides
        return x32 @ (q.reshape(G, K // G, N).astype(jnp.float32) * g[:, None, :]).reshape(K, N)
    xg = x32.reshape(x.shape[0], G, K // G)
    sx = jnp.max(jnp.abs(xg), axis=-1, keepdims=True) / 127.0
    sx = jnp.where(sx > 0, sx, 1.0)
    xq = jnp.clip(jnp.round(xg / sx), -127, 127).astype(jnp.int8)
    acc = jax.lax.dot_general(xq, q.reshape(G, K // G, N), (((2,), (1,)), ((1,), (0,))),
                              preferred_element_type=jnp.int32)  # [G, T, N]
    return jnp.einsum("gtn,tg,gn->tn", acc.astype(jnp.float32), sx[..., 0], g)
