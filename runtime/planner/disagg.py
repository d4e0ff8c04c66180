"""`pagedjax plan --disagg`: separate prefill and decode pools sized from the TTFT and ITL
targets (reserve-then-transfer serving, runtime/core/disagg.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from runtime.config import ModelConfig
from runtime.planner.core import GB, CapacityPlan, DeviceProfile, _bin, fleet_size, step_time_s


@dataclass(frozen=True)
class DisaggPlan:
    """Separate prefill and decode pools (reserve-then-transfer, runtime/core/disagg.py) sized from
    the two latency targets: prefill is compute-bound (FLOP/s for the TTFT target), decode is
    bandwidth-bound (the largest batch whose step fits the ITL target)."""
    prompt_tokens: int
    ttft_target_s: float
    itl_target_s: float
    mfu: float                        # achieved fraction of peak FLOP/s in prefill
    prefill_flops_per_request: float  # 2 * P * prompt_tokens
    prefill_flops_for_ttft: float     # that / ttft target: FLOP/s one prompt needs
    prefill_time_s: float             # one prompt on one device at `mfu`
    ttft_feasible: bool               # one device meets the TTFT target for a lone prompt
    decode_batch_for_itl: int         # largest B with step(B) <= ITL target (and B <= B_max)
    decode_step_s: float              # step(B) at that batch
    decode_bandwidth_for_itl: float   # (weights + B*C_seq) / ITL: bytes/s the target needs
    decode_tps: float                 # B / step(B) per decode device
    kv_transfer_bytes_per_request: int
    prefill_devices: int | None       # with a target RPS
    decode_devices: int | None
    kv_transfer_bytes_per_s: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_disagg(model: ModelConfig, device: DeviceProfile, p: CapacityPlan, *, prompt_tokens: int,
                ttft_target_s: float, itl_target_s: float, mfu: float = 0.5) -> DisaggPlan:
    """The prefill/decode split for `p`'s model, device, context and RPS (see DisaggPlan)."""
    for name, value in (("prompt_tokens", prompt_tokens), ("ttft_target", ttft_target_s),
                        ("itl_target", itl_target_s)):
        if value <= 0:
            raise ValueError(f"{name}: must be positive, got {value}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu: must be in (0, 1], got {mfu}")
    flops = 2.0 * p.param_count * prompt_tokens
    effective = device.peak_flops * mfu
    prefill_s = flops / effective
    bw, c_seq, w = device.bandwidth_bytes_per_s, p.kv_bytes_per_seq, p.weight_bytes
    # step(B) = (W + B*C_seq)/bw <= ITL  <=>  B <= (ITL*bw - W)/C_seq
    batch = max(0, min(p.b_max, int((itl_target_s * bw - w) // c_seq)))
    step = step_time_s(max(batch, 1), w, c_seq, bw)
    tps = batch / step if batch else 0.0
    kv_req = p.kv_bytes_per_token * prompt_tokens
    prefill_n = decode_n = xfer = None
    if p.target_rps is not None:
        prefill_n = max(1, math.ceil(p.target_rps * flops / effective - 1e-9))
        decode_n = fleet_size(p.target_rps, p.output_tokens, tps) if tps > 0 else None
        xfer = p.target_rps * kv_req
    return DisaggPlan(prompt_tokens, ttft_target_s, itl_target_s, mfu, flops, flops / ttft_target_s, prefill_s,
                      prefill_s <= ttft_target_s, batch, step, (w + batch * c_seq) / itl_target_s, tps, kv_req,
                      prefill_n, decode_n, xfer)


def format_disagg(d: DisaggPlan, device: DeviceProfile) -> str:
    n = device.name
    lines = [
        f"Disaggregated: TTFT <= {d.ttft_target_s * 1e3:g} ms for {d.prompt_tokens:,}-token prompts, "
        f"ITL <= {d.itl_target_s * 1e3:g} ms, prefill at {d.mfu:.0%} of peak FLOP/s",
        f"  prefill       {d.prefill_flops_per_request / 1e12:,.2f} TFLOP per prompt -> "
        f"{d.prefill_flops_for_ttft / 1e12:,.1f} TFLOP/s for the TTFT target; one {n}: "
        f"{d.prefill_time_s * 1e3:,.1f} ms ({'meets it' if d.ttft_feasible else 'misses it: tensor parallel'})",
    ]
    if d.decode_batch_for_itl:
        lines.append(f"  decode        B <= {d.decode_batch_for_itl} at the ITL target (step "
                     f"{d.decode_step_s * 1e3:.2f} ms, needs {d.decode_bandwidth_for_itl / 1e12:.2f} TB/s) -> "
                     f"{d.decode_tps:,.0f} tokens/s per {n}")
    else:
        lines.append(f"  decode        no batch meets the ITL target on one {n} (the weights alone take longer "
                     "to read)")
    lines.append(f"  KV transfer   {_bin(d.kv_transfer_bytes_per_request)} per request, prefill pool -> decode pool")
    if d.prefill_devices is not None:
        decode = f"{d.decode_devices} x {n}" if d.decode_devices is not None else "none fits"
        lines.append(f"  split         {d.prefill_devices} x {n} prefill + {decode} decode; "
                     f"{d.kv_transfer_bytes_per_s / GB:,.2f} GB/s of KV between the pools")
    return "\n".join(lines)
