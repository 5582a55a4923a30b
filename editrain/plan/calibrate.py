"""Calibration: compute speed and the link's bandwidth and latency, fitted to measured runs.

From each run directory (``metrics.jsonl``, ``ranks/rank{RANK}.jsonl``, ``config.toml``),
its latest job's steps and settings only (a run resumed elastically ran its earlier jobs
on another layout; :func:`job_rows`), with the vocabulary the run's tokenizer really has
(:func:`run_vocab_size`):

* compute per step: the mean ``compute_s`` of the fastest replica's steps after the first
  ``skip`` (the replica-internal collectives are inside it; the mean, since a loaded
  machine's step times have a long tail that the throughput pays for), split into the
  compute of a step with no round beside it and the slowdown per round that runs beside
  the compute (the communication thread's CPU work; :func:`fit_compute`): across runs
  whose settings launch such rounds at different rates, a least-squares line of the
  runs' mean compute against their rounds per step; with one rate, within the runs, the
  steps a round ran beside against the others;
* the step overhead: the median over steps without a sync of the ``train_time_s`` advance
  minus the step's compute, sync wait and gradient sync (logging, the step boundary; the
  step's data loading and optimizer step are in its compute: ``Trainer.train_step``);
* the replicas' speeds: each replica's mean busy time (``compute_s`` plus a simulated
  slowdown) over the fastest one's (a straggler spread);
* the link: every sync row gives ``comm_time_s`` (seconds inside the round's collectives,
  less the time the logging rank waited there for ranks that launched the round later:
  :func:`peer_lag_s`), ``sync_collectives`` and ``bytes_sent`` (this rank's bytes; a node
  sends its ``S`` ranks' bytes over its one link). A least-squares fit of
  ``comm_time_s = collectives * latency + node_bytes / bandwidth`` (both >= 0) over all
  the runs' rounds gives the effective latency per collective and bandwidth. When every
  round has the same bytes and collectives (one setting), the two cannot be told apart:
  the latency is then taken as given (``latency_s``, default 0) and the bandwidth fitted.

The compute per step is the calibrated job's: the cluster names that job's FLOPs per step
and GPUs per replica (:meth:`Calibration.measured_job`), so that a plan of another model,
batch or layout converts it at the same achieved FLOP/s per GPU
(:func:`editrain.plan.model.measured_scale`); the other fitted numbers carry over as they
are (:meth:`Calibration.cluster` says why).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from editrain.errors import ConfigError, plain_count, plain_scalar, spelled
from editrain.metrics import (
    ROW_FIELDS,
    current_rows,
    latest_job,
    latest_job_start,
    measured_rows,
    read_jsonl,
    read_rank_steps,
    read_summary,
)
from editrain.paths import shown
from editrain.plan.inputs import GBIT, SHAPE_FIELDS, Cluster, MethodSpec, ModelSpec
from editrain.plan.model import model_shape, step_flops
from editrain.rundir import list_checkpoints, read_marker
from editrain.safe_io import Int, Obj, read_toml


@dataclass
class RunSample:
    """What one run directory contributes to a calibration."""

    run_dir: str
    method: MethodSpec
    model: ModelSpec
    replicas: int
    shard_size: int
    compute_s: float
    """Mean compute seconds per step of the fastest replica."""
    overhead_s: float
    """Seconds per step outside compute, sync waits and gradient syncs."""
    factors: list[float]
    """Each replica's mean busy time (compute + simulated slowdown) over the fastest one's
    mean compute."""
    syncs: list[tuple[float, float, float]]
    """``(collectives, node bytes, comm_time_s)`` per sync round."""
    link_delays: list[float] = field(default_factory=list)
    """The simulated link's share of each round's ``comm_time_s`` (``link_delay_s``; 0
    without a simulated link)."""
    sim: dict[str, Any] = field(default_factory=dict)
    """The run's ``[sim]`` options (the simulated link, for comparison)."""
    quiet_compute_s: float | None = None
    """Mean compute seconds of the fastest replica's steps with no round beside them
    (None: every step had one)."""
    rounds_per_step: float = 0.0
    """Rounds that ran beside the compute per step of the fastest replica (counted in the
    run; about :attr:`MethodSpec.overlapping_rounds_per_step`)."""


@dataclass
class Calibration:
    """The fitted numbers.

    Attributes:
        step_time_s: compute seconds per step of the fastest replica with no round running
            beside it (:func:`fit_compute`).
        step_overhead_s: seconds per step outside compute and communication.
        bandwidth_bytes_per_s: effective link bandwidth (None: no sync rounds to fit).
        latency_s: effective latency per collective.
        straggler_spread: slowest replica's compute over the fastest's, minus 1.
        residual_rms_s: root-mean-square error of the link fit per round.
        rounds: sync rounds fitted.
        latency_fitted: whether the latency was fitted (False: taken as given).
        samples: the runs.
        own_bandwidth_bytes_per_s: the machine's own per-byte cost beyond a simulated
            link (``comm_time_s - link_delay_s``, less rank 0's wait for late ranks), as a
            bandwidth; None without one.
        own_latency_s: the machine's own cost per collective beyond a simulated link.
        overlap_cpu_s: compute seconds a round running beside the compute adds (the
            communication thread's CPU work; :func:`fit_compute`).
        overlap_fit: how it was fitted: ``across settings``, ``within runs`` or ``none``
            (no run had such rounds).
        pipeline_factor: the runs' pipelined step over :attr:`step_time_s` (the bubble
            and the stages' imbalance taken out; 1 without pipeline stages).
    """

    step_time_s: float
    step_overhead_s: float
    bandwidth_bytes_per_s: float | None
    latency_s: float
    straggler_spread: float
    residual_rms_s: float
    rounds: int
    latency_fitted: bool
    samples: list[RunSample]
    own_bandwidth_bytes_per_s: float | None = None
    own_latency_s: float = 0.0
    overlap_cpu_s: float = 0.0
    overlap_fit: str = "none"
    pipeline_factor: float = 1.0

    def with_link(self, bandwidth_bytes_per_s: float | None, latency_s: float) -> dict[str, Any]:
        """Cluster fields for another simulated link on the same machine: the link's
        per-byte and per-collective costs plus the machine's own (fitted beyond the
        simulated link of the calibration runs).

        Args:
            bandwidth_bytes_per_s: the simulated link's bandwidth (None: unlimited).
            latency_s: its latency per message.

        Returns:
            ``inter_node_gbps`` and ``inter_node_latency_ms`` for :meth:`cluster`.
        """
        per_byte = (1.0 / bandwidth_bytes_per_s if bandwidth_bytes_per_s else 0.0) + (
            1.0 / self.own_bandwidth_bytes_per_s if self.own_bandwidth_bytes_per_s else 0.0)
        gbps = 1.0 / per_byte / GBIT if per_byte > 0 else 1e6
        return {"inter_node_gbps": gbps,
                "inter_node_latency_ms": (latency_s + self.own_latency_s) * 1000.0}

    def measured_job(self) -> tuple[float, int]:
        """``(FLOPs per step of one replica, GPUs per replica)`` of the job the compute
        per step was measured on: the first run's (the runs share one model and layout;
        :func:`calibrate`). With them a plan converts :attr:`step_time_s` to another
        model, batch or layout (:func:`editrain.plan.model.measured_scale`)."""
        first = self.samples[0]
        return (step_flops(model_shape(first.model), first.model),
                first.method.pp * first.shard_size * first.method.tp)

    def cluster(self, **changes: Any) -> Cluster:
        """The calibrated cluster: one replica per node (the runs' layout), the measured
        step time and the job it was measured on (``step_time_flops``,
        ``step_time_gpus``: another job planned on it gets the step time scaled), the
        overhead, the fitted link (``latency_per = "collective"``: the latency was fitted
        per collective).

        The overhead per step and the compute a round beside it adds are taken as they
        are for any job: the overhead is the step boundary's bookkeeping (logging, the
        sync engine's step), no work on the model; the rounds' CPU cost was measured to
        follow the rounds, not their bytes (``docs/planning.md``, Assumptions and
        limits). The link is fitted per byte and per collective, which the plan counts
        for the planned model itself.

        Args:
            changes: fields to replace (e.g. ``straggler_spread``).
        """
        first = self.samples[0]
        gbps = (self.bandwidth_bytes_per_s / GBIT if self.bandwidth_bytes_per_s
                else 1e6)  # no rounds measured: an unlimited link
        flops, gpus = self.measured_job()
        data: dict[str, Any] = dict(
            nodes=first.replicas, gpus_per_node=gpus,
            inter_node_gbps=gbps, inter_node_latency_ms=self.latency_s * 1000.0,
            latency_per="collective", step_time_s=self.step_time_s,
            step_time_flops=flops, step_time_gpus=gpus,
            step_overhead_s=self.step_overhead_s, straggler_spread=self.straggler_spread,
            overlap_cpu_s=self.overlap_cpu_s)
        data.update(changes)
        return Cluster(**data)

    def to_toml(self) -> str:
        """The calibrated ``[cluster]`` table (and the first run's ``[model]``) as TOML."""
        c = self.cluster()
        m = self.samples[0].model
        lines = ["# calibrated by `editrain plan --calibrate` from "
                 + ", ".join(s.run_dir for s in self.samples), "[cluster]"]
        for key in ("nodes", "gpus_per_node", "inter_node_gbps", "inter_node_latency_ms",
                    "latency_per", "step_time_s", "step_time_flops", "step_time_gpus",
                    "step_overhead_s", "straggler_spread", "overlap_cpu_s"):
            lines.append(f"{key} = {_toml_value(getattr(c, key))}")
        lines += ["", "[model]"]
        for key in ("preset", "hf_config", "init_from", "vocab_size", *SHAPE_FIELDS,
                    "seq_len", "batch_size", "dtype"):
            v = getattr(m, key)
            if v is not None:
                lines.append(f"{key} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _get(cfg: dict[str, Any], section: str, key: str, default: Any) -> Any:
    v = cfg.get(section, {}).get(key, default)
    return default if v == "none" else v


def _option_count(cfg: dict[str, Any], section: str, key: str, default: int,
                  least: int = 1) -> int:
    """``[section] key`` of a run's ``config.toml`` as the count training read: a TOML
    integer of at least ``least`` (``true``, ``2.5``, ``"4"`` are refused naming the
    option, never coerced by ``int()``: the run directory is a file anyone may have
    edited)."""
    return plain_count(_get(cfg, section, key, default), f"{section}.{key}", least)


def _flag(cfg: dict[str, Any], section: str, key: str, default: bool | None) -> bool | None:
    """``[section] key`` of a run's ``config.toml`` as true or false (None where unset and
    ``default`` is None); a number or a string is refused naming the option (``bool()``
    made the text "false" true)."""
    value = _get(cfg, section, key, default)
    return None if value is None else plain_scalar(value, bool, f"{section}.{key}")


def _replicas(cfg: dict[str, Any]) -> int:
    per_replica = (_option_count(cfg, "dist", "shard_size", 1) * _option_count(cfg, "dist", "tp_size", 1)
                   * _option_count(cfg, "dist", "pp_size", 1))
    return max(1, _nproc(cfg, per_replica) // per_replica)


def _nproc(cfg: dict[str, Any], default: int) -> int:
    return _option_count(cfg, "dist", "nproc", default)


def read_config(run_dir: str | Path) -> tuple[MethodSpec, ModelSpec]:
    """The method setting and the model of a run's latest job, from its ``config.toml``
    (every job writes its own there): the model training built, its shape overrides,
    ``model.hf_config`` or ``model.init_from`` included, with the vocabulary the run's
    tokenizer has (:func:`run_vocab_size`; a Hugging Face config's own for a model read
    from one).

    Args:
        run_dir: a directory written by ``editrain train``.

    Raises:
        ConfigError: no ``config.toml``.
    """
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(f"plan: {shown(run_dir)} holds no config.toml")
    cfg = _read_toml(path)
    try:
        method, model = _settings(cfg)
    except ConfigError as e:  # e.g. a model.hf_config moved since, or relative elsewhere
        raise ConfigError(f"plan: {shown(path)}: {e}") from None
    if model.preset is None:  # the model's vocabulary is its config.json's
        return method, model
    return method, dataclasses.replace(model, vocab_size=run_vocab_size(run_dir, cfg))




def run_vocab_size(run_dir: str | Path, cfg: dict[str, Any]) -> int | None:
    """The vocabulary the run trained with: its tokenizer's, which a trained BPE makes
    smaller than ``data.vocab_size`` where the corpus has fewer distinct pieces (347 of
    512 asked for on a small corpus).

    Read from ``summary.json`` (the trainer's ``vocab_size``), else from the newest
    checkpoint's marker (a run that has not finished a job); the configured
    ``data.vocab_size`` only for a run with neither (an editrain older than both).

    Args:
        run_dir: the run directory.
        cfg: its ``config.toml``.
    """
    d = Path(run_dir)
    if (d / "summary.json").is_file():
        summary = read_summary(d, error=ConfigError)  # editrain.metrics.SUMMARY_SCHEMA
        if _count(summary.get("vocab_size")):
            return summary["vocab_size"]
    found = list_checkpoints(d)
    if found:
        marker = read_marker(found[-1])  # checked: vocab_size a positive integer or null
        if marker.get("vocab_size") is not None:
            return marker["vocab_size"]
    return _get(cfg, "data", "vocab_size", None)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def job_rows(run_dir: Path, world: int
             ) -> tuple[int, list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """The rows of the run's latest job: ``(the step it started after, its rows of
    metrics.jsonl, its per-rank rows by data rank)``.

    The files hold every job's rows. Those of the current history are the readers' own
    (:func:`editrain.metrics.current_rows`, :func:`editrain.metrics.read_rank_steps`);
    of them, the latest job's are the steps after the one it resumed from
    (:func:`editrain.metrics.latest_job_start`), and its ranks the ``world`` data ranks of
    its layout: a rank of an earlier, larger layout may have logged later steps on a
    timeline the job left.

    Each file's rows of the latest job are those after its start event
    (:func:`editrain.metrics.latest_job`), which numbers them as that file does (A-EDiT's
    replicas count their own steps). A run of an older editrain has no such event: its
    rows are those after the step of the checkpoint the job resumed.

    Args:
        run_dir: the run directory.
        world: the latest job's processes (``dist.nproc``: every rank writes a file).
    """
    logged = read_jsonl(run_dir / "metrics.jsonl")
    job = latest_job(logged)
    if job is not None:
        start, own = job
        rows = [r for r in own if "event" not in r and isinstance(r.get("step"), int)]
        ranks = {rank: got for rank, got in read_rank_steps(run_dir, latest_job_only=True)
                 .items() if rank < world}
        return start, rows, ranks
    start = latest_job_start(run_dir)
    rows = [r for r in current_rows(logged) if r["step"] > start]
    ranks = {rank: [r for r in got if r["step"] > start]
             for rank, got in read_rank_steps(run_dir).items() if rank < world}
    return start, rows, ranks


ROW_SCHEMA = Obj({**ROW_FIELDS, "replica": Int(hi=1 << 20)})
"""The rows the calibration measures (:func:`editrain.metrics.measured_rows`): every field
a reader of a run's rows computes with (:data:`editrain.metrics.ROW_FIELDS`, as the
benchmarks read them), and a rank's ``replica``, by which its compute is grouped."""


CONFIG_MAX_BYTES = 4 << 20
"""The largest ``config.toml`` of a run directory read (a few kilobytes are written)."""


def _read_toml(path: Path) -> dict[str, Any]:
    """A run's ``config.toml``: a regular file within :data:`CONFIG_MAX_BYTES` (a link is
    not followed), parsed; one :class:`ConfigError` line naming it otherwise."""
    return read_toml(path, max_bytes=CONFIG_MAX_BYTES, where=f"plan: {shown(path)}", option="plan",
                     error=ConfigError, what="run configuration")


def _settings(cfg: dict[str, Any]) -> tuple[MethodSpec, ModelSpec]:
    """The :class:`MethodSpec` and :class:`ModelSpec` of a run's resolved configuration."""
    S = _option_count(cfg, "dist", "shard_size", 1)
    tp = _option_count(cfg, "dist", "tp_size", 1)
    sync = cfg.get("sync", {})
    method_name = sync.get("method", "edit")
    sync_time = _get(cfg, "sync", "local_sgd_sync_time", None)
    method = MethodSpec(
        method=method_name, H=_option_count(cfg, "sync", "local_sgd_sync_interval", 32),
        fragments=_option_count(cfg, "sync", "fragments", 1),
        overlap=_option_count(cfg, "sync", "overlap_steps", 0, least=0),
        eager=sync.get("merge") == "eager",
        codec=sync.get("comm_dtype", "fp32") if method_name not in (
            "sync", "post_local_sgd") else "fp32",
        error_feedback=_flag(cfg, "sync", "error_feedback", True),
        cpu_offload=_flag(cfg, "sync", "cpu_offload", False),
        layerwise=_flag(cfg, "sync", "layerwise", method_name in ("edit", "aedit")),
        sync_time_s=plain_scalar(sync_time, float, "sync.local_sgd_sync_time")
        if method_name == "aedit" and sync_time is not None else None,
        shard_size=S, tp=tp, ft=_get(cfg, "dist", "fault_tolerance", "none") == "torchft",
        **_pipeline_settings(cfg))
    train = cfg.get("train", {})
    model = ModelSpec(
        **_model_source(cfg),
        seq_len=_option_count(cfg, "train", "seq_len", 64),
        batch_size=_option_count(cfg, "train", "batch_size", 8) * S
        * _option_count(cfg, "train", "gradient_accumulation_steps", 1),
        dtype=train.get("precision", "fp32") if train.get("precision") in ("fp32", "bf16")
        else "fp32")

    return method, model


def _pipeline_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`MethodSpec` pipeline fields of a run's ``[dist]`` section (none without
    stages: training ignores the others then)."""
    pp = _option_count(cfg, "dist", "pp_size", 1)
    if pp == 1:
        return {}
    return {"pp": pp, "pp_schedule": _get(cfg, "dist", "pp_schedule", "1f1b"),
            "pp_microbatches": _option_count(cfg, "dist", "pp_microbatches", 0, least=0),
            "pp_stages_per_rank": _option_count(cfg, "dist", "pp_stages_per_rank", 1)}


def _model_source(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelSpec` fields of the model the run trained, from its ``[model]``
    section as training reads it: a ``model.hf_config`` file or a ``model.init_from``
    directory (its shape and vocabulary are the file's), else the preset with every
    shape override (``model.n_layers``, ``model.dim``...) and ``data.vocab_size``."""
    files = {name: _get(cfg, "model", name, None) for name in ("hf_config", "init_from")}
    if any(v is not None for v in files.values()):
        return files
    shape = {name: _get(cfg, "model", option, None) for name, option in SHAPE_FIELDS.items()}
    shape["tie_embeddings"] = _flag(cfg, "model", "tie_embeddings", None)
    return {"preset": _get(cfg, "model", "preset", "small"),
            "vocab_size": _get(cfg, "data", "vocab_size", None), **shape}


def read_run(run_dir: str | Path, skip: int = 4) -> RunSample:
    """One run directory's measurements.

    Args:
        run_dir: a directory written by ``editrain train``.
        skip: steps left out at the start (start-up, allocator warm-up).

    Raises:
        ConfigError: not a run directory, or too few steps.
    """
    d = Path(run_dir)
    if not (d / "metrics.jsonl").is_file() or not (d / "config.toml").is_file():
        raise ConfigError(f"plan --calibrate: {shown(d)} is not a run directory (no metrics.jsonl "
                          "and config.toml)")
    cfg = _read_toml(d / "config.toml")
    method, model = read_config(d)
    S = method.shard_size or 1
    try:
        replicas = _replicas(cfg)
        # the rank files are keyed by global rank: the job's processes (tp peers and the
        # pipeline's stages included)
        world = _nproc(cfg, replicas * method.pp * S * method.tp)
    except ConfigError as e:
        raise ConfigError(f"plan: {shown(d / 'config.toml')}: {e}") from None
    start, rows, ranks = job_rows(d, world)
    rows = measured_rows(rows, ROW_SCHEMA)
    ranks = {rank: measured_rows(got, ROW_SCHEMA) for rank, got in ranks.items()}
    # Every round of the job: those a step's row carries and those with a row of their
    # own (completed by finish() after the last step), each with the step it launched at.
    rounds = [(launch_step(r), r["sync"]) for r in rows if isinstance(r.get("sync"), dict)]
    at_end = _launched_by_the_end(rows)
    rows = sorted((r for r in rows if r.get("loss") is not None), key=lambda r: r["step"])
    first = start + skip  # each job starts up again: its own first steps are left out
    window = [r for r in rows if r["step"] > first]
    if len(window) < 2:
        job = f" in its latest job (after step {start})" if start else ""
        raise ConfigError(f"plan --calibrate: {shown(d)} has {len(rows)} steps{job}; it needs more "
                          f"than {skip + 2}")

    # Per-replica compute from the per-rank logs (the global rows are one replica's).
    # Per replica: (compute, compute + simulated slowdown) per step. Means, not medians:
    # throughput is set by the total time, and a shared machine's step times have a long
    # tail.
    per_replica: dict[int, list[tuple[float, float, int]]] = {}
    # Each rank's clock at the end of each step (after the round's launch), for the
    # logging rank's wait for the others inside a round's first collective.
    clocks: dict[int, dict[int, float]] = {}
    for rank, got in ranks.items():
        # its own first steps: a rank's file counts its replica's steps (A-EDiT's apart)
        own_first = got[0]["step"] - 1 + skip if got else first
        for r in got:
            if r.get("unix_time") is not None:
                clocks.setdefault(rank, {})[r["step"]] = r["unix_time"]
            if r["step"] > own_first and r.get("compute_s") is not None:
                c = r["compute_s"]
                per_replica.setdefault(r.get("replica", 0), []).append(
                    (c, c + (r.get("sim_stall_s") or 0.0), r["step"]))
    if not per_replica:
        per_replica = {0: [(r["compute_s"], r["compute_s"], r["step"]) for r in window
                           if r.get("compute_s") is not None]}
    means = sorted((statistics.fmean(b for _, b, _ in v), statistics.fmean(c for c, _, _ in v),
                    [(k, c) for c, _, k in v]) for v in per_replica.values() if v)
    # The fastest replica's own compute (its random stalls, if any, are the model's to add).
    fastest = means[0][1]
    medians = [busy for busy, _, _ in means]
    # Steps a round ran beside: after its launch at step k (the sync row's "step"), steps
    # k + 1 .. k + n, n the setting's overlapped steps (0: blocking rounds, sync). The
    # rounds counted are those with such a step among the fastest replica's steps.
    steps = {k for k, _ in means[0][2]}
    beside: set[int] = set()
    counted = 0
    for k, _ in rounds:
        if method.overlapped_steps:
            mine = steps & set(range(k + 1, k + method.overlapped_steps + 1))
            counted += bool(mine)
            beside |= mine
    quiet_steps = [c for k, c in means[0][2] if k not in beside]
    quiet = statistics.fmean(quiet_steps) if quiet_steps else None
    # Overhead: per step, the clock's advance minus compute and waits; the median over
    # steps without a sync (a sync run by finish() between steps, before an evaluation or
    # a checkpoint, is in the clock but in no row's wait; one after the last step has a
    # row of its own, without a loss, so it is in no step's gap).
    clock = "train_time_s" if all("train_time_s" in r for r in window) else "wall_time_s"
    gaps = [b[clock] - a[clock] - (b.get("compute_s") or 0.0) - (b.get("sync_wait_s") or 0.0)
            - (b.get("grad_sync_s") or 0.0) for a, b in zip(window, window[1:])
            if b["step"] == a["step"] + 1 and "sync" not in b]
    overhead = max(0.0, statistics.median(gaps)) if gaps else 0.0
    syncs, delays = [], []
    # With pipeline stages the logging rank's rounds are its stage's alone, on a link the
    # other stages' rounds share at the same time: they fit no link (docs/planning.md).
    for i, (k, s) in enumerate(rounds if method.pp == 1 else []):
        if s.get("comm_time_s") is not None and s.get("bytes_sent") is not None:
            delay = s.get("link_delay_s") or 0.0
            # The logging rank (rank 0) waits inside the round's first collective for the
            # ranks that launched it later; that is no cost of the link or the machine.
            # (A-EDiT's replicas count their steps apart: no common step to compare.)
            # Of the rounds the end launches one after the other, the first has waited for
            # the ranks' arrival: the next start on ranks that its collectives brought
            # together.
            late = 0.0 if method.method == "aedit" or i in at_end[1:] else peer_lag_s(
                clocks, k)
            syncs.append((float(s.get("sync_collectives") or 1), float(s["bytes_sent"] * S),
                          max(delay, s["comm_time_s"] - late)))
            delays.append(delay)
    return RunSample(str(d), method, model, replicas, S, fastest, overhead,
                     [m / fastest for m in medians], syncs, delays, dict(cfg.get("sim", {})),
                     quiet, counted / len(means[0][2]))


def launch_step(row: dict[str, Any]) -> int:
    """The step at whose boundary the round of ``row`` (a row with a ``sync`` entry) was
    launched, where each rank's clock of that step (``unix_time``, written after the
    step's launches) says when it joined the round's first collective.

    A delayed round (streaming, non-blocking: its entry's ``launch_step``) launched there
    and ran behind the steps up to its merge, whose step is the entry's ``step``. Any other
    round launched at its entry's ``step``: a layer-wise round runs in the next forward
    (its row is that step's), a blocking one at that boundary, and those
    ``finish(force=True)`` runs after the last step there (the last step's clock: each
    rank gets there after it).

    ``row`` is one :func:`measured_rows` kept: its steps are JSON integers (a float step
    is no step of editrain's: ``int()`` truncated one)."""
    entry = row["sync"]
    for key in ("launch_step", "step"):
        if key in entry:
            return entry[key]
    return row["step"]


def _launched_by_the_end(rows: list[dict[str, Any]]) -> list[int]:
    """Indexes (among the rows with a ``sync`` entry, in file order) of the rounds that
    ``finish(force=True)`` launched after the last step, in order: rows of their own
    after the last row with a loss, without a ``launch_step`` (a delayed round merged
    there launched at its own step)."""
    synced = [r for r in rows if isinstance(r.get("sync"), dict)]
    last = max((i for i, r in enumerate(rows) if r.get("loss") is not None), default=-1)
    after = [r for r in rows[last + 1:] if isinstance(r.get("sync"), dict)]
    first = len(synced) - len(after)
    return [first + j for j, r in enumerate(after) if "launch_step" not in r["sync"]]


def peer_lag_s(clocks: dict[int, dict[int, float]], step: int) -> float:
    """Seconds the last rank finished ``step`` after rank 0 (0 when rank 0 was last or a
    clock is missing): how long rank 0 waits for the others in a round launched there.

    Each rank's ``unix_time`` is written after its step's round was launched (for a
    blocking round after it was done: then about 0). The ranks' clocks must agree (one
    machine; across machines their offset enters).

    Args:
        clocks: ``{rank: {step: unix_time}}`` from the rank logs.
        step: the round's launch step.
    """
    mine = clocks.get(0, {}).get(step)
    others = [c[step] for rank, c in clocks.items() if rank != 0 and step in c]
    if mine is None or not others:
        return 0.0
    return max(0.0, max(others) - mine)


def fit_link(rounds: list[tuple[float, float, float]], latency_s: float | None = None
             ) -> tuple[float | None, float, float, bool]:
    """Least-squares fit of ``seconds = collectives * latency + bytes / bandwidth``.

    Args:
        rounds: ``(collectives, bytes, seconds)`` per round.
        latency_s: the latency to assume when the rounds cannot separate it (None: 0).

    Returns:
        ``(bandwidth bytes/s or None, latency s, rms residual s, latency fitted)``.
    """
    if not rounds:
        return None, latency_s or 0.0, 0.0, False
    scc = sum(c * c for c, _, _ in rounds)
    sxx = sum(x * x for _, x, _ in rounds)
    scx = sum(c * x for c, x, _ in rounds)
    scy = sum(c * y for c, _, y in rounds)
    sxy = sum(x * y for _, x, y in rounds)
    det = scc * sxx - scx * scx
    fitted = False
    # Relative determinant: near 0 when every round has the same bytes per collective.
    if det > 1e-6 * scc * sxx:
        lat = (scy * sxx - sxy * scx) / det
        inv_bw = (scc * sxy - scx * scy) / det
        fitted = lat >= 0 and inv_bw > 0
    if not fitted:
        lat = latency_s or 0.0
        inv_bw = max(sxy - lat * scx, 0.0) / sxx if sxx else 0.0
    bw = 1.0 / inv_bw if inv_bw > 0 else None
    rms = math.sqrt(sum((y - c * lat - x * inv_bw) ** 2 for c, x, y in rounds) / len(rounds))
    return bw, lat, rms, fitted


def fit_compute(runs: list[tuple[float, float, float | None]]
                ) -> tuple[float, float, str]:
    """Compute per step with no round beside it, and the compute seconds a round running
    beside the compute adds (the communication thread's CPU work on shared cores).

    Across settings (two or more rates of such rounds among the runs): the least-squares
    line ``mean compute = step + cost x rounds per step`` over the runs. With one rate,
    within the runs: the step from the steps with no round beside them (median over the
    runs), the cost from the rest of the mean, ``(mean - quiet) / rounds per step``
    (median). A negative cost is taken as 0 (the step is then the median mean).

    Args:
        runs: ``(rounds per step, mean compute s, mean compute s of the steps with no
            round beside them or None)`` per run.

    Returns:
        ``(step s, cost s per round, how: "across settings", "within runs" or "none")``.
    """
    if not runs:
        raise ConfigError("plan --calibrate: no runs to fit the compute on")
    rates = [x for x, _, _ in runs]
    means = [y for _, y, _ in runs]
    if len({round(x, 12) for x in rates}) >= 2:
        mx, my = statistics.fmean(rates), statistics.fmean(means)
        sxx = sum((x - mx) ** 2 for x in rates)
        cost = sum((x - mx) * (y - my) for x, y in zip(rates, means)) / sxx
        step = my - cost * mx
        if cost >= 0 and step > 0:
            return step, cost, "across settings"
        return statistics.median(means), 0.0, "none"
    with_rounds = [(x, y, q) for x, y, q in runs if x > 0 and q is not None]
    if not with_rounds:
        return statistics.median(means), 0.0, "none"
    cost = statistics.median((y - q) / x for x, y, q in with_rounds)
    if cost < 0:
        return statistics.median(means), 0.0, "none"
    step = statistics.median(q if q is not None and x > 0 else y for x, y, q in runs)
    return step, cost, "within runs"


def _check_one_job(samples: list[RunSample]) -> None:
    """Refuse runs of different models, batches or replica layouts: the compute per step
    is fitted across the runs as one job's (with and without rounds beside it), and the
    plan scales it from the first run's job (:meth:`Calibration.measured_job`). The
    methods, links and stragglers may differ; that is what several runs are for."""
    first = samples[0]
    want = dataclasses.asdict(first.model)
    for s in samples[1:]:
        got = dataclasses.asdict(s.model)
        diff = [f"model.{k} {spelled(want[k])} vs {spelled(got[k])}" for k in want if want[k] != got[k]]
        for name, a, b in (("shard_size", first.shard_size, s.shard_size),
                           ("tp", first.method.tp, s.method.tp),
                           ("pipeline", _pipeline_of(first.method),
                            _pipeline_of(s.method))):
            if a != b:
                diff.append(f"{name} {a} vs {b}")
        if diff:
            raise ConfigError(
                f"plan --calibrate: {shown(s.run_dir)} ran another job than "
                f"{shown(first.run_dir)} ("
                + ", ".join(diff) + "): calibrate from runs of one model, batch and replica "
                "layout, pipeline included (their methods, links and stragglers may "
                "differ)")


def _pipeline_of(method: MethodSpec) -> str:
    """A run's pipeline as the refusal names it: ``pp 2, 1f1b, 4 microbatches, 1 chunk``."""
    return (f"pp {method.pp}, {method.pp_schedule}, {method.microbatches} microbatches, "
            f"{method.pp_stages_per_rank} chunk(s) per rank" if method.pp > 1 else "none")


def calibrate(run_dirs: list[str | Path], skip: int = 4, latency_s: float | None = None
              ) -> Calibration:
    """Fit compute speed, overhead, stragglers and the link from one or more runs.

    Args:
        run_dirs: run directories (same machine and model; settings may differ).
        skip: steps left out at the start of each run.
        latency_s: latency to assume when the rounds cannot separate it.

    Raises:
        ConfigError: no run directories or an unreadable one.
    """
    if not run_dirs:
        raise ConfigError("plan --calibrate: give at least one run directory")
    samples = [read_run(d, skip) for d in run_dirs]
    _check_one_job(samples)
    rounds = [r for s in samples for r in s.syncs]
    bw, lat, rms, fitted = fit_link(rounds, latency_s)
    own_bw, own_lat = None, 0.0
    delays = [x for s in samples for x in s.link_delays]
    if any(delays):
        own = [(c, x, y - dl) for (c, x, y), dl in zip(rounds, delays)]
        own_bw, own_lat, _, _ = fit_link(own)
    spread = max(max(s.factors) for s in samples) - 1.0
    step, cost, how = fit_compute([(s.rounds_per_step, s.compute_s, s.quiet_compute_s)
                                   for s in samples])
    # A pipelined step holds the schedule's bubble: the cluster's step_time_s is the step
    # with every GPU busy (the rounds' slowdown stays per pipelined step, as measured).
    factor = pipeline_factor(samples[0])
    step /= factor
    return Calibration(
        step_time_s=step,
        step_overhead_s=statistics.median(s.overhead_s for s in samples),
        bandwidth_bytes_per_s=bw, latency_s=lat, straggler_spread=spread,
        residual_rms_s=rms, rounds=len(rounds), latency_fitted=fitted, samples=samples,
        own_bandwidth_bytes_per_s=own_bw, own_latency_s=own_lat, overlap_cpu_s=cost,
        overlap_fit=how, pipeline_factor=factor)


def pipeline_factor(sample: RunSample) -> float:
    """How many times the step with every GPU busy a run's pipelined step takes: the
    schedule's bubble and the stages' imbalance (:func:`editrain.plan.pipeline.
    schedule_factor`; the activations' transfers are left in the compute). 1 without
    pipeline stages.

    Raises:
        ConfigError: the run's pipeline does not suit its model (as training checks).
    """
    method = sample.method
    if method.pp == 1:
        return 1.0
    from editrain.plan.model import Layout
    from editrain.plan.pipeline import check_pipeline, schedule_factor

    shape = model_shape(sample.model)
    lay = Layout(sample.replicas, sample.shard_size, method.tp, method.pp)
    try:
        pipe = check_pipeline(shape, sample.model, method, lay)
    except ConfigError as e:
        raise ConfigError(f"plan --calibrate: {shown(sample.run_dir)}: {e}") from None
    return schedule_factor(shape, sample.model, pipe)


__all__ = ["Calibration", "RunSample", "calibrate", "fit_compute", "fit_link", "job_rows",
           "launch_step", "measured_rows", "peer_lag_s", "read_config", "read_run", "run_vocab_size"]
