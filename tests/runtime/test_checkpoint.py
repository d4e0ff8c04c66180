import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint.gguf_source import GGUFSource
from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.store import convert, load_checkpoint, read_meta, write_checkpoint
from runtime.cli import main
from runtime.model.families.llama import Llama, dense_logits, init_params
from tests.model_files import write_gguf, write_hf_dir
from tests.tiny import CHAT_TEMPLATE, tiny_config, tiny_tokenizer_json

TOKENS = jnp.array([5, 17, 200, 3, 99, 42, 7, 150], dtype=jnp.int32)


@pytest.fixture(scope="module")
def tiny():
    tok_json, vocab = tiny_tokenizer_json()
    cfg = tiny_config(vocab)
    return cfg, init_params(cfg, seed=3), tok_json


def logits(cfg, params):
    return np.asarray(dense_logits(cfg, params, TOKENS))


def test_save_load_round_trip_identical_logits(tmp_path, tiny):
    cfg, params, tok_json = tiny
    write_checkpoint(tmp_path / "ck", cfg, params, tok_json, CHAT_TEMPLATE)
    cfg2, params2, tok = load_checkpoint(tmp_path / "ck")
    assert cfg2 == cfg
    np.testing.assert_array_equal(logits(cfg2, params2), logits(cfg, params))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_nnx_module_matches_pure_forward(tiny):
    cfg, params, _ = tiny
    model = Llama(cfg, params)
    np.testing.assert_allclose(np.asarray(model(TOKENS)), logits(cfg, params), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_safetensors_conversion(tmp_path, tiny, shards):
    cfg, params, tok_json = tiny
    src = write_hf_dir(tmp_path / "hf", cfg, params, tok_json, CHAT_TEMPLATE, shards=shards)
    convert(HFSource(src), tmp_path / "out", progress=False)
    cfg2, params2, tok = load_checkpoint(tmp_path / "out")
    np.testing.assert_allclose(logits(cfg2, params2), logits(cfg, params), rtol=1e-6, atol=1e-5)
    assert tok.chat is not None


@pytest.mark.parametrize("qtype,tol", [("F32", 1e-5), ("F16", 2e-2), ("Q8_0", 0.15)])
def test_gguf_conversion_undoes_rotary_permutation(tmp_path, tiny, qtype, tol):
    cfg, params, tok_json = tiny
    src = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json, qtype=qtype, chat_template=CHAT_TEMPLATE)
    convert(GGUFSource(src), tmp_path / "out", progress=False)
    cfg2, params2, tok = load_checkpoint(tmp_path / "out")
    want, got = logits(cfg, params), logits(cfg2, params2)
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.85
    assert tok.encode("hello the world") == load_checkpoint(tmp_path / "out")[2].encode("hello the world")


def test_bfloat16_conversion(tmp_path, tiny):
    cfg, params, tok_json = tiny
    src = write_hf_dir(tmp_path / "hf", cfg, params, tok_json)
    assert main(["convert", "--from", "hf", str(src), "--out", str(tmp_path / "bf"), "--dtype", "bfloat16"]) == 0
    _, p2, _ = load_checkpoint(tmp_path / "bf")
    assert p2["embed"].dtype == jnp.bfloat16


# --- bad input: one line, exit code 2, nothing half-written -------------------------------

def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def test_missing_path(tmp_path, capsys):
    code, err = run_cli(capsys, "convert", "--from", "gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"))
    assert code == 2 and "no such file" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_inspect_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    code, err = run_cli(capsys, "inspect", str(tmp_path / "d"))
    assert code == 2 and "not a pagedjax checkpoint" in err
    code, err = run_cli(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 2 and "no such checkpoint" in err


def test_truncated_gguf(tmp_path, tiny, capsys):
    cfg, params, tok_json = tiny
    src = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])
    code, err = run_cli(capsys, "convert", "--from", "gguf", str(src), "--out", str(tmp_path / "o"))
    assert code == 2 and "truncated" in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_not_a_gguf(tmp_path, capsys):
    (tmp_path / "x.gguf").write_bytes(b"hello world" * 10)
    code, err = run_cli(capsys, "convert", "--from", "gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o"))
    assert code == 2 and "not a GGUF file" in err


def test_corrupt_safetensors(tmp_path, tiny, capsys):
    cfg, params, tok_json = tiny
    src = write_hf_dir(tmp_path / "hf", cfg, params, tok_json)
    st = src / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    code, err = run_cli(capsys, "convert", "--from", "hf", str(src), "--out", str(tmp_path / "o"))
    assert code == 2 and "truncated" in err and not (tmp_path / "o").exists()


def test_unsupported_architecture(tmp_path, tiny, capsys):
    cfg, params, tok_json = tiny
    src = write_hf_dir(tmp_path / "hf", cfg, params, tok_json)
    c = json.loads((src / "config.json").read_text())
    c["architectures"] = ["MambaForCausalLM"]
    (src / "config.json").write_text(json.dumps(c))
    code, err = run_cli(capsys, "convert", "--from", "hf", str(src), "--out", str(tmp_path / "o"))
    assert code == 2 and "unsupported architecture 'MambaForCausalLM'" in err
    g = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json, arch="mamba")
    code, err = run_cli(capsys, "convert", "--from", "gguf", str(g), "--out", str(tmp_path / "o"))
    assert code == 2 and "unsupported architecture 'mamba'" in err


def test_unsupported_tensor_type(tmp_path, tiny, capsys):
    cfg, params, tok_json = tiny
    g = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json, qtype="MXFP4")  # Q5_0 is now supported
    code, err = run_cli(capsys, "convert", "--from", "gguf", str(g), "--out", str(tmp_path / "o"))
    assert code == 2 and "unsupported type MXFP4" in err


def test_out_exists_needs_force(tmp_path, tiny, capsys):
    cfg, params, tok_json = tiny
    src = write_hf_dir(tmp_path / "hf", cfg, params, tok_json)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    code, err = run_cli(capsys, "convert", "--from", "hf", str(src), "--out", str(tmp_path / "o"))
    assert code == 2 and "already exists" in err and (tmp_path / "o" / "keep").exists()
    code, _ = run_cli(capsys, "convert", "--from", "hf", str(src), "--out", str(tmp_path / "o"), "--force")
    assert code == 0 and not (tmp_path / "o" / "keep").exists() and (tmp_path / "o" / "config.json").exists()


def test_inspect_prints_sizes(tmp_path, tiny, capsys):
    cfg, params, tok_json = tiny
    write_checkpoint(tmp_path / "ck", cfg, params, tok_json, None)
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    per_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert re.search(r"heads / KV heads +4 / 2 \(GQA 2:1\)", out)
    assert f"{per_tok:,}" in out and f"{per_tok * 1000:,}" in out
    assert f"{cfg.param_count():,}" in out


def test_inspect_a_gguf_file_states_how_each_type_loads(tmp_path, tiny, capsys):
    cfg, params, tok_json = tiny
    src = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json, qtype="Q8_0", chat_template=CHAT_TEMPLATE)
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "tensor types" in out and re.search(r"Q8_0 x\d+", out)
    assert re.search(r"Q8_0 +int8 values and block scales kept as they are by --quantize w8a8", out)
    src = write_gguf(tmp_path / "m4.gguf", cfg, params, tok_json, qtype="Q4_0", chat_template=CHAT_TEMPLATE)
    assert main(["inspect", str(src)]) == 0
    assert re.search(r"Q4_0 +4-bit values, block scales and offsets kept as they are by --quantize w4a16",
                     capsys.readouterr().out)


def test_convert_gguf_with_quantize_stores_int8(tmp_path, tiny):
    """Projections that are not Q8_0 (here Q4_0) are dequantized, then SmoothQuant-requantized
    (w8a8's own scheme: a scale per 32 inputs, the smoothing folded, no input scale left)."""
    cfg, params, tok_json = tiny
    src = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json, qtype="Q4_0", chat_template=CHAT_TEMPLATE)
    assert main(["convert", "--from", "gguf", str(src), "--out", str(tmp_path / "q"), "--quantize", "w8a8"]) == 0
    _, qp, _ = load_checkpoint(tmp_path / "q")
    assert qp["layers"]["w_down"]["q"].dtype == jnp.int8 and "in" not in qp["layers"]["w_down"]
    assert qp["layers"]["w_down"]["g"].shape[-2] == cfg.intermediate_size // 32
    assert read_meta(tmp_path / "q")["group_size"] == 32 and not read_meta(tmp_path / "q")["exact_q8_0"]


def test_convert_q8_0_gguf_keeps_its_int8_values_and_block_scales(tmp_path, tiny, capsys):
    """--quantize w8a8 of an all-Q8_0 GGUF stores llama.cpp's own values and block scales:
    values x scales equal the float conversion of the same file bit for bit (no float round
    trip, no requantizing), the int8 head too, and inspect says so."""
    from runtime.checkpoint.store import read_meta

    cfg, params, tok_json = tiny
    src = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json, qtype="Q8_0", chat_template=CHAT_TEMPLATE)
    assert main(["convert", "--from", "gguf", str(src), "--out", str(tmp_path / "f")]) == 0
    assert main(["convert", "--from", "gguf", str(src), "--out", str(tmp_path / "q"), "--quantize", "w8a8",
                 "--quantize-lm-head"]) == 0
    assert read_meta(tmp_path / "q")["group_size"] == 32
    _, fp, _ = load_checkpoint(tmp_path / "f")
    _, qp, _ = load_checkpoint(tmp_path / "q")
    for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = qp["layers"][k]
        assert set(w) == {"q", "g"} and w["q"].dtype == jnp.int8
        L, K, N = w["q"].shape
        assert w["g"].shape == (L, K // 32, N)
        deq = np.asarray(w["q"], np.float32).reshape(L, K // 32, 32, N) * np.asarray(w["g"])[:, :, None, :]
        np.testing.assert_array_equal(deq.reshape(L, K, N), np.asarray(fp["layers"][k]))
    # no smoothing folded into the norms
    np.testing.assert_array_equal(np.asarray(qp["layers"]["attn_norm"]), np.asarray(fp["layers"]["attn_norm"]))
    head = qp["head"]
    deq = np.asarray(head["q"], np.float32).reshape(-1, 32, cfg.vocab_size) * np.asarray(head["g"])[:, None, :]
    np.testing.assert_array_equal(deq.reshape(cfg.hidden_size, -1), np.asarray(fp["embed"]).T)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "q")]) == 0
    assert "int8 decoder weights (a GGUF's Q8_0 blocks, exact), a float32 scale per 32 inputs" in capsys.readouterr().out
    assert main(["convert", "--from", "gguf", str(src), "--out", str(tmp_path / "b"), "--quantize", "w8a8",
                 "--dtype", "bfloat16"]) == 2
