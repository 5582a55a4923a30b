"""Heterogeneity simulation on one machine: slow link, stragglers, stalls, corrupted replicas.

* The link model delays the *communication path* only (the engine's comm thread), so a
  method that overlaps communication with compute really hides it.
* Stragglers and stalls delay the *compute* of one replica (all of its ranks, so they stay
  in lock-step as a real slow node would).
* Corruption scales one replica's pseudo-gradient just before a sync (a learning-rate burst or
  a bad-data step), to produce loss spikes on purpose.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

_UNITS = {
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUM = r"([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)"


def _err(option: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"sim.{option}: cannot parse {value!r}; expected {allowed}")


def parse_bandwidth(text: str) -> float:
    """``"100MB/s"`` -> bytes per second."""
    m = re.fullmatch(_NUM + r"\s*([a-zA-Z]+/s)", text.strip())
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise _err("link_bandwidth", text, "a positive rate such as 100MB/s, 1Gbit/s, 500kB/s")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_duration(text: str, option: str = "link_latency") -> float:
    """``"5ms"`` -> seconds."""
    m = re.fullmatch(_NUM + r"\s*(s|ms|us)?", text.strip())
    if not m:
        raise _err(option, text, "a duration such as 5ms, 0.2s, 300us")
    return float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]


@dataclass
class Straggler:
    """Replica ``replica`` computes ``factor`` times slower during steps [start, stop)."""

    replica: int
    factor: float
    start: int = 0
    stop: int | None = None

    def active(self, step: int) -> bool:
        """Whether the slowdown applies at ``step``."""
        return step >= self.start and (self.stop is None or step < self.stop)


@dataclass
class SimPlan:
    """The parsed simulation options."""

    bandwidth: float | None = None
    latency: float = 0.0
    stragglers: list[Straggler] = field(default_factory=list)
    stall_prob: float = 0.0
    stall_seconds: float = 0.0
    corrupt: dict[int, tuple[int, float]] = field(default_factory=dict)
    """sync index -> (replica, scale of its pseudo-gradient)."""
    step_schedule: list[int] = field(default_factory=list)
    """A-EDiT forced steps per window, per replica."""
    fail: tuple[int, int, str] | None = None
    """(rank, step, "step" | "checkpoint"): where a worker dies on the first attempt."""

    def maybe_fail(self, rank: int, step: int, phase: str) -> None:
        """Exit this process abruptly (no cleanup, like a crash) if the plan says so.
        Only on the first attempt, so that a restarted run can finish."""
        import os

        if (self.fail is not None and self.fail == (rank, step, phase)
                and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0):
            os._exit(17)

    def link_delay(self, nbytes: int) -> float:
        """Seconds one cross-replica message of ``nbytes`` costs on the simulated link."""
        t = self.latency
        if self.bandwidth:
            t += nbytes / self.bandwidth
        return t

    @property
    def has_link(self) -> bool:
        """Whether a link model is configured."""
        return self.bandwidth is not None or self.latency > 0


def parse_sim(sim: Any) -> SimPlan:
    """Validate and parse a ``SimSection`` (raises ``ValueError`` naming the option)."""
    plan = SimPlan(step_schedule=list(getattr(sim, "step_schedule", [])))
    if sim.link_bandwidth:
        plan.bandwidth = parse_bandwidth(sim.link_bandwidth)
    if sim.link_latency:
        plan.latency = parse_duration(sim.link_latency)
    for spec in sim.straggler:
        m = re.fullmatch(r"(\d+)=" + _NUM + r"(?:@(\d+)-(\d+))?", spec.strip())
        if not m or float(m.group(2)) < 1:
            raise _err("straggler", spec, "REPLICA=FACTOR (FACTOR >= 1) or "
                       "REPLICA=FACTOR@FROM-TO, e.g. 1=2 or 0=3@100-200")
        start = int(m.group(3)) if m.group(3) else 0
        stop = int(m.group(4)) if m.group(4) else None
        if stop is not None and stop <= start:
            raise _err("straggler", spec, "FROM < TO")
        plan.stragglers.append(Straggler(int(m.group(1)), float(m.group(2)), start, stop))
    if sim.random_stall:
        m = re.fullmatch(_NUM + r"\s*,\s*(.+)", sim.random_stall.strip())
        if not m or not 0 <= float(m.group(1)) <= 1:
            raise _err("random_stall", sim.random_stall, "PROB,SECONDS with PROB in [0, 1]")
        plan.stall_prob = float(m.group(1))
        plan.stall_seconds = parse_duration(m.group(2), "random_stall")
    if getattr(sim, "fail", None):
        m = re.fullmatch(r"(\d+)@(\d+)(?::(step|checkpoint))?", sim.fail.strip())
        if not m:
            raise _err("fail", sim.fail, "RANK@STEP or RANK@STEP:checkpoint, e.g. 1@15")
        plan.fail = (int(m.group(1)), int(m.group(2)), m.group(3) or "step")
    for spec in sim.corrupt_replica:
        m = re.fullmatch(r"(\d+)@(\d+)(?::(-?" + _NUM[1:-1] + r"))?", spec.strip())
        if not m:
            raise _err("corrupt_replica", spec, "REPLICA@SYNC or REPLICA@SYNC:SCALE, "
                       "e.g. 1@20 or 1@20:50")
        plan.corrupt[int(m.group(2))] = (int(m.group(1)), float(m.group(3) or 30.0))
    return plan


def check_replicas(plan: SimPlan, num_replicas: int) -> None:
    """Reject replica indices that do not exist in this topology."""
    if sim_schedule_len := len(getattr(plan, "step_schedule", [])):
        if sim_schedule_len != num_replicas:
            raise ValueError(f"sim.step_schedule: needs one entry per replica "
                             f"({num_replicas}), got {sim_schedule_len}")
    for s in plan.stragglers:
        if s.replica >= num_replicas:
            raise ValueError(f"sim.straggler: replica {s.replica} does not exist "
                             f"(there are {num_replicas} replicas: 0..{num_replicas - 1})")
    for sync, (r, _) in plan.corrupt.items():
        if r >= num_replicas:
            raise ValueError(f"sim.corrupt_replica: replica {r} (at sync {sync}) does not "
                             f"exist (there are {num_replicas} replicas)")


class ComputeSlowdown:
    """Applies stragglers and random stalls to one replica's compute.

    Every rank of the replica draws the same random numbers (seeded by replica), so the
    replica's ranks stall together, as one slow node would.

    Args:
        plan: the parsed simulation.
        replica: this rank's replica index.
        seed: base seed of the stall draws.
    """

    def __init__(self, plan: SimPlan, replica: int, seed: int) -> None:
        self.plan = plan
        self.replica = replica
        self.rng = random.Random(seed * 1_000_003 + replica)
        self.total_s = 0.0

    def after_compute(self, step: int, compute_s: float) -> float:
        """Sleep as this replica's slowdown demands after a step that computed for
        ``compute_s`` seconds; returns the seconds slept."""
        extra = 0.0
        for s in self.plan.stragglers:
            if s.replica == self.replica and s.active(step):
                extra += (s.factor - 1.0) * compute_s
        if self.plan.stall_prob > 0 and self.rng.random() < self.plan.stall_prob:
            extra += self.plan.stall_seconds
        if extra > 0:
            time.sleep(extra)
            self.total_s += extra
        return extra
