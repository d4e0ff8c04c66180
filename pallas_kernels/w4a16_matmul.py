"""w4a16 matmul for Hopper (Pallas, Mosaic GPU backend) + its reference.

y [M, N] = x [M, K] (bfloat16/float16) @ W [K, N], W stored as 4-bit values with a
float32 scale and offset per 32 inputs (w = q * s + m: GGUF Q4_0/Q4_1/Q4_K's form and
``--quantization w4a16``'s, runtime/model/quant.py). At decode batch sizes the product is
a read of the weights, so what counts is that only the nibbles (plus 1/4 byte of scale and
offset per weight) cross HBM: 0.75 bytes per weight against bfloat16's 2.

Kernel design (one CTA = one warpgroup, grid = (M / 64, N / tn)):

* The K axis is walked ``tk = 128`` inputs at a time, ``num_stages`` tiles in flight:
  each step TMA-copies the activation tile [64, 128], the packed weight tile [64, tn]
  uint8 and the tile's four groups of scales and offsets [4, tn] each.
* The packed tile is widened in registers: its low nibbles are the tile's inputs 0-63,
  its high nibbles inputs 64-127 (the GPU layout ``pack_for_gpu`` makes from the stored
  one, once at load), so each half is one [64, tn] WGMMA-layout array; rows 0-31 and
  32-63 of a half take their group's scale and offset, broadcast over the rows. The
  bfloat16 weights go to one SMEM buffer and a wgmma adds x_tile @ w_tile into the
  float32 accumulator.
* Decode rows (M < 64) are padded to one 64-row tile: the tensor core's work is not what
  bounds a weight read. What does is how many CTAs stream weights at once: with fewer
  output tiles than ~2 waves of SMs the K axis is split (grid axis ``split``), each CTA
  writing a float32 partial sum that the wrapper adds.

``pack_for_gpu`` pads K to a multiple of 128 with zero weights (and the wrapper pads x
with zero columns), so models whose hidden size is a multiple of 64 only (SmolLM2's 576)
run too. N must be a multiple of 64.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat

ROWS = 64  # rows of one wgmma tile (M)
TK = 128  # inputs per K step: one packed [64, tn] tile = two 64-input halves
GROUP = 32  # inputs sharing a scale and an offset
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SMEM_BUDGET = 220 * 1024  # bytes; H100/H200 allow 227 KiB per CTA
_TARGET_CTAS = 264  # ~2 waves on 132 SMs: below it the K axis is split (decode shapes)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static configuration of one kernel instantiation."""
  rows: int  # M padded to whole 64-row tiles
  k: int  # K padded to whole 128-input tiles
  n: int
  tn: int  # output columns per CTA (64 or 128)
  num_splits: int  # K ranges per output tile, each written as a float32 partial sum
  num_stages: int
  dtype: Any
  interpret: Any  # InterpretGPUParams or None

  @property
  def k_steps(self) -> int:
    return self.k // TK

  @property
  def out_dtype(self) -> Any:
    return self.dtype if self.num_splits == 1 else jnp.dtype(jnp.float32)

  def smem_bytes(self) -> int:
    isz = jnp.dtype(self.dtype).itemsize
    per_stage = ROWS * TK * isz + (TK // 2) * self.tn + 2 * (TK // GROUP) * self.tn * 4
    return (self.num_stages * per_stage + TK * self.tn * isz
            + ROWS * self.tn * jnp.dtype(self.out_dtype).itemsize)


def _make_plan(x, qg, s, m, *, interpret, block_n, num_stages, num_k_splits) -> _Plan:
  if x.ndim != 2:
    raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
    raise ValueError(f"kernel supports bfloat16/float16 activations, got {x.dtype}")
  M, K = x.shape
  if qg.ndim != 2 or qg.dtype != jnp.uint8:
    raise ValueError(f"packed weights must be uint8 [K/2, N] (pack_for_gpu), got {qg.dtype} "
                     f"{tuple(qg.shape)}")
  kp, N = 2 * qg.shape[0], qg.shape[1]
  if kp % TK or not K <= kp < K + TK:
    raise ValueError(f"packed weights hold {kp} inputs; x has {K} (pack_for_gpu pads K to a "
                     f"multiple of {TK})")
  for name, a in (("scales", s), ("offsets", m)):
    if tuple(a.shape) != (kp // GROUP, N) or a.dtype != jnp.float32:
      raise ValueError(f"{name} must be float32 {(kp // GROUP, N)}, got {a.dtype} {tuple(a.shape)}")
  if block_n not in (64, 128):
    raise ValueError(f"block_n must be 64 or 128, got {block_n!r}")
  tn = block_n if N % block_n == 0 else 64
  if N % tn:
    raise ValueError(f"N = {N} must be a multiple of 64")
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
  if num_k_splits is not None and (not isinstance(num_k_splits, int) or num_k_splits < 1):
    raise ValueError(f"num_k_splits must be None or a positive int, got {num_k_splits!r}")
  rows, k_steps = -(-M // ROWS) * ROWS, kp // TK
  if num_k_splits is None:  # a decode product has few output tiles: split K to fill the SMs
    tiles = rows // ROWS * (N // tn)
    num_k_splits = 1 if tiles >= _TARGET_CTAS // 2 else -(-_TARGET_CTAS // tiles)
  splits = min(num_k_splits, k_steps)
  plan = _Plan(rows=rows, k=kp, n=N, tn=tn, num_splits=splits,
               num_stages=min(num_stages, -(-k_steps // splits)), dtype=jnp.dtype(x.dtype),
               interpret=_compat.resolve_interpret(interpret))
  while plan.smem_bytes() > _SMEM_BUDGET and plan.num_stages > 1:
    plan = dataclasses.replace(plan, num_stages=plan.num_stages - 1)
  return plan


def _kernel_body(plan: _Plan, x_ref, q_ref, s_ref, m_ref, o_ref,
                 x_smem, q_smem, s_smem, m_smem, w_smem, o_smem, bar):
  interpreted = plan.interpret is not None
  stages, tn = plan.num_stages, plan.tn
  layout = plgpu.Layout.WGMMA
  mi = lax.axis_index("m")
  ni = lax.axis_index("n")
  split = lax.axis_index("split")
  cols = pl.ds(ni * tn, tn)
  # this CTA's K steps: [begin, begin + n_steps)
  begin = lax.div(split * plan.k_steps, jnp.int32(plan.num_splits))
  n_steps = lax.div((split + 1) * plan.k_steps, jnp.int32(plan.num_splits)) - begin

  def issue(step):  # (step: this CTA's own count from 0)
    slot = lax.rem(step, jnp.int32(stages))
    k = begin + step
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(mi * ROWS, ROWS), pl.ds(k * TK, TK)],
                            x_smem.at[slot], bar.at[slot])
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(k * (TK // 2), TK // 2), cols],
                            q_smem.at[slot], bar.at[slot])
    groups = pl.ds(k * (TK // GROUP), TK // GROUP)
    plgpu.copy_gmem_to_smem(s_ref.at[groups, cols], s_smem.at[slot], bar.at[slot])
    plgpu.copy_gmem_to_smem(m_ref.at[groups, cols], m_smem.at[slot], bar.at[slot])

  for i in range(stages):
    pl.when(i < n_steps)(functools.partial(issue, jnp.int32(i)))

  def row_vector(ref):
    """[tn] from SMEM, broadcast over the 64 rows of a WGMMA-layout tile."""
    v = ref[...] if interpreted else plgpu.load(ref, (), layout=layout.reduce(0))
    return lax.broadcast_in_dim(v, (ROWS, tn), [1])

  first_group = _compat.broadcasted_iota(jnp.int32, (ROWS, tn), 0, layout=layout,
                                         interpreted=interpreted) < GROUP

  def step_fn(step, acc):
    slot = lax.rem(step, jnp.int32(stages))
    plgpu.barrier_wait(bar.at[slot])
    packed = q_smem.at[slot][...] if interpreted else plgpu.load(q_smem.at[slot], (), layout=layout)
    # Mosaic GPU has no 8-bit shifts (bitwise ops only): the high nibble stays in place,
    # x16, and its scale is divided by 16 instead.
    for half, (nibbles, unit) in enumerate(((packed & 0x0F, 1.0), (packed & 0xF0, 1 / 16))):
      g = 2 * half  # this half's rows 0-31 are group g, rows 32-63 group g + 1
      scale = jnp.where(first_group, row_vector(s_smem.at[slot, g]), row_vector(s_smem.at[slot, g + 1]))
      offset = jnp.where(first_group, row_vector(m_smem.at[slot, g]), row_vector(m_smem.at[slot, g + 1]))
      w = nibbles.astype(jnp.float32) * (scale * unit) + offset
      w_smem[pl.ds(half * ROWS, ROWS), :] = w.astype(plan.dtype)
    plgpu.commit_smem()

    def mm(acc_ref):
      plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem)
      return acc_ref[...]

    acc = acc + pl.run_scoped(mm, plgpu.ACC((ROWS, tn), jnp.float32))
    # The wgmma reading this slot has completed: refill it.
    pl.when(step + stages < n_steps)(functools.partial(issue, step + stages))
    return acc

  init = _compat.layout_cast(jnp.zeros((ROWS, tn), jnp.float32), layout, interpreted=interpreted)
  acc = lax.fori_loop(0, n_steps, step_fn, init)
  o_smem[...] = acc.astype(plan.out_dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, pl.ds(mi * ROWS, ROWS), cols])
  plgpu.wait_smem_to_gmem(0)


def _run_kernel(plan: _Plan, x, qg, s, m):
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  # 1-byte tiles: rows of tn bytes, swizzled by a row's width
  q_tiled = (plgpu.TilingTransform((8, plan.tn)), plgpu.SwizzleTransform(plan.tn))
  stages, tn, dt = plan.num_stages, plan.tn, plan.dtype
  scratch = [
      plgpu.SMEM((stages, ROWS, TK), dt, transforms=tiled),  # x
      plgpu.SMEM((stages, TK // 2, tn), jnp.uint8, transforms=q_tiled),  # packed weights
      plgpu.SMEM((stages, TK // GROUP, tn), jnp.float32),  # scales
      plgpu.SMEM((stages, TK // GROUP, tn), jnp.float32),  # offsets
      plgpu.SMEM((TK, tn), dt, transforms=tiled),  # widened weights
      plgpu.SMEM((ROWS, tn), plan.out_dtype),  # output tile (a float32 partial sum when split)
      plgpu.Barrier(num_arrivals=4, num_barriers=stages),
  ]
  kernel = plgpu.kernel(
      functools.partial(_kernel_body, plan),
      out_type=jax.ShapeDtypeStruct((plan.num_splits, plan.rows, plan.n), plan.out_dtype),
      scratch_types=scratch,
      grid=(plan.rows // ROWS, plan.n // tn, plan.num_splits),
      grid_names=("m", "n", "split"),
      interpret=plan.interpret,
  )
  return kernel(x, qg, s, m)


@functools.partial(jax.jit, static_argnames=("plan",))
def _w4a16_jit(x, qg, s, m, *, plan: _Plan):
  M, K = x.shape
  xp = jnp.pad(x, ((0, plan.rows - M), (0, plan.k - K)))
  parts = _run_kernel(plan, xp, qg, s, m)[:, :M]
  return parts[0] if plan.num_splits == 1 else parts.sum(0).astype(plan.dtype)


def w4a16_matmul(x: jax.Array, qg: jax.Array, s: jax.Array, m: jax.Array, *,
                 interpret: Any = False, block_n: int = 128, num_stages: int = 3,
                 num_k_splits: int | None = None) -> jax.Array:
  """x [M, K] bfloat16/float16 @ the 4-bit weight (``pack_for_gpu``'s qg [Kp/2, N] uint8,
  s and m [Kp/32, N] float32) -> [M, N] in x's dtype. interpret: False (hardware), True
  (the Mosaic GPU interpreter on CPU, races detected), or an InterpretGPUParams.
  num_k_splits: K ranges per output tile (float32 partial sums, added in the wrapper);
  None picks enough for ~2 waves of CTAs."""
  plan = _make_plan(x, qg, s, m, interpret=interpret, block_n=block_n, num_stages=num_stages,
                    num_k_splits=num_k_splits)
  if plan.interpret is None and jax.default_backend() != "gpu":
    raise ValueError("the Mosaic GPU kernel needs a Hopper GPU (backend is "
                     f"{jax.default_backend()!r}); pass interpret=True to run it in the "
                     "Mosaic GPU interpreter, or use the XLA dequantizing path")
  return _w4a16_jit(x, qg, s, m, plan=plan)


def lower_for_cuda(x, qg, s, m, *, block_n: int = 128, num_stages: int = 3,
                   num_k_splits: int | None = None) -> str:
  """Lowers the hardware kernel for CUDA (no GPU needed) and returns the text (arguments
  may be jax.ShapeDtypeStruct): the whole Mosaic GPU lowering minus PTX compilation."""
  plan = _make_plan(x, qg, s, m, interpret=False, block_n=block_n, num_stages=num_stages,
                    num_k_splits=num_k_splits)
  traced = jax.jit(functools.partial(_w4a16_jit, plan=plan)).trace(x, qg, s, m)
  return traced.lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------
# Layouts and the reference.
# ----------------------------------------------------------------------------
def pack_for_gpu(q4: jax.Array, s4: jax.Array, m4: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The stored layout (q4 [..., K/2, N]: row 16g+j holds input 32g+j in its low nibble
  and 32g+16+j in its high one; s4, m4 [..., K/32, N]) -> the kernel's: K padded with zero
  weights to a multiple of 128, and in each 128-input tile packed row r holding input r
  (low nibble) and input 64 + r (high nibble). Leading axes (a layer stack) are kept."""
  *lead, K2, N = q4.shape
  K = 2 * K2
  g = q4.reshape(*lead, K // GROUP, 1, GROUP // 2, N)
  q = jnp.concatenate([g & 15, g >> 4], axis=-3).reshape(*lead, K, N)  # one value per input
  kp = -(-K // TK) * TK
  none = [(0, 0)] * len(lead)
  q = jnp.pad(q, (*none, (0, kp - K), (0, 0))).reshape(*lead, kp // TK, 2, TK // 2, N)
  qg = (q[..., 0, :, :] | (q[..., 1, :, :] << 4)).reshape(*lead, kp // 2, N).astype(jnp.uint8)
  pad = (*none, (0, (kp - K) // GROUP), (0, 0))
  return qg, jnp.pad(s4, pad), jnp.pad(m4, pad)


def ref_w4a16_matmul(x: jax.Array, q4: jax.Array, s4: jax.Array, m4: jax.Array) -> jax.Array:
  """x @ (the stored layout dequantized), float32 math, in x's dtype."""
  from runtime.model.linear import dequantize_int4

  w = dequantize_int4(q4, s4, m4)
  y = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
  return y.astype(x.dtype)
