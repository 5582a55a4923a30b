"""Lazy exports of a package (PEP 562): a public name's module is imported on first use.

``editrain``, ``editrain.sync`` and ``editrain.models`` re-export names whose modules import
torch; a command that needs none of them (``editrain data``) imports none of those modules.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], namespace: MutableMapping[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__`` for names imported on use.

    Args:
        package: the package's name, for the error of an unknown attribute.
        exports: public name -> the module that defines it.
        namespace: the package's ``globals()``: a name, once imported, is stored there, so
            the next lookup never reaches ``__getattr__``.

    Returns:
        ``(__getattr__, __dir__)``, to be bound at the package's top level.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    getattr_.__doc__ = f"Import a public name of {package} on first access (PEP 562)."
    dir_.__doc__ = f"Public names of {package} plus its own attributes."
    return getattr_, dir_
