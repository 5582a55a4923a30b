"""Measured speed limits: each replica's solo speed, run alone with its own simulation.

The physical limit of a cluster of replicas that never wait for each other is the sum of
the replicas' solo speeds. Each solo run is a single replica (``dist.nproc =
dist.shard_size``) with the same simulated slowdown that replica has in the compared runs
(replica ``r``'s straggler factor is mapped onto replica 0 of the solo run; random stalls
keep their settings), the same threads per process and the same steps, and no
communication at all (``edit`` with a sync interval longer than the run). Replicas whose
simulation is identical share one solo run. Solo runs are started by the scenario,
interleaved with the method runs of every repeat.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from editrain.bench.measures import replica_stats, steady_throughput
from editrain.bench.runs import Run


@dataclass
class SoloPlan:
    """Which solo runs measure which replicas."""

    replica_keys: list[str]
    """Per replica of the compared runs: the key of the solo run that measures it."""
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Solo key -> the option layer that turns a compared run into that solo run."""
    labels: dict[str, str] = field(default_factory=dict)
    """Solo key -> run label (``solo-replica1``, ``solo-replicas0+1``)."""
    sims: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Solo key -> the ``sim`` options of the solo run (for the record)."""

    def replicas_of(self, key: str) -> list[int]:
        """The replicas a solo run stands for."""
        return [r for r, k in enumerate(self.replica_keys) if k == key]


def solo_sim(sim: Any, replica: int) -> dict[str, Any]:
    """The ``sim`` options of replica ``replica``'s solo run.

    Args:
        sim: the compared runs' resolved ``SimSection``.
        replica: the replica to measure.

    Returns:
        ``sim`` options: that replica's stragglers mapped onto replica 0, the random
        stalls unchanged; no link (a solo replica has no cross-replica traffic), no
        corruption, failure or forced A-EDiT schedule.
    """
    from editrain.sim import parse_sim

    plan = parse_sim(sim)
    stragglers = []
    for s in plan.stragglers:
        if s.replica != replica:
            continue
        spec = f"0={s.factor:g}"
        if s.start or s.stop is not None:
            spec += f"@{s.start}-{s.stop}"
        stragglers.append(spec)
    return {"straggler": stragglers, "random_stall": sim.random_stall,
            "link_bandwidth": None, "link_latency": None, "corrupt_replica": [],
            "fail": None, "step_schedule": []}


def plan_solo_runs(cfg: Any) -> SoloPlan:
    """The solo runs that measure every replica of a run configured as ``cfg``.

    Args:
        cfg: the compared runs' validated configuration (``Bench.config(...)``).

    Returns:
        The plan; one solo run per distinct simulation.
    """
    shard = cfg.dist.shard_size
    replicas = cfg.dist.nproc // shard
    threads = cfg.dist.threads_per_proc or max(1, (os.cpu_count() or 1) // cfg.dist.nproc)
    plan = SoloPlan(replica_keys=[])
    for replica in range(replicas):
        sim = solo_sim(cfg.sim, replica)
        key = json.dumps(sim, sort_keys=True)
        plan.replica_keys.append(key)
        if key in plan.layers:
            continue
        plan.sims[key] = sim
        plan.layers[key] = {
            "dist": {"nproc": shard, "shard_size": shard, "threads_per_proc": threads},
            "sim": sim,
            "sync": {"method": "edit", "local_sgd_sync_interval": cfg.train.steps + 1},
        }
    for key in plan.layers:
        members = plan.replicas_of(key)
        plan.labels[key] = ("solo-replica" if len(members) == 1 else "solo-replicas") \
            + "+".join(map(str, members))
    return plan


def solo_speed(run: Run, skip: int) -> dict[str, Any]:
    """Tokens/s of one solo run and its replica's utilisation.

    Args:
        run: the solo run.
        skip: steps left out at the start.

    Returns:
        ``tokens_per_s`` (from ``metrics.jsonl``, like the compared runs' throughput) and
        ``utilisation`` (from the per-rank logs; None without them).
    """
    if not run.ok:
        return {"tokens_per_s": None, "utilisation": None}
    window = steady_throughput(run, skip)
    reps = replica_stats(run, skip)
    return {"tokens_per_s": window.get("tokens_per_s"),
            "utilisation": reps[0]["utilisation"] if reps else None}


def measured_limit(plan: SoloPlan, solo_runs: dict[str, Run], skip: int) -> dict[str, Any]:
    """The limit of one repeat: the sum over replicas of their solo tokens/s.

    Args:
        plan: the solo plan.
        solo_runs: solo key -> that repeat's solo run.
        skip: steps left out at the start.

    Returns:
        ``tokens_per_s`` (None when a solo run failed) and ``per_replica`` (each replica's
        solo tokens/s).
    """
    speeds = {key: solo_speed(run, skip) for key, run in solo_runs.items()}
    per_replica = [speeds[key]["tokens_per_s"] for key in plan.replica_keys]
    total = sum(per_replica) if all(v is not None for v in per_replica) else None
    return {"tokens_per_s": total, "per_replica": per_replica,
            "utilisation": {plan.labels[k]: s["utilisation"] for k, s in speeds.items()}}


__all__ = ["SoloPlan", "measured_limit", "plan_solo_runs", "solo_sim", "solo_speed"]
