"""The fleet hub: one Ray actor that replicas report to and the gateway reads from.

It plays the part of vLLM's ZMQ event publisher, fleet-wide: each replica pushes its KV
event batches (vLLM's msgpack format, kept as bytes with a sequence number, so any
consumer can replay from where it stopped), its stats and its Prometheus text. The
gateway pulls everything newer than its last sequence number. Operator commands for
replicas (policy changes) travel back as the answer to a report. The autoscaler, which
runs inside Ray Serve's controller, logs its decisions here for the console.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

EVENTS_KEPT = 50_000      # batches kept for replay
DECISIONS_KEPT = 500


class FleetHub:
    def __init__(self) -> None:
        self.seq = 0
        self.events: deque[tuple[int, str, bytes]] = deque(maxlen=EVENTS_KEPT)
        self.stats: dict[str, dict[str, Any]] = {}
        self.metrics: dict[str, bytes] = {}
        self.seen: dict[str, float] = {}
        self.commands: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.scale_log: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        self.knobs: dict[str, Any] | None = None
        # The gateway's own queue (requests no replica had room for): relayed to the replicas
        # so the autoscaler, which only hears from replicas, counts it as demand.
        self.gateway: dict[str, float] = {"queued": 0.0, "queued_tokens": 0.0}

    def report(self, replica: str, stats: dict[str, Any], batch: bytes | None, metrics: bytes | None
               ) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, float]]:
        """-> (policy commands for this replica, the gateway's queue)."""
        self.stats[replica] = stats
        self.seen[replica] = time.time()
        if metrics is not None:
            self.metrics[replica] = metrics
        if batch is not None:
            self.seq += 1
            self.events.append((self.seq, replica, batch))
        return self.commands.pop(replica, []), dict(self.gateway)

    def pull(self, since: int, gateway: dict[str, float] | None = None) -> dict[str, Any]:
        """Everything newer than `since`; `gap` says events were dropped (replay impossible:
        the consumer must rebuild from scratch, as after vLLM's replay window)."""
        if gateway is not None:
            self.gateway = gateway
        first = self.events[0][0] if self.events else self.seq + 1
        batches = [(s, r, b) for s, r, b in self.events if s > since]
        return {"seq": self.seq, "batches": batches, "gap": since + 1 < first and since < self.seq,
                "stats": dict(self.stats), "seen": dict(self.seen)}

    def replica_metrics(self) -> dict[str, bytes]:
        return dict(self.metrics)

    def command(self, replica: str, who: str, changes: dict[str, Any]) -> None:
        self.commands.setdefault(replica, []).append((who, changes))

    def forget(self, replica: str) -> None:
        for d in (self.stats, self.metrics, self.seen, self.commands):
            d.pop(replica, None)

    # --- autoscaler ------------------------------------------------------------------------
    def log_scale(self, entry: dict[str, Any]) -> None:
        self.scale_log.append(entry)

    def scale_history(self) -> list[dict[str, Any]]:
        return list(self.scale_log)

    def set_knobs(self, knobs: dict[str, Any]) -> None:
        self.knobs = knobs

    def get_knobs(self) -> dict[str, Any] | None:
        return self.knobs
