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


def test_torchft_is_imported_only_through_import_torchft():
    """The fault-tolerant mode's one door: no module of editrain imports torchft with an
    import statement (at the top or inside a function), the benchmark's peers included;
    each goes through ``editrain.sync.ft.import_torchft``, which sets ``RUST_LOG`` first."""
    importers = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torchft" or n.startswith("torchft.") for n in names):
                importers.append(f"{_module_name(path)}:{node.lineno}")
    assert not importers, importers


# ----------------------------------------------------------------------------- the layers doc
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def layer_entries(text: str) -> list[tuple[int, str]]:
    """The ``(line, path)`` entries of the layers block of ``docs/architecture.md`` (the
    fenced block after ``<!-- layers -->``): each line starts with one or more paths under
    ``editrain/`` (``sync/edit.py``, or ``bench/`` for a whole package) before its
    description; indented lines continue a description."""
    block = text.split("<!-- layers -->", 1)[1].split("```", 2)[1]
    out = []
    for number, line in enumerate(block.splitlines()[1:]):
        if line[:1].isspace():
            continue  # an indented line continues the description above it
        for token in line.split():
            if not (token.endswith(".py") or token.endswith("/")):
                break
            out.append((number, token))
    return out


def _entry_of(module: Path, entries: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The most specific entry covering ``module`` (its file, else its closest package)."""
    rel = module.relative_to(PACKAGE).as_posix()
    best = None
    for line, path in entries:
        if rel == path or (path.endswith("/") and rel.startswith(path)):
            if best is None or len(path) > len(best[1]):
                best = (line, path)
    return best


def test_the_layers_doc_lists_every_module_and_only_modules_that_exist():
    entries = layer_entries(ARCHITECTURE.read_text())
    missing = [p for _, p in entries if not (PACKAGE / p).exists()]
    assert not missing, f"docs/architecture.md lists what editrain/ does not have: {missing}"
    paths = [p for _, p in entries]
    assert len(paths) == len(set(paths)), "a path is listed twice"
    unlisted = [m.relative_to(PACKAGE).as_posix() for m in sorted(PACKAGE.rglob("*.py"))
                if _entry_of(m, entries) is None]
    assert not unlisted, f"modules docs/architecture.md does not list: {unlisted}"


def test_imports_point_down_the_layers_doc():
    """A module imports only modules of its own line of the layers block or below it."""
    from tests.test_imports import import_graph, module_name

    entries = layer_entries(ARCHITECTURE.read_text())
    where = {module_name(m): _entry_of(m, entries) for m in PACKAGE.rglob("*.py")}
    upward = []
    for module, imported in import_graph().items():
        for other in imported:
            a, b = where[module], where[other]
            if a is not None and b is not None and b[0] < a[0]:
                upward.append(f"{module} ({a[1]}) imports {other} ({b[1]})")
    assert not upward, "imports that point up docs/architecture.md's layers: " + "; ".join(
        sorted(upward))
