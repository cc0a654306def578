"""The import graph of the library packages (gpt2, parallel, fused_kernels): no circles between modules or between
gpt2's sub-packages, and the one-way rules of docs/design.md (parallel and fused_kernels know nothing of gpt2; the
training loop and everything under it never import the planner, only the entry gpt2.train.main does; tools/ never
imports benchmarks/).

Read from the source (every import statement, function-level and TYPE_CHECKING ones included: a circle hidden in a
function is still a circle in the design), so it needs no imports of its own and runs in milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gpt2", "parallel", "fused_kernels")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a.b import c` counts a.b.c when c is a module, else a.b)."""
    modules = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each a set of mutually importing nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    """gpt2.<sub-package> for gpt2's modules, the top-level package otherwise."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "gpt2" else parts[0]


def test_circles_finds_a_two_module_loop():
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert circles(import_graph()) == []


def test_no_package_imports_itself_back():
    packages: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        packages.setdefault(package_of(module), set()).update(
            package_of(dep) for dep in deps if package_of(dep) != package_of(module))
    assert circles(packages) == []


def test_lower_layers_know_nothing_of_gpt2():
    for module, deps in import_graph().items():
        if module.startswith(("parallel", "fused_kernels")):
            assert not [d for d in deps if d.startswith("gpt2")], module
        if module.startswith("fused_kernels"):
            assert not [d for d in deps if d.startswith("parallel")], module


ENTRY = "gpt2.train.main"  # train.py's body, the `gpt2-train` script: the composition root


def test_only_the_planning_package_imports_the_planner():
    """The entry (gpt2.train.main) makes the plan and hands the loop a comparison function; no other library module
    reaches the planner, and no library module imports the entry back."""
    graph = import_graph()
    assert ENTRY in graph
    for module, deps in graph.items():
        if not module.startswith("gpt2.planning") and module != ENTRY:
            assert not [d for d in deps if d.startswith("gpt2.planning")], module
        assert ENTRY not in deps, module


def test_tools_never_import_the_studies():
    """tools/ (what users run beside training) stands on the library alone; benchmarks/ (studies) may use tools."""
    for module, deps in import_graph(packages=(*PACKAGES, "tools", "benchmarks")).items():
        if module.startswith("tools"):
            assert not [d for d in deps if d.startswith("benchmarks")], module
