"""A request's host-side state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.block_pool import BlockHash, hash_block
from runtime.sampling import SamplingParams

PRIORITIES = ("interactive", "batch")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, ahead of new arrivals
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: str = "interactive"
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0     # tokens whose KV is in the cache
    num_cached_tokens: int = -1      # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    state_row: int = -1              # penalty-state row while running
    needs_row_reset: bool = False
    row_counted_upto: int = 0        # tokens [0, this) are in the penalty state of state_row
    num_registered_blocks: int = 0   # leading full blocks already offered to the prefix cache
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    # timestamps (monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    # logprobs of generated tokens: (chosen logprob, [(id, logprob)...]) when asked
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority: must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def uses_penalties(self) -> bool:
        p = self.params
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def extra_keys(self) -> tuple:
        return (self.cache_salt,) if self.cache_salt else ()

    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def extend_block_hashes(self, block_size: int) -> None:
        """Hash every full block of the token sequence not hashed yet (chained)."""
        toks = self.all_token_ids
        n_full = len(toks) // block_size
        while len(self.block_hashes) < n_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            self.block_hashes.append(
                hash_block(parent, toks[i * block_size:(i + 1) * block_size], self.extra_keys))
