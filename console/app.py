"""The Litestar app factory: OpenAI routes, operator console, /health, /metrics, OpenAPI.

The lifespan owns the engine. Given an `engine_factory`, loading and warm-up run on a
daemon thread so the server answers (/health 503) while XLA compiles; the engine thread
starts only once every step shape is compiled. `drain` is the SIGTERM path: stop
admitting (503), give in-flight requests the grace period, abort the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from litestar import Litestar, Request, Response, Router, get
from litestar.connection import ASGIConnection
from litestar.contrib.jinja import JinjaTemplateEngine
from litestar.enums import ScopeType
from litestar.exceptions import PermissionDeniedException
from litestar.handlers import BaseRouteHandler
from litestar.middleware import ASGIMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from console import schemas as S
from console.api import ACCESS_KEY, ROUTES, AccessRecord
from console.assets import static_dir, templates_dir
from console.auth import SESSION_STORE, StateSessionStore, csrf_config, handle_csrf_refusal, session_config
from console.native import ROOT_ROUTES
from console.errors import EXCEPTION_HANDLERS, APIError
from console.keys import KeyGate, LimitExceeded, retry_after_header
from console.settings import ServerSettings
from console.state import StateStore, restore_policy
from runtime.core.async_engine import AsyncEngine
from runtime.core.engine import LLMEngine
from runtime.core.metrics import LATENCY_BUCKETS

log = logging.getLogger("pagedjax.server")
access_log = logging.getLogger("pagedjax.access")


# --- the /v1 door: API key, then readiness (guards run before the body is read) ----------------

def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Only an API key opens /v1 (the admin token does not; a key opens nothing else): the
    one --api-key, or a named key from the state file, counted against its limits."""
    st = connection.app.state
    shared, gate = st.settings.api_key, st.key_gate
    auth = connection.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    # One state-file read per request: the key's own row when one is sent; whether any key
    # exists only when none matched (no key of either kind: an open server, loopback by default).
    key = gate.identify(given.strip(), shared) if auth and scheme.lower() == "bearer" else None
    if key is None:
        if shared is None and not st.store.has_keys():
            return
        hdr = {"WWW-Authenticate": "Bearer"}
        if not auth:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           headers=hdr)
        raise APIError(401, "incorrect or revoked API key", code="invalid_api_key", headers=hdr)
    rec = connection.scope.get(ACCESS_KEY)  # type: ignore[call-overload]
    name = key if isinstance(key, str) else key.name
    if rec is not None:
        rec.key = name
    try:
        grant = gate.admit(key)
    except LimitExceeded as exc:
        raise APIError(429, str(exc), code="rate_limit_exceeded", param=exc.limit,
                       headers={"Retry-After": retry_after_header(exc.retry_after)}) from None
    if rec is not None:
        rec.grant = grant
    else:  # no middleware (a bare test app): nothing would settle it
        gate.settle(grant, None, None)


def require_ready(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    st = connection.app.state
    engine = st.get("engine")
    if st.get("draining") or (engine is not None and not engine.accepting):
        raise APIError(503, "the server is shutting down and accepts no new requests", code="draining")
    if not st.get("ready") or engine is None:
        raise APIError(503, "the model is still warming up; retry shortly", code="warming_up",
                       headers={"Retry-After": "5"})


def v1_router(with_security: bool) -> Router:
    return Router(path="/v1", route_handlers=ROUTES, guards=[require_api_key, require_ready],
                  exception_handlers=EXCEPTION_HANDLERS, tags=["OpenAI"],
                  security=[{"bearer": []}] if with_security else None)


def root_router(with_security: bool) -> Router:
    """/tokenize, /detokenize (vLLM's paths and shapes), /generate and /generate_stream (TGI's)
    at the root, behind the same door as /v1."""
    return Router(path="/", route_handlers=ROOT_ROUTES, guards=[require_api_key, require_ready],
                  exception_handlers=EXCEPTION_HANDLERS, tags=["Native"],
                  security=[{"bearer": []}] if with_security else None)


# --- access log + HTTP metrics ----------------------------------------------------------------------

class HttpMetrics:
    """HTTP-side metrics in their own registry (the engine's registry is the engine's)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pagedjax:http_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("pagedjax:http_request_duration_seconds", "HTTP request latency (full response)",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)


class AccessMiddleware(ASGIMiddleware):
    """One JSON line per request on `pagedjax.access`, plus the HTTP metrics. Routes are
    labelled by their template (`/v1/completions`), never the raw path."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, metrics: HttpMetrics, enabled: bool, gate: KeyGate) -> None:
        self.metrics = metrics
        self.enabled = enabled
        self.gate = gate

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if 0 < len(given) <= 64 and given.replace("-", "").isalnum() else secrets.token_hex(8)
        rec = AccessRecord(rid, scope.get("path_template") or scope["path"], scope.get("method", ""))
        scope[ACCESS_KEY] = rec  # type: ignore[literal-required]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await next_app(scope, receive, send_wrapper)
        except BaseException as exc:
            rec.status = rec.status or int(getattr(exc, "status_code", 500))
            raise
        finally:
            self._finish(rec)

    def _finish(self, rec: AccessRecord) -> None:
        total = time.monotonic() - rec.start
        if rec.grant is not None:
            self.gate.settle(rec.grant, rec.prompt_tokens, rec.completion_tokens)
        self.metrics.requests.labels(rec.route, rec.method, str(rec.status)).inc()
        self.metrics.latency.labels(rec.route).observe(total)
        if self.enabled:
            access_log.info(json.dumps({
                "id": rec.request_id, "method": rec.method, "route": rec.route, "status": rec.status, "key": rec.key,
                "prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.completion_tokens,
                "cached_tokens": rec.cached_tokens,
                "ttft_s": None if rec.ttft_s is None else round(rec.ttft_s, 4), "total_s": round(total, 4)}))


# --- /health and /metrics ------------------------------------------------------------------------------

def _status(app: Litestar) -> tuple[str, str | None]:
    st = app.state
    if st.get("failed"):
        return "failed", st.failed
    if st.get("draining"):
        return "draining", None
    return ("ok", None) if st.get("ready") else ("warming_up", None)


@get("/health", summary="Readiness: 200 when serving, 503 while warming up or draining", sync_to_thread=False)
def health(request: Request) -> Response:
    status, detail = _status(request.app)
    body = S.Health(status, request.app.state.settings.model_name, detail)
    return Response(S.encode(body), status_code=200 if status == "ok" else 503, media_type="application/json",
                    headers={"Cache-Control": "no-store"})


@get("/metrics", summary="Prometheus metrics: the engine's and the HTTP server's", sync_to_thread=False)
def metrics(request: Request) -> Response:
    st = request.app.state
    engine = st.get("engine")
    text = (engine.render_metrics() if engine is not None else b"") + generate_latest(st.http_metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST, headers={"Cache-Control": "no-store"})


@get("/replicas/{replica:str}/metrics", summary="One fleet replica's Prometheus metrics, unlabelled (as a model "
     "server exports them: what llm-d's endpoint picker scrapes per endpoint)", sync_to_thread=False)
def replica_metrics(request: Request, replica: str) -> Response:
    engine = request.app.state.get("engine")
    text = engine.replica_metrics(replica) if engine is not None else None
    if text is None:
        raise APIError(404, f"replica: no replica {replica!r} is reporting", param="replica", code="not_found")
    return Response(text, media_type=CONTENT_TYPE_LATEST, headers={"Cache-Control": "no-store"})


# --- lifecycle ----------------------------------------------------------------------------------------------

def _load_and_warm(app: Litestar, factory: Callable[[], LLMEngine]) -> None:
    """Engine thread start-up, off the event loop so /health can say 503 meanwhile."""
    st = app.state
    try:
        llm = factory()
        restore_policy(st.store, llm, reset=st.settings.reset_policy)
        engine = st.engine = AsyncEngine(llm)  # visible (not ready) to the console during warm-up
        if st.settings.warmup and not llm.warmup_seconds:
            log.info("warming up: compiling %d step shapes", len(llm.envelope.bucket_pairs()))
            llm.warmup(progress=sys.stderr.isatty())
        if st.get("draining") or st.get("stopping"):
            return
        engine.start()
        st.ready = True
        log.info("ready: serving %r (%s)", st.settings.model_name, f"warm-up {llm.warmup_seconds:.1f} s"
                 if st.settings.warmup else "no warm-up: step shapes compile on first use")
    except Exception as exc:  # noqa: BLE001 -- reported as one line; /health says failed
        st.failed = f"{type(exc).__name__}: {exc}"
        log.error("the engine failed to start: %s", st.failed)


def drain(app: Litestar, grace_s: float) -> None:
    """Blocking (run it on a thread): refuse new requests with 503, let in-flight ones
    finish for up to grace_s, abort the rest and stop the engine thread."""
    st = app.state
    st.draining = True
    engine = st.get("engine")
    if engine is not None:
        engine.accepting = False
        if engine.has_unfinished():
            log.info("draining: in-flight requests get up to %.0f s to finish", grace_s)
        engine.stop(grace_s)
    st.drained = True


USAGE_FLUSH_S = 5.0  # API-key usage reaches the state file this often (and at shutdown)


async def _flush_usage(gate: KeyGate) -> None:
    while True:
        await asyncio.sleep(USAGE_FLUSH_S)
        try:
            await asyncio.to_thread(gate.flush)
        except Exception as exc:  # noqa: BLE001 -- kept in memory and retried next time
            log.warning("API-key usage not stored this time: %s", exc)


def _lifespan(factory: Callable[[], LLMEngine] | None, fleet: bool):
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        st = app.state
        flusher = asyncio.create_task(_flush_usage(st.key_gate))
        if st.get("engine") is not None:
            llm = getattr(st.engine, "engine", None)  # an AsyncEngine's LLMEngine (tests may pass stubs)
            if not fleet and isinstance(llm, LLMEngine):
                restore_policy(st.store, llm, reset=st.settings.reset_policy)
            st.engine.start()
            st.ready = True
        elif factory is not None:
            st.loader = threading.Thread(target=_load_and_warm, args=(app, factory), name="pagedjax-warmup",
                                         daemon=True)
            st.loader.start()
        try:
            yield
        finally:
            # The HTTP side is done by now (uvicorn waited for it), so nobody listens to
            # what is left in the engine: no grace here; `drain` gave it already.
            st.stopping, st.ready = True, False
            flusher.cancel()
            engine = st.get("engine")
            if engine is not None:
                await asyncio.to_thread(engine.stop, 0.0)
            await asyncio.to_thread(st.key_gate.flush)

    return lifespan


def create_app(settings: ServerSettings, engine: AsyncEngine | None = None,
               engine_factory: Callable[[], LLMEngine] | None = None, fleet: bool = False,
               store: StateStore | None = None) -> Litestar:
    """`engine`: already built (tests; ready at once). `engine_factory`: built and warmed
    up in the background by the lifespan. Neither: the API answers 503 (console-only tests).
    `fleet`: `engine` is a FleetClient (runtime/fleet/gateway.py): the console is the fleet page.
    `store`: the operator state file (console/state.py); None keeps it in memory."""
    http_metrics = HttpMetrics()
    store = store if store is not None else StateStore()
    gate = KeyGate(store, http_metrics.registry)
    keyed = settings.api_key is not None or store.has_keys()
    from console.lora_api import lora_router

    handlers: list = [v1_router(with_security=keyed), root_router(with_security=keyed), lora_router(require_ready),
                      health, metrics,
                      create_static_files_router(path="/static", directories=[static_dir()],
                                                 include_in_schema=False)]
    if fleet:
        from console.fleet_admin import fleet_admin_router

        handlers += [fleet_admin_router(), replica_metrics]
    else:
        from console.admin import admin_router

        handlers.append(admin_router())
    security = {"bearer": SecurityScheme(type="http", scheme="bearer")} if keyed else None
    openapi = OpenAPIConfig(title="pagedjax", version="0.1.0", path="/schema",
                            description="OpenAI-compatible API of the pagedjax serving runtime",
                            components=Components(security_schemes=security))
    return Litestar(
        route_handlers=handlers,
        on_startup=[_publish_schemas],
        lifespan=[_lifespan(engine_factory, fleet)],
        # The console's sessions (kept in the state file) and CSRF check: Litestar's, on /admin only.
        middleware=[AccessMiddleware(http_metrics, settings.access_log, gate), session_config().middleware],
        stores={SESSION_STORE: StateSessionStore(store)},
        csrf_config=csrf_config(store),
        exception_handlers={**EXCEPTION_HANDLERS, PermissionDeniedException: handle_csrf_refusal},
        openapi_config=openapi,
        template_config=TemplateConfig(directory=templates_dir(), engine=JinjaTemplateEngine,
                                       engine_callback=_template_filters),
        state=_initial_state(settings, engine, http_metrics, store, gate, fleet),
        logging_config=None,  # serve.py configures logging; Litestar must not replace it
        debug=False,
    )


def _template_filters(engine: JinjaTemplateEngine) -> None:
    engine.engine.filters["utc"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if t else "—"


def _publish_schemas(app: Litestar) -> None:
    """The operations reference msgspec-generated component schemas (console/schemas.py);
    Litestar rebuilds components from its own registry, so they are added once it has."""
    components = app.openapi_schema.components
    components.schemas = {**(components.schemas or {}), **S.openapi_components()}


def _initial_state(settings: ServerSettings, engine: AsyncEngine | None, http_metrics: HttpMetrics,
                   store: StateStore, gate: KeyGate, fleet: bool):
    from litestar.datastructures import State

    return State({"settings": settings, "engine": engine, "ready": False, "draining": False, "failed": None,
                  "started_at": time.time(), "http_metrics": http_metrics, "store": store, "key_gate": gate,
                  "is_fleet": fleet})
