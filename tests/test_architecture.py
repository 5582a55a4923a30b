"""The package's shape, checked on its source with ``ast``: no module uses another module's
private names, the checkpoint module knows nothing of the engine's insides, and every file
says its one job in the first line of its docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "editrain"

def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_package_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of editrain."""
    if dotted != "editrain" and not dotted.startswith("editrain."):
        return False
    base = PACKAGE.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _absolute(module: str | None, level: int, here: str, is_package: bool) -> str:
    """The absolute name of a (possibly relative) ``from`` import's module."""
    if not level:
        return module or ""
    parts = here.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(names)])


def private_uses(source: str, here: str, is_package: bool = False) -> list[str]:
    """Private names of other modules that module ``here`` imports or reads off an
    imported module.

    * ``from x import _y`` and ``import x._y`` / ``from x._y import z`` (any module: no
      private framework internals either);
    * ``m._y`` where ``m`` is an editrain module bound by an import.
    """
    tree = ast.parse(source)
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> editrain module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if any(_is_private(p) for p in alias.name.split(".")):
                    found.append(f"{here}:{node.lineno}: import {alias.name}")
                if alias.name.startswith("editrain"):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["editrain"] = "editrain"
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, here, is_package)
            if any(_is_private(p) for p in module.split(".")):
                found.append(f"{here}:{node.lineno}: from {module} import ...")
            for alias in node.names:
                if _is_private(alias.name) and module != here:
                    found.append(f"{here}:{node.lineno}: from {module} import {alias.name}")
                full = f"{module}.{alias.name}"
                if _is_package_module(full):
                    bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        dotted = _dotted(node.value)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        if head not in bound:
            continue
        target = ".".join(filter(None, [bound[head], rest]))
        if _is_package_module(target) and target != here:
            found.append(f"{here}:{node.lineno}: {dotted}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    offenders = [use for path in _modules()
                 for use in private_uses(path.read_text(), _module_name(path),
                                         path.name == "__init__.py")]
    assert not offenders, "private names used across modules:\n  " + "\n  ".join(offenders)


def test_the_private_name_check_finds_what_it_should():
    """The checker itself, on a module that breaks every rule once."""
    source = ("from editrain.checkpoint import _base\n"
              "from editrain.sync import edit\n"
              "from . import outer\n"
              "import editrain.sync.comm as comm\n"
              "import torch._dynamo\n"
              "import os\n"
              "from ._own import helper\n"
              "a = edit._reshard\n"
              "b = outer._OUTER_NAMES\n"
              "c = comm._anything\n"
              "d = os._exit\n")
    uses = private_uses(source, "editrain.sync.probe")
    assert len(uses) == 6, uses
    assert not any("os._exit" in u for u in uses)  # stdlib's documented names are fine


def test_checkpoint_module_knows_nothing_of_the_engines_insides():
    """The engine's state goes through its state_dict(); checkpoint.py never names anchors,
    outer optimizer state or the engine's units."""
    path = PACKAGE / "checkpoint.py"
    source = path.read_text()
    words = sorted(set(re.findall(r"\w*(?:anchor|outer)\w*", source, flags=re.IGNORECASE)))
    assert not words, f"checkpoint.py mentions {words}"
    attrs = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    assert "units" not in attrs, "checkpoint.py reads the engine's units"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_names_its_job_in_one_line(path: Path):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    assert doc, f"{path}: no module docstring"
    lines = doc.strip("\n").splitlines()
    first = lines[0].strip()
    assert first.endswith("."), f"{path}: the docstring's first line is not a sentence: {first!r}"
    assert len(lines) == 1 or not lines[1].strip(), (
        f"{path}: the job should fit the first line, followed by a blank line")
    assert len(first) <= 97, f"{path}: first line too long ({len(first)} characters)"


def framework_patches(source: str, here: str) -> list[str]:
    """Monkey-patching of imported third-party modules: assignments to, ``setattr`` or
    ``delattr`` on an attribute reached from an imported non-editrain module (``torch.x.y =
    ...``), and uses of FSDP1 (``FullyShardedDataParallel``), whose internals the reference
    implementation patched (reference defect 10)."""
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("editrain"):
                    imported.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and not node.module.startswith("editrain"):
            for alias in node.names:
                imported.add(alias.asname or alias.name)
    found = []

    def foreign(target: ast.AST) -> bool:
        dotted = _dotted(target)
        return dotted is not None and dotted.split(".")[0] in imported

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) \
                else [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and foreign(t.value):
                found.append(f"{here}:{node.lineno}: assigns {_dotted(t)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args \
                and foreign(node.args[0]):
            found.append(f"{here}:{node.lineno}: {node.func.id} on {_dotted(node.args[0])}")
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name == "FullyShardedDataParallel":
                found.append(f"{here}:{node.lineno}: FSDP1 (FullyShardedDataParallel)")
        if isinstance(node, ast.alias) and node.name.endswith("FullyShardedDataParallel"):
            found.append(f"{here}: imports FSDP1")
    return found


def test_no_framework_internals_are_patched():
    """Reference defect 10: the reference patched FSDP1's private internals for two torch
    versions; editrain uses FSDP2's public API, DeviceMesh, DCP and module hooks only."""
    offenders = [use for path in _modules()
                 for use in framework_patches(path.read_text(), _module_name(path))]
    assert not offenders, "framework patched:\n  " + "\n  ".join(offenders)


def test_the_patch_check_finds_what_it_should():
    source = ("import torch\n"
              "import torch.distributed as dist\n"
              "from torch.distributed import fsdp\n"
              "from torch.distributed.fsdp import FullyShardedDataParallel\n"
              "from editrain.sync import edit\n"
              "torch.nn.Module.forward = None\n"
              "dist.all_reduce = print\n"
              "setattr(fsdp, 'fully_shard', None)\n"
              "edit.DEFAULT = 1\n"
              "x = type('X', (), {})()\n"
              "x.y = 2\n")
    found = framework_patches(source, "editrain.probe")
    assert len(found) == 4, found  # the FSDP1 import and 3 patches; not editrain's or x's
    assert not any("edit.DEFAULT" in f or "x.y" in f for f in found)


def test_only_sync_ft_imports_torchft_inside_the_engine():
    """The fault-tolerant mode's one door: no module of editrain/sync but ft.py imports
    torchft (at the top or inside a function)."""
    importers = []
    for path in sorted((PACKAGE / "sync").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torchft" or n.startswith("torchft.") for n in names):
                importers.append(path.name)
    assert set(importers) == {"ft.py"}, importers


def import_graph() -> dict[str, set[str]]:
    """Module -> the editrain modules it imports (at the top or inside a function)."""
    modules = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, name, path.name == "__init__.py")
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


KNOWN_CYCLES = [["editrain.sync.edit", "editrain.sync.ft_round"]]
"""Cycles the engine rebuild (issue #31) removes; no other may appear."""


def test_no_new_import_cycles():
    cycles = [c for c in import_cycles(import_graph()) if c not in KNOWN_CYCLES]
    assert not cycles, f"import cycles in editrain/: {cycles}"


def test_the_cycle_check_finds_what_it_should():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
