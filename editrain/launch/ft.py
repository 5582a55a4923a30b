"""The worker stage of ``editrain train --ft``: a lighthouse, one process tree per group.

A torchft lighthouse runs here; a group that dies is started again while the others train
on; the run's summary is gathered from every group's own.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

from editrain import rundir
from editrain.config import Config
from editrain.launch.elastic import run_elastic, start_worker_server
from editrain.launch.job import Job
from editrain.paths import shown
from editrain.rundir import logs_dir
from editrain.safe_io import write_atomic
from editrain.spawn import (
    LOOPBACK,
    USER_ERRORS,
    Interrupted,
    LaunchError,
    children_start_with_sigint_blocked,
    free_port,
    one_line,
)

log = logging.getLogger("editrain")


def run_group(cfg: Config, data_entry: str | None = None) -> dict:
    """One replica group of a fault-tolerant run (``cfg.run_dir`` prepared): a torch
    elastic job of ``pp_size x shard_size x tp_size`` workers, never restarted by torch (the
    launcher restarts the whole group, which then heals from its peers). ``data_entry``:
    the token cache entry the launcher prepared."""
    results = run_elastic(cfg, cfg.dist.replica_size, 0, data_entry)
    return results.get(0, {}) if isinstance(results, dict) else {}


def _group_main(cfg: Config, replica: int, attempt: int, lighthouse: str,
                data_entry: str | None = None) -> None:
    """One replica group: a torch elastic job of ``pp_size x shard_size x tp_size`` local
    workers, or with one worker that worker itself, in this process (one interpreter
    start-up less: a restarted replica is back sooner).

    The group dies with the launcher (also one killed with SIGKILL; its workers die with it
    in turn); Ctrl-C or SIGTERM stop it in order and quietly (the launcher reports the
    interrupt; exit code 128 + the signal's number). A failure is said in one line on
    stderr and the process exits with 2 for an error editrain reports, 1 otherwise; the
    tracebacks are in ``RUN_DIR/replica{replica}/logs/`` (see
    :func:`editrain.rundir.logs_dir`).

    Args:
        cfg: the run's configuration (``run_dir`` prepared).
        replica: this group's replica id.
        attempt: how many times this group was started before.
        lighthouse: the torchft lighthouse's address.
        data_entry: the token cache entry the launcher prepared.
    """
    from editrain.fault import ATTEMPT_ENV
    from editrain.spawn import die_with_parent, interrupts_raise
    from editrain.sync.ft import LIGHTHOUSE_ENV, REPLICA_ENV
    from editrain.train import run_worker

    die_with_parent()
    # Warnings as bare lines, whatever this process inherited.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    os.environ[REPLICA_ENV] = str(replica)
    os.environ[ATTEMPT_ENV] = str(attempt)
    os.environ[LIGHTHOUSE_ENV] = lighthouse
    try:
        interrupts_raise()  # inside the try: a Ctrl-C held back while starting comes now
        if cfg.dist.replica_size > 1:
            run_group(cfg, data_entry)
            return
        os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        run_worker(cfg, cfg.run_dir, data_entry)
        return
    except Interrupted as e:
        sys.exit(e.exit_code)
    except LaunchError as e:
        line, code = str(e), e.exit_code
    except Exception as e:  # the group's one worker ran here; run_worker logged the traceback
        name = type(e).__name__
        what = str(e) if name in USER_ERRORS else f"{name}: {e}"
        line = (f"rank 0: {one_line(what)} (traceback: "
                f"{shown(logs_dir(cfg, cfg.run_dir) / 'rank0.log')})")
        code = 2 if name in USER_ERRORS else 1
    print(f"editrain: replica group {replica} failed: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


def every_group_failed(run_dir: Path, codes: list[int]) -> LaunchError:
    """The launcher's refusal when no replica group finished: exit code 2 where every
    group died of an error editrain reported, 1 otherwise. The run directory is quoted
    (:func:`editrain.paths.shown`), the pattern of the groups' log directories after it is
    not: in quotes, ``replica*`` would read as a directory of that name, and a shell would
    not expand it."""
    return LaunchError("every replica group failed (each one's reason is above; the "
                       f"tracebacks are in {shown(run_dir)}/replica*/logs/); nothing "
                       "finished", 2 if codes and all(c == 2 for c in codes) else 1)


def run_ft(job: Job, data_entry: str | None = None) -> dict[str, Any]:
    """``editrain train --ft``: a lighthouse here, one process tree per replica group, a
    group that dies started again (after ``sim.fail_restart_s``) as long as the others
    still train. Returns the run's summary (also written to ``summary.json``). With
    ``checkpoint.export_final``, the global model of the groups' latest checkpoint is then
    exported into ``RUN_DIR/export``.

    A group says why it failed in one line (see :func:`_group_main`). On Ctrl-C or SIGTERM
    here (``KeyboardInterrupt`` / :class:`editrain.spawn.Interrupted`), or any error, the
    groups still running are stopped on the way out: SIGTERM, SIGKILL after 10 s (a
    group's workers die with their group).

    Args:
        job: the checked job (its run directory claimed).
        data_entry: the token cache entry prepared for the run, handed to every group.

    Raises:
        LaunchError: every replica group failed.
    """
    from editrain.sync.ft import start_lighthouse

    d = job.cfg.dist
    lighthouse = None
    address = d.ft_lighthouse
    if not address:
        lighthouse = start_lighthouse(d.ft_min_replicas, d.ft_join_timeout_s,
                                      d.ft_heartbeat_timeout_s,
                                      tick_s=d.ft_heartbeat_interval_s)
        address = lighthouse.address()
    groups = ReplicaGroups(job, address, data_entry)
    try:
        groups.start_all()
        while groups.any_alive():
            if groups.stop_late():
                continue
            groups.restart_dead()
            time.sleep(0.1)
    finally:
        groups.stop_all()
        if lighthouse is not None:
            lighthouse.shutdown()
    summary = summarise_groups(job.run_dir, job.groups, groups.events,
                               time.perf_counter() - groups.t0)
    if not summary["finished_replicas"]:
        codes = [e["exit_code"] for e in groups.events if e["event"] == "died"]
        raise every_group_failed(job.run_dir, codes)
    if job.cfg.checkpoint.export_final:  # the global model, which every group holds
        from editrain.hf_checkpoint import export_checkpoint

        done = export_checkpoint(job.run_dir, job.run_dir / "export")
        log.warning("exported %s (%s) to %s", done.checkpoint, done.source, done.out)
    return summary


class ReplicaGroups:
    """The replica groups of a fault-tolerant run, one process each, and what befell them
    (``events``: start, died, stopped_late; times from the launch).

    Args:
        job: the checked job (its run directory claimed).
        lighthouse: the torchft lighthouse's address.
        data_entry: the token cache entry prepared for the run.
    """

    def __init__(self, job: Job, lighthouse: str, data_entry: str | None) -> None:
        d = job.cfg.dist
        self.job, self.lighthouse, self.data_entry = job, lighthouse, data_entry
        # Every group knows how many there are, and that it is one of them; the final
        # export is the launcher's, once, when they are done (see run_ft).
        self.cfg = dataclasses.replace(
            job.cfg, dist=dataclasses.replace(d, ft_replicas=job.groups,
                                              fault_tolerance="torchft"),
            checkpoint=dataclasses.replace(job.cfg.checkpoint, export_final=False))
        # The groups start as the workers of a local job do: forked from the server that
        # has imported torch (a restarted group is back sooner), or spawned as
        # EDITRAIN_START_METHOD says; never forked from this process, which runs the
        # lighthouse.
        self.ctx = mp.get_context(start_worker_server())
        self.procs: dict[int, Any] = {}
        self.attempts = dict.fromkeys(range(job.groups), 0)
        self.events: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.finished_at: float | None = None

    def start(self, r: int) -> None:
        """Start group ``r`` (again, if it ran before)."""
        self.procs[r] = self.ctx.Process(
            target=_group_main, args=(self.cfg, r, self.attempts[r], self.lighthouse,
                                      self.data_entry), name=f"editrain-replica{r}")
        with children_start_with_sigint_blocked():  # no traceback on a Ctrl-C while it boots
            self.procs[r].start()
        self.events.append({"event": "start", "replica": r, "attempt": self.attempts[r],
                            "time_s": time.perf_counter() - self.t0,
                            "unix_time": time.time()})

    def start_all(self) -> None:
        """Start every group."""
        for r in range(self.job.groups):
            self.start(r)

    def any_alive(self) -> bool:
        """Whether a group still runs."""
        return any(p.is_alive() for p in self.procs.values())

    def stop_late(self) -> bool:
        """A restarted group that has not rejoined when every other group is done never
        will (there is nobody left to heal from): stopped after a grace period. Returns
        whether the run is in that state (every group done or late)."""
        procs, attempts = self.procs, self.attempts
        done = [s for s, p in procs.items() if not p.is_alive() and p.exitcode == 0]
        late = [s for s, p in procs.items() if p.is_alive() and attempts[s] > 0]
        if not (done and len(done) + len(late) == len(procs) and late):
            return False
        self.finished_at = self.finished_at or time.perf_counter()
        if time.perf_counter() - self.finished_at > self.cfg.dist.ft_heartbeat_timeout_s + 5:
            for s in late:
                if not (self.job.group_dir(s) / "summary.json").exists():
                    log.warning("replica group %d restarted too late: the others finished "
                                "before it could rejoin; stopping it", s)
                    procs[s].kill()
                    procs[s].join()
                    self.events.append({"event": "stopped_late", "replica": s,
                                        "attempt": attempts[s],
                                        "time_s": time.perf_counter() - self.t0})
                    procs.pop(s)
        return True

    def restart_dead(self) -> None:
        """Every group that died is started again (after ``sim.fail_restart_s``) while
        another still trains and it has restarts left (``dist.max_restarts``, at least
        one); else it is given up."""
        procs = self.procs
        for r, p in list(procs.items()):
            if p.is_alive() or p.exitcode == 0 or p.exitcode is None:
                continue
            self.events.append({"event": "died", "replica": r, "attempt": self.attempts[r],
                                "exit_code": p.exitcode,
                                "time_s": time.perf_counter() - self.t0,
                                "unix_time": time.time()})
            others = [q for s, q in procs.items() if s != r and q.is_alive()]
            if not others or self.attempts[r] >= max(1, self.cfg.dist.max_restarts):
                log.warning("replica group %d died (exit code %s); not restarted",
                            r, p.exitcode)
                procs.pop(r)
                continue
            log.warning("replica group %d died (exit code %s); restarting it in %.1f s "
                        "while the others train on", r, p.exitcode,
                        self.cfg.sim.fail_restart_s)
            time.sleep(self.cfg.sim.fail_restart_s)
            self.attempts[r] += 1
            self.start(r)

    def stop_all(self) -> None:
        """Interrupted, failed or done: the groups still alive stop in order (their
        workers with them) within a few seconds, else they are killed (their workers die
        with them)."""
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()


def summarise_groups(run_dir: Path, replicas: int, events: list[dict[str, Any]],
                     wall_s: float | None = None) -> dict[str, Any]:
    """The run's summary from every replica group's own ``summary.json`` (also written to
    ``RUN_DIR/summary.json``).

    Args:
        run_dir: the run directory.
        replicas: the run's replica groups.
        events: what the launcher saw of the groups (start, died, stopped_late).
        wall_s: the run's wall time; None (the groups are torchrun jobs, nobody timed the
            run): the longest group's.
    """
    from editrain.metrics import GROUP_SUMMARY_SCHEMA, read_summary

    groups = {}
    for r in range(replicas):
        path = run_dir / f"replica{r}" / "summary.json"
        if os.path.lexists(path):
            # a group's counts read as numbers, its steps and loss there (they were summed
            # and indexed unchecked: a string there was a TypeError, a missing one a KeyError)
            groups[r] = read_summary(path.parent, error=rundir.RunDirError,
                                     schema=GROUP_SUMMARY_SCHEMA)
    finished = [g for g in groups.values()]
    if wall_s is None:
        wall_s = max((g.get("wall_time_s", 0.0) for g in finished), default=0.0)
    summary = {
        "fault_tolerance": "torchft",
        "replicas": replicas,
        "finished_replicas": len(finished),
        "wall_time_s": wall_s,
        "tokens_processed": sum(g.get("tokens_processed", 0) for g in finished),
        "final_val_loss": finished[0]["final_val_loss"] if finished else float("nan"),
        "steps": max((g["steps"] for g in finished), default=0),
        # the tokenizer's vocabulary, the model's (data.vocab_size is what was asked for)
        "vocab_size": finished[0].get("vocab_size") if finished else None,
        "events": events,
        "per_replica": groups,
    }
    from editrain.metrics import to_json  # strict JSON: a NaN loss is written null

    write_atomic(run_dir / "summary.json", to_json(summary, indent=1), root=run_dir)
    return summary
