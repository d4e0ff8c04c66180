"""Export a GGUF (SmolLM2 or Gemma 3 270M) as a plain Hugging Face folder for vLLM (a peer of pagedjax).

Run with the vLLM venv's python (it has transformers, torch and gguf):

    .peers/vllm-venv/bin/python scripts/peers/export_hf.py --gguf PATH.gguf --out .peers/smollm2-hf

Why this exists: vLLM loads Hugging Face folders, and no model hub is reachable here, so the
only copy of a model is the GGUF that `pagedjax pull` downloads. transformers can
read it (`gguf_file=`, dequantized to float32: the same weights pagedjax converts), but the
model it returns is marked as quantized-from-GGUF and refuses `save_pretrained`. So the
state dict is copied into a freshly built model of the same class and that one is saved, as
float32 safetensors, with the tokenizer. The GGUF's chat template is copied into
tokenizer_config.json so /v1/chat/completions formats prompts exactly like pagedjax.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

# The model types whose GGUF-loaded model rebuilds as itself (the two pullable models'):
# Gemma 3 270M loads as a text-only Gemma3ForCausalLM.
SUPPORTED = ("llama", "gemma3_text")


def gguf_chat_template(path: Path) -> str | None:
    """The `tokenizer.chat_template` string of a GGUF file's metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def gguf_add_bos(path: Path) -> bool:
    """The GGUF's `tokenizer.ggml.add_bos_token` (False when absent)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field is not None and field.parts[field.data[0]][0])


def export(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF says whether a prompt starts with BOS (Gemma's must: without it Gemma 3 270M
    # answers "France. The The The ..."); transformers' GGUF tokenizer does not carry it over.
    add_bos = gguf_add_bos(gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                        **({"add_bos_token": True} if add_bos else {}))
    if add_bos and tok("x")["input_ids"][0] != tok.bos_token_id:
        sys.exit("export_hf: the GGUF adds BOS but the exported tokenizer does not")
    if src.config.model_type not in SUPPORTED:
        sys.exit(f"export_hf: expected one of {', '.join(SUPPORTED)}, got {src.config.model_type!r}")
    config_cls, model_cls = type(src.config), type(src)

    # A clean config: the GGUF-loaded one carries loader state that save_pretrained rejects.
    cfg = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures", "dtype",
                "torch_dtype"):
        cfg.pop(key, None)
    config = config_cls(**cfg)
    config.architectures = [model_cls.__name__]
    config.dtype = "float32"
    with torch.device("meta"):
        model = model_cls(config)
    # assign=True takes the dequantized tensors as they are (no copy into meta tensors);
    # strict=True so a missing or renamed tensor fails here, not as garbage text in vLLM.
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in src.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        sys.exit(f"export_hf: state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = src.generation_config
    model.eval()

    # Write into a scratch folder and rename at the end: a half-written export never looks done.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)

    template = gguf_chat_template(gguf)
    if template:
        tc_path = tmp / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["chat_template"] = template
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
        # Newer transformers also write chat_template.jinja, which wins over the JSON key when
        # both exist; keep the two identical.
        jinja = tmp / "chat_template.jinja"
        if jinja.exists():
            jinja.write_text(template)
    else:
        print("export_hf: warning: the GGUF has no chat template", file=sys.stderr)

    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"exported {gguf.name} -> {out} ({n / 1e6:.1f} M parameters, float32, "
          f"chat template {'copied' if template else 'missing'}) in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path, help="the GGUF (from `pagedjax pull smollm2` or `pull gemma3-270m`)")
    ap.add_argument("--out", required=True, type=Path, help="output folder, e.g. .peers/smollm2-hf")
    args = ap.parse_args()
    if not args.gguf.is_file():
        sys.exit(f"export_hf: {args.gguf}: no such file")
    export(args.gguf, args.out)


if __name__ == "__main__":
    main()
