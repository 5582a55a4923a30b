"""The training loop: one :class:`Trainer` per process, wired from components.

``Trainer.__init__`` builds the components (process groups: :mod:`editrain.runtime`; data:
:mod:`editrain.batches`; model and engine: :mod:`editrain.build`; inner optimizer and LR
schedule: :mod:`editrain.optim.inner`, :mod:`editrain.optim.schedule`; evaluation:
:mod:`editrain.evaluation`; simulation callbacks: :class:`editrain.sim.Simulation`),
``Trainer.train()`` loops, ``Trainer.train_step()`` does one inner step. The method itself
lives in :mod:`editrain.sync`; this file only wires it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from editrain.argv import env_int
from editrain.batches import RankData
from editrain.build import build_engine, build_model, materialise, shard_model
from editrain.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    rank_states,
    replicas_and_shards,
    resolve_resume,
    rng_state,
    run_meta,
    save_checkpoint,
    set_rng_state,
)
from editrain.config import Config, to_dict, validate_world
from editrain.config.model import tokenizer_source
from editrain.corpus import prepare_data
from editrain.errors import spelled
from editrain.evaluation import Evaluator
from editrain.fault import (
    ATTEMPT_ENV,
    RunEndWatch,
    ft_identity,
    load_local_optimizer_state,
    local_optimizer_state,
    make_group,
    replica_run_dir,
)
from editrain.hf_checkpoint import export_checkpoint, save_run_tokenizer
from editrain.loop_state import LoopState, next_after
from editrain.metrics import (
    END,
    JOB_START,
    MetricsWriter,
    RankLog,
    ReplayMarks,
    current_rows,
    read_metrics,
    to_json,
)
from editrain.models import causal_lm_loss, num_parameters
from editrain.optim.inner import build_inner_optimizer, clip_gradients, uses_sam
from editrain.optim.schedule import lr_at, set_lr
from editrain.pipeline import PipelineRunner, build_stage, pipeline_eval_loss
from editrain.rundir import checkpoint_progress, command_started, lineage_of, logs_dir
from editrain.runtime import init_distributed, setup_process
from editrain.safe_io import make_dir, write_atomic
from editrain.sim import Simulation, check_replicas, parse_sim
from editrain.sync.comm import format_bytes_by_cause
from editrain.tracking import open_trackers

log = logging.getLogger("editrain")


class Trainer:
    """Builds and runs one rank of a training job.

    Args:
        cfg: the validated configuration.
        run_dir: where metrics, config and checkpoints go (created by the launcher).
        data_entry: the token cache entry the launcher prepared (see
            :func:`editrain.corpus.prepare_data`); None: found from ``cfg.data``.
        rejoined: under torchrun, rank 0's decision for this attempt (the same on every
            rank, :meth:`editrain.launch.run_dir.RunDirClaim.join`): True, it goes on with
            its launch's run, which resumes its latest checkpoint; False, a new claim,
            which resumes ``--resume`` only. None: not told (the local launcher, torchrun
            without its store): a restart torch elastic counted resumes
            (:meth:`_checkpoint_to_resume`).
        run_ended: a torchrun job of a fault-tolerant run's replica group: why the run
            ended for the group, looked at while it waits in its first quorum
            (:class:`~editrain.fault.RunEndWatch`; from
            :func:`editrain.launch.run_dir.ended_run_watch`); None: not looked at.
    """

    def __init__(self, cfg: Config, run_dir: Path, data_entry: str | None = None,
                 rejoined: bool | None = None,
                 run_ended: Callable[[], str | None] | None = None) -> None:
        self.cfg, t = cfg, cfg.train
        self.run_dir = Path(run_dir)
        self.rejoined = rejoined
        validate_world(cfg, env_int("WORLD_SIZE", 1, minimum=1))
        plan = parse_sim(cfg.sim)
        self.info = info = init_distributed(cfg, self.run_dir)  # every rank agreeing
        # The fault-tolerant mode: this job is one replica group of several (its world is
        # the group's ranks); every other mode: the world holds every replica.
        self.ft = cfg.dist.fault_tolerance == "torchft"
        if self.ft:
            self.replica, self.replicas = ft_identity(cfg, info.topo.replica_size)
            self.run_dir = make_dir(self.run_dir / f"replica{self.replica}",
                                    root=self.run_dir)
        else:
            self.replica, self.replicas = info.replica, info.topo.num_replicas
        # Data ranks: the tp peers of a shard read the same batches.
        self.global_rank = self.replica * info.topo.shard_size + info.shard
        self.global_world = self.replicas * info.topo.shard_size
        check_replicas(plan, self.replicas + cfg.sim.replica_offset)
        self.is_logger = info.rank == 0
        self.quiet = cfg.quiet or not self.is_logger or (self.ft and self.replica != 0)
        self.aedit = cfg.sync.use_async

        # Components: data, model, simulation, engine, optimizer, evaluation.
        # (Evaluation over this job's world: in the fault-tolerant mode a replica group's.)
        eval_share = ((info.shard, info.topo.shard_size) if self.aedit else
                      (info.topo.data_rank(info.rank), info.topo.data_world))
        self.data = RankData(cfg, prepare_data(cfg, data_entry), self.global_rank,
                             self.global_world, *eval_share)
        self.model = build_model(cfg, self.data.vocab_size, info.device)
        self.num_params = num_parameters(self.model)
        # Pipeline stages: this rank keeps its stage of the whole model (the same seeded
        # weights, the model's parameter names) and shards, syncs and trains that.
        self.pp = info.topo.pp_size > 1
        if self.pp:
            self.model = build_stage(self.model, info.stage, info.topo.pp_size,
                                     cfg.dist.pp_stages_per_rank)
        blocks = shard_model(cfg, self.model, info)
        # A model built on the meta device gets its shards; pretrained weights seed step 0,
        # into them (each rank reads its own), before the engine takes its anchors from
        # them; a resume overwrites them all.
        materialise(cfg, self.model, info.device)
        # The simulated link is one FIFO per replica, shared by the replica's ranks.
        self.sim = Simulation(plan, self.replica, cfg.sim.replica_offset, self.global_rank,
                              t.seed, self.run_dir / ".link" / f"replica{self.replica}.state",
                              rejoined)
        # In the fault-tolerant mode this job is the replica group: a rank's place in it is
        # its rank (its (stage, shard, tp) position on the group's mesh, the same in every
        # group): it reduces with, and heals from, the rank in the same place of the others.
        self.ft_group = (make_group(cfg, self.replica, self.replicas, info.rank,
                                    info.topo.replica_size) if self.ft else None)
        self.run_end_watch = (RunEndWatch(run_ended)
                              if self.ft and run_ended is not None else None)
        self.engine = build_engine(cfg, self.model, info, blocks, link_delay=self.sim.link,
                                   before_sync=self.sim.sync_hook, cross_replica=self.ft_group)
        self.sim.attach(self.engine)
        # Each replica's loss travels with every round (engine.record_loss at each step);
        # on from the start, so that a --ft group joining before its first step gathers
        # it too.
        self.engine.track_losses()
        # Gradient norms (WSAM, clipping) are summed over the engine's replica group.
        self.replica_group = self.engine.replica_group
        self.optimizer = build_inner_optimizer(cfg, self.model.parameters(), self.replica_group)
        self.runner: PipelineRunner | None = None
        self.pp_group = info.pp_mesh.get_group() if self.pp else None
        if self.pp:
            # A step's micro-batches (gradient accumulation) go through as one batch of
            # them all, each split into dist.pp_microbatches: the same mean loss and
            # gradients as accumulating them.
            accum = t.gradient_accumulation_steps
            self.runner = PipelineRunner(
                self.model, batch_size=t.batch_size * accum, seq_len=t.seq_len,
                n_microbatches=cfg.dist.microbatches * accum,
                schedule=cfg.dist.pp_schedule, group=self.pp_group, device=info.device,
                activation_dtype=torch.bfloat16 if t.precision == "bf16" else None)
        if self.ft_group is not None:
            # What a healthy replica sends one that (re)joins, besides the engine's state.
            self.ft_group.register_state("trainer", self._ft_state, self._load_ft_state)
        self.evaluator = Evaluator(
            self.model, self.data.val, info, self.engine, everyone=not self.aedit,
            streaming=cfg.sync.streaming,
            forward_loss=(lambda x, y: pipeline_eval_loss(self.model, x, y, self.pp_group))
            if self.pp else None, final_batches=self.data.val_final)
        self.tokens_per_step = t.batch_size * t.seq_len * t.gradient_accumulation_steps

        # Loop state (its saved part in checkpoints; a resume replaces it).
        self.loop = LoopState(next_eval=t.eval_every, next_ckpt=cfg.checkpoint.every)
        self.lineage = lineage_of(self.run_dir)
        """This job's run id, timeline and start checkpoint (the launcher's run record;
        None without one): stored in checkpoints, and rotation keeps to the timeline."""
        ckpt = self._checkpoint_to_resume()
        if ckpt is not None:
            self._resume(ckpt)
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_logger, trackers=(
            open_trackers(self.run_dir, wandb=cfg.train.wandb,
                          wandb_project=cfg.train.wandb_project, config=to_dict(cfg),
                          quiet=cfg.quiet) if self.is_logger else []))
        self.rank_log = RankLog(self.run_dir, info.rank)
        if self.is_logger:  # for editrain export
            save_run_tokenizer(self.run_dir, self.data.corpus.tokenizer_path,
                               tokenizer_source(cfg)[1], cfg.model.init_from)
        self.loop.start_clock()

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run to the end of the budget; returns the final summary."""
        cfg, engine = self.cfg, self.engine
        final_val = self._begin()
        progress, shown = self._progress_bar(), ""
        try:
            while not self._budget_done():
                row = self.train_step()
                point = engine.sync_point()  # progress at a sync boundary, else None
                if self.aedit and point is not None and point >= cfg.train.steps:
                    engine.finish()  # the last sync of the run
                    self.loop.finished = True
                    row["tokens"] = self._tokens()
                if (point is not None and point >= self.loop.next_eval
                        and not (self._budget_done() and self._own_final_eval)):
                    # (at the end the final evaluation, over final_eval_tokens, stands in)
                    engine.finish()
                    row.update(self.evaluate())
                    final_val, self.loop.last_eval = row["val_loss"], self.loop.step
                    self.loop.next_eval = next_after(self.loop.next_eval, point,
                                                     cfg.train.eval_every)
                syncs = self._take_syncs()
                if syncs:  # the step's row carries its last round; any earlier ones their own
                    self._log_sync_rows(syncs[:-1])
                    row["sync"] = syncs[-1]
                if self.loop.step % cfg.train.log_every == 0 or "val_loss" in row or "sync" in row:
                    self._log_step(row)
                if (cfg.checkpoint.every and point is not None and point >= self.loop.next_ckpt
                        and not self._budget_done()):
                    # advanced first: the state saved is "after"
                    self.loop.next_ckpt = next_after(self.loop.next_ckpt, point,
                                                     cfg.checkpoint.every)
                    self.save()
                shown = f"loss {row['loss']:.3f}"
                if progress is not None:
                    progress.update(self._task, completed=min(engine.progress_steps,
                                                              cfg.train.steps),
                                    info=f"{shown}  val {final_val:.3f}")
            final_val = self._end(final_val)
            if progress is not None:  # the final evaluation's loss, not the last periodic one
                progress.update(self._task, info=f"{shown}  val {final_val:.3f}")
            # This rank's cross-replica bytes by cause, the last row of its rank log.
            self.rank_log.write({"event": "cross_replica_bytes", "step": self.loop.step,
                                 **engine.comm.ledger.totals()})
        finally:
            if progress is not None:
                progress.stop()
            self.rank_log.close()
        return self._summary(final_val)

    def train_step(self) -> dict[str, Any]:
        """One inner step: micro-batches, (warm-up) gradient averaging, optimizer, sync."""
        engine, sim = self.engine, self.sim
        t0 = time.perf_counter()
        lr = lr_at(engine.progress_steps, self.cfg)
        set_lr(self.optimizer, lr)
        batches = self.data.next_batches(self.info.device)
        self.model.train()
        wait0, grad0 = engine.total_wait_s, engine.total_grad_sync_s
        loss = self._compute(batches)
        grad_sync_s = engine.total_grad_sync_s - grad0
        compute_s = time.perf_counter() - t0 - (engine.total_wait_s - wait0) - grad_sync_s
        stall_s = sim.after_compute(self.loop.step, compute_s)
        t1 = time.perf_counter()
        engine.record_loss(loss)  # each replica's mean loss travels with the next round
        engine.step()
        self.loop.step += 1
        self.loop.steps_run += 1
        sim.after_step(self.loop.step)
        return self._step_row(float(loss), lr, t0, t1, wait0, compute_s, grad_sync_s, stall_s)

    def _compute(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward over the micro-batches, then the optimizer step (with
        ``train.grad_clip``, or through WSAM's closure); returns the mean loss."""
        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=self.info.device)
            for x in batches:
                loss = causal_lm_loss(self.model(x[:, :-1]), x[:, 1:])
                (loss / len(batches)).backward()
                total += loss.detach() / len(batches)
            self.engine.after_backward()
            return total

        grad_clip = self.cfg.train.grad_clip
        if self.runner is not None:
            return self._compute_pipeline(batches, grad_clip)
        if uses_sam(self.cfg):
            loss = self.optimizer.step(closure)
        else:
            loss = closure()
            if grad_clip > 0:
                clip_gradients(self.model, grad_clip, self.info.topo.tp_size,
                               self.replica_group)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _compute_pipeline(self, batches: list[torch.Tensor], grad_clip: float
                          ) -> torch.Tensor:
        """:meth:`_compute` on a pipeline stage: the step's batch through the schedule,
        its loss (known on the last stage) summed over the pipeline so that every stage
        holds it, clipping over every stage of the replica, the optimizer step."""
        x = batches[0] if len(batches) == 1 else torch.cat(batches)
        self.optimizer.zero_grad(set_to_none=True)
        got = self.runner.train_step(x[:, :-1], x[:, 1:])
        loss = torch.zeros(1, device=self.info.device)
        if got is not None:
            loss += got.float()
        dist.all_reduce(loss, group=self.pp_group)  # the others add zeros: exact
        self.engine.after_backward()
        if grad_clip > 0:
            clip_gradients(self.model, grad_clip, self.info.topo.tp_size, self.replica_group,
                           stage_size=self.info.topo.stage_size)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss[0]

    def _step_row(self, loss: float, lr: float, t0: float, t1: float, wait0: float,
                  compute_s: float, grad_sync_s: float, stall_s: float) -> dict[str, Any]:
        """Write this rank's line of the step (``ranks/``) and return the step's row."""
        info, wait = self.info, self.engine.total_wait_s
        step_time = time.perf_counter() - t0
        mine = {"rank": self.global_rank, "replica": self.replica, "shard": info.shard,
                **({"tp": info.tp} if info.topo.tp_size > 1 else {}),
                **({"stage": info.stage} if self.pp else {}),
                "step": self.loop.step, "unix_time": time.time(),
                "tokens": self.loop.step * self.tokens_per_step,
                "loss": loss, "wall_time_s": self._wall(), "step_time_s": step_time,
                "compute_s": compute_s, "sync_wait_s": wait - wait0,
                "grad_sync_s": grad_sync_s}
        if stall_s:
            mine["sim_stall_s"] = stall_s
        self.rank_log.write(mine)
        row: dict[str, Any] = {
            "step": self.loop.step,
            "tokens": self._tokens(),
            "loss": loss,  # this rank's; averaged when the row is logged
            "lr": lr,
            "tokens_per_s": self.tokens_per_step * self.global_world / step_time,
            "step_time_s": step_time,
            "wall_time_s": self._wall(),
            "compute_s": compute_s,
            "sync_wait_s": wait - wait0,
            "grad_sync_s": grad_sync_s,
            "boundary_s": time.perf_counter() - t1,
        }
        if stall_s:
            row["sim_stall_s"] = stall_s
        if self.aedit:
            row["replica_step"] = self.loop.step
        return row

    def _log_step(self, row: dict[str, Any]) -> None:
        """Write a step's row to ``metrics.jsonl``, its loss averaged.

        Every rank of a replica takes this branch at the same step. While training is
        synchronous (warm-up, the sync method) the logged loss is the mean over all
        ranks; in the local phase it is the logging replica's mean: a world-wide
        reduction at every logged step would put a cross-replica round trip on the slow
        link into every step and hold every replica to the slowest one's pace (and for
        A-EDiT, whose replicas are at different steps, it could interleave with a
        rendezvous and deadlock).
        """
        row["loss"] = self.evaluator.mean_loss(row["loss"], everyone=self.engine.in_warmup)
        # One clock reading for both (after the loss's collective): train time never
        # exceeds wall time.
        row["wall_time_s"] = self._wall()
        row["train_time_s"] = row["wall_time_s"] - self.loop.off_train_s
        self._write(row)

    def _take_syncs(self) -> list[dict[str, Any]]:
        """The engine's entries of the rounds finished since the last call, in order, each
        said in one log line (:func:`sync_summary`) on the logging rank."""
        syncs = self.engine.pop_sync_log()
        if self.is_logger and not self.cfg.quiet:
            for entry in syncs:
                log.warning("%s", sync_summary(entry))
        return syncs

    def _log_sync_rows(self, syncs: list[dict[str, Any]], end: bool = False) -> None:
        """Write a row of its own for each round no step's row carries: those that
        ``engine.finish(force=True)`` completes after the last step (several at once with
        streaming or rounds in flight), and all but the last of several that end at one
        step. Each has the step and clocks of where it ended and no loss (docs/metrics.md),
        so that every round is in ``metrics.jsonl`` once, in order.

        ``end``: the rounds the end completed, marked :data:`editrain.metrics.END`: a job
        resumed before them that trains on completes them at later steps, and readers tell
        these rows from a round's own row before its step's row by the mark alone."""
        for entry in syncs:
            wall = self._wall()
            self._write({"step": self.loop.step, "tokens": self._tokens(), "sync": entry,
                         "wall_time_s": wall, "train_time_s": wall - self.loop.off_train_s,
                         **({END: True} if end else {})})

    def _begin(self) -> float:
        """Before the first step: the start line, the first quorum (fault-tolerant), the
        initial (or elastic-resume) evaluation; returns the validation loss (NaN if none)."""
        self._log_start()
        joined = self._ft_join() if self.ft else None
        # The job's start first, then what its join did: readers take the start event as
        # the boundary of a job's rows (editrain.metrics.latest_job, current_rows), so the
        # join's row belongs after it. Its step is where this job's rows are numbered
        # from: a replica that healed took the peers' step in the join.
        self._mark_job_start()
        if joined is not None:
            self._write(joined)
        if self.loop.healed_at is not None:
            return float("nan")  # joined a running job: its curve goes on from the peers'
        if self.loop.resumed_from is None:
            ev = self.evaluate()
            self._write({"step": 0, "tokens": 0, **ev, "wall_time_s": 0.0})
            return ev["val_loss"]
        if self.loop.elastic:
            # The global model on the new topology: this loss should continue the curve
            # from the saved run's final evaluation (so it is over the same tokens).
            ev = self.evaluate(final=True)
            self._write({"event": "elastic_resume", "step": self.loop.step, "tokens": self._tokens(),
                         **ev, "wall_time_s": self._wall()})
            return ev["val_loss"]
        return float("nan")

    def _end(self, final_val: float) -> float:
        """After the last step: every replica on the global model (even mid-window), the
        final evaluation and checkpoint; returns the final validation loss."""
        self.engine.finish(force=True)
        # The rounds it completed (an armed one, those in flight, the forced ones) come
        # after the last step's row: rows of their own, before the final evaluation's, both
        # marked as the end's (editrain.metrics.END).
        self._log_sync_rows(self._take_syncs(), end=True)
        # The final evaluation: unless the loop's last one was at this step over the same
        # tokens (train.final_eval_tokens == train.eval_tokens) and no sync was forced.
        if (self.loop.last_eval != self.loop.step or self.engine.num_syncs_forced
                or self._own_final_eval):
            ev = self.evaluate(final=True)
            final_val = ev["val_loss"]
            self._write({"step": self.loop.step, "tokens": self._tokens(), **ev,
                         "wall_time_s": self._wall(), END: True})
        if self.cfg.checkpoint.final or self.cfg.checkpoint.every:
            self.save()
        if self.cfg.checkpoint.export_final and self.is_logger:
            done = export_checkpoint(self.run_dir, self.run_dir / "export")
            log.warning("exported %s (%s) to %s", done.checkpoint, done.source, done.out)
        return final_val

    def _summary(self, final_val: float) -> dict[str, Any]:
        """The run's summary (rank 0 writes it to ``summary.json``)."""
        topo = self.info.topo
        wall = self._wall()
        summary = {"steps": self.loop.step, "tokens": self._tokens(), "final_val_loss": final_val,
                   "val_tokens": self.loop.val_tokens, "wall_time_s": wall,
                   "train_time_s": wall - self.loop.off_train_s,
                   "num_syncs": self.engine.num_syncs,
                   "num_params": self.num_params, "vocab_size": self.data.vocab_size,
                   "method": self.cfg.sync.method,
                   "replicas": self.replicas, "shard_size": topo.shard_size,
                   "tp_size": topo.tp_size, **({"pp_size": topo.pp_size} if self.pp else {}),
                   "steps_run": self.loop.steps_run,
                   "tokens_processed": self.loop.steps_run * topo.data_world * self.tokens_per_step}
        if self.ft:
            summary.update(replica=self.replica, healed_at=self.loop.healed_at,
                           failed_syncs=self.engine.failed_rounds)
        # Bytes this (the logging) rank sent across replicas, by cause; every rank's are the
        # last row of its rank log (docs/metrics.md).
        summary["cross_replica_bytes"] = self.engine.comm.ledger.totals()
        if self.is_logger:
            # strict JSON: a NaN loss is written null
            write_atomic(self.run_dir / "summary.json", to_json(summary, indent=1),
                         root=self.run_dir)
            syncs = summary["num_syncs"]
            steps = summary["steps"]
            log.warning("done: %d step%s, %d tokens, val loss %.4f, %s, %d sync%s, %s",
                        steps, "" if steps == 1 else "s", summary["tokens"], final_val,
                        times_said(wall, wall - self.loop.wall_offset,
                                   self.loop.wall_offset > 0 or self.loop.resumed_from
                                   is not None, self._command_s()),
                        syncs, "" if syncs == 1 else "s",
                        format_bytes_by_cause(summary["cross_replica_bytes"]))
        return summary

    def _command_s(self) -> float | None:
        """Seconds since this job's ``editrain train`` command started (its run record
        says when: :func:`editrain.rundir.command_started`), or None where not known."""
        started = command_started(self.run_dir)
        return None if started is None else max(0.0, time.time() - started)

    @property
    def _own_final_eval(self) -> bool:
        """The final evaluation covers other tokens than the loop's (``final_eval_tokens``
        differs from ``eval_tokens``), so it always runs, and replaces the loop's at the end."""
        return self.data.val_final is not self.data.val

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Validation loss of the global model (see :class:`editrain.evaluation.Evaluator`;
        ``final``: over ``train.final_eval_tokens``); its time is kept out of
        ``train_time_s``."""
        ev = self.evaluator.evaluate(final=final)
        self.loop.val_tokens = ev["val_tokens"]
        self.loop.off_train_s += ev["eval_time_s"]
        return ev

    def _budget_done(self) -> bool:
        if self.aedit:
            return self.loop.finished
        return self.loop.step >= self.cfg.train.steps

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_to_resume(self) -> Path | None:
        """``--resume``, or when this attempt goes on with its run (a worker restart) the
        latest checkpoint of this run (that job's own progress; ``--resume`` again where it
        has written none yet). In the fault-tolerant mode each replica group resumes its
        own checkpoint (``RUN_DIR/replica{r}``), and a group the launcher restarted reads
        nothing: it heals from a live peer.

        Whether the attempt goes on with its run is rank 0's decision where it was given
        (:attr:`rejoined`, every rank of a torchrun attempt has the same), else
        ``TORCHELASTIC_RESTART_COUNT > 0`` (the local launcher's restarts, one node's
        count). Under torchrun the count used to decide on every rank: torch elastic does
        not count a restart caused by a change of the nodes taking part, and after one
        node's failure the other nodes' counts stay as they were, so some ranks resumed
        the run's checkpoint while others started over: their collectives no longer
        matched, and the job hung until the process group's timeout."""
        if self.ft and env_int(ATTEMPT_ENV, 0) > 0:
            return None
        restart = env_int("TORCHELASTIC_RESTART_COUNT", 0)
        goes_on = restart > 0 if self.rejoined is None else self.rejoined
        found = list_checkpoints(self.run_dir) if goes_on else []
        ckpt = found[-1] if found else None
        if ckpt is None and self.cfg.resume:
            ckpt = resolve_resume(replica_run_dir(self.cfg.resume, self.replica)
                                  if self.ft else self.cfg.resume)
        if goes_on and self.is_logger:
            log.warning("%s", restart_line(restart, self.rejoined, ckpt))
        return ckpt

    def _meta(self) -> dict[str, Any]:
        return run_meta(self.cfg, self.data.vocab_size, self.info.topo.shape,
                        data=self.data.corpus)

    def save(self) -> None:
        """Write a checkpoint (collective; no effect on training)."""
        # An armed layer-wise sync is run now rather than in the next forward: the same
        # jobs in the same order (so training is unchanged), and the anchors saved are the
        # global model of this step, which an elastic resume starts from.
        self.engine.finish()
        t_save = time.perf_counter()
        progress = self._saved_progress() if self.aedit else None
        label = self.loop.step if progress is None else int(round(progress))
        rank_state = {
            **self.loop.to_dict(),
            "tokens": self._tokens(),
            "data": self.data.state_dict(),
            "rng": rng_state(),
            "sim_rng": self.sim.state_dict(),
        }
        if self.info.topo.tp_size > 1:
            rank_state["tp"] = self.info.tp
        if self.pp:
            rank_state["stage"] = self.info.stage
        if self.ft_group is not None:  # torchft's count of committed syncs: a group that
            rank_state["ft_committed"] = self.ft_group.committed_syncs  # resumes behind heals
        # (the engine's own state is saved by save_checkpoint: engine.state_dict())
        saved = save_checkpoint(self.run_dir, label, model=self.model, optimizer=self.optimizer,
                                engine=self.engine, replica=self.info.replica,
                                rank_state=rank_state, meta=self._meta(),
                                keep=self.cfg.checkpoint.keep, lineage=self.lineage,
                                progress=progress,
                                before_commit=lambda: self.sim.before_checkpoint_commit(
                                    self.loop.step))
        if self.is_logger:
            log.warning("checkpoint %s: %.1f MiB in %.2f s", saved.path, saved.bytes / 2**20,
                        saved.seconds)
            self._write({"event": "checkpoint", "step": self.loop.step, "path": str(saved.path),
                         "bytes": saved.bytes, "save_time_s": saved.seconds})
        self.loop.off_train_s += time.perf_counter() - t_save

    def _saved_progress(self) -> float:
        """A-EDiT's progress a checkpoint records (and is labelled with, rounded): the
        exact count of the last sync, identical on every rank, since the replicas' own
        positions differ between syncs (every save is at a sync point); the step count
        during warm-up."""
        engine = self.engine
        return float(engine.global_step) if engine.in_warmup else engine.progress.synced

    def _resume(self, ckpt: Path) -> None:
        state, marker = load_checkpoint(ckpt, model=self.model, optimizer=self.optimizer,
                                        engine=self.engine, replica=self.info.replica,
                                        rank=self.info.rank, meta=self._meta(),
                                        stage=self.info.stage)
        replays = self.is_logger and replays_logged_rows(self.cfg, exact=state is not None)
        resumed = {"resumed_from": ckpt,
                   "replays": ReplayMarks(_logged_history(self.run_dir)) if replays else None}
        if state is not None:  # same topology: exact
            # A-EDiT's run is finished where this run's budget is spent: the final
            # checkpoint of a run resumed with a larger train.steps trains on.
            self.loop = dataclasses.replace(LoopState.from_dict(state, str(ckpt)), **resumed,
                                            finished=state["finished"]
                                            and self.engine.budget_spent,
                                            tokens_base=state.get("tokens"),
                                            progress_base=self.engine.progress_steps)
            self._resume_schedule(marker)
            self.data.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            self.sim.load_state_dict(state["sim_rng"])
            if self.ft_group is not None and "ft_committed" in state:
                # behind a group that trained on since the commit: it heals from one
                self.ft_group.resume_behind(int(state["ft_committed"]))
            if self.is_logger:
                log.warning("resumed exactly from %s at step %d", ckpt, self.loop.step)
            return
        # Elastic: different number of replicas or shards.
        # tp peers and the stages of a pipeline: the same position
        old = [o for o in rank_states(ckpt) if not o.get("tp") and not o.get("stage")]
        # The schedule and clocks of the saving run's first rank; the engine restarted
        # every replica at one step (A-EDiT: the mean of the last sync), not yet finished.
        self.loop = dataclasses.replace(LoopState.from_dict(old[0], str(ckpt)), **resumed,
                                        step=self.engine.global_step, finished=False,
                                        elastic=True, tokens_base=old[0].get("tokens"),
                                        progress_base=self.engine.progress_steps)
        self._resume_schedule(marker)
        self.data.repartition([o["data"] for o in old])
        if self.is_logger:
            old_r, old_s = replicas_and_shards(marker["topology"])
            log.warning(
                "elastic resume from %s: %dx%d -> %dx%d (replicas x shards). Carried over: "
                "the global model (anchors), outer optimizer state, anomaly detectors of "
                "replicas 0..%d, replica 0's inner optimizer state, step %d and the data "
                "epoch (the unread rest of it is re-partitioned). Reset: every replica's "
                "local progress since the last sync, the sync clock.",
                ckpt, old_r, old_s, self.info.topo.num_replicas, self.info.topo.shard_size,
                min(old_r, self.info.topo.num_replicas) - 1, self.loop.step)

    def _resume_schedule(self, marker: dict[str, Any]) -> None:
        """The evaluations and checkpoints due after a resume: those of a run with this
        job's ``train.eval_every`` and ``checkpoint.every`` (multiples of each) after the
        checkpoint's progress, whatever intervals the checkpoint was saved with; with the
        same ones, the schedule the run would have had without the stop. Past the progress:
        the final save of a run did not take its last evaluation and checkpoint, and
        A-EDiT's real progress, not its rounded label, counts (an evaluation due at 8 was
        not taken at 7.5)."""
        self.loop.reschedule(checkpoint_progress(marker), self.cfg.train.eval_every,
                             self.cfg.checkpoint.every)

    # ------------------------------------------------------------------ helpers
    def _write(self, row: dict[str, Any]) -> None:
        # a replay, a row the earlier job did not write, or a replay carrying an evaluation
        # it did not take (another train.eval_every): two rows (ReplayMarks.mark)
        rows = [row] if self.loop.replays is None else self.loop.replays.mark(row)
        for each in rows:
            self.metrics.write(each)

    def _wall(self) -> float:
        return self.loop.wall()

    def _tokens(self) -> int:
        """The run's tokens: those at the resume (the checkpoint's), then the progress
        since at this job's global batch. A resume with other replicas or another
        ``train.batch_size`` (A-EDiT's too) counted every step at the new batch from step 0
        otherwise."""
        # A-EDiT counts progress in the steps of the run's first topology (an elastic
        # resume keeps that reference), each worth tokens_scale ranks' batches.
        ranks = self.engine.tokens_scale if self.aedit else self.global_world
        base, since = 0, self.engine.progress_steps
        if self.loop.tokens_base is not None:
            base, since = self.loop.tokens_base, since - self.loop.progress_base
        return base + int(round(since * ranks * self.tokens_per_step))

    def _log_start(self) -> None:
        if not self.is_logger:
            return
        topo, mem, d = self.info.topo, self.engine.extra_memory(), self.cfg.dist
        chunks = f", {d.pp_stages_per_rank} chunks per rank" if d.pp_stages_per_rank > 1 else ""
        log.warning(
            "editrain: %s on %s x %s%d shards%s (%s, %s%s); model %s with %.2fM "
            "parameters; outer state per rank: %s",
            self.cfg.sync.method, f"{self.replicas} replica{'' if self.replicas == 1 else 's'}",
            f"{topo.pp_size} stages ({d.pp_schedule}, {d.microbatches} microbatches{chunks})"
            f" x " if self.pp else "",
            topo.shard_size,
            f" x {topo.tp_size} tp" if topo.tp_size > 1 else "", self.info.device.type,
            dist.get_backend(),
            f"; fault-tolerant, this is replica {self.replica}" if self.ft else "",
            self.cfg.model.hf_config or self.cfg.model.init_from or self.cfg.model.preset,
            self.num_params / 1e6,
            ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items()) or "none yet",
        )
        note = one_replica_note(self.cfg.sync.method, self.replicas, self.ft)
        if note:
            log.warning(note)

    def _mark_job_start(self) -> None:
        """The first row of this job in this rank's file (and ``metrics.jsonl``): its rows
        follow, numbered from ``step``. Readers tell a resumed run's latest job by it
        (:func:`editrain.metrics.latest_job`): A-EDiT's checkpoint label is a progress,
        and its replicas count their own steps, so no step says where a job started."""
        row = {"event": JOB_START, "step": self.loop.step}
        self.rank_log.write(row)
        self._write(dict(row))

    def _progress_bar(self):
        if self.quiet:
            return None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("[bold]train"), BarColumn(),
                            TextColumn("{task.completed:.0f}/{task.total}"),
                            TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self._task = progress.add_task("train", total=self.cfg.train.steps,
                                       completed=self.engine.progress_steps, info="")
        progress.start()
        return progress

    def close(self, release: bool = True) -> None:
        """Release hooks, threads and files; with ``release`` (every rank finished) also
        the engine's process groups (:meth:`editrain.sync.edit.SyncEngine.close`)."""
        self.engine.close(release=release)
        self.metrics.close()
        if self.ft_group is not None:
            self.ft_group.shutdown()

    # ------------------------------------------------------------------ fault tolerance
    def _ft_join(self) -> dict[str, Any] | None:
        """Take part in the first quorum; a replica that restarts heals there (the global
        model, outer and inner optimizer state, step and data position from a peer).

        Returns:
            The ``ft_join`` event row of a replica that healed, for the logging rank to
            write after the job's start (:meth:`_begin`); None otherwise.
        """
        # A group the launcher restarted rejoins a running job (one peer to heal from is
        # enough); any other start, a resume included, waits for every replica group.
        rejoining = env_int(ATTEMPT_ENV, 0) > 0
        self.engine.join(start_quorum=min(2, self.replicas) if rejoining else None,
                         timeout_s=max(600.0, 2 * self.cfg.dist.ft_join_timeout_s),
                         between_attempts=self.run_end_watch)
        syncs = self.engine.pop_sync_log()
        if self.loop.healed_at is None:
            return None
        # Evaluations and checkpoints the peers already took are not repeated here.
        self.loop.skip_due(self.loop.step, self.cfg.train.eval_every, self.cfg.checkpoint.every)
        if not self.is_logger:
            return None
        log.warning("replica %d joined the running job at step %d (healed from a peer)",
                    self.replica, self.loop.step)
        return {"event": "ft_join", "step": self.loop.step, "tokens": self._tokens(),
                "replica": self.replica, "wall_time_s": self._wall(),
                "unix_time": time.time(), "sync": syncs[-1] if syncs else None}

    def _ft_state(self) -> dict[str, Any]:
        """The trainer's share of what a healing replica receives (see ``_ft_join``)."""
        return {**self.loop.heal_state(self.engine.global_step),
                "data": self.data.state_dict(),
                "optimizer": local_optimizer_state(self.optimizer)}

    def _load_ft_state(self, sd: dict[str, Any]) -> None:
        self.loop.adopt(sd)
        self.data.adopt(sd["data"])  # the peer's position, our share
        load_local_optimizer_state(self.optimizer, sd["optimizer"])
        self.loop.healed_at = self.loop.step


def one_replica_note(method: str, replicas: int, ft: bool) -> str | None:
    """The warning of a local-SGD run that has one replica, or None.

    ``--method edit --nproc 2`` is one replica of two FSDP shards at the default
    ``dist.shard_size`` of 2, not two replicas: its syncs have no other replica's progress
    to average, and only apply the outer optimizer to this replica's own. That is a valid
    run (a baseline, a smoke test), but rarely the one meant, and nothing else in its output
    says so.

    Args:
        method: ``sync.method``.
        replicas: the run's replicas (with ``--ft``, its replica groups).
        ft: whether the run is fault-tolerant (its groups are ``dist.ft_replicas``).
    """
    if replicas != 1 or method == "sync":
        return None
    more = ("set dist.ft_replicas (or dist.nproc) for more groups" if ft else
            "a replica is dist.pp_size x shard_size x tp_size of the dist.nproc ranks: "
            "a smaller --shard-size or a larger --nproc makes more")
    return (f"sync.method = {spelled(method)} on one replica: its syncs have no other replica to "
            f"average with and only apply the outer optimizer to its own progress ({more})")


def sync_summary(entry: dict[str, Any]) -> str:
    """One compact log line for a finished sync (the full record is in metrics.jsonl).

    A fault-tolerant round (it says whether it was ``committed``) that synced nothing is
    no sync: one that did not commit, or the closing round where nobody trained since
    the last, is said to be a round, so the lines that say "sync" are the syncs that
    happened (``num_syncs``). Each is numbered by its index, as in metrics.jsonl."""
    committed = entry.get("committed")
    if committed is False:
        head = f"round {entry['sync']} not committed"
    elif committed and not entry.get("units"):
        head = f"round {entry['sync']} (nothing to sync)"
    else:
        head = f"sync {entry['sync']}"
    # A streaming round names its fragment; a delayed one its launch (the rounds the end
    # forces on a streaming run run at once: a fragment and no launch step).
    where = [f"fragment {entry['fragment']}"] if "fragment" in entry else []
    if "launch_step" in entry:
        where.append(f"launched @step {entry['launch_step']}")
    if where:
        head += f" ({', '.join(where)})"
    parts = [f"{head} @step {entry['step']}: waited {entry['wait_s'] * 1e3:.0f} ms, "
             f"comm {entry['comm_time_s'] * 1e3:.0f} ms, {entry['bytes_sent'] / 2**20:.2f} MiB sent"]
    if entry.get("hidden") is not None:
        parts.append(f"{entry['hidden']:.0%} hidden")
    if entry.get("replica_steps"):
        parts.append("steps " + "/".join(f"{s:g}" for s in entry["replica_steps"]))
    weights = entry.get("weights")
    if weights:  # [R][L]: show each replica's mean weight over units
        parts.append("weights " + " ".join(f"{sum(w) / len(w):.2f}" for w in weights))
    outlier = entry.get("outlier")
    if outlier:
        flagged = [f"r{r}:{sum(row)}" for r, row in enumerate(outlier) if any(row)]
        parts.append("outliers " + (" ".join(flagged) if flagged else "none"))
    clip = [c for c in entry.get("clip", []) if c == c]  # drop NaN (skipped units)
    if clip and min(clip) < 1.0:
        parts.append(f"clipped {sum(c < 1.0 for c in clip)} units (min x{min(clip):.2f})")
    if entry.get("error"):
        parts.append(f"error: {entry['error']}")
    return "; ".join(parts)


def times_said(run_s: float, job_s: float, resumed: bool, command_s: float | None) -> str:
    """The times of the ``done:`` line, each saying what it counts.

    ``run_s`` is ``summary.json``'s ``wall_time_s``: the run's clock of its training
    loop, which starts once a job's model and data are ready (its evaluations and
    checkpoints included) and goes on across resumes from the checkpoint's. A short run's
    is a small part of the command's time (0.2 s of 3 s), which also starts the
    interpreter, checks the inputs, reads the data and starts the workers: that is given
    beside it ("end to end"), where it is known, and for a resumed run, whose clock holds
    its earlier jobs' too, this job's part.

    Args:
        run_s: the run's clock at the end.
        job_s: the part of it this job ran.
        resumed: the job resumed the run (its clock did not start at 0).
        command_s: seconds since this job's ``editrain train`` command started (None:
            not known, e.g. a library call).
    """
    said = (f"{run_s:.1f} s training over the run's jobs, {job_s:.1f} s in this one"
            if resumed else f"{run_s:.1f} s training")
    return said + (f", {command_s:.1f} s end to end" if command_s is not None else "")


def restart_line(restart_count: int, rejoined: bool | None, ckpt: Path | None) -> str:
    """The log line of an attempt that goes on with its run: what happened, then what it
    resumes.

    Torch elastic counts the restarts it made (``TORCHELASTIC_RESTART_COUNT``), not the
    one a change of the nodes taking part caused: such an attempt rejoins its launch's run
    (rank 0's decision, ``rejoined``, from the launch's own token in torchrun's store)
    with a count of 0, which "worker restart 0" misreported as no restart at all.

    Args:
        restart_count: ``TORCHELASTIC_RESTART_COUNT`` of this attempt.
        rejoined: rank 0's decision under torchrun (True: it goes on with its launch's
            run); None where none was given (the local launcher).
        ckpt: the checkpoint it resumes, None where the run has written none yet.
    """
    what = f"resuming from {ckpt}" if ckpt else "no checkpoint yet, starting over"
    if rejoined and restart_count == 0:
        return (f"rejoining this launch's run after a restart torch elastic did not count "
                f"(a change of the nodes taking part): {what}")
    return f"worker restart {restart_count}: {what}"


def replays_logged_rows(cfg: Config, exact: bool) -> bool:
    """Whether a job resumed from a checkpoint (``exact``: on the topology that saved it)
    computes again the rows ``metrics.jsonl`` already holds past the checkpoint, so that
    its own rows up to the last step logged are replays (``"replayed": true``, which
    readers leave out as duplicates).

    Only an exact resume of a run whose steps do not depend on the clock does. An elastic
    resume trains other batches on other replicas from the global model, and after one
    A-EDiT numbers steps anew (the mean of the last sync, in the new topology's steps):
    what it logs at a step logged before is another computation, its final evaluation
    the run's. A-EDiT on the wall clock (no ``sim.step_schedule``) syncs when the time is
    up, so even an exact resume takes other steps per window: its rows are new too.
    """
    if not exact:
        return False
    return not (cfg.sync.use_async and not cfg.sim.step_schedule)


def _logged_history(run_dir: Path) -> list[dict[str, Any]]:
    """The run's current history in ``metrics.jsonl``
    (:func:`~editrain.metrics.current_rows`; empty without the file): what a resumed job
    that computes logged rows again replays (:class:`~editrain.metrics.ReplayMarks`)."""
    try:
        return current_rows(read_metrics(run_dir))
    except FileNotFoundError:
        return []


def run_worker(cfg: Config, run_dir: str | Path, data_entry: str | None = None,
               rejoined: bool | None = None,
               run_ended: Callable[[], str | None] | None = None) -> dict[str, Any]:
    """Entry point of one worker process (spawned by the launcher or by torchrun).

    The process is set up first (:func:`editrain.runtime.setup_process`: it dies with the
    process that started it, also one killed with SIGKILL, and ends quietly on SIGINT, the
    launcher reporting it once); an exception is written with its traceback to
    ``logs/rank{RANK}.log`` of the run and raised again, for the launcher to report in one
    line (see :mod:`editrain.spawn`).

    Args:
        cfg: the validated configuration.
        run_dir: the run directory (prepared by the launcher).
        data_entry: the token cache entry the launcher prepared (None under torchrun:
            every rank finds it from ``cfg.data``).
        rejoined: under torchrun, rank 0's decision for this attempt: it goes on with its
            launch's run (True) or made a new claim (False); None: not told (see
            :class:`Trainer`).
        run_ended: a torchrun replica group's look at whether the run ended while it
            waits in its first quorum (see :class:`Trainer`).
    """
    from editrain.spawn import errors_logged

    setup_process(cfg)
    with errors_logged(logs_dir(cfg, run_dir), env_int("RANK", 0),
                       env_int("WORLD_SIZE", 1, minimum=1)):
        trainer = Trainer(cfg, Path(run_dir), data_entry, rejoined, run_ended)
        finished = False
        try:
            result = trainer.train()
            finished = True
            return result
        finally:
            # Only a rank that finished waits for the others before its groups go: one that
            # failed must exit, for the launcher to see it.
            trainer.close(release=finished)
            if dist.is_initialized():
                dist.destroy_process_group()
