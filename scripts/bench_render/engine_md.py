"""BENCHMARKS.md sections for the engine-speed work: the decode-step breakdown against its
floors, exposed host time with async scheduling on and off, and the w8a8 accuracy gates
(from bench-results/breakdown.json and accuracy-w8a8.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PART_LABELS = (("matmuls_ms", "projections + MLP"), ("lm_head_ms", "LM head"), ("attention_ms", "attention"),
               ("sampling_ms", "sampling"), ("kv_write_ms", "KV write"),
               ("other_ms", "rest (norms, RoPE, embedding, penalty state, per-layer weight slices)"))


def _load(p: Path) -> dict[str, Any] | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _machine(r: dict[str, Any], key: str = "loadavg_1m") -> str:
    m = r.get("machine") or {}
    load = r.get(key)
    return (f"CPU: {m.get('cpu_model', '?')}, {m.get('cores', '?')} cores"
            + (f"; load average {load:.2f} at start" if isinstance(load, (int, float)) else ""))


def _breakdown_section(bd_all: dict[str, Any]) -> list[str]:
    """The part-by-part table of one `bench offline --part breakdown` result."""
    bd = bd_all["breakdown"]
    quant = bd.get("quantization", "none")
    what = bd["dtype"] + (f", {quant} weights" if quant != "none" else "") + (
        ", int8 LM head" if bd.get("lm_head_int8") else "") + (
        ", int8 products in the C++ kernel" + (" on AMX tiles from 16 rows" if bd.get("amx") else "")
        if bd.get("matmul_kernel") else "") + (
        ", float32 products in the C++ kernel" if bd.get("f32_kernel") else "") + (
        ", attention in the C++ kernel" if bd.get("attention_kernel", bd.get("decode_kernel")) else "") + (
        f", {bd['kv_cache_dtype']} KV" if bd.get("kv_cache_dtype") not in (None, "float32") else "")
    product = {"none": "C++ float32 kernel" if bd.get("f32_kernel") else "XLA dot", "w8a8": (("C++ int8 kernel (AMX)" if bd.get("amx") else "C++ int8 kernel")
                                                                                      if bd.get("matmul_kernel") else "int8 x int8 -> int32 dot")
               + " (activations quantized per row)",
               "w8a16": "dequantized int8 weights x float dot"}.get(quant, "XLA dot")
    flags = (f" --quantization {quant}" if quant != "none" else "") + (" --quantize-lm-head" if bd.get("lm_head_int8") else "")
    L = [f"`pagedjax bench offline --part breakdown,overlap{flags}`: "
         f"one jitted decode step of {bd['model']} ({what}) where every sequence shares a "
         f"{bd['rows'][0]['shared_len']}-token system prompt and has "
         f"{bd['rows'][0]['context_len'] - bd['rows'][0]['shared_len']} tokens of its own; median of {bd['iters']}. "
         f"Floors: matmuls at this machine's rate of the {product} for that many rows (or one read of the weights "
         f"at {bd['read_bandwidth_gb_s']:.1f} GB/s, if slower); attention, sampling and the KV write at that read "
         f"bandwidth (the shared prompt read once). {_machine(bd | {'machine': bd_all.get('machine')})}.", ""]
    head = ["part"] + [f"batch {r['batch']} ms" for r in bd["rows"]] + [f"floor at {r['batch']} ms"
                                                                       for r in bd["rows"]]
    rows = []
    for key, label in PART_LABELS:
        rows.append([label] + [f"{r['parts'][key]:.1f}" for r in bd["rows"]]
                    + [f"{r['floors'][key]:.1f}" if key in r["floors"] else "-" for r in bd["rows"]])
    rows.append(["**whole step**"] + [f"**{r['full_ms']:.1f}**" for r in bd["rows"]]
                + [f"{r['matmul_floor_ms']:.1f} (matmuls)" for r in bd["rows"]])
    for hk, label in (("build_input_ms", "host: build step input"), ("device_to_host_ms", "host: device->host"),
                      ("detokenize_ms", "host: detokenize"), ("sse_encode_ms", "host: SSE encode")):
        rows.append([label] + [f"{r['host'][hk]:.2f}" for r in bd["rows"]] + ["0 exposed (overlapped)"] * len(bd["rows"]))
    L += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    L += ["| " + " | ".join(r) + " |" for r in rows]
    L.append("")
    L += [f"Decode step at {r['batch']} sequences: **{r['full_ms'] / r['matmul_floor_ms']:.2f}x** its matmul "
          f"floor ({product} at {r['dot_gflops']:.0f} G(FL)OP/s at {r['batch']} rows)." for r in bd["rows"]]
    L.append("")
    return L


def render_engine_sections(results: str | Path) -> list[str]:
    d = Path(results)
    L: list[str] = []
    bd_all = _load(d / "breakdown.json") or {}
    bd, ov = bd_all.get("breakdown"), bd_all.get("overlap")
    L += ["## Decode step breakdown (engine speed)", ""]
    if bd:
        L += _breakdown_section(bd_all)
        q_all = _load(d / "breakdown-w8a8.json") or {}
        if q_all.get("breakdown"):
            L += ["The same step with w8a8 weights, against the int8 product's own floor:", ""]
            L += _breakdown_section(q_all)
    else:
        L += ["_not measured_ (run `pagedjax bench offline --part breakdown,overlap --out bench-results/breakdown.json`).", ""]
    if ov:
        L += ["Exposed host time: `LLMEngine.step()` in steady decode, median step wall minus the device time of "
              "the same compiled program replayed on the same step input, back to back (alternating rounds). "
              f"SmolLM2, float32; {_machine({'machine': bd_all.get('machine'), 'loadavg_1m': ov.get('loadavg_1m')})}. "
              + ("Text, stop strings and callbacks ran on the output processor's thread, as served."
                 if ov.get("output_thread") else "Text and callbacks ran inside `step()`."),
              ""]
        head = ["batch", "async: step ms", "device ms", "exposed host", "sync: step ms", "device ms", "exposed host"]
        L += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for r in ov["rows"]:
            L.append("| " + " | ".join([str(r["batch"])] + [
                f"{r[f'{k}_step_ms']:.1f} | {r[f'{k}_device_ms']:.1f} | {r[f'{k}_exposed_host_ms']:.2f} ms "
                f"({r[f'{k}_exposed_share'] * 100:.1f}%)" for k in ("async", "sync")]) + " |")
        L.append("")
    accs = [a for a in (_load(f) for f in sorted(d.glob("accuracy-*.json"))) if a and "teacher_forced" in a]
    L += ["## Quantization accuracy (against float32)", ""]
    if accs:
        a0, tf0 = accs[0], accs[0]["teacher_forced"]
        L += [f"`pagedjax bench accuracy` on {a0['checkpoint']}: {tf0['tokens']:,} tokens of "
              f"{', '.join(Path(t).name for t in a0['text'])} (teacher-forced, {tf0['window']}-token windows; "
              f"perplexity float32 {tf0['perplexity_float32']:.3f}) and greedy decoding through the engine; "
              f"{_machine(a0)}; the answer gate asks short chat questions with one clear answer "
              f"(runtime/bench/data/answer_questions.jsonl) and counts the answers whose first line equals "
              f"float32's. Gates: w8a8 +2% and 95% of the answers, w4a16 +5% and 90%, int8 KV +0.5% and 98%, "
              f"the sum of the allowances for both; a bfloat16 KV cache (no gate of its own) is measured as "
              f"the floor an 8-bit cache is judged against, held to int8's gates. A row on another checkpoint names it (its float32 "
              f"perplexity differs); a base model is asked as plain text.", "",
              "| setting | command flags | same answers as float32 | answer gate | correct answers (float32) "
              "| perplexity | vs float32 | perplexity gate | mean abs logprob diff | greedy: identical "
              "| greedy: tokens before first difference |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for a in sorted(accs, key=lambda a: a["teacher_forced"]["perplexity_increase"]):
            tf, g, gate = a["teacher_forced"], a["greedy"], a["gate"]
            flags = " ".join(x for x in (f"--quantization {a['method']}" if a["method"] != "none" else "",
                                         "--quantize-lm-head" if a.get("lm_head_int8") else "",
                                         f"--kv-cache-dtype {a['kv_cache_dtype']}"
                                         if a.get("kv_cache_dtype", "float32") != "float32" else "") if x)
            ans = a.get("answers")  # results from before the answer gate have none
            ans_cells = (f"{ans['kept']}/{ans['questions']} ({ans['kept_share']:.1%}) | "
                         f">= {gate['answers_kept_min']:.0%}: **{'pass' if gate['answers_passed'] else 'FAIL'}** | "
                         f"{ans['correct']} ({ans['float32_correct']})" if ans else "- | - | -")
            ppl_ok = gate.get("perplexity_passed", gate["passed"])
            other = f" on **{a['checkpoint']}**" if a["checkpoint"] != a0["checkpoint"] else ""
            cpu = (a.get("machine") or {}).get("cpu_model")
            other += f" ({cpu})" if cpu != (a0.get("machine") or {}).get("cpu_model") else ""
            served = " (the GGUF's own blocks: `--served`)" if a.get("served") else ""
            L.append(f"| {a.get('setting', a['method'])}{served}{other} | `{flags}` | {ans_cells} | {tf['perplexity']:.3f} | "
                     f"{tf['perplexity_increase'] * 100:+.2f}% | +{gate['perplexity_increase_max'] * 100:.1f}%: "
                     f"**{'pass' if ppl_ok else 'FAIL'}** | {tf['mean_abs_logprob_diff']:.4f} nats | "
                     f"{g['identical']}/{g['prompts']} x {g['max_tokens']} tokens | "
                     f"{g['mean_tokens_before_divergence']:.1f} |")
        L.append("")
    else:
        L += ["_not measured_ (run `pagedjax bench accuracy --out bench-results/accuracy-w8a8.json`).", ""]
    return L


def render_tp(results: str | Path) -> list[str]:
    """The "Tensor parallelism" section: bench-results/tp/tp-step.json (`pagedjax bench tp`)
    and the planner's TP tables (plan-<device>.json), both from scripts/bench_tp.sh."""
    d = Path(results) / "tp"
    L = ["## Tensor parallelism (`bash scripts/bench_tp.sh`)", ""]
    r = _load(d / "tp-step.json")
    if r is None:
        L += ["_not run_ (`bash scripts/bench_tp.sh`).", ""]
    else:
        n, m = r["tensor_parallel_size"], r.get("machine") or {}
        L.append(f"`pagedjax bench tp`: one jitted decode step of {r['model']} (float32, context {r['context_len']} "
                 f"tokens per sequence) at TP 1 and TP {n}, median of {r['rounds']} rounds x {r['iters']} steps, the "
                 f"setups taking turns. The {r['devices']} devices are forced host devices "
                 f"(`XLA_FLAGS=--xla_force_host_platform_device_count`) on the same {m.get('cores')} cores, so TP "
                 f"{n} cannot be faster here: the ratio is what the sharded program costs (two all-reduces per "
                 f"layer, attention per shard, the vocabulary-sharded head and the logits gather). TP runs the "
                 f"plain XLA path, so TP 1 on that path is its yardstick. {_machine(r)}.")
        if r["devices"] > (m.get("cores") or r["devices"]):
            L.append(f"More devices ({r['devices']}) than cores ({m.get('cores')}): the devices' programs take turns "
                     f"on the cores and each all-reduce waits for a device that is not running, so TP {n} here is "
                     f"seconds per step; with devices <= cores (a tiny model at TP 2 on these 2 cores) it was "
                     f"0.8-1.6x TP 1.")
        L.append("")
        setups = r["setups"]
        L.append("| batch | " + " | ".join(f"{s} ms" for s in setups) + f" | TP {n} / TP 1 plain XLA |")
        L.append("|---" * (len(setups) + 2) + "|")
        for row in r["rows"]:
            L.append(f"| {row['batch']} | " + " | ".join(f"{row['step_ms'][s]:.1f}" for s in setups)
                     + f" | {row['tp_over_tp1_xla']:.2f}x |")
        L.append("")
    for dev in ("h100", "h200"):
        p = _load(d / f"plan-{dev}.json")
        if not p or not p.get("tensor_parallel"):
            continue
        L.append(f"Planner (`pagedjax plan --model {p['model']} --device {dev} --context-len {p['context_len']} "
                 f"--tensor-parallel-size 8`), {p['weight_dtype']} weights, {p['kv_dtype']} KV:")
        L.append("")
        L.append("| TP | weights / device GB | KV / token / device KiB | B_max | step at B=1 ms | all-reduce ms | "
                 "TPS at B_max |")
        L.append("|---|---|---|---|---|---|---|")
        for t in p["tensor_parallel"]:
            L.append(f"| {t['tensor_parallel']} | {t['weight_bytes_per_device'] / 1e9:,.1f} | "
                     f"{t['kv_bytes_per_token_per_device'] / 1024:,.0f} | {t['b_max']:,} | {t['step_b1_s'] * 1e3:.2f} | "
                     f"{t['allreduce_b1_s'] * 1e3:.3f} | {t['tps_at_b_max']:,.0f} |")
        L.append("")
    L += ["A multi-GPU run is still owed: no machine with more than one GPU was available.", ""]
    return L
