import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PAGEDJAX_JAX_CACHE", str(ROOT / ".cache" / "jax"))


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
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = Path(str(config.rootpath))

    def key(item) -> int:
        try:
            rel = Path(str(item.path)).relative_to(root).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(rel, len(rank))

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
