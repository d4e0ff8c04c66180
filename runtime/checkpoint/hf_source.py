"""Read a Hugging Face model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from runtime.checkpoint.hf_gemma import GEMMA_ARCHS, GEMMA_KEYS, GEMMA_MAX_POSITIONS, gemma_fields
from runtime.checkpoint.hf_rope import read_rope
from runtime.checkpoint.mapping import HF_RULES, CheckpointError, Rule, hf_rules
from runtime.config import ModelConfig, RopeScaling

# architecture -> (our model's architecture, the transformers family whose config.json keys apply)
ARCHS = {"LlamaForCausalLM": ("llama", "llama"), "MistralForCausalLM": ("llama", "mistral"),
         "Qwen2ForCausalLM": ("qwen2", "qwen2"), "Qwen3ForCausalLM": ("qwen3", "qwen3"),
         "Phi3ForCausalLM": ("phi3", "phi3"), "MixtralForCausalLM": ("mixtral", "mixtral"),
         "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe"), "DeepseekV2ForCausalLM": ("deepseek_v2", "deepseek_v2")}

# config.json keys that never change the model's outputs: bookkeeping, training-only knobs
# (dropout is off at inference, pretraining_tp only split the matmuls), generation defaults
# (the request's sampling parameters decide), leftovers of other tools.
HARMLESS = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "initializer_range", "output_attentions", "output_hidden_states", "output_scores", "return_dict",
    "return_dict_in_generate", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "torchscript", "use_bfloat16", "tf_legacy_loss", "prefix", "task_specific_params",
    "tokenizer_class", "sep_token_id", "decoder_start_token_id", "keys_to_ignore_at_inference",
    "attention_dropout", "pretraining_tp", "resid_pdrop", "embd_pdrop",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id",
    "is_llama_config", "transformers.js_config", "unsloth_version", "unsloth_fixed",
})
# Keys model_config reads, or checks value by value (refusing what it does not implement).
IMPLEMENTED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "rope_theta", "rope_scaling", "rope_parameters",
    "original_max_position_embeddings", "partial_rotary_factor", "hidden_act", "quantization_config",
    "pruned_heads", "auto_map", "rope_interleaved",
})
FAMILY_KEYS = {  # each family's own keys, implemented or checked (transformers' <Family>Config)
    # the window keys: LlamaConfig has none, but Llama-architecture exports of other models
    # carry them; accepted while they say "no window" (_sliding_window)
    "llama": frozenset({"attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                        "layer_types"}),
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset({"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                        "layer_types"}),
    "qwen3": frozenset({"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                        "layer_types"}),
    "phi3": frozenset({"attention_bias", "sliding_window"}),
    # mixture of experts (runtime/model/families/moe.py); output_router_logits, router_aux_loss_coef
    # and router_jitter_noise act in training only (checked below)
    "mixtral": frozenset({"sliding_window", "num_local_experts", "num_experts_per_tok", "output_router_logits",
                          "router_aux_loss_coef", "router_jitter_noise"}),
    "qwen3_moe": frozenset({"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                            "layer_types", "num_experts", "num_local_experts", "num_experts_per_tok",  # (saved as either)
                            "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                            "output_router_logits", "router_aux_loss_coef"}),
    # latent attention + experts (runtime/model/families/deepseek.py); aux_loss_alpha and
    # seq_aux act in training only, qk_head_dim is qk_nope + qk_rope (checked)
    "deepseek_v2": frozenset({"attention_bias", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                              "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "n_routed_experts",
                              "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                              "routed_scaling_factor", "topk_method", "n_group", "topk_group", "norm_topk_prob",
                              "scoring_func", "moe_layer_freq", "output_router_logits", "router_aux_loss_coef",
                              "aux_loss_alpha", "seq_aux", "ep_size", "mlp_bias"}),
}
# Defaults of transformers' config classes where a key is absent and the default matters.
MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768, "phi3": 4096,
                 "mixtral": 4096 * 32, "qwen3_moe": 32768, "deepseek_v2": 2048}
MISTRAL_SLIDING_WINDOW = 4096  # MistralConfig's default: a config.json without the key slides
# Where config.json lacks a key, the config class's default, where it is not the one used for all
KV_HEADS = {"mixtral": 8, "qwen3_moe": 4}  # (else num_attention_heads)
RMS_NORM_EPS = {"mixtral": 1e-5}           # (else 1e-6)
# Gemma 2 / 3: their keys are read and checked in runtime/checkpoint/hf_gemma.py
ARCHS.update(GEMMA_ARCHS)
FAMILY_KEYS.update(GEMMA_KEYS)
MAX_POSITIONS.update(GEMMA_MAX_POSITIONS)
# Custom modelling code a config.json may name that transformers has upstreamed (and loads its
# own class for, which pagedjax matches): Microsoft's Phi-3 repositories carry their
# pre-integration modeling_phi3.py.
UPSTREAMED_CODE = {"phi3": {"modeling_phi3.Phi3ForCausalLM"},
                   # DeepSeek-V2 / V2-Lite's own modeling_deepseek.py (transformers' DeepseekV2 is its math)
                   "deepseek_v2": {"modeling_deepseek.DeepseekV2Model", "modeling_deepseek.DeepseekV2ForCausalLM"}}


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
        if archs[0] not in ARCHS:
            raise CheckpointError(f"{path}: unsupported architecture {archs[0]!r} (supported: {', '.join(ARCHS)})")
        self.arch, self.family = ARCHS[archs[0]]
        self.rules = hf_rules(self.arch)
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

    def _refuse(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path / 'config.json'}: {msg}")

    def _check_keys(self) -> None:
        """Every key is implemented, checked, or known to be harmless: a key that changed the
        math and was skipped would make a model that loads and is silently wrong."""
        c, fam = self.hf, self.family
        unknown = sorted(set(c) - HARMLESS - IMPLEMENTED - FAMILY_KEYS[fam])
        if unknown:
            raise self._refuse(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                               f"for {fam} (pagedjax cannot tell whether it changes the model's outputs)")
        refusals = [
            ("hidden_act", fam not in GEMMA_KEYS and c.get("hidden_act", "silu") not in ("silu", "swish"),
             "supported: silu"),  # (Gemma reads hidden_activation instead)
            ("mlp_bias", bool(c.get("mlp_bias", False)), "MLP biases are not implemented"),
            # Llama's attention_bias biases o_proj too (not implemented); Qwen2Attention has q/k/v
            # biases whatever the key says (transformers ignores it), so only true is consistent.
            ("attention_bias", bool(c.get("attention_bias")) != (fam == "qwen2"),
             "Qwen2 always has q/k/v biases" if fam == "qwen2" else f"attention biases are not implemented for {fam}"),
            ("partial_rotary_factor", c.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0),
             "partial rotary embeddings are not implemented"),
            ("rope_interleaved", bool(c.get("rope_interleaved", False)), "interleaved RoPE is not implemented"),
            ("quantization_config", c.get("quantization_config") is not None,
             "pre-quantized weights are not supported; convert an unquantized checkpoint"),
            ("pruned_heads", bool(c.get("pruned_heads")), "pruned attention heads are not supported"),
            ("decoder_sparse_step", isinstance(c.get("decoder_sparse_step", 1), bool)
             or not isinstance(c.get("decoder_sparse_step", 1), int) or c.get("decoder_sparse_step", 1) < 1,
             "expected a positive integer"),
            ("mlp_only_layers", not isinstance(c.get("mlp_only_layers") or [], list)
             or not all(isinstance(i, int) and 0 <= i < c.get("num_hidden_layers", 0) for i in c.get("mlp_only_layers") or []),
             "expected a list of layer indices"),
            # DeepSeek-V2: what transformers' DeepseekV2 implements, and pagedjax with it
            ("scoring_func", fam == "deepseek_v2" and c.get("scoring_func", "softmax") != "softmax",
             "supported: softmax"),
            ("moe_layer_freq", c.get("moe_layer_freq", 1) != 1, "supported: 1 (every layer from first_k_dense_replace)"),
            ("norm_topk_prob", fam == "deepseek_v2" and bool(c.get("norm_topk_prob")),
             "DeepSeek-V2's router does not renormalise its top-k weights (transformers ignores the key)"),
            ("ep_size", c.get("ep_size", 1) != 1, "supported: 1 (a training layout)"),
            ("num_key_value_heads", fam == "deepseek_v2" and c.get("num_key_value_heads", c.get("num_attention_heads"))
             != c.get("num_attention_heads"), "latent attention expands to one key and value per query head"),
            ("qk_head_dim", fam == "deepseek_v2" and c.get("qk_head_dim") not in (
                None, c.get("qk_nope_head_dim", 128) + c.get("qk_rope_head_dim", 64)),
             "must be qk_nope_head_dim + qk_rope_head_dim"),
            ("head_dim", fam == "deepseek_v2" and c.get("head_dim") not in (None, c.get("qk_rope_head_dim", 64)),
             "DeepSeek-V2's RoPE width is qk_rope_head_dim"),
            ("router_jitter_noise", not isinstance(c.get("router_jitter_noise", 0.0), (int, float)),
             "expected a number (it acts in training only)"),
            ("auto_map", any(k.startswith("AutoModel") and v not in UPSTREAMED_CODE.get(fam, set())
                             for k, v in (c.get("auto_map") or {}).items()),
             "custom modelling code is not supported"),
        ]
        for key, bad, why in refusals:
            if key in c and bad:
                raise self._refuse(f"{key} {c[key]!r} is not supported ({why})")

    def _rope(self) -> tuple[float, RopeScaling | None]:
        """(rope_theta, scaling) from transformers 4.x (`rope_scaling` + `rope_theta`) or 5.x
        (`rope_parameters` with rope_theta inside, possibly one dict per layer type)."""
        c = self.hf
        field = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
        rp = c.get(field) or {}
        if not isinstance(rp, dict):
            raise self._refuse(f"{field} {rp!r} is not supported (expected an object)")
        if self.family == "gemma3" and isinstance(rp.get("full_attention"), dict):  # the sliding layers' own
            field, rp = f"{field}.full_attention", rp["full_attention"]  # RoPE: hf_gemma.local_rope_theta
        nested = [k for k, v in rp.items() if isinstance(v, dict)]
        if nested:  # per layer type: fine only while every layer gets the same RoPE
            if len(nested) != len(rp) or any(rp[k] != rp[nested[0]] for k in nested):
                raise self._refuse(f"{field} per layer type ({', '.join(nested)}) with different RoPE "
                                   "is not supported")
            field, rp = f"{field}.{nested[0]}", rp[nested[0]]
        max_pos = c.get("max_position_embeddings", MAX_POSITIONS[self.family])
        return read_rope(c, self.family, field, rp, max_pos, self._refuse)

    def _sliding_window(self) -> tuple[int | None, tuple[str, ...]]:
        """(the attention window, or None; the layers' types where not every layer slides:
        ModelConfig.layer_types, () = uniform)."""
        c, fam, n = self.hf, self.family, int(self.hf.get("num_hidden_layers", 0))
        types: list[str] = []
        if fam == "llama":  # transformers' Llama has no window: only "no window" is unambiguous
            windowed = [(k, v) for k, v in (("sliding_window", c.get("sliding_window")),
                                            ("use_sliding_window", c.get("use_sliding_window") or None),
                                            *(("layer_types", t) for t in c.get("layer_types") or ()
                                              if t != "full_attention")) if v is not None]
            if windowed:
                key, v = windowed[0]
                raise self._refuse(f"{key} {v!r} is not supported (LlamaForCausalLM has no sliding window)")
            return None, ()
        if fam in ("mistral", "phi3", "mixtral"):  # every layer slides; an absent key is the config class's default
            window = c.get("sliding_window", MISTRAL_SLIDING_WINDOW if fam == "mistral" else None)
        else:  # qwen2: layers from max_window_layers on slide, when use_sliding_window
            window = c.get("sliding_window", 4096) if c.get("use_sliding_window", False) else None
            types = c.get("layer_types")
            if types is None:
                first = c.get("max_window_layers", 28)
                if isinstance(first, bool) or not isinstance(first, int):
                    raise self._refuse(f"max_window_layers {first!r} is not an integer")
                types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                         for i in range(n)]
            bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
            if bad:
                raise self._refuse(f"layer_types {bad[0]!r} is not supported (supported: full_attention, "
                                   "sliding_attention)")
            if len(types) != n:
                raise self._refuse(f"layer_types has {len(types)} entries for {n} layers")
            if "sliding_attention" not in types:
                return None, ()
            if window is None:
                raise self._refuse("layer_types has sliding_attention layers but use_sliding_window is off")
        if window is None:
            return None, ()
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise self._refuse(f"sliding_window {window!r} is not a positive integer")
        return window, (tuple(types) if "full_attention" in types else ())

    def model_config(self) -> ModelConfig:
        c = self.hf
        self._check_keys()
        theta, scaling = self._rope()
        gemma = gemma_fields(c, self.family, self._refuse) if self.family in GEMMA_KEYS else {}
        window, types = (gemma.pop("sliding_window"), gemma.pop("layer_types")) if gemma else self._sliding_window()
        max_pos = c.get("max_position_embeddings", MAX_POSITIONS[self.family])
        if scaling is not None and scaling.max_exact_len is not None and isinstance(max_pos, int):
            # the context is served only as far as the scaling is exact (RopeScaling.max_exact_len);
            # engine_args refuses a longer max_model_len against max_position_embeddings
            max_pos = min(max_pos, scaling.max_exact_len)
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        try:
            heads = int(c["num_attention_heads"])
            latent = self._latent_attention(scaling)
            return ModelConfig(
                architecture=self.arch,
                vocab_size=int(c["vocab_size"]),
                hidden_size=int(c["hidden_size"]),
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=latent.pop("num_kv_heads", int(c.get("num_key_value_heads") or KV_HEADS.get(self.family, heads))),
                head_dim=latent.pop("head_dim", int(c.get("head_dim") or c["hidden_size"] // heads)),
                **latent,
                max_position_embeddings=int(max_pos),
                rope_theta=theta,
                rope_scaling=scaling,
                rms_norm_eps=float(c.get("rms_norm_eps", RMS_NORM_EPS.get(self.family, 1e-6))),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", self.family in GEMMA_KEYS)),  # Gemma ties by default
                attention_bias=self.arch == "qwen2",  # Qwen2: q/k/v biases always; llama: refused above
                bos_token_id=c.get("bos_token_id"),
                eos_token_ids=eos_ids,
                pad_token_id=c.get("pad_token_id"),
                add_bos_token=bool(self._tokenizer_config().get("add_bos_token", False)),
                name=self.path.name,
                sliding_window=window,
                layer_types=types,
                **self._experts(),
                **gemma,
            )
        except KeyError as exc:
            raise self._refuse(f"missing field {exc.args[0]!r}") from None
        except CheckpointError:
            raise
        except ValueError as exc:  # ModelConfig's own checks name the field
            raise self._refuse(str(exc)) from None

    def _latent_attention(self, scaling: RopeScaling | None) -> dict:
        """DeepSeek-V2's MLA fields (the cache: one head of kv_lora_rank + qk_rope_head_dim), and
        its softmax scale where YaRN's mscale_all_dim widens it (transformers' yarn_apply_mscale);
        none for other families. Absent keys: DeepseekV2Config's defaults."""
        c = self.hf
        if self.family != "deepseek_v2":
            return {}
        lora, rope, nope = int(c.get("kv_lora_rank", 512)), int(c.get("qk_rope_head_dim", 64)), int(c.get("qk_nope_head_dim", 128))
        out = {"num_kv_heads": 1, "head_dim": lora + rope, "kv_lora_rank": lora, "q_lora_rank": int(c.get("q_lora_rank") or 0),
               "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": int(c.get("v_head_dim", 128))}
        rp = c.get("rope_scaling") or c.get("rope_parameters") or {}
        all_dim = rp.get("mscale_all_dim") if scaling is not None and scaling.rope_type == "yarn" else None
        if all_dim:
            from runtime.checkpoint.hf_rope import _yarn_mscale

            out["query_pre_attn_scalar"] = (nope + rope) / _yarn_mscale(scaling.factor, float(all_dim)) ** 4
        return out

    def _dense_layers(self) -> tuple[int, ...]:
        """The layers of a mixture of experts whose MLP is dense: Qwen3-MoE's mlp_only_layers
        and those decoder_sparse_step skips, DeepSeek-V2's first first_k_dense_replace."""
        c, n = self.hf, int(self.hf.get("num_hidden_layers", 0))
        if self.family == "deepseek_v2":
            return tuple(range(min(int(c.get("first_k_dense_replace", 0)), n)))
        if self.family == "qwen3_moe":
            only, step = set(c.get("mlp_only_layers") or ()), int(c.get("decoder_sparse_step", 1))
            return tuple(i for i in range(n) if i in only or (i + 1) % step)
        return ()

    def _experts(self) -> dict:
        """The ModelConfig fields of a mixture of experts (none for a dense family)."""
        c, fam = self.hf, self.family
        if fam == "deepseek_v2":  # (absent keys: DeepseekV2Config's defaults)
            return {"num_experts": int(c.get("n_routed_experts", 64)), "num_experts_per_tok": int(c.get("num_experts_per_tok", 6)),
                    "moe_intermediate_size": int(c.get("moe_intermediate_size", 1407)),
                    "num_shared_experts": int(c.get("n_shared_experts") or 0),
                    "routed_scaling_factor": float(c.get("routed_scaling_factor", 1.0)),
                    "topk_method": str(c.get("topk_method", "greedy")), "n_group": int(c.get("n_group") or 1),
                    "topk_group": int(c.get("topk_group") or 1), "norm_topk_prob": False,
                    "dense_layers": self._dense_layers()}
        if fam not in ("mixtral", "qwen3_moe"):
            return {}
        moe3 = fam == "qwen3_moe"  # absent keys: the config classes' defaults
        n = c.get("num_local_experts", c.get("num_experts", 128 if moe3 else 8))
        return {"num_experts": int(n), "num_experts_per_tok": int(c.get("num_experts_per_tok", 8 if moe3 else 2)),
                "moe_intermediate_size": int(c["moe_intermediate_size"] if fam == "qwen3_moe"
                                             else c["intermediate_size"]),
                "norm_topk_prob": fam == "mixtral" or bool(c.get("norm_topk_prob", False)),
                "dense_layers": self._dense_layers()}

    def _tokenizer_config(self) -> dict:
        p = self.path / "tokenizer_config.json"
        return _read_json(p) if p.is_file() else {}

    def num_tensors(self) -> int:
        fused = FUSED if self.arch == "phi3" else {}
        return sum(len(fused.get(name.split(".")[-2:][0], ("",))) for f in self.files
                   for name in read_safetensors_header(f)[0])

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        cfg = self.model_config() if self.arch == "phi3" else None
        for f in self.files:
            for name, a in read_safetensors(f):
                yield from (_unfuse(cfg, name, a) if cfg is not None else ((name, a),))

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


# Phi-3's fused projections -> the Llama names they hold, in row order (each [out, in]).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _unfuse(cfg: ModelConfig, name: str, a: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A fused weight split on read into the tensors HF_RULES map: qkv_proj's rows are q
    (heads x head_dim), k, v (KV heads x head_dim each); gate_up_proj's the gate, then up
    (transformers' Phi3MLP chunks it in two)."""
    prefix, part, leaf = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
    if part not in FUSED or leaf != "weight":
        yield name, a
        return
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    rows = (q, kv, kv) if part == "qkv_proj" else (cfg.intermediate_size,) * 2
    if a.ndim != 2 or a.shape[0] != sum(rows):
        raise CheckpointError(f"tensor {name!r} has shape {list(a.shape)}, expected [{sum(rows)}, {cfg.hidden_size}]")
    for sub, block in zip(FUSED[part], np.split(a, np.cumsum(rows)[:-1])):
        yield f"{prefix}.{sub}.{leaf}", block


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
