"""Benchmark tooling: statistics, reports, workloads, the host benchmark, and
`pagedjax bench serve` driving a real `pagedjax serve` (tiny model). No wall-clock asserts."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from runtime.bench import loadgen, report
from runtime.bench.loadgen import LoadConfig, RequestRecord, build_workload
from runtime.bench.offline import bench_host, format_host
from runtime.bench.report import build_report, summarize
from scripts.bench_render.benchmarks_md import render_benchmarks

ROOT = Path(__file__).resolve().parents[2]


# --- statistics ---------------------------------------------------------------------------------
def test_summarize_percentiles_are_numpys():
    rng = random.Random(7)
    xs = [rng.expovariate(1.0) for _ in range(101)]
    s = summarize(xs)
    for q in (50, 90, 99):
        assert s[f"p{q}"] == float(np.percentile(xs, q))
    assert summarize([1, 2, 3, 4])["p50"] == 2.5 and summarize([3.0])["p99"] == 3.0


def test_summarize_fields_and_order():
    s = summarize([5, 1, 4, 2, 3, None])
    assert s["count"] == 5 and s["mean"] == 3 and s["min"] == 1 and s["max"] == 5 and s["p50"] == 3
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    empty = summarize([])
    assert empty["count"] == 0 and empty["mean"] is None and empty["p99"] is None


def _rec(i, start, ttft, gaps, tokens, ok=True, error=None, prompt=100, cached=None):
    times, t = [], start + ttft
    for g in [0.0, *gaps]:
        t += g
        times.append(t)
    return RequestRecord(i, ok=ok, start=start, ttft=ttft if ok else None,
                         e2e=(times[-1] - start) if ok else None, chunk_times=times if ok else [],
                         prompt_tokens=prompt if ok else 0, output_tokens=tokens if ok else 0,
                         cached_tokens=cached, error=error)


def test_build_report_counts_throughput_and_latencies():
    recs = [_rec(0, 0.0, 0.5, [0.1, 0.1, 0.2], 4, cached=64),
            _rec(1, 0.2, 0.3, [0.1, 0.3], 3, cached=32),
            _rec(2, 0.4, 0, [], 0, ok=False, error="HTTP 429: queue full"),
            _rec(3, 0.5, 0, [], 0, ok=False, error="HTTP 429: queue full")]
    r = build_report(recs, 2.0, config={"scenario": "shared-prefix", "max_tokens": 4, "model": "m"},
                     server={"prefix_cache_hits": 96.0, "prefix_cache_queries": 200.0, "preemptions": 0.0,
                             "prefix_cache_hit_rate": 0.48})
    assert r["successful_requests"] == 2 and r["failed_requests"] == 2
    assert r["errors"] == {"HTTP 429: queue full": 2}
    assert r["total_output_tokens"] == 7 and r["total_input_tokens"] == 200
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(3.5)
    assert r["total_token_throughput"] == pytest.approx(103.5)
    assert r["ttft_s"]["count"] == 2 and r["ttft_s"]["mean"] == pytest.approx(0.4)
    assert sorted(r["samples"]["itl_s"]) == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.3])
    assert r["e2e_s"]["max"] == pytest.approx(0.9)
    assert r["tpot_s"]["count"] == 2
    assert r["client_cached_token_rate"] == pytest.approx(0.48)
    assert sum(r["timeline"]["requests_per_s"]) * r["timeline"]["bin_s"] == pytest.approx(2)
    assert sum(r["timeline"]["output_tokens_per_s"]) * r["timeline"]["bin_s"] == pytest.approx(7)
    json.dumps(r)  # serialisable as is
    text = report.format_report(r)
    assert "TTFT" in text and "48.0%" in text and "error x2" in text


def test_sweep_table_and_plots(tmp_path):
    recs = [_rec(i, 0.1 * i, 0.2, [0.05] * 5, 6) for i in range(8)]
    runs = [(c, build_report(recs, 1.0 + c, config={"scenario": "random", "max_tokens": 6, "concurrency": c,
                                                    "model": "m"}, server=None)) for c in (1, 4)]
    s = report.build_sweep("concurrency", runs)
    assert [p["value"] for p in s["points"]] == [1, 4]
    assert all("samples" not in r for r in s["runs"])
    assert "concurrency" in report.format_sweep(s)
    if not report.have_matplotlib():
        pytest.skip("matplotlib not installed")
    report.plot_report(runs[0][1], tmp_path / "r.png")
    report.plot_sweep(s, tmp_path / "s.png")
    assert (tmp_path / "r.png").stat().st_size > 1000 and (tmp_path / "s.png").stat().st_size > 1000


def test_prometheus_parsing_and_counter_delta():
    text = ("# HELP pagedjax:prefix_cache_hits_total x\n# TYPE pagedjax:prefix_cache_hits_total counter\n"
            "pagedjax:prefix_cache_hits_total 320.0\npagedjax:prefix_cache_queries_total 400.0\n"
            'pagedjax:kv_blocks{state="used"} 3.0\npagedjax:kv_blocks{state="free"} 5.0\n'
            "pagedjax:num_preemptions_total 2.0\n")
    m = loadgen.parse_prometheus(text)
    assert m["pagedjax:kv_blocks"] == 8.0
    before = loadgen.server_counters(m)
    after = dict(before, prefix_cache_hits=420.0, prefix_cache_queries=600.0, preemptions=5.0)
    d = loadgen.counter_delta(before, after)
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.5) and d["preemptions"] == 3.0
    assert loadgen.counter_delta(None, after) is None
    assert loadgen.server_counters({"vllm:num_preemptions_total": 1.0}) == {"preemptions": 1.0}


# --- workloads and configuration ------------------------------------------------------------------------
def test_workloads():
    sp = build_workload("shared-prefix", 12, max_tokens=8, seed=1)
    assert all(s.messages[0]["content"] == loadgen.SYSTEM_PROMPT for s in sp)
    assert len({s.messages[1]["content"] for s in sp}) == 12  # every user message differs
    assert build_workload("shared-prefix", 3, seed=1) == build_workload("shared-prefix", 3, seed=1)
    short = build_workload("shared-prefix", 2, prefix_words=10)
    assert len(short[0].messages[0]["content"].split()) == 10
    rnd = build_workload("random", 20, input_len=100, seed=2)
    lens = [len(s.prompt.split()) for s in rnd]
    assert all(s.messages is None for s in rnd) and min(lens) >= 25 and max(lens) <= 180 and len(set(lens)) > 5
    long = build_workload("long-prompt", 2, input_len=1000)
    assert all(len(s.prompt.split()) >= 1000 for s in long)
    with pytest.raises(ValueError, match="scenario"):
        build_workload("nope", 1)


def test_multi_prefix_interleaves_four_system_prompts():
    mp = build_workload("multi-prefix", 12, seed=3)
    systems = [s.messages[0]["content"] for s in mp]
    assert len(set(systems)) == loadgen.NUM_PREFIXES == 4
    assert systems[:4] == systems[4:8] == systems[8:12]  # request i uses prompt i % 4
    # They differ from the first words on (distinct first KV block), and carry the shared text.
    assert len({s.split()[0] + s.split()[1] for s in set(systems)}) == 4
    assert all(loadgen.SYSTEM_PROMPT in s for s in systems)


def test_as_text_sends_the_same_chat_as_one_completions_prompt():
    chats = build_workload("shared-prefix", 3, seed=1)
    texts = build_workload("shared-prefix", 3, seed=1, as_text=True)
    assert all(t.messages is None and t.prompt for t in texts)
    for c, t in zip(chats, texts):
        system, user = c.messages[0]["content"], c.messages[-1]["content"]
        assert t.prompt.startswith(system) and f"User: {user}" in t.prompt and t.prompt.endswith("Assistant:")
    # The shared system prompt stays a shared prefix of the text prompts.
    assert len({t.prompt[:len(chats[0].messages[0]["content"])] for t in texts}) == 1
    assert build_workload("random", 2, as_text=True) == build_workload("random", 2)


def test_load_config_validation():
    with pytest.raises(ValueError, match="rate"):
        LoadConfig(url="http://x", rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="concurrency"):
        LoadConfig(url="http://x", concurrency=0)
    assert "api_key" not in LoadConfig(url="http://x", api_key="secret").describe()
    assert loadgen.root_url("http://h:1/v1/") == "http://h:1"


def test_system_prompt_is_about_320_smollm2_tokens():
    path = ROOT / "checkpoints" / "smollm2-135m-instruct" / "tokenizer.json"
    if not path.is_file():
        pytest.skip("SmolLM2 checkpoint not converted")
    from tokenizers import Tokenizer

    n = len(Tokenizer.from_file(str(path)).encode(loadgen.SYSTEM_PROMPT).ids)
    assert 290 <= n <= 350


# --- offline host benchmark ----------------------------------------------------------------------------------
def test_offline_host_benchmark_fields():
    r = bench_host(num_seqs=24, steps=6, prompt_len=40, shared_prefix_len=32, token_budget=64)
    assert r["num_seqs"] == 24 and r["steps"] == 6
    for key in ("schedule_commit_us", "build_input_us"):
        s = r[key]
        assert s["count"] == 6 and s["mean"] > 0 and s["p50"] <= s["p99"]
    assert r["prefix_cache_hit_rate"] > 0  # the shared 32-token prefix = 2 cached blocks
    mean = r["schedule_commit_us"]["mean"]
    assert "(target <= 1,000: " in format_host(r)
    assert ": OK)" in format_host({**r, "target_us": mean * 2})
    assert ": OVER TARGET)" in format_host({**r, "target_us": mean / 2})


def test_offline_host_via_cli(tmp_path, capsys):
    from runtime.cli import main

    out = tmp_path / "off.json"
    assert main(["bench", "offline", "--part", "host", "--host-seqs", "16", "--host-steps", "4",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "offline" and data["host"]["steps"] == 4 and "cpu_model" in data["machine"]
    assert "schedule + commit" in capsys.readouterr().out


def test_render_benchmarks_from_json(tmp_path, capsys):
    """scripts/render_benchmarks.py (the renderers are not in the installed package)."""
    from scripts.render_benchmarks import main as render_main

    host = bench_host(num_seqs=8, steps=3)
    report.write_json({"kind": "offline", "host": host}, tmp_path / "offline.json")
    text = render_benchmarks(tmp_path)
    assert "# Benchmarks" in text and "schedule + commit" in text and "_not measured_" in text
    (tmp_path / "commands.txt").write_text("pagedjax bench offline --part host\n")
    out = tmp_path / "BENCHMARKS.md"
    assert render_main(["--results", str(tmp_path), "--commands", str(tmp_path / "commands.txt"),
                        "--out", str(out)]) == 0
    page = out.read_text()
    assert "pagedjax bench offline --part host" in page and "renderer: `scripts/render_benchmarks.py`" in page
    assert render_main(["--results", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert render_main(["guidellm-failed", str(tmp_path / "g.json"), "no venv"]) == 0
    assert json.loads((tmp_path / "g.json").read_text()) == {"ok": False, "reason": "no venv"}


def test_bench_cli_errors(capsys):
    from runtime.cli import main

    assert main(["bench", "sweep", "--url", "http://127.0.0.1:9", "--concurrencies", "1,x"]) == 2
    assert "concurrencies" in capsys.readouterr().err


def test_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    from runtime.cli import main

    monkeypatch.setattr(report, "have_matplotlib", lambda: False)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0]


def test_bench_serve_unreachable_server_fails_cleanly(tmp_path):
    cfg = LoadConfig(url="http://127.0.0.1:9", model="m", num_requests=2, concurrency=1, timeout_s=5,
                     max_duration_s=20, progress=False)
    r = loadgen.run_load(cfg)
    assert r["successful_requests"] == 0 and r["failed_requests"] == 2 and r["server"] is None


# --- against a real server --------------------------------------------------------------------------------------
def test_bench_serve_against_pagedjax_serve(tiny_ckpt, tmp_path):
    server_util = pytest.importorskip("tests.console.server_util")
    from runtime.cli import main

    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    with server_util.start_server(tiny_ckpt, "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                                  "--max-model-len", "512", "--kv-cache-memory", "16MiB") as srv:
        argv = ["bench", "serve", "--url", srv.url, "--scenario", "shared-prefix", "--num-requests", "12",
                "--concurrency", "4", "--max-tokens", "8", "--prefix-words", "40", "--timeout", "120",
                "--max-duration", "300", "--out", str(out), "--no-progress"]
        if srv.api_key:
            argv += [f"--api-key={srv.api_key}"]  # "=": a random key may begin with "-"
        if report.have_matplotlib():
            argv += ["--plot", str(png)]
        assert main(argv) == 0
        # The same server: streams decoding while longer prompts arrive (bench interference).
        inter = tmp_path / "interference.json"
        argv = ["bench", "interference", "--url", srv.url, "--streams", "4", "--stream-tokens", "80",
                "--long-prompt-words", "40", "--long-max-tokens", "4", "--num-long", "2", "--long-interval", "0.3",
                "--out", str(inter)] + ([f"--api-key={srv.api_key}"] if srv.api_key else [])
        assert main(argv) == 0
    i = json.loads(inter.read_text())
    assert (i["streams_ok"], i["long_ok"], i["errors"]) == (4, 2, [])
    assert i["long_prompt_tokens"] > 100 and i["long_ttft_ms"]["n"] == 2
    assert i["itl_ms"]["n"] > 0 and 0 < i["itl_ms"]["p50"] <= i["itl_ms"]["p99"] <= i["itl_ms"]["max"]
    assert i["machine"]["cpu_model"] and i["load_avg_1m"] >= 0
    r = json.loads(out.read_text())
    assert r["successful_requests"] == 12 and r["failed_requests"] == 0, r["errors"]
    assert r["config"]["model"] and r["total_output_tokens"] > 0
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["total_token_throughput"] > 0
    for key in ("ttft_s", "e2e_s", "itl_s"):
        s = r[key]
        if s["count"]:
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"] and math.isfinite(s["mean"])
    assert r["ttft_s"]["count"] == 12 and r["e2e_s"]["count"] == 12
    assert r["total_input_tokens"] > 12 * 200  # the ~220-token shared prefix (byte-level tokens) + message
    srv_counters = r["server"]
    assert srv_counters is not None and srv_counters["prefix_cache_hit_rate"] > 0
    # 4 concurrent ~230-token sequences fit the 16 MiB pool: a preemption here is a scheduler or
    # counter bug (and the key must be there: the delta of pagedjax:num_preemptions_total)
    assert srv_counters["preemptions"] == 0
    if report.have_matplotlib():
        assert png.stat().st_size > 1000
