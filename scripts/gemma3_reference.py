"""Regenerate tests/runtime/data/gemma3_270m_reference.json: what transformers (loading the
Gemma 3 270M GGUF that `pagedjax pull gemma3-270m` fetches) gives for the real-model tests of
tests/runtime/test_gguf_gemma_real.py. Loading it there takes ~75 s on a 2-core machine (model
~50 s, tokenizer ~25 s), so the tests read this file instead.

    .venv/bin/python scripts/gemma3_reference.py      # needs transformers + torch (pagedjax[peer])
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "runtime" / "data" / "gemma3_270m_reference.json"
MAX_TOKENS = 24

BASE = [
    "The capital of France is", "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n",
    "numbers 1234567890 and 3.14159", "unicode: café naïve résumé", "emoji 🎉🚀 and symbols ©®™ 👩‍👩‍👧",
    "中文字符和日本語のテキスト", "한국어 텍스트와 العربية", "def f(x):\n    return x ** 2  # square",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "JSON: {\"a\": [1, 2, {\"b\": null}]}",
    "URL https://example.com/a?b=c&d=e", "CamelCaseIdentifiersAndsnake_case_names", "ALL CAPS SHOUTING!!!",
    "a" * 50, "Ünïcödé Ωμέγα Привет", "SELECT * FROM users WHERE id = 42;", "mixed 12ab34cd 5.6e-7",
    "\n\n\n", "The year 2024 had 366 days.", "    indented code block\n\tand a tab", "", " ", "  ", "\t",
    "x = [i*i for i in range(10) if i % 2]", "<b>bold</b> <div class=\"x\">html</div>", "line1\r\nline2\rline3",
    "Zero\u200bwidth and non\u00a0breaking", "math: ∑ ∫ √ ≤ ≥ ≠ ∞", "quotes “curly” ‘single’ «guillemets»",
    "<bos>literal special tokens<eos>", "<unk> <pad> <mask>", "trailing newline\n", "🙂" * 5,
    "Ĳssel and ǅ digraphs", "ÅÄÖ åäö", "Tiếng Việt có dấu", "हिन्दी पाठ", "עברית", "ελληνικά κείμενα",
]
VARIANTS = [lambda s: s, lambda s: " " + s, lambda s: s + " ", lambda s: s + "\n", lambda s: "  " + s + "\n\n",
            lambda s: s.upper(), lambda s: s.replace(" ", "   ")]


def strings() -> list[str]:
    """A few hundred varied strings (each base string in several spacings and cases), unique."""
    return list(dict.fromkeys(v(s) for s in BASE for v in VARIANTS))


def long_prompt() -> str:
    """~1,000 Gemma tokens (past the 512-token window of the sliding layers), ending in a
    question about its start: only the global layers see that far back."""
    from runtime.corpus import SYSTEM_PROMPT, USER_TOPICS

    lines = "\n".join(f"Customer {i}: {q}" for i, q in enumerate(USER_TOPICS * 3))
    return (f"Store handbook.\n{SYSTEM_PROMPT}\n\nToday's questions:\n{lines}\n\n{SYSTEM_PROMPT}\n\n"
            "Question: how long is the warranty on tents, and what does it cover?\nAnswer:")


PROMPTS = {"short": "The capital of France is", "long": None}


def main() -> int:
    import numpy as np
    import torch
    import transformers

    from runtime.checkpoint.pull import KNOWN_MODELS, fetch_gguf

    gguf = fetch_gguf(KNOWN_MODELS["gemma3-270m"])
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()
    ref: dict = {"transformers": transformers.__version__, "gguf": gguf.name, "max_tokens": MAX_TOKENS,
                 "tokenizer": [], "greedy": {}}
    for s in strings():
        ids = tok(s)["input_ids"]  # BOS first (the GGUF's add_bos_token)
        ref["tokenizer"].append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                                 "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    for name, text in (("short", PROMPTS["short"]), ("long", long_prompt())):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
            logits = model(torch.tensor([ids + gen])).logits[0, len(ids) - 1:-1].double()
        logp = torch.log_softmax(logits, -1).numpy()
        top2 = np.sort(logits.numpy(), -1)[:, -2:]
        ref["greedy"][name] = {
            "text": text, "prompt_ids": ids, "output_ids": gen, "output_text": tok.decode(gen, skip_special_tokens=True),
            "logprobs": [float(logp[i, t]) for i, t in enumerate(gen)],
            "margins": [float(m) for m in top2[:, 1] - top2[:, 0]],  # top-1 minus top-2 logit, per step
        }
        print(f"{name}: {len(ids)} prompt tokens -> {tok.decode(gen)!r}", file=sys.stderr)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(ref, ensure_ascii=False, indent=1) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
