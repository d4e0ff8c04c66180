"""A background thread that owns the device and loops `LLMEngine.step()`, and the output
processor's thread beside it (text, stop strings, callbacks: off the device thread); each
request gets an asyncio queue the web layer awaits. Stopping drains or aborts cleanly."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, AsyncIterator, Sequence

from runtime.core.engine import LLMEngine, RequestOutput
from runtime.model.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.accepting = True
        self.steps = 0

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.engine.outputs.start()
            self._thread = threading.Thread(target=self._loop, name="pagedjax-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                if not self.engine.has_unfinished():
                    self.engine.step()  # applies policy changes and aborts while idle
                    continue
            try:
                self.engine.step()
                self.steps += 1
            except Exception:  # noqa: BLE001 -- LLMEngine.step already fails a bad step's requests
                log.exception("engine loop error")
                time.sleep(0.1)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish for up to grace_s; abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.engine.lock:
            pending = list(self.engine._tracked)
        for rid in pending:
            self.engine.abort(rid)
        end = time.monotonic() + 5.0
        while self.engine.has_unfinished() and time.monotonic() < end and self._thread is not None:
            self._wake.set()
            time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.engine.outputs.stop()  # delivers what the last steps queued
        tracing = getattr(self.engine, "tracing", None)
        if tracing is not None:  # (the spans still batched go out)
            tracing.shutdown()
        if getattr(self.engine, "disk_tier", None) is not None:  # (the prefixes a restart should find)
            from runtime.core import kv_tiers

            kv_tiers.flush_to_disk(self.engine)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    # --- what the web layer needs to know (runtime/fleet/gateway.py answers the same) ---------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.envelope.max_model_len

    @property
    def context_limit(self) -> int:
        """Longest prompt + output one request may have: the context, or the whole cache."""
        return min(self.engine.envelope.max_model_len, self.engine.config.cache.num_tokens)

    def render_metrics(self) -> bytes:
        return self.engine.metrics.render()

    def quote(self, prompt_ids: Sequence[int], max_tokens: int, priority: str = "interactive",
              uses_prefix_cache: bool = True) -> Any:
        """The admission quote (runtime/core/step_model.py); the fleet's gateway has none yet."""
        return self.engine.quote(prompt_ids, max_tokens, priority, uses_prefix_cache)

    def retry_after(self) -> float | None:
        return self.engine.retry_after()

    # --- LoRA adapters (runtime/core/lora.py) ---------------------------------------------
    def lora_adapters(self) -> list[dict[str, Any]]:
        """The adapters served (name, path, rank, slot, requests, ...); [] without LoRA."""
        return self.engine.loras.snapshot()["adapters"] if self.engine.loras is not None else []

    def has_lora(self, name: str) -> bool:
        return self.engine.loras is not None and self.engine.loras.get(name) is not None

    async def load_lora(self, name: str, path: str) -> None:
        """Read and register an adapter off the event loop (AdapterError: nothing changed)."""
        await asyncio.to_thread(self.engine.load_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    # --- requests -----------------------------------------------------------------------
    async def asubmit(self, prompt_ids: Sequence[int], params: SamplingParams, **kw: Any
                      ) -> tuple[str, asyncio.Queue]:
        """`submit` for callers that may also be given a fleet (whose admission awaits). A
        structured output's grammar compiles on a worker thread, off the event loop."""
        if params.guide is not None and kw.get("matcher") is None:
            kw["matcher"] = await asyncio.to_thread(self.engine.compile_guide, params.guide)
        return self.submit(prompt_ids, params, **kw)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, **kw: Any) -> tuple[str, asyncio.Queue]:
        """Add a request from the event loop; returns (request id, queue of RequestOutput).
        Raises ValueError / Overloaded synchronously."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        req = self.engine.add_request(prompt_ids, params, on_output=deliver, **kw)
        self._wake.set()
        return req.request_id, queue

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams, **kw: Any
                     ) -> AsyncIterator[RequestOutput]:
        """Yields outputs until the finished one; aborts the request if the consumer stops early
        (client disconnect, cancellation)."""
        rid, queue = self.submit(prompt_ids, params, **kw)
        finished = False
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()
