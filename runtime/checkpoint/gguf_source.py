"""Read a llama.cpp GGUF file: model config, dequantized tensors, tokenizer, chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from runtime.checkpoint.mapping import GGUF_RULES, CheckpointError, ParamAssembler, Rule
from runtime.config import ModelConfig, RopeScaling

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}
SUPPORTED_ARCHS = ("llama", "qwen2")
CONTROL_TOKEN = 3


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

    def model_config(self) -> ModelConfig:
        heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        tokens = self._field("tokenizer.ggml.tokens") or []
        names = {t.name for t in self.reader.tensors}
        scaling = None
        if self._field(f"{self.arch}.rope.scaling.type") == "llama3":
            scaling = RopeScaling(
                factor=float(self._arch("rope.scaling.factor")),
                original_max_position_embeddings=int(self._arch("rope.scaling.original_context_length")))
        eos = self._field("tokenizer.ggml.eos_token_id")
        bos = self._field("tokenizer.ggml.bos_token_id")
        pad = self._field("tokenizer.ggml.padding_token_id")
        return ModelConfig(
            architecture=self.arch,
            vocab_size=int(self._field(f"{self.arch}.vocab_size", len(tokens))),
            hidden_size=hidden,
            intermediate_size=int(self._arch("feed_forward_length")),
            num_layers=int(self._arch("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._arch("attention.head_count_kv", heads)),
            head_dim=int(self._arch("rope.dimension_count", hidden // heads)),
            max_position_embeddings=int(self._arch("context_length", 4096)),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
            pad_token_id=None if pad is None else int(pad),
            add_bos_token=bool(self._field("tokenizer.ggml.add_bos_token", False)),
            name=str(self._field("general.name", self.path.stem)),
        )

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
        from runtime.quant import LINEAR_WEIGHTS

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
            raw = np.asarray(t.data, np.uint8).reshape(-1, 34)  # Q8_0 block: float16 d, then 32 int8
            out_dim, in_dim = (int(d) for d in reversed(t.shape))
            d = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(out_dim, in_dim // 32)
            q = raw[:, 2:].copy().view(np.int8).reshape(out_dim, in_dim)
            if is_head:  # [V, d] (embedding) or [V, d] (output.weight): groups run along d
                head = {"q": np.ascontiguousarray(q.T), "g": np.ascontiguousarray(d.T)}
            else:
                values.add(t.name, q)
                scales.add(t.name, d)
        g = scales.finish_layers()
        layers = {k: {"q": v, "g": g[k]} for k, v in values.finish_layers().items()}
        return {"layers": layers, **({"head": head} if lm_head else {})}

    # --- tokenizer -----------------------------------------------------------------
    def tokenizer_json(self) -> str:
        from runtime.tokenizer import build_byte_level_bpe

        model = self._str("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(
                f"{self.path}: tokenizer type {model!r} is not supported (supported: gpt2 byte-level BPE)")
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens")]
        merges = [str(m) for m in self._field("tokenizer.ggml.merges") or []]
        types = list(self._field("tokenizer.ggml.token_type") or [])
        specials = [tok for tok, ty in zip(tokens, types) if ty == CONTROL_TOKEN]
        pre = str(self._field("tokenizer.ggml.pre", "default"))
        return build_byte_level_bpe(tokens, merges, specials, pre).to_str()

    def chat_template(self) -> str | None:
        v = self._field("tokenizer.chat_template")
        return None if v is None else str(v)
