"""The trainer's side of the fault-tolerant mode (``dist.fault_tolerance = "torchft"``).

* who this job is: :func:`ft_identity` (replica group id and count), and where its
  replica group writes (:func:`replica_run_dir`);
* its cross-replica group: :func:`make_group`;
* while its replica group waits in its first quorum, whether the run ended meanwhile:
  :class:`RunEndWatch`;
* what a healing replica receives from a healthy one besides the engine's state: the
  trainer's step, data position and the inner optimizer's state, as local tensors
  (:func:`local_optimizer_state` / :func:`load_local_optimizer_state`).

``editrain train --ft`` on one machine (a lighthouse and one job per replica group, a group
that dies restarted) is :func:`editrain.launch.ft.run_ft`.

The algorithm side (quorum, all-or-nothing rounds, healing of the engine) lives in
:mod:`editrain.sync.ft_round`; torchft itself is imported only by :mod:`editrain.sync.ft`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from editrain.argv import env_int
from editrain.config import Config, ConfigError
from editrain.errors import RunDirError
from editrain.sync.ft import LIGHTHOUSE_ENV, REPLICA_ENV

ATTEMPT_ENV = "EDITRAIN_FT_ATTEMPT"
"""How many times this replica group has been started before (0 on the first start)."""


def ft_identity(cfg: Config, group_size: int) -> tuple[int, int]:
    """This job's replica group id and the number of groups.

    Args:
        cfg: the run's configuration (``dist.ft_replica_id``, ``dist.ft_replicas``).
        group_size: ranks of this job (``pp_size x shard_size x tp_size``).
    """
    d = cfg.dist
    replicas = d.ft_replicas or d.nproc // d.replica_size
    replica = d.ft_replica_id
    if replica < 0:
        if REPLICA_ENV not in os.environ:
            raise ConfigError(f"dist.ft_replica_id: not set and ${REPLICA_ENV} is not in the "
                              f"environment; `editrain train --ft` sets it, under torchrun "
                              f"pass --dist.ft_replica_id")
        replica = env_int(REPLICA_ENV)
    if not 0 <= replica < replicas:
        raise ConfigError(f"dist.ft_replica_id: must be in 0..{replicas - 1} "
                          f"(dist.ft_replicas={replicas}), got {replica}")
    return replica, replicas


def replica_run_dir(path: str | Path, replica: int) -> Path:
    """A fault-tolerant run's directory of replica group ``replica`` (``path`` itself if it
    is not a fault-tolerant run directory, e.g. a checkpoint path)."""
    sub = Path(path) / f"replica{replica}"
    return sub if sub.is_dir() else Path(path)


def make_group(cfg: Config, replica: int, replicas: int, group_rank: int, group_size: int):
    """The torchft cross-replica group of this rank (see :class:`TorchftGroup`)."""
    from editrain.sync.ft import TorchftGroup

    d = cfg.dist
    return TorchftGroup(replica, replicas, group_rank, group_size,
                        lighthouse=d.ft_lighthouse or os.environ.get(LIGHTHOUSE_ENV),
                        min_replicas=d.ft_min_replicas, timeout_s=d.ft_timeout_s,
                        quorum_timeout_s=max(600.0, 2 * d.ft_join_timeout_s),
                        heartbeat_interval_s=d.ft_heartbeat_interval_s)


class RunEndWatch:
    """Ends the first quorum of a replica group (a torchrun job of a fault-tolerant run)
    that waits for groups which will never come: every other group finished the run while
    it waited. The start-up check refuses such a group at once
    (:func:`editrain.launch.run_dir.ended_run_problem`), but a group that was already
    waiting when the last other group ended waited out the quorum timeout (600 s): the
    lighthouse forms a quorum of this group alone at every attempt, and nothing in it says
    that the others are gone for good.

    Called on every rank after each failed attempt of the join
    (:meth:`editrain.sync.ft_round.FaultTolerantSchedule.join`). Rank 0 looks at the run
    directory (``look``, the start-up check's own evidence, under the run's lock) at most
    every ``interval_s``, not at every attempt (a few a second); every rank takes its
    answer over the group's default process group (on the device torch picks for its
    backend: the CPU for gloo, this rank's GPU for NCCL), so that the group's ranks stop
    together, a look that raised (an unreadable run record) included.

    Args:
        look: why the run ended for this group, or None: rank 0's look; the other ranks'
            (whose answer is not used) need not look at all.
        interval_s: the least time between two looks.
    """

    def __init__(self, look: Callable[[], str | None], interval_s: float = 1.0) -> None:
        self.look = look
        self.interval_s = interval_s
        self._next_look = 0.0

    def __call__(self) -> None:
        """Raise where rank 0 found the run ended.

        Raises:
            RunDirError: the start-up check's refusal (or the look's own), the same on
                every rank.
        """
        problem = self._rank0_look()
        if dist.is_initialized() and dist.get_world_size() > 1:
            shared = [problem]
            dist.broadcast_object_list(shared, src=0)
            problem = shared[0]
        if problem:
            raise RunDirError(problem)

    def _rank0_look(self) -> str | None:
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + self.interval_s
        try:
            return self.look()
        except RunDirError as e:
            return str(e)


# ---------------------------------------------------------------------------- state
def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded tensor replaced by this rank's local
    shard, copied to the CPU (what the peer in the same place of another replica group,
    the same stage, shard and tp index, can load)."""
    sd = optimizer.state_dict()
    state = {}
    for key, entries in sd["state"].items():
        state[key] = {
            k: (v.to_local() if hasattr(v, "to_local") else v).detach().to("cpu", copy=True)
            if torch.is_tensor(v) else v
            for k, v in entries.items()
        }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Load :func:`local_optimizer_state` of a peer: per-element entries become shards laid
    out like this rank's parameters (DTensors where the parameters are)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for key, entries in sd["state"].items():
        p = params[int(key)]
        out = {}
        for k, v in entries.items():
            if torch.is_tensor(v) and isinstance(p, DTensor) and v.dim() > 0:
                v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                       run_check=False, shape=p.shape, stride=p.stride())
            out[k] = v
        state[key] = out
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
