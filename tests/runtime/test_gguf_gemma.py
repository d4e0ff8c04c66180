"""GGUF general.architecture "gemma3": a tiny random Gemma 3 written as llama.cpp writes one
(norms stored as 1 + w, Q/K rows not permuted, a SentencePiece vocabulary without merges),
read back by GGUFSource and compared with transformers' own GGUF loader: config, weights,
logits and tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from runtime.checkpoint.gguf_source import GGUFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.config import ModelConfig
from runtime.model.families import init_params

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n", "\n\n", "  ", "   ", "<b>", "</b>"]
WORDS = ["the", "capital", "of", "France", "is", "Paris", "hello", "world", "def", "return", "code",
         "tokens", "spaces", "中文", "日本", "cat", "cats", "at", "he", "she"]
STRINGS = [
    "The capital of France is", "the capital of France is Paris.", "hello world", "  two leading spaces",
    "trailing  ", "a   run    of     spaces", "tabs\tand\nnewlines\n\n\nthree", "def f(x):\n    return x",
    "emoji 🎉🚀 fall back to bytes", "中文 and 日本語", "<b>bold</b> markup", "<bos>special<eos> tokens",
    "cats at the hat", "unknown ÆØÅ ĳ", "", " ", "\n", "x" * 40, "Hello World HELLO", "a\u00a0non-breaking space",
]


def vocabulary() -> tuple[list[str], list[int]]:
    """Control tokens, user-defined pieces, the 256 byte tokens, single characters, then
    longer pieces shortest first (the file order the merges are rebuilt from)."""
    tokens = SPECIALS + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [6] * 256
    chars = sorted(set("▁" + "".join(WORDS) + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:()"))
    longer = []
    for w in WORDS:
        for piece in ("▁" + w, w):
            longer += [piece[:k] for k in range(2, len(piece) + 1)]
    longer = sorted(dict.fromkeys(p for p in longer if p not in chars), key=len)
    tokens += chars + longer
    types += [1] * (len(chars) + len(longer))
    return tokens, types


def tiny_config(**kw) -> ModelConfig:
    tokens, _ = vocabulary()
    # head_dim 256: transformers' GGUF loader takes query_pre_attn_scalar from Gemma3TextConfig's
    # default (256), llama.cpp from head_dim; they agree only there (as on the real model)
    base = dict(architecture="gemma3", vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_layers=7,
                num_heads=2, num_kv_heads=1, head_dim=256, max_position_embeddings=256, rope_theta=1_000_000.0,
                rms_norm_eps=1e-6, bos_token_id=2, eos_token_ids=(1,), pad_token_id=0, add_bos_token=True,
                name="tiny gemma3", sliding_window=8, rope_local_theta=10000.0, query_pre_attn_scalar=256.0,
                hidden_activation="gelu_tanh",
                layer_types=("sliding_attention",) * 5 + ("full_attention", "sliding_attention"))
    return ModelConfig(**{**base, **kw})


def write_gemma3_gguf(path: Path, cfg: ModelConfig, params: dict, qtype: str = "F32",
                      extra: dict | None = None, merges: list[str] | None = None) -> Path:
    """As llama.cpp's convert_hf_to_gguf.py writes Gemma 3: our norms are already 1 + w."""
    from gguf.quants import quantize

    tokens, types = vocabulary()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if t != 1 else 0.0 for t in types])
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    for key, value in (extra or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32)
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype != "F32" and a.ndim == 2:
            w.add_tensor(name, quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)

    add("token_embd.weight", params["embed"])
    add("output_norm.weight", params["final_norm"])
    names = {"attn_norm": "attn_norm", "post_attn_norm": "post_attention_norm", "mlp_norm": "ffn_norm",
             "post_mlp_norm": "post_ffw_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
    mats = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
            "w_up": "ffn_up", "w_down": "ffn_down"}
    lp = params["layers"]
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            add(f"blk.{i}.{theirs}.weight", lp[ours][i])
        for ours, theirs in mats.items():
            add(f"blk.{i}.{theirs}.weight", lp[ours][i].T)  # [out, in], rows as they are (no permute)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config()
    params = init_params(cfg, seed=3)
    path = write_gemma3_gguf(tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf", cfg, params)
    return cfg, params, path


def test_config_as_llama_cpp_derives_it(tiny):
    cfg, _, path = tiny
    got = GGUFSource(path).model_config()
    assert np.float32(got.rms_norm_eps) == np.float32(cfg.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(got, rms_norm_eps=cfg.rms_norm_eps, name=cfg.name) == cfg
    # no window: every layer global (the embedding variant), no local RoPE base
    other = dataclasses.replace(cfg, sliding_window=None, layer_types=(), rope_local_theta=None)
    p = write_gemma3_gguf(path.with_name("nowindow.gguf"), other, init_params(other, 0))
    got = GGUFSource(p).model_config()
    assert got.layer_windows() == (0,) * cfg.num_layers and got.rope_local_theta is None


def test_62_layers_scale_queries_by_hidden_over_heads():
    from runtime.checkpoint.gguf_gemma import gemma3_layer_types, gemma3_query_scalar

    assert gemma3_query_scalar(62, 5376, 32, 128) == 168.0 and gemma3_query_scalar(26, 1152, 4, 256) == 256.0
    assert [i for i, t in enumerate(gemma3_layer_types(18, 512)) if t == "full_attention"] == [5, 11, 17]


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """The tiny GGUF through `convert`, as a pagedjax checkpoint: (config, params)."""
    from runtime.checkpoint.store import convert, load_config, load_params

    out = convert(GGUFSource(tiny[2]), tmp_path_factory.mktemp("ckpt") / "tiny", progress=False)
    cfg = load_config(out)
    return cfg, load_params(out, cfg, as_numpy=True)


def test_tensors_map_to_the_gemma_tree_unchanged(tiny, converted):
    cfg, params, path = tiny
    got = converted[1]
    assert set(got["layers"]) == set(params["layers"]) and "lm_head" not in got
    np.testing.assert_array_equal(got["embed"], params["embed"])
    for k, v in params["layers"].items():
        np.testing.assert_array_equal(got["layers"][k], v, err_msg=k)


@pytest.mark.parametrize("key,value", [("gemma3.attn_logit_softcapping", 50.0), ("gemma3.expert_count", 8)])
def test_an_unknown_gemma3_key_is_refused_by_name(tiny, tmp_path, key, value):
    cfg, params, _ = tiny
    path = write_gemma3_gguf(tmp_path / "m.gguf", cfg, params, extra={key: value})
    with pytest.raises(CheckpointError, match=f"unknown metadata '{key}'"):
        GGUFSource(path).model_config()


def test_softcap_local_rope_base_and_end_of_turn_are_read(tiny, tmp_path):
    cfg, params, _ = tiny
    path = write_gemma3_gguf(tmp_path / "m.gguf", cfg, params,
                             extra={"gemma3.final_logit_softcapping": 30.0, "gemma3.rope.freq_base_swa": 20000.0,
                                    "tokenizer.ggml.eot_token_id": 6})
    got = GGUFSource(path).model_config()
    assert got.final_logit_softcapping == 30.0 and got.rope_local_theta == 20000.0
    assert got.eos_token_ids == (1, 6)  # <eos>, then <end_of_turn>: llama.cpp stops at either


# --- against transformers' GGUF loader -------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tiny):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")
    torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[peer])")
    _, _, path = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tok, torch


def test_weights_equal_transformers_plus_one_on_norms(tiny, hf):
    """transformers subtracts the 1 llama.cpp added to Gemma's norms; its q/k rows are ours."""
    cfg, params, _ = tiny
    sd = {k: v.numpy() for k, v in hf[0].state_dict().items()}
    lp = params["layers"]
    for i in (0, 5):
        pre = f"model.layers.{i}."
        np.testing.assert_allclose(sd[pre + "input_layernorm.weight"] + 1, lp["attn_norm"][i], rtol=0, atol=1e-6)
        np.testing.assert_allclose(sd[pre + "post_feedforward_layernorm.weight"] + 1, lp["post_mlp_norm"][i], atol=1e-6)
        np.testing.assert_allclose(sd[pre + "self_attn.q_norm.weight"] + 1, lp["q_norm"][i], atol=1e-6)
        np.testing.assert_array_equal(sd[pre + "self_attn.q_proj.weight"], lp["wq"][i].T)
        np.testing.assert_array_equal(sd[pre + "self_attn.k_proj.weight"], lp["wk"][i].T)
    cfg_hf = hf[0].config
    assert list(cfg_hf.layer_types) == list(cfg.layer_types) and cfg_hf.sliding_window == cfg.sliding_window


def test_logits_equal_transformers(converted, hf):
    import jax.numpy as jnp

    from runtime.model.families import dense_logits

    cfg, params = converted
    model, _, torch = hf
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 24)  # 24 > the window of 8
    mine = np.asarray(dense_logits(cfg, params, jnp.asarray(ids)))
    with torch.no_grad():
        theirs = model(torch.tensor([ids.tolist()])).logits[0].numpy()
    assert np.abs(mine - theirs).max() < 1e-3


def test_tokenizer_equals_transformers(tiny, hf):
    from tokenizers import Tokenizer

    from runtime.tokenizer import TextTokenizer

    cfg, _, path = tiny
    tok = TextTokenizer(Tokenizer.from_str(GGUFSource(path).tokenizer_json()), None, cfg.bos_token_id,
                        cfg.eos_token_ids, cfg.add_bos_token)
    htok = hf[1]
    for s in STRINGS:
        ids = tok.encode(s)
        assert ids == htok(s)["input_ids"], s  # BOS first, as transformers adds it
        assert ids[0] == cfg.bos_token_id
        assert tok.decode(ids, skip_special_tokens=False) == htok.decode(ids, skip_special_tokens=False), s
        assert tok.decode(ids) == htok.decode(ids, skip_special_tokens=True), s
    assert tok.decode(tok.encode("hello  world\n\nthe cats")) == "hello  world\n\nthe cats"
    assert len(tok.encode("🎉")) == 1 + 4  # BOS, then four byte tokens


def test_a_sentencepiece_vocabulary_is_refused_outside_gemma(tiny):
    """llama-architecture SentencePiece files (prefix space, merges by score) are read
    differently; they are refused rather than tokenized the Gemma way."""
    src = GGUFSource(tiny[2])
    src.arch = "llama"
    with pytest.raises(CheckpointError, match=r"tokenizer type 'llama' is not supported for llama"):
        src.tokenizer_json()


def test_merges_the_file_carries_are_used(tiny, tmp_path):
    """A file with merges (none of Gemma's has them; transformers would use them): the same
    merges as rebuilt, written out, tokenize alike; only the first few, into more pieces."""
    from tokenizers import Tokenizer

    from runtime.checkpoint.gguf_tokenizer import merges_by_position, respell

    cfg, params, path = tiny
    rebuilt = [f"{a} {b}" for a, b in merges_by_position(respell(vocabulary()[0]))]
    toks = [Tokenizer.from_str(GGUFSource(p).tokenizer_json()) for p in (
        path, write_gemma3_gguf(tmp_path / "m.gguf", cfg, params, merges=rebuilt),
        write_gemma3_gguf(tmp_path / "few.gguf", cfg, params, merges=rebuilt[:5]))]
    for s in STRINGS:
        assert toks[0].encode(s).ids == toks[1].encode(s).ids, s
    assert len(toks[2].encode("the capital").ids) > len(toks[0].encode("the capital").ids)
