"""Operator login for /admin: operator tokens, roles, server-side sessions in the state file,
CSRF and a failed-login rate limit.

Who may log in: the --admin-token (the bootstrap operator "admin"), or a named operator's
token from the state file (`pagedjax admin add-operator`; console/state.py). A viewer sees
every page and can change nothing (every POST but logout is 403); an operator can change
the policy, abort requests and flush the prefix cache.

Operator tokens and API keys are separate secrets: only a session cookie (made by
logging in) opens /admin, and that cookie is scoped to /admin so it is never even sent
with /v1 calls. The machinery is Litestar's: server-side sessions (the cookie holds a
random id; the session lives in the state file's console_sessions table, so logging out
really ends it and a restart does not) and its CSRF middleware (a signed token in a
cookie, sent back by every form and HTMX request; the signing key is kept in the state
file too). Every request re-reads its operator's row, so a revoke ends their sessions at
once (from the console or from `pagedjax admin revoke-operator` in another process), and a
restart with another --admin-token ends the bootstrap operator's sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import quote

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from litestar import Request, Response, get, post
from litestar.config.csrf import CSRFConfig
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie, MutableScopeHeaders
from litestar.exceptions import PermissionDeniedException
from litestar.middleware.session.server_side import ServerSideSessionBackend, ServerSideSessionConfig
from litestar.response import Redirect, Template
from litestar.stores.base import Store
from litestar.types import Message, ScopeSession

from console.errors import handle_http_exception
from console.render import is_htmx
from console.state import BOOTSTRAP, StateStore

log = logging.getLogger("pagedjax.admin.auth")

SESSION_COOKIE = "pagedjax_admin"
CSRF_COOKIE = "pagedjax_csrf"
CSRF_HEADER = "x-csrf-token"      # what HTMX sends (hx-headers on <body>); forms send `_csrf_token`
SESSION_STORE = "admin_sessions"  # the name Litestar's app-level store registry knows it by
SESSION_TTL_S = 8 * 3600
MAX_FAILURES = 5                  # failed logins per client per window before refusing
FAILURE_WINDOW_S = 60
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC = "admin_public"           # route opt key: reachable without a session
ANY_ROLE = "admin_any_role"       # route opt key: a POST viewers may make too (logout)
NEW_SESSION = "pagedjax.new_session"  # scope key: the login handler asks for a fresh session id
NOT_ADMIN = r"^/(?!admin(?:/|$))."    # every path but /admin/*: no CSRF, no session there (/v1 has its keys)


@dataclass(frozen=True)
class Session:
    """The logged-in operator, as the session stores it (plain JSON values)."""

    who: str                  # the operator's name: what the audit log records
    role: str                 # viewer | operator
    client: str
    created: float
    expires: float            # fixed at login: using the console does not extend it
    admin: str = ""           # the bootstrap operator's: StateStore.bootstrap_fingerprint of its token

    @property
    def can_write(self) -> bool:
        return self.role == "operator"

    @classmethod
    def of(cls, request: ASGIConnection) -> "Session | None":
        data = request.session
        try:
            return cls(**data) if data else None
        except TypeError:  # written by another version: log in again
            return None


# --- Litestar's sessions and CSRF, configured for the console -------------------------------------------

class StateSessionStore(Store):
    """Litestar's Store over the state file's console_sessions table (console/state.py)."""

    def __init__(self, state: StateStore) -> None:
        self.state = state

    @staticmethod
    def _deadline(expires_in: int | timedelta | None) -> float | None:
        if expires_in is None:
            return None
        seconds = expires_in.total_seconds() if isinstance(expires_in, timedelta) else expires_in
        return time.time() + seconds

    async def set(self, key: str, value: str | bytes, expires_in: int | timedelta | None = None) -> None:
        data = value.encode() if isinstance(value, str) else value
        await asyncio.to_thread(self.state.put_session, key, data, self._deadline(expires_in))

    async def get(self, key: str, renew_for: int | timedelta | None = None) -> bytes | None:
        found = await asyncio.to_thread(self.state.session, key)
        if found is None:
            return None
        if renew_for is not None and found[1] is not None:
            await asyncio.to_thread(self.state.renew_session, key, self._deadline(renew_for))
        return found[0]

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self.state.delete_sessions, key)

    async def delete_all(self) -> None:
        await asyncio.to_thread(self.state.delete_sessions)

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self.state.session, key) is not None

    async def expires_in(self, key: str) -> int | None:
        found = await asyncio.to_thread(self.state.session, key)
        return None if found is None or found[1] is None else max(0, int(found[1] - time.time()))


class _SessionBackend(ServerSideSessionBackend):
    """Litestar's server-side sessions with three changes it has no setting for: a request
    without a session stores nothing and gets no cookie (Litestar stores an empty session for
    every request); logging in takes a new id (never one a browser brought: no session
    fixation); the cookie is Secure when the request came over https (a TLS proxy in front)."""

    async def store_in_message(self, scope_session: ScopeSession, message: Message,
                               connection: ASGIConnection) -> None:
        store = self.config.get_store_from_app(connection.scope["app"])
        brought = connection.cookies.get(self.config.key)
        fresh = bool(connection.scope.get(NEW_SESSION))  # type: ignore[call-overload]
        if brought and (fresh or not scope_session):  # logged in again, logged out, or a stale cookie
            await self.delete(brought, store=store)
        if not scope_session and not brought:
            return
        c = self.config

        def cookie(value: str, max_age: int) -> str:
            return Cookie(key=c.key, value=value, max_age=max_age, path=c.path, domain=c.domain, httponly=c.httponly,
                          samesite=c.samesite, secure=c.secure or connection.url.scheme == "https").to_header(header="")

        headers = MutableScopeHeaders.from_message(message)
        if not scope_session:
            headers.add("Set-Cookie", cookie("", 0))
            return
        sid = self.generate_session_id() if fresh or not brought else brought
        await self.set(session_id=sid, data=self.serialize_data(scope_session, connection.scope), store=store)
        headers.add("Set-Cookie", cookie(sid, c.max_age))


@dataclass
class _SessionConfig(ServerSideSessionConfig):
    _backend_class = _SessionBackend


def session_config() -> ServerSideSessionConfig:
    """The console's sessions (app-level middleware; the store is registered as SESSION_STORE)."""
    return _SessionConfig(key=SESSION_COOKIE, path="/admin", max_age=SESSION_TTL_S, httponly=True,
                          samesite="strict", store=SESSION_STORE, exclude=NOT_ADMIN)


def csrf_config(state: StateStore) -> CSRFConfig:
    """Litestar's CSRF middleware for /admin: the token signed with a key the state file keeps
    (a restart does not invalidate the token a logged-in browser holds)."""
    return CSRFConfig(secret=state.console_key("csrf").hex(), cookie_name=CSRF_COOKIE, cookie_path="/admin",
                      header_name=CSRF_HEADER, cookie_httponly=True, cookie_samesite="strict", exclude=NOT_ADMIN)


def handle_csrf_refusal(request: Request, exc: PermissionDeniedException) -> Response:
    """Litestar's CSRF middleware refused a console state change (no token, or not the cookie's)."""
    if not request.url.path.startswith("/admin"):
        return handle_http_exception(request, exc)
    log.warning("admin %s %s refused: %s (%s)", request.method, request.url.path, exc.detail, client_of(request))
    return Response("CSRF token missing or invalid", status_code=403, media_type="text/plain")


# --- failed logins -----------------------------------------------------------------------------------------

class LoginLimiter:
    """Failed logins per client address in a moving window (the `limits` library)."""

    def __init__(self, max_failures: int = MAX_FAILURES, window_s: int = FAILURE_WINDOW_S) -> None:
        self.window_s = window_s
        self._item = RateLimitItemPerSecond(max_failures, window_s)
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def retry_after(self, client: str) -> float:
        """Seconds until `client` may try again (0 when allowed)."""
        if self._limiter.test(self._item, client):
            return 0.0
        return max(0.0, self._limiter.get_window_stats(self._item, client).reset_time - time.time())

    def fail(self, client: str) -> int:
        """Count a failure; returns the failures in the window."""
        self._limiter.hit(self._item, client)
        return self._item.amount - self._limiter.get_window_stats(self._item, client).remaining

    def reset(self, client: str) -> None:
        self._limiter.clear(self._item, client)


class AdminAuth:
    """Per-app login limiter and the gate every /admin request passes (one per admin_router())."""

    def __init__(self) -> None:
        self.limiter = LoginLimiter()
        self._fingerprint: tuple[str, str] | None = None   # (admin token, its fingerprint)

    async def fingerprint(self, request: Request) -> str:
        """StateStore.bootstrap_fingerprint of this server's --admin-token (scrypt: once)."""
        token: str = request.app.state.settings.admin_token
        if self._fingerprint is None or self._fingerprint[0] != token:
            state: StateStore = request.app.state.store
            self._fingerprint = (token, await asyncio.to_thread(state.bootstrap_fingerprint, token))
        return self._fingerprint[1]

    async def session_for(self, request: Request) -> Session | None:
        """The request's session if it is still good: not expired, its operator not revoked, and
        for the bootstrap operator the --admin-token it logged in with still this server's."""
        s = Session.of(request)
        if s is None:
            return None
        why = ("expired" if s.expires <= time.time()
               else "the operator was revoked" if s.who != BOOTSTRAP and request.app.state.store.operator(s.who) is None
               else "the server's --admin-token changed" if s.who == BOOTSTRAP and not hmac.compare_digest(
                   s.admin, await self.fingerprint(request))
               else None)
        if why is None:
            return s
        log.info("admin session of %s ended: %s", s.who, why)
        request.clear_session()
        return None

    # --- the gate (router before_request hook) -----------------------------------------------
    async def before_request(self, request: Request) -> Response | None:
        """Every /admin request but the login form: a good session, and for state changes (which
        Litestar's CSRF middleware has checked already) an operator unless the route lets viewers."""
        if request.route_handler.opt.get(PUBLIC):
            return None
        s = await self.session_for(request)
        if s is None:
            return login_required(request)
        request.state.admin_session = s
        if request.method not in SAFE_METHODS and not s.can_write and not request.route_handler.opt.get(ANY_ROLE):
            log.warning("admin %s %s refused: %s is a viewer", request.method, request.url.path, s.who)
            return Response(f"{s.who} is a viewer: viewers can see every page but change nothing",
                            status_code=403, media_type="text/plain")
        return None


def client_of(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def login_required(request: Request) -> Response:
    target = "/admin/login"
    if request.method == "GET" and not is_htmx(request):
        nxt = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return Redirect(f"{target}?next={quote(nxt)}", status_code=303)
    # HTMX follows HX-Redirect (a plain 303 would be swapped into the page); others get 401/403.
    status = 401 if request.method in SAFE_METHODS else 403
    return Response("login required", status_code=status, media_type="text/plain",
                    headers={"HX-Redirect": target})


def _safe_next(nxt: str | None) -> str:
    # Only same-site admin paths: never an open redirect to "//evil" or "https://...".
    if nxt and nxt.startswith("/admin") and not nxt.startswith("//") and "\\" not in nxt:
        return nxt
    return "/admin"


def _auth(request: Request) -> AdminAuth:
    return request.route_handler.opt["admin_auth"]


def _login_page(request: Request, *, error: str | None, status: int, nxt: str,
                retry_after: float = 0.0) -> Template:
    headers = {"Cache-Control": "no-store"}
    if retry_after:
        headers["Retry-After"] = str(int(retry_after) + 1)
    return Template("admin/login.html", context={"error": error, "next": nxt, "page": "login"},
                    status_code=status, headers=headers)


def _operator_for(request: Request, token: str) -> tuple[str | None, str]:
    """(name, role) of the operator whose token this is, else (None, "")."""
    if not token:
        return None, ""
    expected: str = request.app.state.settings.admin_token
    if hmac.compare_digest(token.encode(), expected.encode()):
        return BOOTSTRAP, "operator"
    op = request.app.state.store.verify_operator(token)
    return (op.name, op.role) if op else (None, "")


@get("/login", opt={PUBLIC: True}, name="admin_login_form")
async def login_form(request: Request, next: str | None = None) -> Response:  # noqa: A002 -- the query name
    if await _auth(request).session_for(request) is not None:
        return Redirect(_safe_next(next), status_code=303)
    return _login_page(request, error=None, status=200, nxt=_safe_next(next))


@post("/login", opt={PUBLIC: True}, name="admin_login")
async def login(request: Request) -> Response:
    """(Litestar's CSRF middleware has checked the form's token: no login CSRF.)"""
    auth, client = _auth(request), client_of(request)
    form = await request.form()
    nxt = _safe_next(form.get("next"))
    wait = auth.limiter.retry_after(client)
    if wait:
        log.warning("admin login from %s refused: rate limited (%.0f s left)", client, wait)
        return _login_page(request, error=f"Too many failed attempts. Try again in {int(wait) + 1} s.",
                           status=429, nxt=nxt, retry_after=wait)
    token = form.get("token")
    who, role = _operator_for(request, token.strip() if isinstance(token, str) else "")
    if who is None:
        n = auth.limiter.fail(client)
        log.warning("admin login failed from %s (%d failure(s) in the last %.0f s)", client, n,
                    auth.limiter.window_s)
        return _login_page(request, error="Invalid or revoked token.", status=401, nxt=nxt)
    auth.limiter.reset(client)
    now = time.time()
    s = Session(who, role, client, now, now + SESSION_TTL_S,
                await auth.fingerprint(request) if who == BOOTSTRAP else "")
    request.set_session(dataclasses.asdict(s))
    request.scope[NEW_SESSION] = True  # type: ignore[literal-required]
    log.info("admin login: %s (%s) from %s", who, role, client)
    return Redirect(nxt, status_code=303)


@post("/logout", name="admin_logout", opt={ANY_ROLE: True})
async def logout(request: Request) -> Response:
    s: Session = request.state.admin_session
    request.clear_session()
    log.info("admin logout (%s)", s.who)
    resp = Redirect("/admin/login", status_code=303)
    if is_htmx(request):
        resp.headers["HX-Redirect"] = "/admin/login"
    return resp


__all__ = ["AdminAuth", "LoginLimiter", "Session", "StateSessionStore", "csrf_config",
           "handle_csrf_refusal", "login", "login_form", "logout", "session_config"]
