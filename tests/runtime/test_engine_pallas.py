"""The engine with attention_backend=pallas (the Mosaic GPU kernel, run by the
interpreter on CPU) gives the same greedy tokens as the plain-XLA path, over a bfloat16
cache and over an fp8_e4m3 one (1-byte values with per-token scales). The int8 cache (a scale
and zero per group of 8 or 32 channels) is not the kernel's: asked for by name, refused."""

import numpy as np
import pytest

from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
from runtime.core.engine import LLMEngine
from runtime.model.sampling import SamplingParams


def engine(ckpt, backend, kv_dtype="bfloat16"):
    def build(model):
        env = SchedulerConfig(4, 32, 256, min_token_bucket=32)  # one prefill shape: interpreting is slow
        return EngineConfig(model, CacheConfig(16, 48, kv_dtype), env,
                            AdmissionPolicy(max_num_seqs=4, max_num_batched_tokens=32,
                                            long_prefill_token_threshold=32), backend, "bfloat16")

    return LLMEngine.from_checkpoint(ckpt, build, warmup=False, progress=False)


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory):
    from tests.tiny import make_tiny_checkpoint

    # The kernel supports head dims 64 and 128 (GQA 3, as SmolLM2).
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny64", head_dim=64, num_heads=6, num_kv_heads=2)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_pallas_backend_matches_xla_greedy(ckpt64, kv_dtype):
    tiny_ckpt = ckpt64
    rng = np.random.default_rng(0)
    # A short prompt and one longer than the 32-token budget (chunked), decoding side by side.
    prompts = [list(rng.integers(3, 260, size=n)) for n in (5, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    xla = [r.output_ids for r in engine(tiny_ckpt, "xla", kv_dtype).generate(prompts, params)]
    eng = engine(tiny_ckpt, "pallas", kv_dtype)
    assert eng.runner.attention_backend == "pallas"
    if kv_dtype != "bfloat16":  # the cache the kernel reads is the 1-byte one
        assert eng.runner.kv[0].values.dtype.itemsize == 1
    pallas = [r.output_ids for r in eng.generate(prompts, params)]
    assert pallas == xla


def test_pallas_backend_refuses_the_int8_cache_in_one_line(ckpt64):
    with pytest.raises(ValueError, match="pallas does not implement the int8 cache's scales and zeros per group of channels"):
        engine(ckpt64, "pallas", "int8")
