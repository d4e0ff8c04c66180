"""The default model (SmolLM2) behind `pagedjax fleet serve`. Its own file, so the test
runner can run it beside the tiny-model fleet module (tests/fleet/test_fleet_ray.py):
each starts its own local Ray instance (Serve's HTTP proxy is off, so they share nothing)."""

from __future__ import annotations

import pytest

from tests.console.server_util import start_server

pytest.importorskip("ray.serve")

pytestmark = pytest.mark.fleet


@pytest.mark.real_model
def test_smollm2_through_the_fleet_with_the_openai_client(smollm2_ckpt):
    """The default model behind the fleet (gateway -> router -> Ray Serve replica), the
    official client, streaming and not; the second chat with the same system prompt hits
    the cache. One replica on both cores with test_api_real_model's envelope, so its step
    programs come from the compilation cache (routing between replicas: the tests above)."""
    with start_server(None, "--replicas", "1", "--threads-per-replica", "2", "--kv-cache-memory", "64MiB",
                      subcommand=("fleet", "serve"), env={"RAY_ADDRESS": ""}, ready_timeout=600) as srv:
        client = srv.openai(timeout=300)
        msgs = [{"role": "system", "content": "You are a geography teacher. Answer in one short sentence. " * 4},
                {"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
        chunks = list(client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=24, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16 * 4
        assert [m.id for m in client.models.list().data] == [srv.model]
        # Structured outputs compile on the replica: a constrained answer, and a bad regex as a 400.
        r = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
        assert r.choices[0].message.content == "Paris"
        bad = srv.client().post("/v1/chat/completions", json={"model": srv.model, "messages": msgs, "max_tokens": 4,
                                                              "structured_outputs": {"regex": "a(b"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs.regex", bad.text


@pytest.mark.real_model
def test_smollm2_through_one_prefill_and_one_decode_replica_equals_one_engine(smollm2_ckpt):
    """Disaggregated: 1 prefill + 1 decode replica of SmolLM2 (the KV of two full prompt
    blocks crosses Ray's object store per request); greedy and seeded completions equal an
    in-process engine built from the same flags, and the decode side served the prompt
    blocks from what it imported."""
    import argparse

    import numpy as np

    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import add_engine_arguments, engine_config_from_args
    from runtime.model.sampling import SamplingParams
    from tests.console.server_util import SMALL_ENVELOPE

    flags = ["--kv-cache-memory", "64MiB"]
    p = argparse.ArgumentParser()
    add_engine_arguments(p, serving=True)
    envelope = [x for k, v in SMALL_ENVELOPE.items() if k not in flags for x in (k, v)]
    ref = LLMEngine.from_checkpoint(smollm2_ckpt, engine_config_from_args(p.parse_args(envelope + flags)),
                                    warmup=False, progress=False)
    rng = np.random.default_rng(11)
    # --no-warmup: each replica compiles just the two or three step shapes these requests use
    # (warm-up itself is the colocated test's and test_api_real_model's to check).
    with start_server(None, "--prefill-replicas", "1", "--decode-replicas", "1", "--threads-per-replica", "1",
                      "--no-warmup", *flags, subcommand=("fleet", "serve"), env={"RAY_ADDRESS": ""}, ready_timeout=600) as srv:
        for params in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=42)):
            ids = [int(t) for t in rng.integers(3, 20000, size=40)]
            r = srv.client(timeout=300).post("/v1/completions", json={"model": srv.model, "prompt": ids,
                                                                      "max_tokens": 10, "ignore_eos": True, **params})
            assert r.status_code == 200, r.text
            want = "".join(ref.generate_text(ids, SamplingParams(max_tokens=10, ignore_eos=True, **params)))
            assert r.json()["choices"][0]["text"] == want, params
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # imported, not recomputed
