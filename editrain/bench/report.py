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

import os
import re
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from editrain.bench.machine import describe_machine
from editrain.bench.results import TABLE_FILE, load_record, record_tables, target_word
from editrain.bench.tables import md_table, spread_cell
from editrain.config import ConfigError

HEADLINE_START = "<!-- bench-headline -->"
HEADLINE_END = "<!-- /bench-headline -->"
"""The markers around the README's generated headline sentence."""

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)]+)\)")


def load_result(results_dir: str | Path) -> tuple[dict[str, Any], str]:
    """A scenario's ``results.json`` record and its ``table.md`` text ('' when absent).

    Args:
        results_dir: the scenario's results directory.
    """
    d = Path(results_dir)
    table = (d / TABLE_FILE).read_text() if (d / TABLE_FILE).is_file() else ""
    return load_record(d), table


def _relative(target: Path, start: Path) -> str:
    """The path of ``target`` relative to ``start``, with forward slashes."""
    try:
        return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return target.resolve().as_posix()


def shows(record: dict[str, Any]) -> list[str]:
    """What the scenario shows: its description, then one line per finding."""
    if record.get("skipped"):
        reason = record["skipped"].removeprefix("skipped: ")
        return [f"Nothing: the scenario was skipped ({reason})."]
    lines = [record.get("description", "").strip(), ""]
    lines += [f"- {f}" for f in record.get("findings", [])]
    return lines


def falls_short(record: dict[str, Any]) -> list[str]:
    """Unmet or unevaluated targets, stated shortfalls, measurement errors, failed runs."""
    out = [f"Measurement error (not a result): {e}." for e in
           record.get("measurement_errors", [])]
    for t in record.get("targets", []):
        if t.get("met") is False:
            out.append(f"Target not met: {t['name']} ({t.get('detail', '')}).")
        elif t.get("met") is None:
            out.append(f"Target not evaluated: {t['name']} ({t.get('detail', '')}).")
    out += record.get("shortfalls", [])
    for label, r in record.get("runs", {}).items():
        if not r.get("ok"):
            out.append(f"Run `{label}` failed: {r.get('error')}.")
    if record.get("mode") != "full" and record.get("size_caveat", True) \
            and not record.get("skipped"):
        out.append(f"These are {record.get('mode')}-size numbers (tiny model, little data, "
                   "short runs); the full size is the reference.")
    return out


def in_short(record: dict[str, Any]) -> list[str]:
    """The scenario's lines in the page's summary: its headline sentences, or its targets."""
    if record.get("skipped"):
        return [f"skipped ({record['skipped'].removeprefix('skipped: ')})"]
    lines = [f"MEASUREMENT ERROR (not a result): {e}" for e in
             record.get("measurement_errors", [])]
    lines += list(record.get("headline", []))
    if not record.get("headline"):
        lines += [f"{t['name']}: {target_word(t.get('met'))}"
                  + (f" ({t['detail']})" if t.get("detail") else "")
                  for t in record.get("targets", [])]
    return lines


def _section(results_dir: Path, record: dict[str, Any], table_md: str,
             out_dir: Path) -> list[str]:
    """One scenario's section: command, machine, what it shows, shortfalls, its tables,
    how it was measured, plots."""
    lines = [f"## {record['scenario']}", "",
             f"Command: `{record.get('command', '?')}`", "",
             f"Machine: {describe_machine(record.get('machine', {}))}; {record.get('mode')} "
             f"size, {record.get('elapsed_s', 0):.0f} s, started {record.get('started')}"
             + (f", {record['repeats']} interleaved repeat(s) of every timed run"
                if record.get("repeats") else "") + ".", ""]
    for error in record.get("measurement_errors", []):
        lines += [f"**MEASUREMENT ERROR (not a result):** {error}", ""]
    if _stale(record):
        lines += [f"**Old methodology:** {STALE_NOTE}", ""]
    lines += ["**What it shows.**", ""] + shows(record) + [""]
    short = falls_short(record)
    lines += ["**Where editrain falls short.**", ""]
    lines += [f"- {s}" for s in short] if short else \
        ["- Nothing measured here: every target was met."]
    lines.append("")
    tables = record_tables(record)
    if not tables and table_md:  # a format-1 record: its tables only exist in table.md
        tables = [("", _strip_page(table_md))]
    for title, table in tables:
        if title:
            lines += [f"### {title}", ""]
        lines += [table.rstrip("\n"), ""]
    if record.get("notes"):
        lines += ["### How it was measured", ""] + [f"- {n}" for n in record["notes"]] + [""]
    for plot in record.get("plots", []):
        lines += [f"![{plot}]({_relative(results_dir / plot, out_dir)})", ""]
    return lines


STALE_NOTE = (
    "this result predates results format 2: its validation losses were measured on the "
    "first 4,096 tokens of a leaky validation split, limits were computed rather than "
    "measured and runs were not repeated. Kept for reference until the scenario is re-run "
    "with its command.")
"""What the report says of a record in the old (format 1) methodology."""


def _stale(record: dict[str, Any]) -> bool:
    """Whether ``record`` was measured with the old methodology (results format 1)."""
    return int(record.get("format", 1)) < 2


def _strip_page(table_md: str) -> str:
    """The tables of an old ``table.md`` page (its Markdown tables only)."""
    return "\n".join(line for line in table_md.splitlines() if line.startswith("|"))


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
    summary_rows = []
    for _d, record, _ in loaded:
        targets = record.get("targets", [])
        met = sum(1 for t in targets if t.get("met") is True)
        summary_rows.append([
            f"[{record['scenario']}](#{record['scenario']})", record.get("mode"),
            "skipped" if record.get("skipped") else
            ("measurement error" if record.get("measurement_errors") else
             (f"{met}/{len(targets)} met" if targets else "no target")),
            ("(old methodology, re-run pending) " if _stale(record) else "")
            + ("<br>".join(in_short(record)) or "-"),
            f"{record.get('elapsed_s', 0):.0f} s",
        ])
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `editrain bench report` on {time.strftime('%Y-%m-%d %H:%M')} from "
        f"{len(loaded)} results director{'y' if len(loaded) == 1 else 'ies'}; every number "
        "below comes from their `results.json`. Each section gives the command that "
        "produced it, the machine, what the numbers show, where editrain falls short, the "
        "scenario's tables and how they were measured (the raw numbers and every run's "
        "metrics are in the results directory: `results.json` and `runs/`). Re-run a "
        "scenario with its command, then `editrain bench report`.",
        "",
        "## In short",
        "",
        md_table(["scenario", "size", "targets", "result", "elapsed"], summary_rows).rstrip(),
        "",
    ]
    for d, record, table in loaded:
        lines += _section(d, record, table, out.parent)
    out.write_text("\n".join(lines).rstrip("\n") + "\n")
    return out


# ---------------------------------------------------------------------------- README
COMPARABLE = ("edit", "edit-sparse", "edit-sparse-eager", "diloco", "sync")
"""Variants with the same sync options in ``bench bandwidth`` and ``bench convergence``
(``edit-streaming`` differs: 4 fragments and 4 steps in flight there, 3 fragments and H/8
steps here), each with its own ``H``: ``overlap_steps`` is ``H - 1`` for ``edit-sparse`` and
``H`` for ``edit-sparse-eager`` in both."""


def slow_link_choice(records: Sequence[dict[str, Any]], link: str = "0.25MB/s+50ms"
                     ) -> str | None:
    """The setting to recommend on a slow link: the lowest product of final validation loss
    (``bench convergence``, equal tokens, the largest size that has the sparse variants)
    and time per token on ``link`` relative to an unlimited one (``bench bandwidth``, the
    latest record measuring the sparse variants there), over :data:`COMPARABLE`. None
    without both records."""
    bws = [r for r in records if r.get("scenario") == "bandwidth"
           and all(link in (r.get("results", {}).get(v) or {})
                   for v in ("edit-sparse", "edit-sparse-eager"))]
    convs = [r for r in records if r.get("scenario") == "convergence"
             and all(v in r.get("results", {}) for v in ("edit-sparse", "edit-sparse-eager"))]
    if not bws or not convs:
        return None
    size = {"tiny": 0, "quick": 1, "full": 2}
    bw = max(bws, key=lambda r: str(r.get("started", "")))
    conv = max(convs, key=lambda r: (size.get(r.get("mode"), 0), str(r.get("started", ""))))
    rows = []
    for v in COMPARABLE:
        speed = ((bw["results"].get(v) or {}).get(link) or {}).get("vs_unlimited") or {}
        loss = ((conv["results"].get(v) or {}).get("final_val_loss") or {}).get("mean")
        if speed.get("median") and loss is not None:
            rows.append((loss / speed["median"], v, speed, loss))
    if len(rows) < 2:
        return None
    rows.sort()
    st = conv.get("settings", {})
    where = link.replace("+", " + ").replace("MB/s", " MB/s").replace("ms", " ms")
    return (f"on a {where} link the lowest loss x time (final validation loss after "
            f"{st.get('steps')} steps, {st.get('seeds')} seeds, times the time per token "
            f"relative to an unlimited link at H = {bw.get('settings', {}).get('sync_interval')})"
            f" is {rows[0][1]}'s: {spread_cell(rows[0][2])}x the speed, loss "
            f"{rows[0][3]:.3f}; then " + ", ".join(
                f"{v} {spread_cell(sp)}x, {loss:.3f}" for _, v, sp, loss in rows[1:]))


def readme_headline(records: Sequence[dict[str, Any]]) -> str:
    """The README's headline sentence, from the scenarios' records.

    Uses the ``default`` record (the validation loss of the default ``editrain train``
    run over the whole held-out split), the ``convergence`` record (EDiT against DiLoCo
    and synchronous training, paired by seed), the ``spikes`` record (peak validation-loss
    increase of DiLoCo and EDiT with a corrupted replica), the ``stragglers`` record
    (non-blocking and blocking A-EDiT's and synchronous training's fraction of the
    measured limit with a 2x straggler; left out when that case has a measurement error or
    the record predates measured limits), the ``bandwidth`` record (streaming EDiT's and
    synchronous training's throughput at 5 MB/s against an unlimited link) and the
    ``peers`` record (whether editrain's DiLoCo reproduces torchft's, and at what speed).

    Args:
        records: the loaded ``results.json`` records.

    Returns:
        The sentence.

    Raises:
        ConfigError: no record yields a clause.
    """
    # Only results measured with the current methodology make the headline.
    # One record per scenario: the largest size wins (e.g. a quick convergence run of extra
    # variants beside the full one).
    size = {"tiny": 0, "quick": 1, "full": 2}
    fresh = sorted((r for r in records if not _stale(r)), key=lambda r: size.get(r.get("mode"), 0))
    by_name = {r.get("scenario"): r for r in fresh}
    clauses = []
    default = by_name.get("default")
    if default and not default.get("skipped"):
        clauses += list(default.get("headline", []))
    spikes = by_name.get("spikes")
    if spikes and not spikes.get("skipped"):
        res, st = spikes.get("results", {}), spikes.get("settings", {})
        d = res.get("diloco", {}).get("peak_increase")
        e = res.get("edit", {}).get("peak_increase")
        if d is not None and e is not None:
            clauses.append(f"with one replica's pseudo-gradient corrupted "
                           f"x{st.get('scale', 0):g} at {len(st.get('corrupt_syncs', []))} "
                           f"syncs, DiLoCo's validation loss jumps by {d:.3g} while EDiT's "
                           f"moves by {e:.2g}")
    strag = by_name.get("stragglers")
    case = (strag or {}).get("results", {}).get("straggler")
    if strag and strag.get("format", 1) >= 2 and case:
        if case.get("errors"):
            clauses.append("the 2x-straggler throughput measurement was flagged as a "
                           "measurement error (see `docs/benchmarks.md`), so no figure is "
                           "given for it")
        else:
            a = case["aedit"]["fraction_of_limit"]
            s = case["sync"]["fraction_of_limit"]
            nb = (case.get("aedit-nb") or {}).get("fraction_of_limit") or {}
            if a.get("median") is not None and s.get("median") is not None:
                n = strag.get("repeats") or 1
                lead = (f"non-blocking A-EDiT reaches {spread_cell(nb)}x the measured sum "
                        f"of the replicas' solo speeds, blocking A-EDiT {spread_cell(a)}x"
                        if nb.get("median") is not None else
                        f"A-EDiT reaches {spread_cell(a)}x the measured sum of the "
                        "replicas' solo speeds")
                clauses.append(f"with a 2x straggler {lead}, synchronous training "
                               f"{spread_cell(s)}x "
                               + (f"(median [min-max] of {n} repeats)" if n > 1
                                  else "(one run each)"))
    bw = by_name.get("bandwidth")
    bw_res = (bw or {}).get("results", {})
    link = "5MB/s+5ms"
    stream = (bw_res.get("edit-streaming") or {}).get(link) or {}
    sync_bw = (bw_res.get("sync") or {}).get(link) or {}
    if bw and (stream.get("vs_unlimited") or {}).get("median") is not None and \
            (sync_bw.get("vs_unlimited") or {}).get("median") is not None:
        exposed = (stream.get("exposed") or {}).get("median")
        clauses.append(
            f"on a simulated 5 MB/s + 5 ms link between 2 replicas (H = "
            f"{bw.get('settings', {}).get('sync_interval')}) streaming EDiT keeps "
            f"{spread_cell(stream['vs_unlimited'])}x of its unlimited-link throughput, "
            f"synchronous training {spread_cell(sync_bw['vs_unlimited'])}x"
            + (f", with {exposed:.0%} of its communication time exposed" if exposed is not None
               else ""))
    # Every record with the sparse setting on the slow links: the runs disagree more than
    # their repeats' spread (the machine's speed drifts between runs), so each is shown.
    slow = [r for r in fresh if r.get("scenario") == "bandwidth"
            and "0.25MB/s+50ms" in (r.get("results", {}).get("edit-sparse") or {})]
    if slow:
        parts = []
        for n in ("1MB/s+50ms", "0.25MB/s+50ms"):
            kept = [((r["results"]["edit-sparse"].get(n) or {}).get("vs_unlimited") or {})
                    for r in slow]
            kept = [k for k in kept if k.get("median") is not None]
            if kept:
                parts.append(" / ".join(spread_cell(k) for k in kept) + "x at "
                             + n.replace("+", " + ").replace("MB/s", " MB/s").replace(
                                 "ms", " ms") + (f" ({len(kept)} runs)" if len(kept) > 1
                                                else ""))
        if parts:
            clauses.append(
                "with sparse 2-bit pseudo-gradients (1/128 of fp32) and the round in flight "
                "for H - 1 steps, EDiT keeps " + " and ".join(parts)
                + " of its unlimited-link throughput")
    eager = next((r for r in reversed(fresh) if r.get("scenario") == "bandwidth"
                  and "0.25MB/s+50ms" in (r.get("results", {}).get("edit-sparse-eager") or {})),
                 None)
    if eager:
        kept = [(n, (eager["results"]["edit-sparse-eager"].get(n, {}).get("vs_unlimited")
                     or {})) for n in ("1MB/s+50ms", "0.25MB/s+50ms")]
        kept = [(n, k) for n, k in kept if k.get("median") is not None]
        if kept:
            clauses.append(
                "with the whole round in flight and the eager merge (sparse 2-bit) it keeps "
                + " and ".join(f"{spread_cell(k)}x at " + n.replace("+", " + ").replace(
                    "MB/s", " MB/s").replace("ms", " ms") for n, k in kept))
    choice = slow_link_choice(fresh)
    if choice:
        clauses.append(choice)
    real = next((r for r in reversed(fresh) if r.get("scenario") == "real_link"), None)
    if real and real.get("headline"):
        clauses += list(real["headline"])
    # EDiT against DiLoCo and sync: the largest record that ran all three (a record of
    # extra variants, e.g. the streaming ones, may be as large and lack sync).
    conv = next((r for r in reversed(fresh) if r.get("scenario") == "convergence"
                 and {"edit", "diloco", "sync"} <= set(r.get("results", {}))), None)
    res = (conv or {}).get("results", {})
    vs_d = res.get("edit", {}).get("paired_vs_diloco") or {}
    vs_s = res.get("edit", {}).get("paired_vs_sync") or {}
    if conv and vs_d.get("mean") is not None and vs_s.get("mean") is not None:
        st = conv.get("settings", {})
        clauses.append(
            f"after {st.get('steps')} steps ({st.get('seeds')} seeds, paired by seed) EDiT's "
            f"validation loss is {vs_d['mean']:+.3f} +- {vs_d.get('std') or 0:.3f} against "
            f"DiLoCo's but {vs_s['mean']:+.3f} +- {vs_s.get('std') or 0:.3f} against "
            "synchronous training's")
    # EDiT with bench tune's recipe at the convergence size (the largest such record).
    recipe_conv = next((r for r in reversed(fresh) if r.get("scenario") == "convergence"
                        and {"edit-recipe", "sync"} <= set(r.get("results", {}))), None)
    if recipe_conv:
        rr = recipe_conv["results"]
        vs_s = rr["edit-recipe"].get("paired_vs_sync") or {}
        vs_d = rr["edit-recipe"].get("paired_vs_diloco") or {}
        sync_loss = (rr["sync"].get("final_val_loss") or {}).get("mean")
        if vs_s.get("mean") is not None and sync_loss:
            st = recipe_conv.get("settings", {})
            clauses.append(
                f"with bench tune's recipe (synchronous warm-up for a quarter of the run, "
                f"H = 20, outer SGD at lr 1 without momentum) EDiT's validation loss after "
                f"{st.get('steps')} steps ({st.get('seeds')} seeds, paired) is "
                f"{vs_s['mean']:+.3f} +- {vs_s.get('std') or 0:.3f} "
                f"({100 * vs_s['mean'] / sync_loss:+.1f}%) against synchronous training's"
                + (f" and {vs_d['mean']:+.3f} +- {vs_d.get('std') or 0:.3f} against DiLoCo's"
                   if vs_d.get("mean") is not None else ""))
            h10 = (rr.get("edit-recipe-h10") or {}).get("paired_vs_sync") or {}
            if h10.get("mean") is not None:
                clauses[-1] += (f" (with H = 10 {h10['mean']:+.3f} +- {h10.get('std') or 0:.3f},"
                                f" {100 * h10['mean'] / sync_loss:+.1f}%)")
    # The latest quick record with the most streaming variants (eager ones first).
    streaming = next((r for r in reversed(fresh) if r.get("scenario") == "convergence"
                      and "edit-eager" in r.get("results", {})), None) or next(
        (r for r in reversed(fresh) if r.get("scenario") == "convergence"
         and "edit-streaming" in r.get("results", {})), None)
    if streaming:
        st = streaming.get("settings", {})
        vs_e = streaming["results"]["edit-streaming"].get("paired_vs_edit") or {}
        if vs_e.get("mean") is not None:
            clause = (f"streaming EDiT's validation loss after {st.get('steps')} steps "
                      f"({st.get('seeds')} seeds) is {vs_e['mean']:+.3f} +- "
                      f"{vs_e.get('std') or 0:.3f} against EDiT's")
            for variant, what in (("edit-sparse", "sparse EDiT's"),
                                  ("edit-eager", "eager EDiT's (a whole round in flight; "
                                                 "outer SGD without momentum, its default)"),
                                  ("edit-sparse-eager", "sparse eager EDiT's")):
                sp_e = (streaming["results"].get(variant) or {}).get("paired_vs_edit") or {}
                if sp_e.get("mean") is not None:
                    clause += f", {what} {sp_e['mean']:+.3f} +- {sp_e.get('std') or 0:.3f}"
            clauses.append(clause)
    tune = by_name.get("tune")
    rows = {(r.get("factor"), r.get("level")): r
            for r in ((tune or {}).get("results") or {}).get("rows", [])}
    base = rows.get(("base", ""))
    recipe = next(((lv, r) for (f, lv), r in rows.items() if f == "recipe"), None)
    if base and recipe and None not in (base.get("relative_gap"),
                                        recipe[1].get("relative_gap")):
        longer = [(lv, r["relative_gap"]) for (f, lv), r in rows.items()
                  if f == "recipe, tokens" and r.get("relative_gap") is not None]
        st = tune.get("settings", {})
        clauses.append(
            f"a tuning study ({st.get('steps')} steps, {st.get('seeds')} seeds, paired) "
            f"takes EDiT's gap to synchronous training's validation loss from "
            f"{100 * base['relative_gap']:+.1f}% with Nesterov outer SGD (lr 0.7, momentum "
            f"0.9; EDiT's default before the study) to "
            f"{100 * recipe[1]['relative_gap']:+.1f}% with a recipe ({recipe[0]})"
            + ("; with " + ", ".join(f"{lv}" for lv, _ in longer) + " the tokens it is "
               + ", ".join(f"{100 * g:+.1f}%" for _, g in longer) if longer else ""))
    scale = by_name.get("scale")
    sized = [r for r in ((scale or {}).get("results") or {}).get("shapes", [])
             if r.get("relative_gap") is not None]
    if len(sized) >= 2:
        st = scale.get("settings", {})
        clauses.append(
            f"by model size ({st.get('steps')} steps, {st.get('seeds')} seeds, paired) the "
            "recipe's gap to synchronous training is "
            + ", ".join(f"{100 * r['relative_gap']:+.1f}% at {r['params'] / 1e6:.1f}M "
                        f"parameters ({r['shape']})" for r in sized))
    peers = by_name.get("peers")
    if peers and not peers.get("skipped"):
        target = next(iter(peers.get("targets", [])), None)
        if target and target.get("met"):
            clause = ("editrain's DiLoCo ends at torchft DiLoCo's validation loss on the same "
                      f"model and data ({target.get('detail')})")
            # Every peers record of that size (e.g. one per H), in H order, largest first.
            same = [r for r in fresh if r.get("scenario") == "peers" and not r.get("skipped")
                    and r.get("mode") == peers.get("mode")]
            ratios = []
            for r in sorted(same, key=lambda r: -(r.get("settings", {}).get("sync_interval")
                                                  or 0)):
                speed = {k: (r.get("results", {}).get(k, {}).get("tokens_per_s") or {})
                         .get("median") for k in ("torchft-diloco", "diloco")}
                if speed["torchft-diloco"] and speed["diloco"]:
                    ratios.append((speed["diloco"] / speed["torchft-diloco"],
                                   r.get("settings", {}).get("sync_interval")))
            if ratios:
                clause += (" and runs at " if all(x >= 1.0 for x, _ in ratios) else " but runs at ")
                clause += " and ".join(f"{x:.2f}x" + (f" (H = {h})" if len(ratios) > 1 else "")
                                       for x, h in ratios)
                clause += " torchft's tokens/s (median of the repeats)"
            clauses.append(clause)
    if not clauses:
        raise ConfigError("bench report --readme: none of the default, spikes, stragglers "
                          "(measured limits) or peers results yields a headline; run them "
                          "first")
    used = [r for r in by_name.values()
            if r.get("scenario") in ("default", "convergence", "spikes", "stragglers",
                                     "bandwidth", "peers", "real_link", "tune", "scale")]
    machine = used[0].get("machine", {})
    sizes = sorted({r.get("mode") for r in used} - {None})
    text = (f"Measured on one {machine.get('usable_cpus', '?')}-core "
            f"{'GPU' if machine.get('cuda') else 'CPU'} machine (`docs/benchmarks.md`, "
            f"{'/'.join(sizes)} size, with the commands): " + "; ".join(clauses) + ".")
    return text


def replace_headline(text: str, sentence: str, name: str = "README.md") -> str:
    """``text`` with the part between the headline markers replaced by ``sentence``.

    Args:
        text: the README's text.
        sentence: the new headline (wrapped at 92 columns).
        name: the file's name, for the error message.

    Raises:
        ConfigError: the markers are missing, out of order or repeated.
    """
    start, end = text.count(HEADLINE_START), text.count(HEADLINE_END)
    if start != 1 or end != 1 or text.index(HEADLINE_START) > text.index(HEADLINE_END):
        raise ConfigError(
            f"{name}: expected exactly one '{HEADLINE_START}' followed by one "
            f"'{HEADLINE_END}' (found {start} and {end}); put them around the headline "
            "sentence that `editrain bench report --readme` should regenerate")
    head, rest = text.split(HEADLINE_START, 1)
    _, tail = rest.split(HEADLINE_END, 1)
    body = textwrap.fill(sentence, width=92, break_on_hyphens=False)
    return f"{head}{HEADLINE_START}\n{body}\n{HEADLINE_END}{tail}"


def write_readme_headline(readme: str | Path, results_dirs: Sequence[str | Path]) -> str:
    """Regenerate the headline between the markers of a README from results directories.

    Args:
        readme: the README file.
        results_dirs: scenario results directories (each with ``results.json``).

    Returns:
        The sentence written.

    Raises:
        ConfigError: the README has no markers, or no record yields a headline.
        FileNotFoundError: the README does not exist.
    """
    path = Path(readme)
    text = check_readme(path)
    sentence = readme_headline([load_record(d) for d in results_dirs])
    path.write_text(replace_headline(text, sentence, path.name))
    return sentence


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
           "load_result", "readme_headline", "replace_headline", "shows",
           "write_benchmarks_md", "write_readme_headline"]
