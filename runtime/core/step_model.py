"""The engine's own step-time model and the admission quote built on it.

`StepTimeModel` learns, online, how long one beat of the engine loop takes as a function of
the tokens the step computes: an exponential average per power-of-two bucket of tokens (the
runner compiles about those sizes), read between measured buckets by linear interpolation and
beyond the largest in proportion to the tokens. Every read-back step feeds it
(LLMEngine._read_back), so it follows the machine it runs on and the load it runs under.

`quote` answers "if this request came now, would it be admitted and how soon would it be
served?" from the live scheduler state and that model, without queueing anything: the queue
limits and `never_fits` decide `admit`; the prompt's prefix hit, the prompts queued ahead of it
in admission order and the unfinished prefill of running requests are the tokens to compute
before its first token, at a per-step rate of the token budget less one token per decoding
row (the running ones and, once admitted, the ones ahead of it) (what is left of the beat under way, whole-budget steps, one for the remainder, the beat
that reads its token back); when its blocks do not fit now, it also waits for the running requests that must finish
first. ITL is the model's step time with those rows plus this one decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.core import capacity
from runtime.core.request import Request
from runtime.core.scheduler import PRIORITY_RANK, Status

if TYPE_CHECKING:
    from runtime.core.engine import LLMEngine


class StepTimeModel:
    ALPHA = 0.2  # weight of the newest beat in its bucket's average

    def __init__(self) -> None:
        self.buckets: dict[int, float] = {}  # power-of-two token bucket -> seconds per beat (EMA)
        self.observed = 0
        # The quote's self-check over the requests that got their first token: an average of
        # log(measured / predicted) TTFT (exp() of it: the model's bias, shown, not applied: scaling
        # the quotes by it measured worse, 72% within 30% against 79-80%, as the error is a spread
        # more than a bias) and of the share within 30%.
        self.ttft_log_ratio = 0.0
        self.ttft_checked = 0
        self.ttft_within_30 = 0.0  # share of recent quotes within +-30% (an average)

    def observe_ttft(self, predicted: float, measured: float) -> None:
        if predicted <= 0 or measured <= 0:
            return
        w = 0.05  # (slow, and each request's say clipped to 2x either way: a compile or a stall is not the model's)
        self.ttft_within_30 += w * (float(abs(predicted - measured) <= 0.3 * measured) - self.ttft_within_30)
        self.ttft_log_ratio += w * (min(max(math.log(measured / predicted), -0.7), 0.7) - self.ttft_log_ratio)
        self.ttft_checked += 1

    @staticmethod
    def bucket(tokens: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(tokens, 1))))

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        b = self.bucket(tokens)
        old = self.buckets.get(b)
        self.buckets[b] = seconds if old is None else (1 - self.ALPHA) * old + self.ALPHA * seconds
        self.observed += 1

    def predict(self, tokens: int) -> float | None:
        """Seconds of a beat computing `tokens` tokens; None before any beat was measured."""
        if not self.buckets:
            return None
        tokens = max(tokens, 1)
        pts = sorted(self.buckets.items())
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if tokens <= b1:
                return t0 + (t1 - t0) * (tokens - b0) / (b1 - b0)
        b, t = pts[-1]
        return t * tokens / b  # (past every measured size: in proportion)


@dataclass(frozen=True)
class Quote:
    admit: bool
    reason: str
    predicted_ttft_s: float | None
    predicted_itl_s: float | None
    retry_after_s: float | None
    queue_ahead: int          # requests ahead of it in admission order
    tokens_ahead: int         # tokens to compute before its first token (its own uncached prompt included)
    prefix_hit_tokens: int
    ttft_bias: float = 1.0    # measured / predicted TTFT so far (a geometric average; the self-check)
    replica: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _remaining_prefill(r: Request) -> int:
    return max(0, r.num_tokens - r.num_computed_tokens) if r.num_computed_tokens < r.num_prompt_tokens else 0


def quote(engine: "LLMEngine", prompt_ids: list[int], max_tokens: int, priority: str = "interactive",
          uses_prefix_cache: bool = True, policy: Any = None, cache_salt: str | None = None) -> Quote:
    """See the module docstring; call under the engine lock. `policy`: judge under this
    admission policy instead of the engine's (the console's preview of a change)."""
    s, pool, p = engine.scheduler, engine.pool, policy or engine.policy
    model = engine.step_model
    probe = Request("quote", list(prompt_ids), _params(max_tokens), priority, cache_salt)
    if not uses_prefix_cache:
        probe.params = _params(max_tokens, penalties=True)
    why = capacity.never_fits(probe.max_total_tokens(), s.envelope.max_model_len, pool, s.groups, s.max_chunk)
    hit_blocks, hit_tables = s._prefix_hit(probe)
    hit = hit_blocks * s.bs
    rank = PRIORITY_RANK[priority]
    ahead = [r for r in s.waiting_requests() if r.status is Status.PREEMPTED or PRIORITY_RANK[r.priority] <= rank]
    # Rows decoding while it waits: the running ones, and the ones ahead of it once admitted.
    decoding = min(sum(1 for r in s.running if r.num_computed_tokens >= r.num_prompt_tokens) + len(ahead),
                   s.envelope.max_num_seqs)
    budget = max(1, min(p.max_num_batched_tokens, s.envelope.max_num_batched_tokens) - decoding)
    tokens = (sum(_remaining_prefill(r) for r in s.running) + sum(r.num_tokens for r in ahead)
              + len(prompt_ids) - hit)
    step = model.predict(budget + decoding)
    itl = model.predict(decoding + 1)
    full = s.num_waiting >= p.max_queue_len or s.queued_tokens + len(prompt_ids) > p.max_queued_tokens
    drain = None if step is None else math.ceil(s.queued_tokens / budget) * step
    if why is not None:
        return Quote(False, f"too_long ({why})", None, None, None, len(ahead), tokens, hit)
    if full:
        return Quote(False, "queue_full" if s.num_waiting >= p.max_queue_len else "queued_tokens", None, itl,
                     drain, len(ahead), tokens, hit)
    ttft = None
    if step is not None:
        # What is left of the beat under way when it arrives (half of one, on average), whole-budget
        # steps, the remainder's (smaller, faster) step, then the beat that reads its token back.
        full, rem = divmod(tokens, budget)
        ttft = 1.5 * (itl or 0.0) + full * step + (model.predict(rem + decoding) or 0.0 if rem else 0.0)
    reason = "admitted at the next step" if not ahead else f"queued behind {len(ahead)} requests"
    hits = [b for t in hit_tables for b in t if b >= 0]
    room = capacity.headroom(pool, p, num_tokens=len(prompt_ids), max_total_tokens=probe.max_total_tokens(),
                             hits=hits, promised=capacity.promised_growth(s.running, p.admission_mode, s.bs, s.groups,
                                                                            s.max_chunk),
                             engine_busy=bool(s.running), groups=s.groups, hit_tokens=hit, chunk=s.max_chunk)
    if not ahead and not room.fits and ttft is not None and itl is not None:
        # It waits for running requests to finish and free their blocks: the fewest, soonest first.
        short = room.need + room.kept_free - room.available
        wait_steps = 0
        for r in sorted(s.running, key=lambda r: r.max_total_tokens() - r.num_tokens):
            short -= len(r.held_blocks())
            wait_steps = r.max_total_tokens() - r.num_tokens
            if short <= 0:
                break
        ttft += wait_steps * itl
        reason = "waits for running requests to free KV blocks"
    if step is None:
        reason += " (no step measured yet: no prediction)"
    return Quote(True, reason, ttft, itl, None, len(ahead), tokens, hit, math.exp(model.ttft_log_ratio))


def _params(max_tokens: int, penalties: bool = False) -> Any:
    from runtime.model.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=1.1 if penalties else 1.0)
