"""Import-graph checks: no import cycle inside ``fsdp_impl``, ``harness`` or ``bench``, ``harness``
imports nothing from ``fsdp_impl`` (it is a generic pytest plugin), no test module imports
another test module, and the functional suites do not import ``bench``.

The graph is built statically with ``ast`` from every ``import`` statement of every module,
including imports inside functions (a local import is still a cycle that only shows up when the
function runs), but not those under ``if TYPE_CHECKING:`` (never executed). An edge goes to the
module named by the statement; ``from pkg import name`` goes to ``pkg.name`` when that is a
module of the tree, else to ``pkg``. Importing a submodule also runs its parents' ``__init__``,
but that is the ordinary package mechanism, not a cycle, so parent packages get no edge.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package`` (packages by ``__init__``)."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` except those guarded by ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield from _import_nodes(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``node`` (a statement of ``module``) imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    found = set()
    for alias in node.names:
        if f"{prefix}.{alias.name}" in known:  # a submodule
            found.add(f"{prefix}.{alias.name}")
        elif prefix in known:  # an attribute of the module
            found.add(prefix)
    return found


def import_graph(packages: tuple[str, ...], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> modules (of the scanned packages) it imports."""
    files: dict[str, Path] = {}
    for package in packages:
        files.update(_module_files(root, package))
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _import_nodes(tree):
            edges |= _targets(module, is_package, node, files)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", ["fsdp_impl", "harness", "bench"])
def test_no_import_cycle(package: str) -> None:
    graph = import_graph((package,))
    assert len(graph) > 5, f"found only {sorted(graph)} under {ROOT / package}"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_harness_imports_nothing_from_fsdp_impl() -> None:
    graph = import_graph(("harness", "fsdp_impl"))
    bad = {m: sorted(t for t in targets if t.split(".")[0] == "fsdp_impl")
           for m, targets in graph.items() if m.split(".")[0] == "harness"}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"harness modules import fsdp_impl: {bad}"


def test_checker_sees_local_import_cycles(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by a function-level relative import is found, one
    closed only under ``if TYPE_CHECKING:`` is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from .. import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(("pkg",), tmp_path)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.c"} and graph["pkg.c"] == set()
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_import_fsdp_impl_exposes_optim() -> None:
    """In a fresh interpreter, ``import fsdp_impl`` alone gives ``fsdp_impl.optim.AdamW`` (the
    way the optim docs use it), not only after some other code imported the subpackage."""
    code = "import fsdp_impl; print(fsdp_impl.optim.AdamW.__module__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fsdp_impl.optim.adam"


def test_tests_import_no_test_module_and_functional_suites_no_bench() -> None:
    """Test modules never import another test module (shared helpers live in ``common/``
    packages, CONTRIBUTING.md), and the functional suites and the mutation catalogue never import
    the benchmarks (``bench`` measures the engine; tests must not depend on it)."""
    graph = import_graph(("tests", "bench"))
    assert any(m.startswith("tests.functional.test_") for m in graph), sorted(graph)[:5]
    assert not import_rule_violations(graph)


def import_rule_violations(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every edge that breaks the rules of the test above."""
    bad = []
    for module, targets in sorted(graph.items()):
        if module.split(".")[0] != "tests":
            continue
        for target in sorted(targets):
            if target.split(".")[0] == "tests" and target.rsplit(".", 1)[-1].startswith("test_"):
                bad.append(f"{module} -> {target} (a test module)")
            elif target.split(".")[0] == "bench" and module.startswith(("tests.functional", "tests.mutants")):
                bad.append(f"{module} -> {target} (the benchmarks)")
    return bad


def test_import_rules_catch_test_and_bench_imports(tmp_path: Path) -> None:
    """The rule checker itself: it reports a test module importing another one and a functional
    suite importing bench, and accepts imports of a common helper."""
    for pkg in ("tests", "tests/functional", "tests/functional/common", "bench"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "bench" / "runtime.py").write_text("")
    (tmp_path / "tests/functional/common/helpers.py").write_text("")
    (tmp_path / "tests/functional/test_a.py").write_text("from tests.functional.common import helpers\n")
    (tmp_path / "tests/functional/test_b.py").write_text(
        "from tests.functional.test_a import x\ndef f():\n    from bench.runtime import y\n")
    assert import_rule_violations(import_graph(("tests", "bench"), tmp_path)) == [
        "tests.functional.test_b -> bench.runtime (the benchmarks)",
        "tests.functional.test_b -> tests.functional.test_a (a test module)"]
