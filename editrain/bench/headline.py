"""The README's headline: a short table of the committed results and the telling plots.

``editrain bench report --readme README.md`` writes it between the README's
``<!-- bench-headline -->`` markers (see :mod:`editrain.bench.report`). Every cell comes
from a ``results.json`` record, and every row links the records it was read from: their
``command`` reproduces it, and ``docs/benchmarks.md`` has the long form.

Only records of the current methodology (results format 2) are used; where a scenario has
records of several sizes, the largest wins, as on the benchmarks page. A row whose record
is missing is left out; a row whose measurement was flagged says so instead of a number.
Each row kind's words are templates in ``text/headline.toml``; its function here picks
the record and reads the values.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from editrain.bench.options import MODES
from editrain.bench.prose import fill, prose
from editrain.bench.tables import cell, fmt_bytes, spread_cell
from editrain.config import ConfigError

TEXT = prose("headline")
Loaded = tuple[Path, dict[str, Any]]
"""A scenario's results directory and its ``results.json`` record."""

HEADLINE_PLOTS = (
    ("spikes", "val_loss_spikes.png", "Validation loss with a corrupted replica"),
    ("stragglers", "fraction_of_limit.png", "Throughput with a straggler"),
    ("bandwidth", "throughput_vs_link.png", "Throughput as the link slows"),
)
"""(scenario, plot file, caption) of the headline's plots, each from the record the
table uses for that scenario."""

COLUMNS = ("what is measured", "editrain", "baseline or peer", "conditions (source)")
"""The headline table's columns."""

CELLS = ("what", "editrain", "peer", "conditions")
"""A row's text fields: each a template of its row kind in ``text/headline.toml``."""

SIZES = {mode: rank for rank, mode in enumerate(MODES)}

HIDDEN = (("edit-streaming", "streaming"), ("edit-eager", "eager"),
          ("edit-sparse", "sparse 2-bit"))
"""(convergence variant, name) of the variants that hide the communication."""


@dataclass(frozen=True)
class HeadlineRow:
    """One row of the headline table.

    Attributes:
        what: what is measured.
        editrain: editrain's figure (with its spread where the result has one).
        peer: the baseline's or peer's figure, measured in the same run.
        conditions: the setting the figures hold for.
        sources: the results directories the figures come from.
    """

    what: str
    editrain: str
    peer: str
    conditions: str
    sources: tuple[Path, ...]


def is_stale(record: dict[str, Any]) -> bool:
    """Whether ``record`` predates results format 2 (the old methodology); its format is
    an integer (:data:`editrain.bench.results.RESULTS_SCHEMA`), 1 where it has none."""
    return record.get("format", 1) < 2


def _times(s: dict[str, Any] | None) -> str:
    return spread_cell(s) + "x"


def _same(s: dict[str, Any]) -> str:
    """A spread whose repeats all agree as the value once and how many agreed."""
    if s.get("n", 0) >= 2 and cell(s["min"]) == cell(s["max"]):
        return f"{cell(s['median'])} (all {s['n']} repeats)"
    return spread_cell(s)


def _percent(s: dict[str, Any]) -> str:
    """``12.9% [-1.0% to 20.8%]`` (a dash would read as a minus sign before a negative)."""
    if s.get("n", 0) < 2:
        return f"{100 * s['median']:.1f}%"
    return f"{100 * s['median']:.1f}% [{100 * s['min']:.1f}% to {100 * s['max']:.1f}%]"


def _loss(stats: dict[str, Any]) -> str:
    """A loss over seeds, ``mean +- std`` (the mean alone for one seed)."""
    if stats.get("n", 0) < 2:
        return f"{stats['mean']:.3f}"
    return f"{stats['mean']:.3f} +- {stats.get('std') or 0:.3f}"


def _diff(stats: dict[str, Any]) -> str:
    return f"{stats['mean']:+.3f} +- {stats.get('std') or 0:.3f}"


def _link(name: str) -> str:
    """``5MB/s+5ms`` as ``5 MB/s + 5 ms``."""
    return name.replace("+", " + ").replace("MB/s", " MB/s").replace("ms", " ms")


def _repeats(s: dict[str, Any]) -> str:
    n = s.get("n", 1) or 1
    return f"median [min-max] of {n} repeats" if n > 1 else "one run"


def _settings(record: dict[str, Any]) -> defaultdict:
    """A record's settings, None for a missing one (as the templates read them)."""
    return defaultdict(lambda: None, record.get("settings", {}))


def _get(record: dict[str, Any], *keys: str) -> Any:
    """``record["results"][k0][k1]...``, or None where a level is missing."""
    value: Any = record.get("results", {})
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _known(*stats: dict[str, Any] | None, key: str = "median") -> bool:
    """Whether every one of ``stats`` has a ``key`` value."""
    return all((s or {}).get(key) is not None for s in stats)


class _Picker:
    """The records the headline reads, chosen as the benchmarks page summarises them."""

    def __init__(self, loaded: Sequence[Loaded]) -> None:
        # Current methodology only; sorted by size (stable), so the last record of a
        # scenario is its largest and, at equal size, its last directory.
        self.fresh = sorted(((d, r) for d, r in loaded if not is_stale(r)),
                            key=lambda dr: SIZES.get(dr[1].get("mode"), 0))
        self.used: list[Loaded] = []

    def every(self, scenario: str, needs: Sequence[str] = ()) -> list[Loaded]:
        """Every record of ``scenario`` whose results have ``needs``, smallest size first."""
        return [(d, r) for d, r in self.fresh if r.get("scenario") == scenario
                and not r.get("skipped") and set(needs) <= set(r.get("results", {}))]

    def last(self, scenario: str, needs: Sequence[str] = ()) -> Loaded | None:
        """The largest (then last) record of ``scenario`` whose results have ``needs``."""
        found = self.every(scenario, needs)
        return found[-1] if found else None

    def figures(self, scenario: str, *paths: Sequence[str]) -> tuple[Loaded | None, list[Any]]:
        """The last record of ``scenario`` whose results have each path's first key, and
        the value at each path (all None without such a record)."""
        got = self.last(scenario, [path[0] for path in paths])
        return got, [_get(got[1], *path) if got else None for path in paths]

    def row(self, said: dict[str, str], sources: Sequence[Loaded],
            **values: Any) -> HeadlineRow:
        """A row of ``said``'s templates filled with ``values``, read from ``sources``
        (remembered for the machine line)."""
        self.used += [s for s in sources if all(s[0] != u[0] for u in self.used)]
        return HeadlineRow(*(fill(said[c], **values) for c in CELLS),
                           tuple(d for d, _ in sources))


# ---------------------------------------------------------------------- the rows, in order
def _default_row(p: _Picker) -> list[HeadlineRow]:
    """The default ``editrain train`` run: validation loss before and after, and against
    the same run in synchronous mode at equal tokens (both wall times)."""
    got = p.last("default", ["default"])
    run = _get(got[1], "default") if got else None
    if not run or run.get("final_val_loss") is None:
        return []
    said, split, sync = TEXT["default"], run.get("split") or {}, _get(got[1], "sync") or {}
    overlap = split.get("val_train_overlap")
    synced = sync.get("final_val_loss") is not None and run.get("vs_sync") is not None
    return [p.row(said, [got], run=run, seconds=run.get("launch_s", run.get("wall_time_s", 0)),
                  synced=fill(said["synced"], sync=sync, run=run) if synced else "",
                  load=_load_text(got[1]), overlap="" if overlap is None else fill(
                      said["overlap"], overlap=overlap, window=split.get("overlap_window")))]


def _load_text(record: dict[str, Any]) -> str:
    """The load average at the runs' starts (wall times on a shared machine stretch with
    it), or nothing when the record has no loads."""
    loads = (record.get("machine") or {}).get("load_during_runs")
    if not loads:
        return ""
    lo, hi = loads
    return fill(TEXT["load_one" if f"{lo:.1f}" == f"{hi:.1f}" else "load_range"], lo=lo, hi=hi)


def _convergence_row(p: _Picker) -> list[HeadlineRow]:
    """Final validation loss at equal tokens: EDiT against DiLoCo and synchronous."""
    got, (edit, diloco, sync, vs_diloco, vs_sync) = p.figures(
        "convergence", ("edit", "final_val_loss"), ("diloco", "final_val_loss"),
        ("sync", "final_val_loss"), ("edit", "paired_vs_diloco"), ("edit", "paired_vs_sync"))
    if not _known(vs_diloco, vs_sync, key="mean"):
        return []
    return [p.row(TEXT["convergence"], [got], st=_settings(got[1]), edit=_loss(edit),
                  diloco=_loss(diloco), sync=_loss(sync), vs_diloco=_diff(vs_diloco),
                  vs_sync=_diff(vs_sync))]


def _recipe_row(p: _Picker) -> list[HeadlineRow]:
    """EDiT with bench tune's recipe against synchronous, and its gap by model size."""
    got, (edit, vs_sync, sync) = p.figures("convergence", ("edit-recipe", "final_val_loss"),
                                            ("edit-recipe", "paired_vs_sync"),
                                            ("sync", "final_val_loss"))
    if not _known(vs_sync, key="mean") or not (sync or {}).get("mean"):
        return []
    said, sources, more = TEXT["recipe"], [got], ""
    scale = p.last("scale", ["shapes"])
    sized = [s for s in _get(scale[1], "shapes") or []
             if s.get("relative_gap") is not None] if scale else []
    if len(sized) >= 2:  # a lone shape says nothing about size
        sources.append(scale)
        more = fill(said["by_size"], sizes=", ".join(
            fill(said["size"], gap=100 * s["relative_gap"], params=s["params"] / 1e6)
            for s in sized))
    return [p.row(said, sources, st=_settings(got[1]), edit=_loss(edit), sync=_loss(sync),
                  gap=100 * vs_sync["mean"] / sync["mean"], vs_sync=_diff(vs_sync), more=more)]


def _hidden_row(p: _Picker) -> list[HeadlineRow]:
    """The variants that hide the communication, each minus EDiT per seed."""
    got = p.last("convergence", ["edit", "edit-streaming", "edit-eager"]) or \
        p.last("convergence", ["edit", "edit-streaming"])
    res = got[1]["results"] if got else {}
    parts = [f"{name} {_diff(res[v]['paired_vs_edit'])}" for v, name in HIDDEN
             if (res.get(v) or {}).get("paired_vs_edit")]
    if not parts or not _known(res["edit"].get("final_val_loss"), key="mean"):
        return []
    return [p.row(TEXT["hidden"], [got], st=_settings(got[1]), parts="; ".join(parts),
                  edit=_loss(res["edit"]["final_val_loss"]))]


def _spikes_row(p: _Picker) -> list[HeadlineRow]:
    """Peak validation-loss rise with one replica's pseudo-gradient corrupted."""
    got, (diloco, edit) = p.figures("spikes", ("diloco", "peak_increase"),
                                    ("edit", "peak_increase"))
    if diloco is None or edit is None:
        return []
    st = _settings(got[1])
    return [p.row(TEXT["spikes"], [got], st=st, scale=st.get("scale", 0),
                  syncs=len(st.get("corrupt_syncs", [])), edit=cell(edit), diloco=cell(diloco))]


def _straggler_row(p: _Picker) -> list[HeadlineRow]:
    """Throughput with one replica 2x slower, as a share of the measured limit."""
    got, (case,) = p.figures("stragglers", ("straggler",))
    if not case:
        return []
    if case.get("errors"):
        return [p.row({**TEXT["stragglers"], **TEXT["stragglers"]["flagged"]}, [got])]
    nb, blocking, sync = ((case.get(v) or {}).get("fraction_of_limit") or {}
                          for v in ("aedit-nb", "aedit", "sync"))
    ours, name = (nb, "A-EDiT (non-blocking)") if _known(nb) else (blocking, "A-EDiT")
    if not _known(ours, sync):
        return []
    return [p.row(TEXT["stragglers"], [got], name=name, ours=_times(ours), sync=_times(sync),
                  repeats=_repeats(ours))]


def _simulated_link_row(p: _Picker) -> list[HeadlineRow]:
    """Throughput kept on the simulated 5 MB/s link against an unlimited one."""
    link = "5MB/s+5ms"
    got, (stream, diloco, sync) = p.figures(
        "bandwidth", *((v, link, "vs_unlimited") for v in ("edit-streaming", "diloco", "sync")))
    if not _known(stream, diloco, sync):
        return []
    return [p.row(TEXT["simulated_link"], [got], st=_settings(got[1]), link=_link(link),
                  stream=_times(stream), diloco=_times(diloco), sync=_times(sync),
                  repeats=_repeats(stream))]


def _sparse_link_rows(p: _Picker) -> list[HeadlineRow]:
    """The sparse setting on the slower simulated links: every run of it, since they
    disagree more than their repeats' spread."""
    rows, said = [], {**TEXT["simulated_link"], **TEXT["sparse_link"]}
    for link in ("1MB/s+50ms", "0.25MB/s+50ms"):
        runs = [(dr, _get(dr[1], "edit-sparse", link, "vs_unlimited"),
                 _get(dr[1], "diloco", link, "vs_unlimited"))
                for dr in p.every("bandwidth", ["edit-sparse", "diloco"])]
        runs = [(dr, s, d) for dr, s, d in runs if _known(s, d)]
        if runs:
            rows.append(p.row(
                said, [dr for dr, _, _ in runs], st=_settings(runs[0][0][1]), link=_link(link),
                sparse=" / ".join(_times(s) for _, s, _ in runs),
                several=fill(said["several"], runs=len(runs)) if len(runs) > 1 else "",
                diloco=" / ".join(_times(d) for _, _, d in runs), repeats=_repeats(runs[0][1])))
    return rows


def _real_link_row(p: _Picker) -> list[HeadlineRow]:
    """Throughput kept on a real shaped link: sparse against int8 streaming."""
    got, (sparse, stream) = p.figures("real_link", ("sparse-topk2", "kept"),
                                      ("streaming-int8", "kept"))
    if not _known(sparse, stream):
        return []
    return [p.row(TEXT["real_link"], [got], st=_settings(got[1]), sparse=_times(sparse),
                  stream=_times(stream), repeats=_repeats(sparse))]


def _real_peer_rows(p: _Picker) -> list[HeadlineRow]:
    """editrain's settings against torchft's streaming DiLoCo at its best delay (most tokens/s
    kept), over a real shaped link in the same run (``scripts/real_link.sh`` with a
    ``torchft-d<D>`` setting): tokens/s kept against each one's own unshaped run and the
    final validation loss (equal tokens), one row per record, slowest link last."""
    found = []
    for d, r in p.every("real_link"):
        kept = [s for s in r.get("results", {}) if _known(_get(r, s, "kept"))]
        ours = [s for s in kept if not s.startswith("torchft-")]
        peers = [s for s in kept if s.startswith("torchft-")]
        if ours and peers:
            found.append(((d, r), ours, max(peers, key=lambda s: _get(r, s, "kept", "median"))))
    rows = []
    for (d, r), ours, best in sorted(found, key=lambda f: -_rate_bits(f[0][1])):
        rows.append(p.row(TEXT["real_peer"], [(d, r)], st=_settings(r),
                          ours="; ".join(f"{s} {_kept_and_loss(r, s)}" for s in ours),
                          delay=best.split("-d")[-1], peer=_kept_and_loss(r, best),
                          repeats=_repeats(_get(r, ours[0], "kept"))))
    return rows


def _kept_and_loss(record: dict[str, Any], name: str) -> str:
    """A real-link setting's tokens/s kept, and its final validation loss on the shaped
    link where the record has one."""
    loss = _get(record, name, record.get("settings", {}).get("rate"), "final_val_loss") or {}
    return _times(_get(record, name, "kept")) + (
        fill(TEXT["real_peer"]["loss"], loss=_same(loss)) if _known(loss) else "")


def _rate_bits(record: dict[str, Any]) -> float:
    """A record's tc rate (``10mbit``, ``500kbit``, ``1.5gbit``) in bits per second; 0 if
    it is no such rate. Read as tc writes one, digits and an optional fraction before the
    unit: ``float()`` also read ``nan``, ``inf``, ``1_0`` and a sign, and a NaN rate made
    the rows' order depend on where it stood."""
    got = TC_RATE.fullmatch(str(record.get("settings", {}).get("rate", "")).lower())
    return float(got[1]) * TC_UNITS[got[2]] if got else 0.0


TC_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
"""The tc rate units a real-link record's ``settings.rate`` is written in, in bits/s."""
TC_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(gbit|mbit|kbit|bit)")


def _peers_rows(p: _Picker) -> list[HeadlineRow]:
    """editrain's DiLoCo against torchft's on the same model and data, one row per H
    (largest first) at the largest size: final validation loss and tokens/s."""
    top = p.last("peers", ["diloco", "torchft-diloco"])
    same = [dr for dr in p.every("peers", ["diloco", "torchft-diloco"])
            if dr[1].get("mode") == top[1].get("mode")] if top else []
    rows = []
    for d, r in sorted(same, key=lambda dr: -(dr[1].get("settings", {}).get("sync_interval")
                                              or 0)):
        ours, theirs = r["results"]["diloco"], r["results"]["torchft-diloco"]
        speed, their_speed = (s.get("tokens_per_s") or {} for s in (ours, theirs))
        loss, their_loss = (s.get("final_val_loss") or {} for s in (ours, theirs))
        if not _known(speed, their_speed, loss, their_loss):
            continue
        target = next(iter(r.get("targets", [])), {})
        agree = target.get("met") and target.get("detail")
        rows.append(p.row(
            TEXT["peers"], [(d, r)], st=_settings(r), loss=_same(loss),
            their_loss=_same(their_loss), speed=spread_cell(speed),
            their_speed=spread_cell(their_speed), repeats=_repeats(speed),
            agree=fill(TEXT["peers"]["agree"], detail=target["detail"]) if agree else ""))
    return rows


def _faults_row(p: _Picker) -> list[HeadlineRow]:
    """Useful tokens lost when one replica is killed: ``--ft`` against a restart."""
    got, (ft, restart) = p.figures("faults", ("ft-fail", "window_loss"),
                                   ("restart-fail", "window_loss"))
    if not _known(ft, restart):
        return []
    return [p.row(TEXT["faults"], [got], st=_settings(got[1]), ft=_percent(ft),
                  restart=_percent(restart), repeats=_repeats(ft))]


def _data_row(p: _Picker) -> list[HeadlineRow]:
    """``editrain data`` on the largest corpus measured, with a given tokenizer, against
    the same tokenizer's own ``encode_batch`` over the same files (the limit)."""
    got = p.last("data", ["points"])
    points = [q for q in (_get(got[1], "points") or []) if (q.get("limit") or {}).get("ok")
              and (q.get("given_tokenizer") or {}).get("ok")] if got else []
    if not points:
        return []
    q = max(points, key=lambda q: q.get("bytes", 0))
    ours, limit = q["given_tokenizer"], q["limit"]
    rounds = len(ours.get("runs_seconds") or [None])  # records before rounds: one build
    return [p.row(
        TEXT["data"], [got], megabytes=q["bytes"] / 1e6, tokens=cell(ours["tokens_per_s"]),
        peak=fmt_bytes(ours.get("peak_rss")), limit_tokens=cell(limit["tokens_per_s"]),
        limit_peak=fmt_bytes(limit.get("peak_rss")), limit=defaultdict(lambda: None, limit),
        ratio=cell(ours["time_vs_limit"]),
        runs=fill(TEXT["data"]["rounds"], rounds=rounds) if rounds > 1 else _repeats({}))]


ROWS = (_default_row, _convergence_row, _recipe_row, _hidden_row, _spikes_row,
        _straggler_row, _simulated_link_row, _sparse_link_rows, _real_link_row,
        _real_peer_rows, _peers_rows, _faults_row, _data_row)
"""The headline's row kinds, in the order of the table."""


def headline_rows(loaded: Sequence[Loaded]) -> tuple[list[HeadlineRow], list[Loaded]]:
    """The headline's rows, and the records they were read from.

    Args:
        loaded: (results directory, record) of every scenario directory.

    Returns:
        The rows in the order of the table, and the records used.
    """
    p = _Picker(loaded)
    return [row for make in ROWS for row in make(p)], p.used


# ---------------------------------------------------------------------- the Markdown
def relative_link(target: Path, start: Path) -> str:
    """``target`` relative to ``start``, with forward slashes."""
    try:
        return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return target.resolve().as_posix()


def _md_line(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: Sequence[str], body: Iterable[Iterable[str]]) -> list[str]:
    """A left-aligned Markdown table (md_table right-aligns numbers; these cells are
    mostly words)."""
    return [_md_line(head), "|" + "---|" * len(head)] + [_md_line(cells) for cells in body]


def _links(row: HeadlineRow, base: Path) -> str:
    """Links to the records a row was read from, relative to ``base``."""
    return ", ".join(f"[{d.name}]({relative_link(d / 'results.json', base)})"
                     for d in row.sources)


def readme_headline(loaded: Sequence[Loaded], base: str | Path = ".") -> str:
    """The README's headline: one line on the machine, the table, the plots.

    Args:
        loaded: (results directory, record) of every scenario directory.
        base: the README's directory (links are relative to it).

    Returns:
        The Markdown text.

    Raises:
        ConfigError: no record yields a row.
    """
    rows, used = headline_rows(loaded)
    if not rows:
        raise ConfigError(TEXT["no_rows"])
    base, machine = Path(base), used[0][1].get("machine", {})
    sizes = sorted({r.get("mode") for _, r in used} - {None}, key=lambda m: SIZES.get(m, 0))
    intro = fill(TEXT["intro"], cpus=machine.get("usable_cpus", "?"),
                 kind="GPU" if machine.get("cuda") else "CPU", sizes="/".join(sizes))
    lines = [textwrap.fill(intro, width=92, break_on_hyphens=False), ""] + _table(
        COLUMNS, [[row.what, row.editrain, row.peer, f"{row.conditions} ({_links(row, base)})"]
                  for row in rows])
    p, plots = _Picker(loaded), []
    for scenario, name, caption in HEADLINE_PLOTS:
        got = next((dr for dr in used if dr[1].get("scenario") == scenario), None) \
            or p.last(scenario)
        if got and name in got[1].get("plots", []) and (got[0] / name).is_file():
            plots.append((caption, relative_link(got[0] / name, base)))
    if plots:
        lines += [""] + _table([c for c, _ in plots], [[f"![{c}]({path})" for c, path in plots]])
    return "\n".join(lines)


__all__ = ["COLUMNS", "HEADLINE_PLOTS", "HeadlineRow", "Loaded", "headline_rows", "is_stale",
           "readme_headline", "relative_link"]
