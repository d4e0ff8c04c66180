"""Swap preemption (runtime/core/kv_tiers.py SwapSpace, the scheduler's `_preempt` / `_admit`):
a batch-tier victim's KV goes to the host tier and comes back when it resumes, so it computes
nothing twice; interactive victims keep recompute; the greedy tokens never change."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from runtime.core.kv_tiers import SWAP_COOLDOWN_STEPS, HostTier, SwapSpace
from runtime.core.request import Request
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

SP = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 260, size=n)]


def engine(ckpt, offload: int = 0, mode: str = "auto"):
    from runtime.core.engine import LLMEngine

    eng = make_engine(ckpt, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                      watermark=0.0)
    cfg = replace(eng.config, kv_offload_memory=offload, preemption_mode=mode)
    return LLMEngine.from_checkpoint(ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)


def run(eng, priority: str):
    """Four 40-token prompts that grow to 100 tokens each (28 blocks) in a 14-block pool."""
    reqs = [eng.add_request(prompt(i, 40), SP, priority=priority) for i in range(4)]
    peak = 0
    while eng.has_unfinished():
        eng.step()
        if eng.host_tier is not None:
            t = eng.host_tier
            assert t.bytes + t.swapped <= t.capacity_bytes
            peak = max(peak, t.swapped)
    eng.pool.check_invariants()
    assert eng.pool.num_used_blocks == 0
    return [r.output_ids for r in reqs], eng.scheduler.counters, peak


def test_batch_victims_swap_and_recompute_nothing_with_the_same_tokens(tiny_ckpt):
    plain, c_plain, _ = run(engine(tiny_ckpt), "batch")
    recomp_eng = engine(tiny_ckpt, 64 << 20, "recompute")
    recomp, c_recomp, _ = run(recomp_eng, "batch")
    swap_eng = engine(tiny_ckpt, 64 << 20, "auto")
    swapped, c_swap, peak = run(swap_eng, "batch")
    assert swapped == plain == recomp
    assert c_plain.preemptions >= 2 and c_plain.recomputed_tokens >= 100
    assert c_recomp.swapped_out == 0
    assert c_swap.swapped_out >= 2 and c_swap.swapped_in == c_swap.swapped_out
    assert c_swap.recomputed_tokens <= 0.2 * c_plain.recomputed_tokens
    assert peak > 0 and swap_eng.host_tier.swapped == 0  # (every swap came back and let its bytes go)
    metrics = swap_eng.metrics.render().decode()
    assert f"pagedjax:preemption_swaps_total {float(c_swap.swapped_out)}" in metrics
    snap = swap_eng.snapshot()
    assert snap.swapped_out == c_swap.swapped_out and snap.recomputed_tokens == c_swap.recomputed_tokens


def test_interactive_victims_keep_recompute(tiny_ckpt):
    _, c, _ = run(engine(tiny_ckpt, 64 << 20, "auto"), "interactive")
    assert c.preemptions >= 2 and c.swapped_out == 0 and c.recomputed_tokens > 0


def test_aborting_a_swapped_request_gives_its_host_bytes_back(tiny_ckpt):
    eng = engine(tiny_ckpt, 64 << 20, "auto")
    reqs = [eng.add_request(prompt(i, 40), SP, priority="batch") for i in range(4)]
    while not any(r.swap is not None and r.swap.arrays is not None for r in reqs):
        assert eng.has_unfinished()
        eng.step()
    victim = next(r for r in reqs if r.swap is not None)
    assert eng.host_tier.swapped == victim.swap.nbytes == sum(a.nbytes for a in victim.swap.arrays) > 0
    eng.abort(victim.request_id)
    eng.run_until_done()
    assert victim.finish_reason == "abort" and victim.swap is None
    assert eng.host_tier.swapped == 0
    eng.pool.check_invariants()
    assert eng.pool.num_used_blocks == 0


def _req(priority="batch", computed=96, blocks=6, **params) -> Request:
    r = Request("r", list(range(100)), SamplingParams(temperature=0.0, **params), priority=priority)
    r.block_tables = [list(range(blocks))]
    r.num_computed_tokens = computed
    return r


def test_the_swap_rule():
    space = SwapSpace(HostTier(10_000), block_bytes=1000)
    assert space.decide(_req("interactive"), 100) is None and not space.declined  # not its tier
    out = space.decide(_req(), 100)
    assert out is not None and out.nbytes == 6000 and space.tier.swapped == 6000
    assert space.decide(_req(), 100) is None and space.declined == {"host tier full": 1}
    space.release(out)
    assert space.tier.swapped == 0
    cooling = _req()
    cooling.swapped_in_at = 100 - SWAP_COOLDOWN_STEPS + 1
    assert space.decide(cooling, 100) is None and space.declined["cooldown"] == 1
    assert space.decide(_req(repetition_penalty=1.2), 100) is None
    assert space.declined["computes every token"] == 1
    # by cost: out and back 12,000 bytes at 1 us/byte (12 ms) against 96 tokens at 0.1 / 1 ms each
    space.observe_copy(1.0, 1_000_000)
    space.observe_prefill(0.1, 1000)
    assert space.decide(_req(), 100) is None and space.declined["recompute cheaper"] == 1
    space.prefill_s_per_token = None
    space.observe_prefill(1.0, 1000)
    assert space.decide(_req(), 100) is not None


@pytest.mark.parametrize("bad", ["swap", "never"])
def test_an_unknown_preemption_mode_is_refused(tiny_ckpt, bad):
    with pytest.raises(ValueError, match="preemption_mode: must be 'auto' or 'recompute'"):
        engine(tiny_ckpt, 64 << 20, bad)


def test_the_flags_parse_and_a_disk_limit_without_a_directory_is_refused(tiny_ckpt):
    import argparse

    from runtime.core.engine_args import add_engine_arguments, engine_config_from_args
    import json

    from runtime.config import ModelConfig

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    model = ModelConfig.from_json(json.loads((tiny_ckpt / "config.json").read_text()))
    cfg = engine_config_from_args(ap.parse_args(["--kv-offload-memory", "1GiB", "--preemption-mode", "recompute"]))(model)
    assert cfg.preemption_mode == "recompute" and cfg.kv_offload_memory == 1 << 30
    with pytest.raises(SystemExit):
        ap.parse_args(["--preemption-mode", "swap"])
    with pytest.raises(ValueError, match="kv_offload_disk: the disk tier's limit needs --kv-offload-dir"):
        engine_config_from_args(ap.parse_args(["--kv-offload-memory", "1GiB", "--kv-offload-disk", "2GiB"]))(model)
