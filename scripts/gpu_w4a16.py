"""scripts/gpu_check.py's w4a16 step: the Pallas Mosaic GPU 4-bit matmul
(pallas_kernels/w4a16_matmul.py) on Llama-3-8B's projection shapes.

On the GPU, per shape (K x N) and row count (1, 8, 64): the kernel's output against the
float32 reference, and the time per call of the kernel, of a bfloat16 dense matmul on the
same shape (what w4a16 replaces) and of XLA dequantizing the 4-bit weight in the graph (the
path without the kernel). Each executable applies its product to R distinct weights (together
>= 200 MB, 4x the L2), so every call reads its weight from HBM; GB/s = weight bytes read /
time. Off a GPU (dry run): every shape lowered for CUDA and one small shape run in the
Mosaic GPU interpreter against the reference.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.w4a16_matmul import lower_for_cuda, pack_for_gpu, ref_w4a16_matmul, w4a16_matmul

# Llama-3-8B: q/o (4096 x 4096), gate/up (4096 x 14336), down (14336 x 4096).
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
ROWS = (1, 8, 64)
COLD_BYTES = 200e6


def _weights(K: int, N: int, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A random stored-layout 4-bit weight, made on the device (nothing large crosses)."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    q4 = jax.random.randint(k1, (K // 2, N), 0, 256, jnp.int32).astype(jnp.uint8)
    s4 = jax.random.uniform(k2, (K // 32, N), jnp.float32, 1e-3, 2e-3)
    m4 = -8 * s4 + jax.random.normal(k3, (K // 32, N), jnp.float32) * 1e-3
    return q4, s4, m4


def _time(fn: Callable[..., Any], args: tuple, reps: int) -> float:
    """Median seconds per product: one executable runs the product on each weight in `args`."""
    jax.block_until_ready(fn(*args))
    per = len(args) - 1
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - t) / per)
    return statistics.median(samples)


def _rotated(product: Callable[..., jax.Array], arity: int) -> Callable[..., Any]:
    """x, then R weights of `arity` arrays each -> the R products, in one executable."""
    def run(x, *flat):
        return [product(x, *flat[i:i + arity]) for i in range(0, len(flat), arity)]
    return jax.jit(run)


def _dequantized(x, q4, s4, m4):
    """The path without the kernel: runtime/model/linear.py's Int4Grouped on the stored layout
    (the weight dequantized in the graph, then a dot in x's dtype)."""
    from runtime.model.linear import Int4Grouped

    return Int4Grouped(q4, s4, m4).product(x)


def run(on_gpu: bool, reps: int, time_left: Callable[[], float],
        on_step: Callable[[str], None] = lambda name: None) -> tuple[dict[str, Any], bool]:
    """The step's results and whether anything failed; `on_step` names each shape as it
    starts (the caller's hang watchdog)."""
    out: dict[str, Any] = {"shapes": [], "notes": []}
    failed = False
    if not on_gpu:
        sds = jax.ShapeDtypeStruct
        for K, N in SHAPES:
            for M in ROWS:
                lower_for_cuda(sds((M, K), jnp.bfloat16), sds((K // 2, N), jnp.uint8),
                               sds((K // 32, N), jnp.float32), sds((K // 32, N), jnp.float32))
        q4, s4, m4 = _weights(256, 128, 0)
        x = jax.random.normal(jax.random.PRNGKey(1), (3, 256), jnp.bfloat16)
        got = np.asarray(w4a16_matmul(x, *pack_for_gpu(q4, s4, m4), interpret=True), np.float32)
        want = np.asarray(ref_w4a16_matmul(x, q4, s4, m4), np.float32)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        failed = err > 2e-2
        out["shapes"].append({"lowered": [list(s) for s in SHAPES], "rows": list(ROWS),
                              "interpreted_rel_err": err, "ok": not failed})
        print(f"  w4a16: {len(SHAPES) * len(ROWS)} shapes lowered for CUDA; interpreter rel err {err:.2e} "
              f"({'ok' if not failed else 'FAIL'})")
        return out, failed
    for K, N in SHAPES:
        if time_left() < 30:
            out["notes"].append(f"{K}x{N}: skipped (time budget)")
            continue
        on_step(f"w4a16 {K}x{N}")
        R = max(2, int(-(-COLD_BYTES // (K * N * 0.75))))
        stored = [_weights(K, N, seed) for seed in range(R)]
        packed = [pack_for_gpu(*w) for w in stored]
        dense = [(jax.random.normal(jax.random.PRNGKey(seed), (K, N), jnp.bfloat16) * 0.02,) for seed in range(R)]
        flat = [a for w in packed for a in w]
        for M in ROWS:
            x = jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.bfloat16)
            row: dict[str, Any] = {"K": K, "N": N, "rows": M, "weights_rotated": R}
            try:
                got = np.asarray(w4a16_matmul(x, *packed[0]), np.float32)
                want = np.asarray(ref_w4a16_matmul(x, *stored[0]), np.float32)
                row["rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
                row["ok"] = row["rel_err"] <= 2e-2
                kernel = _time(_rotated(lambda x, q, s, m: w4a16_matmul(x, q, s, m), 3), (x, *flat), reps)
                bf16 = _time(_rotated(lambda x, w: x @ w, 1), (x, *[d for w in dense for d in w]), reps)
                xla = _time(_rotated(_dequantized, 3), (x, *[a for w in stored for a in w]), reps)
                row.update(kernel_us=kernel * 1e6, bf16_dense_us=bf16 * 1e6, xla_dequant_us=xla * 1e6,
                           kernel_weight_GBps=K * N * 0.75 / kernel / 1e9, bf16_weight_GBps=K * N * 2 / bf16 / 1e9,
                           speedup_vs_bf16=bf16 / kernel, speedup_vs_xla_dequant=xla / kernel)
            except Exception as e:  # noqa: BLE001 - report and carry on
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            failed |= not row.get("ok", False)
            out["shapes"].append(row)
            print(f"w4a16 {K}x{N} rows {M:3d}: " + (
                f"kernel {row['kernel_us']:8.1f} us ({row['kernel_weight_GBps']:5.0f} GB/s) bf16 dense "
                f"{row['bf16_dense_us']:8.1f} us ({row['speedup_vs_bf16']:.2f}x) XLA dequant "
                f"{row['xla_dequant_us']:8.1f} us ({row['speedup_vs_xla_dequant']:.2f}x) rel err {row['rel_err']:.1e}"
                if "error" not in row else f"ERROR {row['error'][:200]}"), flush=True)
    return out, failed
