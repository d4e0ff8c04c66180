"""End to end with the official openai client against a real `pagedjax serve` (tiny model)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.console.server_util import ServerHandle, start_server

REPEAT = "the the the"  # the tiny model continues this greedily with printable text
BLOCK = 16  # the server's --block-size (its default)


@pytest.fixture(scope="module")
def server(tiny_ckpt) -> ServerHandle:
    with start_server(tiny_ckpt) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def test_health_models_schema(server, client):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    schema = httpx.get(server.url + "/schema/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])


def test_completion_non_streaming(client, server):
    r = client.completions.create(model=server.model, prompt=REPEAT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text.startswith(" the")
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    # Shorter than one block: the prefix cache only serves whole blocks, so nothing is cached
    # however often the prompt has been seen.
    assert r.usage.prompt_tokens < BLOCK and r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_streaming_matches_non_streaming(client, server):
    kw = dict(model=server.model, prompt=REPEAT, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0  # the same sub-block prompt: never cached
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): each chunk carries the
    usage so far, completion tokens never going down, the last equal to the final usage chunk;
    without include_usage it adds nothing."""
    import json

    def chunks(options):
        body = {"model": server.model, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 6,
                "stream": True, "ignore_eos": True, "stream_options": options}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers,
                          timeout=60) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    got = chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c["usage"] is not None for c in got)
    done = [c["usage"]["completion_tokens"] for c in got]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 6
    assert got[-1]["choices"] == [] and got[-2]["usage"] == got[-1]["usage"]
    assert all(c["usage"]["prompt_tokens"] == got[-1]["usage"]["prompt_tokens"] > 0 for c in got)
    assert all(c.get("usage") is None for c in chunks({"continuous_usage_stats": True}))


def test_raw_sse_framing(server):
    body = {"model": server.model, "prompt": REPEAT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]


def test_chat_streaming_and_not(client, server):
    kw = dict(model=server.model, messages=[{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hello"}], temperature=0)
    r = client.chat.completions.create(max_tokens=8, **kw)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(max_completion_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n2(client, server):
    r = client.completions.create(model=server.model, prompt=REPEAT, max_tokens=6, n=2, seed=5,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, n=2, stream=True))
    done = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert done == {0, 1}


def test_stop_strings(client, server):
    kw = dict(model=server.model, prompt=REPEAT, max_tokens=40, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[9:13]  # something the greedy continuation really contains
    assert stop.strip()
    cut = full[:full.index(stop)]
    r = client.completions.create(stop=[stop, "never-seen"], **kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_repeats(client, server):
    kw = dict(model=server.model, prompt=REPEAT, max_tokens=24, temperature=1.0, logprobs=1)
    a = client.completions.create(seed=1234, **kw).choices[0]
    b = client.completions.create(seed=1234, **kw).choices[0]
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens
    msgs = [{"role": "user", "content": "tell me"}]
    c1 = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=10, seed=7, temperature=1.5)
    c2 = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=10, seed=7, temperature=1.5)
    assert c1.choices[0].message.content == c2.choices[0].message.content


def test_logprobs(client, server):
    r = client.completions.create(model=server.model, prompt=REPEAT, max_tokens=5, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    c = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    chunks = list(client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, logprobs=True, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 4


def test_prompt_forms_and_echo(client, server):
    tokens = list(REPEAT.encode())[:4]  # byte-level vocabulary: any small ids are valid
    r = client.completions.create(model=server.model, prompt=["a", "b c"], max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert client.completions.create(model=server.model, prompt=tokens, max_tokens=3).usage.prompt_tokens == 4
    r = client.completions.create(model=server.model, prompt=[tokens, tokens[:2]], max_tokens=3)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 6
    r = client.completions.create(model=server.model, prompt=REPEAT, max_tokens=3, echo=True, temperature=0)
    assert r.choices[0].text.startswith(REPEAT)


def test_prefix_cache_reported(client, server):
    # A first block no other test sends, so the first request finds nothing cached.
    prompt = "prefix-cache-probe " + "the " * 40  # several full 16-token blocks
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    # Every whole block before the last prompt token (whose logits must be computed) is a hit.
    n = r.usage.prompt_tokens
    assert n > 2 * BLOCK and r.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK


def test_api_key_required(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # open
    assert httpx.get(server.url + "/metrics").status_code == 200  # open
    # the admin token is not an API key
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {server.admin_token}"})
    assert r.status_code == 401


def test_metrics_and_access_log(client, server):
    r = httpx.post(server.url + "/v1/completions", headers={**server.headers, "X-Request-Id": "trace-me-1"},
                   json={"model": server.model, "prompt": REPEAT, "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-1"
    assert server.metric("pagedjax:http_requests_total", route="/v1/completions", method="POST", status="200") >= 1
    assert server.wait_metric("pagedjax:kv_blocks", 0, state="used") == 0
    text = httpx.get(server.url + "/metrics").text
    assert "pagedjax:http_request_duration_seconds_bucket" in text and "pagedjax:generation_tokens_total" in text
    rec = server.access_record("trace-me-1")
    assert rec["route"] == "/v1/completions" and rec["status"] == 200
    assert rec["completion_tokens"] == 3 and rec["prompt_tokens"] > 0 and rec["cached_tokens"] is not None
    assert rec["ttft_s"] is not None and rec["total_s"] >= rec["ttft_s"]
