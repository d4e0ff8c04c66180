"""The CPU W8A8 linear kernel (runtime/kernels/cpu/cpu_matmul.cc): packing and the call.

Kept because it wins against XLA's own CPU libraries (scripts/bench_yardstick.py, BENCHMARKS.md,
2-core AMX Xeon, one run): the SmolLM2 w8a8 step at 1 row 13.6 ms against 45.0 (XLA's
default) / 63.1 (YNN fusions); at 64 rows 115 ms against 311 / 337 (XLA hands the 64-row int8
dots to YNNPACK). The float32 kernel (cpu_linear_f32.cc, `linear_f32`): 26.9 ms against 37.0
(the best XLA setting) at 1 row, 167 ms against 397 at 64 rows.

`pack_params` turns a w8a8 tree ({"q": int8 [..., in, out], "s", "in"?}) into the kernel's
layout once, when the engine starts: {"p": int8 [..., strips, in/4, 256], "s": [..., out],
"c": int32 [..., out] (128 * column sums, see the .cc), "in"?}. Projections that read the
same input are packed as one: wq|wk|wv -> "qkv", w_gate|w_up -> "gate_up" (one activation
quantization and one call instead of three or two). runtime.model.quant.linear runs a packed
weight through `linear` below; the model splits the fused outputs.

Grouped w8a8 ({"q", "g": [..., in/32, out]}: GGUF Q8_0's values and block scales, kept
exact) packs the same values with {"gs": float32 [..., in/32, out], "gc": int32 [..., in/32,
out]} (128 * each group's column sums) in place of "s" / "c", and runs the kernel's grouped
target (activations quantized per row and group of 32, as llama.cpp does).

Weight-only quantized weights (w4a16: {"q4", "s4", "m4"}, its 8-bit head {"q8", "s8"}) go to
their own kernel (cpu_linear_wq.cc, `linear_wq`): `pack_wq_params` repacks them into strips of
16 columns, {"qp": uint8 [..., N/16, K/32, 256 | 512], "qps": float32 [..., N/16, K/32, 2 | 1,
16]} (values; each group's scales, then offsets), q|k|v and gate|up fused; the kernel
reads the 4- or 8-bit values as stored and multiplies float32 activations.

Used for w8a8 on the CPU backend when the library was built with AVX512-VNNI
(`vectorized()`); elsewhere XLA's int8 dot stays (same numbers up to float rounding).

Float32 layers have their own kernel (runtime/kernels/cpu/cpu_linear_f32.cc, AVX-512 or AVX2 + FMA:
`f32_vectorized()`, on by default where `f32_default()`): `pack_float_params` packs the
projections into strips of 16 columns, {"f": float32 [..., N/16, K, 16]}, fused the same
way, and `linear_f32` calls it. Its gate|up is packed as {"fg": ...}, the gate's and the up
projection's strips alternating, so the kernel returns silu(gate) * up itself; `linear_f32`
also adds a residual in the kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.config import KernelConfig
from runtime.kernels.cpu import build as cpu_kernels

TARGET = "pagedjax_int8_linear"
GROUPED_TARGET = "pagedjax_int8_linear_g32"
F32_TARGET = "pagedjax_f32_linear"
TAIL_TARGET = "pagedjax_f32_layer_tail"
WQ_TARGET = "pagedjax_wq_linear"
WQ_TAIL_TARGET = "pagedjax_wq_layer_tail"
STRIP = 64     # output columns per packed strip
F32_STRIP = 16  # the float kernel's strip
FUSED = {"qkv": ("wq", "wk", "wv"), "gate_up": ("w_gate", "w_up")}
PACKED = {**FUSED, "wo": ("wo",), "w_down": ("w_down",)}  # packed name -> the projections it holds


def vectorized(kernels: KernelConfig | None = None) -> bool:
    """The kernels are enabled and the int8 one was compiled with AVX512-VNNI."""
    lib = cpu_kernels.library() if cpu_kernels.enabled(kernels) else None
    return bool(lib is not None and lib.PagedjaxInt8LinearVectorized())


def amx(kernels: KernelConfig | None = None) -> bool:
    """w8a8 products of 16+ rows run on AMX tiles (Sapphire Rapids and later: the kernel was
    compiled with AMX-INT8 and the OS lends the tile registers); KernelConfig.amx off
    (PAGEDJAX_AMX=0) keeps the AVX512-VNNI loop (same outputs, for an A/B)."""
    kernels = kernels or KernelConfig().with_env()
    return vectorized(kernels) and bool(cpu_kernels.library().PagedjaxInt8LinearAmx()) and kernels.amx


def f32_vectorized(kernels: KernelConfig | None = None) -> bool:
    """The kernels are enabled and the float32 one was compiled with AVX2 + FMA or AVX-512."""
    lib = cpu_kernels.library() if cpu_kernels.enabled(kernels) else None
    return bool(lib is not None and lib.PagedjaxF32LinearVectorized())


def f32_default(kernels: KernelConfig | None = None) -> bool:
    """Whether float32 layers go through the float kernel: KernelConfig.f32_kernel on / off
    (PAGEDJAX_F32_KERNEL=1 / 0) forces it; auto: wherever it is vectorized (measured faster
    than XLA's dot with the AVX2 and the AVX-512 tile; see cpu_linear_f32.cc)."""
    kernels = kernels or KernelConfig().with_env()
    if not f32_vectorized(kernels) or kernels.f32_kernel == "off":
        return False
    return kernels.f32_kernel == "on" or bool(cpu_kernels.library().PagedjaxF32LinearPreferred())


def packed_array(w: Any) -> Any:
    """The main array of a weight packed for a C++ kernel ("p", "f", "fg", "qp" or "qpg"), else None."""
    if isinstance(w, dict):
        return next((w[k] for k in ("p", "f", "fg", "qp", "qpg") if k in w), None)
    return None


def is_packed(w: Any) -> bool:
    return isinstance(w, dict) and "p" in w


def pack_weight(q: np.ndarray, s: np.ndarray, in_scale: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """int8 [..., K, N] + scales [..., N] -> the kernel's tree (see the module docstring)."""
    q = np.asarray(q, np.int8)
    *lead, K, N = q.shape
    kp, np_ = -(-K // 4) * 4, -(-N // STRIP) * STRIP
    pad = np.zeros((*lead, kp, np_), np.int8)
    pad[..., :K, :N] = q
    # [.., K/4, 4, S, 4, 16] (kq, t, strip, panel, lane) -> [.., S, K/4, panel, lane, t]
    g = pad.reshape(*lead, kp // 4, 4, np_ // STRIP, 4, 16)
    nd = len(lead)
    packed = g.transpose(*range(nd), nd + 2, nd, nd + 3, nd + 4, nd + 1).reshape(*lead, np_ // STRIP, kp // 4, 256)
    out = {"p": np.ascontiguousarray(packed), "s": np.asarray(s, np.float32),
           "c": (128 * q.astype(np.int32).sum(axis=-2)).astype(np.int32)}
    if in_scale is not None:
        out["in"] = np.asarray(in_scale, np.float32)
    return out


def pack_grouped_weight(q: np.ndarray, g: np.ndarray) -> dict[str, np.ndarray]:
    """int8 [..., K, N] + group scales [..., K/32, N] -> the grouped kernel's tree."""
    q = np.asarray(q, np.int8)
    *lead, K, N = q.shape
    G = np.shape(g)[-2]
    if K % 32 or G * 32 != K:
        raise ValueError(f"grouped int8 weights: {K} rows in groups of 32 need {K // 32} scale rows, got {G}")
    packed = pack_weight(q, np.ones(q.shape[:-2] + (N,), np.float32))["p"]
    comp = 128 * q.astype(np.int32).reshape(*lead, G, 32, N).sum(axis=-2)
    return {"p": packed, "gs": np.asarray(g, np.float32), "gc": comp.astype(np.int32)}


def _pack(ws: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Several w8a8 weights reading one input, packed side by side (outputs concatenated)."""
    if all("g" in w for w in ws):
        return pack_grouped_weight(np.concatenate([np.asarray(w["q"]) for w in ws], axis=-1),
                                   np.concatenate([np.asarray(w["g"]) for w in ws], axis=-1))
    if any("g" in w for w in ws):
        raise ValueError("fused projections must all be grouped (Q8_0) or all per-channel")
    ins = [w.get("in") for w in ws]
    if any(i is not None for i in ins) and not all(i is not None and np.array_equal(i, ins[0]) for i in ins):
        raise ValueError("fused projections must share their input scale")
    q = np.concatenate([np.asarray(w["q"]) for w in ws], axis=-1)
    s = np.concatenate([np.asarray(w["s"]) for w in ws], axis=-1)
    return pack_weight(q, s, None if ins[0] is None else np.asarray(ins[0]))


def pack_params(params: dict[str, Any]) -> dict[str, Any]:
    """A w8a8 tree -> the same model with packed (and fused) projections and int8 head."""
    layers = dict(params["layers"])
    for name, names in PACKED.items():
        if all(n in layers for n in names):  # (a mixture of experts has no dense MLP to pack)
            layers[name] = _pack([layers.pop(n) for n in names])
    out = {**params, "layers": layers}
    if "head" in params:
        out["head"] = _pack([params["head"]])
    return out


def pack_wq(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A stored 4-bit ({"q4", "s4", "m4"}) or 8-bit ({"q8", "s8"}) weight [..., K, N] (N
    divisible by 16) -> the weight-only kernel's {"qp", "qps"} (module docstring)."""
    if "q4" in w:
        q, scales = np.asarray(w["q4"], np.uint8), [w["s4"], w["m4"]]
        *lead, H, N = q.shape
        G, per = H // 16, 16      # 16 bytes per input pair (j, 16 + j) of a group
    else:
        q, scales = np.asarray(w["q8"]).view(np.uint8), [w["s8"]]
        *lead, K, N = q.shape
        G, per = K // 32, 32
    if N % F32_STRIP:
        raise ValueError(f"the quantized kernel packs {F32_STRIP}-column strips: {N} columns do not divide")
    S, nd = N // F32_STRIP, len(lead)
    # [.., G, per, S, 16] -> [.., S, G, per, 16]
    v = q.reshape(*lead, G, per, S, F32_STRIP).transpose(*range(nd), nd + 2, nd, nd + 1, nd + 3)
    if wq_permuted():  # the AVX2 decode's column order within each 16 bytes (cpu_linear_wq.cc)
        v = v[..., WQ_PERMUTATION]
    sm = np.stack([np.asarray(a, np.float32).reshape(*lead, G, S, F32_STRIP) for a in scales], axis=-2)
    sm = sm.transpose(*range(nd), nd + 1, nd, nd + 2, nd + 3)  # [.., G, S, n, 16] -> [.., S, G, n, 16]
    return {"qp": np.ascontiguousarray(v.reshape(*lead, S, G, per * F32_STRIP)), "qps": np.ascontiguousarray(sm)}


WQ_PERMUTATION = np.array([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def wq_permuted() -> bool:
    """The loaded kernel library decodes 16-byte rows with permuted columns (its AVX2 path)."""
    lib = cpu_kernels.library()
    return bool(lib is not None and lib.PagedjaxWqLinearPermuted())


def pack_wq_params(params: dict[str, Any], swiglu_tail: bool = False) -> dict[str, Any]:
    """A w4a16 tree -> the same model with its projections (q|k|v and gate|up fused) and its
    8-bit head packed for the weight-only kernel; unchanged when a width does not divide by 16.
    `swiglu_tail` (a Llama-style layer: SwiGLU, no post-norms): gate|up is stored as {"qpg",
    "qps"}, which typed() reads as PackedWqSwiGLU, so the layer's products fuse into one
    WqTail call; other families keep {"qp", "qps"} and apply their own activation."""
    layers = dict(params["layers"])
    if any(np.shape(layers[n]["q4"])[-1] % F32_STRIP for names in PACKED.values() for n in names):
        return params
    for name, names in PACKED.items():
        ws = [layers.pop(n) for n in names]
        layers[name] = pack_wq({k: np.concatenate([np.asarray(w[k]) for w in ws], axis=-1) for k in ("q4", "s4", "m4")})
    if swiglu_tail:
        layers["gate_up"] = {"qpg": layers["gate_up"]["qp"], "qps": layers["gate_up"]["qps"]}
    out = {**params, "layers": layers}
    if "head" in params and np.shape(params["head"]["q8"])[-1] % F32_STRIP == 0:
        out["head"] = pack_wq(params["head"])
    return out


def linear_wq(x: jax.Array, w: dict[str, jax.Array], residual: jax.Array | None = None,
              norm: tuple | None = None) -> jax.Array:
    """rms_norm(x) [T, K] (x itself without `norm` = (weight [K], eps)) @ a packed weight-only
    quantized weight -> [T, N] float32, plus `residual` [T, N] if given (both in the kernel)."""
    if cpu_kernels.library() is None:  # (also registers the target in this process)
        raise ValueError("a packed quantized weight needs the C++ CPU kernels, which are not available here")
    n = w["qp"].shape[-3] * F32_STRIP
    empty = jnp.zeros((0,), jnp.float32)
    r = empty if residual is None else residual.astype(jnp.float32)
    nw, eps = (empty, 0.0) if norm is None else (norm[0].astype(jnp.float32), float(norm[1]))
    call = jax.ffi.ffi_call(WQ_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), w["qp"], w["qps"], r, nw, num_threads=np.int64(cpu_kernels.num_threads()),
                eps=np.float32(eps))


def layer_tail_wq(a: jax.Array, h: jax.Array, wo: dict[str, jax.Array], norm: tuple,
                  gate_up: dict[str, jax.Array], w_down: dict[str, jax.Array],
                  next_qkv: dict[str, jax.Array] | None = None,
                  next_norm: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """`layer_tail_f32` for weight-only quantized layers ({"qp", "qps"} each; gate|up the gate's
    columns then the up's): h1 = h + a @ wo, out = h1 + swiglu(rms_norm(h1, *norm) @ gate|up)
    @ w_down, and given the next layer's, its qkv = rms_norm(out) @ wq|wk|wv, in one call
    (cpu_linear_wq.cc WqLayerTail says why). Returns (out, qkv or None)."""
    if cpu_kernels.library() is None:
        raise ValueError("a packed quantized weight needs the C++ CPU kernels, which are not available here")
    empty_f, empty_u = jnp.zeros((0,), jnp.float32), jnp.zeros((0, 0, 0), jnp.uint8)
    n = 0 if next_qkv is None else next_qkv["qp"].shape[-3] * F32_STRIP
    call = jax.ffi.ffi_call(WQ_TAIL_TARGET, (jax.ShapeDtypeStruct(h.shape, jnp.float32),
                                             jax.ShapeDtypeStruct((h.shape[0], n), jnp.float32)),
                            vmap_method="sequential")
    nxt = (empty_f, empty_u, jnp.zeros((0, 0, 0, 0), jnp.float32)) if next_qkv is None else (
        next_norm.astype(jnp.float32), next_qkv["qp"], next_qkv["qps"])
    out, qkv = call(a.astype(jnp.float32), h.astype(jnp.float32), wo["qp"], wo["qps"], norm[0].astype(jnp.float32),
                    gate_up["qp"], gate_up["qps"], w_down["qp"], w_down["qps"], *nxt,
                    num_threads=np.int64(cpu_kernels.num_threads()), eps=np.float32(norm[1]))
    return out, (None if next_qkv is None else qkv)


def pack_float(w: np.ndarray) -> dict[str, np.ndarray]:
    """float32 [..., K, N] (N divisible by 16) -> {"f": [..., N/16, K, 16]}: strip s holds
    columns 16s..16s+15, each k's 16 values contiguous (the kernel's operand order)."""
    w = np.asarray(w, np.float32)
    *lead, K, N = w.shape
    if N % F32_STRIP:
        raise ValueError(f"the float32 kernel packs {F32_STRIP}-column strips: {N} columns do not divide")
    nd = len(lead)
    g = w.reshape(*lead, K, N // F32_STRIP, F32_STRIP)
    return {"f": np.ascontiguousarray(g.transpose(*range(nd), nd + 1, nd, nd + 2))}


def pack_float_params(params: dict[str, Any], tied: bool) -> dict[str, Any]:
    """A float32 tree -> the same model with its projections packed (and fused) for the float
    kernel, gate|up as SwiGLU pairs (`pack_swiglu`), plus the packed head (`with_float_head`);
    unchanged when some projection's width does not divide by 16."""
    layers = dict(params["layers"])
    if any(np.shape(layers[n])[-1] % F32_STRIP for names in PACKED.values() for n in names):
        return params
    for name, names in PACKED.items():
        if name == "gate_up":
            layers[name] = pack_swiglu(np.asarray(layers.pop("w_gate")), np.asarray(layers.pop("w_up")))
            continue
        w = np.concatenate([np.asarray(layers.pop(n), np.float32) for n in names], axis=-1)
        layers[name] = pack_float(w)
    return with_float_head({**params, "layers": layers}, tied)


def pack_swiglu(gate: np.ndarray, up: np.ndarray) -> dict[str, np.ndarray]:
    """float32 gate and up [..., K, I] -> {"fg": [..., 2 I/16, K, 16]}: the strips of gate
    and up columns 16j..16j+15 side by side, so one kernel item holds both and its epilogue
    writes silu(gate) * up [.., I] (no [T, 2I] product in memory, no separate op)."""
    gate, up = np.asarray(gate, np.float32), np.asarray(up, np.float32)
    *lead, K, inter = gate.shape
    if up.shape != gate.shape or inter % F32_STRIP:
        raise ValueError(f"SwiGLU packing: gate {gate.shape} and up {up.shape} must match, width divisible by 16")
    pairs = np.stack([gate.reshape(*lead, K, -1, F32_STRIP), up.reshape(*lead, K, -1, F32_STRIP)], axis=-2)
    return {"fg": pack_float(pairs.reshape(*lead, K, 2 * inter))["f"]}


def with_float_head(params: dict[str, Any], tied: bool) -> dict[str, Any]:
    """params plus a packed float32 copy of the LM head ("head_f32": the embedding transposed
    when `tied`) where the vocabulary divides by 16; models/llama.py lm_head says when it
    serves. Float32 trees get it from pack_float_params, w8a8 ones whose head stays float
    from the runner."""
    head = np.asarray(params["embed"]).T if tied else np.asarray(params["lm_head"])
    if head.shape[-1] % F32_STRIP:
        return params
    return {**params, "head_f32": pack_float(np.asarray(head, np.float32))}


def linear_f32(x: jax.Array, w: dict[str, jax.Array], residual: jax.Array | None = None,
               norm: tuple | None = None) -> jax.Array:
    """rms_norm(x) [T, K] (x itself without `norm` = (weight [K], eps)) @ a packed float32
    weight -> [T, N] float32, plus `residual` [T, N] if given; the norm and the residual run in
    the kernel. A SwiGLU pair weight ({"fg"}) gives silu(gate) * up [T, N/2]."""
    if cpu_kernels.library() is None:  # (also registers the target in this process)
        raise ValueError("a packed float32 weight needs the C++ CPU kernels, which are not available here")
    swiglu = "fg" in w
    packed = w["fg"] if swiglu else w["f"]
    n = packed.shape[-3] * F32_STRIP // (2 if swiglu else 1)
    if swiglu and residual is not None:
        raise ValueError("the SwiGLU product takes no residual")
    empty = jnp.zeros((0,), jnp.float32)
    r = empty if residual is None else residual.astype(jnp.float32)
    nw, eps = (empty, 0.0) if norm is None else (norm[0].astype(jnp.float32), float(norm[1]))
    call = jax.ffi.ffi_call(F32_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), packed, r, nw, num_threads=np.int64(cpu_kernels.num_threads()),
                swiglu=np.int64(swiglu), eps=np.float32(eps))


def layer_tail_f32(a: jax.Array, h: jax.Array, wo: dict[str, jax.Array], norm: tuple,
                   gate_up: dict[str, jax.Array], w_down: dict[str, jax.Array],
                   next_qkv: dict[str, jax.Array] | None = None,
                   next_norm: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """A decoder layer after attention in one kernel call: h1 = h + a @ wo, then out = h1 +
    swiglu(rms_norm(h1, *norm) @ gate|up) @ w_down [T, d] float32; given the next layer's
    packed qkv and its norm weight (eps is `norm`'s), also that layer's qkv = rms_norm(out) @
    wq|wk|wv [T, N]. Returns (out, qkv or None): the numbers of the same `linear_f32` calls
    (cpu_linear_f32.cc F32LayerTail says why one call)."""
    if cpu_kernels.library() is None:
        raise ValueError("a packed float32 weight needs the C++ CPU kernels, which are not available here")
    empty = jnp.zeros((0,), jnp.float32)
    n = 0 if next_qkv is None else next_qkv["f"].shape[-3] * F32_STRIP
    call = jax.ffi.ffi_call(TAIL_TARGET, (jax.ShapeDtypeStruct(h.shape, jnp.float32),
                                          jax.ShapeDtypeStruct((h.shape[0], n), jnp.float32)), vmap_method="sequential")
    out, qkv = call(a.astype(jnp.float32), h.astype(jnp.float32), wo["f"], norm[0].astype(jnp.float32), gate_up["fg"],
                    w_down["f"], empty if next_qkv is None else next_norm.astype(jnp.float32),
                    empty if next_qkv is None else next_qkv["f"], num_threads=np.int64(cpu_kernels.num_threads()),
                    eps=np.float32(norm[1]))
    return out, (None if next_qkv is None else qkv)


def linear(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """x [T, K] @ a packed w8a8 weight -> [T, N] float32."""
    if cpu_kernels.library() is None:  # (also registers the target in this process)
        raise ValueError("a packed int8 weight needs the C++ CPU kernels, which are not available here")
    if "gs" in w:
        n = w["gs"].shape[-1]
        call = jax.ffi.ffi_call(GROUPED_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                                vmap_method="sequential")
        return call(x.astype(jnp.float32), w["p"], w["gs"].astype(jnp.float32), w["gc"],
                    num_threads=np.int64(cpu_kernels.num_threads()))
    n = w["s"].shape[-1]
    empty = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), w["in"].astype(jnp.float32) if "in" in w else empty, w["p"],
                w["s"].astype(jnp.float32), w["c"], num_threads=np.int64(cpu_kernels.num_threads()))


# --- the packed weights as Linear objects (runtime/model/linear.py) ---------------------------

import runtime.model.linear as _linear  # noqa: E402  (after the kernel calls they wrap)
from runtime.model.linear import HeldPerLayer, Linear, Norm, PerLayer, pytree  # noqa: E402


@_linear.register_reader
def from_packed(w: dict) -> Linear | None:
    """A stored dict packed here ("f", "fg": float kernel; "p": int8 kernel; "qp": weight-only
    quantized kernel) as its Linear."""
    if "f" in w:
        return PackedF32(w["f"])
    if "fg" in w:
        return PackedSwiGLU(w["fg"])
    if "qp" in w:
        return PackedWq(w["qp"], w["qps"])
    if "qpg" in w:
        return PackedWqSwiGLU(w["qpg"], w["qps"])
    if "p" not in w:
        return None
    if "gs" in w:
        return PackedInt8Grouped(w["p"], w["gs"], w["gc"])
    return PackedInt8(w["p"], w["s"], w["c"], w.get("in"))


@pytree
class PackedInt8(Linear):
    """w8a8 in the int8 kernel's layout (AVX512-VNNI, AMX tiles from 16 rows)."""
    fast_at_one_row = True
    p: jax.Array   # [N/64, K/4, 256] int8
    s: jax.Array   # [N] float32
    c: jax.Array   # [N] int32: 128 * column sums
    in_scale: jax.Array | None = None  # [K] float32

    def product(self, x):
        d = {"p": self.p, "s": self.s, "c": self.c}
        if self.in_scale is not None:
            d["in"] = self.in_scale
        return linear(x, d).astype(x.dtype)

    @property
    def out_features(self):
        return self.s.shape[-1]


@pytree
class PackedInt8Grouped(Linear):
    """GGUF Q8_0 values in the int8 kernel's layout, activations quantized per group of 32."""
    fast_at_one_row = True
    p: jax.Array   # [N/64, K/4, 256] int8
    gs: jax.Array  # [K/32, N] float32
    gc: jax.Array  # [K/32, N] int32

    def product(self, x):
        return linear(x, {"p": self.p, "gs": self.gs, "gc": self.gc}).astype(x.dtype)

    @property
    def out_features(self):
        return self.gs.shape[-1]


@pytree
class PackedWq(Linear):
    """4-bit (or the head's 8-bit) weight-only values in the quantized kernel's strips: the norm
    and the residual run inside its call."""
    fast_at_one_row = True
    qp: jax.Array   # [N/16, K/32, 256 | 512] uint8
    qps: jax.Array  # [N/16, K/32, 2 | 1, 16] float32

    def apply(self, x, residual=None, norm=None):
        return linear_wq(x, {"qp": self.qp, "qps": self.qps}, residual, norm).astype(x.dtype)

    @property
    def out_features(self):
        return self.qp.shape[-3] * F32_STRIP


@pytree
class PackedWqSwiGLU(PackedWq):
    """A Llama-style layer's gate|up in PackedWq's layout (the gate's columns, then the up's):
    its own type so the layer's products fuse into one WqTail call (pack_wq_params)."""


@pytree
class PackedF32(Linear):
    """float32 in the float kernel's strips: the norm and the residual run inside its call."""
    f: jax.Array  # [N/16, K, 16]

    def apply(self, x, residual=None, norm=None):
        return linear_f32(x, {"f": self.f}, residual, norm).astype(x.dtype)

    @property
    def out_features(self):
        return self.f.shape[-3] * F32_STRIP


@pytree
class PackedSwiGLU(Linear):
    """gate|up packed as strip pairs: the kernel returns silu(gate) * up itself."""
    fg: jax.Array  # [2I/16, K, 16]

    def apply(self, x, residual=None, norm=None):
        raise ValueError("a SwiGLU pair weight is applied with glu()")

    def glu(self, x, norm=None, act=jax.nn.silu):
        if act is not jax.nn.silu:
            raise ValueError("the SwiGLU pair kernel computes silu(gate) * up only")
        return linear_f32(x, {"fg": self.fg}, norm=norm).astype(x.dtype)

    @property
    def out_features(self):
        return self.fg.shape[-3] * F32_STRIP // 2


def _at(w: Linear, index: jax.Array) -> Linear:
    """Layer `index`'s weight of a per-layer or a stacked packed weight."""
    if isinstance(w, PerLayer):
        return w.at(index)
    return jax.tree.map(lambda a: a[index], w)


@pytree
class F32Tail(HeldPerLayer):
    """A Llama-style decoder layer after attention as ONE float-kernel call: h1 = h + a @ wo,
    out = h1 + swiglu(rms_norm(h1) @ gate|up) @ w_down; with `qkv` (the layers' q|k|v held
    per layer) the same call also makes the next layer's q|k|v of rms_norm(out), so a 1-row
    step makes one product call per layer instead of four (cpu_linear_f32.cc F32LayerTail).
    The numbers are those of the separate PackedF32 / PackedSwiGLU calls. Not scanned: the
    runner's layer scan hands it the layer index (`at`)."""
    wo: Linear
    gate_up: Linear
    w_down: Linear
    attn_norms: jax.Array | None = None  # [L, d]: the chained next layer's norm weights
    qkv: PerLayer | None = None
    index: jax.Array | None = None

    def at(self, index: jax.Array) -> "F32Tail":
        return dataclasses.replace(self, index=index)

    @property
    def chains(self) -> bool:
        return self.qkv is not None

    def first_qkv(self, x: jax.Array, eps: float) -> jax.Array:
        """Layer 0's q|k|v of rms_norm(x): the product the chain carries into layer 0."""
        return self.qkv.layers[0].apply(x, norm=(self.attn_norms[0], eps))

    def apply(self, a: jax.Array, h: jax.Array, norm: Norm) -> tuple[jax.Array, jax.Array | None]:
        """(the layer's output, the next layer's q|k|v or None when not chained)."""
        if not isinstance(self.wo, PerLayer):
            wo, gu, down = (_at(w, self.index) for w in (self.wo, self.gate_up, self.w_down))
            return self.call(a, h, wo, norm, gu, down)[0].astype(h.dtype), None
        n = len(self.wo.layers)
        next_norm = None
        if self.chains:
            next_norm = self.attn_norms[jnp.minimum(self.index + 1, n - 1)]

        def branch(i):
            def run(a, h, nw, nn):
                nxt = self.qkv.layers[i + 1] if self.chains and i + 1 < n else None
                out, q = self.call(a, h, self.wo.layers[i], (nw, norm[1]), self.gate_up.layers[i],
                                   self.w_down.layers[i], nxt, nn)
                if self.chains and q is None:  # the last layer: no next qkv
                    q = jnp.zeros((a.shape[0], self.qkv.layers[0].out_features), jnp.float32)
                return out.astype(h.dtype), (None if q is None else q.astype(h.dtype))
            return run
        return jax.lax.switch(self.index, [branch(i) for i in range(n)], a, h, norm[0], next_norm)

    @staticmethod
    def call(a, h, wo, norm, gu, down, nxt=None, nn=None):
        """One layer's kernel call on its typed weights (the next layer's q|k|v too, given)."""
        return layer_tail_f32(a, h, {"f": wo.f}, norm, {"fg": gu.fg}, {"f": down.f},
                              None if nxt is None else {"f": nxt.f}, nn)


@pytree
class WqTail(F32Tail):
    """F32Tail for weight-only quantized layers (PackedWq, gate|up a PackedWqSwiGLU): the
    same one call per layer, in the quantized kernel (cpu_linear_wq.cc WqLayerTail)."""

    @staticmethod
    def call(a, h, wo, norm, gu, down, nxt=None, nn=None):
        w = lambda lin: {"qp": lin.qp, "qps": lin.qps}  # noqa: E731
        return layer_tail_wq(a, h, w(wo), norm, w(gu), w(down), None if nxt is None else w(nxt), nn)


def _is(w: Any, cls: type) -> bool:
    return isinstance(w.layers[0] if isinstance(w, PerLayer) else w, cls)


@_linear.register_fuser
def fuse_layer_tails(params: dict[str, Any]) -> dict[str, Any]:
    """A typed tree whose wo, gate|up and w_down are all packed for the float kernel (or all
    for the weight-only quantized one, gate|up as a SwiGLU) -> the same tree with them as one
    F32Tail (WqTail), chained to the next layer's q|k|v where the layers' qkv is held per
    layer; any other tree unchanged."""
    layers = params["layers"]
    kinds = [(F32Tail, PackedF32, PackedSwiGLU), (WqTail, PackedWq, PackedWqSwiGLU)]
    kind = next(((tail, plain) for tail, plain, glu in kinds if _is(layers.get("wo"), plain)
                 and _is(layers.get("gate_up"), glu) and _is(layers.get("w_down"), plain)), None)
    if kind is None:
        return params
    cls, plain = kind
    qkv = layers.get("qkv")
    chained = isinstance(qkv, PerLayer) and isinstance(layers["wo"], PerLayer) and _is(qkv, plain)
    rest = {k: v for k, v in layers.items() if k not in ("wo", "gate_up", "w_down")}
    tail = cls(layers["wo"], layers["gate_up"], layers["w_down"],
               attn_norms=layers["attn_norm"] if chained else None, qkv=qkv if chained else None)
    return {**params, "layers": {**rest, "tail": tail}}
