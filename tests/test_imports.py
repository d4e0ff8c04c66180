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
ALLOWED_CYCLES: tuple[frozenset[str], ...] = (
    frozenset({"runtime.attention", "runtime.cpu_attention"}),
)


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
    assert "runtime.engine" not in graph["runtime.snapshot"]         # under TYPE_CHECKING


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
