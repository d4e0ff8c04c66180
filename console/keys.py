"""API keys at the /v1 door, as a gateway does: who is calling, and is it within its limits.

A request is admitted against its key's limits before its body is read (the route guard),
and settles when its response has been sent in full (the access middleware): that is
when its tokens are known and its concurrency slot frees. Limits are sliding 60-second
windows per key, kept in this process: rpm counts admitted requests (the `limits`
library's moving window), tpm counts the prompt and completion tokens of settled
requests, max_concurrent counts requests whose responses have not finished. A key over a limit gets 429 with Retry-After and the limit
named. Usage is counted per key (Prometheus labels, the console's keys page) and added to
the state file every few seconds, so at most that much is lost to a `kill -9`.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from prometheus_client import CollectorRegistry, Counter, Gauge

from console.state import ApiKey, StateStore

WINDOW_S = 60
SHARED = "api-key"          # the one --api-key, as a key name: no limits


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after: float, limit: str) -> None:
        super().__init__(message)
        self.retry_after, self.limit = retry_after, limit


@dataclass
class Grant:
    """One admitted request of one key (settled once)."""
    key: str
    settled: bool = False


@dataclass
class _Window:
    """A key's tokens per minute and requests in flight. Hand-written: tpm charges a response's
    tokens after it is sent, past the limit, and `limits` refuses (records nothing for) a charge
    that would pass it and keeps one entry per unit of cost."""
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (settle time, tokens)
    token_sum: int = 0
    in_flight: int = 0

    def expire(self, now: float) -> None:
        while self.tokens and now - self.tokens[0][0] >= WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


def _per_minute(n: int) -> RateLimitItemPerSecond:
    return RateLimitItemPerSecond(n, WINDOW_S)


class KeyGate:
    """Per-key windows, usage counters and their flush to the state file."""

    def __init__(self, store: StateStore, registry: CollectorRegistry) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._rpm = MovingWindowRateLimiter(MemoryStorage())
        self._pending: dict[str, list[int]] = {}   # key -> [requests, rejected, prompt, completion] not yet stored
        self.requests = Counter("pagedjax:api_key_requests", "Requests by API key name and outcome",
                                ["key", "outcome"], registry=registry)
        self.tokens = Counter("pagedjax:api_key_tokens", "Tokens by API key name (prompt, completion)",
                              ["key", "kind"], registry=registry)
        self.in_flight = Gauge("pagedjax:api_key_in_flight", "Requests in flight by API key name", ["key"],
                               registry=registry)

    # --- who is it ---------------------------------------------------------------------------
    def identify(self, given: str, shared: str | None) -> ApiKey | str | None:
        """The named key, SHARED for the --api-key, None when neither matches."""
        if shared is not None and secrets.compare_digest(given.encode(), shared.encode()):
            return SHARED
        return self.store.verify_key(given)

    # --- limits -----------------------------------------------------------------------------------
    def admit(self, key: ApiKey | str) -> Grant:
        """Count the request against the key's limits or raise LimitExceeded (counted as rejected)."""
        now = time.time()  # (the clock `limits` keeps its windows by)
        name = key if isinstance(key, str) else key.name
        with self._lock:
            w = self._windows.setdefault(name, _Window())
            w.expire(now)
            if not isinstance(key, str):
                refusal = self._refusal(key, w, now)
                if refusal is not None:
                    self._count(name, rejected=1)
                    self.requests.labels(name, "rate_limited").inc()
                    raise refusal
                if key.rpm is not None:
                    self._rpm.hit(_per_minute(key.rpm), name)  # (free: _refusal tested it)
            w.in_flight += 1
            self._count(name, requests=1)
        self.requests.labels(name, "admitted").inc()
        self.in_flight.labels(name).inc()
        return Grant(name)

    def _refusal(self, key: ApiKey, w: _Window, now: float) -> LimitExceeded | None:
        if key.max_concurrent is not None and w.in_flight >= key.max_concurrent:
            return LimitExceeded(f"rate limit: key {key.name!r} has {w.in_flight} requests in flight, its "
                                 f"max_concurrent limit is {key.max_concurrent}", 1.0, "max_concurrent")
        if key.rpm is not None and not self._rpm.test(_per_minute(key.rpm), key.name):
            # Until the oldest admission in the window ages out.
            wait = self._rpm.get_window_stats(_per_minute(key.rpm), key.name).reset_time - now
            return LimitExceeded(f"rate limit: key {key.name!r} is over its limit of {key.rpm} requests per "
                                 "minute", wait, "rpm")
        if key.tpm is not None and w.token_sum >= key.tpm:
            # Wait until enough of the window's tokens age out to fall under the limit.
            excess, wait = w.token_sum - key.tpm, WINDOW_S
            for t, n in w.tokens:
                excess -= n
                if excess < 0:
                    wait = WINDOW_S - (now - t)
                    break
            return LimitExceeded(f"rate limit: key {key.name!r} used {w.token_sum} tokens in the last minute, its "
                                 f"limit is {key.tpm} tokens per minute", wait, "tpm")
        return None

    def settle(self, grant: Grant, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """The response has been sent: free the slot, count the tokens (once)."""
        if grant.settled:
            return
        grant.settled = True
        now = time.time()
        p, c = prompt_tokens or 0, completion_tokens or 0
        with self._lock:
            w = self._windows.setdefault(grant.key, _Window())
            w.in_flight -= 1
            if p + c:
                w.tokens.append((now, p + c))
                w.token_sum += p + c
            self._count(grant.key, prompt=p, completion=c)
        self.in_flight.labels(grant.key).dec()
        if p:
            self.tokens.labels(grant.key, "prompt").inc(p)
        if c:
            self.tokens.labels(grant.key, "completion").inc(c)

    def in_flight_now(self) -> dict[str, int]:
        with self._lock:
            return {k: w.in_flight for k, w in self._windows.items()}

    # --- usage ----------------------------------------------------------------------------------------
    def _count(self, name: str, requests: int = 0, rejected: int = 0, prompt: int = 0, completion: int = 0) -> None:
        if name == SHARED:
            return  # the shared key has no row: Prometheus counts it
        u = self._pending.setdefault(name, [0, 0, 0, 0])
        u[0] += requests
        u[1] += rejected
        u[2] += prompt
        u[3] += completion

    def flush(self) -> None:
        """Add the usage counted since the last flush to the state file."""
        with self._lock:
            pending, self._pending = self._pending, {}
        try:
            self.store.add_usage({k: tuple(v) for k, v in pending.items()})  # type: ignore[misc]
        except Exception:
            with self._lock:  # keep it for the next flush rather than lose it
                for k, v in pending.items():
                    u = self._pending.setdefault(k, [0, 0, 0, 0])
                    for i, x in enumerate(v):
                        u[i] += x
            raise

    def usage(self) -> list[dict[str, Any]]:
        """Every key with its stored usage plus what is not flushed yet."""
        with self._lock:
            pending = {k: list(v) for k, v in self._pending.items()}
            flight = {k: w.in_flight for k, w in self._windows.items()}
        rows = []
        for k in self.store.keys():
            p = pending.get(k.name, [0, 0, 0, 0])
            rows.append({"key": k, "requests": k.requests + p[0], "rejected": k.rejected + p[1],
                         "prompt_tokens": k.prompt_tokens + p[2], "completion_tokens": k.completion_tokens + p[3],
                         "in_flight": flight.get(k.name, 0)})
        return rows


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
