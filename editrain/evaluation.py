"""The validation loss of the global model, and losses averaged over ranks.

:meth:`Evaluator.evaluate` runs the rank's share of the validation batches
(:class:`editrain.batches.RankData`) and sums over the ranks that share the split. At a
sync boundary (where the trainer evaluates) every replica holds the global model, so this
is the global model's loss; evaluated between syncs it would be the mean over replicas of
their local models' losses on their shares. Streaming runs (delayed outer updates or
fragments) evaluate the anchors, the global model, swapped in for the evaluation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from editrain.data import EvalBatch
from editrain.models import causal_lm_loss
from editrain.topology import SHARD_DIM, MeshInfo


class Evaluator:
    """Evaluates one rank's model on its share of the validation split.

    Args:
        model: the (sharded) model.
        batches: this rank's validation batches.
        info: the mesh.
        engine: the sync engine (``has_anchors``, ``global_model()``).
        everyone: the split is shared out over every data rank of every replica (else
            over this replica's ranks: A-EDiT).
        streaming: the method delays outer updates (evaluate the engine's global model).
        forward_loss: with pipeline stages, ``forward_loss(tokens, targets)``: one batch
            through the pipeline, its mean loss on the last stage and None on the others
            (:func:`editrain.pipeline.pipeline_eval_loss`); None: the model's own forward.
        final_batches: this rank's batches of the final evaluation (``train.final_eval_tokens``;
            None: ``batches``).
    """

    def __init__(self, model: torch.nn.Module, batches: Sequence[EvalBatch], info: MeshInfo,
                 engine: Any, everyone: bool, streaming: bool,
                 forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
                 | None = None, final_batches: Sequence[EvalBatch] | None = None) -> None:
        self.model, self.batches, self.info, self.engine = model, batches, info, engine
        self.final_batches = batches if final_batches is None else final_batches
        self.everyone, self.streaming = everyone, streaming
        self.forward_loss = forward_loss
        self.shard_group = info.mesh.get_group(SHARD_DIM)
        # A-EDiT with pipeline stages: a replica's sums are over all of its stages.
        self.replica_group = engine.replica_group if info.topo.pp_size > 1 else None

    @torch.no_grad()
    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Validation loss over ``train.eval_tokens`` of the validation split (``final``:
        ``train.final_eval_tokens``; 0: the whole split).

        The split's windows are shared out over all ranks of all replicas and the sums
        all-reduced, so each evaluation costs 1/world of the split per rank (for A-EDiT,
        over the ranks of each replica).

        Returns:
            ``val_loss``, ``val_tokens`` (targets evaluated) and ``eval_time_s``.
        """
        t0 = time.perf_counter()
        info = self.info
        streaming = self.streaming and self.engine.has_anchors
        total = torch.zeros(2, dtype=torch.float64, device=info.device)
        with self.engine.global_model() if streaming else contextlib.nullcontext():
            self.model.eval()
            for batch in self.final_batches if final else self.batches:
                x = batch.tokens.to(info.device)
                if self.forward_loss is None:
                    loss = causal_lm_loss(self.model(x[:, :-1]), x[:, 1:])
                else:  # a pipeline stage: only the last one has the loss
                    loss = self.forward_loss(x[:, :-1], x[:, 1:])
                    if loss is None:
                        continue
                # Padding passes (targets == 0) keep the forward count equal on every rank.
                total[0] += loss.double() * batch.targets
                total[1] += batch.targets
            self.model.train()
        if self.everyone and info.topo.world_size > 1:
            if info.tp:
                total.zero_()  # tp peers evaluated the same windows: the first counts
            self._all_reduce_world(total, "evaluation")
        elif not self.everyone and self.replica_group is not None:
            if info.tp:
                total.zero_()
            dist.all_reduce(total, group=self.replica_group)
        elif not self.everyone and info.topo.shard_size > 1:
            dist.all_reduce(total, group=self.shard_group)
        return {"val_loss": float(total[0] / total[1]), "val_tokens": int(total[1]),
                "eval_time_s": time.perf_counter() - t0}

    def mean_loss(self, loss: float, everyone: bool) -> float:
        """Mean of ``loss`` over all data ranks (``everyone``) or over this replica's."""
        info = self.info
        group = None if everyone else self.shard_group
        size = info.topo.data_world if everyone else info.topo.shard_size
        if size == 1:
            return loss
        # tp peers (and the stages of a pipeline) hold the same loss: only the first counts
        first = info.tp == 0 and info.stage == 0
        t = torch.tensor([loss if not everyone or first else 0.0],
                         dtype=torch.float64, device=info.device)
        if everyone:
            self._all_reduce_world(t, "control")
        else:
            dist.all_reduce(t, group=group)
        return float(t[0]) / size

    def _all_reduce_world(self, t: torch.Tensor, cause: str) -> None:
        """Sum over every rank, counted as cross-replica bytes of ``cause`` where the
        engine keeps the count (``docs/metrics.md``, bytes by cause)."""
        comm = getattr(self.engine, "comm", None)
        if comm is None:
            dist.all_reduce(t)
            return
        comm.all_reduce_main(t, None, cause, spans_replicas=self.info.topo.num_replicas > 1)
