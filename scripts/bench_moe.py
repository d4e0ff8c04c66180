"""One mixture-of-experts MLP (runtime/model/families/moe.py experts_mlp: route, three grouped
expert products, combine) at T tokens, against one dense SwiGLU MLP of the same FLOPs (T x k
rows through one expert's three matrices): the experts through the C++ kernel
(runtime/kernels/cpu/cpu_experts.cc), through XLA's loop over the experts
(linear.expert_products), and through jax.lax.ragged_dot as XLA lowers it here.

Shapes (random weights, float32): a Mixtral-shaped layer scaled by 1/4 (d 1024, f 3584, 8
experts, top 2) and a Qwen3-MoE-shaped one scaled down (d 1024, f 384, 64 experts, top 8).
Rounds alternate between the three so drift in the machine's speed hits each alike; the CPU
model, its vector flags and the load average are printed beside the numbers.

    .venv/bin/python scripts/bench_moe.py [--tokens 1 8 64 512] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"mixtral/4": dict(d=1024, f=3584, E=8, k=2), "qwen3-moe/4": dict(d=1024, f=384, E=64, k=8)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from runtime.bench.machine import machine_info
    from runtime.config import ModelConfig
    from runtime.model.families import moe
    from runtime.kernels.cpu import experts as cpu_experts
    from runtime.model.linear import StackedExperts

    info = machine_info()
    print(f"# {info['cpu_model']}, {info['cores']} cores, jax {info.get('jax')} ({info.get('jax_backend')}); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for name, s in SHAPES.items():
        d, f, E, k = s["d"], s["f"], s["E"], s["k"]
        cfg = ModelConfig("mixtral", 100, d, f, 1, 8, 8, d // 8, num_experts=E, num_experts_per_tok=k,
                          moe_intermediate_size=f)
        rng = np.random.default_rng(0)
        lp = {"router": jnp.asarray(rng.standard_normal((d, E)).astype(np.float32)),
              **{n: jnp.asarray(rng.standard_normal((E, *shape)).astype(np.float32) / np.sqrt(shape[0]))
                 for n, shape in (("experts_gate", (d, f)), ("experts_up", (d, f)), ("experts_down", (f, d)))}}
        dense = {n: lp[n][0] for n in ("experts_gate", "experts_up", "experts_down")}

        def dense_mlp(x, w):
            return (jax.nn.silu(x @ w["experts_gate"]) * (x @ w["experts_up"])) @ w["experts_down"]

        class Ragged:  # the same layer with the experts through jax.lax.ragged_dot
            def __init__(self, w):
                self.w = w

            def product(self, x, sizes):
                return jax.lax.ragged_dot(x, self.w, sizes)

        names = ("experts_gate", "experts_up", "experts_down")
        one_layer = {"layers": {n: StackedExperts(lp[n][None]) for n in names}}
        stacked = {"kernel": cpu_experts.pack_held(one_layer)["layers"],  # packed once, as the runner does
                   "loop": one_layer["layers"]}

        def held(lp, how):
            experts = {n: Ragged(lp[n]) if how == "ragged" else stacked[how][n].at(jnp.int32(0)) for n in names}
            return {"router": lp["router"], **experts}

        fns = {how: jax.jit(lambda lp, x, how=how: moe.experts_mlp(cfg, held(lp, how), x))
               for how in ("kernel", "loop", "ragged")}
        for T in args.tokens:
            x = jnp.asarray(rng.standard_normal((T, d)).astype(np.float32))
            xs = jnp.asarray(rng.standard_normal((T * k, d)).astype(np.float32))
            dense_fn = jax.jit(dense_mlp)
            call = {"moe, C++ kernel": lambda: fns["kernel"](lp, x), "moe, XLA loop": lambda: fns["loop"](lp, x),
                    "moe, ragged_dot": lambda: fns["ragged"](lp, x), "dense, same FLOPs": lambda: dense_fn(xs, dense)}
            for c in call.values():
                jax.block_until_ready(c())
            times: dict[str, list[float]] = {n: [] for n in call}
            for _ in range(args.reps):
                for n, c in call.items():
                    t = time.perf_counter()
                    jax.block_until_ready(c())
                    times[n].append(time.perf_counter() - t)
            ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            base = ms["dense, same FLOPs"]
            print(f"{name:12s} T={T:4d} ({T * k:5d} rows): " + " | ".join(
                f"{n} {v:8.2f} ms" + ("" if n.startswith("dense") else f" ({v / base:.2f}x)") for n, v in ms.items()),
                flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
