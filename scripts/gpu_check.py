#!/usr/bin/env python
"""Hopper (H100/H200) check of the Pallas ragged paged attention kernel.

    python scripts/gpu_check.py --out results.json          # on the GPU, < 8 min
    python scripts/gpu_check.py --dry-run --out dry.json    # CPU: shapes, reference,
                                                            # XLA path, CUDA lowering
    ... --engine-checkpoint checkpoints/smollm2-135m-instruct   # + engine greedy parity

Steps (GPU run):
  1. copy-bandwidth ceiling: a large device-to-device copy (bytes read + written / t);
  2. correctness on 3 shapes: kernel and the plain-XLA path vs the f32 reference;
  3. decode sweep: batch {1, 8, 32, 128} x context {1k, 4k, 16k}, 32 query heads,
     8 KV heads, head dim 128, block size 16, bf16. Each shape's cache holds enough
     disjoint block regions (>= 200 MB in all, 4x the 50 MB L2) and consecutive calls
     walk them cyclically, so every call reads K/V that left L2 long ago. Reports
     bytes moved (K+V read, q read, out written) / time and % of the copy ceiling,
     for the kernel and the plain-XLA path on the same inputs (the XLA path is
     skipped, with a note, when it would not fit the memory or time budget), and
     cross-checks the two outputs;
  4. one mixed batch: 64 decodes + a 512-token prefill chunk; then the w4a16 matmul
     (scripts/gpu_w4a16.py): the Pallas 4-bit kernel against a bf16 dense matmul and
     XLA's dequantizing path on Llama-3-8B's projection shapes at 1, 8 and 64 rows;
  5. optional (--engine-checkpoint DIR): two engines (attention_backend pallas and
     xla, bfloat16) generate greedily for 3 chat prompts; token ids are compared;
  6. a compact table on stdout and everything in JSON (rewritten after every step,
     so a timeout or a hang still leaves the results so far).

Times are per call, including the jitted wrapper around the kernel (work list,
Q layout, output gather): several calls are unrolled inside one executable and
several executables are dispatched back to back before one wait, so dispatch and
the host round trip are amortised; the median over samples is reported.
Exit status: 0 ok, 1 a check failed or errored, 2 no suitable GPU (or bad usage),
3 the watchdog fired (something hung or ran far over budget).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels.paged_attention import (  # noqa: E402
    lower_for_cuda,
    ragged_paged_attention,
    ref_ragged_paged_attention,
)
import gpu_w4a16  # noqa: E402  (scripts/: the w4a16 matmul step)

T_PROCESS_START = time.time()
TIME_BUDGET_S = 7 * 60  # no new step starts after this (from process start)
WATCHDOG_S = 7 * 60 + 40  # hard stop: write what we have and exit 3
STEP_HANG_S = 150  # ... also when one step (one shape: compiles + timing) takes this long
ENGINE_HANG_S = 240  # ... or the engine check (two engines, compiles included)
ENGINE_RESERVE_S = 110  # kept free for --engine-checkpoint (two engines, compile included)
L2_COLD_BYTES = 200e6  # rotate through at least this much KV (~4x the 50 MB L2)
UNROLL_BYTES = 64e6  # unroll small shapes until one executable reads about this much
TARGET_SAMPLE_S = 5e-3  # each timing sample dispatches groups until ~this long
MAX_GROUPS_PER_SAMPLE = 64
STEP_TIMING_BUDGET_S = 20.0  # timed samples of one path on one shape (not compile)
XLA_MAX_CALL_S = 1.0  # the XLA path is not timed further if one call takes longer
XLA_MIN_LEFT_S = 25.0  # ... or if less than this is left of the time budget
XLA_MEM_FRACTION = 0.5  # ... or if its estimated working set exceeds this share of free memory
TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 kernel vs f32 reference (as in the tests)
NEAR_TIE_NATS = 0.5  # engine check: a divergence at a near tie (bf16 logits) is not a failure
SWEEP_BATCHES = (1, 8, 32, 128)
SWEEP_CONTEXTS = (1024, 4096, 16384)
HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 128, 16
CHAT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "List two prime numbers.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="gpu_check.json", help="JSON results path")
  p.add_argument("--dry-run", action="store_true",
                 help="CPU-safe parts only: shapes, reference, XLA path, lowering")
  p.add_argument("--reps", type=int, default=7, help="timing samples per shape")
  p.add_argument("--tune", action="store_true",
                 help="also sweep kv_tile_tokens x num_stages on one shape")
  p.add_argument("--engine-checkpoint", type=Path, default=None, metavar="DIR",
                 help="converted checkpoint (e.g. checkpoints/smollm2-135m-instruct): compare"
                 " greedy tokens of attention_backend=pallas vs xla (dry run: xla only)")
  p.add_argument("--engine-max-tokens", type=int, default=24,
                 help="greedy tokens per prompt in the engine check")
  p.add_argument("--engine-tps", action="store_true",
                 help="engine decode TPS of a Llama-3-8B-shaped model with random bf16 weights made on"
                 " the device, at B in 1,16,64,B_max, against the planner, with exposed host time"
                 " (dry run: a scaled-down shape in float32 on CPU)")
  p.add_argument("--engine-variants", default="bf16,w8a16,w4a16,fp8kv,int8kv,llama31,gemma3,mixtral,deepseek",
                 help="engine TPS runs: bf16 weights; w8a16 (int8 weights); w4a16 (4-bit weights, the Pallas "
                      "w4a16 kernel); fp8kv (fp8_e4m3 KV cache, read by the Pallas kernel); int8kv "
                      "(int8 KV cache with a scale and zero per 8 (K) or 32 (V) channels: the XLA attention path); llama31 (Llama 3.1 8B: llama3 RoPE); "
                      "gemma3 (a Gemma-3-1B shape: sliding-window KV groups, XLA attention); mixtral (8 of "
                      "Mixtral 8x7B's layers: 8 experts, top 2, through ragged_dot); deepseek (8 of "
                      "DeepSeek-V2-Lite's layers: the latent MLA cache on the XLA path, 64 experts top 6 + 2 shared)")
  args = p.parse_args(argv)
  if args.reps < 1:
    p.error("--reps must be >= 1")
  if not 1 <= args.engine_max_tokens <= 256:
    p.error("--engine-max-tokens must be in 1..256")
  return args


def xla_path() -> tuple[Callable[..., jax.Array], str]:
  try:
    from runtime.model.xla_attention import xla_ragged_paged_attention
  except ImportError as e:
    print(f"note: runtime.model.xla_attention.xla_ragged_paged_attention unavailable ({e});"
          " timing the pure-jnp reference as the XLA path instead")
    return ref_ragged_paged_attention, "reference (fallback)"
  return xla_ragged_paged_attention, "runtime.model.xla_attention.xla_ragged_paged_attention"


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


def free_device_bytes() -> int | None:
  """Free bytes in the allocator of the default device, when it reports them."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - not every backend has memory_stats
    return None
  if "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


# ---------------------------------------------------------------------------
# Results: written after every step; the watchdog writes them on a hang.
# ---------------------------------------------------------------------------
class Recorder:
  """Holds the results, rewrites the JSON after every step, and (GPU run) watches
  for a hang: a step running past its limit, or the whole run past WATCHDOG_S,
  makes it write what it has and exit with status 3."""

  def __init__(self, path: str, results: dict[str, Any]):
    self.path, self.results = Path(path), results
    self.step, self.step_t0, self.step_limit = "start", time.time(), float("inf")
    self.done = False
    self._lock = threading.Lock()

  @property
  def step(self) -> str:
    return self._step

  @step.setter
  def step(self, name: str) -> None:  # a new step: restart its hang clock
    self._step, self.step_t0 = name, time.time()
    self.step_limit = ENGINE_HANG_S if name == "engine" else STEP_HANG_S

  def save(self) -> None:
    with self._lock:
      self.results["seconds"] = time.time() - T_PROCESS_START
      text = json.dumps(self.results, indent=2, default=str)
      tmp = self.path.with_name(self.path.name + ".tmp")
      tmp.write_text(text)
      os.replace(tmp, self.path)

  def start_watchdog(self, total_s: float) -> None:
    def fire(why: str) -> None:
      msg = f"watchdog: {why} in step {self._step!r}; wrote partial results to {self.path}"
      try:
        self.results.setdefault("notes", []).append(msg)
        self.results["watchdog"] = self._step
        self.save()
      finally:
        print(f"\n{msg}", file=sys.stderr, flush=True)
        os._exit(3)

    def watch() -> None:
      while not self.done:
        time.sleep(1.0)
        now = time.time()
        if self.done:
          return
        if now - T_PROCESS_START > total_s:
          fire(f"run past {total_s:.0f}s")
        if now - self.step_t0 > self.step_limit:
          fire(f"no progress for {now - self.step_t0:.0f}s (hung?)")

    threading.Thread(target=watch, name="gpu_check-watchdog", daemon=True).start()


def time_left() -> float:
  return TIME_BUDGET_S - (time.time() - T_PROCESS_START)


# ---------------------------------------------------------------------------
# Batches.
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
  """A ragged batch description; arrays are built by `device_batch`."""
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
  def kv_token_bytes(self) -> int:  # K and V of one token, all KV heads (bf16)
    return self.hkv * self.d * 2 * 2

  @property
  def kv_bytes(self) -> int:
    """K+V bytes the attention must read: every sequence's context, once."""
    return sum(self.kv_lens) * self.kv_token_bytes

  @property
  def q_bytes(self) -> int:  # q read, and the same again for out written
    return self.num_tokens * self.hq * self.d * 2

  @property
  def io_bytes(self) -> int:
    """Bytes an ideal kernel moves: K+V once, q read, out written."""
    return self.kv_bytes + 2 * self.q_bytes

  def kernel_kv_bytes(self, kv_tile: int = 64) -> int:
    """K+V bytes the kernel's TMA copies request: each query tile (64 // G tokens)
    reads its causal prefix in whole KV tiles, so prefill chunks re-read context
    (much of it from L2). Equal to kv_bytes for decode with kv_len % kv_tile == 0."""
    tq = 64 // (self.hq // self.hkv)
    tokens = 0
    for ql, kl in zip(self.q_lens, self.kv_lens):
      for lo in range(0, ql, tq):
        last = kl - ql + min(ql, lo + tq)  # tokens visible to the tile's last row
        tokens += -(-last // kv_tile) * kv_tile
    return tokens * self.kv_token_bytes

  def cache_bytes(self, regions: int) -> int:  # K and V caches together
    return 2 * (regions * self.blocks_per_region + 1) * self.bs * self.hkv * self.d * 2

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
  arrays = (q, k, v, jnp.asarray(kv), jnp.asarray(tables), jnp.asarray(qsl), jnp.asarray(ns))
  return jax.block_until_ready(arrays)


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


def kernel_plan(b: Batch, regions: int = 1, **kernel_kw) -> dict[str, Any]:
  """The kernel's static plan for a shape (splits, stages after the SMEM fit, ...)."""
  try:
    from pallas_kernels.paged_attention import _make_plan  # private: informational only
    q, k, v, _, bt, _, _ = b.shape_structs(regions=regions)
    kw = dict(kv_tile_tokens=64, num_stages=4, num_kv_splits=b.num_kv_splits)
    kw.update(kernel_kw)
    p = _make_plan(q, k, v, bt, sm_scale=b.d ** -0.5, interpret=False, **kw)
    return dict(num_work=p.num_work, kv_tile=p.kv_tile, num_stages=p.num_stages,
                num_splits=p.num_splits, smem_bytes=p.smem_bytes())
  except Exception as e:  # noqa: BLE001
    return {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------
def regions_for(b: Batch) -> int:
  return int(min(64, max(1, math.ceil(L2_COLD_BYTES / max(b.kv_bytes, 1)))))


def unroll_for(b: Batch) -> int:
  """Calls per executable: small shapes take a few microseconds of GPU time, less
  than a dispatch, so several run back to back inside one executable."""
  return int(min(8, max(1, math.ceil(UNROLL_BYTES / max(b.kv_bytes, 1)))))


@dataclasses.dataclass
class Timing:
  s: float  # median seconds per call
  min_s: float
  max_s: float
  calls: int  # timed calls
  unroll: int  # calls per executable
  groups: int  # executables dispatched per sample
  first_s: float  # compile + first run
  out: Any  # output of the first call (region 0), for cross-checks

  def summary(self) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(self).items() if k != "out"}


class TooSlow(Exception):
  pass


def time_attention(attn: Callable[..., jax.Array], arrays, reps: int, *, unroll: int,
                   budget_s: float = STEP_TIMING_BUDGET_S,
                   max_call_s: float | None = None) -> Timing:
  """Seconds per call. Call number c (over warm-up and timing) reads block-table
  region c % regions, so a region is re-read only after all the others (>= ~200 MB
  of other K/V) went through L2. `unroll` calls run inside one executable; each
  sample dispatches `groups` executables back to back and waits once."""
  q, k, v, kv, tables, qsl, ns = arrays
  regions = int(tables.shape[0])

  @jax.jit
  def run(q, k, v, kv, tables, qsl, ns, start):
    outs = []
    for i in range(unroll):
      tab = lax.dynamic_index_in_dim(tables, (start + i) % regions, axis=0, keepdims=False)
      outs.append(attn(q, k, v, kv, tab, qsl, ns))
    return outs  # every output is live: nothing is dead-code eliminated

  starts = [jax.device_put(np.int32(r)) for r in range(regions)]
  cursor = 0

  def launch():
    nonlocal cursor
    out = run(q, k, v, kv, tables, qsl, ns, starts[cursor])
    cursor = (cursor + unroll) % regions
    return out

  t0 = time.perf_counter()
  first = jax.block_until_ready(launch())  # compile + run (region 0)
  first_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(launch())  # warm, and a (pessimistic) estimate of one group
  t_group = time.perf_counter() - t0
  if max_call_s is not None and t_group > max_call_s * unroll:
    raise TooSlow(f"one call took {t_group / unroll:.2f}s (> {max_call_s}s)")
  groups = int(min(MAX_GROUPS_PER_SAMPLE, max(1, math.ceil(TARGET_SAMPLE_S / t_group))))
  reps = int(max(1, min(reps, budget_s // max(groups * t_group, 1e-9))))
  jax.block_until_ready([launch() for _ in range(groups)])  # warm the dispatch path
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready([launch() for _ in range(groups)])
    samples.append((time.perf_counter() - t0) / (groups * unroll))
  return Timing(float(np.median(samples)), float(min(samples)), float(max(samples)),
                reps * groups * unroll, unroll, groups, first_s, first[0])


def copy_ceiling(nbytes: int = 2 << 30, reps: int = 7, per_sample: int = 4) -> float:
  """Bytes/s of a large device-to-device copy (read + write counted): the best of
  `reps` samples, each `per_sample` back-to-back copies and one wait."""
  n = nbytes // 4
  x = jnp.arange(n, dtype=jnp.uint32)
  f = jax.jit(lambda a, c: a ^ c)  # c is a runtime value: nothing folds away
  c = jax.device_put(np.uint32(0x5A5A5A5A))
  jax.block_until_ready(f(x, c))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(per_sample):
      y = f(x, c)  # the previous y is freed once its copy is done
    jax.block_until_ready(y)
    times.append((time.perf_counter() - t0) / per_sample)
  del x, y
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


def err(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"


def check_correctness(b: Batch, xla_fn, *, on_gpu: bool) -> dict[str, Any]:
  q, k, v, kv, tables, qsl, ns = device_batch(b, regions=1, seed=11)
  args = (q, k, v, kv, tables[0], qsl, ns)
  scale = b.d ** -0.5
  f32 = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
  ref = jax.jit(functools.partial(ref_ragged_paged_attention, sm_scale=scale))(*f32)
  res: dict[str, Any] = {
      "name": b.name, "tokens": b.num_tokens, "seqs": len(b.q_lens),
      "hq": b.hq, "hkv": b.hkv, "d": b.d, "bs": b.bs, "plan": kernel_plan(b),
  }
  try:
    xla_out = xla_fn(*args, sm_scale=scale)
    res.update(xla_max_err=max_err(xla_out, ref), xla_ok=within_tol(xla_out, ref))
  except Exception as e:  # noqa: BLE001 - report, and still check the kernel
    res.update(xla_error=err(e), xla_ok=False)
  if on_gpu:
    try:
      out = ragged_paged_attention(*args, sm_scale=scale, num_kv_splits=b.num_kv_splits)
      res.update(kernel_max_err=max_err(out, ref), kernel_ok=within_tol(out, ref))
    except Exception as e:  # noqa: BLE001
      res.update(kernel_error=err(e), kernel_ok=False)
  else:
    lower_for_cuda(*b.shape_structs(), sm_scale=scale, num_kv_splits=b.num_kv_splits)
    res.update(kernel_lowered_for_cuda=True)
  return res


def xla_guard(b: Batch, reserve_s: float) -> str | None:
  """Why the plain-XLA path should not run on this shape, or None."""
  left = time_left() - reserve_s
  if left < XLA_MIN_LEFT_S:
    return f"skipped: {left:.0f}s left of the time budget"
  # Per KV-chunk loop step: a gathered [S, chunk, Hkv, D] bf16 slice of K and of V,
  # their f32 copies, scores; twice over for buffers in flight.
  chunk = min(8, b.max_blocks) * b.bs
  est = 2 * b.num_slots * chunk * b.hkv * b.d * (2 + 4) * 2
  est += 4 * (b.num_tokens + 32) * b.hq * b.d * 4  # f32 q copy, out, prefill tiles
  free = free_device_bytes()
  if free is not None and est > XLA_MEM_FRACTION * free:
    return f"skipped: needs ~{est / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
  return None


def bench(b: Batch, xla_fn, xla_name: str, ceiling: float, reps: int, *,
          reserve_s: float = 0.0, kernel_kw: dict[str, Any] | None = None,
          with_xla: bool = True) -> dict[str, Any]:
  regions, unroll = regions_for(b), unroll_for(b)
  scale = b.d ** -0.5
  kw = dict(kernel_kw or {})
  res: dict[str, Any] = {
      "name": b.name, "batch": len(b.q_lens), "tokens": b.num_tokens,
      "kv_bytes": b.kv_bytes, "io_bytes": b.io_bytes,
      "kernel_kv_tma_bytes": b.kernel_kv_bytes(kw.get("kv_tile_tokens", 64)),
      "regions": regions, "cache_bytes": b.cache_bytes(regions),
      "kernel_kwargs": kw, "plan": kernel_plan(b, regions, **kw)}
  arrays = device_batch(b, regions, seed=3)
  kernel = functools.partial(ragged_paged_attention, sm_scale=scale, **kw)
  tk = time_attention(kernel, arrays, reps, unroll=unroll)
  res.update(kernel_s=tk.s, kernel_GBps=b.io_bytes / tk.s / 1e9,
             kernel_pct_ceiling=100 * b.io_bytes / tk.s / ceiling,
             kernel_timing=tk.summary())
  if with_xla:
    why = xla_guard(b, reserve_s)
    if why:
      res["xla_skipped"] = why
    else:
      try:
        tx = time_attention(functools.partial(xla_fn, sm_scale=scale), arrays, reps,
                            unroll=unroll, max_call_s=XLA_MAX_CALL_S,
                            budget_s=min(STEP_TIMING_BUDGET_S, max(1.0, time_left() - reserve_s - 10)))
      except TooSlow as e:
        res["xla_skipped"] = f"skipped: {e}"
      except Exception as e:  # noqa: BLE001 - the XLA path is the baseline, not the subject
        res["xla_skipped"] = f"error: {err(e)}"[:300]
      else:
        res.update(xla_path=xla_name, xla_s=tx.s, xla_GBps=b.io_bytes / tx.s / 1e9,
                   xla_pct_ceiling=100 * b.io_bytes / tx.s / ceiling,
                   speedup_vs_xla=tx.s / tk.s, xla_timing=tx.summary(),
                   kernel_vs_xla_max_err=max_err(tk.out, tx.out),
                   kernel_vs_xla_ok=within_tol(tk.out, tx.out))
  del arrays
  return res


def engine_check(ckpt: Path, backends: tuple[str, ...], max_tokens: int,
                 res: dict[str, Any]) -> dict[str, Any]:
  """Greedy token ids of the same chat prompts from one engine per backend
  (bfloat16 weights and KV cache), compared with the first backend's. Fills `res`
  as it goes (a watchdog dump shows how far it got)."""
  from runtime.checkpoint.store import load_checkpoint
  from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
  from runtime.core.engine import LLMEngine
  from runtime.model.sampling import SamplingParams

  res.update(checkpoint=str(ckpt), backends=list(backends), max_tokens=max_tokens,
             prompts=list(CHAT_PROMPTS))
  model_cfg, params, tok = load_checkpoint(ckpt)
  try:
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in CHAT_PROMPTS]
  except ValueError:  # no chat template: plain text
    prompts = [tok.encode(p) for p in CHAT_PROMPTS]
  res["prompt_tokens"] = [len(p) for p in prompts]
  max_len = 16 * -(-(max(len(p) for p in prompts) + max_tokens + 16) // 16)
  # 64-token steps: the prompts are prefilled in chunks next to decodes (mixed batches).
  sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_len)
  policy = AdmissionPolicy(max_num_seqs=4, max_num_batched_tokens=64,
                           long_prefill_token_threshold=64)
  cache = CacheConfig(16, 4 * (max_len // 16) + 8, "bfloat16", False)
  sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
  runs: dict[str, Any] = {}
  for backend in backends:
    t0 = time.time()
    eng = LLMEngine(EngineConfig(model_cfg, cache, sched, policy, backend, "bfloat16"),
                    params, tok, warmup=False, progress=False)
    reqs = eng.generate(prompts, sp)
    runs[backend] = {"ids": [list(r.output_ids) for r in reqs],
                     "logprobs": [r.formatted_logprobs() for r in reqs],
                     "seconds": time.time() - t0}
    res[f"{backend}_seconds"] = runs[backend]["seconds"]
    res[f"{backend}_ids"] = runs[backend]["ids"]
    res[f"{backend}_text"] = [tok.decode(i) for i in runs[backend]["ids"]]
    del eng, reqs
  base = backends[0]
  res["compare"] = [dict(c, backends=[base, other])
                    for other in backends[1:] for c in compare_greedy(runs[base], runs[other])]
  res["ok"] = all(c["status"] in ("match", "near-tie divergence") for c in res["compare"])
  return res


def compare_greedy(x: dict[str, Any], y: dict[str, Any]) -> list[dict[str, Any]]:
  """Per prompt: identical greedy ids, or where they first differ and how close the
  choice was there (the smaller of the two engines' logprob gaps between the two
  tokens; inf when one token is outside the other engine's top-5)."""
  out = []
  for i, (a, b) in enumerate(zip(x["ids"], y["ids"])):
    j = next((t for t, (u, w) in enumerate(zip(a, b)) if u != w), None)
    if j is None:
      out.append({"prompt": i, "status": "match" if len(a) == len(b)
                  else "MISMATCH (lengths differ)"})
      continue
    gaps = []
    for run, theirs in ((x, b[j]), (y, a[j])):
      chosen, top = run["logprobs"][i][j]
      alt = dict(top).get(theirs)
      gaps.append(float("inf") if alt is None else float(chosen - alt))
    gap = min(gaps)
    out.append({"prompt": i, "first_divergence": j, "gap_nats": gap,
                "status": "near-tie divergence" if gap <= NEAR_TIE_NATS else "MISMATCH"})
  return out


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------
def print_table(rows: list[dict[str, Any]]) -> None:
  hdr = (f"{'shape':<22}{'KV MB':>9}{'kernel us':>11}{'GB/s':>7}{'%ceil':>7}"
         f"{'xla us':>10}{'GB/s':>7}{'%ceil':>7}{'speedup':>8}{'splits':>7}")
  print(hdr)
  print("-" * len(hdr))
  for r in rows:
    if "error" in r:
      print(f"{r['name']:<22}  ERROR: {r['error'][:80]}")
      continue
    if "xla_s" in r:
      x = (f"{r['xla_s'] * 1e6:>10.1f}{r['xla_GBps']:>7.0f}{r['xla_pct_ceiling']:>7.1f}"
           f"{r['speedup_vs_xla']:>8.2f}")
    else:
      x = f"{'-':>10}{'-':>7}{'-':>7}{'-':>8}"
    splits = r.get("plan", {}).get("num_splits", "?")
    print(f"{r['name']:<22}{r['kv_bytes'] / 1e6:>9.1f}{r['kernel_s'] * 1e6:>11.1f}"
          f"{r['kernel_GBps']:>7.0f}{r['kernel_pct_ceiling']:>7.1f}{x}{splits:>7}"
          + ("" if r.get("kernel_vs_xla_ok", True) else "  kernel != xla!")
          + (f"  xla {r['xla_skipped'][:40]}" if "xla_skipped" in r else ""))


def print_summary(results: dict[str, Any]) -> None:
  for r in results.get("correctness", []):
    print(f"correctness {r['name']:<26} kernel "
          f"{'ok' if r.get('kernel_ok') else 'FAIL'} ({r.get('kernel_max_err', float('nan')):.1e}),"
          f" xla {'ok' if r.get('xla_ok') else 'FAIL'} ({r.get('xla_max_err', float('nan')):.1e})")
  eng = results.get("engine")
  if eng:
    if "error" in eng or "skipped" in eng:
      print(f"engine check: {eng.get('error') or eng.get('skipped')}")
    else:
      print(f"engine check ({', '.join(eng['backends'])}): {'ok' if eng['ok'] else 'FAIL'}; "
            + ("ran (one backend, nothing to compare)" if not eng["compare"] else "")
            + "; ".join(f"prompt {c['prompt']}: {c['status']}"
                        + (f" at token {c['first_divergence']} (gap {c['gap_nats']:.2f})"
                           if "first_divergence" in c else "") for c in eng["compare"]))


def run_engine_step(args: argparse.Namespace, rec: Recorder, backends: tuple[str, ...]) -> bool:
  """The optional engine check; returns True when it failed."""
  ckpt = args.engine_checkpoint
  rec.step = "engine"
  if not (ckpt / "config.json").is_file():
    rec.results["engine"] = {"skipped": f"no checkpoint at {ckpt} (config.json missing)"}
    print(f"engine check skipped: no checkpoint at {ckpt}")
    return False
  if not args.dry_run and time_left() < 45:
    rec.results["engine"] = {"skipped": f"time budget ({time_left():.0f}s left)"}
    print("engine check skipped: time budget")
    return False
  print(f"engine check: {' vs '.join(backends)} on {ckpt} ...", flush=True)
  r = rec.results["engine"] = {}
  try:
    engine_check(ckpt, backends, args.engine_max_tokens, r)
  except Exception as e:  # noqa: BLE001
    r.update(error=err(e)[:500], ok=False)
  rec.save()
  return not r.get("ok", False)


def run_engine_tps(args: argparse.Namespace, rec: Recorder) -> bool:
  """The Llama-3-8B-shaped engine run; returns True when it failed."""
  from runtime.bench.gpu_engine import (DEEPSEEK_SCALED, DEEPSEEK_V2_LITE_8L, GEMMA3_1B, GEMMA3_SCALED, LLAMA3_8B,
                                        LLAMA3_SCALED, LLAMA31_ROPE, MIXTRAL_8L, MIXTRAL_SCALED, engine_decode_tps,
                                        format_engine_tps)

  rec.step = "engine_tps"
  failed = False
  # bf16 first (the engine-speed issue's table), then the quantization issue's rows:
  # int8 weights dequantized in the graph (w8a16), an fp8 KV cache (the Pallas kernel reads its
  # 1-byte values: half a bf16 cache's bytes per step) and an int8 one (its per-channel-group
  # scales and zeros: the XLA attention path, which the Pallas kernel does not read yet).
  # Then the model-families issue's rows: Llama 3.1 8B (llama3 RoPE scaling) and a Gemma-3-1B
  # shape (sliding-window KV groups, 262k vocabulary; the XLA attention path); and the MoE
  # issue's: Mixtral 8x7B's layers (8 of them; the experts through ragged_dot) and
  # DeepSeek-V2-Lite's (the latent MLA cache, shared experts).
  variants = {"bf16": {}, "w8a16": {"quantization": "w8a16"}, "w4a16": {"quantization": "w4a16"},
              "fp8kv": {"kv_dtype": "fp8_e4m3"},
              "int8kv": {"kv_dtype": "int8"}, "llama31": {"rope_scaling": LLAMA31_ROPE},
              "gemma3": {"model": "gemma3", "attention_backend": "xla"}, "mixtral": {"model": "mixtral"},
              "deepseek": {"model": "deepseek", "attention_backend": "xla"}}
  for name in args.engine_variants.split(","):
    if name not in variants:
      print(f"--engine-variants: unknown {name!r} (known: {', '.join(variants)})")
      return True
    key = "engine_tps" if name == "bf16" else f"engine_tps_{name}"
    kw = dict(variants[name])
    model = kw.pop("model", "llama")
    rope = {"rope_scaling": kw.pop("rope_scaling")} if "rope_scaling" in kw else {}
    scaled, full = {"gemma3": (GEMMA3_SCALED, GEMMA3_1B), "mixtral": (MIXTRAL_SCALED, MIXTRAL_8L),
                    "deepseek": (DEEPSEEK_SCALED, DEEPSEEK_V2_LITE_8L), "llama": (LLAMA3_SCALED, LLAMA3_8B)}[model]
    try:
      if args.dry_run:
        shape = {**scaled, **rope}
        r = engine_decode_tps(shape, (1, 4, 8), context_len=200, steps=3, dtype="float32",
                              kv_memory=64 << 20, device_name="cpu-none", **kw)
      else:
        shape = {**full, **rope}
        r = engine_decode_tps(shape, (1, 16, 64, 100_000), context_len=1000, steps=8, **kw)
      rec.results[key] = r
      print(format_engine_tps(r), flush=True)
    except Exception as e:  # noqa: BLE001
      rec.results[key] = {"error": err(e)[:800]}
      print(f"engine TPS check ({name}) failed: {err(e)[:300]}")
      failed = True
    finally:
      rec.save()
  return failed


def run_spec_verify(args: argparse.Namespace, rec: Recorder) -> bool:
  """Speculative decoding: a verifying step (k=4 proposals a row) against a plain decode step
  on the Llama-3-8B shape; returns True when it failed."""
  from runtime.bench.gpu_engine import LLAMA3_8B, LLAMA3_SCALED, format_verify_cost, verify_step_cost

  rec.step = "spec_verify"
  try:
    if args.dry_run:
      r = verify_step_cost(LLAMA3_SCALED, (1, 4), k=4, context_len=200, steps=3, dtype="float32",
                           kv_memory=64 << 20)
    else:
      r = verify_step_cost(LLAMA3_8B, (1, 8, 64), k=4, context_len=1000, steps=8)
    rec.results["spec_verify"] = r
    print(format_verify_cost(r), flush=True)
    return False
  except Exception as e:  # noqa: BLE001
    rec.results["spec_verify"] = {"error": err(e)[:800]}
    print(f"speculative verify check failed: {err(e)[:300]}")
    return True
  finally:
    rec.save()


def dry_run(args: argparse.Namespace) -> int:
  """Everything that does not need a GPU, at the real shapes where affordable."""
  xla_fn, xla_name = xla_path()
  rec = Recorder(args.out, {"dry_run": True, "jax": jax.__version__,
                            "backend": jax.default_backend(), "xla_path": xla_name})
  results = rec.results
  print(f"dry run on {jax.default_backend()}: no kernel timing; lowering the kernel for CUDA")
  results["correctness"] = []
  failed = False
  for b in correctness_batches():
    rec.step = f"correctness {b.name}"
    r = check_correctness(b, xla_fn, on_gpu=False)
    failed |= not r["xla_ok"]
    print(f"  correctness {b.name}: reference ok, XLA path max err"
          f" {r.get('xla_max_err', float('nan')):.2e} ({'ok' if r['xla_ok'] else 'FAIL'}),"
          f" kernel lowered; plan {r['plan']}")
    results["correctness"].append(r)

  # The timing harness itself (region rotation, unrolling, outputs), on the XLA
  # path with a small shape: the first output must be region 0's attention.
  rec.step = "harness"
  hb = Batch("harness_b4_ctx256", (1,) * 4, (256,) * 4)
  arrays = device_batch(hb, regions=3, seed=5)
  t = time_attention(functools.partial(xla_fn, sm_scale=hb.d ** -0.5), arrays, 2, unroll=2,
                     budget_s=5.0)
  q, k, v, kv, tables, qsl, ns = arrays
  ref = ref_ragged_paged_attention(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                     for a in (q, k, v, kv, tables[0], qsl, ns)),
                                   sm_scale=hb.d ** -0.5)
  ok = within_tol(t.out, ref)
  failed |= not ok
  results["harness"] = {**t.summary(), "region0_ok": ok}
  print(f"  timing harness: {t.calls} calls ({t.unroll} per executable, {t.groups} per sample),"
        f" region-0 output {'ok' if ok else 'WRONG'}")

  planned = []
  for b in sweep_batches() + [mixed_batch()]:
    rec.step = f"plan {b.name}"
    regions = regions_for(b)
    lower_for_cuda(*b.shape_structs(regions=regions), sm_scale=b.d ** -0.5)
    kv, tables, qsl, ns = host_metadata(b, regions, seed=3)  # shape building
    assert tables.shape == (regions, b.num_slots, b.max_blocks)
    assert len(np.unique(tables)) == tables.size and tables.min() >= 1  # disjoint regions
    planned.append({"name": b.name, "tokens": b.num_tokens, "kv_bytes": b.kv_bytes,
                    "io_bytes": b.io_bytes, "kernel_kv_tma_bytes": b.kernel_kv_bytes(),
                    "regions": regions, "unroll": unroll_for(b),
                    "cache_bytes": b.cache_bytes(regions), "plan": kernel_plan(b, regions)})
    print(f"  planned {b.name:<22} KV {b.kv_bytes / 1e6:9.1f} MB, {regions:2d} regions x"
          f" {unroll_for(b)} unrolled, caches {planned[-1]['cache_bytes'] / 1e9:6.2f} GB,"
          f" splits {planned[-1]['plan'].get('num_splits')}: lowered")
  results["planned"] = planned
  results["peak_cache_GB"] = max(p["cache_bytes"] for p in planned) / 1e9
  rec.step = "w4a16"
  results["w4a16"], w4_failed = gpu_w4a16.run(False, args.reps, time_left)
  failed |= w4_failed
  rec.save()
  if args.engine_checkpoint is not None:
    # The Pallas engine would run in the (very slow) interpreter here: XLA only.
    failed |= run_engine_step(args, rec, ("xla",))
    print_summary({"engine": results.get("engine")})
  if args.engine_tps:
    failed |= run_engine_tps(args, rec)
    failed |= run_spec_verify(args, rec)
  rec.save()
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
  xla_fn, xla_name = xla_path()
  rec = Recorder(args.out, {"device": desc, "jax": jax.__version__, "xla_path": xla_name,
                            "dry_run": False, "notes": []})
  rec.start_watchdog(WATCHDOG_S)
  try:
    return run_gpu_checks(args, rec, xla_fn, xla_name)
  except BaseException as e:
    rec.results["fatal"] = f"in step {rec.step!r}: {err(e)}"[:1000]
    rec.save()
    raise
  finally:
    rec.done = True


def run_gpu_checks(args: argparse.Namespace, rec: Recorder, xla_fn, xla_name: str) -> int:
  results = rec.results
  reserve = ENGINE_RESERVE_S if args.engine_checkpoint is not None else 0.0
  failed = False

  rec.step = "copy ceiling"
  ceiling = copy_ceiling()
  results["copy_ceiling_GBps"] = ceiling / 1e9
  print(f"device {results['device']}; jax {jax.__version__};"
        f" copy ceiling {ceiling / 1e9:.0f} GB/s",
        flush=True)
  rec.save()

  results["correctness"] = []
  for b in correctness_batches():
    rec.step = f"correctness {b.name}"
    try:
      r = check_correctness(b, xla_fn, on_gpu=True)
    except Exception as e:  # noqa: BLE001 - report and carry on
      r = {"name": b.name, "error": err(e)}
    ok = r.get("kernel_ok", False) and r.get("xla_ok", False)
    failed |= not ok
    problems = [r[k][:100] for k in ("error", "kernel_error", "xla_error") if k in r]
    print(f"correctness {b.name:<26} kernel max err {r.get('kernel_max_err', float('nan')):.2e}"
          f" {'ok' if r.get('kernel_ok') else 'FAIL'}; XLA max err"
          f" {r.get('xla_max_err', float('nan')):.2e} {'ok' if r.get('xla_ok') else 'FAIL'}"
          + (f"  [{'; '.join(problems)}]" if problems else ""), flush=True)
    results["correctness"].append(r)
    rec.save()

  rows = []
  results["sweep"], results["mixed"] = [], None
  for b in sweep_batches() + [mixed_batch()]:
    if time_left() - reserve < 15:
      results["notes"].append(f"{b.name}: skipped (time budget)")
      print(f"skip {b.name}: time budget")
      continue
    rec.step = f"bench {b.name}"
    try:
      r = bench(b, xla_fn, xla_name, ceiling, args.reps, reserve_s=reserve)
    except Exception as e:  # noqa: BLE001
      r = {"name": b.name, "error": err(e)[:500]}
    failed |= "error" in r or not r.get("kernel_vs_xla_ok", True)
    rows.append(r)
    if b.name.startswith("mixed"):
      results["mixed"] = r
    else:
      results["sweep"].append(r)
    rec.save()
    if "error" in r:
      print(f"{b.name:<22} ERROR {r['error'][:200]}", flush=True)
    else:
      print(f"{b.name:<22} kernel {r['kernel_s'] * 1e6:9.1f} us {r['kernel_GBps']:6.0f} GB/s"
            f" ({r['kernel_pct_ceiling']:4.1f}%)  xla "
            + (f"{r['xla_s'] * 1e6:9.1f} us" if "xla_s" in r else r.get("xla_skipped", "-"))
            + ("" if r.get("kernel_vs_xla_ok", True)
               else f"  kernel != xla (max err {r['kernel_vs_xla_max_err']:.2e})"), flush=True)

  if time_left() - reserve > 60:
    def on_step(name: str) -> None:
      rec.step = name
    results["w4a16"], w4_failed = gpu_w4a16.run(True, args.reps, lambda: time_left() - reserve, on_step)
    failed |= w4_failed
    rec.save()
  else:
    results["notes"].append("w4a16: skipped (time budget)")

  if args.engine_checkpoint is not None:
    failed |= run_engine_step(args, rec, ("xla", "pallas"))

  if args.engine_tps:
    failed |= run_engine_tps(args, rec)
    failed |= run_spec_verify(args, rec)

  if args.tune and time_left() > 60:
    tb = Batch("tune_b32_ctx4096", (1,) * 32, (4096,) * 32)
    results["tune"] = []
    for kv_tile in (64, 128):
      for stages in (2, 3, 4):
        if time_left() < 20:
          results["notes"].append(f"tune kv_tile={kv_tile} stages={stages}: skipped (time)")
          continue
        kw = dict(kv_tile_tokens=kv_tile, num_stages=stages)
        rec.step = f"tune {kw}"
        try:
          r = bench(tb, xla_fn, xla_name, ceiling, args.reps, with_xla=False, kernel_kw=kw)
        except Exception as e:  # noqa: BLE001
          r = {"name": tb.name, "error": err(e)[:300], "kernel_kwargs": kw}
        results["tune"].append(r)
        rec.save()
        eff = r.get("plan", {}).get("num_stages", "?")
        print(f"tune {kw} (effective stages {eff}): "
              + (f"{r['kernel_GBps']:.0f} GB/s" if "error" not in r else r["error"][:100]))

  rec.step = "report"
  print()
  print(f"copy ceiling {ceiling / 1e9:.0f} GB/s (read+write); GB/s = (K+V read + q read +"
        " out written) / time per call, wrapper included; %ceil of the copy ceiling")
  print_table(rows)
  print_summary(results)
  rec.save()
  print(f"\n{'FAILED' if failed else 'ok'} in {results['seconds']:.0f}s; wrote {args.out}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
