"""The fleet's two decisions as plain functions (no Ray): where a request goes, and how
many replicas the fleet should have. runtime/fleet/router.py and autoscale.py adapt them
to Ray Serve; tests call them on synthetic stats.

Routing is the rule of the serving chapters (../shared/seeds/), in this order:
  1. skip a replica that cannot hold the request: its free blocks above the watermark,
     less what was routed to it since its last stats, are fewer than the request needs
     (prompt minus its cached prefix there, plus max_tokens in reserve mode);
  2. skip a replica whose queue is far longer than the least loaded one's (the imbalance
     guard: a hot prefix must not melt one replica);
  3. the longest cached prefix wins; with no match anywhere, the most free blocks win;
  4. round-robin only among exact ties.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class ReplicaStats:
    """What a replica reports (record_routing_stats) and the router routes on."""

    replica: str
    num_blocks: int
    block_size: int
    free_blocks: int            # a new request could get: free + evictable cached, less what is promised
    watermark_blocks: int
    running: int
    waiting: int
    max_num_seqs: int
    admission_mode: str         # reserve | optimistic
    step_time_s: float = 0.0    # recent mean step wall time
    tokens_per_step: float = 0.0
    cached_blocks: int = 0
    used_blocks: int = 0
    prefix_hit_rate: float = 0.0
    queued_tokens: int = 0      # prompt + max_tokens of waiting requests
    time: float = 0.0           # wall clock of the sample
    draining: bool = False
    pid: int = 0                # the replica's process (operators; fault tests)
    node: str = ""
    # Requests the engine took in the last seconds: the router stops counting its own note
    # of a routed request once the replica's stats include it (then it is in free_blocks).
    recent_requests: tuple[str, ...] = ()
    # Disaggregated serving (--prefill-replicas/--decode-replicas): the pool, and the KV
    # transfers this replica exported (prefill) or imported (decode).
    role: str = "engine"        # engine (colocated) | prefill | decode
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_ms: float = 0.0  # mean per transfer: export, or receive + import
    # LoRA adapters it serves: (name, lora_id, in a device slot now, path) each
    loras: tuple[tuple[str, int, bool, str], ...] = ()

    def lora(self, name: str) -> tuple[str, int, bool, str] | None:
        return next((a for a in self.loras if a[0] == name), None)
    kv_transfer_failures: int = 0

    @property
    def headroom_blocks(self) -> int:
        return self.free_blocks - self.watermark_blocks

    @property
    def queue(self) -> int:
        return self.running + self.waiting

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ReplicaStats":
        names = cls.__dataclass_fields__
        kw = {k: v for k, v in d.items() if k in names}
        kw["recent_requests"] = tuple(kw.get("recent_requests", ()))
        kw["loras"] = tuple(tuple(a) for a in kw.get("loras", ()))
        return cls(**kw)


@dataclass(frozen=True)
class RouteRequest:
    """The gateway's view of one request: tokenized once, hashed with the engine's hash."""

    block_hashes: tuple[bytes, ...]
    prompt_tokens: int
    max_tokens: int
    lora: str | None = None  # the LoRA adapter it names (its model), None: the base model


@dataclass(frozen=True)
class Decision:
    replica: str | None         # None: no replica can take it now
    reason: str                 # prefix | lora | free_blocks | tie | full
    matched_blocks: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # replica -> why

    def describe(self) -> str:
        if self.replica is None:
            return "no replica can hold it: " + ", ".join(f"{r}: {w}" for r, w in self.skipped.items())
        why = {"prefix": f"matched {self.matched_blocks} cached blocks", "free_blocks": "most free blocks",
               "tie": "tie (round-robin)", "lora": "its LoRA adapter is in a device slot there"}[self.reason]
        return why + ("; skipped " + ", ".join(f"{r} ({w})" for r, w in self.skipped.items()) if self.skipped else "")


def blocks_needed(stats: ReplicaStats, req: RouteRequest, matched: int) -> int:
    tokens = req.prompt_tokens + (req.max_tokens if stats.admission_mode == "reserve" else 0)
    return max(0, math.ceil(tokens / stats.block_size) - matched)


def route(req: RouteRequest, replicas: Sequence[ReplicaStats], matched: Callable[[str], int],
          pending_blocks: Callable[[str], int] = lambda r: 0, pending_requests: Callable[[str], int] = lambda r: 0,
          imbalance: int = 16, last_tie: str | None = None) -> Decision:
    """`matched(r)`: leading blocks of the prompt replica r holds; `pending_*`: what was
    routed to r and its stats do not show yet; `last_tie`: the replica the previous tie
    went to (round-robin continues after it)."""
    skipped: dict[str, str] = {}
    fits: list[tuple[ReplicaStats, int, int]] = []  # (stats, matched blocks, queue)
    for s in replicas:
        if s.draining:
            skipped[s.replica] = "draining"
            continue
        if req.lora is not None and s.lora(req.lora) is None:
            skipped[s.replica] = f"does not serve adapter {req.lora}"
            continue
        m = matched(s.replica)
        need, room = blocks_needed(s, req, m), s.headroom_blocks - pending_blocks(s.replica)
        # An idle replica takes anything that fits its cache at all (the engine's own rule:
        # the watermark never starves an idle engine).
        idle = s.queue + pending_requests(s.replica) == 0
        if need > (s.free_blocks if idle else room):
            skipped[s.replica] = f"needs {need} blocks, {max(room, 0)} free above the watermark"
            continue
        fits.append((s, m, s.queue + pending_requests(s.replica)))
    if not fits:
        return Decision(None, "full", 0, skipped)
    least = min(q for _, _, q in fits)
    balanced = []
    for s, m, q in fits:
        if q > least + imbalance:
            skipped[s.replica] = f"queue {q} vs {least} on the least loaded"
        else:
            balanced.append((s, m, q))
    best_match = max(m for _, m, _ in balanced)
    # LoRA affinity (vLLM's and llm-d's), after the prefix (its blocks were computed under the
    # adapter, and a hit saves more than a slot write): where the adapter already holds a device
    # slot, the request starts without writing it into one.
    resident = [t for t in balanced if req.lora is not None and t[0].lora(req.lora)[2]]
    affinity = best_match == 0 and bool(resident) and len(resident) < len(balanced)
    if affinity:
        balanced = resident
    if best_match > 0:
        top = [(s, m, q) for s, m, q in balanced if m == best_match]
        reason = "prefix"
    else:
        most = max(s.headroom_blocks - pending_blocks(s.replica) for s, _, _ in balanced)
        top = [(s, m, q) for s, m, q in balanced if s.headroom_blocks - pending_blocks(s.replica) == most]
        reason = "lora" if affinity else "free_blocks"
    if len(top) > 1:
        # Among equal matches prefer free blocks before falling back to the turn.
        most = max(s.headroom_blocks - pending_blocks(s.replica) for s, _, _ in top)
        top = [t for t in top if t[0].headroom_blocks - pending_blocks(t[0].replica) == most]
    if len(top) > 1:
        top.sort(key=lambda t: t[0].replica)
        chosen = next((t for t in top if last_tie is not None and t[0].replica > last_tie), top[0])
        return Decision(chosen[0].replica, reason if reason in ("prefix", "lora") else "tie", chosen[1], skipped)
    return Decision(top[0][0].replica, reason, top[0][1], skipped)


# --- autoscaling -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaleKnobs:
    min_replicas: int = 1
    max_replicas: int = 4
    target_utilization: float = 0.8   # of max_num_seqs per replica
    horizon_s: float = 60.0           # a new replica's start-up time: the queue must clear within it
    scale_in_utilization: float = 0.4
    scale_in_delay_s: float = 60.0    # demand must stay low this long before one replica goes

    def validate(self) -> "ScaleKnobs":
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas/max_replicas: need 1 <= {self.min_replicas} <= {self.max_replicas}")
        if not 0 < self.scale_in_utilization < self.target_utilization <= 1:
            raise ValueError("scale_in_utilization < target_utilization <= 1 required")
        if self.horizon_s <= 0 or self.scale_in_delay_s < 0:
            raise ValueError("horizon_s must be > 0 and scale_in_delay_s >= 0")
        return self


@dataclass(frozen=True)
class ScaleInputs:
    replicas: int
    running: int
    waiting: int
    queued_tokens: int       # tokens the waiting requests still need (prompt + max_tokens)
    step_time_s: float       # mean decode step time across replicas
    max_num_seqs: int        # per replica


@dataclass(frozen=True)
class ScaleDecision:
    target: int
    reason: str
    needed_seqs: float
    capacity_seqs: float


def decide_scale(x: ScaleInputs, k: ScaleKnobs, state: dict[str, Any], now: float) -> ScaleDecision:
    """Proactive: the queue's work, in sequence-seconds (queued tokens x step time: each
    token is one step of one sequence), spread over the horizon, is the concurrency the
    queue needs on top of what runs now. Scale out as soon as that exceeds what the
    replicas hold at the target utilization (before the queue overflows); scale in one
    replica at a time, only after demand stayed under the low mark for the delay.
    `state` persists between calls (the low-demand timer)."""
    per = max(1, x.max_num_seqs)
    needed = x.running + x.queued_tokens * x.step_time_s / k.horizon_s
    if x.waiting and not x.step_time_s:  # nothing measured yet: queued requests count as sequences
        needed = x.running + x.waiting
    capacity = x.replicas * per * k.target_utilization
    want = max(k.min_replicas, min(k.max_replicas, math.ceil(needed / (per * k.target_utilization)) or 1))
    if want > x.replicas:
        state.pop("low_since", None)
        return ScaleDecision(want, f"scale out: needs {needed:.1f} concurrent sequences, {x.replicas} replica(s) "
                                   f"hold {capacity:.0f} at {k.target_utilization:.0%}", needed, capacity)
    if x.replicas > k.max_replicas:
        return ScaleDecision(k.max_replicas, f"above max_replicas {k.max_replicas}", needed, capacity)
    low = (x.replicas - 1) * per * k.scale_in_utilization
    if x.replicas > k.min_replicas and needed <= low and not x.waiting:
        since = state.setdefault("low_since", now)
        if now - since >= k.scale_in_delay_s:
            state.pop("low_since", None)
            return ScaleDecision(x.replicas - 1, f"scale in: {needed:.1f} sequences fit {x.replicas - 1} replica(s) "
                                                 f"under {k.scale_in_utilization:.0%} for {now - since:.0f} s",
                                 needed, capacity)
        return ScaleDecision(x.replicas, f"hold: low demand for {now - since:.0f} of {k.scale_in_delay_s:.0f} s",
                             needed, capacity)
    state.pop("low_since", None)
    return ScaleDecision(x.replicas, f"hold: {needed:.1f} sequences within capacity {capacity:.0f}", needed, capacity)
