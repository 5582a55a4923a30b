"""Process group and device mesh construction, plus rank arithmetic.

The world of ``W`` ranks is a ``("sync", "shard")`` mesh of shape ``(R, S)``, or with tensor
parallelism a ``("sync", "shard", "tp")`` mesh of shape ``(R, S, T)``:

* a *replica* is the ``S x T`` ranks on fast links that hold one model copy: FSDP2 shards it
  over ``shard``, tensor parallelism splits its layers over ``tp``;
* a *sync group* is the ``R`` ranks holding the same piece (the same ``(shard, tp)``
  position) in every replica, on slow links.

``rank = (replica * S + shard) * T + tp`` (tp innermost: tp peers are neighbours, on one
node). ``R = 1``, ``S = 1`` and ``T = 1`` are all valid; ``T = 1`` is the 2-D mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from editrain import malloc

SYNC_DIM = "sync"
SHARD_DIM = "shard"
TP_DIM = "tp"


@dataclass(frozen=True)
class Topology:
    """Rank arithmetic for a ``(replicas, shard_size, tp_size)`` mesh; pure, no process
    group needed.

    Args:
        world_size: total number of ranks ``W``.
        shard_size: FSDP2 ranks per replica ``S``.
        tp_size: tensor-parallel ranks per shard ``T``; ``S * T`` must divide ``W``.
    """

    world_size: int
    shard_size: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.tp_size < 1 or self.world_size % self.tp_size != 0:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f"dist.tp_size={self.tp_size} must divide the world size {self.world_size}; "
                f"allowed values: {divisors}")
        per_tp = self.world_size // self.tp_size
        if self.shard_size < 1 or per_tp % self.shard_size != 0:
            divisors = [d for d in range(1, per_tp + 1) if per_tp % d == 0]
            what = (f"the world size {self.world_size}" if self.tp_size == 1 else
                    f"world size / dist.tp_size = {per_tp}")
            raise ValueError(
                f"dist.shard_size={self.shard_size} must divide {what}; "
                f"allowed values: {divisors}"
            )

    @property
    def replica_size(self) -> int:
        """Ranks per replica ``S * T``."""
        return self.shard_size * self.tp_size

    @property
    def num_replicas(self) -> int:
        """Number of replicas ``R = W / (S * T)``."""
        return self.world_size // self.replica_size

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape: ``(R, S)``, or ``(R, S, T)`` with tensor parallelism."""
        base = (self.num_replicas, self.shard_size)
        return base if self.tp_size == 1 else (*base, self.tp_size)

    def replica_of(self, rank: int) -> int:
        """Replica (sync-dim) index of a global rank."""
        return rank // self.replica_size

    def shard_of(self, rank: int) -> int:
        """Shard (FSDP2) index of a global rank inside its replica."""
        return (rank // self.tp_size) % self.shard_size

    def tp_of(self, rank: int) -> int:
        """Tensor-parallel index of a global rank."""
        return rank % self.tp_size

    def position_of(self, rank: int) -> int:
        """Index of a global rank inside its replica (``shard * T + tp``)."""
        return rank % self.replica_size

    def replica_ranks(self, replica: int) -> list[int]:
        """The ``S * T`` global ranks of one replica."""
        return [replica * self.replica_size + i for i in range(self.replica_size)]

    def sync_ranks(self, position: int) -> list[int]:
        """The ``R`` global ranks at ``position`` (see :meth:`position_of`) in every
        replica (a sync group)."""
        return [r * self.replica_size + position for r in range(self.num_replicas)]

    def data_rank(self, rank: int) -> int:
        """Data-parallel index of a global rank (tp peers read the same batch)."""
        return self.replica_of(rank) * self.shard_size + self.shard_of(rank)

    @property
    def data_world(self) -> int:
        """Data-parallel ranks ``R * S``."""
        return self.num_replicas * self.shard_size


def default_backend(device_type: str) -> str:
    """``nccl`` for CUDA, ``gloo`` otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


def default_device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class MeshInfo:
    """What the rest of editrain needs to know about the running topology.

    Attributes:
        mesh: the ``("sync", "shard")`` DeviceMesh, or ``("sync", "shard", "tp")``.
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
    def tp_mesh(self) -> DeviceMesh | None:
        """1-D sub-mesh over this rank's tp peers (None without tensor parallelism)."""
        return self.mesh[TP_DIM] if self.topo.tp_size > 1 else None

    @property
    def shard_mesh(self) -> DeviceMesh:
        """1-D sub-mesh over this rank's replica (what FSDP2 shards over)."""
        return self.mesh[SHARD_DIM]

    @property
    def sync_mesh(self) -> DeviceMesh:
        """1-D sub-mesh over this rank's sync group."""
        return self.mesh[SYNC_DIM]


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """A store namespaced by restart attempt, under torch elastic's agent-hosted store.

    After a worker failure torch elastic restarts every worker against the *same* agent
    store; without a per-attempt namespace the new workers read the dead attempt's gloo
    addresses and fail to connect. Returns None outside torch elastic.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"editrain/attempt_{attempt}", store)


def init_mesh(
    shard_size: int,
    backend: str | None = None,
    device_type: str | None = None,
    timeout_s: float = 600.0,
    tp_size: int = 1,
    keep_freed_memory: bool = True,
) -> MeshInfo:
    """Initialise the default process group (if needed) and the ``("sync", "shard")`` mesh,
    or the ``("sync", "shard", "tp")`` mesh when ``tp_size > 1``.

    Reads the usual ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

    Args:
        shard_size: ranks per replica; must divide the world size.
        backend: ``"gloo"``, ``"nccl"`` or None to choose from the device type.
        device_type: ``"cpu"``, ``"cuda"`` or None to detect.
        timeout_s: collective timeout; a hung peer fails after this long.
        tp_size: tensor-parallel ranks per shard (see :mod:`editrain.models.tensor_parallel`).
        keep_freed_memory: set glibc's malloc up as ``editrain train`` sets up its workers
            (:func:`editrain.malloc.keep_freed_memory`: a step's freed buffers are reused
            by the next instead of being page-faulted in again); False leaves malloc alone.
    """
    if keep_freed_memory:
        malloc.keep_freed_memory()
    device_type = device_type or default_device_type()
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store = _attempt_store(timeout)
        extra = {} if store is None else {
            "store": store, "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend=backend or default_backend(device_type),
                                timeout=timeout, **extra)
    world, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology(world, shard_size, tp_size)
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
    names = (SYNC_DIM, SHARD_DIM) if tp_size == 1 else (SYNC_DIM, SHARD_DIM, TP_DIM)
    mesh = init_device_mesh(device_type, topo.shape, mesh_dim_names=names)
    return MeshInfo(mesh=mesh, topo=topo, rank=rank, device=device)


def topology_of(mesh: DeviceMesh) -> Topology:
    """Topology of an existing ``("sync", "shard")`` or ``("sync", "shard", "tp")`` mesh,
    validating its dim names."""
    names = tuple(mesh.mesh_dim_names or ())
    if names == (SYNC_DIM, SHARD_DIM):
        return Topology(mesh.size(), mesh.size(1))
    if names == (SYNC_DIM, SHARD_DIM, TP_DIM):
        return Topology(mesh.size(), mesh.size(1), mesh.size(2))
    raise ValueError(
        f"editrain needs a DeviceMesh with mesh_dim_names=('sync', 'shard') or "
        f"('sync', 'shard', 'tp'), got {mesh.mesh_dim_names}; build it with "
        "editrain.init_mesh(shard_size=..., tp_size=...)"
    )
