"""Workers of the fault-tolerance tests: replica groups as separate process trees meeting
through a torchft lighthouse (``dist.fault_tolerance = "torchft"`` at the engine level)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch

from tests.reference import batch, loss_on, make_inner, make_model


def rejoined(rounds: list[dict[str, Any]], dead: int) -> bool:
    """Whether replica ``dead`` is back: a committed round with it after a round without it
    that came after it had joined. The join's attempts before every group was there (a
    quorum of the groups started first, not committed) say nothing about a death: counted,
    a survivor took the join itself for the rejoin and ended at its last step, however
    long the restart still took."""
    joined = gone = False
    for e in rounds:
        present = dead in (e["members"] or [])
        if present and e["committed"]:
            if gone:
                return True
            joined = True
        elif joined and not present:
            gone = True
    return False


def ft_rank(rank: int, S: int, case: dict[str, Any], replica: int, R: int, lighthouse: str,
            attempt: int) -> dict[str, Any]:
    """One rank of replica group ``replica``: train ``case["steps"]`` steps with the engine
    in the fault-tolerant mode; ``case["die"] = (replica, step)`` kills that group's first
    attempt right after that step. Returns the final parameters and, for every round, the
    sync log entry and the parameters right after it."""
    from torch.distributed.fsdp import fully_shard

    from editrain.sync import StepScheduleTrigger, SyncConfig, SyncEngine
    from editrain.sync.ft import TorchftGroup
    from editrain.topology import init_mesh

    info = init_mesh(shard_size=S)
    group = TorchftGroup(replica, R, rank, S, lighthouse=lighthouse,
                         min_replicas=case.get("min_replicas", 1), timeout_s=20,
                         quorum_timeout_s=120)
    model = make_model()
    if S > 1:
        for block in model.layers:
            fully_shard(block, mesh=info.shard_mesh)
        fully_shard(model, mesh=info.shard_mesh)
    opt = make_inner(model.parameters(), case.get("inner", "adamw"))
    schedule = case.get("schedule")  # A-EDiT: steps per window of each replica
    total = case["steps"] * (schedule[replica] if schedule else 1)
    messages = []
    in_sync = case.get("die_in_sync")  # (replica, sync index, cross-replica message number)

    def link(nbytes: int) -> float:
        """Called before every cross-replica message: kills the group inside a sync."""
        if in_sync and attempt == 0 and replica == in_sync[0] \
                and engine.counters.next_index == in_sync[1]:
            messages.append(nbytes)
            if len(messages) == in_sync[2]:
                os._exit(17)
        return 0.0

    engine = SyncEngine(model, info.mesh, SyncConfig(**case["sync"]), blocks=model.layers,
                        cross_replica=group, link_delay=link,
                        trigger=StepScheduleTrigger(schedule) if schedule else None)
    rounds: list[dict[str, Any]] = []

    def full() -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters()}

    sent = [engine.comm.ledger.totals()]  # the ledger at the last record

    def record() -> None:
        """The rounds logged since the last call; the first carries the bytes the ledger
        counted since the previous round was recorded, by cause (``ledger``)."""
        entries = engine.pop_sync_log()
        if not entries:
            return
        now = engine.comm.ledger.totals()
        ledger = {cause: now[cause] - sent[0][cause] for cause in now}
        sent[0] = now
        for entry in entries:
            rounds.append({**entry, "global_step": engine.global_step, "params": full(),
                           "ledger": ledger})
            ledger = dict.fromkeys(ledger, 0)

    # case["resume_commits"] = (replica, directory): that group's first attempt saves what
    # the trainer's checkpoint at a sync holds after each of its commits; its restart
    # resumes the last one, as a group that torchrun restarts does.
    resumes = case.get("resume_commits")
    saved = Path(resumes[1]) / f"replica{replica}_commit.pt" if resumes else None
    if saved is not None and replica == resumes[0] and attempt:
        state = torch.load(saved, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        engine.load_state_dict(state["engine"])
        group.resume_behind(state["committed"])

    def save_commit() -> None:
        if saved is None or replica != resumes[0] or attempt:
            return
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "engine": engine.state_dict(), "committed": group.committed_syncs},
                   saved.with_suffix(".tmp"))
        saved.with_suffix(".tmp").replace(saved)

    engine.join(start_quorum=2 if attempt else None)
    record()
    steps_seen = [engine.global_step]
    die = case.get("die")
    pace = float(case.get("step_sleep", 0.0))
    # A survivor of a death trains on past ``total`` until the restarted group has joined
    # (bounded): on a loaded machine its restart can take longer than the survivors' last
    # steps, and it then has nobody left to heal from (the CLI's launcher stops such a
    # group; these tests are about the rejoin, so they wait for it).
    dead = (die or in_sync or (None,))[0]
    # (A lighthouse that needs every replica holds them at the sync until it is back.)
    awaiting = (attempt == 0 and dead is not None and replica != dead
                and case.get("min_replicas", 1) < R)

    while engine.global_step < total or (awaiting and not rejoined(rounds, dead)
                                         and engine.global_step < total + 2000):
        step = engine.global_step
        loss_on(model, batch(replica * S + rank, step, 0)).backward()
        opt.step()
        opt.zero_grad()
        engine.step()
        synced = len(rounds)
        record()
        if len(rounds) > synced and rounds[-1]["committed"]:
            save_commit()
        steps_seen.append(engine.global_step)
        if die is not None and attempt == 0 and replica == die[0] and engine.global_step == die[1]:
            os._exit(17)  # the whole group dies (S = 1), mid local phase
        if pace:
            time.sleep(pace)
    engine.finish(force=True)
    record()
    out = {"params": full(), "rounds": rounds, "replica": replica, "steps_seen": steps_seen,
           "heals": engine.heals, "failed_rounds": engine.failed_rounds,
           "num_syncs": engine.num_syncs}
    engine.close()
    group.shutdown()
    return out


def _group_main(S: int, case: dict[str, Any], replica: int, R: int, lighthouse: str,
                attempt: int, out_dir: str) -> None:
    from editrain.spawn import run_ranks

    # The ranks fork from this group process (it has imported torch and run no operation
    # yet), a restart's too: run_groups holds a restart back past the heartbeat timeout.
    outs = run_ranks(ft_rank, S, case, replica, R, lighthouse, attempt, start_method="fork")
    torch.save(outs, Path(out_dir) / f"replica{replica}_attempt{attempt}.pt")


RESTART_AFTER_HEARTBEATS = 2.0
"""A dead group is started again this many lighthouse heartbeat timeouts after its death."""


def run_groups(R: int, S: int, case: dict[str, Any], out_dir: Path,
               restart_delay_s: float | None = None, timeout_s: float = 240.0
               ) -> dict[int, list]:
    """Run ``R`` replica groups of ``S`` ranks, each its own process tree, around one
    lighthouse in this process; a group that dies is started again (attempt 1) after
    ``restart_delay_s`` (default: :data:`RESTART_AFTER_HEARTBEATS` heartbeat timeouts).
    Returns ``{replica: per-rank results of its last attempt}``."""
    from editrain.spawn import START_METHOD_ENV
    from editrain.sync.ft import start_lighthouse

    heartbeat_timeout_s = case.get("heartbeat_timeout_s", 2.0)
    lighthouse = start_lighthouse(min_replicas=case.get("min_replicas", 1),
                                  join_timeout_s=case.get("join_timeout_s", 60.0),
                                  heartbeat_timeout_s=heartbeat_timeout_s)
    # Groups start from the suite's fork server (never "fork" here: this process runs the
    # lighthouse's threads). A restart is held back past the lighthouse's heartbeat timeout,
    # as a real restart takes seconds: the lighthouse has seen the group die, and the
    # survivors have synced without it, before it is back (one back within the timeout is
    # not what these tests are about). It was spawned, which took as long by importing
    # torch twice: a few CPU seconds and a restart time that depended on the load.
    if restart_delay_s is None:
        restart_delay_s = RESTART_AFTER_HEARTBEATS * heartbeat_timeout_s
    ctx = mp.get_context(os.environ.get(START_METHOD_ENV) or "spawn")
    procs: dict[int, Any] = {}
    attempts = dict.fromkeys(range(R), 0)
    try:
        for r in range(R):
            procs[r] = ctx.Process(target=_group_main, args=(S, case, r, R, lighthouse.address(),
                                                             0, str(out_dir)))
            procs[r].start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs.values()) and time.monotonic() < deadline:
            for r, p in procs.items():
                if not p.is_alive() and p.exitcode != 0 and attempts[r] == 0:
                    time.sleep(restart_delay_s)
                    attempts[r] = 1
                    procs[r] = ctx.Process(target=_group_main, args=(
                        S, case, r, R, lighthouse.address(), 1, str(out_dir)))
                    procs[r].start()
                    break
            time.sleep(0.05)
        for p in procs.values():
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"replica groups still running after {timeout_s} s")
        failed = {r: p.exitcode for r, p in procs.items() if p.exitcode != 0}
        if failed:
            raise RuntimeError(f"replica groups failed (exit codes {failed})")
    finally:
        lighthouse.shutdown()
    return {r: torch.load(out_dir / f"replica{r}_attempt{attempts[r]}.pt", weights_only=False)
            for r in range(R)}
