"""Tensor parallelism (runtime/model/tp.py) on CPU with forced host devices: TP 2/4 give TP 1's
greedy tokens and logprobs (prefix cache, chunked prefill, preemption included) with no
compilations after warm-up; invalid sizes fail with one line. The parity runs go through
tests/runtime/tp_check.py in a subprocess (XLA_FLAGS must be set before jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "runtime" / "tp_check.py"
TOL = 1e-4


def _env(devices: int = 4) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.setdefault("PAGEDJAX_JAX_CACHE", str(Path.home() / ".cache" / "pagedjax" / "jax-tests"))
    return env


def _run_check(ckpt: Path, *args: str, timeout: int = 600, **env: str) -> dict[int, dict]:
    out = subprocess.run([sys.executable, str(CHECK), str(ckpt), *args], env={**_env(), **env}, capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["tp"]: r for r in rows}


def _assert_parity(res: dict[int, dict], tps: list[int], *, pressure: bool = True) -> None:
    ref = res[1]
    assert ref["prefix_hits"] > 0
    if pressure:
        assert ref["preemptions"] > 0
    for tp in tps:
        r = res[tp]
        assert r["same_tokens"], (r["tokens"], ref["tokens"])
        assert r["max_logprobs_diff"] < TOL and r["max_top_diff"] < TOL, r
        assert r["prefix_hits"] == ref["prefix_hits"]
        if pressure:
            assert r["preemptions"] == ref["preemptions"] > 0
        assert r["compilations_after_warmup"] == 0
        assert r["devices"] == 4
    assert ref["compilations_after_warmup"] == 0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tp")
    # vocab_size 268 (the tokenizer's 267 + one unused row) divides by 2 and 4.
    return {"8q4kv": make_tiny_checkpoint(d / "8q4kv", num_heads=8, num_kv_heads=4, vocab_size=268),
            "8q2kv": make_tiny_checkpoint(d / "8q2kv", num_heads=8, num_kv_heads=2, vocab_size=268),
            "4q2kv": make_tiny_checkpoint(d / "4q2kv")}


def test_tp2_tp4_match_tp1(ckpts):
    res = _run_check(ckpts["8q4kv"], "2", "4")
    _assert_parity(res, [2, 4])
    assert res[2]["kv_shard_shape"][2] == 2 and res[4]["kv_shard_shape"][2] == 1  # the cache by KV head


def test_gemma3_tp2_matches_tp1(tmp_path):
    """Gemma 3's layer (pre- and post-norms, q/k norms, GeGLU, scaled embeddings) with a
    sliding window on 2 of 3 layers (KV groups: pages released as the window passes) and both
    soft-caps, sharded 2 ways: TP 1's tokens and logprobs."""
    ckpt = make_tiny_checkpoint(tmp_path / "gemma3", architecture="gemma3", num_heads=4, num_kv_heads=2,
                                num_layers=3, vocab_size=268, sliding_window=24, hidden_activation="gelu_tanh",
                                layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                                query_pre_attn_scalar=16.0, attn_logit_softcapping=50.0,
                                final_logit_softcapping=30.0, rope_local_theta=10000.0, rope_theta=1e6)
    # 3 KV groups of 1 layer (1 full, 2 sliding): a page is a third of a Llama page here
    res = _run_check(ckpt, "2", "--pages=30")
    _assert_parity(res, [2])


def test_tp4_replicates_kv_heads(ckpts):
    res = _run_check(ckpts["8q2kv"], "4")
    _assert_parity(res, [4])
    assert res[4]["kv_heads"] == 4 and res[4]["kv_shard_shape"][2] == 1  # 2 KV heads, each twice


def test_w8a8_checkpoint_with_int8_head_matches_tp1(ckpts, tmp_path):
    """A `convert --quantize w8a8 --quantize-lm-head` checkpoint restored into its shards: TP 2
    (int8 values, scales and input scales split with their weights, the int8 head by
    vocabulary) and TP 4 (quantized wk/wv replicated per KV head) give TP 1's tokens."""
    from runtime.checkpoint.store import read_meta
    from runtime.cli import main

    out = tmp_path / "w8a8"
    assert main(["convert", "--from", "pagedjax", str(ckpts["8q2kv"]), "--out", str(out), "--quantize", "w8a8",
                 "--quantize-lm-head"]) == 0
    assert read_meta(out)["quantization"] == "w8a8"
    # TP 1 on the same XLA int8 path as the shards (the C++ int8 kernel quantizes 1-row
    # activations that XLA's path keeps float, and serves the int8 head at 1 row): the
    # comparison is of the sharding alone
    res = _run_check(out, "2", "4", "--quick", PAGEDJAX_CPU_KERNELS="0")
    _assert_parity(res, [2, 4], pressure=False)
    assert res[4]["kv_heads"] == 4 and res[2]["quantization"] == res[4]["quantization"] == "w8a8"
    assert res[1]["lm_head_int8"] and res[4]["lm_head_int8"]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_pallas_step_under_tp_lowers_for_two_gpus(tmp_path, kv_dtype):
    """The TP 2 engine step with the Pallas kernel (tests/runtime/tp_pallas_lower.py), lowered
    for CUDA: one Mosaic GPU kernel per layer inside the step's shard_map, each reading its
    device's KV head of the cache (1 of 2) and that head's query rows; an fp8 cache's 1-byte
    values and per-token scales go to the kernel as such."""
    ckpt = make_tiny_checkpoint(tmp_path / "tiny64", head_dim=64, num_heads=6, num_kv_heads=2)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "runtime" / "tp_pallas_lower.py"), str(ckpt), kv_dtype],
                         env=_env(2), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert r["backend"] == "pallas" and r["num_partitions"] == 2 and r["shard_map"]
    assert len(r["kernel_operands"]) == 1  # in the layer scan's body: one call per layer
    ops = r["kernel_operands"][0]
    cache_rows = r["num_layers"] * r["num_blocks"]
    elem = "f8E4M3FN" if kv_dtype == "fp8_e4m3" else "bf16"
    assert ops[3] == ops[4] == f"tensor<{cache_rows}x16x1x64x{elem}>"  # this device's 1 of 2 KV heads
    assert ops[2].startswith("tensor<1x") and ops[2].endswith("x64xbf16>")  # its 3 query heads' rows
    if kv_dtype == "fp8_e4m3":
        assert len(ops) == 7 and ops[5] == ops[6] and ops[5].startswith("tensor<4x1x")  # [S, 1 head, tokens] scales
    else:
        assert len(ops) == 5


def test_quantized_weights_shard_with_their_weights():
    """The spec rules for w8a8 / w8a16 leaves, without an engine."""
    import numpy as np

    from runtime.model import tp
    from tests.tiny import tiny_config

    cfg = tiny_config(268, num_heads=8, num_kv_heads=2)
    q = lambda i, o, extra=(): {"q": np.zeros((2, i, o), np.int8), "s": np.zeros((2, o)), **dict(extra)}
    params = {"embed": np.zeros((268, 64)), "final_norm": np.zeros(64),
              "head": {"q": np.zeros((64, 268), np.int8), "s": np.zeros(268), "in": np.zeros(64)},
              "layers": {"wq": q(64, 128), "wk": q(64, 32), "wo": q(128, 64, [("in", np.zeros((2, 128)))]),
                         "w_up": {"w8": np.zeros((2, 64, 128), np.int8), "s": np.zeros((2, 128))}}}
    sp = tp.param_specs(cfg, params, 2)
    t = lambda x: tuple(x)
    assert t(sp["layers"]["wq"]["q"]) == (None, None, "tp") and t(sp["layers"]["wq"]["s"]) == (None, "tp")
    assert t(sp["layers"]["wo"]["q"]) == (None, "tp", None) and t(sp["layers"]["wo"]["s"]) == ()
    assert t(sp["layers"]["wo"]["in"]) == (None, "tp")  # SmoothQuant's input scale goes with the rows
    assert t(sp["layers"]["w_up"]["w8"]) == (None, None, "tp") and t(sp["layers"]["w_up"]["s"]) == (None, "tp")
    assert t(sp["head"]["q"]) == (None, "tp") and t(sp["head"]["s"]) == ("tp",) and t(sp["head"]["in"]) == ()
    stored = tp.param_specs(cfg, params, 4, stored=True)  # 4 > 2 KV heads: wk stays whole until replicated
    assert t(stored["layers"]["wk"]["q"]) == () and t(stored["layers"]["wk"]["s"]) == ()
    # GGUF Q8_0's block scales "g" [L, in/32, out] go with the values: by columns, or by
    # groups of rows for a row-parallel weight
    g = lambda i, o: {"q": np.zeros((2, i, o), np.int8), "g": np.zeros((2, i // 32, o))}
    grouped = {**params, "head": {"q": np.zeros((64, 268), np.int8), "g": np.zeros((2, 268))},
               "layers": {"wq": g(64, 128), "wo": g(128, 64)}}
    gs = tp.param_specs(cfg, grouped, 2)
    assert t(gs["layers"]["wq"]["g"]) == (None, None, "tp") and t(gs["layers"]["wo"]["g"]) == (None, "tp", None)
    assert t(gs["head"]["g"]) == (None, "tp")
    with pytest.raises(ValueError, match="packed for the C\\+\\+ kernel"):
        tp.param_specs(cfg, {**params, "layers": {"wq": {"p": np.zeros(1), "s": np.zeros(1)}}}, 2)


def test_validation_messages():
    from runtime.model import tp
    from tests.tiny import tiny_config

    cfg = tiny_config(268, num_heads=8, num_kv_heads=4)
    cases = [(0, {}, "must be at least 1"), (8, {"num_devices": 4}, "only 4 devices"),
             (3, {"num_devices": 4}, "does not divide the model's 8 query heads"),
             (2, {"num_devices": 4, "attention_backend": "pallas"}, "Pallas"),
             (2, {"num_devices": 4, "quantization": "w4a16"}, "w4a16 weights are not sharded yet")]
    for n, kw, msg in cases:
        with pytest.raises(ValueError, match="tensor_parallel_size: .*" + msg):
            tp.validate(cfg, n, **kw)
    with pytest.raises(ValueError, match="more than the model's 3 KV heads and not a multiple"):
        tp.validate(tiny_config(268, num_heads=12, num_kv_heads=3), 4, num_devices=4)
    with pytest.raises(ValueError, match="does not divide the model's 4 KV heads"):
        tp.validate(tiny_config(268, num_heads=12, num_kv_heads=4), 3, num_devices=4)
    with pytest.raises(ValueError, match="MLP size 130"):
        tp.validate(tiny_config(268, num_heads=8, num_kv_heads=4, intermediate_size=130), 4, num_devices=4)
    tp.validate(cfg, 1)  # TP 1: nothing to check
    # A vocabulary that does not divide keeps the embeddings / LM head whole on each device.
    import numpy as np

    params = {"embed": np.zeros((267, 64)), "final_norm": np.zeros(64), "layers": {"wq": np.zeros((2, 64, 128))}}
    specs = tp.param_specs(tiny_config(267), params, 2)
    assert tuple(specs["embed"]) == (None, None) and tuple(specs["layers"]["wq"]) == (None, None, "tp")
    with pytest.raises(ValueError, match="parameter layers/wq of shape \\(2, 64, 128\\) does not shard 3 ways"):
        tp.check_shards(params, tp.param_specs(tiny_config(267), params, 3), 3)


def test_cli_rejects_bad_size_with_one_line(ckpts):
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--checkpoint", str(ckpts["4q2kv"]),
                          "--prompt", "hi", "--max-tokens", "2", "--tensor-parallel-size", "3"],
                         env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tensor_parallel_size: 3 does not divide the model's 4 query heads" in lines[0], lines
    too_many = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--checkpoint",
                               str(ckpts["4q2kv"]), "--prompt", "hi", "--tensor-parallel-size", "8"],
                              env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert too_many.returncode == 2
    assert "only 4 devices; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8" in too_many.stderr


def _assert_kv_in_place(r: dict) -> None:
    """The compiled step holds no temporary as large as one device's KV-cache shard: it writes
    the donated cache in place (tp_check.step_memory). A copied cache is not seen in tokens,
    step counts or compilations, only here (and in seconds per decode step)."""
    assert r["step_temp_bytes"] < r["kv_shard_bytes"], r


def test_tp_step_writes_kv_cache_in_place(ckpts):
    """TP 4 over 4 KV heads (one per device, as SmolLM2 at TP 3) and TP 2 (two per device):
    `generate`'s path (no warm-up, a 20-token prompt in two chunks, 4 tokens) over a
    2048-block pool. The same tokens, engine steps and 2 step programs as TP 1, and no
    per-layer copy of the cache: at TP 4 that copy once took 6 shards of temporaries
    (25 MB against the 4 MB shard) while tokens, steps and compilations stayed the same."""
    res = _run_check(ckpts["8q4kv"], "2", "4", "--memory")
    for tp in (1, 2, 4):
        r = res[tp]
        assert r["same_tokens"] and len(r["tokens"]) == 4, r
        assert r["compilations"] == 2 and r["steps"] == res[1]["steps"], r  # one prefill shape, one decode shape
        _assert_kv_in_place(r)


@pytest.mark.real_model
def test_smollm2_tp3_matches_tp1(smollm2_ckpt):
    """SmolLM2-135M: 9 query / 3 KV heads, vocabulary 49152, MLP 1536: TP 3 (2 prompts x 8 tokens,
    16-token chunks), one KV head per device; its step writes the cache in place (a copied
    cache made `pagedjax generate --tensor-parallel-size 3` take seconds to minutes per token)."""
    res = _run_check(smollm2_ckpt, "3", "--quick", "--step-memory")
    _assert_parity(res, [3], pressure=False)
    assert res[3]["kv_shard_shape"][2] == 1
    for tp in (1, 3):
        _assert_kv_in_place(res[tp])


SPEC_CHECK = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from runtime.core.engine import LLMEngine
from runtime.model.sampling import SamplingParams

def engine(tp, spec):
    env = SchedulerConfig(4, 32, 256)
    def build(model):
        return EngineConfig(model, CacheConfig(16, 64, "float32", True), env,
                            AdmissionPolicy(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=32),
                            "xla", "float32", tensor_parallel_size=tp, speculative=spec)
    build.tensor_parallel_size = tp
    return LLMEngine.from_checkpoint(Path({ckpt!r}), build, warmup=False, progress=False)

prompts = [[11, 12, 13, 14, 15] * 4, [31, 32, 33] * 6]
params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=4, max_tokens=24, ignore_eos=True)]
want = [r.output_ids for r in engine(1, None).generate(prompts, params)]
eng = engine(2, SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64))
got = [r.output_ids for r in eng.generate(prompts, params)]
print("SAME", got == want, eng.scheduler.counters.spec_accepted, eng.pool.num_used_blocks)
"""


def test_tp2_with_speculation_gives_tp1_tokens(ckpts):
    """Speculative decoding under TP 2 (the verify slots' logits gathered by vocabulary shard):
    greedy and seeded tokens equal TP 1 without speculation."""
    code = SPEC_CHECK.format(root=str(ROOT), ckpt=str(ckpts["8q4kv"]))
    out = subprocess.run([sys.executable, "-c", code], env=_env(2), capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    same, kept, used = next(x for x in out.stdout.splitlines() if x.startswith("SAME")).split()[1:]
    assert same == "True" and int(kept) > 0 and int(used) == 0
