"""Benchmark scenarios: the methods side by side on one simulated cluster.

``editrain bench SCENARIO [--quick | --full | --tiny] [--out DIR] [--section.key=value ...]``
runs one scenario and writes ``results.json``, ``table.md`` and PNG plots into the results
directory (default ``bench_results/<scenario>``). Timed comparisons repeat every run,
interleaved (1 time tiny, 3 quick, 5 full; ``--repeats N``). Scenarios:

========== ==============================================================================
default     `editrain train` with every option at its default: validation loss over the
            whole held-out split, time, throughput (the README's quick-start figures)
convergence validation loss vs tokens of sync, post_local_sgd, diloco, edit, aedit (full:
            tiny preset, 2,000 steps, 3 seeds, paired differences; about an hour)
tune        what closes EDiT's gap to sync at equal tokens: warm-up, H, outer lr and
            momentum, inner lr, penalty, tokens, shape, one at a time, then the recipe
scale       tune's recipe against sync as the model grows (tiny, blocks, small shapes) at
            equal tokens: the paired gap against parameters and tokens per parameter
batch       tune's recipe against sync as the tokens per replica per step grow (512,
            2,048, 8,192) at equal tokens, each method's lr tuned per batch, seeds paired
bandwidth   tokens/s of sync, diloco, edit as the simulated link gets slower
stragglers  tokens/s and loss with a 2x straggler or random stalls (sync, edit, aedit)
            against the measured limit (each replica's solo speed)
spikes      validation-loss spikes from corrupted replicas (diloco, edit, edit ablations)
memory      extra bytes per rank of the outer state (full copy vs sharded vs offloaded)
overlap     forward wait at a layer-wise sync vs prefetch depth (edit vs diloco)
optimizers  AdamW vs AGD vs AdamW + WSAM as inner optimizers, equal steps, 3 seeds
peers       torchft's DiLoCo next to diloco and edit (skipped when torchft is missing)
faults      one replica killed mid-run: --ft (the others train on, it heals) against
            restart-from-checkpoint; useful throughput and time lost
plan        `editrain plan --calibrate` on some runs predicts held-out settings:
            predicted vs measured tokens/s, utilisation and exposed communication
data        `editrain data` on 20 MB, 150 MB (full: and 1 GB) of Python: tokens/s and peak
            memory against the tokenizer's own encode_batch speed (one process per CPU)
all         every scenario above
report      docs/benchmarks.md from the results (``--readme FILE``: its headline too)
========== ==============================================================================

One module per scenario. A scenario is a declaration, ``SCENARIO =
scenario.Scenario(...)``: its sizes, its runs, what it measures from them, its tables,
plots, targets and findings; :func:`editrain.bench.scenario.execute` runs every scenario
the same way. The shared machinery, one job per module:

=============== ========================================================================
``scenario``    the declaration (Scenario, Job, Table, Verdict) and the one runner
``prose``       the scenarios' words as data: ``text/<module>.toml`` templates, filled
``options``     sizes, the options every run shares, the bench command line
``machine``     the machine record (CPUs, versions, load, commit)
``runner``      :class:`~editrain.bench.runner.Bench`: running and repeating the runs,
                writing the record
``runs``        a finished run read back (``metrics.jsonl``, ``ranks/rank{RANK}.jsonl``)
``measures``    numbers of one run: throughput, per-replica speed and utilisation
``limits``      measured limits: each replica's solo speed
``stats``       medians, spreads, paired differences over repeats and seeds
``tables``      Markdown tables
``results``     ``results.json`` and ``table.md``
``plots``       matplotlib set-up
``report``      ``docs/benchmarks.md`` and the README headline from the results
=============== ========================================================================

``torchft_peer`` is the torchft DiLoCo worker the ``peers`` scenario starts.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from editrain.argv import env_switch
from editrain.config import ConfigError
from editrain.errors import spelled
from editrain.paths import check_path
from editrain.paths import shown as shown_path

SCENARIOS = ("default", "convergence", "tune", "scale", "batch", "bandwidth", "stragglers", "spikes",
             "memory", "overlap", "optimizers", "peers", "faults", "plan", "data")
"""Scenario names in the order ``all`` runs them (and the report lists them)."""

REUSABLE = ("convergence", "tune", "scale", "batch")
"""Scenarios whose results are losses only (deterministic runs): ``--reuse`` may read back
their finished runs from an earlier invocation, e.g. one cut short."""

TINY_ENV = "EDITRAIN_BENCH_TINY"
"""Environment variable: set to 1 to run the smoke-test size (same as ``--tiny``); 0 or
unset: the size the command line picks (:func:`editrain.argv.env_switch`)."""


def scenario_module(name: str):
    """The module implementing scenario ``name``."""
    if name not in SCENARIOS:
        raise ConfigError(f"bench: unknown scenario {spelled(name)}; allowed: "
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
        extra: further command-line arguments: bench flags (``--tiny``, ``--full``,
            ``--seeds N``...; see :func:`~editrain.bench.options.split_extra`) and training
            options applied to every run (``--model.preset small``...).
        tiny: the smoke-test size (overrides ``quick``); also ``EDITRAIN_BENCH_TINY=1``.

    Returns:
        The record written to ``results.json`` (``all``: scenario -> record; ``report``:
        ``{"path": ...}``).
    """
    from editrain.bench.options import DEFAULT_ROOT, command_line, split_extra
    from editrain.bench.runner import Bench
    from editrain.bench.scenario import execute

    extra = list(extra or [])
    flags, overrides = split_extra(extra)
    tiny = tiny or bool(flags.get("tiny")) or env_switch(TINY_ENV)
    if flags.get("full") and (quick or tiny):
        raise ConfigError("bench: --full contradicts --quick / --tiny; give one size")
    mode = "tiny" if tiny else ("quick" if quick else "full")
    root = Path(out_dir) if out_dir is not None else DEFAULT_ROOT
    if flags.get("links") and name != "bandwidth":
        raise ConfigError(f"bench --links picks links of the bandwidth scenario; {name} has "
                          "none")
    if flags.get("reuse") and name not in REUSABLE:
        raise ConfigError(f"bench --reuse reads back finished runs of the loss-only scenarios "
                          f"({', '.join(REUSABLE)}); {name} compares speeds, which must be "
                          f"measured in one invocation")
    if flags.get("methods") and name != "convergence":
        raise ConfigError(f"bench --methods picks variants of the convergence scenario; "
                          f"{name} runs all of its own")
    if name == "report":
        return _report(root, flags)
    if name == "all":
        return {scenario: run_scenario(scenario, quick=quick, extra=extra, tiny=tiny,
                                       out_dir=None if out_dir is None else str(root / scenario))
                for scenario in SCENARIOS}
    module = scenario_module(name)
    results_dir = Path(out_dir) if out_dir is not None else DEFAULT_ROOT / name
    shown = extra + (["--tiny"] if tiny and "--tiny" not in extra else [])
    bench = Bench(name, mode, results_dir, user_overrides=overrides,
                  command=command_line(name, quick, out_dir, shown), flags=flags)
    bench.log(f"{mode} size; results in {results_dir}")
    return execute(module.SCENARIO, bench)


def _report(root: Path, flags: dict[str, Any]) -> dict[str, Any]:
    """``bench report``: ``docs/benchmarks.md`` (``--path``) and the headline of
    ``--readme`` from the results under ``root``."""
    from editrain.bench.report import (
        check_readme,
        scenario_dirs,
        write_benchmarks_md,
        write_readme_headline,
    )

    path, readme = flags.get("path", "docs/benchmarks.md"), flags.get("readme")
    check_path("bench report --path", path, "out_file")
    if readme:
        check_path("bench report --readme", readme, "in_file")
    dirs = scenario_dirs(root, SCENARIOS)
    if not dirs:
        raise ConfigError(f"bench report: no <scenario>/results.json under "
                          f"{shown_path(root)}; run `editrain bench all` (or single "
                          "scenarios) first")
    if readme:
        check_readme(readme)  # no markers: fail before writing anything
    written = write_benchmarks_md(dirs, path=path)
    print(f"wrote {written} from {len(dirs)} scenario(s)")
    out: dict[str, Any] = {"path": str(written)}
    if readme:
        write_readme_headline(readme, dirs)
        print(f"wrote the headline table of {readme}")
        out["readme"] = readme
    return out


__all__ = ["REUSABLE", "SCENARIOS", "TINY_ENV", "run_scenario", "scenario_module"]
