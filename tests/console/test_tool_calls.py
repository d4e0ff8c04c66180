"""Tool-call formats: parsers per family, forced-call guides (compiled by llguidance, checked
against what they accept), closing object schemas, a forced call cut by max_tokens, and
streaming holds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from console import schemas as S
from console.format import Formatter
from console.structured import ToolPlan, ToolStream, parse_tool_calls
from console.tool_calls import FORMATS, close_objects, forced_guide, parse_auto, parse_forced
from runtime.model.structured import GuideCompiler
from runtime.tokenizer import TextTokenizer
from tests.tiny import tiny_tokenizer_json

HERMES, LLAMA, MISTRAL, GENERIC = (FORMATS[n] for n in ("hermes", "llama3_json", "mistral", "generic"))
WEATHER_PARAMS = {"type": "object", "required": ["city"],
                  "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = {"get_weather": S.FunctionDef(name="get_weather", parameters=WEATHER_PARAMS),
         "get_time": S.FunctionDef(name="get_time")}


def _args(call: S.ToolCall) -> dict:
    return json.loads(call.function.arguments)


# --- parsers ---------------------------------------------------------------------------------------

def test_hermes_blocks_among_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_auto(HERMES, text, TOOLS)
    assert content == "Let me check." and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert _args(calls[0]) == {"city": "Paris"} and calls[0].id != calls[1].id
    # an unknown tool or a block that is not JSON stays text
    text = '<tool_call>{"name": "launch", "arguments": {}}</tool_call> and <tool_call>{oops</tool_call>'
    assert parse_auto(HERMES, text, TOOLS) == (text, [])


def test_llama3_json_is_the_whole_answer():
    for text in ('{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                 '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                 ' {"name": "get_weather", "arguments": {"city": "Oslo"}} '):
        content, (call,) = parse_auto(LLAMA, text, TOOLS)
        assert content is None and call.function.name == "get_weather" and _args(call) == {"city": "Oslo"}
    content, calls = parse_auto(LLAMA, '{"name": "get_time", "parameters": {}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Rome"}}', TOOLS)
    assert content is None and [c.function.name for c in calls] == ["get_time", "get_weather"]
    for text in ('The weather is fine.', '{"answer": 42}', '{"name": "get_weather", "parameters": {"city": "Oslo"}} '
                 'and more text', '{"name": "nope", "parameters": {}}'):
        assert parse_auto(LLAMA, text, TOOLS) == (text, [])


def test_mistral_list_with_or_without_its_tag():
    for text in ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}]',
                 ' [{"name": "get_weather", "arguments": {"city": "Lima"}}]'):
        content, (call,) = parse_auto(MISTRAL, text, TOOLS)
        assert content is None and _args(call) == {"city": "Lima"}
        assert len(call.id) == 9 and call.id.isalnum()  # what Mistral's templates accept back
    assert parse_auto(MISTRAL, "[1, 2]", TOOLS) == ("[1, 2]", [])


def test_parallel_tool_calls_false_keeps_the_first():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_time"}</tool_call>'
    plan = ToolPlan("auto", TOOLS, parallel=False, format=GENERIC)
    assert len(parse_tool_calls(text, plan)[1]) == 1


@pytest.mark.parametrize("fmt, text", [
    (GENERIC, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Par'),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Par'),
])
def test_forced_call_cut_short_is_still_a_call(fmt, text):
    call = parse_forced(fmt, text, ["get_weather", "get_time"])
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Par'


def test_forced_call_cut_inside_the_name_or_before_the_arguments():
    assert parse_forced(GENERIC, '<tool_call>{"name": "get_w', ["get_weather", "get_time"]).function.name == \
        "get_weather"
    ambiguous = parse_forced(GENERIC, '<tool_call>{"name": "get_', ["get_weather", "get_time"])
    assert ambiguous.function.name == "get_" and ambiguous.function.arguments == ""
    assert parse_forced(GENERIC, "", ["get_weather"]).function.name == "get_weather"
    call = parse_forced(LLAMA, '{"name": "get_weather", "param', ["get_weather"])
    assert (call.function.name, call.function.arguments) == ("get_weather", "")


def test_forced_call_complete_even_if_the_closing_tag_was_cut():
    call = parse_forced(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool',
                        ["get_weather"])
    assert _args(call) == {"city": "Paris"}


def test_a_repeated_key_comes_back_once():
    call = parse_forced(GENERIC, '<tool_call>{"name": "f", "arguments": {"x": 1, "x": 2}}</tool_call>', ["f"])
    assert call.function.arguments == '{"x": 2}'


# --- schemas and guides ----------------------------------------------------------------------------

def test_close_objects():
    s = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "additionalProperties": True},
        "typed": {"type": "object", "additionalProperties": {"type": "object", "properties": {"c": {}}}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"d": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"e": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"f": {}}}, {"properties": {"g": {}}}]},
        "tagged": {"type": "object", "properties": {"kind": {}}, "oneOf": [{"properties": {"h": {}}}]}},
        "$defs": {"x": {"type": "object", "properties": {}}}}
    c = close_objects(s)
    p = c["properties"]
    assert c["additionalProperties"] is False and p["a"]["additionalProperties"] is False
    assert p["open"]["additionalProperties"] is True  # the schema allows more: kept
    assert p["typed"]["additionalProperties"]["additionalProperties"] is False
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False and p["either"]["anyOf"][1] == {"type": "null"}
    assert all("additionalProperties" not in b for b in p["both"]["allOf"])
    assert "additionalProperties" not in p["tagged"] and "additionalProperties" not in p["tagged"]["oneOf"][0]
    assert c["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in s  # the request's schema is not changed


@pytest.fixture(scope="module")
def compiler() -> GuideCompiler:
    tok_json, vocab = tiny_tokenizer_json()
    return GuideCompiler(TextTokenizer(Tokenizer.from_str(tok_json), eos_token_ids=(0,)), vocab)


def _accepts(compiler: GuideCompiler, guide, text: str) -> bool:
    m = compiler.compile(guide)
    ids = compiler.tokenizer.encode(text)
    return bool(m.consume_tokens(ids)) and not m.is_error() and m.is_accepting()


@pytest.mark.parametrize("fmt, good", [
    (GENERIC, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_forced_guides_keep_to_the_family_shape_and_the_schema(compiler, fmt, good):
    guide = forced_guide(fmt, {"get_weather": WEATHER_PARAMS})
    assert _accepts(compiler, guide, good)
    key = fmt.args_key
    assert not _accepts(compiler, guide, good.replace('"Paris"', '"Paris", "country": "FR"'))  # undeclared
    assert not _accepts(compiler, guide, good.replace('{"city": "Paris"', '{"city": "Paris", "city": "Rome"'))
    assert not _accepts(compiler, guide, good.replace('"get_weather"', '"get_time"'))
    assert not _accepts(compiler, guide, good.replace(f'"{key}"', '"args"'))


def test_required_chooses_among_tools_and_open_schemas_stay_open(compiler):
    guide = forced_guide(GENERIC, {"get_weather": WEATHER_PARAMS, "tag": {
        "type": "object", "properties": {"labels": {"type": "object", "additionalProperties": {"type": "string"}}}}})
    assert _accepts(compiler, guide, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert _accepts(compiler, guide, '<tool_call>{"name": "tag", "arguments": {"labels": {"k": "v"}}}</tool_call>')
    assert not _accepts(compiler, guide, '<tool_call>{"name": "tag", "arguments": {"x": 1}}</tool_call>')


def test_a_description_with_gbnf_syntax_is_still_lark(compiler):
    params = {"type": "object", "properties": {"rule": {"type": "string", "description": "root ::= x"}}}
    guide = forced_guide(GENERIC, {"f": params})
    assert _accepts(compiler, guide, '<tool_call>{"name": "f", "arguments": {"rule": "a"}}</tool_call>')


# --- streaming and the response shapes -------------------------------------------------------------

def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[str, str, list[S.ToolCall]]:
    ts = ToolStream(plan)
    sent = "".join(ts.feed(p) for p in pieces)
    tail, calls = ts.finish()
    return sent, tail, calls


def test_streaming_holds_what_may_be_a_call():
    plan = ToolPlan("auto", TOOLS, format=LLAMA)
    sent, tail, calls = _stream(plan, ['{"name": "get_', 'time", "parameters": {}}'])
    assert sent == "" and tail == "" and [c.function.name for c in calls] == ["get_time"]
    sent, tail, calls = _stream(plan, ["It is", " sunny."])
    assert sent == "It is sunny." and tail == "" and calls == []
    sent, tail, calls = _stream(plan, ['{"not": ', '"a call"}'])
    assert sent == "" and tail == '{"not": "a call"}' and calls == []
    plan = ToolPlan("auto", TOOLS, format=HERMES)
    sent, tail, calls = _stream(plan, ["Sure. <tool", '_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'])
    assert sent == "Sure. " and tail == "" and len(calls) == 1


def _job(text: str, reason: str) -> SimpleNamespace:
    return SimpleNamespace(index=0, text=[text], token_ids=[], logprobs=[], finish_reason=reason, stop_reason=None)


@pytest.mark.parametrize("fmt, text", [
    (GENERIC, '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Pa'),
])
def test_forced_call_cut_by_max_tokens_comes_back_as_tool_calls(fmt, text):
    plan = ToolPlan("forced", TOOLS, format=fmt, parallel=False, forced=["get_weather"])
    fmt_ = Formatter(None, False, tools=plan)
    choice = fmt_.chat_choice(_job(text, "length"))
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Pa'
    # streamed: nothing as content, one tool-call delta with the partial arguments, then "length"
    out = SimpleNamespace(text=text, token_ids=[], logprobs=[], finished=True, finish_reason="length",
                          stop_reason=None)
    chunk = Formatter(None, False, tools=plan).chat_delta(_job("", None), out)
    assert chunk.finish_reason == "length" and chunk.delta.content is None
    (delta,) = chunk.delta.tool_calls
    assert delta.function.name == "get_weather" and delta.function.arguments == '{"city": "Pa'


def test_a_complete_forced_call_finishes_with_tool_calls():
    plan = ToolPlan("forced", TOOLS, format=HERMES, parallel=False, forced=["get_weather"])
    choice = Formatter(None, False, tools=plan).chat_choice(
        _job('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "stop"))
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _args(choice.message.tool_calls[0]) == {"city": "Oslo"}


def test_a_stop_string_inside_a_forced_call_keeps_finish_reason_stop():
    plan = ToolPlan("forced", TOOLS, format=GENERIC, parallel=False, forced=["get_weather"])
    choice = Formatter(None, False, tools=plan).chat_choice(
        _job('<tool_call>{"name": "get_weather", "arguments": {"ci', "stop"))
    assert choice.finish_reason == "stop" and choice.message.tool_calls[0].function.arguments == '{"ci'
