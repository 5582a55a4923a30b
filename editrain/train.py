"""The training loop: one :class:`Trainer` per process.

``Trainer.__init__`` builds (mesh, data, model, sharding, optimizers, sync engine),
``Trainer.train()`` loops, ``Trainer.train_step()`` does one inner step, ``evaluate()`` the
validation loss. The method itself lives in :mod:`editrain.sync`; this file only wires it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from editrain.config import Config, model_config, validate_world
from editrain.data import SequenceStream, prepare_tokens, val_batches
from editrain.metrics import MetricsWriter
from editrain.models import Llama, causal_lm_loss, num_parameters
from editrain.optim import build_optimizer, wrap_sam
from editrain.sim import ComputeSlowdown, check_replicas, parse_sim
from editrain.sync import EDiT
from editrain.topology import SHARD_DIM, MeshInfo, init_mesh

log = logging.getLogger("editrain")


def shard_model(model: torch.nn.Module, blocks: list[torch.nn.Module], info: MeshInfo,
                precision: str) -> None:
    """FSDP2: one ``fully_shard`` unit per block plus the root, on the ``"shard"`` sub-mesh."""
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )
    for block in blocks:
        fully_shard(block, mesh=info.shard_mesh, mp_policy=mp)
    fully_shard(model, mesh=info.shard_mesh, mp_policy=mp)


def lr_at(step: int, cfg: Config) -> float:
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
        self.info = info = init_mesh(cfg.dist.shard_size, backend=backend, device_type=device_type)
        check_replicas(self.plan, info.topo.num_replicas)
        self.is_logger = info.rank == 0
        self.quiet = cfg.quiet or not self.is_logger

        # ---- data: every rank reads a disjoint stream; validation is the same everywhere
        self.data = prepare_tokens(
            cfg.data.path, Path(cfg.data.cache_dir).expanduser(), cfg.data.vocab_size,
            cfg.data.tokenizer, cfg.data.val_fraction, cfg.data.max_bytes,
        )
        t = cfg.train
        self.stream = SequenceStream(self.data.train, t.seq_len, info.rank,
                                     info.topo.world_size, t.seed)
        # The whole replica evaluates the same windows, so no cross-replica traffic is needed.
        self.val = val_batches(self.data.val, t.seq_len, t.batch_size, t.eval_batches,
                               info.shard, info.topo.shard_size)

        # ---- model, sharding, optimizers, sync engine
        mcfg = model_config(cfg, vocab_size=self.data.vocab_size)
        self.model = Llama(mcfg, seed=t.seed).to(info.device)
        self.num_params = num_parameters(self.model)
        blocks = self.model.blocks()
        shard_model(self.model, blocks, info, t.precision)
        self.optimizer = self._build_optimizer()
        self.engine = EDiT(
            self.model, info.mesh, cfg.sync, blocks=blocks,
            link_delay=self.plan.link_delay if self.plan.has_link else None,
            before_sync=self._corrupt if self.plan.corrupt else None,
            seed=t.seed,
        )
        self.slowdown = ComputeSlowdown(self.plan, info.replica, t.seed)
        self.shard_group = info.mesh.get_group(SHARD_DIM)
        self.tokens_per_step = t.batch_size * t.seq_len * t.gradient_accumulation_steps
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_logger)
        self.step = 0
        self.wall_start = time.perf_counter()
        self.next_eval = 0

    # ------------------------------------------------------------------ building
    def _build_optimizer(self) -> torch.optim.Optimizer:
        cfg, o, t = self.cfg, self.cfg.optim, self.cfg.train
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
                        norm_group=self.info.mesh.get_group(SHARD_DIM)
                        if cfg.dist.shard_size > 1 else None)

    def _corrupt(self, sync_index: int) -> None:
        """Fault injection: scale this replica's pseudo-gradient before sync ``sync_index``."""
        target = self.plan.corrupt.get(sync_index)
        if target is None or target[0] != self.info.replica:
            return
        with torch.no_grad():
            for unit in self.engine.units:
                if unit.anchor is not None:
                    unit.load_flat(unit.anchor.to(unit.device) - target[1] * unit.pseudo_grad())

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run to the end of the budget; returns the final summary."""
        cfg = self.cfg
        self._log_start()
        progress = self._progress()
        final_val = self.evaluate()
        self.metrics.write({"step": 0, "tokens": 0, "val_loss": final_val,
                            "wall_time_s": 0.0})
        self.next_eval = cfg.train.eval_every
        last_eval = 0
        try:
            while self.step < cfg.train.steps:
                row = self.train_step()
                if self._eval_due():
                    self.engine.finish()
                    row["val_loss"] = final_val = self.evaluate()
                    last_eval = self.step
                    while self.next_eval <= self.step:
                        self.next_eval += cfg.train.eval_every
                if self.step % cfg.train.log_every == 0 or "val_loss" in row or "sync" in row:
                    self.metrics.write(row)
                if progress is not None:
                    progress.update(self._task, advance=1,
                                    info=f"loss {row['loss']:.3f}  val {final_val:.3f}")
            # Every replica ends on the global model, even mid-window.
            self.engine.finish(force=True)
            if last_eval != self.step or self.engine.num_syncs_forced:
                final_val = self.evaluate()
                self.metrics.write({"step": self.step, "tokens": self._tokens(),
                                    "val_loss": final_val,
                                    "wall_time_s": time.perf_counter() - self.wall_start})
        finally:
            if progress is not None:
                progress.stop()
        summary = {"steps": self.step, "tokens": self._tokens(), "final_val_loss": final_val,
                   "wall_time_s": time.perf_counter() - self.wall_start,
                   "num_syncs": self.engine.num_syncs}
        if self.is_logger:
            log.warning("done: %d steps, %d tokens, val loss %.4f, %.1f s, %d syncs",
                        summary["steps"], summary["tokens"], final_val, summary["wall_time_s"],
                        summary["num_syncs"])
        return summary

    def train_step(self) -> dict[str, Any]:
        """One inner step: micro-batches, (warm-up) gradient averaging, optimizer, sync."""
        cfg, t = self.cfg, self.cfg.train
        t0 = time.perf_counter()
        lr = lr_at(self.step, cfg)
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
        if cfg.optim.sam in (None, "none"):
            loss = closure()
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
            self.optimizer.step()
        else:
            loss = self.optimizer.step(closure)
        self.optimizer.zero_grad(set_to_none=True)
        compute_s = time.perf_counter() - t0
        self.slowdown.after_compute(self.step, compute_s)
        self.engine.step()
        self.step += 1

        if self.info.topo.shard_size > 1:
            dist.all_reduce(loss, group=self.shard_group)
            loss = loss / self.info.topo.shard_size
        step_time = time.perf_counter() - t0
        row: dict[str, Any] = {
            "step": self.step,
            "tokens": self._tokens(),
            "loss": float(loss),
            "lr": lr,
            "tokens_per_s": self.tokens_per_step * self.info.topo.world_size / step_time,
            "step_time_s": step_time,
            "wall_time_s": time.perf_counter() - self.wall_start,
            "compute_s": compute_s,
        }
        syncs = self.engine.pop_sync_log()
        if syncs:
            row["sync"] = syncs[-1]
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss of this replica's model over the fixed validation windows."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        for x in self.val:
            x = x.to(self.info.device)
            loss = causal_lm_loss(self.model(x[:, :-1]), x[:, 1:])
            total += torch.tensor([float(loss) * x.shape[0], x.shape[0]], dtype=torch.float64,
                                  device=self.info.device)
        self.model.train()
        if self.info.topo.shard_size > 1:
            dist.all_reduce(total, group=self.shard_group)
        return float(total[0] / total[1])

    # ------------------------------------------------------------------ helpers
    def _eval_due(self) -> bool:
        if self.step < self.next_eval:
            return False
        if not self.cfg.sync.is_local_sgd:
            return True
        # Local SGD: evaluate the global model, i.e. right at a sync.
        return self.engine.sync_pending or self.engine.steps_since_sync == 0

    def _tokens(self) -> int:
        return self.step * self.tokens_per_step * self.info.topo.world_size

    def _log_start(self) -> None:
        if not self.is_logger:
            return
        topo, mem = self.info.topo, self.engine.extra_memory()
        log.warning(
            "editrain: %s on %d replicas x %d shards (%s, %s); model %s with %.2fM parameters; "
            "outer state per rank: %s",
            self.cfg.sync.method, topo.num_replicas, topo.shard_size, self.info.device.type,
            dist.get_backend(), self.cfg.model.preset, self.num_params / 1e6,
            ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items()) or "none yet",
        )

    def _progress(self):
        if self.quiet:
            return None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/"
                            "{task.total}"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self._task = progress.add_task("train", total=self.cfg.train.steps, info="")
        progress.start()
        return progress

    def close(self) -> None:
        """Release hooks, threads and files."""
        self.engine.close()
        self.metrics.close()


def run_worker(cfg: Config, run_dir: str | Path) -> dict[str, Any]:
    """Entry point of one worker process (spawned by the launcher or by torchrun)."""
    threads = cfg.dist.threads_per_proc or max(
        1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    trainer = Trainer(cfg, Path(run_dir))
    try:
        return trainer.train()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
