"""Console pages against a real tiny-model engine stepped by the test: policy form and
audit log, requests and abort, prefix cache and flush, model page, fragments vs pages."""

from __future__ import annotations

import re

import pytest

from runtime.model.sampling import SamplingParams
from tests.console.admin_util import console_client, logged_in
from tests.engine_util import make_engine

PAGES = ["/admin", "/admin/requests", "/admin/policy", "/admin/prefix-cache", "/admin/model",
         "/admin/blocks?cell=1", "/admin/prefix-cache/flush"]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture()
def client(engine):
    with console_client(engine) as c:
        c.csrf = logged_in(c)
        yield c


def text_of(html: str, element_id: str) -> str:
    m = re.search(rf'id="{element_id}"[^>]*>(.*?)</', html, re.DOTALL)
    assert m, f"no element #{element_id}"
    return m.group(1).strip()


@pytest.mark.parametrize("path", PAGES)
def test_full_page_without_htmx_and_fragment_with_it(client, path):
    full = client.get(path)
    assert full.status_code == 200 and full.text.lstrip().startswith("<!doctype html>")
    assert 'href="/static/console.css"' in full.text and "/static/htmx.min.js" in full.text
    frag = client.get(path, headers={"HX-Request": "true"})
    assert frag.status_code == 200 and "<html" not in frag.text and "<nav" not in frag.text
    assert full.headers["cache-control"] == "no-store"


def test_static_assets_are_vendored(client):
    js = client.get("/static/htmx.min.js")
    assert js.status_code == 200 and 'version:"2.' in js.text
    assert client.get("/static/sse.js").status_code == 200
    assert client.get("/static/console.css").status_code == 200


def test_pages_say_warming_up_until_the_engine_exists(engine):
    with console_client(engine) as c:
        logged_in(c)
        c.app.state.engine = None
        r = c.get("/admin")
        assert r.status_code == 503 and "Engine warming up" in r.text
        assert "warming up" in c.get("/admin/requests", headers={"HX-Request": "true"}).text.lower()


def test_policy_change_applies_and_is_audited(client, engine):
    store = client.app.state.store
    audit = store.audit_count("policy")
    r = client.post("/admin/policy", data={"watermark": "0.2", "max_admissions_per_step": "3", "_csrf_token": client.csrf},
                    follow_redirects=False)
    assert r.status_code == 303
    assert engine.policy.watermark == 0.2 and engine.policy.max_admissions_per_step == 3
    assert store.audit_count("policy") == audit + 1
    stored = store.audit(limit=1)[0]  # the durable row: operator, diff, and the client
    assert (stored.who, stored.action) == ("admin", "policy") and stored.detail["changes"]["watermark"][1] == 0.2
    assert stored.detail["client"] == "testclient"
    assert client.app.state.store.last_policy().policy["max_admissions_per_step"] == 3
    page = client.get("/admin/policy?saved=true").text
    assert text_of(page, "cur-watermark") == "0.2"
    assert "Policy updated" in page
    row = re.search(r'<table class="data" id="audit">.*?<tbody>\s*<tr>(.*?)</tr>', page, re.DOTALL).group(1)
    assert "admin" in row and "watermark" in row and "0.2" in row
    assert client.get("/admin/policy.json").json()["watermark"] == 0.2


@pytest.mark.parametrize("field,value,message", [
    ("watermark", "1.5", "between 0.0 and 0.95"),
    ("watermark", "abc", "must be a number"),
    ("watermark", "nan", "finite"),
    ("max_num_seqs", "2.5", "whole number"),
    ("max_num_seqs", "99", "between 1 and 4"),
    ("admission_mode", "bogus", "reserve"),
    ("max_queue_len", "-1", "between 0"),
])
def test_invalid_value_shows_inline_error_and_changes_nothing(client, engine, field, value, message):
    before, audit = engine.policy, client.app.state.store.audit_count()
    # A valid change to another field in the same submission is not applied either.
    r = client.post("/admin/policy", data={field: value, "max_admissions_per_step": "5", "_csrf_token": client.csrf})
    assert r.status_code == 422
    err = text_of(r.text, f"e-{field}")
    assert message in err
    assert f'aria-describedby="h-{field} e-{field}"' in r.text
    assert engine.policy == before and client.app.state.store.audit_count() == audit
    assert client.get("/admin/policy.json").json() == before.to_json()


def test_htmx_invalid_submission_returns_fragment_with_errors(client, engine):
    r = client.post("/admin/policy", data={"watermark": "1.5", "max_num_seqs": "x"},
                    headers={"HX-Request": "true", "X-CSRF-Token": client.csrf})
    assert r.status_code == 422 and "<html" not in r.text
    assert "e-watermark" in r.text and "e-max_num_seqs" in r.text
    assert 'value="1.5"' in r.text  # the operator's input stays in the field


def test_policy_page_shows_every_knob_with_range(client, engine):
    page = client.get("/admin/policy").text
    for name in engine.policy.ranges(engine.envelope):
        assert f'name="{name}"' in page
        assert text_of(page, f"cur-{name}").replace(",", "") == str(getattr(engine.policy, name))


def test_requests_table_and_abort(client, engine):
    done = []
    prompt = engine.tokenizer.encode("a long running request " * 3)
    req = engine.add_request(prompt, SamplingParams(max_tokens=150, ignore_eos=True), on_output=done.append)
    engine.step()
    page = client.get("/admin/requests").text
    row = re.search(rf'<tr data-request-id="{req.request_id}">(.*?)</tr>', page, re.DOTALL).group(1)
    assert "running" in row and f">{len(prompt)}<" in row
    assert f'action="/admin/requests/{req.request_id}/abort"' in row
    r = client.post(f"/admin/requests/{req.request_id}/abort", headers={"X-CSRF-Token": client.csrf,
                                                                        "HX-Request": "true"})
    assert r.status_code == 200 and "Abort requested" in r.text
    row = client.app.state.store.audit(limit=1)[0]
    assert (row.who, row.action, row.detail["request_id"]) == ("admin", "abort", req.request_id)
    engine.step()
    assert req.is_finished and done[-1].finish_reason == "abort"
    assert req.request_id not in client.get("/admin/requests").text
    r = client.post(f"/admin/requests/{req.request_id}/abort", data={"_csrf_token": client.csrf})
    assert r.status_code == 200 and f"No running or waiting request <code>{req.request_id}</code>" in r.text


def test_prefix_cache_hits_and_flush(client, engine):
    shared = engine.tokenizer.encode("the shared system prompt of every request " * 2)
    for i in range(3):
        engine.generate([shared + engine.tokenizer.encode(f" q{i}")], SamplingParams(max_tokens=2))
    snap = engine.snapshot()
    assert snap.prefix_hits > 0
    dash = client.get("/admin").text
    assert float(re.search(r'id="hit-rate" data-value="([0-9.]+)"', dash).group(1)) == pytest.approx(
        snap.prefix_hits / snap.prefix_queries, abs=1e-6)
    page = client.get("/admin/prefix-cache").text
    assert "the shared system prompt" in page
    assert int(re.search(r'id="pc-cached-blocks" data-value="(\d+)"', page).group(1)) == snap.cached_blocks > 0
    confirm = client.get("/admin/prefix-cache/flush").text
    assert "Flush the prefix cache?" in confirm and 'method="post"' in confirm
    r = client.post("/admin/prefix-cache/flush", data={"_csrf_token": client.csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/admin/prefix-cache?flushed={snap.cached_blocks}"
    assert engine.snapshot().cached_blocks == 0
    row = client.app.state.store.audit(limit=1)[0]
    assert (row.action, row.detail["blocks"]) == ("flush_prefix_cache", snap.cached_blocks)
    assert f"Flushed {snap.cached_blocks} cached block" in client.get(r.headers["location"]).text


def test_dashboard_block_map_and_detail(client, engine):
    dash = client.get("/admin").text
    cells = re.findall(r'<a class="([fcus])" href="\?cell=(\d+)" title="([^"]+)"', dash)
    assert len(cells) == engine.pool.num_blocks  # one cell per block for a small cache
    assert cells[0][2].startswith("block 0 · ")
    detail = client.get("/admin?cell=2").text
    assert "<h3>Block 2</h3>" in detail
    frag = client.get("/admin/blocks?cell=2", headers={"HX-Request": "true"}).text
    assert "Block 2" in frag and "Ref count" in frag and "<html" not in frag
    for chart in ("c-hit", "c-evict", "c-queue", "c-tokens", "c-step", "c-tps", "c-used"):
        assert f'id="{chart}-svg"' in dash  # every chart has a text equivalent beside it
        assert re.search(rf'id="{chart}-d">[^<]+\.</desc>', dash)


def test_model_page(client, engine, tiny_ckpt):
    page = client.get("/admin/model").text
    cfg = engine.config
    assert text_of(page, "block-size") == f"{cfg.cache.block_size} tokens"
    assert f"{cfg.cache.num_blocks}" in text_of(page, "num-blocks")
    per_block = cfg.cache.bytes_per_block(cfg.model)
    assert f"({per_block:,} B)" in text_of(page, "bytes-per-block")
    assert text_of(page, "architecture").startswith("llama")
    assert page.count("×") >= len(engine.envelope.bucket_pairs())
    assert "B_max" in page and "H100" in page
    assert text_of(page, "tp") == "off (one device)"


def test_model_page_shows_quantized_weights_and_kv_cache(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                      kv_dtype="int8", quantization="w8a8")
    with console_client(eng) as c:
        logged_in(c)
        page = c.get("/admin/model").text
    m = eng.config.model
    assert text_of(page, "kv-dtype").startswith("int8 (a float16 scale and zero per 8 channels of K and 32 of V")
    groups = m.head_dim // 8 + (m.head_dim // 32 if m.head_dim % 32 == 0 else 1)
    assert f"(2 · {m.head_dim} · 1 B + {4 * groups} B scales)" in text_of(page, "kv-per-token")
    assert text_of(page, "quantization").startswith("w8a8: int8 decoder weights")
    per_block = eng.config.cache.bytes_per_block(m)
    assert per_block == 16 * m.num_layers * m.num_kv_heads * (2 * m.head_dim + 4 * groups)
    assert f"({per_block:,} B)" in text_of(page, "bytes-per-block")
