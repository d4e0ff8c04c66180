"""`pagedjax bench accuracy`: a quantized model against the float32 one on real text.

Perplexity over a held-out English text (teacher-forced, in fixed windows), the mean
absolute difference of the reference token's logprob, and greedy agreement of the engine
over prompts cut from the same text. The quantized model is built as the engine builds it
(SmoothQuant scales calibrated on support-chat text, not on the evaluation text). Gates (the quantization issue's): perplexity within
+3% for w8a8.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

PPL_GATES = {"w8a8": 0.03}  # allowed relative perplexity increase
DEFAULT_TEXTS = ("../shared/seeds/serving-stack-and-capacity.txt", "../shared/seeds/inference-workload.txt")


def token_logprobs(cfg: Any, params: Any, ids: list[int], window: int) -> np.ndarray:
    """log p(ids[i+1] | ids[:i+1] within its window) for every position, windows of `window`."""
    import jax
    import jax.numpy as jnp

    from runtime.models.llama import dense_logits

    window = min(window, len(ids) - 1)
    fn = jax.jit(lambda p, t: jax.nn.log_softmax(dense_logits(cfg, p, t), -1))
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


def evaluate(cfg: Any, params: Any, ids: list[int], method: str, window: int, tokenizer: Any = None
             ) -> dict[str, Any]:
    """Teacher-forced comparison; with `tokenizer`, quantized exactly as the engine does
    (calibrated smoothing), else plain per-channel quantization."""
    import jax
    import jax.numpy as jnp

    from runtime.quant import prepare, quantize_params

    ref = token_logprobs(cfg, jax.tree.map(jnp.asarray, params), ids, window)
    qp = prepare(params, method, cfg, tokenizer) if tokenizer is not None else quantize_params(params, method)
    got = token_logprobs(cfg, jax.tree.map(jnp.asarray, qp), ids, window)
    ppl_ref, ppl = math.exp(-ref.mean()), math.exp(-got.mean())
    return {"tokens": len(ref), "window": min(window, len(ids) - 1), "perplexity_float32": ppl_ref, "perplexity": ppl,
            "perplexity_increase": ppl / ppl_ref - 1.0, "mean_abs_logprob_diff": float(np.abs(got - ref).mean())}


def greedy_agreement(ckpt: Path, prompts: list[list[int]], method: str, max_tokens: int) -> dict[str, Any]:
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
    from runtime.engine import LLMEngine
    from runtime.sampling import SamplingParams

    outs = {}
    for q in ("none", method):
        def build(model, q=q):
            env = SchedulerConfig(16, 256, 1024)
            return EngineConfig(model, CacheConfig.from_memory(model, 256 << 20), env,
                                AdmissionPolicy(max_num_seqs=16, max_num_batched_tokens=256,
                                                long_prefill_token_threshold=256, max_admissions_per_step=16),
                                "xla", "float32", quantization=q)
        eng = LLMEngine.from_checkpoint(ckpt, build, warmup=False, progress=False)
        reqs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        outs[q] = [r.output_ids for r in reqs]
    same_prefix = []
    for a, b in zip(outs["none"], outs[method]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same_prefix.append(n)
    return {"prompts": len(prompts), "max_tokens": max_tokens, "identical": sum(n == max_tokens for n in same_prefix),
            "mean_tokens_before_divergence": float(np.mean(same_prefix)),
            "agreement": float(np.mean(same_prefix)) / max_tokens}


def run_accuracy(args: argparse.Namespace) -> int:
    from runtime.bench.benchmarks_md import machine_info
    from runtime.checkpoint.store import load_checkpoint
    from runtime.cli import resolve_checkpoint

    texts = [Path(args.text)] if args.text else [Path(t) for t in DEFAULT_TEXTS if Path(t).is_file()]
    if not texts:
        print("pagedjax bench accuracy: error: text: no --text given and ../shared/seeds is not here",
              file=__import__("sys").stderr)
        return 2
    ckpt = Path(resolve_checkpoint(args.checkpoint))
    cfg, params, tok = load_checkpoint(ckpt)
    text = "\n".join(t.read_text() for t in texts)
    ids = tok.encode(text)[:args.max_text_tokens]
    res = {"kind": "accuracy", "machine": machine_info(), "checkpoint": ckpt.name, "method": args.quantization,
           "text": [str(t) for t in texts]}
    res["teacher_forced"] = evaluate(cfg, params, ids, args.quantization, args.window, tok)
    sents = [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.split()) >= 8]
    step = max(1, len(sents) // args.prompts)
    prompts = [tok.encode(s + ".") for s in sents[::step][:args.prompts]]
    res["greedy"] = greedy_agreement(ckpt, prompts, args.quantization, args.max_tokens)
    gate = PPL_GATES[args.quantization]
    tf = res["teacher_forced"]
    res["gate"] = {"perplexity_increase_max": gate, "passed": tf["perplexity_increase"] <= gate}
    g = res["greedy"]
    print(f"== accuracy: {args.quantization} vs float32, {ckpt.name}, {tf['tokens']:,} tokens of "
          f"{', '.join(t.name for t in texts)} ==\n"
          f"  perplexity            {tf['perplexity_float32']:.3f} -> {tf['perplexity']:.3f} "
          f"({tf['perplexity_increase'] * 100:+.2f}%; gate +{gate * 100:.0f}%: "
          f"{'PASS' if res['gate']['passed'] else 'FAIL'})\n"
          f"  mean |d logprob|      {tf['mean_abs_logprob_diff']:.4f} nats per reference token\n"
          f"  greedy agreement      {g['identical']}/{g['prompts']} identical over {g['max_tokens']} tokens; "
          f"{g['mean_tokens_before_divergence']:.1f} tokens before the first difference on average")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return 0 if res["gate"]["passed"] else 1


def add_accuracy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="checkpoint directory (default: the pulled default model)")
    p.add_argument("--quantization", choices=tuple(PPL_GATES), default="w8a8")
    p.add_argument("--text", help="held-out English text (default: the two chapters in ../shared/seeds)")
    p.add_argument("--max-text-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512, help="teacher-forced window, tokens")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", metavar="FILE.json")
