"""Every instruction-set variant of the C++ CPU kernels (runtime/kernels/cpu/build.py VARIANTS:
native, avx512-amx, avx512-vnni, avx2, scalar) built and checked on this machine, each in a
process of its own (PAGEDJAX_CPU_KERNEL_VARIANT=<name> python -m tests.kernels.check_variant):
the library reports the variant's paths (the avx2 build no VNNI, the scalar one no vector
code), and its int8 linear, float32 linear, layer tail, attention and KV write equal the
numpy references. A variant this CPU cannot execute skips, naming the missing features.
Without a compiler the kernels are refused in one log line and XLA serves."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from runtime.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")
OUTPUTS: dict[str, Path] = {}  # variant -> its outputs (.npz), for the cross-variant comparison


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDJAX_CPU_KERNELS", build.VARIANT_ENV)}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", list(build.VARIANTS))
def test_variant_builds_and_matches_the_references(variant, tmp_path_factory):
    if build.compiler() is None:
        pytest.skip("no C++ compiler: the kernels are not built here (XLA serves)")
    if variant != "native" and not X86:
        pytest.skip(f"{variant} is an x86-64 build; this machine is {platform.machine()}")
    if lacks := build.missing_features(variant):
        pytest.skip(f"this CPU lacks {' '.join(lacks)}: the {variant} build cannot run here")
    out = tmp_path_factory.mktemp("variant") / f"{variant}.npz"
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.check_variant", str(out)], cwd=ROOT,
                          env=_env(**{build.VARIANT_ENV: variant}), capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["variant"] == variant and report["checks"] > 30
    paths = report["paths"]
    if want := build.VARIANTS[variant].paths:
        assert {k: paths[k] for k in want} == want
    if variant == "avx2":  # AVX2 + FMA float paths, and no VNNI: int8 takes the scalar loop
        assert not paths["int8_vectorized"] and paths["f32_vectorized"] and not paths["amx"]
    if variant == "scalar":  # no vector code at all
        assert not paths["int8_vectorized"] and not paths["f32_vectorized"] and paths["attention"] == "scalar"
    OUTPUTS[variant] = out


def test_variants_give_the_same_bits_where_the_kernels_say_so():
    """The int8 products (integer sums, the same two scalings) and the float32 products (each
    output the same k-ordered FMA chain: cpu_linear_f32.cc) equal bit for bit on every
    variant, AMX and the scalar loops included; the rest (exp, the norm's reduction, the
    attention split) only to the references' tolerances."""
    if len(OUTPUTS) < 2:
        pytest.skip("fewer than two variants ran in this session")
    runs = {v: np.load(p) for v, p in OUTPUTS.items()}
    first, *others = runs
    keys = [k for k in runs[first].files if k.startswith(("int8_", "f32_")) and not k.startswith("int8_g32")]
    assert len(keys) >= 15
    for v in others:
        for k in keys:
            np.testing.assert_array_equal(runs[v][k], runs[first][k], err_msg=f"{k}: {v} against {first}")


def test_missing_features_names_what_the_cpu_lacks(monkeypatch):
    if not X86:
        assert build.missing_features("avx2") == ["x86_64"] and build.missing_features("native") == []
        return
    monkeypatch.setattr(build, "cpu_flags", lambda: set(build.VARIANTS["avx2"].needs))  # an AVX2-only CPU
    assert build.missing_features("avx2") == [] and build.missing_features("scalar") == []
    assert build.missing_features("native") == []
    assert {"avx512f", "avx512_vnni"} <= set(build.missing_features("avx512-vnni"))
    assert {"amx_tile", "amx_int8"} <= set(build.missing_features("avx512-amx"))


def test_the_flags_pin_each_branch():
    flags = {n: " ".join(v.flags) for n, v in build.VARIANTS.items()}
    assert flags["native"] == "-march=native"
    assert "-march=x86-64-v3" in flags["avx2"] and "-mno-avx512f" in flags["avx2"]
    assert "-march=x86-64 " in flags["scalar"] + " "
    assert "-mavx512vnni" in flags["avx512-vnni"] and "-mamx-int8" not in flags["avx512-vnni"]
    assert "-mamx-int8" in flags["avx512-amx"] and "-mamx-tile" in flags["avx512-amx"]


LOAD = textwrap.dedent("""
    import logging, json, sys
    logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(name)s: %(message)s")
    from runtime.kernels.cpu import attention as cpu_attention
    from runtime.kernels.cpu import matmul as cpu_matmul
    out = {"available": cpu_attention.available(), "int8": cpu_matmul.vectorized(),
           "f32": cpu_matmul.f32_default()}
    if len(sys.argv) > 1:  # then serve a few tokens
        from runtime.cli import enable_compilation_cache
        from runtime.model.sampling import SamplingParams
        enable_compilation_cache()  # (plain XLA programs here: no kernel target in them)
        from tests.engine_util import make_engine
        eng = make_engine(sys.argv[1])
        r = eng.generate([[3, 4, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        out.update(attention_kernel=eng.runner.attention_kernel, f32_kernel=eng.runner.f32_kernel,
                   tokens=r[0].output_ids)
    print(json.dumps(out))
""")


def _load(env: dict[str, str], *args: str) -> tuple[dict, list[str]]:
    proc = subprocess.run([sys.executable, "-c", LOAD, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # the kernels' build says what it did (hugepages, in the same package, logs its own arena)
    logs = [line for line in proc.stderr.splitlines() if "runtime.kernels.cpu.build" in line]
    return json.loads(proc.stdout.strip().splitlines()[-1]), logs


def test_without_a_compiler_one_line_says_so_and_xla_serves(tiny_ckpt, tmp_path):
    env = _env(PATH=str(tmp_path / "no-bin"), PAGEDJAX_KERNEL_CACHE=str(tmp_path / "cache"))
    env.pop("CXX", None)
    out, logs = _load(env, str(tiny_ckpt))
    assert len(logs) == 1 and "no C++ compiler" in logs[0] and "plain XLA" in logs[0], logs
    assert out["available"] is False and not out["int8"] and not out["f32"]
    assert out["attention_kernel"] is False and out["f32_kernel"] is False and len(out["tokens"]) == 4


def test_a_variant_this_cpu_cannot_run_or_an_unknown_one_is_refused_in_one_line():
    refused = next((v for v in build.VARIANTS if build.missing_features(v)), "no-such-variant")
    out, logs = _load(_env(**{build.VARIANT_ENV: refused}))
    assert out["available"] is False
    assert len(logs) == 1 and "plain XLA" in logs[0] and (
        "lacks" in logs[0] if refused in build.VARIANTS else "unknown CPU kernel variant" in logs[0]), logs
