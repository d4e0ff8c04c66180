"""The basics on the real default model (SmolLM2-135M-Instruct), served with no --checkpoint."""

from __future__ import annotations

import json
import re

import pytest

from tests.console.server_util import ServerHandle, start_server

pytestmark = pytest.mark.real_model

BLOCK = 16  # the server's --block-size (its default)


@pytest.fixture(scope="module")
def server(smollm2_ckpt) -> ServerHandle:
    # No --checkpoint: `serve` resolves the default model (the fixture made sure it is converted).
    with start_server(None, "--kv-cache-memory", "64MiB") as srv:
        yield srv


def test_chat_knows_paris(server):
    client = server.openai(timeout=300)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=32, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    # The module's first request on a fresh server (warm-up runs the model, not the prefix cache).
    n = r.usage.prompt_tokens
    assert n > BLOCK and r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # The same prompt again: every whole block before the last prompt token is a prefix-cache hit.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK


def test_completions_n_seed_logprobs_stop(server):
    client = server.openai(timeout=300)
    kw = dict(model=server.model, prompt="The capital of France is", max_tokens=8, temperature=0.8, seed=42,
              logprobs=2)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in a.choices)
    greedy = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=12,
                                       temperature=0, stop=["Paris"])
    assert "Paris" not in greedy.choices[0].text


# --- structured outputs and tools, through the official client -------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "pet", "address", "scores"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                         "pet": {"enum": ["cat", "dog", "fish"]},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}},
                         "scores": {"type": "array", "minItems": 1, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 0, "maximum": 10}}}}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}]


def test_parse_returns_a_pydantic_object(server):
    from enum import Enum

    from pydantic import BaseModel

    class Pet(str, Enum):
        cat = "cat"
        dog = "dog"

    class Person(BaseModel):
        name: str
        age: int
        pet: Pet

    client = server.openai(timeout=300)
    r = client.chat.completions.parse(model=server.model, response_format=Person, max_tokens=80, temperature=0,
                                      messages=[{"role": "user", "content": "Describe a person as JSON."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_json_schema_samples_always_validate(server):
    import jsonschema

    client = server.openai(timeout=300)
    choices = []
    for seed in (1, 100):  # n=10 each: 20 seeded samples (choice j has seed + j)
        choices += client.chat.completions.create(
            model=server.model, n=10, seed=seed, temperature=1.0, max_tokens=120,
            messages=[{"role": "user", "content": "Invent a person with a pet, an address and scores."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}}).choices
    assert len(choices) == 20
    for c in choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_regex_choice_and_grammar(server):
    client = server.openai(timeout=300)
    r = client.completions.create(model=server.model, prompt="Call me at", max_tokens=20, temperature=0.7, seed=3,
                                  extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}})
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text)
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=8, n=3, seed=2,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert all(c.message.content in ("yes", "no", "maybe") for c in r.choices)
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "Yes." | "No."'}})
    assert r.choices[0].message.content in ("Yes.", "No.")


def test_forced_tool_call_then_tool_answer(server):
    client = server.openai(timeout=300)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=server.model, messages=msgs, tools=WEATHER, tool_choice=named,
                                       max_tokens=60, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["unit"] in ("celsius", "fahrenheit")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, tools=WEATHER,
                                                 tool_choice="required", max_tokens=60, temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments)["city"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "unit": "celsius"}'}]
    r = client.chat.completions.create(model=server.model, messages=follow, tools=WEATHER, max_tokens=40,
                                       temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


# The schema of the forced call that once came back as `content` with finish_reason "length":
# no additionalProperties, so JSON Schema leaves the object open, and SmolLM2 kept inventing
# (and repeating) keys until max_tokens. Forced calls now close such objects.
OPEN_WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}]


def test_forced_call_with_an_open_schema_keeps_to_declared_keys(server):
    client = server.openai(timeout=300)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 4}):
        r = client.chat.completions.create(model=server.model, messages=msgs, tools=OPEN_WEATHER, tool_choice=named,
                                           max_tokens=80, **kw)
        for c in r.choices:
            (call,) = c.message.tool_calls
            assert c.message.content is None and call.function.name == "get_weather"
            assert c.finish_reason == "tool_calls", c
            args = json.loads(call.function.arguments)
            assert set(args) <= {"city", "unit"} and "city" in args
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, tools=OPEN_WEATHER,
                                                 tool_choice="required", max_tokens=80, temperature=0, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    (delta,) = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert set(json.loads(delta.function.arguments)) <= {"city", "unit"}


def test_forced_call_cut_by_max_tokens_is_still_a_tool_call(server):
    client = server.openai(timeout=300)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=server.model, messages=msgs, tools=OPEN_WEATHER, tool_choice=named,
                                       max_tokens=20, temperature=0)
    (c,) = r.choices
    (call,) = c.message.tool_calls
    assert c.finish_reason == "length" and c.message.content is None and call.function.name == "get_weather"
    # 20 tokens end inside the arguments (the call's opening takes 17): the partial JSON text
    assert call.function.arguments.startswith("{") and call.function.arguments != "{}"
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, tools=OPEN_WEATHER,
                                                 tool_choice=named, max_tokens=20, temperature=0, stream=True))
    (delta,) = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert delta.function.arguments == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
])
def test_bad_structured_input_is_400_naming_the_field(server, extra, param):
    import openai

    client = server.openai(timeout=60)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=extra)
    assert exc.value.body["param"] == param, exc.value.body
