"""Peers: other implementations of the same methods, side by side with editrain.

Today the only peer is torchft's DiLoCo (``torchft.local_sgd.DiLoCo``). torchft needs its
own lighthouse/manager processes and is an optional dependency; when it is not importable
the scenario is skipped with a clear message and a ``results.json`` that says so.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from editrain.bench.common import Bench, md_table

NAME = "peers"
DESCRIPTION = (
    "torchft's DiLoCo next to editrain's `diloco` and `edit` on the same model and data "
    "(optional: needs the `torchft` package)."
)


def torchft_version() -> str | None:
    """torchft's version when it is importable, else None."""
    if importlib.util.find_spec("torchft") is None:
        return None
    try:
        from importlib.metadata import version

        return version("torchft")
    except Exception:
        return "unknown"


def run(bench: Bench) -> dict[str, Any]:
    """Run the scenario (or record why it was skipped)."""
    found = torchft_version()
    if found is None:
        reason = "skipped: torchft not installed (pip install torchft to compare with it)"
    else:
        reason = (f"skipped: torchft {found} is installed, but editrain's benchmark does not "
                  "drive it yet (its DiLoCo needs a torchft Manager and lighthouse per "
                  "replica group; not wired up or verified here)")
    bench.log(reason)
    table = md_table(["peer", "status"], [["torchft DiLoCo", reason]])
    return bench.finish(settings={"torchft": found}, methods=["torchft-diloco"],
                        results={"torchft-diloco": {"status": "skipped", "reason": reason}},
                        tables=[("Peers", table)],
                        notes=["A skipped peer is not a failure of editrain's benchmarks."],
                        description=DESCRIPTION, skipped=reason)
