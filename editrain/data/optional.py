"""Optional dependencies of the data layer: imported on demand, or a pip command to install them.

``pyarrow`` (``.parquet`` files) and ``datasets`` (Hugging Face datasets) are extras of the
package; a source that needs a missing one fails with the extra that provides it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, purpose: str, *, load: bool = True) -> ModuleType | None:
    """Import an optional dependency, or only check that it is installed.

    Args:
        module: Dotted module name (``"pyarrow.parquet"``, ``"datasets"``).
        extra: The ``editrain`` extra that installs it (``"parquet"``, ``"hf"``).
        purpose: What needs it, for the message (``"reading .parquet files"``).
        load: Import and return the module; with ``False``, only look it up (no import
            of the module itself, so configuration checks stay fast) and return None.

    Returns:
        The module, or None with ``load=False``.

    Raises:
        ImportError: The module is not installed; the message starts with ``data.path:``
            and gives the ``pip install "editrain[EXTRA]"`` command.
    """
    top = module.partition(".")[0]
    message = (f'data.path: {purpose} needs the {top} package; install it with '
               f'pip install "editrain[{extra}]"')
    if not load:
        try:
            # find_spec of a top-level name imports nothing; it returns None when the
            # module is missing (or blocked by a None entry in sys.modules).
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ImportError(message)
        return None
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(message) from exc
