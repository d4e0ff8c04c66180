"""LoRA adapters on the host: reading PEFT's format, the registry of named adapters, and which
adapter holds which device slot (runtime/model/lora.py holds the slots themselves).

An adapter is served under its own name (a request's `model`). Loading it reads and checks the
whole file at once (`read_adapter`: a bad file fails there, naming the problem, and nothing is
registered). Its `lora_id` is a hash of its files' contents: it keys the prefix cache (a prefix
computed under one adapter is never served to another, nor to a different adapter later loaded
under the same name), it is the KV events' `lora_id`, and every replica of a fleet that loads
the same files gives it the same id (the gateway hashes prompts as the replicas do).

Device slots: a request takes its adapter's slot when it starts running and gives it back when
it finishes or is preempted (`LoraSlots.acquire` / `release`). An adapter not in a slot goes into
a free one, or one whose adapter no running request uses (least recently used first); when every
slot holds a running request's adapter the request waits (the scheduler's one rule,
`LoraSlots.can_run`). Adapters read from disk stay on the host up to `max_cpu_loras` (LRU),
and are read again when a request names one that fell out.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from runtime.config import LoraConfig, ModelConfig
from runtime.model.lora import module_shape

# PEFT's module names -> the model's projections (Phi-3's fused ones split by their rows)
PEFT_MODULES: dict[str, tuple[str, ...]] = {
    "q_proj": ("wq",), "k_proj": ("wk",), "v_proj": ("wv",), "o_proj": ("wo",),
    "gate_proj": ("w_gate",), "up_proj": ("w_up",), "down_proj": ("w_down",),
    "qkv_proj": ("wq", "wk", "wv"), "gate_up_proj": ("w_gate", "w_up"),
    # multi-head latent attention (deepseek_v2); its kv_b_proj is absorbed into the attention
    # (the family reads it as a matrix, not as a product): refused
    "q_a_proj": ("wq_a",), "q_b_proj": ("wq_b",), "kv_a_proj_with_mqa": ("wkv_a",),
}
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")
# adapter_config.json: fields that say how the adapter was trained or where it came from (no
# effect on its product), and those read here; any other field set is refused.
_IGNORED = {"auto_mapping", "base_model_name_or_path", "revision", "task_type", "inference_mode", "init_lora_weights",
            "lora_dropout", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "peft_version",
            "megatron_core", "qalora_group_size", "layers_pattern", "layers_to_transform", "exclude_modules",
            "target_modules", "ensure_weight_tying", "megatron_config"}
_READ = {"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "bias"}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and the problem."""


class AdapterBusy(AdapterError):
    """An adapter that requests are still using (it cannot be unloaded now)."""


@dataclass
class Adapter:
    """One adapter read into the table's terms: per projection (a [L, in, r], b [L, r, out]), the
    scaling in b, zeros in the layers it leaves out."""
    name: str
    path: str
    lora_id: int
    rank: int
    modules: tuple[str, ...]
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int, supported: tuple[str, ...],
                 name: str = "", lora_id: int = 0, folds: dict | None = None) -> Adapter:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) checked against the
    model and read. `supported`: the model's projections the device table holds. `folds`: what
    SmoothQuant did to them (runtime/model/quant.py quantize_params): a projection whose input the
    served model holds as x / s reads it with A's rows times s, one whose output it holds times f
    gets its delta times f, so the adapter's delta is its delta on the float model."""
    d = Path(path)
    if not d.is_dir():
        raise AdapterError(f"{d}: not a directory (a PEFT adapter is a directory with adapter_config.json "
                           "and adapter_model.safetensors)")
    conf_path, st_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not conf_path.is_file():
        raise AdapterError(f"{d}: no adapter_config.json")
    if not st_path.is_file():
        bin_only = (d / "adapter_model.bin").is_file()
        raise AdapterError(f"{d}: no adapter_model.safetensors" + (" (adapter_model.bin is not read: convert it "
                                                                     "to safetensors)" if bin_only else ""))
    try:
        conf = json.loads(conf_path.read_text())
    except ValueError as exc:
        raise AdapterError(f"{conf_path}: not valid JSON ({exc})") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{conf_path}: must be a JSON object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{conf_path}: peft_type {conf.get('peft_type')!r} is not supported (only LORA)")
    if conf.get("bias", "none") != "none":
        raise AdapterError(f"{conf_path}: bias {conf['bias']!r} is not supported (only \"none\")")
    for k, v in conf.items():
        if k not in _IGNORED and k not in _READ and v not in (None, False, {}, [], "", 0):
            raise AdapterError(f"{conf_path}: {k} = {json.dumps(v)[:60]} is not supported")
    r0, alpha = conf.get("r"), conf.get("lora_alpha")
    if not isinstance(r0, int) or r0 < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{conf_path}: needs r (a positive integer) and lora_alpha (a number)")
    rslora = bool(conf.get("use_rslora", False))

    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(st_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{st_path}: cannot be read ({exc})") from None
    parts: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{st_path}: tensor {key} is not a LoRA weight of an attention or MLP projection "
                               f"({', '.join(PEFT_MODULES)})")
        layer, module, side = int(m[1]), m[2], m[3]
        if module == "kv_b_proj":
            raise AdapterError(f"{st_path}: kv_b_proj is not supported (latent attention absorbs it into the "
                               "attention; adapters on q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa and o_proj are)")
        if module not in PEFT_MODULES:
            raise AdapterError(f"{st_path}: {module} is not a supported target module "
                               f"(supported: {', '.join(PEFT_MODULES)})")
        if layer >= cfg.num_layers:
            raise AdapterError(f"{st_path}: {key} is for layer {layer}; the model has {cfg.num_layers}")
        parts.setdefault((module, layer), {})[side] = np.asarray(t, np.float32)
    if not parts:
        raise AdapterError(f"{st_path}: holds no LoRA weights")
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rank = 0
    for (module, layer), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{st_path}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r] (torch's Linear layout)
        r = a.shape[0]
        targets = PEFT_MODULES[module]
        din = module_shape(cfg, targets[0])[0]
        outs = [module_shape(cfg, t)[1] for t in targets]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != din or b.shape != (sum(outs), r):
            raise AdapterError(f"{st_path}: layer {layer} {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                               f"do not fit this model ([r, {din}] and [{sum(outs)}, r])")
        if r > max_rank:
            raise AdapterError(f"{d}: rank {r} ({module}) exceeds --max-lora-rank {max_rank}")
        rank = max(rank, r)
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        row = 0
        for t, width in zip(targets, outs):
            if t not in supported:
                raise AdapterError(f"{d}: target {module} is not a projection LoRA can wrap in this model "
                                   f"(a mixture of experts' experts are not supported; wrappable: "
                                   f"{', '.join(s for s in supported)})")
            wa, wb = weights.setdefault(t, (np.zeros((cfg.num_layers, din, max_rank), np.float32),
                                            np.zeros((cfg.num_layers, max_rank, width), np.float32)))
            wa[layer, :, :r] = a.T
            wb[layer, :r, :] = b[row:row + width].T * scaling
            row += width
    for t, (wa, wb) in weights.items():
        f = (folds or {}).get(t, {})
        if "in" in f:
            wa *= f["in"][:, :, None]
        if "out" in f:
            wb *= f["out"][:, None, :]
    trimmed = {t: (wa[:, :, :rank], wb[:, :rank]) for t, (wa, wb) in weights.items()}
    return Adapter(name, str(d), lora_id, rank, tuple(sorted(trimmed)), trimmed)


def content_id(path: str | Path) -> int:
    """A positive 63-bit id of the adapter directory's config and weights (the same files, the same id)."""
    import hashlib

    h = hashlib.sha256()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            with open(Path(path) / f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError:
            pass  # (read_adapter names what is missing)
    return int.from_bytes(h.digest()[:8], "big") >> 1 or 1


@dataclass
class Registered:
    """A name the server serves: where its adapter is and the id of this load."""
    name: str
    path: str
    lora_id: int
    rank: int
    modules: tuple[str, ...]
    loaded_at: float = field(default_factory=time.time)
    requests: int = 0       # requests that named it
    tokens: int = 0         # tokens generated under it


class LoraSlots:
    """The registry (name -> adapter), the host copies (LRU) and the device slots."""

    def __init__(self, cfg: ModelConfig, lcfg: LoraConfig, supported: tuple[str, ...],
                 write: Callable[[int, dict | None], None], folds: dict | None = None) -> None:
        self.cfg, self.lcfg, self.supported, self.write, self.folds = cfg, lcfg, supported, write, folds
        self.registered: dict[str, Registered] = {}
        self.host: OrderedDict[int, Adapter] = OrderedDict()  # lora_id -> adapter, least recently used first
        self.slots: list[int | None] = [None] * lcfg.max_loras  # lora_id per device slot
        self.slot_used: list[float] = [0.0] * lcfg.max_loras
        self.refs: dict[int, int] = {}  # lora_id -> running requests
        self.swaps_in = 0
        self.swap_seconds = 0.0
        self.lock = threading.Lock()

    # --- the registry (API thread) -------------------------------------------------------
    def load(self, name: str, path: str | Path) -> Registered:
        """Read and check the adapter, then register it under `name` (AdapterError: nothing changed)."""
        if not name or not re.fullmatch(r"[A-Za-z0-9._:/@-]{1,128}", name):
            raise AdapterError(f"lora_name: {name!r} must be 1-128 characters of letters, digits and ._:/@-")
        with self.lock:
            if name in self.registered:
                raise AdapterError(f"lora_name: an adapter named {name!r} is already loaded (unload it first)")
        ad = read_adapter(path, self.cfg, self.lcfg.max_lora_rank, self.supported, name, content_id(path), self.folds)
        with self.lock:
            if name in self.registered:
                raise AdapterError(f"lora_name: an adapter named {name!r} is already loaded (unload it first)")
            reg = Registered(name, ad.path, ad.lora_id, ad.rank, ad.modules)
            self.registered[name] = reg
            self._keep(ad)
        return reg

    def unload(self, name: str) -> Registered:
        """Forget the name; requests already running under it finish (their slot stays until then)."""
        with self.lock:
            reg = self.registered.pop(name, None)
            if reg is None:
                raise KeyError(name)
            self.host.pop(reg.lora_id, None)
            return reg

    def get(self, name: str) -> Registered | None:
        with self.lock:
            return self.registered.get(name)

    def _keep(self, ad: Adapter) -> None:
        self.host[ad.lora_id] = ad
        self.host.move_to_end(ad.lora_id)
        while len(self.host) > self.lcfg.max_cpu_loras:
            self.host.popitem(last=False)

    def _adapter(self, lora_id: int) -> Adapter:
        ad = self.host.get(lora_id)
        if ad is not None:
            self.host.move_to_end(lora_id)
            return ad
        reg = next((r for r in self.registered.values() if r.lora_id == lora_id), None)
        if reg is None:
            raise AdapterError(f"adapter id {lora_id} was unloaded")
        ad = read_adapter(reg.path, self.cfg, self.lcfg.max_lora_rank, self.supported, reg.name, lora_id, self.folds)
        self._keep(ad)
        return ad

    # --- device slots (the scheduler, between steps) -----------------------------------------
    def slot_of(self, lora_id: int) -> int:
        return self.slots.index(lora_id) if lora_id in self.slots else -1

    def can_run(self, lora_id: int) -> bool:
        """Its adapter is in a slot, or a slot can take it (free, or no running request uses its adapter)."""
        return lora_id in self.slots or any(s is None or not self.refs.get(s) for s in self.slots)

    def acquire(self, lora_id: int) -> tuple[int, bool]:
        """(the slot a starting request uses, whether its adapter was written there now)."""
        with self.lock:
            slot = self.slot_of(lora_id)
            written = slot < 0
            if written:
                free = [i for i, s in enumerate(self.slots) if s is None or not self.refs.get(s)]
                if not free:
                    raise RuntimeError("no LoRA slot is free (the scheduler checks can_run first)")
                slot = min(free, key=lambda i: (self.slots[i] is not None, self.slot_used[i]))
                t0 = time.perf_counter()
                self.write(slot, self._adapter(lora_id).weights)
                self.swap_seconds += time.perf_counter() - t0
                self.swaps_in += 1
                self.slots[slot] = lora_id
            self.refs[lora_id] = self.refs.get(lora_id, 0) + 1
            self.slot_used[slot] = time.monotonic()
            return slot, written

    def release(self, lora_id: int) -> None:
        with self.lock:
            n = self.refs.get(lora_id, 0) - 1
            if n > 0:
                self.refs[lora_id] = n
            else:
                self.refs.pop(lora_id, None)

    def snapshot(self) -> dict[str, Any]:
        """For the console and /v1/models: each adapter, where it is, what it served."""
        with self.lock:
            by_id = {r.lora_id: r for r in self.registered.values()}
            return {
                "max_loras": self.lcfg.max_loras, "max_lora_rank": self.lcfg.max_lora_rank,
                "max_cpu_loras": self.lcfg.max_cpu_loras, "swaps_in": self.swaps_in,
                "swap_seconds": self.swap_seconds,
                "slots": [{"slot": i, "adapter": by_id[s].name if s in by_id else (None if s is None else f"#{s}"),
                           "running": self.refs.get(s, 0) if s is not None else 0} for i, s in enumerate(self.slots)],
                "adapters": [{"name": r.name, "path": r.path, "lora_id": r.lora_id, "rank": r.rank,
                              "modules": list(r.modules), "loaded_at": r.loaded_at, "requests": r.requests,
                              "tokens": r.tokens, "slot": self.slot_of(r.lora_id),
                              "on_host": r.lora_id in self.host, "running": self.refs.get(r.lora_id, 0)}
                             for r in self.registered.values()],
            }
