"""A request's host-side state as the scheduler and engine see it.

One token list: `token_ids` is the prompt followed by every generated token the host
knows. With async scheduling the device is one step ahead: a token it has sampled but the
host has not read back yet is *pending* (`num_pending`, at most one) -- it counts in
`num_tokens` (the scheduler plans around it) and the next step reads it from the device's
own last-token state, so the host never waits for it.

Each field has one writer. The scheduler (runtime/core/scheduler.py) owns the lifecycle:
status, blocks, computed/pending/known tokens, the penalty-row bookkeeping, the prefix
cache's registration and finish_reason. The engine (runtime/core/engine.py) owns what a step's
read-back adds beside the token: timestamps, logprobs, stop_reason, the matcher. The
methods here only derive (`extend_block_hashes` fills the hash cache of the known
tokens), and `step_row` (runtime/model/batch.py) only reads.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.core.ledger import Ledger

from runtime.core.block_pool import BlockHash, hash_block
from runtime.model.batch import ScheduledSeq
from runtime.model.sampling import SamplingParams

PRIORITIES = ("interactive", "batch")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, ahead of new arrivals
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative decoding, per request (runtime/core/speculative.py): what its proposals did
    (the usage's `speculative` extension) and its backoff."""

    proposed: int = 0
    accepted: int = 0
    miss_streak: int = 0        # verifications in a row that kept no proposal
    resume_at: int = 0          # output-token count before which it does not propose


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]             # prompt + generated tokens known on the host (given: the prompt)
    params: SamplingParams
    priority: str = "interactive"
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # LoRA (runtime/core/lora.py): the adapter it runs under (0: the base model; the id of that
    # load, which keys its prefix blocks), its name, and the device slot it holds while running.
    lora_id: int = 0
    lora_name: str | None = None
    lora_slot: int = -1

    status: Status = Status.WAITING
    num_prompt_tokens: int = -1      # set from token_ids at creation
    num_pending: int = 0             # sampled on the device, not yet read back (0 or 1)
    # One block table per KV group (runtime/kv_groups.py; one table for a model without
    # sliding layers). A sliding group's entries that slid out of its window are NULL_BLOCK.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed_tokens: int = 0     # tokens whose KV is in the cache (or being written by a launched step)
    num_cached_tokens: int = -1      # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    # Swap preemption (runtime/core/kv_tiers.py): while preempted, its KV parked in host RAM
    # (a kv_tiers.SwapOut), restored at admission instead of recomputed; the scheduler step it
    # last came back at (not swapped out again soon after); computed tokens a recompute
    # preemption dropped (counted as recomputed when it resumes).
    swap: Any = None
    swapped_in_at: int = -1 << 30
    lost_tokens: int = 0
    state_row: int = -1              # device state row (penalties, last token) while running
    needs_row_reset: bool = False
    row_counted_upto: int = 0        # tokens [0, this) are in the penalty state of state_row
    num_registered_blocks: int = 0   # leading full blocks already offered to the prefix cache
    # Blocks a disaggregated decode reserved for it (runtime/core/disagg.py), held while it waits
    # and released at admission once its prefix hits hold the imported ones.
    pinned_blocks: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    # timestamps (monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    # logprobs of generated tokens when asked: the step's raw rows (chosen logprob, top ids, top
    # logprobs; numpy), always; the client's form is `formatted_logprobs()` (the output
    # processor formats the same rows off the device thread)
    logprobs: list[tuple[Any, ...]] = field(default_factory=list)
    matcher: Any = None              # llguidance matcher of a structured output (params.guide)
    # prompt logprobs when asked: entry i is prompt token i+1's, raw like `logprobs`
    prompt_logprobs: list[tuple[Any, ...]] = field(default_factory=list)
    # Speculative decoding: tokens proposed to follow token_ids, computed by the next step
    # with its last token and kept up to the first the step's samples disagree with.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_masks: Any = None           # a structured output's mask per proposal position ([d, W] int32)
    spec: SpecStats = field(default_factory=SpecStats)
    # What was decided about it and why (runtime/core/ledger.py), for the operator.
    ledger: Ledger = field(default_factory=Ledger)
    quoted_ttft_s: float | None = None  # the admission quote's TTFT when it arrived (runtime/core/step_model.py)

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority: must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    # --- views of the block tables -----------------------------------------------------
    @property
    def block_ids(self) -> list[int]:
        """The block table of a one-group cache (every model without sliding layers)."""
        if len(self.block_tables) != 1:
            raise ValueError(f"block_ids: the request holds {len(self.block_tables)} KV groups' tables; "
                             "use block_tables")
        return self.block_tables[0]

    @block_ids.setter
    def block_ids(self, ids: list[int]) -> None:
        self.block_tables = [list(ids)]

    def held_blocks(self) -> list[int]:
        """Every page the request holds, all groups (released entries left out)."""
        return [b for t in self.block_tables for b in t if b >= 0]

    # --- views of the one token list ---------------------------------------------------
    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_generated(self) -> int:
        """Generated tokens the host knows (a pending one not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included (what max_tokens counts)."""
        return self.num_generated + self.num_pending

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_tokens_with_spec(self) -> int:
        """What the next step may compute up to: the tokens and the proposals after them."""
        return self.num_tokens + len(self.spec_token_ids)

    def formatted_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """The generated tokens' logprobs in the client's form: (chosen, [(id, logprob)...])."""
        return [format_logprob(e) for e in self.logprobs]

    def formatted_prompt_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Prompt tokens 1.. in the same form (token 0 has none)."""
        return [format_logprob(e) for e in self.prompt_logprobs]

    # --- properties the scheduler asks -----------------------------------------------------
    @property
    def uses_prefix_cache(self) -> bool:
        return uses_prefix_cache(self.params)

    @property
    def banned_tokens(self) -> tuple[int, ...] | None:
        """Token ids its next token may not be while below min_tokens (EOS added by the
        engine), or None."""
        p = self.params
        return p.stop_token_ids if self.num_output_tokens < p.min_tokens else None

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def extra_keys(self) -> tuple:
        """What its block hashes carry beside the tokens: the salt, and the adapter (a prefix
        computed under one adapter is another's KV: never shared)."""
        return ((self.cache_salt,) if self.cache_salt else ()) + ((("lora", self.lora_id),) if self.lora_id else ())

    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def reached_length_limit(self, max_model_len: int) -> bool:
        """No more tokens may be sampled (the last one may still be pending)."""
        return self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len

    def extend_block_hashes(self, block_size: int) -> None:
        """Hash every full block of the known tokens not hashed yet (chained)."""
        toks = self.token_ids
        n_full = len(toks) // block_size
        while len(self.block_hashes) < n_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            self.block_hashes.append(
                hash_block(parent, toks[i * block_size:(i + 1) * block_size], self.extra_keys))


def uses_prefix_cache(params: SamplingParams) -> bool:
    """Whether a request may take prompt blocks from the prefix cache. Penalties build their
    state from the tokens a step computes, and prompt logprobs need every prompt token's
    logits: such a request computes its whole prompt (and a disaggregated decode transfers
    it nothing). The scheduler's lookup and runtime/core/disagg.py both ask this."""
    penalties = params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
    return not penalties and params.prompt_logprobs is None


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading full blocks a request may take from the prefix cache: those before its last
    token, which is always computed (its logits give the next token)."""
    return (num_tokens - 1) // block_size


def format_logprob(raw: tuple) -> tuple[float, list[tuple[int, float]]]:
    """The engine's raw row (logprob, top ids, top logprobs) -> (logprob, [(id, logprob)]); a
    structured output's forbidden tokens (-inf) are left out of the top list."""
    lp, ids, tops = raw
    return float(lp), [(a, b) for a, b in zip(ids.tolist(), tops.tolist()) if b > -math.inf]


def step_row(req: Request, n: int) -> ScheduledSeq:
    """Request -> its row in the next step (the one place a request becomes a row): `n` tokens from `num_computed_tokens`. It only
    reads the request: the scheduler's `commit` accounts the step once it is launched
    (computed tokens, the penalty state's `row_counted_upto`)."""
    from runtime.model.sampling import SamplingRow

    start = req.num_computed_tokens
    drafts = req.spec_token_ids  # (the scheduler leaves proposals only on a decode row with none pending)
    known = (req.token_ids + drafts if drafts else req.token_ids)[start:start + n]
    pending = len(known) < n  # the tail is the token sampled by the step still in flight
    seq = ScheduledSeq(
        token_ids=known + [0] * (n - len(known)), start_pos=start, block_tables=req.block_tables,
        prompt_len=req.num_prompt_tokens, state_row=req.state_row, reset_row=req.needs_row_reset,
        sample=start + n == req.num_tokens_with_spec, sampling_row=SamplingRow(req.params, req.num_output_tokens),
        count_from=max(0, req.row_counted_upto - start), pending_last=pending, drafts=list(drafts),
        draft_masks=req.spec_masks[:len(drafts)] if drafts and req.spec_masks is not None else None,
        lora_slot=req.lora_slot)
    P = req.num_prompt_tokens
    if req.params.prompt_logprobs is not None and start < P - 1:
        nxt = req.token_ids[start + 1:min(start + n + 1, P)]
        seq.prompt_next = nxt + [-1] * (n - len(nxt))
    return seq
