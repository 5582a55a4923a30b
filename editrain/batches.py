"""One rank's data: its share of the train stream and of the validation batches.

Every data rank (the tensor-parallel peers of a shard are one data rank: they read the
same batches) reads a disjoint stream of the train split. The validation split is shared
out over every data rank of every replica for the lock-step methods; an A-EDiT replica
may already wait in its next rendezvous (a blocking cross-replica collective) when another
evaluates, so there each replica evaluates the whole split over its own ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from editrain.config import ConfigError
from editrain.data import EvalBatch, SequenceStream, TokenData, check_batch_size, eval_batches


class RankData:
    """The train stream and validation batches of one data rank.

    Args:
        cfg: the run's configuration (``train``: sequence length, batch size, seed,
            evaluation tokens).
        corpus: the prepared corpus (:func:`editrain.corpus.prepare_data`).
        rank: this data rank among ``world`` (over every replica).
        world: the data ranks of the job.
        eval_rank: this rank's place among the ranks ``eval_world`` that share the
            validation split.
        eval_world: the ranks that share the validation split.

    Raises:
        ConfigError: the batch size does not fit the train split (the local launcher
            checks this before any worker starts; under torchrun this is the first look
            at the corpus, and an absurd batch size would loop in the sampler).
    """

    def __init__(self, cfg: Any, corpus: TokenData, rank: int, world: int, eval_rank: int,
                 eval_world: int) -> None:
        t = cfg.train
        try:
            check_batch_size(corpus.train, t.seq_len, t.batch_size, world)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.corpus = corpus
        self.seq_len, self.batch_size, self.seed = t.seq_len, t.batch_size, t.seed
        self.micro_batches = t.gradient_accumulation_steps
        self.rank, self.world = rank, world
        self.stream = SequenceStream(corpus.train, t.seq_len, rank, world, t.seed)
        self.val: list[EvalBatch] = eval_batches(corpus.val, t.seq_len, t.batch_size,
                                                 eval_rank, eval_world, t.eval_tokens)
        """The batches of the evaluations at the start and during the run."""
        self.val_final: list[EvalBatch] = self.val if t.final_eval_tokens == t.eval_tokens \
            else eval_batches(corpus.val, t.seq_len, t.batch_size, eval_rank, eval_world,
                              t.final_eval_tokens)
        """The batches of the evaluation at the end (and at an elastic resume, which
        continues the curve from that value)."""

    @property
    def vocab_size(self) -> int:
        """The corpus's vocabulary size."""
        return self.corpus.vocab_size

    def next_batches(self, device: torch.device) -> list[torch.Tensor]:
        """The micro-batches of one step (``train.gradient_accumulation_steps`` of them),
        each ``batch_size`` windows of ``seq_len + 1`` tokens, on ``device``."""
        return [self.stream.next_batch(self.batch_size).to(device)
                for _ in range(self.micro_batches)]

    def state_dict(self) -> dict[str, Any]:
        """The stream's position (see :meth:`SequenceStream.state_dict`)."""
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of this rank."""
        self.stream.load_state_dict(state)

    def adopt(self, state: dict[str, Any]) -> None:
        """Go on from a peer's position (a healed replica of the fault-tolerant mode): the
        peer's epoch and position, in this rank's share."""
        data = dict(state, rank=self.stream.rank)
        data["position"] = min(int(data["position"]), self.stream.share_size)
        self.stream.load_state_dict(data)

    def repartition(self, states: list[dict[str, Any]]) -> None:
        """An elastic resume: the unread rest of the epoch that the saved ranks'
        ``states`` left, shared out over this job's data ranks."""
        self.stream = SequenceStream.repartition(self.corpus.train, self.seq_len, self.seed,
                                                 states, self.rank, self.world)
