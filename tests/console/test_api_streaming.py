"""Concurrency and disconnects against a real `pagedjax serve` (tiny model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.console.server_util import ServerHandle, start_server

ABORTS = ("pagedjax:request_success_total", {"finished_reason": "abort"})


@pytest.fixture(scope="module")
def server(tiny_ckpt) -> ServerHandle:
    # The whole context of the tiny model (1024): a request the disconnect tests cut short
    # runs ~1,000 steps, far longer than it takes the server to see the client leave.
    with start_server(tiny_ckpt, "--max-model-len", "1024") as srv:
        yield srv


def _aborts(server: ServerHandle) -> float:
    return server.metric(ABORTS[0], **ABORTS[1]) or 0.0


async def _stream_one(client: httpx.AsyncClient, server: ServerHandle, i: int) -> dict:
    chat = i % 2 == 0
    body = {"model": server.model, "max_tokens": 24, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"client {i}"}]
    else:
        body["prompt"] = f"the the the {i}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    payloads = [line[len("data: "):] for line in lines]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    return chunks[-1]["usage"]


def test_32_concurrent_streams(server):
    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
            return await asyncio.gather(*(_stream_one(client, server, i) for i in range(32)))

    usages = asyncio.run(main())
    assert len(usages) == 32
    assert server.wait_metric("pagedjax:kv_blocks", 0, state="used") == 0
    assert server.metric("pagedjax:num_requests_running") == 0


def test_streaming_disconnect_aborts(server):
    before = _aborts(server)
    body = {"model": server.model, "prompt": "the the the", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                break  # the first token arrived; leaving the block closes the connection mid-stream
    assert server.wait_metric(ABORTS[0], before + 1, **ABORTS[1]) == before + 1
    assert server.wait_metric("pagedjax:kv_blocks", 0, state="used") == 0


def test_non_streaming_disconnect_aborts(server):
    before = _aborts(server)
    body = {"model": server.model, "prompt": "the the the", "max_tokens": 480, "ignore_eos": True, "n": 8}
    headers = {**server.headers, "X-Request-Id": "hang-up-1"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(30, read=0.3))
    assert server.wait_metric(ABORTS[0], before + 8, **ABORTS[1]) == before + 8
    assert server.wait_metric("pagedjax:kv_blocks", 0, state="used") == 0
    assert server.access_record("hang-up-1")["status"] == 499
    # and the server is fine afterwards
    r = httpx.post(server.url + "/v1/completions", headers=server.headers,
                   json={"model": server.model, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200
