"""LoRA adapters through a real `pagedjax serve`: --lora-modules at start, /v1/models with each
adapter's parent, a request naming an adapter as its model (transformers + peft's tokens), 404
for an unknown one, and the runtime load/unload routes: operator-only once API keys are on,
audited, a bad file refused with the problem named and nothing half-loaded."""

from __future__ import annotations

import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.store import convert
from tests.console.server_util import start_server
from tests.runtime.test_families_config import PROMPT, build_hf

peft = pytest.importorskip("peft", reason="peft not installed (pip install -e .[peer])")
from tests.runtime.test_lora import N, build_adapter, peft_greedy  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_api")
    src = build_hf(tmp / "hf", "llama")
    convert(HFSource(src), tmp / "ck", progress=False)
    a0 = build_adapter(src, tmp / "a0", 1)
    a1 = build_adapter(src, tmp / "a1", 2, r=4, targets=["q_proj", "v_proj", "down_proj"])
    with start_server(tmp / "ck", "--lora-modules", f"tenant-a={a0}", "--max-loras", "2",
                      "--max-model-len", "256") as srv:
        yield srv, src, a0, a1, tmp


def complete(srv, model: str, prompt=PROMPT) -> tuple[int, dict]:
    with srv.client() as c:
        r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0,
                                            "ignore_eos": True})
    return r.status_code, r.json()


def text_of(srv, ids: list[int]) -> str:
    """The text of these token ids as a completion ends it (a trailing partial UTF-8 character is
    not emitted; the tiny byte tokenizer makes many)."""
    with srv.client() as c:
        return c.post("/detokenize", json={"tokens": ids}).json()["prompt"].rstrip("\ufffd")


def test_adapter_from_the_command_line_is_listed_and_served(served):
    srv, src, a0, _, _ = served
    with srv.client() as c:
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert set(models) == {srv.model, "tenant-a"}
    assert models["tenant-a"]["parent"] == srv.model and models["tenant-a"]["root"] == str(a0)
    assert models[srv.model].get("parent") is None
    code, body = complete(srv, "tenant-a")
    assert code == 200 and body["model"] == "tenant-a"
    assert body["choices"][0]["text"] == text_of(srv, peft_greedy(src, a0, PROMPT))
    code, base = complete(srv, srv.model)
    assert base["choices"][0]["text"] == text_of(srv, peft_greedy(src, None, PROMPT))
    assert srv.metric("pagedjax:lora_requests_total", adapter="tenant-a") == 1
    assert srv.metric("pagedjax:lora_generation_tokens_total", adapter="tenant-a") == N
    assert srv.metric("vllm:lora_requests_info", max_lora="2", running_lora_adapters="",
                      waiting_lora_adapters="") is not None
    code, err = complete(srv, "tenant-zz")
    assert code == 404 and err["error"]["code"] == "model_not_found" and "'tenant-zz' does not exist" in err["error"]["message"]


def test_runtime_load_and_unload_are_operator_only_and_audited(served):
    srv, src, a0, a1, tmp = served
    body = {"lora_name": "tenant-b", "lora_path": str(a1)}
    with srv.client() as c:  # an API key is not enough once keys are on
        r = c.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "operator_required"
    import httpx

    op = {"Authorization": f"Bearer {srv.admin_token}"}
    bad = tmp / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": true}')
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}, headers=op)
    assert r.status_code == 400 and "no adapter_model.safetensors" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=op)
    assert r.status_code == 200 and "tenant-b" in r.text
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=op)
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    with srv.client() as c:
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {srv.model, "tenant-a", "tenant-b"}
    code, out = complete(srv, "tenant-b")
    assert out["choices"][0]["text"] == text_of(srv, peft_greedy(src, a1, PROMPT))
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "tenant-b"}, headers=op)
    assert r.status_code == 200
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "tenant-b"}, headers=op)
    assert r.status_code == 404
    assert complete(srv, "tenant-b")[0] == 404
    from console.state import StateStore

    rows = [(a.who, a.action, a.detail.get("name")) for a in StateStore(srv.state_dir / "state.db").iter_audit()
            if a.action.endswith("_lora")]
    assert rows == [("admin", "load_lora", "tenant-b"), ("admin", "unload_lora", "tenant-b")]
