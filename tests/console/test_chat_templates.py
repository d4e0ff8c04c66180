"""Real chat templates (tests/console/chat_templates/, with their sources in its README)
render here exactly as transformers' apply_chat_template renders them, with and without
tools, tool calls and tool results; and each checkpoint family gets its tool-call format."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from console import schemas as S
from console.structured import ToolPlan, render_messages
from console.tool_calls import FORMATS, detect
from runtime.tokenizer import ChatTemplate

TEMPLATES = Path(__file__).parent / "chat_templates"
# template file -> (bos_token, eos_token, the family's tool-call format, architecture)
FAMILIES = {
    "llama-3.1-instruct": ("<|begin_of_text|>", "<|eot_id|>", "llama3_json", "llama"),
    "qwen2.5-instruct": ("", "<|im_end|>", "hermes", "qwen2"),
    "qwen3": ("", "<|im_end|>", "hermes", "qwen3"),
    "mistral-7b-instruct-v0.3": ("<s>", "</s>", "mistral", "llama"),
    "gemma-3-it": ("<bos>", "<eos>", "generic", "gemma3"),
    "smollm2-instruct": ("<|im_start|>", "<|im_end|>", "generic", "llama"),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CALL_ID = "abcDEF123"  # Mistral's templates take 9 alphanumerics only

# OpenAI-shaped conversations, as a client sends them (arguments as JSON text)
PLAIN = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
MULTI_TURN = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
              {"role": "user", "content": "Another?"}]
ASKING = [{"role": "system", "content": "You help with weather."},
          {"role": "user", "content": "What is the weather in Paris?"}]
CALLED = ASKING + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temperature": 18}'}]


def _template(name: str) -> ChatTemplate:
    bos, eos, _, _ = FAMILIES[name]
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), bos, eos)


def _as_transformers_takes(messages: list[dict]) -> list[dict]:
    """The conversation as transformers' docs pass it: tool-call arguments as a dict, and text
    content (an assistant turn that only calls tools has "", as vLLM renders it)."""
    out = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def _transformers(name: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    bos, eos, _, _ = FAMILIES[name]
    special = {"bos_token": bos, "eos_token": eos} if bos else {"eos_token": eos}
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools,
                                        chat_template=(TEMPLATES / f"{name}.jinja").read_text(),
                                        add_generation_prompt=add_generation_prompt, **special)
    return rendered[0]


def _ours(name: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """Through the API's own path: decoded request messages -> render_messages -> the template."""
    tpl = _template(name)
    decoded = msgspec.json.decode(json.dumps(messages), type=list[S.ChatMessage])
    plan = ToolPlan("auto", {t["function"]["name"]: S.FunctionDef(**t["function"]) for t in tools or []},
                    format=detect(tpl.source, FAMILIES[name][3])) if tools else ToolPlan("none")
    msgs, specs = render_messages(decoded, plan, tpl.renders_tools, "tool_calls" in tpl.source)
    assert (specs is not None) == (tools is not None and tpl.renders_tools)
    return tpl.render(msgs, add_generation_prompt, specs)


CASES = [("plain", PLAIN, None, True), ("multi_turn", MULTI_TURN, None, True), ("plain_no_prompt", PLAIN, None, False),
         ("tools", ASKING, [WEATHER], True), ("tool_call_and_result", CALLED, [WEATHER], True),
         ("tool_call_and_result_no_tools", CALLED, None, True)]
TOOL_AWARE = ["llama-3.1-instruct", "qwen2.5-instruct", "qwen3", "mistral-7b-instruct-v0.3"]


@pytest.mark.parametrize("name", TOOL_AWARE)
@pytest.mark.parametrize("case, messages, tools, gen", CASES, ids=[c[0] for c in CASES])
def test_tool_aware_templates_render_as_transformers(name, case, messages, tools, gen):
    expected = _transformers(name, _as_transformers_takes(messages), tools, gen)
    assert _ours(name, messages, tools, gen) == expected
    if tools and case == "tools":  # the template itself listed the tool
        assert "get_weather" in expected and "Current weather in a city" in expected


def test_each_family_writes_the_call_its_own_way():
    rendered = {n: _ours(n, CALLED, [WEATHER], True) for n in TOOL_AWARE}
    args = '{"city": "Paris", "unit": "celsius"}'
    assert f'{{"name": "get_weather", "parameters": {args}}}<|eot_id|>' in rendered["llama-3.1-instruct"]
    assert "Environment: ipython" in rendered["llama-3.1-instruct"]
    for q in ("qwen2.5-instruct", "qwen3"):
        assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>' in rendered[q]
        assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in rendered[q]
    assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {args}, "id": "{CALL_ID}"}}]</s>' \
        in rendered["mistral-7b-instruct-v0.3"]


@pytest.mark.parametrize("case, messages, tools, gen", CASES[:4], ids=[c[0] for c in CASES[:4]])
@pytest.mark.parametrize("name", ["gemma-3-it", "smollm2-instruct"])
def test_templates_without_tools_render_as_transformers(name, case, messages, tools, gen):
    """Without tools these match transformers; with tools the tool prompt goes into the
    system message first (these templates do not read `tools`)."""
    if tools is None:
        assert _ours(name, messages, None, gen) == _transformers(name, messages, None, gen)
        return
    from console.structured import TOOL_PROMPT

    listing = ('- get_weather: Current weather in a city Arguments (JSON schema): '
               + json.dumps(WEATHER["function"]["parameters"]))
    system = {"role": "system", "content": messages[0]["content"] + "\n\n" + TOOL_PROMPT.format(tools=listing)}
    assert _ours(name, messages, tools, gen) == _transformers(name, [system, *messages[1:]], None, gen)


def test_gemma_folds_the_system_message_into_the_first_user_turn():
    out = _ours("gemma-3-it", PLAIN, None, True)
    assert out == "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    with_tools = _ours("gemma-3-it", ASKING, [WEATHER], True)
    assert with_tools.startswith("<bos><start_of_turn>user\nYou help with weather.\n\nYou can call tools.")
    assert "<start_of_turn>system" not in with_tools


def test_template_errors_are_messages_errors_as_transformers_raises_them():
    import jinja2

    # Gemma: a tool turn breaks user/model alternation; Mistral: an id that is not 9 characters
    bad_id = [dict(m) for m in CALLED]
    bad_id[2] = {**bad_id[2], "tool_calls": [{**bad_id[2]["tool_calls"][0], "id": "call_1"}]}
    for name, msgs, tools in (("gemma-3-it", CALLED, None), ("mistral-7b-instruct-v0.3", bad_id, [WEATHER])):
        with pytest.raises(jinja2.TemplateError):
            _transformers(name, _as_transformers_takes(msgs), tools, True)
        with pytest.raises(ValueError, match="^messages: "):
            _ours(name, msgs, tools, True)


def test_environment_matches_transformers():
    """loop controls, strftime_now, namespace, tojson options, {% generation %}, and `tools`
    / `documents` defined as none when not given."""
    src = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}|{% endfor %}"
           "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
           "{{ strftime_now('%Y') | length }}|{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=true) }}|"
           "{{ tools is none }}{{ documents is none }}|{% generation %}{{ eos_token }}{% endgeneration %}")
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [{"role": "user", "content": str(i)} for i in range(4)]
    expected = render_jinja_template(conversations=[msgs], chat_template=src, eos_token="</s>")[0][0]
    assert ChatTemplate(src, "", "</s>").render(msgs, False) == expected == '0|1|4|4|{"a": "é", "b": 1}|TrueTrue|</s>'


def test_sandbox_refuses_internals():
    tpl = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="^messages: "):
        tpl.render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="^messages: "):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_format_and_tools_awareness(name):
    _, _, fmt, arch = FAMILIES[name]
    tpl = _template(name)
    assert detect(tpl.source, arch).name == fmt
    assert tpl.renders_tools == (name in TOOL_AWARE)


def test_format_falls_back_to_the_architecture():
    assert detect(None, "qwen2") is FORMATS["hermes"] and detect(None, "qwen3") is FORMATS["hermes"]
    assert detect(None, "llama") is FORMATS["generic"] and detect("{{ messages }}", None) is FORMATS["generic"]


def test_a_template_that_does_not_parse_is_a_messages_error():
    tpl = ChatTemplate("{% for m in messages %}{{ m.content }")
    assert not tpl.renders_tools
    with pytest.raises(ValueError, match="^messages: chat template failed"):
        tpl.render([{"role": "user", "content": "x"}])
