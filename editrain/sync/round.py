"""One sync round: the units it syncs, its jobs, its statistics, its log entry, its state.

A *round* syncs one set of units once (all of them, or one streaming fragment's). Every
schedule and the fault-tolerant path make rounds of this one kind; the engine closes them
with one book-keeping (:meth:`editrain.sync.rounds.Rounds.close_round`).
"""

from __future__ import annotations

import bisect
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from editrain.sync.comm import CommStats


@dataclass
class SyncRound:
    """Book-keeping of one sync (of one fragment's units) in flight."""

    index: int
    step_counts: torch.Tensor | None
    units: list[int]
    """The round's units, in forward order."""
    fragment: int = 0
    delayed: bool = False
    """Launched at a step boundary and merged ``overlap_steps`` steps later."""
    launch_step: int = 0
    apply_at: int = 0
    """Delayed rounds: the global step after which the merge is due."""
    submitted: list[Future] = field(default_factory=list)
    stats: Future | None = None
    waited: int = 0
    """Positions of ``units`` waited for (and, if delayed, merged)."""
    wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    comm: CommStats = field(default_factory=CommStats)
    windows: list[float] | None = None
    """A-EDiT: every replica's agreed elapsed time when it entered the rendezvous."""
    rendezvous: Future | None = None
    """Non-blocking A-EDiT: the job gathering the step counts (the round's first job)."""
    skipped: bool = False
    """Non-blocking A-EDiT: too few steps in total; nothing is reduced or merged."""
    my_steps: int = 0
    """Non-blocking A-EDiT: this replica's steps up to its snapshot."""
    work_s: float = 0.0
    """Wall time of the round's jobs on the communication thread."""
    values: int = 0
    """Pseudo-gradient values this rank reduced in the round (its compression's base)."""
    replicas: int = 0
    """Replicas the round reduced over (its compression's base; 0: not known)."""
    staleness: int = 0
    """Rounds launched after this one and before its merge."""
    loss: torch.Tensor | None = None
    """This rank's mean training loss since the previous round (``record_loss``; None: not
    recorded), gathered by the statistics job into :attr:`replica_loss`."""
    # Filled by the statistics job (identical on every rank).
    replica_loss: list[float | None] | None = None
    """Every replica's mean training loss since its previous round (None: unknown)."""
    norms: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    outlier: torch.Tensor | None = None
    z: torch.Tensor | None = None
    clip: list[float] = field(default_factory=list)
    # The fault-tolerant mode (sync/ft_round.py).
    members: list[int] | None = None
    """Replica ids of the quorum, in the order of its collectives."""
    contributes: list[bool] | None = None
    """Per member: whether it sends a pseudo-gradient (a healed replica does not)."""
    quorum: Any = None
    """The fault-tolerant mode, delayed rounds: the quorum it was launched in."""
    quorum_wait_s: float = 0.0
    tentative: dict[int, torch.Tensor | None] | None = None
    """Reduced pseudo-gradients by position, applied only once the round commits (None:
    nobody was trusted for that unit)."""

    def position(self, u: int) -> int:
        """Number of the round's units with index ``<= u``."""
        return bisect.bisect_right(self.units, u)

    def jobs(self) -> list[Future]:
        """The round's queued jobs (rendezvous, statistics, units)."""
        return [f for f in (self.rendezvous, self.stats, *self.submitted) if f is not None]

    def done(self) -> bool:
        """Whether every queued job of the round has finished (on this rank)."""
        return all(f.done() for f in self.jobs())

    def wait(self) -> None:
        """Wait for every queued job (re-raises a failed job's exception)."""
        for fut in self.jobs():
            fut.result()

    def log_entry(self, step: int, rendezvous_wait_s: float, fragment: bool
                  ) -> dict[str, Any]:
        """The sync log's record of this finished round (``metrics.jsonl``'s ``sync``) at
        global step ``step``; ``fragment``: name the streaming fragment."""
        stats = self.comm.snapshot()
        entry: dict[str, Any] = {
            "sync": self.index,
            "step": step,
            "units": len(self.units),
            "wait_s": self.wait_s,
            "sync_time_s": time.perf_counter() - self.started,
            "rendezvous_wait_s": rendezvous_wait_s,
            **stats,
            "work_s": self.work_s,
            "hidden": (max(0.0, 1.0 - self.wait_s / self.work_s) if self.work_s > 0
                       else None),
        }
        entry["compression"] = self.compression(stats["bytes_sent"])
        entry["staleness"] = self.staleness
        if fragment:
            entry["fragment"] = self.fragment
        if self.delayed:
            entry["launch_step"] = self.launch_step
        if self.step_counts is not None:
            entry["replica_steps"] = self.step_counts.tolist()
        if self.replica_loss is not None:
            entry["replica_loss"] = self.replica_loss
        if self.norms is not None:
            entry["norms"] = self.norms.tolist()
        if self.weights is not None:
            entry["weights"] = self.weights.tolist()
        if self.outlier is not None:
            entry["outlier"] = self.outlier.tolist()
        if self.z is not None:
            entry["z"] = _nan_to_none(self.z)
        if self.clip:
            entry["clip"] = self.clip
        return entry

    def compression(self, bytes_sent: int) -> float | None:
        """Bytes this rank sent for the round per byte that a ring all-reduce of its
        pseudo-gradients in fp32 sends (``2 (R - 1) / R * 4`` per value); statistics and
        clipping included. None where nothing was reduced."""
        if not self.values or self.replicas < 2:
            return None
        return bytes_sent / (2 * (self.replicas - 1) / self.replicas * 4 * self.values)

    def state_dict(self) -> dict[str, Any]:
        """A delayed round whose jobs are done, as plain data (its merge is still to come)."""
        return {
            "index": self.index, "fragment": self.fragment, "units": self.units,
            "launch_step": self.launch_step, "apply_at": self.apply_at,
            "wait_s": self.wait_s, "work_s": self.work_s, "comm": self.comm.snapshot(),
            "norms": None if self.norms is None else self.norms.tolist(),
            "weights": None if self.weights is None else self.weights.tolist(),
            "outlier": None if self.outlier is None else self.outlier.tolist(),
            "z": None if self.z is None else _nan_to_none(self.z),
            "clip": self.clip,
            "step_counts": None if self.step_counts is None else self.step_counts.tolist(),
            "windows": self.windows, "skipped": self.skipped, "my_steps": self.my_steps,
            "values": self.values, "replicas": self.replicas, "staleness": self.staleness,
            "replica_loss": self.replica_loss,
        }

    @classmethod
    def from_state(cls, sd: dict[str, Any]) -> SyncRound:
        """Inverse of :meth:`state_dict`: a delayed round with completed jobs."""
        rnd = cls(index=int(sd["index"]), step_counts=None, units=list(sd["units"]),
                  fragment=int(sd["fragment"]), delayed=True,
                  launch_step=int(sd["launch_step"]), apply_at=int(sd["apply_at"]),
                  wait_s=float(sd["wait_s"]), work_s=float(sd["work_s"]),
                  clip=list(sd["clip"]), windows=sd.get("windows"),
                  skipped=bool(sd.get("skipped", False)), my_steps=int(sd.get("my_steps", 0)),
                  values=int(sd.get("values", 0)), replicas=int(sd.get("replicas", 0)),
                  staleness=int(sd.get("staleness", 0)),
                  replica_loss=sd.get("replica_loss"))
        if sd.get("step_counts") is not None:
            rnd.step_counts = torch.tensor(sd["step_counts"], dtype=torch.float64)
        for key, value in sd["comm"].items():
            setattr(rnd.comm, key, value)
        for key, dtype in (("norms", torch.float64), ("weights", torch.float64),
                           ("outlier", torch.bool)):
            if sd[key] is not None:
                setattr(rnd, key, torch.tensor(sd[key], dtype=dtype))
        if sd["z"] is not None:
            rnd.z = torch.tensor([[math.nan if v is None else v for v in row]
                                  for row in sd["z"]], dtype=torch.float64)
        for _ in rnd.units:
            done: Future = Future()
            done.set_result(None)
            rnd.submitted.append(done)
        return rnd


def _nan_to_none(t: torch.Tensor) -> list[list[float | None]]:
    return [[None if math.isnan(v) else v for v in row] for row in t.tolist()]


def by_replica(norms: torch.Tensor, rnd: SyncRound, replicas: int) -> torch.Tensor:
    """The quorum's ``[members, L]`` norms laid out by replica id (``[replicas, L]``), NaN
    for replicas absent or not contributing: the penalty excludes them."""
    out = torch.full((replicas, norms.shape[1]), float("nan"), dtype=norms.dtype)
    assert rnd.members is not None and rnd.contributes is not None
    for row, (member, contributes) in enumerate(zip(rnd.members, rnd.contributes)):
        if contributes:
            out[member] = norms[row]
    return out
