"""`pagedjax fleet serve --prefill-replicas 1 --decode-replicas 1` for real: a local Ray
instance, one prefill and one decode replica of the tiny model (one core each), the KV
moving through Ray's object store. One fleet for the module; the tests run in order.

Replica KV: 512 KiB = 64 blocks of 16 tokens, watermark 4 blocks, reserve mode: a request
with prompt + max_tokens of 910 reserves 57 blocks, so the decode replica then has no room
for a 50 + 400 token one. --max-replicas 3 leaves room for the console to add a replica.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.console.server_util import start_server
from tests.fleet.fleet_util import logged_in_console, state

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.fleet

ENGINE_FLAGS = ("--admission-mode", "reserve", "--kv-cache-memory", "512KiB", "--max-num-seqs", "4")
FLEET = ("--prefill-replicas", "1", "--decode-replicas", "1", "--max-replicas", "3", "--threads-per-replica", "1",
         *ENGINE_FLAGS,
         "--fleet-queue-cap", "4", "--fleet-queue-timeout", "120", "--kv-transfer-timeout", "10",
         "--kv-reservation-lease", "2")


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 260, size=n)]


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault") / "kv_send_failures"


@pytest.fixture(scope="module")
def fleet(tiny_ckpt, fault_file):
    with start_server(tiny_ckpt, *FLEET, subcommand=("fleet", "serve"), ready_timeout=420,
                      env={"RAY_ADDRESS": "", "PAGEDJAX_FAULT_KV_SEND_FILE": str(fault_file)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def console(fleet):
    with logged_in_console(fleet) as c:
        yield c


def roles(console: httpx.Client) -> dict[str, dict]:
    return {r["role"]: r for r in state(console)["replicas"]}


def wait_for(pred, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def settle(console: httpx.Client) -> None:
    """Both replicas idle and holding no blocks (no reservation left anywhere)."""
    wait_for(lambda: len(s := state(console)["replicas"]) == 2 and all(
        r["running"] == r["waiting"] == r["used_blocks"] == 0 for r in s), 30, "idle replicas with no used blocks")


def prefill_prompt_tokens(fleet, console) -> float:
    rid = roles(console)["prefill"]["replica"]
    text = fleet.client().get(f"/replicas/{rid}/metrics").text
    return float(re.search(r"^pagedjax:prompt_tokens_total (\S+)", text, re.M).group(1))


def completion(fleet, ids: list[int], **params) -> httpx.Response:
    return fleet.client(timeout=120).post("/v1/completions", json={"model": fleet.model, "prompt": ids,
                                                                   "ignore_eos": True, **params})


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """One in-process engine built from the same engine flags the replicas get."""
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p, serving=True)
    return LLMEngine.from_checkpoint(tiny_ckpt, engine_config_from_args(p.parse_args(list(ENGINE_FLAGS))),
                                     warmup=False, progress=False)


def test_cli_refuses_disaggregation_with_replica_flags(tiny_ckpt):
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "fleet", "serve", "--checkpoint", str(tiny_ckpt),
                        "--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "3"],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert r.returncode == 2, r.stderr
    assert "leave out --replicas and --min-replicas" in r.stderr and "Traceback" not in r.stderr


def test_same_tokens_as_one_engine_and_transfers_reported(fleet, console, reference):
    from runtime.model.sampling import SamplingParams

    s = state(console)
    assert sorted(r["role"] for r in s["replicas"]) == ["decode", "prefill"]
    for i, params in enumerate([dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=1234)]):
        ids = prompt(100 + i, 50)  # 3 full blocks travel (the last token is computed on the decode side)
        r = completion(fleet, ids, max_tokens=12, **params)
        assert r.status_code == 200, r.text
        want = "".join(reference.generate_text(ids, SamplingParams(max_tokens=12, ignore_eos=True, **params)))
        assert r.json()["choices"][0]["text"] == want, params
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # imported, not recomputed
    settle(console)
    # (each replica reports on its own beat: wait for both)
    rs = wait_for(lambda: (x := roles(console))["decode"]["kv_transfers"] == x["prefill"]["kv_transfers"] == 2 and x,
                  10, "the transfers in both replicas' stats")
    assert rs["prefill"]["kv_transfer_bytes"] == rs["decode"]["kv_transfer_bytes"] > 0
    assert rs["prefill"]["kv_transfer_ms"] > 0 and rs["decode"]["kv_transfer_ms"] > 0

    def exported() -> bool:  # each replica's exposition reaches the gateway about every second
        text = fleet.client().get("/metrics").text
        ok = re.search(r'^pagedjax:kv_transfer_seconds_count\{replica="[^"]+",stage="transfer"\} 2\.0', text, re.M)
        for direction, role in (("out", "prefill"), ("in", "decode")):
            m = re.search(rf'^pagedjax:kv_transfer_bytes_total\{{replica="{rs[role]["replica"]}",'
                          rf'direction="{direction}"\}} (\S+)', text, re.M)
            ok = ok and m and float(m.group(1)) == rs[role]["kv_transfer_bytes"]
        return bool(ok and f'pagedjax:fleet_replica_role{{replica="{rs["prefill"]["replica"]}",role="prefill"}} 1'
                    in text)

    wait_for(exported, 15, "the transfer bytes and times at /metrics")
    page = console.get("/admin").text
    assert re.search(r'<span class="pill role-prefill">prefill</span>', page)
    assert re.search(r'<span class="pill role-decode">decode</span>', page)
    assert "KV transfers" in page and page.count('class="num kv-transfers"') == 2


def test_no_room_on_decode_waits_without_prefilling(fleet, console):
    settle(console)
    client = fleet.openai(timeout=120)
    # 32 of the decode replica's 64 blocks reserved for this one (10-token prompt: nothing to transfer)
    long = client.completions.create(model=fleet.model, prompt=prompt(200, 10), max_tokens=490,
                                     extra_body={"ignore_eos": True}, stream=True)
    assert next(iter(long)).choices
    before = prefill_prompt_tokens(fleet, console)
    result: dict = {}

    def waiting() -> None:  # 50 + 460 tokens: 32 blocks, which the decode replica cannot promise now
        result["r"] = fleet.client(timeout=120).post(
            "/v1/completions", headers={"X-Request-Id": "noroom"},
            json={"model": fleet.model, "prompt": prompt(201, 50), "max_tokens": 460, "ignore_eos": True})

    t = threading.Thread(target=waiting)
    t.start()
    # The moment it waits in the fleet queue (the long one holds the decode replica's blocks;
    # the tiny model may finish those 490 tokens within a second or two, so judge that moment).
    s = wait_for(lambda: (x := state(console))["queued"] == 1 and x, 20, "the request to wait in the fleet queue")
    pre = next(r for r in s["replicas"] if r["role"] == "prefill")
    assert not [x for x in pre["recent_requests"] if x.startswith("noroom")] and pre["running"] == 0  # not prefilled
    long.close()  # the long request is aborted: its blocks return, the waiting one gets its reservation
    t.join(timeout=120)
    assert result["r"].status_code == 200, result["r"].text
    wait_for(lambda: "noroom-0/prefill1" in roles(console)["prefill"]["recent_requests"], 10,
             "the prefill replica to run it once reserved")
    wait_for(lambda: prefill_prompt_tokens(fleet, console) >= before + 50, 10, "its prompt tokens on the prefill side")


def test_a_prefill_slower_than_the_lease_keeps_its_reservation(fleet, console, fault_file, reference):
    """The gateway renews the 2 s lease while the prefill replica takes 5 s: the request is
    served on its first reservation (no retry), with the tokens of one engine."""
    from runtime.model.sampling import SamplingParams

    settle(console)
    retries = fleet.metric("pagedjax:fleet_kv_transfer_retries_total")
    fault_file.write_text("delay 5")
    ids = prompt(250, 50)
    t0 = time.monotonic()
    r = completion(fleet, ids, max_tokens=6, temperature=0.0)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 >= 5 and fault_file.read_text() == "0"  # the delay did happen
    assert fleet.metric("pagedjax:fleet_kv_transfer_retries_total") == retries
    want = "".join(reference.generate_text(ids, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)))
    assert r.json()["choices"][0]["text"] == want


# A gateway that reserves on the decode replica, renews the lease as a live gateway does
# (pools.py `_keep`) until told to die on stdin, then dies before it prefills or releases:
# another Ray driver on the fleet's own Ray instance, gone with os._exit.
LOST_GATEWAY = r"""
import json, os, sys, threading, ray
from ray import serve
from runtime.model.sampling import SamplingParams
ray.init(address=sys.argv[1], namespace="pagedjax", log_to_driver=False)
h = serve.get_deployment_handle("decode", app_name="pagedjax-decode")
ans = h.reserve.remote({"prompt_ids": list(range(3, 203)), "params": SamplingParams(max_tokens=100, ignore_eos=True),
                        "replica_hint": sys.argv[2]}).result(timeout_s=120)
print("RESERVED " + json.dumps(ans), flush=True)
die = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), die.set()), daemon=True).start()
while not die.wait(ans["lease_s"] / 5):
    if not h.renew.remote({"replica_hint": sys.argv[2], "reservation_id": ans["reservation_id"]}).result(timeout_s=30):
        print("LOST", flush=True)
        os._exit(3)
os._exit(0)
"""


def tail(f) -> str:
    f.seek(0)
    return f.read()[-2000:]


def test_a_reservation_whose_gateway_is_gone_is_freed_within_its_lease(fleet, console, tmp_path):
    from runtime.fleet.replica import TRANSFER_TIMEOUT_S

    settle(console)
    address = re.search(r"local Ray instance at (\S+)", fleet.log_text()).group(1)
    decode = roles(console)["decode"]["replica"]
    # (a local instance of this Ray has token auth on; a driver naming its address must say so)
    err = (tmp_path / "driver.err").open("w+")  # a file, not a pipe: Ray's chatter cannot fill it and block
    proc = subprocess.Popen([sys.executable, "-c", LOST_GATEWAY, address, decode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True,
                            cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ""})
    try:
        line = ""
        while not line.startswith("RESERVED "):  # (Ray may print its own lines first)
            line = proc.stdout.readline()
            assert line, f"the driver exited without reserving: {proc.wait(60)}\n{tail(err)}"
        ans = json.loads(line.removeprefix("RESERVED "))
        assert ans["replica"] == decode and ans["lease_s"] == 2.0 and ans["num_transfer"] > 0
        # 200 prompt + 100 tokens: 19 blocks, held while the driver renews (no race with the lease)...
        wait_for(lambda: roles(console)["decode"]["used_blocks"] >= 19, 30, "the reservation in the replica's stats")
        assert proc.poll() is None, proc.stdout.read()  # (renewals kept it: "LOST" would have ended the driver)
        proc.stdin.write("die\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0, tail(err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        err.close()
    gone = time.monotonic()
    # ...and a gateway that will never come back: the 2 s lease frees them, well before any
    # other timer on the replica (the shortest, the transfer timeout) could have.
    wait_for(lambda: roles(console)["decode"]["used_blocks"] == 0, 60, "the lost reservation to be released")
    assert time.monotonic() - gone < TRANSFER_TIMEOUT_S
    r = completion(fleet, prompt(260, 50), max_tokens=4)  # and the fleet serves on
    assert r.status_code == 200, r.text


def test_failed_transfer_retried_once_then_clear_error_and_nothing_leaked(fleet, console, fault_file):
    settle(console)
    fault_file.write_text("1")  # one failure: the retry carries it
    r = completion(fleet, prompt(300, 50), max_tokens=4)
    assert r.status_code == 200, r.text
    fault_file.write_text("2")  # both attempts fail
    r = completion(fleet, prompt(301, 50), max_tokens=4)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed"
    assert "failed twice" in err["message"] and "send from prefill replica" in err["message"]
    assert "planted fault" in err["message"]
    settle(console)  # both reservations released, nothing pinned on either replica
    assert fault_file.read_text() == "0"
    assert fleet.metric("pagedjax:fleet_kv_transfer_retries_total") == 2
    assert fleet.metric("pagedjax:fleet_kv_transfer_failed_total") == 1
    assert completion(fleet, prompt(301, 50), max_tokens=4).status_code == 200  # and it serves again


def test_prefill_replica_dying_mid_transfer_frees_the_reservation_and_the_pool_recovers(fleet, console, fault_file,
                                                                                       reference):
    from runtime.model.sampling import SamplingParams

    settle(console)
    dead = roles(console)["prefill"]["replica"]
    retries = fleet.metric("pagedjax:fleet_kv_transfer_retries_total")
    fault_file.write_text("exit")  # the prefill replica's process exits at its next send
    r = completion(fleet, prompt(400, 50), max_tokens=4)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed"
    # Attempt 1 saw the replica die; the retry did not go back to it (none left reporting).
    assert f"prefill on replica {dead}: ActorDiedError" in err["message"], err
    assert "no prefill replica is reporting" in err["message"], err
    assert fleet.metric("pagedjax:fleet_kv_transfer_retries_total") == retries + 1
    # Both reservations released (the release is sent as the attempt ends; the stats follow).
    wait_for(lambda: (d := roles(console)["decode"])["used_blocks"] == d["running"] == 0, 10,
             "the decode replica to hold no blocks")
    # Ray Serve replaces the replica; the fleet serves again, with the same tokens.
    wait_for(lambda: (p := roles(console).get("prefill")) and p["replica"] != dead, 180,
             "a replacement prefill replica to report")
    settle(console)
    ids = prompt(401, 50)
    r = completion(fleet, ids, max_tokens=6, temperature=0.0)
    assert r.status_code == 200, r.text
    want = "".join(reference.generate_text(ids, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)))
    assert r.json()["choices"][0]["text"] == want


def test_console_resizes_the_pools(fleet, console):
    settle(console)
    page = console.get("/admin").text
    assert 'id="pools"' in page and 'id="pool-size-decode">1<' in page and "at most 3 replicas" in page
    nonce = re.search(r'name="_csrf_token" value="([^"]+)"', page).group(1)

    def post(**sizes) -> httpx.Response:
        return console.post("/admin/fleet/pools", data={"_csrf_token": nonce, **{k: str(v) for k, v in sizes.items()}},
                            headers={"HX-Request": "true"})

    # Refused with the reason, nothing changed: below one, above --max-replicas, not a number.
    for sizes, why in [(dict(decode=0), "decode_replicas: must be a whole number of at least 1"),
                       (dict(prefill=2, decode=2), "more than the fleet&#39;s 3"),
                       (dict(decode="two"), "decode")]:
        r = post(**sizes)
        assert r.status_code == 422 and why in r.text, (sizes, r.text[:2000])
    assert state(console)["pools"] == {"prefill": 1, "decode": 1, "max_replicas": 3}

    old = {x["replica"] for x in state(console)["replicas"] if x["role"] == "decode"}
    r = post(prefill=1, decode=2)
    assert r.status_code == 200 and "Pools resized" in r.text, r.text[:2000]
    assert state(console)["pools"]["decode"] == 2
    wait_for(lambda: sum(x["role"] == "decode" for x in state(console)["replicas"]) == 2, 180,
             "a second decode replica to report")
    assert fleet.metric("pagedjax:fleet_pool_replicas", pool="decode") == 2
    change = state(console)["changes"][0]
    assert change["action"] == "pools" and change["detail"]["changes"] == {"decode": [1, 2]}, change
    assert change["who"] == "admin"
    # The new decode replica takes reservations: the fleet policy sends a request to the
    # replica with the most free blocks (then round-robin), and the new one is empty. (Ray's
    # handle may learn of it a moment after it reports; until then a call pinned to it goes
    # to the other, which still serves it.)
    def transfers() -> dict[str, int]:
        return {x["replica"]: x["kv_transfers"] for x in state(console)["replicas"] if x["role"] == "decode"}

    def new_one_imported() -> bool:
        # (the stats report every 0.2 s: give the transfer a few reports to show, not a fixed sleep)
        try:
            return wait_for(lambda: any(n > 0 for rep, n in transfers().items() if rep not in old), 2,
                            "a transfer into the new decode replica", every=0.1)
        except AssertionError:
            return False

    for i in range(8):
        r = completion(fleet, prompt(510 + i, 50), max_tokens=8, temperature=0.0)
        assert r.status_code == 200, r.text
        if new_one_imported():
            break
    assert new_one_imported(), (old, transfers())

    assert post(decode=1).status_code == 200
    wait_for(lambda: sum(x["role"] == "decode" for x in state(console)["replicas"]) == 1, 180,
             "the decode pool back to one replica")
    settle(console)
    assert completion(fleet, prompt(600, 50), max_tokens=4).status_code == 200
