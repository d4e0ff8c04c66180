"""How the fleet names and recognises its failures: the error codes a fleet request ends with
(the API layer maps them to 503s with Retry-After) and the Ray exceptions that mean a
replica is gone. Ray is imported only when an exception is examined, so the API layer can
read the codes without it."""

from __future__ import annotations

REPLICA_FAILED = "replica_failed"          # the replica serving a stream died mid-stream
KV_TRANSFER_FAILED = "kv_transfer_failed"  # a disaggregated request's KV transfer failed twice


def is_replica_death(exc: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(exc, (rex.RayActorError, rex.ActorDiedError, rex.ActorUnavailableError))
