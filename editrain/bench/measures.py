"""Numbers measured on one run: throughput, per-replica speed and utilisation, curves."""

from __future__ import annotations

import math
from typing import Any

from editrain.bench.runs import Run
from editrain.bench.stats import finite, measured, median, spread

UTILISATION_TOLERANCE = 1e-6
"""Rounding slack when checking that a utilisation is at most 1."""


def _total(items: list[dict[str, Any]], key: str) -> float:
    """The sum of ``key`` over ``items`` (missing and non-finite values left out)."""
    return sum(finite(x.get(key) for x in items))


def steady_throughput(run: Run, skip: int = 3) -> dict[str, Any]:
    """Tokens per second of the whole cluster over the steady part of a run.

    The window runs from the first timed sync after step ``skip`` to the last timed sync
    (so it holds whole sync cycles: every method pays for exactly its share of syncs),
    or, when the run has fewer than two timed syncs (synchronous training, a run without
    syncs), from step ``skip`` to the last step. Throughput is the tokens added in the
    window divided by the time between its two rows of ``metrics.jsonl``
    (``train_time_s``: wall time of compute, sync waits, blocking collectives, simulated
    stalls and metric writes, with evaluation and checkpoint time left out; scenarios that
    measure speed also evaluate only at the end).

    Args:
        run: the run.
        skip: steps left out at the start (start-up, allocator warm-up).

    Returns:
        ``tokens_per_s``, ``seconds``, ``tokens``, ``from_step``, ``to_step``, ``steps``,
        ``step_time_s``, ``syncs`` and the per-step sums of the sync entries and rows inside
        the window (``wait_s_per_step``, ``compute_s_per_step``...); empty when the run
        has too few rows.
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
    # train_time_s leaves evaluation and checkpoint time out (rows of older runs lack it).
    clock = "train_time_s" if "train_time_s" in ra and "train_time_s" in rb else "wall_time_s"
    seconds = rb[clock] - ra[clock]
    tokens = rb["tokens"] - ra["tokens"]
    steps = rb["step"] - ra["step"]
    inside = [s for i, s in run.timed_syncs() if a < i <= b]
    window = rows[a + 1:b + 1]
    out: dict[str, Any] = {
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "seconds": seconds, "tokens": tokens, "from_step": ra["step"], "to_step": rb["step"],
        "steps": steps, "step_time_s": seconds / steps if steps else None,
        "syncs": len(inside)}
    sums = {f"{key}_per_step": _total(inside, key)
            for key in ("wait_s", "comm_time_s", "link_delay_s", "sync_time_s")}
    sums["compute_s_per_step"] = _total(window, "compute_s")
    if any("grad_sync_s" in r for r in window):
        sums["grad_sync_s_per_step"] = _total(window, "grad_sync_s")
    return out | {key: total / steps if steps else None for key, total in sums.items()}


def rank_window(rows: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Speed and utilisation of one rank from its per-rank rows.

    The window runs from the end of this rank's step ``skip`` (its first row with
    ``step >= skip``) to its last row. Utilisation is the time the rank spent computing,
    simulated slowdowns and stalls included (they emulate slower compute), over the wall
    time of the window: ``sum(compute_s + sim_stall_s) / (wall_time_s[last] -
    wall_time_s[first])``. Every step's compute and stall lie inside its own
    ``step_time_s``, and the steps of the window lie inside the window's wall time, so the
    utilisation cannot exceed 1; a value above 1 means the logs are wrong.

    Args:
        rows: the rank's step rows in step order.
        skip: steps left out at the start.

    Returns:
        ``tokens_per_s``, ``utilisation``, ``seconds``, ``tokens``, ``steps``,
        ``compute_s``, ``stall_s``, ``sync_wait_s``, ``grad_sync_s`` (sums over the
        window), ``from_step``, ``to_step``; empty with fewer than 2 rows.
    """
    if len(rows) < 2:
        return {}
    a = next((i for i, r in enumerate(rows) if r["step"] >= skip), 0)
    if a >= len(rows) - 1:
        a = 0
    first, last, window = rows[a], rows[-1], rows[a + 1:]
    seconds = last["wall_time_s"] - first["wall_time_s"]
    compute, stall = _total(window, "compute_s"), _total(window, "sim_stall_s")
    tokens = last.get("tokens", 0) - first.get("tokens", 0)
    return {
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "utilisation": (compute + stall) / seconds if seconds > 0 else None,
        "seconds": seconds, "tokens": tokens, "steps": last["step"] - first["step"],
        "compute_s": compute, "stall_s": stall,
        "sync_wait_s": _total(window, "sync_wait_s"),
        "grad_sync_s": _total(window, "grad_sync_s"),
        "from_step": first["step"], "to_step": last["step"],
    }


def replica_stats(run: Run, skip: int = 3) -> list[dict[str, Any]]:
    """Per-replica tokens/s and utilisation of a run, from its per-rank logs.

    A replica's tokens/s is the sum of its ranks' (each rank counts its own tokens); its
    utilisation the mean over its ranks (they compute in lock-step). See
    :func:`rank_window` for the window and the definitions.

    Args:
        run: the run (its ``ranks`` read from ``ranks/rank{RANK}.jsonl``).
        skip: steps left out at the start.

    Returns:
        One dict per replica, in replica order: ``replica``, ``ranks``, ``tokens_per_s``,
        ``utilisation``, ``max_rank_utilisation``, and its first rank's window (``steps``,
        ``seconds``...); empty when the run has no per-rank logs.
    """
    out = []
    for replica, ranks in sorted(run.replicas().items()):
        windows = [w for w in (rank_window(run.ranks[r], skip) for r in ranks) if w]
        if not windows:
            continue
        speeds = finite(w["tokens_per_s"] for w in windows)
        utils = finite(w["utilisation"] for w in windows)
        first = {key: windows[0][key] for key in ("steps", "compute_s", "stall_s",
                                                  "sync_wait_s", "seconds", "from_step",
                                                  "to_step")}
        out.append({
            "replica": replica, "ranks": ranks, **first,
            "tokens_per_s": sum(speeds) if len(speeds) == len(windows) else None,
            "utilisation": sum(utils) / len(utils) if utils else None,
            "max_rank_utilisation": max(utils) if utils else None})
    return out


def replica_spreads(per_replica: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each replica's tokens/s and utilisation over repeats (:func:`replica_stats` of each
    repeat's run): ``replica``, ``tokens_per_s`` and ``utilisation`` spreads."""
    count = max((len(p) for p in per_replica), default=0)
    return [{"replica": i,
             "tokens_per_s": spread(p[i]["tokens_per_s"] for p in per_replica if len(p) > i),
             "utilisation": spread(p[i]["utilisation"] for p in per_replica if len(p) > i)}
            for i in range(count)]


def utilisation_errors(replicas: list[dict[str, Any]]) -> list[str]:
    """Descriptions of the replicas whose utilisation (of any rank) exceeds 1."""
    return [f"replica {r['replica']}: utilisation {r['max_rank_utilisation']:.4f} > 1"
            for r in replicas if r.get("max_rank_utilisation") is not None
            and r["max_rank_utilisation"] > 1 + UTILISATION_TOLERANCE]


def over_repeats(runs: list[Run], skip: int
                 ) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]], list[list[str]]]:
    """What a timed scenario measures on each repeat of one setting: the steady window
    (:func:`steady_throughput`), the per-replica numbers (:func:`replica_stats`), both empty
    for a failed run, and the utilisation errors (:func:`utilisation_errors`)."""
    windows = [steady_throughput(r, skip) if r.ok else {} for r in runs]
    per_replica = [replica_stats(r, skip) if r.ok else [] for r in runs]
    return windows, per_replica, [utilisation_errors(p) for p in per_replica]


def run_refs(runs: list[Run]) -> dict[str, list[str]]:
    """The record's pointers to the runs of a setting: their labels and their errors."""
    return {"runs": [r.label for r in runs], "errors": [r.error for r in runs if r.error]}


def aedit_period(edit_run: Run | None, interval: int) -> float:
    """A-EDiT's sync period for a comparison with EDiT: ``H`` times the median step time
    of the EDiT run's steps without a sync, simulated stalls left out (the fast replica's
    compute), so that A-EDiT syncs about as often as EDiT does; at least 0.2 s (0.1 s a
    step without a finished EDiT run)."""
    step = None
    if edit_run is not None and edit_run.ok:
        step = median(_compute_time(r) for r in edit_run.rows if "sync" not in r)
    return round(max(0.2, interval * (step or 0.1)), 3)


def _compute_time(row: dict[str, Any]) -> float | None:
    """A step row's time less its simulated stall (None where it says no step time: the
    rows were read against :data:`editrain.metrics.ROW_SCHEMA`, so a time is a number or
    ``null``)."""
    step = row.get("step_time_s")
    return None if step is None else step - (row.get("sim_stall_s") or 0.0)


def val_curve(run: Run) -> list[tuple[float, float, float]]:
    """``(tokens, wall_time_s, val_loss)`` of every evaluation, in token order (tokens and
    time 0 where the row has none). An evaluation whose loss is no finite number, or whose
    tokens or time is there but no finite number >= 0, is no measurement and left out
    (:func:`editrain.bench.stats.measured`: ``float()`` took ``true`` as 1 and parsed
    ``"512"``; a bool loss passed as a number)."""
    points = [(measured(r.get("tokens", 0)), measured(r.get("wall_time_s", 0.0)),
               measured(r.get("val_loss"), -math.inf)) for r in run.evals]
    return sorted(p for p in points if None not in p)


__all__ = ["UTILISATION_TOLERANCE", "aedit_period", "over_repeats", "rank_window",
           "replica_spreads", "replica_stats", "run_refs", "steady_throughput",
           "utilisation_errors", "val_curve"]
