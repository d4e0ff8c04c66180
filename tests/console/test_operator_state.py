"""Operators, roles, API keys with limits and the durable policy, through the real app
(console.app.create_app) serving a tiny-model engine, with the state in a real SQLite file.
A second StateStore on the same file plays `pagedjax admin` in another process."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from litestar.testing import TestClient

from console.app import create_app
from console.keys import KeyGate, LimitExceeded
from console.settings import ServerSettings
from console.state import StateStore
from runtime.core.async_engine import AsyncEngine
from tests.engine_util import make_engine

REPO = Path(__file__).resolve().parents[2]
ADMIN = "bootstrap-admin-token"


def engine_for(ckpt: Path, **policy):
    return make_engine(ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, **policy)


@contextmanager
def serving(engine, state_dir: Path, **settings) -> Iterator[TestClient]:
    """The app with a running engine thread and the state file in `state_dir`."""
    s = ServerSettings(admin_token=ADMIN, model_name="tiny", warmup=False, **settings)
    app = create_app(s, engine=AsyncEngine(engine), store=StateStore.open(state_dir))
    with TestClient(app) as client:
        yield client


def log_in(client: TestClient, token: str) -> str:
    """The real login form; returns the session's CSRF token."""
    nonce = re.search(r'name="_csrf_token" value="([^"]+)"', client.get("/admin/login").text).group(1)
    r = client.post("/admin/login", data={"token": token, "_csrf_token": nonce, "next": "/admin/policy"},
                    follow_redirects=False)
    assert r.status_code == 303, r.text
    return re.search(r'"X-CSRF-Token": "([^"]+)"', client.get("/admin/policy").text).group(1)


def eventually(get, ok, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not ok(value := get()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def complete(client: TestClient, key: str | None, max_tokens: int = 4):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/completions", headers=headers,
                       json={"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "temperature": 0})


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return engine_for(tiny_ckpt)


# --- API keys ------------------------------------------------------------------------------------

def test_a_key_over_its_rpm_gets_429_naming_the_limit_while_another_key_is_served(engine, tmp_path, caplog):
    cli = StateStore.open(tmp_path)
    slow, fast = cli.add_key("slow", rpm=2), cli.add_key("fast")
    with serving(engine, tmp_path) as c, caplog.at_level(logging.INFO, logger="pagedjax.access"):
        assert complete(c, None).status_code == 401          # keys exist: the door is closed without one
        assert [complete(c, slow).status_code for _ in range(2)] == [200, 200]
        r = complete(c, slow)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["param"] == "rpm" and "2 requests per minute" in err["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert complete(c, fast).status_code == 200          # the other key is not held back
        # A request settles (tokens counted, access line written) just after its last byte is sent.
        metrics = eventually(lambda: c.get("/metrics").text, lambda t: 'key="fast",kind="completion"' in t)
        assert 'pagedjax:api_key_requests_total{key="slow",outcome="rate_limited"} 1.0' in metrics
        assert 'pagedjax:api_key_requests_total{key="slow",outcome="admitted"} 2.0' in metrics
        assert re.search(r'pagedjax:api_key_tokens_total\{key="fast",kind="completion"\} [1-9]', metrics)
        keys_logged = [re.search(r'"key": ("[^"]*"|null)', m).group(1) for m in caplog.messages if '"route"' in m]
        assert '"slow"' in keys_logged and '"fast"' in keys_logged
        # The secret is everything after the second "_" (token_urlsafe may itself contain "_").
        secrets_ = [k.split("_", 2)[2] for k in (slow, fast)]
        assert all(len(s) >= 40 for s in secrets_)
        assert not any(s in m for s in secrets_ for m in caplog.messages)
    # usage reached the state file at shutdown
    usage = {k.name: k for k in StateStore.open(tmp_path).keys()}
    assert (usage["slow"].requests, usage["slow"].rejected) == (2, 1)
    assert usage["fast"].requests == 1 and usage["fast"].completion_tokens >= 1 and usage["fast"].prompt_tokens >= 1


def test_a_revoked_key_gets_401_at_once_and_the_shared_key_keeps_working(engine, tmp_path):
    cli = StateStore.open(tmp_path)
    key = cli.add_key("k")
    with serving(engine, tmp_path, api_key="shared-key") as c:
        assert complete(c, key).status_code == 200
        assert complete(c, "shared-key").status_code == 200
        cli.revoke_key("k")                                   # from another process, while serving
        r = complete(c, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert complete(c, "shared-key").status_code == 200
        assert 'pagedjax:api_key_requests_total{key="api-key",outcome="admitted"} 2.0' in c.get("/metrics").text


def test_a_key_over_its_tpm_waits_for_its_tokens_to_age_out(engine, tmp_path):
    key = StateStore.open(tmp_path).add_key("t", tpm=10)
    with serving(engine, tmp_path) as c:
        assert complete(c, key, max_tokens=8).status_code == 200   # prompt + 8 tokens > 10
        r = complete(c, key)
        assert r.status_code == 429 and r.json()["error"]["param"] == "tpm"
        assert "limit is 10 tokens per minute" in r.json()["error"]["message"]


def test_gate_windows_slide_and_concurrency_frees_on_settle(tmp_path, monkeypatch):
    import limits.storage.memory
    from prometheus_client import CollectorRegistry

    import console.keys

    now = [1000.0]  # one clock for the gate and the `limits` windows it keeps rpm in
    clock = SimpleNamespace(time=lambda: now[0])
    monkeypatch.setattr(console.keys, "time", clock)
    monkeypatch.setattr(limits.storage.memory, "time", clock)

    def at(t):
        now[0] = 1000.0 + t

    store = StateStore.open(tmp_path)
    store.add_key("c", max_concurrent=1, rpm=3)
    gate = KeyGate(store, CollectorRegistry())
    k = store.keys()[0]
    g = gate.admit(k)
    at(1.0)
    with pytest.raises(LimitExceeded, match="max_concurrent limit is 1"):
        gate.admit(k)
    at(2.0)
    gate.settle(g, 3, 4)
    gate.settle(g, 3, 4)          # settling twice frees one slot, counts once
    at(10.0)
    gate.settle(gate.admit(k), 1, 1)
    at(20.0)
    gate.settle(gate.admit(k), 1, 1)
    at(30.0)
    with pytest.raises(LimitExceeded) as exc:
        gate.admit(k)
    assert exc.value.limit == "rpm" and exc.value.retry_after == pytest.approx(30.0)   # the 0.0 admission ages out at 60
    at(60.5)
    gate.settle(gate.admit(k), 0, 0)
    gate.flush()
    row = store.keys()[0]
    assert (row.requests, row.rejected, row.prompt_tokens, row.completion_tokens) == (4, 2, 5, 6)


def test_gate_tpm_waits_until_enough_tokens_age_out(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry

    import console.keys

    now = [0.0]
    monkeypatch.setattr(console.keys, "time", SimpleNamespace(time=lambda: now[0]))
    store = StateStore.open(tmp_path)
    store.add_key("t", tpm=100)
    gate, k = KeyGate(store, CollectorRegistry()), store.keys()[0]
    for t, n in ((0.0, 60), (10.0, 30), (20.0, 50)):   # 140 tokens: the last response passed the limit
        now[0] = t
        gate.settle(gate.admit(k), n, 0)
    now[0] = 30.0
    with pytest.raises(LimitExceeded, match="used 140 tokens") as exc:
        gate.admit(k)
    assert exc.value.limit == "tpm" and exc.value.retry_after == pytest.approx(30.0)  # 60 of them leave at 60
    now[0] = 60.0
    gate.settle(gate.admit(k), 0, 0)


# --- operators and roles ----------------------------------------------------------------------------

def test_a_viewer_sees_pages_but_every_change_is_403_and_nothing_changes(engine, tmp_path):
    token = StateStore.open(tmp_path).add_operator("vera", "viewer")
    with serving(engine, tmp_path) as c:
        csrf = log_in(c, token)
        page = c.get("/admin/policy").text
        assert 'id="read-only"' in page and "<fieldset disabled" in page and "vera" in page
        for path in ("/admin", "/admin/requests", "/admin/audit", "/admin/keys", "/admin/operators"):
            assert c.get(path).status_code == 200, path
        before, rows = engine.policy, c.app.state.store.audit_count()
        for path, data in [("/admin/policy", {"watermark": "0.3"}), ("/admin/prefix-cache/flush", {}),
                           ("/admin/requests/nope/abort", {}), ("/admin/keys", {"name": "x"}),
                           ("/admin/operators", {"name": "y", "role": "operator"})]:
            r = c.post(path, data={**data, "_csrf_token": csrf}, follow_redirects=False)
            assert r.status_code == 403 and "viewer" in r.text, path
        assert engine.policy == before and c.app.state.store.audit_count() == rows
        assert c.app.state.store.keys() == [] and [o.name for o in c.app.state.store.operators()] == ["vera"]
        assert c.post("/admin/logout", data={"_csrf_token": csrf}, follow_redirects=False).status_code == 303


def test_revoking_an_operator_logs_them_out_at_once(engine, tmp_path):
    cli = StateStore.open(tmp_path)
    token = cli.add_operator("olga", "operator")
    with serving(engine, tmp_path) as c:
        log_in(c, token)
        assert c.get("/admin", follow_redirects=False).status_code == 200
        cli.revoke_operator("olga")
        r = c.get("/admin", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/admin/login")
        assert c.get("/admin/requests", headers={"HX-Request": "true"}).status_code == 401
        nonce = re.search(r'name="_csrf_token" value="([^"]+)"', c.get("/admin/login").text).group(1)
        assert c.post("/admin/login", data={"token": token, "_csrf_token": nonce}).status_code == 401


def test_concurrent_policy_changes_from_two_operators_serialise_and_are_both_audited(engine, tmp_path):
    cli = StateStore.open(tmp_path)
    tokens = {"ann": cli.add_operator("ann", "operator"), "ben": cli.add_operator("ben", "operator")}
    with serving(engine, tmp_path) as c0:
        clients = {}
        for name, tok in tokens.items():
            c = TestClient(c0.app)   # its own cookie jar; the same app, already started by c0
            clients[name] = (c, log_in(c, tok))
        fields = {"ann": ("max_queue_len", range(100, 110)), "ben": ("max_admissions_per_step", range(1, 11))}
        errors = []

        def run(name):
            c, csrf = clients[name]
            field, values = fields[name]
            for v in values:
                r = c.post("/admin/policy", data={field: str(v), "_csrf_token": csrf}, follow_redirects=False)
                if r.status_code != 303:
                    errors.append(r.text)

        threads = [threading.Thread(target=run, args=(n,)) for n in fields]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        store = c0.app.state.store
        rows = store.audit(limit=100, action="policy")
        assert sorted(r.who for r in rows).count("ann") == 10 and [r.who for r in rows].count("ben") == 10
        assert engine.policy.max_queue_len == 109 and engine.policy.max_admissions_per_step == 10
        assert store.last_policy().policy == engine.policy.to_json()   # the stored one is the applied one


# --- restarts ------------------------------------------------------------------------------------------

def test_policy_survives_a_restart_with_its_audit_row(tiny_ckpt, tmp_path, caplog):
    token = StateStore.open(tmp_path).add_operator("rita", "operator")
    with serving(engine_for(tiny_ckpt), tmp_path) as c:
        csrf = log_in(c, token)
        r = c.post("/admin/policy", data={"watermark": "0.25", "admission_mode": "reserve", "_csrf_token": csrf},
                   follow_redirects=False)
        assert r.status_code == 303
    with caplog.at_level(logging.INFO, logger="pagedjax.state"), serving(engine_for(tiny_ckpt), tmp_path) as c:
        log_in(c, token)
        assert c.get("/admin/policy.json").json()["watermark"] == 0.25
        page = c.get("/admin/policy").text
        assert re.search(r'id="cur-watermark">\s*0.25', page) and re.search(r'id="cur-admission_mode">\s*reserve', page)
        audit = c.get("/admin/audit?action=policy").text
        assert "rita" in audit and "0.25" in audit
        restored = [m for m in caplog.messages if "restored" in m]
        assert len(restored) == 1 and "set by rita" in restored[0] and "watermark=0.25" in restored[0]
    with serving(engine_for(tiny_ckpt), tmp_path, reset_policy=True) as c:   # --reset-policy: the flags win
        log_in(c, ADMIN)
        assert c.get("/admin/policy.json").json()["watermark"] == 0.05
        assert StateStore.open(tmp_path).audit(limit=1)[0].detail["reason"] == "started with --reset-policy"


def test_audit_page_pages_and_exports(engine, tmp_path):
    cli = StateStore.open(tmp_path)
    for i in range(120):
        cli.record(f"op{i % 3}", "abort", request_id=f"r{i}")
    with serving(engine, tmp_path) as c:
        log_in(c, ADMIN)
        first = c.get("/admin/audit").text
        assert "Page 1 of 3" in first and "r119" in first and "r69" not in first
        third = c.get("/admin/audit?page=3").text
        assert "</code> r0</span>" in third and "</code> r119</span>" not in third
        csv_r = c.get("/admin/audit.csv")
        assert csv_r.headers["content-type"].startswith("text/csv") and len(csv_r.text.splitlines()) == 121
        assert c.get("/admin/audit.json?action=abort").json()[0]["detail"] == {"request_id": "r0"}


def test_cli_add_operator_prints_a_token_that_logs_in(engine, tmp_path):
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "admin", "add-operator", "cleo", "--role", "operator",
                        "--state-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert token.startswith("pjo_") and "\n" not in token and "shown only this once" in r.stderr
    with serving(engine, tmp_path) as c:
        log_in(c, token)
        assert "cleo" in c.get("/admin/operators").text
