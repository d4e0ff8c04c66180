"""Tool-call formats per model family: how a checkpoint writes a call, how a forced call is
generated in that shape, and how calls are read back out of generated text.

The format is picked from the checkpoint (`detect`): its chat template is the model's own
statement of it (the tool-call shape the template writes back), else its architecture.

- hermes (Qwen2, Qwen3, Hermes-style templates): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>` blocks, anywhere in the answer, several allowed.
- llama3_json (Llama 3.1 / 3.2 templates): the whole answer is `{"name": ..., "parameters":
  {...}}`, optionally after `<|python_tag|>`; several calls separated by `;`.
- mistral (templates with `[TOOL_CALLS]`): the whole answer is `[TOOL_CALLS] [{"name": ...,
  "arguments": {...}}, ...]` (the tag is a special token, so decoded text often lacks it);
  call ids are 9 alphanumerics, as those templates require.
- generic (everything else, e.g. SmolLM2): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  as TOOL_PROMPT (console/structured.py) asks.

A forced call (`tool_choice` required or a named function) is constrained to one call in
the family's shape, with the tool's parameter schema closed (`close_objects`): arguments hold
only declared properties unless the schema itself allows more, and llguidance emits declared
properties at most once each, in schema order.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from console import schemas as S
from runtime.model.structured import Guide

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
# The separators the templates' tojson writes calls back with: a forced call looks like the
# calls the model saw in training, and no free whitespace (a small model can spend its budget on it).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str         # "arguments", or Llama's "parameters"
    prefix: str = ""      # text around one forced call
    suffix: str = ""
    as_list: bool = False  # mistral: the calls are a JSON list
    whole_answer: bool = False  # a call is the whole answer (not blocks inside text)


FORMATS = {f.name: f for f in (
    ToolFormat("generic", "arguments", OPEN, CLOSE),
    ToolFormat("hermes", "arguments", OPEN + "\n", "\n" + CLOSE),
    ToolFormat("llama3_json", "parameters", whole_answer=True),
    ToolFormat("mistral", "arguments", as_list=True, whole_answer=True),
)}


def detect(template: str | None, architecture: str | None) -> ToolFormat:
    """The checkpoint's tool-call format: the one its chat template writes, else its architecture's."""
    src = template or ""
    if OPEN in src:
        return FORMATS["hermes"]
    if PYTHON_TAG in src or '"parameters": dictionary of argument name' in src:
        return FORMATS["llama3_json"]
    if MISTRAL_TAG in src:
        return FORMATS["mistral"]
    if architecture in ("qwen2", "qwen3"):
        return FORMATS["hermes"]
    return FORMATS["generic"]


def of_tokenizer(tok: Any) -> ToolFormat:
    chat = getattr(tok, "chat", None)
    return detect(getattr(chat, "source", None), getattr(tok, "architecture", None))


def call_id(fmt: ToolFormat) -> str:
    if fmt.name == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def make_call(fmt: ToolFormat, name: str, arguments: Any) -> S.ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return S.ToolCall(id=call_id(fmt), function=S.FunctionCall(name, text))


def write_back(fmt: ToolFormat, calls: list[tuple[str, Any]]) -> str:
    """Past calls as text in the family's shape, for a template that does not render tool_calls."""
    objs = [{"name": n, fmt.args_key: a} for n, a in calls]
    if fmt.as_list:
        return f"{MISTRAL_TAG} {json.dumps(objs, ensure_ascii=False)}"
    if fmt.whole_answer:
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objs)
    return "".join(f"{fmt.prefix}{json.dumps(o, ensure_ascii=False)}{fmt.suffix}" for o in objs)


# --- forced calls ----------------------------------------------------------------------------------

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# an object that takes properties from elsewhere too: closing it on its own `properties` would
# reject those
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")


def close_objects(schema: Any, close: bool = True) -> Any:
    """A copy of `schema` where every object schema that does not say what else it allows
    gets `additionalProperties: false`: JSON Schema's default is open, and a small model fills
    an open object with invented (and, llguidance allowing, repeated) keys until max_tokens.
    A schema that allows more (additionalProperties true or a schema) keeps it; so do objects
    whose properties are spread over allOf / anyOf / oneOf branches and their own (closing
    either part would reject the other's)."""
    if not isinstance(schema, dict):
        return schema
    out = copy.copy(schema)
    types = out.get("type")
    is_object = "properties" in out or types == "object" or (isinstance(types, list) and "object" in types)
    if close and is_object and not any(k in out for k in _OPEN_KEYS + _COMBINED):
        out["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    for key in ("items", "additionalProperties", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    if isinstance(out.get("items"), list):
        out["items"] = [close_objects(v) for v in out["items"]]
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [close_objects(v) for v in out["prefixItems"]]
    for key in ("anyOf", "oneOf", "allOf"):  # alternatives stand alone unless the node adds properties
        if isinstance(out.get(key), list):
            alone = key != "allOf" and "properties" not in out
            out[key] = [close_objects(v, close=alone) for v in out[key]]
    return out


def forced_guide(fmt: ToolFormat, tools: dict[str, Any]) -> Guide:
    """One call of one of `tools` (name -> parameters schema) in the family's shape."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", fmt.args_key],
              "properties": {"name": {"const": n}, fmt.args_key: close_objects(p)}} for n, p in tools.items()]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt.as_list:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    schema = {"x-guidance": JSON_STYLE, **schema}
    if not (fmt.prefix or fmt.suffix):
        return Guide.json_schema(schema, "tool_choice")
    # JSON text never has "::=" outside strings; escaping it inside keeps the grammar from
    # being read as GBNF (runtime/model/structured.py tells Lark from GBNF by it).
    body = json.dumps(schema, ensure_ascii=False).replace("::=", ":\\u003a=")
    return Guide("grammar", f"start: {json.dumps(fmt.prefix)} call {json.dumps(fmt.suffix)}\ncall: %json {body}",
                 "tool_choice")


# --- reading calls back ----------------------------------------------------------------------------

def _strip_lead(fmt: ToolFormat, text: str) -> str:
    s = text.strip()
    for tag in (fmt.prefix.strip(), PYTHON_TAG, MISTRAL_TAG):
        if tag and s.startswith(tag):
            s = s[len(tag):].lstrip()
    return s


def _as_call(fmt: ToolFormat, obj: Any, names: Any) -> S.ToolCall | None:
    """A parsed object that is a call of a known tool, as a ToolCall (its arguments re-serialized:
    a key the text repeats appears once, with its last value)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
    return make_call(fmt, obj["name"], args) if isinstance(args, dict) else None


def parse_forced(fmt: ToolFormat, text: str, names: list[str]) -> S.ToolCall:
    """The one call of a forced generation. Cut short (max_tokens), it is still a call: the
    name (completed when only one tool starts with what was generated) and the arguments
    text as generated so far."""
    s = _strip_lead(fmt, text)
    try:
        obj, _ = json.JSONDecoder().raw_decode(s)
        call = _as_call(fmt, obj[0] if fmt.as_list and isinstance(obj, list) and obj else obj, names)
        if call is not None:
            return call
    except ValueError:
        pass
    s = s[1:].lstrip() if fmt.as_list and s.startswith("[") else s
    m = re.match(r'\{\s*"name"\s*:\s*"([^"\\]*)(")?', s)
    name, args = (m.group(1) if m else ""), ""
    if m and m.group(2):
        a = re.compile(r'\s*,\s*"%s"\s*:\s*' % re.escape(fmt.args_key)).match(s, m.end())
        args = s[a.end():] if a else ""
    else:
        starts = [n for n in names if n.startswith(name)]
        name = starts[0] if len(starts) == 1 else name
    return S.ToolCall(id=call_id(fmt), function=S.FunctionCall(name, args))


def parse_auto(fmt: ToolFormat, text: str, names: Any) -> tuple[str | None, list[S.ToolCall]]:
    """(content left, calls) of a free answer; text that is not a well-formed call of a known
    tool stays content."""
    if fmt.whole_answer:
        return _parse_whole(fmt, text, names)
    calls, content, rest = [], [], text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        body, closed, rest = after.partition(CLOSE)
        content.append(before)
        try:
            call = _as_call(fmt, json.loads(body), names)
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
            continue
        content.append(OPEN + body + (CLOSE if closed else ""))  # not a call: keep it as text
    content.append(rest)
    left = "".join(content).strip()
    return ((left or None) if calls else text), calls


def _parse_whole(fmt: ToolFormat, text: str, names: Any) -> tuple[str | None, list[S.ToolCall]]:
    s = _strip_lead(fmt, text)
    try:
        objs = json.loads(s) if fmt.as_list else [json.loads(p) for p in s.split(";") if p.strip()]
    except ValueError:
        return text, []
    if not isinstance(objs, list):
        objs = [objs]
    calls = [_as_call(fmt, o, names) for o in objs]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


def held_from(fmt: ToolFormat, text: str, sent: int) -> int:
    """Streaming a free answer: where the text that may still turn into a call begins (what
    is before it can go out as content now)."""
    if fmt.whole_answer:  # the answer's start decides: a call's opening holds it all, else it flows
        s = text.lstrip()
        maybe_call = not s or any(s.startswith(t) or t.startswith(s) for t in ("{", "[", PYTHON_TAG, MISTRAL_TAG))
        return sent if maybe_call else len(text)
    hold = text.find(OPEN, sent)
    if hold >= 0:
        return hold
    for k in range(min(len(OPEN) - 1, len(text) - sent), 0, -1):  # a marker may be starting at the end
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
