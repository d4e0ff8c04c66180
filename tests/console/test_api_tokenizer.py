"""/tokenize and /detokenize (vLLM's shapes) and chat messages without content, in process
on a tiny model."""

from __future__ import annotations

import pytest

from tests.console.admin_util import API_KEY, console_client
from tests.engine_util import make_engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    engine = make_engine(tiny_ckpt)
    with console_client(engine) as c:
        c.engine = engine
        yield c


def test_tokenize_a_prompt_and_back(client):
    tok = client.engine.tokenizer
    r = client.post("/tokenize", json={"model": "tiny", "prompt": "hello there", "return_token_strs": True},
                    headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == client.engine.envelope.max_model_len
    assert "".join(body["token_strs"]) == tok.decode(body["tokens"], skip_special_tokens=False)
    r = client.post("/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": "hello there"}


def test_tokenize_messages_with_the_chat_template(client):
    tok = client.engine.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.post("/tokenize", json={"messages": msgs}, headers=AUTH)
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    r = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}, headers=AUTH)
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
])
def test_tokenize_bad_input_is_400_naming_the_field(client, body, param):
    r = client.post("/tokenize", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_unknown_model_is_404(client):
    r = client.post("/tokenize", json={"prompt": "x", "model": "other"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"


def test_detokenize_refuses_ids_outside_the_vocabulary_and_needs_the_key(client):
    r = client.post("/detokenize", json={"tokens": [10**6]}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401


def test_chat_message_without_content_is_rejected_before_anything_is_queued(client):
    r = client.post("/v1/chat/completions", headers=AUTH,
                    json={"model": "tiny", "messages": [{"role": "system", "content": "x"}, {"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content"
    assert not client.engine.has_unfinished()


def test_tokenizer_info_gives_what_a_remote_tokenizer_needs(client):
    """lm-evaluation-harness's remote tokenizer reads eos/bos/pad and the chat template here,
    then encodes the eos text with /tokenize to find its id."""
    r = client.get("/tokenizer_info", headers=AUTH)
    assert r.status_code == 200, r.text
    info = r.json()
    tok = client.engine.tokenizer
    assert info["chat_template"] == tok.chat.source and info["model_max_length"] > 0
    ids = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                      headers=AUTH).json()["tokens"]
    assert ids == [tok.eos_token_ids[0]]
    assert client.get("/tokenizer_info").status_code == 401
