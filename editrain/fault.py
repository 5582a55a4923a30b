"""The fault-tolerant mode around the trainer (``dist.fault_tolerance = "torchft"``).

* who this job is: :func:`ft_identity` (replica group id and count);
* what a healing replica receives from a healthy one besides the engine's state: the
  trainer's step, data position and the inner optimizer's state, as local tensors
  (:func:`local_optimizer_state` / :func:`load_local_optimizer_state`);
* ``editrain train --ft`` on one machine: :func:`run_ft` starts a lighthouse and one job
  (its own process tree and torch.distributed world) per replica group, restarts a group
  that dies (``sim.fail`` kills one) and writes the run's summary.

The algorithm side (quorum, all-or-nothing rounds, healing of the engine) lives in
:mod:`editrain.sync.ft_round`; torchft itself is imported only by :mod:`editrain.sync.ft`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from editrain.config import Config, ConfigError
from editrain.sync.ft import LIGHTHOUSE_ENV, REPLICA_ENV

log = logging.getLogger("editrain")

ATTEMPT_ENV = "EDITRAIN_FT_ATTEMPT"
"""How many times this replica group has been started before (0 on the first start)."""


def ft_identity(cfg: Config, group_size: int) -> tuple[int, int]:
    """This job's replica group id and the number of groups.

    Args:
        cfg: the run's configuration (``dist.ft_replica_id``, ``dist.ft_replicas``).
        group_size: ranks of this job (``shard_size x tp_size``).
    """
    d = cfg.dist
    replicas = d.ft_replicas or d.nproc // d.replica_size
    replica = d.ft_replica_id
    if replica < 0:
        if REPLICA_ENV not in os.environ:
            raise ConfigError(f"dist.ft_replica_id: not set and ${REPLICA_ENV} is not in the "
                              f"environment; `editrain train --ft` sets it, under torchrun "
                              f"pass --dist.ft_replica_id")
        replica = int(os.environ[REPLICA_ENV])
    if not 0 <= replica < replicas:
        raise ConfigError(f"dist.ft_replica_id: must be in 0..{replicas - 1} "
                          f"(dist.ft_replicas={replicas}), got {replica}")
    return replica, replicas


def make_group(cfg: Config, replica: int, replicas: int, group_rank: int, group_size: int):
    """The torchft cross-replica group of this rank (see :class:`TorchftGroup`)."""
    from editrain.sync.ft import TorchftGroup

    d = cfg.dist
    return TorchftGroup(replica, replicas, group_rank, group_size,
                        lighthouse=d.ft_lighthouse or os.environ.get(LIGHTHOUSE_ENV),
                        min_replicas=d.ft_min_replicas, timeout_s=d.ft_timeout_s,
                        quorum_timeout_s=max(600.0, 2 * d.ft_join_timeout_s),
                        heartbeat_interval_s=d.ft_heartbeat_interval_s)


# ---------------------------------------------------------------------------- state
def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded tensor replaced by this rank's local
    shard, copied to the CPU (what a peer with the same shard index can load)."""
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


# ---------------------------------------------------------------------------- launcher
def _group_main(cfg: Config, replica: int, attempt: int, lighthouse: str) -> None:
    """One replica group: a torch elastic job of ``shard_size x tp_size`` local workers, or with
    one worker that worker itself, in this process (one interpreter start-up less: a
    restarted replica is back sooner).

    The group dies with the launcher (also one killed with SIGKILL; its workers die with it
    in turn); Ctrl-C or SIGTERM stop it in order and quietly (the launcher reports the
    interrupt; exit code 128 + the signal's number). A failure is said in one line on
    stderr and the process exits with 2 for an error editrain reports, 1 otherwise; the
    tracebacks are in ``RUN_DIR/replica{replica}/logs/`` (see
    :func:`editrain.launch.logs_dir`).

    Args:
        cfg: the run's configuration (``run_dir`` prepared).
        replica: this group's replica id.
        attempt: how many times this group was started before.
        lighthouse: the torchft lighthouse's address.
    """
    from editrain.launch import logs_dir, run_group
    from editrain.spawn import (
        LOOPBACK,
        USER_ERRORS,
        Interrupted,
        LaunchError,
        die_with_parent,
        free_port,
        interrupts_raise,
        one_line,
    )
    from editrain.train import run_worker

    die_with_parent()
    os.environ[REPLICA_ENV] = str(replica)
    os.environ[ATTEMPT_ENV] = str(attempt)
    os.environ[LIGHTHOUSE_ENV] = lighthouse
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    try:
        interrupts_raise()  # inside the try: a Ctrl-C held back while starting comes now
        if cfg.dist.replica_size > 1:
            run_group(cfg)
            return
        os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        run_worker(cfg, cfg.run_dir)
        return
    except Interrupted as e:
        sys.exit(e.exit_code)
    except LaunchError as e:
        line, code = str(e), e.exit_code
    except Exception as e:  # the group's one worker ran here; run_worker logged the traceback
        name = type(e).__name__
        what = str(e) if name in USER_ERRORS else f"{name}: {e}"
        line = (f"rank 0: {one_line(what)} (traceback: "
                f"{logs_dir(cfg, cfg.run_dir) / 'rank0.log'})")
        code = 2 if name in USER_ERRORS else 1
    print(f"editrain: replica group {replica} failed: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_ft(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """``editrain train --ft``: a lighthouse here, one process tree per replica group, a
    group that dies started again (after ``sim.fail_restart_s``) as long as the others
    still train. Returns the run's summary (also written to ``summary.json``).

    A group says why it failed in one line (see :func:`_group_main`). On Ctrl-C or SIGTERM
    here (``KeyboardInterrupt`` / :class:`editrain.spawn.Interrupted`), or any error, the
    groups still running are stopped on the way out: SIGTERM, SIGKILL after 10 s (a
    group's workers die with their group).

    Args:
        cfg: the run's configuration.
        run_dir: the prepared run directory.

    Raises:
        LaunchError: every replica group failed.
    """
    from editrain.spawn import LaunchError, children_start_with_sigint_blocked
    from editrain.sync.ft import start_lighthouse

    d = cfg.dist
    replicas = d.nproc // d.replica_size
    lighthouse = None
    address = d.ft_lighthouse
    if not address:
        lighthouse = start_lighthouse(d.ft_min_replicas, d.ft_join_timeout_s,
                                      d.ft_heartbeat_timeout_s,
                                      tick_s=d.ft_heartbeat_interval_s)
        address = lighthouse.address()
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(d, ft_replicas=replicas,
                                                            fault_tolerance="torchft"))
    ctx = mp.get_context("spawn")
    procs: dict[int, Any] = {}
    attempts = dict.fromkeys(range(replicas), 0)
    events: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def start(r: int) -> None:
        procs[r] = ctx.Process(target=_group_main, args=(cfg, r, attempts[r], address),
                               name=f"editrain-replica{r}")
        with children_start_with_sigint_blocked():  # no traceback on a Ctrl-C while it boots
            procs[r].start()
        events.append({"event": "start", "replica": r, "attempt": attempts[r],
                       "time_s": time.perf_counter() - t0, "unix_time": time.time()})

    try:
        for r in range(replicas):
            start(r)
        finished_at: float | None = None
        while any(p.is_alive() for p in procs.values()):
            # A restarted group that has not rejoined when every other group is done never
            # will (there is nobody left to heal from): stop it after a grace period.
            done = [s for s, p in procs.items() if not p.is_alive() and p.exitcode == 0]
            late = [s for s, p in procs.items() if p.is_alive() and attempts[s] > 0]
            if done and len(done) + len(late) == len(procs) and late:
                finished_at = finished_at or time.perf_counter()
                if time.perf_counter() - finished_at > d.ft_heartbeat_timeout_s + 5:
                    for s in late:
                        if not (run_dir / f"replica{s}" / "summary.json").exists():
                            log.warning("replica group %d restarted too late: the others "
                                        "finished before it could rejoin; stopping it", s)
                            procs[s].kill()
                            procs[s].join()
                            events.append({"event": "stopped_late", "replica": s,
                                           "attempt": attempts[s],
                                           "time_s": time.perf_counter() - t0})
                            procs.pop(s)
                    continue
            for r, p in list(procs.items()):
                if p.is_alive() or p.exitcode == 0 or p.exitcode is None:
                    continue
                events.append({"event": "died", "replica": r, "attempt": attempts[r],
                               "exit_code": p.exitcode, "time_s": time.perf_counter() - t0,
                               "unix_time": time.time()})
                others = [q for s, q in procs.items() if s != r and q.is_alive()]
                if not others or attempts[r] >= max(1, d.max_restarts):
                    log.warning("replica group %d died (exit code %s); not restarted",
                                r, p.exitcode)
                    procs.pop(r)
                    continue
                log.warning("replica group %d died (exit code %s); restarting it in %.1f s "
                            "while the others train on", r, p.exitcode, cfg.sim.fail_restart_s)
                time.sleep(cfg.sim.fail_restart_s)
                attempts[r] += 1
                start(r)
            time.sleep(0.1)
    finally:
        # Interrupted or failed: the groups still alive stop in order (their workers with
        # them) within a few seconds, else they are killed (their workers die with them).
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        if lighthouse is not None:
            lighthouse.shutdown()
    summary = _summarise(run_dir, replicas, events, time.perf_counter() - t0)
    if not summary["finished_replicas"]:
        codes = [e["exit_code"] for e in events if e["event"] == "died"]
        raise LaunchError("every replica group failed (each one's reason is above; the "
                          f"tracebacks are in {run_dir}/replica*/logs/); nothing finished",
                          2 if codes and all(c == 2 for c in codes) else 1)
    return summary


def _summarise(run_dir: Path, replicas: int, events: list[dict[str, Any]],
               wall_s: float) -> dict[str, Any]:
    """The run's summary from every replica group's own ``summary.json``."""
    groups = {}
    for r in range(replicas):
        path = run_dir / f"replica{r}" / "summary.json"
        if path.exists():
            groups[r] = json.loads(path.read_text())
    finished = [g for g in groups.values()]
    summary = {
        "fault_tolerance": "torchft",
        "replicas": replicas,
        "finished_replicas": len(finished),
        "wall_time_s": wall_s,
        "tokens_processed": sum(g.get("tokens_processed", 0) for g in finished),
        "final_val_loss": finished[0]["final_val_loss"] if finished else float("nan"),
        "steps": max((g["steps"] for g in finished), default=0),
        "events": events,
        "per_replica": groups,
    }
    from editrain.metrics import to_json  # strict JSON: a NaN loss is written null

    (run_dir / "summary.json").write_text(to_json(summary, indent=1))
    return summary
