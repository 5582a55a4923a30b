"""The warm-up's gradient averaging across replicas (and the synchronous method's).

FSDP2 averages each gradient over the shard group; during the warm-up (and for ever with
``method = "sync"``) every gradient shard is then averaged over its sync group too, which
completes HSDP's semantics. The all-reduce runs on the communication thread
(:meth:`editrain.sync.reduction.Reduction.grad_allreduce`); the caller waits for it.
"""

from __future__ import annotations

import time

from torch.autograd.profiler import record_function

from editrain.sync.comm import CommPath
from editrain.sync.reduction import Reduction


class GradientAveraging:
    """Averages the gradients over the sync group and times it.

    Args:
        comm: the engine's communication path.
        reduction: the engine's reduction (which knows the units' gradients).
    """

    def __init__(self, comm: CommPath, reduction: Reduction) -> None:
        self.comm = comm
        self.reduction = reduction
        self.total_s = 0.0
        """Seconds the caller waited for the averaging, since the start (metrics)."""

    def average(self) -> None:
        """Average every gradient shard over the sync group, now (the caller's thread
        waits)."""
        t0 = time.perf_counter()
        with record_function("editrain::grad_allreduce"):
            self.comm.run(self.reduction.grad_allreduce, cause="gradients")
        self.total_s += time.perf_counter() - t0
