"""The proactive autoscaler as a Ray Serve autoscaling policy.

Ray Serve's controller calls `ProactivePolicy` every control-loop period with the
replicas' `record_autoscaling_stats` (running, waiting, queued tokens, step time,
max_num_seqs) averaged over its look-back window; `policy.decide_scale` turns them into
a replica count. Scale-in goes through Ray Serve's graceful shutdown: the replica stops
getting requests, keeps serving what it has (up to graceful_shutdown_timeout_s), then
stops. Every decision that changes the count, and one in every `log_every` holds, goes
to the fleet hub's log with its inputs and reason (the console shows it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from runtime.fleet.policy import ScaleInputs, ScaleKnobs, decide_scale

log = logging.getLogger("ray.serve")


def inputs_from_metrics(metrics: dict[str, dict[Any, float]] | None, replicas: int) -> ScaleInputs:
    m = metrics or {}

    def total(name: str) -> float:
        return float(sum(m.get(name, {}).values()))

    def most(name: str) -> float:
        return float(max(m.get(name, {}).values(), default=0.0))

    steps = [v for v in m.get("step_time_s", {}).values() if v > 0]
    seqs = [v for v in m.get("max_num_seqs", {}).values() if v > 0]
    # Replicas' queues plus the gateway's (which every replica relays, hence max not sum).
    return ScaleInputs(replicas=replicas, running=round(total("running")),
                       waiting=round(total("waiting") + most("fleet_queued")),
                       queued_tokens=round(total("queued_tokens") + most("fleet_queued_tokens")),
                       step_time_s=sum(steps) / len(steps) if steps else 0.0,
                       max_num_seqs=round(max(seqs)) if seqs else 1)


class ProactivePolicy:
    """`policy_kwargs` are ScaleKnobs fields (JSON), plus `hold_log_s`: a decision that
    changes the target is always logged, a hold at most once per hold_log_s."""

    def __init__(self, hold_log_s: float = 10.0, **knobs: Any) -> None:
        self.knobs = ScaleKnobs(**knobs).validate()
        self.hold_log_s = hold_log_s
        self._hub: Any = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        now = time.time()
        # Decide relative to the target, not the running count: replicas still starting
        # (the initial ones, or a scale-out in progress) are capacity on its way.
        prev = getattr(ctx, "target_num_replicas", None) or ctx.current_num_replicas
        x = inputs_from_metrics(ctx.aggregated_metrics, prev)
        k = self.knobs
        lo = max(k.min_replicas, getattr(ctx, "capacity_adjusted_min_replicas", k.min_replicas))
        hi = min(k.max_replicas, getattr(ctx, "capacity_adjusted_max_replicas", k.max_replicas))
        d = decide_scale(x, k, state, now)
        target = max(lo, min(hi, d.target))
        # The controller calls this every ~0.1 s: log changes of the target, holds now and then.
        if target != prev or now - state.get("logged_at", 0.0) >= self.hold_log_s:
            state["logged_at"] = now
            self._log({"time": now, "from": prev, "to": target, "running_replicas": ctx.current_num_replicas, "reason": d.reason,
                       "needed_seqs": round(d.needed_seqs, 2), "capacity_seqs": round(d.capacity_seqs, 2),
                       "running": x.running, "waiting": x.waiting, "queued_tokens": x.queued_tokens,
                       "step_time_s": round(x.step_time_s, 4), "knobs": vars(k).copy()})
        return target, state

    def _log(self, entry: dict[str, Any]) -> None:
        if entry["from"] != entry["to"]:
            log.info("pagedjax autoscaler: %d -> %d replicas: %s", entry["from"], entry["to"], entry["reason"])
        try:
            if self._hub is None:
                import ray

                from runtime.fleet.replica import HUB_NAME, NAMESPACE

                if not ray.is_initialized():  # called outside Ray (tests): nothing to log to
                    return

                self._hub = ray.get_actor(HUB_NAME, namespace=NAMESPACE)
            self._hub.log_scale.remote(entry)  # fire and forget: never block the controller
        except Exception:  # noqa: BLE001 -- no hub: the decision is still in Ray's log
            self._hub = None
