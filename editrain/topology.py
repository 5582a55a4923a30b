"""Process group and device mesh construction, plus rank arithmetic.

The world of ``W`` ranks is a ``("sync", "shard")`` mesh of shape ``(R, S)``, or with tensor
parallelism a ``("sync", "shard", "tp")`` mesh of shape ``(R, S, T)``, or with pipeline
parallelism a ``("sync", "pp", "shard", "tp")`` mesh of shape ``(R, P, S, T)``:

* a *replica* is the ``P x S x T`` ranks on fast links that hold one model copy: the
  pipeline splits it into ``P`` stages over ``pp`` (each stage a contiguous run of
  blocks, :mod:`editrain.pipeline`), FSDP2 shards a stage over ``shard``, tensor
  parallelism splits its layers over ``tp``;
* a *sync group* is the ``R`` ranks holding the same piece (the same ``(stage, shard, tp)``
  position) in every replica, on slow links.

``rank = ((replica * P + stage) * S + shard) * T + tp`` (tp innermost: tp peers are
neighbours, on one node; then shard, then stage). ``R``, ``P``, ``S`` and ``T`` may each be
1; ``P = T = 1`` is the 2-D mesh, ``P = 1`` the 3-D one (the mesh is 4-D only with pipeline
stages, so nothing changes without them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from editrain import malloc
from editrain.argv import env_int
from editrain.errors import plain_scalar, spelled

if TYPE_CHECKING:  # torch is imported where a mesh is built: the launcher checks the
    # topology (Topology) before it imports torch (see editrain.launch)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

SYNC_DIM = "sync"
SHARD_DIM = "shard"
TP_DIM = "tp"
PP_DIM = "pp"


@dataclass(frozen=True)
class Topology:
    """Rank arithmetic for a ``(replicas, pp_size, shard_size, tp_size)`` mesh; pure, no
    process group needed.

    Args:
        world_size: total number of ranks ``W``.
        shard_size: FSDP2 ranks per stage ``S``.
        tp_size: tensor-parallel ranks per shard ``T``.
        pp_size: pipeline stages per replica ``P``; ``P * S * T`` must divide ``W``.
    """

    world_size: int
    shard_size: int
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        # The sizes come from Python callers too (``init_mesh(shard_size=...)``): a numpy
        # integer (``np.int64`` from ``np.arange``) is taken and stored as a plain int, so
        # that the mesh shape and every rank list built from it are plain; a bool, a float
        # (``2.0`` divides like 2 but is no mesh size) or a tensor is refused by name, as
        # the config options' types are (the same check: errors.plain_scalar).
        for name, option in (("world_size", "world size"), ("shard_size", "dist.shard_size"),
                             ("tp_size", "dist.tp_size"), ("pp_size", "dist.pp_size")):
            object.__setattr__(self, name, plain_scalar(getattr(self, name), int, option))
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.tp_size < 1 or self.world_size % self.tp_size != 0:
            divisors = _divisors(self.world_size)
            raise ValueError(
                f"dist.tp_size={self.tp_size} must divide the world size {self.world_size}; "
                f"allowed values: {divisors}")
        per_tp = self.world_size // self.tp_size
        if self.pp_size < 1 or per_tp % self.pp_size != 0:
            what = (f"the world size {self.world_size}" if self.tp_size == 1 else
                    f"world size / dist.tp_size = {per_tp}")
            raise ValueError(
                f"dist.pp_size={spelled(self.pp_size)} must divide {what}; "
                f"allowed values: {_divisors(per_tp)}")
        per_stage = per_tp // self.pp_size
        if self.shard_size < 1 or per_stage % self.shard_size != 0:
            divisors = _divisors(per_stage)
            if self.pp_size > 1:
                what = (f"world size / (dist.pp_size x dist.tp_size) = {per_stage}"
                        if self.tp_size > 1 else f"world size / dist.pp_size = {per_stage}")
            else:
                what = (f"the world size {self.world_size}" if self.tp_size == 1 else
                        f"world size / dist.tp_size = {per_tp}")
            raise ValueError(
                f"dist.shard_size={self.shard_size} must divide {what}; "
                f"allowed values: {divisors}"
            )

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage of a replica ``S * T`` (the ranks that hold one
        stage's units; the whole replica without pipeline parallelism)."""
        return self.shard_size * self.tp_size

    @property
    def replica_size(self) -> int:
        """Ranks per replica ``P * S * T``."""
        return self.pp_size * self.stage_size

    @property
    def num_replicas(self) -> int:
        """Number of replicas ``R = W / (P * S * T)``."""
        return self.world_size // self.replica_size

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape: ``(R, S)``, ``(R, S, T)`` with tensor parallelism, or
        ``(R, P, S, T)`` with pipeline stages."""
        if self.pp_size > 1:
            return (self.num_replicas, self.pp_size, self.shard_size, self.tp_size)
        base = (self.num_replicas, self.shard_size)
        return base if self.tp_size == 1 else (*base, self.tp_size)

    def replica_of(self, rank: int) -> int:
        """Replica (sync-dim) index of a global rank."""
        return rank // self.replica_size

    def stage_of(self, rank: int) -> int:
        """Pipeline stage (pp) index of a global rank inside its replica."""
        return (rank // self.stage_size) % self.pp_size

    def shard_of(self, rank: int) -> int:
        """Shard (FSDP2) index of a global rank inside its stage."""
        return (rank // self.tp_size) % self.shard_size

    def tp_of(self, rank: int) -> int:
        """Tensor-parallel index of a global rank."""
        return rank % self.tp_size

    def position_of(self, rank: int) -> int:
        """Index of a global rank inside its replica (``(stage * S + shard) * T + tp``)."""
        return rank % self.replica_size

    def replica_ranks(self, replica: int) -> list[int]:
        """The ``P * S * T`` global ranks of one replica, every stage."""
        return [replica * self.replica_size + i for i in range(self.replica_size)]

    def stage_ranks(self, replica: int, stage: int = 0) -> list[int]:
        """The ``S * T`` global ranks of one stage of one replica (the whole replica
        without pipeline parallelism)."""
        first = (replica * self.pp_size + stage) * self.stage_size
        return list(range(first, first + self.stage_size))

    def pp_ranks(self, rank: int) -> list[int]:
        """The ``P`` global ranks of ``rank``'s pipeline (its replica, shard and tp
        index; one per stage, in stage order)."""
        base = self.replica_of(rank) * self.replica_size + rank % self.stage_size
        return [base + p * self.stage_size for p in range(self.pp_size)]

    def sync_ranks(self, position: int) -> list[int]:
        """The ``R`` global ranks at ``position`` (see :meth:`position_of`: the same
        stage, shard and tp index) in every replica (a sync group)."""
        return [r * self.replica_size + position for r in range(self.num_replicas)]

    def data_rank(self, rank: int) -> int:
        """Data-parallel index of a global rank (tp peers and the stages of one pipeline
        read the same batch)."""
        return self.replica_of(rank) * self.shard_size + self.shard_of(rank)

    @property
    def data_world(self) -> int:
        """Data-parallel ranks ``R * S``."""
        return self.num_replicas * self.shard_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_backend(device_type: str) -> str:
    """``nccl`` for CUDA, ``gloo`` otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


def default_device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class MeshInfo:
    """What the rest of editrain needs to know about the running topology.

    Attributes:
        mesh: the ``("sync", "shard")`` DeviceMesh, ``("sync", "shard", "tp")``, or
            ``("sync", "pp", "shard", "tp")`` with pipeline stages.
        topo: rank arithmetic.
        rank: this process's global rank.
        device: this process's device.
    """

    mesh: DeviceMesh
    topo: Topology
    rank: int
    device: torch.device

    @property
    def replica(self) -> int:
        """This rank's replica index."""
        return self.topo.replica_of(self.rank)

    @property
    def shard(self) -> int:
        """This rank's shard index."""
        return self.topo.shard_of(self.rank)

    @property
    def tp(self) -> int:
        """This rank's tensor-parallel index."""
        return self.topo.tp_of(self.rank)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return self.topo.stage_of(self.rank)

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """1-D sub-mesh over this rank's pipeline: one rank per stage, in stage order (what
        :class:`editrain.pipeline.PipelineRunner` runs over; None without pipeline
        parallelism)."""
        return self.mesh[PP_DIM] if self.topo.pp_size > 1 else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """1-D sub-mesh over this rank's tp peers (None without tensor parallelism)."""
        return self.mesh[TP_DIM] if self.topo.tp_size > 1 else None

    @property
    def shard_mesh(self) -> DeviceMesh:
        """1-D sub-mesh over this rank's shard peers (what FSDP2 shards over: the replica,
        or with pipeline stages this rank's stage of it, without its tp peers)."""
        return self.mesh[SHARD_DIM]

    @property
    def sync_mesh(self) -> DeviceMesh:
        """1-D sub-mesh over this rank's sync group."""
        return self.mesh[SYNC_DIM]


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """A store namespaced by the attempt, under torch elastic's agent-hosted store.

    After a worker failure torch elastic restarts every worker against the *same* agent
    store; without a namespace of its own the new attempt's workers read the dead
    attempt's gloo addresses and fail to connect. The namespace is an id rank 0 makes for
    the attempt and gives the others (:func:`editrain.agent_store.attempt_id`), waiting
    as long as the process group does (``timeout``). It used to be
    ``TORCHELASTIC_RESTART_COUNT``, which torch elastic leaves unchanged on a restart it
    does not count (the nodes taking part changed) and which then differs between nodes:
    ranks looked for each other in different namespaces, or read a dead attempt's
    addresses under the same count, and the process group never formed. Returns None
    outside torch elastic's agent store.
    """
    import torch.distributed as dist

    from editrain.agent_store import attempt_id, uses_agent_store

    if not uses_agent_store():
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], env_int("MASTER_PORT", minimum=1),
                          is_master=False, timeout=timeout)
    attempt = attempt_id(store, env_int("RANK"), env_int("WORLD_SIZE", minimum=1),
                         timeout)
    return dist.PrefixStore(f"editrain/attempt_{attempt}", store)


def init_mesh(
    shard_size: int,
    backend: str | None = None,
    device_type: str | None = None,
    timeout_s: float = 600.0,
    tp_size: int = 1,
    keep_freed_memory: bool = True,
    pp_size: int = 1,
) -> MeshInfo:
    """Initialise the default process group (if needed) and the ``("sync", "shard")`` mesh,
    the ``("sync", "shard", "tp")`` mesh when ``tp_size > 1``, or the
    ``("sync", "pp", "shard", "tp")`` mesh when ``pp_size > 1`` (whatever ``tp_size``).

    Reads the usual ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).
    The sizes are checked against the world size (``WORLD_SIZE`` while no group exists)
    before the default group is started: a wrong ``shard_size`` fails on its own rank,
    before any rendezvous.

    Args:
        shard_size: FSDP2 ranks per replica (per stage with ``pp_size > 1``); ``pp_size x
            shard_size x tp_size`` must divide the world size.
        backend: ``"gloo"``, ``"nccl"`` or None to choose from the device type.
        device_type: ``"cpu"``, ``"cuda"`` or None to detect.
        timeout_s: collective timeout; a hung peer fails after this long.
        tp_size: tensor-parallel ranks per shard (see :mod:`editrain.models.tensor_parallel`).
        keep_freed_memory: set glibc's malloc up as ``editrain train`` sets up its workers
            (:func:`editrain.malloc.keep_freed_memory`: a step's freed buffers are reused
            by the next instead of being page-faulted in again); False leaves malloc alone.
        pp_size: pipeline stages per replica (see :mod:`editrain.pipeline`).

    Raises:
        ValueError: ``pp_size x shard_size x tp_size`` does not divide the world size (the
            message names the option and the allowed values).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _check_sizes_before_group(shard_size, tp_size, pp_size)
    if keep_freed_memory:
        malloc.keep_freed_memory()
    device_type = device_type or default_device_type()
    device = init_default_group(backend, device_type, timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology(world, shard_size, tp_size, pp_size)
    if pp_size > 1:
        names: tuple[str, ...] = (SYNC_DIM, PP_DIM, SHARD_DIM, TP_DIM)
    elif tp_size == 1:
        names = (SYNC_DIM, SHARD_DIM)
    else:
        names = (SYNC_DIM, SHARD_DIM, TP_DIM)
    mesh = init_device_mesh(device_type, topo.shape, mesh_dim_names=names)
    return MeshInfo(mesh=mesh, topo=topo, rank=rank, device=device)


def _check_sizes_before_group(shard_size: int, tp_size: int, pp_size: int) -> None:
    """Refuse sizes that cannot divide the world before any process group exists.

    Under torchrun a rank that started the default group and only then found its
    ``shard_size`` wrong leaves the other ranks waiting in the group's rendezvous or in the
    mesh's first collective; checked here against ``WORLD_SIZE`` (the group's size once it
    exists), it fails alone with :class:`Topology`'s message and nothing started. Without
    a world size to check against (no group, no ``WORLD_SIZE``) the check is left to
    :class:`Topology` after the group is up, as before.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        try:
            world = env_int("WORLD_SIZE", minimum=1)
        except (KeyError, ValueError):
            return  # init_process_group reports a missing or malformed WORLD_SIZE itself
    Topology(world, shard_size, tp_size, pp_size)


def init_default_group(backend: str | None = None, device_type: str | None = None,
                       timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group if it is not yet, and make this rank's device
    the current one (the ``LOCAL_RANK``-th GPU on CUDA); returns that device.

    :func:`init_mesh` calls it first; a caller that must agree with the other ranks on the
    mesh's shape before the mesh's groups are made (``editrain train`` under torchrun, where
    every node has its own command line: :func:`editrain.runtime.init_distributed`) calls
    it, gathers, then calls :func:`init_mesh`. Arguments as :func:`init_mesh`'s.
    """
    import torch
    import torch.distributed as dist

    device_type = device_type or default_device_type()
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store = _attempt_store(timeout)
        extra = {} if store is None else {
            "store": store, "rank": env_int("RANK"),
            "world_size": env_int("WORLD_SIZE", minimum=1)}
        dist.init_process_group(backend=backend or default_backend(device_type),
                                timeout=timeout, **extra)
    if device_type != "cuda":
        return torch.device(device_type)
    rank = dist.get_rank()
    local_rank = env_int("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def shutdown() -> None:
    """End the process group :func:`init_mesh` started, at the end of a training loop:
    every rank waits for the others (a barrier), then destroys the default group, and with
    it the mesh's groups. Call it on every rank after the engine has closed (the ``with
    editrain.edit(...)`` block has ended, or ``engine.close()``), which destroys the
    engine's own groups first: gloo aborts a process whose groups are left to the
    interpreter's exit now and then (``terminate called without an active exception``).
    Does nothing if no process group is initialised.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def topology_of(mesh: DeviceMesh) -> Topology:
    """Topology of an existing ``("sync", "shard")``, ``("sync", "shard", "tp")`` or
    ``("sync", "pp", "shard", "tp")`` mesh, validating its dim names."""
    names = tuple(mesh.mesh_dim_names or ())
    if names == (SYNC_DIM, SHARD_DIM):
        return Topology(mesh.size(), mesh.size(1))
    if names == (SYNC_DIM, SHARD_DIM, TP_DIM):
        return Topology(mesh.size(), mesh.size(1), mesh.size(2))
    if names == (SYNC_DIM, PP_DIM, SHARD_DIM, TP_DIM):
        return Topology(mesh.size(), mesh.size(2), mesh.size(3), mesh.size(1))
    raise ValueError(
        f"editrain needs a DeviceMesh with mesh_dim_names=('sync', 'shard'), "
        f"('sync', 'shard', 'tp') or ('sync', 'pp', 'shard', 'tp'), got "
        f"{mesh.mesh_dim_names}; build it with "
        "editrain.init_mesh(shard_size=..., tp_size=..., pp_size=...)"
    )
