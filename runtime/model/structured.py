"""Structured outputs: a request's text constrained to a JSON schema, a regex, a choice of
strings or a Lark / GBNF grammar, with llguidance (a Rust parser behind a numpy API).

Host side, per constrained request: one `LLMatcher` (compiled when the request is added,
within a time limit, so a bad or huge grammar is a 400 and never blocks the engine). Each
step the engine writes every constrained row's allowed tokens into one [S, ceil(V/32)]
int32 bitmask (`TokenMasks`); the jitted sampler masks the logits with it (one input
of fixed shape: constrained and free rows share a step, no extra compiled shapes). After
the token comes back the matcher consumes it; a finished grammar finishes the request.

The mask for a row's next token needs the token before it, so a step holding a
constrained row is read back before the next one is planned (runtime/core/engine.py): while
constrained requests run, the pipeline runs one step deep.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPILE_TIMEOUT_S = 5.0
# Threads that fill constrained rows' masks each step. More than a few fight the engine's
# own host thread for cores; 64 constrained rows take ~4 ms on two (runtime/bench/structured.py).
MASK_THREADS = min(4, max(2, (os.cpu_count() or 2) // 2))
# Compact JSON (no free whitespace between tokens): a small model given free whitespace can
# spend its whole budget on newlines. A schema's own "x-guidance" options still win.
JSON_DEFAULTS = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class Guide:
    """What a request's output must match (plain data: it travels to fleet replicas).
    kind: json (spec = a JSON schema as JSON text) | json_object | regex | choice (spec =
    a JSON list of strings) | grammar (Lark, or GBNF as llama.cpp writes it);
    param: the request field that asked for it, named by every error."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.param}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> "Guide":
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ValueError(f"{param}: must be a JSON schema object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema), param)

    @classmethod
    def choice(cls, options: Sequence[str], param: str) -> "Guide":
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError(f"{param}: must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)), param)

    def grammar(self) -> str:
        """The llguidance grammar text (raises ValueError on malformed input)."""
        import llguidance

        M = llguidance.LLMatcher
        try:
            if self.kind == "json":
                return M.grammar_from_json_schema(self.spec, defaults=JSON_DEFAULTS)
            if self.kind == "json_object":
                return M.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_DEFAULTS)
            if self.kind == "regex":
                return M.grammar_from_regex(self.spec)
            if self.kind == "choice":
                return M.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(self.spec)))
            lark = self.spec if "::=" not in self.spec else llguidance.gbnf_to_lark.any_to_lark(self.spec)
            return M.grammar_from_lark(lark)
        except Exception as exc:  # noqa: BLE001 -- llguidance raises ValueError or its own errors
            raise ValueError(f"{self.param}: {_first_line(exc)}") from None


def _first_line(exc: Any) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class GuideCompiler:
    """Compiles Guides into fresh matchers for one tokenizer. Compiled grammars are kept
    (LRU) and deep-copied per request, so n choices or repeated schemas compile once."""

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S,
                 cache_size: int = 64):
        self.tokenizer, self.vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self._lltok: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Guide, Any] = OrderedDict()
        self._cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pagedjax-grammar")
        self.executor: Any = None

    def _llguidance_tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                try:
                    import llguidance
                except ImportError:
                    raise ValueError("structured_outputs: this server was installed without llguidance "
                                     "(pip install llguidance)") from None
                tok = self.tokenizer
                self._lltok = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=list(tok.eos_token_ids) or None)
                self.executor = llguidance.LLExecutor(MASK_THREADS)
            return self._lltok

    def compile(self, guide: Guide) -> Any:
        """A fresh LLMatcher for `guide`; ValueError naming guide.param when it does not
        compile, or does not within timeout_s (the compile goes on in the background and
        its result is dropped)."""
        with self._lock:
            hit = self._cache.get(guide)
            if hit is not None:
                self._cache.move_to_end(guide)
                return hit.deep_copy()
        lltok = self._llguidance_tokenizer()
        fut = self._pool.submit(self._build, lltok, guide.grammar())
        try:
            matcher = fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"{guide.param}: the grammar did not compile within {self.timeout_s:g} s; "
                             f"simplify it") from None
        if matcher.is_error():
            raise ValueError(f"{guide.param}: {_clean(matcher.get_error())}")
        with self._lock:
            self._cache[guide] = matcher.deep_copy()
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher


    @staticmethod
    def _build(lltok: Any, grammar: str) -> Any:
        import llguidance

        return llguidance.LLMatcher(lltok, grammar, log_level=0)


def _clean(msg: str) -> str:
    """llguidance's errors carry a caret diagram; the first lines say what is wrong."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3])[:400] or "the grammar does not compile"


class TokenMasks:
    """Builds the step's [S, W] int32 allowed-token bitmask (bit t%32 of word t//32; -1 =
    every token allowed). Rows: a grammar's allowed set, and/or end-of-sequence and stop
    token ids banned while a request is below its min_tokens."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.width = -(-vocab_size // 32)
        self._free: dict[int, np.ndarray] = {}

    def all_allowed(self, rows: int) -> np.ndarray:
        a = self._free.get(rows)
        if a is None:
            a = self._free[rows] = np.full((rows, self.width), -1, np.int32)
            a.flags.writeable = False
        return a

    def build(self, rows: int, guided: Sequence[tuple[int, Any]], banned: Sequence[tuple[int, Sequence[int]]],
              executor: Any = None) -> np.ndarray:
        """guided: (row, matcher); banned: (row, token ids to forbid)."""
        if not guided and not banned:
            return self.all_allowed(rows)
        mask = np.full((rows, self.width), -1, np.int32)
        if guided:
            import llguidance.numpy as lln

            if executor is not None and len(guided) > 1:
                lln.fill_next_token_bitmask_par(executor, [(m, r) for r, m in guided], mask)
            else:
                for r, m in guided:
                    lln.fill_next_token_bitmask(m, mask, r)
        words = mask.view(np.uint32)
        for r, ids in banned:
            for t in ids:
                if 0 <= t < self.vocab_size:
                    words[r, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return mask


def allowed_ids(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a mask row allows (tests, diagnostics)."""
    bits = (mask_row.astype(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])
