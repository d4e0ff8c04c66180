"""`pagedjax` command line: pull, convert, inspect, generate, serve, bench, plan.

User errors print one line and exit 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from runtime.checkpoint.mapping import CheckpointError
from runtime.jax_setup import enable_compilation_cache, quiet_libraries  # noqa: F401  (re-exported)
from runtime.optional import MissingDependency, missing_optional, require

EXIT_USAGE = 2


class UserError(Exception):
    pass


def _fail(msg: str) -> int:
    print(f"pagedjax: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


# --- pull / convert / inspect ------------------------------------------------------

def cmd_pull(args: argparse.Namespace) -> int:
    from runtime.checkpoint.pull import pull

    out = pull(args.model, Path(args.out) if args.out else None, quantize=args.quantize)
    print(out)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from runtime.checkpoint.store import convert

    src_path = Path(args.src)
    if not src_path.exists():
        raise CheckpointError(f"{src_path}: no such file or directory")
    if args.source == "pagedjax":
        if args.quantize == "none":
            raise CheckpointError("--from pagedjax: give --quantize w8a8 (or w8a16); a float copy needs no convert")
        from runtime.checkpoint.store import quantize_checkpoint
        print(quantize_checkpoint(src_path, Path(args.out), args.quantize, force=args.force,
                                  lm_head=args.quantize_lm_head))
        return 0
    if args.source == "gguf":
        from runtime.checkpoint.gguf_source import GGUFSource
        source = GGUFSource(src_path)
    else:
        from runtime.checkpoint.hf_source import HFSource
        source = HFSource(src_path)
    if args.quantize != "none" and args.dtype != "float32":
        raise CheckpointError("--quantize: quantizes float32 weights; drop --dtype bfloat16")
    out = convert(source, Path(args.out), dtype=args.dtype, force=args.force, quantize=args.quantize,
                  lm_head=args.quantize_lm_head)
    print(out)
    return 0


def inspect_text(path: Path) -> str:
    from runtime.checkpoint.store import load_config

    cfg = load_config(path)
    from runtime.checkpoint.store import read_meta, stored_weight_bytes
    from runtime.model.quant import describe

    meta = read_meta(path)
    stored_bytes = stored_weight_bytes(path)
    dtype, quant = meta["dtype"], meta["quantization"]
    n = cfg.param_count()
    kv_tok = cfg.kv_bytes_per_token(dtype)
    rows = [
        ("checkpoint", str(path)),
        ("name", cfg.name),
        ("architecture", cfg.architecture),
        ("layers", cfg.num_layers),
        ("hidden size", cfg.hidden_size),
        *((("attention", f"multi-head latent: {cfg.num_heads} heads over one cached row of {cfg.kv_lora_rank} latent "
                         f"+ {cfg.qk_rope_head_dim} RoPE columns per token (expanded K/V would be "
                         f"{cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)})"),)
          if cfg.mla else (("heads / KV heads", f"{cfg.num_heads} / {cfg.num_kv_heads} "
                                                f"(GQA {cfg.num_heads // cfg.num_kv_heads}:1)"), ("head dim", cfg.head_dim))),
        *((("MLP", f"{cfg.num_experts} experts of width {cfg.moe_intermediate_size}, top {cfg.num_experts_per_tok}"
               f"{' renormalised' if cfg.norm_topk_prob else ''} per token"
               + (f", {cfg.num_shared_experts} shared" if cfg.num_shared_experts else "")
               + (f"; layers {', '.join(map(str, cfg.dense_layers))} dense of width {cfg.intermediate_size}"
                  if cfg.dense_layers else "")),) if cfg.num_experts
          else (("MLP size", cfg.intermediate_size),)),
        ("vocab", cfg.vocab_size),
        ("context length", cfg.max_position_embeddings),
        ("rope theta", cfg.rope_theta),
        ("tied embeddings", cfg.tie_word_embeddings),
        ("parameters", f"{n:,} ({n / 1e6:.1f} M)"
                       + (f"; {int(cfg.params_touched(1)):,} active per token" if cfg.num_experts else "")),
        ("dtype", dtype),
        ("quantization", describe(quant, meta["lm_head_int8"], meta["group_size"],
                                  meta["exact_gguf"] or meta["exact_q8_0"])),
        ("weight bytes", f"{stored_bytes:,} ({stored_bytes / 2**20:.1f} MiB)"),
        ("KV bytes per token", f"{kv_tok:,} ({kv_tok / 1024:.1f} KiB, {dtype})"),
        ("KV bytes per 1,000-token seq", f"{kv_tok * 1000:,} ({kv_tok * 1000 / 2**20:.1f} MiB)"),
        ("KV bytes per 16-token block", f"{kv_tok * 16:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def gguf_inspect_text(path: Path) -> str:
    """A GGUF source: its model, tensor types and how `convert` loads each of them."""
    from collections import Counter

    from runtime.checkpoint.gguf_source import GGUFSource

    src = GGUFSource(path)
    cfg = src.model_config()
    types = Counter(t.tensor_type.name for t in src.reader.tensors)
    n = cfg.param_count()
    rows = [("GGUF file", str(path)), ("name", cfg.name), ("architecture", cfg.architecture),
            ("layers", cfg.num_layers),
            ("heads / KV heads", f"{cfg.num_heads} / {cfg.num_kv_heads}"), ("parameters", f"{n:,}"),
            ("tensor types", ", ".join(f"{k} x{v}" for k, v in sorted(types.items())))]
    exact = src.projections_q8_0(cfg)
    for k in sorted(types):
        how = ("float, copied" if k in ("F32", "F16", "BF16") else
               "int8 values and block scales kept as they are by --quantize w8a8 (every projection is Q8_0; "
               "otherwise dequantized to float)" if k == "Q8_0" and exact else
               "4-bit values, block scales and offsets kept as they are by --quantize w4a16 (every projection "
               "4-bit); otherwise dequantized to float" if k in ("Q4_0", "Q4_1", "Q4_K") else
               "blocks dequantized to float; --quantize w8a8 then requantizes per output channel, smoothed")
        rows.append((f"  {k}", how))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.checkpoint)
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                print(gguf_inspect_text(path))
                return 0
    print(inspect_text(path))
    return 0


# --- generate ------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    from runtime.checkpoint.pull import resolve_checkpoint
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import engine_config_from_args, load_lora_modules, lora_modules
    from runtime.model.sampling import SamplingParams

    if args.lora is not None and args.lora not in dict(lora_modules(args)):
        raise ValueError(f"lora: {args.lora!r} is not one of --lora-modules")
    path = resolve_checkpoint(args.checkpoint)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    engine = LLMEngine.from_checkpoint(path, engine_config_from_args(args), warmup=False)
    load_lora_modules(engine, args)
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    for delta in engine.generate_text(tok.encode(text), params, lora=args.lora):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


# --- parser ----------------------------------------------------------------------------

# Subcommands defined outside this module: (module, function(subparsers) that adds the
# subcommand). Each is always registered; the function and its module import only required
# dependencies, and a command that needs an optional one declares it with
# `set_defaults(requires=("ray", ...))` (runtime/optional.py names the package and extra).
# A new subcommand is one more line here.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("console.serve", "add_serve_parser"),
    ("runtime.fleet.serve", "add_fleet_parser"),
    ("runtime.bench.cli", "add_bench_parser"),
    ("console.admin_cli", "add_admin_parser"),
)


def build_parser() -> argparse.ArgumentParser:
    from runtime.core.engine_args import add_engine_arguments
    from runtime.planner import add_plan_arguments

    p = argparse.ArgumentParser(prog="pagedjax", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    from runtime.checkpoint.pull import DEFAULT_MODEL, KNOWN_MODELS

    s = sub.add_parser("pull", help=f"download and convert a known model (default: {DEFAULT_MODEL})")
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL, choices=list(KNOWN_MODELS),
                   help=f"one of: {', '.join(KNOWN_MODELS)} (default: %(default)s)")
    s.add_argument("--out", help="checkpoint directory (default: checkpoints/<name>, or <name>-<quantize>)")
    s.add_argument("--quantize", choices=("none", "w4a16"), default="none",
                   help="w4a16: keep the GGUF's 4-bit blocks as stored (`convert --quantize w4a16`); serve it as "
                        "stored (--quantization auto)")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("convert", help="convert GGUF or Hugging Face safetensors into a pagedjax checkpoint")
    s.add_argument("--from", dest="source", choices=("gguf", "hf", "pagedjax"), required=True,
                   help="pagedjax: an existing float checkpoint, to store it quantized (--quantize)")
    s.add_argument("src", help="GGUF file, Hugging Face model directory or pagedjax checkpoint")
    s.add_argument("--quantize", choices=("none", "w8a8", "w8a16", "w4a16"), default="none",
                   help="store int8 weights and scales (w8a8: SmoothQuant-calibrated, as `serve --quantization "
                        "w8a8` would at start-up; from a GGUF whose projections are all Q8_0, its own int8 values "
                        "and block scales, exact; w4a16: from a GGUF, its Q4_0/Q4_1/Q4_K blocks as stored, refused "
                        "for a projection of another type; else 4-bit round to nearest per 32 inputs), so start-up "
                        "loads them without requantizing")
    s.add_argument("--quantize-lm-head", action="store_true", help="with --quantize w8a8: store an int8 LM head too")
    s.add_argument("--out", required=True, help="output checkpoint directory, e.g. checkpoints/NAME")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    s.add_argument("--force", action="store_true", help="overwrite an existing --out")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("inspect", help="show a checkpoint's (or a GGUF file's) architecture, sizes and quantization")
    s.add_argument("checkpoint", help="pagedjax checkpoint directory or GGUF file")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    s.add_argument("--checkpoint", help="checkpoint directory (default: the pulled default model)")
    s.add_argument("--prompt", required=True)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--lora", default=None, metavar="NAME", help="generate under this adapter of --lora-modules")
    add_engine_arguments(s, serving=False)
    s.set_defaults(func=cmd_generate)

    for module, func in SUBCOMMANDS:
        getattr(importlib.import_module(module), func)(sub)

    s = sub.add_parser("plan", help="capacity planning from the serving formulas")
    add_plan_arguments(s)
    from runtime.planner import run_plan
    s.set_defaults(func=run_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = f"pagedjax {args.command}"
    try:
        require(command, *getattr(args, "requires", ()))
        quiet_libraries()
        return int(args.func(args) or 0)
    except (CheckpointError, UserError, ValueError, FileNotFoundError, MissingDependency) as exc:
        return _fail(str(exc))
    except ImportError as exc:
        module = missing_optional(exc)
        if module is None:
            raise
        return _fail(str(MissingDependency(command, module)))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
