"""The README's headline: a short table of the committed results and the telling plots.

``editrain bench report --readme README.md`` writes it between the README's
``<!-- bench-headline -->`` markers (see :mod:`editrain.bench.report`). Every cell comes
from a ``results.json`` record, and every row links the records it was read from: their
``command`` reproduces it, and ``docs/benchmarks.md`` has the long form.

Only records of the current methodology (results format 2) are used; where a scenario has
records of several sizes, the largest wins, as on the benchmarks page. A row whose record
is missing is left out; a row whose measurement was flagged says so instead of a number.
"""

from __future__ import annotations

import os
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

SIZES = {"tiny": 0, "quick": 1, "full": 2}


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
    """Whether ``record`` predates results format 2 (the old methodology)."""
    return int(record.get("format", 1)) < 2


def _times(s: dict[str, Any] | None) -> str:
    """A ratio's ``median [min-max]`` followed by ``x``."""
    return spread_cell(s) + "x"


def _same(s: dict[str, Any]) -> str:
    """A ``stats.spread`` whose repeats may all agree: the value once, and how many agreed;
    the usual ``median [min-max]`` otherwise."""
    if s.get("n", 0) >= 2 and cell(s["min"]) == cell(s["max"]):
        return f"{cell(s['median'])} (all {s['n']} repeats)"
    return spread_cell(s)


def _percent(s: dict[str, Any]) -> str:
    """A fraction's spread in percent, ``12.9% [-1.0% to 20.8%]`` (a dash would read as a
    minus sign next to a negative bound)."""
    if s.get("n", 0) < 2:
        return f"{100 * s['median']:.1f}%"
    return f"{100 * s['median']:.1f}% [{100 * s['min']:.1f}% to {100 * s['max']:.1f}%]"


def _loss(stats: dict[str, Any]) -> str:
    """A loss over seeds: ``mean +- std`` (3 decimals; the mean alone for one seed)."""
    if stats.get("n", 0) < 2:
        return f"{stats['mean']:.3f}"
    return f"{stats['mean']:.3f} +- {stats.get('std') or 0:.3f}"


def _diff(stats: dict[str, Any]) -> str:
    """A paired difference over seeds: ``+mean +- std``."""
    return f"{stats['mean']:+.3f} +- {stats.get('std') or 0:.3f}"


def _link(name: str) -> str:
    """``5MB/s+5ms`` as ``5 MB/s + 5 ms``."""
    return name.replace("+", " + ").replace("MB/s", " MB/s").replace("ms", " ms")


def _repeats(s: dict[str, Any]) -> str:
    """``median [min-max] of N repeats`` or ``one run``."""
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

    def row(self, what: str, editrain: str, peer: str, conditions: str,
            sources: Sequence[Loaded]) -> HeadlineRow:
        """A row read from ``sources`` (remembered for the machine line)."""
        self.used += [s for s in sources if all(s[0] != u[0] for u in self.used)]
        return HeadlineRow(what, editrain, peer, conditions, tuple(d for d, _ in sources))


def _default_row(p: _Picker) -> list[HeadlineRow]:
    """The default ``editrain train`` run: validation loss before and after, and against
    the same run in synchronous mode at equal tokens (both wall times)."""
    got = p.last("default", ["default"])
    run = _get(got[1], "default") if got else None
    if not got or not run or run.get("final_val_loss") is None:
        return []
    split = run.get("split") or {}
    overlap = split.get("val_train_overlap")
    sync = _get(got[1], "sync") or {}
    said = TEXT["default"]
    peer = fill(said["before"], run=run)
    if sync.get("final_val_loss") is not None and run.get("vs_sync") is not None:
        peer = fill(said["sync"], sync=sync, run=run, before=peer)
    return [p.row(
        said["what"],
        fill(said["ours"], run=run, seconds=run.get("launch_s", run.get("wall_time_s", 0))),
        peer,
        fill(said["conditions"], run=run, load=_load_text(got[1]), overlap="" if overlap is None
             else fill(said["overlap"], overlap=overlap, window=split.get("overlap_window"))),
        [got])]


def _load_text(record: dict[str, Any]) -> str:
    """``; load average A-B at the runs' starts`` (wall times on a shared machine stretch
    with it), or nothing when the record has no loads."""
    loads = (record.get("machine") or {}).get("load_during_runs")
    if not loads:
        return ""
    lo, hi = loads
    return fill(TEXT["load_one" if f"{lo:.1f}" == f"{hi:.1f}" else "load_range"], lo=lo, hi=hi)


def _convergence_rows(p: _Picker) -> list[HeadlineRow]:
    """Final validation loss at equal tokens: EDiT against DiLoCo and synchronous training,
    EDiT with bench tune's recipe, and the variants that hide the communication."""
    rows, said = [], TEXT["convergence"]
    got = p.last("convergence", ["edit", "diloco", "sync"])
    if got:
        res, st = got[1]["results"], _settings(got[1])
        vs_d, vs_s = res["edit"].get("paired_vs_diloco"), res["edit"].get("paired_vs_sync")
        if vs_d and vs_s and vs_d.get("mean") is not None and vs_s.get("mean") is not None:
            rows.append(p.row(
                fill(said["what"], st=st), f"EDiT {_loss(res['edit']['final_val_loss'])}",
                fill(said["peer"], diloco=_loss(res["diloco"]["final_val_loss"]),
                     sync=_loss(res["sync"]["final_val_loss"])),
                fill(said["conditions"], st=st, vs_diloco=_diff(vs_d), vs_sync=_diff(vs_s)),
                [got]))
    got = p.last("convergence", ["edit-recipe", "sync"])
    if got:
        res, st = got[1]["results"], _settings(got[1])
        vs_s = res["edit-recipe"].get("paired_vs_sync") or {}
        sync = res["sync"].get("final_val_loss") or {}
        if vs_s.get("mean") is not None and sync.get("mean"):
            sources, more = [got], ""
            scale = p.last("scale", ["shapes"])
            sized = [s for s in _get(scale[1], "shapes") or []
                     if s.get("relative_gap") is not None] if scale else []
            if len(sized) >= 2:  # a lone shape says nothing about size
                sources.append(scale)
                more = "; by model size " + ", ".join(
                    f"{100 * s['relative_gap']:+.1f}% at {s['params'] / 1e6:.1f}M parameters"
                    for s in sized)
            rows.append(p.row(
                fill(said["recipe_what"], st=st),
                f"{_loss(res['edit-recipe']['final_val_loss'])} "
                f"({100 * vs_s['mean'] / sync['mean']:+.1f}%)",
                f"synchronous {_loss(sync)}",
                fill(said["recipe_conditions"], st=st, vs_sync=_diff(vs_s), more=more), sources))
    got = p.last("convergence", ["edit", "edit-streaming", "edit-eager"]) or \
        p.last("convergence", ["edit", "edit-streaming"])
    if got:
        res, st = got[1]["results"], _settings(got[1])
        parts = [f"{name} {_diff(res[v]['paired_vs_edit'])}" for v, name in (
            ("edit-streaming", "streaming"), ("edit-eager", "eager"),
            ("edit-sparse", "sparse 2-bit")) if (res.get(v) or {}).get("paired_vs_edit")]
        if parts and (res["edit"].get("final_val_loss") or {}).get("mean") is not None:
            rows.append(p.row(
                fill(said["hidden_what"], st=st), "; ".join(parts),
                f"EDiT {_loss(res['edit']['final_val_loss'])}",
                fill(said["hidden_conditions"], st=st), [got]))
    return rows


def _spikes_row(p: _Picker) -> list[HeadlineRow]:
    """Peak validation-loss rise with one replica's pseudo-gradient corrupted."""
    got = p.last("spikes", ["diloco", "edit"])
    if not got:
        return []
    res, st = got[1]["results"], got[1].get("settings", {})
    d, e = res["diloco"].get("peak_increase"), res["edit"].get("peak_increase")
    if d is None or e is None:
        return []
    said = TEXT["spikes"]
    return [p.row(
        fill(said["what"], scale=st.get("scale", 0), syncs=len(st.get("corrupt_syncs", []))),
        f"EDiT {cell(e)}", f"DiLoCo {cell(d)}", fill(said["conditions"], st=_settings(got[1])),
        [got])]


def _straggler_row(p: _Picker) -> list[HeadlineRow]:
    """Throughput with one replica 2x slower, as a share of the measured limit."""
    got = p.last("stragglers", ["straggler"])
    case = _get(got[1], "straggler") if got else None
    if not got or not case:
        return []
    what = TEXT["stragglers"]["what"]
    if case.get("errors"):
        return [p.row(what, "measurement error", "measurement error",
                      TEXT["stragglers"]["flagged"], [got])]
    nb = (case.get("aedit-nb") or {}).get("fraction_of_limit") or {}
    blocking = (case.get("aedit") or {}).get("fraction_of_limit") or {}
    ours, name = (nb, "A-EDiT (non-blocking)") if nb.get("median") is not None else \
        (blocking, "A-EDiT")
    sync = (case.get("sync") or {}).get("fraction_of_limit") or {}
    if ours.get("median") is None or sync.get("median") is None:
        return []
    return [p.row(what, f"{name} {_times(ours)}", f"synchronous {_times(sync)}",
                  f"{_repeats(ours)}", [got])]


def _link_rows(p: _Picker) -> list[HeadlineRow]:
    """Throughput kept on slow links against an unlimited one: the simulated 5 MB/s link,
    the sparse setting on the slower ones (every run of it: they disagree more than their
    repeats' spread), and the real shaped link."""
    rows = []
    got = p.last("bandwidth", ["edit-streaming", "diloco", "sync"])
    link = "5MB/s+5ms"
    if got:
        res, st = got[1]["results"], got[1].get("settings", {})
        kept = {v: (res[v].get(link) or {}).get("vs_unlimited") or {}
                for v in ("edit-streaming", "diloco", "sync")}
        if all(k.get("median") is not None for k in kept.values()):
            rows.append(p.row(
                fill(TEXT["links"]["simulated"], link=_link(link)),
                f"streaming EDiT {_times(kept['edit-streaming'])}",
                f"DiLoCo {_times(kept['diloco'])}; synchronous {_times(kept['sync'])}",
                f"H = {st.get('sync_interval')}; "
                f"{_repeats(kept['edit-streaming'])}", [got]))
    for link in ("1MB/s+50ms", "0.25MB/s+50ms"):
        runs = [(dr, _get(dr[1], "edit-sparse", link, "vs_unlimited"),
                 _get(dr[1], "diloco", link, "vs_unlimited"))
                for dr in p.every("bandwidth", ["edit-sparse", "diloco"])]
        runs = [(dr, s, d) for dr, s, d in runs if s and d and s.get("median") is not None
                and d.get("median") is not None]
        if runs:
            several = f" ({len(runs)} runs)" if len(runs) > 1 else ""
            rows.append(p.row(
                fill(TEXT["links"]["simulated"], link=_link(link)),
                "sparse 2-bit EDiT " + " / ".join(_times(s) for _, s, _ in runs) + several,
                "DiLoCo " + " / ".join(_times(d) for _, _, d in runs),
                f"H = {runs[0][0][1].get('settings', {}).get('sync_interval')}; "
                f"{_repeats(runs[0][1])}", [dr for dr, _, _ in runs]))
    got = p.last("real_link", ["sparse-topk2", "streaming-int8"])
    if got:
        st = got[1].get("settings", {})
        sparse = _get(got[1], "sparse-topk2", "kept") or {}
        stream = _get(got[1], "streaming-int8", "kept") or {}
        if sparse.get("median") is not None and stream.get("median") is not None:
            rows.append(p.row(
                fill(TEXT["links"]["real"], rate=st.get("rate")),
                f"sparse 2-bit EDiT {_times(sparse)}", f"int8 streaming EDiT {_times(stream)}",
                f"{_repeats(sparse)}", [got]))
    return rows


def _real_link_peer_rows(p: _Picker) -> list[HeadlineRow]:
    """Over a real shaped link (network namespaces, tc), editrain's setting against
    torchft's streaming DiLoCo measured in the same run (``scripts/real_link.sh`` with a
    ``torchft-d<D>`` setting), one row per record, slowest link last: tokens/s kept
    against each one's own unshaped run, and the final validation loss (equal tokens) on
    the shaped link, for every editrain setting of the record and the peer's best delay
    (most tokens/s kept)."""
    found = []
    for d, r in p.every("real_link"):
        res = r.get("results", {})
        ours = [s for s in res if not s.startswith("torchft-")]
        peers = [s for s in res if s.startswith("torchft-")
                 and (_get(r, s, "kept") or {}).get("median") is not None]
        ours = [s for s in ours if (_get(r, s, "kept") or {}).get("median") is not None]
        if not ours or not peers:
            continue
        best = max(peers, key=lambda s: res[s]["kept"]["median"])
        found.append(((d, r), ours, best))
    rows = []
    for (d, r), ours, best in sorted(found, key=lambda f: -_rate_bits(f[0][1])):
        st = _settings(r)
        rows.append(p.row(
            fill(TEXT["links"]["real_peer"], rate=st["rate"]),
            "; ".join(_kept_and_loss(r, s, s) for s in ours),
            _kept_and_loss(r, best, "torchft streaming DiLoCo, delay " + best.split("-d")[-1]),
            fill(TEXT["links"]["real_peer_conditions"], st=st,
                 repeats=_repeats(r["results"][ours[0]]["kept"])),
            [(d, r)]))
    return rows


def _kept_and_loss(record: dict[str, Any], name: str, label: str) -> str:
    """``LABEL 0.98 [..]x, loss 6.5 [..]``: a real-link setting's tokens/s kept and its
    final validation loss on the shaped link (left out where the record has none)."""
    loss = _get(record, name, record.get("settings", {}).get("rate"), "final_val_loss") or {}
    return f"{label} {_times(record['results'][name]['kept'])}" + (
        f", loss {_same(loss)}" if loss.get("median") is not None else "")


def _rate_bits(record: dict[str, Any]) -> float:
    """A record's tc rate (``10mbit``, ``1mbit``, ``500kbit``) in bits per second; 0 when
    it cannot be read."""
    rate = str(record.get("settings", {}).get("rate", "")).lower()
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * scale
            except ValueError:
                return 0.0
    return 0.0


def _peers_rows(p: _Picker) -> list[HeadlineRow]:
    """editrain's DiLoCo against torchft's on the same model and data, one row per H
    (largest first): final validation loss and tokens/s."""
    rows = []
    top = p.last("peers", ["diloco", "torchft-diloco"])
    if not top:
        return []
    same = [dr for dr in p.every("peers", ["diloco", "torchft-diloco"])
            if dr[1].get("mode") == top[1].get("mode")]
    for d, r in sorted(same, key=lambda dr: -(dr[1].get("settings", {}).get("sync_interval")
                                              or 0)):
        ours, theirs = r["results"]["diloco"], r["results"]["torchft-diloco"]
        target = next(iter(r.get("targets", [])), {})
        speeds = [s.get("tokens_per_s") or {} for s in (ours, theirs)]
        losses = [s.get("final_val_loss") or {} for s in (ours, theirs)]
        if any(s.get("median") is None for s in speeds + losses):
            continue
        agree = (f"; loss {target['detail']}" if target.get("met") and target.get("detail")
                 else "")
        rows.append(p.row(
            fill(TEXT["peers"]["what"], h=r.get("settings", {}).get("sync_interval")),
            f"{_same(losses[0])}; {spread_cell(speeds[0])} tok/s",
            f"{_same(losses[1])}; {spread_cell(speeds[1])} tok/s",
            f"same model and data; {_repeats(speeds[0])}{agree}", [(d, r)]))
    return rows


def _faults_row(p: _Picker) -> list[HeadlineRow]:
    """Useful tokens lost when one replica is killed: ``--ft`` against a restart."""
    got = p.last("faults", ["ft-fail", "restart-fail"])
    if not got:
        return []
    st = _settings(got[1])
    ft = _get(got[1], "ft-fail", "window_loss") or {}
    restart = _get(got[1], "restart-fail", "window_loss") or {}
    if ft.get("median") is None or restart.get("median") is None:
        return []
    said = TEXT["faults"]
    return [p.row(fill(said["what"], st=st), f"--ft {_percent(ft)}",
                  f"restart from a checkpoint {_percent(restart)}",
                  fill(said["conditions"], st=st, repeats=_repeats(ft)), [got])]


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
    said = TEXT["data"]
    rounds = len(ours.get("runs_seconds") or [None])  # records before rounds: one build
    runs = fill(said["rounds"], rounds=rounds) if rounds > 1 else _repeats({})
    return [p.row(
        fill(said["what"], megabytes=q["bytes"] / 1e6),
        f"{cell(ours['tokens_per_s'])}; {fmt_bytes(ours.get('peak_rss'))}",
        fill(said["peer"], tokens_per_s=cell(limit["tokens_per_s"]),
             peak=fmt_bytes(limit.get("peak_rss"))),
        fill(said["conditions"], limit=defaultdict(lambda: None, limit),
             ratio=cell(ours["time_vs_limit"]), runs=runs), [got])]


def headline_rows(loaded: Sequence[Loaded]) -> tuple[list[HeadlineRow], list[Loaded]]:
    """The headline's rows, and the records they were read from.

    Args:
        loaded: (results directory, record) of every scenario directory.

    Returns:
        The rows in the order of the table, and the records used.
    """
    p = _Picker(loaded)
    rows = (_default_row(p) + _convergence_rows(p) + _spikes_row(p) + _straggler_row(p)
            + _link_rows(p) + _real_link_peer_rows(p) + _peers_rows(p) + _faults_row(p)
            + _data_row(p))
    return rows, p.used


def relative_link(target: Path, start: Path) -> str:
    """``target`` relative to ``start``, with forward slashes."""
    try:
        return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return target.resolve().as_posix()


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
    base = Path(base)
    machine = used[0][1].get("machine", {})
    sizes = sorted({r.get("mode") for _, r in used} - {None}, key=lambda m: SIZES.get(m, 0))
    # Left-aligned (md_table right-aligns numbers; these cells are mostly words).
    table = "\n".join(
        ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        + ["| " + " | ".join([row.what, row.editrain, row.peer, row.conditions + " (" + ", ".join(
            f"[{d.name}]({relative_link(d / 'results.json', base)})" for d in row.sources)
            + ")"]) + " |" for row in rows])
    intro = fill(TEXT["intro"], cpus=machine.get("usable_cpus", "?"),
                 kind="GPU" if machine.get("cuda") else "CPU", sizes="/".join(sizes))
    lines = [textwrap.fill(intro, width=92, break_on_hyphens=False), "", table]
    p = _Picker(loaded)
    plots = []
    for scenario, name, caption in HEADLINE_PLOTS:
        got = next((dr for dr in used if dr[1].get("scenario") == scenario), None) \
            or p.last(scenario)
        if got and name in got[1].get("plots", []) and (got[0] / name).is_file():
            plots.append((caption, relative_link(got[0] / name, base)))
    if plots:
        lines += ["", "| " + " | ".join(c for c, _ in plots) + " |",
                  "|" + "---|" * len(plots),
                  "| " + " | ".join(f"![{c}]({path})" for c, path in plots) + " |"]
    return "\n".join(lines)


__all__ = ["COLUMNS", "HEADLINE_PLOTS", "HeadlineRow", "Loaded", "headline_rows", "is_stale",
           "readme_headline", "relative_link"]
