"""Our checkpoint format: `params/` (orbax) + config.json + tokenizer.json + chat_template.jinja.

Conversions write into a temporary sibling directory and rename it into place at the end,
so an interrupted or failed conversion leaves nothing half-written at `--out`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from runtime.checkpoint.mapping import CheckpointError, ParamAssembler
from runtime.config import ModelConfig
from runtime.models.llama import param_shapes

log = logging.getLogger(__name__)
FILES = ("config.json", "tokenizer.json")
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


def _np_dtype(name: str):
    if name not in DTYPES:
        raise CheckpointError(f"--dtype: unsupported {name!r} (use float32 or bfloat16)")
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return DTYPES[name]


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp dir next to `out`; on success it replaces `out`, on failure it vanishes."""
    out = out.resolve()
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already exists (pass --force to overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_params(path: Path, params: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.resolve(), params)
        ckptr.wait_until_finished()


def write_checkpoint(out: Path, cfg: ModelConfig, params: dict[str, Any], tokenizer_json: str,
                     chat_template: str | None, dtype: str = "float32", force: bool = False) -> Path:
    with atomic_output_dir(out, force) as tmp:
        save_params(tmp / "params", params)
        cfg.save(tmp / "config.json")
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        if chat_template:
            (tmp / "chat_template.jinja").write_text(chat_template)
        (tmp / "pagedjax.json").write_text(json.dumps({"format": 1, "dtype": dtype}) + "\n")
    return out


def convert(source: Any, out: Path, dtype: str = "float32", force: bool = False,
            progress: bool = True) -> Path:
    """Stream tensors from a GGUFSource/HFSource into our format, with a per-tensor bar."""
    np_dtype = _np_dtype(dtype)
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already exists (pass --force to overwrite)")
    cfg = source.model_config()
    asm = ParamAssembler(cfg, source.rules, np_dtype)
    total = source.num_tensors()
    for name, array in tqdm(source.tensors(), total=total, desc="converting", unit="tensor",
                            disable=not progress):
        asm.add(name, array)
    params = asm.finish(param_shapes(cfg))
    return write_checkpoint(out, cfg, params, source.tokenizer_json(), source.chat_template(), dtype, force)


def check_checkpoint_dir(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    missing = [f for f in (*FILES, "params") if not (path / f).exists()]
    if missing:
        raise CheckpointError(f"{path}: not a pagedjax checkpoint (missing {', '.join(missing)})")


def load_config(path: Path) -> ModelConfig:
    check_checkpoint_dir(path)
    try:
        return ModelConfig.load(path / "config.json")
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: invalid ({exc})") from None


def load_params(path: Path, cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    """Restore parameters as jax arrays, cast to `dtype` (e.g. jnp.bfloat16 on GPU)."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from runtime.checkpoint.mapping import check_shapes

    try:
        with ocp.StandardCheckpointer() as ckptr:
            raw = ckptr.restore((path / "params").resolve())
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot restore parameters ({type(exc).__name__}: {exc})") from None
    check_shapes(raw, param_shapes(cfg))
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=dtype or a.dtype), raw)


def load_checkpoint(path: Path, dtype: Any = None):
    """-> (ModelConfig, params pytree, TextTokenizer)."""
    from runtime.tokenizer import TextTokenizer

    cfg = load_config(path)
    params = load_params(path, cfg, dtype)
    tok = TextTokenizer.from_checkpoint(path, cfg.bos_token_id, cfg.eos_token_ids, cfg.add_bos_token)
    return cfg, params, tok
