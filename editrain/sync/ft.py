"""Fault-tolerant cross-replica communication through torchft (``dist.fault_tolerance``).

In the fault-tolerant mode every replica is a job of its own (one torch.distributed world
of ``P x S x T`` ranks: its pipeline stages, FSDP2 shards and tensor-parallel ranks), and
the replicas meet only through torchft: a *lighthouse* forms a quorum of the replicas
present at each sync, every rank of a replica group runs a torchft ``Manager`` (rank 0's
serves the group: the quorum and the commit vote are over all of its ranks), and the ranks
in the same place of their groups (stage, shard and tp index) across the quorum share a
reconfigurable gloo process group. A replica that dies drops out of the next quorum; one
that (re)joins is behind in committed syncs, so the quorum tells it to *heal*: it receives
the global state (anchors, outer optimizer, counters, the trainer's state) from a healthy
peer, rank by rank over HTTP, with nothing read from disk.

This module is the only one in editrain that imports torchft, and it does so only through
:func:`import_torchft` (which quiets torchft's Rust logs first). :class:`TorchftGroup` offers
what the engine's communication path needs (sum all-reduce, all-gather, the quorum's size
and this replica's place in it) plus the round protocol: :meth:`TorchftGroup.begin`
before a sync, :meth:`TorchftGroup.commit` after it. A collective that fails (a replica left
mid-sync) raises :class:`QuorumError`; the round is then not committed and nothing of it is
applied (see ``docs/fault_tolerance.md``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from editrain.argv import env_int

log = logging.getLogger("editrain")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's variable for the lighthouse address (``http://host:port``)."""
REPLICA_ENV = "EDITRAIN_FT_REPLICA"
"""This replica group's index (0 .. dist.replicas - 1), set by ``editrain train --ft``."""


class QuorumError(RuntimeError):
    """A cross-replica collective failed: a replica left during the sync."""


@dataclass(frozen=True)
class Quorum:
    """The replicas of one sync."""

    size: int
    """Replicas in the quorum."""
    rank: int
    """This replica's position among them (ordered by replica id)."""
    quorum_id: int
    healed: bool
    """This replica was behind and has just loaded the global state from a peer."""


FLIGHT_RECORDER_NOTE = "Unable to reset NCCL flight recorder recording"
"""The start of the warning torchft's manager logs at every new quorum where torch has no
NCCL flight recorder (a CPU build), where there are no NCCL traces to be incorrect."""


TORCHFT_RECORD_LOGGERS = ("torchft_quorums", "torchft_commits")
"""torchft's loggers of structured records: its manager logs an empty message at info on
each of them, its fields in ``extra``, at every new quorum and every commit vote, for the
OpenTelemetry handler torchft attaches to them itself (``TORCHFT_USE_OTEL``). Through
the root logger's plain-text handler each was a blank line."""


class _WithoutFlightRecorderNote(logging.Filter):
    """Drops :data:`FLIGHT_RECORDER_NOTE` (a torch with the recorder never logs it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return FLIGHT_RECORDER_NOTE not in record.getMessage()


def _torchft_logs_warnings() -> None:
    """torchft's servers (Rust) log every quorum at info, three lines a sync, unless
    ``RUST_LOG`` says otherwise: warnings only, but what the user set wins. Read once, when
    torchft is first imported, so this comes before every import of it.

    Its Python loggers (``torchft.*``) log at info too, four lines a sync on every rank
    (the quorum's reconfiguration, the commit vote): they log at warnings unless the user
    set the ``torchft`` logger's level. Editrain's own launcher runs its workers at
    warnings anyway; under torchrun the worker is ``editrain train`` itself, whose lines
    are info, so torchft's were printed too.

    Its record loggers (:data:`TORCHFT_RECORD_LOGGERS`, outside ``torchft.*``) printed two
    blank lines on stderr at every attempt of a group's first quorum under torchrun:
    their records stay with the handlers on those loggers themselves (torchft's
    OpenTelemetry one), and no longer reach the root logger's, unless the user set their
    level. Nothing but those empty records is logged there."""
    os.environ.setdefault("RUST_LOG", "warn")
    torchft_log = logging.getLogger("torchft")
    if torchft_log.level == logging.NOTSET:
        torchft_log.setLevel(logging.WARNING)
    for name in TORCHFT_RECORD_LOGGERS:
        records = logging.getLogger(name)
        if records.level == logging.NOTSET:
            records.propagate = False
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _WithoutFlightRecorderNote) for f in manager_log.filters):
        manager_log.addFilter(_WithoutFlightRecorderNote())


def import_torchft(module: str = "torchft") -> ModuleType:
    """torchft's ``module`` (``"torchft"``, ``"torchft.manager"``, ...), imported with its
    Rust logs at warnings. Every import of torchft in editrain goes through here, the
    benchmark's peer workers' too: the log level is read when torchft is first imported,
    so one import that skipped :func:`_torchft_logs_warnings` would print three info lines
    a sync for the rest of the process, whoever imports torchft after it.

    Raises:
        ValueError: ``module`` is not torchft or one of its submodules.
        ImportError: torchft is not installed.
    """
    if module != "torchft" and not module.startswith("torchft."):
        raise ValueError(f"import_torchft imports torchft's modules only, got {module!r}")
    _torchft_logs_warnings()
    return importlib.import_module(module)


def torchft_available() -> bool:
    """Whether torchft can be imported (the ``editrain[ft]`` extra)."""
    try:
        import_torchft()
    except ImportError:
        return False
    return True


def start_lighthouse(min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float,
                     tick_s: float = 0.1, bind: str = "[::]:0") -> Any:
    """Start a torchft lighthouse in this process; ``.address()`` gives its URL and
    ``.shutdown()`` stops it.

    Args:
        min_replicas: replicas a quorum needs at least.
        join_timeout_s: how long a quorum waits for replicas that are alive (heartbeating)
            but not yet at the sync; a rejoining replica waits for the others' next sync.
        heartbeat_timeout_s: a replica silent for this long is considered dead.
        tick_s: how often a pending quorum is re-checked (so a quorum that waits for a
            dead replica forms at most this long after its heartbeat timed out).
        bind: address to listen on.
    """
    return import_torchft("torchft.coordination").LighthouseServer(bind=bind, min_replicas=min_replicas,
                            join_timeout_ms=int(join_timeout_s * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
                            quorum_tick_ms=max(1, int(tick_s * 1000)))


class TorchftGroup:
    """This rank's view of the replicas through a torchft ``Manager``.

    Args:
        replica: this replica group's index (stable across restarts; names it to torchft).
        replicas: how many replica groups the run has (``dist.replicas``): replica ids are
            ``0 .. replicas - 1``; a quorum may hold fewer.
        group_rank: this rank's index inside its replica group (its rank in the group's job).
        group_size: ranks per replica group.
        lighthouse: the lighthouse address (default: ``$TORCHFT_LIGHTHOUSE``).
        min_replicas: the quorum needs at least this many replicas to commit a sync.
        timeout_s: collectives, commit votes and state transfer fail after this long.
        quorum_timeout_s: how long a replica may wait for a quorum (a rejoining replica
            waits for the others' next sync: longer than a sync interval).
        heartbeat_interval_s: how often this group tells the lighthouse it is alive.
        store_addr / store_port: this replica group's TCPStore (default: torchrun's
            ``MASTER_ADDR`` / ``MASTER_PORT``).
    """

    def __init__(self, replica: int, replicas: int, group_rank: int, group_size: int, *,
                 lighthouse: str | None = None, min_replicas: int = 1,
                 timeout_s: float = 60.0, quorum_timeout_s: float = 600.0,
                 heartbeat_interval_s: float = 0.1, store_addr: str | None = None, store_port: int | None = None) -> None:
        Manager = import_torchft("torchft.manager").Manager
        ProcessGroupGloo = import_torchft("torchft.process_group").ProcessGroupGloo

        if not 0 <= replica < replicas:
            raise ValueError(f"replica id {replica} outside 0..{replicas - 1}")
        self.replica = replica
        self.replicas = replicas
        self._state_fns: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._healed = False
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        """The reconfigurable cross-replica group (gloo; on CUDA the engine stages through
        host memory, like its default private groups)."""
        self.manager = Manager(
            pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
            use_async_quorum=False, timeout=timedelta(seconds=timeout_s),
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            heartbeat_interval=timedelta(seconds=heartbeat_interval_s),
            rank=group_rank, world_size=group_size,
            store_addr=store_addr or os.environ["MASTER_ADDR"],
            store_port=store_port or env_int("MASTER_PORT", minimum=1),
            lighthouse_addr=lighthouse or os.environ.get(LIGHTHOUSE_ENV),
            replica_id=f"editrain_replica_{replica}",
            # Replicas start from one seed (the engine compares checksums at the start);
            # a replica that restarts later heals instead.
            init_sync=False,
        )
        self.quorum: Quorum | None = None
        self.quorums = 0
        """Quorums formed by this rank (metrics)."""

    # ------------------------------------------------------------------ state transfer
    def register_state(self, key: str, state_dict: Callable[[], Any],
                       load_state_dict: Callable[[Any], None]) -> None:
        """What a healthy replica sends a healing one under ``key`` (this rank's share of
        it: the peer in the same place of its replica group sends it), and how to take it in. The
        functions run on the main thread's behalf while it waits in :meth:`begin`."""
        self._state_fns[key] = (state_dict, load_state_dict)

        def load(sd: Any, fn: Callable[[Any], None] = load_state_dict) -> None:
            fn(sd)
            self._healed = True

        self.manager.register_state_dict_fn(key, load, state_dict)

    # ------------------------------------------------------------------ rounds
    def begin(self) -> Quorum:
        """Form the quorum of this sync (blocks until the lighthouse has it) and heal this
        replica first if it is behind. Call on every rank of the replica, on the main
        thread.

        Raises:
            QuorumError: the process group could not be set up or healing failed.
        """
        self._healed = False
        self.manager.start_quorum()
        err = self.manager.errored()
        if err is not None:
            raise QuorumError(f"torchft quorum failed: {err.original_exception}")
        rank = self.manager.participating_rank()
        if rank is None:
            raise QuorumError("this replica is not part of the quorum")
        self.quorums += 1
        self.quorum = Quorum(size=self.manager.num_participants(), rank=rank,
                             quorum_id=self.quorums, healed=self._healed)
        return self.quorum

    def commit(self) -> bool:
        """Whether this replica group may apply the sync: no collective failed on any of
        its ranks and the quorum has enough replicas. A replica that did not commit while
        others did is behind afterwards and heals at the next sync."""
        return bool(self.manager.should_commit())

    def report_error(self, exc: Exception) -> None:
        """Mark this round failed on this rank (its commit vote becomes no)."""
        self.manager.report_error(exc)

    @property
    def committed_syncs(self) -> int:
        """Syncs this replica has committed (torchft's step; healing adopts the peer's).
        Saved with checkpoints: a group that resumes behind the others heals."""
        return int(self.manager.current_step())

    @committed_syncs.setter
    def committed_syncs(self, value: int) -> None:
        self.manager.load_state_dict({"step": int(value),
                                      "batches_committed": self.manager.batches_committed()})

    def resume_behind(self, saved: int) -> None:
        """Take up the count of a checkpoint written after ``saved`` commits, as one
        commit fewer: the checkpoint holds the global model of its last commit and no
        local progress, while a group that kept training since that commit has the same
        count and is many steps ahead (its job never stopped; its rounds since may have
        failed, which count nothing). torchft heals by count only, so at an equal count
        the resumed group would not heal: it would train on from its checkpoint's step,
        syncing with the others at their later steps, to the end. One fewer makes it
        heal from any group that holds the commit, at its first quorum; groups that all
        resume from checkpoints keep their order (the older heal from the newer). A live
        group that missed that very commit ends at the resumed group's count: the first
        round (:meth:`~editrain.sync.ft_round.FaultTolerantSchedule.run`) sees it
        contribute and does not commit, so the resumed group heals at the next one."""
        self.committed_syncs = max(0, int(saved) - 1)

    # ------------------------------------------------------------------ collectives
    @property
    def size(self) -> int:
        """Replicas in the current quorum."""
        return 1 if self.quorum is None else self.quorum.size

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:  # gloo reports a vanished peer as a RuntimeError
            self.report_error(exc)
            raise QuorumError(f"cross-replica {what} failed (a replica left?): {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place sum over the quorum (CPU tensor)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait(self.pg.allreduce([tensor], opts), "all-reduce")

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """Gather the flat ``tensor`` of every member into ``out`` (``[size * n]``, CPU)."""
        rows = list(out.view(self.size, -1).unbind(0))
        self._wait(self.pg.allgather([rows], [tensor.reshape(-1)], AllgatherOptions()),
                   "all-gather")

    def shutdown(self) -> None:
        """Stop the manager (and its checkpoint server)."""
        self.manager.shutdown(wait=False)
