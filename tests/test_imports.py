"""No import cycles among the runtime/, console/ and pallas_kernels/ modules.

Counted: module-level and function-level imports (a function-level import that closes a
cycle is a cycle in the design, even when it does not fail at import time). Not counted:
imports under `if TYPE_CHECKING:`. Strings passed to importlib (runtime/cli.py's
SUBCOMMANDS) are not imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "console", "pallas_kernels")

# Cycles that predate this test, each in modules this test's change did not touch. Every
# entry must still be a cycle (a stale entry fails the test), so the list only shrinks:
# break a cycle, delete its line.
ALLOWED_CYCLES: tuple[frozenset[str], ...] = ()


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(path: Path, name: str) -> set[str]:
    """Every module name an import statement anywhere in the file may load (`from a import b`
    yields both `a` and `a.b`: b may be a submodule)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _imported_names(p, m) if n in mods and n != m} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def _describe(graph: dict[str, set[str]], comp: frozenset[str]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & comp))}" for m in sorted(comp))


def test_the_checker_sees_module_and_function_level_imports_but_not_type_checking():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [frozenset({"a", "b", "c"})]
    graph = import_graph()
    assert "runtime.checkpoint.mapping" in graph["runtime.cli"]      # module level
    assert "runtime.checkpoint.pull" in graph["runtime.cli"]         # function level (cmd_pull)
    assert "runtime.core.engine" not in graph["runtime.core.snapshot"]         # under TYPE_CHECKING


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    unexpected = [c for c in found if c not in ALLOWED_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(_describe(graph, c) for c in unexpected)
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not stale, f"no longer cycles; delete them from ALLOWED_CYCLES: {stale}"


def test_cli_serve_and_bench_do_not_import_each_other_back():
    """The cycle this test was written for: cli -> console.serve / bench / fleet -> cli."""
    graph = import_graph()
    for m in graph:
        if m.startswith(("console.", "runtime.bench.", "runtime.fleet.", "runtime.checkpoint.")):
            assert "runtime.cli" not in graph[m], m


# The four cycles issue #36 found, by today's module names: each pair must not import each
# other back (directly or through others).
FORBIDDEN_CYCLES = (
    ("runtime.model.xla_attention", "runtime.kernels.cpu.attention"),
    ("runtime.core.engine", "runtime.core.disagg"),
    ("runtime.core.engine", "runtime.core.output_processor"),
    ("runtime.fleet.gateway", "runtime.fleet.pools"),
    ("runtime.model.families.llama", "runtime.model.quant"),
)

# Layers, lowest first: a module imports from its own layer or below, never above. The seam
# types (Linear, the KV pages) sit under the kernels that implement them.
LAYERS = (
    ("runtime.config", "runtime.corpus", "runtime.jax_setup", "runtime.kv_groups", "runtime.optional"),
    ("runtime.model.linear", "runtime.model.kv_pages"),
    ("runtime.kernels",),
    ("runtime.model", "runtime.checkpoint", "runtime.tokenizer", "pallas_kernels"),
    ("runtime.core", "runtime.planner"),
    ("runtime.fleet", "runtime.bench", "console"),
    ("runtime.cli",),
)


def layer_of(module: str) -> int | None:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    return None if best is None else best[0]


def test_forbidden_cycles_stay_broken():
    graph = import_graph()
    comps = cycles(graph)
    for a, b in FORBIDDEN_CYCLES:
        assert a in graph and b in graph, f"renamed? {a}, {b}"
        assert not any(a in c and b in c for c in comps), f"{a} and {b} import each other again"


def test_no_import_runs_up_a_layer():
    graph = import_graph()
    unplaced = sorted(m for m in graph if layer_of(m) is None and m not in ("runtime", "console"))
    assert not unplaced, f"modules outside every layer (add them to LAYERS): {unplaced}"
    up = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
          if layer_of(m) is not None and layer_of(d) is not None and layer_of(d) > layer_of(m)]
    assert not up, "imports from a lower layer up to a higher one:\n" + "\n".join(sorted(up))
