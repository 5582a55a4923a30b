"""Measured speed limits: every replica's solo speed, all run at once, none communicating.

The physical limit of a cluster of replicas that never wait for each other is the sum of
the replicas' speeds when each trains alone, never communicating, while the others do the
same on the same machine (so the limit includes the contention for cores and memory that
the compared runs have too). Each solo run is a single replica (``dist.nproc =
dist.shard_size``) that simulates replica ``r`` of the compared runs (``sim.replica_offset
= r``: its straggler factor and its own random-stall stream), with the same threads per
process, and no communication at all (``edit`` with a sync interval longer than the
run). The solo runs of one round are started together, as separate jobs; rounds are
interleaved with the compared runs.

A compared run's limit is taken over the same steps (:func:`matched_limit`): each replica's
solo speed between the steps that replica ran in the compared run's window. A simulated
slowdown is drawn per step from the replica's own stream (a random stall at step k is the
same in every run that simulates that replica), so over the same steps a solo run has
exactly the stalls the replica had; over other steps it would not (with stalls of p = 0.1
a stretch of 70 to 120 steps holds 4% to 14% stalled steps: a limit over the solo run's own
steps was off by up to 7% from the replica's share of the same process). A solo run
therefore trains at least as many steps as the whole budget (``train.steps x replicas``),
enough for any replica's share.

The machine's speed drifts while a benchmark runs (on a shared 2-vCPU host a 5 s window of
the same work varies by +-10%, and a replica's step time by up to 1.5x between runs a
minute apart), so a limit measured once per repeat can be off by more than the gap it is
meant to show. A compared run's limit is therefore bracketed (:func:`bracketed_limit`):
solo runs are measured just before and just after every pair of compared runs, and the
limit is the mean of the two, each over the same steps; how far the two brackets differ
is recorded with it (``drift``), the size of the error a single solo measurement had.

The limit assumes that every replica computes all the time, as the solo runs of a round
do. A replica that waits leaves what the processes share (memory bandwidth, caches, a
sibling hyperthread) to the others, and they then compute faster than their solo speed
beside a busy neighbour: on the 2-vCPU development host the straggler's solo run alone
went 1% to 6% (median 3%) faster than beside the fast replica's solo run (an ad-hoc probe,
4 interleaved rounds). A method whose replicas idle (``sync``, ``edit``) can therefore come
out slightly above its limit by this effect; one whose replicas rarely wait gains little
from it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from editrain.bench.measures import rank_window, replica_stats, steady_throughput
from editrain.bench.runs import Run


@dataclass
class SoloPlan:
    """Which solo runs measure which replicas."""

    replica_keys: list[str]
    """Per replica of the compared runs: the key of the solo run that measures it."""
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Solo key -> the option layer that turns a compared run into that solo run."""
    labels: dict[str, str] = field(default_factory=dict)
    """Solo key -> run label (``solo-replica1``)."""
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
        ``sim`` options: that replica's stragglers and the random stalls, seen from replica
        ``replica`` (``replica_offset``: the same straggler indices, its own stall stream);
        no link (a solo replica has no cross-replica traffic), no corruption, failure or
        forced A-EDiT schedule.
    """
    from editrain.sim import parse_sim

    simulated = sim.replica_offset + replica
    mine = [spec for spec, s in zip(sim.straggler, parse_sim(sim).stragglers)
            if s.replica == simulated]
    return {"straggler": mine, "random_stall": sim.random_stall,
            "replica_offset": simulated,
            "link_bandwidth": None, "link_latency": None, "corrupt_replica": [],
            "fail": None, "step_schedule": []}


def plan_solo_runs(cfg: Any, margin: float = 1.0) -> SoloPlan:
    """The solo runs that measure every replica of a run configured as ``cfg``: one per
    replica (each replica's random stalls are its own stream, so none are shared).

    Args:
        cfg: the compared runs' validated configuration (``Bench.config(...)``).
        margin: a solo run trains ``margin x train.steps x replicas`` steps. 1 covers any
            replica's share of the budget; A-EDiT can overshoot it by up to a sync period
            of steps (a replica trains on until the last sync ends), which matters when the
            period is long next to the budget (tiny runs).
    """
    if margin < 1.0:
        raise ValueError(f"solo-run margin must be >= 1 (got {margin})")
    shard = cfg.dist.shard_size
    replicas = cfg.dist.nproc // shard
    steps = math.ceil(margin * cfg.train.steps * replicas)  # any replica's share fits
    threads = cfg.dist.threads_per_proc or max(1, (os.cpu_count() or 1) // cfg.dist.nproc)
    keys = [f"replica{replica}" for replica in range(replicas)]
    sims = {key: solo_sim(cfg.sim, replica) for replica, key in enumerate(keys)}
    layers = {key: {"dist": {"nproc": shard, "shard_size": shard, "threads_per_proc": threads},
                    "sim": sims[key],
                    "sync": {"method": "edit", "local_sgd_sync_interval": steps + 1},
                    "train": {"steps": steps, "eval_every": steps}} for key in keys}
    return SoloPlan(replica_keys=keys, layers=layers, sims=sims,
                    labels={key: f"solo-{key}" for key in keys})


def measured_limit(plan: SoloPlan, solo_runs: dict[str, Run], skip: int) -> dict[str, Any]:
    """The limit of one round: the sum over replicas of their solo tokens/s (from
    ``metrics.jsonl``, like the compared runs' throughput).

    Args:
        plan: the solo plan.
        solo_runs: solo key -> that round's solo run.
        skip: steps left out at the start.

    Returns:
        ``tokens_per_s`` (None when a solo run failed), ``per_replica`` (each replica's
        solo tokens/s) and ``utilisation`` (solo label -> the solo replica's, from its
        per-rank logs; None without them).
    """
    speeds, utilisation = {}, {}
    for key, run in solo_runs.items():
        stats = replica_stats(run, skip) if run.ok else []
        speeds[key] = steady_throughput(run, skip).get("tokens_per_s") if run.ok else None
        utilisation[plan.labels[key]] = stats[0]["utilisation"] if stats else None
    per_replica = [speeds[key] for key in plan.replica_keys]
    return {"tokens_per_s": _total(per_replica), "per_replica": per_replica,
            "utilisation": utilisation}


def solo_speed_over(run: Run, first: int, last: int) -> float | None:
    """A solo run's tokens/s (its ranks' sum) from the end of its step ``first`` to the end
    of step ``last`` (None when a rank lacks either step)."""
    if not run.ok:
        return None
    return _total([_span_speed(rows, first, last) for rows in run.ranks.values()])


def _span_speed(rows: list[dict[str, Any]], first: int, last: int) -> float | None:
    """One rank's tokens/s from the end of step ``first`` to the end of step ``last``."""
    span = [r for r in rows if first <= r["step"] <= last]
    if not span or span[0]["step"] != first or span[-1]["step"] != last:
        return None
    return rank_window(span, skip=first).get("tokens_per_s")


def matched_limit(plan: SoloPlan, solo_runs: dict[str, Run], run: Run,
                  skip: int) -> dict[str, Any]:
    """The limit of one compared run, over the same steps: the sum over replicas of the
    replica's solo tokens/s over the steps it trained in ``run`` (its per-rank window, from
    its step ``skip`` to its last step; :func:`editrain.bench.measures.rank_window`).

    Args:
        plan: the solo plan.
        solo_runs: solo key -> the same repeat's solo run.
        run: the compared run.
        skip: steps left out at the start.

    Returns:
        ``tokens_per_s`` (None when a replica's steps are missing from its solo run),
        ``per_replica`` (each replica's solo tokens/s over its steps) and ``steps`` (each
        replica's ``[first, last]``).
    """
    stats = {s["replica"]: s for s in replica_stats(run, skip)} if run.ok else {}
    windows = [stats.get(replica) for replica in range(len(plan.replica_keys))]
    steps = [None if w is None else [w["from_step"], w["to_step"]] for w in windows]
    per_replica = [None if span is None else solo_speed_over(solo_runs[key], *span)
                   for key, span in zip(plan.replica_keys, steps)]
    return {"tokens_per_s": _total(per_replica), "per_replica": per_replica, "steps": steps}


def bracketed_limit(plan: SoloPlan, brackets: Sequence[dict[str, Run]], run: Run,
                    skip: int) -> dict[str, Any]:
    """The limit of one compared run from the solo runs around it: per replica, the mean of
    its solo speeds over the same steps (:func:`matched_limit`) in every bracket.

    Args:
        plan: the solo plan.
        brackets: the solo runs measured just before and just after ``run`` (solo key ->
            run, one mapping per bracket).
        run: the compared run.
        skip: steps left out at the start.

    Returns:
        As :func:`matched_limit` (None where a bracket lacks a replica's steps), plus
        ``brackets`` (each bracket's limit) and ``drift`` (their range over their mean).
    """
    each = [matched_limit(plan, solos, run, skip) for solos in brackets]
    per_replica = [_mean([x["per_replica"][replica] for x in each])
                   for replica in range(len(plan.replica_keys))]
    totals = [x["tokens_per_s"] for x in each]
    mean = _mean(totals)
    drift = None if mean is None else (max(totals) - min(totals)) / mean
    return {"tokens_per_s": _total(per_replica), "per_replica": per_replica,
            "steps": each[0]["steps"] if each else [], "brackets": totals, "drift": drift}


def _total(values: Sequence[float | None]) -> float | None:
    """The sum of ``values``; None when there are none or one is missing (a failed run)."""
    return sum(values) if values and all(v is not None for v in values) else None


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean of ``values``; None when there are none or one is missing."""
    total = _total(values)
    return None if total is None else total / len(values)


__all__ = ["SoloPlan", "bracketed_limit", "matched_limit", "measured_limit", "plan_solo_runs",
           "solo_sim", "solo_speed_over"]
