"""Speculative decoding on the host: who proposes, what, and when it stops paying.

A decode row that speculates computes its last token followed by d proposed tokens in one
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

from typing import Any

import numpy as np

from runtime.config import SpeculativeConfig
from runtime.core.request import Request, SpecStats, Status

__all__ = ["SpecStats", "propose_ngram", "may_speculate", "propose", "record"]

BACKOFF_MAX_TOKENS = 64  # the longest pause (in output tokens) after proposals kept missing


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
    would need the drafts), a structured output (its mask needs the grammar advanced by
    each draft) or a min_tokens ban still in force. `pending_ok`: judge a request whose last
    token is still on the device as if it were read (whether to read it back first). Backoff: after two verifications in a
    row keep nothing, it pauses for a doubling number of tokens."""
    p = req.params
    if not p.speculative or num_running >= spec.disable_by_batch_size or req.status is not Status.RUNNING:
        return False
    if (req.num_pending and not pending_ok) or req.num_computed_tokens != req.num_tokens - 1:
        return False
    if req.matcher is not None or req.banned_tokens is not None:
        return False
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        return False
    return req.num_output_tokens >= req.spec.resume_at


def propose(req: Request, spec: SpeculativeConfig, max_model_len: int) -> list[int]:
    """The drafts for the request's next step (never past max_tokens or the context)."""
    room = min(spec.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
               max_model_len - req.num_tokens - 1)
    return propose_ngram(req.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, room)


def record(req: Request, proposed: int, accepted: int, totals: Any = None) -> None:
    """After a verification: count it (in the request, and in `totals`, the scheduler's
    counters the snapshot reads) and adjust the request's backoff."""
    if totals is not None:
        totals.spec_proposed += proposed
        totals.spec_accepted += accepted
    s = req.spec
    s.proposed += proposed
    s.accepted += accepted
    if accepted:
        s.miss_streak = 0
        return
    s.miss_streak += 1
    if s.miss_streak >= 2:
        s.resume_at = req.num_output_tokens + min(1 << s.miss_streak, BACKOFF_MAX_TOKENS)
