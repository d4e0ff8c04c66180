"""Command-line flags shared by `generate`, `serve` and `bench` -> EngineConfig."""

from __future__ import annotations

import argparse
import json
from typing import Callable

from runtime.config import (AdmissionPolicy, CacheConfig, EngineConfig, EvictionAlert, GiB, KernelConfig, LoraConfig,
                            ModelConfig, SchedulerConfig, SpeculativeConfig, parse_memory)

CPU_DEFAULT_KV_MEMORY = 2 * GiB  # 64 streams of ~700 unshared tokens (SmolLM2, float32) without preemption


def add_engine_arguments(p: argparse.ArgumentParser, serving: bool = True) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget in bytes or with a unit (e.g. 2GiB); default 2GiB on CPU, "
                        "60%% of free device memory on GPU")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: min(model, 4096))")
    # Serving defaults: 64 streams decode in one step and a 512-token step admits a dozen
    # shared-prefix chats at once (measured: BENCHMARKS.md, "Serving defaults").
    g.add_argument("--max-num-seqs", type=int, default=64 if serving else 4, help="compiled sequence envelope")
    g.add_argument("--max-num-batched-tokens", type=int, default=512 if serving else 128,
                   help="compiled per-step token envelope")
    g.add_argument("--quantization", choices=("auto", "none", "w8a8", "w8a16", "w4a16"), default="auto",
                   help="auto: as the checkpoint stores it (float, or what `convert --quantize` wrote). "
                        "w8a8: int8 weights and int8 activations in every decoder projection, one scale per 32 "
                        "inputs, SmoothQuant-calibrated; the LM head and embeddings stay float. "
                        "w8a16: int8 weights only, for bandwidth-bound GPU decode (on CPU slower than w8a8 from 2 rows). "
                        "w4a16: 4-bit weights (a scale and an offset per 32 inputs; a Q4 GGUF's own with `convert "
                        "--quantize w4a16`), an 8-bit head, float activations. "
                        "Accuracy: `pagedjax bench accuracy`")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with w8a8: an int8 LM head as well (a scale per 32 inputs; faster steps of 2+ rows "
                        "on CPU; its accuracy: `pagedjax bench accuracy --quantize-lm-head`)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16", "int8", "fp8_e4m3"), default="auto",
                   help="auto: the compute dtype. int8: a float16 scale and zero per 8 (K) / 32 (V) channels of each "
                        "token's head (3.0x the tokens of a float32 cache for SmolLM2; the XLA path and the C++ kernel). "
                        "fp8_e4m3: one scale per token and head (3.8x; also the Pallas kernel). Both dequantize on "
                        "read. Accuracy: `pagedjax bench accuracy --kv-cache-dtype int8`")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step back before planning the next (for comparison; slower)")
    g.add_argument("--attention-backend", choices=("auto", "xla", "pallas"), default="auto")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 7, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": 4}\' (n-gram prompt '
                        'lookup; "suffix" also looks in recent outputs, "suffix_decoding_max_cached_requests": 1000; '
                        '"draft_model" with "model": DIR proposes with a smaller checkpoint; '
                        'greedy and seeded outputs are the tokens made without it; a request opts out with '
                        '"speculative": false)')
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many devices (attention by heads, MLP Megatron-style, "
                        "embeddings by vocabulary, the KV cache by KV head). On CPU set "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N first. Float weights and the XLA "
                        "attention path only (the C++ CPU kernels are off under TP)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (auto: float32 on CPU, bfloat16 on GPU)")
    k = p.add_argument_group("CPU kernels (runtime/kernels/cpu; each is on where built and measured faster; "
                             "PAGEDJAX_* environment variables override these, docs/kernels.md)")
    k.add_argument("--no-cpu-kernels", action="store_true", help="plain XLA: no C++ attention or products")
    k.add_argument("--f32-kernel", choices=("auto", "on", "off"), default="auto",
                   help="float32 products on the C++ kernel (auto: where preferred for this CPU)")
    k.add_argument("--no-amx", action="store_true", help="int8 products on the AVX512-VNNI loop, not AMX tiles")
    k.add_argument("--no-per-layer-weights", action="store_true",
                   help="keep layer weights stacked (XLA then copies each layer's slice)")
    k.add_argument("--no-huge-pages", action="store_true", help="weights and KV cache on ordinary 4 KB pages")
    k.add_argument("--linger-us", type=int, default=KernelConfig.linger_us,
                   help="microseconds a kernel pool helper waits for the next call's work (0: sleep at once)")
    g.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="host RAM for a second KV tier: prefix-cache blocks the device pool evicts go there and "
                        "come back on a prefix hit instead of being recomputed (e.g. 4GiB; default none)")
    g.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="a third KV tier on local disk under the host tier: blocks it takes are written to DIR and "
                        "a restarted server serves them (needs --kv-offload-memory)")
    g.add_argument("--kv-offload-disk", default=None, metavar="SIZE",
                   help="the disk tier's limit (default 8GiB; needs --kv-offload-dir)")
    g.add_argument("--no-request-ledger", action="store_true",
                   help="keep no per-request decision ledger (the console's request timelines)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send each finished request's decision ledger as an OpenTelemetry span to this OTLP/HTTP "
                        "collector (e.g. http://localhost:4318; needs the otel extra)")
    g.add_argument("--preemption-mode", choices=("auto", "recompute"), default="auto",
                   help="auto: a batch-tier request preempted for blocks has its KV moved to the host tier and "
                        "back instead of recomputed, when the measured copy is cheaper (needs --kv-offload-memory); "
                        "recompute: every preempted request recomputes (default auto)")
    lo = p.add_argument_group("LoRA adapters (many fine-tunes of the base model in one batch; a request names one "
                              "as its model)")
    lo.add_argument("--enable-lora", action="store_true", help="hold adapter slots (implied by --lora-modules)")
    lo.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="PEFT adapters to serve from the start: name=path, or JSON {\"name\": ..., \"path\": ...}")
    lo.add_argument("--max-loras", type=int, default=LoraConfig.max_loras,
                    help="adapter slots on the device: the most adapters one step's rows use")
    lo.add_argument("--max-lora-rank", type=int, default=LoraConfig.max_lora_rank, help="the largest rank a slot holds")
    lo.add_argument("--max-cpu-loras", type=int, default=LoraConfig.max_cpu_loras,
                    help="adapters kept read in host memory (LRU); others are read from disk again when named")
    lo.add_argument("--lora-dtype", choices=("float32", "bfloat16"), default=LoraConfig.dtype,
                    help="the adapter slots' storage (bfloat16: half the bytes per step, products in float32)")
    e = p.add_argument_group("KV eviction signal (the console's dashboard and /metrics kv_eviction_rate)")
    e.add_argument("--eviction-window", type=float, default=EvictionAlert.window_s, metavar="SECONDS",
                   help="the rate's window; a cached block used within it counts as a live prefix when evicted")
    e.add_argument("--eviction-warn", type=float, default=EvictionAlert.warn, metavar="RATE",
                   help="lost / allocated blocks at which the signal warns (the seeds: 5%%)")
    e.add_argument("--eviction-alert", type=float, default=EvictionAlert.alert, metavar="RATE",
                   help="... and alerts: underprovisioned (the seeds: 10%%)")
    a = p.add_argument_group("admission policy (live-tunable from the console)")
    a.add_argument("--watermark", type=float, default=0.05)
    a.add_argument("--admission-mode", choices=("reserve", "optimistic"), default="optimistic")
    a.add_argument("--long-prefill-token-threshold", type=int, default=None)
    a.add_argument("--max-admissions-per-step", type=int, default=AdmissionPolicy.max_admissions_per_step)
    a.add_argument("--max-queue-len", type=int, default=AdmissionPolicy.max_queue_len)
    a.add_argument("--max-queued-tokens", type=int, default=AdmissionPolicy.max_queued_tokens)


def _default_kv_memory(model: ModelConfig) -> int:
    import jax

    dev = jax.devices()[0]
    if dev.platform == "gpu":
        stats = dev.memory_stats() or {}
        limit, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
        weights = model.param_count() * 2
        if limit:
            return max(int(0.6 * (limit - used - weights)), 64 << 20)
    return CPU_DEFAULT_KV_MEMORY


def engine_arg_names() -> list[str]:
    """The argparse destinations add_engine_arguments defines (a fleet ships them to replicas)."""
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return [a.dest for a in p._actions if a.dest != "help"]


def kernel_config_from_args(args: argparse.Namespace) -> KernelConfig:
    return KernelConfig(cpu_kernels=not getattr(args, "no_cpu_kernels", False),
                        f32_kernel=getattr(args, "f32_kernel", "auto"), amx=not getattr(args, "no_amx", False),
                        per_layer_weights=not getattr(args, "no_per_layer_weights", False),
                        huge_pages=not getattr(args, "no_huge_pages", False),
                        linger_us=getattr(args, "linger_us", KernelConfig.linger_us))


def lora_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--lora-modules as (name, path) pairs: name=path, or vLLM's JSON form {"name", "path"}."""
    out = []
    for item in getattr(args, "lora_modules", None) or ():
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                out.append((str(d["name"]), str(d["path"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora_modules: {item!r} is not JSON with \"name\" and \"path\"") from None
            extra = set(d) - {"name", "path"}
            if extra:
                raise ValueError(f"lora_modules: {', '.join(sorted(extra))} not supported in {item!r}")
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {item!r} must be name=path")
            out.append((name, path))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: a name is given twice ({', '.join(names)})")
    return out


def load_lora_modules(engine: object, args: argparse.Namespace) -> None:
    """Load --lora-modules into a built engine (an AdapterError names the file and the problem)."""
    for name, path in lora_modules(args):
        engine.load_lora(name, path)  # type: ignore[attr-defined]


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig | None:
    if not (getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None)):
        for flag, field in (("max_loras", "max_loras"), ("max_lora_rank", "max_lora_rank"),
                            ("max_cpu_loras", "max_cpu_loras"), ("lora_dtype", "dtype")):
            if getattr(args, flag, None) not in (None, getattr(LoraConfig, field)):
                raise ValueError(f"{flag}: needs --enable-lora (or --lora-modules)")
        return None
    lora_modules(args)  # (its errors before any weights are read)
    return LoraConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras, getattr(args, "lora_dtype", "float32"))


def engine_config_from_args(args: argparse.Namespace) -> Callable[[ModelConfig], EngineConfig]:
    """Returns a builder: the model's config is known only once the checkpoint is read."""

    def build(model: ModelConfig) -> EngineConfig:
        import jax

        if getattr(args, "kv_offload_disk", None) and not getattr(args, "kv_offload_dir", None):
            raise ValueError("kv_offload_disk: the disk tier's limit needs --kv-offload-dir")
        dtype = args.dtype
        if dtype == "auto":
            dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
        memory = parse_memory(args.kv_cache_memory) if args.kv_cache_memory else _default_kv_memory(model)
        # auto stores the compute dtype (a bfloat16 cache on XLA:CPU measured ~100x slower:
        # its scatter/convert path).
        kv_dtype = getattr(args, "kv_cache_dtype", "auto")
        kv_dtype = dtype if kv_dtype == "auto" else kv_dtype
        cache = CacheConfig.from_memory(model, memory, args.block_size, kv_dtype=kv_dtype,
                                        enable_prefix_cache=not args.no_prefix_cache)
        max_len = args.max_model_len or min(model.max_position_embeddings, 4096)
        if max_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len: {max_len} exceeds the model's {model.max_position_embeddings}")
        envelope = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len)
        policy = AdmissionPolicy(
            watermark=args.watermark, admission_mode=args.admission_mode,
            max_num_seqs=envelope.max_num_seqs, max_num_batched_tokens=envelope.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold or envelope.max_num_batched_tokens,
            max_admissions_per_step=args.max_admissions_per_step, max_queue_len=args.max_queue_len,
            max_queued_tokens=args.max_queued_tokens)
        policy.validate(envelope)
        return EngineConfig(model, cache, envelope, policy, args.attention_backend, dtype,
                            async_scheduling=not getattr(args, "no_async_scheduling", False),
                            quantization=getattr(args, "quantization", "auto"),
                            quantize_lm_head=getattr(args, "quantize_lm_head", False),
                            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                            kernels=kernel_config_from_args(args),
                            speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
                            eviction=EvictionAlert(getattr(args, "eviction_window", EvictionAlert.window_s),
                                                   getattr(args, "eviction_warn", EvictionAlert.warn),
                                                   getattr(args, "eviction_alert", EvictionAlert.alert)),
                            kv_offload_memory=parse_memory(args.kv_offload_memory)
                            if getattr(args, "kv_offload_memory", None) else 0,
                            kv_offload_dir=getattr(args, "kv_offload_dir", None),
                            kv_offload_disk=parse_memory(getattr(args, "kv_offload_disk", None) or "8GiB"),
                            preemption_mode=getattr(args, "preemption_mode", "auto"),
                            request_ledger=not getattr(args, "no_request_ledger", False),
                            otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
                            lora=lora_config_from_args(args))

    # LLMEngine.from_checkpoint reads it before the weights (TP restores them into their shards).
    build.tensor_parallel_size = getattr(args, "tensor_parallel_size", 1)  # type: ignore[attr-defined]
    return build
