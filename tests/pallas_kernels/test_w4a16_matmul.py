"""Tests for pallas_kernels/w4a16_matmul.py and its Linear (runtime/model/mosaic_linear.py).

All on CPU: the GPU layout against the stored one, the Mosaic GPU kernel in the Mosaic GPU
interpreter (races detected, out-of-bounds reads raising, fresh memory NaN) against the
float32 reference, the hardware variant lowered for CUDA (TMA, wgmma and register-layout
checks the interpreter does not model), and a tiny w4a16 model whose projections run through
the kernel against the XLA dequantizing path.

Tolerance: the kernel rounds each dequantized weight to the activation dtype (bfloat16:
2^-9 relative) and its output too, so it is compared with the reference on weights rounded
the same way, at atol = rtol = 1e-2 of the output's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels.w4a16_matmul import lower_for_cuda, pack_for_gpu, ref_w4a16_matmul, w4a16_matmul
from runtime.model.linear import dequantize_int4
from runtime.model.quant import quantize_weight_int4


def _weight(K, N, seed=0):
    w = np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32)
    q = quantize_weight_int4(jnp.asarray(w))
    return q["q4"], q["s4"], q["m4"]


def _unpack_gpu(qg):
    """The kernel's layout read back, one value per (padded) input: [Kp, N]."""
    kp2, N = qg.shape
    t = np.asarray(qg).reshape(kp2 // 64, 64, N)
    return np.concatenate([t & 15, t >> 4], axis=1).reshape(2 * kp2, N)


@pytest.mark.parametrize("K", [64, 128, 192, 576])
def test_gpu_layout_holds_the_stored_values(K):
    q4, s4, m4 = _weight(K, 64)
    qg, sg, mg = pack_for_gpu(q4, s4, m4)
    kp = -(-K // 128) * 128
    assert qg.shape == (kp // 2, 64) and sg.shape == mg.shape == (kp // 32, 64)
    w = _unpack_gpu(qg).astype(np.float32) * np.repeat(np.asarray(sg), 32, 0) + np.repeat(np.asarray(mg), 32, 0)
    np.testing.assert_array_equal(w[:K], np.asarray(dequantize_int4(q4, s4, m4)))
    assert not w[K:].any()  # the padding inputs weigh nothing


def test_gpu_layout_keeps_a_layer_axis():
    layers = [_weight(192, 64, seed) for seed in range(3)]
    stacked = pack_for_gpu(*(jnp.stack([w[i] for w in layers]) for i in range(3)))
    for li, w in enumerate(layers):
        for got, want in zip(stacked, pack_for_gpu(*w)):
            np.testing.assert_array_equal(np.asarray(got[li]), np.asarray(want))


# ---------------------------------------------------------------------------
# The kernel in the Mosaic GPU interpreter.
# ---------------------------------------------------------------------------
@pytest.fixture
def interpreter():
    _compat.reset_interpret_state()
    yield
    assert not _compat.races_found()
    _compat.reset_interpret_state()


def _expected(x, q4, s4, m4):
    """The reference on weights rounded to x's dtype, as the kernel feeds the tensor core."""
    w = dequantize_int4(q4, s4, m4).astype(x.dtype).astype(jnp.float32)
    return np.asarray(jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST))


@pytest.mark.parametrize("M,K,N,dtype", [
    (1, 128, 128, jnp.bfloat16),     # one decode row, one tile
    (3, 576, 192, jnp.bfloat16),     # K padded (576 -> 640), N in 64-column tiles
    (64, 256, 128, jnp.float16),     # a full row tile
    (70, 192, 64, jnp.bfloat16),     # two row tiles, the second mostly padding
], ids=lambda v: str(v))
def test_kernel_matches_reference(interpreter, M, K, N, dtype):
    q4, s4, m4 = _weight(K, N, seed=M)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), dtype)
    y = w4a16_matmul(x, *pack_for_gpu(q4, s4, m4), interpret=True)
    assert y.shape == (M, N) and y.dtype == x.dtype
    want = _expected(x, q4, s4, m4)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=1e-2 * scale, rtol=1e-2)
    # and the public reference (float32 weights) agrees to the weights' rounding
    ref = np.asarray(ref_w4a16_matmul(x, q4, s4, m4), np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("stages,splits", [(1, 1), (3, 1), (2, 2), (3, 3)])
def test_kernel_stages_and_k_splits_match(interpreter, stages, splits):
    """One stage (each K step waits for its own copies), and K split in uneven ranges (3 steps
    over 2 CTAs: float32 partial sums added in the wrapper) give the same product."""
    q4, s4, m4 = _weight(384, 128)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 384)), jnp.bfloat16)
    y = w4a16_matmul(x, *pack_for_gpu(q4, s4, m4), interpret=True, num_stages=stages, num_k_splits=splits)
    want = _expected(x, q4, s4, m4)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=1e-2 * np.abs(want).max(), rtol=1e-2)


def test_decode_shapes_split_k_to_fill_the_gpu():
    from pallas_kernels.w4a16_matmul import _make_plan

    sds = jax.ShapeDtypeStruct

    def plan(M, K, N):
        return _make_plan(sds((M, K), jnp.bfloat16), sds((K // 2, N), jnp.uint8), sds((K // 32, N), jnp.float32),
                          sds((K // 32, N), jnp.float32), interpret=False, block_n=128, num_stages=3,
                          num_k_splits=None)
    one = plan(1, 4096, 4096)  # 32 output tiles: split K 9 ways (~2 waves of 132 SMs)
    assert one.num_splits == 9 and one.out_dtype == jnp.float32
    assert plan(1, 4096, 14336).num_splits == 3
    assert plan(512, 4096, 14336).num_splits == 1  # enough tiles already


# ---------------------------------------------------------------------------
# The hardware variant, lowered for CUDA on this CPU machine.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("M,K,N,block_n,stages,splits,dtype", [
    (1, 4096, 4096, 128, 3, None, jnp.bfloat16),   # Llama-3-8B's wo at batch 1 (K split 9 ways)
    (64, 4096, 14336, 128, 4, None, jnp.bfloat16),  # its gate at 64 rows
    (512, 4096, 4096, 128, 3, 1, jnp.bfloat16),    # a prefill chunk: no split, bf16 tiles out
    (8, 576, 1536, 128, 3, None, jnp.bfloat16),    # SmolLM2's gate (K padded)
    (1, 1536, 576, 64, 2, 4, jnp.float16),         # SmolLM2's down: 64-column tiles
], ids=lambda v: str(v))
def test_hardware_kernel_lowers_for_cuda(M, K, N, block_n, stages, splits, dtype):
    sds = jax.ShapeDtypeStruct
    kp = -(-K // 128) * 128
    text = lower_for_cuda(sds((M, K), dtype), sds((kp // 2, N), jnp.uint8), sds((kp // 32, N), jnp.float32),
                          sds((kp // 32, N), jnp.float32), block_n=block_n, num_stages=stages, num_k_splits=splits)
    assert "mosaic_gpu" in text


# ---------------------------------------------------------------------------
# Argument validation.
# ---------------------------------------------------------------------------
def _args(M=2, K=128, N=64):
    q4, s4, m4 = _weight(K, N)
    return (jnp.zeros((M, K), jnp.bfloat16), *pack_for_gpu(q4, s4, m4))


@pytest.mark.parametrize("mutate,kw,msg", [
    (lambda a: (a[0].astype(jnp.float32), *a[1:]), {}, "bfloat16/float16"),
    (lambda a: (a[0][None], *a[1:]), {}, "x must be"),
    (lambda a: (a[0], a[1].astype(jnp.int8), *a[2:]), {}, "uint8"),
    (lambda a: (jnp.zeros((2, 320), jnp.bfloat16), *a[1:]), {}, "pack_for_gpu pads"),
    (lambda a: (*a[:2], a[2][:1], a[3]), {}, "scales must be"),
    (lambda a: (*a[:3], a[3].astype(jnp.bfloat16)), {}, "offsets must be"),
    (lambda a: a, {"block_n": 96}, "block_n"),
    (lambda a: a, {"num_stages": 0}, "num_stages"),
    (lambda a: a, {"num_k_splits": 0}, "num_k_splits"),
    (lambda a: a, {"interpret": "yes"}, "interpret"),
])
def test_argument_validation(mutate, kw, msg):
    with pytest.raises(ValueError, match=msg):
        w4a16_matmul(*mutate(_args()), **{"interpret": True, **kw})


def test_columns_not_a_multiple_of_64_are_refused():
    q4, s4, m4 = _weight(128, 96)
    with pytest.raises(ValueError, match="multiple of 64"):
        w4a16_matmul(jnp.zeros((1, 128), jnp.bfloat16), *pack_for_gpu(q4, s4, m4), interpret=True)


def test_hardware_mode_without_gpu_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        w4a16_matmul(*_args())


# ---------------------------------------------------------------------------
# The Linear: a tiny w4a16 model through the kernel against the XLA path.
# ---------------------------------------------------------------------------
def test_model_through_the_kernel_matches_the_xla_path(interpreter):
    from runtime.model import mosaic_linear
    from runtime.model.families import family
    from runtime.model.quant import cast_params, quantize_params
    from runtime.model.families import init_params
    from tests.tiny import tiny_config

    cfg = tiny_config(96, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, head_dim=64)
    params = quantize_params(init_params(cfg, 0), "w4a16")
    tokens = jnp.asarray([3, 17, 5, 9, 21], jnp.int32)
    fam = family(cfg)
    xla = fam.dense_logits(cfg, cast_params(params, jnp.bfloat16), tokens)
    packed = cast_params(mosaic_linear.pack_params(params), jnp.bfloat16)
    assert isinstance(packed["layers"]["wq"]["sg"], jax.Array) and packed["layers"]["wq"]["sg"].dtype == jnp.float32
    kernel = fam.dense_logits(cfg, packed, tokens)
    a, b = np.asarray(kernel, np.float32), np.asarray(xla, np.float32)
    np.testing.assert_allclose(a, b, atol=3e-2 * np.abs(b).max(), rtol=3e-2)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8


def test_the_kernel_applies_only_to_16_bit_w4a16_on_one_gpu():
    from runtime.model.mosaic_linear import applies, hopper

    if jax.default_backend() != "gpu":
        assert not hopper()  # (a CPU, or a GPU before Hopper: the XLA path)
    assert applies("w4a16", jnp.bfloat16, 1) is hopper()
    assert not applies("w4a16", jnp.float32, 1)
    assert not applies("w4a16", jnp.bfloat16, 2)
    assert not applies("w8a8", jnp.bfloat16, 1)


def test_a_width_the_kernel_does_not_tile_stays_on_the_xla_path():
    from runtime.model.mosaic_linear import pack_params

    wide, narrow = (dict(zip(("q4", "s4", "m4"), _weight(128, n))) for n in (128, 80))
    packed = pack_params({"layers": {"wq": wide, "wk": narrow, "attn_norm": np.ones(128, np.float32)}})["layers"]
    assert set(packed["wq"]) == {"qg", "sg", "mg"} and packed["wk"] is narrow
    assert packed["attn_norm"].shape == (128,)


def test_gpu_check_step_dry_run(interpreter, monkeypatch):
    """scripts/gpu_check.py's w4a16 step off a GPU: every timed shape lowers, and the
    interpreted kernel agrees with the reference."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import gpu_w4a16

    out, failed = gpu_w4a16.run(False, 1, lambda: 100.0)
    assert not failed and out["shapes"][0]["ok"]
    assert len(out["shapes"][0]["lowered"]) == len(gpu_w4a16.SHAPES)
