"""Running a scenario's training jobs (progress, repeats, sizes) and writing its record.

Each run is a normal ``editrain train --config RESULTS_DIR/runs/<label>.toml`` job in a
child process (killed past a time limit, so a hang fails the run instead of blocking the
scenario) with its run directory under ``RESULTS_DIR/runs/<label>``, so every run can be
inspected, plotted (``editrain plot``) or resumed like any other. The scenario derives its
numbers from the runs and hands them to :meth:`Bench.finish`, which writes ``results.json``
and ``table.md``.

Timed comparisons repeat every run :attr:`Bench.repeats` times, interleaved (A B C A B C
...), so that a change of the machine's speed during the scenario hits every method alike;
the label of repeat ``i`` ends in ``-r{i}``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from pathlib import Path
from typing import Any

from editrain.bench.machine import load_average, machine_info
from editrain.bench.options import MODES, REPEATS, base_overrides, merge
from editrain.bench.results import FORMAT, clean_json, write_record
from editrain.bench.runs import Run, read_run
from editrain.bench.stats import finite
from editrain.config import ConfigError, load_config
from editrain.config.applicability import drop_inapplicable


def child_env(threads: int | None = None) -> dict[str, str]:
    """The environment of a child process: this one's, with editrain's source tree on
    ``PYTHONPATH`` (and ``OMP_NUM_THREADS`` when ``threads`` is given)."""
    import editrain

    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    source = str(Path(editrain.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    return env


def run_child(argv: list[str], log_path: Path, timeout_s: float) -> str | None:
    """Run a command in its own process session, its output to ``log_path``.

    Args:
        argv: the command.
        log_path: where its stdout and stderr go.
        timeout_s: wall-clock limit; past it the whole session (the command and every
            process it started) gets SIGTERM, then SIGKILL 10 s later.

    Returns:
        None on exit status 0, else why it failed (see :func:`child_failure`).
    """
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            return f"did not finish within {timeout_s:.0f} s (killed)"
        except BaseException:  # interrupted (Ctrl-C, a test's timeout): leave nothing behind
            _kill_session(proc)
            raise
    return child_failure(code, log_path)


def child_failure(code: int, log_path: Path) -> str | None:
    """Why a child that ended with exit status ``code`` failed (None: it did not): the status
    and the last line of its output in ``log_path``."""
    if code == 0:
        return None
    lines = log_path.read_text(errors="replace").splitlines()
    last = next((x.strip() for x in reversed(lines) if x.strip()), "")
    return f"exit status {code}: {last}"


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of ``proc`` (its session leader), SIGKILL if needed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10.0)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def repeat_label(label: str, repeat: int) -> str:
    """The label of repeat ``repeat`` of run ``label`` (``edit-r0``...)."""
    return f"{label}-r{repeat}"


def _val_text(run: Run) -> str:
    """The run's final validation loss for a progress line."""
    val = run.final_val_loss
    return "n/a" if val is None else f"{val:.4f}"


class Bench:
    """Runs the training jobs of one scenario and writes its results.

    Args:
        scenario: the scenario's name (``convergence``, ``bandwidth``...).
        mode: ``tiny``, ``quick`` or ``full``.
        out_dir: the results directory.
        user_overrides: training options from the command line, applied to every run last.
        command: the equivalent ``editrain bench`` command (recorded).
        flags: bench-only flags (``seeds``, ``repeats``...).
        started: when the scenario started (seconds since the epoch; default now), for a
            record written after runs that something else started.
    """

    def __init__(self, scenario: str, mode: str, out_dir: Path,
                 user_overrides: dict[str, Any] | None = None, command: str = "",
                 flags: dict[str, Any] | None = None, started: float | None = None) -> None:
        self.base = base_overrides(mode)  # refuses an unknown mode first
        self.scenario = scenario
        self.mode = mode
        self.out_dir = Path(out_dir)
        self.user_overrides = user_overrides or {}
        self.command = command
        self.flags = flags or {}
        self.machine = machine_info()
        now = time.time()
        self.started = now if started is None else started
        self._t0 = time.perf_counter() - (now - self.started)
        self.runs: dict[str, Run] = {}
        self.run_timeout_s: float = self.pick(240, 1800, 7200)
        """Wall-clock limit of one training run; a run past it is killed and failed."""
        self.planned_runs: int | None = None
        """How many runs the scenario will start (for the ``run k/N`` progress lines)."""
        self._run_seconds: list[float] = []
        self.reused: list[str] = []
        """``--reuse``: the runs read back from an earlier invocation (in the record)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ settings
    def pick(self, tiny: Any, quick: Any, full: Any) -> Any:
        """The value for this size."""
        return (tiny, quick, full)[MODES.index(self.mode)]

    @property
    def repeats(self) -> int:
        """Interleaved repeats of timed runs: 1 tiny, 3 quick, 5 full, or ``--repeats N``."""
        return int(self.flags.get("repeats") or REPEATS[self.mode])

    def options(self, *layers: dict[str, Any] | None,
                last: dict[str, Any] | None = None) -> dict[str, Any]:
        """Base options, then the scenario's layers, then the user's overrides, then
        ``last`` (options no user override may change, e.g. a solo run's topology); an
        option set for every run is left out of the runs whose method or mode it does not
        apply to (``editrain train`` would refuse it there)."""
        return drop_inapplicable(merge(self.base, *layers, self.user_overrides, last))

    def check(self, *layers: dict[str, Any] | None, last: dict[str, Any] | None = None) -> None:
        """Validate a run's options now (a typo must fail before the first run starts)."""
        load_config(None, self._run_options(self.out_dir / "x", layers, last))

    def config(self, *layers: dict[str, Any] | None) -> Any:
        """The validated configuration a run built from ``layers`` will have."""
        return load_config(None, self.options(*layers))

    def setting(self, dotted: str, *layers: dict[str, Any] | None) -> Any:
        """The value option ``dotted`` will have in a run built from ``layers``."""
        return attrgetter(dotted)(self.config(*layers))

    def log(self, text: str) -> None:
        """Progress line on stdout."""
        print(f"[{self.scenario}] {text}", flush=True)

    def plan(self, runs: int) -> None:
        """Announce how many runs the scenario will start (progress lines say ``k/N``)."""
        self.planned_runs = runs

    # ------------------------------------------------------------------ runs
    def train(self, label: str, *layers: dict[str, Any] | None, title: str | None = None,
              last: dict[str, Any] | None = None) -> Run:
        """Run one training job (``editrain train`` in a child process) and read it back.

        The job runs in its own process session with the configuration written to
        ``runs/<label>.toml`` and its output to ``runs/<label>.log``; when it outlives
        :attr:`run_timeout_s` the whole session is killed and the run counts as failed, so
        that a hang cannot block a long scenario.

        Args:
            label: unique name of the run inside this scenario (its directory name).
            layers: option dicts merged over the base options (the user's win over them).
            title: what the progress line calls the run (default: the label).
            last: options merged over the user's too (see :meth:`options`).

        Returns:
            The run; ``run.error`` says why when it failed (the scenario goes on).

        Raises:
            ConfigError: the options are invalid (checked before anything starts).
        """
        title = title or label
        if self.flags.get("reuse") and (run := self._reused(label, layers, last)) is not None:
            self.runs[label] = run
            self.reused.append(label)
            self.log(f"{self._run_number(len(self.runs))} {title} ... reused (finished "
                     f"earlier with these options), val {_val_text(run)}")
            return run
        return self._launch([(label, layers, last, title)], title)[0]

    def train_together(self, jobs: Sequence[tuple[str, tuple, dict[str, Any] | None, str]]
                       ) -> list[Run]:
        """Run several training jobs at the same time (each its own ``editrain train``),
        e.g. replicas' solo runs that must share the machine as the replicas do: one
        ``(label, layers, last, title)`` per job, as for :meth:`train`; the runs in order."""
        return self._launch(jobs, " + ".join(title for *_, title in jobs) + " (at once)")

    def _launch(self, jobs: Sequence[tuple[str, tuple, dict[str, Any] | None, str]],
                shown: str) -> list[Run]:
        """Start ``(label, layers, last, title)`` jobs together, wait for all, keep them."""
        prepared = [self._prepare(label, layers, last) for label, layers, last, _ in jobs]
        load = load_average()
        self.announce(shown)
        t0 = time.perf_counter()
        if len(prepared) == 1:  # in this thread, so that Ctrl-C kills the child at once
            errors = [run_child(*prepared[0][1:], self.run_timeout_s)]
        else:
            with ThreadPoolExecutor(max_workers=len(prepared)) as pool:
                errors = list(pool.map(lambda job: run_child(*job[1:], self.run_timeout_s),
                                       prepared))
        elapsed = time.perf_counter() - t0
        return [self.record_run(read_run(label, job[0], self.options(*layers, last=last),
                                         elapsed, error), load, title)
                for (label, layers, last, title), job, error in zip(jobs, prepared, errors)]

    def _run_options(self, run_dir: Path, layers: tuple, last: dict[str, Any] | None
                     ) -> dict[str, Any]:
        """The options a job's configuration file holds."""
        return merge(self.options(*layers, last=last), {"run_dir": str(run_dir),
                                                        "overwrite": True, "quiet": True})

    def _reused(self, label: str, layers: tuple, last: dict[str, Any] | None) -> Run | None:
        """``--reuse``: the finished run ``label`` of an earlier invocation into this
        results directory, if its written configuration, read with today's options and
        defaults, is the one this invocation would write, and the sync settings it ran with
        (its run directory's resolved ``config.toml``) are the ones today's per-method
        defaults give (a run of an earlier default, e.g. EDiT's outer optimizer before #35,
        is not reused); else None (it runs again). Which code ran it is not checked
        otherwise: reuse runs of the same code, or of code whose golden runs
        (``tests/test_golden.py``) are unchanged."""
        from dataclasses import asdict

        from editrain.config import to_dict

        run_dir = self.out_dir / "runs" / label
        config_path, resolved_path = run_dir.parent / f"{label}.toml", run_dir / "config.toml"
        if not ((run_dir / "summary.json").is_file() and config_path.is_file()):
            return None
        want = load_config(None, self._run_options(run_dir, layers, last))
        try:
            have = load_config(config_path)
            ran = load_config(resolved_path) if resolved_path.is_file() else None
        except ConfigError:
            return None
        if to_dict(have) != to_dict(want) or (
                ran is not None and asdict(ran.sync.resolve()) != asdict(want.sync.resolve())):
            return None
        run = read_run(label, run_dir, self.options(*layers, last=last))
        return run if run.ok else None

    def _prepare(self, label: str, layers: tuple, last: dict[str, Any] | None
                 ) -> tuple[Path, list[str], Path]:
        """Validate a job's options and write its configuration: ``(run directory, argv,
        log path)``."""
        from editrain.config import dumps_toml, to_dict

        run_dir = self.out_dir / "runs" / label
        if run_dir.exists():  # a stale run of an earlier invocation: start from nothing
            shutil.rmtree(run_dir)
        cfg = load_config(None, self._run_options(run_dir, layers, last))
        config_path = run_dir.parent / f"{label}.toml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(dumps_toml(to_dict(cfg)))
        return (run_dir, [sys.executable, "-m", "editrain", "train", "--config",
                          str(config_path)], run_dir.parent / f"{label}.log")

    def _run_number(self, index: int) -> str:
        """``run k/N`` (``run k`` when the scenario did not say how many runs it starts)."""
        return f"run {index}" + (f"/{self.planned_runs}" if self.planned_runs else "")

    def announce(self, title: str) -> None:
        """Log ``run k/N TITLE ...`` for the run about to start."""
        self.log(f"{self._run_number(len(self.runs) + 1)} {title} ...")

    def record_run(self, run: Run, load: float | None = None, title: str | None = None) -> Run:
        """Keep a finished run (also one started outside :meth:`train`) and log its result;
        ``load`` is the load average just before it started, ``title`` what the progress
        line calls it (default: its label)."""
        run.load_before = load
        self.runs[run.label] = run
        self._run_seconds.append(run.launch_s)
        index = len(self.runs)
        text = f"{self._run_number(index)} {title or run.label} ... "
        if run.ok:
            text += f"done in {run.launch_s:.0f} s, val {_val_text(run)}"
        else:
            text += f"FAILED after {run.launch_s:.0f} s: {run.error}"
        if self.planned_runs and index < self.planned_runs:
            left = (self.planned_runs - index) * sum(self._run_seconds) / len(self._run_seconds)
            text += (f" (about {left / 60:.0f} min left)" if left >= 120
                     else f" (about {left:.0f} s left)")
        self.log(text)
        return run

    # ------------------------------------------------------------------ output
    def finish(self, *, settings: dict[str, Any], methods: Sequence[str],
               results: dict[str, Any], tables: Sequence[tuple[str, str]],
               targets: Sequence[dict[str, Any]] = (), findings: Sequence[str] = (),
               notes: Sequence[str] = (), plots: Sequence[Path] = (),
               description: str = "", skipped: str | None = None,
               shortfalls: Sequence[str] = (), size_caveat: bool = True,
               errors: Sequence[str] = (), headline: Sequence[str] = (),
               repeats: int | None = None) -> dict[str, Any]:
        """Write ``results.json`` and ``table.md``; print the page; return the record (as
        written: JSON-safe; the report needs nothing else).

        The arguments are the record's fields: those that
        :class:`~editrain.bench.scenario.Scenario` (``description``, ``settings``,
        ``methods``, ``notes``, ``size_caveat``) and its
        :class:`~editrain.bench.scenario.Verdict` (``targets``, ``findings``,
        ``shortfalls``, ``headline``) describe, and:

        Args:
            results: the scenario's numbers.
            tables: ``(title, markdown table)`` pairs.
            targets: ``{"name", "met" (True/False/None), "detail"}`` checks.
            plots: PNG files written into the results directory.
            skipped: set when the scenario could not run at all (reason).
            errors: measurement errors (e.g. a fraction of a measured limit above 1): shown
                loudly at the top of the page and of the report, never as a result.
            repeats: interleaved repeats of the timed runs (None: not a timed scenario).
        """
        elapsed = time.perf_counter() - self._t0
        record: dict[str, Any] = {
            "format": FORMAT, "scenario": self.scenario, "mode": self.mode,
            "command": self.command, "argv": sys.argv, "machine": self.machine,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)),
            "elapsed_s": elapsed, "description": description, "settings": settings,
            "base_options": self.base, "user_overrides": self.user_overrides,
            "methods": list(methods), "repeats": repeats, "results": results,
            "tables": [{"title": t, "markdown": m} for t, m in tables],
            "measurement_errors": list(errors), "headline": list(headline),
            "targets": list(targets), "findings": list(findings),
            "shortfalls": list(shortfalls), "size_caveat": size_caveat, "notes": list(notes),
            "plots": [p.name for p in plots],
            "runs": {label: {"run_dir": str(r.run_dir), "ok": r.ok, "error": r.error,
                             "launch_s": r.launch_s, "load_before": r.load_before,
                             "summary": r.summary, **({"retried": r.retried} if r.retried else {})}
                     for label, r in self.runs.items()},
        }
        if self.reused:
            record["reused_runs"] = list(self.reused)
        loads = finite(r.load_before for r in self.runs.values())
        if loads:
            record["machine"]["load_during_runs"] = [min(loads), max(loads)]
        if skipped is not None:
            record["skipped"] = skipped
        end_load = load_average()
        if end_load is not None:
            record["machine"]["load_average_end"] = end_load
        record = clean_json(record)
        print(write_record(self.out_dir, record), flush=True)
        for error in errors:
            self.log(f"MEASUREMENT ERROR: {error}")
        self.log(f"wrote {self.out_dir / 'results.json'}, {self.out_dir / 'table.md'}"
                 + "".join(f", {self.out_dir / p.name}" for p in plots)
                 + f" ({elapsed:.0f} s)")
        return record


__all__ = ["Bench", "child_env", "repeat_label", "run_child"]
