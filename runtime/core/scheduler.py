"""Continuous batching with KV-aware admission control.

Every step: running sequences first (decodes and unfinished prefill chunks), growing
their block tables and preempting by priority when blocks run out (optimistic mode);
then admissions from the waiting queue -- preempted requests first, then interactive,
then batch -- while the free blocks left after prefix-cache hits stay above the
watermark. `reserve` mode admits only when prompt + max_tokens fit alongside what the
running sequences may still grow into, so it never preempts. The arithmetic of both
modes is runtime/core/capacity.py's, which disaggregation and the fleet's stats share.

KV groups (runtime/kv_groups.py): a request holds one block table per group. `_grow`
releases what a sliding group's window no longer sees before it allocates, and
`_prefix_hit` takes a cached prefix only as far as every group still holds what the next
query reads (a sliding group: just its window before the hit point).

The scheduler is the one writer of a request's lifecycle fields (runtime/core/request.py):
it admits, grows, preempts and finishes, and `commit` / `append_token` account a
launched step's tokens; the engine builds step rows from requests without changing them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from runtime.core import capacity
from runtime.core.block_pool import BlockPool, NoFreeBlocks
from runtime.kv_groups import NULL_BLOCK, KVGroups
from runtime.config import AdmissionPolicy, CacheConfig, SchedulerConfig
from runtime.core.request import Request, Status, cacheable_blocks

PRIORITY_RANK = {"interactive": 0, "batch": 1}


class Overloaded(Exception):
    """The admission policy's queue limits are reached (HTTP 429)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)  # preempted with req.swap: KV to read to host
    swapped_in: list[Request] = field(default_factory=list)   # admitted with req.swap: KV to write back
    num_batched_tokens: int = 0
    num_admitted: int = 0


@dataclass
class SchedulerCounters:
    prefix_queries: int = 0     # prompt tokens looked up
    prefix_hits: int = 0        # of which served from cache
    preemptions: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    spec_proposed: int = 0      # speculative decoding: proposed tokens verified
    spec_accepted: int = 0      # of which kept
    preempted_blocks_lost: int = 0  # blocks preemptions dropped (not in the prefix cache: their KV is gone)
    swapped_out: int = 0        # preemptions whose KV went to host RAM (swap preemption)
    swapped_in: int = 0         # of which came back
    recomputed_tokens: int = 0  # tokens computed a second time because a preemption dropped their KV


class Scheduler:
    def __init__(self, cache: CacheConfig, envelope: SchedulerConfig, policy: AdmissionPolicy,
                 pool: BlockPool, groups: KVGroups | None = None):
        self.cache, self.envelope, self.policy, self.pool = cache, envelope, policy, pool
        self.groups = groups or KVGroups.single()
        self.bs = cache.block_size
        # The most tokens one step computes for a request (what a sliding group holds beyond its window).
        self.max_chunk = min(policy.long_prefill_token_threshold, policy.max_num_batched_tokens,
                             envelope.max_num_batched_tokens)
        self.resumed: deque[Request] = deque()
        self.waiting: dict[str, deque[Request]] = {p: deque() for p in PRIORITY_RANK}
        self.running: list[Request] = []
        self.free_rows = list(range(envelope.max_num_seqs - 1, -1, -1))
        self.counters = SchedulerCounters()
        self.queued_tokens = 0
        self.num_steps = 0   # schedule() calls
        # Swap preemption's rule and host budget (runtime/core/kv_tiers.py SwapSpace; the
        # engine sets it with a host tier); None: every preemption recomputes.
        self.swap: Any = None
        # LoRA adapters' device slots (runtime/core/lora.py LoraSlots; the engine sets it); None: no LoRA.
        self.loras: Any = None

    # --- queue ---------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return capacity.blocks_for(tokens, self.bs)

    @property
    def num_waiting(self) -> int:
        return len(self.resumed) + sum(len(q) for q in self.waiting.values())

    def waiting_requests(self) -> list[Request]:
        return [*self.resumed, *self.waiting["interactive"], *self.waiting["batch"]]

    def _reject(self, reason: str) -> None:
        self.counters.rejections[reason] = self.counters.rejections.get(reason, 0) + 1

    def add(self, req: Request, pinned_blocks: Sequence[int] = ()) -> None:
        """Queue a request; `pinned_blocks`: blocks reserved for it (runtime/core/disagg.py), which
        it holds while it waits and hands back at admission."""
        total = req.max_total_tokens()
        why = capacity.never_fits(total, self.envelope.max_model_len, self.pool, self.groups, self.max_chunk)
        if why == "context":
            self._reject("too_long")
            raise ValueError(f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.params.max_tokens}) "
                             f"exceeds the maximum context length of {self.envelope.max_model_len} tokens")
        if why == "cache":
            self._reject("too_long")
            raise ValueError(f"prompt + max_tokens ({total} tokens) can never fit in the KV cache "
                             f"({self.pool.num_blocks * self.bs} tokens)")
        p = self.policy
        if self.num_waiting >= p.max_queue_len:
            self._reject("queue_full")
            raise Overloaded("queue_full", f"the waiting queue is full ({p.max_queue_len} requests)")
        if self.queued_tokens + req.num_prompt_tokens > p.max_queued_tokens:
            self._reject("queued_tokens")
            raise Overloaded("queued_tokens", f"queued prompt tokens would exceed {p.max_queued_tokens}")
        req.pinned_blocks = list(pinned_blocks)
        self.queued_tokens += req.num_prompt_tokens
        q = self.waiting[req.priority]
        if req.pinned_blocks:
            # Its blocks are reserved already: ahead of the requests without (which could
            # otherwise wait on the very blocks it pins), behind earlier reserved ones.
            i = 0
            while i < len(q) and q[i].pinned_blocks:
                i += 1
            q.insert(i, req)
        else:
            q.append(req)
        req.ledger.add("queued", f"in the {req.priority} queue", position=q.index(req) + 1 if req.pinned_blocks else len(q),
                       waiting=self.num_waiting, running=len(self.running), reserved_blocks=len(req.pinned_blocks))

    def _pop_waiting(self, req: Request) -> None:
        q = self.resumed if req.status is Status.PREEMPTED else self.waiting[req.priority]
        q.remove(req)
        self.queued_tokens -= req.num_prompt_tokens

    def _peek_waiting(self, skip: "set[str] | frozenset[str]" = frozenset()) -> Request | None:
        """The first waiting request in admission order, passing over those in `skip` (ids)."""
        for q in (self.resumed, self.waiting["interactive"], self.waiting["batch"]):
            for r in q:
                if r.request_id not in skip:
                    return r
        return None

    # --- lifecycle -------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        self.pool.free(req.held_blocks())
        req.block_tables = self._empty_tables()
        if req.state_row >= 0:
            self.free_rows.append(req.state_row)
            req.state_row = -1
        if req.lora_slot >= 0:
            self.loras.release(req.lora_id)
            req.lora_slot = -1

    def _unpin(self, req: Request) -> None:
        if req.pinned_blocks:
            self.pool.free(req.pinned_blocks)
            req.pinned_blocks = []

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED):
            self._pop_waiting(req)
            self._unpin(req)
            self.drop_swap(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    def drop_swap(self, req: Request) -> None:
        """Let its host copy go (its bytes back to the tier)."""
        if req.swap is not None:
            self.swap.release(req.swap)
            req.swap = None

    def _preempt(self, req: Request, out: SchedulerOutput, may_swap: bool = True, why: str = "") -> None:
        """Take a running request's blocks back. Its KV either goes to host RAM (swap: the
        engine reads it after this schedule, before the blocks are written again) or is
        dropped and recomputed when it resumes (less what the prefix cache still holds)."""
        self.running.remove(req)
        req.swap = self.swap.decide(req, self.num_steps) if self.swap is not None and may_swap else None
        inputs = dict(computed_tokens=req.num_computed_tokens, blocks=len(req.held_blocks()),
                      free_blocks=self.pool.num_free_blocks)
        if req.swap is not None:
            self.counters.swapped_out += 1
            out.swapped_out.append(req)
            req.ledger.add("preempted", f"{why}; its KV goes to host RAM (swap)", **inputs, swap_bytes=req.swap.nbytes)
        else:
            how = f"recompute: {self.swap.last_why}" if self.swap is not None and may_swap else "recompute"
            req.ledger.add("preempted", f"{why}; its KV is dropped ({how})", **inputs)
            infos = self.pool.infos
            self.counters.preempted_blocks_lost += sum(infos[b].block_hash is None for b in req.held_blocks())
            req.lost_tokens = max(req.lost_tokens, req.num_computed_tokens)
        self._release(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        req.status = Status.PREEMPTED
        self.resumed.appendleft(req)
        self.queued_tokens += req.num_prompt_tokens
        self.counters.preemptions += 1
        out.preempted.append(req)

    def preempt_all(self) -> None:
        """The device lost the KV cache: every running request recomputes, and waiting ones
        drop the blocks reserved for them (their imported KV is gone too)."""
        out = SchedulerOutput()
        for req in list(self.running):
            self._preempt(req, out, may_swap=False, why="the device lost the KV cache (a failed step)")
        for req in self.waiting_requests():
            self._unpin(req)

    def _victim_why(self, victim: Request, needy: Request) -> str:
        if victim is needy:
            return "out of KV blocks to grow, and the lowest-ranked running request itself"
        return (f"out of KV blocks while {needy.request_id} grew; chosen as the victim: {victim.priority} tier, "
                f"{victim.num_computed_tokens} computed tokens (batch first, then least work lost)")

    def _note_waiting(self, req: Request | None, why: str, **inputs) -> None:
        """Record on the request admission stopped at (if any) why it waits."""
        if req is not None:
            req.ledger.add("waiting", why, **inputs)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        """Batch tier first; within it, not one that just came back from a swap (it would
        thrash: runtime/core/kv_tiers.py SWAP_COOLDOWN_STEPS); then the one whose preemption
        loses the least work."""
        from runtime.core.kv_tiers import SWAP_COOLDOWN_STEPS
        return max(candidates, key=lambda r: (PRIORITY_RANK[r.priority],
                                              self.num_steps - r.swapped_in_at >= SWAP_COOLDOWN_STEPS,
                                              -r.num_computed_tokens))

    # --- the step ----------------------------------------------------------------------
    def _chunk(self, req: Request, start: int, budget: int) -> int:
        n = min(req.num_tokens_with_spec - start, budget)
        if n > 1:
            n = min(n, self.policy.long_prefill_token_threshold)
        return max(n, 0)

    def _empty_tables(self) -> list[list[int]]:
        return [[] for _ in range(self.groups.num_groups)]

    def _grow(self, req: Request, start: int, end: int) -> bool:
        """Make the request's tables hold what computing tokens [start, end) needs: each
        sliding group first releases the blocks its window left behind (`skipped_blocks`:
        the step's queries start at `start`), then every group gets blocks up to `end`, all
        groups or none."""
        for g, table in enumerate(req.block_tables):
            self._release_skipped(table, self.groups.skipped_blocks(g, start, self.bs))
        needs = [max(0, self.blocks_for(end) - len(t)) for t in req.block_tables]
        if sum(needs) == 0:
            return True
        try:
            new = self.pool.allocate(sum(needs))
        except NoFreeBlocks:
            return False
        for table, k in zip(req.block_tables, needs):
            table.extend(new[:k])
            new = new[k:]
        return True

    def _release_skipped(self, table: list[int], skip: int) -> None:
        """Release table entries [0, skip) (NULL_BLOCK in place). Released entries are always
        a leading run, so only the new ones are visited."""
        freed = []
        b = min(skip, len(table)) - 1
        while b >= 0 and table[b] != NULL_BLOCK:
            freed.append(table[b])
            table[b] = NULL_BLOCK
            b -= 1
        if freed:
            self.pool.free(freed[::-1])

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        p = self.policy
        budget = min(p.max_num_batched_tokens, self.envelope.max_num_batched_tokens)
        max_seqs = min(p.max_num_seqs, self.envelope.max_num_seqs)
        self.running.sort(key=lambda r: (PRIORITY_RANK[r.priority], r.arrival_time))
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < max_seqs:
            req = self.running[i]
            if req.reached_length_limit(self.envelope.max_model_len):
                i += 1  # its last token is still pending on the device: it finishes when read back
                continue
            n = self._chunk(req, req.num_computed_tokens, budget)
            while not self._grow(req, req.num_computed_tokens, req.num_computed_tokens + n):
                if req.spec_token_ids:  # proposals never preempt anyone: drop them first
                    n -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                if p.admission_mode == "reserve":
                    n = 0  # cannot happen with exact reservations; never preempt in reserve mode
                    break
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim, out, why=self._victim_why(victim, req))
                if victim is req:
                    n = 0
                    break
            if n == 0:
                req.spec_token_ids = []
                if req.status is Status.RUNNING:
                    i += 1
                continue
            if req.spec_token_ids:  # the budget may cut the proposals short
                del req.spec_token_ids[n - 1:]
            out.scheduled.append((req, n))
            if req.num_computed_tokens < req.num_prompt_tokens:
                req.ledger.add("chunk", "prefill chunk", start=req.num_computed_tokens, tokens=n, budget_left=budget - n)
            else:
                req.ledger.add("chunk", "decode", tokens=n)
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(out, budget, max_seqs)
        else:
            self._note_waiting(self._peek_waiting(), "no admissions in a step that preempted")
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, max_seqs: int) -> None:
        p = self.policy
        promised = capacity.promised_growth(self.running, p.admission_mode, self.bs, self.groups, self.max_chunk)
        pending = self._pending_prefix_blocks()
        held: set[str] = set()
        while True:
            if budget <= 0:
                self._note_waiting(self._peek_waiting(held), "this step's token budget is spent",
                                   max_num_batched_tokens=p.max_num_batched_tokens)
                return
            if len(self.running) >= max_seqs or len(out.scheduled) >= max_seqs:
                self._note_waiting(self._peek_waiting(held), "max_num_seqs requests are running",
                                   max_num_seqs=max_seqs)
                return
            if out.num_admitted >= p.max_admissions_per_step:
                self._note_waiting(self._peek_waiting(held), "this step admitted max_admissions_per_step",
                                   max_admissions_per_step=p.max_admissions_per_step)
                return
            req = self._peek_waiting(held)
            if req is None:
                return
            if not self.free_rows or req.num_pending:
                why = "no free state row" if not self.free_rows else "its last token is still being read back"
                self._note_waiting(req, why)  # (a preempted request waits until its pending token is read back)
                return
            if req.lora_id and not self.loras.can_run(req.lora_id):  # the queue behind it goes on
                held.add(req.request_id)
                req.ledger.add("waiting", "every LoRA slot holds an adapter of running requests",
                               adapter=req.lora_name, max_loras=len(self.loras.slots))
                continue
            swap = req.swap  # swapped out: its own KV comes back from host RAM, no prefix lookup
            num_hit, hit_tables = (0, self._empty_tables()) if swap else self._prefix_hit(req)
            hits = [b for t in hit_tables for b in t if b != NULL_BLOCK]
            if not swap and num_hit < len(req.block_hashes) and req.block_hashes[num_hit] in pending:
                # A running request is computing this prompt's next blocks: it waits a step and
                # hits them. The queue behind it goes on (stopping here left most of a burst's
                # first steps empty: 16 names in 64 chats on one system prompt held 7 of 8).
                held.add(req.request_id)
                req.ledger.add("waiting", "a running request is computing its next prompt blocks: it hits them next step")
                continue
            cached = swap.num_computed_tokens if swap else num_hit * self.bs
            n = self._chunk(req, cached, budget)
            room = capacity.headroom(self.pool, p, num_tokens=req.num_tokens, max_total_tokens=req.max_total_tokens(),
                                     hits=hits, promised=promised, engine_busy=bool(self.running),
                                     pinned=req.pinned_blocks, groups=self.groups, hit_tokens=0 if swap else cached,
                                     chunk=self.max_chunk)
            if not room.fits:  # head of line waits: FCFS within its tier
                self._note_waiting(req, "not enough free KV blocks above the watermark", need_blocks=room.need,
                                   available_blocks=room.available, kept_free_blocks=room.kept_free,
                                   prefix_hit_tokens=cached)
                return
            self._pop_waiting(req)
            self.pool.touch(hits)
            self._unpin(req)  # (its hits now hold the imported blocks; the rest become free)
            req.block_tables = hit_tables
            if (swap and not self._swap_tables(req)) or not self._grow(req, cached, cached + n):
                self.pool.free(req.held_blocks())
                req.block_tables = self._empty_tables()
                self._requeue_front(req)  # (a swapped one keeps its host copy for the next try)
                self._note_waiting(req, "the pool ran out of blocks while allocating for it")
                return
            if swap:
                self.counters.swapped_in += 1
                req.swapped_in_at = self.num_steps
                out.swapped_in.append(req)
                req.ledger.add("admitted", "resumed with its KV written back from host RAM (swap)",
                               computed_tokens=cached, blocks=len(req.held_blocks()), chunk=n)
            else:
                req.ledger.add("admitted", "resumed after a preemption" if req.num_preemptions else "admitted",
                               prefix_hit_tokens=cached, blocks=len(req.held_blocks()), chunk=n,
                               free_blocks_after=self.pool.num_free_blocks)
            promised += capacity.promised_growth([req], p.admission_mode, self.bs, self.groups,
                                                 self.max_chunk)  # (it runs now)
            self._start(req, cached)
            if not swap:
                pending.update(req.block_hashes[num_hit:req.num_prompt_tokens // self.bs])
            out.scheduled.append((req, n))
            out.num_admitted += 1
            budget -= n

    def _swap_tables(self, req: Request) -> bool:
        """Fresh blocks in the places the swapped-out tables held blocks (NULL_BLOCK entries
        of a sliding group stay NULL): `req.swap.restored` lists them in the order of the
        host copy. False when the pool cannot give them all."""
        layout = req.swap.tables
        try:
            new = self.pool.allocate(sum(b != NULL_BLOCK for t in layout for b in t))
        except NoFreeBlocks:
            return False
        it = iter(new)
        req.block_tables = [[NULL_BLOCK if b == NULL_BLOCK else next(it) for b in t] for t in layout]
        req.swap.restored = new
        return True

    def _pending_prefix_blocks(self) -> set:
        """Hashes of full prompt blocks that running requests are still prefilling. A waiting
        request whose next block is among them is held back a step or two rather than
        computing a second copy (a burst of requests with one system prompt would otherwise
        prefill it once per request admitted in the first step)."""
        if not self.cache.enable_prefix_cache:
            return set()
        pending: set = set()
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                r.extend_block_hashes(self.bs)
                pending.update(r.block_hashes[r.num_computed_tokens // self.bs:r.num_prompt_tokens // self.bs])
        return pending

    def _requeue_front(self, req: Request) -> None:
        (self.resumed if req.status is Status.PREEMPTED else self.waiting[req.priority]).appendleft(req)
        self.queued_tokens += req.num_prompt_tokens

    def _prefix_hit(self, req: Request) -> tuple[int, list[list[int]]]:
        """What a prefix hit reuses: (n, per-group tables) for the longest prefix of n cached
        blocks that every group can serve -- a full group all n blocks, a sliding group the
        blocks its window reads before the hit point (`KVGroups.hit_window`; the entries
        before are NULL_BLOCK). Each group shortens n to its own longest hit until all
        agree (vLLM's find_longest_cache_hit for hybrid models). Read-only."""
        if not self.cache.enable_prefix_cache or not req.uses_prefix_cache:
            return 0, self._empty_tables()
        req.extend_block_hashes(self.bs)
        hashes = req.block_hashes[:cacheable_blocks(req.num_tokens, self.bs)]
        found: dict[tuple[int, int], int | None] = {}

        def cached(g: int, i: int) -> int | None:
            if (g, i) not in found:
                found[g, i] = self.pool.cached_block(hashes[i], req.token_ids, i, g)
            return found[g, i]

        n = len(hashes)
        settled = False
        while not settled:
            settled = True
            for g in range(self.groups.num_groups):
                m = self._longest_hit(g, n, cached)
                if m < n:
                    n, settled = m, False
        tables: list[list[int]] = []
        for g in range(self.groups.num_groups):
            window = self.groups.hit_window(g, n, self.bs)
            hit = [cached(g, i) for i in window]  # (all cached: _longest_hit settled n)
            tables.append([NULL_BLOCK] * window.start + [b for b in hit if b is not None])
        return n, tables

    def _longest_hit(self, g: int, n: int, cached) -> int:
        """The largest m <= n such that group g caches every block of hit_window(g, m). Scans
        right to left counting cached blocks; a run [i, i + run) is a hit once the window of
        m = i + run starts inside it (a full group's window starts at 0: a prefix match)."""
        if not self.groups.windows[g]:
            m = 0
            while m < n and cached(g, m) is not None:
                m += 1
            return m
        run = 0
        for i in range(n - 1, -1, -1):
            if cached(g, i) is None:
                run = 0
                continue
            run += 1
            if self.groups.hit_window(g, i + run, self.bs).start >= i:
                return i + run
        return 0

    def _start(self, req: Request, cached: int) -> None:
        first = req.num_cached_tokens < 0
        if req.lost_tokens:  # (a recompute preemption's tokens, less what the prefix cache kept)
            self.counters.recomputed_tokens += max(0, req.lost_tokens - cached)
            req.lost_tokens = 0
        if first:
            req.num_cached_tokens = cached
            self.counters.prefix_queries += req.num_prompt_tokens
            self.counters.prefix_hits += cached
        req.num_computed_tokens = cached
        req.num_registered_blocks = cached // self.bs
        req.state_row = self.free_rows.pop()
        if req.lora_id:
            req.lora_slot, written = self.loras.acquire(req.lora_id)
            req.ledger.add("lora", f"adapter {req.lora_name} {'written into' if written else 'already in'} device slot "
                                   f"{req.lora_slot}", slot=req.lora_slot)
        req.needs_row_reset = True
        req.row_counted_upto = 0
        req.status = Status.RUNNING
        self.running.append(req)

    # --- once a step is launched ------------------------------------------------------
    def commit(self, req: Request, n: int) -> bool:
        """Account `n` tokens of a launched step as computed (their KV is being written) and
        register newly full blocks whose tokens the host knows. Returns True when the step
        samples a token for the request (the chunk reached the end of its tokens): that
        token is pending until `append_token` brings it back."""
        req.num_computed_tokens += n
        req.needs_row_reset = False
        # The step's row adds its tokens to the penalty state (runtime/model/batch.py `step_row`
        # skips those already there); recorded here, where the step is committed.
        req.row_counted_upto = max(req.row_counted_upto, req.num_computed_tokens)
        sampled = req.num_computed_tokens == req.num_tokens_with_spec
        if sampled:
            req.num_pending += 1
            req.row_counted_upto = req.num_tokens  # the device counts the sampled token itself
        self._register_full_blocks(req)
        return sampled

    def accept_drafts(self, req: Request, accepted: int) -> None:
        """A verified step is read back: of its `len(spec_token_ids)` proposals the first
        `accepted` were kept. The rejected ones' KV slots are rolled back (they count as not
        computed, so no block holding one is offered to the prefix cache; the next tokens
        overwrite them) and the blocks only they needed return to the pool. Call before
        appending the step's tokens."""
        rejected = len(req.spec_token_ids) - accepted
        req.spec_token_ids = []
        if req.status is not Status.RUNNING:
            return
        req.num_computed_tokens -= max(rejected, 0)
        # (also blocks placed for proposals that never ran: a draft's cut by a grammar)
        keep = self.blocks_for(req.num_computed_tokens + 1)  # (+1: the kept sample's slot, next step)
        freed = [b for t in req.block_tables for b in t[keep:] if b != NULL_BLOCK]
        for t in req.block_tables:
            del t[keep:]
        if freed:
            self.pool.free(freed)

    def append_token(self, req: Request, token: int) -> None:
        """The host read back a sampled token (resolving the pending one, if any)."""
        req.token_ids.append(token)
        req.num_pending = max(0, req.num_pending - 1)
        self._register_full_blocks(req)

    def _register_full_blocks(self, req: Request) -> None:
        if not self.cache.enable_prefix_cache or req.status is not Status.RUNNING:
            return
        full = min(req.num_computed_tokens, len(req.token_ids)) // self.bs  # hashes need known tokens
        if full > req.num_registered_blocks:
            req.extend_block_hashes(self.bs)
            toks = req.token_ids
            for b in range(req.num_registered_blocks, full):
                for g, table in enumerate(req.block_tables):
                    if table[b] != NULL_BLOCK:  # (a sliding group may have released it already)
                        self.pool.cache_block(table[b], req.block_hashes[b], toks[b * self.bs:(b + 1) * self.bs],
                                              req.block_hashes[b - 1] if b else None, group=g, lora_id=req.lora_id)
            req.num_registered_blocks = full
