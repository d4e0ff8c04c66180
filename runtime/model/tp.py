"""Tensor parallelism (--tensor-parallel-size N): the sharding rules, in one place.

One mesh axis "tp" over the first N devices; the engine step stays one jitted program
(GSPMD) with explicit in/out shardings:

* attention by heads: wq/wk/wv (and their biases) column-sharded, so device i holds query
  heads [i*Hq/N, (i+1)*Hq/N) and the KV heads of exactly those GQA groups; wo row-sharded.
  The paged attention (KV write + read) runs per shard under shard_map on the local heads,
  with the block table replicated: blocks are logical and the same on every shard.
* When N exceeds the KV head count, each KV head is replicated N/Hkv times (as vLLM does):
  wk/wv gain the copies and the runner's config says Hkv*r heads, one group per device.
* MLP Megatron-style: w_gate/w_up column-sharded, w_down row-sharded (XLA inserts the one
  all-reduce per block, as after wo).
* a mixture of experts: expert parallelism on the same axis. Each device holds E/N whole
  experts of every expert layer (the stacks [L, E, in, out] split on E), routes every token
  (the router is replicated, the tokens already on every device), runs the picks of its own
  experts and one all-reduce sums the devices' parts (expert_parallel); shared experts and
  dense MLP layers Megatron-style like w_gate / w_down. No token is dropped: there is no
  capacity to exceed. Latent attention (MLA) is not sharded yet.
* embeddings / LM head by vocabulary (replicated, and logged, when the vocabulary does not
  divide); norms replicated; the KV cache [L*NB, BS, Hkv, D] sharded on its KV-head axis.

Quantized weights (runtime/model/quant.py) shard like the float ones: the int8 values as the
weight, a column-parallel weight's per-output-channel scales with its columns, a
row-parallel one's whole (its outputs are summed across devices) and its input scale
("in", SmoothQuant) with its rows. A row-parallel w8a8 product quantizes each activation
row by its absmax over the whole row (XLA all-reduces the max across the shards) and
sums int32 partial products, so the tokens are TP 1's. The int8 LM head ("head") shards
by vocabulary like the float one.

The C++ CPU kernels (runtime/kernels/cpu/attention.py, runtime/kernels/cpu/matmul.py) are not used under TP:
on CPU attention takes the plain XLA path. On GPUs the Pallas kernel (float or quantized
cache) runs per shard under the same shard_map, on each device's heads and cache slice.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from runtime.config import ModelConfig

log = logging.getLogger(__name__)
AXIS = "tp"


def kv_replication(cfg: ModelConfig, n: int) -> int:
    """Copies of each KV head so every device holds whole GQA groups (1: none)."""
    return n // cfg.num_kv_heads if n > cfg.num_kv_heads else 1


def validate(cfg: ModelConfig, n: int, *, attention_backend: str = "auto", quantization: str = "none",
             num_devices: int | None = None) -> None:
    """ValueError("tensor_parallel_size: ...") when the model or the machine cannot run at N."""
    if n < 1:
        raise ValueError(f"tensor_parallel_size: must be at least 1, got {n}")
    if n == 1:
        return
    if cfg.mla:
        raise ValueError("tensor_parallel_size: multi-head latent attention is not sharded yet (its cache is one "
                         "latent row per token, no KV heads to split); serve it with --tensor-parallel-size 1")
    if cfg.num_experts and quantization not in ("none", "auto"):
        raise ValueError(f"tensor_parallel_size: {quantization} expert weights are not sharded yet")
    if cfg.num_experts % n:
        raise ValueError(f"tensor_parallel_size: {n} does not divide the model's {cfg.num_experts} experts "
                         "(expert parallelism gives each device whole experts)")
    if quantization == "w4a16":  # its packed nibbles and group scales have no sharding rule yet
        raise ValueError("tensor_parallel_size: w4a16 weights are not sharded yet; serve w4a16 with "
                         "--tensor-parallel-size 1, or shard float32 / w8a8 weights")
    k = jax.device_count() if num_devices is None else num_devices
    if n > k:
        raise ValueError(f"tensor_parallel_size: {n} needs {n} devices, only {k} "
                         f"{'device' if k == 1 else 'devices'}; on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hq % n:
        raise ValueError(f"tensor_parallel_size: {n} does not divide the model's {hq} query heads")
    if n > hkv and n % hkv:
        raise ValueError(f"tensor_parallel_size: {n} is more than the model's {hkv} KV heads and not a multiple "
                         f"of them (KV heads can only be replicated a whole number of times)")
    if n <= hkv and hkv % n:
        raise ValueError(f"tensor_parallel_size: {n} does not divide the model's {hkv} KV heads")
    if (not cfg.num_experts or cfg.dense_layers) and cfg.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size: {n} does not divide the model's MLP size "
                         f"{cfg.intermediate_size}")
    if (cfg.num_shared_experts * cfg.moe_intermediate_size) % n:
        raise ValueError(f"tensor_parallel_size: {n} does not divide the shared experts' width "
                         f"{cfg.num_shared_experts * cfg.moe_intermediate_size}")
    if attention_backend == "pallas" and jax.default_backend() != "gpu":
        # On GPUs the kernel runs per shard under the step's shard_map (its lowering for two
        # GPUs is checked by tests/runtime/test_tp.py); on CPU only the Mosaic GPU interpreter
        # could run it, and its io_callbacks deadlock or fail with 2+ devices.
        raise ValueError("tensor_parallel_size: the Pallas attention backend under tensor parallelism needs "
                         "GPUs (the Mosaic GPU interpreter cannot run on several devices); use "
                         "--attention-backend xla or auto here")


def make_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def runner_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config the sharded step runs: KV heads as replicated for N > Hkv."""
    r = kv_replication(cfg, n)
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def vocab_sharded(cfg: ModelConfig, n: int) -> bool:
    return cfg.vocab_size % n == 0


COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up")
ROW_PARALLEL = ("wo", "w_down")


def _weight_spec(w: Any, col: P, row_in: bool) -> Any:
    """A layer weight's spec: the float array's, or a quantized dict's (int8 values like the
    weight; scales "s" [L, out] with the columns when column-parallel, else whole; the input
    scale "in" [L, in] with the rows when row-parallel, else whole; GGUF Q8_0's block scales
    "g" [L, in/32, out] like the values, by groups of rows when row-parallel)."""
    if not isinstance(w, dict):
        return col
    whole = col == P()
    specs = {}
    for k in w:
        if k in ("q", "w8", "g"):
            specs[k] = col
        elif k == "s":
            specs[k] = P() if whole or row_in else P(None, AXIS)
        elif k == "in":
            specs[k] = P(None, AXIS) if row_in and not whole else P()
        else:  # "p"/"f": packed for the C++ kernels, which TP does not use
            raise ValueError(f"tensor_parallel_size: no sharding rule for a weight packed for the C++ kernel ({k!r})")
    return specs


def param_specs(cfg: ModelConfig, params: dict[str, Any], n: int, *, stored: bool = False) -> dict[str, Any]:
    """A PartitionSpec per parameter leaf (float or quantized). `stored`: the checkpoint's
    tree before KV-head replication (wk/wv/bk/bv then stay whole when they are replicated
    after loading)."""
    rep_kv = stored and kv_replication(cfg, n) > 1
    vocab = AXIS if vocab_sharded(cfg, n) else None
    layer = {"wq": P(None, None, AXIS), "wk": P(None, None, AXIS), "wv": P(None, None, AXIS),
             "bq": P(None, AXIS), "bk": P(None, AXIS), "bv": P(None, AXIS), "wo": P(None, AXIS, None),
             "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None),
             "attn_norm": P(), "mlp_norm": P(), "q_norm": P(), "k_norm": P(),
             "post_attn_norm": P(), "post_mlp_norm": P(),  # (Gemma's norms after attention and the MLP)
             # a mixture of experts: whole experts per device (expert parallelism), the router
             # replicated, shared experts and dense layers Megatron-style like w_gate / w_down
             "router": P(), "experts_gate": P(None, AXIS), "experts_up": P(None, AXIS), "experts_down": P(None, AXIS),
             "shared_gate": P(None, None, AXIS), "shared_up": P(None, None, AXIS), "shared_down": P(None, AXIS, None),
             "dense_gate": P(None, None, AXIS), "dense_up": P(None, None, AXIS), "dense_down": P(None, AXIS, None)}
    if rep_kv:
        layer.update(wk=P(), wv=P(), bk=P(), bv=P())
    specs: dict[str, Any] = {}
    for name, value in params.items():
        if name == "layers":
            unknown = set(value) - set(layer)
            if unknown:
                raise ValueError(f"tensor_parallel_size: no sharding rule for parameters {sorted(unknown)}")
            specs[name] = {k: _weight_spec(v, layer[k], k in ROW_PARALLEL) for k, v in value.items()}
        elif name == "embed":
            specs[name] = P(vocab, None)
        elif name == "lm_head":
            specs[name] = P(None, vocab)
        elif name == "head":  # the int8 LM head {"q": [d, V], "s": [V], "in": [d]}: by vocabulary
            specs[name] = {k: {"q": P(None, vocab), "g": P(None, vocab), "s": P(vocab), "in": P()}[k] for k in value}
        elif name == "final_norm":
            specs[name] = P()
        else:
            raise ValueError(f"tensor_parallel_size: no sharding rule for parameter {name!r}")
    return specs


def param_shardings(cfg: ModelConfig, params: dict[str, Any], mesh: Mesh, *, stored: bool = False) -> dict[str, Any]:
    specs = param_specs(cfg, params, mesh.size, stored=stored)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def check_shards(params: dict[str, Any], specs: dict[str, Any], n: int) -> None:
    """A checkpoint whose shapes do not shard: one clear ValueError."""
    def check(path, a, spec):
        for dim, ax in zip(a.shape, tuple(spec)):
            if ax is not None and dim % n:
                name = jax.tree_util.keystr(path, simple=True, separator="/")
                raise ValueError(f"tensor_parallel_size: parameter {name} of shape {tuple(a.shape)} does not "
                                 f"shard {n} ways")
    jax.tree_util.tree_map_with_path(check, params, specs, is_leaf=lambda x: isinstance(x, P))


def _repeat_heads(w: jax.Array, heads: int, r: int) -> jax.Array:
    """[..., heads*D] -> [..., heads*r*D]: each head's columns r times, in place of the head."""
    lead, cols = w.shape[:-1], w.shape[-1]
    x = w.reshape(*lead, heads, 1, cols // heads)
    return jnp.broadcast_to(x, (*lead, heads, r, cols // heads)).reshape(*lead, heads * r * (cols // heads))


def replicate_kv_heads(cfg: ModelConfig, params: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """wk/wv (bk/bv) with each KV head copied N/Hkv times, written straight into their
    shards (one jitted program with the sharded outputs); others unchanged."""
    r = kv_replication(cfg, mesh.size)
    if r == 1:
        return params
    layers = dict(params["layers"])
    names = [k for k in ("wk", "wv", "bk", "bv") if k in layers]
    spec = {"wk": P(None, None, AXIS), "wv": P(None, None, AXIS), "bk": P(None, AXIS), "bv": P(None, AXIS)}
    # (a quantized wk/wv: its values and per-column scales repeat with the head's columns)
    out = {k: jax.tree.map(lambda s: NamedSharding(mesh, s), _weight_spec(layers[k], spec[k], False),
                           is_leaf=lambda x: isinstance(x, P)) for k in names}
    fn = jax.jit(lambda d: jax.tree.map(lambda v: _repeat_heads(v, cfg.num_kv_heads, r), d), out_shardings=out)
    layers.update(fn({k: layers[k] for k in names}))
    log.info("tensor_parallel_size=%d exceeds the model's %d KV heads: each KV head is replicated %d times "
             "(%d KV heads, one GQA group per device; the KV cache holds the copies)",
             mesh.size, cfg.num_kv_heads, r, cfg.num_kv_heads * r)
    return {**params, "layers": layers}


def shard_params(cfg: ModelConfig, params: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """Params (as loaded: whole, or already in their stored shards) -> the step's shards,
    KV heads replicated for N > Hkv. device_put is a no-op for leaves already placed."""
    stored = param_shardings(cfg, params, mesh, stored=True)
    check_shards(params, param_specs(cfg, params, mesh.size, stored=True), mesh.size)
    params = jax.device_put(params, stored)
    params = replicate_kv_heads(cfg, params, mesh)
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def kv_spec(leaf: Any) -> P:
    """The KV cache's leaves [L*NB, BS, Hkv, D] (and a quantized cache's scales and zeros
    [L*NB, BS, Hkv, G]) by KV head."""
    return P(None, None, AXIS, None)


def kv_sharding(mesh: Mesh, kv: Any) -> Any:
    return jax.tree.map(lambda a: NamedSharding(mesh, kv_spec(a)), kv)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_attention(fn: Any, mesh: Mesh) -> Any:
    """fn(inp, q [T,Hq,D], k, v [T,Hkv,D], layer, cache) -> (out [T,Hq,D], cache), run per
    shard on its local heads (its own GQA groups and cache slice); inp replicated."""
    heads = P(None, AXIS, None)

    def wrapped(inp, q, k, v, layer, cache):
        cache_specs = jax.tree.map(kv_spec, cache)
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(), heads, heads, heads, P(), cache_specs),
                             out_specs=(heads, cache_specs), check_vma=False)(inp, q, k, v, layer, cache)

    return wrapped


def hold_expert_shards(params: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """The held experts (linear.StackedExperts, split by expert over the mesh by param_specs)
    marked with the mesh: the family then runs them through expert_parallel."""
    from runtime.model.linear import StackedExperts

    layers = {k: dataclasses.replace(v, mesh=mesh) if isinstance(v, StackedExperts) else v
              for k, v in params["layers"].items()}
    return {**params, "layers": layers}


def expert_parallel(fn: Any, x: jax.Array, weights: jax.Array, experts: jax.Array, gate: Any, up: Any,
                    down: Any) -> jax.Array:
    """Expert parallelism: fn(x, weights, experts, gate, up, down, first) -> [T, d] float32 (the
    sum over each token's picks among the experts held, ids from `first`), run per device on its
    E / N experts and summed across devices. Every device already holds every token (attention
    is tensor-parallel and its output all-reduced), so dispatch is each device selecting the
    (token, expert) pairs routed to its own experts: none is dropped, no capacity is fixed, and
    the combine is one all-reduce of [T, d] per layer (an all-to-all would move tokens that are
    already everywhere)."""
    mesh = gate.mesh
    spec = P(None, AXIS)

    def local(x, weights, experts, gw, uw, dw, index):
        first = jax.lax.axis_index(AXIS) * gw.shape[1]
        held = [dataclasses.replace(h, w=w, index=index, mesh=None) for h, w in ((gate, gw), (up, uw), (down, dw))]
        return jax.lax.psum(fn(x, weights, experts, *held, first=first), AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), spec, spec, spec, P()), out_specs=P(),
                         check_vma=False)(x, weights, experts, gate.w, up.w, down.w, gate.index)


def gather_logits(cfg: ModelConfig, mesh: Mesh, logits: jax.Array) -> jax.Array:
    """[S, V] logits: computed vocab-sharded (when the vocabulary divides), then replicated."""
    if vocab_sharded(cfg, mesh.size):
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, AXIS)))
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
