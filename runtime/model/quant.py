"""W8A8 linear layers: int8 weights with one scale per 32 inputs of each column, activations
quantized per token and 32 inputs on the fly, int8 x int8 -> int32 dots and the rescale
(W8A8_GROUP says why groups). The LM head and the embeddings stay float (the embedding is a
gather; the head's logits feed sampling and logprobs directly).

(A bfloat16-weights mode was measured and left out: its isolated dot is 1.8x float32 at 64
rows on an AVX512-BF16 EPYC, but inside the layer scan XLA:CPU made the whole step 1.4x
slower at batch 64 and 7x at batch 1.)

A quantized weight is a pytree in place of the float array, so the stacked-layer scan and
the checkpoint tree keep their shape:
  w8a8   {"q": int8 [..., in, out], "g": float32 [..., in/32, out]}: w8a8's own (SmoothQuant
         folded into what makes each input), or a GGUF Q8_0 checkpoint's values and block
         scales, never requantized; activations get a scale per token and group of 32
         (llama.cpp's Q8_0 dot).
  w8a8, per channel  {"q": int8 [..., in, out], "s": float32 [..., out] (, "in": float32
         [..., in])}: where a projection's width does not divide by 32, and older checkpoints;
         activations per token.
  w8a16  {"w8": int8 [..., in, out], "s": float32 [..., out]}: weight-only, dequantized in
         the graph and multiplied in the compute dtype (halves the weight bytes a
         bandwidth-bound GPU decode reads; on a 2-core EPYC 1.47x float32 at batch 1 and
         1.08x at 64, but slower than w8a8 from 2 rows on).
  w4a16  {"q4": uint8 [..., in/2, out], "s4", "m4": float32 [..., in/32, out]}: 4-bit values
         (row 16 g + j holds input 32 g + j in its low nibble, 32 g + 16 + j in its high one:
         GGUF Q4_0 / Q4_1's order), w = q * s4 + m4 per group of 32 inputs: a GGUF Q4_0 /
         Q4_1 / Q4_K checkpoint's own values, or a float one's quantized by `quantize_weight_int4`;
         activations stay float. Its LM head is 8-bit weight-only: {"q8": int8 [d, V], "s8":
         float32 [d/32, V]} (GGUF Q8_0's, or `quantize_head_w8`'s).
  packed {"p", "s", "c" (, "in")}: w8a8 repacked at start for the C++ kernel on CPUs with
         AVX512-VNNI (runtime/kernels/cpu/matmul.py), q|k|v and gate|up fused.
The products themselves are the Linear objects of runtime/model/linear.py (`from_stored`
reads these dicts once); this module quantizes and calibrates.

Why hand-written and not qwix (Google's JAX quantization library): qwix quantizes a Flax
Linen / NNX model by intercepting its dot_general / einsum calls, and its products are
XLA's. The paged step is plain functions (no Flax module) whose CPU products are C++ custom
calls (the VNNI / AMX kernel, 2-3x XLA's int8 dot here) over weights packed once at start,
with q|k|v and gate|up fused, and a GGUF Q8_0 checkpoint's own block scales: none of that
is a dot_general for qwix to rewrite. What it would add (per-channel absmax int8, dynamic
per-token activations) is the dozen lines of `quantize_weight` and `linear` below.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.model.linear import Dense, from_stored, grouped_product

QUANTIZATIONS = ("none", "w8a8", "w8a16", "w4a16")
Q8_0_GROUP = 32  # inputs per scale in a grouped (GGUF Q8_0) weight
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


# What each weight setting is held to by `pagedjax bench accuracy` (runtime/bench/accuracy.py):
# (largest relative perplexity increase, largest share of changed answers) against float32.
WEIGHT_GATES = {"w8a8": (0.02, 0.05), "w8a16": (0.02, 0.05), "w4a16": (0.05, 0.10)}


def describe(method: str, lm_head: bool = False, group_size: int | None = None, exact_gguf: bool = False) -> str:
    """One line on what a quantization setting serves (bits, groups, what stays in higher
    precision, its accuracy gates): `inspect` and the console's model page print it."""
    if method == "none":
        return "none (float weights)"
    if method == "w4a16":
        origin = "a GGUF's Q4_0/Q4_1/Q4_K blocks, exact" if exact_gguf else "round to nearest, searched grids"
        text = (f"w4a16: 4-bit decoder weights ({origin}), "
                f"a float32 scale and offset per {group_size or W4_GROUP} inputs (6.0 bits per weight in all); "
                "LM head int8 with a scale per 32 inputs; activations, embeddings and norms float")
    elif method == "w8a8" and group_size:
        origin = "a GGUF's Q8_0 blocks, exact" if exact_gguf else "SmoothQuant-calibrated"
        text = (f"w8a8: int8 decoder weights ({origin}), "
                f"a float32 scale per {group_size} inputs (9.0 bits per weight); activations int8 per token and "
                f"{group_size} inputs; LM head {'int8' if lm_head else 'float'}; embeddings and norms float")
    elif method == "w8a8":
        text = ("w8a8: int8 decoder weights, a scale per output channel, SmoothQuant-calibrated; activations int8 "
                f"per token; LM head {'int8' if lm_head else 'float'}; embeddings and norms float")
    else:
        text = "w8a16: int8 decoder weights, a scale per output channel, weight-only; activations float"
    ppl, changed = WEIGHT_GATES[method]
    return f"{text}. Gates: >= {1 - changed:.0%} of float32's answers, perplexity <= +{ppl:.0%} (pagedjax bench accuracy)"


def is_quantized(w: Any) -> bool:
    return isinstance(w, dict) and any(k in w for k in ("q", "w8", "p", "q4", "qp", "qpg", "qg"))


def quantization_of(params: dict[str, Any]) -> str:
    """Which method a parameter tree was quantized with ("none" for float weights)."""
    lay = params["layers"]
    w = lay.get("wq", lay.get("qkv", lay.get("experts_gate")))
    if isinstance(w, tuple):  # held per layer (models/llama.py unstack_weights)
        w = w[0]
    if not is_quantized(w):
        return "none"
    if "q4" in w or "qp" in w or "qg" in w:
        return "w4a16"
    return "w8a16" if "w8" in w else "w8a8"


def cast_params(params: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Device arrays in the compute dtype, except integer weights (int8 values, int32 kernel
    compensations) and float32 scales."""
    def place(path, a):
        key = jax.tree_util.keystr(path)
        dt = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype  # (a device array stays put)
        keep = np.issubdtype(dt, np.integer) or key.endswith(
            ("['s']", "['g']", "['gs']", "['s4']", "['m4']", "['s8']", "['qps']", "['sg']", "['mg']"))
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
    if method == "w4a16":  # the head always comes as 8-bit (quantize_params says why)
        for k in LINEAR_WEIGHTS:
            *lead, K, N = layers[k]
            layers[k] = {"q4": (*lead, K // 2, N), "s4": (*lead, K // W4_GROUP, N), "m4": (*lead, K // W4_GROUP, N)}
        d, v = shapes["embed"][1], shapes["embed"][0]
        return {**shapes, "layers": layers, "head": {"q8": (d, v), "s8": (d // W4_GROUP, v)}}
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
# w8a8's scales: one per 32 inputs for weights and activations alike (llama.cpp's Q8_0 dot; the
# C++ kernel's grouped path). One scale per token was too coarse: SmolLM2's w_down inputs reach
# |x| ~2,900 in one layer while most of the row is ~1, and the per-token scheme changed 3 of
# 4 greedy continuations (KL to float32 0.014); per 32 inputs it is 0.0018. 64 and 96 were
# measurably worse than 32.
W8A8_GROUP = Q8_0_GROUP


def quantize_weight_grouped(w: np.ndarray, group: int = W8A8_GROUP) -> dict[str, np.ndarray]:
    """[..., in, out] float -> int8 with one scale per `group` inputs of each column (absmax / 127):
    {"q": int8 [..., in, out], "g": float32 [..., in/group, out]}, the Q8_0 layout."""
    w = np.asarray(w, np.float32)
    *lead, K, N = w.shape
    if K % group:
        raise ValueError(f"grouped int8: {K} inputs do not divide into groups of {group}")
    wg = w.reshape(*lead, K // group, group, N)
    g = np.abs(wg).max(axis=-2) / 127.0
    g = np.where(g > 0, g, 1.0).astype(np.float32)
    q = np.clip(np.rint(wg / g[..., None, :]), -127, 127).astype(np.int8).reshape(w.shape)
    return {"q": q, "g": g}


W4_GROUP = 32  # inputs per scale and offset of a 4-bit weight (GGUF Q4_0 / Q4_1's block)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [..., K, N] -> [..., K/2, N] in the w4a16 order (module docstring)."""
    *lead, K, N = q.shape
    g = np.asarray(q, np.uint8).reshape(*lead, K // W4_GROUP, 2, W4_GROUP // 2, N)
    return (g[..., 0, :, :] | (g[..., 1, :, :] << 4)).reshape(*lead, K // 2, N)


def unpack_nibbles(q4: np.ndarray) -> np.ndarray:
    """pack_nibbles' inverse: [..., K/2, N] -> uint8 values [..., K, N]."""
    *lead, H, N = q4.shape
    g = np.asarray(q4, np.uint8).reshape(*lead, H // (W4_GROUP // 2), 1, W4_GROUP // 2, N)
    return np.concatenate([g & 15, g >> 4], axis=-3).reshape(*lead, 2 * H, N)


# Candidate grids per group (llama.cpp's make_qkx2_quants search): the group's range divided
# into 15 + r steps for r in -1.0, -0.9, ..., +1.0, each rounded, then the scale and offset
# refitted by least squares to those levels; the candidate with the smallest squared error
# wins. Plain round-to-nearest over [min, max] is the r = 0 candidate before its refit. On
# Gemma 3 270M (mostly Q5_0 weights, so 4 bits is a real loss) the weights' relative error
# fell from 8.2% to 7.1% (its Q4_K wo came back exact), the mean logprob difference to float32
# from 0.80 to 0.68 nats and the perplexity change from +17.7% to -7.3% on the seed chapters;
# answers kept: 43% -> 38% of a base model's verbose first lines (BENCHMARKS.md).
W4_SEARCH = np.linspace(-1.0, 1.0, 21, dtype=np.float32)


def quantize_weight_int4(w: np.ndarray, group: int = W4_GROUP) -> dict[str, np.ndarray]:
    """[..., in, out] float -> 4-bit values with a scale and an offset per `group` inputs of each
    column (the GGUF Q4_1 layout): {"q4", "s4", "m4"}, w ~ q * s4 + m4, each group's grid
    chosen by W4_SEARCH."""
    w = np.asarray(w, np.float32)
    *lead, K, N = w.shape
    if K % group:
        raise ValueError(f"w4a16: {K} inputs do not divide into groups of {group}")
    if lead:  # a layer at a time keeps the search's temporaries small
        parts = [quantize_weight_int4(w[i], group) for i in range(w.shape[0])]
        return {k: np.stack([p[k] for p in parts]) for k in ("q4", "s4", "m4")}
    wg = w.reshape(K // group, group, N)
    lo, hi = wg.min(axis=1), wg.max(axis=1)
    span = np.where(hi > lo, hi - lo, 1.0).astype(np.float32)
    best_q = np.zeros(wg.shape, np.uint8)
    best = (np.full(lo.shape, np.inf, np.float32), np.ones_like(lo), lo.copy())  # error, scale, offset
    for r in W4_SEARCH:
        q = np.clip(np.rint((wg - lo[:, None]) * ((15.0 + r) / span)[:, None]), 0, 15)
        sl, sl2 = q.sum(1), (q * q).sum(1)
        sx, slx = wg.sum(1), (q * wg).sum(1)
        det = group * sl2 - sl * sl
        ok = det > 0
        d = np.where(ok, det, 1.0)
        scale = np.where(ok, (group * slx - sl * sx) / d, span / 15.0)
        off = np.where(ok, (sl2 * sx - sl * slx) / d, lo)
        err = ((q * scale[:, None] + off[:, None] - wg) ** 2).sum(1)
        better = err < best[0]
        best = tuple(np.where(better, new, old) for new, old in zip((err, scale, off), best))
        best_q = np.where(better[:, None], q.astype(np.uint8), best_q)
    return {"q4": pack_nibbles(best_q.reshape(K, N)), "s4": best[1].astype(np.float32),
            "m4": best[2].astype(np.float32)}


def dequantize_int4(w: dict[str, np.ndarray]) -> np.ndarray:
    """A stored 4-bit weight as float32 [..., in, out] (q * s4 + m4, as the products read it)."""
    q = unpack_nibbles(w["q4"]).astype(np.float32)
    *lead, K, N = q.shape
    s, m = np.asarray(w["s4"], np.float32), np.asarray(w["m4"], np.float32)
    return (q.reshape(*lead, K // W4_GROUP, W4_GROUP, N) * s[..., None, :] + m[..., None, :]).reshape(q.shape)


def quantize_head_w8(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The LM head [d, V] as 8-bit weight-only values, one scale per 32 inputs (absmax / 127,
    GGUF Q8_0's scheme): {"q8": int8 [d, V], "s8": float32 [d/32, V]}."""
    w = np.asarray(params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T, np.float32)
    g = quantize_weight_grouped(w)
    return {"q8": np.ascontiguousarray(g["q"]), "s8": g["g"]}


def groupable(layers: dict[str, Any], group: int = W8A8_GROUP) -> bool:
    """Every projection's input dimension divides into groups (else w8a8 falls back to one
    scale per output channel and per token)."""
    return all(np.shape(layers[k])[-2] % group == 0 for k in LINEAR_WEIGHTS if k in layers)


def quantize_params(params: dict[str, Any], method: str, act_absmax: dict[str, np.ndarray] | None = None,
                    lm_head: bool = False, grouped: bool = True, head_dim: int | None = None,
                    folds: dict[str, dict[str, np.ndarray]] | None = None) -> dict[str, Any]:
    """The checkpoint tree with every decoder projection quantized (host side, numpy).
    With `act_absmax` (per-layer, per-input-channel maxima of each projection's input, from
    `activation_absmax` on calibration text) the activation outliers are smoothed first
    (SmoothQuant): x W = (x / s)(s W), s = max|x|^a / max|W|^(1-a) per input channel.
    `grouped` (and every input dimension a multiple of W8A8_GROUP): one scale per 32 inputs,
    and every 1/s folds into what makes the input: the norms before wq|wk|wv and w_gate|w_up,
    w_up's columns for w_down (the MLP's product is elementwise), wv's columns for wo (s tied
    over the query heads that read one KV head; needs `head_dim`, else wo is not smoothed).
    Otherwise one scale per output channel, and
    wo and w_down carry 1/s as an input scale (`"in"`) applied before quantizing.
    `folds` (a dict, filled): what the smoothing did to each projection's input and output, as
    projection -> {"in": [L, in] s (its input is x / s), "out": [L, out] f (its output is y * f)}:
    a LoRA adapter on the smoothed model scales its A rows by s and its B columns by f
    (runtime/core/lora.py), so its delta is the one it has on the float model."""
    folds = {} if folds is None else folds

    def fold(w: str, kind: str, f: np.ndarray) -> None:
        entry = folds.setdefault(w, {})
        entry[kind] = entry[kind] * f if kind in entry else f.astype(np.float32)
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    if method == "none":
        return params
    if method == "w4a16":
        # Weight-only 4-bit, round to nearest per group of 32. The head goes to 8 bits (not 4,
        # not float): at one row a float32 head is as many bytes as all 4-bit layers together.
        layers = {k: (quantize_weight_int4(v) if k in LINEAR_WEIGHTS and not is_quantized(v) else v)
                  for k, v in params["layers"].items()}
        return {**params, "layers": layers, "head": params.get("head") or quantize_head_w8(params)}
    if method == "w8a16":  # weight-only: activations stay float, nothing to smooth
        layers = {k: ({"w8": (qw := quantize_weight(v))["q"], "s": qw["s"]} if k in LINEAR_WEIGHTS else v)
                  for k, v in params["layers"].items()}
        return {**params, "layers": layers}
    lay = {k: np.asarray(v, np.float32) if (k in LINEAR_WEIGHTS or k.endswith("norm") or k == "bv")
           and not is_quantized(v) else v for k, v in params["layers"].items()}
    grouped = grouped and groupable(lay) and not any(is_quantized(lay[k]) for k in LINEAR_WEIGHTS if k in lay)
    in_scale: dict[str, np.ndarray] = {}
    if act_absmax is not None:
        def smooth(x_max: np.ndarray, ws: list[str]) -> np.ndarray:  # [L, in]
            sc = smoothing_scale(x_max, np.max([np.abs(lay[w]).max(axis=-1) for w in ws], axis=0))
            for w in ws:
                lay[w] = lay[w] * sc[..., :, None]
            return sc
        if grouped:  # first: the folds change w_up and wv, whose own smoothing reads their maxima
            sc = smooth(act_absmax["down_in"], ["w_down"])
            lay["w_up"] = lay["w_up"] / sc[..., None, :]
            fold("w_down", "in", sc)
            fold("w_up", "out", 1.0 / sc)
            if head_dim and "wv" in lay:
                kv = lay["wv"].shape[-1] // head_dim
                sc = smoothing_scale(_tied_over_kv_heads(act_absmax["o_in"], kv, head_dim),
                                     _tied_over_kv_heads(np.abs(lay["wo"]).max(axis=-1), kv, head_dim))
                lay["wo"] = lay["wo"] * sc[..., :, None]
                sv = sc.reshape(sc.shape[0], kv, -1, head_dim)[:, :, 0].reshape(sc.shape[0], kv * head_dim)
                lay["wv"] = lay["wv"] / sv[..., None, :]
                fold("wo", "in", sc)
                fold("wv", "out", 1.0 / sv)
                if "bv" in lay:
                    lay["bv"] = lay["bv"] / sv
        for norm, key, ws in (("attn_norm", "attn_in", ["wq", "wk", "wv"]), ("mlp_norm", "mlp_in", ["w_gate", "w_up"])):
            sc = smooth(act_absmax[key], ws)
            lay[norm] = lay[norm] / sc
            for w in ws:
                fold(w, "in", sc)
        if not grouped:
            for key, w in (("o_in", "wo"), ("down_in", "w_down")):
                in_scale[w] = 1.0 / smooth(act_absmax[key], [w])
    layers = {}
    for k, v in lay.items():
        if k in LINEAR_WEIGHTS and not is_quantized(v):
            v = quantize_weight_grouped(v) if grouped else quantize_weight(v)
            if k in in_scale:
                v["in"] = in_scale[k]
        layers[k] = v
    out = {**params, "layers": layers}
    if lm_head and act_absmax is not None:
        out["head"] = quantize_head(params, act_absmax["head_in"], grouped)
    return out


EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


def quantize_experts(params: dict[str, Any], method: str) -> dict[str, Any]:
    """A mixture of experts' expert stacks [L, E, in, out] as int8 with one scale per expert and
    output channel (absmax / 127): {"w8", "s"} for w8a16, {"q", "s"} for w8a8 (the rows then
    quantized per row in the product: linear.expert_products). Routers, shared experts and
    dense layers stay float."""
    layers = dict(params["layers"])
    for k in EXPERT_WEIGHTS:
        if k in layers and not is_quantized(layers[k]):
            stack = layers[k]  # one layer at a time: a whole stack in float32 would be tens of GB
            q = np.empty(np.shape(stack), np.int8)
            scale = np.empty((*np.shape(stack)[:-2], np.shape(stack)[-1]), np.float32)
            for i in range(q.shape[0]):
                qw = quantize_weight(np.asarray(stack[i], np.float32))
                q[i], scale[i] = qw["q"], qw["s"]
            layers[k] = {"w8": q, "s": scale} if method == "w8a16" else {"q": q, "s": scale}
    return {**params, "layers": layers}


def _tied_over_kv_heads(x_max: np.ndarray, kv_heads: int, head_dim: int) -> np.ndarray:
    """Per-row maxima of wo's input side [L, H*D] (of x or of W) with the query heads of each
    KV head sharing one value per dimension (their max): then s is the same for them and 1/s folds into that KV head's wv
    columns (query head h reads KV head h // (H / KV), as transformers' repeat_kv)."""
    L = x_max.shape[0]
    t = x_max.reshape(L, kv_heads, -1, head_dim)
    return np.broadcast_to(t.max(axis=2, keepdims=True), t.shape).reshape(L, -1)


def smoothing_scale(x_max: np.ndarray, w_max: np.ndarray) -> np.ndarray:
    """SmoothQuant's per-input-channel s = max|x|^a / max|W|^(1-a), clipped to [1e-2, 1e2]."""
    sc = np.maximum(x_max, 1e-5) ** SMOOTH_ALPHA / np.maximum(w_max, 1e-5) ** (1 - SMOOTH_ALPHA)
    return np.clip(sc, 1e-2, 1e2).astype(np.float32)


# Measured (SmolLM2, 4,095 tokens of the seed chapters): w8a8 perplexity +1.55% with the float
# head, +1.87% with this one, for a 64-row decode step 10% faster (172 -> 154 ms, 2-core EPYC);
# on a 224-token narrative +2.77% -> +3.64%. Smoothing strengths 0.3-0.85 were no better than
# the layers' 0.5. Hence opt-in: --quantize-lm-head.
def quantize_head(params: dict[str, Any], x_max: np.ndarray, grouped: bool = False) -> dict[str, np.ndarray]:
    """An int8 copy of the LM head [d, V] (per vocabulary column), smoothed like wo: the
    float head (the tied embedding) stays for the embedding gather and 1-row steps. `grouped`
    (the w8a8 layers are): one scale per 32 inputs instead, not smoothed (1/s has nowhere to
    fold: the final norm also feeds the float head)."""
    w = np.asarray(params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T, np.float32)
    if grouped:
        g = quantize_weight_grouped(w)
        return {"q": np.ascontiguousarray(g["q"]), "g": g["g"]}
    sc = smoothing_scale(x_max, np.abs(w).max(axis=-1))
    q = quantize_weight(w * sc[:, None])
    return {"q": np.ascontiguousarray(q["q"]), "s": q["s"], "in": (1.0 / sc).astype(np.float32)}


CALIBRATION_TOKENS = 1024


def calibration_ids(tokenizer: Any, max_positions: int) -> list[int]:
    """Calibration text for SmoothQuant: support-chat traffic (the load generator's system
    prompt and questions through the chat template), never the accuracy evaluation's text."""
    from runtime.corpus import shared_prefix_messages

    ids: list[int] = []
    for messages in shared_prefix_messages(8, seed=3):
        text = tokenizer.apply_chat_template(messages) if tokenizer.chat else " ".join(m["content"] for m in messages)
        ids += tokenizer.encode(text)
    return ids[:min(CALIBRATION_TOKENS, max_positions)]


def prepare(params: dict[str, Any], method: str, cfg: Any, tokenizer: Any, lm_head: bool = False,
            folds: dict[str, dict[str, np.ndarray]] | None = None) -> dict[str, Any]:
    """quantize_params with the activation maxima measured on the calibration text (w8a8;
    `lm_head` adds the int8 head). A tree that is already quantized by `method` (a `convert
    --quantize` checkpoint) is returned as it is: start-up never requantizes; one quantized
    otherwise is an error. `folds`: filled with what SmoothQuant did to the projections (quantize_params)."""
    if method == "w4a16" and cfg.num_experts:
        raise ValueError("quantization: w4a16 of a mixture of experts is not implemented (its experts have no "
                         "4-bit form yet); serve it with --quantization w8a16, w8a8 or none")
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
    if cfg.num_experts and method != "none":
        if lm_head:
            raise ValueError("quantize_lm_head: not implemented for a mixture of experts (its calibration run is "
                             "a dense model's)")
        return quantize_experts(quantize_params(params, method, grouped=False), method)
    if method in ("none", "w8a16", "w4a16"):
        return quantize_params(params, method)
    return quantize_params(params, method,
                           activation_absmax(cfg, params, calibration_ids(tokenizer, cfg.max_position_embeddings)),
                           lm_head=lm_head, head_dim=cfg.head_dim, folds=folds)


def activation_absmax(cfg: Any, params: dict[str, Any], token_ids: list[int]) -> dict[str, np.ndarray]:
    """Per layer, the largest |value| of each input channel of the four projection groups
    (attention in, attention out, MLP in, MLP down) over `token_ids`, float model, dense."""
    from runtime.model.families import family
    from runtime.model.families.llama import dense_causal_attention, rms_norm, rope_inv_freq

    p = jax.tree_util.tree_map(jnp.asarray, params)
    T = len(token_ids)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    pos = jnp.arange(T, dtype=jnp.int32)

    @jax.jit
    def run(p, ids):
        inv = jnp.asarray(rope_inv_freq(cfg))

        def layer(h, lp):
            y = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
            q, k, v = family(cfg).qkv_projection(cfg, {**lp, **{n: Dense(lp[n]) for n in ("wq", "wk", "wv")}}, y, pos, inv)
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


def linear(x: jax.Array, w: Any, residual: jax.Array | None = None, norm: Any = None) -> jax.Array:
    """rms_norm(x) @ a stored weight (+ residual): its Linear's product (runtime/model/linear.py)."""
    return from_stored(w).apply(x, residual, norm)


def grouped_linear(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """x [T, K] @ a stored grouped (GGUF Q8_0) weight -> float32 [T, N]."""
    return grouped_product(x, w["q"], w["g"])
