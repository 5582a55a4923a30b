"""The benchmarks' prose as data (issue 52 item 5): ``editrain/bench/text/*.toml``.

The words of every scenario (description, notes, the sentences of its verdict) are TOML
templates read by :mod:`editrain.bench.prose`; the golden records of
``tests/test_bench_declared.py`` prove that the filled templates are the sentences the
modules wrote before. Here: the files are shipped, parse, are ASCII, hold only valid
templates, and every module's file exists.
"""

from __future__ import annotations

import ast
import fnmatch
import string
import tomllib
from pathlib import Path

import pytest

from editrain.bench.prose import TEXT_DIR, fill, prose

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "editrain" / "bench"
FILES = sorted((BENCH / TEXT_DIR).glob("*.toml"))


def _strings(value):
    """Every string of a parsed TOML value, depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


def test_the_text_files_are_package_data():
    """pyproject's package data for ``editrain.bench`` matches every text file, so a
    non-editable install ships them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["editrain.bench"]
    assert FILES
    for path in FILES:
        relative = path.relative_to(BENCH).as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_text_is_an_ascii_template(path):
    """Each file parses, is ASCII, and each string is a valid format template (balanced
    braces, named or indexed fields only: never a positional ``{}``)."""
    text = path.read_text(encoding="utf-8")
    assert text.isascii(), path.name
    data = prose(path.stem)
    strings = list(_strings(data))
    assert strings, path.name
    for s in strings:
        for _, field, _, _ in string.Formatter().parse(s):
            assert field != "", f"{path.name}: positional field in {s[:60]!r}"


def test_every_module_that_reads_prose_has_its_file():
    """``prose("name")`` in a bench module names a file that exists."""
    names = set()
    for module in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "prose" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    assert names >= {"stragglers", "bandwidth", "convergence"}
    assert names <= {p.stem for p in FILES}


def test_fill():
    """Named fields, format specs, attribute and item lookups, literal braces, lists, and
    values a template does not name."""
    assert fill("{a:.1%} of {b[k]} at {c.real:g}{{RANK}}", a=0.1234, b={"k": "x"}, c=2.0,
                unused=1) == "12.3% of x at 2{RANK}"
    assert fill(["{n} one", "two {n:+d}"], n=3) == ["3 one", "two +3"]
    with pytest.raises(KeyError):
        fill("{missing}", other=1)
