"""Console pages for the durable operator state (console/state.py): the audit log with
paging and CSV/JSON export, operators and API keys (add, revoke, usage).

A new token or key is shown once, on the page that made it; only its hash is stored.
Viewers see these pages; the before-request gate (console/auth.py) refuses their POSTs.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from litestar import Request, Response, get, post
from litestar.response import Redirect, Stream, Template

from console.render import is_htmx, render
from console.state import ROLES, StateError, StateStore, audit_csv, audit_json

AUDIT_PAGE = 50
ACTIONS = ("policy", "abort", "flush_prefix_cache", "add_operator", "revoke_operator", "add_key", "revoke_key")


def _store(request: Request) -> StateStore:
    return request.app.state.store


def _render(request: Request, page: str, ctx: dict[str, Any], status: int = 200) -> Template:
    return render(request, page, ctx, status)


# --- audit log -------------------------------------------------------------------------------------
def _action(action: str | None) -> str | None:
    return action if action in ACTIONS else None


@get("/audit", name="admin_audit", sync_to_thread=True)
def audit_page(request: Request, page: int = 1, action: str | None = None) -> Template:
    store, action = _store(request), _action(action)
    total = store.audit_count(action)
    pages = max(1, math.ceil(total / AUDIT_PAGE))
    page = min(max(1, page), pages)
    rows = store.audit(offset=(page - 1) * AUDIT_PAGE, limit=AUDIT_PAGE, action=action)
    return _render(request, "audit", {"rows": rows, "total": total, "pnum": page, "pages": pages,
                                      "action": action, "actions": ACTIONS, "state_path": store.path})


def _export(request: Request, fmt: str, action: str | None) -> Stream:
    rows = _store(request).iter_audit(_action(action))
    media, body = ("text/csv", audit_csv(rows)) if fmt == "csv" else ("application/json", audit_json(rows))
    name = f"pagedjax-audit{'-' + action if _action(action) else ''}.{fmt}"
    return Stream(body, media_type=media, headers={"Content-Disposition": f'attachment; filename="{name}"',
                                                   "Cache-Control": "no-store"})


@get("/audit.csv", name="admin_audit_csv", sync_to_thread=False)
def audit_export_csv(request: Request, action: str | None = None) -> Stream:
    return _export(request, "csv", action)


@get("/audit.json", name="admin_audit_json", sync_to_thread=False)
def audit_export_json(request: Request, action: str | None = None) -> Stream:
    return _export(request, "json", action)


# --- operators ----------------------------------------------------------------------------------------
def _operators_ctx(request: Request, **extra: Any) -> dict[str, Any]:
    return {"operators": _store(request).operators(), "roles": ROLES, "new": None, "error": None,
            "values": {}, **extra}


@get("/operators", name="admin_operators", sync_to_thread=True)
def operators_page(request: Request) -> Template:
    return _render(request, "operators", _operators_ctx(request))


@post("/operators", name="admin_operator_add")
async def operator_add(request: Request) -> Template:
    form = await request.form()
    name, role = str(form.get("name", "")).strip(), str(form.get("role", ""))
    who = request.state.admin_session.who
    try:
        token = await asyncio.to_thread(_store(request).add_operator, name, role, who)
    except StateError as exc:
        return _render(request, "operators", _operators_ctx(request, error=str(exc),
                                                            values={"name": name, "role": role}), 422)
    return _render(request, "operators", _operators_ctx(request, new={"name": name, "role": role, "token": token}))


@post("/operators/{name:str}/revoke", name="admin_operator_revoke", sync_to_thread=True, status_code=200)
def operator_revoke(request: Request, name: str) -> Response:
    s = request.state.admin_session
    try:
        _store(request).revoke_operator(name, s.who)
    except StateError as exc:
        return _render(request, "operators", _operators_ctx(request, error=str(exc)), 422)
    # Their sessions end at their next request (AdminAuth.session_for re-reads the row).
    if name == s.who:  # revoked oneself: this session is over too
        request.clear_session()
        return Redirect("/admin/login", status_code=303, headers={"HX-Redirect": "/admin/login"})
    if not is_htmx(request):
        return Redirect("/admin/operators", status_code=303)
    return _render(request, "operators", _operators_ctx(request))


# --- API keys --------------------------------------------------------------------------------------------
def _keys_ctx(request: Request, **extra: Any) -> dict[str, Any]:
    st = request.app.state
    return {"keys": st.key_gate.usage(), "shared_key": st.settings.api_key is not None, "new": None,
            "error": None, "values": {}, **extra}


@get("/keys", name="admin_keys", sync_to_thread=True)
def keys_page(request: Request) -> Template:
    return _render(request, "keys", _keys_ctx(request))


def _limit(text: Any) -> int | None:
    text = str(text or "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise StateError(f"{text!r}: limits are whole numbers (leave a field empty for no limit)") from None


@post("/keys", name="admin_key_add")
async def key_add(request: Request) -> Template:
    form = await request.form()
    values = {k: str(form.get(k, "")).strip() for k in ("name", "rpm", "tpm", "max_concurrent")}
    who = request.state.admin_session.who
    try:
        limits = {k: _limit(values[k]) for k in ("rpm", "tpm", "max_concurrent")}
        key = await asyncio.to_thread(lambda: _store(request).add_key(values["name"], who=who, **limits))
    except StateError as exc:
        return _render(request, "keys", _keys_ctx(request, error=str(exc), values=values), 422)
    return _render(request, "keys", _keys_ctx(request, new={"name": values["name"], "key": key}))


@post("/keys/{name:str}/revoke", name="admin_key_revoke", sync_to_thread=True, status_code=200)
def key_revoke(request: Request, name: str) -> Response:
    try:
        _store(request).revoke_key(name, request.state.admin_session.who)
    except StateError as exc:
        return _render(request, "keys", _keys_ctx(request, error=str(exc)), 422)
    if not is_htmx(request):
        return Redirect("/admin/keys", status_code=303)
    return _render(request, "keys", _keys_ctx(request))


STATE_ROUTES = [audit_page, audit_export_csv, audit_export_json, operators_page, operator_add, operator_revoke,
                keys_page, key_add, key_revoke]
