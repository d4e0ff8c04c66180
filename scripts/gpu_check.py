#!/usr/bin/env python
"""Hopper (H100/H200) check of the Pallas ragged paged attention kernel.

    python scripts/gpu_check.py --out results.json          # on the GPU, < 8 min
    python scripts/gpu_check.py --dry-run --out dry.json    # CPU: shapes, reference,
                                                            # XLA path, CUDA lowering

Steps (GPU run):
  1. copy-bandwidth ceiling: a large device-to-device copy (bytes read + written / t);
  2. correctness on 3 shapes: kernel (and the plain-XLA path) vs the f32 reference;
  3. decode sweep: batch {1, 8, 32, 128} x context {1k, 4k, 16k}, 32 query heads,
     8 KV heads, head dim 128, block size 16, bf16. Caches are spread over enough
     disjoint block regions (a different block table per call) that L2 stays cold.
     Reports K+V bytes read / time and % of the copy ceiling, for the kernel and the
     plain-XLA path on the same inputs;
  4. one mixed batch: 64 decodes + a 512-token prefill chunk;
  5. a compact table on stdout and everything in JSON.

Times are per call, including the jitted wrapper around the kernel (work list,
Q layout, output gather), measured as the median of several timed groups of
back-to-back calls inside one executable (dispatch is amortised, L2 is not warm).
Exit status: 0 ok, 1 a check failed or errored, 2 no suitable GPU (or bad usage).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.paged_attention import (  # noqa: E402
    lower_for_cuda,
    ragged_paged_attention,
    ref_ragged_paged_attention,
)

TIME_BUDGET_S = 7 * 60  # leave headroom under the 8-minute target
L2_COLD_BYTES = 200e6  # rotate through at least this much KV (~4x the 50 MB L2)
TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 kernel vs f32 reference (as in the tests)
SWEEP_BATCHES = (1, 8, 32, 128)
SWEEP_CONTEXTS = (1024, 4096, 16384)
HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 128, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="gpu_check.json", help="JSON results path")
  p.add_argument("--dry-run", action="store_true",
                 help="CPU-safe parts only: shapes, reference, XLA path, lowering")
  p.add_argument("--reps", type=int, default=7, help="timed groups per shape")
  p.add_argument("--tune", action="store_true",
                 help="also sweep kv_tile_tokens x num_stages on one shape")
  args = p.parse_args(argv)
  if args.reps < 1:
    p.error("--reps must be >= 1")
  return args


def xla_path() -> tuple[Callable[..., jax.Array], str]:
  try:
    from runtime.attention import xla_ragged_paged_attention
  except ImportError as e:
    print(f"note: runtime.attention.xla_ragged_paged_attention unavailable ({e});"
          " timing the pure-jnp reference as the XLA path instead")
    return ref_ragged_paged_attention, "reference (fallback)"
  return xla_ragged_paged_attention, "runtime.attention.xla_ragged_paged_attention"


def hopper_device() -> tuple[Any | None, str]:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if not gpus:
    return None, f"no GPU visible to JAX (default backend: {jax.default_backend()})"
  dev = gpus[0]
  kind = getattr(dev, "device_kind", "?")
  cc = str(getattr(dev, "compute_capability", ""))
  if cc.startswith("9") or any(x in kind for x in ("H100", "H200", "H800", "GH200")):
    return dev, kind
  return None, f"GPU {kind!r} (compute capability {cc or '?'}) is not Hopper (sm_90)"


# ---------------------------------------------------------------------------
# Batches.
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
  """A ragged batch description; arrays are built by `host_arrays`."""
  name: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  hq: int = HQ
  hkv: int = HKV
  d: int = HEAD_DIM
  bs: int = BLOCK
  pad_tokens: int = 0
  pad_slots: int = 0
  num_kv_splits: int | None = None

  @property
  def num_tokens(self) -> int:
    return sum(self.q_lens) + self.pad_tokens

  @property
  def num_slots(self) -> int:
    return len(self.q_lens) + self.pad_slots

  @property
  def max_blocks(self) -> int:
    return max(-(-kv // self.bs) for kv in self.kv_lens)

  @property
  def blocks_per_region(self) -> int:
    return self.num_slots * self.max_blocks

  @property
  def kv_bytes(self) -> int:  # K and V bytes the attention must read (bf16)
    return sum(self.kv_lens) * self.hkv * self.d * 2 * 2

  def shape_structs(self, dtype=jnp.bfloat16, regions: int = 1):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    nb = regions * self.blocks_per_region + 1
    s = self.num_slots
    return (sds((self.num_tokens, self.hq, self.d), dtype),
            sds((nb, self.bs, self.hkv, self.d), dtype),
            sds((nb, self.bs, self.hkv, self.d), dtype),
            sds((s,), i32), sds((s, self.max_blocks), i32), sds((s + 1,), i32),
            sds((1,), i32))


def host_metadata(b: Batch, regions: int, seed: int):
  """kv_lens, per-region block tables [regions, S, MB], qsl, num_seqs (numpy)."""
  rng = np.random.default_rng(seed)
  n, s, mb = len(b.q_lens), b.num_slots, b.max_blocks
  kv = np.zeros(s, np.int32)
  kv[:n] = b.kv_lens
  qsl = np.zeros(s + 1, np.int32)
  qsl[1:n + 1] = np.cumsum(b.q_lens)
  qsl[n + 1:] = qsl[n]
  # Block 0 is a spare; every region owns a disjoint, shuffled set of blocks.
  ids = 1 + rng.permutation(regions * b.blocks_per_region).astype(np.int32)
  tables = ids.reshape(regions, s, mb)
  return kv, tables, qsl, np.array([n], np.int32)


def device_batch(b: Batch, regions: int, seed: int):
  kv, tables, qsl, ns = host_metadata(b, regions, seed)
  key = jax.random.key(seed)
  kq, kk, kv_key = jax.random.split(key, 3)
  nb = regions * b.blocks_per_region + 1
  shape = (nb, b.bs, b.hkv, b.d)
  q = jax.random.normal(kq, (b.num_tokens, b.hq, b.d), jnp.bfloat16)
  k = jax.random.uniform(kk, shape, jnp.bfloat16, -1.0, 1.0)
  v = jax.random.uniform(kv_key, shape, jnp.bfloat16, -1.0, 1.0)
  return q, k, v, jnp.asarray(kv), jnp.asarray(tables), jnp.asarray(qsl), jnp.asarray(ns)


def correctness_batches() -> list[Batch]:
  rng = np.random.default_rng(7)
  lens = tuple(int(x) for x in rng.integers(1, 3000, size=16))
  return [
      Batch("decode_16_mixed_lens", (1,) * 16, lens, pad_tokens=5, pad_slots=3),
      Batch("mixed_gqa8_bs32", (1,) * 8 + (100, 257), (900,) * 8 + (700, 257),
            hq=64, hkv=8, bs=32, pad_tokens=7, pad_slots=1),
      Batch("prefill_gqa1_d64_split4", (1000, 37), (1000, 37), hq=8, hkv=8, d=64,
            pad_tokens=3, num_kv_splits=4),
  ]


def sweep_batches() -> list[Batch]:
  return [Batch(f"decode_b{b}_ctx{c}", (1,) * b, (c,) * b)
          for c in SWEEP_CONTEXTS for b in SWEEP_BATCHES]


def mixed_batch() -> Batch:
  return Batch("mixed_64dec_512pf", (1,) * 64 + (512,), (2048,) * 64 + (2560,))


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------
def regions_for(b: Batch) -> int:
  return int(min(64, max(1, math.ceil(L2_COLD_BYTES / max(b.kv_bytes, 1)))))


def time_attention(attn: Callable[..., jax.Array], arrays, reps: int) -> float:
  """Seconds per call. Calls run back to back inside one executable, each on a
  different block-table region; groups of them are timed from Python."""
  q, k, v, kv, tables, qsl, ns = arrays
  regions = tables.shape[0]
  inner = min(8, regions)
  groups = [tables[g * inner:(g + 1) * inner] for g in range(max(1, regions // inner))]

  @jax.jit
  def run(q, k, v, kv, tabs, qsl, ns):
    total = jnp.float32(0)
    for i in range(inner):
      total = total + jnp.sum(attn(q, k, v, kv, tabs[i], qsl, ns).astype(jnp.float32))
    return total

  jax.block_until_ready(run(q, k, v, kv, groups[0], qsl, ns))  # compile
  for g in groups[:2]:
    jax.block_until_ready(run(q, k, v, kv, g, qsl, ns))
  per_group = []
  for r in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(run(q, k, v, kv, groups[r % len(groups)], qsl, ns))
    per_group.append(time.perf_counter() - t0)
  return float(np.median(per_group)) / inner


def copy_ceiling(nbytes: int = 2 << 30, reps: int = 10) -> float:
  """Bytes/s of a large device-to-device copy (read + write counted)."""
  n = nbytes // 4
  x = jnp.arange(n, dtype=jnp.uint32)
  f = jax.jit(lambda a, c: a ^ c)  # c is a runtime value: nothing folds away
  c = jnp.uint32(0x5A5A5A5A)
  jax.block_until_ready(f(x, c))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x, c))
    times.append(time.perf_counter() - t0)
  return 2 * n * 4 / min(times)


# ---------------------------------------------------------------------------
# Steps.
# ---------------------------------------------------------------------------
def max_err(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def within_tol(out, ref) -> bool:
  out = np.asarray(jnp.asarray(out, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  return bool(np.all(np.abs(out - ref) <= TOL["atol"] + TOL["rtol"] * np.abs(ref)))


def check_correctness(b: Batch, xla_fn, *, on_gpu: bool) -> dict[str, Any]:
  q, k, v, kv, tables, qsl, ns = device_batch(b, regions=1, seed=11)
  args = (q, k, v, kv, tables[0], qsl, ns)
  scale = b.d ** -0.5
  f32 = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
  ref = jax.jit(functools.partial(ref_ragged_paged_attention, sm_scale=scale))(*f32)
  xla_out = xla_fn(*args, sm_scale=scale)
  res: dict[str, Any] = {
      "name": b.name, "tokens": b.num_tokens, "seqs": len(b.q_lens),
      "hq": b.hq, "hkv": b.hkv, "d": b.d, "bs": b.bs,
      "xla_max_err": max_err(xla_out, ref), "xla_ok": within_tol(xla_out, ref),
  }
  if on_gpu:
    out = ragged_paged_attention(*args, sm_scale=scale, num_kv_splits=b.num_kv_splits)
    res.update(kernel_max_err=max_err(out, ref), kernel_ok=within_tol(out, ref))
  else:
    lower_for_cuda(*b.shape_structs(), sm_scale=scale, num_kv_splits=b.num_kv_splits)
    res.update(kernel_lowered_for_cuda=True)
  return res


def bench(b: Batch, xla_fn, xla_name: str, ceiling: float, reps: int,
          kernel_kw: dict[str, Any] | None = None, with_xla: bool = True) -> dict[str, Any]:
  regions = regions_for(b)
  arrays = device_batch(b, regions, seed=3)
  scale = b.d ** -0.5
  kw = dict(kernel_kw or {})
  kernel = functools.partial(ragged_paged_attention, sm_scale=scale, **kw)
  t_k = time_attention(kernel, arrays, reps)
  res = {"name": b.name, "batch": len(b.q_lens), "tokens": b.num_tokens,
         "kv_bytes": b.kv_bytes, "regions": regions, "kernel_kwargs": kw,
         "kernel_s": t_k, "kernel_GBps": b.kv_bytes / t_k / 1e9,
         "kernel_pct_ceiling": 100 * b.kv_bytes / t_k / ceiling}
  if with_xla:
    t_x = time_attention(functools.partial(xla_fn, sm_scale=scale), arrays, reps)
    res.update(xla_path=xla_name, xla_s=t_x, xla_GBps=b.kv_bytes / t_x / 1e9,
               xla_pct_ceiling=100 * b.kv_bytes / t_x / ceiling,
               speedup_vs_xla=t_x / t_k)
  del arrays
  return res


def print_table(rows: list[dict[str, Any]]) -> None:
  hdr = (f"{'shape':<22}{'KV MB':>9}{'kernel us':>11}{'GB/s':>8}{'%ceil':>7}"
         f"{'xla us':>10}{'GB/s':>8}{'%ceil':>7}{'speedup':>9}")
  print(hdr)
  print("-" * len(hdr))
  for r in rows:
    if "error" in r:
      print(f"{r['name']:<22}  ERROR: {r['error'][:80]}")
      continue
    x = (f"{r['xla_s'] * 1e6:>10.1f}{r['xla_GBps']:>8.0f}{r['xla_pct_ceiling']:>7.1f}"
         f"{r['speedup_vs_xla']:>9.2f}") if "xla_s" in r else ""
    print(f"{r['name']:<22}{r['kv_bytes'] / 1e6:>9.1f}{r['kernel_s'] * 1e6:>11.1f}"
          f"{r['kernel_GBps']:>8.0f}{r['kernel_pct_ceiling']:>7.1f}{x}")


def dry_run(args: argparse.Namespace) -> int:
  """Everything that does not need a GPU, at the real shapes where affordable."""
  t0 = time.time()
  xla_fn, xla_name = xla_path()
  results: dict[str, Any] = {"dry_run": True, "jax": jax.__version__,
                             "backend": jax.default_backend(), "xla_path": xla_name}
  print(f"dry run on {jax.default_backend()}: no timing; lowering the kernel for CUDA")
  results["correctness"] = []
  failed = False
  for b in correctness_batches():
    r = check_correctness(b, xla_fn, on_gpu=False)
    failed |= not r["xla_ok"]
    print(f"  correctness {b.name}: reference ok, XLA path max err"
          f" {r['xla_max_err']:.2e} ({'ok' if r['xla_ok'] else 'FAIL'}), kernel lowered")
    results["correctness"].append(r)
  planned = []
  for b in sweep_batches() + [mixed_batch()]:
    regions = regions_for(b)
    lower_for_cuda(*b.shape_structs(regions=regions), sm_scale=b.d ** -0.5)
    kv, tables, qsl, ns = host_metadata(b, regions, seed=3)  # shape building
    assert tables.shape == (regions, b.num_slots, b.max_blocks)
    planned.append({"name": b.name, "tokens": b.num_tokens, "kv_bytes": b.kv_bytes,
                    "regions": regions,
                    "cache_bytes": 2 * (regions * b.blocks_per_region + 1) * b.bs
                    * b.hkv * b.d * 2})
    print(f"  planned {b.name:<22} KV {b.kv_bytes / 1e6:9.1f} MB, {regions:2d}"
          f" regions, caches {planned[-1]['cache_bytes'] / 1e9:6.2f} GB: lowered")
  results["planned"] = planned
  results["seconds"] = time.time() - t0
  Path(args.out).write_text(json.dumps(results, indent=2))
  print(f"dry run {'FAILED' if failed else 'ok'} in {results['seconds']:.0f}s;"
        f" wrote {args.out}")
  return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.dry_run:
    return dry_run(args)
  dev, desc = hopper_device()
  if dev is None:
    print(f"gpu_check: {desc}. This check needs an NVIDIA Hopper GPU (H100/H200);"
          " run with --dry-run to exercise the CPU-safe parts.", file=sys.stderr)
    return 2
  start = time.time()
  xla_fn, xla_name = xla_path()
  results: dict[str, Any] = {"device": desc, "jax": jax.__version__,
                             "xla_path": xla_name, "dry_run": False, "notes": []}
  failed = False

  ceiling = copy_ceiling()
  results["copy_ceiling_GBps"] = ceiling / 1e9
  print(f"device {desc}; jax {jax.__version__}; copy ceiling {ceiling / 1e9:.0f} GB/s")

  results["correctness"] = []
  for b in correctness_batches():
    try:
      r = check_correctness(b, xla_fn, on_gpu=True)
    except Exception as e:  # noqa: BLE001 - report and carry on
      r = {"name": b.name, "error": f"{type(e).__name__}: {e}"}
    ok = r.get("kernel_ok", False)
    failed |= not ok
    print(f"correctness {b.name:<26} kernel max err {r.get('kernel_max_err', float('nan')):.2e}"
          f" {'ok' if ok else 'FAIL'}; XLA max err {r.get('xla_max_err', float('nan')):.2e}"
          + (f"  [{r['error'][:100]}]" if "error" in r else ""))
    results["correctness"].append(r)

  rows = []
  for b in sweep_batches() + [mixed_batch()]:
    if time.time() - start > TIME_BUDGET_S:
      results["notes"].append(f"{b.name}: skipped (time budget)")
      print(f"skip {b.name}: time budget")
      continue
    try:
      r = bench(b, xla_fn, xla_name, ceiling, args.reps)
    except Exception as e:  # noqa: BLE001
      r = {"name": b.name, "error": f"{type(e).__name__}: {e}"}
      failed = True
    rows.append(r)
    if "error" not in r:
      print(f"{b.name:<22} kernel {r['kernel_s'] * 1e6:9.1f} us {r['kernel_GBps']:6.0f} GB/s"
            f" ({r['kernel_pct_ceiling']:4.1f}%)  xla {r.get('xla_s', float('nan')) * 1e6:9.1f} us")
  results["sweep"] = [r for r in rows if not r["name"].startswith("mixed")]
  results["mixed"] = next((r for r in rows if r["name"].startswith("mixed")), None)

  if args.tune and time.time() - start < TIME_BUDGET_S - 60:
    tb = Batch("tune_b32_ctx4096", (1,) * 32, (4096,) * 32)
    results["tune"] = []
    for kv_tile in (64, 128):
      for stages in (2, 3, 4):
        try:
          r = bench(tb, xla_fn, xla_name, ceiling, args.reps, with_xla=False,
                    kernel_kw=dict(kv_tile_tokens=kv_tile, num_stages=stages))
        except Exception as e:  # noqa: BLE001
          r = {"name": tb.name, "error": f"{type(e).__name__}: {e}",
               "kernel_kwargs": dict(kv_tile_tokens=kv_tile, num_stages=stages)}
        results["tune"].append(r)
        print(f"tune {r['kernel_kwargs']}: "
              + (f"{r['kernel_GBps']:.0f} GB/s" if "error" not in r else r["error"][:100]))

  print()
  print(f"copy ceiling {ceiling / 1e9:.0f} GB/s (read+write); attention rates count"
        " K+V bytes read; times include the jitted wrapper")
  print_table(rows)
  results["seconds"] = time.time() - start
  Path(args.out).write_text(json.dumps(results, indent=2, default=str))
  print(f"\n{'FAILED' if failed else 'ok'} in {results['seconds']:.0f}s; wrote {args.out}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
