"""Tests for pallas_kernels/paged_attention.py.

Three layers, all on CPU:

* the pure-jnp reference against a float64 NumPy oracle written here;
* the Mosaic GPU kernel run in the Mosaic GPU interpreter (simulated GMEM/SMEM,
  TMA, barriers and wgmma) with race detection on, out-of-bounds reads raising
  and freshly allocated memory filled with NaN, against the reference and oracle;
* the kernel's hardware variant lowered for CUDA (the full Mosaic GPU lowering,
  no GPU needed), which checks TMA/wgmma/layout constraints the interpreter does
  not model.

Tolerances (max |a - b| <= atol + rtol * |b|, elementwise):
  reference (float32 inputs) vs float64 oracle ............ atol = rtol = 1e-5
  kernel (bf16 in, f32 softmax/accumulate, bf16 out) vs the
  reference / oracle on the same bf16-rounded inputs ....... atol = rtol = 2e-2
    (P is rounded to bf16 before P @ V and the output is rounded to bf16:
     ~2^-8 relative each).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels.paged_attention import (
    lower_for_cuda,
    ragged_paged_attention,
    ref_ragged_paged_attention,
)

REF_TOL = dict(atol=1e-5, rtol=1e-5)
KERNEL_TOL = dict(atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------
# Case construction and the float64 oracle.
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  hq: int
  hkv: int
  d: int
  bs: int
  pad_tokens: int = 3  # padding query rows after the real ones
  pad_slots: int = 1  # sequence slots beyond num_seqs
  spare_blocks: int = 3
  share_first_block: bool = False  # seq 1 reuses seq 0's first block (prefix hit)
  kv_tile: int = 64
  stages: int = 4
  splits: int | None = 1


def build(case: Case, seed: int = 0, dtype=jnp.bfloat16):
  """Returns (args tuple of jax arrays, numpy float64 copies, sm_scale)."""
  rng = np.random.default_rng(seed)
  n = len(case.q_lens)
  s = n + case.pad_slots
  blocks_per_seq = [-(-kv // case.bs) for kv in case.kv_lens]
  mb = max(blocks_per_seq + [1]) + 1  # one trailing arbitrary column
  nb = sum(blocks_per_seq) + case.spare_blocks
  ids = rng.permutation(nb)  # permuted (non-contiguous) block assignment
  tables = rng.integers(0, nb, size=(s, mb)).astype(np.int32)  # arbitrary ids
  used = 0
  for i, nblk in enumerate(blocks_per_seq):
    tables[i, :nblk] = ids[used:used + nblk]
    used += nblk
  if case.share_first_block:
    tables[1, 0] = tables[0, 0]
  qsl = np.zeros(s + 1, np.int32)
  qsl[1:n + 1] = np.cumsum(case.q_lens)
  qsl[n + 1:] = qsl[n]
  kv_lens = np.zeros(s, np.int32)
  kv_lens[:n] = case.kv_lens
  t = int(qsl[n]) + case.pad_tokens

  def rand(*shape):  # rounded to `dtype` so every implementation sees the same
    return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype)
                      .astype(jnp.float32))

  q, k, v = rand(t, case.hq, case.d), rand(nb, case.bs, case.hkv, case.d), \
      rand(nb, case.bs, case.hkv, case.d)
  args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(qsl),
          jnp.asarray([n], jnp.int32))
  np_args = (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
             kv_lens, tables, qsl, n)
  return args, np_args, case.d ** -0.5


QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize(args, np_args, dtype):
  """The case's K/V as a quantized cache: symmetric, one float32 scale per token
  and KV head (absmax / the type's largest value). Returns the kernel's args with
  1-byte caches, the (k_scale, v_scale) keywords, and np_args holding the
  dequantized values (what every implementation must attend over)."""
  top = QUANT_MAX[jnp.dtype(dtype)]
  out, scales, deq = list(args), {}, list(np_args)
  for i, name in ((1, "k_scale"), (2, "v_scale")):
    x = np.asarray(args[i], np.float32)
    sc = np.abs(x).max(-1)
    sc = np.where(sc > 0, sc / top, 1.0).astype(np.float32)
    y = x / sc[..., None]
    if dtype == jnp.int8:
      y = np.clip(np.rint(y), -127, 127)
    values = jnp.asarray(y, dtype)
    out[i], scales[name] = values, jnp.asarray(sc)
    deq[i] = np.asarray(values, np.float64) * sc[..., None].astype(np.float64)
  return tuple(out), scales, tuple(deq)


def oracle(q, k, v, kv_lens, tables, qsl, num_seqs, sm_scale):
  """Float64, loop-based: token i of sequence s sits at kv_len - q_len + i."""
  t, hq, d = q.shape
  bs, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  out = np.zeros((t, hq, d), np.float64)
  for s in range(num_seqs):
    q_len, kv_len = qsl[s + 1] - qsl[s], kv_lens[s]
    pos = np.arange(kv_len)
    keys = k[tables[s, pos // bs], pos % bs]  # [kv_len, hkv, d]
    vals = v[tables[s, pos // bs], pos % bs]
    for i in range(q_len):
      tok, p = qsl[s] + i, kv_len - q_len + i
      for h in range(hq):
        sc = keys[:p + 1, h // g] @ q[tok, h] * sm_scale
        w = np.exp(sc - sc.max())
        out[tok, h] = (w / w.sum()) @ vals[:p + 1, h // g]
  return out


def assert_close(actual, expected, tol, what):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  np.testing.assert_allclose(actual, expected, err_msg=what, **tol)


# GQA ratio 1/3/4/8, head dim 64/128, block size 16/32, each at least twice.
KERNEL_CASES = [
    # q_len 1 everywhere; 130 tokens = 3 KV tiles > 2 stages (slot reuse);
    # kv_len 1 and 17 give a 1-row and a partial last block.
    Case("decode_only_gqa4_d128_bs16", (1, 1, 1, 1), (1, 16, 17, 130),
         hq=8, hkv=2, d=128, bs=16, pad_slots=2, stages=2),
    # Fresh prefills: q_len == kv_len; 70 tokens at G=1 = 2 query tiles.
    Case("prefill_only_gqa1_d64_bs32", (70, 5), (70, 5), hq=2, hkv=2, d=64,
         bs=32),
    # Decodes, a chunked-prefill chunk (9 new of 40) and a fresh prefill
    # (q == kv == 30, 2 tiles of 21 tokens at G=3); 8 cache blocks per KV tile.
    Case("mixed_gqa3_d64_bs16", (1, 9, 1, 30), (50, 40, 1, 30), hq=6, hkv=2,
         d=64, bs=16, pad_tokens=4, kv_tile=128),
    # KV split in 3 (short sequences leave splits empty), G=8 -> 8-token tiles.
    Case("mixed_gqa8_d128_bs32_split3", (1, 12, 1), (200, 12, 95), hq=16,
         hkv=2, d=128, bs=32, stages=2, splits=3),
    # Automatic split choice; two sequences share a (prefix-cache) block.
    Case("decode_prefix_gqa4_d64_bs32_autosplit", (3, 1), (33, 64), hq=4,
         hkv=1, d=64, bs=32, share_first_block=True, splits=None),
    # GQA 1 at head dim 128 / block 16 and GQA 8 at 64 / 32 with splits 2.
    Case("mixed_gqa1_d128_bs16_split2", (2, 1), (20, 40), hq=2, hkv=2, d=128,
         bs=16, splits=2),
    Case("decode_gqa8_d64_bs16", (1, 1), (90, 7), hq=8, hkv=1, d=64, bs=16),
    Case("decode_gqa3_d128_bs32", (1, 4), (64, 4), hq=3, hkv=1, d=128, bs=32),
]


# ---------------------------------------------------------------------------
# Reference vs oracle (plain XLA, fast).
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_reference_matches_float64_oracle(case):
  args, np_args, scale = build(case, dtype=jnp.float32)
  got = ref_ragged_paged_attention(*args, sm_scale=scale)
  assert got.dtype == jnp.float32 and got.shape == args[0].shape
  assert_close(got, oracle(*np_args, scale), REF_TOL, case.name)


def test_reference_padding_rows_and_slots_are_zero():
  case = Case("pad", (2, 1), (5, 9), hq=4, hkv=2, d=64, bs=16, pad_tokens=5,
              pad_slots=3)
  args, _, scale = build(case, dtype=jnp.float32)
  got = np.asarray(ref_ragged_paged_attention(*args, sm_scale=scale))
  assert np.all(got[3:] == 0.0)
  # num_seqs = 0: everything is padding.
  empty = args[:6] + (jnp.asarray([0], jnp.int32),)
  assert np.all(np.asarray(ref_ragged_paged_attention(*empty, sm_scale=scale)) == 0)


# ---------------------------------------------------------------------------
# The kernel in the Mosaic GPU interpreter.
# ---------------------------------------------------------------------------
# A barrier bug makes the interpreter wait forever inside a callback, where a
# signal cannot interrupt it; the thread method ends the run with stack dumps.
@pytest.mark.timeout(600, method="thread")
class TestInterpretKernel:
  """Kernel under the Mosaic GPU interpreter (races detected, OOB reads raise,
  fresh memory is NaN so any unwritten output row would show up)."""

  @pytest.fixture(autouse=True)
  def _interpreter_state(self):
    _compat.reset_interpret_state()
    yield
    _compat.reset_interpret_state()

  def run(self, args, scale, case, **kw):
    out = ragged_paged_attention(
        *args, sm_scale=scale, interpret=True, kv_tile_tokens=case.kv_tile,
        num_stages=case.stages, num_kv_splits=case.splits, **kw)
    return jax.block_until_ready(out)

  @pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
  def test_matches_reference_and_oracle(self, case):
    args, np_args, scale = build(case)
    out = self.run(args, scale, case)
    assert out.shape == args[0].shape and out.dtype == jnp.bfloat16
    assert not _compat.races_found(), "race detector fired"
    f32_args = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                     for a in args)
    ref = ref_ragged_paged_attention(*f32_args, sm_scale=scale)
    assert_close(out, np.asarray(ref, np.float64), KERNEL_TOL, "vs reference")
    assert_close(out, oracle(*np_args, scale), KERNEL_TOL, "vs oracle")
    n_real = int(np_args[5][np_args[6]])
    assert np.all(np.asarray(out[n_real:], np.float32) == 0.0), "padding rows"

  @pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
  @pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
  def test_quantized_cache_matches_reference_and_oracle(self, case, dtype):
    """1-byte K/V widened in the kernel, the scales on S's and P's columns: the
    same attention as over the dequantized cache (KV tiles of 8 blocks, KV
    splits, a shared block)."""
    args, np_args, scale = build(case)
    qargs, scales, deq = quantize(args, np_args, dtype)
    out = self.run(qargs, scale, case, **scales)
    assert out.shape == args[0].shape and out.dtype == jnp.bfloat16
    assert not _compat.races_found(), "race detector fired"
    ref = ref_ragged_paged_attention(qargs[0].astype(jnp.float32), *qargs[1:],
                                     sm_scale=scale, **scales)
    assert_close(out, np.asarray(ref, np.float64), KERNEL_TOL, "vs reference")
    assert_close(out, oracle(*deq, scale), KERNEL_TOL, "vs oracle")
    n_real = int(np_args[5][np_args[6]])
    assert np.all(np.asarray(out[n_real:], np.float32) == 0.0), "padding rows"

  def test_all_slots_padding_gives_zeros(self):
    case = KERNEL_CASES[0]
    args, _, scale = build(case)
    args = args[:6] + (jnp.asarray([0], jnp.int32),)
    out = self.run(args, scale, case)
    assert np.all(np.asarray(out, np.float32) == 0.0)
    assert not _compat.races_found()

  def test_out_of_range_block_id_raises(self):
    case = KERNEL_CASES[0]
    args, _, scale = build(case)
    tables = np.array(args[4])
    num_blocks = args[1].shape[0]
    tables[3, 1] = num_blocks + 7  # a block sequence 3 (kv_len 130) does read
    args = args[:4] + (jnp.asarray(tables),) + args[5:]
    with _compat.quiet_callback_errors():
      with pytest.raises(_compat.InterpretRuntimeError, match="Out-of-bounds"):
        self.run(args, scale, case)


  @pytest.mark.skipif(
      not _compat.interpret_supports_transposed_wgmma(),
      reason="this jax's Mosaic GPU interpreter cannot run wgmma on a transposed"
      " SMEM ref (plgpu.transpose_ref); interpreted runs materialise K^T instead")
  def test_interpreter_runs_the_hardware_formulation(self):
    from pallas_kernels import paged_attention as pa
    case = KERNEL_CASES[0]
    args, _, scale = build(case)
    plan = pa._make_plan(*args[:3], args[4], sm_scale=scale, interpret=True,
                         kv_tile_tokens=64, num_stages=2, num_kv_splits=1)
    assert plan.transposed_k  # same kernel jaxpr as on hardware
    self.run(args, scale, case)
    assert not _compat.races_found()


# ---------------------------------------------------------------------------
# The hardware variant, lowered for CUDA on this CPU machine.
# ---------------------------------------------------------------------------
LOWERING_CONFIGS = [
    # (hq, hkv, d, bs, kv_tile, splits, dtype)
    (32, 8, 128, 16, 64, 1, jnp.bfloat16),
    (32, 8, 128, 16, 128, None, jnp.bfloat16),
    (6, 2, 64, 32, 128, 2, jnp.bfloat16),
    (8, 8, 64, 16, 64, 3, jnp.float16),
    (64, 8, 128, 32, 64, 1, jnp.bfloat16),
    (3, 1, 128, 32, 64, 2, jnp.bfloat16),
]


def _cfg_id(cfg):
  hq, hkv, d, bs, kv_tile, splits, dtype = cfg
  return (f"g{hq // hkv}_d{d}_bs{bs}_tile{kv_tile}_split{splits or 'auto'}"
          f"_{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("cfg", LOWERING_CONFIGS, ids=_cfg_id)
def test_hardware_kernel_lowers_for_cuda(cfg):
  hq, hkv, d, bs, kv_tile, splits, dtype = cfg
  t, s, mb, nb = 40, 5, 12, 64
  sds = jax.ShapeDtypeStruct
  text = lower_for_cuda(
      sds((t, hq, d), dtype), sds((nb, bs, hkv, d), dtype),
      sds((nb, bs, hkv, d), dtype), sds((s,), jnp.int32),
      sds((s, mb), jnp.int32), sds((s + 1,), jnp.int32), sds((1,), jnp.int32),
      sm_scale=d ** -0.5, kv_tile_tokens=kv_tile, num_kv_splits=splits)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("cfg", [
    (32, 8, 128, 16, 64, 1, jnp.int8),
    (6, 2, 64, 32, 128, 2, jnp.float8_e4m3fn),
    (3, 1, 64, 16, 64, None, jnp.int8),
    (8, 1, 128, 32, 128, 1, jnp.float8_e4m3fn),
], ids=_cfg_id)
def test_quantized_kernel_lowers_for_cuda(cfg):
  """1-byte caches: int8 / fp8 TMA tiles, their scales, the widening loads."""
  hq, hkv, d, bs, kv_tile, splits, kv_dtype = cfg
  t, s, mb, nb = 40, 5, 12, 64
  sds = jax.ShapeDtypeStruct
  text = lower_for_cuda(
      sds((t, hq, d), jnp.bfloat16), sds((nb, bs, hkv, d), kv_dtype),
      sds((nb, bs, hkv, d), kv_dtype), sds((s,), jnp.int32),
      sds((s, mb), jnp.int32), sds((s + 1,), jnp.int32), sds((1,), jnp.int32),
      sm_scale=d ** -0.5, k_scale=sds((nb, bs, hkv), jnp.float32),
      v_scale=sds((nb, bs, hkv), jnp.float32), kv_tile_tokens=kv_tile,
      num_kv_splits=splits)
  assert "mosaic_gpu" in text


# ---------------------------------------------------------------------------
# Argument validation (before any tracing).
# ---------------------------------------------------------------------------
def _good():
  args, _, scale = build(Case("v", (1, 2), (4, 6), hq=4, hkv=2, d=64, bs=16))
  return list(args), scale


def _with(i, value):
  def f(args):
    args[i] = value
    return args
  return f


VALIDATION_CASES = [
    ("q_rank", _with(0, jnp.zeros((4, 64), jnp.bfloat16)), r"q must be \[T, Hq, D\]"),
    ("hq_not_multiple", _with(0, jnp.zeros((5, 3, 64), jnp.bfloat16)),
     r"multiple of num KV heads"),
    ("head_dim", lambda a: [jnp.zeros((5, 4, 96), jnp.bfloat16),
                            jnp.zeros((8, 16, 2, 96), jnp.bfloat16),
                            jnp.zeros((8, 16, 2, 96), jnp.bfloat16), *a[3:]],
     r"unsupported head dim 96"),
    ("head_dim_mismatch", _with(0, jnp.zeros((5, 4, 128), jnp.bfloat16)),
     r"head dim mismatch"),
    ("v_shape", _with(2, jnp.zeros((3, 16, 2, 64), jnp.bfloat16)),
     r"v_cache shape"),
    ("table_rows", _with(4, jnp.zeros((2, 3), jnp.int32)),
     r"rows must equal len\(kv_lens\)"),
    ("qsl_len", _with(5, jnp.zeros((3,), jnp.int32)), r"length S\+1=4"),
    ("num_seqs_shape", _with(6, jnp.zeros((), jnp.int32)), r"num_seqs must have shape"),
    ("kv_lens_dtype", _with(3, jnp.zeros((3,), jnp.float32)), r"kv_lens must be int32"),
    ("float32_inputs", lambda a: [x.astype(jnp.float32) if x.dtype == jnp.bfloat16
                                  else x for x in a], r"bfloat16/float16"),
    ("cache_dtype", lambda a: [a[0], a[1].astype(jnp.float16), *a[2:]],
     r"cache dtype"),
]


@pytest.mark.parametrize("name,mutate,msg", VALIDATION_CASES,
                         ids=[c[0] for c in VALIDATION_CASES])
def test_argument_validation(name, mutate, msg):
  args, scale = _good()
  with pytest.raises(ValueError, match=msg):
    ragged_paged_attention(*mutate(args), sm_scale=scale, interpret=True)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(sm_scale=0.0), "sm_scale"),
    (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(sm_scale=0.1, kv_tile_tokens=96), "kv_tile_tokens"),
    (dict(sm_scale=0.1, num_stages=0), "num_stages"),
    (dict(sm_scale=0.1, num_kv_splits=0), "num_kv_splits"),
    (dict(sm_scale=0.1, kv_tile_tokens=256, num_stages=2), "SMEM"),
    (dict(sm_scale=0.1, interpret="yes"), "interpret"),
], ids=["scale0", "scale_nan", "kv_tile", "stages", "splits", "smem", "interp"])
def test_keyword_validation(kwargs, msg):
  args, _ = _good()
  if "SMEM" in msg:  # needs head dim 128 to overflow
    args = [jnp.zeros((3, 4, 128), jnp.bfloat16),
            jnp.zeros((8, 16, 2, 128), jnp.bfloat16),
            jnp.zeros((8, 16, 2, 128), jnp.bfloat16), *args[3:]]
  kwargs.setdefault("interpret", True)
  with pytest.raises(ValueError, match=msg):
    ragged_paged_attention(*args, **kwargs)


def test_quantized_cache_validation():
  args, scale = _good()
  i8 = [args[0], args[1].astype(jnp.int8), args[2].astype(jnp.int8), *args[3:]]
  sc = jnp.ones(args[1].shape[:3], jnp.float32)
  with pytest.raises(ValueError, match="needs k_scale and v_scale"):
    ragged_paged_attention(*i8, sm_scale=scale, interpret=True)
  with pytest.raises(ValueError, match="both or neither"):
    ragged_paged_attention(*i8, sm_scale=scale, interpret=True, k_scale=sc)
  with pytest.raises(ValueError, match="not bfloat16"):
    ragged_paged_attention(*args, sm_scale=scale, interpret=True, k_scale=sc, v_scale=sc)
  with pytest.raises(ValueError, match=r"v_scale must be float32 \(5, 16, 2\)"):
    ragged_paged_attention(*i8, sm_scale=scale, interpret=True, k_scale=sc, v_scale=sc[:, :8])
  with pytest.raises(ValueError, match="must both be the q dtype"):  # K int8, V bf16
    ragged_paged_attention(args[0], i8[1], *args[2:], sm_scale=scale, interpret=True,
                           k_scale=sc, v_scale=sc)


def test_reference_validates_too():
  args, scale = _good()
  with pytest.raises(ValueError, match="rows must equal"):
    ref_ragged_paged_attention(*_with(4, jnp.zeros((2, 3), jnp.int32))(args),
                               sm_scale=scale)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-only behaviour")
def test_hardware_mode_without_gpu_is_a_clear_error():
  args, scale = _good()
  with pytest.raises(ValueError, match="interpret=True"):
    ragged_paged_attention(*args, sm_scale=scale)


# ---------------------------------------------------------------------------
# On a Hopper GPU: the compiled kernel against the reference.
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_hardware_matches_reference(case):
  args, np_args, scale = build(case)
  out = ragged_paged_attention(
      *args, sm_scale=scale, kv_tile_tokens=case.kv_tile,
      num_stages=case.stages, num_kv_splits=case.splits)
  assert_close(out, oracle(*np_args, scale), KERNEL_TOL, case.name)
