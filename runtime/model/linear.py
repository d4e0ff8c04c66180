"""The `Linear` seam: every projection of a model family is an object that knows its own
product. A family multiplies by `w.apply(x)` and never asks how `w` is stored.

    Dense          float [in, out]                                   x @ w
    Int8           w8a8: int8 [in, out], scale per output (+ SmoothQuant input scale)
    Int8Grouped    GGUF Q8_0: int8 [in, out], one scale per 32 inputs of each output
    Int8WeightOnly w8a16: int8 dequantized in the graph, float activations
    Int4Grouped    w4a16: 4-bit values, a scale and an offset per 32 inputs, float activations
    Int8GroupedWeightOnly  w4a16's LM head: int8, a scale per 32 inputs, float activations
    PerLayer       a weight held as separate per-layer arrays inside the layer scan
    LmHead         the vocabulary projection with its optional faster copies

The C++ CPU kernels add their packed forms beside these (runtime/kernels/cpu/matmul.py: PackedInt8,
PackedInt8Grouped, PackedF32, PackedSwiGLU, F32Tail, PackedWq, PackedWqSwiGLU, WqTail), built once by the
runner; runtime/model/mosaic_linear.py adds Int4Mosaic, the Hopper GPU's w4a16.

`apply(x, residual, norm)` computes rms_norm(x) @ w + residual; a kernel that folds the
norm (prologue) and the residual (epilogue) into its call overrides `apply`, the others
inherit the plain ops below, so every path gives the numbers it gave as separate ops.

Checkpoints and the runner hold the stored form (plain arrays and dicts: {"q", "s", "in"},
the kernels' packed {"f"}, ...), which sharding rules, huge-page placement and inspection
read. `typed()` reads it into these objects; the family calls it at trace time (no cost
per step), so any caller passes the stored tree as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

Norm = tuple  # (weight [in], eps): an RMS norm a product applies to its input first

# A 1-row step (one stream decoding) is a matrix-vector product, bound by the weight read:
# there the int8 weights dequantized into a float product beat the int8 dot (SmolLM2 batch-1
# step on a 2-core EPYC: 20.8 ms against 23.2 ms); from 2 rows on the int8 dot wins (2: 29
# vs 33 ms, 8: 37 vs 43, 64: 172 vs 199). Rows are a compiled bucket size, so each bucket
# compiles one path and the switch costs nothing per step.
WEIGHT_ONLY_MAX_ROWS = 1


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def pytree(cls):
    """A frozen dataclass registered as a pytree: array fields are leaves, fields marked
    `static` (metadata) are part of the tree's structure."""
    cls = dataclass(frozen=True)(cls)
    meta = [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]
    data = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static(default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"static": True})


class Linear:
    """rms_norm(x) @ W (+ residual). Subclasses give `product`; kernels that fuse the norm and
    the residual into their call override `apply`."""

    fast_at_one_row: ClassVar[bool] = False  # an int8 product that also beats the float head at 1 row

    def product(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def apply(self, x: jax.Array, residual: jax.Array | None = None, norm: Norm | None = None) -> jax.Array:
        if norm is not None:
            x = rms_norm(x, *norm)
        y = self.product(x)
        return y if residual is None else residual + y

    def glu(self, x: jax.Array, norm: Norm | None = None, act: Any = jax.nn.silu) -> jax.Array:
        """act(gate) * up for a weight holding gate|up side by side [in, 2I] -> [T, I]."""
        gate, up = jnp.split(self.apply(x, norm=norm), 2, axis=-1)
        return act(gate) * up

    @property
    def out_features(self) -> int:
        raise NotImplementedError


@pytree
class Dense(Linear):
    w: jax.Array  # [in, out] in the compute dtype

    def product(self, x):
        return x @ self.w

    @property
    def out_features(self):
        return self.w.shape[-1]


@pytree
class Int8(Linear):
    """w8a8: each row of x gets its own scale (absmax/127), so one outlier token never costs
    the others their precision."""
    q: jax.Array                      # [in, out] int8
    s: jax.Array                      # [out] float32
    in_scale: jax.Array | None = None  # [in] float32: SmoothQuant's 1/s, before quantizing x

    def product(self, x):
        x32 = x.astype(jnp.float32)
        if self.in_scale is not None:
            x32 = x32 * self.in_scale
        if x.shape[0] <= WEIGHT_ONLY_MAX_ROWS:  # same int8 weights, float activations
            return (x32 @ (self.q.astype(jnp.float32) * self.s[..., None, :])).astype(x.dtype)
        sx = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
        sx = jnp.where(sx > 0, sx, 1.0)
        xq = jnp.clip(jnp.round(x32 / sx), -127, 127).astype(jnp.int8)
        acc = jax.lax.dot(xq, self.q, preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * sx * self.s).astype(x.dtype)

    @property
    def out_features(self):
        return self.q.shape[-1]


@pytree
class Int8Grouped(Linear):
    """GGUF Q8_0's own values and block scales, never requantized: activations get a scale
    per token and group of 32 (llama.cpp's Q8_0 dot)."""
    q: jax.Array  # [in, out] int8
    g: jax.Array  # [in/32, out] float32

    def product(self, x):
        return grouped_product(x, self.q, self.g).astype(x.dtype)

    @property
    def out_features(self):
        return self.q.shape[-1]


def grouped_product(x: jax.Array, q: jax.Array, g: jax.Array) -> jax.Array:
    """x [T, K] @ a grouped weight -> float32 [T, N]: each row's groups of 32 inputs quantized
    with their own scale, one int8 dot per group, summed with both scales."""
    g = g.astype(jnp.float32)
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


@pytree
class Int8WeightOnly(Linear):
    """w8a16: dequantized in the graph and multiplied in the compute dtype (halves the weight
    bytes a bandwidth-bound decode reads)."""
    w8: jax.Array  # [in, out] int8
    s: jax.Array   # [out] float32

    def product(self, x):
        return x @ (self.w8.astype(x.dtype) * self.s.astype(x.dtype)[..., None, :])

    @property
    def out_features(self):
        return self.w8.shape[-1]


@pytree
class Int4Grouped(Linear):
    """w4a16 (runtime/model/quant.py's layout): the weight dequantized in the graph, w = q * s4 +
    m4 per group of 32 inputs, times float activations. The C++ kernel's PackedWq reads the
    nibbles themselves; this is the path without it (and the reference it is tested against)."""
    q4: jax.Array  # [in/2, out] uint8
    s4: jax.Array  # [in/32, out] float32
    m4: jax.Array  # [in/32, out] float32

    def product(self, x):
        return x @ dequantize_int4(self.q4, self.s4, self.m4).astype(x.dtype)

    @property
    def out_features(self):
        return self.q4.shape[-1]


def expert_products(x: jax.Array, w: jax.Array, sizes: jax.Array, layer: jax.Array | None = None,
                    scale: jax.Array | None = None, int8_acts: bool = False) -> jax.Array:
    """x [M, K] with its rows sorted by expert (sizes [E] rows each, summing to M) times each
    row's expert's matrix -> [M, N]: w [E, K, N], or every layer's [L, E, K, N] with `layer`
    (StackedExperts: only the used experts' matrices are read). Only the experts' own rows, as
    a mixture of experts needs (runtime/model/families/moe.py).

    jax.lax.ragged_dot says exactly this, and is what runs off CPU. XLA:CPU lowers it to one
    masked product per expert over every row (E x the FLOPs, and all E matrices read at one
    token): a 2-row product over 8 experts of 1024x3584 took 40 ms against 1.9 ms here. So on
    CPU a loop over the experts that have rows, each multiplying its rows in tiles of R: the
    matrices read are the active experts', the rows multiplied at most R - 1 past each
    expert's own per expert. A tile's rows past its expert's end belong to the next experts,
    which are written after it, so nothing is masked. R follows the step's row count, so this
    loop's sums may differ in the last bits between batch sizes; the C++ kernel
    (runtime/kernels/cpu/experts.py PackedExperts, the float32 engine's path) sums every row
    the same way and copies no matrix out of the stack.

    Quantized experts (runtime/model/quant.py quantize_experts): w int8 with `scale` [(L,) E, N]
    per expert and output channel; `int8_acts` (w8a8) quantizes each row by its absmax / 127 and
    multiplies int8 by int8 (int32 sums), else (w8a16) the expert's matrix is dequantized and
    multiplied in the rows' dtype."""
    if jax.default_backend() != "cpu":
        return _ragged_products(x, w if layer is None else w[layer], sizes,
                                None if scale is None else scale if layer is None else scale[layer], int8_acts)
    M, K = x.shape
    E, N = w.shape[-3], w.shape[-1]
    R = min(64, 1 << max(0, (-(-M // E) - 1).bit_length()))  # an expert's even share of the rows, to 64
    starts = jnp.cumsum(sizes) - sizes
    xpad = jnp.concatenate([x, jnp.zeros((R, K), x.dtype)])

    def expert(e, out):
        def run(out):
            if layer is None:
                we = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
            else:
                we = jax.lax.dynamic_slice(w, (layer, e, 0, 0), (1, 1, K, N))[0, 0]
            se = None if scale is None else (scale[e] if layer is None else scale[layer, e])

            def tile(j, out):
                r0 = starts[e] + j * R
                rows = jax.lax.dynamic_slice_in_dim(xpad, r0, R)
                y = _expert_tile(rows, we, se, int8_acts)
                return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), r0, 0)

            return jax.lax.fori_loop(0, (sizes[e] + R - 1) // R, tile, out)

        return jax.lax.cond(sizes[e] > 0, run, lambda o: o, out)

    return jax.lax.fori_loop(0, E, expert, jnp.zeros((M + R, N), x.dtype))[:M]


def _quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w8a8's activations: each row as int8 with its own absmax / 127 scale [M, 1]."""
    x32 = x.astype(jnp.float32)
    sx = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
    sx = jnp.where(sx > 0, sx, 1.0)
    return jnp.clip(jnp.round(x32 / sx), -127, 127).astype(jnp.int8), sx


def _expert_tile(rows: jax.Array, we: jax.Array, se: jax.Array | None, int8_acts: bool) -> jax.Array:
    """rows [R, K] times one expert's matrix [K, N] (float, or int8 with scales se [N])."""
    if se is None:
        return rows @ we.astype(rows.dtype)
    if int8_acts:
        xq, sx = _quantize_rows(rows)
        return jax.lax.dot(xq, we, preferred_element_type=jnp.int32).astype(jnp.float32) * sx * se
    return ((rows @ we.astype(rows.dtype)).astype(jnp.float32) * se).astype(rows.dtype)


def _ragged_products(x: jax.Array, w: jax.Array, sizes: jax.Array, scale: jax.Array | None,
                     int8_acts: bool) -> jax.Array:
    """expert_products off CPU: jax.lax.ragged_dot over one layer's [E, K, N], int8 x int8 into
    int32 for w8a8, the int8 matrices dequantized for w8a16; each row then takes its expert's
    output scales."""
    if scale is None:
        return jax.lax.ragged_dot(x, w, sizes)
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right")  # each row's expert
    se = scale[jnp.minimum(group, scale.shape[0] - 1)]                                # [M, N]
    if int8_acts:
        xq, sx = _quantize_rows(x)
        acc = jax.lax.ragged_dot(xq, w, sizes, preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * sx * se).astype(x.dtype)
    return (jax.lax.ragged_dot(x, w.astype(x.dtype), sizes).astype(jnp.float32) * se).astype(x.dtype)


def dequantize_int4(q4: jax.Array, s4: jax.Array, m4: jax.Array) -> jax.Array:
    """[..., K/2, N] nibbles + [..., K/32, N] scales and offsets -> float32 [..., K, N]."""
    *lead, H, N = q4.shape
    g = q4.reshape(*lead, H // 16, 1, 16, N)
    q = jnp.concatenate([g & 15, g >> 4], axis=-3).astype(jnp.float32)  # [..., G, 2, 16, N]
    w = q.reshape(*lead, H // 16, 32, N) * s4[..., None, :] + m4[..., None, :]
    return w.reshape(*lead, 2 * H, N)


@pytree
class Int8GroupedWeightOnly(Linear):
    """w4a16's LM head: int8 values with one scale per 32 inputs (GGUF Q8_0's), dequantized in
    the graph, float activations."""
    fast_at_one_row = True
    q8: jax.Array  # [in, out] int8
    s8: jax.Array  # [in/32, out] float32

    def product(self, x):
        K, N = self.q8.shape
        w = (self.q8.reshape(K // 32, 32, N).astype(jnp.float32) * self.s8[:, None, :]).reshape(K, N)
        return (x.astype(jnp.float32) @ w).astype(x.dtype)

    @property
    def out_features(self):
        return self.q8.shape[-1]


class HeldPerLayer:
    """A weight the layer scan does not slice: it reaches the layer's body as `at(layer)`."""

    def at(self, index: jax.Array) -> Any:
        raise NotImplementedError


@pytree
class StackedExperts(HeldPerLayer):
    """One expert weight of a mixture of experts, every layer's [L, E, K, N], held whole: the
    layer scan does not slice it (a slice copies every expert's matrix, used or not); `at`
    names the scan's layer and `product` multiplies the rows routed to each expert (the C++
    CPU kernel's form, runtime/kernels/cpu/experts.py PackedExperts, the runner makes)."""
    w: jax.Array
    index: jax.Array | None = None
    rows: tuple[int, ...] = static(())  # per layer its row of w (-1: none) where only some layers have experts
    mesh: Any = static(None)  # expert parallelism: w split by expert over this mesh (runtime/model/tp.py)
    s: jax.Array | None = None  # quantized experts: w int8, s [L, E, N] per expert and output channel
    int8_acts: bool = static(False)  # w8a8 (else w8a16: the matrices dequantized)

    def at(self, index: jax.Array) -> "StackedExperts":
        return dataclasses.replace(self, index=layer_row(self.rows, index))

    def product(self, x: jax.Array, sizes: jax.Array) -> jax.Array:
        return expert_products(x, self.w, sizes, self.index, self.s, self.int8_acts)


def layer_row(rows: tuple[int, ...], layer: jax.Array) -> jax.Array:
    """The row of a weight stacked over some layers only (`rows`: per layer its row, -1 for
    none; () = every layer, in order) that `layer` reads; a layer without one reads row 0
    (its family never runs that branch: LayerSubset)."""
    if not rows:
        return layer
    return jnp.maximum(jnp.asarray(rows, jnp.int32)[layer], 0)


def subset_rows(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """`rows` for a weight stacked over `layers` (in order) of num_layers; () when all are."""
    if tuple(layers) == tuple(range(num_layers)):
        return ()
    where = {layer: i for i, layer in enumerate(layers)}
    return tuple(where.get(i, -1) for i in range(num_layers))


@pytree
class LayerSubset(HeldPerLayer):
    """A weight only some layers have, stacked over them [n, ...] (a mixture of experts' dense
    MLP layers, or its routers and shared experts beside those): the layer scan does not slice
    it; `at(layer)` is that layer's array (row 0 for a layer without one: the family runs the
    other branch there)."""
    w: jax.Array
    rows: tuple[int, ...] = static(())

    def at(self, index: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.w, layer_row(self.rows, index), keepdims=False)


@pytree
class PerLayer(Linear, HeldPerLayer):
    """Inside the layer scan: a weight held as separate per-layer arrays (`unstack_weights`
    says why) and the layer the scan is at; each product is a lax.switch over the layers'
    own weights (a custom call's operand is a whole buffer, a scanned slice a copy)."""
    layers: tuple           # per-layer Linear objects
    index: jax.Array | None = None  # the scan's layer (set by `at`)

    def at(self, index: jax.Array) -> "PerLayer":
        return PerLayer(self.layers, index)

    def apply(self, x, residual=None, norm=None):
        nw = None if norm is None else norm[0]

        def branch(w):
            return lambda x, r, nw: w.apply(x, r, None if nw is None else (nw, norm[1]))
        return jax.lax.switch(self.index, [branch(w) for w in self.layers], x, residual, nw)

    def glu(self, x, norm=None, act=jax.nn.silu):
        nw = None if norm is None else norm[0]

        def branch(w):
            return lambda x, nw: w.glu(x, None if nw is None else (nw, norm[1]), act)
        return jax.lax.switch(self.index, [branch(w) for w in self.layers], x, nw)

    @property
    def out_features(self):
        return self.layers[0].out_features


@pytree
class LmHead:
    """hidden [N, d] -> float32 logits [N, V]. `weight` is the stored head ([d, V], or the
    tied embedding [V, d] contracted on its model axis in place: no transposed copy). Faster
    copies the runner may add, each where it was measured to win:
    `int8` (the w8a8 head, opt-in --quantize-lm-head) for 2+ rows, or any rows when its
    kernel serves 1 row well (XLA's int8 dot is slow for one row: 40 ms against 4 ms);
    `f32` (the float kernel's packed copy) up to F32_MAX_ROWS rows (1.1-2x XLA's product at
    2-64 rows on a 2-core Zen 3 EPYC, 2.2 ms against 3.0 at 1 row on an AMX Xeon; above 64
    XLA's is as fast or faster)."""
    weight: jax.Array
    int8: Linear | None = None
    f32: Linear | None = None
    tied: bool = static(True)
    int8_any_rows: bool = static(False)
    F32_MAX_ROWS: ClassVar[int] = 64

    def apply(self, hidden: jax.Array) -> jax.Array:
        rows = hidden.shape[0]
        if self.int8 is not None and (rows > 1 or self.int8_any_rows):
            return self.int8.apply(hidden.astype(jnp.float32))
        if self.f32 is not None and rows <= self.F32_MAX_ROWS:
            return self.f32.apply(hidden.astype(jnp.float32))
        axis = 1 if self.tied else 0
        return jax.lax.dot_general(hidden, self.weight, (((1,), (axis,)), ((), ())),
                                   preferred_element_type=jnp.float32)


# --- stored trees -> typed ------------------------------------------------------------------

# Readers of stored forms defined elsewhere: runtime/kernels/cpu/matmul.py registers its packed dicts.
# A packed dict only exists after that module made it, so its reader is registered by then
# (and this module needs no import of the kernels).
_READERS: list[Callable[[dict], "Linear | None"]] = []


def register_reader(fn: Callable[[dict], "Linear | None"]) -> Callable[[dict], "Linear | None"]:
    _READERS.append(fn)
    return fn


# Fusions of several typed weights into one object a backend runs as one call (runtime/
# cpu_matmul.py registers its fused layer tail), applied by `typed` in order.
_FUSERS: list[Callable[[dict], dict]] = []


def register_fuser(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
    _FUSERS.append(fn)
    return fn


def from_stored(w: Any) -> Any:
    """One stored weight (float array, or a quantized dict as runtime/model/quant.py writes it) as
    its Linear; a tuple of per-layer weights as PerLayer; a typed weight unchanged."""
    if isinstance(w, Linear):
        return w
    if isinstance(w, tuple):
        return PerLayer(tuple(from_stored(a) for a in w))
    if isinstance(w, dict):
        for read in _READERS:
            lin = read(w)
            if lin is not None:
                return lin
        if "q4" in w:
            return Int4Grouped(w["q4"], w["s4"], w["m4"])
        if "q8" in w:
            return Int8GroupedWeightOnly(w["q8"], w["s8"])
        if "w8" in w:
            return Int8WeightOnly(w["w8"], w["s"])
        if "g" in w:
            return Int8Grouped(w["q"], w["g"])
        return Int8(w["q"], w["s"], w.get("in"))
    return Dense(w)


PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "qkv", "gate_up",
               "wq_a", "wq_b", "wkv_a")  # (the last three: latent attention's)


def typed(params: dict[str, Any]) -> dict[str, Any]:
    """A parameter tree with every projection as its Linear and the head as an LmHead; a
    typed tree is returned as it is."""
    leaf = from_stored
    if isinstance(params.get("head"), LmHead):
        return params
    layers = {k: leaf(v) if k in PROJECTIONS else v for k, v in params["layers"].items()}
    tied = "lm_head" not in params
    int8 = leaf(params["head"]) if "head" in params else None
    head = LmHead(params["embed"] if tied else params["lm_head"], int8=int8,
                  f32=leaf(params["head_f32"]) if "head_f32" in params else None,
                  tied=tied, int8_any_rows=bool(int8 is not None and int8.fast_at_one_row))
    if "lora" in params:  # the step's adapters (runtime/model/lora.py LoraTable), before any fusion sees them
        layers = params["lora"].wrap(layers, params["lora_batch"])
    rest = {k: v for k, v in params.items() if k not in ("layers", "lm_head", "head", "head_f32", "lora", "lora_batch")}
    out = {**rest, "layers": layers, "head": head}
    for fuse in _FUSERS:
        out = fuse(out)
    return out
