"""One fleet replica: a Ray Serve deployment that owns one engine and its KV cache.

The gateway calls `generate` through a DeploymentHandle (streaming); the prefix-aware
router (runtime/fleet/router.py) picks the replica from what `record_routing_stats`
reports and from the KV events this replica publishes. A background task pushes, every
`report_s`, the pool's residency events (vLLM's KV-event format), its stats and its
Prometheus text to the fleet hub (runtime/fleet/hub.py), so the gateway can label every
series by replica and the console can show each one.

Nothing here imports jax at module level: the replica pins its CPUs first (two replicas
sharing a small machine each get their own cores), then builds the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections import deque
from typing import Any, AsyncIterator

from runtime.core import capacity
from runtime.fleet.policy import ReplicaStats

log = logging.getLogger("pagedjax.fleet.replica")

HUB_NAME = "pagedjax-fleet-hub"
RECENT_S = 10.0  # how long a taken request id stays in the stats
NAMESPACE = "pagedjax"
# Disaggregated mode: a reservation lives this long past its last renewal. The gateway
# renews it while the prompt waits for and runs its prefill (however long that queue is),
# so one whose gateway is gone (crashed; or restarted against a long-lived Ray cluster)
# frees its blocks within the lease, not after a fixed timer that a slow prefill outlives.
RESERVATION_LEASE_S = 5.0
# A prefill replica drops a sent KV object the gateway never dropped after this long.
SENT_TTL_S = 30.0
TRANSFER_TIMEOUT_S = 10.0
# Test hook: a file holding a number N makes the prefill replica's next N sends fail;
# holding "exit", the replica process dies at its next send (the file is reset to 0 first,
# so its replacement serves); holding "delay S", its next send waits S seconds. tests/fleet/test_fleet_disagg.py plants failures this way.
FAULT_FILE_ENV = "PAGEDJAX_FAULT_KV_SEND_FILE"


def pin_cpus(threads: int, rank: int) -> list[int] | None:
    """Give replica `rank` its own `threads` cores (round-robin over the allowed ones) so
    XLA's pool and the C++ kernels size themselves to them (both read the affinity)."""
    if threads <= 0 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    mine = [cpus[(rank * threads + i) % len(cpus)] for i in range(min(threads, len(cpus)))]
    os.sched_setaffinity(0, set(mine))
    return mine


def _transfer_totals(engine: Any, role: str) -> dict[str, Any]:
    """A disaggregated replica's transfers for the fleet page: prefill replicas count what
    they exported, decode replicas what they imported (receive + import time)."""
    get = engine.metrics.registry.get_sample_value
    direction, stages = ("out", ("export",)) if role == "prefill" else ("in", ("transfer", "import"))
    count = get("pagedjax:kv_transfer_seconds_count", {"stage": stages[-1]}) or 0.0
    secs = sum(get("pagedjax:kv_transfer_seconds_sum", {"stage": st}) or 0.0 for st in stages)
    return {"role": role, "kv_transfers": int(count),
            "kv_transfer_bytes": int(get("pagedjax:kv_transfer_bytes_total", {"direction": direction}) or 0),
            "kv_transfer_ms": 1000.0 * secs / count if count else 0.0,
            "kv_transfer_failures": int(get("pagedjax:kv_transfer_failures_total", {}) or 0)}


def replica_stats(engine: Any, name: str, draining: bool = False, window_s: float = 10.0,
                  node: str = "", recent: tuple[str, ...] = (), role: str = "engine") -> ReplicaStats:
    """The routing view of one engine (caller need not hold the lock). `free_blocks` is what
    a new request could still get: allocatable blocks less what is already promised, i.e.
    the growth reserved for running requests (reserve mode) and what the waiting ones need,
    so the router's capacity check sees what the replica's own admission will see (the
    same rule: runtime/core/capacity.py)."""
    with engine.lock:
        pool, sched, policy = engine.pool, engine.scheduler, engine.policy
        waiting = sched.waiting_requests()
        queued = sum(r.max_total_tokens() for r in waiting)
        promised = capacity.promised_blocks(sched.running, waiting, policy.admission_mode, pool.block_size)
        steps = [s for s in engine.metrics.window.recent(engine.metrics.window.steps, window_s) if s.num_tokens]
        c = sched.counters
        return ReplicaStats(
            replica=name, num_blocks=pool.num_blocks, block_size=pool.block_size,
            free_blocks=pool.num_free_blocks - promised,
            watermark_blocks=capacity.watermark_blocks(policy, pool.num_blocks),
            running=len(sched.running), waiting=len(waiting), max_num_seqs=policy.max_num_seqs,
            admission_mode=policy.admission_mode,
            step_time_s=sum(s.step_time for s in steps) / len(steps) if steps else 0.0,
            tokens_per_step=sum(s.num_tokens for s in steps) / len(steps) if steps else 0.0,
            cached_blocks=pool.num_cached_blocks, used_blocks=pool.num_used_blocks,
            prefix_hit_rate=c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0,
            queued_tokens=queued, time=time.time(), draining=draining, pid=os.getpid(), node=node,
            recent_requests=recent, **(_transfer_totals(engine, role) if role != "engine" else {}),
            loras=tuple((a["name"], a["lora_id"], a["slot"] >= 0, a["path"])
                        for a in (engine.loras.snapshot()["adapters"] if getattr(engine, "loras", None) else ())))


class EngineReplica:
    """The deployment's class (wrapped with `serve.deployment` by runtime/fleet/serve.py)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from ray import serve

        ctx = serve.get_replica_context()
        self.name = ctx.replica_id.unique_id
        import ray

        self.node = ray.get_runtime_context().get_node_id()[:8]
        rank = getattr(getattr(ctx, "rank", None), "local_rank", 0) or 0
        # Disaggregated: "prefill" or "decode" (each its own deployment; the decode pool's
        # ranks start after the prefill pool's, so the two do not pin the same cores).
        self.role = spec.get("role", "engine")
        rank += int(spec.get("rank_offset", 0))
        self.cpus = pin_cpus(int(spec.get("threads", 0)), rank)
        from runtime.jax_setup import quiet_libraries

        quiet_libraries()  # also enables the persistent compilation cache
        from pathlib import Path

        from runtime.core.async_engine import AsyncEngine
        from runtime.core.engine import LLMEngine
        from runtime.core.engine_args import engine_config_from_args, load_lora_modules

        args = argparse.Namespace(**spec["engine_args"])
        t0 = time.monotonic()
        llm = LLMEngine.from_checkpoint(Path(spec["checkpoint"]), engine_config_from_args(args), warmup=False,
                                        progress=False)
        load_lora_modules(llm, args)
        llm.pool.record_events()
        llm.pool.events.append(("cleared",))  # a fresh replica holds nothing: say so first
        if llm.disk_tier is not None:  # (but its disk tier may, from before a restart)
            llm.pool.events.extend(llm.disk_tier.announce())
        if spec.get("warmup", True):
            llm.warmup(progress=False)
        self.llm, self.engine = llm, AsyncEngine(llm)
        self.engine.start()
        self.draining = False
        self.fleet_queue: dict[str, float] = {}
        self.recent: deque[tuple[float, str]] = deque(maxlen=1024)  # (when, request id) taken
        self.report_s = float(spec.get("report_s", 0.2))
        self.metrics_every = max(1, int(1.0 / self.report_s))
        self._hub = None
        self.zmq_pub, self.zmq_seq, self.zmq_endpoint = None, 0, None
        if spec.get("kv_events_endpoint"):
            self._bind_zmq(spec["kv_events_endpoint"], rank, spec.get("kv_events_topic", ""))
        if self.role != "engine":
            from runtime.core.kv_transfer import RayConnector

            self.connector = RayConnector()
            self.reservations: dict[str, tuple[Any, float]] = {}  # id -> (Reservation, expiry)
            self.sent: dict[Any, tuple[Any, float]] = {}          # ObjectRef -> (handle, expiry)
            self.transfer_timeout_s = float(spec.get("transfer_timeout_s", TRANSFER_TIMEOUT_S))
            self.lease_s = float(spec.get("reservation_lease_s", RESERVATION_LEASE_S))
        self._pump = asyncio.get_event_loop().create_task(self._report_loop())
        log.info("replica %s ready on cpus %s in %.1f s", self.name, self.cpus, time.monotonic() - t0)

    def _bind_zmq(self, endpoint: str, rank: int, topic: str) -> None:
        """vLLM's KV-event publisher, for consumers outside the fleet (llm-d's precise prefix
        scorer, ...): a ZMQ PUB socket sending (topic, 8-byte big-endian sequence number,
        KVEventBatch msgpack) per batch; replica `rank` binds the endpoint's port + rank, as
        vLLM offsets it per data-parallel rank."""
        import zmq

        scheme, _, rest = endpoint.rpartition(":")
        self.zmq_endpoint = f"{scheme}:{int(rest) + rank}" if rest.isdigit() else endpoint
        self.zmq_pub = zmq.Context.instance().socket(zmq.PUB)
        self.zmq_pub.setsockopt(zmq.SNDHWM, 100_000)
        self.zmq_pub.bind(self.zmq_endpoint)
        self.zmq_topic = topic.encode()
        log.info("replica %s publishes KV events on %s", self.name, self.zmq_endpoint)

    def _publish_zmq(self, batch: bytes) -> None:
        import zmq

        try:
            self.zmq_pub.send_multipart((self.zmq_topic, self.zmq_seq.to_bytes(8, "big"), batch), flags=zmq.NOBLOCK)
            self.zmq_seq += 1
        except zmq.Again:  # a slow subscriber: PUB drops, as vLLM's does
            pass

    # --- requests ------------------------------------------------------------------------------
    async def generate(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        """First item: {"accepted": replica} or {"rejected": kind, ...} (so the gateway can
        answer 429/400 before its first byte); then lists of RequestOutput."""
        from runtime.core.scheduler import Overloaded

        if self.draining:
            yield {"rejected": "overloaded", "reason": "draining", "message": "replica is draining"}
            return
        try:
            more = {"lora": req["lora"]} if req.get("lora") else {}
            rid, queue = await self.engine.asubmit(req["prompt_ids"], req["params"], request_id=req["request_id"],
                                            priority=req.get("priority", "interactive"),
                                            cache_salt=req.get("cache_salt"), decisions=req.get("decisions", ()),
                                            **more)
        except Overloaded as exc:
            yield {"rejected": "overloaded", "reason": exc.reason, "message": str(exc)}
            return
        except (ValueError, LookupError) as exc:
            yield {"rejected": "invalid", "message": str(exc)}
            return
        async for outs in self._accepted(rid, queue):
            yield outs

    async def _accepted(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[Any]:
        """An admitted request: counted for routing, "accepted" first, then its outputs."""
        self.recent.append((time.monotonic(), rid))
        yield {"accepted": self.name}
        async for outs in self._outputs(rid, queue):
            yield outs

    async def _outputs(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[Any]:
        finished = False
        try:
            while not finished:
                outs = [await queue.get()]
                while not queue.empty():
                    outs.append(queue.get_nowait())
                finished = outs[-1].finished
                yield outs
        finally:  # the gateway cancelled the stream (client gone) or the replica is stopping
            if not finished:
                self.engine.abort(rid)

    async def quote(self, req: dict[str, Any]) -> dict[str, Any]:
        """This replica's admission quote (runtime/core/step_model.py; the gateway pins the call here)."""
        q = await asyncio.to_thread(self.llm.quote, req["prompt_ids"], req["max_tokens"], req.get("priority", "interactive"),
                                    req.get("uses_prefix_cache", True))
        return q.to_json()

    # --- disaggregated prefill/decode (runtime/core/disagg.py: reserve, then transfer) -------------
    # Every call carries {"replica_hint": <this replica>}: the router pins it here (the
    # reservation or the KV object lives on this replica only).
    async def reserve(self, req: dict[str, Any]) -> dict[str, Any]:
        """Decode side: pin the request's blocks -> {"reservation_id", "skip_blocks",
        "num_transfer", "lease_s"}, or {"no_room": why} (nothing changed), or {"invalid": why}.
        The reservation is released unless `renew` is called within every lease_s."""
        import uuid

        from runtime.core.disagg import NoRoom

        if self.draining:
            return {"no_room": f"decode replica {self.name} is draining"}
        try:
            res = await asyncio.to_thread(self.llm.reserve, req["prompt_ids"], req["params"],
                                          cache_salt=req.get("cache_salt"))
        except NoRoom as exc:
            return {"no_room": str(exc)}
        except ValueError as exc:
            return {"invalid": str(exc)}
        rid = uuid.uuid4().hex
        self.reservations[rid] = (res, time.monotonic() + self.lease_s)
        return {"replica": self.name, "reservation_id": rid, "skip_blocks": res.skip_blocks,
                "num_transfer": res.num_transfer, "lease_s": self.lease_s}

    async def renew(self, req: dict[str, Any]) -> bool:
        """Decode side: the gateway still wants this reservation: extend its lease. False:
        unknown (released, expired or imported)."""
        entry = self.reservations.get(req["reservation_id"])
        if entry is not None:
            self.reservations[req["reservation_id"]] = (entry[0], time.monotonic() + self.lease_s)
        return entry is not None

    async def release(self, req: dict[str, Any]) -> bool:
        """Decode side: free a reservation that will not be used (unknown ids: a no-op)."""
        entry = self.reservations.pop(req["reservation_id"], None)
        if entry is not None:
            await asyncio.to_thread(self.llm.release, entry[0])
        return entry is not None

    async def import_and_generate(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        """Decode side: receive the KV (req["handle"]: [RayHandle] or None when nothing
        travels), import it into the reservation, add the request with it and stream as
        `generate` does. A failed transfer releases the reservation and answers
        {"rejected": "transfer", ...} (the gateway retries with a new one)."""
        from runtime.core.kv_transfer import TransferError
        from runtime.core.scheduler import Overloaded

        entry = self.reservations.pop(req["reservation_id"], None)
        if entry is None:
            yield {"rejected": "transfer", "message": f"decode replica {self.name}: reservation expired or unknown"}
            return
        res = entry[0]
        try:
            if req.get("handle"):
                t0 = time.perf_counter()
                blocks = await asyncio.to_thread(self.connector.recv, req["handle"][0], self.transfer_timeout_s)
                self.llm.metrics.kv_transfer_seconds.labels("transfer").observe(time.perf_counter() - t0)
                await asyncio.to_thread(self.llm.import_kv, res, blocks)
            rid, queue = await self.engine.asubmit(req["prompt_ids"], req["params"], request_id=req["request_id"],
                                                   priority=req.get("priority", "interactive"),
                                                   cache_salt=req.get("cache_salt"), reservation=res)
        except TransferError as exc:
            self.llm.metrics.kv_transfer_failures.inc()
            await asyncio.to_thread(self.llm.release, res)
            yield {"rejected": "transfer", "message": f"receive/import on decode replica {self.name}: {exc}"}
            return
        except Overloaded as exc:
            await asyncio.to_thread(self.llm.release, res)
            yield {"rejected": "overloaded", "reason": exc.reason, "message": str(exc)}
            return
        except ValueError as exc:
            await asyncio.to_thread(self.llm.release, res)
            yield {"rejected": "invalid", "message": str(exc)}
            return
        async for outs in self._accepted(rid, queue):
            yield outs

    async def prefill_export(self, req: dict[str, Any]) -> dict[str, Any]:
        """Prefill side: run the prompt (max_tokens=1) through this engine's loop, copy its
        blocks from skip_blocks on out of the prefix cache, send them -> {"handle":
        [RayHandle], "nbytes"} or {"error": why}. The export runs in the output callback,
        on the engine thread right after the step that finished the prompt: no later step
        can have evicted its blocks yet."""
        from runtime.model.sampling import SamplingParams

        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        ids, skip, salt = req["prompt_ids"], int(req["skip_blocks"]), req.get("cache_salt")

        def on_output(out: Any) -> None:  # the engine thread
            if not out.finished:
                return
            try:
                if out.finish_reason == "error":
                    raise RuntimeError(out.error or "the prefill step failed")
                result: Any = self.llm.export_kv(ids, skip, cache_salt=salt)
            except Exception as exc:  # noqa: BLE001 -- answered to the gateway, which retries
                result = exc
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        try:
            pre = self.llm.add_request(ids, params, request_id=req["request_id"], cache_salt=salt,
                                       priority=req.get("priority", "interactive"), on_output=on_output)
        except Exception as exc:  # noqa: BLE001 -- Overloaded / ValueError
            return {"error": f"prefill replica {self.name}: {exc}"}
        self.engine._wake.set()  # (AsyncEngine.submit's wake-up; its own callback is not wanted here)
        self.recent.append((time.monotonic(), pre.request_id))
        try:
            blocks = await done
        except asyncio.CancelledError:
            self.engine.abort(pre.request_id)
            raise
        if isinstance(blocks, Exception):
            return {"error": f"prefill/export on prefill replica {self.name}: {blocks}"}
        try:
            await self._planted_fault()
            handle = await asyncio.to_thread(self.connector.send, req["request_id"], blocks)
        except Exception as exc:  # noqa: BLE001
            return {"error": f"send from prefill replica {self.name}: {exc}"}
        self.sent[handle.ref] = (handle, time.monotonic() + SENT_TTL_S)
        return {"handle": [handle], "nbytes": blocks.nbytes, "replica": self.name}

    async def drop(self, req: dict[str, Any]) -> None:
        """Prefill side: the gateway is done with a sent KV object (imported or failed)."""
        for h in req.get("handle") or ():
            self.sent.pop(h.ref, None)
            self.connector.drop(h)

    async def _planted_fault(self) -> None:
        path = os.environ.get(FAULT_FILE_ENV)
        if not path or not os.path.exists(path):
            return
        with open(path) as f:
            text = f.read().strip()
        if text.startswith("delay "):  # a slow prefill: the next send waits this many seconds
            with open(path, "w") as f:
                f.write("0")
            await asyncio.sleep(float(text.split()[1]))
            return
        if text == "exit":
            with open(path, "w") as f:
                f.write("0")
            log.warning("planted fault (%s): replica %s exits mid-transfer", FAULT_FILE_ENV, self.name)
            os._exit(1)
        n = int(text or 0)
        if n > 0:
            with open(path, "w") as f:
                f.write(str(n - 1))
            from runtime.core.kv_transfer import TransferError

            raise TransferError(f"planted fault ({FAULT_FILE_ENV})")

    def _expire(self) -> None:
        """Reservations whose lease ran out and KV objects never dropped, past their TTL."""
        now = time.monotonic()
        for rid in [r for r, (_, t) in self.reservations.items() if t < now]:
            res, _ = self.reservations.pop(rid)
            log.warning("reservation %s not renewed within its %.1f s lease (its gateway is gone): releasing "
                        "its %d blocks", rid, self.lease_s, len(res.block_ids))
            self.llm.release(res)
        for ref in [r for r, (_, t) in self.sent.items() if t < now]:
            handle, _ = self.sent.pop(ref)
            self.connector.drop(handle)

    # --- what the router, the autoscaler and the hub read -------------------------------------
    def stats(self) -> ReplicaStats:
        cutoff = time.monotonic() - RECENT_S
        while self.recent and self.recent[0][0] < cutoff:
            self.recent.popleft()
        return replica_stats(self.llm, self.name, self.draining, node=self.node,
                             recent=tuple(r for _, r in self.recent), role=self.role)

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats().to_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        s = self.stats()
        return {"running": float(s.running), "waiting": float(s.waiting), "queued_tokens": float(s.queued_tokens),
                "step_time_s": s.step_time_s, "max_num_seqs": float(s.max_num_seqs),
                # the gateway's queue, the same number on every replica (the policy takes the max)
                "fleet_queued": float(self.fleet_queue.get("queued", 0.0)),
                "fleet_queued_tokens": float(self.fleet_queue.get("queued_tokens", 0.0))}

    def check_health(self) -> None:
        if not self.engine.running:
            raise RuntimeError("the engine thread stopped")

    def update_policy(self, who: str, changes: dict[str, Any]) -> dict[str, Any]:
        return self.llm.update_policy(who, **changes).to_json()

    def _hub_handle(self) -> Any:
        if self._hub is None:
            import ray

            try:
                self._hub = ray.get_actor(HUB_NAME, namespace=NAMESPACE)
            except ValueError:
                return None
        return self._hub

    async def _report_loop(self) -> None:
        """Every report_s: the pool's new residency events go out as one KVEventBatch (ZMQ
        at once if enabled; to the hub with the stats, kept in order until it answers)."""
        from runtime.core.kv_events import encode_batch, to_vllm_events

        n, backlog = 0, []  # raw events the hub has not acknowledged yet
        while True:
            try:
                if self.role != "engine":
                    self._expire()
                with self.llm.lock:
                    raw = self.llm.pool.take_events()
                if raw and self.zmq_pub is not None:
                    self._publish_zmq(encode_batch(to_vllm_events(raw, self.llm.pool.block_size)))
                backlog += raw
                hub = self._hub_handle()
                if hub is not None:
                    batch = encode_batch(to_vllm_events(backlog, self.llm.pool.block_size)) if backlog else None
                    metrics = self.llm.metrics.render() if n % self.metrics_every == 0 else None
                    commands, self.fleet_queue = await hub.report.remote(self.name, self.stats().to_dict(), batch,
                                                                         metrics)
                    backlog = []
                    n += 1
                    for who, changes in commands or ():
                        try:
                            self.llm.update_policy(who, **changes)
                        except ValueError as exc:
                            log.warning("policy change from %s refused: %s", who, exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 -- the hub restarting must not stop serving
                log.exception("report to the fleet hub failed")
            await asyncio.sleep(self.report_s)

    async def __del__(self) -> None:
        """Ray Serve calls this after the graceful-shutdown wait (no request left, or the
        timeout): stop the engine, aborting what is left."""
        self.draining = True
        self._pump.cancel()
        await asyncio.to_thread(self.engine.stop, 0.0)
