"""Experiment trackers, TensorBoard and Weights & Biases, fed under standard names.

They get the rows of ``metrics.jsonl`` under standard names for local SGD
(:data:`STANDARD_METRICS`, documented in ``docs/metrics.md``).

A row of ``metrics.jsonl`` is editrain's own record; a tracker gets :func:`standard_metrics`
of it: flat scalars named ``train/...``, ``val/...``, ``sync/...``, ``comm/...`` and
``ft/...``, one value per replica where the row holds one (``sync/pseudo_grad_norm/replica1``).
Only the logging rank writes them, as it writes ``metrics.jsonl``: no collective is added.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import Any

from editrain.errors import RunDirError
from editrain.safe_io import make_dir, read_bytes, write_atomic

WANDB_MODES = ("off", "offline", "online")
"""``train.wandb``: no W&B run, a run written to the run directory only (``wandb sync``
uploads it later), or a run streamed to the W&B server."""

RUN_ID_FILE = "wandb-run-id"
"""In the run directory: the W&B run's id, so that a resumed run continues the same W&B
run."""

STANDARD_METRICS: tuple[tuple[str, str], ...] = (
    ("train/loss", "training loss of the logged step (the logging rank's replica)"),
    ("train/lr", "inner learning rate"),
    ("train/tokens", "tokens trained so far, all replicas"),
    ("train/tokens_per_s", "tokens per second of the step, all replicas"),
    ("train/step_time_s", "wall time of the step"),
    ("train/compute_s", "forward, backward and optimizer time of the step"),
    ("train/exposed_comm_s", "time the step waited for communication (a sync's exposed "
                             "part and, synchronous or in warm-up, the gradient all-reduce)"),
    ("sim/stall_s", "simulated stall of the step (sim.random_stall, stragglers)"),
    ("val/loss", "validation loss"),
    ("val/tokens", "validation tokens it was measured on"),
    ("sync/index", "number of the sync (round) logged at this step"),
    ("sync/units", "units (layers) the round synchronised"),
    ("sync/staleness_steps", "steps between the round's launch and its merge (0: merged "
                             "where it was launched; streaming, overlap and eager rounds "
                             "more)"),
    ("sync/staleness_rounds", "rounds launched after this one and before its merge (the "
                              "age of the contribution when it entered the outer "
                              "optimizer)"),
    ("train/loss/replica{r}", "replica r's mean training loss over its steps since its "
                              "previous round (logged with the round: each replica's own "
                              "loss, at no extra collective where the round gathers "
                              "statistics)"),
    ("sync/pseudo_grad_norm/replica{r}", "norm of replica r's pseudo-gradient over the "
                                         "round's units"),
    ("sync/weight/replica{r}", "replica r's weight in the round, mean over its units "
                               "(the penalty's softmax; 1/replicas without it)"),
    ("sync/outliers", "(replica, unit) pairs the penalty dropped as anomalous"),
    ("sync/clipped_units", "units whose averaged pseudo-gradient was clipped"),
    ("sync/clip_coef_min", "smallest clip coefficient of the round (1: nothing clipped)"),
    ("comm/bytes_sent", "bytes this rank sent across replicas in the round"),
    ("comm/compression", "bytes sent in the round per byte of an fp32 ring all-reduce "
                         "of its pseudo-gradients (1: fp32; int8 about 0.26 and the "
                         "default topk2 under 0.01 with 2 replicas)"),
    ("comm/collectives", "cross-replica collectives of the round"),
    ("comm/time_s", "time the round's collectives took (behind the compute or not)"),
    ("comm/exposed_s", "time the training thread waited for the round"),
    ("comm/hidden", "fraction of the round's work hidden behind the compute"),
    ("ft/quorum_size", "replica groups in the round's quorum (--ft)"),
    ("ft/committed", "1 when the round committed, 0 when it was dropped (--ft)"),
    ("ft/healed", "1 when this replica group healed from a peer in the round (--ft)"),
)
"""Every name :func:`standard_metrics` can produce, with its meaning (``{r}``: a replica)."""

_STEP_FIELDS = {"loss": "train/loss", "lr": "train/lr", "tokens": "train/tokens",
                "tokens_per_s": "train/tokens_per_s", "step_time_s": "train/step_time_s",
                "compute_s": "train/compute_s", "sim_stall_s": "sim/stall_s",
                "val_loss": "val/loss", "val_tokens": "val/tokens"}
_SYNC_FIELDS = {"sync": "sync/index", "units": "sync/units", "bytes_sent": "comm/bytes_sent",
                "sync_collectives": "comm/collectives", "comm_time_s": "comm/time_s",
                "wait_s": "comm/exposed_s", "hidden": "comm/hidden",
                "quorum_size": "ft/quorum_size", "compression": "comm/compression",
                "staleness": "sync/staleness_rounds"}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def standard_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The scalars of one ``metrics.jsonl`` row under their standard names (see
    :data:`STANDARD_METRICS`); an event row (checkpoint, restart) gives none.

    Args:
        row: a step row (with its ``sync`` entry, if a round ended at the step), a
            round's own row (a round that ended between steps) or an evaluation row.
    """
    if "event" in row:
        return {}
    out: dict[str, float] = {}
    for key, name in _STEP_FIELDS.items():
        if _number(row.get(key)):
            out[name] = float(row[key])
    if "loss" in row and any(_number(row.get(k)) for k in ("sync_wait_s", "grad_sync_s")):
        out["train/exposed_comm_s"] = float((row.get("sync_wait_s") or 0.0)
                                            + (row.get("grad_sync_s") or 0.0))
    sync = row.get("sync")
    if isinstance(sync, dict):
        out.update(_sync_metrics(sync))
    return out


def _sync_metrics(s: dict[str, Any]) -> dict[str, float]:
    out = {name: float(s[key]) for key, name in _SYNC_FIELDS.items() if _number(s.get(key))}
    if _number(s.get("step")):
        launch = s.get("launch_step")
        out["sync/staleness_steps"] = float(s["step"] - launch) if _number(launch) else 0.0
    for r, loss in enumerate(s.get("replica_loss") or []):
        if _number(loss):
            out[f"train/loss/replica{r}"] = float(loss)
    for r, per_unit in enumerate(s.get("norms") or []):
        values = [v for v in per_unit if _number(v)]
        if values:
            out[f"sync/pseudo_grad_norm/replica{r}"] = math.sqrt(sum(v * v for v in values))
    for r, per_unit in enumerate(s.get("weights") or []):
        values = [v for v in per_unit if _number(v)]
        if values:
            out[f"sync/weight/replica{r}"] = sum(values) / len(values)
    if s.get("outlier") is not None:
        out["sync/outliers"] = float(sum(bool(v) for per in s["outlier"] for v in per))
    clip = [v for v in s.get("clip") or [] if _number(v)]
    if clip:
        out["sync/clipped_units"] = float(sum(v < 1.0 for v in clip))
        out["sync/clip_coef_min"] = float(min(clip))
    if isinstance(s.get("committed"), bool):
        out["ft/committed"] = float(s["committed"])
    if isinstance(s.get("healed"), bool):
        out["ft/healed"] = float(s["healed"])
    return out


class TensorBoardTracker:
    """TensorBoard events in ``RUN_DIR/tb`` (when ``tensorboard`` is installed)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Its files are opened by name: the directory is checked (editrain.safe_io).
        self._writer = SummaryWriter(str(make_dir(run_dir / "tb", root=run_dir)))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run: its files in the run directory (``RUN_DIR/wandb``, unless
    ``WANDB_DIR`` says otherwise), its id kept in ``RUN_DIR/wandb-run-id`` so that a resumed
    run continues it.

    Args:
        run_dir: the run directory.
        mode: ``offline`` or ``online``; ``WANDB_MODE``, if set, wins (W&B's own
            convention).
        project: the W&B project (``WANDB_PROJECT``, if set, wins).
        config: the run's configuration, recorded with the run.
        quiet: no W&B messages on the terminal.
    """

    def __init__(self, run_dir: Path, mode: str, project: str, config: dict[str, Any],
                 quiet: bool = False) -> None:
        import wandb

        id_file = run_dir / RUN_ID_FILE
        run_id = (read_bytes(id_file, 256, error=RunDirError, what="W&B run id").decode(
            "ascii", "replace").strip() if os.path.lexists(id_file) else uuid.uuid4().hex[:8])
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or project,
            mode=os.environ.get("WANDB_MODE") or mode, id=run_id, resume="allow",
            name=run_dir.name, config=config,
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            settings=wandb.Settings(console="off", silent=quiet))
        write_atomic(id_file, run_id + "\n", root=run_dir)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def open_trackers(run_dir: str | Path, tensorboard: bool = True, wandb: str = "off",
                  wandb_project: str = "editrain", config: dict[str, Any] | None = None,
                  quiet: bool = False) -> list[Any]:
    """The trackers of a run's logging rank: TensorBoard when it is installed (and
    ``tensorboard``), W&B when ``wandb`` is not ``off``.

    Args:
        run_dir: the run directory.
        tensorboard: write TensorBoard events if ``tensorboard`` is importable.
        wandb: ``train.wandb`` (:data:`WANDB_MODES`).
        wandb_project: ``train.wandb_project``.
        config: the run's configuration as plain data (recorded by W&B).
        quiet: no W&B messages on the terminal.
    """
    run_dir = Path(run_dir)
    trackers: list[Any] = []
    if tensorboard:
        try:
            trackers.append(TensorBoardTracker(run_dir))
        except Exception:  # tensorboard is an optional extra
            pass
    if wandb != "off":
        trackers.append(WandbTracker(run_dir, wandb, wandb_project, config or {}, quiet))
    return trackers


__all__ = ["RUN_ID_FILE", "STANDARD_METRICS", "TensorBoardTracker", "WANDB_MODES",
           "WandbTracker", "open_trackers", "standard_metrics"]
