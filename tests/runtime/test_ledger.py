"""The per-request decision ledger (runtime/core/ledger.py): every request's final state is
explained by its entries (queued, why it waited, admission with its prefix hit, chunks,
preemptions with the victim's reason and swap or recompute, finish), the ledger stays bounded,
finished ones are kept for a while, and the console shows it as a timeline and as JSON."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from runtime.core.ledger import KEEP_HEAD, MAX_ENTRIES, Ledger
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

SP = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 260, size=n)]


def kinds(led: dict) -> list[str]:
    return [e["kind"] for e in led["entries"]]


def test_folding_and_the_bound():
    led = Ledger()
    led.add("queued", "in the batch queue", position=1)
    for i in range(5):
        led.add("waiting", "not enough free KV blocks above the watermark", need_blocks=3 + i)
    assert [(e.kind, e.count) for e in led.entries] == [("queued", 1), ("waiting", 5)]
    assert led.entries[1].inputs == {"need_blocks": 7} and led.entries[1].last_t >= led.entries[1].t
    for i in range(2 * MAX_ENTRIES):
        led.add("chunk", f"chunk {i}")  # (distinct reasons never fold)
    assert len(led.entries) == MAX_ENTRIES and led.dropped == 2 * MAX_ENTRIES + 2 - MAX_ENTRIES
    assert [e.kind for e in led.entries[:2]] == ["queued", "waiting"]  # the head stays
    assert led.entries[-1].reason == f"chunk {2 * MAX_ENTRIES - 1}" and KEEP_HEAD < MAX_ENTRIES


def test_every_request_s_final_state_is_explained(tiny_ckpt):
    """Four batch requests that outgrow a 14-block pool with a host tier: the ledgers say who
    waited for blocks, who was preempted for whom and whether its KV went to host RAM, and how
    each finished; a finished request's ledger stays readable."""
    from runtime.core.engine import LLMEngine

    base = make_engine(tiny_ckpt, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                       watermark=0.0)
    cfg = replace(base.config, kv_offload_memory=64 << 20)
    eng = LLMEngine.from_checkpoint(tiny_ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)
    reqs = [eng.add_request(prompt(i, 40), SP, priority="batch") for i in range(4)]
    eng.run_until_done()
    leds = [eng.ledger(r.request_id) for r in reqs]
    for r, led in zip(reqs, leds):
        assert led is not None and led["state"] == "finished" and led["finish_reason"] == "length"
        assert kinds(led)[0] == "queued" and kinds(led)[-1] == "finished"
        assert "admitted" in kinds(led) and "chunk" in kinds(led)
        assert led["entries"][-1]["inputs"]["output_tokens"] == 60
        assert kinds(led).count("preempted") == r.num_preemptions
    pre = [e for led in leds for e in led["entries"] if e["kind"] == "preempted"]
    assert pre and all("out of KV blocks" in e["reason"] for e in pre)
    assert any("goes to host RAM (swap)" in e["reason"] for e in pre)
    assert any(e["reason"] == "resumed with its KV written back from host RAM (swap)"
               for led in leds for e in led["entries"])
    waited = [e for led in leds for e in led["entries"] if e["kind"] == "waiting"]
    assert any(e["reason"] == "not enough free KV blocks above the watermark" and e["inputs"]["need_blocks"] > 0
               for e in waited)
    chunks = [e for e in leds[0]["entries"] if e["kind"] == "chunk" and e["reason"] == "decode"]
    assert sum(e["count"] for e in chunks) >= 50  # one folded row per run of decode steps
    assert eng.ledger("no-such-request") is None


def test_interactive_victims_say_recompute_and_the_ledger_can_be_off(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                      watermark=0.0)
    reqs = [eng.add_request(prompt(i, 40), SP) for i in range(4)]
    eng.run_until_done()
    pre = [e for r in reqs for e in eng.ledger(r.request_id)["entries"] if e["kind"] == "preempted"]
    assert pre and all(e["reason"].endswith("its KV is dropped (recompute)") for e in pre)
    off = make_engine(tiny_ckpt, num_blocks=14)
    from runtime.core.engine import LLMEngine

    cfg = replace(off.config, request_ledger=False)
    off = LLMEngine.from_checkpoint(tiny_ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)
    r = off.generate([prompt(1, 20)], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert off.ledger(r.request_id) is None and r.ledger.entries == []


@pytest.fixture()
def console(tiny_ckpt):
    from tests.console.admin_util import console_client, logged_in

    eng = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
    with console_client(eng) as c:
        logged_in(c)
        yield c, eng


def test_the_console_shows_the_timeline_and_json(console):
    c, eng = console
    done = eng.generate([prompt(3, 50)], SamplingParams(temperature=0.0, max_tokens=4), request_id="led-1")[0]
    waiting = eng.add_request(prompt(4, 20), SamplingParams(temperature=0.0, max_tokens=4), request_id="led-2")
    page = c.get("/admin/requests/led-1")
    assert page.status_code == 200 and 'id="ledger"' in page.text
    assert "in the interactive queue" in page.text and "prefill chunk" in page.text and "finished" in page.text
    js = c.get("/admin/requests/led-1.json").json()
    assert js["request_id"] == "led-1" and js["state"] == "finished" and kinds(js)[-1] == "finished"
    assert js["output_tokens"] == done.num_output_tokens == 4
    assert kinds(c.get("/admin/requests/led-2.json").json()) == ["queued"] and waiting.status.value == "waiting"
    assert 'href="/admin/requests/led-2"' in c.get("/admin/requests").text  # the requests table links it
    frag = c.get("/admin/requests/led-1", headers={"HX-Request": "true"})
    assert frag.status_code == 200 and "<html" not in frag.text and 'id="ledger"' in frag.text
    missing = c.get("/admin/requests/nope.json")
    assert missing.status_code == 404 and "no ledger" in missing.json()["detail"]
    assert c.get("/admin/requests/nope").status_code == 404
    eng.run_until_done()


def test_decisions_from_before_the_engine_come_first(tiny_ckpt):
    """A named API key's check (console/api.py) and a fleet gateway's routing arrive with the
    request (add_request's `decisions`) and head its ledger."""
    eng = make_engine(tiny_ckpt, num_blocks=64)
    r = eng.add_request(prompt(1, 20), SamplingParams(temperature=0.0, max_tokens=2), request_id="k1",
                        decisions=[("api_key", "key 'team-a': within its limits", {}),
                                   ("routed", "to r1: matched 2 cached blocks", {"matched_blocks": 2})])
    eng.run_until_done()
    led = eng.ledger("k1")
    assert kinds(led)[:3] == ["api_key", "routed", "queued"] and led["entries"][1]["inputs"] == {"matched_blocks": 2}
    assert r.finish_reason == "length"


def test_a_named_key_s_check_is_in_the_ledger_through_the_api(tiny_ckpt):
    from tests.console.admin_util import console_client, logged_in

    eng = make_engine(tiny_ckpt, num_blocks=64)
    with console_client(eng) as c:
        logged_in(c)
        store = c.app.state.store
        secret = store.add_key("team-a", rpm=100)
        import threading

        stop = threading.Event()

        def loop():  # (the engine loop the server would run)
            while not stop.is_set():
                if eng.has_unfinished():
                    eng.step()
                else:
                    stop.wait(0.005)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt(2, 10), "max_tokens": 2},
                       headers={"Authorization": f"Bearer {secret}", "X-Request-Id": "keyed"})
        finally:
            stop.set()
            t.join()
        assert r.status_code == 200, r.text
        led = c.get("/admin/requests/keyed-0.json").json()
        assert led["entries"][0]["kind"] == "api_key" and "team-a" in led["entries"][0]["reason"]


def test_the_requests_page_says_why_a_request_waits(tiny_ckpt):
    """A request held back by the watermark shows its latest decision (the wait and its reason)
    in the requests table and the snapshot."""
    from tests.console.admin_util import console_client, logged_in

    eng = make_engine(tiny_ckpt, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                      watermark=0.5)
    eng.add_request(prompt(1, 100), SamplingParams(temperature=0.0, max_tokens=40), request_id="big")
    eng.step()
    eng.add_request(prompt(2, 100), SamplingParams(temperature=0.0, max_tokens=40), request_id="held")
    eng.step()
    view = {r.request_id: r for r in eng.snapshot().requests}
    assert view["held"].state == "waiting"
    assert view["held"].latest == "waiting: not enough free KV blocks above the watermark"
    with console_client(eng) as c:
        logged_in(c)
        page = c.get("/admin/requests").text
        assert "not enough free KV blocks above the watermark" in page
    eng.run_until_done()
