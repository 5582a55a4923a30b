"""The run's record: ``metrics.jsonl``, per-rank step logs, TensorBoard files, loss plots.

``metrics.jsonl`` holds one JSON object per logged step, evaluation and event; TensorBoard
event files are optional. A round's ``sync`` entry is in the row of the step where it
ended; a round that ends between steps (those ``engine.finish(force=True)`` completes after
the last step) has a row of its own without a loss (docs/metrics.md, "Rows of
metrics.jsonl").

Stable field names of a step row: ``step``, ``tokens`` (cumulative, all ranks), ``loss``
(that step's training loss: the mean over all ranks while training is synchronous, over
the logging replica's ranks in the local phase), ``val_loss`` (when
computed, with ``val_tokens`` evaluated and ``eval_time_s``), ``lr``, ``tokens_per_s``,
``step_time_s``, ``wall_time_s`` (the run's clock of its training loop: from a job's first
evaluation and step on, continued across resumes; the start-up of a job is not in it,
see docs/metrics.md), ``train_time_s`` (wall time minus evaluation and checkpoint time).
Later fields only add to these.

Besides that global record, every rank writes ``ranks/rank{RANK}.jsonl`` (:class:`RankLog`):
one line per step with its own timings, so benchmarks can report every replica.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from editrain.errors import RunDirError
from editrain.paths import shown
from editrain.safe_io import (
    Bool,
    Field,
    Int,
    List,
    Map,
    Num,
    Obj,
    Str,
    cut_partial_line,
    make_dir,
    open_write,
    read_json,
    read_json_value,
    regular_size,
)
from editrain.tracking import open_trackers, standard_metrics

METRICS_FILE = "metrics.jsonl"
RANKS_DIR = "ranks"
CONFIG_MAX_BYTES = 1 << 20
"""The largest run ``config.toml`` a plot's legend reads its method from."""


def _clean(v: Any) -> Any:
    """JSON-safe value: NaN/Inf become null (a broken replica must not break the file)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def to_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON text of run output (``metrics.jsonl`` rows, ``summary.json``, benchmark
    results): a NaN or infinite number is written as ``null``, never as the bare ``NaN`` /
    ``Infinity`` that Python's ``json`` writes by default and strict parsers reject.

    Args:
        obj: plain data (dicts, lists, numbers, strings, None).
        **kwargs: passed on to :func:`json.dumps` (``indent``, ``separators``...).

    Returns:
        The JSON text.

    Raises:
        ValueError: a non-finite number the cleaning cannot reach (``allow_nan`` is off,
            so invalid JSON is never written).
        TypeError: an object that JSON cannot hold.
    """
    return json.dumps(_clean(obj), allow_nan=False, **kwargs)


class MetricsWriter:
    """Appends rows to ``RUN_DIR/metrics.jsonl`` and hands their scalars to the run's
    trackers (TensorBoard if installed, W&B if asked for: :mod:`editrain.tracking`).

    Every row is flushed to the operating system at once, so a worker that crashes or is
    killed loses at most the row it was writing. ``fsync`` (what only a crash of the machine
    itself needs) runs at most every ``fsync_every_s`` seconds and on :meth:`close`: on a
    busy disk one ``fsync`` costs from 0.2 to several milliseconds, which at every step put
    up to a quarter of a small model's step time on the logging rank, and through the
    syncs on every replica.

    Args:
        run_dir: the run directory.
        enabled: False on every rank but the logging rank.
        tensorboard: also write TensorBoard events when ``tensorboard`` is importable (when
            ``trackers`` is None).
        fsync_every_s: least seconds between two ``fsync`` calls (0: after every row).
        trackers: the trackers to feed (default: :func:`editrain.tracking.open_trackers`
            with ``tensorboard``); unused on a rank that does not log.
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True,
                 fsync_every_s: float = 30.0, trackers: list[Any] | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self.fsync_every_s = fsync_every_s
        self._last_fsync = time.monotonic()
        # A writer killed mid-row leaves a line without its newline: cut off, so that the
        # next row does not fuse with it. Never through a link (editrain.safe_io).
        if enabled:
            cut_partial_line(self.path, root=run_dir)
        self._file = open_write(self.path, "a", root=run_dir) if enabled else None
        self._trackers: list[Any] = []
        if enabled:
            self._trackers = (open_trackers(run_dir, tensorboard=tensorboard)
                              if trackers is None else list(trackers))

    def write(self, row: dict[str, Any]) -> None:
        """Append one row; flushed immediately so a crash loses at most this row (synced to
        the disk every ``fsync_every_s``)."""
        if self._file is None:
            return
        self._file.write(to_json(row, separators=(",", ":")) + "\n")
        self._file.flush()
        now = time.monotonic()
        if now - self._last_fsync >= self.fsync_every_s:
            os.fsync(self._file.fileno())
            self._last_fsync = now
        if self._trackers and isinstance(row.get("step"), int):
            scalars = standard_metrics(row)
            if scalars:
                for tracker in self._trackers:
                    tracker.log(scalars, row["step"])

    def close(self) -> None:
        """Close the files and the trackers."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


class RankLog:
    """Appends this rank's per-step rows to ``RUN_DIR/ranks/rank{RANK}.jsonl``.

    Rows are buffered (a step must not wait on the disk) and flushed every ``flush_every``
    rows and on :meth:`close`.

    Args:
        run_dir: the run directory.
        rank: this process's global rank.
        flush_every: rows between flushes.
    """

    def __init__(self, run_dir: str | Path, rank: int, flush_every: int = 50) -> None:
        folder = make_dir(Path(run_dir) / RANKS_DIR, root=run_dir)
        self.path = folder / f"rank{rank}.jsonl"
        cut_partial_line(self.path, root=run_dir)
        self._file = open_write(self.path, "a", root=run_dir)
        self._pending = 0
        self.flush_every = flush_every

    def write(self, row: dict[str, Any]) -> None:
        """Append one row."""
        if self._file is None:
            return
        self._file.write(to_json(row, separators=(",", ":")) + "\n")
        self._pending += 1
        if self._pending >= self.flush_every:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        """Flush and close."""
        if self._file is not None:
            self._file.close()
            self._file = None


ROW_MAX_CHARS = 1 << 20
"""The longest row of a JSON-lines file read back (editrain's rows: a few kilobytes)."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file editrain wrote: a regular file (a link is refused),
    each line parsed with :func:`editrain.safe_io.read_json_value` (bounded depth); a line
    cut off by a killed writer, one that is not a JSON object, or longer than
    :data:`ROW_MAX_CHARS` is skipped.

    Raises:
        RunDirError: the file is a link or not a regular file.
    """
    regular_size(path, error=RunDirError, what="JSON-lines file")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        while line := f.readline(ROW_MAX_CHARS + 1):
            if len(line) > ROW_MAX_CHARS:  # skipped without holding it whole
                while line and not line.endswith("\n"):
                    line = f.readline(ROW_MAX_CHARS + 1)
                continue
            try:
                row = read_json_value(line, str(path), error=ValueError)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def read_rank_logs(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Rows of every ``ranks/rank{RANK}.jsonl`` of a run, by rank (empty if none)."""
    return {int(path.stem.removeprefix("rank")): read_jsonl(path)
            for path in sorted((Path(run_dir) / RANKS_DIR).glob("rank*.jsonl"))}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of a run's ``metrics.jsonl`` (a truncated last line is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{shown(path)}: no metrics file (is {shown(run_dir)} a run "
                                "directory?)")
    return read_jsonl(path)


SUMMARY_FILE = "summary.json"
SUMMARY_MAX_BYTES = 16 << 20
"""The largest ``summary.json`` read back (a few kilobytes are written)."""

_SECONDS = Num()
"""A duration or a clock of a summary: a finite JSON number >= 0."""


class _SummaryLoss(Num):
    """A summary's loss: a finite number >= 0, ``null`` where the run has none (a NaN,
    as :func:`to_json` writes it), or JSON's ``NaN``, as an editrain before strict JSON
    output wrote that same absence (``json.dumps``): its run directories are resumed,
    benchmarked and calibrated from as they were before the schema. Infinities and
    anything but a number are still refused."""

    def __init__(self) -> None:
        super().__init__(nullable=True)

    def problem(self, value: Any) -> str | None:
        if type(value) is float and math.isnan(value):
            return None
        return super().problem(value)


RUN_SUMMARY_FIELDS: dict[str, Field] = {
    "steps": Int(), "tokens": Int(), "final_val_loss": _SummaryLoss(),
    "val_tokens": Int(), "wall_time_s": _SECONDS, "train_time_s": Num(-1e18),
    "num_syncs": Int(), "num_params": Int(), "vocab_size": Int(nullable=True),
    "method": Str(), "replicas": Int(), "shard_size": Int(), "tp_size": Int(),
    "pp_size": Int(), "steps_run": Int(), "tokens_processed": Int(), "replica": Int(),
    "healed_at": Int(nullable=True), "failed_syncs": Int(),
    "cross_replica_bytes": Map(Num())}
"""The fields of a trainer's ``summary.json`` (:meth:`editrain.train.Trainer._summary`), as
it writes them: counts JSON integers, times finite numbers (``train_time_s``, a difference
of two clocks, may round below 0), a NaN loss ``null`` (an older editrain's ``NaN`` is
read too: :class:`_SummaryLoss`)."""
GROUP_SUMMARY_SCHEMA = Obj(RUN_SUMMARY_FIELDS, required=("steps", "final_val_loss"))
"""A fault-tolerant run's replica group's own ``summary.json`` (a trainer's, which always
holds its steps and final loss: the run's summary takes them)."""
LAUNCH_EVENT_SCHEMA = Obj({"event": Str(), "replica": Int(), "attempt": Int(),
                           "exit_code": Int(-(1 << 31), 1 << 31), "time_s": _SECONDS,
                           "unix_time": _SECONDS}, required=("event",))
"""What the fault-tolerant launcher saw of a group (:class:`editrain.launch.ft` ``events``:
start, died, stopped_late; a stop has no ``unix_time``)."""
SUMMARY_SCHEMA = Obj({**RUN_SUMMARY_FIELDS, "fault_tolerance": Str(),
                      "finished_replicas": Int(), "events": List(LAUNCH_EVENT_SCHEMA),
                      "per_replica": Map(GROUP_SUMMARY_SCHEMA)})
"""A run's ``summary.json``: a trainer's (:data:`RUN_SUMMARY_FIELDS`), or a fault-tolerant
run's, which adds the launcher's events and every group's own summary by its index. Other
fields (an older or newer editrain's, a peer's) are not looked at."""


def read_summary(run_dir: str | Path, *, error: type[Exception] = ValueError,
                 schema: Obj = SUMMARY_SCHEMA) -> dict[str, Any]:
    """A run's ``summary.json``, read against ``schema``: a field a reader does arithmetic
    on that holds what editrain never writes there (``true`` tokens, a string time, an
    event without its name) is refused in one line naming the file and the field, not
    summed into a result or raised as a TypeError or KeyError deep in a reader.

    Args:
        run_dir: the run directory (or a replica group's).
        error: the exception type to raise.
        schema: what the file must be (:data:`GROUP_SUMMARY_SCHEMA` for a group's).

    Raises:
        ``error``: the file is unreadable, not JSON, or a field does not fit.
    """
    return read_json(Path(run_dir) / SUMMARY_FILE, max_bytes=SUMMARY_MAX_BYTES,
                     schema=schema, error=error, what="run summary")


_ROW_SECONDS = Num(nullable=True)
"""A duration a row logs: a finite JSON number >= 0 (``null``: not measured, as
:func:`to_json` writes a NaN)."""
_LOSS = Num(-1e18, nullable=True)
"""A loss a row logs: a finite JSON number (``null``: a NaN loss)."""
ROUND_FIELDS: dict[str, Field] = {
    "step": Int(), "launch_step": Int(), "wait_s": _ROW_SECONDS,
    "sync_time_s": _ROW_SECONDS, "rendezvous_wait_s": _ROW_SECONDS,
    "comm_time_s": _ROW_SECONDS, "link_delay_s": _ROW_SECONDS,
    "bytes_sent": Int(nullable=True), "sync_collectives": Int(nullable=True),
    "replica_steps": List(Num()), "outlier": List(List(Bool()))}
"""The fields of a row's ``sync`` entry that readers compute with, as the engine writes
them (:meth:`editrain.sync.round.Round.log_entry`): steps and counts integers, times
finite seconds, each replica's steps a number, the penalty's outlier flags a list of
true/false per replica."""
ROW_FIELDS: dict[str, Field] = {
    "step": Int(), "tokens": Int(), "loss": _LOSS, "val_loss": _LOSS, "val_tokens": Int(),
    "eval_time_s": _ROW_SECONDS, "wall_time_s": Num(), "train_time_s": Num(),
    "unix_time": Num(nullable=True), "step_time_s": _ROW_SECONDS, "compute_s": _ROW_SECONDS,
    "sim_stall_s": _ROW_SECONDS, "sync_wait_s": _ROW_SECONDS, "grad_sync_s": _ROW_SECONDS,
    "sync": Obj(ROUND_FIELDS, nullable=True)}
"""The fields of a row of ``metrics.jsonl`` or of a rank's file that readers compute with
(the benchmarks' windows, ``plan --calibrate``'s fit), as the trainer writes them
(:meth:`editrain.train.Trainer._step_row`). A row's ``replica`` is not here: a rank's
replica that is none is the rank's own (:func:`replica_of`), not a reason to skip its
rows."""
ROW_SCHEMA = Obj(ROW_FIELDS)
"""A measurement row (:func:`measured_rows`): every field of :data:`ROW_FIELDS` it has is
what editrain writes there; other fields are not looked at."""


def is_measured(row: dict[str, Any], schema: Obj = ROW_SCHEMA) -> bool:
    """Whether every field of ``row`` that ``schema`` names is what editrain writes there
    (:func:`measured_rows`)."""
    try:
        schema.check(row, "row", "", ValueError)
    except ValueError:
        return False
    return True


def measured_rows(rows: Sequence[dict[str, Any]], schema: Obj = ROW_SCHEMA
                  ) -> list[dict[str, Any]]:
    """The rows of ``rows`` whose every field a reader computes with is what editrain
    writes there (``schema``, :data:`ROW_SCHEMA` by default: steps and counts JSON
    integers, seconds finite numbers >= 0, a bool or a string never a number).

    A row with another value (``true`` tokens, ``"0.1"`` seconds, NaN, a negative time, a
    step of 9.5, a sync entry that is no object) is skipped as no measurement, not
    refused: every reader of these files skips a row it cannot read (:func:`read_jsonl` a
    line that is no JSON object, :func:`current_rows` a step that is no number), since
    the file is a log a killed writer or a hand may have left anything in. Before, the
    benchmarks subtracted a string's tokens (a TypeError), counted ``true`` as 1 token or
    second, and ``plan --calibrate``'s ``float()`` parsed ``"0.1"``.

    Args:
        rows: rows as read (in any order: the order is kept).
        schema: what a row must fit (``plan --calibrate`` adds its ``replica``).
    """
    return [row for row in rows if is_measured(row, schema)]


def replica_of(rows: Sequence[dict[str, Any]], default: int) -> int:
    """The replica a rank's rows say they belong to (their first row's ``replica``), else
    ``default``: a ``replica`` that is no integer >= 0 (``true``, ``2.7``, ``"1"``, a list)
    is no replica, as a ``rank`` that is none leaves the file's own (:func:`_rank_of`);
    ``int()`` took ``true`` as replica 1, truncated 2.7 and crashed on a list."""
    said = rows[0].get("replica") if rows else None
    return said if _is_step(said) and said >= 0 else default


def current_rows(rows: Sequence[dict[str, Any]], resume_evaluations: bool = False
                 ) -> list[dict[str, Any]]:
    """The measurement rows of a run's ``metrics.jsonl`` that hold its current history, in
    file order: events are left out, and so are rows a resumed job logged again
    (``"replayed": true``: the same computation as a row the file holds); where a later
    job's steps go back without being replays (an elastic resume, A-EDiT's, a new
    timeline's from an earlier checkpoint), its rows replace the earlier job's from that
    step on, which belong to a history the run left. An elastic resume's event (its step:
    the checkpoint's) also ends the earlier job's rows after it, those at the new job's
    first step included.

    A job's start (its :data:`JOB_START` event, at the step it resumed) also ends, at the
    job's first row of its own, what the earlier jobs logged past that step and it did not
    compute again (:func:`_left_by_a_later_job`): the rows at and after that row's step,
    and the end of the history (the rows marked :data:`END`: the rounds
    ``engine.finish(force=True)`` completed after the last step and the final evaluation;
    a later job that resumed before them and trained on completes those rounds at later
    steps, each then logged once).

    A row a resumed job computed again that the history lacked (marked
    :data:`FILLS_GAP`: the earlier job died before writing it) takes its place among the
    rows of its step, as a replay's original holds it.

    Args:
        rows: the file's rows in file order (:func:`read_metrics`).
        resume_evaluations: keep the elastic resume events that carry an evaluation (the
            global model at the resume, which continues a loss curve) among the rows.
    """
    kept: list[dict[str, Any]] = []
    resumed = _ResumePoint()
    for row in rows:
        if row.get("event") == JOB_START and _is_step(row.get("step")):
            resumed.job_started(row["step"])
            continue
        if row.get("event") == "elastic_resume" and isinstance(row.get("step"), int | float):
            kept = [r for r in kept if r["step"] <= row["step"]]
            if resume_evaluations and row.get("val_loss") is not None:
                kept.append(row)
            continue
        if "event" in row or not _is_step_number(row.get("step")):
            continue  # (a hostile row's step, text or a list, compares with no step)
        if row.get("replayed"):
            resumed.replayed(row)
            continue
        if row.get(FILLS_GAP) is True:
            resumed.replayed(row)
            kept = _with_gap_filled(kept, row)
            continue
        start = resumed.take()
        if start is not None:
            kept = _left_by_a_later_job(kept, start, row["step"])
        if kept and row["step"] < kept[-1]["step"]:
            kept = [r for r in kept if r["step"] < row["step"]]
        kept.append(row)
    return kept


def _with_gap_filled(kept: list[dict[str, Any]], row: dict[str, Any]
                     ) -> list[dict[str, Any]]:
    """``kept`` with a :data:`FILLS_GAP` row after the rows of its step and those before:
    where the earlier job would have written it (its rows up to that step are the
    history's; a replaying job's rows never go past the history's last step)."""
    at = len(kept)
    while at and kept[at - 1]["step"] > row["step"]:
        at -= 1
    return [*kept[:at], row, *kept[at:]]


class _ResumePoint:
    """Where the history that the next row of its own continues was resumed (for
    :func:`current_rows`), from the jobs' :data:`JOB_START` events since the last such row.

    Usually the latest job's start. A job that logged only replays and stopped before the
    end it replayed (killed, restarted by torchrun from a checkpoint it saved while
    replaying) and the job after it are one history from the earlier start: the checkpoint
    it saved at the earlier job's last step does not hold the rounds that job's end
    completed. A job that replayed up to its end (the same end again, with its own final
    checkpoint) leaves the history as it was: the job after it is on its own.
    """

    def __init__(self) -> None:
        self.start: int | None = None
        self.replayed_end = False
        """Whether the last replayed row was one of the end (marked :data:`END`: a round
        the end completed or the final evaluation). Not any row without a loss: an
        evaluation at the old last step or a round's own row before its step's row has
        that shape too, and the job that replayed it may not have reached its end."""

    def job_started(self, step: int) -> None:
        """A job's :data:`JOB_START` event at ``step``."""
        if self.replayed_end:
            self.start = None
        self.start = step if self.start is None else min(self.start, step)
        self.replayed_end = False

    def replayed(self, row: dict[str, Any]) -> None:
        """A row the latest job logged while replaying: a replay, or one that fills a gap
        (:data:`FILLS_GAP`)."""
        self.replayed_end = row.get(END) is True

    def take(self) -> int | None:
        """The resume point, at the first row of its own since the last (then forgotten);
        None where no job started since."""
        start, self.start = self.start, None
        self.replayed_end = False
        return start


def _is_step(value: Any) -> bool:
    """Whether ``value`` is a step number (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_step_number(value: Any) -> bool:
    """Whether ``value`` is the step of a measurement row: a finite number >= 0, not a
    bool (a negative step, which editrain never writes, would read as a later job going
    back before every step and drop the history)."""
    if isinstance(value, float):
        return math.isfinite(value) and value >= 0
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _left_by_a_later_job(kept: list[dict[str, Any]], start: int, first: int
                         ) -> list[dict[str, Any]]:
    """The current rows once a job that started after step ``start`` logs its first row
    that is no replay, at step ``first``.

    Of the earlier jobs' rows past ``start``, those that the new job computed again are
    current (its rows of them are marked replayed); two kinds it did not compute again
    belong to a history the run left:

    * those at ``first`` and later: the new job logged that step anew (a resume that
      replays nothing, such as A-EDiT's on the wall clock, even at the step where the
      earlier job's rows end);
    * the end of the history: the rows after the last one with a training loss that are
      marked :data:`END` (the rounds ``engine.finish(force=True)`` completed after the
      last step, and the final evaluation). A job that replays steps up to there and
      trains on does not end there: the rounds that end completed, it completes at later
      steps, in rows of its own. A job that resumed at their step (the final checkpoint,
      saved after them) keeps them: its start is not before them. Unmarked rows after
      the last loss stay (a job that died after an evaluation's row or a round's own row
      before its step's row: the new job's copies of them are replays), and so do those
      of a run written before the marker, as they did then.

    Args:
        kept: the current rows so far, in file order.
        start: the new job's start (its :data:`JOB_START` event's step).
        first: the step of the new job's first row that is no replay.
    """
    end = len(kept)
    while end and "loss" not in kept[end - 1]:
        end -= 1
    return [r for i, r in enumerate(kept)
            if r["step"] <= start
            or (r["step"] < first and (i < end or r.get(END) is not True))]


END = "end"
"""The field (``"end": true``) of every row the end of training writes after the last
step's row (:meth:`editrain.train.Trainer._end`): the rounds ``engine.finish(force=True)``
completes and the final evaluation. :func:`current_rows` tells the end of a history by it
(not by a row's shape: an evaluation's row or a round's own row has no loss either)."""


FILLS_GAP = "fills_gap"
"""The field (``"fills_gap": true``) of a row that a resumed job computed again while it
replayed the rows the file held (up to their last step) and that the run's current history
lacked: the earlier job died between two rows of one step (a round's own row and the
step's row) or inside its end (before the end's rounds' rows or the final evaluation's).
It is no duplicate, so it is not marked ``"replayed"``; :func:`current_rows` keeps it
among the rows of its step, not as the first row of a new history (which would end the
earlier job's rows at that step). Which rows are replays is told by what each row
records (:func:`computation_of`), not by its step alone (:class:`ReplayMarks`)."""


EVALUATION_FIELDS = ("val_loss", "val_tokens", "eval_time_s")
"""The fields an evaluation adds to a row (:meth:`editrain.evaluation.Evaluator.evaluate`):
in a row of its own, or carried in the row of the step it was taken at."""


def computation_of(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a row of ``metrics.jsonl`` is the record of, the same in a replay of it: the
    step's row (it has a loss; an evaluation or a round at that step rides in it, see
    :func:`evaluation_of`), a round in a row of its own (its index, and its fragment where
    it names one), an evaluation in a row of its own (step 0's, the final one), at the
    row's step. Not the end's mark (:data:`END`): a run an older editrain wrote lacks it."""
    step = _plain(row.get("step"))
    if "loss" in row:
        return ("step", step)
    sync = row.get("sync")
    if isinstance(sync, dict):
        return ("round", step, _plain(sync.get("sync")), _plain(sync.get("fragment")))
    if "val_loss" in row:
        return evaluation_of(row)
    return ("other", step)


def evaluation_of(row: dict[str, Any]) -> tuple[Any, ...] | None:
    """The evaluation a row records, in a row of its own or carried in its step's row: the
    model at the row's step over ``val_tokens`` tokens (a periodic evaluation over
    ``train.eval_tokens`` and the final one over ``train.final_eval_tokens`` at the same
    step are two computations where those differ, one where they do not: the trainer
    then takes one of them); None where the row carries none."""
    if "val_loss" not in row:
        return None
    return ("evaluation", _plain(row.get("step")), _plain(row.get("val_tokens")))


def _computations(row: dict[str, Any]) -> list[tuple[Any, ...]]:
    """:func:`computation_of` of a row, then the evaluation its step's row carries."""
    computation = computation_of(row)
    carried = evaluation_of(row) if computation[0] == "step" else None
    return [computation] if carried is None else [computation, carried]


def _plain(value: Any) -> Any:
    """``value`` as a key can hold it (a hostile file's list or object: its text)."""
    return value if isinstance(value, int | float | str | None) else repr(value)


class ReplayMarks:
    """How a resumed job that computes logged rows again marks its rows up to the last
    step the run's current history holds (:attr:`until`): ``"replayed": true`` on a row
    of a computation the history holds a row of (each of those matches one row), and
    :data:`FILLS_GAP` on one it lacks. Before, every row up to that step was marked
    replayed, so the rows the earlier job died before writing (a step's row after its
    round's own row, the final evaluation after the end's rounds) were in no current row.

    An evaluation carried in a step's row is a computation of its own
    (:func:`evaluation_of`): a job resumed with another ``train.eval_every`` evaluates at
    steps the earlier job did not, and its replayed step's row carried that evaluation
    into the rows readers leave out. Such a row is written as two (:meth:`mark`): the
    step's row without the evaluation, a replay, and the evaluation in a row of its own
    that fills the gap. The earlier job's evaluations stay in its rows, current.

    Args:
        history: the run's current rows when the job resumed (:func:`current_rows`).
    """

    def __init__(self, history: Sequence[dict[str, Any]]) -> None:
        steps = [r["step"] for r in history]
        self.until: int | None = max(steps) if steps else None
        """The last step of the history: the job's rows after it are its own."""
        self._unmatched = Counter(c for r in history for c in _computations(r))

    def mark(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Mark ``row`` (a measurement row the job is about to write) where it is at or
        before :attr:`until`; events and later rows are left as they are.

        Returns:
            The rows to write in its place: ``[row]``, marked; or, where ``row`` is a
            replayed step's row carrying an evaluation the history lacks, the step's row
            without it (marked replayed) and the evaluation's own row (marked
            :data:`FILLS_GAP`), ``row`` itself left unmarked.
        """
        if self.until is None or "event" in row or row.get("step", 0) > self.until:
            return [row]
        computation, *carried = _computations(row)
        if not self._take(computation):
            row[FILLS_GAP] = True
            for evaluation in carried:  # (written with it: the history holds it now)
                self._take(evaluation)
            return [row]
        if all(self._take(evaluation) for evaluation in carried):
            row["replayed"] = True
            return [row]
        return _split_evaluation(row)

    def _take(self, computation: tuple[Any, ...]) -> bool:
        """Whether the history holds a row of ``computation`` not matched yet (then it is
        matched). An evaluation is also matched by the history's evaluation at its step
        that says no ``val_tokens``: an editrain before them wrote it, and the same
        evaluation computed again now says its tokens."""
        if self._unmatched[computation] <= 0:
            computation = _without_tokens(computation)
            if computation is None or self._unmatched[computation] <= 0:
                return False
        self._unmatched[computation] -= 1
        return True


def _without_tokens(computation: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The :func:`evaluation_of` key of an evaluation whose row says no ``val_tokens`` (an
    older editrain's) at ``computation``'s step; None for any other computation."""
    if computation[0] != "evaluation" or computation[2] is None:
        return None
    return (*computation[:2], None)


def _split_evaluation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A replayed step's ``row`` and the evaluation it carries as two rows: the step's
    row without the evaluation (``"replayed": true``), then the evaluation in a row of its
    own (:data:`FILLS_GAP`), with the step's tokens and clocks, as step 0's evaluation
    row is written."""
    step_row = {k: v for k, v in row.items() if k not in EVALUATION_FIELDS}
    step_row["replayed"] = True
    evaluation = {k: row[k] for k in ("step", "tokens", *EVALUATION_FIELDS,
                                      "wall_time_s", "train_time_s") if k in row}
    evaluation[FILLS_GAP] = True
    return [step_row, evaluation]


JOB_START = "job_start"
"""The event a job writes first, to ``metrics.jsonl`` and to each rank's file: its
``step`` is where that file's numbering stood (its rank's own steps: for A-EDiT, whose
replicas count apart, neither the checkpoint's label, a progress, nor another rank's)."""


def latest_job(rows: Sequence[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]] | None:
    """``(the step it started after, the rows it wrote)`` of the latest job in one file's
    rows (file order), from its :data:`JOB_START` event; None where the file has none (a
    run of an older editrain, or a rank the latest job did not have)."""
    for i in range(len(rows) - 1, -1, -1):
        row, step = rows[i], rows[i].get("step")
        if row.get("event") == JOB_START and _is_step(step):
            return step, list(rows[i + 1:])
    return None


def latest_job_start(run_dir: str | Path) -> int:
    """The step the run's latest job started after, in the numbering of ``metrics.jsonl``'s
    rows (which are its first rank's): the ``step`` of the job's start event there
    (:func:`latest_job`). A run of an older editrain has none: the step of
    the checkpoint the job resumed (its ``from_step`` in the record's history), 0 for a job
    that started the run or a run without a record; for A-EDiT that is a label of the
    progress, not a step of the rows (its replicas count their own steps)."""
    from editrain.rundir import record_of  # (rundir reads no metrics: no cycle)

    path = Path(run_dir) / "metrics.jsonl"
    job = latest_job(read_jsonl(path)) if path.is_file() else None
    if job is not None:
        return job[0]
    record = record_of(run_dir)
    if record is None or not record.history:
        return 0
    step = record.history[-1].get("from_step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step > 0 else 0


def read_rank_steps(run_dir: str | Path, latest_job_only: bool = False
                    ) -> dict[int, list[dict[str, Any]]]:
    """The per-rank step rows of a run directory (``ranks/rank{RANK}.jsonl``), cleaned.

    Reads the files with :func:`read_rank_logs` and keeps the step rows: rows
    without a ``step`` and a ``wall_time_s`` (events), rows whose step is no number >= 0
    (a string, a bool, NaN: no measurement, as in :func:`current_rows`) and replayed rows
    of a resumed run are left out, and a later attempt's rows replace an earlier one's
    (:func:`latest_rows`).

    Args:
        run_dir: the run directory.
        latest_job_only: keep each file's rows after its last :data:`JOB_START` event
            only (:func:`latest_job`; none from a file without one).

    Returns:
        rank -> rows in step order; empty when the directory has no per-rank files.
    """
    out: dict[int, list[dict[str, Any]]] = {}
    if not (Path(run_dir) / RANKS_DIR).is_dir():
        return out
    for rank, raw in read_rank_logs(run_dir).items():
        if latest_job_only:
            job = latest_job(raw)
            raw = job[1] if job is not None else []
        rows = [r for r in raw if isinstance(r, dict) and _is_step_number(r.get("step"))
                and "wall_time_s" in r and "event" not in r and not r.get("replayed")]
        out[_rank_of(rows, rank)] = latest_rows(rows)
    return out


def _rank_of(rows: list[dict[str, Any]], file_rank: int) -> int:
    """The rank a rank file's rows say they are (their first row's ``rank``), else the
    file name's: a ``rank`` that is no integer >= 0 (``true``, ``"1"``, 1.5) is no rank
    (``int()`` made those 1)."""
    said = rows[0].get("rank") if rows else None
    return said if _is_step(said) and said >= 0 else file_rank


def latest_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last one written, in step order.

    A file appended to by a later attempt (a restarted worker going back to its last
    checkpoint, or a second run into the same directory) has steps that go back; the later
    attempt's rows replace the earlier ones from the step it restarted at.

    Args:
        rows: rows in file order.
    """
    kept: list[dict[str, Any]] = []
    for row in rows:
        while kept and kept[-1]["step"] >= row["step"]:
            kept.pop()
        kept.append(row)
    return kept


def _label(run_dir: Path) -> str:
    """A run's name in a legend: its directory's (a fault-tolerant run's replica group: the
    run's and the group's), and its method."""
    from editrain.rundir import group_index

    name = run_dir.name
    if group_index(run_dir) is not None:
        name = f"{run_dir.resolve().parent.name}/{name}"
        run_dir = run_dir.parent  # the group's config.toml is the run's
    cfg = run_dir / "config.toml"
    if cfg.is_file():
        from editrain.safe_io import read_toml

        try:  # only the legend needs it: a file that is not a run's leaves the method out
            sync = read_toml(cfg, max_bytes=CONFIG_MAX_BYTES, where=shown(cfg),
                             error=ValueError).get("sync")
        except ValueError:
            sync = None
        method = sync.get("method") if isinstance(sync, dict) else None
        if isinstance(method, str) and 0 < len(method) <= 40:
            return f"{name} ({method})"
    return name


SMOOTHING = 0.8
"""Weight of the smoothed training curve's exponential moving average (TensorBoard's and
W&B's "smoothing" slider): each point keeps 0.8 of the average before it, so the curve
averages about the last five logged steps. At the default batch the raw loss moves by
about 0.3 from one step to the next, which that average brings to about 0.1; a heavier
weight (0.9) lags the default run's fast first fall by half a nat."""


def smooth_ema(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """The debiased exponential moving average TensorBoard draws over a scalar.

    ``m_i = weight * m_(i-1) + (1 - weight) * v_i`` from ``m_(-1) = 0``, divided by
    ``1 - weight ** n`` (``n`` the finite values so far) so that the start is not pulled
    towards 0: the first point is the first value, and a constant series stays constant.
    A non-finite value is passed through and leaves the average as it was.

    Args:
        values: the series, one point per logged step.
        weight: in [0, 1): 0 draws the series itself.

    Returns:
        The smoothed series, as long as ``values``.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = weight * last + (1.0 - weight) * v
        n += 1
        out.append(last / (1.0 - weight ** n))
    return out


def loss_series(rows: Sequence[dict[str, Any]], x_key: str,
                weight: float = SMOOTHING) -> dict[str, list[float]]:
    """What a loss plot draws of one run against ``x_key`` (``tokens`` or ``wall_time_s``).

    Returns:
        ``train_x``/``train_y`` (the raw training loss of every logged step),
        ``smooth_y`` (:func:`smooth_ema` of it), ``val_x``/``val_y`` (the evaluations) and
        ``sync_x`` (where a row logged a sync: one light vertical line each).
    """
    train = [(r[x_key], r["loss"]) for r in rows if r.get("loss") is not None and x_key in r]
    val = [(r[x_key], r["val_loss"]) for r in rows
           if r.get("val_loss") is not None and x_key in r]
    return {"train_x": [x for x, _ in train], "train_y": [y for _, y in train],
            "smooth_y": smooth_ema([y for _, y in train], weight),
            "val_x": [x for x, _ in val], "val_y": [y for _, y in val],
            "sync_x": [r[x_key] for r in rows if r.get("sync") and x_key in r]}


def has_losses(run_dir: str | Path) -> bool:
    """Whether a run's ``metrics.jsonl`` holds a training or validation loss to draw."""
    s = loss_series(current_rows(read_metrics(Path(run_dir)), resume_evaluations=True),
                    "tokens")
    return bool(s["train_x"] or s["val_x"])


def plot_runs(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> list[Path]:
    """Draw loss-vs-tokens and loss-vs-time PNGs for one or more runs.

    Args:
        run_dirs: run directories to compare.
        out_dir: where to write the PNGs (default: the first run directory).

    Returns:
        The written files.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [Path(d) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else dirs[0]
    make_dir(out, root=out)  # the user's choice of directory (a link there is theirs)
    written = []
    for x_key, x_label, name in (("tokens", "tokens (all replicas)", "loss_vs_tokens.png"),
                                 ("wall_time_s", "wall time (s)", "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for d in dirs:
            label = _label(d)
            s = loss_series(current_rows(read_metrics(d), resume_evaluations=True), x_key)
            color = None
            if s["train_x"]:  # the raw loss faint, its moving average over it
                raw, = ax.plot(s["train_x"], s["train_y"], alpha=0.25, linewidth=0.8)
                color = raw.get_color()
                ax.plot(s["train_x"], s["smooth_y"], color=color, linewidth=1.4,
                        label=f"{label} train (EMA {SMOOTHING:g})")
            for i, x in enumerate(s["sync_x"]):
                ax.axvline(x, color=color or "grey", alpha=0.15, linewidth=0.8,
                           label=f"{label} syncs" if i == 0 else None)
            if s["val_x"]:
                ax.plot(s["val_x"], s["val_y"], marker="o", markersize=3, color=color,
                        linestyle="--", label=f"{label} val")
        ax.set_xlabel(x_label)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # else matplotlib warns of an empty legend
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / name
        with open_write(path, "w", binary=True) as f:  # never through a link
            fig.savefig(f, dpi=110, format="png")
        plt.close(fig)
        written.append(path)
    return written
