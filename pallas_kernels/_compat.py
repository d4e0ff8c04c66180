"""Every jax 0.10.x / 0.11.x difference the Pallas kernels care about, in one place.

The CPU machines run jax 0.10.x; the Hopper machine may run 0.11.x. The Mosaic GPU
*interpreter* (``interpret=InterpretGPUParams(...)``, runs a Mosaic GPU kernel on
CPU with simulated GMEM/SMEM, barriers and a race detector) is young and its
coverage differs between versions. What jax 0.10.2's interpreter lacks (each item
reproduced with a minimal kernel; item 1 is re-probed at run time):

1. ``wgmma`` with a transposed SMEM operand (``plgpu.transpose_ref(ref, (1, 0))``):
   the interpreter's wgmma callback only understands indexing transforms and
   fails with ``AttributeError: 'TransposeTransform' object has no attribute
   'indices'``. The kernel needs K^T as the B operand of Q @ K^T.
   Worked around (kernel-side, interpret mode only, when the probe fails): K^T is
   materialised into a scratch SMEM buffer with an ordinary register transpose
   (``kt_smem[...] = k_smem[...].T``) and the wgmma reads that buffer.
2. ``plgpu.layout_cast`` (also used by ``plgpu.broadcasted_iota(layout=...)``):
   no CPU lowering (``MLIR translation rule for primitive 'layout_cast' not found
   for platform cpu``). Worked around: in interpret mode the cast is the identity
   (value-preserving by definition; it only pins a register layout).
3. ``wgmma`` with the A operand in registers: unsupported (the interpreter treats
   every operand as an SMEM allocation key). Not worked around here: the kernel
   always stages P in SMEM, on hardware too (FlashAttention-2 style), so the
   tested formulation is the deployed one.
4. ``pl.run_state`` (``plgpu.ACC.init``): "Higher-order primitive run_state".
   The kernel never uses it (fresh zeroed accumulators are added in registers).
5. ``InterpretGPUParams`` / ``reset_gpu_interpret_mode_state`` / ``get_races`` are
   not exported publicly in 0.10.x; imported from ``jax._src`` here.

Everything else the kernel uses (TMA copies with dynamic indices, multi-arrival
barriers, fori_loop, pl.when, scalar GMEM reads, SMEM tiling/swizzle transforms)
runs in the 0.10.2 interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

# --- interpreter parameters and state ---------------------------------------
try:  # newer jax may export it publicly
  from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams  # type: ignore[attr-defined]
except ImportError:  # jax 0.10.x
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401

try:
  from jax.experimental.pallas.mosaic_gpu import (  # type: ignore[attr-defined]
      reset_gpu_interpret_mode_state as _reset_state,
  )
  from jax.experimental.pallas.mosaic_gpu import get_races as _get_races  # type: ignore[attr-defined]
except ImportError:  # jax 0.10.x
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
      get_races as _get_races,
      reset_gpu_interpret_mode_state as _reset_state,
  )

# Errors raised from inside an interpreted kernel (e.g. an out-of-bounds read)
# surface as a runtime error from the io_callback that hit them.
InterpretRuntimeError: tuple[type[BaseException], ...] = (
    getattr(jax.errors, "JaxRuntimeError", RuntimeError),
    IndexError,
)


def strict_interpret_params() -> Any:
  """Interpreter settings used for testing: races detected, OOB reads raise,
  uninitialised memory reads back as NaN."""
  return InterpretGPUParams(
      detect_races=True,
      out_of_bounds_reads="raise",
      uninitialized_memory="nan",
  )


def resolve_interpret(interpret: Any) -> Any | None:
  """Maps the public ``interpret`` argument to InterpretGPUParams or None."""
  if interpret is False or interpret is None:
    return None
  if interpret is True:
    return strict_interpret_params()
  if isinstance(interpret, InterpretGPUParams):
    return interpret
  raise ValueError(
      "interpret must be a bool or an InterpretGPUParams instance, got"
      f" {type(interpret).__name__}"
  )


def reset_interpret_state() -> None:
  """Must be called after an interpreted kernel raised, before the next one."""
  _reset_state()


def races_found() -> bool:
  return bool(_get_races().races_found)


@contextlib.contextmanager
def quiet_callback_errors() -> Iterator[None]:
  """Silences jax's log record for an io_callback that raised (expected in
  probes and in tests that plant faults; the exception itself still propagates)."""
  log = logging.getLogger("jax._src.callback")
  old = log.level
  log.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    log.setLevel(old)


# --- capability probes --------------------------------------------------------
def layout_cast(x: jax.Array, layout: Any, *, interpreted: bool) -> jax.Array:
  """plgpu.layout_cast, or the identity under the interpreter (the cast only
  pins a register layout for the Mosaic GPU lowering; values are unchanged)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  return x if interpreted else plgpu.layout_cast(x, layout)


def broadcasted_iota(
    dtype: Any, shape: tuple[int, ...], dim: int, *, layout: Any, interpreted: bool
) -> jax.Array:
  return layout_cast(
      jax.lax.broadcasted_iota(dtype, shape, dim), layout, interpreted=interpreted
  )


@functools.cache
def interpret_supports_transposed_wgmma() -> bool:
  """Runs a tiny interpreted kernel computing A @ B^T with a transposed SMEM ref."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  def body(a_ref, b_ref, o_ref, a_smem, b_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(b_ref, b_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[0])
    plgpu.barrier_wait(bar.at[1])

    def mm(acc):
      plgpu.wgmma(acc, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
      return acc[...]

    o_smem[...] = pl.run_scoped(mm, plgpu.ACC((64, 64), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) % 7
  b = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) % 5
  tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  try:
    with quiet_callback_errors():
      out = _probe_kernel(body, tr, a, b)
    ok = bool(np.allclose(np.asarray(out), a @ b.T))
  except Exception:  # noqa: BLE001 - any failure means "not supported"
    reset_interpret_state()
    return False
  return ok


def _probe_kernel(body, tr, a, b):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
      scratch_types=[
          plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tr),
          plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tr),
          plgpu.SMEM((64, 64), jnp.float32),
          plgpu.Barrier(num_barriers=2),
      ],
      interpret=InterpretGPUParams(),
  )
  return jax.block_until_ready(
      kernel(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)))
