"""The tensor-parallel engine step with the Pallas attention kernel, lowered for CUDA on this
CPU machine; run by tests/runtime/test_tp.py in a subprocess (XLA_FLAGS must force the host
devices before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/runtime/tp_pallas_lower.py CKPT KV_DTYPE

Builds the engine at TP 2 with attention_backend=pallas, swaps in the hardware kernel
(pallas_kernels.paged_attention.hardware_attention: off a GPU only the interpreter could run
it, and the interpreter cannot run on several devices), and lowers one decode step for two
GPUs: the whole Mosaic GPU lowering of the kernel under the step's shard_map. Prints one
JSON line: the partition count and each kernel call's operand types (per-shard shapes)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(ckpt: Path, kv_dtype: str) -> None:
    from pallas_kernels.paged_attention import hardware_attention
    from runtime.model import runner as model_runner
    from runtime.model.batch import build_step_input
    from runtime.bench.step_rows import decode_rows
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
    from runtime.core.engine import LLMEngine
    from runtime.model.attention_backend import PallasAttention

    from runtime.model import tp

    # Stand in for two GPUs: the hardware kernel in place of the interpreter, and past the
    # check that refuses Pallas under TP off a GPU (right for a run, not for a lowering).
    model_runner.make_backend = lambda *a, **kw: PallasAttention(kernel=hardware_attention)
    validate = tp.validate
    tp.validate = lambda cfg, n, **kw: validate(cfg, n, **{**kw, "attention_backend": "xla"})

    def build(model):
        return EngineConfig(model, CacheConfig(16, 32, kv_dtype), SchedulerConfig(4, 32, 256, min_token_bucket=32),
                            AdmissionPolicy(max_num_seqs=4, max_num_batched_tokens=32,
                                            long_prefill_token_threshold=32), "pallas", "bfloat16",
                            tensor_parallel_size=2)

    build.tensor_parallel_size = 2
    r = LLMEngine.from_checkpoint(ckpt, build, warmup=False, progress=False).runner
    rows = decode_rows(r, 4, 40, shared_len=32)
    inp = build_step_input(rows, 4, 4, r.max_blocks_per_seq, r.cache_cfg.block_size, r.scratch_row)
    text = r._step.trace(r.params, r.kv, r.penalty, inp).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @mosaic_gpu\w*\([^)]*\).*?: \(([^)]*)\)", text)
    parts = re.findall(r"mhlo.num_partitions = (\d+)", text)
    print(json.dumps({"kv_dtype": kv_dtype, "backend": r.attention_backend, "num_partitions": int(parts[0]),
                      "kernel_operands": [c.split(", ") for c in calls], "shard_map": "manual_computation" in text,
                      "kv_heads": r.cfg.num_kv_heads, "num_blocks": r.cache_cfg.num_blocks,
                      "num_layers": r.cfg.num_layers}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
