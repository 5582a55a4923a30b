"""Benchmark scenarios: the methods side by side on one simulated cluster.

``editrain bench SCENARIO [--quick] [--out DIR] [--tiny] [--section.key=value ...]`` runs
one scenario and writes ``results.json``, ``table.md`` and PNG plots into the results
directory (default ``bench_results/<scenario>``). Scenarios:

========== ==============================================================================
convergence validation loss vs tokens of sync, post_local_sgd, diloco, edit, aedit
bandwidth   tokens/s of sync, diloco, edit as the simulated link gets slower
stragglers  tokens/s and loss with a 2x straggler or random stalls (sync, edit, aedit)
spikes      validation-loss spikes from corrupted replicas (diloco, edit, edit ablations)
memory      extra bytes per rank of the outer state (full copy vs sharded vs offloaded)
overlap     forward wait at a layer-wise sync vs prefetch depth (edit vs diloco)
optimizers  AdamW vs AGD vs AdamW + WSAM as inner optimizers, equal steps, 3 seeds
peers       torchft's DiLoCo side by side (skipped when torchft is not installed)
all         every scenario above
report      assemble docs/benchmarks.md from the results directories
========== ==============================================================================

One module per scenario (each has ``NAME``, ``DESCRIPTION`` and ``run(bench)``), the shared
runner in :mod:`editrain.bench.common`, the report in :mod:`editrain.bench.report`.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from editrain.config import ConfigError

SCENARIOS = ("convergence", "bandwidth", "stragglers", "spikes", "memory", "overlap",
             "optimizers", "peers")
"""Scenario names in the order ``all`` runs them (and the report lists them)."""

TINY_ENV = "EDITRAIN_BENCH_TINY"
"""Environment variable: set to 1 to run the smoke-test size (same as ``--tiny``)."""


def scenario_module(name: str):
    """The module implementing scenario ``name``."""
    if name not in SCENARIOS:
        raise ConfigError(f"bench: unknown scenario {name!r}; allowed: "
                          f"{', '.join(SCENARIOS)}, all, report")
    return importlib.import_module(f"editrain.bench.{name}")


def run_scenario(name: str, quick: bool = False, out_dir: str | None = None,
                 extra: list[str] | None = None, tiny: bool = False) -> dict[str, Any]:
    """Run one scenario (or ``all``, or ``report``) and write its results.

    Args:
        name: a scenario name, ``all`` or ``report``.
        quick: the quick size (tiny model, small data; minutes on 2 cores).
        out_dir: results directory (default ``bench_results/<scenario>``; for ``all`` and
            ``report`` the directory holding one sub-directory per scenario, default
            ``bench_results``).
        extra: further command-line arguments: ``--tiny`` (smoke-test size), ``--seeds N``,
            ``--path FILE`` (report), and training options applied to every run
            (``--model.preset small``...).
        tiny: the smoke-test size (overrides ``quick``); also ``EDITRAIN_BENCH_TINY=1``.

    Returns:
        The record written to ``results.json`` (``all``: scenario -> record; ``report``:
        ``{"path": ...}``).
    """
    from editrain.bench.common import DEFAULT_ROOT, Bench, command_line, split_extra

    extra = list(extra or [])
    flags, overrides = split_extra(extra)
    tiny = tiny or bool(flags.get("tiny")) or os.environ.get(TINY_ENV, "") not in ("", "0")
    mode = "tiny" if tiny else ("quick" if quick else "full")
    root = Path(out_dir) if out_dir is not None else DEFAULT_ROOT

    if name == "report":
        from editrain.bench.report import write_benchmarks_md

        dirs = [root / s for s in SCENARIOS if (root / s / "results.json").is_file()]
        if not dirs:
            raise ConfigError(f"bench report: no results.json under {root}/<scenario>/; run "
                              "`editrain bench all` (or single scenarios) first")
        path = write_benchmarks_md(dirs, path=flags.get("path", "docs/benchmarks.md"))
        print(f"wrote {path} from {len(dirs)} scenario(s)")
        return {"path": str(path)}
    if name == "all":
        out: dict[str, Any] = {}
        for scenario in SCENARIOS:
            sub = None if out_dir is None else str(root / scenario)
            out[scenario] = run_scenario(scenario, quick=quick, out_dir=sub, extra=extra,
                                         tiny=tiny)
        return out

    module = scenario_module(name)
    results_dir = Path(out_dir) if out_dir is not None else DEFAULT_ROOT / name
    shown = extra + (["--tiny"] if tiny and "--tiny" not in extra else [])
    bench = Bench(name, mode, results_dir, user_overrides=overrides,
                  command=command_line(name, quick, out_dir, shown), flags=flags)
    bench.log(f"{mode} size; results in {results_dir}")
    return module.run(bench)


__all__ = ["SCENARIOS", "TINY_ENV", "run_scenario", "scenario_module"]
