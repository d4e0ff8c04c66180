import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Compiled programs outlive the checkout (a fresh clone of the same code into the same path
# compiles little again); the product's own cache (~/.cache/pagedjax/jax) stays apart from the tests'.
os.environ.setdefault("PAGEDJAX_JAX_CACHE", str(Path.home() / ".cache" / "pagedjax" / "jax-tests"))


def pytest_configure(config):
    from runtime.cli import enable_compilation_cache

    enable_compilation_cache()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from tests.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def smollm2_ckpt() -> Path:
    """The real default model, pulled and converted once (cached under checkpoints/)."""
    from runtime.checkpoint.pull import default_checkpoint, pull

    path = ROOT / default_checkpoint()
    if not (path / "config.json").is_file():
        pull(out=path, progress=False)
    return path


# Under `--dist loadfile` each worker takes the next whole file as it frees up, in collection
# order. Starting the longest files first (longest-processing-time-first) keeps one worker
# from picking up a 5-minute file at the end while the other sits idle. Approximate order,
# from fresh-clone runs on the 2-core machine (the slowest start servers or Ray fleets).
# The disaggregated fleet compiles the same step shapes as the colocated one (same engine
# flags), so it goes after it: its replicas then load them from the compilation cache.
LONGEST_FIRST = (
    "tests/fleet/test_fleet_ray.py",
    "tests/runtime/test_tp.py",
    "tests/runtime/test_real_model.py",
    "tests/console/test_api_real_model.py",
    "tests/fleet/test_fleet_disagg.py",
    "tests/fleet/test_fleet_smollm2.py",
    "tests/console/test_admin_browser.py",
    "tests/runtime/test_kv_quant.py",
    "tests/runtime/test_quant.py",
    "tests/pallas_kernels/test_paged_attention.py",
    "tests/runtime/test_lora.py",
    # then the fast tier's longest (`-m fast` hands these out first; 14-24 s each unloaded)
    "tests/console/test_api_errors.py",
    "tests/console/test_api_openai.py",
    "tests/runtime/test_families.py",
    "tests/runtime/test_cpu_linear_f32.py",
    "tests/runtime/test_kv_transfer.py",
    "tests/console/test_admin_pages.py",
)


# The `fast` tier (`pytest -m fast`, `bash scripts/test.sh -m fast`): the inner loop, under
# 3 minutes on the 2-core machine with two workers. Every test is in it unless it carries a
# slower tier's marker or is listed here, by file or as "file::test" (every parametrization).
# An entry goes here when it alone takes a large share of that budget: the per-file times
# printed at the end of a run (and --durations) say which.
SLOW_TIERS = ("real_model", "fleet", "browser", "gpu")
SLOW = (
    "tests/runtime/test_tp.py",                      # tensor parallelism: multi-device subprocesses
    "tests/runtime/test_kv_quant.py",                # quantized KV: compiles its own step shapes
    "tests/runtime/test_quant.py",                   # w8a8 / w8a16 models: compiles, C++ kernels
    "tests/pallas_kernels/test_paged_attention.py",  # Pallas in interpret mode on CPU
    "tests/pallas_kernels/test_w4a16_matmul.py",     # the same, for the 4-bit matmul
    "tests/runtime/test_engine_pallas.py",           # the engine on interpreted Pallas kernels (minutes)
    "tests/runtime/test_engine.py",                  # the engine end to end, many configurations
    "tests/runtime/test_engine_steady.py",           # a full warm-up, then a 200-request workload
    "tests/runtime/test_bench.py",                   # benchmark runs, one against a live server
    "tests/runtime/test_bench_engine_parts.py",      # step breakdowns, Llama-3-shaped engine runs
    "tests/runtime/test_families_config.py",         # family configs against transformers (RoPE, windows)
    # Gemma 2 / 3 through the engine against transformers (the conversions and attention checks stay fast)
    "tests/runtime/test_families_gemma.py::test_gemma_matches_transformers_through_the_engine",
    "tests/runtime/test_families_gemma.py::test_gemma_prefix_cache_preemption_and_batch_invariance",
    "tests/runtime/test_families_phi3.py",           # Phi-3 against transformers through the engine
    "tests/runtime/test_families_moe.py::test_moe_matches_transformers_through_the_engine",
    "tests/runtime/test_families_moe.py::test_moe_prefix_cache_and_batch_invariance",
    "tests/runtime/test_families_moe.py::test_expert_parallel_2_and_4_give_1s_tokens",  # 4-device subprocesses
    "tests/runtime/test_families_moe.py::test_decoder_sparse_step_makes_the_skipped_layers_dense",
    "tests/runtime/test_families_moe.py::test_quantized_experts_serve_close_to_float",
    # DeepSeek-V2 through the engine and the API against transformers (conversion and routing stay fast)
    "tests/runtime/test_families_deepseek.py::test_deepseek_matches_transformers_through_the_engine",
    "tests/runtime/test_families_deepseek.py::test_deepseek_prefix_cache_preemption_and_batch_invariance",
    "tests/runtime/test_families_deepseek.py::test_deepseek_through_the_openai_api",
    "tests/runtime/test_families_deepseek.py::test_a_quantized_latent_cache",
    "tests/runtime/test_families_deepseek.py::test_latent_blocks_transfer_between_prefill_and_decode_engines",
    # yarn / dynamic / longrope through the engine against transformers (the tables stay fast)
    "tests/runtime/test_rope_scaling.py::test_yarn_matches_transformers",
    "tests/runtime/test_rope_scaling.py::test_dynamic_is_default_rope_within_max_positions_and_refused_past_them",
    "tests/runtime/test_rope_scaling.py::test_longrope_matches_transformers_within_the_original_context",
    "tests/console/test_api_lifecycle.py",           # four server starts, drains with timeouts
    "tests/console/test_api_streaming.py",           # a server under 32 concurrent streams
    "tests/console/test_api_fuzz.py",                # schemathesis against a live server
    "tests/test_packaging.py",                       # builds and installs the wheel
    "tests/runtime/test_cpu_kernel_variants.py",     # builds every ISA variant of the C++ kernels
    "tests/kernels/test_sanitizers.py",              # the C++ kernels built and run under sanitizers
    "tests/runtime/test_kv_transfer.py::test_ray_connector",  # starts a local Ray instance
    # speculative decoding's statistical, churn and batch-size runs (its equality checks stay fast)
    "tests/runtime/test_speculative.py::test_sampled_tokens_follow_the_target_distribution",
    "tests/runtime/test_speculative.py::test_churn_with_speculation_leaks_nothing",
    "tests/runtime/test_speculative.py::test_speculation_turns_off_at_the_batch_size",
    "tests/runtime/test_speculative.py::test_suffix_proposes_a_repeated_answer_from_the_cache",
    "tests/runtime/test_speculative.py::test_a_poor_draft_model_keeps_little_and_changes_nothing",
    # the engine served through each C++ kernel (the kernels' own tests stay fast)
    "tests/runtime/test_cpu_attention.py::test_kernel_inside_the_engine_gives_the_xla_tokens",
    "tests/runtime/test_cpu_matmul.py::test_engine_serves_w8a8_through_the_kernel",
    "tests/runtime/test_cpu_matmul.py::test_engine_serves_a_q8_0_checkpoint_through_the_grouped_kernel",
    "tests/runtime/test_w4a16.py::test_a_q4_gguf_serves_its_own_4bit_values_with_the_float_engine_s_tokens",
    "tests/runtime/test_w4a16.py::test_a_float_checkpoint_served_as_w4a16",
    # 20 mixed requests through both schedulers, and four CLI processes
    "tests/runtime/test_engine_async.py::test_async_and_sync_scheduling_give_the_same_outputs",
    "tests/console/test_state.py::test_an_unusable_state_dir_is_one_line_and_exit_2",
    # LoRA: every family and the quantized bases against transformers + peft; a served adapter
    "tests/runtime/test_lora.py::test_every_family_matches_peft_alone_and_beside_the_base",
    "tests/runtime/test_lora.py::test_quantized_bases_under_lora",
    "tests/runtime/test_lora.py::test_deepseek_latent_attention_adapters_match_peft",
    "tests/runtime/test_lora.py::test_xla_path_and_bfloat16_slots_give_the_kernels_tokens",
    "tests/console/test_api_lora.py",
)


def _rel(item, root: Path) -> str | None:
    try:
        return Path(str(item.path)).relative_to(root).as_posix()
    except ValueError:
        return None


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = Path(str(config.rootpath))
    slow = set(SLOW)

    for item in items:
        rel = _rel(item, root)
        name = getattr(item, "originalname", item.name)  # (a parametrized test's name, without [...])
        if rel not in slow and f"{rel}::{name}" not in slow and not any(
                item.get_closest_marker(m) for m in SLOW_TIERS):
            item.add_marker(pytest.mark.fast)

    def key(item) -> int:
        return rank.get(_rel(item, root), len(rank))

    items.sort(key=key)  # stable: within a file, and among the rest, collection order stays


# Per-file time (setup + call + teardown of every test in it), printed after the slowest steps:
# it is what LONGEST_FIRST above should follow, and what a suite over its time budget trims.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    top = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_sep("=", f"slowest files (of {len(_FILE_SECONDS)}; {sum(_FILE_SECONDS.values()):.0f} s in all)")
    for path, s in top:
        terminalreporter.write_line(f"{s:8.1f}s {path}")
