"""Heterogeneity simulation on one machine: slow link, stragglers, stalls, corrupted replicas.

* The link model delays the *communication path* only (the engine's comm thread), so a
  method that overlaps communication with compute really hides it.
* Stragglers and stalls delay the *compute* of one replica (all of its ranks, so they stay
  in lock-step as a real slow node would).
* Corruption scales one replica's pseudo-gradient just before a sync (a learning-rate burst or
  a bad-data step), to produce loss spikes on purpose.

The link model
--------------
A message of ``n`` bytes costs ``latency + n / bandwidth`` seconds. :meth:`SimPlan.link_delay`
prices each message on its own; :class:`SharedLink` models one node's *uplink*, shared by
every rank (process) of that replica: the ranks reserve the link first come, first served
through a small state file (``fcntl.flock`` + the system-wide ``time.monotonic`` clock), so
a node with S ranks does not get S times the bandwidth, and overlapping transfers queue
behind each other. Each caller sleeps until its own bytes have left and arrived. Limits:

* only the sending side is modelled (a full-duplex link: a node's downlink is free, and
  receiving does not queue behind sending);
* FIFO per node, in the order the reservations take the lock (no fair sharing, no
  priorities); latency is added after the transfer and does not occupy the link;
* replicas do not congest one another (no shared core network or switch);
* no transport overhead (headers, acks, slow start, retransmissions): payload bytes only.
"""

from __future__ import annotations

import fcntl
import math
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from editrain.argv import env_int
from editrain.errors import spelled
from editrain.safe_io import make_dir, open_write

_UNITS = {
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUM = r"([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)"


MIN_BANDWIDTH = 1.0
"""Slowest simulated link, bytes per second (8bit/s)."""
MAX_BANDWIDTH = 1e15
"""Fastest simulated link, bytes per second (1PB/s; above it the link costs nothing)."""
MAX_SECONDS = 3600.0
"""Longest simulated latency or stall (one hour): more would only hang the run."""
MAX_FACTOR = 1000.0
"""Largest straggler slowdown factor."""
MAX_SCALE = 1e6
"""Largest magnitude of a corrupt_replica scale (the default is 30)."""
MAX_INDEX = 2**63 - 1
"""Largest replica, rank, step or sync index in a spec (an int64)."""


def _err(option: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"sim.{option}: cannot parse {spelled(value)}; expected {allowed}")


def _index(text: str, option: str, spec: str) -> int:
    """An integer field of a spec (replica, rank, step, sync), at most :data:`MAX_INDEX`."""
    value = int(text)
    if value > MAX_INDEX:
        raise ValueError(f"sim.{option}: {value} in {spelled(spec)} is too large (at most 2^63 - 1)")
    return value


def parse_bandwidth(text: str) -> float:
    """``"100MB/s"`` -> bytes per second, between :data:`MIN_BANDWIDTH` and
    :data:`MAX_BANDWIDTH`.

    Args:
        text: a positive number and a unit: B/s, kB/s, MB/s, GB/s or bit/s, kbit/s, Mbit/s,
            Gbit/s (case-insensitive).

    Raises:
        ValueError: naming ``sim.link_bandwidth`` and what is allowed.
    """
    m = re.fullmatch(_NUM + r"\s*([a-zA-Z]+/s)", text.strip())
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise _err("link_bandwidth", text, "a positive rate such as 100MB/s, 1Gbit/s, 500kB/s")
    rate = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not MIN_BANDWIDTH <= rate <= MAX_BANDWIDTH:  # also inf (1e999MB/s)
        raise ValueError(f"sim.link_bandwidth: {spelled(text.strip())} is out of range; allowed "
                         f"from 1B/s (8bit/s) to 1e15B/s (1PB/s)")
    return rate


def parse_duration(text: str, option: str = "link_latency") -> float:
    """``"5ms"`` -> seconds, at most :data:`MAX_SECONDS`.

    Args:
        text: a number >= 0 with an optional unit s, ms or us (seconds by default).
        option: the ``sim`` option named in errors.

    Raises:
        ValueError: naming ``sim.<option>`` and what is allowed.
    """
    m = re.fullmatch(_NUM + r"\s*(s|ms|us)?", text.strip())
    if not m:
        raise _err(option, text, "a duration such as 5ms, 0.2s, 300us")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]
    if not seconds <= MAX_SECONDS:  # also inf (1e999s)
        raise ValueError(f"sim.{option}: {spelled(text.strip())} is out of range; allowed from 0 "
                         f"to {MAX_SECONDS:g} s")
    return seconds


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

    def maybe_fail(self, rank: int, step: int, phase: str,
                   rejoined: bool | None = None) -> None:
        """Exit this process abruptly (no cleanup, like a crash) if the plan says so.
        Only on the first attempt (:func:`first_attempt`), so that a restarted run can
        finish."""
        if (self.fail is not None and self.fail == (rank, step, phase)
                and first_attempt(rejoined)):
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

    def shared_link(self, path: str | os.PathLike[str]) -> SharedLink | None:
        """The uplink of one replica (node), shared by all of its ranks; ``None`` when no
        link is configured.

        Every rank of replica ``R`` must build it with the *same* ``path`` and other
        replicas with other paths; the trainer uses ``<run_dir>/.link/replica<R>.state``.
        Pass the result as the engine's ``link_delay`` instead of :meth:`link_delay`, which
        prices each rank's messages independently (S ranks then get S times the bandwidth).
        """
        if not self.has_link:
            return None
        return SharedLink(path, self.bandwidth, self.latency)


class Reservation(NamedTuple):
    """One message's slot on a :class:`SharedLink`, in the link's clock."""

    now: float
    """When it was asked for."""
    start: float
    """When its first byte leaves (``now`` unless the link was busy)."""
    end: float
    """When its last byte has left; the link is busy until then."""


def _boot_id() -> str:
    # time.monotonic restarts at a reboot: a state file written before one is stale.
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class SharedLink:
    """One node's uplink, shared by every process of the node (see the module docstring).

    Calling it reserves the link for ``nbytes`` behind every earlier reservation (FIFO) and
    returns the seconds the caller must sleep until its message has been transmitted and
    has arrived: ``(end - now) + latency``. The state (the time the link is busy until) is
    a small file read and rewritten under an exclusive ``fcntl.flock``; a missing, empty
    or unreadable file, or one from another boot, means an idle link. The file is opened
    afresh at each call, so forked processes and threads each hold their own lock.

    Args:
        path: the state file, the same for all ranks of one replica, one per replica
            (created with its parent directories if missing).
        bandwidth: bytes per second, or ``None`` for an infinitely fast link (latency only).
        latency: seconds added to every message; it does not occupy the link.
        clock: the time source; it must be shared by all processes of the node
            (``time.monotonic`` is, on Linux). Injectable for tests.
    """

    def __init__(self, path: str | os.PathLike[str], bandwidth: float | None,
                 latency: float, clock: Callable[[], float] = time.monotonic) -> None:
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"SharedLink: bandwidth must be positive or None, got {bandwidth!r}")
        if not latency >= 0:
            raise ValueError(f"SharedLink: latency must be >= 0, got {latency!r}")
        self.path = Path(path)
        self.bandwidth = bandwidth
        self.latency = float(latency)
        self.clock = clock
        self._boot = _boot_id()
        make_dir(self.path.parent, root=self.path.parent.parent)
        os.close(self._open())

    def _open(self) -> int:
        """The link's file, never through a link (it lies in the run directory)."""
        with open_write(self.path, "c+", binary=True) as f:
            return os.dup(f.fileno())

    def __repr__(self) -> str:
        return (f"SharedLink({str(self.path)!r}, bandwidth={self.bandwidth!r}, "
                f"latency={self.latency!r})")

    def _parse(self, data: bytes) -> float:
        try:
            fields = data.decode("ascii").split()
            busy_until = float(fields[0])
        except (UnicodeDecodeError, IndexError, ValueError):
            return 0.0
        if not math.isfinite(busy_until) or (len(fields) > 1 and fields[1] != self._boot):
            return 0.0
        return busy_until

    def reserve(self, nbytes: int) -> Reservation:
        """Book the link for ``nbytes`` after every earlier reservation of the node."""
        duration = nbytes / self.bandwidth if self.bandwidth else 0.0
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            now = self.clock()
            busy_until = self._parse(os.pread(fd, 256, 0))
            start = max(now, busy_until)
            end = start + duration
            if end != busy_until:
                data = f"{end!r} {self._boot}\n".encode("ascii")
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
        finally:
            os.close(fd)  # also releases the lock
        return Reservation(now, start, end)

    def __call__(self, nbytes: int) -> float:
        """Reserve the link for a message of ``nbytes``; the seconds to sleep until it has
        arrived (queueing + transmission + latency)."""
        r = self.reserve(nbytes)
        return (r.end - r.now) + self.latency


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
        factor = float(m.group(2))
        if not factor <= MAX_FACTOR:  # also inf (1e999)
            raise ValueError(f"sim.straggler: factor {m.group(2)} in {spelled(spec.strip())} is out "
                             f"of range; allowed from 1 to {MAX_FACTOR:g}")
        start = _index(m.group(3), "straggler", spec) if m.group(3) else 0
        stop = _index(m.group(4), "straggler", spec) if m.group(4) else None
        if stop is not None and stop <= start:
            raise _err("straggler", spec, "FROM < TO")
        plan.stragglers.append(Straggler(_index(m.group(1), "straggler", spec), factor, start,
                                         stop))
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
        plan.fail = (_index(m.group(1), "fail", sim.fail), _index(m.group(2), "fail", sim.fail),
                     m.group(3) or "step")
    for spec in sim.corrupt_replica:
        m = re.fullmatch(r"(\d+)@(\d+)(?::(-?" + _NUM[1:-1] + r"))?", spec.strip())
        if not m:
            raise _err("corrupt_replica", spec, "REPLICA@SYNC or REPLICA@SYNC:SCALE, "
                       "e.g. 1@20 or 1@20:50")
        scale = float(m.group(3) or 30.0)
        if not abs(scale) <= MAX_SCALE:  # also inf (1e999)
            raise ValueError(f"sim.corrupt_replica: scale {m.group(3)} in {spelled(spec.strip())} is "
                             f"out of range; allowed from -{MAX_SCALE:g} to {MAX_SCALE:g}")
        plan.corrupt[_index(m.group(2), "corrupt_replica", spec)] = (
            _index(m.group(1), "corrupt_replica", spec), scale)
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


def first_attempt(rejoined: bool | None) -> bool:
    """Whether this worker's attempt is its job's first, for ``sim.fail``, which kills a
    worker once.

    A replica group the ``--ft`` launcher restarted (``EDITRAIN_FT_ATTEMPT`` above 0) is
    not. Under torchrun, ``rejoined`` is rank 0's decision for the attempt (the trainer's,
    the same on every rank): an attempt that went on with its launch's run is a restart,
    whatever ``TORCHELASTIC_RESTART_COUNT`` says. torch elastic does not count a restart
    caused by a change of the nodes taking part, and after one node's failure the healthy
    nodes restart their workers at the count they had: going by the count, a worker of
    such a node failed again at the same step, on every restart. Not told (None: the
    local launcher's restarts, torchrun without its store), the count decides.
    """
    if env_int("EDITRAIN_FT_ATTEMPT", 0) > 0:
        return False
    if rejoined is not None:
        return not rejoined
    return env_int("TORCHELASTIC_RESTART_COUNT", 0) == 0


class Simulation:
    """One replica's simulation plan as callbacks the training loop calls at fixed points.

    * :meth:`after_compute`: after a step's forward, backward and optimizer step (the
      stragglers and stalls sleep here);
    * :meth:`after_step`: after the step is counted (``sim.fail``'s ``step`` phase);
    * :meth:`before_checkpoint_commit`: once a checkpoint's files are written, before it
      is committed (``sim.fail``'s ``checkpoint`` phase);
    * :meth:`before_sync`: the engine's ``before_sync`` hook (``sim.corrupt_replica``),
      given through :attr:`sync_hook` once :meth:`attach` named the engine;
    * :attr:`link`: the replica's simulated uplink, the engine's ``link_delay``.

    Args:
        plan: the parsed simulation.
        replica: this rank's replica index (corruption targets it).
        offset: ``sim.replica_offset``, added to ``replica`` for stragglers and stalls.
        rank: this rank's data rank (``sim.fail`` targets it).
        seed: base seed of the stall draws.
        link_path: the state file of the replica's shared link (see
            :meth:`SimPlan.shared_link`).
        rejoined: under torchrun, rank 0's decision for the attempt (the trainer's): an
            attempt that went on with its run is a restart, where ``sim.fail`` does not
            fire (:func:`first_attempt`); None: not told.
    """

    def __init__(self, plan: SimPlan, replica: int, offset: int, rank: int, seed: int,
                 link_path: str | os.PathLike[str], rejoined: bool | None = None) -> None:
        self.plan = plan
        self.replica = replica
        self.rank = rank
        self.rejoined = rejoined
        self.link = plan.shared_link(link_path)
        self.slowdown = ComputeSlowdown(plan, replica + offset, seed)
        self.engine: Any = None

    def attach(self, engine: Any) -> None:
        """Name the engine whose pseudo-gradients :meth:`before_sync` scales."""
        self.engine = engine

    @property
    def sync_hook(self) -> Callable[[int], None] | None:
        """The engine's ``before_sync`` hook: :meth:`before_sync` when a replica is to be
        corrupted, else None."""
        return self.before_sync if self.plan.corrupt else None

    def after_compute(self, step: int, compute_s: float) -> float:
        """Stragglers and stalls after a step that computed for ``compute_s`` seconds;
        the seconds slept (see :meth:`ComputeSlowdown.after_compute`)."""
        return self.slowdown.after_compute(step, compute_s)

    def after_step(self, step: int) -> None:
        """``sim.fail``: die here if this rank is to fail once it has counted ``step``."""
        self.plan.maybe_fail(self.rank, step, "step", self.rejoined)

    def before_checkpoint_commit(self, step: int) -> None:
        """``sim.fail`` with ``:checkpoint``: die with the checkpoint of ``step`` written
        but not committed."""
        self.plan.maybe_fail(self.rank, step, "checkpoint", self.rejoined)

    def before_sync(self, sync_index: int) -> None:
        """Fault injection: scale this replica's pseudo-gradient before sync ``sync_index``."""
        target = self.plan.corrupt.get(sync_index)
        if target is None or target[0] != self.replica:
            return
        self.engine.scale_pseudo_gradients(target[1])

    def state_dict(self) -> list[int]:
        """The stall draws' generator state (what a checkpoint keeps: ``sim_rng``)."""
        return list(self.slowdown.rng.getstate()[1])

    def load_state_dict(self, state: list[int]) -> None:
        """Restore :meth:`state_dict`."""
        rs = self.slowdown.rng.getstate()
        self.slowdown.rng.setstate((rs[0], tuple(state), rs[2]))
