"""Tokenizer: `tokenizers` encode/decode, incremental detokenization, chat templates."""

from __future__ import annotations

import json
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

# Split regexes for GGUF `tokenizer.ggml.pre` values whose merges were learned on them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):  # digits one by one, then GPT-2 splitting
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
             "qwen2": _QWEN2_SPLIT}.get(pre)
    if split:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def build_byte_level_bpe(tokens: list[str], merges: list[str], specials: list[str], pre: str) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON (as transformers renders it)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore names are not allowed")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (training templates mark the assistant's part
    with it): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    """What transformers' apply_chat_template renders in (transformers/utils/chat_template_utils.py):
    sandboxed, trim_blocks and lstrip_blocks, loop controls, plain-JSON tojson, raise_exception,
    strftime_now and a guarded namespace()."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    return env


@dataclass
class ChatTemplate:
    """A checkpoint's Jinja chat template, rendered with the variables transformers gives it:
    messages (keys whose value is None dropped, as transformers does), tools (None when the
    request has none), documents (None), add_generation_prompt, bos_token, eos_token."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    _compiled: Any = field(default=None, repr=False)
    _variables: frozenset[str] | None = field(default=None, repr=False)

    @property
    def variables(self) -> frozenset[str]:
        """The names the template reads from its context (none if it does not parse: rendering
        then reports that, as a 400 naming messages)."""
        if self._variables is None:
            try:
                self._variables = frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(self.source)))
            except jinja2.TemplateSyntaxError:
                self._variables = frozenset()
        return self._variables

    @property
    def renders_tools(self) -> bool:
        return "tools" in self.variables

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None, **extra: Any) -> str:
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            if self._compiled is None:
                self._compiled = _environment().from_string(self.source)
            return self._compiled.render(messages=msgs, tools=list(tools) if tools is not None else None,
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except jinja2.TemplateError as exc:
            raise ValueError(f"messages: chat template failed: {exc}") from None


class TextTokenizer:
    """What the engine and web layer use: ids <-> text and the chat template."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 bos_token_id: int | None = None, eos_token_ids: Sequence[int] = (), add_bos: bool = False,
                 architecture: str | None = None):
        self.tok = tokenizer
        self.architecture = architecture  # the model family (config.json): picks the tool-call format
        self.add_bos = add_bos and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        bos = tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else ""
        eos = tokenizer.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        self.chat = ChatTemplate(chat_template, bos or "", eos or "") if chat_template else None

    @classmethod
    def from_checkpoint(cls, ckpt_dir: Path, bos_token_id: int | None, eos_token_ids: Sequence[int],
                        add_bos: bool) -> "TextTokenizer":
        tok = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json"))
        tpl = ckpt_dir / "chat_template.jinja"
        cfg = ckpt_dir / "config.json"
        arch = json.loads(cfg.read_text()).get("architecture") if cfg.is_file() else None
        return cls(tok, tpl.read_text() if tpl.exists() else None, bos_token_id, eos_token_ids, add_bos, arch)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (e.g. a rendered chat template) stay whole.
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """The chat template writes `tools` into the prompt itself."""
        return self.chat is not None and self.chat.renders_tools

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None, **extra: Any) -> str:
        if self.chat is None:
            raise ValueError("messages: this checkpoint has no chat template; use /v1/completions")
        return self.chat.render(messages, add_generation_prompt, tools, **extra)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, list(prompt_ids))


class IncrementalDetokenizer:
    """A growing token list -> text deltas, never half a UTF-8 character: `tokenizers`'
    DecodeStream, primed with a few prompt tokens of left context so byte-level merges and
    leading spaces render as in a whole decode. `text` is everything emitted so far."""

    CONTEXT = 5       # prompt tokens of left context, at least
    MAX_CONTEXT = 24  # looked back at most for a context that decodes without U+FFFD

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=self._context(list(prompt_ids)), skip_special_tokens=skip_special_tokens)
        self.text = ""

    def _context(self, prompt_ids: list[int]) -> list[int]:
        # A context whose text holds U+FFFD (it starts or ends inside a character: token-id
        # prompts) would be emitted as output by the stream; take a longer one, or none.
        for n in range(self.CONTEXT, self.MAX_CONTEXT + 1):
            ctx = prompt_ids[-n:]
            if "\ufffd" not in self.tokenizer.decode(ctx, self.skip_special_tokens):
                return ctx
            if n >= len(prompt_ids):
                break
        return []

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the text they complete. One stream step per token: a step
        given several ids at once can leave the tail of their text out for good (several
        tokens come at once from a speculative step)."""
        out = []
        for t in token_ids:
            try:
                delta = self._stream.step(self.tokenizer.tok, int(t))
            except Exception as exc:  # noqa: BLE001 -- tokenizers raises a plain Exception
                if "Invalid prefix" not in str(exc):
                    raise
                # A decoder whose text of a longer list does not begin with that of the shorter
                # (vllm-project/vllm#17448): start over from this token, without context.
                self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
                delta = self._stream.step(self.tokenizer.tok, int(t))
            if delta:
                out.append(delta)
        text = "".join(out)
        self.text += text
        return text
