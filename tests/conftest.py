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
