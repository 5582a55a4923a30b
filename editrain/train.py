"""The training loop: one :class:`Trainer` per process.

``Trainer.__init__`` builds (mesh, data, model, sharding, optimizers, sync engine),
``Trainer.train()`` loops, ``Trainer.train_step()`` does one inner step, ``evaluate()`` the
validation loss. The method itself lives in :mod:`editrain.sync`; this file only wires it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from editrain.api import parallelize
from editrain.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    rng_state,
    run_meta,
    save_checkpoint,
    set_rng_state,
)
from editrain.config import Config, ConfigError, model_config, validate_world
from editrain.corpus import prepare_data
from editrain.data import SequenceStream, check_batch_size, eval_batches
from editrain.metrics import MetricsWriter, RankLog, read_metrics
from editrain.models import Llama, causal_lm_loss, num_parameters
from editrain.optim import build_optimizer, wrap_sam
from editrain.optim.wsam import global_norm
from editrain.rundir import lineage_of
from editrain.sim import ComputeSlowdown, check_replicas, parse_sim
from editrain.sync import StepScheduleTrigger, SyncEngine
from editrain.topology import SHARD_DIM, init_mesh

log = logging.getLogger("editrain")


def lr_at(step: float, cfg: Config) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio * lr`` over ``train.steps``."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """Builds and runs one rank of a training job.

    Args:
        cfg: the validated configuration.
        run_dir: where metrics, config and checkpoints go (created by the launcher).
    """

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        validate_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.plan = parse_sim(cfg.sim)
        device_type = None if cfg.dist.device == "auto" else cfg.dist.device
        backend = None if cfg.dist.backend == "auto" else cfg.dist.backend
        self.info = info = init_mesh(cfg.dist.shard_size, backend=backend, device_type=device_type,
                                     tp_size=cfg.dist.tp_size)
        # The fault-tolerant mode: this job is one replica group of several (its world is
        # the group's ranks); every other mode: the world holds every replica.
        self.ft = cfg.dist.fault_tolerance == "torchft"
        if self.ft:
            from editrain.fault import ft_identity

            self.replica, self.replicas = ft_identity(cfg, info.topo.replica_size)
            self.run_dir = self.run_dir / f"replica{self.replica}"
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.replica, self.replicas = info.replica, info.topo.num_replicas
        # Data ranks: the tp peers of a shard read the same batches.
        self.global_rank = self.replica * info.topo.shard_size + info.shard
        self.global_world = self.replicas * info.topo.shard_size
        check_replicas(self.plan, self.replicas + cfg.sim.replica_offset)
        self.is_logger = info.rank == 0
        self.quiet = cfg.quiet or not self.is_logger or (self.ft and self.replica != 0)

        # ---- data: every rank reads a disjoint stream; evaluation covers the whole
        # validation split, shared out over all ranks (see evaluate()).
        self.data = prepare_data(cfg)
        t = cfg.train
        # (The local launcher checked this already; under torchrun this is the first look
        # at the corpus, and an absurd batch size would loop in the sampler.)
        try:
            check_batch_size(self.data.train, t.seq_len, t.batch_size, self.global_world)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.stream = SequenceStream(self.data.train, t.seq_len, self.global_rank,
                                     self.global_world, t.seed)
        # Lock-step methods share the evaluation out over every rank of every replica. An
        # A-EDiT replica may already wait in its next rendezvous (a blocking cross-replica
        # collective) when another evaluates, so there each replica evaluates the whole
        # split over its own ranks, with no cross-replica collective.
        self.eval_everyone = not cfg.sync.use_async
        # (over this job's world: in the fault-tolerant mode a replica group's own ranks)
        eval_rank, eval_world = ((info.topo.data_rank(info.rank), info.topo.data_world)
                                 if self.eval_everyone else (info.shard, info.topo.shard_size))
        self.val = eval_batches(self.data.val, t.seq_len, t.batch_size, eval_rank, eval_world,
                                t.eval_tokens)

        # ---- model, sharding, optimizers, sync engine
        if cfg.model.hf_config:
            from editrain.models.hf import HFCausalLM

            self.model = HFCausalLM.from_config_file(
                cfg.model.hf_config, tokenizer_vocab_size=self.data.vocab_size, seed=t.seed,
            ).to(info.device)
        else:
            mcfg = model_config(cfg, vocab_size=self.data.vocab_size)
            self.model = Llama(mcfg, seed=t.seed).to(info.device)
        self.num_params = num_parameters(self.model)
        # FSDP2: one unit per block, embeddings and output head (sync.split_root) plus the
        # root, on the "shard" sub-mesh.
        blocks = parallelize(self.model, info, self.model.blocks(), t.precision,
                             split_root=cfg.sync.split_root)
        self.replica_group = info.mesh.get_group(SHARD_DIM) if info.topo.shard_size > 1 else None
        """The ranks holding one model copy between them (with tensor parallelism: the
        replica's shard x tp ranks): gradient norms are summed over them."""
        if info.topo.tp_size > 1:
            self.replica_group, _ = dist.new_subgroups_by_enumeration(
                [info.topo.replica_ranks(r) for r in range(info.topo.num_replicas)])
        self.optimizer = self._build_optimizer()
        # The simulated link is one FIFO per replica, shared by the replica's ranks.
        link = self.plan.shared_link(self.run_dir / ".link" / f"replica{self.replica}.state")
        self.ft_group = None
        if self.ft:
            from editrain.fault import make_group

            # This job is the replica group: a rank's place in it is its rank (with tensor
            # parallelism, shard x tp positions; the peer in the same place sends its state).
            self.ft_group = make_group(cfg, self.replica, self.replicas, info.rank,
                                       info.topo.replica_size)
        self.engine = SyncEngine(
            self.model, info.mesh, cfg.sync, blocks=blocks,
            link_delay=link,
            before_sync=self._corrupt if self.plan.corrupt else None,
            trigger=StepScheduleTrigger(cfg.sim.step_schedule) if cfg.sim.step_schedule else None,
            seed=t.seed,
            comm_backend=cfg.dist.comm_backend,
            cross_replica=self.ft_group,
        )
        if self.ft_group is not None:
            # What a healthy replica sends one that (re)joins, besides the engine's state.
            self.ft_group.register_state("trainer", self._ft_state, self._load_ft_state)
        self.slowdown = ComputeSlowdown(self.plan, self.replica + cfg.sim.replica_offset,
                                        t.seed)
        self.shard_group = info.mesh.get_group(SHARD_DIM)
        self.tokens_per_step = t.batch_size * t.seq_len * t.gradient_accumulation_steps
        self.aedit = cfg.sync.use_async
        if self.aedit:
            # The engine knows the budget: with the time trigger a replica also enters the
            # rendezvous once the cluster has probably used it up. (A forced step schedule
            # stays deterministic: the run ends at the first sync that reaches it.)
            self.engine.set_budget(cfg.train.steps)
        self.step = 0
        self.steps_run = 0
        """Inner steps this process ran (a healed replica adopts its peers' step count)."""
        self.healed_at: int | None = None
        self.val_tokens = 0
        self.next_eval = t.eval_every
        self.next_ckpt = cfg.checkpoint.every
        self.last_eval = 0
        self.finished = False
        self.wall_offset = 0.0
        self.off_train_s = 0.0  # evaluation and checkpoint time, kept out of train_time_s
        self.resumed_from: Path | None = None
        self.lineage = lineage_of(self.run_dir)
        """This job's run id, timeline and start checkpoint (the launcher's run record;
        None without one): stored in checkpoints, and rotation keeps to the timeline."""
        self.elastic = False
        self.replay_until: int | None = None
        ckpt = self._checkpoint_to_resume()
        if ckpt is not None:
            self._resume(ckpt)
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_logger)
        self.rank_log = RankLog(self.run_dir, info.rank)
        self.wall_start = time.perf_counter()

    def _checkpoint_to_resume(self) -> Path | None:
        """``--resume``, or the latest checkpoint of this run after a worker restart. In
        the fault-tolerant mode each replica group resumes its own checkpoint
        (``RUN_DIR/replica{r}``), and a group the launcher restarted reads nothing: it
        heals from a live peer."""
        if self.ft and int(os.environ.get("EDITRAIN_FT_ATTEMPT", "0")) > 0:
            return None
        if self.cfg.resume:
            return resolve_resume(replica_run_dir(self.cfg.resume, self.replica)
                                  if self.ft else self.cfg.resume)
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            found = list_checkpoints(self.run_dir)
            if self.is_logger:
                log.warning("worker restart %s: %s", os.environ["TORCHELASTIC_RESTART_COUNT"],
                            f"resuming from {found[-1]}" if found else "no checkpoint yet, "
                            "starting over")
            return found[-1] if found else None
        return None

    # ------------------------------------------------------------------ building
    def _build_optimizer(self) -> torch.optim.Optimizer:
        o, t = self.cfg.optim, self.cfg.train
        params = list(self.model.parameters())
        if o.name == "adamw":
            opt = build_optimizer("adamw", params, lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.weight_decay)
        elif o.name == "agd":
            opt = build_optimizer("agd", params, lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.weight_decay, delta=o.agd_delta)
        else:
            opt = build_optimizer("sgd", params, lr=t.lr, momentum=o.momentum,
                                  weight_decay=t.weight_decay)
        if o.sam in (None, "none"):
            return opt
        return wrap_sam(o.sam, opt, rho=o.rho, gamma=o.gamma, adaptive=o.adaptive,
                        decouple=o.decouple, max_norm=t.grad_clip or None,
                        norm_group=self.replica_group)

    def _corrupt(self, sync_index: int) -> None:
        """Fault injection: scale this replica's pseudo-gradient before sync ``sync_index``."""
        target = self.plan.corrupt.get(sync_index)
        if target is None or target[0] != self.replica:
            return
        self.engine.scale_pseudo_gradients(target[1])

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run to the end of the budget; returns the final summary."""
        cfg = self.cfg
        self._log_start()
        if self.ft:
            self._ft_join()
        progress = self._progress_bar()
        final_val = float("nan")
        if self.healed_at is not None:
            pass  # joined a running job: its curve goes on from the peers' step
        elif self.resumed_from is None:
            ev = self.evaluate()
            final_val = ev["val_loss"]
            self._write({"step": 0, "tokens": 0, **ev, "wall_time_s": 0.0})
        elif self.elastic:
            # The global model on the new topology: this loss should continue the curve.
            ev = self.evaluate()
            final_val = ev["val_loss"]
            self._write({"event": "elastic_resume", "step": self.step, "tokens": self._tokens(),
                         **ev, "wall_time_s": self._wall()})
        try:
            while not self._budget_done():
                row = self.train_step()
                point = self._sync_point()  # progress at a sync boundary, else None
                if self.aedit and point is not None and point >= cfg.train.steps:
                    self.engine.finish()  # the last sync of the run
                    self.finished = True
                    row["tokens"] = self._tokens()
                if point is not None and point >= self.next_eval:
                    self.engine.finish()
                    row.update(self.evaluate())
                    final_val = row["val_loss"]
                    self.last_eval = self.step
                    while self.next_eval <= point:
                        self.next_eval += cfg.train.eval_every
                syncs = self.engine.pop_sync_log()
                if syncs:
                    row["sync"] = syncs[-1]
                    if self.is_logger and not cfg.quiet:
                        log.warning("%s", sync_summary(syncs[-1]))
                if self.step % cfg.train.log_every == 0 or "val_loss" in row or "sync" in row:
                    # Every rank of a replica takes this branch at the same step. While
                    # training is synchronous (warm-up, the sync method) the logged loss is
                    # the mean over all ranks; in the local phase it is the logging
                    # replica's mean: a world-wide reduction at every logged step would put
                    # a cross-replica round trip on the slow link into every step and hold
                    # every replica to the slowest one's pace (and for A-EDiT, whose
                    # replicas are at different steps, it could interleave with a
                    # rendezvous and deadlock).
                    row["loss"] = self._mean_loss(row["loss"],
                                                  everyone=self.engine.in_warmup)
                    row["train_time_s"] = self._wall() - self.off_train_s
                    self._write(row)
                if (cfg.checkpoint.every and point is not None and point >= self.next_ckpt
                        and not self._budget_done()):
                    while self.next_ckpt <= point:  # advanced first: saved state is "after"
                        self.next_ckpt += cfg.checkpoint.every
                    self.save()
                if progress is not None:
                    progress.update(self._task, completed=min(self._progress_steps(),
                                                              cfg.train.steps),
                                    info=f"loss {row['loss']:.3f}  val {final_val:.3f}")
            # Every replica ends on the global model, even mid-window.
            self.engine.finish(force=True)
            if self.last_eval != self.step or self.engine.num_syncs_forced:
                ev = self.evaluate()
                final_val = ev["val_loss"]
                self._write({"step": self.step, "tokens": self._tokens(), **ev,
                             "wall_time_s": self._wall()})
            if cfg.checkpoint.final or cfg.checkpoint.every:
                self.save()
        finally:
            if progress is not None:
                progress.stop()
            self.rank_log.close()
        summary = {"steps": self.step, "tokens": self._tokens(), "final_val_loss": final_val,
                   "val_tokens": self.val_tokens, "wall_time_s": self._wall(),
                   "train_time_s": self._wall() - self.off_train_s,
                   "num_syncs": self.engine.num_syncs,
                   "num_params": self.num_params, "method": cfg.sync.method,
                   "replicas": self.replicas, "shard_size": self.info.topo.shard_size,
                   "tp_size": self.info.topo.tp_size,
                   "steps_run": self.steps_run,
                   "tokens_processed": self.steps_run * self.info.topo.data_world
                   * self.tokens_per_step}
        if self.ft:
            summary.update(replica=self.replica, healed_at=self.healed_at,
                           failed_syncs=self.engine.failed_rounds)
        if self.is_logger:
            from editrain.metrics import to_json  # strict JSON: a NaN loss is written null

            (self.run_dir / "summary.json").write_text(to_json(summary, indent=1))
            log.warning("done: %d steps, %d tokens, val loss %.4f, %.1f s, %d syncs",
                        summary["steps"], summary["tokens"], final_val, summary["wall_time_s"],
                        summary["num_syncs"])
        return summary

    def train_step(self) -> dict[str, Any]:
        """One inner step: micro-batches, (warm-up) gradient averaging, optimizer, sync."""
        cfg, t = self.cfg, self.cfg.train
        t0 = time.perf_counter()
        lr = lr_at(self._progress_steps(), cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = [self.stream.next_batch(t.batch_size).to(self.info.device)
                   for _ in range(t.gradient_accumulation_steps)]

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=self.info.device)
            for x in batches:
                loss = causal_lm_loss(self.model(x[:, :-1]), x[:, 1:])
                (loss / len(batches)).backward()
                total += loss.detach() / len(batches)
            self.engine.after_backward()
            return total

        self.model.train()
        wait0, grad0 = self._sync_wait(), self.engine.total_grad_sync_s
        if cfg.optim.sam in (None, "none"):
            loss = closure()
            if t.grad_clip > 0:
                self._clip_gradients(t.grad_clip)
            self.optimizer.step()
        else:
            loss = self.optimizer.step(closure)
        self.optimizer.zero_grad(set_to_none=True)
        grad_sync_s = self.engine.total_grad_sync_s - grad0
        compute_s = time.perf_counter() - t0 - (self._sync_wait() - wait0) - grad_sync_s
        stall_s = self.slowdown.after_compute(self.step, compute_s)
        t1 = time.perf_counter()
        self.engine.step()
        self.step += 1
        self.steps_run += 1
        self.plan.maybe_fail(self.global_rank, self.step, "step")

        step_time = time.perf_counter() - t0
        mine = {"rank": self.global_rank, "replica": self.replica, "shard": self.info.shard,
                **({"tp": self.info.tp} if self.info.topo.tp_size > 1 else {}),
                "step": self.step, "unix_time": time.time(),
                "tokens": self.step * self.tokens_per_step,
                "loss": float(loss), "wall_time_s": self._wall(), "step_time_s": step_time,
                "compute_s": compute_s, "sync_wait_s": self._sync_wait() - wait0,
                "grad_sync_s": grad_sync_s}
        if stall_s:
            mine["sim_stall_s"] = stall_s
        self.rank_log.write(mine)
        row: dict[str, Any] = {
            "step": self.step,
            "tokens": self._tokens(),
            "loss": float(loss),  # this rank's; averaged when the row is logged
            "lr": lr,
            "tokens_per_s": self.tokens_per_step * self.global_world / step_time,
            "step_time_s": step_time,
            "wall_time_s": self._wall(),
            "compute_s": compute_s,
            "sync_wait_s": self._sync_wait() - wait0,
            "grad_sync_s": grad_sync_s,
            "boundary_s": time.perf_counter() - t1,
        }
        if stall_s:
            row["sim_stall_s"] = stall_s
        if self.aedit:
            row["replica_step"] = self.step
        return row

    def _clip_gradients(self, max_norm: float) -> None:
        """``train.grad_clip``: torch's clipping, or under tensor parallelism the norm over
        the replica's shard x tp ranks with every piece counted once
        (:func:`editrain.optim.wsam.global_norm`: the tensors split over different meshes
        there are beyond ``clip_grad_norm_``)."""
        if self.info.topo.tp_size == 1:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        coef = (max_norm / (global_norm(grads, self.replica_group) + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

    def _mean_loss(self, loss: float, everyone: bool) -> float:
        """Mean of ``loss`` over all data ranks (``everyone``) or over this replica's."""
        group = None if everyone else self.shard_group
        size = self.info.topo.data_world if everyone else self.info.topo.shard_size
        if size == 1:
            return loss
        # tp peers hold the same loss: only the first of them counts
        t = torch.tensor([loss if not everyone or self.info.tp == 0 else 0.0],
                         dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t, group=group)
        return float(t[0]) / size

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss over the whole validation split (or ``train.eval_tokens``).

        The split's windows are shared out over all ranks of all replicas and the sums
        all-reduced, so each evaluation costs 1/world of the split per rank (for A-EDiT,
        over the ranks of each replica: see ``__init__``). At a sync
        boundary (where the trainer evaluates) every replica holds the global model, so this
        is the global model's loss; evaluated between syncs it would be the mean over
        replicas of their local models' losses on their shares. Streaming runs (delayed
        outer updates or fragments) evaluate the anchors, the global model, swapped in for
        the evaluation.

        Returns:
            ``val_loss``, ``val_tokens`` (targets evaluated) and ``eval_time_s``.
        """
        t0 = time.perf_counter()
        streaming = self.cfg.sync.streaming and self.engine.has_anchors
        total = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        with self.engine.global_model() if streaming else contextlib.nullcontext():
            self.model.eval()
            for batch in self.val:
                x = batch.tokens.to(self.info.device)
                loss = causal_lm_loss(self.model(x[:, :-1]), x[:, 1:])
                # Padding passes (targets == 0) keep the forward count equal on every rank.
                total[0] += loss.double() * batch.targets
                total[1] += batch.targets
            self.model.train()
        if self.eval_everyone and self.info.topo.world_size > 1:
            if self.info.tp:
                total.zero_()  # tp peers evaluated the same windows: the first counts
            dist.all_reduce(total)
        elif not self.eval_everyone and self.info.topo.shard_size > 1:
            dist.all_reduce(total, group=self.shard_group)
        self.val_tokens = int(total[1])
        elapsed = time.perf_counter() - t0
        self.off_train_s += elapsed
        return {"val_loss": float(total[0] / total[1]), "val_tokens": self.val_tokens,
                "eval_time_s": elapsed}

    # ------------------------------------------------------------------ progress
    def _progress_steps(self) -> float:
        """Progress in synchronous-step equivalents (the engine's; see
        ``SyncEngine.progress_steps``)."""
        return self.engine.progress_steps

    def _sync_point(self) -> float | None:
        """Progress if this step boundary is a sync point, else None (the engine decides;
        see ``SyncEngine.sync_point``)."""
        return self.engine.sync_point()

    def _budget_done(self) -> bool:
        if self.aedit:
            return self.finished
        return self.step >= self.cfg.train.steps

    # ------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict[str, Any]:
        return run_meta(self.cfg, self.data.vocab_size, self.info.topo.shape, data=self.data)

    def save(self) -> None:
        """Write a checkpoint (collective; no effect on training)."""
        # An armed layer-wise sync is run now rather than in the next forward: the same
        # jobs in the same order (so training is unchanged), and the anchors saved are the
        # global model of this step, which an elastic resume starts from.
        self.engine.finish()
        t_save = time.perf_counter()
        label = int(round(self._progress_steps())) if self.aedit else self.step
        rank_state = {
            "step": self.step,
            "next_eval": self.next_eval,
            "next_ckpt": self.next_ckpt,
            "last_eval": self.last_eval,
            "finished": self.finished,
            "wall_time_s": self._wall(),
            "off_train_s": self.off_train_s,
            "data": self.stream.state_dict(),
            "rng": rng_state(),
            "sim_rng": list(self.slowdown.rng.getstate()[1]),
        }
        if self.info.topo.tp_size > 1:
            rank_state["tp"] = self.info.tp
        if self.ft_group is not None:  # torchft's count of committed syncs: a group that
            rank_state["ft_committed"] = self.ft_group.committed_syncs  # resumes behind heals
        # (the engine's own state is saved by save_checkpoint: engine.state_dict())
        saved = save_checkpoint(self.run_dir, label, model=self.model, optimizer=self.optimizer,
                                engine=self.engine, replica=self.info.replica,
                                rank_state=rank_state, meta=self._meta(),
                                keep=self.cfg.checkpoint.keep, lineage=self.lineage,
                                before_commit=lambda: self.plan.maybe_fail(
                                    self.global_rank, self.step, "checkpoint"))
        if self.is_logger:
            log.warning("checkpoint %s: %.1f MiB in %.2f s", saved.path, saved.bytes / 2**20,
                        saved.seconds)
            self._write({"event": "checkpoint", "step": self.step, "path": str(saved.path),
                         "bytes": saved.bytes, "save_time_s": saved.seconds})
        self.off_train_s += time.perf_counter() - t_save

    def _resume(self, ckpt: Path) -> None:
        state, marker = load_checkpoint(ckpt, model=self.model, optimizer=self.optimizer,
                                        engine=self.engine, replica=self.info.replica,
                                        rank=self.info.rank, meta=self._meta())
        self.resumed_from = ckpt
        if self.is_logger:
            self.replay_until = _last_logged_step(self.run_dir)
        if state is not None:  # same topology: exact
            self.step = state["step"]
            self.next_eval, self.next_ckpt = state["next_eval"], state["next_ckpt"]
            self.last_eval, self.finished = state["last_eval"], state["finished"]
            self.wall_offset = state["wall_time_s"]
            self.off_train_s = state.get("off_train_s", 0.0)
            self.stream.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            rs = self.slowdown.rng.getstate()
            self.slowdown.rng.setstate((rs[0], tuple(state["sim_rng"]), rs[2]))
            if self.ft_group is not None and "ft_committed" in state:
                self.ft_group.committed_syncs = int(state["ft_committed"])
            if self.is_logger:
                log.warning("resumed exactly from %s at step %d", ckpt, self.step)
            return
        # Elastic: different number of replicas or shards.
        self.elastic = True
        old = [json.loads(p.read_text()) for p in sorted(ckpt.glob("rank_*.json"))]
        old = [o for o in old if not o.get("tp")]  # tp peers saved the same data position
        first = old[0]
        t = self.cfg.train
        # The engine restarted every replica at one step (A-EDiT: the mean of the last sync).
        self.step = self.engine.global_step
        self.next_eval, self.next_ckpt = first["next_eval"], first["next_ckpt"]
        self.last_eval, self.wall_offset = first["last_eval"], first["wall_time_s"]
        self.off_train_s = first.get("off_train_s", 0.0)
        self.stream = SequenceStream.repartition(
            self.data.train, t.seq_len, t.seed, [o["data"] for o in old],
            self.global_rank, self.global_world)
        if self.is_logger:
            old_r, old_s = marker["topology"][:2]
            log.warning(
                "elastic resume from %s: %dx%d -> %dx%d (replicas x shards). Carried over: "
                "the global model (anchors), outer optimizer state, anomaly detectors of "
                "replicas 0..%d, replica 0's inner optimizer state, step %d and the data "
                "epoch (the unread rest of it is re-partitioned). Reset: every replica's "
                "local progress since the last sync, the sync clock.",
                ckpt, old_r, old_s, self.info.topo.num_replicas, self.info.topo.shard_size,
                min(old_r, self.info.topo.num_replicas) - 1, self.step)

    # ------------------------------------------------------------------ helpers
    def _write(self, row: dict[str, Any]) -> None:
        if self.replay_until is not None and row.get("step", 0) <= self.replay_until \
                and "event" not in row:
            row["replayed"] = True
        self.metrics.write(row)

    def _wall(self) -> float:
        return self.wall_offset + time.perf_counter() - self.wall_start

    def _sync_wait(self) -> float:
        return self.engine.total_wait_s

    def _tokens(self) -> int:
        # A-EDiT after an elastic resume counts progress in the first topology's steps.
        ranks = self.engine.tokens_scale if self.aedit else self.global_world
        return int(round(self._progress_steps() * ranks * self.tokens_per_step))

    def _log_start(self) -> None:
        if not self.is_logger:
            return
        topo, mem = self.info.topo, self.engine.extra_memory()
        log.warning(
            "editrain: %s on %d replicas x %d shards%s (%s, %s%s); model %s with %.2fM "
            "parameters; outer state per rank: %s",
            self.cfg.sync.method, self.replicas, topo.shard_size,
            f" x {topo.tp_size} tp" if topo.tp_size > 1 else "", self.info.device.type,
            dist.get_backend(),
            f"; fault-tolerant, this is replica {self.replica}" if self.ft else "",
            self.cfg.model.hf_config or self.cfg.model.preset,
            self.num_params / 1e6,
            ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items()) or "none yet",
        )

    def _progress_bar(self):
        if self.quiet:
            return None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("[bold]train"), BarColumn(),
                            TextColumn("{task.completed:.0f}/{task.total}"),
                            TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self._task = progress.add_task("train", total=self.cfg.train.steps,
                                       completed=self._progress_steps(), info="")
        progress.start()
        return progress

    def close(self) -> None:
        """Release hooks, threads and files."""
        self.engine.close()
        self.metrics.close()
        if self.ft_group is not None:
            self.ft_group.shutdown()

    # ------------------------------------------------------------------ fault tolerance
    def _ft_join(self) -> None:
        """Take part in the first quorum; a replica that restarts heals there (the global
        model, outer and inner optimizer state, step and data position from a peer)."""
        # A group the launcher restarted rejoins a running job (one peer to heal from is
        # enough); any other start, a resume included, waits for every replica group.
        rejoining = int(os.environ.get("EDITRAIN_FT_ATTEMPT", "0")) > 0
        self.engine.join(start_quorum=min(2, self.replicas) if rejoining else None,
                         timeout_s=max(600.0, 2 * self.cfg.dist.ft_join_timeout_s))
        syncs = self.engine.pop_sync_log()
        if self.healed_at is not None:
            # Evaluations and checkpoints the peers already took are not repeated here.
            every = self.cfg.train.eval_every
            while every and self.next_eval <= self.step:
                self.next_eval += every
            every = self.cfg.checkpoint.every
            while every and self.next_ckpt <= self.step:
                self.next_ckpt += every
        if self.healed_at is not None and self.is_logger:
            log.warning("replica %d joined the running job at step %d (healed from a peer)",
                        self.replica, self.step)
            self._write({"event": "ft_join", "step": self.step, "tokens": self._tokens(),
                         "replica": self.replica, "wall_time_s": self._wall(),
                         "unix_time": time.time(),
                         "sync": syncs[-1] if syncs else None})

    def _ft_state(self) -> dict[str, Any]:
        """The trainer's share of what a healing replica receives (see ``_ft_join``)."""
        from editrain.fault import local_optimizer_state

        return {"step": self.engine.global_step, "next_eval": self.next_eval,
                "next_ckpt": self.next_ckpt, "last_eval": self.last_eval,
                "data": self.stream.state_dict(),
                "optimizer": local_optimizer_state(self.optimizer)}

    def _load_ft_state(self, sd: dict[str, Any]) -> None:
        from editrain.fault import load_local_optimizer_state

        self.step = int(sd["step"])
        self.next_eval, self.next_ckpt = sd["next_eval"], sd["next_ckpt"]
        self.last_eval = sd["last_eval"]
        data = dict(sd["data"], rank=self.stream.rank)  # the peer's position, our share
        data["position"] = min(int(data["position"]), self.stream.share_size)
        self.stream.load_state_dict(data)
        load_local_optimizer_state(self.optimizer, sd["optimizer"])
        self.healed_at = self.step


def sync_summary(entry: dict[str, Any]) -> str:
    """One compact log line for a finished sync (the full record is in metrics.jsonl)."""
    head = f"sync {entry['sync']}"
    if "fragment" in entry:
        head += f" (fragment {entry['fragment']}, launched @step {entry['launch_step']})"
    elif "launch_step" in entry:
        head += f" (launched @step {entry['launch_step']})"
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
    return "; ".join(parts)


def replica_run_dir(path: str | Path, replica: int) -> Path:
    """A fault-tolerant run's directory of replica group ``replica`` (``path`` itself if it
    is not a fault-tolerant run directory, e.g. a checkpoint path)."""
    sub = Path(path) / f"replica{replica}"
    return sub if sub.is_dir() else Path(path)


def _last_logged_step(run_dir: Path) -> int | None:
    """The highest step already in ``metrics.jsonl`` (rows up to it are replays)."""
    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        return None
    steps = [r["step"] for r in rows if "step" in r and "event" not in r]
    return max(steps) if steps else None


def worker_threads(cfg: Config) -> int:
    """Intra-op threads of one worker: ``dist.threads_per_proc`` if set, else what the
    user (or torchrun, which sets 1 unless told otherwise) put in ``OMP_NUM_THREADS``, else
    the machine's cores shared out over the local processes."""
    if cfg.dist.threads_per_proc:
        return cfg.dist.threads_per_proc
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


MALLOC_MMAP_THRESHOLD = 32 * 2**20
"""Blocks at least this large are ``mmap``-ed by glibc's malloc (glibc's own ceiling)."""
MALLOC_TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the top of glibc's heap that it keeps instead of handing back."""
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
               "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory a training step frees, for the next step.

    A CPU step allocates and frees the same activation and gradient buffers every time.
    By default glibc ``mmap``s the larger ones afresh (its threshold follows the blocks
    freed so far) and returns free memory at the top of its heap to the kernel once it
    exceeds twice that threshold; whether a step's buffers land in reused pages or in
    new ones then depends on the heap's layout, and new pages cost a page fault each
    (zeroed by the kernel). Measured on the tiny preset (2 replicas x 1 process, 2
    cores): 2,000 to 4,000 page faults per step, 19 to 21 ms of CPU per step, against
    none and 15 ms with this setting. Blocks below ``MALLOC_MMAP_THRESHOLD`` come from
    the heap and the heap is never trimmed below ``MALLOC_TRIM_THRESHOLD`` of free
    memory, so a worker's resident memory stays at its peak (as with PyTorch's caching
    allocators on accelerators).

    Only on glibc, and not when the user set any of glibc's ``MALLOC_*_`` tuning
    variables (their choice stands); a preloaded allocator (jemalloc, tcmalloc) does
    not read these settings.

    Returns:
        Whether the settings were applied.
    """
    import ctypes
    import platform
    import sys

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
                and mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


def run_worker(cfg: Config, run_dir: str | Path) -> dict[str, Any]:
    """Entry point of one worker process (spawned by the launcher or by torchrun).

    The process dies with the process that started it, also one killed with SIGKILL, and
    ends quietly on SIGINT (the launcher reports it once); an exception is written with
    its traceback to ``logs/rank{RANK}.log`` of the run and raised again, for the launcher
    to report in one line (see :mod:`editrain.spawn`).

    Args:
        cfg: the validated configuration.
        run_dir: the run directory (prepared by the launcher).
    """
    from editrain.launch import logs_dir
    from editrain.spawn import die_with_parent, errors_logged, sigint_ends_quietly

    die_with_parent()
    sigint_ends_quietly()
    torch.set_num_threads(worker_threads(cfg))
    keep_freed_memory()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with errors_logged(logs_dir(cfg, run_dir), int(os.environ.get("RANK", "0")),
                       int(os.environ.get("WORLD_SIZE", "1"))):
        trainer = Trainer(cfg, Path(run_dir))
        try:
            return trainer.train()
        finally:
            trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()
