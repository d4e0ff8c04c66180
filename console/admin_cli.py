"""`pagedjax admin`: operators, API keys and the audit log in the state file, from a shell.

Works while the server runs (SQLite serialises the writers; the server reads every
operator and key row fresh, so a revoke counts at once). A new token or key is printed
once, to stdout alone, so `TOKEN=$(pagedjax admin add-operator bob)` captures just it.
"""

from __future__ import annotations

import argparse
import getpass
import sys
import time
from typing import Any


def add_state_dir_argument(s: argparse.ArgumentParser) -> None:
    s.add_argument("--state-dir", default=None,
                   help="operator state: policy, audit log, operators, API keys "
                        "(default: .pagedjax/state beside the checkpoints directory)")


def open_store(args: argparse.Namespace) -> Any:
    from console.state import StateStore, default_state_dir

    return StateStore.open(args.state_dir or default_state_dir())


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if t else "-"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def cmd_admin(args: argparse.Namespace) -> int:
    store = open_store(args)
    try:
        return _run(args, store)
    finally:
        store.close()


def _who() -> str:
    """The audit log's "who" for a shell command: the OS user."""
    try:
        return f"{getpass.getuser()}@cli"
    except Exception:  # noqa: BLE001 -- no passwd entry (some containers)
        return "cli"


def _run(args: argparse.Namespace, store: Any) -> int:
    a, who = args.admin_command, _who()
    if a == "add-operator":
        print(store.add_operator(args.name, args.role, who))
        print(f"operator {args.name!r} ({args.role}) added; the token above is shown only this once "
              f"({store.path})", file=sys.stderr)
    elif a == "list-operators":
        print(_table(["name", "role", "added (UTC)", "revoked (UTC)"],
                     [[o.name, o.role, _when(o.created), _when(o.revoked)] for o in store.operators()]))
    elif a == "revoke-operator":
        store.revoke_operator(args.name, who)
        print(f"operator {args.name!r} revoked; their console sessions end at their next request", file=sys.stderr)
    elif a == "add-key":
        print(store.add_key(args.name, rpm=args.rpm, tpm=args.tpm, max_concurrent=args.max_concurrent, who=who))
        print(f"key {args.name!r} added; the key above is shown only this once ({store.path})", file=sys.stderr)
    elif a == "list-keys":
        def lim(v: int | None) -> str:
            return "-" if v is None else str(v)
        print(_table(["name", "rpm", "tpm", "max_concurrent", "requests", "rate_limited", "prompt_tokens",
                      "completion_tokens", "added (UTC)", "revoked (UTC)"],
                     [[k.name, lim(k.rpm), lim(k.tpm), lim(k.max_concurrent), k.requests, k.rejected, k.prompt_tokens,
                       k.completion_tokens, _when(k.created), _when(k.revoked)] for k in store.keys()]))
    elif a == "revoke-key":
        store.revoke_key(args.name, who)
        print(f"key {args.name!r} revoked; its next request gets 401", file=sys.stderr)
    elif a == "audit":
        from console.state import audit_csv, audit_json

        rows = list(store.iter_audit(args.action))[-args.limit:] if args.limit else store.iter_audit(args.action)
        for chunk in (audit_csv if args.format == "csv" else audit_json)(iter(rows)):
            sys.stdout.write(chunk)
    return 0


def add_admin_parser(sub: Any) -> None:
    p = sub.add_parser("admin", help="operators, API keys and the audit log (the state file)",
                       description=__doc__.splitlines()[0])
    a = p.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    def cmd(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002
        s = a.add_parser(name, help=help, description=help)
        add_state_dir_argument(s)
        s.set_defaults(func=cmd_admin)
        return s

    s = cmd("add-operator", "add a console operator; prints their login token once")
    s.add_argument("name")
    s.add_argument("--role", choices=("viewer", "operator"), default="viewer",
                   help="viewer: sees every page, changes nothing; operator: changes policy, aborts, flushes "
                        "(default: viewer)")
    cmd("list-operators", "list operators (names and roles; tokens are never stored)")
    cmd("revoke-operator", "revoke an operator: their sessions end at once").add_argument("name")
    s = cmd("add-key", "add an API key with optional limits; prints the key once")
    s.add_argument("name")
    s.add_argument("--rpm", type=int, default=None, help="requests per minute (sliding window)")
    s.add_argument("--tpm", type=int, default=None, help="prompt + completion tokens per minute")
    s.add_argument("--max-concurrent", type=int, default=None, help="requests in flight at once")
    cmd("list-keys", "list API keys, their limits and usage")
    cmd("revoke-key", "revoke an API key: its next request gets 401").add_argument("name")
    s = cmd("audit", "print the audit log (oldest first)")
    s.add_argument("--format", choices=("csv", "json"), default="csv")
    s.add_argument("--action", default=None, help="only this action (policy, abort, add_key, ...)")
    s.add_argument("--limit", type=int, default=0, help="only the last N rows")
