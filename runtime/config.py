"""Frozen configuration records.

ModelConfig comes from a checkpoint's config.json; CacheConfig and SchedulerConfig fix
the compiled envelope at start; AdmissionPolicy holds the live, operator-tunable knobs.
Validation raises ValueError naming the field, never `assert`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1}
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
# Channels per int8 KV scale and zero, for K and for V (why: runtime/model/kv_pages.py).
INT8_KV_GROUP = {"k": 8, "v": 32, "latent": 32}  # latent: an MLA cache's one row per token (keys and values)


def kv_scale_groups(kv_dtype: str, head_dim: int, part: str) -> int:
    """Scale groups per token and KV head of a quantized cache's K or V (`part` "k" / "v"):
    int8 one per INT8_KV_GROUP[part] channels (one per head where head_dim does not divide),
    fp8 one per head; 0 unquantized."""
    if kv_dtype == "int8":
        g = INT8_KV_GROUP[part]
        return head_dim // g if head_dim % g == 0 else 1
    return 1 if kv_dtype in QUANTIZED_KV_DTYPES else 0


def kv_scale_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes beside one token's head of K and V together: int8 a float16 scale and zero per
    group, fp8 one float32 scale each, 0 unquantized."""
    return sum(kv_scale_groups(kv_dtype, head_dim, part) for part in "kv") * 4


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


# RoPE frequency scalings the model implements (runtime/model/families/llama.py rope_inv_freq);
# "default" (no scaling) is rope_scaling null.
ROPE_TYPES = ("llama3", "linear", "freq_factors", "yarn", "dynamic", "longrope")
# Per rope_type: the fields it reads. Any other field must keep its default, so a config.json
# edited (or written by a newer version) to set one is refused, not silently ignored.
_ROPE_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "freq_factors": ("freq_factors",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor"),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "longrope": ("freq_factors", "original_max_position_embeddings", "attention_factor"),
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. rope_type "llama3": Llama 3.1's (long wavelengths slowed by
    `factor`, short ones kept, smooth between); "linear": positions divided by `factor`;
    "freq_factors": each inverse frequency divided by its own factor (llama.cpp's
    `rope_freqs.weight`, the form a GGUF carries llama3 scaling in); "yarn": YaRN (static, as
    transformers): frequencies that turn fewer than beta_slow times over
    original_max_position_embeddings divided by `factor`, those turning more than beta_fast
    times kept, a linear ramp over the dimensions between; "dynamic": NTK-aware scaling,
    which only changes the frequencies once a sequence passes original_max_position_embeddings
    (transformers recomputes them for the whole sequence then, which a KV cache cannot follow),
    so it is the default RoPE up to there and served only up to there; "longrope" (Phi-3):
    `freq_factors` are the short factors, used while a sequence stays within
    original_max_position_embeddings (past it transformers switches every position to the
    long factors: not servable with a KV cache, so served only up to there). yarn and
    longrope multiply cos and sin by `attention_factor`. rope_type comes after the llama3
    fields and defaults to llama3: checkpoints converted before it existed were all llama3."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    freq_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0  # yarn, longrope: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: the ramp's ends, in rotations over original_max_position_embeddings
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole dimensions

    def __post_init__(self) -> None:
        _check(self.rope_type in ROPE_TYPES, "rope_scaling.rope_type",
               f"{self.rope_type!r} is not supported (supported: default, {', '.join(ROPE_TYPES)})")
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))  # hashable: jit's static arg
        used = _ROPE_FIELDS[self.rope_type]
        for fld in dataclasses.fields(self):
            if fld.name not in used and fld.name != "rope_type" and getattr(self, fld.name) != fld.default:
                raise ValueError(f"rope_scaling.{fld.name}: not used by rope_type {self.rope_type!r}")
        if "freq_factors" in used:
            _check(bool(self.freq_factors) and all(math.isfinite(f) and f > 0 for f in self.freq_factors),
                   "rope_scaling.freq_factors", "must be positive finite numbers, one per rotary frequency")
        if "factor" in used:
            _check(math.isfinite(self.factor) and self.factor > 0, "rope_scaling.factor",
                   f"must be positive, got {self.factor}")
        if "original_max_position_embeddings" in used:
            _check(self.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings",
                   "must be positive")
        if self.rope_type == "llama3":
            _check(self.high_freq_factor > self.low_freq_factor > 0, "rope_scaling.high_freq_factor",
                   f"must exceed low_freq_factor (> 0), got {self.high_freq_factor} and {self.low_freq_factor}")
        _check(math.isfinite(self.attention_factor) and self.attention_factor > 0, "rope_scaling.attention_factor",
               f"must be positive, got {self.attention_factor}")
        for beta in ("beta_fast", "beta_slow"):
            _check(math.isfinite(getattr(self, beta)), f"rope_scaling.{beta}", f"must be a number, got {getattr(self, beta)}")
        _check(isinstance(self.truncate, bool), "rope_scaling.truncate", f"must be true or false, got {self.truncate!r}")

    @property
    def max_exact_len(self) -> int | None:
        """The longest sequence this scaling is served exactly for (dynamic, longrope: their
        frequencies change past original_max_position_embeddings), None where any length is."""
        return self.original_max_position_embeddings if self.rope_type in ("dynamic", "longrope") else None

    def to_json(self) -> dict[str, Any]:
        """Only the fields its rope_type uses."""
        d = {"rope_type": self.rope_type, **{k: getattr(self, k) for k in _ROPE_FIELDS[self.rope_type]}}
        if "freq_factors" in d:
            d["freq_factors"] = list(self.freq_factors)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RopeScaling":
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        _check(not unknown, "rope_scaling", f"unknown fields {unknown}")
        return cls(**d)


ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "deepseek_v2")  # runtime/model/families FAMILIES
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's activation: SwiGLU, or GeGLU (tanh GELU)
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "deepseek_v2")
TOPK_METHODS = ("greedy", "group_limited_greedy")  # DeepSeek-V2's router: over all experts, or the best groups'


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a family of runtime/models: "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    add_bos_token: bool = False
    name: str = "model"
    # Sliding-window attention: a query at position p sees keys p - sliding_window + 1 .. p
    # on the layers `layer_types` marks "sliding_attention" (every layer when layer_types is
    # empty and sliding_window is set: Mistral). None: full attention everywhere.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()   # per layer: "full_attention" | "sliding_attention"; () = uniform
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5 (default head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (global: rope_theta)
    hidden_activation: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    # Mixture of experts (mixtral, qwen3_moe; runtime/model/families/moe.py): every layer's MLP is
    # num_experts SwiGLU experts of width moe_intermediate_size, num_experts_per_tok per token
    # picked by a softmax router, their weights renormalised to sum 1 when norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Layers whose MLP is a dense SwiGLU of intermediate_size in a mixture of experts
    # (DeepSeek-V2's first_k_dense_replace, Qwen3-MoE's mlp_only_layers / decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()
    num_shared_experts: int = 0  # DeepSeek-V2: a SwiGLU of num_shared * moe_intermediate_size every token runs
    routed_scaling_factor: float = 1.0  # DeepSeek-V2: the routed experts' weights multiplied by it
    topk_method: str = "greedy"  # TOPK_METHODS; group_limited_greedy: top experts of the topk_group best of n_group
    n_group: int = 1
    topk_group: int = 1
    # Multi-head latent attention (deepseek_v2; runtime/model/families/deepseek.py): the KV cache
    # holds one row of kv_lora_rank + qk_rope_head_dim per token and layer, stored as
    # num_kv_heads = 1 of head_dim = that width; q_lora_rank 0 = a plain query projection.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check(getattr(self, f) > 0, f, "must be positive")
        _check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
               f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        _check(self.architecture in ARCHITECTURES, "architecture",
               f"unsupported architecture {self.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
        _check(self.sliding_window is None or self.sliding_window > 0, "sliding_window", "must be positive")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # hashable: jit's static arg
        _check(not self.layer_types or len(self.layer_types) == self.num_layers, "layer_types",
               f"has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        _check(not bad, "layer_types", f"{bad[:1]} not supported (supported: {', '.join(LAYER_TYPES)})")
        _check(self.sliding_window is not None or "sliding_attention" not in self.layer_types, "layer_types",
               "has sliding_attention layers but sliding_window is not set")
        moe = self.architecture in MOE_ARCHITECTURES
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        _check(all(0 <= i < self.num_layers for i in self.dense_layers) and len(set(self.dense_layers))
               == len(self.dense_layers), "dense_layers", f"must be distinct layers 0..{self.num_layers - 1}")
        _check(moe or not self.dense_layers, "dense_layers", f"{self.architecture} has no experts")
        _check(self.topk_method in TOPK_METHODS, "topk_method",
               f"{self.topk_method!r} not supported (supported: {', '.join(TOPK_METHODS)})")
        _check(self.n_group > 0 and self.num_experts % self.n_group == 0 and 0 < self.topk_group <= self.n_group,
               "n_group", f"{self.num_experts} experts in {self.n_group} groups, {self.topk_group} picked")
        _check(self.topk_method == "greedy" or self.topk_group * (self.num_experts // self.n_group)
               >= self.num_experts_per_tok, "topk_group", "its groups hold fewer experts than num_experts_per_tok")
        mla = self.architecture == "deepseek_v2"
        _check(not mla or min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) > 0,
               "kv_lora_rank", "deepseek_v2 needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim")
        _check(not mla or (self.num_kv_heads == 1 and self.head_dim == self.kv_lora_rank + self.qk_rope_head_dim),
               "head_dim", "a latent cache is one head of kv_lora_rank + qk_rope_head_dim")
        _check(mla or not self.kv_lora_rank, "kv_lora_rank", f"{self.architecture} has no latent attention")
        _check(not moe or self.num_experts > 0, "num_experts", f"{self.architecture} needs experts")
        _check(not moe or 0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
               f"must be 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}")
        _check(not moe or self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
        _check(moe or self.num_experts == 0, "num_experts", f"{self.architecture} has no experts")
        _check(self.hidden_activation in ACTIVATIONS, "hidden_activation",
               f"{self.hidden_activation!r} not supported (supported: {', '.join(ACTIVATIONS)})")
        for f in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
            v = getattr(self, f)
            _check(v is None or (math.isfinite(v) and v > 0), f, f"must be positive, got {v}")
        s = self.rope_scaling
        _check(s is None or s.rope_type not in ("freq_factors", "longrope") or len(s.freq_factors) == self.head_dim // 2,
               "rope_scaling.freq_factors", f"needs one factor per rotary frequency ({self.head_dim // 2})")
        exact = s.max_exact_len if s is not None else None
        _check(exact is None or self.max_position_embeddings <= exact, "max_position_embeddings",
               f"{self.max_position_embeddings} is past where {s.rope_type if s else ''} RoPE scaling is served "
               f"exactly ({exact}; the long-context factors are not implemented)")

    def layer_windows(self) -> tuple[int, ...]:
        """Per layer: the number of keys a query sees (its window), 0 for full attention."""
        w = self.sliding_window or 0
        if not self.layer_types:
            return (w,) * self.num_layers
        return tuple(w if t == "sliding_attention" else 0 for t in self.layer_types)

    # --- sizes used by inspect, the engine log and the planner -----------------
    @property
    def mla(self) -> bool:
        """Multi-head latent attention: the cache holds one latent row per token and layer."""
        return self.kv_lora_rank > 0

    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the experts (every layer but dense_layers; none if dense)."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers) if self.num_experts else ()

    def param_count(self) -> int:
        d, f, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
        if self.mla:
            H, c, r, qk = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim
            q_proj = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * (qk + r) if self.q_lora_rank
                      else d * H * (qk + r))
            attn = q_proj + d * (c + r) + c + c * H * (qk + self.v_head_dim) + H * self.v_head_dim * d
        norms = 4 if self.architecture in ("gemma2", "gemma3") else 2  # Gemma: post-attention and post-MLP norms too
        qk_norms = 2 * self.head_dim if self.architecture in ("qwen3", "gemma3", "qwen3_moe") else 0
        moe = (self.num_experts + self.num_shared_experts) * 3 * d * self.moe_intermediate_size + d * self.num_experts
        mlp = len(self.moe_layers()) * moe + (L - len(self.moe_layers())) * 3 * d * f
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return L * (attn + norms * d + qk_norms) + mlp + emb + d

    def expert_param_count(self) -> int:
        """Parameters of one expert of one layer (0 for a dense model)."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.num_experts else 0

    def params_touched(self, tokens: float) -> float:
        """Parameters a step over `tokens` tokens reads: everything but the experts, plus per
        layer the experts those tokens are expected to pick (with uniform routing,
        E * (1 - (1 - k/E)^tokens) distinct experts); param_count() for a dense model.
        One token: the active parameters."""
        p = self.param_count()
        if not self.num_experts:
            return float(p)
        E, k = self.num_experts, self.num_experts_per_tok
        distinct = E * (1.0 - (1.0 - k / E) ** max(tokens, 0.0))
        return p - len(self.moe_layers()) * (E - distinct) * self.expert_param_count()

    def kv_bytes_per_token(self, kv_dtype: str = "bfloat16") -> int:
        """Layers x KV heads x (2 (K and V) x head dim x bytes per element, plus a quantized
        cache's scales and zeros: kv_scale_bytes). Latent attention: layers x one latent row
        (it is the keys and, through its first kv_lora_rank columns, the values)."""
        if self.mla:  # (a quantized latent row: its scales and zeros, or its fp8 scale, beside it)
            scale = kv_scale_groups(kv_dtype, self.head_dim, "latent") * 4
            return self.num_layers * (self.head_dim * DTYPE_BYTES[kv_dtype] + scale)
        scale = kv_scale_bytes(kv_dtype, self.head_dim)
        return self.num_layers * self.num_kv_heads * (2 * self.head_dim * DTYPE_BYTES[kv_dtype] + scale)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["dense_layers"] = list(self.dense_layers)
        d["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        _check(not unknown, "config.json", f"unknown fields {sorted(unknown)}")
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling.from_json(d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["layer_types"] = tuple(d.get("layer_types") or ())
        d["dense_layers"] = tuple(d.get("dense_layers") or ())
        return cls(**d)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        return cls.from_json(json.loads(path.read_text()))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024
    kv_dtype: str = "float32"
    enable_prefix_cache: bool = True
    # A model with sliding-window layers: split the layers into KV groups and release the
    # blocks a window has passed (runtime/kv_groups.py; num_blocks then counts pages of
    # a group's layers). False keeps every block of every layer (the reference layout).
    kv_groups: bool = True

    def __post_init__(self) -> None:
        _check(self.block_size in (8, 16, 32, 64), "block_size", "must be one of 8, 16, 32, 64")
        _check(self.num_blocks >= 2, "num_blocks", "must be at least 2")
        _check(self.kv_dtype in DTYPE_BYTES, "kv_dtype", f"must be one of {sorted(DTYPE_BYTES)}")

    @property
    def num_tokens(self) -> int:
        return self.block_size * self.num_blocks

    def bytes_per_block(self, model: ModelConfig) -> int:
        """One block (page) of the pool: block_size tokens of one KV group's layers (all
        layers for a model without sliding layers; runtime/kv_groups.py)."""
        from runtime.kv_groups import KVGroups

        group = KVGroups.of(model, self.kv_groups).group_size
        return model.kv_bytes_per_token(self.kv_dtype) * self.block_size * group // model.num_layers

    @classmethod
    def from_memory(cls, model: ModelConfig, memory_bytes: int, block_size: int = 16,
                    kv_dtype: str = "float32", enable_prefix_cache: bool = True,
                    kv_groups: bool = True) -> "CacheConfig":
        per_block = cls(block_size=block_size, kv_dtype=kv_dtype, kv_groups=kv_groups).bytes_per_block(model)
        n = int(memory_bytes // per_block)
        _check(n >= 2, "kv_cache_memory",
               f"{memory_bytes} bytes hold {n} blocks of {per_block} bytes; need at least 2")
        return cls(block_size=block_size, num_blocks=n, kv_dtype=kv_dtype,
                   enable_prefix_cache=enable_prefix_cache, kv_groups=kv_groups)


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '123456' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    units = {"gib": GiB, "gb": 10**9, "g": GiB, "mib": 1 << 20, "mb": 10**6, "m": 1 << 20,
             "kib": 1 << 10, "kb": 10**3, "k": 1 << 10, "b": 1}
    for suffix, mult in units.items():
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], mult
            break
    else:
        scale = 1
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"kv_cache_memory: cannot parse {text!r} (use bytes or e.g. 2GiB, 512MiB)") from None
    _check(value > 0, "kv_cache_memory", "must be positive")
    return int(value * scale)


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclass(frozen=True)
class SchedulerConfig:
    """The compiled envelope: shapes XLA compiles once at start."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    min_token_bucket: int = 8

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               f"must be >= max_num_seqs ({self.max_num_seqs})")
        _check(self.max_model_len >= 16, "max_model_len", "must be >= 16")

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        return pow2_buckets(1, self.max_num_seqs)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Powers of two up to the budget, plus 3/4 of a budget of 256+: a step costs about its
        bucket, and the tail steps of a prefill burst (the system prompt alone, the last chunk)
        land just above half the budget (the 64-chat burst's first step, 356 tokens: 678-717 ms
        in the 512 shape, 544-598 ms in 384, 2-core EPYC)."""
        b = pow2_buckets(1, self.max_num_batched_tokens)
        top = self.max_num_batched_tokens * 3 // 4
        return tuple(sorted({*b, top})) if self.max_num_batched_tokens >= 256 and top > b[-2] else b

    def bucket_pairs(self) -> list[tuple[int, int]]:
        """(num_seqs, num_tokens) shapes compiled at start. Pure-decode steps (tokens ==
        seqs) get one shape per sequence bucket; steps with prefill chunks get one shape
        per token bucket, with as many sequence slots as fit. This keeps the program count
        linear (|seq buckets| + |token buckets|), not their product."""
        pairs = {(s, s) for s in self.seq_buckets}
        pairs |= {(min(t, self.max_num_seqs), t) for t in self.token_buckets if t >= self.min_token_bucket}
        return sorted(pairs)

    def bucket_for(self, num_seqs: int, num_tokens: int) -> tuple[int, int]:
        if num_tokens == num_seqs:
            s = next(b for b in self.seq_buckets if b >= num_seqs)
            return s, s
        t = next(b for b in self.token_buckets if b >= max(num_tokens, self.min_token_bucket))
        return min(t, self.max_num_seqs), t


AdmissionMode = Literal["reserve", "optimistic"]


@dataclass(frozen=True)
class AdmissionPolicy:
    """Live knobs; replaced whole (never mutated) at a step boundary."""

    watermark: float = 0.05
    admission_mode: AdmissionMode = "optimistic"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 512
    max_admissions_per_step: int = 32
    max_queue_len: int = 1024
    max_queued_tokens: int = 1 << 22  # the one default: runtime/core/engine_args.py's flag takes it
    # Service-level targets per priority tier, in seconds (0: none); the console and /metrics
    # show how many requests (TTFT) and tokens (ITL) meet them (runtime/core/metrics.py slo_attainment).
    slo_ttft_interactive_s: float = 0.0
    slo_itl_interactive_s: float = 0.0
    slo_ttft_batch_s: float = 0.0
    slo_itl_batch_s: float = 0.0

    # (low, high) allowed ranges, shown by the console next to each field.
    @staticmethod
    def ranges(envelope: SchedulerConfig) -> dict[str, tuple[Any, Any]]:
        return {
            "watermark": (0.0, 0.95),
            "admission_mode": ("reserve", "optimistic"),
            "max_num_seqs": (1, envelope.max_num_seqs),
            "max_num_batched_tokens": (1, envelope.max_num_batched_tokens),
            "long_prefill_token_threshold": (1, envelope.max_num_batched_tokens),
            "max_admissions_per_step": (1, 4096),
            "max_queue_len": (0, 1_000_000),
            "max_queued_tokens": (0, 1 << 40),
            "slo_ttft_interactive_s": (0.0, 3600.0), "slo_itl_interactive_s": (0.0, 3600.0),
            "slo_ttft_batch_s": (0.0, 3600.0), "slo_itl_batch_s": (0.0, 3600.0),
        }

    def validate(self, envelope: SchedulerConfig) -> None:
        for name, (lo, hi) in self.ranges(envelope).items():
            value = getattr(self, name)
            if name == "admission_mode":
                _check(value in (lo, hi), name, f"must be 'reserve' or 'optimistic', got {value!r}")
                continue
            real = name == "watermark" or name.startswith("slo_")
            if real:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool)
            _check(ok, name, f"must be a {'number' if real else 'whole number'}, got {value!r}")
            _check(lo <= value <= hi, name, f"must be between {lo} and {hi}, got {value}")

    def replace(self, envelope: SchedulerConfig, **changes: Any) -> "AdmissionPolicy":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown policy field (known: {', '.join(sorted(known))})")
        new = dataclasses.replace(self, **changes)
        new.validate(envelope)
        return new

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


F32_KERNEL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class KernelConfig:
    """The hand-written CPU paths (runtime/kernels/cpu). Each is used only where it is built for
    this CPU and was measured faster; these switch one off for an A/B or a workaround (the
    outputs are the same). An environment variable in ENV, when set, overrides its field
    (`with_env`, the one place they are read): handy for an A/B without a new command line."""

    cpu_kernels: bool = True        # C++ attention and products at all (off: plain XLA)
    f32_kernel: str = "auto"        # float32 products: auto (where preferred for this CPU) | on | off
    amx: bool = True                # int8 products of 16+ rows on AMX tiles where the CPU has them
    per_layer_weights: bool = True  # layer weights as separate arrays (no scanned-slice copies)
    huge_pages: bool = True         # weights and KV cache on 2 MB pages (Linux)
    linger_us: int = 100            # a pool helper waits this long for the next call's work (0: sleep)

    ENV: ClassVar[dict[str, str]] = {
        "cpu_kernels": "PAGEDJAX_CPU_KERNELS", "f32_kernel": "PAGEDJAX_F32_KERNEL", "amx": "PAGEDJAX_AMX",
        "per_layer_weights": "PAGEDJAX_PER_LAYER_WEIGHTS", "huge_pages": "PAGEDJAX_HUGEPAGES",
        "linger_us": "PAGEDJAX_LINGER_US"}

    def __post_init__(self) -> None:
        _check(self.f32_kernel in F32_KERNEL_MODES, "f32_kernel", f"must be one of {', '.join(F32_KERNEL_MODES)}")
        _check(self.linger_us >= 0, "linger_us", "must be >= 0")

    def with_env(self, environ: Any = None) -> "KernelConfig":
        """This config with the set environment variables of ENV applied (1/0 for the switches,
        1/0 for f32_kernel's on/off, microseconds for linger_us)."""
        import os

        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for name, var in self.ENV.items():
            v = env.get(var)
            if v is None or v == "":
                continue
            if name == "f32_kernel":
                changes[name] = {"1": "on", "0": "off"}.get(v, v)
            elif name == "linger_us":
                changes[name] = int(v)
            else:
                changes[name] = v != "0"
        return dataclasses.replace(self, **changes) if changes else self


SPEC_METHODS = ("ngram", "suffix", "draft_model")  # implemented proposers (runtime/core/speculative.py)
SPEC_NOT_YET = {"eagle": "EAGLE",
                "eagle3": "EAGLE-3", "mtp": "multi-token prediction", "medusa": "Medusa"}


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (runtime/core/lora.py, runtime/model/lora.py): `max_loras` adapter slots
    on the device (a step's rows use at most that many adapters), each up to `max_lora_rank`;
    `max_cpu_loras` adapters kept read on the host beyond them (LRU; others are read from disk
    again when a request names them). `dtype`: how the slots hold the adapters' matrices
    (float32: exact; bfloat16: half the bytes each step reads, the products still in float32)."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 32
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check(isinstance(self.max_loras, int) and 1 <= self.max_loras <= 256, "max_loras",
               f"must be 1..256, got {self.max_loras!r}")
        _check(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512, "max_lora_rank",
               f"must be 1..512, got {self.max_lora_rank!r}")
        _check(isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
               f"must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        _check(self.dtype in ("float32", "bfloat16"), "lora_dtype", f"must be float32 or bfloat16, got {self.dtype!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON keys): which proposer, how many tokens it may
    propose per step, and where speculation stops paying (`disable_by_batch_size`: a step
    of that many running requests or more is compute-bound enough that verifying drafts
    costs more than it saves, and it also gives up the host/device overlap)."""

    method: str = "ngram"
    num_speculative_tokens: int = 7  # with the last token, a batch-1 step's 8-token shape
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4   # measured: BENCHMARKS.md, "Speculative decoding"
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished outputs it proposes from
    model: str | None = None         # draft_model: the draft's checkpoint directory (same tokenizer)

    def __post_init__(self) -> None:
        if self.method in SPEC_NOT_YET:
            raise ValueError(f"speculative_config.method: {SPEC_NOT_YET[self.method]} ({self.method!r}) is not "
                             f"implemented yet; implemented: {', '.join(SPEC_METHODS)}")
        _check(self.method in SPEC_METHODS, "speculative_config.method",
               f"must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        _check((self.method == "draft_model") == (self.model is not None), "speculative_config.model",
               "the draft's checkpoint directory, with method \"draft_model\" (and only with it)")
        _check(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
               "speculative_config.num_speculative_tokens", f"must be 1..16, got {self.num_speculative_tokens!r}")
        _check(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
               "speculative_config.prompt_lookup_min", f"must be >= 1, got {self.prompt_lookup_min!r}")
        _check(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "speculative_config.prompt_lookup_max",
               f"must be >= prompt_lookup_min ({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}")
        _check(isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 1,
               "speculative_config.disable_by_batch_size", f"must be >= 1, got {self.disable_by_batch_size!r}")
        _check(isinstance(self.suffix_decoding_max_cached_requests, int)
               and self.suffix_decoding_max_cached_requests >= 1,
               "speculative_config.suffix_decoding_max_cached_requests",
               f"must be >= 1, got {self.suffix_decoding_max_cached_requests!r}")

    @classmethod
    def parse(cls, text: "str | dict[str, Any] | None") -> "SpeculativeConfig | None":
        """JSON text or a dict -> config; None or "" -> None (off). Unknown keys are refused."""
        if text is None or text == "":
            return None
        try:
            d = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
        _check(isinstance(d, dict), "speculative_config", "must be a JSON object")
        if d.get("method") in SPEC_NOT_YET:
            cls(method=d["method"])  # (raises the one-line refusal naming it)
        known = {f.name for f in dataclasses.fields(cls)}
        if (d.get("method", "ngram") == "draft_model") != (d.get("model") is not None):
            raise ValueError("speculative_config.model: the draft's checkpoint directory, with method "
                             "\"draft_model\" (and only with it)")
        if d.get("method", "ngram") != "suffix" and "suffix_decoding_max_cached_requests" in d:
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests: only for method \"suffix\"")
        unknown = sorted(set(d) - known)
        _check(not unknown, "speculative_config", f"unsupported key(s) {', '.join(unknown)}; "
               f"supported: {', '.join(sorted(known))}")
        return cls(**d)


@dataclass(frozen=True)
class EvictionAlert:
    """The KV eviction rate as a capacity signal (the seeds: alert at 5% under normal load,
    underprovisioned above 10%): over the last `window_s` seconds, the blocks of in-flight or
    recently used prefixes the pool lost (a preempted request's uncached blocks; cached blocks
    evicted within `window_s` of their last use) over the blocks it allocated. `warn` and
    `alert` are the rates that change its state (runtime/core/metrics.py eviction_signal)."""
    window_s: float = 60.0
    warn: float = 0.05
    alert: float = 0.10

    def __post_init__(self) -> None:
        _check(math.isfinite(self.window_s) and self.window_s > 0, "eviction_window", "must be a positive number of seconds")
        _check(0 < self.warn <= self.alert <= 1, "eviction_warn",
               f"need 0 < warn <= alert <= 1, got warn {self.warn} and alert {self.alert}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    attention_backend: str = "auto"  # auto | xla | pallas
    dtype: str = "float32"
    async_scheduling: bool = True    # plan and launch step N+1 while step N runs on the device
    quantization: str = "auto"       # auto (as the checkpoint stores it) | none | w8a8 | w8a16 | w4a16 (runtime/model/quant.py)
    quantize_lm_head: bool = False   # w8a8: an int8 LM head too (faster, less accurate: runtime/model/quant.py)
    tensor_parallel_size: int = 1    # devices the model is sharded over (runtime/model/tp.py); 1: one device
    kernels: KernelConfig = field(default_factory=KernelConfig)  # the CPU kernels' switches
    speculative: SpeculativeConfig | None = None  # speculative decoding (runtime/core/speculative.py); None: off
    eviction: EvictionAlert = field(default_factory=EvictionAlert)  # the eviction-rate signal's window and thresholds
    kv_offload_memory: int = 0  # bytes of host RAM for the second KV tier (runtime/core/kv_tiers.py); 0: none
    kv_offload_dir: str | None = None  # the third tier's directory (survives restarts); None: none
    kv_offload_disk: int = 8 * GiB     # bytes the third tier may take on disk
    # auto: a batch-tier victim's KV goes to the host tier and back when that pays
    # (runtime/core/kv_tiers.py SwapSpace.decide; needs kv_offload_memory); recompute: never
    preemption_mode: str = "auto"
    request_ledger: bool = True  # each request's decisions and reasons (runtime/core/ledger.py); off: none kept
    otlp_traces_endpoint: str | None = None  # finished requests' ledgers as OpenTelemetry spans (runtime/core/tracing.py)
    lora: LoraConfig | None = None  # multi-LoRA serving (runtime/core/lora.py); None: base weights only
