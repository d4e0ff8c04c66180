"""LoRA on the device: a fixed table of adapter slots and the Linear that adds a row's adapter.

    LoraTable   every LoRA-able projection's slots: a [L, S, in, P*R], b [L, S, P*R, out]
    LoraBatch   the step's rows sorted by slot (computed in the step from StepInput.lora_slots)
    LoraLinear  base.apply(x) + (x @ a[slot]) @ b[slot] for each row's slot (none: + 0)

The table's shape depends only on the model and `--max-loras` / `--max-lora-rank`, never on
which adapters are loaded: writing an adapter into a slot (`write_slot`) is a data update of
a jitted step's argument, so adding and removing adapters compiles nothing.

A row's product is Punica's SGMV: each slot's rows multiplied by its own matrices, so the FLOPs
are the rows' own T * R * (in + out), not S times that. On CPU the C++ kernel
(runtime/kernels/cpu/cpu_lora.cc) groups the rows by slot and reads each active adapter's
matrices once; elsewhere the rows are sorted by slot here (LoraBatch) and multiplied as
segments (runtime/model/linear.py expert_products: jax.lax.ragged_dot off CPU). Rows without an
adapter take no product; a step with none skips the whole thing (one lax.cond per product).

A stored projection may hold several of the model's (the runner fuses q|k|v): its slot holds
each part's a side by side ([in, P*R]) and each part's b in its own columns ([R, out]); part p's
columns take u[:, pR:(p+1)R] @ b (`parts`: each stored name's column offsets). A rank below the
table's is zero-padded; the adapter's scaling (alpha / r, rsLoRA alpha / sqrt r) is folded into
b when it is written.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.config import ModelConfig
from runtime.model.linear import HeldPerLayer, Linear, expert_products, pytree, rms_norm, static

# a stored projection -> the model's projections it holds, in its column order
PARTS = {"qkv": ("wq", "wk", "wv"), "gate_up": ("w_gate", "w_up")}
MODULES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wq_a", "wq_b", "wkv_a")  # (the last three: MLA's)


def module_shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    """(in, out) of one of the model's projections."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if cfg.mla:  # latent attention: queries of qk_nope + qk_rope per head, values of v_head_dim
        H, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q_in = cfg.q_lora_rank or d
        mla = {"wq": (d, H * qk), "wq_a": (d, cfg.q_lora_rank), "wq_b": (q_in, H * qk),
               "wkv_a": (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), "wo": (H * cfg.v_head_dim, d)}
        if name in mla:
            return mla[name]
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}[name]


def lora_names(layers: dict[str, Any]) -> tuple[str, ...]:
    """The stored projections LoRA can wrap: the model's plain projections (or the runner's fusions
    of them), held as arrays, quantized dicts or per-layer tuples. A mixture of experts' experts
    (StackedExperts) and its routed MLP are held objects, not projections: left out."""
    out = []
    for name in (*MODULES, *PARTS):
        w = layers.get(name)
        if w is not None and (isinstance(w, (dict, tuple, Linear)) or hasattr(w, "shape")) \
                and not (isinstance(w, HeldPerLayer) and not isinstance(w, Linear)):
            out.append(name)
    return tuple(out)


@pytree
class LoraTable:
    """The adapter slots on the device, per stored projection name."""
    a: dict   # name -> [L, S, in, P*R] float32 or bfloat16 (LoraConfig.dtype)
    b: dict   # name -> [L, S, R, out] (the adapter's scaling folded in)
    parts: tuple = static(())  # ((name, (0, out of part 0, ..., out)), ...): each name's part columns
    rank: int = static(16)
    slots: int = static(1)
    kernel: bool = static(False)  # the C++ CPU kernel's products (runtime/kernels/cpu/lora.py), else XLA's

    @classmethod
    def empty(cls, cfg: ModelConfig, names: tuple[str, ...], slots: int, rank: int,
              kernel: bool = False, dtype: Any = jnp.float32) -> "LoraTable":
        L = cfg.num_layers
        a, b, cols = {}, {}, []
        for name in names:
            parts = PARTS.get(name, (name,))
            din = module_shape(cfg, parts[0])[0]
            offsets = tuple(int(x) for x in np.cumsum([0, *(module_shape(cfg, p)[1] for p in parts)]))
            a[name] = jnp.zeros((L, slots, din, len(parts) * rank), dtype)
            b[name] = jnp.zeros((L, slots, rank, offsets[-1]), dtype)
            cols.append((name, offsets))
        return cls(a, b, tuple(cols), rank, slots, kernel)

    def columns(self, name: str) -> tuple[int, ...]:
        return dict(self.parts)[name]

    def wrap(self, layers: dict[str, Any], batch: "LoraBatch") -> dict[str, Any]:
        """A typed layer tree with each projection the table covers as a LoraLinear (linear.typed
        calls it: the table rides in the parameter tree, so linear.py needs no import of this module)."""
        return {k: LoraLinear(v, self.a[k], self.b[k], batch, parts=self.columns(k), kernel=self.kernel)
                if k in self.a else v for k, v in layers.items()}

    def slot_arrays(self, cfg: ModelConfig, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[dict, dict]:
        """One slot's host arrays in the table's layout from an adapter's per-module weights:
        module -> (a [L, in, r], b [L, r, out]) with the scaling already in b (runtime/core/lora.py
        Adapter). Modules the adapter leaves out, and ranks below the table's, are zeros."""
        R = self.rank
        a_out, b_out = {}, {}
        for name in self.a:
            parts = PARTS.get(name, (name,))
            sa = np.zeros(self.a[name].shape[:1] + self.a[name].shape[2:], np.float32)  # [L, in, P*R]
            sb = np.zeros(self.b[name].shape[:1] + self.b[name].shape[2:], np.float32)  # [L, R, out]
            col = 0
            for i, part in enumerate(parts):
                width = module_shape(cfg, part)[1]
                if part in weights:
                    wa, wb = weights[part]
                    r = wa.shape[-1]
                    sa[:, :, i * R:i * R + r] = wa
                    sb[:, :r, col:col + width] = wb
                col += width
            a_out[name], b_out[name] = sa, sb
        return a_out, b_out


@partial(jax.jit, donate_argnums=(0,))
def _write(table: LoraTable, slot: jax.Array, a: dict, b: dict) -> LoraTable:
    put = lambda t, x: jax.lax.dynamic_update_index_in_dim(t, x.astype(t.dtype), slot, 1)  # noqa: E731
    return dataclasses.replace(table, a={k: put(table.a[k], a[k]) for k in table.a},
                               b={k: put(table.b[k], b[k]) for k in table.b})


def write_slot(table: LoraTable, slot: int, a: dict, b: dict) -> LoraTable:
    """The table with `slot` holding these arrays (slot_arrays'); the old table is donated. One
    program for every slot and adapter (the slot is an argument, the shapes the table's)."""
    return _write(table, jnp.int32(slot), a, b)


@pytree
class LoraBatch:
    """The step's rows by LoRA slot, made once per step in the jitted step. The sorted fields are
    the XLA products' (the C++ kernel groups the rows itself: None there)."""
    slots: jax.Array  # [T] int32 each row's slot (-1: none)
    on: jax.Array     # [T] bool the row has an adapter
    any: jax.Array    # [] bool some row has one
    order: jax.Array | None = None  # [T] int32 rows sorted by slot, rows without an adapter last
    inv: jax.Array | None = None    # [T] int32 the inverse permutation
    sizes: jax.Array | None = None  # [S] int32 rows per slot

    @classmethod
    def of(cls, slots: jax.Array, table: LoraTable) -> "LoraBatch":
        on = slots >= 0
        if table.kernel:
            return cls(slots, on, jnp.any(on))
        key = jnp.where(on, slots, table.slots)
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
        sizes = jnp.zeros(table.slots, jnp.int32).at[key].add(1, mode="drop")
        return cls(slots, on, jnp.any(on), order, inv, sizes)


@pytree
class LoraLinear(Linear, HeldPerLayer):
    """A projection with the step's adapters added: base.apply(x) + each row's low-rank delta.
    Held per layer (the scan hands it the layer): its slots are read for that layer only."""
    base: Any          # the Linear it wraps: stacked over the layers, or held per layer
    a: jax.Array       # [L, S, in, P*R]
    b: jax.Array       # [L, S, R, out]
    batch: LoraBatch
    index: jax.Array | None = None
    parts: tuple = static((0,))  # the parts' column offsets (LoraTable.parts)
    kernel: bool = static(False)

    def at(self, index: jax.Array) -> "LoraLinear":
        base = self.base.at(index) if isinstance(self.base, HeldPerLayer) else jax.tree.map(lambda w: w[index], self.base)
        return dataclasses.replace(self, base=base, index=index)

    def apply(self, x, residual=None, norm=None):
        y = self.base.apply(x, residual, norm)
        return y + self.delta(x, norm).astype(y.dtype)

    def delta(self, x: jax.Array, norm: Any = None) -> jax.Array:
        """[T, out] float32: each row's (rms_norm(x) @ a[slot]) @ b[slot] (x as it is without
        `norm`), zero for rows without an adapter; a step with none computes nothing here."""
        bt = self.batch

        def run() -> jax.Array:
            x_ = x if norm is None else rms_norm(x, *norm)
            if self.kernel:
                from runtime.kernels.cpu.lora import lora_products

                return lora_products(x_, bt.slots, self.a, self.b, self.parts, self.index)
            xs = x_.astype(jnp.float32)[bt.order]
            u = expert_products(xs, self.a, bt.sizes, self.index)
            R, cols = self.b.shape[-2], jnp.arange(self.b.shape[-1])
            d = sum(jnp.where((cols >= lo) & (cols < hi), expert_products(u[:, p * R:(p + 1) * R], self.b, bt.sizes,
                                                                        self.index), 0.0)
                    for p, (lo, hi) in enumerate(zip(self.parts[:-1], self.parts[1:])))
            return jnp.where(bt.on[:, None], d[bt.inv], 0.0)
        return jax.lax.cond(bt.any, run, lambda: jnp.zeros((x.shape[0], self.b.shape[-1]), jnp.float32))

    @property
    def out_features(self):
        return self.base.out_features

