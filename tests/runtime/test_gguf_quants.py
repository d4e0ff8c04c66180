"""GGUF tensor types decode exactly as llama.cpp's ggml does: GGUFSource.tensors (through the
gguf package) against a transcription of ggml-quants.c's dequantize_row_* on random blocks,
bit for bit, for every type SUPPORTED_TYPES names."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from runtime.checkpoint.gguf_source import SUPPORTED_TYPES, GGUFSource

F32 = np.float32
QK_K = 256


def half(b: np.ndarray) -> F32:
    return F32(np.frombuffer(bytes(b), np.float16)[0])


def scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return ((int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4),
            (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4))


# One block (uint8 bytes) -> its values, step by step as the C code computes them in float.
def ref_q8_0(b):
    d = half(b[:2])
    return [F32(int(q) * d) for q in b[2:].view(np.int8)]


def ref_q4_0(b, with_min=False):
    d = half(b[:2])
    m = half(b[2:4]) if with_min else None
    qs = b[4:] if with_min else b[2:]
    lo = [(int(q) & 0xF) for q in qs] + [(int(q) >> 4) for q in qs]
    return [F32(x * d + m) if with_min else F32((x - 8) * d) for x in lo]


def ref_q5_0(b, with_min=False):
    d = half(b[:2])
    m = half(b[2:4]) if with_min else None
    off = 4 if with_min else 2
    qh = int.from_bytes(bytes(b[off:off + 4]), "little")
    qs = b[off + 4:]
    out = [F32(0)] * 32
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        x0 = (int(qs[j]) & 0x0F) | xh0
        x1 = (int(qs[j]) >> 4) | xh1
        if with_min:
            out[j], out[j + 16] = F32(x0 * d + m), F32(x1 * d + m)
        else:
            out[j], out[j + 16] = F32((x0 - 16) * d), F32((x1 - 16) * d)
    return out


def ref_q4_k(b):
    d, dmin, scales, q = half(b[:2]), half(b[2:4]), b[4:16], b[16:]
    out = []
    for j in range(QK_K // 64):
        sc, m = scale_min_k4(2 * j, scales)
        d1, m1 = F32(d * F32(sc)), F32(dmin * F32(m))
        sc, m = scale_min_k4(2 * j + 1, scales)
        d2, m2 = F32(d * F32(sc)), F32(dmin * F32(m))
        qq = q[32 * j:32 * j + 32]
        out += [F32(d1 * F32(int(x) & 0xF) - m1) for x in qq]
        out += [F32(d2 * F32(int(x) >> 4) - m2) for x in qq]
    return out


def ref_q5_k(b):
    d, dmin, scales, qh, ql = half(b[:2]), half(b[2:4]), b[4:16], b[16:48], b[48:]
    out, u1, u2 = [], 1, 2
    for j in range(QK_K // 64):
        sc, m = scale_min_k4(2 * j, scales)
        d1, m1 = F32(d * F32(sc)), F32(dmin * F32(m))
        sc, m = scale_min_k4(2 * j + 1, scales)
        d2, m2 = F32(d * F32(sc)), F32(dmin * F32(m))
        qq = ql[32 * j:32 * j + 32]
        out += [F32(d1 * F32((int(x) & 0xF) + (16 if int(h) & u1 else 0)) - m1) for x, h in zip(qq, qh)]
        out += [F32(d2 * F32((int(x) >> 4) + (16 if int(h) & u2 else 0)) - m2) for x, h in zip(qq, qh)]
        u1, u2 = u1 << 2, u2 << 2
    return out


def ref_q6_k(b):
    ql, qh, sc, d = b[:128], b[128:192], b[192:208].view(np.int8), half(b[208:210])
    out = [F32(0)] * QK_K
    for n in range(2):
        L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
        for lane in range(32):
            i = lane // 16
            q1 = ((int(L[lane]) & 0xF) | (((int(H[lane]) >> 0) & 3) << 4)) - 32
            q2 = ((int(L[lane + 32]) & 0xF) | (((int(H[lane]) >> 2) & 3) << 4)) - 32
            q3 = ((int(L[lane]) >> 4) | (((int(H[lane]) >> 4) & 3) << 4)) - 32
            q4 = ((int(L[lane + 32]) >> 4) | (((int(H[lane]) >> 6) & 3) << 4)) - 32
            for k, q in enumerate((q1, q2, q3, q4)):
                out[128 * n + lane + 32 * k] = F32(F32(d * F32(int(S[i + 2 * k]))) * F32(q))
    return out


def ref_f16(b):
    return list(b.view(np.float16).astype(F32))


def ref_bf16(b):
    return list((b.view(np.uint16).astype(np.uint32) << 16).view(F32))


def ref_f32(b):
    return list(b.view(F32))


REFERENCE = {
    "Q8_0": ref_q8_0, "Q4_0": ref_q4_0, "Q4_1": lambda b: ref_q4_0(b, True), "Q5_0": ref_q5_0,
    "Q5_1": lambda b: ref_q5_0(b, True), "Q4_K": ref_q4_k, "Q5_K": ref_q5_k, "Q6_K": ref_q6_k,
    "F16": ref_f16, "BF16": ref_bf16, "F32": ref_f32,
}
# Byte offsets of each block's float16 scales: set to finite values (random bytes could be NaN).
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n_blocks: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Random bytes for n_blocks blocks (finite scales and values); -> (uint8 [n, type_size], block_size)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype in ("F16", "F32", "BF16"):
        vals = rng.standard_normal(n_blocks * block).astype(F32)
        cast = {"F16": np.float16, "F32": F32}.get(qtype)
        raw = (vals.astype(cast).view(np.uint8) if cast else (vals.view(np.uint32) >> 16).astype(np.uint16)
               .view(np.uint8)).reshape(n_blocks, size)
    for off in HALVES.get(qtype, ()):
        raw[:, off:off + 2] = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw, block


def write_typed_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str, tuple[int, int]]]) -> Path:
    """A GGUF holding raw blocks: name -> (uint8 bytes, type, (rows, cols))."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, qtype, (rows, cols)) in tensors.items():
        qt = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        w.add_tensor(name, raw.reshape(rows, cols // block * size), raw_dtype=qt)  # the shape in bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_supported_type_decodes_as_ggml(tmp_path):
    rng = np.random.default_rng(0)
    rows, tensors, want = 2, {}, {}
    for qtype in sorted(SUPPORTED_TYPES):
        raw, block = random_blocks(qtype, 2 * rows, rng)
        tensors[f"t.{qtype}"] = (raw, qtype, (rows, 2 * block))
        want[f"t.{qtype}"] = np.array([v for b in raw for v in REFERENCE[qtype](b)], F32).reshape(rows, 2 * block)
    assert set(REFERENCE) == SUPPORTED_TYPES
    got = dict(GGUFSource(write_typed_gguf(tmp_path / "q.gguf", tensors)).tensors())
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == F32 and got[name].shape == w.shape, name
        assert np.array_equal(got[name].view(np.uint32), w.view(np.uint32)), name  # bit for bit


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_requantizing_a_dequantized_tensor_gives_the_same_bytes(qtype):
    """The types gguf can write: quantize -> dequantize -> quantize is a fixed point, byte for byte."""
    qt = gguf.GGMLQuantizationType[qtype]
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(F32)
    q = quantize(x, qt)
    y = dequantize(q, qt)
    assert np.abs(y - x).max() < 0.5  # a real (lossy) quantization of x, not garbage
    assert np.array_equal(quantize(y, qt), q)
    assert np.array_equal(dequantize(quantize(y, qt), qt).view(np.uint32), y.view(np.uint32))


def test_an_unsupported_type_is_refused_naming_the_tensor(tmp_path):
    from runtime.checkpoint.mapping import CheckpointError

    raw, block = random_blocks("Q2_K", 1, np.random.default_rng(2))
    path = write_typed_gguf(tmp_path / "q.gguf", {"t.q2": (raw, "Q2_K", (1, block))})
    with pytest.raises(CheckpointError, match=r"tensor 't.q2' has unsupported type Q2_K"):
        GGUFSource(path)
