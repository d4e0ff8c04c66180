"""The fleet's routing and autoscaling rules on synthetic stats (no Ray)."""

from __future__ import annotations

import pytest

from runtime.fleet.autoscale import ProactivePolicy, inputs_from_metrics
from runtime.fleet.policy import ReplicaStats, RouteRequest, ScaleInputs, ScaleKnobs, decide_scale, route


def stats(name: str, free: int = 100, running: int = 0, waiting: int = 0, mode: str = "optimistic",
          num_blocks: int = 100, **kw) -> ReplicaStats:
    return ReplicaStats(name, num_blocks, 16, free, 5, running, waiting, 64, mode, **kw)


REQ = RouteRequest(tuple(bytes([i]) * 32 for i in range(10)), prompt_tokens=170, max_tokens=64)


def test_longest_cached_prefix_wins_over_free_blocks():
    reps = [stats("a", free=90), stats("b", free=40), stats("c", free=40)]
    held = {"a": 2, "b": 7, "c": 3}
    d = route(REQ, reps, lambda r: held[r])
    assert (d.replica, d.reason, d.matched_blocks) == ("b", "prefix", 7)
    assert "matched 7 cached blocks" in d.describe()


def test_no_match_goes_to_most_free_blocks_and_ties_round_robin():
    reps = [stats("a", free=50), stats("b", free=80)]
    assert route(REQ, reps, lambda r: 0).replica == "b"
    tied = [stats("a", free=80), stats("b", free=80), stats("c", free=80)]
    last, picks = None, []
    for _ in range(4):
        d = route(REQ, tied, lambda r: 0, last_tie=last)
        assert d.reason == "tie"
        picks.append(last := d.replica)
    assert picks == ["a", "b", "c", "a"]


def test_equal_prefix_matches_prefer_free_blocks():
    reps = [stats("a", free=30), stats("b", free=60)]
    assert route(REQ, reps, lambda r: 4).replica == "b"


def test_replica_that_cannot_hold_the_request_is_skipped():
    # reserve mode: (170 + 64) / 16 -> 15 blocks, minus the 2 it already caches = 13;
    # 'a' has 15 - 5 (watermark) = 10 above the watermark and is busy, so it cannot.
    reps = [stats("a", free=15, running=3, mode="reserve"), stats("b", free=30, running=3, mode="reserve")]
    d = route(REQ, reps, lambda r: 2 if r == "a" else 0)
    assert d.replica == "b" and "needs 13 blocks" in d.skipped["a"]
    # optimistic mode only needs the prompt: 11 - 2 = 9 blocks, which fit in 'a'.
    reps = [stats("a", free=15, running=3), stats("b", free=30, running=3)]
    assert route(REQ, reps, lambda r: 2 if r == "a" else 0).replica == "a"


def test_blocks_routed_since_the_last_stats_count_against_a_replica():
    reps = [stats("a", free=40, running=1), stats("b", free=30, running=1)]
    assert route(REQ, reps, lambda r: 0).replica == "a"
    assert route(REQ, reps, lambda r: 0, pending_blocks=lambda r: 20 if r == "a" else 0).replica == "b"
    d = route(REQ, reps, lambda r: 0, pending_blocks=lambda r: 30)
    assert d.replica is None and d.reason == "full" and set(d.skipped) == {"a", "b"}
    assert "no replica can hold it" in d.describe()


def test_idle_replica_takes_anything_its_cache_can_hold():
    # Below the watermark but idle: the engine's own rule admits it, so the router must too.
    assert route(REQ, [stats("a", free=12)], lambda r: 0).replica == "a"
    assert route(REQ, [stats("a", free=12, running=1)], lambda r: 0).replica is None


def test_imbalance_guard_skips_a_hot_replica_despite_its_prefix():
    reps = [stats("hot", running=30, waiting=10), stats("cold", running=2)]
    held = {"hot": 9, "cold": 0}
    d = route(REQ, reps, lambda r: held[r], imbalance=16)
    assert d.replica == "cold" and d.reason == "free_blocks" and "queue 40 vs 2" in d.skipped["hot"]
    assert route(REQ, reps, lambda r: held[r], imbalance=64).replica == "hot"


def test_draining_replicas_get_nothing():
    reps = [stats("a", draining=True), stats("b", free=10, running=1)]
    d = route(RouteRequest((), 16, 4), reps, lambda r: 0)
    assert d.replica == "b" and d.skipped == {"a": "draining"}


def test_stats_round_trip_through_dicts():
    s = stats("a", step_time_s=0.1, queued_tokens=7)
    assert ReplicaStats.from_dict({**s.to_dict(), "unknown_field": 1}) == s
    assert s.headroom_blocks == 95 and s.queue == 0


# --- autoscaler ----------------------------------------------------------------------------------

K = ScaleKnobs(min_replicas=1, max_replicas=4, target_utilization=0.8, horizon_s=60, scale_in_utilization=0.4,
               scale_in_delay_s=30)


def test_scale_out_before_the_queue_overflows():
    # 1 replica of 64 seqs, 40 running (under 0.8 x 64 = 51) but 120 queued requests x 200
    # tokens at 50 ms a step: 24,000 x 0.05 / 60 = 20 more sequences -> 60 > 51: scale out.
    x = ScaleInputs(replicas=1, running=40, waiting=120, queued_tokens=24_000, step_time_s=0.05, max_num_seqs=64)
    d = decide_scale(x, K, {}, now=0)
    assert d.target == 2 and d.reason.startswith("scale out") and d.needed_seqs == pytest.approx(60)
    # The same queue at a faster step clears within the horizon: hold.
    fast = ScaleInputs(1, 40, 120, 24_000, 0.01, 64)
    assert decide_scale(fast, K, {}, now=0).target == 1


def test_scale_out_is_capped_and_unmeasured_queues_count_as_sequences():
    x = ScaleInputs(replicas=2, running=0, waiting=1000, queued_tokens=10**7, step_time_s=0.0, max_num_seqs=8)
    assert decide_scale(x, K, {}, now=0).target == 4


def test_scale_in_waits_for_the_delay_then_drops_one_replica():
    x = ScaleInputs(replicas=3, running=5, waiting=0, queued_tokens=0, step_time_s=0.05, max_num_seqs=64)
    state: dict = {}
    assert decide_scale(x, K, state, now=100).target == 3
    assert decide_scale(x, K, state, now=120).reason.startswith("hold: low demand")
    d = decide_scale(x, K, state, now=131)
    assert d.target == 2 and d.reason.startswith("scale in")
    # Demand coming back resets the timer.
    busy = ScaleInputs(3, 120, 0, 0, 0.05, 64)
    assert decide_scale(busy, K, state, now=140).target == 3 and "low_since" not in state


def test_never_below_min_replicas():
    x = ScaleInputs(replicas=1, running=0, waiting=0, queued_tokens=0, step_time_s=0.0, max_num_seqs=64)
    assert decide_scale(x, K, {}, now=0).target == 1


@pytest.mark.parametrize("bad", [dict(min_replicas=0), dict(min_replicas=3, max_replicas=2),
                                 dict(target_utilization=0.3, scale_in_utilization=0.4), dict(horizon_s=0)])
def test_bad_knobs_are_refused(bad):
    with pytest.raises(ValueError):
        ScaleKnobs(**bad).validate()


class Ctx:
    def __init__(self, metrics, current=1, target=1, state=None):
        self.aggregated_metrics, self.current_num_replicas, self.target_num_replicas = metrics, current, target
        self.policy_state = state or {}
        self.capacity_adjusted_min_replicas, self.capacity_adjusted_max_replicas = 1, 3


def test_ray_policy_reads_the_replicas_autoscaling_stats():
    metrics = {"running": {"r1": 60.0}, "waiting": {"r1": 50.0}, "queued_tokens": {"r1": 500_000.0},
               "step_time_s": {"r1": 0.05}, "max_num_seqs": {"r1": 64.0}}
    x = inputs_from_metrics(metrics, 1)
    assert (x.running, x.waiting, x.queued_tokens, x.step_time_s, x.max_num_seqs) == (60, 50, 500_000, 0.05, 64)
    policy = ProactivePolicy(min_replicas=1, max_replicas=8, horizon_s=60)
    target, state = policy(Ctx(metrics))
    assert target == 3  # the capacity-adjusted maximum (3) caps the knob's 8
    assert "logged_at" in state
    target, _ = policy(Ctx({}, current=2, target=2))
    assert target == 2  # nothing reported yet: hold (no scale-in before the delay)


def test_a_replica_start_failure_becomes_one_line():
    from runtime.fleet.serve import _one_line

    wall = RuntimeError("The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
                        '  File "replica.py", line 10, in __init__\n    raise FileNotFoundError(...)\n'
                        "ray.exceptions.RayTaskError(FileNotFoundError): ...\n"
                        "FileNotFoundError: /models/x: not a pagedjax checkpoint (no config.json)\n")
    assert _one_line(wall) == "FileNotFoundError: /models/x: not a pagedjax checkpoint (no config.json)"
    assert _one_line(RuntimeError("just text")) == "just text"


def test_pool_resize_validates_then_redeploys_only_what_changed():
    from runtime.fleet.pools import Pools

    calls = []
    pools = Pools({}, {"prefill": 1, "decode": 1}, 3, calls.append)
    for sizes, msg in [({"decode": 0}, "decode_replicas: must be a whole number of at least 1"),
                       ({"prefill": 2, "decode": 2}, "2 \\+ 2 replicas is more than the fleet's 3"),
                       ({"prefill": 1.5}, "prefill_replicas")]:
        with pytest.raises(ValueError, match=msg):
            pools.resize(sizes)
    assert calls == [] and pools.sizes == {"prefill": 1, "decode": 1}
    assert pools.resize({"prefill": 1}) == {} and calls == []          # no change: no redeploy
    assert pools.resize({"decode": 2}) == {"decode": (1, 2)}
    assert calls == [{"prefill": 1, "decode": 2}] and pools.view() == {"prefill": 1, "decode": 2, "max_replicas": 3}
    assert 'pagedjax:fleet_pool_replicas{pool="decode"} 2' in pools.metric_lines([])
    with pytest.raises(ValueError, match="cannot be resized"):
        Pools({}, {"prefill": 1, "decode": 1}, 3).resize({"decode": 2})


def test_lora_affinity_prefers_the_replica_holding_the_adapter_in_a_slot():
    """A request naming an adapter goes where it is resident in a device slot, over more free
    blocks elsewhere; never to a replica that does not serve it; a cached prefix (computed under
    that adapter) wins over residency, and a base request ignores adapters."""
    import dataclasses

    ad = lambda resident: (("tenant-a", 7, resident, "/ad"),)  # noqa: E731
    reps = [stats("a", free=90, loras=ad(False)), stats("b", free=40, loras=ad(True)), stats("c", free=95)]
    req = dataclasses.replace(REQ, lora="tenant-a")
    d = route(req, reps, lambda r: 0)
    assert (d.replica, d.reason) == ("b", "lora") and "device slot" in d.describe()
    assert d.skipped["c"] == "does not serve adapter tenant-a"
    assert route(req, reps, lambda r: {"a": 4, "b": 0, "c": 0}[r]).replica == "a"
    held_a = [stats("a", free=90, loras=ad(True)), stats("b", free=40, loras=ad(True))]
    assert route(req, held_a, lambda r: {"a": 0, "b": 3}[r]).reason == "prefix"
    assert route(REQ, reps, lambda r: 0).replica == "c"
    none_resident = [stats("a", free=90, loras=ad(False)), stats("b", free=40, loras=ad(False))]
    assert route(req, none_resident, lambda r: 0).replica == "a"
    assert ReplicaStats.from_dict(reps[1].to_dict()).loras == ad(True)


def test_gateway_hashes_an_adapters_prompt_as_the_replica_does():
    """The gateway's block hashes for a request naming an adapter equal the engine's (the salt,
    then the adapter's content id), so the router's prefix matches are the replicas' hits."""
    from runtime.core.request import Request
    from runtime.fleet.gateway import FleetClient
    from runtime.model.sampling import SamplingParams

    class View:
        def live(self):
            return [stats("a", loras=(("tenant-a", 12345, True, "/ad"),))]

    gw = FleetClient.__new__(FleetClient)
    gw.view, gw.block_size = View(), 16
    ids = list(range(3, 70))
    rr = gw.route_request(ids, SamplingParams(max_tokens=4), "salt", "tenant-a")
    req = Request("r", ids, SamplingParams(), cache_salt="salt", lora_id=12345)
    req.extend_block_hashes(16)
    assert rr.block_hashes == tuple(req.block_hashes[:len(rr.block_hashes)]) and len(rr.block_hashes) == 4
    assert gw.route_request(ids, SamplingParams(max_tokens=4), "salt").block_hashes != rr.block_hashes
