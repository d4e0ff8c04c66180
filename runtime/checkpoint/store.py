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
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from runtime.checkpoint.mapping import CheckpointError, ParamAssembler, check_shapes
from runtime.config import ModelConfig
from runtime.model.families import param_shapes

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
                     chat_template: str | None, dtype: str = "float32", force: bool = False,
                     quantization: str = "none", lm_head_int8: bool = False, group_size: int | None = None,
                     exact_gguf: bool = False) -> Path:
    with atomic_output_dir(out, force) as tmp:
        save_params(tmp / "params", params)
        cfg.save(tmp / "config.json")
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        if chat_template:
            (tmp / "chat_template.jinja").write_text(chat_template)
        meta = {"format": 1, "dtype": dtype, "quantization": quantization, "lm_head_int8": lm_head_int8}
        if group_size:  # a scale per group_size inputs (w8a8's own, or GGUF Q8_0's as stored there)
            meta["group_size"] = group_size
        if exact_gguf:  # the quantized values and scales are a GGUF's own blocks, as stored there
            meta["exact_q8_0" if quantization == "w8a8" else "exact_gguf"] = True
        (tmp / "pagedjax.json").write_text(json.dumps(meta) + "\n")
    return out


def read_meta(path: Path) -> dict[str, Any]:
    """pagedjax.json (dtype, quantization); older checkpoints lack it or the quantization."""
    meta = path / "pagedjax.json"
    d = json.loads(meta.read_text()) if meta.is_file() else {}
    return {"dtype": d.get("dtype", "float32"), "quantization": d.get("quantization", "none"),
            "lm_head_int8": bool(d.get("lm_head_int8", False)), "group_size": d.get("group_size"),
            "exact_q8_0": bool(d.get("exact_q8_0", False)), "exact_gguf": bool(d.get("exact_gguf", False))}


def stored_weight_bytes(path: Path) -> int:
    """Bytes of the stored parameters: int8 quantized weights at 1 B, scales at 4 B, the
    rest at the checkpoint's dtype."""
    from runtime.config import DTYPE_BYTES
    from runtime.model.quant import quantized_shapes

    meta = read_meta(path)
    shapes = quantized_shapes(param_shapes(load_config(path)), meta["quantization"], meta["lm_head_int8"],
                              meta["group_size"])
    total = 0

    def walk(tree: dict) -> None:
        nonlocal total
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v)
            else:
                size = int(np.prod(v))
                total += size * (1 if k in ("q", "w8", "q4", "q8") else 4 if k in ("s", "in", "g", "s4", "m4", "s8")
                                 else DTYPE_BYTES[meta["dtype"]])
    walk(shapes)
    return total


def quantize_for_checkpoint(cfg: ModelConfig, params: dict[str, Any], method: str, tokenizer_json: str,
                            chat_template: str | None, lm_head: bool = False) -> dict[str, Any]:
    """Quantize float params as the engine would at start-up (w8a8: SmoothQuant calibrated on
    the support-chat text through this checkpoint's own tokenizer), as numpy arrays."""
    import jax
    from tokenizers import Tokenizer

    from runtime.model.quant import prepare
    from runtime.tokenizer import TextTokenizer

    if cfg.num_experts:
        raise CheckpointError(f"--quantize {method}: a mixture of experts is not stored quantized yet; convert it "
                              f"as float and serve it with --quantization {method}")

    tok = TextTokenizer(Tokenizer.from_str(tokenizer_json), chat_template, cfg.bos_token_id, cfg.eos_token_ids,
                        cfg.add_bos_token)
    return jax.tree.map(np.asarray, prepare(params, method, cfg, tok, lm_head=lm_head))


def convert(source: Any, out: Path, dtype: str = "float32", force: bool = False,
            progress: bool = True, quantize: str = "none", lm_head: bool = False) -> Path:
    """Stream tensors from a GGUFSource/HFSource into our format, with a per-tensor bar;
    `quantize` stores int8 weights and their scales (start-up then loads them as they are)."""
    np_dtype = _np_dtype(dtype)
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already exists (pass --force to overwrite)")
    cfg = source.model_config()
    if quantize == "w4a16" and hasattr(source, "check_4bit"):
        source.check_4bit(cfg)  # refused before any tensor is read
    asm = ParamAssembler(cfg, source.rules, np_dtype)
    total = source.num_tensors()
    for name, array in tqdm(source.tensors(), total=total, desc="converting", unit="tensor",
                            disable=not progress):
        asm.add(name, array)
    params = asm.finish(param_shapes(cfg))
    tok_json, template = source.tokenizer_json(), source.chat_template()
    if quantize == "w4a16" and hasattr(source, "q4_weights"):  # a GGUF: its 4-bit blocks, as they are
        print("quantizing (w4a16): the GGUF's 4-bit values, block scales and offsets, kept exact", file=sys.stderr)
        from runtime.model.quant import W4_GROUP, quantize_head_w8, quantized_shapes

        exact4 = source.q4_weights(cfg)
        head = exact4.get("head") or quantize_head_w8(params)  # a Q8_0 head as stored, else from its floats
        params = {**params, "layers": {**params["layers"], **exact4["layers"]}, "head": head}
        check_shapes(params, quantized_shapes(param_shapes(cfg), "w4a16"))
        return write_checkpoint(out, cfg, params, tok_json, template, dtype, force, quantize, True, W4_GROUP,
                                exact_gguf=True)
    exact = source.q8_0_weights(cfg, lm_head) if quantize == "w8a8" and hasattr(source, "q8_0_weights") else None
    if exact is not None:  # every projection is Q8_0: its int8 values and block scales, as they are
        print("quantizing (w8a8): the GGUF's Q8_0 values and block scales, kept exact", file=sys.stderr)
        from runtime.model.quant import Q8_0_GROUP, quantized_shapes

        params = {**params, "layers": {**params["layers"], **exact["layers"]}}
        if "head" in exact:
            params["head"] = exact["head"]
        check_shapes(params, quantized_shapes(param_shapes(cfg), "w8a8", lm_head, Q8_0_GROUP))
        return write_checkpoint(out, cfg, params, tok_json, template, dtype, force, quantize, lm_head, Q8_0_GROUP,
                                exact_gguf=True)
    if quantize != "none":
        print(f"quantizing ({quantize}) ...", file=sys.stderr)
        params = quantize_for_checkpoint(cfg, params, quantize, tok_json, template, lm_head)
    return write_checkpoint(out, cfg, params, tok_json, template, dtype, force, quantize,
                            lm_head or quantize == "w4a16", _group_size(params))


def quantize_checkpoint(src: Path, out: Path, method: str, force: bool = False, lm_head: bool = False) -> Path:
    """A pagedjax float checkpoint -> the same model with quantized weights at `out`."""
    cfg = load_config(src)
    meta = read_meta(src)
    if meta["quantization"] != "none":
        raise CheckpointError(f"{src}: already quantized ({meta['quantization']}); quantize its float source instead")
    if meta["dtype"] != "float32":
        raise CheckpointError(f"{src}: stored as {meta['dtype']}; quantize a float32 checkpoint")
    if out.resolve() == src.resolve():
        raise CheckpointError(f"{out}: is the source checkpoint; choose another --out")
    params = load_params(src, cfg, as_numpy=True)
    template = src / "chat_template.jinja"
    tok_json = (src / "tokenizer.json").read_text()
    chat = template.read_text() if template.is_file() else None
    print(f"quantizing ({method}) ...", file=sys.stderr)
    qp = quantize_for_checkpoint(cfg, params, method, tok_json, chat, lm_head)
    return write_checkpoint(out, cfg, qp, tok_json, chat, "float32", force, method, lm_head or method == "w4a16",
                            _group_size(qp))


def _group_size(params: dict[str, Any]) -> int | None:
    """The inputs per scale of a grouped w8a8 tree (None: one scale per output channel)."""
    from runtime.model.quant import W4_GROUP, W8A8_GROUP, is_grouped, quantization_of

    if quantization_of(params) == "w4a16":
        return W4_GROUP
    return W8A8_GROUP if quantization_of(params) == "w8a8" and is_grouped(params) else None


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


def load_params(path: Path, cfg: ModelConfig, dtype: Any = None, as_numpy: bool = False, *,
                shardings: Any = None, check: Any = None) -> dict[str, Any]:
    """Restore parameters as jax arrays, float ones cast to `dtype` (e.g. jnp.bfloat16 on
    GPU); int8 weights and their scales of a quantized checkpoint keep their dtype.
    shardings(tree) -> a NamedSharding per leaf of the stored tree (tensor parallelism):
    orbax then restores each array straight into its shards, no whole copy on one device
    first; check(tree), given the stored shapes, raises first when they do not shard."""
    import jax
    import orbax.checkpoint as ocp

    from runtime.model.quant import QUANTIZATIONS, cast_params, quantized_shapes

    meta = read_meta(path)
    method = meta["quantization"]
    if method not in QUANTIZATIONS:
        raise CheckpointError(f"{path}: unknown quantization {method!r} in pagedjax.json")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            if shardings is None:
                raw = ckptr.restore((path / "params").resolve())
            else:
                raw = _restore_sharded(ckptr, (path / "params").resolve(), cfg, method, meta, shardings, check)
    except ValueError as exc:
        if isinstance(exc, CheckpointError) or str(exc).startswith("tensor_parallel_size:"):
            raise
        raise CheckpointError(f"{path}: cannot restore parameters ({type(exc).__name__}: {exc})") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot restore parameters ({type(exc).__name__}: {exc})") from None
    check_shapes(raw, quantized_shapes(param_shapes(cfg), method, meta["lm_head_int8"], meta["group_size"]))
    if as_numpy:
        return jax.tree.map(np.asarray, raw)
    return jax.tree.map(jax.numpy.asarray, raw) if dtype is None else cast_params(raw, dtype)


def _restore_sharded(ckptr: Any, directory: Path, cfg: ModelConfig, method: str, meta: dict[str, Any],
                     shardings: Any, check: Any) -> dict[str, Any]:
    import jax

    from runtime.model.quant import quantized_shapes

    stored = ckptr.metadata(directory).item_metadata.tree
    stored = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), stored)
    check_shapes(stored, quantized_shapes(param_shapes(cfg), method, meta["lm_head_int8"], meta["group_size"]))
    if check is not None:
        check(stored)
    target = jax.tree.map(lambda m, sh: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh), stored, shardings(stored))
    return ckptr.restore(directory, target)


def load_tokenizer(path: Path, cfg: ModelConfig):
    from runtime.tokenizer import TextTokenizer

    return TextTokenizer.from_checkpoint(path, cfg.bos_token_id, cfg.eos_token_ids, cfg.add_bos_token)


def load_checkpoint(path: Path, dtype: Any = None):
    """-> (ModelConfig, params pytree, TextTokenizer)."""
    from runtime.tokenizer import TextTokenizer

    cfg = load_config(path)
    params = load_params(path, cfg, dtype)
    tok = TextTokenizer.from_checkpoint(path, cfg.bos_token_id, cfg.eos_token_ids, cfg.add_bos_token)
    return cfg, params, tok
