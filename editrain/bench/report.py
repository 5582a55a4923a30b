"""``docs/benchmarks.md`` and the README headline, generated from ``results.json`` records.

``editrain bench report [--out RESULTS_ROOT] [--path PAGE] [--readme README.md]`` reads
``RESULTS_ROOT/<scenario>/results.json`` (default ``bench_results``; the committed results
are under ``docs/benchmarks``).

Every number on the page comes from a record: the summary, each scenario's tables (stored
in the record), targets, findings, shortfalls and notes. Nothing is typed by hand and
nothing refers to an earlier run; re-run a scenario and the report again to change a
number. Measurement errors a scenario flagged (e.g. a fraction of a measured limit above
1) are shown at the top of the page and of their section, never as results.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from editrain.bench import results
from editrain.bench.headline import is_stale, readme_headline, relative_link
from editrain.bench.machine import describe_machine
from editrain.bench.prose import fill, prose
from editrain.bench.tables import md_table
from editrain.config import ConfigError

TEXT = prose("report")
HEADLINE_START = "<!-- bench-headline -->"
HEADLINE_END = "<!-- /bench-headline -->"
"""The markers around the README's generated headline (table and plots)."""


def load_result(results_dir: str | Path) -> tuple[dict[str, Any], str]:
    """A scenario's ``results.json`` record and its ``table.md`` text ('' when absent)."""
    table = Path(results_dir) / results.TABLE_FILE
    return results.load_record(results_dir), table.read_text() if table.is_file() else ""


def _skipped(record: dict[str, Any]) -> str:
    return record["skipped"].removeprefix("skipped: ")


def shows(record: dict[str, Any]) -> list[str]:
    """What the scenario shows: its description, then one line per finding."""
    if record.get("skipped"):
        return [f"Nothing: the scenario was skipped ({_skipped(record)})."]
    return [record.get("description", "").strip(), ""] + [
        f"- {f}" for f in record.get("findings", [])]


def falls_short(record: dict[str, Any]) -> list[str]:
    """Unmet or unevaluated targets, stated shortfalls, measurement errors, failed runs."""
    out = [f"Measurement error (not a result): {e}." for e in
           record.get("measurement_errors", [])]
    for t in record.get("targets", []):
        if t.get("met") is False or t.get("met") is None:
            state = "not met" if t.get("met") is False else "not evaluated"
            out.append(f"Target {state}: {t['name']} ({t.get('detail', '')}).")
    out += record.get("shortfalls", [])
    out += [f"Run `{label}` failed: {r.get('error')}." for label, r in
            record.get("runs", {}).items() if not r.get("ok")]
    if record.get("mode") != "full" and record.get("size_caveat", True) \
            and not record.get("skipped"):
        out.append(fill(TEXT["size_caveat"], mode=record.get("mode")))
    return out


def in_short(record: dict[str, Any]) -> list[str]:
    """The scenario's lines in the page's summary: its headline sentences, or its targets."""
    if record.get("skipped"):
        return [f"skipped ({_skipped(record)})"]
    errors = [f"MEASUREMENT ERROR (not a result): {e}" for e in
              record.get("measurement_errors", [])]
    targets = [results.target_line(t) for t in record.get("targets", [])]
    return errors + (list(record.get("headline", [])) or targets)


def _summary_row(record: dict[str, Any]) -> list[Any]:
    """The scenario's row of the page's summary table."""
    targets = record.get("targets", [])
    met = sum(1 for t in targets if t.get("met") is True)
    verdict = ("skipped" if record.get("skipped") else
               ("measurement error" if record.get("measurement_errors") else
                (f"{met}/{len(targets)} met" if targets else "no target")))
    stale = "(old methodology, re-run pending) " if is_stale(record) else ""
    return [f"[{record['scenario']}](#{record['scenario']})", record.get("mode"), verdict,
            stale + ("<br>".join(in_short(record)) or "-"),
            f"{record.get('elapsed_s', 0):.0f} s"]


def _section(results_dir: Path, record: dict[str, Any], table_md: str,
             out_dir: Path) -> list[str]:
    """One scenario's section: command, machine, what it shows, shortfalls, its tables,
    how it was measured, plots."""
    repeats = (f", {record['repeats']} interleaved repeat(s) of every timed run"
               if record.get("repeats") else "")
    lines = [f"## {record['scenario']}", "", f"Command: `{record.get('command', '?')}`", "",
             f"Machine: {describe_machine(record.get('machine', {}))}; {record.get('mode')} "
             f"size, {record.get('elapsed_s', 0):.0f} s, started {record.get('started')}"
             f"{repeats}.", ""]
    lines += results.error_lines(record)
    if is_stale(record):
        lines += [f"**Old methodology:** {TEXT['stale']}", ""]
    lines += ["**What it shows.**", ""] + shows(record) + [""]
    lines += results.bullets("**Where editrain falls short.**", falls_short(record)
                             or ["Nothing measured here: every target was met."])
    tables = results.record_tables(record)
    if not tables and table_md:  # a format-1 record: its tables only exist in table.md
        tables = [("", "\n".join(x for x in table_md.splitlines() if x.startswith("|")))]
    lines += results.tables_lines(tables, "###")
    lines += results.bullets("### How it was measured", record.get("notes", []))
    for plot in record.get("plots", []):
        lines += [f"![{plot}]({relative_link(results_dir / plot, out_dir)})", ""]
    return lines


def write_benchmarks_md(results_dirs: Sequence[str | Path],
                        path: str | Path = "docs/benchmarks.md") -> Path:
    """Assemble the scenarios' results into one Markdown page.

    Args:
        results_dirs: results directories of scenarios (each with ``results.json``), in
            the order they should appear.
        path: the page to write.

    Returns:
        The written path.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    loaded = [(Path(d), *load_result(d)) for d in results_dirs]
    summary = md_table(["scenario", "size", "targets", "result", "elapsed"],
                       [_summary_row(record) for _, record, _ in loaded])
    lines = ["# Benchmarks", "",
             fill(TEXT["intro"], when=time.strftime("%Y-%m-%d %H:%M"), count=len(loaded),
                  plural="y" if len(loaded) == 1 else "ies"),
             "", "## In short", "", summary.rstrip(), ""]
    for d, record, table in loaded:
        lines += _section(d, record, table, out.parent)
    out.write_text("\n".join(lines).rstrip("\n") + "\n")
    return out


# ---------------------------------------------------------------------------- README
def scenario_dirs(root: str | Path, scenarios: Sequence[str]) -> list[Path]:
    """The results directories under ``root`` that hold a ``results.json``: each scenario's
    own (``root/<scenario>``), then its extra runs (``root/<scenario>-<label>``, e.g. a
    quick convergence run of more variants beside the full one), in scenario order.

    Args:
        root: the results root (``docs/benchmarks`` for the committed results).
        scenarios: the scenario names, in order (``editrain.bench.SCENARIOS``).
    """
    base = Path(root)
    return [d for s in scenarios for d in [base / s, *sorted(base.glob(f"{s}-*"))]
            if (d / results.RESULTS_FILE).is_file()]


def replace_headline(text: str, headline: str, name: str = "README.md") -> str:
    """``text`` with the part between the headline markers replaced by ``headline``.

    Args:
        text: the README's text.
        headline: the new headline (Markdown, written as it is).
        name: the file's name, for the error message.

    Raises:
        ConfigError: the markers are missing, out of order or repeated.
    """
    start, end = text.count(HEADLINE_START), text.count(HEADLINE_END)
    if start != 1 or end != 1 or text.index(HEADLINE_START) > text.index(HEADLINE_END):
        raise ConfigError(fill(TEXT["markers"], name=name, start_marker=HEADLINE_START,
                               end_marker=HEADLINE_END, start=start, end=end))
    head, rest = text.split(HEADLINE_START, 1)
    tail = rest.split(HEADLINE_END, 1)[1]
    return f"{head}{HEADLINE_START}\n{headline.strip(chr(10))}\n{HEADLINE_END}{tail}"


def write_readme_headline(readme: str | Path, results_dirs: Sequence[str | Path]) -> str:
    """Regenerate the headline between the markers of a README from results directories.

    Args:
        readme: the README file.
        results_dirs: scenario results directories (each with ``results.json``).

    Returns:
        The headline written (links relative to the README's directory).

    Raises:
        ConfigError: the README has no markers, or no record yields a headline.
        FileNotFoundError: the README does not exist.
    """
    path = Path(readme)
    text = check_readme(path)
    headline = readme_headline([(Path(d), results.load_record(d)) for d in results_dirs],
                               base=path.parent)
    path.write_text(replace_headline(text, headline, path.name))
    return headline


def check_readme(readme: str | Path) -> str:
    """A README's text, after checking that it has the headline markers.

    Args:
        readme: the README file.

    Raises:
        ConfigError: no markers (or not exactly one pair, in order).
        FileNotFoundError: the README does not exist.
    """
    path = Path(readme)
    text = path.read_text()
    replace_headline(text, "", path.name)
    return text


__all__ = ["HEADLINE_END", "HEADLINE_START", "check_readme", "falls_short", "in_short",
           "load_result", "readme_headline", "replace_headline", "scenario_dirs", "shows",
           "write_benchmarks_md", "write_readme_headline"]
