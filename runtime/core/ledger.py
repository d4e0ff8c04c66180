"""Each request's decision ledger: what the engine decided about it, when, on which inputs, why.

The scheduler, the KV tiers and the engine write one `Decision` per event: queued (position),
waiting (why admission stopped at it: blocks and the watermark, the token budget, the
sequence cap, the admissions-per-step cap, a prefix another request is computing), admitted
(prefix hits, blocks), chunks, preempted (why it was the victim; swap or recompute and why),
swapped back in, blocks promoted from a KV tier, speculation, finished. The operator reads it
at /admin/requests/{id} (a timeline) and /admin/requests/{id}.json, for running and waiting
requests and the last `FINISHED_KEPT` finished ones (LLMEngine.ledger).

Bounded: an entry that repeats the kind and reason of one of the last two entries folds into it
(a count and the last time: a request waiting 300 steps for the same blocks is one entry, and
decode steps alternating with speculation verdicts are two), and past
`MAX_ENTRIES` the oldest entries after the first `KEEP_HEAD` (arrival, first admission) go.
Writing one is a list append or an attribute update on the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_ENTRIES = 64
KEEP_HEAD = 8
FINISHED_KEPT = 256   # finished requests whose ledgers the engine keeps


@dataclass
class Decision:
    t: float                  # wall-clock seconds (time.time()) of the first occurrence
    kind: str                 # queued | waiting | admitted | lora | chunk | preempted | swapped_in | promoted | speculation | finished
    reason: str               # one line, for a person
    inputs: dict[str, Any] = field(default_factory=dict)  # the numbers the decision read (of the last occurrence)
    count: int = 1            # occurrences folded into this entry
    last_t: float = 0.0       # time of the last occurrence


@dataclass
class Ledger:
    entries: list[Decision] = field(default_factory=list)
    dropped: int = 0          # entries let go past MAX_ENTRIES

    def add(self, kind: str, reason: str, **inputs: Any) -> None:
        now = time.time()
        for last in self.entries[-1:-3:-1]:
            if last.kind == kind and last.reason == reason:
                last.count += 1
                last.last_t = now
                last.inputs = inputs
                return
        self.entries.append(Decision(now, kind, reason, inputs, 1, now))
        if len(self.entries) > MAX_ENTRIES:
            del self.entries[KEEP_HEAD]
            self.dropped += 1

    def to_json(self) -> dict[str, Any]:
        return {"entries": [asdict(d) for d in self.entries], "dropped": self.dropped}


class NullLedger(Ledger):
    """What a request carries with the ledger off (`--no-request-ledger`): writes nothing."""

    def add(self, kind: str, reason: str, **inputs: Any) -> None:
        pass
