"""Read a llama.cpp GGUF file: model config, dequantized tensors, tokenizer, chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from runtime.checkpoint.gguf_gemma import GEMMA3_KEYS, GEMMA3_RULES, gemma3_fields
from runtime.checkpoint.mapping import GGUF_ARCH_KEYS, GGUF_RULES, CheckpointError, ParamAssembler, Rule
from runtime.config import ModelConfig, RopeScaling

# Dequantized by the gguf package (gguf.quants), block for block as llama.cpp's ggml does.
SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
CONTROL_TOKEN = 3
ARCH_KEYS = GGUF_ARCH_KEYS  # (runtime/checkpoint/mapping.py says which and why)


# Architectures whose SentencePiece vocabulary ("llama" tokenizer model) is read the Gemma way
# (no prefix space, merges in file order: runtime/checkpoint/gguf_tokenizer.py).
SENTENCEPIECE_ARCHS = ("gemma3",)



def q8_0_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks (float16 d, then 32 int8) -> (values [n, 32] int8, scale [n] float32)."""
    b = raw.reshape(-1, 34)
    return b[:, 2:].copy().view(np.int8), b[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]


def _q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 blocks (float16 d, 16 bytes of nibbles: values 0-15, w = d (q - 8)) -> (values
    [n, 32] uint8, scale [n], offset [n]) with w = q scale + offset exactly (-8 d is exact)."""
    b = raw.reshape(-1, 18)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    return _nibbles(b[:, 2:]), d, np.float32(-8) * d


def _q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 blocks (float16 d, float16 m, 16 bytes of nibbles): w = d q + m."""
    b = raw.reshape(-1, 20)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    return _nibbles(b[:, 4:]), d, m


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks of 256 (float16 d and dmin, 12 bytes of 6-bit scales and mins, 128
    bytes of nibbles) -> 8 groups of 32 each: w = (d sc) q - dmin m, as gguf computes it."""
    from gguf.quants import Q4_K

    b = raw.reshape(-1, 144)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(15)).reshape(-1, 8, 32)  # [n, group, 32]: chunk j's low nibbles, then its high
    return q.reshape(-1, 32), (d * sc.astype(np.float32)).reshape(-1), -(dmin * mn.astype(np.float32)).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> its 32 values: the low nibbles are elements 0-15, the high 16-31."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


# GGUF 4-bit block types w4a16 serves exactly: raw bytes -> (values [n, 32], scale [n], offset [n])
Q4_BLOCKS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}

class GGUFSource:
    rules: tuple[Rule, ...] = GGUF_RULES

    def __init__(self, path: Path):
        import gguf

        if not path.is_file():
            raise CheckpointError(f"{path}: no such GGUF file")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file (bad magic)")
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # the reader raises several kinds on a short/garbled file
            raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from None
        self.path = path
        self.arch = self._str("general.architecture")
        if self.arch not in SUPPORTED_ARCHS:
            raise CheckpointError(f"{path}: unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.arch == "gemma3":
            self.rules = GEMMA3_RULES
        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name} "
                    f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})")

    # --- metadata ----------------------------------------------------------------
    def _field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _str(self, key: str) -> str:
        v = self._field(key)
        if v is None:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {key!r}")
        return str(v)

    def _arch(self, key: str, default: Any = None) -> Any:
        v = self._field(f"{self.arch}.{key}", default)
        if v is None:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {self.arch}.{key!r}")
        return v

    def _refuse(self, key: str, value: Any, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {key} {value!r} is not supported ({why})")

    def _rope(self, head_dim: int) -> RopeScaling | None:
        """llama.cpp's RoPE scaling: linear as rope.scaling.type (or the older rope.scale_linear),
        llama3 as the `rope_freqs.weight` tensor of per-frequency divisors."""
        a = self.arch
        for key in (f"{a}.rope.scaling.attn_factor",):
            v = self._field(key)
            if v is not None and float(v) != 1.0:
                raise self._refuse(key, v, "attention scaling of cos/sin is not implemented")
        kind = str(self._field(f"{a}.rope.scaling.type", "linear"))
        if kind not in ("none", "linear"):
            raise self._refuse(f"{a}.rope.scaling.type", kind,
                               "supported: none, linear; llama3 comes as the rope_freqs.weight tensor")
        # llama.cpp divides positions by any factor it finds, whatever the type says
        fkey = next((f"{a}.{k}" for k in ("rope.scaling.factor", "rope.scale_linear")
                     if self._field(f"{a}.{k}") is not None), None)
        factor = 1.0 if fkey is None else float(self._field(fkey))
        if factor == 0.0:  # llama.cpp: 0 means unset
            factor = 1.0
        if factor < 0:
            raise self._refuse(str(fkey), factor, "must be positive")
        freqs = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None and factor != 1.0:
            raise self._refuse(str(fkey), factor, "linear scaling together with rope_freqs.weight is not implemented")
        if freqs is not None:
            from gguf.quants import dequantize

            ff = np.asarray(dequantize(freqs.data, freqs.tensor_type), np.float64).reshape(-1)
            if ff.size != head_dim // 2 or not np.all(np.isfinite(ff) & (ff > 0)):
                raise CheckpointError(f"{self.path}: rope_freqs.weight has {ff.size} entries "
                                      f"(needs {head_dim // 2} positive factors, one per rotary frequency)")
            return None if np.all(ff == 1.0) else RopeScaling(rope_type="freq_factors", freq_factors=tuple(ff))
        return None if factor == 1.0 else RopeScaling(factor, rope_type="linear")

    def model_config(self) -> ModelConfig:
        a = self.arch
        known = GEMMA3_KEYS if a == "gemma3" else ARCH_KEYS
        unknown = sorted(k for k in self.reader.fields
                         if k.startswith(f"{a}.") and k.removeprefix(f"{a}.") not in known)
        if unknown:
            raise CheckpointError(f"{self.path}: unknown metadata {', '.join(map(repr, unknown))} "
                                  "(pagedjax cannot tell whether it changes the model's outputs)")
        for key in ("expert_count", "expert_used_count"):
            v = self._field(f"{a}.{key}")
            if v not in (None, 0):
                raise self._refuse(f"{a}.{key}", v, "mixture-of-experts models are not supported")
        heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        tokens = self._field("tokenizer.ggml.tokens") or []
        names = {t.name for t in self.reader.tensors}
        head_dim = int(self._arch("attention.key_length", self._arch("rope.dimension_count", hidden // heads)))
        for key in ("rope.dimension_count", "attention.value_length"):
            v = self._field(f"{a}.{key}")
            if v is not None and int(v) != head_dim:
                raise self._refuse(f"{a}.{key}", v, f"must equal the head dimension {head_dim}: "
                                   "partial rotary embeddings / unequal K and V heads are not implemented")
        window = self._field(f"{a}.attention.sliding_window")
        layers = int(self._arch("block_count"))
        extra: dict[str, Any] = {"sliding_window": None if window is None or int(window) == 0 else int(window)}
        if a == "gemma3":
            extra = gemma3_fields(lambda k: self._field(f"{a}.{k}"), layers, hidden, heads, head_dim)
        eos = self._field("tokenizer.ggml.eos_token_id")
        bos = self._field("tokenizer.ggml.bos_token_id")
        pad = self._field("tokenizer.ggml.padding_token_id")
        try:
            return ModelConfig(
                architecture=self.arch,
                vocab_size=int(self._field(f"{a}.vocab_size", len(tokens))),
                hidden_size=hidden,
                intermediate_size=int(self._arch("feed_forward_length")),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(self._arch("attention.head_count_kv", heads)),
                head_dim=head_dim,
                max_position_embeddings=int(self._arch("context_length", 4096)),
                rope_theta=float(self._arch("rope.freq_base", 10000.0)),
                rope_scaling=self._rope(head_dim),
                rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
                tie_word_embeddings="output.weight" not in names,
                attention_bias="blk.0.attn_q.bias" in names,
                bos_token_id=None if bos is None else int(bos),
                eos_token_ids=self._stop_ids(eos),
                pad_token_id=None if pad is None else int(pad),
                add_bos_token=bool(self._field("tokenizer.ggml.add_bos_token", False)),
                name=str(self._field("general.name", self.path.stem)),
                **extra,
            )
        except CheckpointError:
            raise
        except ValueError as exc:  # ModelConfig's own checks name the field
            raise CheckpointError(f"{self.path}: {exc}") from None

    def _stop_ids(self, eos: Any) -> tuple[int, ...]:
        """EOS, then the end-of-turn token where the file names one (Gemma's <end_of_turn>):
        llama.cpp ends generation at either."""
        ids = [int(v) for v in (eos, self._field("tokenizer.ggml.eot_token_id")) if v is not None]
        return tuple(dict.fromkeys(ids))

    # --- tensors -----------------------------------------------------------------
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            try:
                w = dequantize(t.data, t.tensor_type)
            except Exception as exc:
                raise CheckpointError(f"{self.path}: cannot decode tensor {t.name!r} ({exc})") from None
            # The reader lists dims innermost-first; the array is [out, in] (or [n]).
            yield t.name, np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])

    def _projection_assemblers(self, cfg: ModelConfig) -> tuple[ParamAssembler, ParamAssembler, str]:
        """Assemblers for the decoder projections' int8 values and float32 block scales, and
        the name of the tensor that serves as the LM head."""
        from runtime.model.quant import LINEAR_WEIGHTS

        rules = tuple(r for r in self.rules if r.path.split("/")[-1] in LINEAR_WEIGHTS)
        head_name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
        return (ParamAssembler(cfg, rules, np.dtype(np.int8)), ParamAssembler(cfg, rules, np.dtype(np.float32)),
                head_name)

    def projections_q8_0(self, cfg: ModelConfig, lm_head: bool = False) -> bool:
        """Every decoder projection (and, with `lm_head`, the head) is stored as Q8_0: from
        the tensor types alone, no data read (`inspect` asks this)."""
        values, _, head_name = self._projection_assemblers(cfg)
        found = [t for t in self.reader.tensors
                 if values.match(t.name) is not None or (lm_head and t.name == head_name)]
        return bool(found) and all(t.tensor_type.name == "Q8_0" for t in found) and (
            not lm_head or any(t.name == head_name for t in found))

    def q8_0_weights(self, cfg: ModelConfig, lm_head: bool = False) -> dict[str, Any] | None:
        """The decoder projections (and, with `lm_head`, the head: output.weight or the tied
        token embedding) as stored: {"layers": {"wq": {"q": int8 [L, in, out], "g": float32
        [L, in/32, out]}, ...}, "head"?: {"q": [d, V], "g": [d/32, V]}} with llama.cpp's own
        values and block scales (dequantized = q * g, exactly as `tensors` gives them), or
        None unless every one of those tensors is Q8_0."""
        if not self.projections_q8_0(cfg, lm_head):
            return None
        values, scales, head_name = self._projection_assemblers(cfg)
        head = None
        for t in self.reader.tensors:
            is_head = lm_head and t.name == head_name
            if not is_head and values.match(t.name) is None:
                continue
            out_dim, in_dim = (int(d) for d in reversed(t.shape))
            q, d = q8_0_blocks(np.asarray(t.data, np.uint8))
            q, d = q.reshape(out_dim, in_dim), d.reshape(out_dim, in_dim // 32)
            if is_head:  # [V, d] (embedding) or [V, d] (output.weight): groups run along d
                head = {"q": np.ascontiguousarray(q.T), "g": np.ascontiguousarray(d.T)}
            else:
                values.add(t.name, q)
                scales.add(t.name, d)
        g = scales.finish_layers()
        layers = {k: {"q": v, "g": g[k]} for k, v in values.finish_layers().items()}
        return {"layers": layers, **({"head": head} if lm_head else {})}

    def check_4bit(self, cfg: ModelConfig) -> None:
        """CheckpointError unless every decoder projection is a 4-bit type w4a16 keeps exactly
        (from the tensor types alone: `convert` asks before it reads any data)."""
        values, _, _ = self._projection_assemblers(cfg)
        for t in self.reader.tensors:
            if values.match(t.name) is not None and t.tensor_type.name not in Q4_BLOCKS:
                raise CheckpointError(
                    f"{self.path}: w4a16 keeps 4-bit tensors as stored, and {t.name} is {t.tensor_type.name} "
                    f"(exact paths: {', '.join(Q4_BLOCKS)}); convert without --quantize and serve "
                    f"--quantization w4a16 to requantize the float weights")

    def q4_weights(self, cfg: ModelConfig) -> dict[str, Any]:
        """The decoder projections as stored, for w4a16: {"layers": {"wq": {"q4": uint8 [L, in/2,
        out], "s4", "m4": float32 [L, in/32, out]}, ...}, "head": {"q8": int8 [d, V], "s8":
        [d/32, V]}}. Q4_0 / Q4_1 / Q4_K blocks give their 4-bit values with one scale and offset
        per 32 inputs, q * s4 + m4 equal bit for bit to `tensors`' float32 (gguf's dequantizer);
        a Q8_0 head its own int8 values and block scales (no "head" for any other type: the
        caller quantizes its float values). A projection of any other type: CheckpointError."""
        from runtime.model.quant import pack_nibbles

        self.check_4bit(cfg)
        values, scales, head_name = self._projection_assemblers(cfg)
        offsets = ParamAssembler(cfg, values.rules, np.dtype(np.float32))
        values = ParamAssembler(cfg, values.rules, np.dtype(np.uint8))
        head = None
        for t in self.reader.tensors:
            if t.name == head_name and t.tensor_type.name == "Q8_0":
                V, d = (int(x) for x in reversed(t.shape))
                q, g = q8_0_blocks(np.asarray(t.data, np.uint8))
                head = {"q8": np.ascontiguousarray(q.reshape(V, d).T), "s8": np.ascontiguousarray(g.reshape(V, d // 32).T)}
                continue
            if values.match(t.name) is None:
                continue
            kind = t.tensor_type.name
            out_dim, in_dim = (int(x) for x in reversed(t.shape))
            q, sc, off = Q4_BLOCKS[kind](np.asarray(t.data, np.uint8))
            values.add(t.name, q.reshape(out_dim, in_dim))
            scales.add(t.name, sc.reshape(out_dim, in_dim // 32))
            offsets.add(t.name, off.reshape(out_dim, in_dim // 32))
        q4, s4, m4 = values.finish_layers(), scales.finish_layers(), offsets.finish_layers()
        layers = {k: {"q4": pack_nibbles(v), "s4": s4[k], "m4": m4[k]} for k, v in q4.items()}
        return {"layers": layers, **({"head": head} if head is not None else {})}

    # --- tokenizer -----------------------------------------------------------------
    def tokenizer_json(self) -> str:
        from runtime.tokenizer import build_byte_level_bpe

        model = self._str("tokenizer.ggml.model")
        if model == "llama" and self.arch in SENTENCEPIECE_ARCHS:
            return self._sentencepiece_json()
        if model != "gpt2":
            raise CheckpointError(
                f"{self.path}: tokenizer type {model!r} is not supported for {self.arch} "
                f"(supported: gpt2 byte-level BPE; llama SentencePiece for {', '.join(SENTENCEPIECE_ARCHS)})")
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens")]
        merges = [str(m) for m in self._field("tokenizer.ggml.merges") or []]
        types = list(self._field("tokenizer.ggml.token_type") or [])
        specials = [tok for tok, ty in zip(tokens, types) if ty == CONTROL_TOKEN]
        pre = str(self._field("tokenizer.ggml.pre", "default"))
        return build_byte_level_bpe(tokens, merges, specials, pre).to_str()

    def _sentencepiece_json(self) -> str:
        from runtime.checkpoint.gguf_tokenizer import build_sentencepiece_bpe

        if self._field("tokenizer.ggml.add_space_prefix", False):
            raise self._refuse("tokenizer.ggml.add_space_prefix", True, "Gemma's tokenizer adds no prefix space")
        merges = self._field("tokenizer.ggml.merges")
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens")]
        types = [int(t) for t in self._field("tokenizer.ggml.token_type") or [1] * len(tokens)]
        unk = self._field("tokenizer.ggml.unknown_token_id")
        if unk is None or not 0 <= int(unk) < len(tokens):
            raise CheckpointError(f"{self.path}: GGUF metadata lacks a valid 'tokenizer.ggml.unknown_token_id'")
        try:
            return build_sentencepiece_bpe(tokens, types, tokens[int(unk)],
                                           None if merges is None else [str(m) for m in merges]).to_str()
        except ValueError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None

    def chat_template(self) -> str | None:
        v = self._field("tokenizer.chat_template")
        return None if v is None else str(v)
