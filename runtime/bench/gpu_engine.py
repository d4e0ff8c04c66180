"""The engine at Llama-3-8B's shapes with random bfloat16 weights made on the device (no
checkpoint can travel to the GPU machine): decode tokens/s at several batch sizes against
the planner's B*W / (2P + B*C_seq), and the host time the async pipeline leaves exposed.
Used by scripts/gpu_check.py; `--dry-run` there runs it at a scaled-down shape on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0,
                 eos_token_ids=(1,), pad_token_id=0, name="llama-3-8b-shaped-random")
# The same architecture, small enough for a CPU dry run of the whole path.
LLAMA3_SCALED = {**LLAMA3_8B, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 896, "num_layers": 2,
                 "num_heads": 8, "num_kv_heads": 2, "head_dim": 32, "name": "llama-3-shaped-scaled"}
# Llama 3.1 8B: the same shapes with its llama3 RoPE scaling (what 3.1/3.2/3.3 ship).
LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
# Gemma 3 1B's shapes: 26 layers, 5 of every 6 sliding over 512 tokens (KV groups), one KV head
# of 256, a 262k vocabulary; served on the XLA attention path (the Pallas kernel has no window).
GEMMA3_1B = dict(architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
                 num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768, rope_theta=1e6,
                 rope_local_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2,
                 eos_token_ids=(1,), pad_token_id=0, sliding_window=512, query_pre_attn_scalar=256.0,
                 hidden_activation="gelu_tanh", name="gemma-3-1b-shaped-random",
                 layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)))
# Mixtral 8x7B's layer (8 experts of 4096 x 14336, top 2; GQA 32:8) at 8 of its 32 layers:
# 11.9 B parameters, 23.7 GB in bfloat16 (the 32 layers' 93 GB do not fit one H100), 3.4 B
# active per token. The experts run as ragged_dot off CPU.
MIXTRAL_8L = dict(architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=8,
                  num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, name="mixtral-8x7b-8-layers-random")
MIXTRAL_SCALED = {**MIXTRAL_8L, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
                  "moe_intermediate_size": 512, "num_layers": 2, "num_heads": 8, "num_kv_heads": 2, "head_dim": 32,
                  "name": "mixtral-shaped-scaled"}
# DeepSeek-V2-Lite's layer at 8 of its 27 layers (the first dense): MLA with a 512 + 64 latent
# row per token and layer, 16 heads, 64 routed experts of width 1408 (top 6) + 2 shared; the
# latent cache read on the XLA attention path (the Pallas kernel has no latent mode yet), the
# experts through ragged_dot. 3.9 B parameters, 7.8 GB in bfloat16.
DEEPSEEK_V2_LITE_8L = dict(architecture="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                           num_layers=8, num_heads=16, num_kv_heads=1, head_dim=576, max_position_embeddings=32768,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=100000, eos_token_ids=(100001,),
                           pad_token_id=100001, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                           num_shared_experts=2, dense_layers=(0,), norm_topk_prob=False, kv_lora_rank=512,
                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                           name="deepseek-v2-lite-8-layers-random")
DEEPSEEK_SCALED = {**DEEPSEEK_V2_LITE_8L, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
                   "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_layers": 2,
                   "num_heads": 4, "head_dim": 80, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                   "qk_nope_head_dim": 32, "v_head_dim": 32, "bos_token_id": 1, "eos_token_ids": (2,),
                   "pad_token_id": 0, "name": "deepseek-v2-shaped-scaled"}
GEMMA3_SCALED = {**GEMMA3_1B, "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256, "num_layers": 6,
                 "head_dim": 32, "sliding_window": 64, "query_pre_attn_scalar": 32.0, "name": "gemma-3-shaped-scaled",
                 "layer_types": tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6))}


def model_config(cfg_kw: dict[str, Any]) -> Any:
    """A ModelConfig from one of the dicts above (`rope_scaling` given as a dict)."""
    from runtime.config import ModelConfig, RopeScaling

    kw = dict(cfg_kw)
    if isinstance(kw.get("rope_scaling"), dict):
        kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
    return ModelConfig(**kw)


def random_params_on_device(cfg: Any, dtype: Any, quantization: str = "none") -> Any:
    """Every leaf drawn by a jitted normal on the device (fan-in scaled; norms = 1). With a
    quantization, the decoder projections are random int8 values with fan-in scales, in the
    tree runtime/model/quant.py serves (w8a16: {"w8", "s"}, w8a8: {"q", "s"}; w4a16: random
    nibbles with a scale and an offset per 32 inputs, {"q4", "s4", "m4"}, centred on zero)."""
    import jax
    import jax.numpy as jnp

    from runtime.model.families import param_shapes
    from runtime.model.quant import LINEAR_WEIGHTS

    leaves, tree = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    out = []
    for i, (path, shape) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        if name.endswith("norm']"):
            out.append(jnp.ones(shape, dtype))
            continue
        fan_in = shape[-1] if "embed" in name else shape[-2]
        if quantization == "w4a16" and any(f"['{w}']" in name for w in LINEAR_WEIGHTS):
            *lead, K, N = shape
            q4 = jax.jit(lambda k, shp=(*lead, K // 2, N): jax.random.randint(k, shp, 0, 256, jnp.int32)
                         .astype(jnp.uint8))(jax.random.key(i))
            s4 = jnp.full((*lead, K // 32, N), 1.7 / (7.5 * math.sqrt(fan_in)), jnp.float32)
            out.append({"q4": q4, "s4": s4, "m4": -7.5 * s4})
            continue
        if quantization != "none" and any(f"['{w}']" in name for w in LINEAR_WEIGHTS):
            ints = jax.jit(lambda k, shape=shape: jax.random.randint(k, shape, -127, 128, jnp.int8))(jax.random.key(i))
            scale = jnp.full(shape[:-2] + shape[-1:], 1.7 / (127 * math.sqrt(fan_in)), jnp.float32)
            out.append({("w8" if quantization == "w8a16" else "q"): ints, "s": scale})
            continue
        draw = jax.jit(lambda k, shape=shape, s=1.0 / math.sqrt(fan_in): (jax.random.normal(k, shape) * s).astype(dtype))
        out.append(draw(jax.random.key(i)))
    return jax.tree_util.tree_unflatten(tree, out)


def synthetic_tokenizer(vocab: int) -> Any:
    """A byte-level tokenizer with `vocab` entries, so any sampled id detokenizes."""
    from tokenizers import Tokenizer

    from runtime.tokenizer import TextTokenizer, build_byte_level_bpe

    alphabet = [chr(c) for c in range(33, 127)]  # printable ASCII: its own byte-level symbols
    tokens = ["<pad>", "<eos>"] + alphabet + [f"w{i}" for i in range(vocab - 2 - len(alphabet))]
    tok = Tokenizer.from_str(build_byte_level_bpe(tokens, [], ["<pad>", "<eos>"], "smollm").to_str())
    return TextTokenizer(tok, None, 0, (1,))


def engine_decode_tps(cfg_kw: dict[str, Any], batches: tuple[int, ...], *, context_len: int = 1000,
                      steps: int = 8, dtype: str = "bfloat16", kv_memory: int | None = None,
                      device_name: str = "h200", attention_backend: str = "auto", quantization: str = "none",
                      kv_dtype: str | None = None) -> dict[str, Any]:
    """`quantization` (w8a16 / w8a8: int8 weights; w4a16: 4-bit, through the Pallas kernel on a
    GPU) and `kv_dtype` (int8 / fp8_e4m3: a quantized cache) give the quantization issue's GPU rows."""
    import jax
    import jax.numpy as jnp

    from runtime.bench.breakdown import _median_ms
    from runtime.bench.step_rows import timed_steps
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import _default_kv_memory
    from runtime.kv_groups import KVGroups
    from runtime.planner import DEVICES, tokens_per_s
    from runtime.planner.core import kv_bytes_per_seq
    from runtime.model.sampling import SamplingParams

    cfg = model_config(cfg_kw)
    jdt = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype]
    params = random_params_on_device(cfg, jdt, quantization)
    kv_dtype = kv_dtype or dtype
    weight_bytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))
    # what a step of B rows reads (a mixture of experts: the experts B tokens pick; planner)
    read_bytes = (lambda B: weight_bytes * cfg.params_touched(B) / cfg.param_count())
    max_len = 16 * math.ceil((context_len + steps + 64) / 16)
    cache = CacheConfig.from_memory(cfg, kv_memory or _default_kv_memory(cfg), 16, kv_dtype)
    # the decode rows keep every block of every KV group (runtime/bench/step_rows.py)
    per_seq_blocks = max_len // 16 * KVGroups.of(cfg).num_groups
    b_cap = cache.num_blocks // per_seq_blocks
    batches = tuple(sorted({min(b, b_cap) for b in batches}))
    top = max(batches)
    tokens = max(top, 2048)
    env = SchedulerConfig(top, tokens, max_len)
    pol = AdmissionPolicy(max_num_seqs=top, max_num_batched_tokens=tokens, long_prefill_token_threshold=tokens,
                          max_admissions_per_step=top, watermark=0.0)
    eng = LLMEngine(EngineConfig(cfg, cache, env, pol, attention_backend, dtype, quantization=quantization), params,
                    synthetic_tokenizer(cfg.vocab_size), warmup=False, progress=False)
    dev = DEVICES.get(device_name)
    kv_seq = kv_bytes_per_seq(cfg, kv_dtype, context_len)
    rng = np.random.default_rng(0)
    rows = []
    for B in batches:
        sp = SamplingParams(temperature=0.0, max_tokens=steps * 3 + 8, ignore_eos=True)
        res: dict[str, Any] = {"batch": B}
        for mode in (True, False):
            eng.set_async_scheduling(mode)
            prompts = [list(rng.integers(2, cfg.vocab_size, size=context_len)) for _ in range(B)]
            walls = timed_steps(eng, prompts, sp, steps, warm_tokens=3)
            res["async_step_ms" if mode else "sync_step_ms"] = float(np.median(walls) * 1e3)
        # device time of the same decode step, alone
        from runtime.model.batch import build_step_input
        from runtime.bench.step_rows import decode_rows

        r_ = eng.runner
        seqs = decode_rows(r_, B, context_len)
        s_b, t_b = env.bucket_for(B, B)
        inp = jax.device_put(build_step_input(seqs, s_b, t_b, r_.max_blocks_per_seq, 16, r_.scratch_row,
                                              r_.masks.all_allowed(s_b), num_groups=r_.kv_groups.num_groups,
                                              cascade=not r_.kv_groups.windows[0]))

        def go():
            r_.kv, r_.penalty, out, *_ = r_._step(r_.params, r_.kv, r_.penalty, inp)
            return out.token_ids
        res["device_step_ms"] = _median_ms(go, steps)
        eng.reset_prefix_cache()
        res["tokens_per_s"] = B / (res["async_step_ms"] / 1e3)
        res["exposed_host_ms"] = max(0.0, res["async_step_ms"] - res["device_step_ms"])
        res["exposed_share"] = res["exposed_host_ms"] / res["async_step_ms"]
        if dev is not None:
            res["planner_tokens_per_s"] = tokens_per_s(B, read_bytes(B), kv_seq, dev.bandwidth_bytes_per_s)
            res["measured_vs_planner"] = res["tokens_per_s"] / res["planner_tokens_per_s"]
        rows.append(res)
    return {"model": cfg.name, "dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_dtype,
            "attention_backend": eng.runner.attention_backend, "context_len": context_len, "weight_bytes": weight_bytes,
            "kv_blocks": cache.num_blocks, "b_max_at_context": b_cap, "device_profile": device_name, "rows": rows}


def format_engine_tps(r: dict[str, Any]) -> str:
    q = f", {r['quantization']} weights" if r.get("quantization", "none") != "none" else ""
    kv = f", KV {r['kv_cache_dtype']} ({r.get('attention_backend', '?')} attention)" if r.get("kv_cache_dtype") else ""
    lines = [f"== engine decode: {r['model']} ({r['dtype']}{q}{kv}, random weights), context {r['context_len']}, "
             f"B_max {r['b_max_at_context']} =="]
    for x in r["rows"]:
        plan = (f"  planner {x['planner_tokens_per_s']:,.0f} tok/s ({x['measured_vs_planner'] * 100:.0f}%)"
                if "planner_tokens_per_s" in x else "")
        lines.append(f"  B={x['batch']:<4} step {x['async_step_ms']:8.2f} ms (sync {x['sync_step_ms']:.2f}, device "
                     f"{x['device_step_ms']:.2f}; exposed host {x['exposed_host_ms']:.2f} ms = "
                     f"{x['exposed_share'] * 100:.1f}%)  {x['tokens_per_s']:,.0f} tok/s{plan}")
    return "\n".join(lines)


def verify_step_cost(cfg_kw: dict[str, Any], batches: tuple[int, ...], k: int = 4, *, context_len: int = 1000,
                     steps: int = 8, dtype: str = "bfloat16", kv_memory: int | None = None) -> dict[str, Any]:
    """Speculative decoding's premise on this device: the device time of a decode step whose
    rows each verify k proposals (1 + k tokens a row) against a plain decode step, at each
    batch size, on random weights. A verifying step pays when the tokens it keeps per row
    exceed `ratio - 1` (`break_even_kept`)."""
    import jax
    import jax.numpy as jnp

    from runtime.bench.breakdown import _median_ms
    from runtime.bench.step_rows import decode_rows
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import _default_kv_memory
    from runtime.model.batch import build_step_input

    cfg = model_config(cfg_kw)
    params = random_params_on_device(cfg, {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype])
    max_len = 16 * math.ceil((context_len + k + 64) / 16)
    cache = CacheConfig.from_memory(cfg, kv_memory or _default_kv_memory(cfg), 16, dtype)
    b_cap = cache.num_blocks // (max_len // 16)
    batches = tuple(sorted({min(b, b_cap) for b in batches}))
    top = max(batches)
    tokens = max(top * (k + 1), 64)
    env = SchedulerConfig(top, tokens, max_len)
    pol = AdmissionPolicy(max_num_seqs=top, max_num_batched_tokens=tokens, long_prefill_token_threshold=tokens)
    eng = LLMEngine(EngineConfig(cfg, cache, env, pol, "auto", dtype, quantization="none",
                                 speculative=SpeculativeConfig(num_speculative_tokens=k)), params,
                    synthetic_tokenizer(cfg.vocab_size), warmup=False, progress=False)
    r_ = eng.runner
    rows = []
    for B in batches:
        res: dict[str, Any] = {"batch": B}
        for name, d in (("decode_ms", 0), ("verify_ms", k)):
            seqs = decode_rows(r_, B, context_len, drafts=d)
            s_b, t_b = env.bucket_for(B, B * (1 + d))
            inp = jax.device_put(build_step_input(seqs, s_b, t_b, r_.max_blocks_per_seq, 16, r_.scratch_row,
                                                  r_.masks.all_allowed(s_b), spec_k=k))

            def go():
                r_.kv, r_.penalty, out, *_ = r_._step(r_.params, r_.kv, r_.penalty, inp)
                return out.token_ids
            res[name] = _median_ms(go, steps)
        res["ratio"] = res["verify_ms"] / res["decode_ms"]
        res["break_even_kept"] = res["ratio"] - 1.0
        rows.append(res)
    return {"model": cfg.name, "dtype": dtype, "k": k, "context_len": context_len,
            "attention_backend": r_.attention_backend, "rows": rows}


def format_verify_cost(r: dict[str, Any]) -> str:
    lines = [f"== speculative verify step: {r['model']} ({r['dtype']}, {r['attention_backend']} attention), "
             f"k={r['k']} proposals a row, context {r['context_len']} =="]
    for x in r["rows"]:
        lines.append(f"  B={x['batch']:<4} decode {x['decode_ms']:8.2f} ms  verify {x['verify_ms']:8.2f} ms  "
                     f"= {x['ratio']:.2f}x: pays when more than {x['break_even_kept']:.2f} proposals a row are kept")
    return "\n".join(lines)
