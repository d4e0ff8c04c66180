"""Forced tool calls through the HTTP API, per family, in process: a stub engine generates
under the request's real llguidance guide (seeded random tokens among those the guide
allows, no model), so what comes back is what the guide lets through. The prompt the engine
gets is rendered by the family's real chat template (tests/console/chat_templates/)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from litestar.testing import TestClient
from tokenizers import Tokenizer

from console.app import create_app
from console.settings import ServerSettings
from runtime.core.engine import RequestOutput
from runtime.model.structured import GuideCompiler, TokenMasks, allowed_ids
from runtime.tokenizer import TextTokenizer
from tests.tiny import tiny_tokenizer_json

TEMPLATES = Path(__file__).parent / "chat_templates"
AUTH = {"Authorization": "Bearer api-secret"}
# no additionalProperties: an open object, which a forced call closes
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time"}}]
STRUCTURAL = set('"{}[],:')


class GuidedStubEngine:
    """Just enough of AsyncEngine for /v1/chat/completions: each request's tokens are drawn
    (seeded) among those its guide allows, structural characters favoured so calls finish."""

    max_model_len = context_limit = 4096

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer, self.vocab_size = tokenizer, tokenizer.vocab_size
        self.compiler = GuideCompiler(tokenizer, self.vocab_size)
        self.masks = TokenMasks(self.vocab_size)
        self.accepting, self.prompts = True, []

    def start(self) -> None:
        pass

    def stop(self, grace_s: float = 0.0) -> None:
        self.accepting = False

    def has_unfinished(self) -> bool:
        return False

    def abort(self, request_id: str) -> None:
        pass

    async def asubmit(self, prompt_ids, params, request_id, priority="interactive", decisions=()):
        self.prompts.append(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        assert params.guide is not None, "a forced call is guided"
        matcher, rng = self.compiler.compile(params.guide), random.Random(params.seed or 0)
        queue: asyncio.Queue = asyncio.Queue()
        ids: list[int] = []
        reason = "length"
        while len(ids) < params.max_tokens:
            allowed = [int(t) for t in allowed_ids(self.masks.build(1, [(0, matcher)], [])[0], self.vocab_size)]
            if matcher.is_stopped() or allowed == list(self.tokenizer.eos_token_ids):
                reason = "stop"
                break
            weights = [50 if set(self.tokenizer.decode([t])) & STRUCTURAL else 1 for t in allowed]
            tok = rng.choices(allowed, weights)[0]
            assert matcher.consume_token(tok)
            before = self.tokenizer.decode(ids)
            ids.append(tok)
            queue.put_nowait(RequestOutput(request_id, [tok], self.tokenizer.decode(ids)[len(before):],
                                           completion_tokens=len(ids)))
        queue.put_nowait(RequestOutput(request_id, [], "", finished=True, finish_reason=reason,
                                       completion_tokens=len(ids), prompt_tokens=len(prompt_ids)))
        return request_id, queue


def _client(template: str, architecture: str) -> tuple[TestClient, GuidedStubEngine]:
    tok_json, _ = tiny_tokenizer_json()
    tok = TextTokenizer(Tokenizer.from_str(tok_json), (TEMPLATES / f"{template}.jinja").read_text(),
                        eos_token_ids=(0,), architecture=architecture)
    engine = GuidedStubEngine(tok)
    settings = ServerSettings(model_name="stub", admin_token="admin-secret", api_key="api-secret")
    return TestClient(create_app(settings, engine=engine)), engine


def _chat(c: TestClient, **kw) -> dict:
    body = {"model": "stub", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, **kw}
    r = c.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(c: TestClient, **kw) -> list[dict]:
    body = {"model": "stub", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "stream": True, **kw}
    with c.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize("template, arch, shape", [
    ("qwen2.5-instruct", "qwen2", "<tool_call>\n{"),     # hermes
    ("llama-3.1-instruct", "llama", '{"name": '),         # llama3_json: the whole answer
    ("mistral-7b-instruct-v0.3", "llama", '[{"name": '),  # mistral: a list
    ("smollm2-instruct", "llama", "<tool_call>{"),        # generic
])
def test_forced_calls_per_family(template, arch, shape):
    c, engine = _client(template, arch)
    with c:
        named = {"type": "function", "function": {"name": "get_weather"}}
        for seed in range(6):
            r = _chat(c, tool_choice=named, seed=seed, max_tokens=200)
            (choice,) = r["choices"]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            (call,) = choice["message"]["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == "get_weather" and "city" in args and set(args) <= {"city", "unit"}
        if template != "smollm2-instruct":  # the template itself listed the tools
            assert "Current weather" in engine.prompts[-1] and "You can call tools" not in engine.prompts[-1]
        # required: one call of either tool, streamed as one tool-call delta and no content
        chunks = _stream(c, tool_choice="required", seed=3, max_tokens=200)
        assert not any(ch["choices"][0]["delta"].get("content") for ch in chunks if ch["choices"])
        (delta,) = [tc for ch in chunks if ch["choices"] for tc in ch["choices"][0]["delta"].get("tool_calls") or []]
        assert delta["function"]["name"] in ("get_weather", "get_time")
        json.loads(delta["function"]["arguments"])
        assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]] == \
            ["tool_calls"]


@pytest.mark.parametrize("template, arch", [("qwen2.5-instruct", "qwen2"), ("llama-3.1-instruct", "llama")])
def test_forced_call_cut_by_max_tokens_is_a_tool_call_with_finish_reason_length(template, arch):
    c, _ = _client(template, arch)
    named = {"type": "function", "function": {"name": "get_weather"}}
    with c:
        full = _chat(c, tool_choice=named, seed=1, max_tokens=200)["choices"][0]["message"]["tool_calls"][0]
        for n in (3, 30, 55):  # cut before the name, inside it, inside the arguments
            (choice,) = _chat(c, tool_choice=named, seed=1, max_tokens=n)["choices"]
            assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            # the arguments as far as they were generated: a prefix of the whole call's
            partial = call["function"]["arguments"]
            assert len(partial) < len(full["function"]["arguments"])
            assert full["function"]["arguments"].startswith(partial) and (partial != "") == (n == 55)
            chunks = _stream(c, tool_choice=named, seed=1, max_tokens=n)
            (delta,) = [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls") or []]
            assert delta["function"]["arguments"] == partial
            assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]] == \
                ["length"]
