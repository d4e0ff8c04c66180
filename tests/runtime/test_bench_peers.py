"""The "Side by side" section of BENCHMARKS.md (scripts/bench_peers.sh results), rendered
from small synthetic peers-*.json files: ratios, load and CPU facts, missing systems."""

from __future__ import annotations

import json
import re

from runtime.bench.machine import annotate_peer
from scripts.bench_render.benchmarks_md import render_benchmarks
from scripts.bench_render.peers_md import load_peers, render_peers

CONFIG = {"scenario": "shared-prefix", "concurrency": 64, "max_tokens": 64, "ignore_eos": False, "seed": 0,
          "model": "smollm2-135m-instruct"}


def _report(system: str, tok_s: float, *, tokens: int = 4096, load: float = 0.3, busy: float = 2.0,
            cpu: str = "Test CPU 9000", n: int = 64, failed: int = 0) -> dict:
    return {"kind": "serve", "config": dict(CONFIG), "num_requests": n, "successful_requests": n - failed,
            "failed_requests": failed, "total_output_tokens": tokens, "output_throughput": tok_s,
            "ttft_s": {"p50": 0.25, "p99": 1.5}, "itl_s": {"p50": 0.04}, "server": {"prefix_cache_hit_rate": 0.9},
            "peer": {"system": system, "version": f"{system} 1.0", "startup_s": 42,
                     "warmup_reply": "The capital of France is Paris.",
                     "server_cmd": f"serve {system} &", "bench_cmd": f"pagedjax bench serve --out peers-{system}.json"},
            "machine": {"cpu_model": cpu, "cores": 2, "loadavg_1m": load, "cpu_busy_pct_before": busy}}


def _write(tmp_path, reports: dict[str, dict]) -> None:
    for system, r in reports.items():
        (tmp_path / f"peers-{system}.json").write_text(json.dumps(r))


def _row(text: str, label: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_side_by_side_ratios_cpu_and_load(tmp_path):
    _write(tmp_path, {"llamacpp": _report("llamacpp", 250.0, load=0.4),
                      "vllm-bf16": _report("vllm-bf16", 100.0),
                      "vllm-fp32": _report("vllm-fp32", 80.0, load=1.25),
                      "pagedjax": _report("pagedjax", 200.0)})
    text = "\n".join(render_peers(tmp_path))
    assert "## Side by side: pagedjax vs vLLM-CPU vs llama.cpp" in text
    head = _row(text, "system")
    col = head.index("tok/s vs pagedjax")
    # Each system's output tok/s over pagedjax's.
    assert _row(text, "pagedjax float32")[col] == "1.00x"
    assert _row(text, "vLLM-CPU float32")[col] == "0.40x"
    assert _row(text, "vLLM-CPU bfloat16")[col] == "0.50x"
    assert _row(text, "llama.cpp")[col] == "1.25x"
    # pagedjax over vLLM float32, over the faster vLLM (bfloat16 here), over llama.cpp.
    assert "pagedjax vs vLLM-CPU float32 (same weights dtype): **2.50x**" in text
    assert "pagedjax vs the faster vLLM-CPU (vLLM-CPU bfloat16): **2.00x**" in text
    assert "pagedjax vs llama.cpp: **0.80x**" in text
    # Rows in a fixed order, pagedjax first; CPU model once (all the same), load per row.
    labels = [ln.split("|")[1].strip() for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert labels == ["pagedjax float32", "vLLM-CPU float32", "vLLM-CPU bfloat16", "llama.cpp"]
    assert "Measured on: Test CPU 9000, 2 cores." in text
    assert _row(text, "vLLM-CPU float32")[head.index("load avg 1m at start")] == "1.25"
    assert _row(text, "pagedjax float32")[head.index("CPU busy before run")] == "2%"
    assert _row(text, "pagedjax float32")[head.index("output tok/s")] == "200.0"
    assert _row(text, "pagedjax float32")[head.index("ok/failed")] == "64/0"
    assert "not quiet" not in text and "Not comparable" not in text
    assert "serve vllm-fp32 &" in text and "pagedjax bench serve --out peers-llamacpp.json" in text


def test_side_by_side_in_benchmarks_md_and_faster_vllm_is_fp32(tmp_path):
    _write(tmp_path, {"pagedjax": _report("pagedjax", 150.0), "vllm-fp32": _report("vllm-fp32", 120.0),
                      "vllm-bf16": _report("vllm-bf16", 60.0)})
    text = render_benchmarks(tmp_path)
    assert "## Side by side: pagedjax vs vLLM-CPU vs llama.cpp" in text
    assert "pagedjax vs vLLM-CPU float32 (same weights dtype): **1.25x**" in text
    assert "pagedjax vs the faster vLLM-CPU (vLLM-CPU float32): **1.25x**" in text
    assert "llama.cpp: **" not in text  # not measured: no ratio line


def test_side_by_side_without_pagedjax_busy_machine_and_mixed_cpus(tmp_path):
    _write(tmp_path, {"vllm-fp32": _report("vllm-fp32", 80.0, busy=90.0, cpu="CPU A"),
                      "llamacpp": _report("llamacpp", 100.0, cpu="CPU B", n=8)})
    text = "\n".join(render_peers(tmp_path))
    assert "no ratios" in text
    head = _row(text, "system")
    assert _row(text, "llama.cpp")[head.index("tok/s vs pagedjax")] == "-"
    assert _row(text, "llama.cpp")[head.index("CPU")] == "CPU B, 2 cores"  # CPUs differ: one per row
    assert "not quiet before vLLM-CPU float32" in text
    assert "**Not comparable:** llamacpp" in text


def test_side_by_side_not_run_and_a_failed_run(tmp_path):
    assert "_not run_" in "\n".join(render_peers(tmp_path))
    _write(tmp_path, {"pagedjax": _report("pagedjax", 0.0, tokens=0, failed=64),
                      "vllm-fp32": _report("vllm-fp32", 80.0)})
    text = "\n".join(render_peers(tmp_path))
    head = _row(text, "system")
    assert _row(text, "pagedjax float32")[head.index("ok/failed")] == "0/64"
    assert _row(text, "vLLM-CPU float32")[head.index("tok/s vs pagedjax")] == "-"  # no division by zero


def test_annotate_peer_records_machine_and_load(tmp_path):
    p = tmp_path / "peers-x.json"
    r = _report("x", 10.0)
    del r["peer"], r["machine"]
    p.write_text(json.dumps(r))
    annotate_peer(p, {"system": "x", "startup_s": 5, "loadavg_1m": 0.7, "cpu_busy_pct_before": 3.0})
    d = json.loads(p.read_text())
    assert d["peer"] == {"system": "x", "startup_s": 5}
    assert d["machine"]["loadavg_1m"] == 0.7 and d["machine"]["cpu_busy_pct_before"] == 3.0
    assert d["machine"]["cores"] >= 1 and d["machine"]["cpu_model"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", d["machine"]["measured_at"])
    assert list(load_peers(tmp_path)) == ["x"]


def test_fleet_section_compares_the_routers_and_shows_the_plan(tmp_path):
    from scripts.bench_render.peers_md import render_fleet

    assert "_not run_" in "\n".join(render_fleet(tmp_path))
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    reports = {k: _report(k, tok) for k, tok in (("pagedjax", 120.0), ("fleet-prefix", 130.0), ("fleet-default", 100.0))}
    for k, rate in (("pagedjax", 0.9), ("fleet-prefix", 0.88), ("fleet-default", 0.55)):
        reports[k]["client_cached_token_rate"] = rate
        reports[k]["request_throughput"] = 4.0
        reports[k]["config"]["scenario"] = "multi-prefix"
    _write(fleet, reports)
    (fleet / "plan.json").write_text(json.dumps({"context_len": 400, "output_tokens": 32, "target_rps": 4.0,
                                                 "weight_dtype": "float32", "kv_dtype": "float32", "fleet": 1,
                                                 "fleet_with_headroom": 2, "headroom": 0.2, "tps_ceiling": 900.0}))
    text = "\n".join(render_fleet(tmp_path))
    assert _row(text, "fleet, 2 replicas, prefix-aware router")[6] == "88.0%"
    assert "prefix-aware **88.0%** vs default **55.0%** (one replica: 90.0%)" in text
    assert "1.30x of the default's" in text
    assert "1 replica(s) of this machine (2 with 20% headroom)" in text and "65.0 output tok/s per replica" in text


def test_rows_from_different_sessions_are_flagged(tmp_path):
    """A row carried over from another session (this machine's speed drifts between sessions)
    shows when it was measured, and the table says the rows were not measured together."""
    old = _report("llamacpp", 90.0)
    new = {s: _report(s, t) for s, t in (("pagedjax", 200.0), ("vllm-fp32", 150.0))}
    for r in new.values():
        r["machine"]["measured_at"] = "2026-12-03 11:05"
    _write(tmp_path, {"llamacpp": old, **new})
    text = "\n".join(render_peers(tmp_path))
    col = _row(text, "system").index("measured (UTC)")
    assert _row(text, "pagedjax float32")[col] == "2026-12-03 11:05"
    assert _row(text, "llama.cpp")[col] == "earlier run"
    assert "Rows from different sessions" in text
    assert "pagedjax vs llama.cpp: **2.22x** (measured in different sessions)" in text
    del new["pagedjax"]["machine"]["measured_at"], new["vllm-fp32"]["machine"]["measured_at"]
    _write(tmp_path, new)
    (tmp_path / "peers-llamacpp.json").unlink()
    assert "Rows from different sessions" not in "\n".join(render_peers(tmp_path))


def test_best_setting_comes_from_the_faster_vllm_s_session(tmp_path):
    """A faster pagedjax row measured on another CPU (the same name, other vector units) is not
    "the best setting" against this session's vLLM; a vLLM row of another session says so."""
    rows = {s: _report(s, t) for s, t in (("pagedjax", 200.0), ("pagedjax-w8a8", 150.0), ("vllm-fp32", 100.0),
                                          ("pagedjax-w8a8-head", 400.0))}
    for k, r in rows.items():
        r["machine"]["measured_at"] = "2026-12-03 15:47"
        r["machine"]["cpu_model"] = "AMD EPYC (avx512 vnni bf16)" if k == "pagedjax-w8a8-head" else "AMD EPYC (avx2)"
    _write(tmp_path, rows)
    text = "\n".join(render_peers(tmp_path))
    assert "Rows from different sessions" in text
    assert "pagedjax vs vLLM-CPU float32 (same weights dtype): **2.00x** output tok/s\n" in text + "\n"
    assert "pagedjax at its best setting" not in text  # float32 itself is the best of this session
    rows["pagedjax"]["machine"]["cpu_model"] = "AMD EPYC (avx512 vnni bf16)"
    _write(tmp_path, rows)
    text = "\n".join(render_peers(tmp_path))
    assert "**2.00x** output tok/s (measured in different sessions)" in text
    assert "best setting (pagedjax w8a8" in text and "vLLM-CPU: **1.50x**" in text


def test_disaggregation_section_shows_each_setup_and_the_planners_split(tmp_path):
    from scripts.bench_render.peers_md import render_disagg

    assert "_not run_" in "\n".join(render_disagg(tmp_path))
    d = tmp_path / "disagg"
    d.mkdir()
    cfg = {"streams": 16, "stream_tokens": 400, "num_long": 6, "long_interval_s": 4.0}
    for key, itl99, ttft50 in (("serve", 1454.4, 5361.5), ("disagg-1p1d", 475.8, 34852.7)):
        (d / f"{key}.json").write_text(json.dumps({
            "config": cfg, "machine": {"cpu_model": "Test CPU 9000", "cores": 2}, "load_avg_1m": 1.9,
            "long_prompt_tokens": 2012, "streams_ok": 16, "long_ok": 6, "output_tokens_per_s": 96.0,
            "itl_ms": {"p50": 148.1, "p99": itl99}, "long_ttft_ms": {"p50": ttft50, "p99": ttft50 * 1.2}}))
    (d / "plan-h200.json").write_text(json.dumps({"disagg": {
        "prompt_tokens": 2000, "ttft_target_s": 0.5, "itl_target_s": 0.02, "prefill_time_s": 0.0011,
        "decode_batch_for_itl": 1731, "prefill_devices": 1, "decode_devices": 1, "kv_transfer_bytes_per_s": 9.2e8}}))
    text = "\n".join(render_disagg(tmp_path))
    assert _row(text, "1 prefill + 1 decode replica (one core each), reserve-then-transfer")[1:5] == [
        "148", "476", "34.9", "41.8"]
    assert _row(text, "2 colocated replicas (one core each), prefix-aware router")[1] == "_not run_"
    assert "ITL p99 **476 ms** disaggregated against **1,454 ms** for `serve`" in text
    assert "TTFT p50 34.9 s against 5.4 s" in text and "Test CPU 9000" in text
    assert "1 prefill + 1 decode H200, 0.92 GB/s of KV" in text and "B <= 1,731" in text


def test_tp_section_shows_the_ratio_and_the_planner(tmp_path):
    from scripts.bench_render.engine_md import render_tp

    assert "_not run_" in "\n".join(render_tp(tmp_path))
    d = tmp_path / "tp"
    d.mkdir()
    setups = ["TP 1, C++ kernels (as served)", "TP 1, plain XLA", "TP 2, plain XLA"]
    (d / "tp-step.json").write_text(json.dumps({
        "model": "m", "tensor_parallel_size": 2, "devices": 2, "context_len": 350, "rounds": 5, "iters": 4,
        "setups": setups, "machine": {"cpu_model": "Test CPU 9000", "cores": 2}, "loadavg_1m": 0.5,
        "rows": [{"batch": 8, "step_ms": dict(zip(setups, (3.3, 5.7, 5.1))), "tp_over_tp1_xla": 0.89}]}))
    (d / "plan-h200.json").write_text(json.dumps({"model": "llama-3-70b", "context_len": 2000,
        "weight_dtype": "bfloat16", "kv_dtype": "bfloat16", "tensor_parallel": [
            {"tensor_parallel": 8, "weight_bytes_per_device": 17.6e9, "kv_bytes_per_token_per_device": 40960,
             "b_max": 796, "step_b1_s": 0.0053, "allreduce_b1_s": 0.00161, "tps_at_b_max": 32716}]}))
    text = "\n".join(render_tp(tmp_path))
    assert _row(text, "8") == ["8", "3.3", "5.7", "5.1", "0.89x"]
    assert "| 8 | 17.6 | 40 | 796 | 5.30 | 1.610 | 32,716 |" in text and "Test CPU 9000" in text
    assert "More devices" not in text and "multi-GPU run is still owed" in text
