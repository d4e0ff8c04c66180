"""Start-up and shutdown of a real `pagedjax serve`: a bad checkpoint is one line and exit 2;
/health is 503 until warm-up ends; SIGTERM drains (in-flight requests finish, or are aborted
past the grace period; new ones get 503) and the process exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from litestar.testing import TestClient

from console.app import create_app
from console.settings import ServerSettings
from runtime.config import SchedulerConfig
from tests.console.server_util import SMALL_ENVELOPE, ServerHandle, _command, start_server
from tests.engine_util import make_engine

TOKENS = 200


def test_bad_checkpoint_is_one_line_exit_2(tmp_path):
    r = subprocess.run([*_command(), "serve", "--checkpoint", str(tmp_path / "missing")], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("pagedjax: error:") and "missing" in lines[-1]
    assert "Traceback" not in r.stderr


def test_warming_up_then_ready(tiny_ckpt, monkeypatch):
    """The app's own start-up (the loader thread's load, warm-up, start) with the engine's
    warm-up held on an event: the 503s are observed while it is held, not raced against a
    warm-up that a warm compilation cache can finish before the first request."""
    llm = make_engine(tiny_ckpt)
    entered, release = threading.Event(), threading.Event()

    def held_warmup(progress: bool = True) -> None:
        entered.set()
        assert release.wait(120), "the test never released the warm-up"
        llm.warmup_seconds = 0.01  # compiling is not under test here (first use compiles)

    monkeypatch.setattr(llm, "warmup", held_warmup)
    settings = ServerSettings(model_name="tiny", admin_token="admin-secret", api_key="api-secret")
    headers = {"Authorization": "Bearer api-secret"}
    app = create_app(settings, engine_factory=lambda: llm)
    with TestClient(app) as c:
        try:
            assert entered.wait(120), "the loader thread never reached warm-up"
            first = c.get("/health")
            assert first.status_code == 503 and first.json()["status"] == "warming_up"
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up" and "retry-after" in r.headers
        finally:
            release.set()
        app.state.loader.join(120)  # warm-up returned: the loader starts the engine and says ready
        assert not app.state.loader.is_alive() and not app.state.get("failed")
        assert c.get("/health").json()["status"] == "ok"
        assert c.get("/v1/models", headers=headers).status_code == 200


def test_generated_admin_token_is_printed_once(tiny_ckpt):
    with start_server(tiny_ckpt, "--no-warmup", admin_token=None) as server:  # (warm-up prints nothing of it)
        # nobody chose an admin token: one was generated and printed exactly once
        printed = [line for line in server.logs if line.startswith("admin token: ")]
        assert len(printed) == 1 and server.admin_token and server.admin_token in printed[0]
        assert sum(server.admin_token in line for line in server.logs) == 1


def test_no_warmup_is_ready_without_compiling_then_compiles_on_first_use(tiny_ckpt):
    with start_server(tiny_ckpt, "--no-warmup") as server:
        deadline = time.monotonic() + 10  # the line follows readiness by a moment
        while not any("no warm-up: step shapes compile on first use" in line for line in server.logs):
            assert time.monotonic() < deadline, server.log_text()[-2000:]
            time.sleep(0.05)
        assert server.metric("pagedjax:compilations_total") == 0
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120,
                       json={"model": server.model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert server.metric("pagedjax:compilations_total") >= 1  # the shapes it used, no more
        env = SchedulerConfig(*(int(SMALL_ENVELOPE[f]) for f in ("--max-num-seqs", "--max-num-batched-tokens",
                                                                 "--max-model-len")))
        assert server.metric("pagedjax:compilations_total") < len(env.bucket_pairs())  # not a full warm-up


def _stream(server: ServerHandle, i: int, started: threading.Semaphore) -> list[str]:
    body = {"model": server.model, "messages": [{"role": "user", "content": f"count {i}"}], "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    started.release()  # the role chunk: the request is in the engine
    return events


def _start_streams(server: ServerHandle, n: int) -> tuple[ThreadPoolExecutor, list]:
    started = threading.Semaphore(0)
    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(_stream, server, i, started) for i in range(n)]
    deadline = time.monotonic() + 60
    for _ in range(n):
        while not started.acquire(timeout=0.1):
            for f in futures:
                if f.done():
                    f.result()  # raises what went wrong in the stream
            assert time.monotonic() < deadline, "streams did not start"
    return pool, futures


def _wait_draining(server: ServerHandle) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = httpx.get(server.url + "/health", timeout=5)
        if r.status_code == 503:
            assert r.json()["status"] == "draining"
            return
        time.sleep(0.01)
    raise AssertionError("the server never reported draining")


def test_sigterm_drains_in_flight_then_exits_0(tiny_ckpt):
    with start_server(tiny_ckpt, "--shutdown-grace", "60") as server:
        pool, futures = _start_streams(server, 10)  # 8 running, 2 queued
        server.proc.send_signal(signal.SIGTERM)
        _wait_draining(server)
        r = httpx.post(server.url + "/v1/completions", headers=server.headers,
                       json={"model": server.model, "prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        for f in futures:
            events = f.result(timeout=120)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks)
            assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        pool.shutdown()
        assert server.proc.wait(60) == 0
        assert "draining" in server.log_text() and "Traceback" not in server.log_text()


def test_sigterm_aborts_what_outlives_the_grace(tiny_ckpt):
    with start_server(tiny_ckpt, "--shutdown-grace", "0") as server:
        pool, futures = _start_streams(server, 4)
        server.proc.send_signal(signal.SIGTERM)
        for f in futures:
            events = f.result(timeout=60)
            assert events[-1] == "[DONE]"
            errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
            assert errors and errors[0]["code"] == "aborted"
        pool.shutdown()
        assert server.proc.wait(60) == 0
