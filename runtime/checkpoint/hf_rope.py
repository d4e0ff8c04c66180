"""RoPE from a Hugging Face config.json: its rope_type's keys read, checked, or refused in one
line naming the field, as transformers' modeling_rope_utils reads them (HFSource._rope picks
the dict: rope_scaling or rope_parameters, or one of its per-layer-type dicts)."""

from __future__ import annotations

import math
from typing import Callable

from runtime.checkpoint.mapping import CheckpointError
from runtime.config import RopeScaling

Refuse = Callable[[str], CheckpointError]  # HFSource._refuse: "<config.json>: msg"

# rope_type -> the keys of its dict that it reads (beside rope_type/type, rope_theta and the
# no-op partial_rotary_factor / attention_factor checked below)
ROPE_KEYS = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                      "mscale", "mscale_all_dim", "truncate"),
             "longrope": ("short_factor", "long_factor", "factor", "attention_factor",
                          "original_max_position_embeddings")}


# rope_theta where config.json has none: the config class's default (10000 elsewhere)
ROPE_THETA = {"mixtral": 1e6, "qwen3_moe": 10000.0}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for `factor` (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_rope(c: dict, family: str, field: str, rp: dict, max_pos: int,
              refuse: Refuse) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rp`, the RoPE dict of config.json `c` (named `field` in
    messages); `max_pos`: max_position_embeddings (the config class's default if absent)."""
    rtype = rp.get("rope_type", rp.get("type", "default"))
    tfield = f"{field}.{'rope_type' if 'rope_type' in rp else 'type'}"
    if family == "phi3":  # Phi3Config reads its LongRoPE's older names as longrope, and knows no other
        rtype = "longrope" if rtype in ("su", "yarn") else rtype
        if rtype not in ("default", "longrope"):
            raise refuse(f"{tfield} {rtype!r} is not supported for phi3 (supported: default, longrope)")
    if not isinstance(rtype, str) or rtype not in ROPE_KEYS:
        raise refuse(f"{tfield} {rtype!r} is not supported (supported: {', '.join(sorted(ROPE_KEYS))})")
    for key in sorted(set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", "attention_factor"}
                      - set(ROPE_KEYS[rtype])):
        raise refuse(f"{field}.{key} is not supported with rope_type {rtype!r}")
    if "truncate" in rp and "." in field:  # transformers reads truncate from the outer dict only
        raise refuse(f"{field}.truncate is not supported in a per-layer-type dict")
    for key, why in (("partial_rotary_factor", "partial rotary embeddings are not implemented"),
                     ("attention_factor", f"rope_type {rtype!r} does not scale cos and sin")):
        if key not in ROPE_KEYS[rtype] and rp.get(key) not in (None, 1, 1.0):
            raise refuse(f"{field}.{key} {rp[key]!r} is not supported ({why})")

    def num(key: str, kind: type = float, default: object = None) -> float:
        v = rp.get(key, default)
        if v is None:
            raise refuse(f"{field}.{key} is missing (rope_type {rtype!r} needs it)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
            raise refuse(f"{field}.{key} {v!r} is not a number")
        return kind(v)

    def given(key: str) -> bool:  # as transformers reads it: factor, attention_factor unless null; others if truthy
        return rp.get(key) is not None if key in ("factor", "attention_factor") else bool(rp.get(key))

    theta = num("rope_theta", default=c.get("rope_theta", ROPE_THETA.get(family, 10000.0)))
    orig_key = "original_max_position_embeddings"
    if rtype in ("llama3", "yarn", "longrope"):
        # transformers: a top-level original_max_position_embeddings wins (Phi3Config always
        # has one, 4096 by default); else the dict's; else max_position_embeddings
        orig = c.get(orig_key, 4096 if family == "phi3" else rp.get(orig_key))
        rp = {**rp, orig_key: max_pos if orig is None else orig}
    try:
        if rtype == "linear":
            return theta, RopeScaling(num("factor"), rope_type="linear")
        if rtype == "llama3":
            return theta, RopeScaling(num("factor"), num("low_freq_factor"), num("high_freq_factor"),
                                      int(num(orig_key, int)), rope_type="llama3")
        if rtype == "dynamic":  # NTK: the default RoPE up to max_position_embeddings (RopeScaling)
            return theta, RopeScaling(num("factor"), original_max_position_embeddings=int(max_pos),
                                      rope_type="dynamic")
        if rtype == "default":
            return theta, None
        orig = int(num(orig_key, int))  # yarn, longrope
        # an absent factor is the context's growth (transformers: "Phi3 and DeepSeek-V3 do this")
        factor = num("factor") if given("factor") else float(max_pos) / orig
        if rtype == "yarn":
            truncate = rp.get("truncate", True)
            if not isinstance(truncate, bool):
                raise refuse(f"{field}.truncate {truncate!r} is not true or false")
            if given("attention_factor"):
                attention = num("attention_factor")
            elif given("mscale") and given("mscale_all_dim"):  # DeepSeek's form; our families scale cos/sin only
                attention = _yarn_mscale(factor, num("mscale")) / _yarn_mscale(factor, num("mscale_all_dim"))
            else:
                attention = _yarn_mscale(factor)
            return theta, RopeScaling(factor, original_max_position_embeddings=orig, rope_type="yarn",
                                      attention_factor=attention, truncate=truncate,
                                      beta_fast=num("beta_fast") if given("beta_fast") else 32.0,
                                      beta_slow=num("beta_slow") if given("beta_slow") else 1.0)
        if rtype == "longrope":  # the short factors; the long ones apply past orig only, never served
            short = _rope_factors(c, field, rp, refuse, "short_factor")
            _rope_factors(c, field, rp, refuse, "long_factor")
            attention = num("attention_factor") if given("attention_factor") else (
                1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
            return theta, RopeScaling(rope_type="longrope", freq_factors=short, original_max_position_embeddings=orig,
                                      attention_factor=attention)
    except CheckpointError:
        raise
    except ValueError as exc:  # RopeScaling's checks: "rope_scaling.<key>: why"
        raise refuse(f"{field}.{str(exc).removeprefix('rope_scaling.')}") from None
    raise AssertionError(f"ROPE_KEYS has {rtype!r} but read_rope does not read it")


def _rope_factors(c: dict, field: str, rp: dict, refuse: Refuse, key: str) -> tuple[float, ...]:
    """longrope's per-frequency factors: one positive number per rotary frequency."""
    v = rp.get(key)
    heads = c.get("num_attention_heads")
    dim = c.get("head_dim") or (c.get("hidden_size", 0) // heads if heads else 0)
    if (not isinstance(v, list) or len(v) != dim // 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v)):
        raise refuse(f"{field}.{key} is not a list of {dim // 2} positive numbers (one per rotary frequency)")
    return tuple(float(x) for x in v)
