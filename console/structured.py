"""Structured outputs and tool calls at the API edge: request fields -> a runtime Guide
(what the engine constrains the output to), tools -> prompt text, and generated text ->
OpenAI `tool_calls`.

Tool calls, as served here (docs/api.md, the tools section):
- The checkpoint's chat template renders `tools` when it reads them. Otherwise -- SmolLM2's
  ignores them -- TOOL_PROMPT with every tool's name, description and JSON schema goes into
  the system message. Past calls go to a template that renders `tool_calls` in OpenAI's shape
  (arguments as a dict); otherwise they are written back into the assistant turn as text in
  the family's format. `role: "tool"` turns are rendered by the template.
- The call format is the checkpoint's family's (console/tool_calls.py: hermes, llama3_json,
  mistral, generic).
- `required` and a named function are *forced*: the output is constrained to one call of
  one tool (named: that one) in the family's shape, with its parameters' schema closed, so
  the arguments parse and hold only declared keys; cut short by max_tokens it is still
  returned as a call (finish_reason "length", the arguments as far as generated).
  `required` makes exactly one call (vLLM makes a list); `auto` parses calls out of free
  text (all of them, or the first with parallel_tool_calls false).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from console import schemas as S
from console.errors import APIError
from console.tool_calls import (FORMATS, ToolFormat, forced_guide, held_from, parse_auto, parse_forced,
                                write_back)
from runtime.model.structured import Guide

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
    guide: Guide | None = None                 # forced: one call in the format's shape
    parallel: bool = True
    format: ToolFormat = FORMATS["generic"]
    forced: list[str] = field(default_factory=list)  # forced: the tools it may call

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(body: S.ChatCompletionRequest, has_guide: bool, fmt: ToolFormat = FORMATS["generic"]) -> ToolPlan:
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: requires tools", param="tool_choice")
        return ToolPlan("none", format=fmt)
    by_name: dict[str, S.FunctionDef] = {}
    for i, t in enumerate(tools):
        if t.function.name in by_name:
            raise APIError(400, f"tools[{i}].function.name: {t.function.name!r} is given twice",
                           param=f"tools[{i}].function.name")
        if t.function.parameters is not None:
            check_schema(t.function.parameters, f"tools[{i}].function.parameters")
        by_name[t.function.name] = t.function
    if choice == "none":
        return ToolPlan("none", format=fmt)
    if choice in (None, "auto"):
        if has_guide:
            raise APIError(400, "tool_choice: auto tool calls cannot be combined with response_format or "
                                "structured_outputs; set tool_choice to none, required or a function",
                           param="tool_choice")
        return ToolPlan("auto", by_name, parallel=body.parallel_tool_calls, format=fmt)
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
    guide = forced_guide(fmt, {n: by_name[n].parameters or NO_ARGUMENTS for n in names})
    return ToolPlan("forced", by_name, guide, parallel=False, format=fmt, forced=names)


def tool_specs(plan: ToolPlan) -> list[dict[str, Any]]:
    """The request's tools as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": {"name": f.name, **({"description": f.description} if f.description
                                                                  else {}),
                                               "parameters": f.parameters or NO_ARGUMENTS}}
            for f in plan.tools.values()]


def render_messages(messages: list[S.ChatMessage], plan: ToolPlan, template_renders_tools: bool,
                    template_renders_calls: bool | None = None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat messages as template dicts, and the `tools` to hand the template (None: listed
    here, in the system message). Past calls go to a template that renders `tool_calls` in
    OpenAI's shape with `arguments` parsed into a dict (what tool-aware templates index and
    tojson, as vLLM hands them); otherwise they are written back into the content as text,
    in the family's format."""
    renders_calls = template_renders_tools if template_renders_calls is None else template_renders_calls

    def text(m: S.ChatMessage) -> str:
        return "".join(p.text for p in m.content) if isinstance(m.content, list) else (m.content or "")

    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": text(m), **({"name": m.name} if m.name else {})}
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls]
            if renders_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": n, "arguments": a}}
                                   for c, (n, a) in zip(m.tool_calls, calls)]
            else:
                d["content"] += write_back(plan.format, calls)
        out.append(d)
    if not plan.active:
        return out, None
    specs = tool_specs(plan)
    if template_renders_tools:
        return out, specs
    listing = "\n".join(f"- {s['function']['name']}: {s['function'].get('description', '')} Arguments (JSON "
                        f"schema): {json.dumps(s['function']['parameters'])}" for s in specs)
    prompt = TOOL_PROMPT.format(tools=listing)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _arguments(s: str) -> Any:
    """A past call's arguments (JSON text on the wire) as templates expect them: a dict; empty: {}."""
    if not s.strip():
        return {}
    try:
        return json.loads(s)
    except ValueError:
        return s


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[S.ToolCall]]:
    """(content left, tool calls) of a finished generation. A forced one is always its call,
    even cut short (see tool_calls.parse_forced)."""
    if plan.mode == "forced":
        return None, [parse_forced(plan.format, text, plan.forced)]
    if plan.mode != "auto":
        return text, []
    content, calls = parse_auto(plan.format, text, plan.tools)
    if not plan.parallel:
        calls = calls[:1]
    return content, calls


def tool_finish_reason(calls: list[S.ToolCall], reason: str | None) -> str | None:
    """"tool_calls" for a choice that ended itself with whole calls; a call cut short (max_tokens,
    or a stop string inside a forced call) keeps the reason that cut it."""
    if not calls or reason != "stop":
        return reason
    try:
        for c in calls:
            json.loads(c.function.arguments)
    except ValueError:
        return reason
    return "tool_calls"


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
        hold = max(self.sent, held_from(self.plan.format, self.text, self.sent))
        out, self.sent = self.text[self.sent:hold], hold
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
