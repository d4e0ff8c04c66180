"""Structured outputs and tool calls at the API edge: request fields -> a runtime Guide
(what the engine constrains the output to), tools -> prompt text, and generated text ->
OpenAI `tool_calls`.

Tool calls, as served here (documented in README "Structured outputs and tools"):
- The checkpoint's chat template renders `tools` when it knows them (its source uses
  `tools`). Otherwise -- SmolLM2's ignores them -- TOOL_PROMPT with every tool's name,
  description and JSON schema goes into the system message, and past calls are written
  back into assistant turns as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  `role: "tool"` turns are rendered by the template as their own role.
- `required` and a named function are *forced*: the output is constrained to the JSON
  `{"name": ..., "arguments": ...}` of one tool (named: that one) with its parameters'
  schema, so `arguments` always parse. `required` makes exactly one call (vLLM makes a
  list); `auto` parses `<tool_call>` blocks out of free text (all of them, or the first
  with parallel_tool_calls false).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from console import schemas as S
from console.errors import APIError
from runtime.model.structured import Guide

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_PROMPT = """You can call tools. To call one, answer with only
<tool_call>{{"name": "<tool name>", "arguments": {{<the arguments as JSON>}}}}</tool_call>
Available tools:
{tools}"""
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def check_schema(schema: Any, param: str) -> None:
    """A JSON schema, or a 400 naming `param` (llguidance then decides if it can compile it)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: must be a JSON schema object", param=param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise APIError(400, f"{param}: not a valid JSON schema{f' at {where}' if where else ''}: "
                            f"{exc.message[:200]}", param=param) from None


def guide_from_body(body: Any) -> Guide | None:
    """response_format or structured_outputs (not both) -> the Guide, or None."""
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise APIError(400, "structured_outputs: cannot be combined with response_format", param="structured_outputs")
    if rf is not None and rf.type == "json_object":
        return Guide("json_object", param="response_format")
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format.json_schema: required when type is json_schema",
                           param="response_format.json_schema")
        if rf.json_schema.schema is None:
            return Guide("json_object", param="response_format.json_schema")
        check_schema(rf.json_schema.schema, "response_format.json_schema.schema")
        return Guide.json_schema(rf.json_schema.schema, "response_format.json_schema.schema")
    if so is None:
        return None
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise APIError(400, f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object "
                            f"(got {', '.join(given) or 'none'})", param="structured_outputs")
    kind, param = given[0], f"structured_outputs.{given[0]}"
    if kind == "json":
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise APIError(400, f"{param}: not valid JSON", param=param) from None
        check_schema(schema, param)
        return Guide.json_schema(schema, param)
    if kind == "choice":
        return Guide.choice(so.choice, param)
    if kind == "json_object":
        return Guide("json_object", param=param)
    return Guide(kind, getattr(so, kind), param)


# --- tools -------------------------------------------------------------------------------------------

@dataclass
class ToolPlan:
    mode: str                                  # none | auto | forced
    tools: dict[str, S.FunctionDef] = field(default_factory=dict)
    guide: Guide | None = None                 # forced: the call's JSON
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(body: S.ChatCompletionRequest, has_guide: bool) -> ToolPlan:
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: requires tools", param="tool_choice")
        return ToolPlan("none")
    by_name: dict[str, S.FunctionDef] = {}
    for i, t in enumerate(tools):
        if t.function.name in by_name:
            raise APIError(400, f"tools[{i}].function.name: {t.function.name!r} is given twice",
                           param=f"tools[{i}].function.name")
        if t.function.parameters is not None:
            check_schema(t.function.parameters, f"tools[{i}].function.parameters")
        by_name[t.function.name] = t.function
    if choice == "none":
        return ToolPlan("none")
    if choice in (None, "auto"):
        if has_guide:
            raise APIError(400, "tool_choice: auto tool calls cannot be combined with response_format or "
                                "structured_outputs; set tool_choice to none, required or a function",
                           param="tool_choice")
        return ToolPlan("auto", by_name, parallel=body.parallel_tool_calls)
    if has_guide:
        raise APIError(400, "tool_choice: a forced tool call cannot be combined with response_format or "
                            "structured_outputs", param="tool_choice")
    if isinstance(choice, S.NamedToolChoice):
        if choice.function.name not in by_name:
            raise APIError(400, f"tool_choice.function.name: no tool is named {choice.function.name!r}",
                           param="tool_choice.function.name")
        names = [choice.function.name]
    else:
        names = list(by_name)
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": n}, "arguments": by_name[n].parameters or NO_ARGUMENTS}}
             for n in names]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return ToolPlan("forced", by_name, Guide.json_schema(schema, "tool_choice"), parallel=False)


def render_messages(messages: list[S.ChatMessage], plan: ToolPlan, template_renders_tools: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat messages as template dicts (tool calls written back as text unless the template
    renders them), and the `tools` to hand the template (None: rendered here)."""
    def text(m: S.ChatMessage) -> str:
        return "".join(p.text for p in m.content) if isinstance(m.content, list) else (m.content or "")

    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": text(m), **({"name": m.name} if m.name else {})}
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)} for c in m.tool_calls]
            if template_renders_tools:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                    "arguments": a["arguments"]}} for c, a in zip(m.tool_calls, calls)]
            else:
                d["content"] += "".join(f"{OPEN}{json.dumps(c)}{CLOSE}" for c in calls)
        out.append(d)
    if not plan.active:
        return out, None
    specs = [{"type": "function", "function": {"name": f.name, "description": f.description or "",
                                               "parameters": f.parameters or NO_ARGUMENTS}}
             for f in plan.tools.values()]
    if template_renders_tools:
        return out, specs
    listing = "\n".join(f"- {s['function']['name']}: {s['function']['description']} Arguments (JSON schema): "
                        f"{json.dumps(s['function']['parameters'])}" for s in specs)
    prompt = TOOL_PROMPT.format(tools=listing)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _loads_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return s


def _call(name: str, arguments: Any) -> S.ToolCall:
    return S.ToolCall(id=f"call_{secrets.token_hex(12)}",
                      function=S.FunctionCall(name, json.dumps(arguments, ensure_ascii=False)))


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[S.ToolCall]]:
    """(content left, tool calls) of a finished generation."""
    if plan.mode == "forced":
        try:
            obj = json.loads(text)
            return None, [_call(obj["name"], obj["arguments"])]
        except (ValueError, KeyError, TypeError):  # cut off by max_tokens: no call, the text stays
            return text, []
    if plan.mode != "auto":
        return text, []
    calls, content, rest = [], [], text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        body, closed, rest = after.partition(CLOSE)
        content.append(before)
        try:
            obj = json.loads(body)
            if obj.get("name") in plan.tools and isinstance(obj.get("arguments", {}), dict):
                calls.append(_call(obj["name"], obj.get("arguments", {})))
                continue
        except (ValueError, AttributeError):
            pass
        content.append(OPEN + body + (CLOSE if closed else ""))  # not a call: keep it as text
    content.append(rest)
    if not plan.parallel:
        calls = calls[:1]
    left = "".join(content).strip()
    return (left or None) if calls else text, calls


class ToolStream:
    """Streaming one choice with tools: text flows as content until a tool call may begin
    (forced: never); what follows is held and parsed when the choice finishes."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent = plan, "", 0

    def feed(self, delta: str) -> str:
        """New text -> the content that can be sent now."""
        self.text += delta
        if self.plan.mode == "forced":
            return ""
        hold = self.text.find(OPEN, self.sent)
        if hold < 0:  # a marker may be starting at the end: hold its possible prefix back
            hold = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):
                    hold = len(self.text) - k
                    break
        out, self.sent = self.text[self.sent:hold], max(self.sent, hold)
        return out

    def finish(self) -> tuple[str, list[S.ToolCall]]:
        """(content not sent yet, tool calls) at the end of the choice."""
        content, calls = parse_tool_calls(self.text, self.plan)
        if not calls:
            return self.text[self.sent:], []
        # the content before the first call was sent already; what is left is text between calls
        sent = self.text[:self.sent].strip()
        tail = (content or "").strip()
        return (tail[len(sent):] if tail.startswith(sent) else ""), calls
