"""Capacity planner behind `pagedjax plan`: the memory-bandwidth model of decode.

Formulas (DESIGN.md "Capacity formulas"), in plain bytes: KV/token = 2*L*N_kv*H*bytes,
C_seq = S*KV/token, B_max = floor((M - weights - overhead)/C_seq), B* = weights/C_seq,
step(B) = (weights + B*C_seq)/W, TPS(B) = B/step(B) -> W/C_seq, prefill = 2*P*S/peak_flops,
fleet = ceil(RPS*output_tokens/TPS(B_max)).

The seeds' Llama-2-13B/H100/S=1000 example mixes units ("0.78 GB" per sequence is
819.2e6 B = 781 MiB; "54 GB free" is 80 - 26). Here GPU memory is the HBM capacity in
binary units (80 GiB = 85.9e9 B), weights = param_count*bytes (26.03e9 B) and the default
GPU overhead is 3e9 B: 56.9e9 B left for KV gives the seeds' B_max = 69 (80e9 B and no
overhead: 65; the other seed's "~50 GB free" at S=1024: 59). B=1 step 8.0 ms; TPS at
B_max ~2,800 (seeds ~2,900) and W/C_seq ~4,090 (seeds 4,295): both seed figures come from
C_seq = 0.78e9 B, which the pure formulas below reproduce when given it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.config import DTYPE_BYTES, QUANTIZED_KV_DTYPES, GiB, ModelConfig, kv_scale_bytes, kv_scale_groups
from runtime.kv_groups import KVGroups

GB = 10**9
BLOCK_SIZE = 16
WEIGHT_DTYPE_BYTES: dict[str, float] = {**DTYPE_BYTES, "int4": 0.5}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
                 "fp32": "float32", "f32": "float32", "float": "float32", "float8": "fp8_e4m3", "fp8": "fp8_e4m3", "i8": "int8"}


def _llama(name: str, vocab: int, d: int, ffn: int, layers: int, heads: int, kv: int, *,
           head_dim: int = 128, max_pos: int = 4096, theta: float = 10000.0,
           tied: bool = False) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=d, intermediate_size=ffn,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_theta=theta,
                       tie_word_embeddings=tied, name=name)


MODELS: dict[str, ModelConfig] = {m.name: m for m in (
    _llama("llama-2-7b", 32000, 4096, 11008, 32, 32, 32),
    _llama("llama-2-13b", 32000, 5120, 13824, 40, 40, 40),
    _llama("llama-2-70b", 32000, 8192, 28672, 80, 64, 8),
    _llama("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, max_pos=8192, theta=500000.0),
    _llama("llama-3-70b", 128256, 8192, 28672, 80, 64, 8, max_pos=8192, theta=500000.0),
    _llama("smollm2-135m", 49152, 576, 1536, 30, 9, 3, head_dim=64, max_pos=8192,
           theta=100000.0, tied=True),
    # mixtures of experts: 46.7 B parameters, 12.9 B active per token (top 2 of 8)
    dataclasses.replace(_llama("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8, max_pos=32768, theta=1e6),
                        architecture="mixtral", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    # 30.5 B parameters, 3.3 B active (top 8 of 128)
    dataclasses.replace(_llama("qwen3-30b-a3b", 151936, 2048, 6144, 48, 32, 4, max_pos=40960, theta=1e6),
                        architecture="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    # multi-head latent attention: one cached row of 512 + 64 per token and layer
    # (DeepSeek-V2-Lite: 15.7 B parameters, 2.7 B active; first layer dense, 2 shared experts)
    dataclasses.replace(_llama("deepseek-v2-lite", 102400, 2048, 10944, 27, 16, 1, head_dim=576, max_pos=32768),
                        architecture="deepseek_v2", num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                        num_shared_experts=2, dense_layers=(0,), norm_topk_prob=False, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    # DeepSeek-V2: 236 B parameters, 21 B active; top 6 of 160 from the best 3 of 8 groups
    dataclasses.replace(_llama("deepseek-v2", 102400, 5120, 12288, 60, 128, 1, head_dim=576, max_pos=32768),
                        architecture="deepseek_v2", num_experts=160, num_experts_per_tok=6, moe_intermediate_size=1536,
                        num_shared_experts=2, dense_layers=(0,), norm_topk_prob=False, kv_lora_rank=512,
                        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        topk_method="group_limited_greedy", n_group=8, topk_group=3, routed_scaling_factor=16.0),
)}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_flops: float
    link_bytes_per_s: float = 0.0     # device-to-device, one direction (NVLink); 0: none
    allreduce_latency_s: float = 10e-6  # fixed cost of one small all-reduce (NCCL ballpark)


DEVICES: dict[str, DeviceProfile] = {d.name: d for d in (
    DeviceProfile("h100", 80 * GiB, 3.35e12, 989e12, 450e9),   # SXM5, dense bf16; NVLink 4: 900 GB/s both ways
    DeviceProfile("h200", 141 * GiB, 4.8e12, 989e12, 450e9),
    DeviceProfile("a100", 80 * GiB, 2.0e12, 312e12, 300e9),    # 80 GB SXM; NVLink 3
)}
DEVICE_NAMES = (*DEVICES, "cpu")


def _total_ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _best_seconds(fn: Any, repeats: int) -> float:
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


class ReadProbe:
    """Passes of every core reading its slice of one float32 array of `nbytes` (np.max, which
    releases the GIL and keeps up with memory), kept for repeated passes. One thread summing
    the array read 9 GB/s where two threads read 23 on a 2-core Xeon: a decode step streams
    its weights from every core, so the single-thread figure flattered every bandwidth ratio.
    A benchmark can interleave passes with the work it compares against: on the shared 2-core
    VMs here the rate moved between 28 and 37 GB/s over minutes, so a probe taken minutes
    apart from the steps made their ratio swing by a fifth."""

    def __init__(self, nbytes: int):
        from concurrent.futures import ThreadPoolExecutor

        self.array = np.ones(max(1, nbytes // 4), dtype=np.float32)
        n = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
        self.parts = np.array_split(self.array, n)
        self.pool = ThreadPoolExecutor(n)
        self.rates: list[float] = []
        self._pass()  # (untimed: the first pass after the array is written ran up to a third slower)

    def _pass(self) -> float:
        t0 = time.perf_counter()
        list(self.pool.map(np.max, self.parts))
        return self.array.nbytes / max(time.perf_counter() - t0, 1e-9)

    def sample(self) -> float:
        """One timed pass; its rate (bytes/s) is kept in `rates`."""
        self.rates.append(self._pass())
        return self.rates[-1]

    def close(self) -> None:
        self.pool.shutdown()
        self.array = self.parts = None  # type: ignore[assignment]


def read_bandwidth(size_mb: int = 512, repeats: int = 5) -> float:
    """Bytes/s: the best of `repeats` ReadProbe passes over a size_mb array."""
    probe = ReadProbe(size_mb << 20)
    try:
        return max(probe.sample() for _ in range(max(1, repeats)))
    finally:
        probe.close()


def measure_cpu(size_mb: int = 512, repeats: int = 5, matmul_n: int = 1024) -> DeviceProfile:
    """Measure this machine: read bandwidth from every core (`read_bandwidth`), peak FLOP/s =
    best float32 matmul (rough), memory = MemTotal from /proc/meminfo."""
    bandwidth = read_bandwidth(size_mb, repeats)
    x = np.ones((matmul_n, matmul_n), dtype=np.float32)
    flops = 2 * matmul_n**3 / _best_seconds(lambda: x @ x, 3)
    return DeviceProfile("cpu", _total_ram_bytes(), bandwidth, flops)


def device_profile(name: str, *, size_mb: int = 512) -> DeviceProfile:
    key = name.lower()
    if key == "cpu":
        return measure_cpu(size_mb=size_mb)
    if key not in DEVICES:
        raise ValueError(f"device: unknown device {name!r} (known: {', '.join(DEVICE_NAMES)})")
    return DEVICES[key]


def normalize_dtype(name: str, *, weights: bool = False) -> str:
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    table = WEIGHT_DTYPE_BYTES if weights else DTYPE_BYTES
    if key not in table:
        what = "weight_dtype" if weights else "kv_dtype"
        raise ValueError(f"{what}: unknown dtype {name!r} (known: {', '.join(sorted(table))})")
    return key


# --- the formulas, usable on their own (the seeds' literal numbers go straight in) ------
def step_time_s(batch: int, weight_bytes: float, kv_bytes_per_seq: float, bandwidth: float) -> float:
    """A decode step's bytes over the bandwidth; `weight_bytes` the weights it reads (a mixture
    of experts: the experts `batch` tokens touch, weights_read)."""
    return (weight_bytes + batch * kv_bytes_per_seq) / bandwidth


def tokens_per_s(batch: int, weight_bytes: float, kv_bytes_per_seq: float, bandwidth: float) -> float:
    return batch / step_time_s(batch, weight_bytes, kv_bytes_per_seq, bandwidth) if batch > 0 else 0.0


def weights_read(model: ModelConfig, batch: int, bytes_per_param: float) -> float:
    """Weight bytes one decode step of `batch` sequences reads (ModelConfig.params_touched)."""
    return model.params_touched(batch) * bytes_per_param


def fleet_size(rps: float, output_tokens: int, tps_per_gpu: float, headroom: float = 0.0) -> int:
    """ceil(rps * output_tokens / tps_per_gpu), then ceil(that * (1 + headroom))."""
    if tps_per_gpu <= 0:
        raise ValueError("tps_per_gpu: must be positive (the model does not fit on the device?)")
    base = math.ceil(rps * output_tokens / tps_per_gpu - 1e-9)
    return math.ceil(base * (1.0 + headroom) - 1e-9)


@dataclass(frozen=True)
class SweepRow:
    batch: int
    step_time_s: float
    tps: float
    memory_fits: bool


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    device: DeviceProfile
    context_len: int
    output_tokens: int
    weight_dtype: str
    kv_dtype: str
    overhead_bytes: int
    headroom: float
    target_rps: float | None
    param_count: int
    active_param_count: int  # read per token (a mixture of experts: its top-k experts), = param_count if dense
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_token_mha: int  # same model with N_kv = N_heads (MLA: the expanded K/V), to show what GQA / MLA save
    kv_bytes_per_seq: int
    kv_bytes_per_block: int
    kv_budget_bytes: int  # memory - weights - overhead (may be negative: does not fit)
    b_max: int
    b_star: float  # crossover: KV bytes per step == weight bytes
    rows: tuple[SweepRow, ...]
    step_time_b1_s: float
    tps_ceiling: float  # TPS at B_max: the practical per-device ceiling used for the fleet
    tps_asymptote: float  # W / C_seq, the B -> infinity limit (ignores memory)
    prefill_time_s: float  # 2 * P * S / peak_flops for one S-token prompt
    min_devices_for_weights: int
    fleet: int | None
    fleet_with_headroom: int | None
    latent: bool = False  # multi-head latent attention: kv_bytes_per_token is one latent row per layer
    # Devices one sequence must be split over (context parallelism) when its KV exceeds one
    # device's KV budget (the seeds' rule: C_seq(S) > M - 2P, with this plan's weights and
    # overhead for 2P); 1: it fits one device; 0: no device has any KV budget at all.
    context_parallel: int = 1

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kv_bytes_per_seq(model: ModelConfig, kv_dtype: str, context_len: int) -> int:
    """C_seq: the KV one sequence of `context_len` tokens holds. Every layer's keys for a model
    whose layers all see the whole context; with sliding-window layers, what the engine's KV
    groups keep (runtime/kv_groups.py: a sliding layer only the pages its window still sees),
    counted in pages of BLOCK_SIZE tokens."""
    groups = KVGroups.of(model)
    if not groups.frees_blocks:
        return model.kv_bytes_per_token(kv_dtype) * context_len
    page = model.kv_bytes_per_token(kv_dtype) * BLOCK_SIZE * groups.group_size // model.num_layers
    return groups.steady_pages(context_len, BLOCK_SIZE) * page


def crossover(read: Any, c_seq: float) -> float:
    """B* where a step's KV bytes equal the weight bytes it reads: weights / C_seq, and for a
    mixture of experts (whose step reads more experts as B grows) the fixed point of
    B = read(B) / C_seq."""
    b = read(1) / c_seq
    for _ in range(50):
        b = read(max(b, 1.0)) / c_seq
    return b


def plan(model: ModelConfig, device: DeviceProfile, *, context_len: int, weight_dtype: str = "bfloat16",
         kv_dtype: str = "bfloat16", overhead_bytes: int = 3 * GB, target_rps: float | None = None,
         output_tokens: int = 200, headroom: float = 0.2,
         batch_sweep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)) -> CapacityPlan:
    """Capacity of one device (rows also include B_max when it is not in batch_sweep)."""
    for name, value in (("context_len", context_len), ("output_tokens", output_tokens)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if overhead_bytes < 0 or headroom < 0:
        raise ValueError("overhead/headroom: must be >= 0")
    if target_rps is not None and target_rps <= 0:
        raise ValueError(f"rps: must be positive, got {target_rps}")
    wd, kd = normalize_dtype(weight_dtype, weights=True), normalize_dtype(kv_dtype)
    params = model.param_count()
    weights = int(params * WEIGHT_DTYPE_BYTES[wd])
    read = lambda b: weights_read(model, b, WEIGHT_DTYPE_BYTES[wd])  # noqa: E731  (a MoE reads the experts B touches)
    per_token = model.kv_bytes_per_token(kd)
    if model.mla:  # the keys and values the latent expands to, per head
        mha = model.num_layers * model.num_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim
                                                    + model.v_head_dim) * DTYPE_BYTES[kd]
    else:
        mha = dataclasses.replace(model, num_kv_heads=model.num_heads).kv_bytes_per_token(kd)
    c_seq = kv_bytes_per_seq(model, kd, context_len)
    budget = device.memory_bytes - weights - int(overhead_bytes)
    b_max = max(0, budget // c_seq)
    bw = device.bandwidth_bytes_per_s
    batches = sorted({int(b) for b in batch_sweep if b >= 1} | ({b_max} if b_max else set()))
    rows = tuple(SweepRow(b, step_time_s(b, read(b), c_seq, bw), tokens_per_s(b, read(b), c_seq, bw),
                          b <= b_max) for b in batches)
    ceiling = tokens_per_s(b_max, read(b_max), c_seq, bw)
    active = int(model.params_touched(1))
    fleet = fleet_h = None
    if target_rps is not None and ceiling > 0:
        fleet = fleet_size(target_rps, output_tokens, ceiling)
        fleet_h = fleet_size(target_rps, output_tokens, ceiling, headroom)
    return CapacityPlan(
        model=model.name, device=device, context_len=context_len, output_tokens=output_tokens,
        weight_dtype=wd, kv_dtype=kd, overhead_bytes=int(overhead_bytes), headroom=headroom,
        target_rps=target_rps, param_count=params, active_param_count=active, num_layers=model.num_layers,
        num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        weight_bytes=weights, kv_bytes_per_token=per_token, kv_bytes_per_token_mha=mha,
        kv_bytes_per_seq=c_seq, kv_bytes_per_block=per_token * BLOCK_SIZE, kv_budget_bytes=budget,
        b_max=b_max, b_star=crossover(read, c_seq), rows=rows,
        step_time_b1_s=step_time_s(1, read(1), c_seq, bw), tps_ceiling=ceiling,
        tps_asymptote=bw / c_seq, prefill_time_s=2 * active * context_len / device.peak_flops,
        min_devices_for_weights=math.ceil((weights + overhead_bytes) / device.memory_bytes),
        fleet=fleet, fleet_with_headroom=fleet_h, latent=model.mla,
        context_parallel=context_parallel_devices(c_seq, budget))


def context_parallel_devices(c_seq: int, kv_budget: int) -> int:
    """How many devices one sequence's KV (c_seq bytes) must be split over when each has
    kv_budget bytes for KV (its weights replicated): 1 when it fits one, 0 when none has room."""
    if kv_budget <= 0:
        return 0
    return max(1, math.ceil(c_seq / kv_budget))


# --- output -----------------------------------------------------------------------------
def _bin(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_plan(p: CapacityPlan) -> str:
    d = p.device
    group = p.num_heads // p.num_kv_heads
    latent = p.latent
    attn = "MLA" if latent else "MHA" if group == 1 else f"GQA {group}:1"
    more = p.kv_bytes_per_token_mha / p.kv_bytes_per_token
    kv_note = (f"the expanded K/V would be {_bin(p.kv_bytes_per_token_mha)}, {more:.1f}x more" if latent else
               f"MHA ({p.num_heads} KV heads) would be {_bin(p.kv_bytes_per_token_mha)}, {group}x more"
               if group > 1 else "no GQA: every query head has its own K/V")
    scale_note = (f" + {kv_scale_bytes(p.kv_dtype, p.head_dim) / 2:g} B scales" if p.kv_dtype in QUANTIZED_KV_DTYPES
                  else "")
    if latent and p.kv_dtype in QUANTIZED_KV_DTYPES:
        scale_note = f" + {kv_scale_groups(p.kv_dtype, p.head_dim, 'latent') * 4} B scales"
    kv_formula = (f"{p.num_layers} x (one latent row of {p.head_dim} x {DTYPE_BYTES[p.kv_dtype]} B{scale_note})" if latent else
                  f"2 x {p.num_layers} x {p.num_kv_heads} x ({p.head_dim} x {DTYPE_BYTES[p.kv_dtype]} B{scale_note})")
    lines = [
        f"Capacity plan: {p.model} on {d.name}, weights {p.weight_dtype}, KV {p.kv_dtype}, "
        f"context {p.context_len} tokens",
        f"  model         {p.param_count / 1e9:.3f} B params"
        + (f" ({p.active_param_count / 1e9:.3f} B active per token)" if p.active_param_count != p.param_count else "")
        + f", L={p.num_layers}, N_heads={p.num_heads}, N_kv={p.num_kv_heads} ({attn}), head_dim={p.head_dim}",
        f"  device        {d.memory_bytes / GB:.1f} GB ({_bin(d.memory_bytes)}), "
        f"{d.bandwidth_bytes_per_s / 1e12:.3g} TB/s, {d.peak_flops / 1e12:.3g} TFLOP/s",
        f"  weights       {p.weight_bytes / GB:.2f} GB  (+ overhead {p.overhead_bytes / GB:.2f} GB)",
        f"  KV / token    {_bin(p.kv_bytes_per_token)} = {kv_formula}  [{kv_note}]",
        f"  KV / block    {_bin(p.kv_bytes_per_block)} ({BLOCK_SIZE} tokens)",
        f"  KV / seq      {p.kv_bytes_per_seq / GB:.3f} GB ({_bin(p.kv_bytes_per_seq)}) at "
        f"{p.context_len} tokens",
        f"  KV budget     {p.kv_budget_bytes / GB:.2f} GB  -> B_max = {p.b_max} sequences",
        f"  crossover     B* = weights / C_seq = {p.b_star:.1f}",
        f"  decode        B=1 step {p.step_time_b1_s * 1e3:.2f} ms; TPS at B_max {p.tps_ceiling:,.0f} "
        f"tokens/s; W/C_seq limit {p.tps_asymptote:,.0f} tokens/s",
        f"  prefill       {p.prefill_time_s * 1e3:.1f} ms for a {p.context_len}-token prompt "
        f"(2*P*S / peak FLOP/s{', P active' if p.active_param_count != p.param_count else ''})",
    ]
    if p.context_parallel > 1:
        lines.append(f"  context par.  one {p.context_len}-token sequence holds {_bin(p.kv_bytes_per_seq)} of KV, more "
                     f"than the {_bin(p.kv_budget_bytes)} a {d.name} has for KV (C_seq > M - weights - overhead): "
                     f"it needs context parallelism over >= {p.context_parallel} devices, each holding "
                     f"{_bin(p.kv_bytes_per_seq / p.context_parallel)} of it and merging partial softmaxes every "
                     f"decode step (pagedjax does not split a sequence yet: a request that long is refused)")
    if p.b_max == 0:
        lines.append(f"  DOES NOT FIT  weights + overhead + one sequence exceed one {d.name}; "
                     f"weights alone need >= {p.min_devices_for_weights} devices (tensor parallel)")
    if p.target_rps is not None:
        need = p.target_rps * p.output_tokens
        if p.fleet is None:
            lines.append(f"  fleet         {need:,.0f} output tokens/s needed; no single-device replica fits")
        else:
            lines.append(f"  fleet         {p.target_rps:g} req/s x {p.output_tokens} tokens = {need:,.0f} "
                         f"tokens/s -> {p.fleet} x {d.name}, {p.fleet_with_headroom} with "
                         f"{p.headroom:.0%} headroom")
    lines.append(f"  {'batch':>7} {'step ms':>9} {'tokens/s':>10}  fits")
    for r in p.rows:
        mark = " (B_max)" if r.batch == p.b_max else ""
        lines.append(f"  {r.batch:>7} {r.step_time_s * 1e3:>9.2f} {r.tps:>10,.0f}  "
                     f"{'yes' if r.memory_fits else 'no'}{mark}")
    return "\n".join(lines)


def plot_plan(p: CapacityPlan, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = [r.batch for r in p.rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].axhline(p.tps_asymptote, ls=":", c="gray", label="W / C_seq")
    for ax, ys, label in zip(axes, ([r.tps for r in p.rows], [r.step_time_s * 1e3 for r in p.rows]),
                             ("tokens/s", "decode step (ms)")):
        ax.plot(b, ys, "o-")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch (concurrent sequences)", ylabel=label)
        if p.b_max:
            ax.axvline(p.b_max, c="red", ls="--", label=f"B_max={p.b_max}")
        ax.axvline(p.b_star, c="green", ls="--", label=f"B*={p.b_star:.1f}")
        ax.legend()
    fig.suptitle(f"{p.model} on {p.device.name}, S={p.context_len}, KV {p.kv_dtype}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


