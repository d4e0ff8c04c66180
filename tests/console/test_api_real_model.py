"""The basics on the real default model (SmolLM2-135M-Instruct), served with no --checkpoint."""

from __future__ import annotations

import pytest

from tests.console.server_util import ServerHandle, start_server

pytestmark = pytest.mark.real_model


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
    assert r.usage.prompt_tokens > 5 and r.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: prefix-cache hit


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
