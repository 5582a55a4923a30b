"""A finished training run read back from its run directory (global and per-rank logs).

A run directory written by ``editrain train`` holds ``metrics.jsonl`` (rank 0: one global
row per step, evaluations, sync entries; a round completed between steps, such as by the
end's ``finish()``, in a row of its own without a loss), ``summary.json``, ``config.toml``
and, from every rank, ``ranks/rank{RANK}.jsonl``: one line per step of that rank with ``rank``,
``replica``, ``shard``, ``step`` (this replica's step count), ``tokens`` (this rank's
cumulative tokens), ``wall_time_s``, ``step_time_s``, ``compute_s``, ``sync_wait_s``,
``grad_sync_s`` and ``sim_stall_s`` when a simulated stall or slowdown happened.
Evaluation time is in no row's ``step_time_s``.

The per-rank readers (:func:`read_rank_steps`, :func:`latest_rows`) live in
:mod:`editrain.metrics`, beside ``current_rows``, so that ``editrain plan --calibrate``
reads a run as the benchmarks do; they are re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from editrain.metrics import (
    latest_rows,
    measured_rows,
    read_rank_steps,
    read_summary,
    replica_of,
)
from editrain.safe_io import read_toml_value

STEP_ROW_KEYS = ("step", "tokens", "wall_time_s")
"""What a step's row of ``metrics.jsonl`` (one with a training loss) holds for the
throughput window to time it (every row the trainer writes has them)."""


@dataclass
class Run:
    """One finished (or failed) training run and what the scenarios read from it."""

    label: str
    run_dir: Path
    overrides: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Step rows of ``metrics.jsonl`` (those with a training loss), in step order."""
    sync_rows: list[dict[str, Any]] = field(default_factory=list)
    """Rows of ``metrics.jsonl`` that hold a round and no training loss: the rounds that
    ``finish()`` completed after the last step (and any but the last of several that
    ended at one step), in file order. Their time is in no step's row."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """Rows holding a validation loss (including the step-0 and final evaluations)."""
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per-rank step rows from ``ranks/rank{RANK}.jsonl``, by rank, in step order (empty
    when the trainer wrote none)."""
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved configuration the run wrote to ``config.toml``."""
    launch_s: float = 0.0
    """Wall time of the whole launch (process start-up included)."""
    error: str | None = None
    load_before: float | None = None
    """The machine's 1-minute load average just before the run started."""
    retried: list[str] = field(default_factory=list)
    """The errors of earlier attempts that were run again (a peer's hung run; see
    :func:`editrain.bench.peers.run_torchft`)."""

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

    @property
    def initial_val_loss(self) -> float | None:
        """The validation loss of the initial model (the step-0 evaluation), if logged."""
        for r in self.evals:
            v = r.get("val_loss")
            if r.get("step") == 0 and isinstance(v, int | float) and math.isfinite(v):
                return float(v)
        return None

    def replicas(self) -> dict[int, list[int]]:
        """Replica index -> the ranks that logged for it (from the per-rank files); a rank
        whose rows say no replica, or one that is no integer >= 0, is its own
        (:func:`editrain.metrics.replica_of`)."""
        out: dict[int, list[int]] = {}
        for rank, rows in sorted(self.ranks.items()):
            out.setdefault(replica_of(rows, rank), []).append(rank)
        return out

    def sync_entries(self) -> list[dict[str, Any]]:
        """Every round's sync entry, in the order the rounds ended: those the step rows
        carry and those of :attr:`sync_rows` (for what a round did, such as its replicas'
        steps or its outlier flags; its time is :meth:`timed_syncs`'s).

        By the step each ended at, and at one step by the round's index: several rounds
        that end at one step have rows of their own before the step's row, which carries
        the last of them (a sort by step alone put that one first)."""
        rows = sorted((r for r in (*self.rows, *self.sync_rows)
                       if isinstance(r.get("sync"), dict)),
                      key=lambda r: (r["step"], _round_index(r["sync"])))
        return [r["sync"] for r in rows]

    def timed_syncs(self) -> list[tuple[int, dict[str, Any]]]:
        """``(row index, sync entry)`` of the syncs whose time is inside the step rows.

        A blocking sync (``sync``, ``post_local_sgd``, ``diloco``) runs inside the step that
        triggers it. A layer-wise sync runs in the forward of the *next* step (its entry's
        ``step`` is the row's step - 1); when an evaluation or the end of the run comes
        first, ``finish()`` runs it between two steps instead, outside every row's
        ``step_time_s`` and ``wall_time_s`` (entry ``step`` == row ``step``): such syncs
        are left out here.
        """
        return [(i, r["sync"]) for i, r in enumerate(self.rows)
                if isinstance(r.get("sync"), dict)
                and not (self.layerwise and r["sync"].get("step") == r.get("step"))]


def _round_index(entry: dict[str, Any]) -> float:
    """A sync entry's round index (``sync``), for the order of rounds ending at one step;
    one without a number after those with one, in the order given."""
    index = entry.get("sync")
    return index if isinstance(index, int | float) and not isinstance(index, bool) \
        else math.inf


def read_run(label: str, run_dir: Path, overrides: dict[str, Any], launch_s: float = 0.0,
             error: str | None = None) -> Run:
    """Load whatever a run directory holds into a :class:`Run` (its fields: the arguments);
    ``error`` is set when there is no ``summary.json``.

    The rows of ``metrics.jsonl`` and of the rank files are read against one schema
    (:func:`editrain.metrics.measured_rows`, :data:`editrain.metrics.ROW_SCHEMA`): a row
    whose tokens, clock, seconds or sync entry is not what editrain writes (``"512"``
    tokens, a ``true`` time, a list of outlier flags that are no lists) is no measurement
    and left out, so every scenario computes with numbers only. Before, the throughput
    window subtracted a string's tokens (a TypeError) and counted ``true`` as 1.

    Raises:
        ValueError: ``summary.json`` or ``config.toml`` is not what editrain writes (one
            line naming the file and the field: :data:`editrain.metrics.SUMMARY_SCHEMA`),
            as the record of the results is refused (:func:`editrain.bench.results.load_record`).
    """
    from editrain.metrics import current_rows, read_metrics

    run = Run(label=label, run_dir=run_dir, overrides=overrides, launch_s=launch_s, error=error)
    if (run_dir / "metrics.jsonl").is_file():
        rows = measured_rows(current_rows(read_metrics(run_dir)))
        run.rows = sorted((r for r in rows if r.get("loss") is not None
                           and all(key in r for key in STEP_ROW_KEYS)),
                          key=lambda r: r["step"])
        run.sync_rows = [r for r in rows if r.get("loss") is None
                         and isinstance(r.get("sync"), dict)]
        run.evals = [r for r in rows if r.get("val_loss") is not None]
    run.ranks = {rank: measured_rows(rows) for rank, rows in read_rank_steps(run_dir).items()}
    if (run_dir / "summary.json").is_file():
        run.summary = read_summary(run_dir)
    if (run_dir / "config.toml").is_file():
        run.config = read_toml_value((run_dir / "config.toml").read_text(),
                                     str(run_dir / "config.toml"), error=ValueError)
    if run.error is None and not run.summary:
        run.error = "no summary.json (the run did not finish)"
    return run


__all__ = ["Run", "latest_rows", "read_rank_steps", "read_run"]
