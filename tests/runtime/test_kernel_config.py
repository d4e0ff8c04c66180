"""The CPU kernels' switches live in EngineConfig.kernels (CLI flags), environment variables
override them in one place (KernelConfig.with_env), and the runner obeys them."""

from __future__ import annotations

import argparse

import pytest

from runtime.config import KernelConfig
from runtime.core.engine_args import add_engine_arguments, kernel_config_from_args
from runtime.kernels.cpu import build as cpu_kernels
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine


def test_environment_overrides_each_field_and_nothing_else():
    base = KernelConfig(f32_kernel="on", linger_us=7)
    assert base.with_env({}) == base
    env = {"PAGEDJAX_CPU_KERNELS": "0", "PAGEDJAX_F32_KERNEL": "0", "PAGEDJAX_AMX": "0",
           "PAGEDJAX_PER_LAYER_WEIGHTS": "0", "PAGEDJAX_HUGEPAGES": "0", "PAGEDJAX_LINGER_US": "0"}
    assert base.with_env(env) == KernelConfig(False, "off", False, False, False, 0)
    assert KernelConfig(cpu_kernels=False).with_env({"PAGEDJAX_CPU_KERNELS": "1"}).cpu_kernels
    with pytest.raises(ValueError, match="f32_kernel"):
        KernelConfig(f32_kernel="fast")


def test_cli_flags_make_the_kernel_config():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert kernel_config_from_args(p.parse_args([])) == KernelConfig()
    args = p.parse_args(["--no-cpu-kernels", "--f32-kernel", "off", "--no-amx", "--no-per-layer-weights",
                         "--no-huge-pages", "--linger-us", "0"])
    assert kernel_config_from_args(args) == KernelConfig(False, "off", False, False, False, 0)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ CPU kernels are not built here")
def test_runner_obeys_the_switches_with_the_same_tokens(tiny_ckpt, monkeypatch):
    for var in KernelConfig.ENV.values():
        monkeypatch.delenv(var, raising=False)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11]]
    on = make_engine(tiny_ckpt)
    off = make_engine(tiny_ckpt, kernels=KernelConfig(cpu_kernels=False, per_layer_weights=False, huge_pages=False))
    assert on.runner.attention_kernel and not off.runner.attention_kernel
    assert not off.runner.f32_kernel and not off.runner.per_layer_weights
    assert [r.output_ids for r in on.generate(prompts, sp)] == [r.output_ids for r in off.generate(prompts, sp)]
