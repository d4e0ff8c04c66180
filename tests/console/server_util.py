"""Start a real `pagedjax serve` subprocess on a free loopback port for tests.

    with start_server(tiny_ckpt, "--max-queue-len", "4") as srv:
        httpx.get(srv.url + "/health")
        srv.openai().completions.create(model=srv.model, prompt="hi", max_tokens=4)

The server gets a small compiled envelope (SMALL_ENVELOPE, overridable flag by flag),
a random API key and admin token, and the environment (PAGEDJAX_JAX_CACHE included, so
restarts reuse compiled programs). It is SIGTERMed (then killed) on exit.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SMALL_ENVELOPE = {"--max-num-seqs": "8", "--max-num-batched-tokens": "64", "--max-model-len": "512",
                  "--kv-cache-memory": "16MiB"}
READY_TIMEOUT_S = 300.0  # a cold JAX cache compiles every shape on 2 cores


@dataclass
class ServerHandle:
    url: str                      # http://127.0.0.1:PORT
    proc: subprocess.Popen
    api_key: str | None
    admin_token: str
    logs: list[str] = field(default_factory=list)  # stdout+stderr lines, appended live
    model: str = ""
    state_dir: Path | None = None  # its --state-dir

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw: Any) -> httpx.Client:
        """httpx client with the base URL and the API key header."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60.0), **kw)

    def openai(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 60.0), **kw)

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample's value from /metrics (exact name, e.g. 'pagedjax:kv_blocks', and labels)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})? (\S+)$", line)
            if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))).strip(",") == want:
                return float(m.group(3))
        return None

    def log_text(self) -> str:
        return "\n".join(self.logs)

    def access_records(self) -> list[dict]:
        import json

        return [json.loads(line) for line in list(self.logs) if line.startswith("{") and '"route"' in line]

    def access_record(self, request_id: str, timeout: float = 10.0) -> dict:
        """The access-log line of one request (written just after its response ends)."""
        deadline = time.monotonic() + timeout
        while True:
            for rec in self.access_records():
                if rec.get("id") == request_id:
                    return rec
            if time.monotonic() > deadline:
                raise LookupError(f"no access-log line for request {request_id!r}")
            time.sleep(0.05)

    def wait_metric(self, name: str, want: float, timeout: float = 10.0, **labels: str) -> float | None:
        """Polls /metrics until the sample equals `want` (or the timeout); returns the last value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, **labels)
            if value == want or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait for it; kills it if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command() -> list[str]:
    """The checkout's CLI: run with cwd = the repository root, `-m` imports the code under
    test, not the copy `pip install .` put in site-packages (which .venv/bin/pagedjax runs)."""
    return [sys.executable, "-m", "runtime.cli"]


def _args(checkpoint: Path | None, extra: tuple[str, ...], port: int, api_key: str | None,
          admin: str | None, subcommand: tuple[str, ...] = ("serve",), state_dir: Path | None = None) -> list[str]:
    args = [*_command(), *subcommand, "--host", "127.0.0.1", "--port", str(port)]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    given = {a.split("=")[0] for a in extra if a.startswith("--")}
    for flag, value in SMALL_ENVELOPE.items():
        if flag not in given:
            args += [flag, value]
    if api_key and "--api-key" not in given:
        args.append(f"--api-key={api_key}")  # "=": a random key may begin with "-"
    if admin and "--admin-token" not in given:
        args.append(f"--admin-token={admin}")
    if state_dir is not None and "--state-dir" not in given:
        args += ["--state-dir", str(state_dir)]
    return args + list(extra)


def _pump(proc: subprocess.Popen, logs: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        logs.append(line.rstrip("\n"))


@contextmanager
def start_server(checkpoint: Path | None, *extra_args: str, env: dict[str, str] | None = None,
                 api_key: str | None = "auto", admin_token: str | None = "auto",
                 ready_timeout: float = READY_TIMEOUT_S, wait_ready: bool = True,
                 subcommand: tuple[str, ...] = ("serve",), state_dir: Path | None = None
                 ) -> Iterator[ServerHandle]:
    """Run `pagedjax serve` until the block exits (SIGTERM, then kill). checkpoint None: no
    --checkpoint (the default model, resolved from the repository root). api_key: "auto" (a
    random key), a key, or None (no key). admin_token: the same, except None lets the server
    generate one (read back from its "admin token: ..." line). wait_ready=False returns as soon as the socket
    answers (/health may still be 503). subcommand: ("fleet", "serve") runs the fleet gateway.
    state_dir: the operator state (policy, audit, operators, keys); None gives each server a
    fresh one, so no test inherits another's policy."""
    state_dir = state_dir or Path(tempfile.mkdtemp(prefix="pagedjax-state-"))
    key = "k" + secrets.token_urlsafe(12) if api_key == "auto" else api_key  # (never a leading "-")
    admin = "t" + secrets.token_urlsafe(12) if admin_token == "auto" else admin_token
    for attempt in range(3):  # the free port can be taken between probe and bind
        port = free_port()
        full_env = {k: v for k, v in os.environ.items() if k not in ("PAGEDJAX_API_KEY", "PAGEDJAX_ADMIN_TOKEN")}
        full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        proc = subprocess.Popen(_args(checkpoint, extra_args, port, key, admin, subcommand, state_dir),
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=full_env, cwd=Path(__file__).parents[2])
        handle = ServerHandle(f"http://127.0.0.1:{port}", proc, key, admin or "",
                              model=_model_name(checkpoint, extra_args), state_dir=state_dir)
        threading.Thread(target=_pump, args=(proc, handle.logs), daemon=True).start()
        try:
            _wait(handle, ready_timeout, wait_ready)
        except PortTaken:
            handle.stop(signal.SIGKILL)
            continue
        except BaseException:
            handle.stop(signal.SIGKILL)
            raise
        break
    else:
        raise RuntimeError("could not bind a free port in 3 attempts")
    if not handle.admin_token:
        handle.admin_token = next((m.group(1) for line in handle.logs
                                   if (m := re.match(r"admin token: (\S+)$", line))), "")
    try:
        yield handle
    finally:
        handle.stop()


class PortTaken(Exception):
    pass


def _model_name(checkpoint: Path | None, extra: tuple[str, ...]) -> str:
    for i, a in enumerate(extra):
        if a.startswith("--served-model-name="):
            return a.split("=", 1)[1]
        if a == "--served-model-name" and i + 1 < len(extra):
            return extra[i + 1]
    if checkpoint is None:
        from runtime.checkpoint.pull import default_checkpoint

        return default_checkpoint().name
    return Path(checkpoint).resolve().name


def _wait(h: ServerHandle, timeout: float, ready: bool) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if h.proc.poll() is not None:
            time.sleep(0.2)  # let the pump drain the last lines
            if "address already in use" in h.log_text().lower():
                raise PortTaken()
            raise RuntimeError(f"pagedjax serve exited with {h.proc.returncode}:\n" + "\n".join(h.logs[-30:]))
        try:
            r = httpx.get(h.url + "/health", timeout=2)
            if r.status_code == 200 or not ready:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"pagedjax serve not ready after {timeout:.0f} s:\n" + "\n".join(h.logs[-30:]))
