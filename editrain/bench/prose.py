"""The benchmarks' prose as data: ``editrain/bench/text/<name>.toml``, one file per module.

A scenario's description, its notes (how it was measured), the sentences of its findings,
targets and shortfalls, and the report's captions are TOML strings rather than Python
literals, so that a module holds the logic and its file holds the words. A text with named
fields (``{steps}``, ``{ratio:.0%}``) is a :meth:`str.format` template filled from the
measured values by :func:`fill`; a literal brace is written ``{{`` / ``}}``. The files
ship with the package (``[tool.setuptools.package-data]`` in ``pyproject.toml``).
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from editrain.safe_io import read_toml_value

TEXT_DIR = "text"
"""The folder of the text files inside ``editrain.bench``."""


@cache
def prose(name: str) -> dict[str, Any]:
    """The texts of module ``name`` (the parsed ``text/<name>.toml``)."""
    path = files("editrain.bench").joinpath(TEXT_DIR, f"{name}.toml")
    return read_toml_value(path.read_text(encoding="utf-8"), str(path), error=ValueError)


def fill(template: str | list[str], /, **values: Any) -> Any:
    """``template`` with its named fields filled from ``values`` (a list: each item);
    values a template does not name are ignored."""
    if isinstance(template, list):
        return [t.format(**values) for t in template]
    return template.format(**values)


__all__ = ["TEXT_DIR", "fill", "prose"]
