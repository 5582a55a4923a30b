"""The import graph of editrain: no cycles, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "editrain"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``editrain.sync.edit`` for ``editrain/sync/edit.py`` (a package: its own name)."""
    parts = ["editrain", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports there never run."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, here: str, is_package: bool, modules: set[str]) -> set[str]:
    """The editrain modules that module ``here`` imports when it runs, at its top level or
    inside functions (a deferred import still makes a cycle), but not under
    ``TYPE_CHECKING``. ``from pkg import sub`` counts as importing ``pkg.sub`` when that
    is a module, else as importing ``pkg``."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in node.orelse:  # (the else branch does run)
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".") if is_package else here.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    out.discard(here)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the editrain modules it imports, for every module under ``root``."""
    paths = sorted(root.rglob("*.py"))
    names = {module_name(p, root): p for p in paths}
    modules = set(names)
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", modules)
            for name, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def test_editrain_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (modules that import each other, directly or not): " \
        + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_cycles_through_deferred_imports(tmp_path: Path):
    """The checker itself: a cycle closed by an import inside a function is found, one
    under TYPE_CHECKING is not, and ``from pkg import sub`` points at ``pkg.sub``."""
    pkg = tmp_path / "editrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from editrain.sub import b\n")
    (pkg / "a.py").write_text("from editrain.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from editrain import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from editrain import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(pkg)
    assert graph["editrain.a"] == {"editrain.sub.b"}
    assert graph["editrain.sub.b"] == {"editrain.a"}
    assert graph["editrain.c"] == set()
    assert graph["editrain.d"] == {"editrain.c"}
    assert cycles(graph) == [["editrain.a", "editrain.sub.b"]]
