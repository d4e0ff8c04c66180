"""`/admin/snapshot.json`: the engine's read model (runtime/core/snapshot.py) as JSON, for tools
and for a fleet page aggregating replicas. Mounted in admin_router (console/admin.py), so
the same login and session rules apply.

Kept out of console/admin.py so that module can import JSON_ROUTES without a cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from litestar import Request, Response, get

from runtime.core import snapshot as read

NO_STORE = {"Cache-Control": "no-store"}
# state code -> the first letter of its name (the block map's CSS classes use the same)
_LETTERS = bytes.maketrans(bytes(range(len(read.BLOCK_STATES))), "".join(s[0] for s in read.BLOCK_STATES).encode())


def snapshot_json_body(engine: Any, blocks: bool = False, prefixes: int = 10) -> dict[str, Any]:
    """The read model without per-block records (those grow with the cache): counts,
    requests, policy, prefix counters and chains; `blocks` adds one letter per block
    (f/c/u/s, the first letter of its state) -- ~50 kB for a 50k-block cache."""
    snap = read.take_snapshot(engine, with_blocks=False)
    body = dataclasses.asdict(snap)
    del body["blocks"]
    body["hit_rate"] = snap.hit_rate
    body["evicted_age_mean"] = snap.evicted_age_mean
    body["prefixes"] = [{"first_block": c[0].block_id, "hits": c[0].hits, "blocks": len(c),
                         "tokens": sum(len(b.token_ids) for b in c), "in_use": any(b.ref_count > 0 for b in c)}
                        for c in read.prefix_chains(read.hashed_blocks(engine), prefixes)]
    if blocks:
        codes = read.block_states(engine)
        body["block_map"] = codes.translate(_LETTERS).decode()
        body["block_counts"] = {s: codes.count(i) for i, s in enumerate(read.BLOCK_STATES)}
    return body


@get("/snapshot.json", name="admin_snapshot_json", sync_to_thread=True)
def snapshot_json(request: Request, blocks: bool = False) -> Response:
    ae = request.app.state.get("engine")
    engine = getattr(ae, "engine", ae)
    if engine is None:
        return Response({"detail": "engine not ready"}, status_code=503)
    return Response(snapshot_json_body(engine, blocks), headers=NO_STORE)


JSON_ROUTES = [snapshot_json]
