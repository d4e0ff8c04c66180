"""w4a16 on a Hopper GPU: the Pallas Mosaic GPU kernel (pallas_kernels/w4a16_matmul.py) behind
the `Linear` seam. The runner repacks each 4-bit projection once at load (`pack_params`); the
family then multiplies by an `Int4Mosaic` like any other weight, and the kernel reads the
nibbles from HBM (0.75 bytes per weight with the scales and offsets, against bfloat16's 2).

Off a GPU the same object runs the kernel in the Mosaic GPU interpreter (tests; slow), so the
packed tree is checked against the XLA dequantizing path (`Int4Grouped`) on any machine."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from runtime.model import linear as _linear
from runtime.model.linear import Linear, pytree

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def hopper() -> bool:
    """The first device is an NVIDIA Hopper GPU (compute capability 9.x: wgmma and TMA)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def applies(quantization: str, dtype: Any, tp: int) -> bool:
    """The rule for serving w4a16 through the kernel: a Hopper GPU, one device, 16-bit
    activations (the wgmma operands); elsewhere (another GPU included) the XLA path
    dequantizes in the graph."""
    return quantization == "w4a16" and tp == 1 and jnp.dtype(dtype) in KERNEL_DTYPES and hopper()


def pack_params(params: dict[str, Any]) -> dict[str, Any]:
    """A w4a16 tree -> the same model with every 4-bit projection whose width the kernel tiles
    (a multiple of 64 columns) in the kernel's layout ({"qg", "sg", "mg"}, the layer axis
    kept); other projections, the 8-bit head and float leaves unchanged (the XLA path).
    (The layers stay stacked: whether XLA copies a scanned slice before the kernel, as XLA:CPU
    does, is for scripts/gpu_check.py's w4a16 engine row to show on a GPU.)"""
    from pallas_kernels.w4a16_matmul import pack_for_gpu

    def pack(w: Any) -> Any:
        if not (isinstance(w, dict) and "q4" in w) or w["q4"].shape[-1] % 64:
            return w
        qg, sg, mg = pack_for_gpu(jnp.asarray(w["q4"]), jnp.asarray(w["s4"]), jnp.asarray(w["m4"]))
        return {"qg": qg, "sg": sg, "mg": mg}

    return {**params, "layers": {k: pack(v) for k, v in params["layers"].items()}}


@_linear.register_reader
def from_packed(w: dict) -> Linear | None:
    return Int4Mosaic(w["qg"], w["sg"], w["mg"]) if "qg" in w else None


@pytree
class Int4Mosaic(Linear):
    """4-bit values, a scale and an offset per 32 inputs, in the Mosaic GPU kernel's layout
    (K padded to a multiple of 128; pallas_kernels/w4a16_matmul.pack_for_gpu)."""
    qg: jax.Array  # [Kp/2, N] uint8
    sg: jax.Array  # [Kp/32, N] float32
    mg: jax.Array  # [Kp/32, N] float32

    def product(self, x):
        from pallas_kernels.w4a16_matmul import w4a16_matmul

        lead = x.shape[:-1]
        y = w4a16_matmul(x.reshape(-1, x.shape[-1]), self.qg, self.sg, self.mg,
                         interpret=jax.default_backend() != "gpu")
        return y.reshape(*lead, y.shape[-1])

    @property
    def out_features(self):
        return self.qg.shape[-1]
