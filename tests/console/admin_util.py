"""Shared helpers for the console tests (no tests here).

`console_app` builds the real app (console.app.create_app) with a tiny-model engine that
is *not* started: tests drive `engine.step()` themselves, so what the pages show is
deterministic. `login` goes through the real login form.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from console.app import create_app
from console.settings import ServerSettings
from runtime.core.async_engine import AsyncEngine
from runtime.core.engine import LLMEngine

ADMIN_TOKEN = "admin-token-for-tests"
API_KEY = "api-key-for-tests"


@contextmanager
def console_client(engine: LLMEngine, *, api_key: str | None = API_KEY, ckpt: Path | None = None
                   ) -> Iterator[TestClient]:
    settings = ServerSettings(admin_token=ADMIN_TOKEN, api_key=api_key, model_name="tiny",
                              checkpoint=ckpt or Path("tiny"), access_log=False, warmup=False)
    app = create_app(settings)  # no engine, no factory: the lifespan starts nothing
    with TestClient(app) as client:
        # Attached after start-up so the lifespan does not start the engine thread: tests
        # step the engine themselves and the pages show exactly what they did.
        app.state.engine = AsyncEngine(engine)
        app.state.ready = True
        yield client


def login_nonce(client: TestClient, next_path: str = "/admin") -> str:
    r = client.get(f"/admin/login?next={next_path}")
    assert r.status_code == 200, r.text
    return re.search(r'name="_csrf_token" value="([^"]+)"', r.text).group(1)


def login(client: TestClient, token: str = ADMIN_TOKEN, next_path: str = "/admin") -> Any:
    nonce = login_nonce(client, next_path)
    return client.post("/admin/login", data={"token": token, "_csrf_token": nonce, "next": next_path},
                       follow_redirects=False)


def csrf_of(html: str) -> str:
    return re.search(r'"X-CSRF-Token": "([^"]+)"', html).group(1)


def logged_in(client: TestClient) -> str:
    """Log in and return the session's CSRF token."""
    r = login(client)
    assert r.status_code == 303, r.text
    return csrf_of(client.get("/admin/model").text)
