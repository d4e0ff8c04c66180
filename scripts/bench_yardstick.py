"""The yardstick the hand-written CPU kernels must beat (issue #36, deliverable 3).

One run, one table: the SmolLM2 decode step at 1 and 64 rows, float32 and W8A8, with the
hand-written C++ kernels against XLA's own CPU paths (as installed, without any library, and
with the XNNPACK, YNNPACK and oneDNN flags of the installed jaxlib). A kernel stays only where
it wins this table; its docstring says so with the figure.

    .venv/bin/python scripts/bench_yardstick.py [--rounds 2] [--iters 10] [--out FILE.json]
    .venv/bin/python scripts/bench_yardstick.py --rounds 1 --iters 1      # smoke run
    .venv/bin/python scripts/bench_yardstick.py --list                    # the settings and their flags

How it measures. XLA_FLAGS are read once, when jax starts, so every setting runs in a fresh
process: `python -m runtime.cli bench offline --part decode --batches 1,64` (the in-process
decode benchmark, runtime/bench/offline.py) with the setting's PAGEDJAX_CPU_KERNELS and
XLA_FLAGS. The settings take turns in rounds (round 1: A B C D E F, round 2: A B C D E F; within
a round float32 for every setting, then W8A8 for every setting), and each cell keeps its best
round (the lowest median step time), so every setting sees the same machine state. Before its
first run a setting's flags are checked in a small probe process (an unknown flag or value makes
XLA abort: such a setting is reported "refused by this jaxlib: <first error line>", not a
crash); the probe also compiles SmolLM2-shaped dots (f32 and int8 at 1 and 64 rows), says which
library took them and checks their numbers against numpy. In round 1 each run dumps its
optimized step HLO (the persistent compilation cache is off for that run, so the step is
compiled) and the table says which library fusions and kernel calls the real step contains.
Where a run with both batch sizes fails, each batch size runs alone, so a crash at 64 rows does
not hide the 1-row figure.

What the flags of jaxlib 0.10.2 do (read from the XLA source, xla/debug_options_flags.cc, and
seen in this jaxlib's compiled HLO):

    xla_cpu_use_xnnpack                   bool; parses, changes nothing seen here
    xla_cpu_experimental_xnn_fusion_type  dot,eltwise,reduce (or +x/-x against the default, empty);
                                          parses, but this jaxlib has no __xnn_fusion emitter
                                          (only XNNPACK's ynnpack/ is linked): no fusion made
    xla_cpu_experimental_xnn_graph_fusion_mode
                                          XNN_GRAPH_FUSION_MODE_{DISABLED,GREEDY,GREEDY_SLINKY,
                                          BYPASS_COST_MODEL}; parses, no fusion made
    xla_cpu_experimental_ynn_fusion_type  dot,eltwise,reduce,individual_dot,individual_convolution;
                                          default individual_dot: XLA as installed already hands
                                          dots of more than one row (f32 and int8) to YNNPACK,
                                          matrix-vector dots stay XLA's own; "=" (empty) turns it off
    xla_cpu_use_onednn                    bool; with xla_cpu_experimental_onednn_fusion_type
                                          (dot,eltwise,reduce) f32 dots become __onednn_fusion
                                          (int8 dots are left to YNNPACK); the 64-row SmolLM2 step
                                          then compiles but dies on its first run ("partition
                                          compile failed", SIGILL), with "dot" alone as well
    xla_cpu_experimental_onednn_custom_call
                                          bool; parses, no oneDNN call made for these dots

A benchmark, not a test: its numbers depend on the machine and how busy it is (the load average
at the start and end is printed beside the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = "checkpoints/smollm2-135m-instruct"
BATCHES = (1, 64)
DTYPES = ("float32", "w8a8")
QUANT_ARG = {"float32": "none", "w8a8": "w8a8"}

# name -> (what it is, PAGEDJAX_CPU_KERNELS, XLA_FLAGS)
SETTINGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "kernels": ("the hand-written C++ kernels (the default engine)", "1", ()),
    "xla": ("plain XLA as installed (jaxlib default: YNNPACK for dots of >1 row)", "0", ()),
    "xla-nolib": ("plain XLA, no library: its own codegen + Eigen", "0",
                  ("--xla_cpu_use_xnnpack=false", "--xla_cpu_experimental_ynn_fusion_type=")),
    "xla+xnnpack": ("plain XLA + XNNPACK and its fusions", "0",
                    ("--xla_cpu_use_xnnpack=true", "--xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce",
                     "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY")),
    "xla+ynn": ("plain XLA + YNNPACK fusions (dot, eltwise, reduce)", "0",
                ("--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise,reduce",)),
    "xla+onednn": ("plain XLA + oneDNN fusions (dot, eltwise)", "0",
                   ("--xla_cpu_use_onednn=true", "--xla_cpu_experimental_onednn_fusion_type=dot,eltwise")),
    # by name only (--settings): variants of the above
    "xla+onednn-reduce": ("plain XLA + oneDNN fusions (dot, eltwise, reduce)", "0",
                          ("--xla_cpu_use_onednn=true",
                           "--xla_cpu_experimental_onednn_fusion_type=dot,eltwise,reduce")),
    "xla+onednn-cc": ("plain XLA + oneDNN custom calls", "0",
                      ("--xla_cpu_use_onednn=true", "--xla_cpu_experimental_onednn_custom_call=true")),
}
DEFAULT_SETTINGS = ("kernels", "xla", "xla-nolib", "xla+xnnpack", "xla+ynn", "xla+onednn")

# What the probe process runs under a setting's flags: jax starts (the flags parse), and
# SmolLM2-shaped projections (576 -> 1536, 1 and 64 rows) compile; which library fusion took
# each dot, and its largest error against numpy.
PROBE = r"""
import json, re, numpy as np, jax, jax.numpy as jnp
out = {"jax_started": float(jnp.ones((4, 4)).sum()) == 16.0}
rng = np.random.default_rng(0)
kinds = lambda t: sorted(set(re.findall(r'"kind":"(__\w+)"', t)) | set(re.findall(r'custom_call_target="([^"]+)"', t)))
for m in (1, 64):
    x = rng.standard_normal((m, 576), np.float32); w = rng.standard_normal((576, 1536), np.float32)
    f = jax.jit(lambda x, w: jax.nn.silu(x @ w))
    ref = x.astype(np.float64) @ w; ref = ref / (1 + np.exp(-ref))
    out[f"f32_{m}"] = {"fusions": kinds(f.lower(x, w).compile().as_text()),
                       "max_rel_err": float(np.abs(np.asarray(f(x, w)) - ref).max() / np.abs(ref).max())}
    xi = rng.integers(-127, 128, (m, 576), dtype=np.int8); wi = rng.integers(-127, 128, (576, 1536), dtype=np.int8)
    g = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32))
    out[f"int8_{m}"] = {"fusions": kinds(g.lower(xi, wi).compile().as_text()),
                        "exact": bool((np.asarray(g(xi, wi)) == xi.astype(np.int64) @ wi).all())}
print("PROBE " + json.dumps(out))
"""

# counted in the optimized step HLO of round 1
FUSION_PATTERNS = {
    "ynn": r'"kind":"__ynn_fusion"',
    "onednn": r'"kind":"__onednn_fusion"',
    "xnn": r'"kind":"__xnn_fusion"',
    "onednn_call": r'custom_call_target="__onednn\$',
    "kernel_call": r'custom_call_target="pagedjax_',
}


# --- machine facts ---------------------------------------------------------------------------
def cpu_facts() -> dict[str, Any]:
    model, flags = "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    wanted = [f for f in flags if f.startswith(("avx512", "amx")) or "vnni" in f or f in ("avx2", "fma")]
    return {"cpu_model": model, "cpu_flags": wanted, "cores": os.cpu_count()}


def loadavg() -> str | None:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [ln for ln in git("status", "--porcelain", "--untracked-files=no").splitlines() if ln.strip()]
    return {"commit": git("rev-parse", "HEAD") or None, "tracked_files_changed": len(changed)}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("jax", "jaxlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


# --- one process per setting ---------------------------------------------------------------
def setting_env(kernels: str, flags: tuple[str, ...], extra_flags: tuple[str, ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env["PAGEDJAX_CPU_KERNELS"] = kernels
    env["XLA_FLAGS"] = " ".join((*flags, *extra_flags))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def first_error_line(stderr: str) -> str:
    """The line that says why XLA or Python stopped: the first glog error/fatal line (E1206 ...
    file.cc:145] message: the message), else an 'Unknown flag' line, else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        m = re.match(r"^[EF]\d{4} [\d:.]+\s+\d+ [^\]]+\] (.*)$", ln)
        if m:
            return m.group(1)
    for ln in lines:
        if "Unknown flag" in ln or "Illegal value" in ln:
            return ln
    return lines[-1] if lines else "no output"


def probe(name: str, kernels: str, flags: tuple[str, ...], timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=setting_env(kernels, flags),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"probe timed out after {timeout:.0f} s"}
    dt = time.perf_counter() - t0
    found = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
    if p.returncode != 0 or not found:
        return {"status": "refused", "error": first_error_line(p.stderr or p.stdout), "returncode": p.returncode,
                "seconds": dt}
    return {"status": "ok", "seconds": dt, **json.loads(found[0][len("PROBE "):])}


def step_fusions(dump_dir: Path) -> list[dict[str, int]] | None:
    """Library fusions and kernel calls in each optimized `pagedjax_step` module, in compile
    order (the decode benchmark compiles batch 1 first, then 64)."""
    files = sorted(dump_dir.glob("*pagedjax_step*after_optimizations.txt"),
                   key=lambda f: int(m.group(1)) if (m := re.match(r"module_(\d+)", f.name)) else 0)
    if not files:
        return None
    out = []
    for f in files:
        text = f.read_text(errors="replace")
        out.append({k: len(re.findall(pat, text)) for k, pat in FUSION_PATTERNS.items()})
    return out


def describe_failure(p: subprocess.CompletedProcess) -> str:
    """First error line, and the signal where the process died of one (SIGILL, SIGABRT...)."""
    err = first_error_line(p.stderr or p.stdout)
    sig = -p.returncode if p.returncode < 0 else p.returncode - 128 if p.returncode > 128 else 0
    if sig:
        try:
            err += f" (died of {signal.Signals(sig).name})"
        except ValueError:
            pass
    return err


def run_decode(args: argparse.Namespace, kernels: str, flags: tuple[str, ...], dtype: str,
               batches: tuple[int, ...], dump: bool) -> dict[str, Any]:
    """One `bench offline --part decode` process; its rows, or why it failed (with the step's
    library fusions from the HLO dump either way: a step may compile and then fail to run)."""
    work = Path(tempfile.mkdtemp(prefix="yardstick-"))
    try:
        out_json = work / "decode.json"
        extra: tuple[str, ...] = ()
        env_over: dict[str, str] = {}
        if dump:
            extra = (f"--xla_dump_to={work / 'hlo'}", "--xla_dump_hlo_as_text",
                     "--xla_dump_hlo_module_re=pagedjax_step")
            env_over["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cache hit compiles (and dumps) nothing
        env = {**setting_env(kernels, flags, extra), **env_over}
        cmd = [sys.executable, "-m", "runtime.cli", "bench", "offline", "--part", "decode",
               "--batches", ",".join(map(str, batches)), "--iters", str(args.iters),
               "--context-len", str(args.context_len), "--checkpoint", args.checkpoint,
               "--quantization", QUANT_ARG[dtype], "--no-progress", "--out", str(out_json)]
        t0 = time.perf_counter()
        res: dict[str, Any] = {"batches": list(batches)}
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {**res, "ok": False, "error": f"timed out after {args.timeout:.0f} s"}
        res["seconds"] = time.perf_counter() - t0
        if dump:
            fus = step_fusions(work / "hlo")
            if fus is not None and len(fus) == len(batches):
                res["step_fusions"] = {str(b): f for b, f in zip(batches, fus)}
            elif fus is not None:
                res["step_fusions_modules"] = fus
        if p.returncode != 0 or not out_json.is_file():
            tail = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()][-15:]
            return {**res, "ok": False, "error": describe_failure(p), "returncode": p.returncode,
                    "stderr_tail": tail}
        decode = json.loads(out_json.read_text())["decode"]
        rows = {str(r["batch"]): {"full_ms": r["full_ms"], "full_min_ms": r["full_min_ms"],
                                  "no_attention_ms": r["no_attention_ms"]} for r in decode["rows"]}
        return {**res, "ok": True, "rows": rows, "kv_dtype": decode.get("dtype"), "model": decode.get("model"),
                "loadavg_1m": decode.get("loadavg_1m")}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_cell(args: argparse.Namespace, s: dict[str, Any], dtype: str, rnd: int) -> None:
    """This round's run of one setting and dtype: the batch sizes that have worked in one process;
    where that run fails, each of its batch sizes alone, so a crash at 64 rows does not hide the
    1-row figure. A batch size that failed alone runs alone in later rounds (a failure may be
    passing: the working tree is being edited while the benchmark runs)."""
    got = s["dtypes"].setdefault(dtype, {"runs": [], "alone": [], "failed": {}})
    dump = rnd == 0 and not args.no_step_hlo
    run = partial(run_decode, args, s["pagedjax_cpu_kernels"], tuple(s["xla_flags"]), dtype, dump=dump)
    together = tuple(b for b in BATCHES if b not in got["alone"])
    results = []
    if together:
        results.append(run(together))
        if not results[-1]["ok"] and len(together) > 1:
            got["alone"] += list(together)
    results += [run((b,)) for b in BATCHES if b in got["alone"]]
    for res in results:
        res["round"] = rnd + 1
        got["runs"].append(res)
        for b, f in res.get("step_fusions", {}).items():
            got.setdefault("step_fusions", {})[b] = f
        if not res["ok"] and len(res["batches"]) == 1:
            got["failed"][str(res["batches"][0])] = res["error"]
        if res.get("model"):
            s.setdefault("model", res["model"])
        cells = " ".join(f"{b}: {r['full_ms']:.2f} ms" for b, r in res.get("rows", {}).items())
        what = f"{s['name']} [{','.join(map(str, res['batches']))}]"
        print(f"  round {rnd + 1} {dtype:<8} {what:<24}"
              + (f"{cells}  ({res['seconds']:.0f} s)" if res["ok"] else f"failed: {res['error']}"), flush=True)


# --- the table -------------------------------------------------------------------------------
def best_cells(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per batch: the best round (lowest median step), and the fastest single step seen."""
    cells: dict[str, dict[str, float]] = {}
    for r in runs:
        if not r.get("ok"):
            continue
        for b, row in r["rows"].items():
            c = cells.setdefault(b, {"ms": row["full_ms"], "min_ms": row["full_min_ms"]})
            c["ms"] = min(c["ms"], row["full_ms"])
            c["min_ms"] = min(c["min_ms"], row["full_min_ms"])
    return cells


def fusion_note(res: dict[str, Any]) -> str:
    """'ynn 7/14 kern 0/0' style: library fusions and kernel calls in the step at 1 / 64 rows."""
    parts = []
    for dtype in DTYPES:
        f = res.get("dtypes", {}).get(dtype, {}).get("step_fusions")
        if not f:
            continue
        keys = [k for k in FUSION_PATTERNS if any(f[b][k] for b in f)]
        counts = " ".join(f"{k} {'/'.join(str(f[str(b)][k]) if str(b) in f else '-' for b in BATCHES)}"
                          for k in keys) or "none"
        parts.append(f"{dtype}: {counts}")
    return "; ".join(parts)


def format_table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"== yardstick: {report['checkpoint']} decode step, context {report['context_len']} tokens, "
             f"best of {report['rounds']} round(s), median of {report['iters']} step(s) each ==",
             f"  CPU     {m['cpu_model']}, {m['cores']} cores; flags: {' '.join(m['cpu_flags']) or '-'}",
             f"  load    start {report['loadavg_start']}   end {report['loadavg_end']}   (/proc/loadavg 1/5/15 min)",
             f"  commit  {report['commit']['commit']} ({report['commit']['tracked_files_changed']} tracked files "
             f"changed in the tree)   jax {report['versions']['jax']} jaxlib {report['versions']['jaxlib']}",
             f"  took    {report['elapsed_s']:.0f} s", ""]
    heads = [f"{d} {b} row{'s' if b > 1 else ''}" for d in report["dtypes"] for b in BATCHES]
    lines.append(f"  {'setting':<18}" + "".join(f"{h:>20}" for h in heads) + "   step: library fusions 1/64 rows")
    base = next((s for s in report["settings"] if s["name"] == "kernels"), None)
    for s in report["settings"]:
        if s["status"] != "ok":
            lines.append(f"  {s['name']:<18}{s['status']} by this jaxlib: {s['error']}" if s["status"] == "refused"
                         else f"  {s['name']:<18}failed: {s['error']}")
            continue
        cells = []
        for d in report["dtypes"]:
            got = s["dtypes"].get(d, {})
            for b in BATCHES:
                c = got.get("best", {}).get(str(b))
                if c is None:
                    cells.append(f"{'failed':>20}")
                    continue
                ref = base and base.get("dtypes", {}).get(d, {}).get("best", {}).get(str(b))
                ratio = f" {c['ms'] / ref['ms']:5.2f}x" if ref else ""
                cells.append(f"{c['ms']:>11.2f} ms{ratio:>7}")
        lines.append(f"  {s['name']:<18}" + "".join(cells) + "   " + fusion_note(s))
        for d in report["dtypes"]:
            got = s["dtypes"].get(d, {})
            for b, err in sorted(got.get("failed", {}).items(), key=lambda kv: int(kv[0])):
                if b not in got.get("best", {}):
                    lines.append(f"  {'':<18}{d} {b} row{'s' if int(b) > 1 else ''}: failed: {err}")
            if not got.get("failed") and got.get("error"):
                lines.append(f"  {'':<18}{d}: failed: {got['error']}")
    lines += ["", "  ms: the step's median, best round; x: that time / the kernels' (above 1: slower than the kernels)",
              "  fusions: ynn/onednn/xnn = XLA library fusions, kernel_call = the C++ kernels' custom calls, "
              "counted in the optimized step HLO (round 1)", "", "  settings:"]
    for s in report["settings"]:
        flags = " ".join(s["xla_flags"]) or "(none)"
        lines.append(f"    {s['name']:<18}PAGEDJAX_CPU_KERNELS={s['pagedjax_cpu_kernels']} XLA_FLAGS={flags}")
        if s.get("probe", {}).get("status") == "ok":
            pr = s["probe"]
            took = ", ".join(f"{k}: {'+'.join(pr[k]['fusions']) or 'xla'}" for k in ("f32_1", "f32_64", "int8_1", "int8_64"))
            ok = all(pr[k].get("exact", True) for k in ("int8_1", "int8_64"))
            err = max(pr[k]["max_rel_err"] for k in ("f32_1", "f32_64"))
            lines.append(f"    {'':<18}probe dots -> {took}; f32 rel err {err:.1e}, int8 {'exact' if ok else 'WRONG'}")
    return "\n".join(lines)


# --- the command -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_yardstick.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--rounds", type=int, default=2, help="times every setting runs; each cell keeps its best")
    p.add_argument("--iters", type=int, default=10, help="timed steps per run (the run's median is its time)")
    p.add_argument("--context-len", type=int, default=350, help="context tokens per row")
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                   help=f"comma-separated, in this order (known: {', '.join(SETTINGS)})")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=FLAGS",
                   help="an extra setting: plain XLA (PAGEDJAX_CPU_KERNELS=0) with these XLA_FLAGS")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="float32,w8a8 or one of them")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one benchmark process may take")
    p.add_argument("--no-step-hlo", action="store_true",
                   help="skip the round-1 HLO dump of the step (then round 1 may use the compilation cache)")
    p.add_argument("--out", metavar="FILE.json", help="write the report as JSON")
    p.add_argument("--list", action="store_true", help="print the settings and exit")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.iters < 1:
        p.error("--rounds and --iters must be >= 1")
    a.settings = [s for s in a.settings.split(",") if s]
    bad = [s for s in a.settings if s not in SETTINGS]
    if bad:
        p.error(f"--settings: unknown {bad[0]!r} (known: {', '.join(SETTINGS)})")
    a.extra = {}
    for spec in a.setting:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in SETTINGS:
            p.error(f"--setting: expected NAME=FLAGS with a new name, got {spec!r}")
        a.extra[name] = (f"plain XLA + {flags}", "0", tuple(flags.split()))
    a.dtypes = [d for d in a.dtypes.split(",") if d]
    if not a.dtypes or any(d not in DTYPES for d in a.dtypes):
        p.error(f"--dtypes: expected a comma-separated subset of {','.join(DTYPES)}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    table = {**{n: SETTINGS[n] for n in args.settings}, **args.extra}
    if args.list:
        for name, (what, k, flags) in table.items():
            print(f"{name:<18}{what}\n{'':<18}PAGEDJAX_CPU_KERNELS={k} XLA_FLAGS={' '.join(flags) or '(none)'}")
        return 0
    if not (ROOT / args.checkpoint).is_dir() and not Path(args.checkpoint).is_dir():
        print(f"bench_yardstick.py: error: checkpoint {args.checkpoint} not found "
              f"(.venv/bin/python -m runtime.cli pull smollm2)", file=sys.stderr)
        return 2
    if os.environ.get("XLA_FLAGS"):
        print(f"note: XLA_FLAGS={os.environ['XLA_FLAGS']!r} in the environment is replaced by each setting's flags",
              file=sys.stderr)
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "kind": "yardstick", "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": cpu_facts(), "loadavg_start": loadavg(), "commit": git_commit(), "versions": versions(),
        "checkpoint": Path(args.checkpoint).name, "context_len": args.context_len, "rounds": args.rounds,
        "iters": args.iters, "batches": list(BATCHES), "dtypes": args.dtypes, "model": None,
        "pagedjax_env": {k: v for k, v in os.environ.items()
                         if k.startswith("PAGEDJAX_") and k != "PAGEDJAX_CPU_KERNELS"},
        "settings": [{"name": n, "description": what, "pagedjax_cpu_kernels": k, "xla_flags": list(flags),
                      "status": "pending", "dtypes": {}} for n, (what, k, flags) in table.items()],
    }
    print(f"yardstick: {len(table)} settings x {len(args.dtypes)} dtypes x {args.rounds} round(s), "
          f"load {report['loadavg_start']}", flush=True)
    for s in report["settings"]:
        s["probe"] = probe(s["name"], s["pagedjax_cpu_kernels"], tuple(s["xla_flags"]), min(args.timeout, 600))
        s["status"] = s["probe"]["status"]
        s["error"] = s["probe"].get("error")
        print(f"  probe {s['name']:<18}{s['status']}" + (f": {s['error']}" if s["error"] else ""), flush=True)
    runnable = [s for s in report["settings"] if s["status"] == "ok"]
    for rnd in range(args.rounds):
        for dtype in args.dtypes:
            for s in runnable:
                run_cell(args, s, dtype, rnd)
                report["model"] = report["model"] or s.get("model")
    for s in runnable:
        for dtype, got in s["dtypes"].items():
            got["best"] = best_cells(got["runs"])
            if not got["best"]:
                got["error"] = next((r["error"] for r in got["runs"] if not r.get("ok")), "no run finished")
    report["loadavg_end"] = loadavg()
    report["elapsed_s"] = time.perf_counter() - t_start
    text = format_table(report)
    report["table"] = text
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(out)
        print(f"wrote {args.out}")
    return 0 if runnable else 1


if __name__ == "__main__":
    sys.exit(main())
