"""Token outputs -> text outputs, off the device thread.

The engine's read-back is token-level: it appends each sampled token, applies the stops a
token decides (EOS, stop token ids, max_tokens, a finished grammar) and emits a
`RequestOutput` with `token_ids` and no text. This processor turns those into what clients
see: incremental detokenization, stop strings (and the characters held back while they
might still begin one), logprobs formatted from the step's raw rows, and the callbacks. A stop string finishes the request here, first:
its final output goes out at once, and the engine is told to drop the request at its next
step boundary (`on_stop`); whatever the engine still sends for it is discarded.

It runs inline (`push` returns the text outputs: `LLMEngine.step()` for tests and offline
use) or on its own thread (`start`, as `AsyncEngine` does), where the device thread only
queues the step's outputs: the text work then runs while the device thread waits on the
next step, which releases the GIL.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from runtime.core.request import format_logprob
from runtime.model.sampling import SamplingParams
from runtime.tokenizer import IncrementalDetokenizer, TextTokenizer

if TYPE_CHECKING:
    from runtime.core.engine import RequestOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Text:
    """One live request's text state."""
    detok: IncrementalDetokenizer
    params: SamplingParams
    on_output: Callable[["RequestOutput"], None] | None
    emitted: int = 0                      # characters of detok.text already sent


class OutputProcessor:
    def __init__(self, tokenizer: TextTokenizer, on_stop: Callable[[str, str], None],
                 on_end: Callable[[str, str], None] | None = None):
        self.tokenizer = tokenizer
        self.on_stop = on_stop            # (request id, stop string): the engine drops the request
        # (request id, reason): how a request with stop strings that the engine ended by length
        # ended for its client ("stop" when a stop string came on that last token), once
        self.on_end = on_end or (lambda rid, reason: None)
        self._lock = threading.Lock()     # guards _live/_stopped: add() comes from web threads
        self._live: dict[str, _Text] = {}
        self._stopped: set[str] = set()   # finished here by a stop string; the engine's end not seen yet
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._busy = 0                    # batches queued or being processed (threaded mode)

    # --- requests ------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            on_output: Callable[["RequestOutput"], None] | None) -> None:
        with self._lock:
            self._live[request_id] = _Text(self.tokenizer.detokenizer(prompt_ids), params, on_output)

    # --- outputs -------------------------------------------------------------------------
    def push(self, outputs: list["RequestOutput"]) -> list["RequestOutput"]:
        """Inline: the text outputs, delivered. Threaded: queued for the thread; returns []."""
        if not outputs:
            return []
        q = self._queue
        if q is not None:
            with self._lock:
                self._busy += 1
            q.put(outputs)
            return []
        return self._process(outputs)

    def _process(self, outputs: list["RequestOutput"]) -> list["RequestOutput"]:
        texted = []
        for out in outputs:
            t = self._text(out)
            if t is None:
                continue
            texted.append(t)
            cb = self._callback(t)
            if cb is not None:
                try:
                    cb(t)
                except Exception:  # noqa: BLE001 -- a consumer's bug must not stop the engine
                    log.exception("output callback for %s failed", t.request_id)
        return texted

    def _callback(self, out: "RequestOutput") -> Callable | None:
        with self._lock:
            st = self._live.pop(out.request_id, None) if out.finished else self._live.get(out.request_id)
        return st.on_output if st is not None else None

    def _text(self, out: "RequestOutput") -> "RequestOutput | None":
        with self._lock:
            st = self._live.get(out.request_id)
            stopped = out.request_id in self._stopped
            if stopped and out.finished:  # the engine's own end of a request a stop string ended here
                self._stopped.discard(out.request_id)
        if st is None or stopped:
            if out.finished and out.finish_reason == "length":  # (stopped: max_tokens came before the stop)
                self.on_end(out.request_id, "stop" if stopped else "length")
            return None
        ids = out.token_ids if out.text_ids is None else out.text_ids
        p = st.params
        ends: list[int] = []  # the text's length after each token, where a stop string may cut an output of several
        if p.stop and len(ids) > 1:
            for t in ids:
                st.detok.push([t])
                ends.append(len(st.detok.text))
        elif ids:
            st.detok.push(ids)
        text = st.detok.text
        text_end = len(text)
        stop = None
        # A stop string may end a request the engine would let go on, or one it ended by
        # length on this very token (the stop string wins, as it came first in the text).
        if p.stop and out.finish_reason in (None, "length") and out.completion_tokens >= p.min_tokens:
            for s in p.stop:
                idx = text.find(s, max(0, st.emitted - len(s)))
                if 0 <= idx < text_end:
                    stop, text_end = s, idx
            if stop is None and not out.finished:  # hold back what could begin a stop string
                text_end = max(st.emitted, len(text) - (max(len(s) for s in p.stop) - 1))
        delta = text[st.emitted:text_end] if text_end > st.emitted else ""
        st.emitted = max(st.emitted, text_end)
        fmt = {"text": delta, "text_ids": None, "logprobs": [format_logprob(e) for e in out.logprobs]}
        if out.prompt_logprobs is not None:
            fmt["prompt_logprobs"] = [None if e is None else format_logprob(e) for e in out.prompt_logprobs]
        if out.finished and p.stop and out.finish_reason == "length":
            self.on_end(out.request_id, "length" if stop is None else "stop")
        if stop is None:
            return dataclasses.replace(out, **fmt)
        if not out.finished:
            with self._lock:
                self._stopped.add(out.request_id)
            self.on_stop(out.request_id, stop)
        if ends:  # (speculative decoding: several tokens) the output ends with the token that completes the stop
            k = next((j for j, e in enumerate(ends) if e >= text_end + len(stop)), len(ends) - 1) + 1
            fmt.update(token_ids=out.token_ids[:k], logprobs=fmt["logprobs"][:k],
                       completion_tokens=out.completion_tokens - (len(out.token_ids) - k))
        return dataclasses.replace(out, **fmt, finished=True, finish_reason="stop", stop_reason=stop)

    # --- threaded mode ---------------------------------------------------------------------
    def start(self) -> None:
        """Process on a thread of its own from now on."""
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, args=(self._queue,), name="pagedjax-outputs",
                                            daemon=True)
            self._thread.start()

    def _loop(self, q: queue.SimpleQueue) -> None:
        while (batch := q.get()) is not None:
            try:
                self._process(batch)
            except Exception:  # noqa: BLE001 -- keep serving the other requests
                log.exception("output processing failed")
            finally:
                with self._lock:
                    self._busy -= 1

    def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver everything queued, then go back to inline processing. Call it once the
        device thread has stopped pushing (AsyncEngine.stop joins that thread first)."""
        if self._thread is not None:
            q, self._queue = self._queue, None  # new pushes run inline; the thread drains the rest
            q.put(None)
            self._thread.join(timeout=timeout_s)
            self._thread = None

    @property
    def idle(self) -> bool:
        """Nothing queued or being processed."""
        with self._lock:
            return self._busy == 0

    @property
    def threaded(self) -> bool:
        return self._thread is not None


__all__ = ["OutputProcessor"]
