"""A scenario's record: ``results.json`` (every number) and ``table.md`` (its page)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from editrain.bench.machine import describe_machine
from editrain.metrics import to_json
from editrain.paths import shown
from editrain.safe_io import Bool, Int, List, Map, Num, Obj, Str, quote, read_json

RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"
FORMAT = 2
"""Version of the record layout: 2 stores the tables, repeats and measurement errors."""

RECORD_MAX_BYTES = 64 << 20
"""The largest ``results.json`` read back (the committed ones are a few hundred KB)."""


_TEXT = Str(max_len=1 << 20)
"""A sentence or a Markdown block of a record (a table of many rows is tens of KB)."""
_TEXTS = List(_TEXT)
RESULTS_SCHEMA = Obj({
    "format": Int(lo=1, hi=1 << 20), "scenario": Str(max_len=200), "mode": Str(max_len=200),
    "command": _TEXT, "description": _TEXT, "started": Str(nullable=True),
    "elapsed_s": Num(), "repeats": Int(nullable=True), "skipped": Str(max_len=1 << 16),
    "size_caveat": Bool(),
    "tables": List(Obj({"title": _TEXT, "markdown": _TEXT})),
    "targets": List(Obj({"name": _TEXT, "met": Bool(nullable=True),
                         "detail": Str(max_len=1 << 20, nullable=True)}, required=("name",))),
    "measurement_errors": _TEXTS, "headline": _TEXTS, "findings": _TEXTS,
    "shortfalls": _TEXTS, "notes": _TEXTS, "plots": List(Str(max_len=1024)),
    "runs": Map(Obj({"ok": Bool(), "error": Str(max_len=1 << 20, nullable=True),
                     "retried": _TEXTS})),
    "machine": Obj({"usable_cpus": Int(nullable=True), "cpu_count": Int(nullable=True),
                    "cuda": Bool(), "git_commit": Str(nullable=True),
                    "load_average": List(Num(), nullable=True),
                    "load_during_runs": List(Num(), length=2)}),
    "settings": Obj({"rate": Str(max_len=64), "sync_interval": Int(nullable=True)}),
    "results": Obj(),
}, required=("scenario", "mode"))
"""The fields of ``results.json`` that the page, the report and the README's headline
read, as :meth:`editrain.bench.runner.Bench.finish` writes them (``null`` where it writes
one; other fields, and a scenario's own ``results``, are not looked at here). A record is
a file anyone can edit or hand over: a format of ``"2"`` was made current by ``int()``, a
string ``elapsed_s`` or a bool ``skipped`` failed deep in the page's formatting; each is
refused when read, in one line naming the file and the field."""


def target_word(met: bool | None) -> str:
    """``yes`` / ``no`` / ``not evaluated``."""
    return "not evaluated" if met is None else ("yes" if met else "no")


def target_line(target: dict[str, Any], mark: str = "") -> str:
    """``name: yes (detail)``, the word between ``mark``s (``**`` for bold)."""
    detail = f" ({target['detail']})" if target.get("detail") else ""
    return f"{target['name']}: {mark}{target_word(target.get('met'))}{mark}{detail}"


def clean_json(v: Any) -> Any:
    """JSON-safe copy: non-finite floats become null, paths and tuples plain values, keys
    strings."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): clean_json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [clean_json(x) for x in v]
    return str(v) if isinstance(v, Path) else v


STATISTICS = ("median", "mean", "min", "max", "std")
"""The fields of a statistic in a scenario's ``results`` (``stats.spread``, ``mean_std``):
a number or null wherever they stand, with ``n`` (how many values) a count."""


def _check_statistics(value: Any, where: str, path: str) -> None:
    """Refuse a statistic of a record's ``results`` that is no number (see
    :data:`STATISTICS`): the schema leaves a scenario's own results open, and the page
    and the headline multiply and compare them (a list for a median failed there with a
    TypeError)."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_statistics(item, where, f"{path}[{i}]")
        return
    if not isinstance(value, dict):
        return
    for key, item in value.items():
        field = f"{path}.{key}"
        if key in STATISTICS and item is not None and (
                isinstance(item, bool) or not isinstance(item, int | float)
                or not math.isfinite(item)):
            raise ValueError(f"{where}: field {field!r}: a finite number or null is expected "
                             f"(found {quote(item)})")
        if key == "n" and item is not None and (isinstance(item, bool) or
                                                not isinstance(item, int) or item < 0):
            raise ValueError(f"{where}: field {field!r}: a count of values is expected "
                             f"(found {quote(item)})")
        _check_statistics(item, where, field)


def load_record(results_dir: str | Path) -> dict[str, Any]:
    """A scenario's ``results.json`` record.

    Args:
        results_dir: the scenario's results directory.

    Raises:
        ValueError: the file is missing, a link, larger than :data:`RECORD_MAX_BYTES`, not
            JSON, not an object of :data:`RESULTS_SCHEMA`, or a statistic of its
            ``results`` no number (one line naming it and the field).
    """
    path = Path(results_dir) / RESULTS_FILE
    record = read_json(path, max_bytes=RECORD_MAX_BYTES, schema=RESULTS_SCHEMA,
                       error=ValueError, what="benchmark results")
    _check_statistics(record.get("results"), shown(path), "results")
    return record


def record_tables(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The ``(title, markdown)`` tables stored in a record (none in format-1 records)."""
    return [(t.get("title", ""), t.get("markdown", "")) for t in record.get("tables", [])]


def error_lines(record: dict[str, Any]) -> list[str]:
    """The record's measurement errors, each a loud paragraph (never shown as a result)."""
    return [x for e in record.get("measurement_errors", [])
            for x in (f"**MEASUREMENT ERROR (not a result):** {e}", "")]


def tables_lines(tables: list[tuple[str, str]], heading: str) -> list[str]:
    """``(title, markdown)`` tables as page lines, each title a ``heading`` (``##``...)."""
    lines: list[str] = []
    for title, table in tables:
        lines += ([f"{heading} {title}", ""] if title else []) + [table.rstrip("\n"), ""]
    return lines


def bullets(heading: str, items: list[str]) -> list[str]:
    """A ``heading`` line and a bullet per item, or nothing without items."""
    return [heading, ""] + [f"- {x}" for x in items] + [""] if items else []


def render_page(record: dict[str, Any]) -> str:
    """The ``table.md`` page of a scenario, from its record alone.

    Args:
        record: the scenario's record (as written to ``results.json``).
    """
    runs = record.get("runs", {}).items()
    lines = [f"# Benchmark: {record['scenario']} ({record['mode']})", ""]
    if record.get("description"):
        lines += [record["description"], ""]
    machine = record.get("machine", {})
    loads = machine.get("load_during_runs")
    lines += [f"Command: `{record.get('command', '?')}`", "",
              f"Machine: {describe_machine(machine)}", "",
              f"Elapsed: {record.get('elapsed_s', 0):.0f} s, started {record.get('started')}."]
    if loads:
        busy = loads[1] > 0.5 * (machine.get("usable_cpus") or 1)
        lines[-1] += (f" Load average (1 min) before each run: {loads[0]:.1f} to "
                      f"{loads[1]:.1f} on {machine.get('usable_cpus')} CPUs"
                      + ("; timings are only comparable on a quiet machine." if busy else "."))
    if record.get("repeats"):
        lines[-1] += (f" Timed runs repeated {record['repeats']} time(s), interleaved; "
                      "tables give the median and [min-max].")
    lines += [""] + error_lines(record)
    if record.get("user_overrides"):
        lines += ["Options given on the command line (applied to every run, over the "
                  f"scenario's own): `{json.dumps(record['user_overrides'])}`", ""]
    if record.get("skipped"):
        lines += [f"**Skipped:** {record['skipped']}", ""]
    lines += tables_lines(record_tables(record), "##")
    lines += bullets("## Targets", [target_line(t, "**") for t in record.get("targets", [])])
    lines += bullets("## Findings", record.get("findings", []))
    lines += bullets("## Shortfalls", record.get("shortfalls", []))
    lines += bullets("## How it was measured", record.get("notes", []))
    if record.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in record["plots"]] + [""]
    lines += bullets("## Failed runs", [f"`{label}`: {r.get('error')}" for label, r in runs
                                        if not r.get("ok")])
    lines += bullets("## Runs run again", [f"`{label}`: {error}" for label, r in runs
                                           for error in r.get("retried", [])])
    return "\n".join(lines)


def write_record(out_dir: Path, record: dict[str, Any]) -> str:
    """Write ``results.json`` and ``table.md`` into ``out_dir``.

    Args:
        out_dir: the results directory.
        record: the record (made JSON-safe here).

    Returns:
        The page written to ``table.md``.
    """
    record = clean_json(record)
    (out_dir / RESULTS_FILE).write_text(to_json(record, indent=1) + "\n")
    page = render_page(record)
    (out_dir / TABLE_FILE).write_text(page)
    return page


__all__ = ["FORMAT", "RESULTS_FILE", "RESULTS_SCHEMA", "TABLE_FILE", "bullets", "clean_json", "error_lines",
           "load_record", "record_tables", "render_page", "tables_lines", "target_line",
           "target_word", "write_record"]
