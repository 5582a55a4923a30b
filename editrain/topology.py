"""Process group and ("sync", "shard") device mesh construction, plus rank arithmetic.

The world of ``W`` ranks is a 2-D mesh of shape ``(R, S)``:

* a *replica* is one row (``S`` ranks on fast links that shard one model copy with FSDP2),
* a *sync group* is one column (the ``R`` ranks holding the same shard index, on slow links).

``rank = sync_index * S + shard_index``. Both ``R = 1`` and ``S = 1`` are valid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SYNC_DIM = "sync"
SHARD_DIM = "shard"


@dataclass(frozen=True)
class Topology:
    """Rank arithmetic for a ``(replicas, shard_size)`` mesh; pure, no process group needed.

    Args:
        world_size: total number of ranks ``W``.
        shard_size: ranks per replica ``S``; must divide ``W``.
    """

    world_size: int
    shard_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.shard_size < 1 or self.world_size % self.shard_size != 0:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f"dist.shard_size={self.shard_size} must divide the world size "
                f"{self.world_size}; allowed values: {divisors}"
            )

    @property
    def num_replicas(self) -> int:
        """Number of replicas ``R = W / S``."""
        return self.world_size // self.shard_size

    def replica_of(self, rank: int) -> int:
        """Replica (sync-dim) index of a global rank."""
        return rank // self.shard_size

    def shard_of(self, rank: int) -> int:
        """Shard index of a global rank inside its replica."""
        return rank % self.shard_size

    def rank_of(self, replica: int, shard: int) -> int:
        """Global rank of ``(replica, shard)``."""
        return replica * self.shard_size + shard

    def replica_ranks(self, replica: int) -> list[int]:
        """The ``S`` global ranks of one replica (a shard group)."""
        return [self.rank_of(replica, s) for s in range(self.shard_size)]

    def sync_ranks(self, shard: int) -> list[int]:
        """The ``R`` global ranks that hold shard ``shard`` in every replica (a sync group)."""
        return [self.rank_of(r, shard) for r in range(self.num_replicas)]


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
        mesh: the 2-D ``("sync", "shard")`` DeviceMesh.
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
) -> MeshInfo:
    """Initialise the default process group (if needed) and the ``("sync", "shard")`` mesh.

    Reads the usual ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

    Args:
        shard_size: ranks per replica; must divide the world size.
        backend: ``"gloo"``, ``"nccl"`` or None to choose from the device type.
        device_type: ``"cpu"``, ``"cuda"`` or None to detect.
        timeout_s: collective timeout; a hung peer fails after this long.
    """
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
    topo = Topology(world, shard_size)
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
    mesh = init_device_mesh(
        device_type, (topo.num_replicas, topo.shard_size), mesh_dim_names=(SYNC_DIM, SHARD_DIM)
    )
    return MeshInfo(mesh=mesh, topo=topo, rank=rank, device=device)


def topology_of(mesh: DeviceMesh) -> Topology:
    """Topology of an existing ``("sync", "shard")`` mesh, validating its dim names."""
    names = mesh.mesh_dim_names
    if names is None or tuple(names) != (SYNC_DIM, SHARD_DIM):
        raise ValueError(
            f"editrain needs a 2-D DeviceMesh with mesh_dim_names=('sync', 'shard'), got {names}; "
            "build it with editrain.init_mesh(shard_size=...)"
        )
    return Topology(mesh.size(), mesh.size(1))
