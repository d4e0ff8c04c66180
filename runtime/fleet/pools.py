"""Disaggregated prefill/decode at the gateway (`fleet serve --prefill-replicas P
--decode-replicas D`): two pools of the same replica class, sized at start and from the
console's fleet page.

A request goes: reserve its blocks on a decode replica (most free blocks first; while none
has room it waits in the fleet queue, nothing prefilled) -> prefill + export on the prefill
replica its prefix matches -> receive + import + generate on the reserved decode replica,
streamed like a colocated request. A stage that fails frees both sides and the request is
tried once more with a new reservation; then it ends with kv_transfer_failed (503). A
replica found dead on the way is dropped from the routing view at once, so the retry does
not go back to it. Until the import starts, the gateway renews the reservation's lease
(--kv-reservation-lease): a gateway that is gone stops renewing, and the decode replica
frees the blocks within the lease.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from runtime.core.engine import RequestOutput
from runtime.fleet.errors import KV_TRANSFER_FAILED, is_replica_death
from runtime.fleet.policy import Decision, ReplicaStats, RouteRequest
from runtime.model.sampling import SamplingParams
from runtime.core.scheduler import Overloaded

if TYPE_CHECKING:
    from runtime.fleet.gateway import FleetClient

log = logging.getLogger("pagedjax.fleet")

ROLES = ("prefill", "decode")


class _StageFailed(Exception):
    """One stage of a disaggregated request's transfer failed (the message names it)."""


@dataclass
class Pools:
    """The two pools' deployment handles, their sizes, and the transfer counters."""

    handles: dict[str, Any]                       # "prefill" / "decode" -> DeploymentHandle
    sizes: dict[str, int]                         # replicas each pool is deployed with
    max_replicas: int                             # both pools together, at most (--max-replicas)
    resize_fn: Callable[[dict[str, int]], None] | None = None  # redeploys with new sizes (Fleet.resize_pools)
    kv_transfer_retries: int = 0                  # transfers that failed and were tried again
    kv_transfer_failed: int = 0                   # requests failed after the retry
    client: FleetClient | None = field(default=None, repr=False)

    # --- sizes (the console's pool form) -----------------------------------------------------
    def resize(self, sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
        """New pool sizes -> {pool: (old, new)} for what changed. Ray Serve adds or drains
        replicas in place (a decode replica being removed finishes its streams first).
        Raises ValueError naming the field."""
        new = {**self.sizes, **sizes}
        for role in ROLES:
            if not isinstance(new[role], int) or new[role] < 1:
                raise ValueError(f"{role}_replicas: must be a whole number of at least 1")
        if sum(new.values()) > self.max_replicas:
            raise ValueError(f"pools: {new['prefill']} + {new['decode']} replicas is more than the fleet's "
                             f"{self.max_replicas} (start it with a larger --max-replicas)")
        changed = {r: (self.sizes[r], new[r]) for r in ROLES if new[r] != self.sizes[r]}
        if changed:
            if self.resize_fn is None:
                raise ValueError("pools: this fleet cannot be resized")
            self.resize_fn(new)
            self.sizes = new
            log.info("pools resized: %s", ", ".join(f"{r} {a} -> {b}" for r, (a, b) in changed.items()))
        return changed

    def view(self) -> dict[str, Any]:
        return {**self.sizes, "max_replicas": self.max_replicas}

    def live(self, role: str) -> list[ReplicaStats]:
        assert self.client is not None
        return [s for s in self.client.view.live() if s.role == role and not s.draining]

    # --- one request -------------------------------------------------------------------------
    async def _reserve(self, request_id: str, req: RouteRequest, payload: dict[str, Any]) -> dict[str, Any]:
        """A reservation on some decode replica: the one the fleet policy picks (longest
        prefix of the prompt already in its cache, then most free blocks counting what was
        just reserved there, round-robin on ties), then the others by headroom. While none
        has room the request waits in the fleet queue (nothing is prefilled meanwhile)."""
        client = self.client
        assert client is not None
        view = client.view

        async def attempt() -> tuple[dict[str, Any] | None, str]:
            why = []
            live = self.live("decode")
            pending = view.pending()
            d = view.decide(req, {s.replica for s in live}, pending)
            rest = sorted((s for s in live if s.replica != d.replica),
                          key=lambda s: (-(s.headroom_blocks - pending.get(s.replica, (0, 0))[0]), s.replica))
            for name in ([d.replica] if d.replica else []) + [s.replica for s in rest]:
                ans = await self.handles["decode"].reserve.remote({**payload, "replica_hint": name})
                if "invalid" in ans:
                    raise ValueError(ans["invalid"])
                if "reservation_id" in ans:
                    # Counted against that replica until its stats show the request.
                    view.note_routed(request_id, req, d if ans["replica"] == d.replica else
                                     Decision(ans["replica"], "free_blocks", 0, d.skipped))
                    return ans, ""
                why.append(f"{name}: {ans['no_room']}")
            return None, "; ".join(why) or "no decode replica is reporting"

        got, why = await attempt()
        if got is not None:
            return got
        last = [why]

        async def again() -> dict[str, Any] | None:
            got, last[0] = await attempt()
            return got

        return await client._wait_in_queue(req, again, 0.1,
                                           f"no decode replica can reserve the request's blocks ({why})",
                                           lambda: f"no decode replica could reserve the request's blocks ({last[0]})")

    def _pick_prefill(self, request_id: str, req: RouteRequest) -> str | None:
        """The prefill replica by the fleet policy (longest cached prefix, then most free
        blocks); one with no room still takes it (its own queue), most headroom first."""
        assert self.client is not None
        view = self.client.view
        live = self.live("prefill")
        if not live:
            return None
        pre = RouteRequest(req.block_hashes, req.prompt_tokens, 1)  # it computes the prompt and one token
        d = view.decide(pre, {s.replica for s in live})
        if d.replica is None:
            best = max(live, key=lambda s: (s.headroom_blocks, s.replica))
            d = Decision(best.replica, "tie", 0, d.skipped)
        view.note_routed(request_id, pre, d)
        return d.replica

    def _stage_failed(self, what: str, replica: str, exc: BaseException) -> _StageFailed:
        if is_replica_death(exc):
            assert self.client is not None
            self.client.view.mark_dead(replica)  # the retry must not go back to it
        return _StageFailed(f"{what} replica {replica}: {type(exc).__name__}")

    async def asubmit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str,
                      priority: str, cache_salt: str | None, req: RouteRequest) -> tuple[str, asyncio.Queue]:
        client = self.client
        assert client is not None
        base = {"prompt_ids": [int(t) for t in prompt_ids], "params": params, "request_id": request_id,
                "priority": priority, "cache_salt": cache_salt}
        errors: list[str] = []
        for attempt in (1, 2):
            res = await self._reserve(request_id, req, base)  # Overloaded / ValueError: nothing held anywhere
            dec, pre, sent, gen = res["replica"], None, None, None
            keeper = asyncio.ensure_future(self._keep(dec, res))
            try:
                if res["num_transfer"]:
                    pre = self._pick_prefill(f"{request_id}/prefill{attempt}", req)
                    if pre is None:
                        raise _StageFailed("prefill: no prefill replica is reporting")
                    try:
                        out = await self.handles["prefill"].prefill_export.remote(
                            {**base, "request_id": f"{request_id}/prefill{attempt}", "replica_hint": pre,
                             "skip_blocks": res["skip_blocks"]})
                    except Exception as exc:  # noqa: BLE001 -- the replica died or Ray failed the call
                        raise self._stage_failed("prefill on", pre, exc) from None
                    if "error" in out:
                        raise _StageFailed(out["error"])
                    sent = out["handle"]
                keeper.cancel()  # the import takes the reservation over as it starts
                gen = self.handles["decode"].options(stream=True).import_and_generate.remote(
                    {**base, "replica_hint": dec, "reservation_id": res["reservation_id"], "handle": sent})
                try:
                    first = await gen.__anext__()
                except asyncio.CancelledError:
                    gen.cancel()
                    raise
                except Exception as exc:  # noqa: BLE001
                    raise self._stage_failed("import on decode", dec, exc) from None
                res = None  # the decode replica owns (or released) the reservation now
            except _StageFailed as exc:
                self._failed(request_id, attempt, str(exc), errors)
                continue
            finally:
                keeper.cancel()
                if res is not None:  # released on every path that did not hand it over
                    asyncio.ensure_future(_quiet(self.handles["decode"].release.remote(
                        {"replica_hint": dec, "reservation_id": res["reservation_id"]})))
                if sent is not None:
                    asyncio.ensure_future(_quiet(self.handles["prefill"].drop.remote(
                        {"replica_hint": pre, "handle": sent})))
            if first.get("rejected") == "transfer":
                self._failed(request_id, attempt, first["message"], errors)
                continue
            if "rejected" in first:
                if first["rejected"] == "overloaded":
                    raise Overloaded(first.get("reason", "overloaded"), first["message"])
                raise ValueError(first["message"])
            return request_id, client._stream(request_id, dec, first["accepted"], gen)
        self.kv_transfer_failed += 1
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        queue.put_nowait(RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                       error=f"{KV_TRANSFER_FAILED}: the KV transfer failed twice "
                                             f"({' / then: '.join(errors)})"))
        return request_id, queue

    async def _keep(self, replica: str, res: dict[str, Any]) -> None:
        """Renew a reservation's lease on its decode replica until cancelled (handed over or
        released): five times a lease, so two lost renewals in a row do not lose it."""
        while True:
            await asyncio.sleep(res["lease_s"] / 5)
            try:
                if not await self.handles["decode"].renew.remote({"replica_hint": replica,
                                                                   "reservation_id": res["reservation_id"]}):
                    log.warning("reservation %s on %s is gone (its import will fail and be retried)",
                                res["reservation_id"], replica)
                    return
            except Exception as exc:  # noqa: BLE001 -- a dead replica shows in the import stage
                log.warning("renewing reservation %s on %s failed: %s", res["reservation_id"], replica,
                            type(exc).__name__)

    def _failed(self, request_id: str, attempt: int, why: str, errors: list[str]) -> None:
        errors.append(why)
        log.warning("request %s: KV transfer attempt %d failed: %s", request_id, attempt, why)
        if attempt == 1:
            self.kv_transfer_retries += 1

    # --- /metrics ----------------------------------------------------------------------------
    def metric_lines(self, live: list[ReplicaStats]) -> list[str]:
        return [
            "# HELP pagedjax:fleet_replica_role Each replica's pool (disaggregated prefill/decode)",
            "# TYPE pagedjax:fleet_replica_role gauge",
            *(f'pagedjax:fleet_replica_role{{replica="{s.replica}",role="{s.role}"}} 1' for s in live),
            "# HELP pagedjax:fleet_pool_replicas Replicas each pool is deployed with",
            "# TYPE pagedjax:fleet_pool_replicas gauge",
            *(f'pagedjax:fleet_pool_replicas{{pool="{r}"}} {self.sizes[r]}' for r in ROLES),
            "# HELP pagedjax:fleet_kv_transfer_retries KV transfers that failed and were tried again",
            "# TYPE pagedjax:fleet_kv_transfer_retries counter",
            f"pagedjax:fleet_kv_transfer_retries_total {self.kv_transfer_retries}",
            "# HELP pagedjax:fleet_kv_transfer_failed Requests failed because their KV transfer failed twice",
            "# TYPE pagedjax:fleet_kv_transfer_failed counter",
            f"pagedjax:fleet_kv_transfer_failed_total {self.kv_transfer_failed}"]


async def _quiet(ref: Any) -> None:
    try:
        await ref
    except Exception as exc:  # noqa: BLE001 -- the replica is gone; its lease covers the rest
        log.warning("disaggregated clean-up call failed: %s", type(exc).__name__)
