"""Tiny random-weight Llama models with a real byte-level tokenizer, written through the
same checkpoint path as converted models."""

from __future__ import annotations

from pathlib import Path

from runtime.checkpoint.store import write_checkpoint
from runtime.config import ModelConfig
from runtime.model.families import init_params
from runtime.tokenizer import build_byte_level_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tiny_tokenizer_json() -> tuple[str, int]:
    alphabet = byte_alphabet()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    return build_byte_level_bpe(tokens, merges, SPECIALS, "smollm").to_str(), len(tokens)


def tiny_config(vocab: int, **kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_ids=(2,),
                pad_token_id=0, name="tiny")
    base.update(kw)
    return ModelConfig(**base)


def make_tiny_checkpoint(out: Path, seed: int = 0, **cfg_kw) -> Path:
    tok_json, vocab = tiny_tokenizer_json()
    cfg = tiny_config(vocab, **cfg_kw)
    params = init_params(cfg, seed)
    # Larger logits make greedy choices decisive (no near-ties between paths).
    params["embed"] = params["embed"] * 4
    write_checkpoint(out, cfg, params, tok_json, CHAT_TEMPLATE, force=True)
    return out
