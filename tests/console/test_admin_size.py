"""A 50,000-block cache keeps the dashboard small: blocks aggregate into at most
MAX_CELLS map cells, and nothing else on the page grows with the cache."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from console.admin_json import snapshot_json_body
from console.views import MAX_CELLS
from runtime.core.block_pool import hash_block
from tests.console.admin_util import console_client, logged_in
from tests.engine_util import make_engine

NUM_BLOCKS = 50_000
LIMIT = 300 * 1000
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="module")
def big_engine(tiny_ckpt):
    engine = make_engine(tiny_ckpt, num_blocks=NUM_BLOCKS, max_num_seqs=4, max_num_batched_tokens=32,
                         max_model_len=256)
    pool = engine.pool
    # A realistic mix without running the model: used, shared (ref 2) and cached blocks.
    used = pool.allocate(20_000)
    pool.touch(used[:3_000])
    cached = pool.allocate(15_000)
    for i, b in enumerate(cached):
        tokens = [i % 200] * pool.block_size
        pool.cache_block(b, hash_block(None, tokens, (i,)), tokens)
    pool.free(cached)
    return engine


def test_dashboard_for_50k_blocks_stays_under_300kb(big_engine, capsys):
    with console_client(big_engine) as client:
        logged_in(client)
        t0 = time.perf_counter()
        page = client.get("/admin")
        elapsed = time.perf_counter() - t0
        fragment = client.get("/admin", headers={"HX-Request": "true"})
    assert page.status_code == 200 and fragment.status_code == 200
    size, frag_size = len(page.content), len(fragment.content)
    with capsys.disabled():
        print(f"\n50,000-block dashboard: full page {size:,} B, live fragment {frag_size:,} B, "
              f"rendered in {elapsed * 1000:.0f} ms")
    assert size < LIMIT and frag_size < LIMIT
    cells = re.findall(r'<a class="([fcus])" href="\?cell=(\d+)" title="blocks (\d+)–(\d+): (\d+) used, '
                       r'(\d+) shared, (\d+) cached, (\d+) free"', page.text)
    assert 0 < len(cells) <= MAX_CELLS
    # The aggregate cells account for every block exactly once.
    assert sum(int(c[4]) + int(c[5]) + int(c[6]) + int(c[7]) for c in cells) == NUM_BLOCKS
    assert sum(int(c[5]) for c in cells) == 3_000 and sum(int(c[6]) for c in cells) == 15_000
    assert re.search(r'id="used-blocks" data-value="20000"', page.text)
    assert re.search(r'id="cached-blocks" data-value="15000"', page.text)


def test_block_detail_lists_one_cells_blocks(big_engine):
    with console_client(big_engine) as client:
        logged_in(client)
        frag = client.get("/admin/blocks?cell=0", headers={"HX-Request": "true"}).text
    per_cell = -(-NUM_BLOCKS // MAX_CELLS)
    assert f"Blocks 0–{per_cell - 1}" in frag
    assert frag.count("<tr><td>") == per_cell
    assert "shared" in frag  # blocks 0..2999 were touched twice


def test_snapshot_json_for_50k_blocks_is_one_letter_per_block(big_engine):
    body = snapshot_json_body(big_engine, blocks=True)
    assert "blocks" not in body and len(body["block_map"]) == NUM_BLOCKS
    counts = {"used": 17_000, "shared": 3_000, "cached": 15_000, "free": 15_000}
    assert body["block_counts"] == counts
    assert {s: body["block_map"].count(s[0]) for s in counts} == counts
    assert body["block_map"][:3_000] == "s" * 3_000 and body["block_map"][20_000] == "c"
    assert (body["used_blocks"], body["cached_blocks"]) == (20_000, 15_000)
    assert body["prefixes"] == []  # cached, never reused
    assert len(json.dumps(snapshot_json_body(big_engine))) < 10_000  # without the map it stays small


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian chromium at /usr/bin/chromium "
                                                  "(run scripts/install_browser.sh)")
def test_screenshot_of_the_aggregated_map(big_engine):
    """The 50k-block page rendered by the real app, shown in Chromium (no server needed:
    Playwright serves the captured page and static files; live polls get 204, no swap)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with console_client(big_engine) as client:
        logged_in(client)
        html = client.get("/admin").text
        static = {name: client.get(f"/static/{name}").content for name in ("console.css", "htmx.min.js")}
    types = {"css": "text/css", "js": "text/javascript"}

    def serve(route) -> None:
        url = route.request.url
        name = url.rsplit("/", 1)[1]
        if "/static/" in url and name in static:
            route.fulfill(body=static[name], content_type=types[name.rsplit(".", 1)[1]])
        elif route.request.headers.get("hx-request"):
            route.fulfill(status=204)
        else:
            route.fulfill(body=html, content_type="text/html")

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        page.route("**/*", serve)
        page.goto("http://console.test/admin")
        assert page.locator("#bmap a").count() <= MAX_CELLS
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console-dashboard-50k-blocks.png"), full_page=False)
        browser.close()
