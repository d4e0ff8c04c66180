"""The prefix-aware router as Ray Serve sees it: a `RequestRouter` subclass.

Ray Serve pickles this module *by value* into the process that owns the handle (the
gateway), so it holds no state of its own: every method imports runtime.fleet.router at
call time and so reaches the gateway's one `VIEW` (replica stats, cache residency, the
decision log) that the admission check and the console read too.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import RequestRouter


class PrefixAwareRouter(RequestRouter):
    """Longest cached prefix -> most free blocks -> round-robin on ties, behind the
    capacity check and the imbalance guard (runtime/fleet/policy.py)."""

    def initialize_state(self, imbalance: int = 16, **kwargs: Any) -> None:
        from runtime.fleet import router

        router.VIEW.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list[list]:
        from runtime.fleet import router

        return router.choose(candidate_replicas, pending_request)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        from runtime.fleet import router

        router.VIEW.mark_dead(replica_id.unique_id)
