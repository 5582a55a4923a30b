"""A scenario as a declaration, and the one runner that executes every declared scenario.

A scenario module declares ``SCENARIO = Scenario(...)``: how it sizes itself
(``setup``), its training runs (``runs``: a list of :class:`Job`, or, for runs that
depend on earlier ones, a generator that yields a job, or a list of jobs to run at the
same time, and is sent the finished run or runs, or :data:`WRITE`), what it measures
from them (``measure``), its tables (:class:`Table`), its plots, its verdict (targets,
findings, shortfalls, headline) and how it was measured (``notes``).
:func:`execute` does the rest the same way for every scenario: check every run's options
before the first starts, run the jobs (progress, time limits, ``--reuse``), derive the
numbers, render the tables, draw the plots and write the record (``Bench.finish``).

Every callable takes the scenario's :class:`Ctx`: the :class:`~editrain.bench.runner.Bench`
(``ctx.bench``), what ``setup`` put there, the finished runs by label (``ctx.runs``) and,
once measured, the numbers (``ctx.results``).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from editrain.bench.plots import pyplot, save_figure
from editrain.bench.tables import md_table, verdict_cell

WRITE = object()
"""Yielded by a generator of runs instead of a job: write the record of what has finished
so far (a long study cut short keeps its finished phases); it is sent the record."""


class Ctx(types.SimpleNamespace):
    """A scenario's state: ``bench``, ``runs`` (label -> run), ``results``, and whatever
    the scenario's ``setup`` returned (its sizes, option layers...)."""


@dataclass
class Job:
    """One training run: ``editrain train`` with the base options, then ``layers``, then
    the user's options, then ``last`` (see :meth:`~editrain.bench.runner.Bench.train`)."""

    label: str
    layers: Sequence[dict[str, Any] | None] = ()
    title: str | None = None
    last: dict[str, Any] | None = None
    start: Callable[[Any, Job], Any] | None = None
    """Runs the job instead of ``editrain train``: ``start(bench, job)`` returns what the
    scenario's measure reads, a run it recorded on the bench (``Bench.record_run``: a
    peer's workers) or the numbers of a measurement that is no training run (``bench
    data``'s builds)."""


@dataclass
class Table:
    """A Markdown table of the record: one row per item of ``rows(ctx)`` (default: the
    ``(name, entry)`` pairs of ``ctx.results``), one cell per column.

    Args:
        title: the table's title (or a function of the context giving it).
        columns: ``(header, cell)`` pairs; ``cell`` is a key of the row's entry (the
            second item of a ``(name, entry)`` row), ``None`` for the row's name, or a
            function of the row.
        rows: the rows (default: ``ctx.results.items()``).
    """

    title: str | Callable[[Ctx], str]
    columns: Sequence[tuple[str, str | Callable[[Any], Any] | None]]
    rows: Callable[[Ctx], Iterable[Any]] | None = None

    def render(self, ctx: Ctx) -> tuple[str, str]:
        """``(title, markdown)`` of the table in the context's numbers."""
        items = self.rows(ctx) if self.rows else ctx.results.items()
        body = [[self.cell(row, how) for _, how in self.columns] for row in items]
        title = self.title(ctx) if callable(self.title) else self.title
        return title, md_table([h for h, _ in self.columns], body)

    @staticmethod
    def cell(row: Any, how: str | Callable[[Any], Any] | None) -> Any:
        """One cell of a row, as ``columns`` says (the row's name, a key or a function)."""
        if how is None:
            return row[0]
        return row[1][how] if isinstance(how, str) else how(row)


def differences(lead: str, what: str, rows: Callable[[Ctx], Iterable[Any]]) -> Table:
    """The table of a scenario's comparisons (``stats.compare`` records) against the spread
    of the repeats, one row per ``(group, comparison)`` of ``rows``: the group (a link, a
    case...) under ``lead``, the pair ``a - b`` under ``what``, the difference of the
    medians and whether it is beyond the spread."""
    return Table("Differences against the spread of the repeats", [
        (lead, lambda row: row[0]), (what, lambda row: f"{row[1]['a']} - {row[1]['b']}"),
        ("value", "difference"),
        ("beyond spread", lambda row: verdict_cell(row[1]["beyond_spread"]))], rows=rows)


@dataclass
class Verdict:
    """What the numbers say: target checks, findings, shortfalls, summary sentences."""

    targets: list[dict[str, Any]] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    shortfalls: list[str] = field(default_factory=list)
    headline: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Scenario:
    """A benchmark scenario, declared (see the module's docstring).

    Args:
        name: the scenario's name (``editrain bench NAME``).
        description: one paragraph: what it measures.
        setup: sizes and option layers from the bench (its mode and flags): a dict whose
            items become attributes of the context.
        runs: the jobs, in order (a list, or a generator sent each finished run).
        measure: the numbers (``results`` of the record) from ``ctx.runs`` (it sets
            ``ctx.skipped`` to a reason when they allow no result at all).
        tables: the record's tables (a :class:`Table`, or a function of the context giving
            ``(title, markdown)``, or a list of them, for tables whose rows are not one per
            item).
        judge: targets, findings, shortfalls and headline from the numbers.
        notes: how the numbers were measured.
        settings: what was run, for the record.
        methods: the compared methods or variants, in table order.
        plots: functions drawing one PNG each into ``ctx.bench.out_dir`` (returning its
            path, or None when there is nothing to draw).
        checks: ``(layers, last)`` of the runs whose options are validated before the
            first run starts (default: every job of a list of jobs).
        planned: how many runs will start (default: the length of a list of jobs).
        repeats: whether the runs are timed and repeated (the record says how often).
        size_caveat: whether the quick and tiny sizes' numbers differ in kind from the full
            size's (the report then says so).
        unavailable: why the scenario cannot run here (e.g. an optional package is
            missing), or None; then nothing runs and the record says it was skipped.
        skipped_as: the record of a skip (``Bench.finish``'s arguments, from the reason);
            default: a one-row table with the reason.
    """

    name: str
    description: str
    setup: Callable[[Any], dict[str, Any]]
    runs: Callable[[Ctx], Any]
    measure: Callable[[Ctx], dict[str, Any]]
    tables: Sequence[Table | Callable[[Ctx], Any]] = ()
    judge: Callable[[Ctx], Verdict] = lambda ctx: Verdict()
    notes: Callable[[Ctx], list[str]] = lambda ctx: []
    settings: Callable[[Ctx], dict[str, Any]] = lambda ctx: {}
    methods: Callable[[Ctx], Sequence[str]] = lambda ctx: list(ctx.results)
    plots: Sequence[Callable[[Ctx], Any]] = ()
    checks: Callable[[Ctx], Iterable[tuple[Sequence[dict], dict | None]]] | None = None
    planned: Callable[[Ctx], int | None] = lambda ctx: None
    repeats: bool = False
    size_caveat: bool = True
    unavailable: Callable[[], str | None] = lambda: None
    skipped_as: Callable[[str], dict[str, Any]] | None = None


def execute(scenario: Scenario, bench: Any) -> dict[str, Any]:
    """Run a declared scenario on ``bench`` and write its record; returns the record."""
    ctx = Ctx(bench=bench, runs={}, results={})
    reason = scenario.unavailable()
    if reason is not None:
        bench.log(reason)
        record = scenario.skipped_as(reason) if scenario.skipped_as else dict(
            settings={}, methods=scenario.methods(ctx),
            results={"status": "skipped", "reason": reason},
            tables=[(scenario.name.capitalize(), md_table(["scenario", "status"],
                                                          [[scenario.name, reason]]))])
        return bench.finish(description=scenario.description, skipped=reason, **record)
    for key, value in scenario.setup(bench).items():
        setattr(ctx, key, value)
    jobs = scenario.runs(ctx)
    listed = isinstance(jobs, list | tuple)
    checks = scenario.checks(ctx) if scenario.checks else \
        [(j.layers, j.last) for j in jobs] if listed else []
    for layers, last in checks:
        bench.check(*layers, last=last)
    planned = len(jobs) if listed else scenario.planned(ctx)
    if planned:
        bench.plan(planned)
    if listed:
        for job in jobs:
            _train(bench, ctx, job)
    else:
        run = None
        try:
            while True:
                job = jobs.send(run)
                run = _record(scenario, ctx) if job is WRITE else _train(bench, ctx, job)
        except StopIteration:
            pass
        finally:  # a failed or interrupted run: the generator's own clean-up runs now
            jobs.close()
    return _record(scenario, ctx)


def _record(scenario: Scenario, ctx: Ctx) -> dict[str, Any]:
    """Measure what has finished, judge it and write the record (``Bench.finish``)."""
    bench = ctx.bench
    ctx.results = scenario.measure(ctx)
    if getattr(ctx, "skipped", None):  # the measure found nothing to report
        return bench.finish(settings={}, methods=[], results=ctx.results, tables=[],
                            description=scenario.description, skipped=ctx.skipped)
    verdict = scenario.judge(ctx)
    tables = []
    for table in scenario.tables:
        made = table.render(ctx) if isinstance(table, Table) else table(ctx)
        tables += made if isinstance(made, list) else [made]
    plots = [p for p in (draw(ctx) for draw in scenario.plots) if p is not None]
    return bench.finish(
        settings=scenario.settings(ctx), methods=scenario.methods(ctx), results=ctx.results,
        tables=tables, targets=verdict.targets, findings=verdict.findings,
        notes=scenario.notes(ctx), plots=plots, description=scenario.description,
        shortfalls=verdict.shortfalls, size_caveat=scenario.size_caveat,
        errors=verdict.errors, headline=verdict.headline,
        repeats=bench.repeats if scenario.repeats else None)


def _train(bench: Any, ctx: Ctx, job: Job | list[Job]) -> Any:
    """Run a job, or a list of jobs at the same time (``Bench.train_together``)."""
    if isinstance(job, list):
        runs = bench.train_together([(j.label, tuple(j.layers), j.last, j.title or j.label)
                                     for j in job])
        ctx.runs.update((r.label, r) for r in runs)
        return runs
    ctx.runs[job.label] = job.start(bench, job) if job.start else bench.train(
        job.label, *job.layers, title=job.title, last=job.last)
    return ctx.runs[job.label]


@contextmanager
def figure(ctx: Ctx, file: str, xlabel: str = "", ylabel: str = "",
           size: tuple[float, float] = (7, 4.5), grid: str | None = "both", **axes: Any):
    """One plot of a scenario: yields its axes, then labels them, draws the grid, saves
    the PNG into the results directory and puts its path in ``ctx.plot``.

    Args:
        ctx: the scenario's context.
        file: the PNG's name.
        xlabel: the x axis's label (none when empty).
        ylabel: the y axis's label (none when empty).
        size: the figure's size in inches.
        grid: the grid's axis (``both``, ``x``, ``y``), or None for no grid.
        axes: further ``Axes.set`` properties (``title``, ``ylim``...).
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
    yield ax
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if axes:
        ax.set(**axes)
    if grid:
        ax.grid(alpha=0.3, axis=grid)
    ctx.plot = save_figure(fig, ctx.bench.out_dir / file)


__all__ = ["WRITE", "Ctx", "Job", "Scenario", "Table", "Verdict", "differences", "execute",
           "figure"]
