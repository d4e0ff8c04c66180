"""The fleet's failure codes: which Ray exceptions mean a replica is gone, and how a fleet
request's error becomes the API's 503 (the code and Retry-After a client retries on)."""

from __future__ import annotations

import asyncio

import pytest

from console.api import Job, _failure
from runtime.fleet.errors import KV_TRANSFER_FAILED, REPLICA_FAILED, is_replica_death


def test_only_actor_deaths_count_as_replica_death():
    rex = pytest.importorskip("ray.exceptions")
    assert is_replica_death(rex.ActorDiedError())
    assert is_replica_death(rex.ActorUnavailableError("gone", None))
    assert not is_replica_death(rex.RayTaskError("f", "tb", ValueError("bad input")))
    assert not is_replica_death(TimeoutError())


@pytest.mark.parametrize("error, code, says", [
    (f"{REPLICA_FAILED}: replica r1: ActorDiedError", REPLICA_FAILED, "retry the request"),
    (f"{KV_TRANSFER_FAILED}: the KV transfer failed twice (prefill on r2: ...)", KV_TRANSFER_FAILED,
     "prefill on r2"),
])
def test_fleet_errors_become_503_with_retry_after(error, code, says):
    job = Job(0, 0, "req", asyncio.Queue(), [1], finished=True, finish_reason="error", error=error)
    e = _failure(job)
    assert (e.status_code, e.code, e.headers) == (503, code, {"Retry-After": "1"})
    assert says in e.message
