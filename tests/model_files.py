"""Write tiny models in foreign formats (GGUF, Hugging Face safetensors) from our params,
so the converters can be round-tripped in tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.config import ModelConfig


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert permutation (rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, cfg: ModelConfig, params: dict, tokenizer_json: str, qtype: str = "F32",
               arch: str = "llama", chat_template: str | None = None) -> Path:
    import gguf
    from gguf.quants import quantize

    tok = json.loads(tokenizer_json)
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in tok.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_bos_token_id(cfg.bos_token_id or 0)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    if chat_template:
        w.add_chat_template(chat_template)
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name: str, a: np.ndarray, quant: bool = True) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if quant and qtype != "F32" and a.ndim == 2:
            if qtype == "F16":
                w.add_tensor(name, a.astype(np.float16))
            else:
                w.add_tensor(name, quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)

    add("token_embd.weight", params["embed"])
    add("output_norm.weight", params["final_norm"], quant=False)
    lp = params["layers"]
    for i in range(cfg.num_layers):
        add(f"blk.{i}.attn_norm.weight", lp["attn_norm"][i], quant=False)
        add(f"blk.{i}.attn_q.weight", permute_rows(lp["wq"][i].T, cfg.num_heads))
        add(f"blk.{i}.attn_k.weight", permute_rows(lp["wk"][i].T, cfg.num_kv_heads))
        add(f"blk.{i}.attn_v.weight", lp["wv"][i].T)
        add(f"blk.{i}.attn_output.weight", lp["wo"][i].T)
        add(f"blk.{i}.ffn_norm.weight", lp["mlp_norm"][i], quant=False)
        add(f"blk.{i}.ffn_gate.weight", lp["w_gate"][i].T)
        add(f"blk.{i}.ffn_up.weight", lp["w_up"][i].T)
        add(f"blk.{i}.ffn_down.weight", lp["w_down"][i].T)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf_dir(out: Path, cfg: ModelConfig, params: dict, tokenizer_json: str, chat_template: str | None = None,
                 shards: int = 1, dtype: str = "F32") -> Path:
    """A Hugging Face Llama directory (config.json, safetensors (sharded + index), tokenizer)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    lp = params["layers"]
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    proj = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
            "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i in range(cfg.num_layers):
        for k, v in names.items():
            tensors[f"model.layers.{i}.{v}.weight"] = lp[k][i]
        for k, v in proj.items():
            tensors[f"model.layers.{i}.{v}.weight"] = lp[k][i].T
    np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
    tensors = {k: np.ascontiguousarray(v, dtype=np_dtype) for k, v in tensors.items()}
    keys = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[s::shards]}
            save_file(part, str(out / fname))
            weight_map.update({k: fname for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf_cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
              "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
              "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    (out / "config.json").write_text(json.dumps(hf_cfg))
    (out / "tokenizer.json").write_text(tokenizer_json)
    if chat_template:
        (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return out


def write_hf_config_dir(d: Path, config: dict, tokenizer_json: str, **changes) -> Path:
    """A Hugging Face model directory holding only `config` (plus `changes`; a key set to None
    is dropped), an empty weights file and the tokenizer: what `convert` opens before it reads
    any weight (the refusal tests' input)."""
    c = dict(config)
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text(tokenizer_json)
    return d
