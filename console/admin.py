"""The operator console under /admin: pages, HTMX fragments and the few actions.

Reads go through the engine's snapshot API (console/views.py builds the view models);
writes go only through `engine.update_policy`, `engine.abort` and
`engine.reset_prefix_cache`. Every page renders fully without JavaScript; a request
carrying `HX-Request: true` gets just the page's `_fragment` partial instead.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any
from urllib.parse import quote

from litestar import Request, Response, Router, get, post
from litestar.response import Redirect, Template

from console import views
from console.auth import AdminAuth, is_htmx, login, login_form, logout
from console.admin_json import JSON_ROUTES
from console.admin_state import STATE_ROUTES
from console.render import NO_STORE, render
from console.state import apply_policy


# (field, label, type, help) in form order; types convert the form's strings.
POLICY_FIELDS: list[tuple[str, str, type, str]] = [
    ("watermark", "Watermark", float,
     "Fraction of KV blocks that new admissions may not take: held back for running sequences to grow."),
    ("admission_mode", "Admission mode", str,
     "reserve: admit only if prompt + max_tokens fit (never preempts). "
     "optimistic: admit on prompt blocks, preempt when decode growth runs out."),
    ("max_num_seqs", "Max running sequences", int, "Sequences in one step (at most the compiled envelope)."),
    ("max_num_batched_tokens", "Max batched tokens", int, "Token budget of one step (prefill chunks + decodes)."),
    ("long_prefill_token_threshold", "Long-prefill chunk cap", int,
     "Largest prefill chunk one request may take in a step, so long prompts do not stall decodes."),
    ("max_admissions_per_step", "Max admissions per step", int,
     "Spreads re-admission after a burst of completions (prevents an eviction storm)."),
    ("max_queue_len", "Max queue length", int, "Waiting requests beyond this are refused with 429."),
    ("max_queued_tokens", "Max queued tokens", int, "Prompt tokens waiting beyond this are refused with 429."),
    ("slo_ttft_interactive_s", "TTFT target, interactive (s)", float,
     "Time to first token an interactive request should meet; 0: no target. The dashboard shows the share met."),
    ("slo_itl_interactive_s", "ITL target, interactive (s)", float,
     "Gap between an interactive request's tokens it should meet; 0: no target."),
    ("slo_ttft_batch_s", "TTFT target, batch (s)", float, "As above, for the batch tier; 0: no target."),
    ("slo_itl_batch_s", "ITL target, batch (s)", float, "As above, for the batch tier; 0: no target."),
]


def _engine(request: Request) -> Any:
    """The LLMEngine, or None while the server is still warming up."""
    ae = request.app.state.get("engine")
    return getattr(ae, "engine", ae)


def _render(request: Request, page: str, ctx: dict[str, Any], status: int = 200) -> Template:
    return render(request, page, ctx, status)


def _starting(request: Request, page: str) -> Template:
    return _render(request, "starting", {"for_page": page}, 503)


# --- dashboard and block map ------------------------------------------------------------------
@get("/", name="admin_dashboard", sync_to_thread=True)
def dashboard(request: Request, cell: int | None = None) -> Template:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "dashboard")
    ctx = views.dashboard(engine)
    ctx["detail"] = _cell_detail(engine, ctx["map"].per_cell, cell) if cell is not None else None
    return _render(request, "dashboard", ctx)


def _cell_detail(engine: Any, per_cell: int, cell: int) -> dict[str, Any]:
    start = max(0, cell) * per_cell
    blocks = views.block_views(engine, start, start + per_cell)
    return {"cell": cell, "start": start, "blocks": blocks}


@get("/blocks", name="admin_blocks", sync_to_thread=True)
def blocks(request: Request, cell: int = 0) -> Template:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "blocks")
    per = views.blocks_per_cell(engine.config.cache.num_blocks)
    return _render(request, "blocks", {"detail": _cell_detail(engine, per, cell)})


# --- requests ----------------------------------------------------------------------------------
@get("/requests", name="admin_requests", sync_to_thread=True)
def requests_page(request: Request, aborted: str | None = None, missing: str | None = None) -> Template:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "requests")
    return _render(request, "requests", {**views.requests_view(engine), "aborted": aborted, "missing": missing})


@get("/requests/{request_id:str}", name="admin_request_ledger", sync_to_thread=True)
def request_ledger(request: Request, request_id: str) -> Template | Response:
    """One request's decision ledger (runtime/core/ledger.py): a timeline, or JSON when the id
    ends in .json. Running, waiting and the last finished requests."""
    engine = _engine(request)
    as_json = request_id.endswith(".json")
    rid = request_id[:-5] if as_json else request_id
    if engine is None:
        return Response({"detail": "engine not ready"}, status_code=503) if as_json else _starting(request, "requests")
    led = engine.ledger(rid)
    if as_json:
        if led is None:
            return Response({"detail": f"no ledger for request {rid!r} (unknown, long finished, or the ledger is off)"},
                            status_code=404, headers=NO_STORE)
        return Response(led, headers=NO_STORE)
    return _render(request, "request", {"rid": rid, "ledger": led, **views.ledger_view(led)}, 200 if led else 404)


@post("/requests/{request_id:str}/abort", name="admin_abort", sync_to_thread=True, status_code=200)
def abort(request: Request, request_id: str) -> Response:
    ae = request.app.state.get("engine")
    if ae is None:
        return Response("engine not ready", status_code=503, media_type="text/plain")
    engine = _engine(request)
    known = any(r.request_id == request_id for r in views.requests_view(engine)["requests"])
    if known:
        ae.abort(request_id)  # AsyncEngine.abort also wakes an idle engine loop
        s = request.state.admin_session
        request.app.state.store.record(s.who, "abort", request_id=request_id, client=s.client)
    flash = {"aborted": request_id} if known else {"missing": request_id}
    if not is_htmx(request):
        key, value = next(iter(flash.items()))
        return Redirect(f"/admin/requests?{key}={quote(value)}", status_code=303)
    return _render(request, "requests", {**views.requests_view(engine), **flash})


# --- admission policy --------------------------------------------------------------------------
RECENT_POLICY_ROWS = 10  # on the policy page; the audit page has the whole history


def _policy_ctx(request: Request, engine: Any, *, values: dict[str, str] | None = None,
                errors: dict[str, str] | None = None, saved: bool = False) -> dict[str, Any]:
    store = request.app.state.store
    policy = engine.policy
    return {"fields": POLICY_FIELDS, "policy": policy.to_json(), "ranges": policy.ranges(engine.envelope),
            "values": values or {}, "errors": errors or {}, "saved": saved,
            "audit": store.audit(limit=RECENT_POLICY_ROWS, action="policy"),
            "audit_total": store.audit_count("policy"), "envelope": engine.envelope}


def parse_number(text: str, typ: type) -> tuple[Any, str | None]:
    """A form field's string as `typ` -> (value, None), or (None, the field's error)."""
    try:
        value: Any = typ(text)
    except ValueError:
        return None, "must be a number" if typ is float else "must be a whole number"
    if isinstance(value, float) and not math.isfinite(value):
        return None, "must be a finite number"
    return value, None


def parse_policy_form(form: Any, engine: Any) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """Form strings -> typed changes (only fields that differ), per-field errors, raw values.
    Each change is validated on its own first so every bad field gets its own message."""
    current = engine.policy
    changes: dict[str, Any] = {}
    errors: dict[str, str] = {}
    raw: dict[str, str] = {}
    for name, _, typ, _ in POLICY_FIELDS:
        text = form.get(name)
        if text is None:
            continue  # a partial form (a tool posting one field) leaves the others alone
        raw[name] = text = str(text).strip()
        value, err = parse_number(text, typ)
        if err:
            errors[name] = err
            continue
        if value == getattr(current, name):
            continue
        try:
            current.replace(engine.envelope, **{name: value})
        except ValueError as exc:
            errors[name] = str(exc).split(": ", 1)[-1]
            continue
        changes[name] = value
    return changes, errors, raw


@get("/policy", name="admin_policy", sync_to_thread=True)
def policy_page(request: Request, saved: bool = False) -> Template:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "policy")
    return _render(request, "policy", _policy_ctx(request, engine, saved=saved))


@post("/policy", name="admin_policy_update")
async def policy_update(request: Request) -> Response:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "policy")
    form = await request.form()
    changes, errors, raw = parse_policy_form(form, engine)
    s = request.state.admin_session
    if form.get("preview") is not None and not errors:  # what the change would do: nothing applied
        try:
            proposed = engine.policy.replace(engine.envelope, **changes)
        except ValueError as exc:
            field, _, msg = str(exc).partition(": ")
            errors[field if field in raw else next(iter(changes), field)] = msg or str(exc)
        else:
            ctx = _policy_ctx(request, engine, values=raw)
            ctx["preview"] = await asyncio.to_thread(views.policy_preview, engine, proposed)
            return _render(request, "policy", ctx)
    if not errors and changes:
        try:  # on a worker thread: it waits for other operators' changes and writes the state file
            await asyncio.to_thread(apply_policy, request.app.state.store, engine, s.who, changes, client=s.client)
        except ValueError as exc:  # a cross-field rule: show it beside the field it names
            field, _, msg = str(exc).partition(": ")
            errors[field if field in raw else next(iter(changes))] = msg or str(exc)
    if errors:
        return _render(request, "policy", _policy_ctx(request, engine, values=raw, errors=errors), 422)
    if not is_htmx(request):
        return Redirect("/admin/policy?saved=true", status_code=303)
    return _render(request, "policy", _policy_ctx(request, engine, saved=True))


@get("/policy.json", name="admin_policy_json", sync_to_thread=False)
def policy_json(request: Request) -> Response:
    engine = _engine(request)
    if engine is None:
        return Response({"detail": "engine not ready"}, status_code=503)
    return Response(engine.policy.to_json(), headers=NO_STORE)


# --- prefix cache -------------------------------------------------------------------------------
@get("/prefix-cache", name="admin_prefix_cache", sync_to_thread=True)
def prefix_cache_page(request: Request, flushed: int | None = None) -> Template:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "prefix_cache")
    return _render(request, "prefix_cache", {**views.prefix_cache(engine), "flushed": flushed})


@get("/prefix-cache/flush", name="admin_flush_confirm", sync_to_thread=True)
def flush_confirm(request: Request) -> Template:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "flush")
    return _render(request, "flush", views.flush_confirm(engine))


@post("/prefix-cache/flush", name="admin_flush", sync_to_thread=True, status_code=200)
def flush(request: Request) -> Response:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "prefix_cache")
    dropped = engine.reset_prefix_cache()
    s = request.state.admin_session
    request.app.state.store.record(s.who, "flush_prefix_cache", blocks=dropped, client=s.client)
    if not is_htmx(request):
        return Redirect(f"/admin/prefix-cache?flushed={dropped}", status_code=303)
    return _render(request, "prefix_cache", {**views.prefix_cache(engine), "flushed": dropped})


# --- model ----------------------------------------------------------------------------------------
@get("/model", name="admin_model", sync_to_thread=True)
def model_page(request: Request) -> Template:
    engine = _engine(request)
    if engine is None:
        return _starting(request, "model")
    return _render(request, "model", {**views.model_view(engine, request.app.state.get("settings")),
                                       "lora": engine.lora_view(), "lora_form": {}})


def _lora_card(request: Request, engine: Any, msg: str, error: bool, form: dict, status: int = 200) -> Response:
    if not is_htmx(request):
        return Redirect("/admin/model", status_code=303) if not error else _render(
            request, "model", {**views.model_view(engine, request.app.state.get("settings")), "lora": engine.lora_view(),
                               "lora_form": form, "lora_msg": msg, "lora_error": True}, status)
    return _render(request, "lora", {"lora": engine.lora_view(), "lora_form": form, "lora_msg": msg,
                                     "lora_error": error}, status)


@post("/model/lora", name="admin_lora_load", status_code=200)
async def lora_load(request: Request) -> Response:
    """Load a PEFT adapter under a name (audited); the file is read and checked first."""
    from runtime.core.lora import AdapterError

    engine = _engine(request)
    if engine is None:
        return _starting(request, "model")
    form = await request.form()
    name, path = (form.get("name") or "").strip(), (form.get("path") or "").strip()
    if engine.loras is None:
        return _lora_card(request, engine, "LoRA is off: start the server with --enable-lora", True, {}, 400)
    if name == getattr(request.app.state.get("settings"), "model_name", None):
        return _lora_card(request, engine, f"{name!r} is the base model's name", True, {"name": name, "path": path}, 422)
    try:
        await asyncio.to_thread(engine.load_lora, name, path)
    except AdapterError as exc:
        return _lora_card(request, engine, f"Nothing was loaded: {exc}", True, {"name": name, "path": path}, 422)
    s = request.state.admin_session
    request.app.state.store.record(s.who, "load_lora", name=name, path=path, client=s.client)
    return _lora_card(request, engine, f"Loaded adapter {name}.", False, {})


@post("/model/lora/unload", name="admin_lora_unload", status_code=200)
async def lora_unload(request: Request) -> Response:
    from runtime.core.lora import AdapterError

    engine = _engine(request)
    if engine is None:
        return _starting(request, "model")
    name = ((await request.form()).get("name") or "").strip()
    if engine.loras is None:
        return _lora_card(request, engine, "LoRA is off: start the server with --enable-lora", True, {}, 400)
    try:
        engine.unload_lora(name)
    except (AdapterError, LookupError) as exc:
        return _lora_card(request, engine, f"Not unloaded: {str(exc).split(': ', 1)[-1]}", True, {}, 409)
    s = request.state.admin_session
    request.app.state.store.record(s.who, "unload_lora", name=name, client=s.client)
    return _lora_card(request, engine, f"Unloaded adapter {name}.", False, {})


def admin_router() -> Router:
    """A fresh router (and session store) per app."""
    auth = AdminAuth()
    return Router(
        path="/admin",
        route_handlers=[login_form, login, logout, dashboard, blocks, requests_page, request_ledger, abort, policy_page,
                        policy_update, policy_json, prefix_cache_page, flush_confirm, flush, model_page, lora_load, lora_unload,
                        *STATE_ROUTES, *JSON_ROUTES],
        before_request=auth.before_request,
        opt={"admin_auth": auth},
        include_in_schema=False,
    )
