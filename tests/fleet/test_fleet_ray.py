"""`pagedjax fleet serve` for real: a local Ray instance, two replicas of a tiny random
model (one core each), the prefix-aware router, the autoscaler. One fleet for the module;
the tests run in order and leave it as the next one expects (two replicas, idle).

Replica KV: 512 KiB = 64 blocks of 16 tokens, watermark 4 blocks, reserve mode, so a
request with max_tokens 400 reserves 28 blocks and each replica holds two of them.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import msgspec
import pytest

from console.state import StateStore
from tests.console.server_util import free_port, start_server
from tests.fleet.fleet_util import logged_in_console, state

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.fleet

# Speculation is on (the engine flags reach the replicas); the tests that need long-running
# streams opt out per request ("speculative": false), or the repetitive tiny model finishes them at once.
FLEET = ("--replicas", "2", "--min-replicas", "1", "--max-replicas", "2", "--scale-in-delay", "600",
         "--scale-horizon", "0.2", "--threads-per-replica", "1", "--admission-mode", "reserve",
         "--kv-cache-memory", "512KiB", "--max-num-seqs", "4", "--fleet-queue-cap", "2",
         "--fleet-queue-timeout", "120", "--drain-timeout", "120",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 5  # ~320 tokens


# vLLM's KV-event types as its subscriber example defines them (the tag is the class name),
# so the test decodes what a vLLM consumer would, not with our own classes.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@pytest.fixture(scope="module")
def zmq_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def fleet(tiny_ckpt, zmq_port):
    with start_server(tiny_ckpt, *FLEET, "--kv-events-endpoint", f"tcp://127.0.0.1:{zmq_port}",
                      subcommand=("fleet", "serve"), env={"RAY_ADDRESS": ""}, ready_timeout=420) as srv:
        yield srv


@pytest.fixture(scope="module")
def console(fleet):
    with logged_in_console(fleet) as c:
        yield c


def wait_for(pred, timeout: float, what: str, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def settle(console: httpx.Client, replicas: int = 2) -> None:
    """Until the replicas' stats show them idle and caught up with what was routed (a
    finished response can precede the engine freeing its blocks by a step, and the stats
    by a report)."""
    def idle() -> bool:
        s = state(console)
        return (len(s["replicas"]) == replicas and all(r["running"] == r["waiting"] == r["used_blocks"] == 0
                                                       for r in s["replicas"])
                and all(n == 0 for _, n in s["in_flight"].values()))

    wait_for(idle, 30, "idle replicas")


def routed(console: httpx.Client, ids: list[str]) -> dict[str, str]:
    """request id (X-Request-Id) -> replica, from the router's decision log."""
    out = {}
    for d in state(console)["decisions"]:
        rid = d["request_id"].rsplit("-", 1)[0]
        if rid in ids and d["replica"]:
            out.setdefault(rid, d["replica"])
    return out


async def _post_all(url: str, bodies: list[dict], ids: list[str], headers: dict) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as c:
        return await asyncio.gather(*[c.post("/v1/completions", json=b, headers={"X-Request-Id": i})
                                      for b, i in zip(bodies, ids)])


def test_fleet_serves_and_reports_two_replicas(fleet, console):
    s = state(console)
    assert len(s["replicas"]) == 2
    assert {r["num_blocks"] for r in s["replicas"]} == {64}
    metrics = fleet.client().get("/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert len(re.findall(rf'^{name}{{replica="[^"]+"}} ', metrics, re.M)) == 2, name
    assert len(re.findall(r'^vllm:cache_config_info\{replica="[^"]+",block_size="16",num_gpu_blocks="64"\} 1',
                          metrics, re.M)) == 2
    assert "pagedjax:fleet_replicas 2" in metrics
    # Each replica's own exposition, as llm-d's endpoint picker scrapes a model server.
    one = state(console)["replicas"][0]["replica"]
    r = fleet.client().get(f"/replicas/{one}/metrics")
    assert r.status_code == 200 and re.search(r"^vllm:num_requests_running 0", r.text, re.M)
    assert 'replica="' not in r.text
    assert fleet.client().get("/replicas/nope/metrics").status_code == 404


def test_replicas_speculate_and_the_usage_says_so(fleet, console):
    """The engine flags reach the replicas: a repetitive completion through the gateway is
    speculated, with the same text as with speculation opted out."""
    body = {"model": fleet.model, "prompt": "one two three four one two three four one two", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    on = httpx.post(fleet.url + "/v1/completions", json=body, headers=fleet.headers, timeout=120).json()
    off = httpx.post(fleet.url + "/v1/completions", json={**body, "speculative": False}, headers=fleet.headers,
                     timeout=120).json()
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert on["usage"]["speculative"]["proposed"] > 0 and "speculative" not in off["usage"]
    settle(console)


def test_kv_events_on_zmq_decode_with_vllms_own_types(fleet, zmq_port):
    """What a vLLM KV-event subscriber (llm-d's precise scorer) would read: multipart
    (topic, 8-byte sequence, msgpack KVEventBatch), decoded with vLLM's struct layout."""
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    for port in (zmq_port, zmq_port + 1):
        sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # let the subscription reach the publishers
    prompt = "zmq events " * 10
    r = fleet.client().post("/v1/completions", json={"model": fleet.model, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200
    stored = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not stored:
        if sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            stored += [e for e in batch.events if isinstance(e, BlockStored)]
    sub.close(0)
    assert stored and stored[0].block_size == 16 and len(stored[0].token_ids) == 16 * len(stored[0].block_hashes)


def test_requests_sharing_a_system_prompt_stay_on_one_replica(fleet, console):
    client = fleet.openai()
    cached, ids = [], []
    for i in range(5):
        r = client.chat.completions.with_raw_response.create(
            model=fleet.model, max_tokens=4,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}])
        ids.append(r.headers["x-request-id"])
        cached.append(r.parse().usage.prompt_tokens_details.cached_tokens)
    where = routed(console, ids)
    assert len(set(where.values())) == 1, where
    assert cached[0] == 0 and all(c >= 16 * 18 for c in cached[1:]), cached
    reasons = [d["reason"] for d in state(console)["decisions"] if d["request_id"].rsplit("-", 1)[0] in ids[1:]]
    assert reasons == ["prefix"] * 4


def test_the_gateway_quotes_from_the_replica_it_would_choose(fleet, console):
    """POST /v1/admission/quote in front of the fleet: after a request with the system prompt,
    the quote for another one names the replica holding that prefix (nothing is reserved)."""
    client = fleet.openai()
    r = client.chat.completions.with_raw_response.create(
        model=fleet.model, max_tokens=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Quote me?"}])
    holder = routed(console, [r.headers["x-request-id"]])[r.headers["x-request-id"]]
    settle(console)
    body = {"model": fleet.model, "max_tokens": 4,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And me?"}]}
    q = fleet.client().post("/v1/admission/quote", json=body)
    assert q.status_code == 200, q.text
    js = q.json()
    assert js["admit"] is True and js["replica"] == holder and "matched" in js["routing"]
    assert js["prefix_hit_tokens"] >= 16 * 16 and js["predicted_ttft_s"] > 0
    assert all(n == 0 for _, n in state(console)["in_flight"].values())  # (a quote routes nothing)


def test_cold_prefixes_spread_by_free_blocks(fleet, console):
    settle(console)
    ids = [f"cold{i}" for i in range(4)]
    bodies = [{"model": fleet.model, "prompt": f"{i} unrelated text {i * 7919} " * 3, "max_tokens": 200,
               "ignore_eos": True} for i in range(4)]
    rs = asyncio.run(_post_all(fleet.url, bodies, ids, fleet.headers))
    assert [r.status_code for r in rs] == [200] * 4
    where = routed(console, ids)
    counts = sorted(list(where.values()).count(r) for r in set(where.values()))
    detail = [(d["request_id"], d["replica"], d["detail"]) for d in state(console)["decisions"][:4]]
    assert counts == [2, 2], detail


def test_all_replicas_full_then_429_with_retry_after(fleet, console):
    """Each replica holds two 28-block reservations; two more wait in the fleet queue
    (cap 2) and are served later; the rest get 429 at once."""
    settle(console)
    ids = [f"full{i}" for i in range(8)]
    bodies = [{"model": fleet.model, "prompt": f"request {i} " * 4, "max_tokens": 400, "ignore_eos": True,
               "speculative": False}
              for i in range(8)]
    rs = asyncio.run(_post_all(fleet.url, bodies, ids, fleet.headers))
    codes = [r.status_code for r in rs]
    log = [(d["request_id"], d["replica"], d["detail"]) for d in state(console)["decisions"][:8]]
    assert codes.count(429) == 2 and codes.count(200) == 6, (codes, log, [r.text[:300] for r in rs])
    refused = [r for r in rs if r.status_code == 429]
    assert all(r.headers.get("retry-after") for r in refused)
    assert all(r.json()["error"]["code"] == "fleet_full" for r in refused)
    assert fleet.metric("pagedjax:fleet_rejections_total") >= 2


def test_policy_change_for_one_replica_from_the_console(fleet, console):
    page = console.get("/admin").text
    csrf = re.search(r'"X-CSRF-Token": "([^"]+)"', page).group(1)
    a, b = sorted(r["replica"] for r in state(console)["replicas"])
    bad = console.post("/admin/fleet/policy", data={"_csrf_token": csrf, "replica": a, "watermark": "2"})
    assert bad.status_code == 422 and "Nothing was changed" in bad.text
    r = console.post("/admin/fleet/policy", data={"_csrf_token": csrf, "replica": a, "admission_mode": "optimistic"})
    assert r.status_code == 200 and f"Policy applied to {a}" in r.text
    modes = lambda: {x["replica"]: x["admission_mode"] for x in state(console)["replicas"]}  # noqa: E731
    wait_for(lambda: modes() == {a: "optimistic", b: "reserve"}, 10, "the change to reach one replica only")
    change = state(console)["changes"][0]  # the page's last changes: the state file's audit log
    assert change["action"] == "policy" and change["detail"]["scope"] == a
    assert change["detail"]["changes"] == {"admission_mode": ["reserve", "optimistic"]}
    stored = StateStore.open(fleet.state_dir).audit(limit=1, action="policy")[0]
    assert stored.id == change["id"] and stored.who == "admin"
    # Back to the fleet-wide setting for the tests that follow.
    console.post("/admin/fleet/policy", data={"_csrf_token": csrf, "admission_mode": "reserve", "replica": a})
    wait_for(lambda: set(modes().values()) == {"reserve"}, 10, "reserve mode on both")


def test_api_key_limits_apply_in_front_of_the_fleet(fleet):
    """A key made with `pagedjax admin add-key` while the fleet runs: its rpm holds at the
    gateway (429 naming the limit) while the shared key is still served."""
    key = StateStore.open(fleet.state_dir).add_key("fleet-rpm1", rpm=1)
    body = {"model": fleet.model, "prompt": "hello", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.post(fleet.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
    r = httpx.post(fleet.url + "/v1/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["param"] == "rpm" and int(r.headers["retry-after"]) >= 1
    assert httpx.post(fleet.url + "/v1/completions", json=body, headers=fleet.headers, timeout=60).status_code == 200


def test_killed_replica_ends_its_streams_with_an_error_and_others_keep_serving(fleet, console):
    settle(console)
    client = fleet.openai(timeout=120)
    stream = client.completions.create(model=fleet.model, prompt="a long story " * 3, max_tokens=450,
                                       extra_body={"ignore_eos": True, "speculative": False}, stream=True)  # (slow)
    first = next(iter(stream))
    assert first.choices
    busy = wait_for(lambda: [r for r in state(console)["replicas"] if r["running"]], 10, "a busy replica")[0]
    os.kill(busy["pid"], signal.SIGKILL)   # a crash, not a graceful stop
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:  # the stream ends with the fleet's error event
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 60
    assert "replica" in str(err.value).lower()
    # New requests are served by the survivor meanwhile; then Ray replaces the dead replica.
    r = fleet.client().post("/v1/completions", json={"model": fleet.model, "prompt": "still there?", "max_tokens": 4})
    assert r.status_code == 200
    wait_for(lambda: len([x for x in state(console)["replicas"] if x["pid"] != busy["pid"]]) == 2, 240,
             "Ray to replace the killed replica")
    assert busy["replica"] not in {x["replica"] for x in state(console)["replicas"]}


def test_scale_in_drains_then_scale_out_under_load(fleet, console):
    """Lower the scale-in delay from the console: one replica goes, the stream it was
    serving finishes first (drained, not lost). Then queued load brings it back (1 -> 2)."""
    settle(console)
    client = fleet.openai(timeout=300)
    long = [client.completions.create(model=fleet.model, prompt=f"drain me {i} " * 3, max_tokens=450,
                                      extra_body={"ignore_eos": True, "speculative": False}, stream=True) for i in range(2)]
    heads = [next(iter(s)) for s in long]
    assert all(h.choices for h in heads)
    page = console.get("/admin").text
    csrf = re.search(r'"X-CSRF-Token": "([^"]+)"', page).group(1)
    r = console.post("/admin/fleet/autoscale", data={"_csrf_token": csrf, "scale_in_delay_s": "1"})
    assert r.status_code == 200 and "Autoscaler updated" in r.text
    # Both streams complete (finish "length", not an error event). The text is counted from
    # the head on: the tiny model's random bytes can keep the detokenizer waiting for a whole
    # UTF-8 character, so one stream's text once came in its head and final chunk only.
    chunks = [[h, *s] for h, s in zip(heads, long)]
    assert [[c.choices[0].finish_reason for c in cs if c.choices and c.choices[0].finish_reason]
            for cs in chunks] == [["length"], ["length"]]
    assert all("".join(c.choices[0].text for c in cs if c.choices) for cs in chunks)
    # (the history entry reaches the hub on the autoscaler's own beat: wait for both)
    wait_for(lambda: len((st := state(console))["replicas"]) == 1 and any(
        e["to"] < e["from"] and e["reason"].startswith("scale in") for e in st["scale_history"]), 120,
        "scale-in to one replica, in the scale history")
    change = state(console)["changes"][0]
    assert change["action"] == "autoscaler" and change["detail"]["changes"]["scale_in_delay_s"][1] == 1
    # Put the delay back up, then queue more work than one replica can hold.
    console.post("/admin/fleet/autoscale", data={"_csrf_token": csrf, "scale_in_delay_s": "600"})
    # Rounds of 4 until the autoscaler acts: one round can finish (the tiny model is fast on
    # a quiet machine) before the autoscaler's next look at the queue.
    def scaled_out() -> bool:
        return any(e["to"] > e["from"] and e["reason"].startswith("scale out") for e in state(console)["scale_history"])

    deadline = time.monotonic() + 60
    for k in range(1000):
        bodies = [{"model": fleet.model, "prompt": f"load {k} {i} " * 4, "max_tokens": 400, "ignore_eos": True,
                   "speculative": False}
                  for i in range(4)]
        rs = asyncio.run(_post_all(fleet.url, bodies, [f"load{k}-{i}" for i in range(4)], fleet.headers))
        assert all(r.status_code in (200, 429) for r in rs)
        if scaled_out() or time.monotonic() > deadline:
            break
    wait_for(scaled_out, 10, "a scale-out decision")
    wait_for(lambda: len(state(console)["replicas"]) == 2, 240, "the second replica back")
