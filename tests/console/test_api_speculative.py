"""Speculative decoding through a real `pagedjax serve` (tiny model): the usage extension, the
per-request opt-out, the metrics, a refused method."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.console.server_util import ServerHandle, start_server

PROMPT = "one two three four one two three four one two three"


@pytest.fixture(scope="module")
def server(tiny_ckpt) -> ServerHandle:
    with start_server(tiny_ckpt, "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}') as srv:
        yield srv


def _complete(server: ServerHandle, **extra) -> dict:
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120,
                   json={"model": server.model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                         "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_usage_reports_what_was_proposed_and_opt_out_gives_the_same_text(server):
    on = _complete(server)
    off = _complete(server, speculative=False)
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    spec = on["usage"]["speculative"]
    assert spec["proposed"] > 0 and 0 <= spec["accepted"] <= spec["proposed"]
    assert "speculative" not in off["usage"]
    metrics = httpx.get(server.url + "/metrics", headers=server.headers).text
    for name in ("pagedjax:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        line = next(x for x in metrics.splitlines() if x.startswith(name + '{method="ngram"}'))
        assert float(line.split()[-1]) > 0


def test_a_bad_speculative_field_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers,
                   json={"model": server.model, "prompt": "x", "speculative": "yes"})
    assert r.status_code == 400 and "speculative" in r.text


def test_an_unimplemented_method_is_refused_in_one_line(tiny_ckpt):
    p = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--checkpoint", str(tiny_ckpt),
                        "--prompt", "hi", "--max-tokens", "2", "--speculative-config", '{"method": "eagle"}'],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert "EAGLE ('eagle') is not implemented yet" in err[-1]


def test_n_choices_and_seeds_with_speculation(server):
    """n > 1 sampled choices: the same texts as with speculation opted out, seed for seed."""
    on = _complete(server, n=3, temperature=0.9, seed=11)
    off = _complete(server, n=3, temperature=0.9, seed=11, speculative=False)
    texts = lambda r: [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert texts(on) == texts(off) and len(texts(on)) == 3
    assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"] == 120
