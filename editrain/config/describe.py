"""The options as documentation: each field's docstring, type and default, for help and docs.

``editrain options`` prints :func:`describe_options`; :mod:`editrain.docs` renders it as
``docs/configuration.md``; the API reference reads :func:`field_docs` of its own dataclasses.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from editrain.config.schema import Config


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings written under each field of a config dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def describe_options() -> list[tuple[str, str, Any, str]]:
    """``(option, type, default, help)`` for every configurable key, in section order."""
    out: list[tuple[str, str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            tname = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
            out.append((prefix + f.name, str(tname), getattr(defaults, f.name),
                        docs.get(f.name, "")))

    walk(Config, "")
    return out
