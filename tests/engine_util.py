"""Engine construction for tests (tiny or real checkpoints)."""

from __future__ import annotations

from pathlib import Path

from runtime.config import (AdmissionPolicy, CacheConfig, EngineConfig, KernelConfig, LoraConfig, SchedulerConfig,
                            SpeculativeConfig)
from runtime.core.engine import LLMEngine


def make_engine(ckpt: Path, *, num_blocks: int = 256, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                max_model_len: int = 512, prefix_cache: bool = True, warmup: bool = False,
                kv_dtype: str = "float32", quantization: str = "auto", quantize_lm_head: bool = False,
                kernels: KernelConfig | None = None, speculative: SpeculativeConfig | None = None,
                lora: LoraConfig | None = None, **policy) -> LLMEngine:
    envelope = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    pol = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               long_prefill_token_threshold=max_num_batched_tokens)
    pol.update(policy)

    def build(model):
        return EngineConfig(model, CacheConfig(16, num_blocks, kv_dtype, prefix_cache), envelope,
                            AdmissionPolicy(**pol), "xla", "float32", quantization=quantization,
                            quantize_lm_head=quantize_lm_head, kernels=kernels or KernelConfig(),
                            speculative=speculative, lora=lora)

    return LLMEngine.from_checkpoint(ckpt, build, warmup=warmup, progress=False)
