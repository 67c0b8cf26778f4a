"""The package's import graph has no cycle, every module imports alone, and the package keeps its shape: no module
over ``MAX_LINES`` lines, no import of a package module deferred into a function.

The graph is read from the source with ``ast`` (fast and exact): an edge ``a -> b`` for every ``import`` of ``b``
in ``a``, at module level or inside a function (an import deferred into a function hides a cycle, it does not
remove it), except imports under ``if TYPE_CHECKING:`` (never run) and imports of ``a``'s own parent packages
(Python imports a package before its modules, so a module reading a name from its package is not a cycle).
Importing ``b`` from a package ``p`` runs ``p/__init__.py`` too: the edge goes to ``p`` as well.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "autoshard"

def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(tree: ast.AST, package: str) -> set[str]:
    """Dotted names ``tree`` imports (``from x import y``: ``x.y`` and ``x``), anywhere but under TYPE_CHECKING."""
    names, stack = set(), [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (see the module docstring)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        ancestors = set(_prefixes(name))
        graph[name] = {prefix for imported in _imported(ast.parse(path.read_text()), package)
                       for prefix in _prefixes(imported) if prefix in modules and prefix not in ancestors}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            child = next(successors, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_graph_finds_a_cycle_hidden_in_a_function():
    tree = ast.parse("from .b import f\ndef g():\n    from . import a\n")
    assert _imported(tree, "pkg") == {"pkg.b", "pkg.b.f", "pkg", "pkg.a"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


MAX_LINES = 700
"""A module longer than this does several jobs: split it by job (issue 42's acceptance)."""


def test_no_module_is_over_max_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_package_import_is_deferred_into_a_function():
    deferred = [f"{name}: {ast.unparse(node)}" for name, path in _modules().items()
                for function in ast.walk(ast.parse(path.read_text()))
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                for node in ast.walk(function)
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("autoshard"))
                or isinstance(node, ast.Import) and any(a.name.startswith("autoshard") for a in node.names)]
    assert not deferred, f"imports deferred into functions (they hide cycles): {deferred}"


_IMPORT_EACH_ALONE = """
import importlib, os, sys, tempfile, traceback

def in_fork(run):
    pid = os.fork()
    if pid == 0:
        try:
            run()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

# the libraries the package imports (torch, sympy...) are imported once, here; every package module is then
# imported in a fresh fork, with no package module loaded
listing = tempfile.NamedTemporaryFile("r")
def list_libraries():
    import autoshard
    with open(listing.name, "w") as out:
        out.write(" ".join(n for n in list(sys.modules) if n.split(".")[0] != "autoshard"))
in_fork(list_libraries)
for name in listing.read().split():
    try:
        importlib.import_module(name)
    except BaseException:
        pass
failed = [name for name in sys.argv[1:] if not in_fork(lambda: importlib.import_module(name))]
print("FAILED", failed)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_every_module_imports_alone():
    names = sorted(_modules())
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE, *names], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
