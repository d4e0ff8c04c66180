"""`pagedjax serve`: load a checkpoint, run the app under uvicorn, drain on SIGTERM/SIGINT.

The checkpoint is loaded before the socket opens, so a bad path is one error line and
exit 2 (runtime/cli.py). Warm-up runs in the background (/health 503 meanwhile).
The first SIGTERM/SIGINT drains: new requests get 503 at once, in-flight requests get
--shutdown-grace seconds to finish, the rest are aborted, then uvicorn exits 0.
A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("pagedjax.server")


def add_serve_parser(sub: Any) -> None:
    from runtime.core.engine_args import add_engine_arguments

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API and the operator console",
                       description="Serve the OpenAI-compatible REST API (/v1), /health, /metrics and the "
                                   "operator console (/admin).")
    add_server_arguments(s)
    add_engine_arguments(s, serving=True)
    s.set_defaults(func=cmd_serve)


def add_server_arguments(s: argparse.ArgumentParser) -> None:
    """The HTTP side's flags (shared with `pagedjax fleet serve`)."""
    s.add_argument("--checkpoint", help="checkpoint directory (default: the default model, pulled if missing)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDJAX_API_KEY, else open)")
    s.add_argument("--admin-token", default=None,
                   help="operator console token (default: $PAGEDJAX_ADMIN_TOKEN, else generated and printed once)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: checkpoint dir name)")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT (default 30)")
    s.add_argument("--no-access-log", action="store_true", help="no JSON access line per request")
    s.add_argument("--no-warmup", action="store_true",
                   help="report ready without compiling every step shape first: start-up in seconds, but "
                        "each new shape compiles under the first request that needs it (pagedjax:compilations_total "
                        "moves); for development, not production")
    from console.admin_cli import add_state_dir_argument

    add_state_dir_argument(s)
    s.add_argument("--reset-policy", action="store_true",
                   help="start from the policy flags, not the last policy an operator applied (recorded as a change)")


def server_settings(args: argparse.Namespace, path: Any) -> Any:
    from console.settings import API_KEY_ENV, ServerSettings, resolve_admin_token

    token, generated = resolve_admin_token(args.admin_token)
    settings = ServerSettings(
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        admin_token=token, model_name=args.served_model_name or path.resolve().name, checkpoint=path,
        shutdown_grace_s=args.shutdown_grace, admin_token_generated=generated, access_log=not args.no_access_log,
        reset_policy=args.reset_policy, warmup=not args.no_warmup)
    if settings.api_key is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key: anyone who can reach it can use /v1", settings.host)
    return settings


def _configure_access_log() -> None:
    """Access lines are bare JSON objects on stdout: one per line, ready for a log shipper."""
    access = logging.getLogger("pagedjax.access")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def cmd_serve(args: argparse.Namespace) -> int:
    from console.admin_cli import open_store
    from console.app import create_app
    from runtime.checkpoint.pull import resolve_checkpoint
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import engine_config_from_args, load_lora_modules

    path = resolve_checkpoint(args.checkpoint)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a pagedjax checkpoint (no config.json); see `pagedjax pull`")
    store = open_store(args)  # before loading: a bad state file is one line and exit 2, not a wasted load
    settings = server_settings(args, path)
    _configure_access_log()
    llm = LLMEngine.from_checkpoint(path, engine_config_from_args(args), warmup=False, progress=sys.stderr.isatty())
    load_lora_modules(llm, args)
    app = create_app(settings, engine_factory=lambda: llm, store=store)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = GracefulServer(config, app, settings.shutdown_grace_s)
    log.info("serving %r on http://%s:%d (API key %s); /health answers 503 until warm-up ends",
             settings.model_name, settings.host, settings.port, "required" if settings.api_key else "not required")
    server.run()
    loader = app.state.get("loader")
    if loader is not None and loader.is_alive():
        # Still compiling: do not let interpreter teardown race XLA on the daemon thread.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return server.exit_code


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose first signal drains instead of closing the socket at once
    (uvicorn would stop accepting: clients would see "connection refused", not 503)."""

    def __init__(self, config: uvicorn.Config, app: Any, grace_s: float) -> None:
        super().__init__(config)
        self.app, self.grace_s, self.exit_code = app, grace_s, 0
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The signal is deliberately not recorded: uvicorn re-raises recorded signals after
        # serving, which would turn a clean drain into "killed by SIGTERM".
        if self._drainer is None:
            self.app.state.draining = True  # new requests get 503 from now on
            log.info("%s: draining (grace %.0f s)", signal.Signals(sig).name, self.grace_s)
            self._drainer = threading.Thread(target=self._drain, name="pagedjax-drain", daemon=True)
            self._drainer.start()
        else:
            log.warning("second signal: exiting now")
            self.should_exit = self.force_exit = True

    def _drain(self) -> None:
        from console.app import drain

        try:
            drain(self.app, self.grace_s)
        except Exception:
            log.exception("drain failed")
        finally:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.app.state.get("failed"):  # warm-up failed: /health said so; now exit non-zero
            self.exit_code = 1
            return True
        return await super().on_tick(counter)
