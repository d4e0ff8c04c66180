"""Gemma 2 / Gemma 3 config.json keys (transformers' Gemma2Config, Gemma3TextConfig), read and
checked for HFSource (runtime/checkpoint/hf_source.py): every key either becomes a ModelConfig
field, is checked against what pagedjax implements, or is refused in one line naming it."""

from __future__ import annotations

from typing import Any, Callable

# Hugging Face architecture -> (our architecture, the transformers family whose keys apply).
# Gemma3ForConditionalGeneration (the multimodal checkpoint: a nested text_config and
# language_model.* weights) is not listed: it is refused as an unsupported architecture.
GEMMA_ARCHS = {"Gemma2ForCausalLM": ("gemma2", "gemma2"), "Gemma3ForCausalLM": ("gemma3", "gemma3")}
_COMMON = frozenset({
    "attention_bias",  # refused when true (HFSource._check_keys)
    "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "hidden_activation", "use_bidirectional_attention",
    "cache_implementation",  # generation's KV cache class ("hybrid"): no effect on the outputs
})
GEMMA_KEYS = {
    "gemma2": _COMMON,
    "gemma3": _COMMON | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
}
GEMMA_MAX_POSITIONS = {"gemma2": 8192, "gemma3": 131072}
# transformers' defaults where a key is absent
_DEFAULTS = {
    "gemma2": {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"sliding_window": 4096, "attn_logit_softcapping": None, "final_logit_softcapping": None},
}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the tanh-approximated GELU


def _number(c: dict, key: str, default: Any, refuse: Callable[[str], Exception]) -> float | None:
    v = c.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise refuse(f"{key} {v!r} is not a positive number")
    return float(v)


def _layer_types(c: dict, family: str, n: int, refuse: Callable[[str], Exception]) -> list[str]:
    """layer_types as transformers derives it where absent: Gemma 2 alternates (even layers
    slide), Gemma 3 makes every sliding_window_pattern-th layer full (default 6)."""
    types = c.get("layer_types")
    if types is None:
        if family == "gemma2":
            return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        key = "sliding_window_pattern" if "sliding_window_pattern" in c else "_sliding_window_pattern"
        pattern = c.get(key, 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise refuse(f"{key} {pattern!r} is not a positive integer")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise refuse(f"layer_types has {len(types) if isinstance(types, list) else types!r} entries for {n} layers")
    bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if bad:
        raise refuse(f"layer_types {bad[0]!r} is not supported (supported: full_attention, sliding_attention)")
    return list(types)


def local_rope_theta(c: dict, refuse: Callable[[str], Exception]) -> float:
    """Gemma 3's sliding layers' RoPE base: rope_parameters.sliding_attention (transformers 5;
    plain RoPE only), else rope_local_base_freq (4.x), else Gemma3TextConfig's 10000."""
    rp = c.get("rope_parameters")
    sliding = rp.get("sliding_attention") if isinstance(rp, dict) else None
    if isinstance(sliding, dict):
        field = "rope_parameters.sliding_attention"
        rtype = sliding.get("rope_type", sliding.get("type", "default"))
        if rtype != "default":
            raise refuse(f"{field}.rope_type {rtype!r} is not supported (the sliding layers' RoPE: default only)")
        for key in sorted(set(sliding) - {"rope_type", "type", "rope_theta"}):
            raise refuse(f"{field}.{key} is not supported")
        if "rope_theta" in sliding:
            return _number(sliding, "rope_theta", None, lambda m: refuse(f"{field}.{m}")) or 10000.0
    return _number(c, "rope_local_base_freq", 10000.0, refuse) or 10000.0


def gemma_fields(c: dict, family: str, refuse: Callable[[str], Exception]) -> dict[str, Any]:
    """The ModelConfig fields particular to Gemma from config.json `c` (sliding_window included:
    the caller's generic window rules do not apply)."""
    act = c.get("hidden_activation", "gelu_pytorch_tanh")  # (hidden_act: transformers' Gemma ignores it)
    if act not in GELU_TANH:
        raise refuse(f"hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
    if c.get("use_bidirectional_attention"):
        raise refuse(f"use_bidirectional_attention {c['use_bidirectional_attention']!r} is not supported "
                     "(causal attention only)")
    d = _DEFAULTS[family]
    if family == "gemma3" and c.get("attn_logit_softcapping") is not None:
        raise refuse(f"attn_logit_softcapping {c['attn_logit_softcapping']!r} is not supported for gemma3 "
                     "(transformers' Gemma 3 attention does not apply it)")
    n = int(c.get("num_hidden_layers", 0))
    types = _layer_types(c, family, n, refuse)
    window = c.get("sliding_window", d["sliding_window"])
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise refuse(f"sliding_window {window!r} is not a positive integer")
    windowed = "sliding_attention" in types
    return {
        "sliding_window": window if windowed else None,
        "layer_types": tuple(types) if windowed else (),
        "query_pre_attn_scalar": _number(c, "query_pre_attn_scalar", 256, refuse),
        "attn_logit_softcapping": _number(c, "attn_logit_softcapping", d["attn_logit_softcapping"], refuse),
        "final_logit_softcapping": _number(c, "final_logit_softcapping", d["final_logit_softcapping"], refuse),
        "rope_local_theta": local_rope_theta(c, refuse) if family == "gemma3" else None,
        "hidden_activation": "gelu_tanh",
    }
