"""The fleet's gateway side: the same interface the web layer uses for one engine
(`asubmit`, `abort`, model facts, metrics), backed by N Ray Serve replicas.

A request is tokenized once (by the web layer) and hashed here with the engine's own
chained block hash; the fleet admission check asks `VIEW.decide` whether any replica
can hold it. If none can, it waits in the fleet queue (bounded: 429 with Retry-After
beyond `queue_cap`, or after `queue_timeout_s`). Then the DeploymentHandle sends it,
and Ray Serve asks our router (runtime/fleet/router.py) which replica takes it. The
first item of the stream says accepted or rejected, so 400/429 are real HTTP statuses.
A replica dying mid-stream ends its streams with an error output; a request it had
not accepted yet is sent again (Ray routes around the dead replica).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from runtime.core.block_pool import hash_prompt_blocks
from runtime.core.engine import RequestOutput
from runtime.fleet.policy import ReplicaStats, RouteRequest
from runtime.fleet.errors import REPLICA_FAILED, is_replica_death
from runtime.fleet.pools import Pools
from runtime.fleet.router import VIEW, FleetView, RoutingRecord
from runtime.model.sampling import SamplingParams
from runtime.core.scheduler import Overloaded

log = logging.getLogger("pagedjax.fleet")



def relabel_metrics(texts: dict[str, bytes]) -> bytes:
    """Merge replicas' Prometheus texts into one exposition, every sample labelled
    replica="<id>" (families merged, so each family appears once)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text.decode()):
            # The text format names a counter's family after its `_total` sample; the
            # optional `_created` timestamps are left out.
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            doc, typ, lines = families.setdefault(name, (fam.documentation, fam.type, []))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = {"replica": replica, **s.labels}
                body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{body}}} {_num(s.value)}")
    out = []
    for name, (doc, typ, lines) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {typ}", *lines]
    return ("\n".join(out) + "\n").encode() if out else b""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return repr(float(v)) if v == v and v not in (float("inf"), float("-inf")) else (
        "NaN" if v != v else ("+Inf" if v > 0 else "-Inf"))


@dataclass(frozen=True)
class FleetSnapshot:
    """What the fleet console reads (one model, no Ray objects)."""

    time: float
    replicas: list[ReplicaStats]
    resident_blocks: dict[str, int]        # blocks the router believes each replica caches
    in_flight: dict[str, tuple[int, int]]  # (blocks, requests) routed that its stats do not show yet
    decisions: list[RoutingRecord]         # newest first
    reasons: dict[str, int]
    scale_history: list[dict[str, Any]]    # newest first
    queued: int
    queue_cap: int
    rejected: int
    policy: dict[str, Any]
    autoscale: dict[str, Any] | None       # knobs, or None when the replica count is fixed
    pools: dict[str, Any] | None = None    # disaggregated: {prefill, decode, max_replicas} as deployed


class FleetClient:
    def __init__(self, handle: Any, hub: Any, tokenizer: Any, vocab_size: int, max_model_len: int,
                 context_limit: int, block_size: int, *, queue_cap: int = 256, queue_timeout_s: float = 30.0,
                 pull_s: float = 0.1, view: FleetView = VIEW, policy: Any = None, envelope: Any = None,
                 autoscale: dict[str, Any] | None = None,
                 rescale: Callable[[dict[str, Any]], None] | None = None, route_at_gateway: bool = True,
                 pools: Pools | None = None) -> None:
        self.handle, self.hub, self.view = handle, hub, view
        # Disaggregated prefill/decode: the two pools (else None: colocated, every request
        # goes through `handle`).
        self.pools = pools
        if pools is not None:
            pools.client = self
        self.policy, self.envelope = policy, envelope  # the fleet-wide admission policy (console form)
        self.autoscale, self._rescale = autoscale, rescale
        # False with Ray's default router (benchmark baseline): no routing or fleet
        # admission here, Ray picks the replica.
        self.route_at_gateway = route_at_gateway
        self._replica_policy: dict[str, Any] = {}  # per-replica overrides (else the fleet policy)
        self._initial_policy = policy               # what a new replica starts with (the CLI flags)
        self._known: set[str] = set()
        self.lock = threading.RLock()
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_model_len, self.context_limit, self.block_size = max_model_len, context_limit, block_size
        self.queue_cap, self.queue_timeout_s, self.pull_s = queue_cap, queue_timeout_s, pull_s
        self.accepting = True
        self.queued = 0                     # requests waiting in the fleet queue (no replica had room)
        self.queued_tokens = 0              # their prompt + max_tokens
        self.rejected = 0
        self._streams: dict[str, tuple[Any, asyncio.Task]] = {}
        self._metrics: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.scale_history: list[dict[str, Any]] = []

    # --- lifecycle (the app's lifespan calls these) ----------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._pump, name="pagedjax-fleet-pump", daemon=True)
            self._thread.start()

    def _pump(self) -> None:
        """Pull the hub: KV events and stats every `pull_s`, metrics and the autoscaler's log
        every second."""
        import ray

        last_slow = 0.0
        while not self._stop.is_set():
            try:
                queue = {"queued": float(self.queued), "queued_tokens": float(self.queued_tokens)}
                self.view.apply_pull(ray.get(self.hub.pull.remote(self.view.seq, queue), timeout=10))
                self._catch_up_new_replicas()
                if time.monotonic() - last_slow > 1.0:
                    last_slow = time.monotonic()
                    self._metrics = ray.get(self.hub.replica_metrics.remote(), timeout=10)
                    self.scale_history = ray.get(self.hub.scale_history.remote(), timeout=10)
            except Exception as exc:  # noqa: BLE001 -- the hub restarting must not kill the gateway
                log.warning("fleet hub pull failed: %s", exc)
                self._stop.wait(1.0)
            self._stop.wait(self.pull_s)

    def _catch_up_new_replicas(self) -> None:
        """A replica Ray started later (scale-out, a replacement) starts from the CLI flags:
        give it the fleet-wide policy changes made since."""
        new = [s.replica for s in self.view.live() if s.replica not in self._known]
        if not new:
            return
        self._known.update(new)
        if self.policy is None or self._initial_policy is None:
            return
        with self.lock:
            diff = {k: v for k, v in self.policy.to_json().items() if self._initial_policy.to_json().get(k) != v}
        for r in new:
            if diff:
                self.hub.command.remote(r, "fleet policy (new replica)", diff)
                log.info("replica %s joined: applying the fleet policy changes %s", r, diff)

    def wait_for_replicas(self, n: int, timeout_s: float) -> bool:
        """Until n replicas have reported (routing needs their stats and residency)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.view.live()) >= n:
                return True
            time.sleep(0.1)
        return False

    def stop(self, grace_s: float = 0.0) -> None:
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        self._stop.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def has_unfinished(self) -> bool:
        return bool(self._streams)

    # --- requests ------------------------------------------------------------------------------
    def route_request(self, prompt_ids: Sequence[int], params: SamplingParams, cache_salt: str | None,
                      lora: str | None = None) -> RouteRequest:
        """Hashed as the replicas hash it (runtime/core/request.py Request.extra_keys: the salt, then
        the adapter's id, which every replica loading the same files gives it)."""
        lora_id = self.lora_id(lora) if lora is not None else 0
        extra = ((cache_salt,) if cache_salt else ()) + ((("lora", lora_id),) if lora_id else ())
        hashes = hash_prompt_blocks(prompt_ids, self.block_size, extra)
        usable = (len(prompt_ids) - 1) // self.block_size  # the engine recomputes the last token
        return RouteRequest(tuple(hashes[:usable]), len(prompt_ids), params.max_tokens, lora)

    # --- LoRA adapters: what the replicas serve (their --lora-modules) -------------------------
    def _loras(self) -> dict[str, tuple[str, int, bool, str]]:
        out: dict[str, tuple[str, int, bool, str]] = {}
        for s in self.view.live():
            for a in s.loras:
                out.setdefault(a[0], a)
        return out

    def lora_id(self, name: str) -> int:
        a = self._loras().get(name)
        return a[1] if a else 0

    def has_lora(self, name: str) -> bool:
        return name in self._loras()

    def lora_adapters(self) -> list[dict[str, Any]]:
        """For /v1/models: each adapter some live replica serves."""
        return [{"name": n, "lora_id": a[1], "path": a[3], "loaded_at": 0} for n, a in sorted(self._loras().items())]

    async def quote(self, prompt_ids: Sequence[int], max_tokens: int, priority: str = "interactive",
                    uses_prefix_cache: bool = True) -> dict[str, Any]:
        """The admission quote in front of the fleet: the replica the router would choose now
        (nothing reserved) answers it (runtime/core/step_model.py) under `replica`; when no
        replica can take the request, the fleet queue's answer (admitted to wait, or full)."""
        from runtime.model.sampling import SamplingParams

        req = self.route_request(prompt_ids, SamplingParams(max_tokens=max_tokens), None)
        d = self.view.decide(req) if self.route_at_gateway and self.view.live() else None
        if d is None or d.replica is None or self.pools is not None:
            full = self.queued >= self.queue_cap or not self.accepting
            why = ("the fleet is draining" if not self.accepting else "the fleet queue is full" if full
                   else "waits in the fleet queue: " + (d.describe() if d is not None else "no replica reported yet"))
            if self.pools is not None and not full:
                why = "disaggregated prefill/decode: no per-replica quote yet"
            return {"admit": not full, "reason": why, "predicted_ttft_s": None, "predicted_itl_s": None,
                    "retry_after_s": None, "queue_ahead": self.queued, "tokens_ahead": None,
                    "prefix_hit_tokens": None, "ttft_bias": None, "replica": None}
        ans = await self.handle.quote.remote({"prompt_ids": [int(t) for t in prompt_ids], "max_tokens": max_tokens,
                                              "priority": priority, "uses_prefix_cache": uses_prefix_cache,
                                              "replica_hint": d.replica})
        return {**ans, "replica": d.replica, "routing": d.describe()}

    def _try_route(self, request_id: str, req: RouteRequest) -> Any:
        """Decide and reserve in one go (no await between): concurrent admissions each see
        the blocks the previous ones took."""
        d = self.view.decide(req)
        if d.replica is not None:
            self.view.note_routed(request_id, req, d)
        return d

    async def _admit(self, request_id: str, req: RouteRequest, ledger: list | None = None) -> str | None:
        """The replica the request goes to, once some replica can hold it (the fleet queue);
        None when no replica has reported yet (their own queues decide). `ledger` gets the
        gateway's decisions for the request's ledger (runtime/core/ledger.py)."""
        ledger = [] if ledger is None else ledger
        if not self.route_at_gateway or not self.view.live():
            ledger.append(("routed", "no replica has reported yet: Ray Serve's router chooses", {}))
            return None
        t0 = time.monotonic()
        d = self._try_route(request_id, req)
        if d.replica is None:
            ledger.append(("waiting", f"in the fleet queue: {d.describe()}", {"fleet_queue": self.queued}))
            last: list = [d]

            async def again() -> str | None:
                last[0] = self._try_route(request_id, req)
                return last[0].replica

            await self._wait_in_queue(req, again, 0.05, f"no replica can hold the request ({d.describe()})",
                                      lambda: "no replica could hold the request")
            d = last[0]
        ledger.append(("routed", f"to {d.replica}: {d.describe()}",
                       {"matched_blocks": d.matched_blocks, "candidates_skipped": dict(d.skipped),
                        "fleet_queue_s": round(time.monotonic() - t0, 4)}))
        return d.replica

    async def _wait_in_queue(self, req: RouteRequest, again: Any, every_s: float, why_now: str,
                             why_later: Any) -> Any:
        """The fleet queue: count the request in, call `again()` every `every_s` until it
        gives a result, the fleet drains, or the queue timeout passes (then 429). A full
        queue refuses at once. Colocated routing and disaggregated reservations both wait here."""
        if self.queued >= self.queue_cap:
            self.rejected += 1
            raise Overloaded("fleet_full", f"{why_now} and the fleet queue is full ({self.queued} waiting)")
        self.queued += 1
        self.queued_tokens += req.prompt_tokens + req.max_tokens
        try:
            deadline = time.monotonic() + self.queue_timeout_s
            while time.monotonic() < deadline:
                await asyncio.sleep(every_s)
                if not self.accepting:
                    raise Overloaded("draining", "the fleet is draining")
                got = await again()
                if got is not None:
                    return got
            self.rejected += 1
            raise Overloaded("fleet_full", f"{why_later()} within {self.queue_timeout_s:.0f} s")
        finally:
            self.queued -= 1
            self.queued_tokens -= req.prompt_tokens + req.max_tokens

    async def asubmit(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str,
                      priority: str = "interactive", cache_salt: str | None = None,
                      decisions: Sequence[tuple] = (), lora: str | None = None) -> tuple[str, asyncio.Queue]:
        """`decisions`: taken before it came here (the API key's), for the request's ledger on the
        replica, ahead of the gateway's own (its routing)."""
        if not self.accepting:
            raise Overloaded("draining", "the fleet is draining")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        req = self.route_request(prompt_ids, params, cache_salt, lora)
        if self.pools is not None:  # disaggregated prefill/decode (runtime/fleet/pools.py)
            if lora is not None:
                raise ValueError("lora: adapters on disaggregated prefill/decode are not supported yet")
            return await self.pools.asubmit(prompt_ids, params, request_id, priority, cache_salt, req)
        decisions = list(decisions)
        hint = await self._admit(request_id, req, decisions)
        payload = {"prompt_ids": [int(t) for t in prompt_ids], "params": params, "request_id": request_id,
                   "priority": priority, "cache_salt": cache_salt, "replica_hint": hint, "decisions": decisions,
                   "lora": lora,
                   "route": {"block_hashes": list(req.block_hashes), "prompt_tokens": req.prompt_tokens,
                             "max_tokens": req.max_tokens}}
        for attempt in range(3):
            gen = self.handle.options(stream=True).generate.remote(payload)
            try:
                first = await gen.__anext__()
                break
            except asyncio.CancelledError:  # the client went away before the replica answered
                gen.cancel()
                self.view.unroute(hint, request_id)
                raise
            except StopAsyncIteration:
                raise RuntimeError("the replica closed the stream before accepting") from None
            except Exception as exc:  # noqa: BLE001
                if attempt < 2 and is_replica_death(exc):
                    log.warning("request %s: replica died before accepting it; sending it again", request_id)
                    if hint is not None:
                        self.view.mark_dead(hint)
                    payload["replica_hint"] = None  # let the router choose among the living
                    continue
                raise
        if "rejected" in first:
            self.view.unroute(hint, request_id)
            if first["rejected"] == "overloaded":
                raise Overloaded(first.get("reason", "overloaded"), first["message"])
            raise ValueError(first["message"])
        return request_id, self._stream(request_id, hint, first["accepted"], gen)

    def _stream(self, request_id: str, hint: str | None, replica: str, gen: Any) -> asyncio.Queue:
        """The accepted stream's outputs, forwarded into the queue the web layer reads."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        task = asyncio.ensure_future(self._forward(request_id, replica, gen, queue))
        self._streams[request_id] = (gen, task)
        return queue

    async def _forward(self, rid: str, replica: str, gen: Any, queue: asyncio.Queue) -> None:
        finished = False
        try:
            async for outs in gen:
                for out in outs:
                    queue.put_nowait(out)
                    finished = finished or out.finished
            if not finished:
                raise RuntimeError("the stream ended without a finished output")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- becomes the stream's error event
            if is_replica_death(exc):
                self.view.mark_dead(replica)
            log.error("request %s: replica %s failed mid-stream: %s", rid, replica, type(exc).__name__)
            queue.put_nowait(RequestOutput(rid, [], "", finished=True, finish_reason="error",
                                           error=f"{REPLICA_FAILED}: replica {replica}: {type(exc).__name__}"))
        finally:
            self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            gen, task = entry
            gen.cancel()   # cancels the replica's generator, which aborts the engine request
            task.cancel()

    # --- operator actions --------------------------------------------------------------------------
    def apply_policy(self, who: str, changes: dict[str, Any], replica: str | None = None) -> None:
        """Validate against the envelope, then queue the change for one replica or all (each
        applies it at its next step boundary). Raises ValueError naming the field."""
        import ray

        live = [s.replica for s in self.view.live()]
        if replica is not None and replica not in live:
            raise ValueError(f"replica: unknown replica {replica!r}")
        targets = [replica] if replica else live
        new = {r: self.policy_for(r).replace(self.envelope, **changes) for r in targets}
        fleet_new = self.policy.replace(self.envelope, **changes) if replica is None else None
        for r in targets:
            ray.get(self.hub.command.remote(r, who, changes), timeout=10)
        with self.lock:
            self._replica_policy.update(new)
            if fleet_new is not None:
                self.policy = fleet_new
        log.info("policy change by %s for %s: %s", who, replica or "all replicas", changes)

    def policy_for(self, replica: str | None) -> Any:
        """A replica's admission policy as the gateway last set it (the fleet's by default)."""
        with self.lock:
            return self._replica_policy.get(replica or "", self.policy)

    def update_autoscale(self, knobs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Validate and apply new autoscaler knobs (Ray Serve updates the deployment in place)
        -> {knob: (old, new)} for what changed (the console audit-logs it)."""
        from runtime.fleet.policy import ScaleKnobs

        if self.autoscale is None or self._rescale is None:
            raise ValueError("autoscale: this fleet runs a fixed replica count (start it with --max-replicas)")
        merged = {**self.autoscale, **knobs}
        ScaleKnobs(**merged).validate()
        self._rescale(merged)
        with self.lock:
            old, self.autoscale = self.autoscale, merged
        return {k: (old.get(k), v) for k, v in knobs.items() if old.get(k) != v}

    def update_pools(self, sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Disaggregated: new pool sizes (runtime/fleet/pools.py) -> {pool: (old, new)}."""
        if self.pools is None:
            raise ValueError("pools: this fleet is colocated (start it with --prefill-replicas/--decode-replicas)")
        with self.lock:
            return self.pools.resize(sizes)

    # --- views -----------------------------------------------------------------------------------
    def snapshot(self) -> FleetSnapshot:
        live = self.view.live()
        with self.lock:
            policy = self.policy.to_json() if self.policy is not None else {}
            auto = dict(self.autoscale) if self.autoscale else None
        return FleetSnapshot(time.time(), live, {s.replica: self.view.residency.num_blocks(s.replica) for s in live},
                             self.view.pending(),
                             list(reversed(self.view.decisions)), dict(self.view.reasons),
                             list(reversed(self.scale_history)), self.queued, self.queue_cap, self.rejected,
                             policy, auto, self.pools.view() if self.pools is not None else None)

    def replica_metrics(self, replica: str) -> bytes | None:
        """One replica's own exposition (no replica label), or None if it is not reporting."""
        live = {s.replica for s in self.view.live()}
        return self._metrics.get(replica) if replica in live else None

    def render_metrics(self) -> bytes:
        """Every replica's series labelled by replica, then the gateway's own."""
        live = self.view.live()
        lines = [
            "# HELP pagedjax:fleet_replicas Replicas reporting to the gateway",
            "# TYPE pagedjax:fleet_replicas gauge", f"pagedjax:fleet_replicas {len(live)}",
            "# HELP pagedjax:fleet_queue_len Requests waiting in the fleet queue (no replica had room)",
            "# TYPE pagedjax:fleet_queue_len gauge", f"pagedjax:fleet_queue_len {self.queued}",
            "# HELP pagedjax:fleet_rejections Requests refused with 429 by the fleet admission check",
            "# TYPE pagedjax:fleet_rejections counter", f"pagedjax:fleet_rejections_total {self.rejected}",
            "# HELP pagedjax:fleet_routing_decisions Routing decisions by reason",
            "# TYPE pagedjax:fleet_routing_decisions counter",
            *(f'pagedjax:fleet_routing_decisions_total{{reason="{r}"}} {n}'
              for r, n in sorted(self.view.reasons.items())),
        ]
        if self.pools is not None:
            lines += self.pools.metric_lines(live)
        return relabel_metrics(self._metrics) + ("\n".join(lines) + "\n").encode()
