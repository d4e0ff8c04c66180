"""Speculative decoding on the host: who proposes, what, and when it stops paying.

Proposers: `ngram` (prompt lookup in the request's own text), `suffix` (the same, then the
recent outputs of the served model: `SuffixCache`) and `draft_model` (a smaller checkpoint
decoding greedily: runtime/core/draft.py). A decode row that speculates computes its last token followed by d proposed tokens in one
step; the step samples a token after each of the d + 1 positions with the keys the row
would have used one step at a time (runtime/model/runner.py `_verify`), and keeps the
proposals up to the first one that differs from its sample, plus that sample. For a
proposer that proposes deterministically (n-gram lookup here) this is exact rejection
sampling: a draft x is kept with probability p(x), and where it is not, the kept sample is
p's draw conditioned on not being x -- the residual distribution. So greedy and seeded
sampled outputs are the tokens the engine makes without speculation.

The scheduler counts the proposals as tokens to compute (`Request.spec_token_ids`) and
rolls back the rejected ones' KV slots when the step is read (`Scheduler.accept_drafts`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from runtime.config import SpeculativeConfig
from runtime.core.request import Request, SpecStats, Status

__all__ = ["SpecStats", "propose_ngram", "may_speculate", "Proposer", "SuffixCache", "record"]

BACKOFF_MAX_TOKENS = 64  # the longest pause (in output tokens) after proposals kept missing
SUFFIX_MAX_TOKENS = 1 << 20  # tokens the suffix cache keeps in all (its index: ~3 entries per token)


def propose_ngram(tokens: list[int] | np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the longest n in [n_min, n_max] whose last n tokens occur earlier in
    `tokens`; the (up to k) tokens that followed their most recent earlier occurrence."""
    if k <= 0:
        return []
    toks = np.asarray(tokens, np.int64)
    L = len(toks)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(toks[:L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == toks[L - n:]).all(axis=1))
        if len(hits):
            # the most recent occurrence that k tokens follow (else the earliest: the most follow)
            full = hits[hits + n + k <= L]
            s = int(full[-1] if len(full) else hits[0]) + n
            return toks[s:s + k].tolist()
    return []


def may_speculate(req: Request, spec: SpeculativeConfig, num_running: int, pending_ok: bool = False) -> bool:
    """The one rule of who proposes this step. A row speculates when: speculation is on for
    it (per request `speculative=False` opts out), the batch is below `disable_by_batch_size`,
    it is decoding (one token to compute, none pending), and its sampling keeps the same
    per-position distribution whatever the drafts are -- so not with penalties (their counts
    would need the drafts) or a min_tokens ban still in force. (A structured output may: its
    grammar checks the proposals and gives each position its mask, `guided_proposals`.) `pending_ok`: judge a request whose last
    token is still on the device as if it were read (whether to read it back first). Backoff: after two verifications in a
    row keep nothing, it pauses for a doubling number of tokens."""
    p = req.params
    if not p.speculative or num_running >= spec.disable_by_batch_size or req.status is not Status.RUNNING:
        return False
    if (req.num_pending and not pending_ok) or req.num_computed_tokens != req.num_tokens - 1:
        return False
    if req.banned_tokens is not None:
        return False
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        return False
    return req.num_output_tokens >= req.spec.resume_at


class SuffixCache:
    """`suffix`: the outputs of recently finished requests (at most `max_requests`, and at
    most SUFFIX_MAX_TOKENS tokens in all), indexed by every n-gram (n in [n_min, n_max]) to
    where its latest occurrence continues. Repeated agentic or templated answers then propose
    from what the model said before, not only from the request's own text. Outputs are kept
    apart by cache salt (a salted tenant never gets proposals from another's outputs). The
    oldest output leaves first and takes its own index entries with it."""

    def __init__(self, max_requests: int, n_min: int, n_max: int, max_tokens: int = 0):
        self.max_requests, self.n_min, self.n_max = max_requests, n_min, n_max
        self.max_tokens = max_tokens or SUFFIX_MAX_TOKENS
        self.outputs: deque[int] = deque()
        self.live: dict[int, tuple[Any, list[int]]] = {}   # id -> (salt, tokens)
        self.index: dict[tuple, tuple[int, int]] = {}     # (salt, *gram) -> (id, where it continues)
        self.num_tokens = 0
        self._ids = 0

    def _grams(self, salt: Any, toks: list[int]):
        for n in range(self.n_min, self.n_max + 1):
            for i in range(n, len(toks)):  # the gram toks[i-n:i] continues at i
                yield (salt, *toks[i - n:i]), i

    def add(self, tokens: list[int], salt: Any = None) -> None:
        toks = list(tokens[-self.max_tokens:])
        if len(toks) <= self.n_min:
            return
        gid, self._ids = self._ids, self._ids + 1
        self.live[gid] = (salt, toks)
        self.outputs.append(gid)
        self.num_tokens += len(toks)
        for key, i in self._grams(salt, toks):
            self.index[key] = (gid, i)
        while len(self.outputs) > self.max_requests or self.num_tokens > self.max_tokens:
            old = self.outputs.popleft()
            s, t = self.live.pop(old)
            self.num_tokens -= len(t)
            for key, _ in self._grams(s, t):
                if self.index.get(key, (None,))[0] == old:  # (a later output's entry stays)
                    del self.index[key]

    def propose(self, tokens: list[int], k: int, salt: Any = None) -> list[int]:
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            hit = self.index.get((salt, *tokens[-n:]))
            if hit is not None:
                return self.live[hit[0]][1][hit[1]:hit[1] + k]
        return []


class Proposer:
    """The configured method's proposals for a request, and what it learns from finished ones."""

    def __init__(self, spec: SpeculativeConfig):
        self.spec = spec
        self.cache = (SuffixCache(spec.suffix_decoding_max_cached_requests, spec.prompt_lookup_min,
                                  spec.prompt_lookup_max) if spec.method == "suffix" else None)

    def propose(self, req: Request, max_model_len: int) -> list[int]:
        """The drafts for the request's next step (never past max_tokens or the context):
        the request's own text first, then (suffix) the recent outputs."""
        spec = self.spec
        room = min(spec.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                   max_model_len - req.num_tokens - 1)
        if spec.method == "draft_model":  # slots the draft fills once the step is placed (runtime/core/draft.py)
            return [0] * max(room, 0)
        own = propose_ngram(req.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, room)
        if own or self.cache is None or room <= 0:
            return own
        return self.cache.propose(req.token_ids, room, req.cache_salt)

    def finished(self, req: Request) -> None:
        if self.cache is not None and req.params.speculative:
            self.cache.add(req.output_ids, req.cache_salt)


def guided_proposals(matcher: Any, drafts: list[int], width: int) -> tuple[list[int], np.ndarray]:
    """A structured output's proposals, cut before the first one its grammar forbids and
    after one that completes it, and the allowed-token mask of each position after the
    first: row j is the mask once drafts[:j+1] are consumed. The matcher is left as it was."""
    import llguidance.numpy as lln

    drafts = drafts[:matcher.validate_tokens(drafts)]
    masks = np.full((len(drafts), width), -1, np.int32)
    consumed = 0
    for t in drafts:
        if not matcher.consume_token(t):
            break
        consumed += 1
        if matcher.is_stopped():  # (the request ends on it: what is sampled after it is dropped)
            break
        lln.fill_next_token_bitmask(matcher, masks, consumed - 1)
    if consumed:
        matcher.rollback(consumed)
    return drafts[:consumed], masks[:consumed]


def record(req: Request, proposed: int, accepted: int, totals: Any = None) -> None:
    """After a verification: count it (in the request, and in `totals`, the scheduler's
    counters the snapshot reads) and adjust the request's backoff."""
    if totals is not None:
        totals.spec_proposed += proposed
        totals.spec_accepted += accepted
    s = req.spec
    s.proposed += proposed
    s.accepted += accepted
    req.ledger.add("speculation", "proposals verified", proposed=proposed, kept=accepted)
    if accepted:
        s.miss_streak = 0
        return
    s.miss_streak += 1
    if s.miss_streak >= 2:
        s.resume_at = req.num_output_tokens + min(1 << s.miss_streak, BACKOFF_MAX_TOKENS)
