"""Shared machinery of the benchmark scenarios.

A scenario builds a :class:`Bench` and asks it for training runs; each run is a normal
``editrain train`` job (``editrain.config.load_config`` + ``editrain.launch.run_local``)
with its run directory under ``RESULTS_DIR/runs/<label>``, so every run can be inspected,
plotted (``editrain plot``) or resumed like any other. The scenario then reads the runs'
``metrics.jsonl``, derives its numbers with the helpers below and hands them back to
:meth:`Bench.finish`, which writes ``results.json`` and ``table.md``.

Sizes. Every scenario has three sizes:

* ``tiny``: smoke-test settings (a handful of steps, one seed, fewer variants), used by
  ``tests/test_bench.py``; ``--tiny`` on the command line or ``EDITRAIN_BENCH_TINY=1``.
* ``quick`` (``--quick``): the tiny model preset on ~1.5 MB of the default corpus, a few
  minutes per scenario on 2 cores.
* ``full``: the small preset on the default corpus size; takes much longer.

Topology. Training runs use 2 replicas x 1 shard (``dist.nproc=2``, ``dist.shard_size=1``):
one process per core on the 2-core reference machine, so wall-clock numbers are not
distorted by two processes sharing one core. Any option can be overridden for every run of
a scenario by appending it to the command, e.g. ``editrain bench convergence --quick
--dist.nproc 4 --dist.shard_size 2``; the overrides are recorded in ``results.json``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from editrain.config import ConfigError, load_config, parse_overrides

MODES = ("tiny", "quick", "full")
RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"
DEFAULT_ROOT = Path("bench_results")

# Bench-only command-line flags (everything else in ``extra`` is a training option).
_FLAG_TINY = "--tiny"
_VALUE_FLAGS = ("--seeds", "--path")


# ---------------------------------------------------------------------------- settings
def base_overrides(mode: str) -> dict[str, Any]:
    """Training options shared by every run of every scenario in ``mode``.

    Args:
        mode: ``tiny``, ``quick`` or ``full``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown benchmark mode {mode!r}; allowed: {', '.join(MODES)}")
    small_data = {"max_bytes": 1_500_000, "vocab_size": 2048, "val_fraction": 0.03}
    base: dict[str, Any] = {
        "model": {"preset": "small" if mode == "full" else "tiny"},
        "data": {} if mode == "full" else dict(small_data),
        "train": {"batch_size": 8, "seq_len": 64, "eval_batches": 4 if mode == "tiny" else 8},
        "dist": {"nproc": 2, "shard_size": 1},
        "checkpoint": {"final": False, "every": 0},
    }
    return base


def merge(*layers: dict[str, Any] | None) -> dict[str, Any]:
    """Deep merge of nested option dicts; later layers win."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in (layer or {}).items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = merge(out[k], v)
            else:
                out[k] = v
    return out


def split_extra(extra: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split the command line's extra arguments into bench flags and training overrides.

    Bench flags: ``--tiny``, ``--seeds N`` (convergence), ``--path FILE`` (report). The
    rest must be training options (``--section.key=value``), applied to every run.

    Returns:
        ``(flags, overrides)``.

    Raises:
        ConfigError: an argument that is neither.
    """
    flags: dict[str, Any] = {}
    rest: list[str] = []
    args = list(extra)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name == _FLAG_TINY:
            flags["tiny"] = True
        elif name in _VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"bench {name}: missing value")
                i += 1
                value = args[i]
            flags[name[2:]] = value
        else:
            rest.append(arg)
        i += 1
    overrides, positional = parse_overrides(rest)
    if positional:
        raise ConfigError(f"bench: unexpected argument(s) {' '.join(positional)}; training "
                          "options look like --train.steps=100")
    if "seeds" in flags:
        try:
            flags["seeds"] = int(flags["seeds"])
        except ValueError:
            raise ConfigError(f"bench --seeds: expected an integer, got {flags['seeds']!r}") \
                from None
        if flags["seeds"] < 1:
            raise ConfigError(f"bench --seeds: must be >= 1, got {flags['seeds']}")
    return flags, overrides


def machine_info() -> dict[str, Any]:
    """The machine a benchmark ran on (CPU count, torch version, platform, load)."""
    import torch

    import editrain

    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "editrain": getattr(editrain, "__version__", "?"),
        "cuda": torch.cuda.is_available(),
    }
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    info["git_commit"] = _git_commit()
    return info


def _load() -> float | None:
    """1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _git_commit() -> str | None:
    """Read-only ``git rev-parse`` of the source tree editrain is imported from."""
    import editrain

    root = Path(editrain.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command_line(scenario: str, quick: bool, out_dir: str | None, extra: Sequence[str]) -> str:
    """The ``editrain bench`` command equivalent to this call."""
    argv = ["editrain", "bench", scenario]
    if quick:
        argv.append("--quick")
    if out_dir is not None:
        argv += ["--out", str(out_dir)]
    return shlex.join(argv + list(extra))


def describe_machine(m: dict[str, Any]) -> str:
    """One line: CPUs, platform, torch, Python, load average."""
    load = m.get("load_average")
    text = (f"{m.get('usable_cpus')} usable CPUs ({m.get('cpu_count')} total, "
            f"{m.get('processor')}), {m.get('platform')}, torch {m.get('torch')}, "
            f"Python {m.get('python')}, editrain {m.get('editrain')}")
    if m.get("git_commit"):
        text += f" (commit {m['git_commit']})"
    if load:
        text += f"; load average at start {load[0]:.2f}"
    return text


# ---------------------------------------------------------------------------- runs
@dataclass
class Run:
    """One finished (or failed) training run and what the scenarios read from it."""

    label: str
    run_dir: Path
    overrides: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Step rows of ``metrics.jsonl`` (those with a training loss), in step order."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """Rows holding a validation loss (including the step-0 and final evaluations)."""
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved configuration the run wrote to ``config.toml``."""
    launch_s: float = 0.0
    """Wall time of the whole ``run_local`` call (process start-up included)."""
    error: str | None = None
    load_before: float | None = None
    """The machine's 1-minute load average just before the run started."""

    @property
    def ok(self) -> bool:
        """Whether the run finished and wrote its summary."""
        return self.error is None and bool(self.summary)

    @property
    def layerwise(self) -> bool:
        """Whether the method syncs unit by unit in the next forward."""
        value = self.config.get("sync", {}).get("layerwise")
        return value is True or (isinstance(value, str) and value.lower() == "true")

    @property
    def final_val_loss(self) -> float | None:
        """The run's final validation loss (None when it failed or diverged)."""
        v = self.summary.get("final_val_loss")
        return v if isinstance(v, int | float) and math.isfinite(v) else None

    def timed_syncs(self) -> list[tuple[int, dict[str, Any]]]:
        """``(row index, sync entry)`` of the syncs whose time is inside the step rows.

        A blocking sync (``sync``, ``post_local_sgd``, ``diloco``) runs inside the step that
        triggers it. A layer-wise sync runs in the forward of the *next* step (its entry's
        ``step`` is the row's step - 1); when an evaluation or the end of the run comes
        first, ``finish()`` runs it between two steps instead, outside every row's
        ``step_time_s`` and ``wall_time_s`` (entry ``step`` == row ``step``): such syncs
        are left out here.
        """
        out = []
        for i, r in enumerate(self.rows):
            s = r.get("sync")
            if not isinstance(s, dict):
                continue
            if self.layerwise and s.get("step") == r.get("step"):
                continue
            out.append((i, s))
        return out


def read_run(label: str, run_dir: Path, overrides: dict[str, Any], launch_s: float = 0.0,
             error: str | None = None) -> Run:
    """Load whatever a run directory holds into a :class:`Run`."""
    import tomllib

    from editrain.metrics import read_metrics

    run = Run(label=label, run_dir=run_dir, overrides=overrides, launch_s=launch_s, error=error)
    if (run_dir / "metrics.jsonl").is_file():
        rows = [r for r in read_metrics(run_dir) if "event" not in r and not r.get("replayed")]
        run.rows = sorted((r for r in rows if r.get("loss") is not None and "step" in r),
                          key=lambda r: r["step"])
        run.evals = [r for r in rows if r.get("val_loss") is not None]
    if (run_dir / "summary.json").is_file():
        run.summary = json.loads((run_dir / "summary.json").read_text())
    if (run_dir / "config.toml").is_file():
        run.config = tomllib.loads((run_dir / "config.toml").read_text())
    if run.error is None and not run.summary:
        run.error = "no summary.json (the run did not finish)"
    return run


class Bench:
    """Runs the training jobs of one scenario and writes its results.

    Args:
        scenario: the scenario's name (``convergence``, ``bandwidth``...).
        mode: ``tiny``, ``quick`` or ``full``.
        out_dir: the results directory.
        user_overrides: training options from the command line, applied to every run last.
        command: the equivalent ``editrain bench`` command (recorded).
        flags: bench-only flags (``seeds``...).
    """

    def __init__(self, scenario: str, mode: str, out_dir: Path,
                 user_overrides: dict[str, Any] | None = None, command: str = "",
                 flags: dict[str, Any] | None = None) -> None:
        """Set up the results directory and record the machine."""
        if mode not in MODES:
            raise ValueError(f"unknown benchmark mode {mode!r}; allowed: {', '.join(MODES)}")
        self.scenario = scenario
        self.mode = mode
        self.out_dir = Path(out_dir)
        self.user_overrides = user_overrides or {}
        self.command = command
        self.flags = flags or {}
        self.base = base_overrides(mode)
        self.machine = machine_info()
        self.started = time.time()
        self._t0 = time.perf_counter()
        self.runs: dict[str, Run] = {}
        self.out_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ settings
    def pick(self, tiny: Any, quick: Any, full: Any) -> Any:
        """The value for this size."""
        return {"tiny": tiny, "quick": quick, "full": full}[self.mode]

    def options(self, *layers: dict[str, Any] | None) -> dict[str, Any]:
        """Base options, then the scenario's layers, then the user's overrides."""
        return merge(self.base, *layers, self.user_overrides)

    def check(self, *layers: dict[str, Any] | None) -> None:
        """Validate a run's options now (a typo must fail before the first run starts)."""
        load_config(None, merge(self.options(*layers), {"run_dir": str(self.out_dir / "x")}))

    def setting(self, dotted: str, *layers: dict[str, Any] | None) -> Any:
        """The value option ``dotted`` will have in a run built from ``layers``."""
        cfg = load_config(None, self.options(*layers))
        node: Any = cfg
        for part in dotted.split("."):
            node = getattr(node, part)
        return node

    def log(self, text: str) -> None:
        """Progress line on stdout."""
        print(f"[{self.scenario}] {text}", flush=True)

    # ------------------------------------------------------------------ runs
    def train(self, label: str, *layers: dict[str, Any] | None) -> Run:
        """Run one training job (``run_local``) and read its metrics back.

        Args:
            label: unique name of the run inside this scenario (its directory name).
            layers: option dicts merged over the base options (the user's win last).

        Returns:
            The run; ``run.error`` says why when it failed (the scenario goes on).
        """
        from editrain.launch import run_local

        run_dir = self.out_dir / "runs" / label
        overrides = self.options(*layers)
        cfg = load_config(None, merge(overrides, {"run_dir": str(run_dir), "overwrite": True,
                                                  "quiet": True}))
        load = _load()
        t0 = time.perf_counter()
        error = None
        try:
            run_local(cfg)
        except ConfigError:
            raise
        except Exception as e:  # a failed worker must not lose the other runs' results
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
        run = read_run(label, run_dir, overrides, time.perf_counter() - t0, error)
        run.load_before = load
        self.runs[label] = run
        if run.ok:
            val = run.final_val_loss
            self.log(f"{label}: {run.summary.get('tokens')} tokens in "
                     f"{run.summary.get('wall_time_s', 0):.1f} s of training "
                     f"({run.launch_s:.1f} s with start-up), final val loss "
                     f"{'n/a' if val is None else f'{val:.4f}'}")
        else:
            self.log(f"{label}: FAILED: {run.error}")
        return run

    # ------------------------------------------------------------------ output
    def finish(self, *, settings: dict[str, Any], methods: Sequence[str],
               results: dict[str, Any], tables: Sequence[tuple[str, str]],
               targets: Sequence[dict[str, Any]] = (), findings: Sequence[str] = (),
               notes: Sequence[str] = (), plots: Sequence[Path] = (),
               description: str = "", skipped: str | None = None,
               shortfalls: Sequence[str] = (), size_caveat: bool = True) -> dict[str, Any]:
        """Write ``results.json`` and ``table.md``; print the tables; return the record.

        Args:
            settings: what was run (sizes, intervals, links...), for the record.
            methods: the compared methods / variants, in table order.
            results: the scenario's numbers.
            tables: ``(title, markdown table)`` pairs.
            targets: ``{"name", "met" (True/False/None), "detail"}`` checks.
            findings: plain sentences generated from the numbers.
            shortfalls: sentences about where editrain falls short (beyond unmet targets).
            size_caveat: whether quick / tiny numbers differ in kind from the full size's
                (the report then says so).
            notes: how the numbers were measured (definitions, caveats).
            plots: PNG files written into the results directory.
            description: one paragraph: what the scenario measures.
            skipped: set when the scenario could not run at all (reason).
        """
        elapsed = time.perf_counter() - self._t0
        record: dict[str, Any] = {
            "scenario": self.scenario,
            "mode": self.mode,
            "command": self.command,
            "argv": sys.argv,
            "machine": self.machine,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)),
            "elapsed_s": elapsed,
            "description": description,
            "settings": settings,
            "base_options": self.base,
            "user_overrides": self.user_overrides,
            "methods": list(methods),
            "results": results,
            "targets": list(targets),
            "findings": list(findings),
            "shortfalls": list(shortfalls),
            "size_caveat": size_caveat,
            "notes": list(notes),
            "plots": [p.name for p in plots],
            "runs": {
                label: {"run_dir": str(r.run_dir), "ok": r.ok, "error": r.error,
                        "launch_s": r.launch_s, "load_before": r.load_before,
                        "summary": r.summary}
                for label, r in self.runs.items()
            },
        }
        loads = finite(r.load_before for r in self.runs.values())
        if loads:
            record["machine"]["load_during_runs"] = [min(loads), max(loads)]
        if skipped is not None:
            record["skipped"] = skipped
        try:
            record["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        except OSError:
            pass
        (self.out_dir / RESULTS_FILE).write_text(json.dumps(clean_json(record), indent=1) + "\n")
        md = self.markdown(record, tables)
        (self.out_dir / TABLE_FILE).write_text(md)
        print(md, flush=True)
        self.log(f"wrote {self.out_dir / RESULTS_FILE}, {self.out_dir / TABLE_FILE}"
                 + "".join(f", {self.out_dir / p.name}" for p in plots)
                 + f" ({elapsed:.0f} s)")
        return record

    def markdown(self, record: dict[str, Any], tables: Sequence[tuple[str, str]]) -> str:
        """The ``table.md`` page of a scenario."""
        lines = [f"# Benchmark: {self.scenario} ({self.mode})", ""]
        if record.get("description"):
            lines += [record["description"], ""]
        lines += [f"Command: `{record['command']}`", "",
                  f"Machine: {describe_machine(record['machine'])}", "",
                  f"Elapsed: {record['elapsed_s']:.0f} s, started {record['started']}."]
        loads = record["machine"].get("load_during_runs")
        if loads:
            lines[-1] += (f" Load average (1 min) before each run: {loads[0]:.1f} to "
                          f"{loads[1]:.1f} on {record['machine'].get('usable_cpus')} CPUs"
                          + ("; timings are only comparable on a quiet machine."
                             if loads[1] > 0.5 * (record["machine"].get("usable_cpus") or 1)
                             else "."))
        lines.append("")
        if record.get("user_overrides"):
            lines += ["Options given on the command line (applied to every run, over the "
                      f"scenario's own): `{json.dumps(record['user_overrides'])}`", ""]
        if record.get("skipped"):
            lines += [f"**Skipped:** {record['skipped']}", ""]
        for title, table in tables:
            if title:
                lines += [f"## {title}", ""]
            lines += [table.rstrip("\n"), ""]
        if record["targets"]:
            lines += ["## Targets", ""]
            for t in record["targets"]:
                lines.append(f"- {t['name']}: **{target_word(t.get('met'))}**"
                             + (f" ({t['detail']})" if t.get("detail") else ""))
            lines.append("")
        if record["findings"]:
            lines += ["## Findings", ""] + [f"- {f}" for f in record["findings"]] + [""]
        if record["shortfalls"]:
            lines += ["## Shortfalls", ""] + [f"- {f}" for f in record["shortfalls"]] + [""]
        if record["notes"]:
            lines += ["## How it was measured", ""] + [f"- {n}" for n in record["notes"]] + [""]
        if record["plots"]:
            lines += ["## Plots", ""] + [f"![{p}]({p})" for p in record["plots"]] + [""]
        failed = [label for label, r in record["runs"].items() if not r["ok"]]
        if failed:
            lines += ["## Failed runs", ""]
            lines += [f"- `{label}`: {record['runs'][label]['error']}" for label in failed]
            lines.append("")
        return "\n".join(lines)


def target_word(met: bool | None) -> str:
    """``yes`` / ``no`` / ``not evaluated``."""
    return "not evaluated" if met is None else ("yes" if met else "no")


def clean_json(v: Any) -> Any:
    """JSON-safe copy: non-finite floats become null, paths and tuples plain values."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): clean_json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [clean_json(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


# ---------------------------------------------------------------------------- metrics
def finite(values: Iterable[Any]) -> list[float]:
    """The finite numbers among ``values``."""
    return [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v)]


def median(values: Iterable[Any]) -> float | None:
    """Median of the finite values (None when there are none)."""
    xs = finite(values)
    return statistics.median(xs) if xs else None


def mean_std(values: Iterable[Any]) -> dict[str, Any]:
    """``mean``, sample ``std`` (0 for one value), ``min``, ``max``, ``n`` of finite values."""
    xs = finite(values)
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def steady_throughput(run: Run, skip: int = 3) -> dict[str, Any]:
    """Tokens per second of the whole cluster over the steady part of a run.

    The window runs from the first timed sync after step ``skip`` to the last timed sync
    (so it holds whole sync cycles: every method pays for exactly its share of syncs),
    or, when the run has fewer than two timed syncs (synchronous training, a run without
    syncs), from step ``skip`` to the last step. Throughput is the tokens added in the
    window divided by the wall time between its two rows (``wall_time_s``: compute, sync
    waits, blocking collectives, simulated stalls, metric writes; scenarios that measure
    speed evaluate only at the end, so no evaluation falls inside the window).

    Returns:
        ``tokens_per_s``, ``seconds``, ``tokens``, ``from_step``, ``to_step``, ``steps``,
        ``syncs`` and the per-step sums of the sync entries inside the window
        (``wait_s``, ``comm_time_s``, ``link_delay_s``, ``sync_time_s``); empty when the
        run has too few rows.
    """
    rows = run.rows
    if len(rows) < 2:
        return {}
    syncs = [i for i, _ in run.timed_syncs() if rows[i]["step"] > skip]
    if len(syncs) >= 2:
        a, b = syncs[0], syncs[-1]
    else:
        a = next((i for i, r in enumerate(rows) if r["step"] >= skip), 0)
        b = len(rows) - 1
        if a >= b:
            a = 0
    ra, rb = rows[a], rows[b]
    seconds = rb["wall_time_s"] - ra["wall_time_s"]
    tokens = rb["tokens"] - ra["tokens"]
    steps = rb["step"] - ra["step"]
    out: dict[str, Any] = {
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "seconds": seconds, "tokens": tokens, "from_step": ra["step"], "to_step": rb["step"],
        "steps": steps, "step_time_s": seconds / steps if steps else None,
    }
    inside = [s for i, s in run.timed_syncs() if a < i <= b]
    out["syncs"] = len(inside)
    for key in ("wait_s", "comm_time_s", "link_delay_s", "sync_time_s"):
        total = sum(finite(s.get(key) for s in inside))
        out[key + "_per_step"] = total / steps if steps else None
    window = rows[a + 1:b + 1]
    out["compute_s_per_step"] = (sum(finite(r.get("compute_s") for r in window)) / steps
                                 if steps else None)
    if any("grad_sync_s" in r for r in window):  # newer trainers report gradient all-reduce
        out["grad_sync_s_per_step"] = sum(finite(r.get("grad_sync_s") for r in window)) / steps
    return out


def val_curve(run: Run) -> list[tuple[float, float, float]]:
    """``(tokens, wall_time_s, val_loss)`` of every evaluation, in order."""
    out = []
    for r in run.evals:
        v = r.get("val_loss")
        if isinstance(v, int | float) and math.isfinite(v):
            out.append((float(r.get("tokens", 0)), float(r.get("wall_time_s", 0.0)), float(v)))
    return sorted(out)


# ---------------------------------------------------------------------------- formatting
def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (cells formatted with :func:`cell`)."""
    head = "| " + " | ".join(headers) + " |"
    sep = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"
    body = ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join([head, sep, *body]) + "\n"


def cell(v: Any) -> str:
    """Table cell text: ``n/a`` for missing numbers, 4 significant digits otherwise."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "n/a"
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` when both are known and ``b`` is not zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_bytes(n: float | None) -> str:
    """``12.3 MiB`` style."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Save and close a figure (a legend on every axis that has labelled artists)."""
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


ScenarioFn = Callable[[Bench], dict[str, Any]]
