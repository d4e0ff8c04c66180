"""Operator state that survives restarts: the admission policy, the audit log, operators
and API keys, and the console's login sessions, in one SQLite file (`<state-dir>/state.db`).

Why SQLite: one file, no server, and transactions -- every change is one `BEGIN
IMMEDIATE ... COMMIT`, so a `kill -9` mid-change leaves the old state or the new one,
never half of it (WAL mode keeps readers off the writer's back). The engine knows nothing
of this file: the web layer applies a change to the engine and records it here under one
lock, so the stored policy is always the engine's last applied one.

Secrets are never stored: a token is `pjo_<id>_<secret>` (operators) or `pjk_<id>_<secret>`
(API keys); the public id finds the row, and only a salted scrypt hash of the whole token
is kept. It is printed once, when it is made. A console session is kept under the sha256
of its id (the cookie), never the id. The one key kept as it is: what the console's CSRF
tokens are signed with (useful only together with a session cookie).
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import io
import json
import logging
import math
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pagedjax.state")

SCHEMA_VERSION = 2
STATE_FILE = "state.db"
ROLES = ("viewer", "operator")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
BOOTSTRAP = "admin"       # the --admin-token operator: never stored, cannot be revoked
SCRYPT = dict(n=2**14, r=8, p=1, dklen=32)   # ~16 MiB, ~50 ms: per login, not per request

_SCHEMA = """
CREATE TABLE audit (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  time REAL NOT NULL,
  who TEXT NOT NULL,
  action TEXT NOT NULL,          -- policy | abort | flush_prefix_cache | add_operator | ...
  detail TEXT NOT NULL           -- JSON object
);
CREATE TABLE current_policy (
  id INTEGER PRIMARY KEY CHECK (id = 1),
  policy TEXT NOT NULL,          -- JSON: AdmissionPolicy.to_json()
  audit_id INTEGER NOT NULL REFERENCES audit(id)
);
CREATE TABLE operators (
  name TEXT PRIMARY KEY,
  public_id TEXT NOT NULL UNIQUE,
  role TEXT NOT NULL CHECK (role IN ('viewer', 'operator')),
  salt BLOB NOT NULL,
  hash BLOB NOT NULL,
  created REAL NOT NULL,
  revoked REAL
);
CREATE TABLE api_keys (
  name TEXT PRIMARY KEY,
  public_id TEXT NOT NULL UNIQUE,
  salt BLOB NOT NULL,
  hash BLOB NOT NULL,
  rpm INTEGER, tpm INTEGER, max_concurrent INTEGER,   -- NULL: no limit
  created REAL NOT NULL,
  revoked REAL,
  requests INTEGER NOT NULL DEFAULT 0,
  rejected INTEGER NOT NULL DEFAULT 0,
  prompt_tokens INTEGER NOT NULL DEFAULT 0,
  completion_tokens INTEGER NOT NULL DEFAULT 0
);
"""
# Schema 2: console sessions (Litestar's server-side sessions, console/auth.py), so an
# operator stays logged in across a restart, and the console's own keys.
_SCHEMA_2 = """
CREATE TABLE console_sessions (
  id_hash BLOB PRIMARY KEY,      -- sha256 of the session id (the cookie's value)
  data BLOB NOT NULL,            -- the session as Litestar serialised it (JSON)
  expires REAL                   -- unix time it ends; NULL: never
);
CREATE TABLE console_keys (
  name TEXT PRIMARY KEY,         -- csrf: signs the CSRF tokens; bootstrap-salt: see bootstrap_fingerprint
  value BLOB NOT NULL
);
"""


class StateError(ValueError):
    """The state file cannot be used (corrupt, unwritable, from a newer version): one line."""


@dataclass(frozen=True)
class AuditRow:
    id: int
    time: float
    who: str
    action: str
    detail: dict[str, Any]

    @property
    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.time))


@dataclass(frozen=True)
class Operator:
    name: str
    role: str
    created: float
    revoked: float | None = None


@dataclass(frozen=True)
class ApiKey:
    name: str
    public_id: str
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    created: float
    revoked: float | None = None
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class StoredPolicy:
    policy: dict[str, Any]
    who: str
    time: float


def default_state_dir() -> Path:
    """Beside the checkpoints directory: `checkpoints/` -> `.pagedjax/state`."""
    from runtime.checkpoint.pull import checkpoints_root

    return checkpoints_root().resolve().parent / ".pagedjax" / "state"


def _hash(token: str, salt: bytes) -> bytes:
    return hashlib.scrypt(token.encode(), salt=salt, maxmem=64 << 20, **SCRYPT)


def _split(token: str, prefix: str) -> str | None:
    """The public id of a well-formed token, else None."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != prefix or not parts[1] or not parts[2]:
        return None
    return parts[1]


def check_name(kind: str, name: str) -> str:
    if not NAME_RE.match(name):
        raise StateError(f"{kind} name {name!r}: use 1-64 letters, digits, '.', '_', '@' or '-', "
                         "starting with a letter or digit")
    return name


def check_limit(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise StateError(f"{name}: must be a whole number >= 1 (omit it for no limit), got {value!r}")
    return value


class StateStore:
    """One SQLite connection shared by the server's threads (serialised by a lock: the
    writes are tiny, and sqlite3 connections are not safe to use concurrently)."""

    def __init__(self, path: Path | str = ":memory:") -> None:
        self.path = str(path)
        self._lock = threading.RLock()
        # A policy change is "apply to the engine, then record": held across both so two
        # operators' changes cannot interleave (the stored one is the engine's last one).
        self.policy_lock = threading.Lock()
        self._verified: dict[str, bytes] = {}   # public id -> sha256 of a token scrypt accepted
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
            self._db.execute("PRAGMA busy_timeout = 10000")
            if self.path != ":memory:":
                mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise StateError(f"{self.path}: cannot use WAL journaling (got {mode})")
                self._db.execute("PRAGMA synchronous = FULL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{self.path}: not a usable pagedjax state file ({exc}); move it aside "
                             "or pass another --state-dir") from None

    @classmethod
    def open(cls, state_dir: Path | str) -> "StateStore":
        d = Path(state_dir)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"--state-dir {d}: cannot create it ({exc.strerror or exc})") from None
        f = d / STATE_FILE
        if f.exists() and not f.is_file():
            raise StateError(f"{f}: not a file")
        return cls(f)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- plumbing ----------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StateError(f"{self.path}: written by a newer pagedjax (schema {version}, this one "
                                 f"reads {SCHEMA_VERSION})")
            if version == 0:
                tables = self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
                if tables:
                    raise StateError(f"{self.path}: an SQLite file, but not a pagedjax state file")
                self._db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} {_SCHEMA_2} "
                                       f"PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
            elif version == 1:
                self._db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA_2} PRAGMA user_version = 2; COMMIT;")
            ok = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise StateError(f"{self.path}: the state file is damaged ({ok})")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """`with self._write() as db:` -- one transaction, committed or rolled back whole."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @staticmethod
    def _audit(db: sqlite3.Connection, who: str, action: str, detail: dict[str, Any]) -> int:
        cur = db.execute("INSERT INTO audit (time, who, action, detail) VALUES (?, ?, ?, ?)",
                         (time.time(), who, action, json.dumps(detail, sort_keys=True)))
        return int(cur.lastrowid)

    def _add_secret(self, table: str, kind: str, name: str, prefix: str, secret_bytes: int,
                    columns: dict[str, Any], who: str, why_unique: str) -> str:
        """A new row holding only the salted hash of a fresh `<prefix>_<id>_<secret>` token,
        audited in the same transaction; returns the token."""
        pid, salt = secrets.token_hex(6), secrets.token_bytes(16)
        token = f"{prefix}_{pid}_{secrets.token_urlsafe(secret_bytes)}"
        cols = {"name": name, "public_id": pid, "salt": salt, "hash": _hash(token, salt), **columns,
                "created": time.time()}
        with self._write() as db:
            if db.execute(f"SELECT 1 FROM {table} WHERE name = ?", (name,)).fetchone():
                raise StateError(f"{kind} {name!r} already exists (names are never reused: {why_unique})")
            db.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                       tuple(cols.values()))
            self._audit(db, who, f"add_{kind}", {"name": name, **columns})
        return token

    def _revoke(self, table: str, kind: str, name: str, who: str) -> None:
        with self._write() as db:
            cur = db.execute(f"UPDATE {table} SET revoked = ? WHERE name = ? AND revoked IS NULL", (time.time(), name))
            if cur.rowcount != 1:
                raise StateError(f"{kind} {name!r}: no such active {kind}")
            self._audit(db, who, f"revoke_{kind}", {"name": name})

    # --- audit log ----------------------------------------------------------------------------
    def record(self, who: str, action: str, **detail: Any) -> int:
        with self._write() as db:
            return self._audit(db, who, action, detail)

    def audit(self, offset: int = 0, limit: int = 50, action: str | tuple[str, ...] | None = None) -> list[AuditRow]:
        """Newest first; `action` is one action or a tuple of them."""
        actions = (action,) if isinstance(action, str) else tuple(action or ())
        where = f"WHERE action IN ({', '.join('?' * len(actions))})" if actions else ""
        args = actions
        rows = self._read(f"SELECT id, time, who, action, detail FROM audit {where} ORDER BY id DESC "
                          "LIMIT ? OFFSET ?", (*args, limit, offset))
        return [AuditRow(i, t, w, a, json.loads(d)) for i, t, w, a, d in rows]

    def audit_count(self, action: str | None = None) -> int:
        where, args = ("WHERE action = ?", (action,)) if action else ("", ())
        return int(self._read(f"SELECT count(*) FROM audit {where}", args)[0][0])

    def iter_audit(self, action: str | None = None, batch: int = 500) -> Iterator[AuditRow]:
        """Oldest first, in batches (an export of a long history never holds the lock long)."""
        last = 0
        while True:
            where = "WHERE id > ?" + (" AND action = ?" if action else "")
            rows = self._read(f"SELECT id, time, who, action, detail FROM audit {where} ORDER BY id LIMIT ?",
                              (last, *((action,) if action else ()), batch))
            if not rows:
                return
            for i, t, w, a, d in rows:
                yield AuditRow(i, t, w, a, json.loads(d))
            last = rows[-1][0]

    # --- admission policy -----------------------------------------------------------------------
    def record_policy(self, who: str, changes: dict[str, tuple[Any, Any]], policy: dict[str, Any],
                      **extra: Any) -> int:
        """The audit row and the current policy, in one transaction."""
        detail = {"changes": {k: [a, b] for k, (a, b) in changes.items()}, **extra}
        with self._write() as db:
            audit_id = self._audit(db, who, "policy", detail)
            db.execute("INSERT INTO current_policy (id, policy, audit_id) VALUES (1, ?, ?) "
                       "ON CONFLICT (id) DO UPDATE SET policy = excluded.policy, audit_id = excluded.audit_id",
                       (json.dumps(policy, sort_keys=True), audit_id))
            return audit_id

    def last_policy(self) -> StoredPolicy | None:
        rows = self._read("SELECT p.policy, a.who, a.time FROM current_policy p JOIN audit a ON a.id = p.audit_id")
        if not rows:
            return None
        policy, who, t = rows[0]
        return StoredPolicy(json.loads(policy), who, t)

    # --- operators ----------------------------------------------------------------------------------
    def add_operator(self, name: str, role: str, who: str = "cli") -> str:
        """Returns the token (shown once; only its hash is kept)."""
        check_name("operator", name)
        if name == BOOTSTRAP:
            raise StateError(f"operator name {BOOTSTRAP!r} is reserved for the --admin-token operator")
        if role not in ROLES:
            raise StateError(f"--role: must be one of {', '.join(ROLES)}, got {role!r}")
        return self._add_secret("operators", "operator", name, "pjo", 24, {"role": role}, who,
                                "the audit log refers to them")

    def operators(self) -> list[Operator]:
        return [Operator(*r) for r in self._read("SELECT name, role, created, revoked FROM operators ORDER BY created")]

    def operator(self, name: str) -> Operator | None:
        """The operator if it exists and is not revoked (checked on every console request)."""
        rows = self._read("SELECT name, role, created, revoked FROM operators WHERE name = ? AND revoked IS NULL",
                          (name,))
        return Operator(*rows[0]) if rows else None

    def verify_operator(self, token: str) -> Operator | None:
        pid = _split(token, "pjo")
        rows = self._read("SELECT name, role, created, revoked, salt, hash FROM operators WHERE public_id = ? "
                          "AND revoked IS NULL", (pid,)) if pid else []
        if not rows:
            return None
        name, role, created, revoked, salt, stored = rows[0]
        return Operator(name, role, created, revoked) if hmac.compare_digest(_hash(token, salt), stored) else None

    def revoke_operator(self, name: str, who: str = "cli") -> None:
        if name == BOOTSTRAP:
            raise StateError(f"{BOOTSTRAP!r} is the --admin-token operator: restart without that token to end it")
        self._revoke("operators", "operator", name, who)

    # --- API keys -------------------------------------------------------------------------------------
    def add_key(self, name: str, *, rpm: int | None = None, tpm: int | None = None,
                max_concurrent: int | None = None, who: str = "cli") -> str:
        """Returns the key (shown once; only its hash is kept)."""
        check_name("key", name)
        limits = {"rpm": check_limit("--rpm", rpm), "tpm": check_limit("--tpm", tpm),
                  "max_concurrent": check_limit("--max-concurrent", max_concurrent)}
        return self._add_secret("api_keys", "key", name, "pjk", 32, limits, who,
                                "usage and the audit log refer to them")

    _KEY_COLS = ("name, public_id, rpm, tpm, max_concurrent, created, revoked, requests, rejected, "
                 "prompt_tokens, completion_tokens")

    def keys(self) -> list[ApiKey]:
        return [ApiKey(*r) for r in self._read(f"SELECT {self._KEY_COLS} FROM api_keys ORDER BY created")]

    def has_keys(self) -> bool:
        return bool(self._read("SELECT 1 FROM api_keys LIMIT 1"))

    def verify_key(self, token: str) -> ApiKey | None:
        """The key's current row (limits and revocation are read fresh on every request, so a
        revoke from another process counts at once); scrypt runs once per token and process."""
        pid = _split(token, "pjk")
        if pid is None:
            return None
        with self._lock:
            row = self._db.execute(f"SELECT {self._KEY_COLS}, salt, hash FROM api_keys WHERE public_id = ? "
                                   "AND revoked IS NULL", (pid,)).fetchone()
        if row is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        if not hmac.compare_digest(self._verified.get(pid, b""), digest):
            if not hmac.compare_digest(_hash(token, row[-2]), row[-1]):
                return None
            self._verified[pid] = digest
        return ApiKey(*row[:-2])

    def revoke_key(self, name: str, who: str = "cli") -> None:
        self._revoke("api_keys", "key", name, who)

    def add_usage(self, usage: dict[str, tuple[int, int, int, int]]) -> None:
        """Per key: (requests, rejected, prompt tokens, completion tokens) to add, in one transaction."""
        if not usage:
            return
        with self._write() as db:
            db.executemany("UPDATE api_keys SET requests = requests + ?, rejected = rejected + ?, "
                           "prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ? "
                           "WHERE name = ?", [(*v, k) for k, v in usage.items()])


    # --- console sessions and keys (console/auth.py) ----------------------------------------------
    @staticmethod
    def _sid(session_id: str) -> bytes:
        return hashlib.sha256(session_id.encode()).digest()

    def session(self, session_id: str) -> tuple[bytes, float | None] | None:
        """(data, expires) of a session that has not ended, else None."""
        rows = self._read("SELECT data, expires FROM console_sessions WHERE id_hash = ? AND "
                          "(expires IS NULL OR expires > ?)", (self._sid(session_id), time.time()))
        return (bytes(rows[0][0]), rows[0][1]) if rows else None

    def put_session(self, session_id: str, data: bytes, expires: float | None) -> None:
        """Store it (a write only when the data changed: the console's pages and their HTMX
        polls hand the same session back on every request); ended sessions are dropped here."""
        key = self._sid(session_id)
        if self._read("SELECT 1 FROM console_sessions WHERE id_hash = ? AND data = ?", (key, data)):
            return
        with self._write() as db:
            db.execute("DELETE FROM console_sessions WHERE expires <= ?", (time.time(),))
            db.execute("INSERT INTO console_sessions (id_hash, data, expires) VALUES (?, ?, ?) ON CONFLICT "
                       "(id_hash) DO UPDATE SET data = excluded.data, expires = excluded.expires",
                       (key, data, expires))

    def renew_session(self, session_id: str, expires: float | None) -> None:
        with self._write() as db:
            db.execute("UPDATE console_sessions SET expires = ? WHERE id_hash = ?", (expires, self._sid(session_id)))

    def delete_sessions(self, session_id: str | None = None) -> None:
        """One session, or (None) every one."""
        with self._write() as db:
            if session_id is None:
                db.execute("DELETE FROM console_sessions")
            else:
                db.execute("DELETE FROM console_sessions WHERE id_hash = ?", (self._sid(session_id),))

    def console_key(self, name: str, nbytes: int = 32) -> bytes:
        """A random key made once per state file (kept across restarts)."""
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO console_keys (name, value) VALUES (?, ?)",
                       (name, secrets.token_bytes(nbytes)))
            return bytes(db.execute("SELECT value FROM console_keys WHERE name = ?", (name,)).fetchone()[0])

    def bootstrap_fingerprint(self, admin_token: str) -> str:
        """What a bootstrap ("admin") session records of the --admin-token it was opened with,
        so a restart with another token ends it: a salted scrypt hash, like stored tokens'."""
        return _hash(admin_token, self.console_key("bootstrap-salt", 16)).hex()


# --- policy: restore at start, apply + record --------------------------------------------------------

def clamp_policy(stored: dict[str, Any], base: Any, envelope: Any) -> tuple[Any, list[str]]:
    """`stored` over `base` (an AdmissionPolicy), each field clamped to what this envelope
    allows. Returns (policy, notes on what was clamped or dropped)."""
    ranges = base.ranges(envelope)
    values, notes = {}, []
    for name, value in stored.items():
        if name not in ranges:
            notes.append(f"{name} dropped (unknown field)")
            continue
        lo, hi = ranges[name]
        if name == "admission_mode":
            if value in (lo, hi):
                values[name] = value
            else:
                notes.append(f"admission_mode {value!r} dropped")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            notes.append(f"{name} {value!r} dropped")
            continue
        if name != "watermark" and not name.startswith("slo_"):
            value = int(value)
        else:
            value = float(value)
        c = min(max(value, lo), hi)
        if c != value:
            notes.append(f"{name} clamped {value} -> {c} (the compiled envelope)")
        values[name] = c
    return base.replace(envelope, **values), notes


def restore_policy(store: StateStore, engine: Any, reset: bool = False,
                   apply: Callable[[str, dict[str, Any]], Any] | None = None) -> None:
    """At start, before the first step: the last applied policy, or (reset) the flags'.
    `engine` has `.policy` and `.envelope`; `apply(who, changes)` sets it (default: the
    LLMEngine's update_policy; the fleet passes its apply-to-every-replica)."""
    where = store.path
    flags = engine.policy
    apply = apply or (lambda who, changes: engine.update_policy(who, **changes))
    if reset:
        store.record_policy("startup", {}, flags.to_json(), reason="started with --reset-policy")
        log.info("admission policy: --reset-policy: starting from the flags (recorded in %s)", where)
        return
    stored = store.last_policy()
    if stored is None:
        log.info("admission policy: none stored in %s yet; starting from the flags", where)
        return
    policy, notes = clamp_policy(stored.policy, flags, engine.envelope)
    changes = {k: v for k, v in policy.to_json().items() if getattr(flags, k) != v}
    if changes:
        apply("restore", changes)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stored.time))
    what = ", ".join(f"{k}={v}" for k, v in changes.items()) or "same as the flags"
    log.info("admission policy restored from %s: set by %s at %s (%s)%s", where, stored.who, when, what,
             f"; {'; '.join(notes)}" if notes else "")


def apply_policy(store: StateStore, engine: Any, who: str, changes: dict[str, Any], **extra: Any) -> Any:
    """Apply a change to the engine and record it, as one step for concurrent operators.
    Raises ValueError (naming the field) and records nothing when the engine refuses it."""
    with store.policy_lock:
        old = engine.policy
        new = engine.update_policy(who, **changes)
        diff = {k: (getattr(old, k), getattr(new, k)) for k in changes if getattr(old, k) != getattr(new, k)}
        store.record_policy(who, diff, new.to_json(), **extra)
        return new


# --- export --------------------------------------------------------------------------------------------

def audit_csv(rows: Iterator[AuditRow]) -> Iterator[str]:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["id", "time_utc", "who", "action", "detail"])
    yield buf.getvalue()
    for r in rows:
        buf.seek(0)
        buf.truncate()
        w.writerow([r.id, r.when, r.who, r.action, json.dumps(r.detail, sort_keys=True)])
        yield buf.getvalue()


def audit_json(rows: Iterator[AuditRow]) -> Iterator[str]:
    yield "["
    for i, r in enumerate(rows):
        yield ("," if i else "") + json.dumps({"id": r.id, "time": r.time, "time_utc": r.when, "who": r.who,
                                                "action": r.action, "detail": r.detail}, sort_keys=True)
    yield "]\n"
