"""The engine: `add_request` / `abort` / `step()`.

Where a request is at any moment:
  waiting   in `scheduler.waiting` (or `scheduler.resumed` after a preemption), no blocks;
            a swapped-out one's KV in host RAM (`Request.swap`, runtime/core/kv_tiers.py);
  running   in `scheduler.running`, holding blocks; its `num_computed_tokens` include the
            tokens of a launched step, and a token that step sampled is *pending* until
            read back (`Request.num_pending`);
  finished  dropped from the scheduler, blocks returned, final output delivered.

`LLMEngine.step()` is one beat of a two-stage pipeline (async scheduling): take aborts and
policy changes, plan step N+1 and launch it -- the device reads each decode row's input
token from its own state, so the host need not know step N's tokens -- then read step N
back: tokens and the stops a token decides. The host work of a beat thus overlaps the
device's work on N+1. Text (detokenizing, stop strings) and the callbacks are the output
processor's (runtime/core/output_processor.py): inline for `step()`'s callers, on a thread of
its own under `AsyncEngine` (runtime/core/async_engine.py), which runs the loop on a background
thread that owns the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from runtime.core.request import step_row
from runtime.model.batch import GUIDED_SPEC_ROWS
from runtime.core import disagg, kv_tiers, speculative
from runtime.kv_groups import KVGroups
from runtime.core.block_pool import BlockPool
from runtime.config import AdmissionPolicy, EngineConfig
from runtime.core.metrics import (EVICTION_STATES, SLO_WINDOWS, EngineMetrics, EngineState, EvictionSignal,
                                  ExpertLoad, LoraCollector, SLOSample, StepSample, eviction_signal, slo_attainment)
from runtime.model.runner import ModelRunner, StepHandle, compilations
from runtime.core.output_processor import OutputProcessor
from runtime.core.request import Request
from runtime.core.ledger import FINISHED_KEPT, NullLedger
from runtime.core.lora import AdapterBusy, AdapterError, LoraSlots
from runtime.core import step_model
from runtime.core.step_model import Quote, StepTimeModel
from runtime.model.sampling import SamplingParams
from runtime.core.scheduler import PRIORITY_RANK, Overloaded, Scheduler, SchedulerOutput
from runtime.core.snapshot import EngineSnapshot, take_snapshot
from runtime.model.structured import GuideCompiler
from runtime.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
__all__ = ["LLMEngine", "RequestOutput", "Overloaded"]


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]                 # new tokens since the last output
    text: str                            # new text since the last output
    finished: bool = False
    finish_reason: str | None = None     # stop | length | abort | error
    stop_reason: Any = None              # the stop string or token id that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # (logprob, [(top id, top logprob)]) per new token; the engine hands the output processor
    # raw rows (logprob, top ids, top logprobs as numpy) and it formats them off the device thread
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    error: str | None = None
    # once, with the first token: None for the first prompt token, then (logprob, top) per token
    prompt_logprobs: list[Any] | None = None
    # engine -> output processor only: the tokens whose text this output adds, when not
    # token_ids (an EOS or stop token ends a request without adding its text)
    text_ids: list[int] | None = field(default=None, repr=False)
    spec: tuple[int, int] = (0, 0)      # speculative decoding so far: tokens proposed, kept


@dataclass(eq=False)
class _InFlight:
    """A launched step: its rows (request, samples a token?) in row order, and its outputs."""
    rows: list[tuple[Request, bool]]
    handle: StepHandle
    num_tokens: int
    launched_at: float                  # perf_counter
    guided: bool = False                # a row's structured output needs this step's token next
    verifies: bool = False              # a row verifies proposals (speculative decoding)
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)  # (req, offset in T, pos, n)


@dataclass(eq=False)
class _Tracked:
    req: Request
    prompt_sent: bool = False           # prompt logprobs delivered


class LLMEngine:
    def __init__(self, config: EngineConfig, params: Any, tokenizer: TextTokenizer, *,
                 warmup: bool = True, progress: bool = True, dtype: Any = None):
        import jax.numpy as jnp

        self.config = config
        self.tokenizer = tokenizer
        self.envelope = config.scheduler
        self.pool = BlockPool(config.cache.num_blocks, config.cache.block_size, config.cache.enable_prefix_cache)
        self.pool.recent_s = config.eviction.window_s  # (a prefix used within the window counts as live)
        self.host_tier = None  # the host-RAM KV tier (runtime/core/kv_tiers.py)
        if config.kv_offload_memory:
            if not config.cache.enable_prefix_cache:
                raise ValueError("kv_offload_memory: the host KV tier holds prefix-cache blocks; it needs the prefix cache")
            if KVGroups.of(config.model, config.cache.kv_groups).num_groups > 1:
                raise ValueError("kv_offload_memory: not implemented for models with sliding-window KV groups")
            self.host_tier = kv_tiers.HostTier(config.kv_offload_memory)
            self.pool.offload_log = []
        elif config.kv_offload_dir:
            raise ValueError("kv_offload_dir: the disk tier sits under the host tier; give --kv-offload-memory too")
        self.disk_tier = (kv_tiers.DiskTier(Path(config.kv_offload_dir), config.kv_offload_disk,
                                            kv_tiers.fingerprint(config, params))
                          if config.kv_offload_dir else None)
        for tier in (self.host_tier, self.disk_tier):  # (their residency events join the pool's, when recorded)
            if tier is not None:
                tier.log = self._log_tier_event
        if self.disk_tier is not None and self.disk_tier.loaded:
            log.info("kv tier: %d blocks (%.1f MiB) on disk in %s from before", self.disk_tier.loaded,
                     self.disk_tier.bytes / 2**20, config.kv_offload_dir)
        self._policy = config.policy
        self._policy.validate(self.envelope)
        self.kv_groups = KVGroups.of(config.model, config.cache.kv_groups)  # (runtime/kv_groups.py)
        self.scheduler = Scheduler(config.cache, self.envelope, self._policy, self.pool, self.kv_groups)
        dtype = dtype or {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[config.dtype]
        from runtime.model.quant import prepare, quantization_of

        if config.quantization == "auto":  # serve the checkpoint as it is stored
            config = self.config = dataclasses.replace(config, quantization=quantization_of(params),
                                                       quantize_lm_head=config.quantize_lm_head or "head" in params)
        folds: dict = {}  # what SmoothQuant did to the projections' inputs and outputs (LoRA follows it)
        if config.lora is not None and quantization_of(params) == "w8a8":
            raise ValueError("lora: this checkpoint is stored as w8a8 (SmoothQuant's scales folded into its weights, "
                             "which an adapter's product must follow); convert the float source and serve it with "
                             "--quantization w8a8")
        params = prepare(params, config.quantization, config.model, tokenizer, lm_head=config.quantize_lm_head,
                         folds=folds)
        self.runner = ModelRunner(config.model, params, config.cache, self.envelope,
                                  config.attention_backend, dtype, config.quantization,
                                  tensor_parallel_size=config.tensor_parallel_size, kernels=config.kernels,
                                  spec_k=config.speculative.num_speculative_tokens if config.speculative else 0,
                                  lora=config.lora)
        self.loras: LoraSlots | None = None  # LoRA adapters: the registry and the device slots (runtime/core/lora.py)
        if config.lora is not None:
            from runtime.model.lora import PARTS

            table = self.runner.params["lora"]
            supported = tuple(m for name in table.a for m in PARTS.get(name, (name,)))
            self.loras = self.scheduler.loras = LoraSlots(config.model, config.lora, supported,
                                                          self.runner.write_lora_slot, folds)
        self.guides = GuideCompiler(tokenizer, config.model.vocab_size)
        self.proposer = speculative.Proposer(config.speculative) if config.speculative else None
        self.draft = None  # draft_model speculation: the draft's runner beside the target's
        if config.speculative is not None and config.speculative.method == "draft_model":
            from runtime.core.draft import DraftModel

            self.draft = DraftModel(config, config.model.vocab_size, self.kv_groups.num_groups, tokenizer)
        if config.preemption_mode not in ("auto", "recompute"):
            raise ValueError(f"preemption_mode: must be 'auto' or 'recompute', got {config.preemption_mode!r}")
        self.swap_space = None  # swap preemption (runtime/core/kv_tiers.py): on the host tier's budget
        if self.host_tier is not None and config.preemption_mode == "auto":
            if self.draft is not None:  # (the draft's cache shares the block ids a swap would move)
                log.info("kv tier: swap preemption off with a draft model: preempted requests recompute")
            else:
                self.swap_space = self.scheduler.swap = kv_tiers.SwapSpace(self.host_tier, self.runner.kv_block_bytes())
        self.metrics = EngineMetrics(lambda: EngineState.read(self.scheduler, self.pool, compilations))
        self.metrics.vllm_cache_config.labels(str(config.cache.block_size), str(config.cache.num_blocks)).set(1)
        if self.loras is not None:
            self.metrics.registry.register(LoraCollector(self.lora_view))
        model = config.model  # a mixture of experts: the steps' routing balance (console, /metrics)
        self.expert_load = (ExpertLoad(model.num_layers, model.num_experts, model.moe_layers())
                            if model.num_experts else None)
        self.lock = threading.RLock()
        self._tracked: dict[str, _Tracked] = {}
        self._finished_ledgers: OrderedDict[str, tuple] = OrderedDict()  # the last FINISHED_KEPT (ledger())
        self.step_model = StepTimeModel()  # seconds per beat by tokens, learned online (admission quotes)
        self.tracing = None  # finished requests' ledgers as OpenTelemetry spans (runtime/core/tracing.py)
        if config.otlp_traces_endpoint:
            if not config.request_ledger:
                raise ValueError("otlp_traces_endpoint: the spans are the request ledgers; drop --no-request-ledger")
            from runtime.core.tracing import LedgerExporter

            self.tracing = LedgerExporter(config.otlp_traces_endpoint)
        self._last_slo = 0.0
        # Requests to end at the next step boundary: (id, reason, stop string) -- aborts, and
        # stop strings the output processor found.
        self._ends: list[tuple[str, str, str | None]] = []
        self.outputs = OutputProcessor(tokenizer, on_stop=lambda rid, s: self._end_later(rid, "stop", s),
                                       on_end=self._count_end)
        # Requests with stop strings the engine ended by length: counted in request_success once
        # the output processor says whether a stop string came on that last token (_count_end).
        self._uncounted: set[str] = set()
        self._uncounted_lock = threading.Lock()
        self._pending_policy: AdmissionPolicy | None = None
        # Async scheduling: the step launched last and not read back yet (see step()).
        self.async_scheduling = config.async_scheduling
        self._inflight: _InFlight | None = None
        self._last_read_back = 0.0
        self._rng = random.Random()
        self._ids = itertools.count()
        self._last = dict(evictions=0)  # pool.num_evictions when _refresh_gauges last saw it
        self.warmup_seconds = 0.0
        self._last_idle_sample = 0.0
        self.compilations_at_ready = 0
        self._log_capacity()
        if warmup:
            self.warmup(progress)

    # --- construction -----------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path: Path, config: "EngineConfig | Callable", **kw: Any) -> "LLMEngine":
        """`config` is an EngineConfig or a callable building one from the ModelConfig."""
        from runtime.checkpoint.store import load_checkpoint

        n = config.tensor_parallel_size if isinstance(config, EngineConfig) else getattr(
            config, "tensor_parallel_size", 1)
        if n == 1:
            model_cfg, params, tok = load_checkpoint(Path(path))
            cfg = config(model_cfg) if callable(config) else config
            return cls(cfg, params, tok, **kw)
        return cls._from_checkpoint_tp(Path(path), config, **kw)

    @classmethod
    def _from_checkpoint_tp(cls, path: Path, config: "EngineConfig | Callable", **kw: Any) -> "LLMEngine":
        """Tensor parallel: validate before reading any weight, then restore each parameter
        straight into its shards (orbax with sharding targets; runtime/model/tp.py)."""
        from runtime.model import tp
        from runtime.checkpoint.store import load_config, load_params, load_tokenizer, read_meta

        model_cfg = load_config(path)
        cfg = config(model_cfg) if callable(config) else config
        stored = read_meta(path)["quantization"]
        tp.validate(cfg.model, cfg.tensor_parallel_size, attention_backend=cfg.attention_backend,
                    quantization=stored if stored != "none" or cfg.quantization == "auto" else cfg.quantization)
        mesh = tp.make_mesh(cfg.tensor_parallel_size)
        n = mesh.size
        params = load_params(path, cfg.model,
                             shardings=lambda tree: tp.param_shardings(cfg.model, tree, mesh, stored=True),
                             check=lambda tree: tp.check_shards(
                                 tree, tp.param_specs(cfg.model, tree, n, stored=True), n))
        return cls(cfg, params, load_tokenizer(path, cfg.model), **kw)

    def _log_capacity(self) -> None:
        c, m = self.config.cache, self.config.model
        per_tok = m.kv_bytes_per_token(c.kv_dtype)
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); %d sequences of 1,000 tokens fit",
                 c.num_blocks, c.block_size, c.num_tokens, self.runner.kv_cache_bytes() / 2**20, c.kv_dtype,
                 c.num_tokens // 1000 if per_tok else 0)

    def warmup(self, progress: bool = True) -> None:
        self.warmup_seconds = self.runner.warmup(progress)
        if self.draft is not None:
            self.warmup_seconds += self.draft.warmup(progress)
        self.compilations_at_ready = compilations()
        log.info("warm-up compiled %d step shapes in %.1f s", len(self.envelope.bucket_pairs()),
                 self.warmup_seconds)

    # --- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                    priority: str = "interactive", cache_salt: str | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None, matcher: Any = None,
                    reservation: disagg.Reservation | None = None, decisions: Sequence[tuple] = (),
                    lora: str | None = None) -> Request:
        """Queue a request. Raises ValueError (bad input) or Overloaded (queue limits).
        A structured output (params.guide) compiles here unless `matcher` is given
        (compile_guide, which callers on an event loop run off it). `reservation`: blocks
        `reserve` pinned for this prompt (disaggregated decode), which it takes over; if
        adding fails the caller still owns them (`release`). `decisions`: (kind, reason, inputs)
        taken about it before it reached this engine (a fleet gateway's), first in its ledger.
        `lora`: the name of a loaded LoRA adapter it runs under (LookupError: none by that name)."""
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        adapter = self._adapter(lora, reservation) if lora is not None else None
        if params.guide is not None and matcher is None:
            matcher = self.compile_guide(params.guide)
        req = Request(request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", [int(t) for t in prompt_ids],
                      params.with_seed(self._rng), priority, cache_salt, matcher=matcher)
        if adapter is not None:
            req.lora_id, req.lora_name = adapter.lora_id, adapter.name
        if not self.config.request_ledger:
            req.ledger = NullLedger()
        for kind, reason, inputs in decisions:
            req.ledger.add(kind, reason, **inputs)
        with self.lock:
            if req.request_id in self._tracked:
                raise ValueError(f"request_id: {req.request_id!r} is already in use")
            pinned = disagg.attach(self, reservation, req) if reservation is not None else ()
            # What a quote would have said (the quote model calibrates on how it turned out).
            try:  # (a self-check never fails a request)
                q = step_model.quote(self, req.token_ids, req.params.max_tokens, req.priority, req.uses_prefix_cache,
                                     cache_salt=cache_salt)
                req.quoted_ttft_s = q.predicted_ttft_s
            except Exception:  # noqa: BLE001
                log.exception("admission quote self-check failed for %s", req.request_id)
            try:
                self.scheduler.add(req, pinned)
            except Overloaded as exc:
                self.metrics.admission_rejections.labels(exc.reason).inc()
                raise
            except ValueError:
                self.metrics.admission_rejections.labels("too_long").inc()
                raise
            self._tracked[req.request_id] = _Tracked(req)
            if adapter is not None:
                adapter.requests += 1
            self.outputs.add(req.request_id, req.prompt_ids, req.params, on_output)
            if reservation is not None:
                disagg.hand_over(reservation)
        return req

    def compile_guide(self, guide: Any) -> Any:
        """A fresh matcher for a structured output (thread-safe; ValueError naming the
        field when it does not compile within the time limit)."""
        return self.guides.compile(guide)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks return to the pool at the next step boundary."""
        self._end_later(request_id, "abort", None)

    def _count_end(self, request_id: str, reason: str) -> None:
        """(output processor) The client-visible end of a request _finish left uncounted."""
        with self._uncounted_lock:
            if request_id not in self._uncounted:
                return
            self._uncounted.discard(request_id)
        self.metrics.request_success.labels(reason).inc()

    def _end_later(self, request_id: str, reason: str, stop_reason: str | None) -> None:
        with self.lock:
            self._ends.append((request_id, reason, stop_reason))

    def ledger(self, request_id: str) -> dict[str, Any] | None:
        """A running, waiting or recently finished request's decision ledger with its state
        (runtime/core/ledger.py), or None when it is unknown (or the ledger is off)."""
        with self.lock:
            t = self._tracked.get(request_id)
            kept = (self._ledger_summary(t.req), t.req.ledger) if t is not None else self._finished_ledgers.get(request_id)
            if kept is None or isinstance(kept[1], NullLedger):
                return None
            return {**kept[0], **kept[1].to_json()}

    @staticmethod
    def _ledger_summary(req: Request) -> dict[str, Any]:
        return {"request_id": req.request_id, "state": req.status.value, "priority": req.priority,
                "prompt_tokens": req.num_prompt_tokens, "output_tokens": req.num_output_tokens,
                "cached_tokens": max(req.num_cached_tokens, 0), "preemptions": req.num_preemptions,
                "finish_reason": req.finish_reason, "swapped": req.swap is not None}

    def quote(self, prompt_ids: Sequence[int], max_tokens: int, priority: str = "interactive",
              uses_prefix_cache: bool = True) -> Quote:
        """Would this request be admitted now, and how soon served (runtime/core/step_model.py)?
        Queues nothing."""
        if priority not in PRIORITY_RANK:
            raise ValueError(f"priority: must be one of {', '.join(PRIORITY_RANK)}, got {priority!r}")
        with self.lock:
            return step_model.quote(self, list(prompt_ids), max_tokens, priority, uses_prefix_cache)

    def retry_after(self) -> float | None:
        """Seconds until the queued prompts are computed at the measured step time (a 429's
        Retry-After), or None before any step was measured."""
        with self.lock:
            s = self.scheduler
            p = self.policy
            step = self.step_model.predict(min(p.max_num_batched_tokens, s.envelope.max_num_batched_tokens))
            if step is None:
                return None
            return -(-s.queued_tokens // max(1, p.max_num_batched_tokens)) * step

    def has_unfinished(self) -> bool:
        """Requests not finished yet, or a launched step not read back."""
        with self.lock:
            return bool(self._tracked) or self._inflight is not None

    # --- live policy -------------------------------------------------------------------------
    @property
    def policy(self) -> AdmissionPolicy:
        with self.lock:
            return self._pending_policy or self._policy

    def update_policy(self, who: str, **changes: Any) -> AdmissionPolicy:
        """Validate and queue a policy change for the next step boundary. On any error
        (ValueError naming the field) the current policy stays."""
        with self.lock:
            old = self._pending_policy or self._policy
            new = old.replace(self.envelope, **changes)
            diff = {k: (getattr(old, k), getattr(new, k)) for k in changes if getattr(old, k) != getattr(new, k)}
            self._pending_policy = new
            log.info("policy change by %s: %s", who, {k: f"{a} -> {b}" for k, (a, b) in diff.items()})
            return new

    def reset_prefix_cache(self) -> int:
        with self.lock:
            return self.pool.reset_prefix_cache()

    # --- disaggregated prefill/decode (runtime/core/disagg.py: reserve, then transfer) -------------
    def reserve(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                cache_salt: str | None = None) -> disagg.Reservation:
        """Decode side: pin the blocks a transferred prompt needs, or raise disagg.NoRoom."""
        return disagg.reserve(self, prompt_ids, params, cache_salt)

    def import_kv(self, reservation: disagg.Reservation, blocks: "disagg.KVBlocks") -> None:
        """Decode side: write transferred blocks into the reservation and cache them."""
        disagg.import_kv(self, reservation, blocks)

    def release(self, reservation: disagg.Reservation) -> None:
        """Decode side: free a reservation that will not be used (idempotent)."""
        disagg.release(self, reservation)

    def export_kv(self, prompt_ids: Sequence[int], skip_blocks: int = 0, *,
                  cache_salt: str | None = None) -> "disagg.KVBlocks":
        """Prefill side: a prefilled prompt's blocks from skip_blocks on, as host arrays."""
        return disagg.export_kv(self, prompt_ids, skip_blocks, cache_salt)

    def _log_tier_event(self, event: tuple) -> None:
        if self.pool.events is not None:
            self.pool.events.append(event)

    # --- the loop body -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One beat: plan and launch step N+1 while step N runs on the device, then read
        step N back (tokens, stops). Without async scheduling N+1 is read at once. Returns
        the text outputs, or [] where the output processor runs on its own thread."""
        outputs: list[RequestOutput] = []
        if self._inflight is not None and (self._inflight.guided or self._inflight.verifies
                                           or self._wants_speculation()):
            # A structured row's next mask needs the token this step samples, a proposal
            # follows it, and a verified row's next position depends on what it kept: read it first.
            done, self._inflight = self._inflight, None
            self._read_back(done, outputs)
        with self.lock:
            self._apply_boundary(outputs)
            self._propose()
            if self.host_tier is not None:  # (runtime/core/kv_tiers.py: up before admission, down before launch)
                kv_tiers.promote(self)
            plan = self.scheduler.schedule()
            if self.host_tier is not None:
                kv_tiers.offload(self)
            if plan.swapped_out or plan.swapped_in:
                kv_tiers.swap(self, plan)
            launched = self._launch(plan, outputs)
            if self.async_scheduling and self.draft is None:  # (the draft mirrors steps with known inputs)
                done, self._inflight = [self._inflight], launched
            else:
                done, self._inflight = [self._inflight, launched], None
            done = [d for d in done if d is not None]
            if not done:
                self._refresh_gauges()
        for d in done:
            self._read_back(d, outputs)
        return self.outputs.push(outputs)

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch the pipeline on or off (benchmarks compare the two); takes effect at the
        next step, which also reads back a step still in flight."""
        with self.lock:
            self.async_scheduling = bool(enabled)

    # --- speculative decoding (runtime/core/speculative.py) -------------------------------------------
    def _wants_speculation(self) -> bool:
        """Whether some running request would propose once the step in flight is read back
        (judged on the tokens known now): then the engine reads it back before planning,
        giving up the overlap for that beat; otherwise it keeps the pipeline."""
        spec = self.config.speculative
        with self.lock:
            running = self.scheduler.running
            if spec is None or len(running) >= spec.disable_by_batch_size:
                return False
            return any(speculative.may_speculate(r, spec, len(running), pending_ok=True)
                       and self.proposer.propose(r, self.envelope.max_model_len) for r in running)

    def _propose(self) -> None:
        spec = self.config.speculative
        if spec is None:
            return
        running = self.scheduler.running
        guided = 0
        for r in running:
            r.spec_token_ids = (self.proposer.propose(r, self.envelope.max_model_len)
                                if speculative.may_speculate(r, spec, len(running)) else [])
            r.spec_masks = None
            if r.matcher is not None and r.spec_token_ids:  # its grammar checks them; a few per step
                if guided >= GUIDED_SPEC_ROWS:
                    r.spec_token_ids = []
                    continue
                guided += 1
                if self.draft is None:  # (a draft's proposals are checked once it has made them: _launch)
                    r.spec_token_ids, r.spec_masks = speculative.guided_proposals(
                        r.matcher, r.spec_token_ids, self.runner.masks.width)

    def _launch(self, plan: SchedulerOutput, outputs: list[RequestOutput]) -> _InFlight | None:
        """Plan -> step rows -> device; the plan's tokens count as computed from here on."""
        if not plan.scheduled:
            return None
        if self.draft is not None:  # the placeholders the scheduler placed become the draft's tokens
            try:
                self.draft.fill([req for req, _ in plan.scheduled if req.spec_token_ids])
            except Exception as exc:  # noqa: BLE001 -- as a failed step: its requests fail, the loop goes on
                self._fail([req for req, _ in plan.scheduled], exc, outputs)
                return None
            for k, (req, n) in enumerate(plan.scheduled):  # a grammar cuts a draft's proposals here
                if req.matcher is not None and req.spec_token_ids:
                    req.spec_token_ids, req.spec_masks = speculative.guided_proposals(
                        req.matcher, req.spec_token_ids, self.runner.masks.width)
                    plan.scheduled[k] = (req, 1 + len(req.spec_token_ids))  # (the blocks of the rest go back
                    # when the step is read: accept_drafts)
            plan.num_batched_tokens = sum(n for _, n in plan.scheduled)
        seqs = [step_row(req, n) for req, n in plan.scheduled]
        num_seqs, num_tokens = self.envelope.bucket_for(len(seqs), plan.num_batched_tokens)
        guided = [(i, req.matcher) for i, (req, _) in enumerate(plan.scheduled)
                  if req.matcher is not None and seqs[i].sample]
        eos = self.tokenizer.eos_token_ids
        banned = [(i, (*eos, *b)) for i, (req, _) in enumerate(plan.scheduled)
                  if seqs[i].sample and (b := req.banned_tokens) is not None]
        try:
            mask = self.runner.masks.build(num_seqs, guided, banned, self.guides.executor)
            handle = self.runner.launch(seqs, num_seqs, num_tokens, token_mask=mask)
            if self.draft is not None:
                self.draft.mirror(seqs, num_seqs, num_tokens)
        except Exception as exc:  # noqa: BLE001 -- one bad step must not kill the loop
            self._fail([req for req, _ in plan.scheduled], exc, outputs)
            return None
        now = time.monotonic()
        rows, prompt_rows, offset = [], [], 0
        for seq, (req, n) in zip(seqs, plan.scheduled):
            if seq.prompt_next:
                prompt_rows.append((req, offset, seq.start_pos, n))
            offset += n
        for req, n in plan.scheduled:
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.metrics.prompt_tokens.inc(min(n, req.num_prompt_tokens - req.num_computed_tokens))
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self.metrics.queue_time.observe(now - req.arrival_time)
            rows.append((req, self.scheduler.commit(req, n)))
        return _InFlight(rows, handle, plan.num_batched_tokens, time.perf_counter(), bool(guided),
                         any(sq.drafts for sq in seqs), prompt_rows)

    def _read_back(self, done: _InFlight, outputs: list[RequestOutput]) -> None:
        """Wait for a launched step (outside the lock: the web thread keeps adding requests),
        then hand each sampled token to its request."""
        try:
            result = done.handle.result()
        except Exception as exc:  # noqa: BLE001 -- the device step failed
            with self.lock:
                later = [req for req, _ in self._inflight.rows] if self._inflight else []
                self._inflight = None  # it was launched from the failed step's state
                self._fail([req for req, _ in done.rows] + later, exc, outputs)
            return
        with self.lock:
            now = time.monotonic()
            new_tokens = 0
            for req, t0, pos, n in done.prompt_rows:
                self._add_prompt_logprobs(req, result, t0, pos, n)
            accepted = result.get("accepted")
            for i, (req, sampled) in enumerate(done.rows):
                if sampled and not req.is_finished:  # (a request aborted or stopped meanwhile drops it)
                    picks: list[Any] = [i]
                    a, d = 0, 0
                    if accepted is not None:  # a verified step: the samples up to the first rejection
                        a, d = int(accepted[i]), len(req.spec_token_ids)
                        self.scheduler.accept_drafts(req, a)
                        picks = [(i, j) for j in range(a + 1)]
                    out, n = self._append_tokens(req, result, picks, now)
                    new_tokens += n
                    if d:  # (the kept proposals the request took: a stop inside the run ends it early)
                        speculative.record(req, d, min(a, n), self.scheduler.counters)
                        self.metrics.count_speculation(self.config.speculative.method, d, min(a, n))
                    if out is not None:
                        outputs.append(out)
            self.metrics.generation_tokens.inc(new_tokens)
            if self.expert_load is not None and "expert_load" in result:
                self.expert_load.add(result["expert_load"])
                self.metrics.count_expert_load(self.expert_load)
            t = time.perf_counter()
            dt = t - max(done.launched_at, self._last_read_back)  # the pipeline's beat
            self.step_model.observe(done.num_tokens, dt)
            if self.swap_space is not None and done.num_tokens >= 64:  # (prefill's cost per token, for the swap rule)
                self.swap_space.observe_prefill(dt, done.num_tokens)
            self._last_read_back = t
            self.metrics.step_time.observe(dt)
            self.metrics.step_tokens.observe(done.num_tokens)
            self._refresh_gauges(dt, done.num_tokens, new_tokens)

    @staticmethod
    def _add_prompt_logprobs(req: Request, result: dict, t0: int, pos: int, n: int) -> None:
        """Positions pos..pos+n-1 of the step predicted prompt tokens pos+1..; a recomputed
        prefill (after preemption) adds nothing twice."""
        k = req.params.prompt_logprobs or 0
        lp, ids, tops = result["prompt_logprobs"], result["prompt_top_ids"], result["prompt_top_logprobs"]
        for j in range(n):
            p = pos + j
            if p + 1 >= req.num_prompt_tokens:
                break
            if p == len(req.prompt_logprobs):  # raw rows: the output processor formats them
                req.prompt_logprobs.append((lp[t0 + j], ids[t0 + j, :k].copy(), tops[t0 + j, :k].copy()))

    def _fail(self, reqs: list[Request], exc: Exception, outputs: list[RequestOutput]) -> None:
        log.error("engine step failed; failing its %d requests: %s", len(reqs), exc, exc_info=exc)
        lost = self.draft is not None and self.draft.recover()
        if self.runner.recover() or lost:  # a donated KV cache is gone: everyone running recomputes
            self.scheduler.preempt_all()
            self.pool.reset_prefix_cache()
        for req in reqs:
            if not req.is_finished:
                outputs.append(self._finish(req, "error", error=f"engine step failed: {exc}"))

    def _apply_boundary(self, outputs: list[RequestOutput]) -> None:
        if self._pending_policy is not None:
            self._policy = self.scheduler.policy = self._pending_policy
            self._pending_policy = None
        ends, self._ends = self._ends, []
        for rid, reason, stop_reason in ends:
            t = self._tracked.get(rid)
            if t is not None and not t.req.is_finished:
                outputs.append(self._finish(t.req, reason, stop_reason=stop_reason))

    def _append_tokens(self, req: Request, result: dict, picks: list[Any], now: float
                       ) -> tuple[RequestOutput | None, int]:
        """Hand a step's tokens for one request to it -- `picks` index the step's arrays, one
        entry, or one per kept position of a verified row -- stopping at the first token that
        ends it. Returns (its output, tokens appended)."""
        new: list[int] = []
        if req.first_token_time is None:
            req.first_token_time = now
            if req.quoted_ttft_s:  # (the quote model's self-check and calibration)
                self.step_model.observe_ttft(req.quoted_ttft_s, now - req.arrival_time)
            self.metrics.ttft.observe(now - req.arrival_time)
            self.metrics.window.ttft.append((now, now - req.arrival_time))
            self.metrics.window.slo.append(SLOSample(now, req.priority, "ttft", now - req.arrival_time))
        else:
            self.metrics.itl.observe(now - req.last_token_time)
            self.metrics.window.itl.append((now, now - req.last_token_time))
            self.metrics.window.slo.append(SLOSample(now, req.priority, "itl", now - req.last_token_time))
        req.last_token_time = now
        p = req.params
        for idx in picks:
            tok = int(result["token_ids"][idx])
            self.scheduler.append_token(req, tok)
            new.append(tok)
            if p.logprobs is not None:  # raw rows (copies: the step's arrays are not kept), formatted off this thread
                k = p.logprobs
                req.logprobs.append((result["logprobs"][idx], result["top_ids"][idx][:k].copy(),
                                     result["top_logprobs"][idx][:k].copy()))
            # The stops a token decides; stop strings are the output processor's.
            if tok in self.tokenizer.eos_token_ids and not p.ignore_eos:
                return self._finish(req, "stop", new_ids=new, text_ids=new[:-1]), len(new)
            if tok in p.stop_token_ids:
                return self._finish(req, "stop", stop_reason=tok, new_ids=new, text_ids=new[:-1]), len(new)
            if req.matcher is not None:
                if not req.matcher.consume_token(tok):
                    return self._finish(req, "error", error=f"structured output rejected token {tok}: "
                                                            f"{req.matcher.get_error()}", new_ids=new,
                                        text_ids=new[:-1]), len(new)
                if req.matcher.is_stopped():  # the grammar is complete: nothing else may follow
                    return self._finish(req, "stop", new_ids=new), len(new)
            # (a token still pending on the device is dropped)
            if req.num_generated >= p.max_tokens or len(req.token_ids) >= self.envelope.max_model_len:
                return self._finish(req, "length", new_ids=new), len(new)
        return self._output(self._tracked[req.request_id], new), len(new)

    def _output(self, t: _Tracked, ids: list[int], **kw: Any) -> RequestOutput:
        req = t.req
        lp = req.logprobs[-len(ids):] if (req.params.logprobs is not None and ids) else []
        plp = None
        if (req.params.prompt_logprobs is not None and not t.prompt_sent
                and len(req.prompt_logprobs) >= req.num_prompt_tokens - 1):
            plp, t.prompt_sent = [None, *req.prompt_logprobs], True
        return RequestOutput(req.request_id, ids, "", prompt_tokens=req.num_prompt_tokens,
                             completion_tokens=req.num_generated, cached_tokens=max(req.num_cached_tokens, 0),
                             logprobs=lp, prompt_logprobs=plp, spec=(req.spec.proposed, req.spec.accepted), **kw)

    def _finish(self, req: Request, reason: str, *, stop_reason: Any = None, error: str | None = None,
                new_ids: list[int] | None = None, text_ids: list[int] | None = None) -> RequestOutput:
        self.scheduler.finish(req, reason)
        if req.lora_id and (reg := self.loras.get(req.lora_name)) is not None and reg.lora_id == req.lora_id:
            reg.tokens += req.num_generated
        req.ledger.add("finished", reason if error is None else f"{reason}: {error}", output_tokens=req.num_output_tokens,
                       preemptions=req.num_preemptions)
        if self.config.request_ledger:  # (its summary and ledger, not the request with its tokens)
            self._finished_ledgers[req.request_id] = kept = (self._ledger_summary(req), req.ledger)
            if self.tracing is not None:
                self.tracing.export(*kept)
            if len(self._finished_ledgers) > FINISHED_KEPT:
                self._finished_ledgers.popitem(last=False)
        if self.proposer is not None:
            self.proposer.finished(req)
        req.finish_time = time.monotonic()
        t = self._tracked.pop(req.request_id)
        if reason == "length" and req.params.stop:
            with self._uncounted_lock:
                self._uncounted.add(req.request_id)
        else:
            self.metrics.request_success.labels(reason).inc()
        self.metrics.e2e.observe(req.finish_time - req.arrival_time)
        req.stop_reason = stop_reason
        return self._output(t, new_ids or [], finished=True, finish_reason=reason,
                            stop_reason=stop_reason, error=error, text_ids=text_ids)

    # --- LoRA adapters ---------------------------------------------------------------------
    def _adapter(self, name: str, reservation: Any) -> Any:
        if self.loras is None:
            raise LookupError(f"model: {name!r} is not served (LoRA adapters are off: start with --enable-lora)")
        if reservation is not None:
            raise ValueError("lora: adapters on disaggregated prefill/decode are not supported yet")
        reg = self.loras.get(name)
        if reg is None:
            raise LookupError(f"model: no adapter named {name!r} is loaded")
        return reg

    def lora_view(self) -> dict[str, Any]:
        """The adapters, their slots, and which adapters running and waiting requests name (the
        console's LoRA card and /metrics; read without the lock, as a scrape)."""
        if self.loras is None:
            return {}
        s = self.scheduler
        running = sorted({r.lora_name for r in list(s.running) if r.lora_name})
        waiting = sorted({r.lora_name for r in s.waiting_requests() if r.lora_name})
        return {**self.loras.snapshot(), "running_adapters": running, "waiting_adapters": waiting}

    def load_lora(self, name: str, path: str) -> Any:
        """Read, check and register an adapter under `name` (runtime/core/lora.py AdapterError: nothing
        changed). Its weights reach a device slot when a request under it starts."""
        if self.loras is None:
            raise AdapterError("lora: LoRA adapters are off (start with --enable-lora or --lora-modules)")
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> Any:
        """Forget an adapter. Refused (AdapterBusy) while requests under it are queued or running: an
        unload loses no request."""
        if self.loras is None:
            raise AdapterError("lora: LoRA adapters are off (start with --enable-lora or --lora-modules)")
        with self.lock:
            reg = self.loras.get(name)
            if reg is None:
                raise LookupError(f"lora_name: no adapter named {name!r} is loaded")
            busy = sum(t.req.lora_id == reg.lora_id for t in self._tracked.values())
            if busy:
                raise AdapterBusy(f"lora_name: {name!r} has {busy} request(s) queued or running; unload it when they end")
            return self.loras.unload(name)

    def _refresh_gauges(self, step_time: float = 0.0, num_tokens: int = 0, new_tokens: int = 0) -> None:
        """Per-step records: the ages of blocks evicted since the last call (a histogram of
        events) and the console's chart sample. The gauges and totals of the scheduler's and
        pool's state are read at scrape time (runtime/core/metrics.py EngineStateCollector)."""
        m, s, pool = self.metrics, self.scheduler, self.pool
        c = s.counters
        new_ev = pool.num_evictions - self._last["evictions"]
        if new_ev:
            for age in list(pool.evicted_ages)[-min(new_ev, len(pool.evicted_ages)):]:
                m.evicted_block_age.observe(age)
            self._last["evictions"] = pool.num_evictions
        now = time.monotonic()
        if not num_tokens and now - self._last_idle_sample < 1.0:
            return  # idle loop iterations: one chart sample a second is enough
        if not num_tokens:
            self._last_idle_sample = now
        m.window.add_step(StepSample(now, step_time, num_tokens, len(s.running), s.num_waiting,
                                     new_tokens, c.prefix_queries, c.prefix_hits, pool.num_evictions,
                                     pool.num_used_blocks, pool.num_cached_blocks))
        if self.host_tier is not None:
            t = self.host_tier
            m.tier_bytes.labels("host").set(t.bytes + t.swapped)
            m.tier_blocks.labels("host").set(len(t.blocks))
            m.tier_hit_blocks.labels("host").set(t.promoted)
        sig = self.eviction(now)
        m.eviction_rate.set(sig.rate or 0.0)
        m.eviction_state.set(EVICTION_STATES.index(sig.state))
        if now - self._last_slo >= 1.0:  # (the windows' shares: once a second is plenty)
            self._last_slo = now
            for w in SLO_WINDOWS:
                for (tier, kind), (met, total) in self.slo_attainment(w, now).items():
                    if total:
                        m.slo_attainment.labels(tier, kind, f"{int(w)}s").set(met / total)
            if self.step_model.ttft_checked:
                m.quote_within.set(self.step_model.ttft_within_30)
            m.quote_calibration.set(math.exp(self.step_model.ttft_log_ratio))

    def slo_attainment(self, window_s: float, now: float | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """(tier, "ttft" | "itl") -> (met, total) over the last window_s seconds, for the targets set."""
        now = time.monotonic() if now is None else now
        return slo_attainment(list(self.metrics.window.slo), self.policy, now, window_s)

    def eviction(self, now: float | None = None) -> "EvictionSignal":
        """The KV eviction signal now (runtime/core/metrics.py eviction_signal), its series
        sampled here too."""
        with self.lock:
            now = time.monotonic() if now is None else now
            pool, c, w = self.pool, self.scheduler.counters, self.config.eviction.window_s
            lost = pool.num_recent_evictions + c.preempted_blocks_lost
            self.metrics.eviction_series.add(now, pool.num_allocated, lost, w)
            return eviction_signal(list(self.metrics.eviction_series.samples), now, pool.num_allocated, lost,
                                   self.config.eviction)

    # --- views -------------------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        with self.lock:
            return take_snapshot(self)

    # --- synchronous helpers (CLI, tests, offline batch) -------------------------------------------
    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 **kw: Any) -> list[Request]:
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.add_request(p, sp, **kw) for p, sp in zip(prompts, plist)]
        self.run_until_done()
        return reqs  # (logprobs stay raw rows: Request.formatted_logprobs() gives the client's form)

    def generate_text(self, prompt_ids: Sequence[int], params: SamplingParams, lora: str | None = None) -> Iterator[str]:
        chunks: list[RequestOutput] = []
        req = self.add_request(prompt_ids, params, on_output=chunks.append, lora=lora)
        while not req.is_finished or chunks:
            if not chunks:
                self.step()
            while chunks:
                out = chunks.pop(0)
                if out.error:
                    raise RuntimeError(out.error)
                if out.text:
                    yield out.text
