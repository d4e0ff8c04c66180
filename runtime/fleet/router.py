"""The prefix-aware routing decision and the fleet view it reads.

Ray Serve runs the request router (runtime/fleet/ray_router.py, which calls `choose`)
inside the DeploymentHandle, i.e. in the gateway's process, so it shares `VIEW` (the fleet as the gateway sees it: replica stats, cache residency
from KV events, what was routed since the last stats, the last decisions) with the
gateway's admission check and console. The decision itself is `policy.route`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from runtime.fleet.policy import Decision, ReplicaStats, RouteRequest, route
from runtime.core.kv_events import Residency, decode_batch

DECISIONS_KEPT = 200
PENDING_TTL_S = 10.0  # a routed request the replica never reports taking stops counting then


@dataclass(frozen=True)
class RoutingRecord:
    time: float
    request_id: str
    replica: str | None
    reason: str
    matched_blocks: int
    prompt_blocks: int
    detail: str


class FleetView:
    """The gateway process's picture of the fleet. Thread-safe (router loop, event pump
    and web handlers run on different threads)."""

    def __init__(self, imbalance: int = 16, stale_s: float = 5.0) -> None:
        self.residency = Residency()
        self.imbalance = imbalance
        self.stale_s = stale_s
        self._stats: dict[str, ReplicaStats] = {}
        self._seen: dict[str, float] = {}
        self._routed: dict[str, dict[str, tuple[float, int]]] = {}  # replica -> request id -> (when, blocks)
        self._lock = threading.Lock()
        # The last tie-break winner per role: disaggregated prefill and decode pools rotate
        # their ties separately (one pool's decisions must not reset the other's turn).
        self._last_tie: dict[str, str] = {}
        self.decisions: deque[RoutingRecord] = deque(maxlen=DECISIONS_KEPT)
        self.seq = 0
        self.dead: set[str] = set()
        self.reasons: Counter[str] = Counter()

    # --- feeds -------------------------------------------------------------------------------
    def update_stats(self, stats: ReplicaStats, seen: float | None = None) -> None:
        with self._lock:
            old = self._stats.get(stats.replica)
            if old is None or stats.time >= old.time:
                self._stats[stats.replica] = stats
            self._seen[stats.replica] = seen or stats.time

    def apply_pull(self, pulled: dict[str, Any]) -> None:
        """One answer of FleetHub.pull: event batches in order, then the latest stats."""
        if pulled.get("gap"):  # events were lost: start over from what comes next
            for r in list(self._stats):
                self.residency.forget(r)
        for _, replica, data in pulled["batches"]:
            if replica not in self.dead:
                self.residency.apply(replica, decode_batch(data))
        for replica, st in pulled["stats"].items():
            if replica not in self.dead:
                self.update_stats(ReplicaStats.from_dict(st), pulled["seen"].get(replica))
        self.seq = pulled["seq"]

    def unroute(self, replica: str | None, request_id: str) -> None:
        """The replica refused the request (or died first): it holds nothing of it."""
        with self._lock:
            self._routed.get(replica or "", {}).pop(request_id, None)

    def mark_dead(self, replica: str) -> None:
        with self._lock:
            self.dead.add(replica)
            self._stats.pop(replica, None)
            self._routed.pop(replica, None)
        self.residency.forget(replica)

    # --- reads -------------------------------------------------------------------------------
    def live(self, names: set[str] | None = None) -> list[ReplicaStats]:
        now = time.time()
        with self._lock:
            return [s for r, s in sorted(self._stats.items())
                    if (names is None or r in names) and now - self._seen.get(r, 0) < self.stale_s]

    def stats(self, replica: str) -> ReplicaStats | None:
        with self._lock:
            return self._stats.get(replica)

    def _pending(self, replica: str) -> tuple[int, int]:
        """Blocks and requests routed to `replica` that its stats do not show yet (a request
        is in flight to it until its id appears among the stats' recent requests)."""
        st = self._stats.get(replica)
        seen = set(st.recent_requests) if st else set()
        q = self._routed.get(replica)
        if not q:
            return 0, 0
        expired = time.time() - PENDING_TTL_S
        for rid in [r for r, (t, _) in q.items() if r in seen or t < expired]:
            del q[rid]
        return sum(b for _, b in q.values()), len(q)

    def pending(self) -> dict[str, tuple[int, int]]:
        """replica -> (blocks, requests) routed to it that its stats do not show yet."""
        with self._lock:
            return {r: self._pending(r) for r in self._stats}

    def decide(self, req: RouteRequest, names: set[str] | None = None,
               pending: dict[str, tuple[int, int]] | None = None) -> Decision:
        """The policy's choice among the live replicas in `names` (all when None); `pending`
        is what `pending()` returned, for a caller that also ranks the rest by it."""
        replicas = self.live(names)
        if pending is None:
            with self._lock:
                pending = {s.replica: self._pending(s.replica) for s in replicas}
        return route(req, replicas, lambda r: self.residency.matched(r, req.block_hashes),
                     lambda r: pending.get(r, (0, 0))[0], lambda r: pending.get(r, (0, 0))[1], self.imbalance,
                     self._last_tie.get(replicas[0].role) if replicas else None)

    def note_routed(self, request_id: str, req: RouteRequest, d: Decision) -> None:
        now = time.time()
        if d.replica is not None:
            st = self.stats(d.replica)
            if d.reason == "tie":
                self._last_tie[st.role if st else ""] = d.replica
            blocks = 0 if st is None else max(0, -(-(req.prompt_tokens + (
                req.max_tokens if st.admission_mode == "reserve" else 0)) // st.block_size) - d.matched_blocks)
            with self._lock:
                self._routed.setdefault(d.replica, {})[request_id] = (now, blocks)
            # Its blocks will be there within a step: the next request with this prefix
            # follows instead of racing the events.
            self.residency.expect(d.replica, req.block_hashes)
        self.reasons[d.reason] += 1
        self.decisions.append(RoutingRecord(now, request_id, d.replica, d.reason, d.matched_blocks,
                                            len(req.block_hashes), d.describe()))


VIEW = FleetView()


def _route_request(pending_request: Any) -> tuple[str, RouteRequest, str | None] | None:
    args = getattr(pending_request, "args", None) or ()
    payload = args[0] if args and isinstance(args[0], dict) else None
    if payload is None or "route" not in payload:
        return None
    r = payload["route"]
    return (payload.get("request_id", "?"), RouteRequest(tuple(r["block_hashes"]), r["prompt_tokens"],
                                                         r["max_tokens"], payload.get("lora")),
            payload.get("replica_hint"))


def _pinned(pending_request: Any) -> str | None:
    args = getattr(pending_request, "args", None) or ()
    return args[0].get("replica_hint") if args and isinstance(args[0], dict) else None


def choose(candidate_replicas: list, pending_request: Any = None) -> list[list]:
    """The body of PrefixAwareRouter.choose_replicas: ranks of Ray's RunningReplica."""
    if not candidate_replicas:
        return []
    by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
    for r in candidate_replicas:  # Ray's own stats channel (record_routing_stats)
        st = getattr(r, "routing_stats", None)
        if st and "replica" in st:
            VIEW.update_stats(ReplicaStats.from_dict(st))
    parsed = _route_request(pending_request)
    if parsed is None:
        # Disaggregated calls (reserve, prefill_export, import_and_generate, ...) name the
        # replica the gateway chose: a reservation or a KV object lives on that one only.
        hint = _pinned(pending_request)
        if hint in by_name:
            return [[by_name[hint]]]
        return [candidate_replicas]  # not a generate call: any replica will do
    request_id, req, hint = parsed
    if hint in by_name:  # the gateway's admission check already decided (and reserved) it
        rest = [r for n, r in by_name.items() if n != hint]
        return [[by_name[hint]], rest] if rest else [[by_name[hint]]]
    d = VIEW.decide(req, set(by_name))
    if d.replica is None or d.replica not in by_name:
        # No stats yet (a replica just started) or none has room: let the replicas' own
        # queues take it, most headroom first; the gateway already applied the fleet cap.
        def headroom(r: Any) -> int:
            st = VIEW.stats(r.replica_id.unique_id)
            return st.headroom_blocks if st else 0

        ranked = sorted(candidate_replicas, key=lambda r: -headroom(r))
        d = Decision(ranked[0].replica_id.unique_id, "tie", 0, d.skipped)
        VIEW.note_routed(request_id, req, d)
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
    VIEW.note_routed(request_id, req, d)
    rest = [r for n, r in by_name.items() if n != d.replica]
    return [[by_name[d.replica]], rest] if rest else [[by_name[d.replica]]]
