"""Server settings: one frozen record built from the `serve` flags (or directly in tests)."""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

ADMIN_TOKEN_ENV = "PAGEDJAX_ADMIN_TOKEN"
API_KEY_ENV = "PAGEDJAX_API_KEY"


@dataclass(frozen=True)
class ServerSettings:
    """Everything the web layer needs that is not the engine itself.

    Only `admin_token`, `model_name` and `checkpoint` matter to most tests; the rest have
    serving defaults. (Console sessions and the key their CSRF tokens are signed with live in
    the state file, console/state.py: a restart keeps operators logged in.)
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None              # protects /v1/* (Authorization: Bearer KEY)
    admin_token: str = field(default_factory=lambda: new_token())
    model_name: str = "pagedjax"            # the served model id (/v1/models, `model` field)
    checkpoint: Path = Path(".")
    shutdown_grace_s: float = 30.0          # SIGTERM: in-flight requests get this long to finish
    admin_token_generated: bool = False     # True when nobody chose the token (it was printed once)
    access_log: bool = True                 # one JSON line per request on `pagedjax.access`
    warmup: bool = True                     # compile every step shape before reporting ready
    retry_after_s: int = 1                  # Retry-After on 429 (the queue drains in about a step)
    reset_policy: bool = False              # start from the flags' policy, not the stored one

    def __post_init__(self) -> None:
        if not self.admin_token:
            raise ValueError("admin_token: must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty (omit it to serve without a key)")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s: must be >= 0, got {self.shutdown_grace_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be between 0 and 65535, got {self.port}")


def new_token() -> str:
    """A random URL-safe token that never begins with "-": operators paste it after a flag
    (`--admin-token X`), where argparse would take "-X..." for an option."""
    return "t" + secrets.token_urlsafe(24)


def resolve_admin_token(given: str | None, out: TextIO = sys.stderr) -> tuple[str, bool]:
    """--admin-token, else $PAGEDJAX_ADMIN_TOKEN, else a fresh one printed once to `out`.

    Returns (token, generated). Printing it (never logging it) keeps it out of log files
    that outlive the terminal session."""
    token = given or os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        return token, False
    token = new_token()
    print(f"admin token: {token}", file=out, flush=True)
    return token, True
