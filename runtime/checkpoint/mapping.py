"""Declarative source-name -> parameter-path tables for GGUF and Hugging Face files.

Each row: (source pattern with `{i}` for the layer index, parameter path, transform).
Transforms turn a source matrix [out, in] into our [in, out] layout; `unpermute_q/k`
undo llama.cpp's interleaved rotary row order so Q/K match the rotate-half convention.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from runtime.config import ModelConfig


class CheckpointError(ValueError):
    """A one-line, user-facing problem with a checkpoint or source file."""


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows grouped (head, pair, half) -> (head, half, pair)."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]

TRANSFORMS: dict[str, Transform] = {
    "copy": lambda w, c: w,
    "t": lambda w, c: w.T,
    "unpermute_q_t": lambda w, c: unpermute_rows(w, c.num_heads).T,
    "unpermute_k_t": lambda w, c: unpermute_rows(w, c.num_kv_heads).T,
    "unpermute_q": lambda w, c: unpermute_rows(w, c.num_heads),
    "unpermute_k": lambda w, c: unpermute_rows(w, c.num_kv_heads),
    # Gemma's RMSNorm multiplies by (1 + w), in float32: stored as that effective multiplier
    # so the shared rms_norm (x * w) applies it unchanged (runtime/model/families/gemma.py)
    "norm_plus_one": lambda w, c: w + np.float32(1.0),
}


@dataclass(frozen=True)
class Rule:
    source: str          # e.g. "blk.{i}.attn_q.weight" ({e}: one expert's, stacked [L, E, ...])
    path: str            # e.g. "layers/wq" (layered) or "embed"
    transform: str = "copy"
    optional: bool = False
    # "dense" / "moe": stacked over only those layers of a mixture of experts (ModelConfig
    # dense_layers / moe_layers()); per-expert rules are always "moe"
    subset: str = ""

    @property
    def layered(self) -> bool:
        return "{i}" in self.source

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.source

    def regex(self) -> re.Pattern[str]:
        return re.compile("^" + re.escape(self.source).replace(r"\{i\}", r"(\d+)").replace(r"\{e\}", r"(\d+)") + "$")


# `{arch}.` metadata keys a GGUF's model config reads or checks (runtime/checkpoint/gguf_source.py);
# any other one is refused by name, so nothing that changes the math is skipped.
# rope.scaling.original_context_length and .finetuned only inform YaRN (refused), rope.scaling.type
# "linear" ignores them.
GGUF_ARCH_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.dimension_count", "rope.freq_base", "rope.scale_linear", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.attn_factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",
})

GGUF_RULES = (
    Rule("token_embd.weight", "embed"),
    Rule("output_norm.weight", "final_norm"),
    Rule("output.weight", "lm_head", "t", optional=True),
    Rule("blk.{i}.attn_norm.weight", "layers/attn_norm"),
    Rule("blk.{i}.attn_q.weight", "layers/wq", "unpermute_q_t"),
    Rule("blk.{i}.attn_k.weight", "layers/wk", "unpermute_k_t"),
    Rule("blk.{i}.attn_v.weight", "layers/wv", "t"),
    Rule("blk.{i}.attn_output.weight", "layers/wo", "t"),
    Rule("blk.{i}.attn_q.bias", "layers/bq", "unpermute_q", optional=True),
    Rule("blk.{i}.attn_k.bias", "layers/bk", "unpermute_k", optional=True),
    Rule("blk.{i}.attn_v.bias", "layers/bv", optional=True),
    Rule("blk.{i}.ffn_norm.weight", "layers/mlp_norm"),
    Rule("blk.{i}.ffn_gate.weight", "layers/w_gate", "t"),
    Rule("blk.{i}.ffn_up.weight", "layers/w_up", "t"),
    Rule("blk.{i}.ffn_down.weight", "layers/w_down", "t"),
)

HF_RULES = (
    Rule("model.embed_tokens.weight", "embed"),
    Rule("model.norm.weight", "final_norm"),
    Rule("lm_head.weight", "lm_head", "t", optional=True),
    Rule("model.layers.{i}.input_layernorm.weight", "layers/attn_norm"),
    Rule("model.layers.{i}.self_attn.q_proj.weight", "layers/wq", "t"),
    Rule("model.layers.{i}.self_attn.k_proj.weight", "layers/wk", "t"),
    Rule("model.layers.{i}.self_attn.v_proj.weight", "layers/wv", "t"),
    Rule("model.layers.{i}.self_attn.o_proj.weight", "layers/wo", "t"),
    Rule("model.layers.{i}.self_attn.q_proj.bias", "layers/bq", optional=True),
    Rule("model.layers.{i}.self_attn.k_proj.bias", "layers/bk", optional=True),
    Rule("model.layers.{i}.self_attn.v_proj.bias", "layers/bv", optional=True),
    Rule("model.layers.{i}.self_attn.q_norm.weight", "layers/q_norm", optional=True),  # Qwen3
    Rule("model.layers.{i}.self_attn.k_norm.weight", "layers/k_norm", optional=True),
    Rule("model.layers.{i}.post_attention_layernorm.weight", "layers/mlp_norm"),
    Rule("model.layers.{i}.mlp.gate_proj.weight", "layers/w_gate", "t"),
    Rule("model.layers.{i}.mlp.up_proj.weight", "layers/w_up", "t"),
    Rule("model.layers.{i}.mlp.down_proj.weight", "layers/w_down", "t"),
)

# Gemma 2 / Gemma 3 (Gemma*ForCausalLM): a norm before and after attention and the MLP, the
# norms' weights stored +1 (see TRANSFORMS), Gemma 3's per-head q/k norms; parameter names as
# runtime/model/families/gemma.py param_shapes (the GGUF rules write the same tree).
_GEMMA_NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
                ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm"))
HF_GEMMA_RULES = (
    Rule("model.embed_tokens.weight", "embed"),
    Rule("model.norm.weight", "final_norm", "norm_plus_one"),
    Rule("lm_head.weight", "lm_head", "t", optional=True),
    *(Rule(f"model.layers.{{i}}.{src}.weight", f"layers/{dst}", "norm_plus_one") for src, dst in _GEMMA_NORMS),
    Rule("model.layers.{i}.self_attn.q_proj.weight", "layers/wq", "t"),
    Rule("model.layers.{i}.self_attn.k_proj.weight", "layers/wk", "t"),
    Rule("model.layers.{i}.self_attn.v_proj.weight", "layers/wv", "t"),
    Rule("model.layers.{i}.self_attn.o_proj.weight", "layers/wo", "t"),
    Rule("model.layers.{i}.self_attn.q_norm.weight", "layers/q_norm", "norm_plus_one", optional=True),  # Gemma 3
    Rule("model.layers.{i}.self_attn.k_norm.weight", "layers/k_norm", "norm_plus_one", optional=True),
    Rule("model.layers.{i}.mlp.gate_proj.weight", "layers/w_gate", "t"),
    Rule("model.layers.{i}.mlp.up_proj.weight", "layers/w_up", "t"),
    Rule("model.layers.{i}.mlp.down_proj.weight", "layers/w_down", "t"),
)
# Mixtral / Qwen3-MoE: Llama's (Qwen3's) attention rules, the MLP as a router and experts
# (runtime/model/families/moe.py), one tensor per expert in the files.
_DENSE_MLP = ("layers/w_gate", "layers/w_up", "layers/w_down")
_BIASES_AND_QK_NORMS = ("layers/bq", "layers/bk", "layers/bv", "layers/q_norm", "layers/k_norm")
_ATTENTION_RULES = tuple(r for r in HF_RULES if r.path not in _DENSE_MLP + _BIASES_AND_QK_NORMS)
HF_MIXTRAL_RULES = (
    *_ATTENTION_RULES,
    Rule("model.layers.{i}.block_sparse_moe.gate.weight", "layers/router", "t"),
    Rule("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "layers/experts_gate", "t"),
    Rule("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "layers/experts_up", "t"),
    Rule("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "layers/experts_down", "t"),
)
HF_QWEN3_MOE_RULES = (
    *_ATTENTION_RULES,
    Rule("model.layers.{i}.self_attn.q_norm.weight", "layers/q_norm"),
    Rule("model.layers.{i}.self_attn.k_norm.weight", "layers/k_norm"),
    Rule("model.layers.{i}.mlp.gate.weight", "layers/router", "t", subset="moe"),
    Rule("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "layers/experts_gate", "t"),
    Rule("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "layers/experts_up", "t"),
    Rule("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "layers/experts_down", "t"),
)
HF_QWEN3_MOE_RULES += (  # the dense MLP of mlp_only_layers / decoder_sparse_step
    Rule("model.layers.{i}.mlp.gate_proj.weight", "layers/dense_gate", "t", subset="dense"),
    Rule("model.layers.{i}.mlp.up_proj.weight", "layers/dense_up", "t", subset="dense"),
    Rule("model.layers.{i}.mlp.down_proj.weight", "layers/dense_down", "t", subset="dense"),
)
# DeepSeek-V2 (runtime/model/families/deepseek.py): latent attention, shared experts beside the
# routed ones, the first first_k_dense_replace layers dense. Which of the query's two forms
# (q_proj, or q_a_proj + norm + q_b_proj) a checkpoint has, its config says: param_shapes checks.
_DS = "model.layers.{i}."
HF_DEEPSEEK_V2_RULES = (
    *(r for r in _ATTENTION_RULES if "self_attn" not in r.source),
    Rule(_DS + "self_attn.q_proj.weight", "layers/wq", "t", optional=True),
    Rule(_DS + "self_attn.q_a_proj.weight", "layers/wq_a", "t", optional=True),
    Rule(_DS + "self_attn.q_a_layernorm.weight", "layers/q_a_norm", optional=True),
    Rule(_DS + "self_attn.q_b_proj.weight", "layers/wq_b", "t", optional=True),
    Rule(_DS + "self_attn.kv_a_proj_with_mqa.weight", "layers/wkv_a", "t"),
    Rule(_DS + "self_attn.kv_a_layernorm.weight", "layers/kv_a_norm"),
    Rule(_DS + "self_attn.kv_b_proj.weight", "layers/wkv_b", "t"),
    Rule(_DS + "self_attn.o_proj.weight", "layers/wo", "t"),
    *(Rule(_DS + f"mlp.{n}_proj.weight", f"layers/dense_{n}", "t", subset="dense") for n in ("gate", "up", "down")),
    Rule(_DS + "mlp.gate.weight", "layers/router", "t", subset="moe"),
    *(Rule(_DS + f"mlp.experts.{{e}}.{n}_proj.weight", f"layers/experts_{n}", "t") for n in ("gate", "up", "down")),
    *(Rule(_DS + f"mlp.shared_experts.{n}_proj.weight", f"layers/shared_{n}", "t", optional=True, subset="moe")
      for n in ("gate", "up", "down")),
)
HF_RULES_BY_ARCH = {"gemma2": HF_GEMMA_RULES, "gemma3": HF_GEMMA_RULES, "mixtral": HF_MIXTRAL_RULES,
                    "qwen3_moe": HF_QWEN3_MOE_RULES, "deepseek_v2": HF_DEEPSEEK_V2_RULES}


def hf_rules(architecture: str) -> tuple[Rule, ...]:
    """The Hugging Face tensor-name rules for one of our architectures."""
    return HF_RULES_BY_ARCH.get(architecture, HF_RULES)


# Sources that carry no weights: rotary caches some HF exporters write (recomputed from the
# config), and llama.cpp's rope_freqs.weight, which GGUFSource.model_config has already
# turned into the config's rope_scaling (or refused).
IGNORED = re.compile(r"(rotary_emb\.inv_freq|rope_freqs\.weight)$")


class ParamAssembler:
    """Collects converted tensors by rule and stacks layers into the model's tree."""

    def __init__(self, cfg: ModelConfig, rules: tuple[Rule, ...], dtype: np.dtype):
        self.cfg, self.rules, self.dtype = cfg, rules, dtype
        self._compiled = [(r, r.regex()) for r in rules]
        self.flat: dict[str, np.ndarray] = {}
        self.layered: dict[str, dict[int, np.ndarray]] = {}

    def match(self, name: str) -> tuple[Rule, int | tuple[int, int] | None] | None:
        """The rule a tensor name follows, with its layer (and expert: (layer, expert))."""
        for rule, rx in self._compiled:
            m = rx.match(name)
            if m:
                if rule.per_expert:
                    return rule, (int(m.group(1)), int(m.group(2)))
                return rule, (int(m.group(1)) if rule.layered else None)
        return None

    def add(self, name: str, array: np.ndarray) -> None:
        hit = self.match(name)
        if hit is None:
            if IGNORED.search(name):
                return
            raise CheckpointError(f"unexpected tensor {name!r}: not part of a {self.cfg.architecture} model")
        rule, layer = hit
        w = TRANSFORMS[rule.transform](np.asarray(array, dtype=np.float32), self.cfg).astype(self.dtype)
        if isinstance(layer, tuple):  # one expert's: kept by (layer, expert) until finish_layers stacks them
            layer, expert = layer
            if layer >= self.cfg.num_layers or expert >= self.cfg.num_experts:
                raise CheckpointError(f"tensor {name!r} names layer {layer}, expert {expert}; the model has "
                                      f"{self.cfg.num_layers} layers of {self.cfg.num_experts} experts")
            self._check_subset(name, "moe", layer)
            self.layered.setdefault(rule.path, {})[layer * self.cfg.num_experts + expert] = np.ascontiguousarray(w)
        elif layer is None:
            self.flat[rule.path] = w
        else:
            if layer >= self.cfg.num_layers:
                raise CheckpointError(f"tensor {name!r} names layer {layer}, model has {self.cfg.num_layers}")
            self._check_subset(name, rule.subset, layer)
            self.layered.setdefault(rule.path, {})[layer] = np.ascontiguousarray(w)

    def subset_layers(self, subset: str) -> tuple[int, ...]:
        """The layers a rule's tensors stack over (all for subset "")."""
        if subset == "dense":
            return self.cfg.dense_layers
        return self.cfg.moe_layers() if subset == "moe" else tuple(range(self.cfg.num_layers))

    def _check_subset(self, name: str, subset: str, layer: int) -> None:
        if subset and layer not in self.subset_layers(subset):
            kind = "dense MLP" if subset == "moe" else "mixture of experts"
            raise CheckpointError(f"tensor {name!r}: layer {layer} has a {kind} in this model's config")

    def finish_layers(self) -> dict:
        """The per-layer tensors stacked [L, ...] by their name under layers/."""
        layers: dict = {}
        for rule in self.rules:
            if rule.layered:
                got = self.layered.get(rule.path, {})
                if not got and rule.optional:
                    continue
                E = self.cfg.num_experts
                if rule.per_expert:  # [moe layers, E, ...], experts of a layer side by side
                    want = [i * E + e for i in self.cfg.moe_layers() for e in range(E)]
                    missing = sorted(set(want) - set(got))
                    if missing:
                        raise CheckpointError(f"missing tensor {rule.source.format(i=missing[0] // E, e=missing[0] % E)!r}")
                    layers[rule.path.split("/")[1]] = np.stack([got[i] for i in want]).reshape(
                        len(want) // E, E, *got[want[0]].shape)
                    continue
                over = self.subset_layers(rule.subset)
                if not over:  # (no layer of that kind in this model)
                    continue
                missing = sorted(set(over) - set(got))
                if missing:
                    raise CheckpointError(f"missing tensor {rule.source.format(i=missing[0])!r}")
                layers[rule.path.split("/")[1]] = np.stack([got[i] for i in over])
        return layers

    def finish(self, expected_shapes: dict) -> dict:
        params: dict = {"layers": self.finish_layers()}
        for rule in self.rules:
            if rule.layered:
                continue
            if rule.path in self.flat:
                params[rule.path] = self.flat[rule.path]
            elif not rule.optional:
                raise CheckpointError(f"missing tensor {rule.source!r}")
        if "lm_head" in params and self.cfg.tie_word_embeddings:
            del params["lm_head"]  # tied: some exporters still write a copy
        check_shapes(params, expected_shapes)
        return params


def check_shapes(params: dict, expected: dict, prefix: str = "") -> None:
    for key, want in expected.items():
        if key not in params:
            raise CheckpointError(f"missing parameter {prefix}{key}")
        if isinstance(want, dict):
            check_shapes(params[key], want, f"{prefix}{key}/")
        elif tuple(params[key].shape) != tuple(want):
            raise CheckpointError(
                f"parameter {prefix}{key} has shape {tuple(params[key].shape)}, config implies {tuple(want)}")
