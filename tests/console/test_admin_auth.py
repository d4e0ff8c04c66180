"""Console access control: login, the session cookie (server-side sessions kept in the state
file, so a restart keeps them), logout, CSRF (Litestar's middleware), the failed-login rate
limit, and the separation of the admin token from the REST API key."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient

from console.app import create_app
from console.settings import ServerSettings
from console.state import StateStore
from tests.console.admin_util import (
    ADMIN_TOKEN,
    API_KEY,
    console_client,
    csrf_of,
    logged_in,
    login,
    login_nonce,
)
from tests.engine_util import make_engine

PAGES = ["/admin", "/admin/requests", "/admin/policy", "/admin/policy.json", "/admin/prefix-cache",
         "/admin/prefix-cache/flush", "/admin/model", "/admin/blocks?cell=0"]
POSTS = ["/admin/policy", "/admin/prefix-cache/flush", "/admin/requests/some-id/abort", "/admin/logout"]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture()
def client(engine):
    with console_client(engine) as c:
        yield c


@pytest.mark.parametrize("path", PAGES)
def test_pages_redirect_to_login_without_a_session(client, path):
    r = client.get(path, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"].startswith("/admin/login?next=")


def test_htmx_request_without_session_gets_hx_redirect(client):
    r = client.get("/admin", headers={"HX-Request": "true"}, follow_redirects=False)
    assert r.status_code == 401 and r.headers["HX-Redirect"] == "/admin/login"


@pytest.mark.parametrize("path", POSTS)
def test_posts_without_session_are_refused(client, engine, path):
    before = engine.policy
    r = client.post(path, data={"watermark": "0.3"}, follow_redirects=False)
    assert r.status_code == 403
    assert engine.policy == before


def test_wrong_token_is_refused_and_logged(client, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedjax.admin.auth"):
        r = login(client, token="not-the-token")
    assert r.status_code == 401 and "Invalid or revoked token" in r.text
    assert "pagedjax_admin" not in r.headers.get("set-cookie", "")
    assert any("admin login failed" in rec.getMessage() for rec in caplog.records)
    assert client.get("/admin", follow_redirects=False).status_code == 303


def test_right_token_sets_a_strict_httponly_expiring_cookie(client):
    r = login(client, next_path="/admin/policy")
    assert r.status_code == 303 and r.headers["location"] == "/admin/policy"
    cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("pagedjax_admin="))
    low = cookie.lower()
    assert "httponly" in low and "samesite=strict" in low and "max-age=" in low and "path=/admin" in low
    assert client.get("/admin", follow_redirects=False).status_code == 200


def test_tampered_cookie_is_rejected(client):
    login(client)
    value = client.cookies.get("pagedjax_admin")
    client.cookies.clear()
    client.cookies.set("pagedjax_admin", value[:-2] + ("AA" if not value.endswith("AA") else "BB"), path="/admin")
    assert client.get("/admin", follow_redirects=False).status_code == 303


def test_login_form_needs_its_nonce(client):
    r = client.post("/admin/login", data={"token": ADMIN_TOKEN}, follow_redirects=False)
    assert r.status_code == 403
    assert client.get("/admin", follow_redirects=False).status_code == 303


def test_logout_revokes_the_session(client):
    csrf = logged_in(client)
    stolen = client.cookies.get("pagedjax_admin")
    r = client.post("/admin/logout", data={"_csrf_token": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin/login"
    assert client.get("/admin", follow_redirects=False).status_code == 303
    # Replaying the old cookie does not help: the server forgot the session.
    client.cookies.set("pagedjax_admin", stolen, path="/admin")
    assert client.get("/admin", follow_redirects=False).status_code == 303


def test_logout_needs_csrf(client):
    logged_in(client)
    assert client.post("/admin/logout", follow_redirects=False).status_code == 403
    assert client.get("/admin", follow_redirects=False).status_code == 200


def test_failed_logins_are_rate_limited(client, caplog):
    for _ in range(5):
        assert login(client, token="wrong").status_code == 401
    with caplog.at_level(logging.WARNING, logger="pagedjax.admin.auth"):
        r = login(client)  # even the right token waits out the window
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    assert any("rate limited" in rec.getMessage() for rec in caplog.records)
    assert client.get("/admin", follow_redirects=False).status_code == 303


def test_open_redirect_is_not_possible(client):
    nonce = login_nonce(client)
    r = client.post("/admin/login", data={"token": ADMIN_TOKEN, "_csrf_token": nonce, "next": "//evil.example/x"},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin"


@pytest.mark.parametrize("headers", [{}, {"X-CSRF-Token": "wrong"}])
def test_state_change_without_valid_csrf_is_403_and_changes_nothing(client, engine, headers):
    logged_in(client)
    before, audit = engine.policy, client.app.state.store.audit_count()
    r = client.post("/admin/policy", data={"watermark": "0.3"}, headers=headers)
    assert r.status_code == 403
    assert engine.policy == before and client.app.state.store.audit_count() == audit
    with engine.lock:
        cached = engine.pool.num_cached_blocks
    assert client.post("/admin/prefix-cache/flush", headers=headers).status_code == 403
    assert engine.pool.num_cached_blocks == cached


def test_csrf_token_in_form_field_or_header_is_accepted(client, engine):
    csrf = logged_in(client)
    r = client.post("/admin/policy", data={"watermark": "0.11", "_csrf_token": csrf}, follow_redirects=False)
    assert r.status_code == 303 and engine.policy.watermark == 0.11
    r = client.post("/admin/policy", data={"watermark": "0.12"}, headers={"X-CSRF-Token": csrf, "HX-Request": "true"})
    assert r.status_code == 200 and engine.policy.watermark == 0.12


def test_api_key_does_not_open_admin(client):
    r = client.get("/admin", headers={"Authorization": f"Bearer {API_KEY}"}, follow_redirects=False)
    assert r.status_code == 303
    assert login(client, token=API_KEY).status_code == 401


def test_admin_session_does_not_authorise_v1(client):
    logged_in(client)
    session = client.cookies.get("pagedjax_admin")
    # The cookie is scoped to /admin, so a browser never sends it to /v1; send it anyway.
    r = client.get("/v1/models", headers={"Cookie": f"pagedjax_admin={session}"})
    assert r.status_code == 401
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_policy_json_requires_session(client, engine):
    assert client.get("/admin/policy.json", follow_redirects=False).status_code == 303
    logged_in(client)
    r = client.get("/admin/policy.json")
    assert r.status_code == 200 and r.json() == engine.policy.to_json()
    assert csrf_of(client.get("/admin").text)


# --- sessions in the state file (Litestar's server-side sessions) and Litestar's CSRF ----------------

@contextmanager
def console_on(state_dir: Path, admin_token: str = ADMIN_TOKEN, jar: httpx.Cookies | None = None
               ) -> Iterator[TestClient]:
    """The console alone (no engine) with its state file in `state_dir`: one server start; `jar`:
    a browser's cookies from before."""
    settings = ServerSettings(admin_token=admin_token, model_name="tiny", checkpoint=Path("tiny"),
                              access_log=False, warmup=False)
    store = StateStore.open(state_dir)
    try:
        with TestClient(create_app(settings, store=store)) as c:
            if jar is not None:
                c.cookies = jar
            yield c
    finally:
        store.close()


def add_key(c: TestClient, name: str, headers: dict[str, str]) -> int:
    return c.post("/admin/keys", data={"name": name}, headers={"HX-Request": "true", **headers}).status_code


def test_a_login_survives_a_server_restart(tmp_path):
    with console_on(tmp_path) as c:
        csrf = logged_in(c)
        jar = c.cookies
    with console_on(tmp_path, jar=jar) as c:   # a new app and state connection on the same file
        assert c.get("/admin/operators", follow_redirects=False).status_code == 200
        assert csrf_of(c.get("/admin/keys").text) == csrf   # the browser's CSRF token is still good
        assert add_key(c, "after-restart", {"X-CSRF-Token": csrf}) == 200
        assert [k.name for k in c.app.state.store.keys()] == ["after-restart"]
        assert c.post("/admin/logout", data={"_csrf_token": csrf}, follow_redirects=False).status_code == 303
        jar = c.cookies
    with console_on(tmp_path, jar=jar) as c:   # logged out stays logged out
        assert c.get("/admin", follow_redirects=False).status_code == 303


def test_a_post_without_the_csrf_token_is_refused_after_a_restart_too(tmp_path):
    with console_on(tmp_path) as c:
        logged_in(c)
        jar = c.cookies
    with console_on(tmp_path, jar=jar) as c:
        assert c.get("/admin/keys", follow_redirects=False).status_code == 200   # logged in
        for headers in ({}, {"X-CSRF-Token": "not-the-token"}):
            assert add_key(c, "nope", headers) == 403
        assert c.app.state.store.keys() == []


def test_another_admin_token_after_a_restart_ends_the_bootstrap_session(tmp_path):
    with console_on(tmp_path) as c:
        logged_in(c)
        jar = c.cookies
    with console_on(tmp_path, admin_token="a-new-admin-token", jar=jar) as c:
        assert c.get("/admin", follow_redirects=False).status_code == 303
    with console_on(tmp_path, jar=jar) as c:   # and it is gone, not just refused
        assert c.get("/admin", follow_redirects=False).status_code == 303


def test_only_logged_in_sessions_are_stored_and_only_as_hashes_under_a_new_id(tmp_path):
    def rows(c):
        return c.app.state.store._read("SELECT count(*) FROM console_sessions")[0][0]

    with console_on(tmp_path) as c:
        r = c.get("/admin/login")
        assert "pagedjax_admin" not in r.headers.get("set-cookie", "") and rows(c) == 0
        assert c.get("/admin", follow_redirects=False).status_code == 303 and rows(c) == 0
        # Session fixation: a cookie planted in the browser before logging in is never promoted.
        nonce, csrf_cookie = login_nonce(c), c.cookies.get("pagedjax_csrf")
        c.cookies.clear()
        r = c.post("/admin/login", data={"token": ADMIN_TOKEN, "_csrf_token": nonce}, follow_redirects=False,
                   headers={"Cookie": f"pagedjax_csrf={csrf_cookie}; pagedjax_admin=chosen-by-an-attacker"})
        assert r.status_code == 303
        sid = r.cookies.get("pagedjax_admin")
        assert sid and sid != "chosen-by-an-attacker" and rows(c) == 1
        assert c.app.state.store.session("chosen-by-an-attacker") is None
        assert c.get("/admin/operators", follow_redirects=False).status_code == 200 and rows(c) == 1
    raw = b"".join(f.read_bytes() for f in tmp_path.iterdir())
    assert sid.encode() not in raw


def test_a_csrf_token_from_another_browser_is_refused(client):
    mine, theirs = logged_in(client), None
    with TestClient(client.app) as other:
        theirs = logged_in(other)
    assert mine != theirs
    assert client.post("/admin/prefix-cache/flush", headers={"X-CSRF-Token": theirs}).status_code == 403


def test_the_session_cookie_is_secure_when_the_request_came_over_https(client):
    with TestClient(client.app, base_url="https://testserver.local") as tls:
        r = login(tls)
        cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("pagedjax_admin="))
        assert "secure" in cookie.lower() and tls.get("/admin", follow_redirects=False).status_code == 200
    cookie = next(c for c in login(client).headers.get_list("set-cookie") if c.startswith("pagedjax_admin="))
    assert "secure" not in cookie.lower()
