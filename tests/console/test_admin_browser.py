"""The console in real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright)
against a real `pagedjax serve` on a tiny model. Run scripts/install_browser.sh first.

The tiny checkpoint allows 8,192 positions so one ignore_eos generation runs for several
seconds: long enough for the once-a-second dashboard to see it come and go.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.console.server_util import start_server
from tests.tiny import make_tiny_checkpoint

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
PAGES = ["/admin", "/admin/requests", "/admin/policy", "/admin/prefix-cache", "/admin/model"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian chromium at /usr/bin/chromium "
                                                     "(run scripts/install_browser.sh)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny8k", max_position_embeddings=8192)
    # 8 MiB of float32 KV for this model = 1,024 blocks of 16 tokens.
    with start_server(ckpt, "--max-model-len", "8192", "--kv-cache-memory", "8MiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(10_000)
    yield pg
    ctx.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"console-{name}.png"), full_page=True)


def log_in(page, server, token: str | None = None) -> None:
    page.goto(server.url + "/admin")
    page.fill("#token", token or server.admin_token)
    page.click("button[type=submit]")


def wait_for_element(page, element_id: str, test: str, timeout: float) -> None:
    """Wait until `test` (JavaScript over the element `e`) holds. An HTMX swap replaces the
    element, so between the old one leaving and the new one arriving it is briefly absent:
    that moment reads as "not yet", not as an error."""
    page.wait_for_function(f"() => {{ const e = document.getElementById('{element_id}'); "
                           f"return e !== null && ({test}); }}", timeout=timeout)


def value(page, element_id: str) -> float:
    return float(page.get_attribute(f"#{element_id}", "data-value"))


class Stream(threading.Thread):
    """One streaming completion read to its end on a background thread."""

    def __init__(self, server, max_tokens: int, request_id: str | None = None, prompt: str = "hello") -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens, self.request_id, self.prompt = server, max_tokens, request_id, prompt
        self.started = threading.Event()
        self.events: list[dict] = []
        self.ended_at: float | None = None

    def run(self) -> None:
        headers = {**self.server.headers, **({"X-Request-ID": self.request_id} if self.request_id else {})}
        body = {"model": self.server.model, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c, c.stream("POST", self.server.url + "/v1/completions",
                                                      json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            self.started.set()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(json.loads(line[6:]))
        self.ended_at = time.monotonic()


def test_login_required_wrong_token_refused_and_logout(page, server):
    for path in PAGES:
        page.goto(server.url + path)
        assert page.url.startswith(server.url + "/admin/login"), path
    shot(page, "login")
    log_in(page, server, token="definitely-wrong")
    assert page.locator("#login-error").inner_text() == "Invalid or revoked token."
    assert "/admin/login" in page.url
    page.fill("#token", server.api_key)  # the REST API key is not an admin token
    page.click("button[type=submit]")
    assert page.locator("#login-error").is_visible()
    page.fill("#token", server.admin_token)
    page.click("button[type=submit]")
    page.wait_for_url(server.url + "/admin")
    assert page.locator("h1").inner_text() == "Dashboard"
    page.click("text=Log out")
    page.wait_for_url(re.compile(r".*/admin/login.*"))
    page.goto(server.url + "/admin/policy")
    assert page.url.startswith(server.url + "/admin/login")


def test_dashboard_used_blocks_rise_and_fall_without_reload(page, server):
    log_in(page, server)
    page.wait_for_selector("#used-blocks")
    wait_for_element(page, "used-blocks", "e.dataset.value === '0'", timeout=5000)
    page.evaluate("window.__noReload = true")
    gen = Stream(server, max_tokens=4000)
    gen.start()
    assert gen.started.wait(30)
    wait_for_element(page, "used-blocks", "Number(e.dataset.value) > 0", timeout=15000)
    shot(page, "dashboard")
    gen.join(120)
    assert gen.ended_at is not None and gen.events[-1]["choices"][0]["finish_reason"] == "length"
    wait_for_element(page, "used-blocks", "e.dataset.value === '0'", timeout=5000)
    assert page.evaluate("window.__noReload") is True  # updated in place by HTMX, not reloaded
    # The cell detail loads into its panel and survives the next refreshes.
    page.click("#bmap a >> nth=0")
    page.wait_for_selector("#block-detail table")
    page.wait_for_timeout(1500)
    assert "Block 0" in page.inner_text("#block-detail")


def test_polling_pauses_while_the_tab_is_hidden(page, server):
    log_in(page, server)
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if r.headers.get("hx-request") else None)
    page.wait_for_timeout(2500)
    assert len(polls) >= 1
    page.evaluate("Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => 'hidden'});"
                  "document.dispatchEvent(new Event('visibilitychange'))")
    page.wait_for_timeout(500)
    polls.clear()
    page.wait_for_timeout(3000)
    assert polls == []
    page.evaluate("delete document.visibilityState")
    page.wait_for_timeout(2500)
    assert len(polls) >= 1


def test_prefix_hit_rate_matches_metrics(page, server):
    shared = "You are a careful assistant. Answer briefly and cite the manual. " * 4
    with server.client() as c:
        for i in range(4):
            r = c.post("/v1/completions", json={"model": server.model, "prompt": shared + f"Question {i}?",
                                                "max_tokens": 4})
            assert r.status_code == 200, r.text
    hits = server.metric("pagedjax:prefix_cache_hits_total")
    queries = server.metric("pagedjax:prefix_cache_queries_total")
    assert hits and queries
    log_in(page, server)
    expected = f"{hits / queries * 100:.1f}%"
    wait_for_element(page, "hit-rate", f"e.textContent.trim() === '{expected}'", timeout=5000)
    shown = float(page.inner_text("#hit-rate").rstrip("%"))
    assert shown > 0 and abs(shown - hits / queries * 100) <= 0.05 + 1e-9
    page.goto(server.url + "/admin/prefix-cache")
    assert "You are a careful assistant" in page.inner_text("#top-prefixes")
    shot(page, "prefix-cache")
    cached = int(page.get_attribute("#pc-cached-blocks", "data-value"))
    page.click("text=Flush prefix cache…")  # asks first, inline
    page.wait_for_selector("#flush-confirm")
    assert f"{cached} cached block" in page.inner_text("#flush-confirm")
    page.click("#flush-yes")
    page.wait_for_selector("#flushed")
    assert page.get_attribute("#pc-cached-blocks", "data-value") == "0"


def test_policy_form_changes_live_policy_and_rejects_invalid(page, server):
    log_in(page, server)
    page.goto(server.url + "/admin/policy")
    old = page.inner_text("#cur-watermark")
    page.fill("#f-watermark", "0.15")
    page.click("text=Apply changes")
    page.wait_for_selector("#policy-saved")
    assert page.inner_text("#cur-watermark") == "0.15"
    assert page.request.get(server.url + "/admin/policy.json").json()["watermark"] == 0.15
    first = page.inner_text("#audit tbody tr >> nth=0")
    assert "watermark" in first and f"{old} → 0.15" in first and "admin" in first
    page.fill("#f-watermark", "1.5")
    page.click("text=Apply changes")
    err = page.wait_for_selector("#e-watermark")
    assert "between 0.0 and 0.95" in err.inner_text()
    assert page.inner_text("#cur-watermark") == "0.15"
    assert page.request.get(server.url + "/admin/policy.json").json()["watermark"] == 0.15
    shot(page, "policy")


def test_abort_from_requests_page_ends_the_stream(page, server):
    log_in(page, server)
    page.goto(server.url + "/admin/requests")
    gen = Stream(server, max_tokens=7000, request_id="console-abort-test")
    gen.start()
    assert gen.started.wait(30)
    row = page.locator('tr[data-request-id="console-abort-test-0"]')
    row.locator(".pill.running").wait_for(timeout=5000)
    shot(page, "requests")
    row.locator("button", has_text="Abort").click()
    clicked = time.monotonic()
    gen.join(15)
    assert gen.ended_at is not None and gen.ended_at - clicked < 10
    assert any("error" in e for e in gen.events)  # the stream ended with the abort, not by length
    assert sum(1 for e in gen.events if "choices" in e) < 7000
    row.wait_for(state="detached", timeout=5000)


def test_screenshot_model_page(page, server):
    log_in(page, server)
    page.goto(server.url + "/admin/model")
    assert page.inner_text("#block-size") == "16 tokens"
    assert page.inner_text("#num-blocks").startswith("1,024")
    shot(page, "model")


def test_a_viewer_sees_every_page_read_only(page, server):
    from console.state import StateStore

    token = StateStore.open(server.state_dir).add_operator(f"viewer{secrets.token_hex(3)}", "viewer")
    log_in(page, server, token=token)
    page.wait_for_url(server.url + "/admin")
    assert "(viewer: read-only)" in page.inner_text("#who")
    page.goto(server.url + "/admin/policy")
    assert page.locator("#read-only").is_visible()
    assert page.locator("#f-watermark").is_disabled() and page.locator("text=Apply changes").is_disabled()
    for path in ("/admin/keys", "/admin/operators"):
        page.goto(server.url + path)
        assert page.locator("#read-only").is_visible(), path
        assert page.locator("form.policy button[type=submit]").is_disabled(), path
    shot(page, "viewer-keys")
    # Even a hand-made POST from this session is refused.
    csrf = page.evaluate("JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
    r = page.request.post(server.url + "/admin/policy", form={"watermark": "0.5", "_csrf_token": csrf})
    assert r.status == 403
    assert page.request.get(server.url + "/admin/policy.json").json()["watermark"] != 0.5


def test_an_operator_adds_a_key_sees_it_once_uses_it_and_revokes_it(page, server):
    log_in(page, server)
    page.goto(server.url + "/admin/keys")
    name = f"k{secrets.token_hex(3)}"
    page.fill("#key-name", name)
    page.fill("#key-rpm", "100")
    page.click("#key-add")
    key = page.wait_for_selector("#key-value").inner_text().strip()
    assert key.startswith("pjk_")
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    page.goto(server.url + "/admin/keys")                       # shown once: not on a reload
    assert page.locator("#key-value").count() == 0 and key not in page.content()
    row = page.locator(f"#key-{name}")
    assert row.locator("[data-col=requests]").inner_text() == "1"
    shot(page, "keys")
    page.on("dialog", lambda d: d.accept())                     # hx-confirm
    row.locator("button", has_text="Revoke").click()
    page.locator(f"#key-{name}.revoked").wait_for(timeout=5000)
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 401


def test_audit_log_pages_filters_and_exports(page, server):
    log_in(page, server)
    page.goto(server.url + "/admin/policy")
    page.fill("#f-max_queue_len", "777")
    page.click("text=Apply changes")
    page.wait_for_selector("#policy-saved")
    page.goto(server.url + "/admin/audit")
    first = page.inner_text("#audit-log tbody tr >> nth=0")
    assert "policy" in first and "777" in first and "admin" in first
    page.select_option("#f-action", "policy")
    page.click("text=Show")
    page.wait_for_url(re.compile(r".*action=policy.*"))
    assert all("policy" in t for t in page.locator("#audit-log tbody tr td:nth-child(4)").all_inner_texts())
    shot(page, "audit")
    with page.expect_download() as dl:
        page.click("#export-csv")
    text = Path(dl.value.path()).read_text()
    assert text.splitlines()[0] == "id,time_utc,who,action,detail" and "777" in text
