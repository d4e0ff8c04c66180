"""Operator login for /admin: operator tokens, roles, signed server-side sessions, CSRF and
a failed-login rate limit.

Who may log in: the --admin-token (the bootstrap operator "admin"), or a named operator's
token from the state file (`pagedjax admin add-operator`; console/state.py). A viewer sees
every page and can change nothing (every POST but logout is 403); an operator can change
the policy, abort requests and flush the prefix cache.

Operator tokens and API keys are separate secrets: only a session cookie (made by
logging in) opens /admin, and that cookie is scoped to /admin so it is never even sent
with /v1 calls. Sessions live in this process's memory, so logout and restarts really end
them, and every request re-reads its operator's row, so a revoke ends their sessions at
once (from the console or from `pagedjax admin revoke-operator` in another process).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from litestar import Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.response import Redirect, Template

from console.render import is_htmx
from console.state import BOOTSTRAP

log = logging.getLogger("pagedjax.admin.auth")

SESSION_COOKIE = "pagedjax_admin"
LOGIN_COOKIE = "pagedjax_login"   # pre-session CSRF nonce for the login form itself
CSRF_FIELD = "_csrf"
CSRF_HEADER = "x-csrf-token"
SESSION_TTL_S = 8 * 3600
LOGIN_NONCE_TTL_S = 15 * 60
MAX_FAILURES = 5                  # failed logins per client per window before refusing
FAILURE_WINDOW_S = 60.0
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC = "admin_public"           # route opt key: reachable without a session
ANY_ROLE = "admin_any_role"       # route opt key: a POST viewers may make too (logout)


@dataclass
class Session:
    sid: str
    csrf: str
    who: str                  # the operator's name: what the audit log records
    created: float
    expires: float
    role: str = "operator"    # viewer | operator
    client: str = ""

    @property
    def can_write(self) -> bool:
        return self.role == "operator"


@dataclass
class LoginLimiter:
    """Sliding-window count of failed logins per client address."""

    max_failures: int = MAX_FAILURES
    window_s: float = FAILURE_WINDOW_S
    _fails: dict[str, deque[float]] = field(default_factory=dict)

    def retry_after(self, client: str, now: float | None = None) -> float:
        """Seconds until `client` may try again (0 when allowed)."""
        now = time.monotonic() if now is None else now
        q = self._fails.get(client)
        if not q:
            return 0.0
        while q and now - q[0] > self.window_s:
            q.popleft()
        if len(q) < self.max_failures:
            return 0.0
        return max(0.0, self.window_s - (now - q[0]))

    def fail(self, client: str) -> int:
        if len(self._fails) > 10_000:  # many distinct clients: forget those with no recent failure
            now = time.monotonic()
            for k in [k for k, q in self._fails.items() if not q or now - q[-1] > self.window_s]:
                del self._fails[k]
        q = self._fails.setdefault(client, deque())
        q.append(time.monotonic())
        return len(q)

    def reset(self, client: str) -> None:
        self._fails.pop(client, None)


class AdminAuth:
    """Per-app session store and login limiter (one per admin_router())."""

    def __init__(self, ttl_s: float = SESSION_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.sessions: dict[str, Session] = {}
        self.limiter = LoginLimiter()

    # --- signing ------------------------------------------------------------------------
    @staticmethod
    def _secret(request: Request) -> bytes:
        return request.app.state.settings.session_secret

    @staticmethod
    def sign(secret: bytes, value: str) -> str:
        mac = hmac.new(secret, value.encode(), hashlib.sha256).digest()
        return f"{value}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"

    @classmethod
    def unsign(cls, secret: bytes, signed: str | None) -> str | None:
        if not signed or "." not in signed:
            return None
        value = signed.rsplit(".", 1)[0]
        return value if hmac.compare_digest(cls.sign(secret, value), signed) else None

    # --- sessions -----------------------------------------------------------------------
    def create(self, who: str, role: str = "operator", client: str = "") -> Session:
        now = time.time()
        self._expire(now)
        s = Session(secrets.token_urlsafe(24), secrets.token_urlsafe(24), who, now, now + self.ttl_s, role, client)
        self.sessions[s.sid] = s
        return s

    def end_sessions_of(self, who: str) -> int:
        gone = [k for k, s in self.sessions.items() if s.who == who]
        for k in gone:
            del self.sessions[k]
        return len(gone)

    def _expire(self, now: float) -> None:
        for sid in [k for k, s in self.sessions.items() if s.expires <= now]:
            del self.sessions[sid]

    def session_for(self, request: Request) -> Session | None:
        sid = self.unsign(self._secret(request), request.cookies.get(SESSION_COOKIE))
        s = self.sessions.get(sid) if sid else None
        if s is None or s.expires <= time.time():
            return None
        return s

    def session_cookie(self, request: Request, s: Session | None) -> Cookie:
        secure = request.url.scheme == "https"
        if s is None:  # logout: expire it in the browser too
            return Cookie(SESSION_COOKIE, path="/admin", value="", max_age=0, httponly=True,
                          samesite="strict", secure=secure)
        return Cookie(SESSION_COOKIE, path="/admin", value=self.sign(self._secret(request), s.sid),
                      max_age=int(self.ttl_s), httponly=True, samesite="strict", secure=secure)

    # --- the gate (router before_request hook) -----------------------------------------------
    async def before_request(self, request: Request) -> Response | None:
        """Every /admin request: a valid session, and for state changes a CSRF token."""
        if request.route_handler.opt.get(PUBLIC):
            return None
        s = self.session_for(request)
        if s is not None and s.who != BOOTSTRAP and request.app.state.store.operator(s.who) is None:
            log.info("admin session of %s ended: the operator was revoked", s.who)
            self.end_sessions_of(s.who)
            s = None
        if s is None:
            return login_required(request)
        request.state.admin_session = s
        if request.method not in SAFE_METHODS:
            if not await csrf_ok(request, s.csrf):
                log.warning("admin %s %s refused: missing or wrong CSRF token (%s)", request.method,
                            request.url.path, client_of(request))
                return Response("CSRF token missing or invalid", status_code=403, media_type="text/plain")
            if not s.can_write and not request.route_handler.opt.get(ANY_ROLE):
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


async def csrf_ok(request: Request, expected: str) -> bool:
    given = request.headers.get(CSRF_HEADER)
    if not given:
        form = await request.form()
        given = form.get(CSRF_FIELD)
    return isinstance(given, str) and bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def _safe_next(nxt: str | None) -> str:
    # Only same-site admin paths: never an open redirect to "//evil" or "https://...".
    if nxt and nxt.startswith("/admin") and not nxt.startswith("//") and "\\" not in nxt:
        return nxt
    return "/admin"


def _auth(request: Request) -> AdminAuth:
    return request.route_handler.opt["admin_auth"]


def _login_page(request: Request, *, error: str | None, status: int, nxt: str,
                retry_after: float = 0.0) -> Template:
    secret = AdminAuth._secret(request)
    nonce = secrets.token_urlsafe(18)
    cookie = Cookie(LOGIN_COOKIE, path="/admin/login", value=AdminAuth.sign(secret, f"{nonce}.{int(time.time())}"),
                    max_age=LOGIN_NONCE_TTL_S, httponly=True, samesite="strict",
                    secure=request.url.scheme == "https")
    headers = {"Cache-Control": "no-store"}
    if retry_after:
        headers["Retry-After"] = str(int(retry_after) + 1)
    return Template("admin/login.html", context={"error": error, "nonce": nonce, "next": nxt, "page": "login"},
                    status_code=status, cookies=[cookie], headers=headers)


def _nonce_ok(request: Request, form_nonce: Any) -> bool:
    raw = AdminAuth.unsign(AdminAuth._secret(request), request.cookies.get(LOGIN_COOKIE))
    if not raw or not isinstance(form_nonce, str):
        return False
    nonce, _, issued = raw.rpartition(".")
    fresh = issued.isdigit() and time.time() - int(issued) < LOGIN_NONCE_TTL_S
    return fresh and hmac.compare_digest(nonce.encode(), form_nonce.encode())


def _operator_for(request: Request, token: str) -> tuple[str | None, str]:
    """(name, role) of the operator whose token this is, else (None, "")."""
    if not token:
        return None, ""
    expected: str = request.app.state.settings.admin_token
    if hmac.compare_digest(token.encode(), expected.encode()):
        return BOOTSTRAP, "operator"
    op = request.app.state.store.verify_operator(token)
    return (op.name, op.role) if op else (None, "")


@get("/login", opt={PUBLIC: True}, name="admin_login_form", sync_to_thread=False)
def login_form(request: Request, next: str | None = None) -> Response:  # noqa: A002 -- the query name
    if _auth(request).session_for(request) is not None:
        return Redirect(_safe_next(next), status_code=303)
    return _login_page(request, error=None, status=200, nxt=_safe_next(next))


@post("/login", opt={PUBLIC: True}, name="admin_login")
async def login(request: Request) -> Response:
    auth, client = _auth(request), client_of(request)
    form = await request.form()
    nxt = _safe_next(form.get("next"))
    wait = auth.limiter.retry_after(client)
    if wait:
        log.warning("admin login from %s refused: rate limited (%.0f s left)", client, wait)
        return _login_page(request, error=f"Too many failed attempts. Try again in {int(wait) + 1} s.",
                           status=429, nxt=nxt, retry_after=wait)
    if not _nonce_ok(request, form.get(CSRF_FIELD)):
        log.warning("admin login from %s refused: stale or missing login form token", client)
        return _login_page(request, error="The login form expired. Please try again.", status=403, nxt=nxt)
    token = form.get("token")
    who, role = _operator_for(request, token.strip() if isinstance(token, str) else "")
    if who is None:
        n = auth.limiter.fail(client)
        log.warning("admin login failed from %s (%d failure(s) in the last %.0f s)", client, n,
                    auth.limiter.window_s)
        return _login_page(request, error="Invalid or revoked token.", status=401, nxt=nxt)
    auth.limiter.reset(client)
    s = auth.create(who, role, client)
    log.info("admin login: %s (%s) from %s", who, role, client)
    resp = Redirect(nxt, status_code=303)
    resp.set_cookie(auth.session_cookie(request, s))
    resp.set_cookie(Cookie(LOGIN_COOKIE, path="/admin/login", value="", max_age=0))
    return resp


@post("/logout", name="admin_logout", opt={ANY_ROLE: True})
async def logout(request: Request) -> Response:
    auth = _auth(request)
    s: Session = request.state.admin_session
    auth.sessions.pop(s.sid, None)
    log.info("admin logout (%s)", s.who)
    resp = Redirect("/admin/login", status_code=303)
    resp.set_cookie(auth.session_cookie(request, None))
    if is_htmx(request):
        resp.headers["HX-Redirect"] = "/admin/login"
    return resp
