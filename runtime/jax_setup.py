"""Process-wide logging and JAX settings every entry point applies (CLI, fleet replicas, tests)."""

from __future__ import annotations

import logging
import os
from pathlib import Path


def quiet_libraries() -> None:
    """orbax/absl and jax log chatty INFO lines; keep the terminal for our own."""
    for name in ("absl", "jax", "jax._src.xla_bridge", "orbax", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    enable_compilation_cache()


def enable_compilation_cache() -> None:
    """JAX persistent compilation cache: a restart reuses compiled step programs."""
    import jax

    path = os.environ.get("PAGEDJAX_JAX_CACHE", str(Path.home() / ".cache" / "pagedjax" / "jax"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
