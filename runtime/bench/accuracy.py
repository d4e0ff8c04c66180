"""`pagedjax bench accuracy`: a quantized model against the float32 one, on answers and on text.

- Answers: ~140 short chat questions with one clear answer (facts, arithmetic, yes/no,
  extraction from a given sentence; runtime/bench/data/answer_questions.jsonl), each answered
  greedily by the float32 engine and by the quantized one; a question counts as kept when the
  two first lines agree after normalisation (case, punctuation, spacing). Perplexity on one
  English text does not catch a changed answer; this does.
- Perplexity over a held-out English text (teacher-forced, in fixed windows), and the mean
  absolute difference of the reference token's logprob.
- Greedy agreement of the engine over 32 prompts cut from the same text, 64 tokens each.

The quantized model is built as the engine builds it (SmoothQuant scales calibrated on
support-chat text, not on the evaluation text); a quantized KV cache is applied as the paged
cache stores it. Gates (the quantization issue's): int8 weights (w8a8, w8a16) keep >= 95% of
the answers with perplexity within +2%; an int8 KV cache >= 98% and +0.5% (fp8 +1%: three
mantissa bits); a setting that quantizes both is held to the sum of the allowances.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model.quant import WEIGHT_GATES

# Allowed relative perplexity increase, per quantized part (the quantization issue's gates);
# a setting that quantizes both weights and KV is held to the sum.
# bfloat16 KV has no gate of its own: it is measured as the floor an 8-bit cache is judged
# against (how many answers a 16-bit rounding of K/V alone changes), held to int8's gates.
PPL_GATES = {**{m: g[0] for m, g in WEIGHT_GATES.items()}, "int8": 0.005, "bfloat16": 0.005, "fp8_e4m3": 0.01}
# Allowed share of changed answers, per quantized part (summed like the perplexity gates).
ANSWER_GATES = {**{m: g[1] for m, g in WEIGHT_GATES.items()}, "int8": 0.02, "bfloat16": 0.02, "fp8_e4m3": 0.02}
KV_CHOICES = ("float32", "bfloat16", "int8", "fp8_e4m3")
QUESTIONS = Path(__file__).parent / "data" / "answer_questions.jsonl"
ANSWER_TOKENS = 24  # a one-line answer fits; the first line is what is compared
# Asked before every question, so the first line is the answer rather than the start of an
# essay (SmolLM2's first lines averaged 13 words without it, 8 with it).
ANSWER_SYSTEM = "Answer in as few words as possible."


def ppl_gate(method: str, kv_dtype: str = "float32") -> float:
    return PPL_GATES.get(method, 0.0) + PPL_GATES.get(kv_dtype, 0.0)


def answer_gate(method: str, kv_dtype: str = "float32") -> float:
    """The least share of float32's answers a setting must keep."""
    return 1.0 - ANSWER_GATES.get(method, 0.0) - ANSWER_GATES.get(kv_dtype, 0.0)


def load_questions(limit: int | None = None) -> list[dict[str, str]]:
    """The answer set, spread over its kinds when `limit` takes fewer than all (every
    len/limit-th question, so a small set still mixes facts, arithmetic, yes/no, extraction)."""
    qs = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    if limit is not None and limit < len(qs):
        qs = [qs[i * len(qs) // limit] for i in range(limit)]
    return qs


def normalise_answer(text: str) -> str:
    """The first non-empty line, lower-cased, punctuation dropped, spaces collapsed."""
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "")
    kept = "".join(c if c.isalnum() or c.isspace() else " " for c in line.lower())
    return " ".join(kept.split())


def is_correct(answer: str, expected: str) -> bool:
    """The expected answer appears as whole words in the normalised answer (reported beside
    the gate, which compares with float32, not with this)."""
    return f" {normalise_answer(expected)} " in f" {normalise_answer(answer)} "


def setting_name(method: str, kv_dtype: str = "float32") -> str:
    parts = ([method] if method != "none" else []) + ([f"{kv_dtype} KV"] if kv_dtype != "float32" else [])
    return " + ".join(parts) or "float32"
DEFAULT_TEXTS = ("../shared/seeds/serving-stack-and-capacity.txt", "../shared/seeds/inference-workload.txt")


def kv_roundtrip_logits(cfg: Any, params: Any, token_ids: Any, kv_dtype: str) -> Any:
    """dense_logits with every K/V row quantized and dequantized as the paged cache stores it
    (runtime/model/kv_pages.py's layout, written before it is read): the same numbers the engine's
    attention sees, without a cache (tests check the two agree)."""
    import jax.numpy as jnp

    from runtime.config import kv_scale_groups
    from runtime.model.kv_pages import dequantize, quantize_rows
    from runtime.model.runner import KV_DTYPES
    from runtime.model.families import family
    from runtime.model.families.llama import attention_scale, causal_mask, dense_causal_attention

    fam = family(cfg)
    if kv_dtype == "float32":
        return fam.dense_logits(cfg, params, token_ids)
    T = token_ids.shape[0]
    windows = jnp.asarray(cfg.layer_windows(), jnp.int32)  # (each layer's window, scale and cap, as served)

    def roundtrip(x, part):
        if kv_dtype == "bfloat16":  # a plain cast, as the cache stores it
            return x.astype(jnp.bfloat16).astype(jnp.float32)
        return dequantize(*quantize_rows(x, KV_DTYPES[kv_dtype], kv_scale_groups(kv_dtype, x.shape[-1], part)))

    def attention(q, k, v, layer, cache):
        k, v = (roundtrip(k, "latent"), None) if v is None else (roundtrip(k, "k"), roundtrip(v, "v"))
        return dense_causal_attention(q, k, v, causal_mask(T, windows[layer]), attention_scale(cfg),
                                      cfg.attn_logit_softcapping), cache

    hidden, *_ = fam.forward_hidden(cfg, params, token_ids, jnp.arange(T, dtype=jnp.int32), attention, None)
    return fam.lm_head(cfg, params, hidden)


def token_logprobs(cfg: Any, params: Any, ids: list[int], window: int, kv_dtype: str = "float32") -> np.ndarray:
    """log p(ids[i+1] | ids[:i+1] within its window) for every position, windows of `window`."""
    import jax
    import jax.numpy as jnp

    window = min(window, len(ids) - 1)
    fn = jax.jit(lambda p, t: jax.nn.log_softmax(kv_roundtrip_logits(cfg, p, t, kv_dtype), -1))
    out = []
    for a in range(0, len(ids) - 1, window):
        chunk = ids[a:a + window + 1]
        if len(chunk) < window + 1:  # the tail: reuse the compiled length, scoring only new tokens
            chunk = ids[-(window + 1):]
            skip = window - (len(ids) - 1 - a)
        else:
            skip = 0
        lp = np.asarray(fn(params, jnp.asarray(chunk[:-1], jnp.int32)))
        picked = lp[np.arange(window), np.asarray(chunk[1:])]
        out.append(picked[skip:])
    return np.concatenate(out)


def evaluate(cfg: Any, params: Any, ids: list[int], method: str, window: int, tokenizer: Any = None,
             kv_dtype: str = "float32", lm_head: bool = False, served: Any = None) -> dict[str, Any]:
    """Teacher-forced comparison of weights quantized by `method` ("none" keeps them) and
    the KV cache stored as `kv_dtype`; with `tokenizer`, weights are quantized exactly as the
    engine does (calibrated smoothing), else plain per-channel quantization. `served`: an
    already quantized tree (a stored checkpoint's) in place of quantizing `params`."""
    import jax
    import jax.numpy as jnp

    from runtime.model.quant import prepare, quantize_params

    ref = token_logprobs(cfg, jax.tree.map(jnp.asarray, params), ids, window)
    if served is not None:
        qp = served
    elif tokenizer is not None:
        qp = prepare(params, method, cfg, tokenizer, lm_head)
    else:
        qp = quantize_params(params, method)
    got = token_logprobs(cfg, jax.tree.map(jnp.asarray, qp), ids, window, kv_dtype)
    ppl_ref, ppl = math.exp(-ref.mean()), math.exp(-got.mean())
    return {"tokens": len(ref), "window": min(window, len(ids) - 1), "perplexity_float32": ppl_ref, "perplexity": ppl,
            "perplexity_increase": ppl / ppl_ref - 1.0, "mean_abs_logprob_diff": float(np.abs(got - ref).mean())}


def engine_outputs(ckpt: Path, method: str, kv_dtype: str, lm_head: bool,
                   jobs: list[tuple[list[list[int]], Any]]) -> list[list[list[int]]]:
    """One engine (paged cache, real KV dtype) built as `serve` builds it for the setting;
    each job (prompts, SamplingParams) -> its output token lists."""
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
    from runtime.core.engine import LLMEngine

    def build(model):
        env = SchedulerConfig(16, 256, 1024)
        return EngineConfig(model, CacheConfig.from_memory(model, 256 << 20, kv_dtype=kv_dtype), env,
                            AdmissionPolicy(max_num_seqs=16, max_num_batched_tokens=256,
                                            long_prefill_token_threshold=256, max_admissions_per_step=16),
                            "xla", "float32", quantization=method, quantize_lm_head=lm_head)
    eng = LLMEngine.from_checkpoint(ckpt, build, warmup=False, progress=False)
    return [[r.output_ids for r in eng.generate(prompts, params)] for prompts, params in jobs]


def greedy_agreement(ref: list[list[int]], got: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy tokens of the quantized engine against the float32 engine's."""
    same_prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                   for a, b in zip(ref, got)]
    return {"prompts": len(ref), "max_tokens": max_tokens, "identical": sum(n == max_tokens for n in same_prefix),
            "mean_tokens_before_divergence": float(np.mean(same_prefix)),
            "agreement": float(np.mean(same_prefix)) / max_tokens}


def answer_agreement(questions: list[dict[str, str]], ref: list[str], got: list[str]) -> dict[str, Any]:
    """Per question: float32's and the setting's answers, kept (same normalised first line)."""
    rows = [{"id": q["id"], "kind": q["kind"], "question": q["question"], "expected": q["answer"],
             "float32": r, "answer": g, "kept": normalise_answer(r) == normalise_answer(g),
             "float32_correct": is_correct(r, q["answer"]), "correct": is_correct(g, q["answer"])}
            for q, r, g in zip(questions, ref, got)]
    n = len(rows)
    return {"questions": n, "kept": sum(r["kept"] for r in rows), "kept_share": sum(r["kept"] for r in rows) / n,
            "float32_correct": sum(r["float32_correct"] for r in rows), "correct": sum(r["correct"] for r in rows),
            "changed": [r for r in rows if not r["kept"]], "rows": rows}


def answer_prompt(tok: Any, question: str) -> str:
    """A question as the model is asked it: through its chat template, or for a base model
    (no template) as a plain-text question and answer."""
    if tok.chat is not None:
        return tok.apply_chat_template([{"role": "system", "content": ANSWER_SYSTEM},
                                        {"role": "user", "content": question}])
    return f"{ANSWER_SYSTEM}\nQuestion: {question}\nAnswer:"


def compare_engines(ckpt: Path, tok: Any, method: str, kv_dtype: str, lm_head: bool, prompts: list[list[int]],
                    max_tokens: int, questions: list[dict[str, str]], served: Path | None = None) -> dict[str, Any]:
    """The float32 engine and the setting's on the same greedy prompts and answer questions
    (the setting's engine serves `served`, a quantized checkpoint, as stored, where given)."""
    from runtime.model.sampling import SamplingParams

    chats = [tok.encode(answer_prompt(tok, q["question"])) for q in questions]
    jobs = [(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)),
            (chats, SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS))]
    (ref_greedy, ref_ans), (got_greedy, got_ans) = (
        engine_outputs(c, m, kv, head, jobs) for c, m, kv, head in ((ckpt, "none", "float32", False),
                                                                     (served or ckpt, method, kv_dtype, lm_head)))
    text = lambda outs: [tok.decode(o, skip_special_tokens=True) for o in outs]  # noqa: E731
    return {"greedy": greedy_agreement(ref_greedy, got_greedy, max_tokens),
            "answers": answer_agreement(questions, text(ref_ans), text(got_ans))}


def run_accuracy(args: argparse.Namespace) -> int:
    from runtime.bench.machine import machine_info
    from runtime.checkpoint.pull import resolve_checkpoint
    from runtime.checkpoint.store import load_checkpoint

    texts = [Path(args.text)] if args.text else [Path(t) for t in DEFAULT_TEXTS if Path(t).is_file()]
    if not texts:
        print("pagedjax bench accuracy: error: text: no --text given and ../shared/seeds is not here",
              file=__import__("sys").stderr)
        return 2
    ckpt = Path(resolve_checkpoint(args.checkpoint))
    cfg, params, tok = load_checkpoint(ckpt)
    text = "\n".join(t.read_text() for t in texts)
    ids = tok.encode(text)[:args.max_text_tokens]
    method, kv = args.quantization, args.kv_cache_dtype
    served = served_params = None
    if args.served:
        from runtime.checkpoint.store import read_meta

        served = Path(args.served)
        stored = read_meta(served)["quantization"]
        if stored != method:
            print(f"pagedjax bench accuracy: error: served: {served} stores {stored} weights, not "
                  f"--quantization {method}", file=__import__("sys").stderr)
            return 2
        served_params = load_checkpoint(served)[1]
    if method == "none" and kv == "float32":
        print("pagedjax bench accuracy: error: quantization: nothing to compare (give --quantization w8a8 "
              "and/or --kv-cache-dtype int8)", file=__import__("sys").stderr)
        return 2
    head = args.quantize_lm_head
    if head and method != "w8a8":
        print("pagedjax bench accuracy: error: quantize_lm_head: needs --quantization w8a8", file=__import__("sys").stderr)
        return 2
    name = setting_name(method, kv) + (" (int8 LM head)" if head else "")
    res = {"kind": "accuracy", "machine": machine_info(), "checkpoint": ckpt.name, "method": method,
           "kv_cache_dtype": kv, "lm_head_int8": head, "setting": name, "text": [str(t) for t in texts]}
    if served:
        res["served"] = str(served)
    res["teacher_forced"] = evaluate(cfg, params, ids, method, args.window, tok, kv_dtype=kv, lm_head=head,
                                     served=served_params)
    sents = [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.split()) >= 8]
    step = max(1, len(sents) // args.prompts)
    prompts = [tok.encode(s + ".") for s in sents[::step][:args.prompts]]
    questions = load_questions(args.questions)
    res.update(compare_engines(ckpt, tok, method, kv, head, prompts, args.max_tokens, questions, served))
    gate, agate = ppl_gate(method, kv), answer_gate(method, kv)
    tf, a = res["teacher_forced"], res["answers"]
    res["gate"] = {"perplexity_increase_max": gate, "answers_kept_min": agate,
                   "perplexity_passed": tf["perplexity_increase"] <= gate, "answers_passed": a["kept_share"] >= agate}
    res["gate"]["passed"] = res["gate"]["perplexity_passed"] and res["gate"]["answers_passed"]
    g = res["greedy"]
    print(f"== accuracy: {name} vs float32, {ckpt.name}, {tf['tokens']:,} tokens of "
          f"{', '.join(t.name for t in texts)} ==\n"
          f"  perplexity            {tf['perplexity_float32']:.3f} -> {tf['perplexity']:.3f} "
          f"({tf['perplexity_increase'] * 100:+.2f}%; gate +{gate * 100:.1f}%: "
          f"{'PASS' if res['gate']['perplexity_passed'] else 'FAIL'})\n"
          f"  same answers          {a['kept']}/{a['questions']} ({a['kept_share']:.1%}; gate {agate:.0%}: "
          f"{'PASS' if res['gate']['answers_passed'] else 'FAIL'}); correct: float32 {a['float32_correct']}, "
          f"{name} {a['correct']}\n"
          f"  mean |d logprob|      {tf['mean_abs_logprob_diff']:.4f} nats per reference token\n"
          f"  greedy agreement      {g['identical']}/{g['prompts']} identical over {g['max_tokens']} tokens; "
          f"{g['mean_tokens_before_divergence']:.1f} tokens before the first difference on average")
    for r in a["changed"][:args.show_changed]:
        print(f"  changed {r['id']}: {r['question']!r}\n      float32: {r['float32'].strip()[:70]!r}\n"
              f"      {name}: {r['answer'].strip()[:70]!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return 0 if res["gate"]["passed"] else 1


def add_accuracy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="checkpoint directory (default: the pulled default model)")
    p.add_argument("--quantization", choices=("none", "w8a8", "w8a16", "w4a16"), default="w8a8")
    p.add_argument("--served", metavar="CHECKPOINT",
                   help="a checkpoint stored quantized (e.g. `convert --quantize w4a16` of the GGUF that --checkpoint "
                        "was converted from), served as stored and compared with --checkpoint's float32 weights")
    p.add_argument("--quantize-lm-head", action="store_true", help="with w8a8: the int8 LM head too")
    p.add_argument("--kv-cache-dtype", choices=KV_CHOICES, default="float32",
                   help="KV cache storage to evaluate with the weights (gates add: w8a8 +2%%/95%%, int8 KV +0.5%%/98%%; "
                        "bfloat16: the 16-bit floor an 8-bit cache is judged against, held to int8's gates)")
    p.add_argument("--text", help="held-out English text (default: the two chapters in ../shared/seeds)")
    p.add_argument("--max-text-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512, help="teacher-forced window, tokens")
    p.add_argument("--prompts", type=int, default=32, help="greedy-agreement prompts cut from the text")
    p.add_argument("--questions", type=int, default=None,
                   help="answer-gate questions to ask (default: all of runtime/bench/data/answer_questions.jsonl)")
    p.add_argument("--show-changed", type=int, default=10, help="print this many changed answers")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", metavar="FILE.json")
