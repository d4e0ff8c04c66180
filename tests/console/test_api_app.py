"""In-process checks of the app factory contract, settings and error hygiene (no subprocess,
no model: a stub engine stands in where one is needed)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from litestar.testing import TestClient

import console.api
from console.app import create_app
from console.assets import static_dir
from console.settings import ADMIN_TOKEN_ENV, ServerSettings, resolve_admin_token


class StubEngine:
    """Just enough of the web layer's engine interface (AsyncEngine, FleetClient) for
    /v1/models and the readiness checks."""

    max_model_len = 512

    def __init__(self) -> None:
        self.accepting, self.started, self.stopped = True, False, False

    def has_unfinished(self) -> bool:
        return False

    def start(self) -> None:
        self.started = True

    def stop(self, grace_s: float = 0.0) -> None:
        self.accepting, self.stopped = False, True


def _settings(**kw) -> ServerSettings:
    return ServerSettings(**{"model_name": "stub", "admin_token": "admin-secret", "api_key": "api-secret", **kw})


def test_contract_without_engine_is_warming_up():
    app = create_app(_settings(checkpoint=Path("/ckpt/stub")))
    with TestClient(app) as c:
        st = app.state
        assert st.engine is None and st.ready is False and st.settings.model_name == "stub" and st.started_at > 0
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "warming_up"
        r = c.get("/v1/models", headers={"Authorization": "Bearer api-secret"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up"
        assert c.get("/schema/openapi.json").status_code == 200
        assert c.get("/metrics").status_code == 200
        # The console vendors htmx under console/static (VENDORED.md): served byte for byte.
        r = c.get("/static/htmx.min.js")
        assert r.status_code == 200 and r.content == (static_dir() / "htmx.min.js").read_bytes()
        assert "javascript" in r.headers["content-type"]
        assert c.get("/static/no-such-file.js").status_code == 404


def test_given_engine_is_started_served_and_stopped():
    engine = StubEngine()
    app = create_app(_settings(), engine=engine)
    with TestClient(app) as c:
        assert engine.started and app.state.ready
        assert c.get("/health").json()["status"] == "ok"
        r = c.get("/v1/models", headers={"Authorization": "Bearer api-secret"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "stub"
        # the admin token does not open /v1, and the API key is not the admin token
        assert c.get("/v1/models", headers={"Authorization": "Bearer admin-secret"}).status_code == 401
    assert engine.stopped


def test_unexpected_error_is_500_without_details(monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("secret internals at 0xdeadbeef")

    monkeypatch.setattr(console.api.S, "decode_body", boom)
    app = create_app(_settings(), engine=StubEngine())
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": "stub", "prompt": "x"},
                   headers={"Authorization": "Bearer api-secret"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "secret" not in r.text and "Traceback" not in r.text


def test_draining_answers_503():
    engine = StubEngine()
    app = create_app(_settings(), engine=engine)
    with TestClient(app) as c:
        from console.app import drain

        drain(app, 0.0)
        assert c.get("/health").json()["status"] == "draining"
        r = c.post("/v1/completions", json={}, headers={"Authorization": "Bearer api-secret"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"


def test_settings_validation():
    with pytest.raises(ValueError, match="admin_token"):
        ServerSettings(admin_token="")
    with pytest.raises(ValueError, match="shutdown_grace_s"):
        ServerSettings(shutdown_grace_s=-1)
    with pytest.raises(ValueError, match="api_key"):
        ServerSettings(api_key="")


def test_admin_token_generated_and_printed_once(monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    out = io.StringIO()
    token, generated = resolve_admin_token(None, out)
    assert generated and out.getvalue() == f"admin token: {token}\n"
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
    out = io.StringIO()
    assert resolve_admin_token(None, out) == ("from-env", False) and out.getvalue() == ""
    assert resolve_admin_token("given", out) == ("given", False)
