"""A-EDiT's clock and rendezvous: one for the blocking, non-blocking and fault-tolerant paths.

Each replica measures the time since its window started with a monotonic clock, agreed
(the maximum) over the ranks of the replica, every pipeline stage included, so that every
rank of a replica decides alike (docs/algorithm.md section 8). At the rendezvous every replica contributes one row (at
least its steps since the last sync and that agreed time); the all-gathered rows are
identical on every rank, and a round whose steps add up to fewer than
``sync.min_total_global_steps`` is skipped, unless it reaches the run's budget (the run
ends at that sync).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from editrain.sync.comm import CommPath, CommStats
from editrain.sync.progress import Progress
from editrain.sync.round import SyncRound


class SyncClock:
    """This rank's window clock and the rendezvous of the replicas.

    Args:
        comm: the communication path (the rendezvous is a collective of the sync group).
        device: where the gathered rows live before they are copied to the CPU.
        min_total_steps: a round is skipped below this many steps over all replicas.
        clock: seconds of a monotonic clock (tests inject their own).
        progress: the run's progress and budget: the round that reaches the budget is
            never skipped (None: no budget).
    """

    def __init__(self, comm: CommPath, device: torch.device, min_total_steps: int,
                 clock: Callable[[], float] | None = None,
                 progress: Progress | None = None) -> None:
        self.comm = comm
        self.device = device
        self.min_total_steps = min_total_steps
        self.progress = progress
        self.now = clock or time.perf_counter
        self.start = self.now()
        """When this replica's current window started."""
        self.launch = self.start
        """Non-blocking A-EDiT: when the last round was launched."""
        self.window_offset = 0.0
        """Non-blocking A-EDiT, merge when done: seconds from the last launch to the merge
        (agreed within the replica), which the next window's length includes."""
        self.pending_windows: list[float] | None = None
        """Every replica's window of the armed (blocking) round, from its rendezvous."""
        self.wait_s = 0.0
        """Seconds the caller waited in rendezvous since the last round's log entry."""
        self.traffic = CommStats()
        """Traffic of the blocking rendezvous, counted with the round that follows it."""

    def restart(self) -> None:
        """A new window starts now."""
        self.start = self.now()

    def restart_all(self) -> None:
        """Window and launch clocks start now; no offset (the local phase (re)starts)."""
        self.start = self.launch = self.now()
        self.window_offset = 0.0

    def elapsed(self) -> float:
        """Seconds since the window started, the maximum over this replica's ranks (every
        pipeline stage: the stages of a replica step together, so they must sync at the
        same step boundary)."""
        elapsed = self.now() - self.start
        if self.comm.agree_size == 1:
            # A one-rank replica agrees with itself: no trip through the communication
            # thread at every step (about 30 us, more when the GIL is contended).
            return elapsed
        t = torch.tensor([elapsed], dtype=torch.float64, device=self.device)
        self.comm.run(self.comm.all_reduce_replica, t, dist.ReduceOp.MAX)
        return float(t)

    def too_few(self, counts: torch.Tensor) -> bool:
        """Whether the gathered step counts are too few for a round (it is skipped). The
        round that reaches the budget is run whatever its steps: the run ends there, and
        skipping it would train on past the budget until the steps since the last sync
        reached the minimum (a budget of 6 steps on 2 replicas with a minimum of 100
        trained 50)."""
        if self.progress is not None and self.progress.reached_by(counts.tolist()):
            return False
        return float(counts.sum()) < self.min_total_steps

    def exchange(self, row: Sequence[float]) -> torch.Tensor:
        """The rendezvous collective, on the communication thread: every replica's ``row``
        (float64), gathered in replica order, on the CPU: ``[R, len(row)]``."""
        mine = torch.tensor(list(row), dtype=torch.float64, device=self.device)
        return self.comm.all_gather_sync(mine).cpu()

    def rendezvous(self, steps: int, elapsed: float, allow_skip: bool = True
                   ) -> torch.Tensor | None:
        """Blocking A-EDiT, from the caller's thread: gather every replica's steps since the
        last sync and its agreed elapsed time. Returns the counts (the windows are kept in
        :attr:`pending_windows`), or None when the round is skipped (too few steps in
        total; the window restarts and the steps count towards the next round)."""
        t0 = time.perf_counter()
        got = self.comm.submit(self.exchange, [steps, elapsed], stats=self.traffic,
                               cause="control").result()
        self.wait_s += time.perf_counter() - t0
        counts = got[:, 0].contiguous()
        if allow_skip and self.too_few(counts):
            self.restart()
            return None
        self.pending_windows = got[:, 1].tolist()
        return counts

    @torch.no_grad()
    def round_rendezvous(self, rnd: SyncRound, row: Sequence[float]) -> None:
        """Non-blocking A-EDiT, the first job of ``rnd`` on the communication thread: the
        same gather as :meth:`rendezvous` (this replica's steps up to its snapshot and its
        window); the round is skipped when the steps are too few."""
        got = self.exchange(row)
        counts = got[:, 0].contiguous()
        rnd.windows = got[:, 1].tolist()
        if self.too_few(counts):
            rnd.skipped = True
        else:
            rnd.step_counts = counts

    def take_traffic(self) -> CommStats:
        """The rendezvous traffic so far, for the round that follows it; counting restarts."""
        out, self.traffic = self.traffic, CommStats()
        return out

    def take_wait(self) -> float:
        """The rendezvous wait so far, for a round's log entry; counting restarts."""
        out, self.wait_s = self.wait_s, 0.0
        return out

    def state_dict(self) -> dict[str, object]:
        """The clock's part of the engine's plain state (times relative to now)."""
        return {
            "elapsed_s": self.now() - self.start,
            "since_launch_s": self.now() - self.launch,
            "window_offset_s": self.window_offset,
            "pending_windows": self.pending_windows,
        }

    def load_state_dict(self, sd: dict[str, object]) -> None:
        """Inverse of :meth:`state_dict`: the clocks continue where they were."""
        now = self.now()
        self.start = now - float(sd["elapsed_s"])
        self.launch = now - float(sd.get("since_launch_s", sd["elapsed_s"]))
        self.window_offset = float(sd.get("window_offset_s", 0.0))
        self.pending_windows = sd.get("pending_windows")
