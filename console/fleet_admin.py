"""The operator console of `pagedjax fleet serve`: one fleet page under /admin.

Reads come from `FleetClient.snapshot()` (runtime/fleet/gateway.py) and the state file's
audit log; writes go only through `FleetClient.apply_policy` (admission policy, fleet-wide
or one replica), `FleetClient.update_autoscale` (the autoscaler's knobs) and
`FleetClient.update_pools` (disaggregated pool sizes), each audit-logged in the state file.
Same login, session and CSRF rules as the single-engine console (console/auth.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

from litestar import Request, Response, Router, get, post
from litestar.response import Redirect, Template

from console.admin import NO_STORE, POLICY_FIELDS, parse_number, parse_policy_form
from console.admin_state import STATE_ROUTES
from console.auth import AdminAuth, is_htmx, login, login_form, logout
from console.render import csrf_token

AUTOSCALE_FIELDS: list[tuple[str, str, type, str]] = [
    ("min_replicas", "Min replicas", int, "Never scale in below this."),
    ("max_replicas", "Max replicas", int, "Never scale out above this."),
    ("target_utilization", "Target utilization", float,
     "Fraction of each replica's max running sequences the fleet plans to fill; more demand scales out."),
    ("horizon_s", "Horizon (s)", float,
     "A new replica's start-up time: scale out when the queue would not clear within it."),
    ("scale_in_delay_s", "Scale-in delay (s)", float, "Demand must stay low this long before one replica stops."),
]
POOL_FIELDS: list[tuple[str, str, str]] = [
    ("prefill", "Prefill replicas", "Run prompts and ship their KV: more of them for long prompts or a tighter TTFT."),
    ("decode", "Decode replicas", "Reserve blocks, receive the KV and generate: more of them for more streams."),
]
RECENT_CHANGES = 20  # fleet changes on the page; /admin/audit has the whole history
FLEET_ACTIONS = ("policy", "autoscaler", "pools")


def _client(request: Request) -> Any:
    return request.app.state.get("engine")


def _render(request: Request, ctx: dict[str, Any], status: int = 200) -> Template:
    s = request.state.admin_session
    name = "admin/_fleet_fragment.html" if is_htmx(request) else "admin/fleet.html"
    ctx = {**ctx, "csrf": csrf_token(request), "who": s.who, "role": s.role, "can_write": s.can_write, "page": "fleet",
           "fleet": True, "clock": time.strftime("%H:%M:%S")}
    return Template(name, context=ctx, status_code=status, headers=NO_STORE)


def recent_changes(store: Any) -> list[Any]:
    """The fleet's last policy, autoscaler and pool changes, newest first (the state file)."""
    return store.audit(limit=RECENT_CHANGES, action=FLEET_ACTIONS)


def fleet_ctx(request: Request, **extra: Any) -> dict[str, Any]:
    client = _client(request)
    snap = client.snapshot()
    rows = []
    for st in snap.replicas:
        used = st.used_blocks
        rows.append({"s": st, "used": used, "cached": st.cached_blocks,
                     "used_pct": used / st.num_blocks if st.num_blocks else 0.0,
                     "cached_pct": st.cached_blocks / st.num_blocks if st.num_blocks else 0.0,
                     "resident": snap.resident_blocks.get(st.replica, 0)})
    when = lambda t: time.strftime("%H:%M:%S", time.localtime(t))  # noqa: E731
    # Disaggregated prefill/decode: each replica's pool and its KV transfers in the table.
    disagg = any(st.role != "engine" for st in snap.replicas)
    return {"snap": snap, "rows": rows, "when": when, "disagg": disagg, "policy_fields": POLICY_FIELDS,
            "autoscale_fields": AUTOSCALE_FIELDS, "pool_fields": POOL_FIELDS,
            "changes": recent_changes(request.app.state.store), "errors": {}, "values": {}, "saved": None, **extra}


@get("/", name="fleet_dashboard", sync_to_thread=True)
def fleet_page(request: Request, saved: str | None = None) -> Template:
    return _render(request, fleet_ctx(request, saved=saved))


def _apply(request: Request, client: Any, form: dict[str, Any]) -> Any:
    replica = (form.get("replica") or "").strip() or None
    # Compared with that replica's own policy, so a change back to the fleet's value counts.
    target = SimpleNamespace(policy=client.policy_for(replica), envelope=client.envelope)
    changes, errors, raw = parse_policy_form(form, target)
    if replica is not None and replica not in {s.replica for s in client.view.live()}:
        errors["replica"] = f"unknown replica {replica!r}"
    if not errors and changes:
        s = request.state.admin_session
        try:
            client.apply_policy(s.who, changes, replica)
        except ValueError as exc:
            errors["policy"] = str(exc)
        else:  # the state file's audit log has the fleet's changes too (with which replicas they hit)
            old, store = target.policy, request.app.state.store
            diff = {k: (getattr(old, k), v) for k, v in changes.items()}
            if replica is None:  # the fleet-wide policy: what the next start restores
                store.record_policy(s.who, diff, client.policy.to_json(), scope="all replicas", client=s.client)
            else:
                store.record(s.who, "policy", changes={k: list(d) for k, d in diff.items()}, scope=replica,
                             client=s.client)
    if errors:
        return _render(request, fleet_ctx(request, errors=errors, values=raw), 422)
    saved = f"Policy applied to {replica or 'all replicas'}" if changes else "No change"
    if not is_htmx(request):
        return Redirect(f"/admin?saved={saved.replace(' ', '+')}", status_code=303)
    return _render(request, fleet_ctx(request, saved=saved))


@post("/fleet/policy", name="fleet_policy", status_code=200)
async def fleet_policy(request: Request) -> Any:
    form = dict(await request.form())
    return await asyncio.to_thread(_apply, request, _client(request), form)


def _numbers(form: dict[str, Any], fields: list[tuple[str, type]]) -> tuple[dict[str, Any], dict[str, str]]:
    """The filled-in fields of a form as numbers, and an error per field that is not one."""
    got: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, typ in fields:
        text = str(form.get(name, "")).strip()
        if not text:
            continue
        value, err = parse_number(text, typ)
        if err:
            errors[name] = err
        else:
            got[name] = value
    return got, errors


async def _change(request: Request, form: dict[str, Any], fields: list[tuple[str, type]], action: str,
                  update: Any, saved: str) -> Any:
    """Parse, apply with `update(values) -> {field: (old, new)}` (ValueError: the form's
    error), audit-log what changed in the state file, render."""
    values, errors = _numbers(form, fields)
    if not errors:
        try:
            diff = await asyncio.to_thread(update, values)
        except ValueError as exc:
            errors[action] = str(exc)
        else:
            if diff:
                s = request.state.admin_session
                request.app.state.store.record(s.who, action, changes={k: list(d) for k, d in diff.items()},
                                               scope="fleet", client=s.client)
    if errors:
        return _render(request, fleet_ctx(request, errors=errors, values={k: str(form.get(k, "")) for k in form}), 422)
    if not is_htmx(request):
        return Redirect(f"/admin?saved={saved.replace(' ', '+')}", status_code=303)
    return _render(request, fleet_ctx(request, saved=saved))


@post("/fleet/autoscale", name="fleet_autoscale", status_code=200)
async def fleet_autoscale(request: Request) -> Any:
    form = dict(await request.form())
    return await _change(request, form, [(n, t) for n, _, t, _ in AUTOSCALE_FIELDS], "autoscaler",
                         _client(request).update_autoscale, "Autoscaler updated")


@post("/fleet/pools", name="fleet_pools", status_code=200)
async def fleet_pools(request: Request) -> Any:
    """Disaggregated: resize the prefill and decode pools (Ray Serve starts or drains replicas)."""
    form = dict(await request.form())
    return await _change(request, form, [(n, int) for n, _, _ in POOL_FIELDS], "pools",
                         _client(request).update_pools, "Pools resized")


@get("/fleet.json", name="fleet_json", sync_to_thread=True)
def fleet_json(request: Request) -> Response:
    """The same snapshot as the page, for tools (replicas with pid and node, decisions,
    autoscaler history, pool sizes, the last changes from the audit log)."""
    snap = _client(request).snapshot()
    changes = [dataclasses.asdict(r) for r in recent_changes(request.app.state.store)]
    return Response({**dataclasses.asdict(snap), "changes": changes}, headers=NO_STORE)


def fleet_admin_router() -> Router:
    auth = AdminAuth()
    return Router(path="/admin", route_handlers=[login_form, login, logout, fleet_page, fleet_policy,
                                                 fleet_autoscale, fleet_pools, fleet_json, *STATE_ROUTES],
                  before_request=auth.before_request, opt={"admin_auth": auth}, include_in_schema=False)
