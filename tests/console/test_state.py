"""The operator state file (console/state.py): durable policy and audit log, operators and
keys stored as salted hashes, atomic changes under kill -9, clear errors for a bad file."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from console.state import StateError, StateStore, audit_csv, audit_json, clamp_policy
from runtime.config import AdmissionPolicy, SchedulerConfig

REPO = Path(__file__).resolve().parents[2]


def test_tokens_are_shown_once_and_only_hashes_are_stored(tmp_path):
    store = StateStore.open(tmp_path)
    token = store.add_operator("bob", "viewer")
    key = store.add_key("alice", rpm=5)
    assert store.verify_operator(token).role == "viewer"
    assert store.verify_operator(token[:-1] + ("x" if token[-1] != "x" else "y")) is None
    assert store.verify_key(key).rpm == 5 and store.verify_key(key + "0") is None
    store.close()
    raw = b"".join(f.read_bytes() for f in tmp_path.iterdir())   # the database and any WAL left
    secret_t, secret_k = token.split("_", 2)[2], key.split("_", 2)[2]
    assert secret_t.encode() not in raw and secret_k.encode() not in raw


def test_names_are_checked_and_never_reused(tmp_path):
    store = StateStore.open(tmp_path)
    store.add_operator("bob", "operator")
    with pytest.raises(StateError, match="already exists"):
        store.add_operator("bob", "viewer")
    with pytest.raises(StateError, match="reserved"):
        store.add_operator("admin", "viewer")
    with pytest.raises(StateError, match="--role"):
        store.add_operator("carol", "root")
    with pytest.raises(StateError, match="letters, digits"):
        store.add_key("../etc", rpm=1)
    with pytest.raises(StateError, match="--rpm"):
        store.add_key("k", rpm=0)
    store.revoke_operator("bob")
    with pytest.raises(StateError, match="no such active operator"):
        store.revoke_operator("bob")
    assert store.operator("bob") is None and store.operators()[0].revoked is not None


def test_revoked_key_and_operator_stop_verifying_at_once_across_connections(tmp_path):
    server, cli = StateStore.open(tmp_path), StateStore.open(tmp_path)   # two processes' views
    key, token = cli.add_key("k"), cli.add_operator("op", "operator")
    assert server.verify_key(key) is not None and server.verify_operator(token) is not None
    cli.revoke_key("k")
    cli.revoke_operator("op")
    assert server.verify_key(key) is None        # the cached scrypt result does not outlive the row
    assert server.verify_operator(token) is None and server.operator("op") is None


def test_policy_and_audit_survive_reopening_with_paging_and_export(tmp_path):
    store = StateStore.open(tmp_path)
    for i in range(7):
        store.record_policy(f"op{i}", {"watermark": (0.05, 0.1 + i / 100)}, {"watermark": 0.1 + i / 100})
    store.record("op9", "abort", request_id="r1")
    store.close()
    again = StateStore.open(tmp_path)
    last = again.last_policy()
    assert last.who == "op6" and last.policy == {"watermark": pytest.approx(0.16)}
    assert again.audit_count() == 8 and again.audit_count("policy") == 7
    page2 = again.audit(offset=3, limit=3)
    assert [r.who for r in page2] == ["op4", "op3", "op2"]       # newest first, paged
    mixed = again.audit(limit=2, action=("abort", "policy"))     # several actions, one query
    assert [(r.who, r.action) for r in mixed] == [("op9", "abort"), ("op6", "policy")]
    assert again.audit(action=("pools",)) == []
    rows = list(again.iter_audit(batch=2))                         # oldest first, in batches
    assert [r.id for r in rows] == sorted(r.id for r in rows) and len(rows) == 8
    csv_text = "".join(audit_csv(iter(rows)))
    assert csv_text.splitlines()[0] == "id,time_utc,who,action,detail" and len(csv_text.splitlines()) == 9
    data = json.loads("".join(audit_json(iter(rows))))
    assert data[-1]["action"] == "abort" and data[-1]["detail"] == {"request_id": "r1"}


def test_stored_policy_is_clamped_to_a_smaller_envelope():
    base = AdmissionPolicy(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=32)
    env = SchedulerConfig(4, 32, 256)
    policy, notes = clamp_policy({"watermark": 0.3, "max_num_seqs": 64, "max_num_batched_tokens": 16,
                                  "admission_mode": "bogus", "gone_field": 1}, base, env)
    assert policy.watermark == 0.3 and policy.max_num_seqs == 4 and policy.max_num_batched_tokens == 16
    assert policy.admission_mode == base.admission_mode
    assert any("max_num_seqs clamped 64 -> 4" in n for n in notes)
    assert any("gone_field" in n for n in notes) and any("admission_mode" in n for n in notes)


def test_a_schema_1_file_gains_the_session_tables_and_keeps_its_rows(tmp_path):
    from console.state import _SCHEMA

    db = sqlite3.connect(tmp_path / "state.db")
    db.executescript(f"{_SCHEMA} PRAGMA user_version = 1;")
    db.execute("INSERT INTO audit (time, who, action, detail) VALUES (1.0, 'old', 'abort', '{}')")
    db.commit()
    db.close()
    store = StateStore.open(tmp_path)
    assert store._read("PRAGMA user_version")[0][0] == 2 and store.audit()[0].who == "old"
    store.put_session("sid", b'{"who": "x"}', None)
    key = store.console_key("csrf")
    store.close()
    again = StateStore.open(tmp_path)
    assert again.session("sid") == (b'{"who": "x"}', None) and again.console_key("csrf") == key


@pytest.mark.parametrize("content,message", [
    (b"this is not a database at all" * 100, "not a usable pagedjax state file"),
    (None, "not a pagedjax state file"),     # a valid SQLite file of something else
])
def test_a_foreign_or_corrupt_file_is_a_clear_error(tmp_path, content, message):
    f = tmp_path / "state.db"
    if content is None:
        sqlite3.connect(f).execute("CREATE TABLE other (x)").connection.commit()
    else:
        f.write_bytes(content)
    with pytest.raises(StateError, match=message):
        StateStore.open(tmp_path)


def test_an_unusable_state_dir_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "state.db").write_bytes(b"garbage" * 500)
    ckpt = tmp_path / "ckpt"   # the state file is opened after the checkpoint is found, before loading it
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    for d, msg in [(tmp_path / "file" / "sub", "cannot create it"), (tmp_path / "bad", "not a usable")]:
        for argv in (["admin", "list-keys", "--state-dir", str(d)],
                     ["serve", "--state-dir", str(d), "--checkpoint", str(ckpt)]):
            r = subprocess.run([sys.executable, "-m", "runtime.cli", *argv], cwd=REPO, capture_output=True,
                               text=True, timeout=120)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and msg in lines[0], (argv, r.stderr)


WRITER = textwrap.dedent("""
    import sys, json
    from console.state import StateStore
    store = StateStore.open(sys.argv[1])
    i = 0
    print("ready", flush=True)
    while True:
        i += 1
        store.record_policy("writer", {"max_queue_len": (i - 1, i)},
                            {"max_queue_len": i, "pad": "x" * 4000})
        print(i, flush=True)  # committed: the test kills after a chosen number of these
""")


def test_kill_9_mid_change_leaves_the_old_or_the_new_policy_never_half(tmp_path):
    """A writer records policy changes as fast as it can and is SIGKILLed at random moments;
    each time, the stored policy is a whole row and matches the newest audit row. The kill
    follows a chosen number of committed changes (read from the writer, not guessed with a
    sleep that a slow start outlasts), while the writer is already at the next one."""
    for committed in (1, 3, 10, 30, 60):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "ready"
        while (line := p.stdout.readline()) and int(line) < committed:
            pass
        assert line, "the writer exited"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        store = StateStore.open(tmp_path)
        last, newest = store.last_policy(), store.audit(limit=1)[0]
        assert last is not None and last.policy["pad"] == "x" * 4000
        assert newest.detail["changes"]["max_queue_len"][1] == last.policy["max_queue_len"]
        assert store.audit_count() == store.audit(limit=1)[0].id - store.audit(offset=store.audit_count() - 1,
                                                                               limit=1)[0].id + 1
        store.close()


def test_restore_goes_through_the_given_apply_as_the_fleet_uses_it(tmp_path, caplog):
    """The fleet restores through its apply-to-every-replica; the stored policy is clamped to
    this start's envelope first, and only fields that differ from the flags are applied."""
    import logging
    from types import SimpleNamespace

    from console.state import restore_policy

    store = StateStore.open(tmp_path)
    store.record_policy("ann", {"watermark": (0.05, 0.3)}, {**AdmissionPolicy().to_json(), "watermark": 0.3,
                                                           "max_num_seqs": 64})
    applied = []
    fleet = SimpleNamespace(policy=AdmissionPolicy(max_num_seqs=8, max_num_batched_tokens=64,
                                                   long_prefill_token_threshold=64),
                            envelope=SchedulerConfig(8, 64, 512))
    with caplog.at_level(logging.INFO, logger="pagedjax.state"):
        restore_policy(store, fleet, apply=lambda who, changes: applied.append((who, changes)))
    assert len(applied) == 1 and applied[0][0] == "restore"
    changes = applied[0][1]
    assert changes["watermark"] == 0.3 and "max_num_seqs" not in changes   # clamped 64 -> 8 = the flags' value
    assert any("set by ann" in m and "max_num_seqs clamped 64 -> 8" in m for m in caplog.messages)
    applied.clear()
    restore_policy(store, fleet, reset=True, apply=lambda who, changes: applied.append(changes))
    assert applied == [] and store.last_policy().policy == fleet.policy.to_json()
