"""Read a Hugging Face model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from runtime.checkpoint.mapping import HF_RULES, CheckpointError, Rule
from runtime.config import ModelConfig, RopeScaling

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None


class HFSource:
    rules: tuple[Rule, ...] = HF_RULES

    def __init__(self, path: Path):
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory (expected a Hugging Face model directory)")
        self.path = path
        self.hf = _read_json(path / "config.json")
        archs = self.hf.get("architectures") or [self.hf.get("model_type", "?")]
        self.arch = ARCHS.get(archs[0])
        if self.arch is None:
            raise CheckpointError(f"{path}: unsupported architecture {archs[0]!r} (supported: {', '.join(ARCHS)})")
        self.files = self._weight_files()
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"{path}: missing tokenizer.json")

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(_read_json(index).get("weight_map", {}).values()))
            files = [self.path / n for n in names]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in the index but missing")
        return files

    def model_config(self) -> ModelConfig:
        c = self.hf
        heads = int(c["num_attention_heads"])
        rs = c.get("rope_scaling") or None
        scaling = None
        if rs and rs.get("rope_type", rs.get("type")) == "llama3":
            scaling = RopeScaling(float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                                  float(rs.get("high_freq_factor", 4.0)),
                                  int(rs.get("original_max_position_embeddings", 8192)))
        elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
            raise CheckpointError(f"{self.path}: unsupported rope_scaling {rs!r}")
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        try:
            return ModelConfig(
                architecture=self.arch,
                vocab_size=int(c["vocab_size"]),
                hidden_size=int(c["hidden_size"]),
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads", heads)),
                head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
                rope_theta=float(c.get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                attention_bias=bool(c.get("attention_bias", self.arch == "qwen2")),
                bos_token_id=c.get("bos_token_id"),
                eos_token_ids=eos_ids,
                pad_token_id=c.get("pad_token_id"),
                add_bos_token=bool(self._tokenizer_config().get("add_bos_token", False)),
                name=self.path.name,
            )
        except KeyError as exc:
            raise CheckpointError(f"{self.path / 'config.json'}: missing field {exc.args[0]!r}") from None

    def _tokenizer_config(self) -> dict:
        p = self.path / "tokenizer_config.json"
        return _read_json(p) if p.is_file() else {}

    def num_tensors(self) -> int:
        return sum(len(read_safetensors_header(f)[0]) for f in self.files)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        for f in self.files:
            yield from read_safetensors(f)

    def tokenizer_json(self) -> str:
        return (self.path / "tokenizer.json").read_text()

    def chat_template(self) -> str | None:
        tpl = self.path / "chat_template.jinja"
        if tpl.is_file():
            return tpl.read_text()
        t = self._tokenizer_config().get("chat_template")
        if isinstance(t, list):  # named templates: take the default one
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        return t


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "F64": np.float64}


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor entries, data start offset); validates that every tensor lies inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file (no header)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file (header length {n})")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    for name, e in header.items():
        if e.get("dtype") not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {e.get('dtype')}")
        if 8 + n + e["data_offsets"][1] > size:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file (tensor {name!r} past end)")
    return header, 8 + n


def read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    import ml_dtypes

    header, start = read_safetensors_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, e in header.items():
        lo, hi = e["data_offsets"]
        dt = _ST_DTYPES[e["dtype"]]
        dt = ml_dtypes.bfloat16 if dt == "bfloat16" else dt
        arr = data[start + lo:start + hi].view(dt).reshape(e["shape"])
        yield name, np.asarray(arr, dtype=np.float32)
