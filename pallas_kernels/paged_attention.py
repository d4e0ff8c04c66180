"""Ragged paged attention for Hopper (Pallas, Mosaic GPU backend) + its reference.

One call serves decode tokens (q_len 1) and chunked-prefill chunks (q_len > 1) of
many sequences, reading K/V from a paged cache ``[num_blocks, block_size, Hkv, D]``.

Kernel design (one CTA = one warpgroup):

* Work is split into *query tiles*: up to ``tq = 64 // G`` consecutive query tokens
  of one sequence (G = Hq // Hkv). The tile's G query heads x tq tokens are folded
  into the 64 rows of one wgmma tile (row ``r`` = token ``r // G``, head
  ``r % G``), so a decode token of a GQA model still feeds the tensor core with
  its whole head group. Grid = (work items, KV heads, KV splits).
* The tile walks its sequence's KV blocks ``kv_tile_tokens`` tokens at a time
  (several cache blocks per step, each fetched by its own TMA copy with the block
  id read from the block table), ``num_stages`` steps in flight, online softmax
  in float32 (base 2), S = Q K^T and O += P V on wgmma with f32 accumulators. P is
  staged through SMEM (works in the interpreter and on hardware alike).
* Long contexts with few tiles are split over the KV axis (``num_kv_splits``);
  each split writes a normalised partial output and its log-sum-exp, combined in
  the jitted wrapper.
* The wrapper (plain XLA, inside the same jit) builds the work list, lays Q out
  as ``[Hkv, tokens * G, D]``, and gathers the per-tile outputs back to
  ``[T, Hq, D]`` with padding rows zeroed.

Quantized caches (int8 or fp8_e4m3 values, one float32 scale per token and KV head,
``k_scale``/``v_scale`` [NB, BS, Hkv]): the TMA copies move the 1-byte values (half the
bytes of a bf16 cache), each tile is widened to bf16 in registers on its way to the
wgmma operand buffer (int8 values are exact in bf16), and the scales never touch the
tiles: K's multiply the score columns (S = Q Kq^T * k_scale) and V's the probabilities
before P V (P' = P * v_scale), so l (the softmax denominator) stays unscaled. The
wrapper gathers each sequence's scales contiguously ([S, Hkv, MB*BS], a 1/D-sized
gather) so one TMA copy per tile brings them.

Contract: cache rows beyond a sequence's kv_len inside its last block, and blocks
named by table entries past ``ceil(kv_len / BS)``, may be read but are masked; they
must hold finite values (a zero-initialised cache does). On hardware an
out-of-range block id reads zeros (TMA bounds); in interpret mode it raises.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat

ROWS = 64  # rows of one wgmma tile (M)
SUPPORTED_HEAD_DIMS = (64, 128)
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_MASK = -1e30  # finite: fully masked rows never produce inf - inf
_LOG2E = math.log2(math.e)
_SMEM_BUDGET = 220 * 1024  # bytes; H100/H200 allow 227 KiB per CTA
_TARGET_CTAS = 264  # ~2 waves on 132 SMs; drives the automatic KV split


# ----------------------------------------------------------------------------
# Argument validation (runs on shapes/dtypes only, before anything is traced).
# ----------------------------------------------------------------------------
def _validate_scales(k_cache, k_scale, v_scale) -> None:
  quantized = jnp.dtype(k_cache.dtype) in QUANTIZED_DTYPES
  if (k_scale is None) != (v_scale is None):
    raise ValueError("k_scale and v_scale come together (both or neither)")
  if quantized and k_scale is None:
    raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale"
                     " [NB, BS, Hkv] float32 (one scale per token and KV head)")
  if not quantized and k_scale is not None:
    raise ValueError(f"k_scale/v_scale are for int8 / float8_e4m3fn caches, not"
                     f" {k_cache.dtype}")
  for name, a in (("k_scale", k_scale), ("v_scale", v_scale)):
    if a is not None and (tuple(a.shape) != tuple(k_cache.shape[:3])
                          or a.dtype != jnp.float32):
      raise ValueError(f"{name} must be float32 {tuple(k_cache.shape[:3])}, got"
                       f" {a.dtype} {tuple(a.shape)}")


def _validate_common(q, k_cache, v_cache, kv_lens, block_tables,
                     query_start_loc, num_seqs, sm_scale) -> None:
  if q.ndim != 3:
    raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
  if k_cache.ndim != 4:
    raise ValueError(
        f"k_cache must be [NB, BS, Hkv, D], got shape {tuple(k_cache.shape)}")
  if tuple(v_cache.shape) != tuple(k_cache.shape):
    raise ValueError(
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape"
        f" {tuple(k_cache.shape)}")
  t, hq, d = q.shape
  _, _, hkv, dk = k_cache.shape
  if t < 1:
    raise ValueError("q must hold at least one (possibly padding) token")
  if dk != d:
    raise ValueError(f"head dim mismatch: q has {d}, k_cache has {dk}")
  if hkv < 1 or hq % hkv:
    raise ValueError(
        f"num query heads ({hq}) must be a multiple of num KV heads ({hkv})")
  if kv_lens.ndim != 1:
    raise ValueError(f"kv_lens must be [S], got shape {tuple(kv_lens.shape)}")
  s = kv_lens.shape[0]
  if block_tables.ndim != 2 or block_tables.shape[0] != s:
    raise ValueError(
        f"block_tables must be [S={s}, max_blocks], got shape"
        f" {tuple(block_tables.shape)} (rows must equal len(kv_lens))")
  if query_start_loc.shape != (s + 1,):
    raise ValueError(
        f"query_start_loc must have length S+1={s + 1}, got shape"
        f" {tuple(query_start_loc.shape)}")
  if num_seqs.shape != (1,):
    raise ValueError(f"num_seqs must have shape (1,), got {tuple(num_seqs.shape)}")
  for name, a in (("kv_lens", kv_lens), ("block_tables", block_tables),
                  ("query_start_loc", query_start_loc), ("num_seqs", num_seqs)):
    if a.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {a.dtype}")
  if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
      or sm_scale <= 0:
    raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static configuration of one kernel instantiation."""
  num_tokens: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  max_blocks: int  # block-table columns after padding to whole KV tiles
  group: int  # G = Hq // Hkv
  tq: int  # query tokens per work item
  num_work: int  # static upper bound on work items
  kv_tile: int  # KV tokens per pipeline step
  num_stages: int
  num_splits: int
  dtype: Any
  kv_dtype: Any  # the cache's element type: dtype, or int8 / float8_e4m3fn
  out_dtype: Any
  sm_scale: float
  interpret: Any  # InterpretGPUParams or None
  transposed_k: bool  # use transpose_ref for K^T (False: materialise K^T)

  @property
  def pages_per_tile(self) -> int:
    return self.kv_tile // self.block_size

  @property
  def quantized(self) -> bool:
    return jnp.dtype(self.kv_dtype) in QUANTIZED_DTYPES

  def smem_bytes(self) -> int:
    isz = jnp.dtype(self.dtype).itemsize
    b = ROWS * self.head_dim * isz  # q
    b += self.num_stages * 2 * self.kv_tile * self.head_dim * jnp.dtype(self.kv_dtype).itemsize  # k, v
    if self.quantized:  # per-stage scales, and the widened K and V tiles
      b += self.num_stages * 2 * self.kv_tile * 4 + 2 * self.kv_tile * self.head_dim * isz
    b += ROWS * self.kv_tile * isz  # p
    b += ROWS * self.head_dim * jnp.dtype(self.out_dtype).itemsize  # o
    b += ROWS * 4  # lse
    # (The interpreter-only K^T scratch is left out: the interpreter has no
    # SMEM limit, and the budget must match what the hardware build needs.)
    return b


def _make_plan(q, k_cache, v_cache, block_tables, *, sm_scale, interpret, kv_tile_tokens,
               num_stages, num_kv_splits) -> _Plan:
  t, hq, d = q.shape
  nb, bs, hkv, _ = k_cache.shape
  s, mb = block_tables.shape
  if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
    raise ValueError(
        f"kernel supports bfloat16/float16 inputs, got {q.dtype} (use the"
        " plain-XLA attention for float32)")
  if v_cache.dtype != k_cache.dtype or (
      k_cache.dtype != q.dtype and jnp.dtype(k_cache.dtype) not in QUANTIZED_DTYPES):
    raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype} must both be"
                     f" the q dtype {q.dtype}, int8 or float8_e4m3fn")
  if d not in SUPPORTED_HEAD_DIMS:
    raise ValueError(f"unsupported head dim {d}; supported: {SUPPORTED_HEAD_DIMS}")
  group = hq // hkv
  if group > ROWS:
    raise ValueError(f"Hq/Hkv = {group} exceeds the {ROWS}-row tile")
  if not isinstance(kv_tile_tokens, int) or kv_tile_tokens < 64 \
      or kv_tile_tokens % 64 or kv_tile_tokens > 256:
    raise ValueError(
        f"kv_tile_tokens must be 64, 128, 192 or 256, got {kv_tile_tokens!r}")
  if bs % 8 or kv_tile_tokens % bs:
    raise ValueError(
        f"block size {bs} must be a multiple of 8 dividing kv_tile_tokens"
        f" ({kv_tile_tokens})")
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
  if num_kv_splits is not None and (
      not isinstance(num_kv_splits, int) or num_kv_splits < 1):
    raise ValueError(f"num_kv_splits must be None or a positive int, got"
                     f" {num_kv_splits!r}")
  params = _compat.resolve_interpret(interpret)
  tq = ROWS // group
  num_work = min(t, t // tq + s)
  ppt = kv_tile_tokens // bs
  mb_pad = -(-mb // ppt) * ppt
  max_kv_tiles = max(1, mb_pad // ppt)
  if num_kv_splits is None:
    ctas = num_work * hkv
    num_kv_splits = 1 if ctas >= _TARGET_CTAS // 2 else min(
        -(-_TARGET_CTAS // ctas), max_kv_tiles, 32)
  transposed_k = params is None or _compat.interpret_supports_transposed_wgmma()
  plan = _Plan(
      num_tokens=t, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
      block_size=bs, max_blocks=mb_pad, group=group, tq=tq, num_work=num_work,
      kv_tile=kv_tile_tokens, num_stages=num_stages,
      num_splits=num_kv_splits, dtype=jnp.dtype(q.dtype),
      kv_dtype=jnp.dtype(k_cache.dtype),
      out_dtype=jnp.dtype(q.dtype) if num_kv_splits == 1 else jnp.dtype(jnp.float32),
      sm_scale=float(sm_scale), interpret=params, transposed_k=transposed_k)
  while plan.smem_bytes() > _SMEM_BUDGET and plan.num_stages > 2:
    plan = dataclasses.replace(plan, num_stages=plan.num_stages - 1)
  if plan.smem_bytes() > _SMEM_BUDGET:
    raise ValueError(
        f"configuration needs {plan.smem_bytes()} bytes of SMEM (budget"
        f" {_SMEM_BUDGET}); lower kv_tile_tokens")
  return plan


# ----------------------------------------------------------------------------
# Kernel body.
# ----------------------------------------------------------------------------
def _kernel_body(plan: _Plan, meta_ref, bt_ref, q_ref, k_ref, v_ref, *refs):
  if plan.quantized:
    ks_ref, vs_ref, *refs = refs  # [S, Hkv, MB*BS] each sequence's scales in a row
  if plan.num_splits > 1:
    o_ref, lse_ref, *scratch = refs
  else:
    (o_ref, *scratch), lse_ref = refs, None
  (q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, kt_smem,
   q_bar, k_bar, v_bar, *qscratch) = scratch
  if plan.quantized:
    ks_smem, vs_smem, kw_smem, vw_smem = qscratch
  interpreted = plan.interpret is not None
  G, KVT, D, BS = plan.group, plan.kv_tile, plan.head_dim, plan.block_size
  stages = plan.num_stages
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  w = lax.axis_index("work")
  h = lax.axis_index("kv_head")
  split = lax.axis_index("split")
  seq = meta_ref[w, 0]
  row0 = meta_ref[w, 1]  # first row of this tile in q_ref[h] (= token * G)
  n_tok = meta_ref[w, 2]  # valid query tokens in the tile (0: padding item)
  pos0 = meta_ref[w, 3]  # absolute position of the tile's first token

  n_kv_tiles = lax.div(pos0 + n_tok + (KVT - 1), jnp.int32(KVT))
  n_kv_tiles = jnp.where(n_tok > 0, n_kv_tiles, 0)
  t_begin = lax.div(split * n_kv_tiles, jnp.int32(plan.num_splits))
  t_end = lax.div((split + 1) * n_kv_tiles, jnp.int32(plan.num_splits))
  n_steps = t_end - t_begin

  def issue(step):
    slot = lax.rem(step, jnp.int32(stages))
    first_page = (t_begin + step) * plan.pages_per_tile
    for p in range(plan.pages_per_tile):
      block_id = bt_ref[seq, first_page + p]
      dst = pl.ds(p * BS, BS)
      plgpu.copy_gmem_to_smem(k_ref.at[block_id, pl.ds(0, BS), h],
                              k_smem.at[slot, dst], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[block_id, pl.ds(0, BS), h],
                              v_smem.at[slot, dst], v_bar.at[slot])
    if plan.quantized:  # the tile's scales: one more arrival on each barrier
      tok = pl.ds((t_begin + step) * KVT, KVT)
      plgpu.copy_gmem_to_smem(ks_ref.at[seq, h, tok], ks_smem.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(vs_ref.at[seq, h, tok], vs_smem.at[slot], v_bar.at[slot])

  @pl.when(n_steps > 0)
  def _prologue():
    plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(row0, ROWS)], q_smem, q_bar)
    for i in range(stages):
      pl.when(i < n_steps)(functools.partial(issue, jnp.int32(i)))
    plgpu.barrier_wait(q_bar)

  scale = plan.sm_scale * _LOG2E
  iota = functools.partial(_compat.broadcasted_iota, jnp.int32, (ROWS, KVT),
                           layout=wgmma_layout, interpreted=interpreted)

  def widen(ref):
    """A quantized [KVT, D] tile -> registers in the compute dtype (WGMMA layout,
    as the widened buffers' stores want it). fp8 goes through float32: the
    hardware has no fp8 -> bf16 conversion."""
    x = ref[...] if interpreted else plgpu.load(ref, (), layout=wgmma_layout)
    if jnp.dtype(plan.kv_dtype) != jnp.dtype(jnp.int8):
      x = x.astype(jnp.float32)
    return x.astype(plan.dtype)

  def column_scales(ref, like):
    """[KVT] scales from SMEM -> broadcast over the rows of a [ROWS, KVT] tile."""
    x = ref[...] if interpreted else plgpu.load(ref, (), layout=wgmma_layout.reduce(0))
    return lax.broadcast_in_dim(x, like.shape, [1])

  def step_fn(step, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(step, jnp.int32(stages))
    plgpu.barrier_wait(k_bar.at[slot])
    if plan.quantized and plan.transposed_k:
      kw_smem[...] = widen(k_smem.at[slot])
      plgpu.commit_smem()
      k_t = plgpu.transpose_ref(kw_smem, (1, 0))
    elif plan.quantized:  # interpreter without transposed wgmma operands
      kt_smem[...] = widen(k_smem.at[slot]).T
      plgpu.commit_smem()
      k_t = kt_smem
    elif plan.transposed_k:
      k_t = plgpu.transpose_ref(k_smem.at[slot], (1, 0))
    else:  # interpreter without transposed wgmma operands (see _compat)
      kt_smem[...] = k_smem.at[slot][...].T
      plgpu.commit_smem()
      k_t = kt_smem

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_t)
      return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((ROWS, KVT), jnp.float32)) * scale
    if plan.quantized:  # column j of S belongs to key j: its scale
      s = s * column_scales(ks_smem.at[slot], s)
    # Causal mask: row r is token r // G at position pos0 + r // G. (Built
    # here rather than hoisted: cheap to regenerate, costly to keep live.)
    row_tok = lax.div(iota(0), jnp.int32(G)) if G > 1 else iota(0)
    kv_pos = iota(1) + (t_begin + step) * KVT
    s = jnp.where(kv_pos <= pos0 + row_tok, s, _MASK)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if plan.quantized:  # P' = P * v_scale (columns): P' Vq = P V
      plgpu.barrier_wait(v_bar.at[slot])
      p_smem[...] = (p * column_scales(vs_smem.at[slot], p)).astype(plan.dtype)
      vw_smem[...] = widen(v_smem.at[slot])
      plgpu.commit_smem()
      v_tile = vw_smem
    else:
      p_smem[...] = p.astype(plan.dtype)
      plgpu.commit_smem()
      plgpu.barrier_wait(v_bar.at[slot])
      v_tile = v_smem.at[slot]

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_tile)
      return acc_ref[...]

    acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, D), jnp.float32))
    # Both wgmmas reading this slot have completed: refill it.
    pl.when(step + stages < n_steps)(functools.partial(issue, step + stages))
    return acc, m_new, l_i

  lc = functools.partial(_compat.layout_cast, interpreted=interpreted)
  init = (
      lc(jnp.zeros((ROWS, D), jnp.float32), wgmma_layout),
      lc(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
      lc(jnp.zeros((ROWS,), jnp.float32), row_layout),
  )
  acc, m_i, l_i = lax.fori_loop(0, n_steps, step_fn, init)

  l_safe = jnp.where(l_i == 0.0, 1.0, l_i)  # empty split: o = 0, lse = -inf
  out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
  rows_needed = n_tok * G

  @pl.when(rows_needed > 0)
  def _store():
    o_smem[...] = out.astype(plan.out_dtype)
    if lse_ref is not None:
      lse_smem[...] = m_i + jnp.log2(l_i)
    plgpu.commit_smem()
    # Store only the rows holding real tokens (decode tiles use G of 64 rows):
    # the smallest power-of-two row count >= rows_needed, at least 8.
    sizes = [r for r in (8, 16, 32, 64) if r <= ROWS]
    for i, r in enumerate(sizes):
      lo = 0 if i == 0 else sizes[i - 1]

      @pl.when((rows_needed > lo) & (rows_needed <= r))
      def _(r=r):
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, r)],
                                o_ref.at[w, h, split, pl.ds(0, r)])
    if lse_ref is not None:
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[w, h, split])
    plgpu.wait_smem_to_gmem(0)


def _run_kernel(plan: _Plan, meta, block_tables, q_rows, k_cache, v_cache, scales=()):
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  D, KVT, dt = plan.head_dim, plan.kv_tile, plan.dtype
  # 1-byte tiles: rows of D bytes, swizzled by a row's width (64 or 128 bytes)
  kv_tiled = tiled if not plan.quantized else (
      plgpu.TilingTransform((8, min(D, 128))), plgpu.SwizzleTransform(min(D, 128)))
  arrivals = plan.pages_per_tile + (1 if plan.quantized else 0)
  scratch = [
      plgpu.SMEM((ROWS, D), dt, transforms=tiled),  # q
      plgpu.SMEM((plan.num_stages, KVT, D), plan.kv_dtype, transforms=kv_tiled),  # k
      plgpu.SMEM((plan.num_stages, KVT, D), plan.kv_dtype, transforms=kv_tiled),  # v
      plgpu.SMEM((ROWS, KVT), dt, transforms=tiled),  # p
      plgpu.SMEM((ROWS, D), plan.out_dtype),  # o (untiled: row slices)
      plgpu.SMEM((ROWS,), jnp.float32),  # lse
      None if plan.transposed_k else plgpu.SMEM((D, KVT), dt, transforms=tiled),
      plgpu.Barrier(num_barriers=1),  # q
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=plan.num_stages),
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=plan.num_stages),
  ]
  if plan.quantized:
    scratch += [
        plgpu.SMEM((plan.num_stages, KVT), jnp.float32),  # k scales
        plgpu.SMEM((plan.num_stages, KVT), jnp.float32),  # v scales
        plgpu.SMEM((KVT, D), dt, transforms=tiled),  # k widened
        plgpu.SMEM((KVT, D), dt, transforms=tiled),  # v widened
    ]
  W, H, S = plan.num_work, plan.num_kv_heads, plan.num_splits
  out_type = [jax.ShapeDtypeStruct((W, H, S, ROWS, D), plan.out_dtype)]
  if S > 1:
    out_type.append(jax.ShapeDtypeStruct((W, H, S, ROWS), jnp.float32))
  kernel = plgpu.kernel(
      functools.partial(_kernel_body, plan),
      out_type=out_type,
      scratch_types=scratch,
      grid=(W, H, S),
      grid_names=("work", "kv_head", "split"),
      compiler_params=None if plan.interpret else plgpu.CompilerParams(
          approx_math=True),
      interpret=plan.interpret,
  )
  outs = kernel(meta, block_tables, q_rows, k_cache, v_cache, *scales)
  return outs[0], (outs[1] if S > 1 else None)


# ----------------------------------------------------------------------------
# Wrapper: work list, Q layout, output gather / split combine (plain XLA).
# ----------------------------------------------------------------------------
def _seq_tables(kv_lens, query_start_loc, num_seqs):
  s = kv_lens.shape[0]
  n = num_seqs[0]
  real = jnp.arange(s) < n
  qsl = jnp.where(jnp.arange(s + 1) <= n, query_start_loc,
                  query_start_loc[jnp.minimum(n, s)])
  q_len = jnp.where(real, qsl[1:] - qsl[:-1], 0)
  kv_len = jnp.where(real, kv_lens, 0)
  return qsl, q_len, kv_len


def _work_list(plan: _Plan, kv_lens, query_start_loc, num_seqs):
  s = kv_lens.shape[0]
  qsl, q_len, kv_len = _seq_tables(kv_lens, query_start_loc, num_seqs)
  tiles = (q_len + plan.tq - 1) // plan.tq
  tile_end = jnp.cumsum(tiles)
  tile_begin = tile_end - tiles
  w = jnp.arange(plan.num_work, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(tile_end, w, side="right"), 0, s - 1)
  valid = w < tile_end[-1]
  local = (w - tile_begin[seq]) * plan.tq
  n_tok = jnp.where(valid, jnp.minimum(plan.tq, q_len[seq] - local), 0)
  tok0 = jnp.where(valid, qsl[seq] + local, 0)
  pos0 = jnp.where(valid, kv_len[seq] - q_len[seq] + local, 0)
  meta = jnp.stack([seq, tok0 * plan.group, n_tok, pos0], axis=1)
  return meta.astype(jnp.int32), qsl, tile_begin


def _gather_outputs(plan: _Plan, o_tiles, lse_tiles, qsl, tile_begin, num_seqs):
  T, G, H = plan.num_tokens, plan.group, plan.num_kv_heads
  s = tile_begin.shape[0]
  t = jnp.arange(T, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, s - 1)
  valid = t < qsl[num_seqs[0]]
  i = t - qsl[seq]
  w = jnp.clip(tile_begin[seq] + i // plan.tq, 0, plan.num_work - 1)
  rows = (i % plan.tq)[:, None] * G + jnp.arange(G)[None, :]  # [T, G]
  widx, hidx, ridx = w[:, None, None], jnp.arange(H)[None, :, None], rows[:, None, :]
  o = o_tiles[widx, hidx, :, ridx, :]  # [T, H, G, splits, D]
  if lse_tiles is None:
    o = o[:, :, :, 0, :]
  else:
    lse = lse_tiles[widx, hidx, :, ridx]  # [T, H, G, splits]
    top = jnp.max(lse, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    wts = jnp.exp2(lse - top)
    o = jnp.where(wts[..., None] > 0, o.astype(jnp.float32), 0.0)
    o = jnp.sum(wts[..., None] * o, axis=-2) / jnp.maximum(
        jnp.sum(wts, axis=-1), 1e-30)[..., None]
  o = o.reshape(T, plan.num_q_heads, plan.head_dim)
  return jnp.where(valid[:, None, None], o, 0).astype(plan.dtype)


@functools.partial(jax.jit, static_argnames=("plan",))
def _paged_attention_jit(q, k_cache, v_cache, kv_lens, block_tables,
                         query_start_loc, num_seqs, k_scale=None, v_scale=None, *,
                         plan: _Plan):
  T, Hq, D = q.shape
  G, H = plan.group, plan.num_kv_heads
  meta, qsl, tile_begin = _work_list(plan, kv_lens, query_start_loc, num_seqs)
  # Q as [Hkv, tokens * G, D] (row = token * G + head-in-group), padded so a
  # 64-row window starting at any token fits and the row count is a multiple of
  # the 8-row TMA tiling.
  q_rows = q.reshape(T, H, G, D).transpose(1, 0, 2, 3).reshape(H, T * G, D)
  num_rows = -(-(T * G + ROWS) // ROWS) * ROWS
  q_rows = jnp.pad(q_rows, ((0, 0), (0, num_rows - T * G), (0, 0)))
  bt = block_tables
  if bt.shape[1] < plan.max_blocks:
    bt = jnp.pad(bt, ((0, 0), (0, plan.max_blocks - bt.shape[1])))
  scales = ()
  if plan.quantized:  # [NB, BS, Hkv] -> [S, Hkv, MB*BS]: a tile's scales contiguous
    S = bt.shape[0]
    scales = tuple(x[bt].transpose(0, 3, 1, 2).reshape(S, H, plan.max_blocks * plan.block_size)
                   for x in (k_scale, v_scale))
  o_tiles, lse_tiles = _run_kernel(plan, meta, bt, q_rows, k_cache, v_cache, scales)
  return _gather_outputs(plan, o_tiles, lse_tiles, qsl, tile_begin, num_seqs)


def _checked_plan(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                  num_seqs, sm_scale, k_scale, v_scale, **plan_kw) -> _Plan:
  """Every argument check (on shapes and dtypes only), then the kernel's plan."""
  _validate_common(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                   num_seqs, sm_scale)
  _validate_scales(k_cache, k_scale, v_scale)
  return _make_plan(q, k_cache, v_cache, block_tables, sm_scale=sm_scale, **plan_kw)


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    interpret: Any = False,
    kv_tile_tokens: int = 64,
    num_stages: int = 4,
    num_kv_splits: int | None = None,
) -> jax.Array:
  """Ragged paged attention on Hopper (Mosaic GPU Pallas kernel).

  Args:
    q: [T, Hq, D] query tokens of all sequences, sequence-major; rows at/after
      ``query_start_loc[num_seqs]`` are padding (returned as zeros).
    k_cache, v_cache: [NB, BS, Hkv, D] paged caches (q's dtype, or int8 /
      float8_e4m3fn with their scales).
    kv_lens: [S] int32 KV length per sequence including this step's tokens.
    block_tables: [S, MB] int32 block ids.
    query_start_loc: [S+1] int32 cumulative query offsets.
    num_seqs: [1] int32 number of real sequences.
    sm_scale: softmax scale.
    k_scale, v_scale: [NB, BS, Hkv] float32, one per token and KV head, for a
      quantized cache (value = stored * scale); None for a float cache.
    interpret: False (hardware), True (Mosaic GPU interpreter on CPU with race
      detection, raising out-of-bounds reads and NaN-filled fresh memory), or an
      InterpretGPUParams.
    kv_tile_tokens: KV tokens per pipeline step (multiple of 64 and of BS).
    num_stages: KV tiles in flight (lowered automatically to fit SMEM).
    num_kv_splits: KV splits per query tile; None picks one from the shapes.

  Returns:
    [T, Hq, D] attention output in q.dtype.
  """
  plan = _checked_plan(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                       num_seqs, sm_scale, k_scale, v_scale, interpret=interpret,
                       kv_tile_tokens=kv_tile_tokens, num_stages=num_stages,
                       num_kv_splits=num_kv_splits)
  if plan.interpret is None and jax.default_backend() != "gpu":
    raise ValueError(
        "the Mosaic GPU kernel needs a Hopper GPU (backend is"
        f" {jax.default_backend()!r}); pass interpret=True to run it in the"
        " Mosaic GPU interpreter, or use the plain-XLA attention")
  return _paged_attention_jit(q, k_cache, v_cache, kv_lens, block_tables,
                              query_start_loc, num_seqs, k_scale, v_scale, plan=plan)


def hardware_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                       num_seqs, *, sm_scale: float, k_scale=None, v_scale=None,
                       kv_tile_tokens: int = 64, num_stages: int = 4,
                       num_kv_splits: int | None = None) -> jax.Array:
  """The hardware kernel, traceable on any backend: for lowering a larger program
  for CUDA on a CPU machine (``lower_for_cuda``; the tensor-parallel engine step in
  tests/runtime/tp_pallas_lower.py). Executing it off a GPU fails."""
  plan = _checked_plan(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                       num_seqs, sm_scale, k_scale, v_scale, interpret=False,
                       kv_tile_tokens=kv_tile_tokens, num_stages=num_stages,
                       num_kv_splits=num_kv_splits)
  return _paged_attention_jit(q, k_cache, v_cache, kv_lens, block_tables,
                              query_start_loc, num_seqs, k_scale, v_scale, plan=plan)


def lower_for_cuda(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                   num_seqs, *, sm_scale: float, k_scale=None, v_scale=None,
                   kv_tile_tokens: int = 64, num_stages: int = 4,
                   num_kv_splits: int | None = None) -> str:
  """Lowers the hardware kernel for CUDA (no GPU needed) and returns the text.

  Arguments may be jax.ShapeDtypeStruct. This runs the whole Mosaic GPU
  lowering (register layouts, TMA and wgmma operand checks) of exactly what a
  Hopper GPU would compile, minus the final PTX compilation, so it catches most
  hardware-only mistakes on a CPU machine.
  """
  def fn(*args, k_scale, v_scale):
    return hardware_attention(*args, sm_scale=sm_scale, k_scale=k_scale,
                              v_scale=v_scale, kv_tile_tokens=kv_tile_tokens,
                              num_stages=num_stages, num_kv_splits=num_kv_splits)

  traced = jax.jit(fn).trace(q, k_cache, v_cache, kv_lens, block_tables,
                             query_start_loc, num_seqs, k_scale=k_scale,
                             v_scale=v_scale)
  return traced.lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------
# Pure-jnp reference (float32 math; the ground truth for every implementation).
# ----------------------------------------------------------------------------
def ref_ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
  """Token-by-token reference: each query token gathers its sequence's whole
  cache (dequantized: values * scales, for a quantized one), masks positions
  after its own, and takes a float32 softmax."""
  _validate_common(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                   num_seqs, sm_scale)
  _validate_scales(k_cache, k_scale, v_scale)
  if k_scale is not None:
    k_cache = k_cache.astype(jnp.float32) * k_scale[..., None]
    v_cache = v_cache.astype(jnp.float32) * v_scale[..., None]
  T, Hq, D = q.shape
  _, BS, Hkv, _ = k_cache.shape
  S, MB = block_tables.shape
  G = Hq // Hkv
  n = num_seqs[0]
  qsl = query_start_loc
  hi = lax.Precision.HIGHEST

  def one_token(t):
    # The token's sequence: the last real sequence starting at or before t.
    starts_before = (jnp.arange(S) < n) & (qsl[:-1] <= t)
    s = jnp.clip(jnp.sum(starts_before) - 1, 0, S - 1)
    valid = t < qsl[n]
    q_len = qsl[s + 1] - qsl[s]
    pos = kv_lens[s] - q_len + (t - qsl[s])  # absolute position of token t
    keys = k_cache[block_tables[s]].reshape(MB * BS, Hkv, D).astype(jnp.float32)
    vals = v_cache[block_tables[s]].reshape(MB * BS, Hkv, D).astype(jnp.float32)
    qt = q[t].reshape(Hkv, G, D).astype(jnp.float32)
    scores = jnp.einsum("hgd,jhd->hgj", qt, keys, precision=hi) * sm_scale
    visible = jnp.arange(MB * BS) <= pos
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hgj,jhd->hgd", probs, vals, precision=hi).reshape(Hq, D)
    return jnp.where(valid & (pos >= 0), out, 0.0)

  out = lax.map(one_token, jnp.arange(T, dtype=jnp.int32), batch_size=min(T, 32))
  return out.astype(q.dtype)
