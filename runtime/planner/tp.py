"""`pagedjax plan --tensor-parallel-size N`: what each device holds and a decode step's
cost at each tensor-parallel size (the memory sweep of its share plus the all-reduces)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import ModelConfig
from runtime.planner.core import GB, CapacityPlan, DeviceProfile, _bin


@dataclass(frozen=True)
class TPRow:
    """One tensor-parallel size: what each device holds and a decode step's cost, the
    memory-bound sweep of its share plus 2 all-reduces per layer (attention out, MLP out)."""
    tensor_parallel: int
    shards: bool                      # heads (and KV heads, or their replication) split evenly
    kv_heads_per_device: int          # KV heads replicated when N > N_kv (as vLLM does)
    weight_bytes_per_device: float
    kv_bytes_per_token_per_device: float
    b_max: int
    step_b1_s: float                  # memory sweep + all-reduces at batch 1
    allreduce_b1_s: float             # of which all-reduces
    tps_at_b_max: float


def allreduce_s(nbytes: float, n: int, device: DeviceProfile) -> float:
    """Ring all-reduce: each device sends and receives 2(N-1)/N of the buffer, plus a fixed cost."""
    if n <= 1:
        return 0.0
    if device.link_bytes_per_s <= 0:
        raise ValueError(f"tensor_parallel_size: {device.name} has no device-to-device link in this planner")
    return device.allreduce_latency_s + 2 * (n - 1) / n * nbytes / device.link_bytes_per_s


def plan_tp(model: ModelConfig, device: DeviceProfile, p: CapacityPlan, sizes: tuple[int, ...]) -> list[TPRow]:
    """`p` (its context, dtypes and overhead) at each tensor-parallel size in `sizes`."""
    act_bytes = 4 if p.weight_dtype == "float32" else 2   # activations travel in the compute dtype
    rows = []
    for n in sizes:
        if n < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {n}")
        kvh = model.num_kv_heads
        shards = model.num_heads % n == 0 and (kvh % n == 0 if n <= kvh else n % kvh == 0)
        heads_dev = max(1, kvh // n) if n <= kvh else 1
        w_dev = p.weight_bytes / n
        kv_tok = p.kv_bytes_per_token * heads_dev / kvh
        c_seq = kv_tok * p.context_len
        b_max = max(0, int((device.memory_bytes - w_dev - p.overhead_bytes) // c_seq))

        def step(b: int) -> tuple[float, float]:
            ar = 2 * model.num_layers * allreduce_s(b * model.hidden_size * act_bytes, n, device)
            return (w_dev + b * c_seq) / device.bandwidth_bytes_per_s + ar, ar

        s1, ar1 = step(1)
        tps = b_max / step(b_max)[0] if b_max else 0.0
        rows.append(TPRow(n, shards, heads_dev, w_dev, kv_tok, b_max, s1, ar1, tps))
    return rows


def format_tp(rows: list[TPRow], device: DeviceProfile) -> str:
    lines = [f"Tensor parallel on {device.name} (all-reduce: {device.link_bytes_per_s / 1e9:.0f} GB/s per direction, "
             f"{device.allreduce_latency_s * 1e6:.0f} us each, 2 per layer per step; TPS is the TP group's)",
             f"  {'TP':>3} {'weights/dev':>12} {'KV/tok/dev':>11} {'B_max':>6} {'step B=1':>9} {'all-reduce':>11} "
             f"{'TPS at B_max':>13} {'per device':>11}"]
    for r in rows:
        note = "" if r.shards else "  (heads do not split evenly: not servable)"
        lines.append(f"  {r.tensor_parallel:>3} {r.weight_bytes_per_device / GB:>9.2f} GB {_bin(r.kv_bytes_per_token_per_device):>11} "
                     f"{r.b_max:>6} {r.step_b1_s * 1e3:>6.2f} ms {r.allreduce_b1_s * 1e3:>8.3f} ms "
                     f"{r.tps_at_b_max:>13,.0f} {r.tps_at_b_max / r.tensor_parallel:>11,.0f}{note}")
    return "\n".join(lines)
