"""A-EDiT's time trigger, skipped syncs and end of budget, with an injected clock.

Each rank's clock advances by a fixed amount per inner step (its "speed"), so the tests
need no sleeping and are deterministic: replica 0 takes 1 s per step, replica 1 (a 2x
straggler) 2 s, and the ranks of one replica may even disagree about the time.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import batch, loss_on, make_model

pytestmark = pytest.mark.slow


def _sharded(S: int, T: int = 1):
    """The mesh, the test model sharded per block and root (split over tp first when
    ``T > 1``), and its inner optimizer."""
    from torch.distributed.fsdp import fully_shard

    import editrain
    from editrain.topology import init_mesh

    info = init_mesh(shard_size=S, tp_size=T)
    model = make_model()
    if T > 1:
        editrain.parallelize(model, info)
        return info, model, torch.optim.AdamW(model.parameters(), lr=3e-3)
    for block in model.layers:
        fully_shard(block, mesh=info.shard_mesh)
    fully_shard(model, mesh=info.shard_mesh)
    return info, model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train_step(model, opt, engine, rank: int, step: int) -> None:
    """One inner step on this rank's batch, up to (not including) ``engine.step()``."""
    loss_on(model, batch(rank, step, 0)).backward()
    engine.after_backward()
    opt.step()
    opt.zero_grad()


def _worker(rank: int, world: int, S: int, dts: list[float], sync: dict, steps: int,
            budget: float | None, max_syncs: int | None, T: int,
            schedule: list[int] | None, end_force: bool, settle: bool) -> dict:
    from editrain.sync import SyncConfig, SyncEngine
    from editrain.sync.triggers import StepScheduleTrigger

    info, model, opt = _sharded(S, T)
    now = [0.0]
    engine = SyncEngine(model, info.mesh, SyncConfig(method="aedit", **sync),
                        blocks=model.layers, clock=lambda: now[0],
                        trigger=None if schedule is None else StepScheduleTrigger(schedule))
    engine.set_budget(budget)
    stopped_at = None
    points, positions = [], []
    for step in range(steps):
        if max_syncs is not None and engine.num_syncs >= max_syncs:
            break  # replicas do different numbers of steps: stop after a sync, together
        positions.append(engine.progress_steps)  # where the trainer reads its lr
        _train_step(model, opt, engine, info.topo.data_rank(rank), step)
        now[0] += dts[rank]
        if settle:
            for rnd in engine.inflight:
                rnd.wait()  # done before the boundary: merged at the first one it may be
        engine.step()
        point = engine.sync_point()
        engine.finish()  # an armed sync runs now (the arithmetic of the next forward)
        if point is not None:
            points.append(round(point, 6))
        if budget is not None and point is not None and point >= budget:
            stopped_at = (engine.global_step, engine.num_syncs, engine.budget_spent)
            break
    engine.finish(force=end_force)
    positions.append(engine.progress_steps)
    out = {"log": engine.pop_sync_log(), "num_syncs": engine.num_syncs,
           "skipped": engine.num_skipped_syncs, "stopped_at": stopped_at,
           "forced": engine.num_syncs_forced,
           "replica": info.replica, "points": points, "positions": positions,
           "steps": engine.global_step,
           "synced": engine.synced_replica_steps, "window_s": engine.last_window_s}
    engine.close()
    return out


def _run(world: int, S: int, dts: list[float], sync: dict, steps: int,
         budget: float | None = None, max_syncs: int | None = None, T: int = 1,
         schedule: list[int] | None = None, end_force: bool = False,
         settle: bool = False) -> list[dict]:
    """Every rank's outcome; ``schedule``: a forced step schedule instead of the time
    trigger; ``end_force``: end with ``finish(force=True)``, as the trainer does;
    ``settle``: non-blocking, wait for the round in flight before each step boundary, so
    that a round merged when done is merged ``overlap_steps`` after its launch exactly,
    whatever the machine's load (a communication as fast as the tests' clock)."""
    from editrain.spawn import run_ranks

    return run_ranks(_worker, world, S, dts, sync, steps, budget, max_syncs, T, schedule,
                     end_force, settle)


PEN_OFF = dict(pseudo_gradnorm_reduce=False, skip_anomaly=False, clip_pseudo_grad=0.0)


def test_time_trigger_gathers_each_replicas_steps():
    # T = 4 s: replica 0 (1 s/step) is due after 4 steps, replica 1 (2 s/step) after 2.
    outs = _run(2, 1, [1.0, 2.0], dict(local_sgd_sync_time=4.0, **PEN_OFF), steps=20,
                max_syncs=2)
    r0 = next(o for o in outs if o["replica"] == 0)
    r1 = next(o for o in outs if o["replica"] == 1)
    assert r0["num_syncs"] == r1["num_syncs"] == 2
    for o in outs:
        assert [e["replica_steps"] for e in o["log"]] == [[4.0, 2.0], [4.0, 2.0]]
    # the window is the longer of the replicas' agreed elapsed times: identical everywhere
    assert r0["window_s"] == r1["window_s"] == 4.0
    assert r0["synced"] == r1["synced"] == 12.0


def test_too_few_steps_skip_the_sync_and_restart_the_clocks():
    outs = _run(2, 1, [1.0, 1.0], dict(local_sgd_sync_time=2.0, min_total_global_steps=100,
                                       **PEN_OFF), steps=6)
    for o in outs:
        # due after steps 2, 4 and 6 (clocks restart after each skip): all skipped
        assert o["num_syncs"] == 0 and o["skipped"] == 3


@pytest.mark.parametrize("sync", [{}, dict(overlap_steps=1)],
                         ids=["blocking", "nonblocking"])
def test_the_round_that_reaches_the_budget_is_never_skipped(sync):
    """A budget of 6 synchronous steps on 2 replicas (12 replica-steps) with a minimum of
    100 steps per round: the rounds before the budget's end are skipped, the one that
    reaches it runs, and the run ends there. Before, it was skipped too and the replicas
    trained on until 100 steps had gathered (50 each, 8 times the budget; here the loop
    gives up after 40)."""
    outs = _run(2, 1, [1.0, 1.0], dict(local_sgd_sync_time=2.0, min_total_global_steps=100,
                                       **sync, **PEN_OFF), steps=40, budget=6)
    for o in outs:
        assert o["stopped_at"] is not None, o["skipped"]
        step, syncs, spent = o["stopped_at"]
        assert spent and syncs == 1 and o["skipped"] >= 1
        assert o["synced"] < 100  # the minimum was never reached: the budget's round ran
        if not sync:  # blocking: the rendezvous of step 6 (due every 2 s = 2 steps)
            assert step == 6 and o["synced"] == 12.0, o["stopped_at"]
        # (non-blocking: the first launch whose carried steps reach 12; where it falls
        # depends on when the rounds before it were done, as merges wait for that)


@pytest.mark.parametrize("S,T", [(2, 1), (1, 2)])
def test_budget_end_is_agreed_by_every_rank(S, T):
    """2 replicas x 2 ranks (2 shards, or 2 tp ranks) whose ranks' clocks disagree: on its
    own clock rank 1 would be due after 2 steps, rank 0 after 3; replica 1 is a straggler
    whose ranks disagree too. The ranks of a replica agree on the elapsed time, and the
    budget's end is decided from gathered counts, so every rank stops at the same sync,
    with no hang (without the agreement over the tp ranks this fails)."""
    dts = [1.0, 1.6, 3.0, 3.9]
    outs = _run(4, S, dts, dict(local_sgd_sync_time=3.0, **PEN_OFF), steps=60, budget=12,
                T=T)
    assert all(o["stopped_at"] is not None for o in outs)
    stops = {o["stopped_at"][1:] for o in outs}  # (sync, budget spent): one for everyone
    assert len(stops) == 1, stops
    (syncs, spent), = stops
    assert spent and syncs >= 2
    # the ranks of a replica stop at the same step; the straggler at fewer steps
    steps = {o["replica"]: {x["stopped_at"][0] for x in outs if x["replica"] == o["replica"]}
             for o in outs}
    assert all(len(v) == 1 for v in steps.values()) and max(steps[1]) < max(steps[0]), steps
    for o in outs[1:]:
        assert o["synced"] == outs[0]["synced"] and o["points"][-1] == outs[0]["points"][-1]
    assert outs[0]["points"][-1] >= 12


NONBLOCKING = dict(overlap_steps=2, merge="keep_local")


def test_nonblocking_skip_carries_the_steps_to_the_next_sync():
    """Non-blocking: a window with too few steps in total is skipped (nothing reduced or
    merged) and its steps count towards the next sync (defect 7).

    Each round is waited for before the step boundaries after its launch (``settle``), so
    every merge falls exactly ``overlap_steps`` after its launch. Without that, where it
    fell was the machine's timing: a replica whose peer was descheduled trained on, and
    under load the 40 steps ran out before the second sync (num_syncs 1)."""
    outs = _run(2, 1, [1.0, 1.0], dict(local_sgd_sync_time=2.0, min_total_global_steps=7,
                                       **NONBLOCKING, **PEN_OFF), steps=40, max_syncs=2,
                settle=True)
    for o in outs:
        # launched at step 2 (2 + 2 < 7 steps: skipped), merged at 4, where the clock
        # restarts: due 2 s later, at step 6, with those 4 steps and the 2 carried, and a
        # window of 6 s; merged at 8; the next window again from the launch at 6 to 10
        assert o["num_syncs"] == 2 and o["skipped"] == 1
        first, second = o["log"]
        assert (first["launch_step"], first["step"], first["replica_steps"]) == (6, 8, [6, 6])
        assert (second["launch_step"], second["step"], second["replica_steps"]) == (
            10, 12, [4, 4])
        assert o["synced"] == 20.0 and o["window_s"] == 4.0


@pytest.mark.parametrize("schedule,budget,stops", [([3, 3], 6, {0: 6, 1: 6}),
                                                   ([2, 3], 10, {0: 8, 1: 12})])
def test_nonblocking_run_ends_at_the_launch_that_reaches_the_budget(schedule, budget, stops):
    """Non-blocking on a forced schedule: the round that reaches the budget is merged at
    its launch, where each replica ends, and the final forced sync finds nothing trained
    since: exactly ``budget`` synchronous steps of tokens (2 x budget replica-steps).
    Before, every replica trained ``overlap_steps`` more steps until that round's merge,
    which the forced sync then synced: ``--steps 6`` trained 7 steps."""
    outs = _run(2, 1, [1.0, 1.0], dict(**NONBLOCKING, **PEN_OFF), steps=40, budget=budget,
                schedule=schedule, end_force=True)
    for o in outs:
        step, syncs, spent = o["stopped_at"]
        assert spent and step == stops[o["replica"]], o["stopped_at"]
        assert o["synced"] == 2 * budget and o["forced"] == 0, (o["synced"], o["forced"])
        last = o["log"][-1]
        assert last["launch_step"] == last["step"] == step  # merged at its launch


@pytest.mark.parametrize("overlap", [1, 2])
@pytest.mark.parametrize("schedule", [[2, 3], [3, 3]])
def test_nonblocking_progress_never_goes_back(schedule, overlap):
    """The progress each rank trains at (its learning rate, its tokens) grows at every
    step and ends at the replica-steps every replica trained. Before, the steps up to a
    round's launch were counted nowhere until its merge: on ``[2, 3]`` replica 0's went
    from 2 (two steps x two replicas, in synchronous steps) back to 0 at its launch, the
    learning rate with it."""
    outs = _run(2, 1, [1.0, 1.0], dict(overlap_steps=overlap, merge="keep_local", **PEN_OFF),
                steps=40, budget=10, schedule=schedule, end_force=True)
    total = sum(o["steps"] for o in outs)
    for o in outs:
        got = o["positions"]
        assert all(b > a for a, b in zip(got, got[1:])), (o["replica"], got)
        assert o["synced"] == total and got[-1] == total / 2, (o["synced"], got, total)


def test_progress_position_holds_an_overshoot():
    """A replica faster than in the last window estimates more than its sync then counts:
    its position (learning rate, tokens) holds there until the count catches up, and a
    checkpoint records the exact count. Pure logic: 2 replicas, a window of [2, 2]."""
    from editrain.sync.progress import Progress

    p = Progress(2)
    p.record_sync([2.0, 2.0], [1.0, 1.0])  # progress 2; replica 0 had half the steps
    assert p.position(0, 4) == 6.0  # 4 more steps, as if the other replica made 4 too
    p.record_sync([4.0, 1.0], [1.0, 1.0])  # it made 1: progress 4.5, ratio 5 / 4
    assert p.estimate(0, 0) == p.synced == 4.5 and p.position(0, 0) == 6.0
    assert p.position(0, 1) == p.position(0, 2) == 6.0  # (5.125, 5.75 estimated)
    assert p.position(0, 3) == 4.5 + 3 * 5 / 8
    restored = Progress(2)
    restored.load_state_dict(p.state_dict())
    assert restored.position(0, 3) == p.position(0, 3)
    restored.rescale((2, 1))  # elastic: the count, not the saving replica's position
    assert restored.position(0, 0) == 4.5


def _gated_worker(rank: int, world: int, dts: list[float], sync: dict, steps: int,
                  gate: str, lead: int) -> dict:
    """Replica 1's launches are held (in its before-sync hook) until replica 0 has trained
    ``lead`` steps past its own launch of the same round: replica 0 can only keep going if
    its sync never waits for replica 1."""
    import json
    import os
    import time

    from editrain.sync import SyncConfig, SyncEngine

    info, model, opt = _sharded(1)
    now = [0.0]
    seen = {"step": 0, "launches": {}}
    gating = [True]

    def publish() -> None:
        tmp = f"{gate}.tmp"
        with open(tmp, "w") as f:
            json.dump(seen, f)
        os.replace(tmp, gate)

    def hold(n: int) -> None:
        if not gating:
            return  # (the final forced sync)
        if rank == 0:
            seen["launches"][str(n)] = engine.global_step
            publish()
            return
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with open(gate) as f:
                    lead_state = json.load(f)
            except (OSError, ValueError):
                lead_state = {"step": 0, "launches": {}}
            launched = lead_state["launches"].get(str(n))
            if launched is not None and lead_state["step"] >= launched + lead:
                return
            time.sleep(0.005)
        raise TimeoutError("replica 0 stopped training: it waited for replica 1")

    engine = SyncEngine(model, info.mesh, SyncConfig(method="aedit", **sync),
                        blocks=model.layers, clock=lambda: now[0], before_sync=hold)
    for step in range(steps):
        if engine.num_syncs >= 2:
            break
        _train_step(model, opt, engine, info.topo.data_rank(rank), step)
        now[0] += dts[rank]
        engine.step()
        if rank == 0:
            seen["step"] = engine.global_step
            publish()
    out = {"log": engine.pop_sync_log(), "replica": info.replica,
           "window_s": engine.last_window_s}
    gating.clear()
    engine.finish(force=True)
    engine.close()
    return out


def test_nonblocking_fast_replica_trains_on_until_the_round_is_done(tmp_path):
    """The fast replica posts its round and trains on; the round completes only when the
    held straggler posts, ``lead`` steps later, and it is merged at the first step boundary
    after that (with the exact-tau merge replica 0 would wait for replica 1 forever). Its
    clock restarts at the merge, and each window's length covers launch to launch."""
    from editrain.spawn import run_ranks

    lead = 6
    outs = run_ranks(_gated_worker, 2, [1.0, 2.0],
                     dict(local_sgd_sync_time=4.0, **NONBLOCKING, **PEN_OFF), 200,
                     str(tmp_path / "gate.json"), lead)
    fast = next(o for o in outs if o["replica"] == 0)
    slow = next(o for o in outs if o["replica"] == 1)
    assert len(fast["log"]) == len(slow["log"]) == 2
    first, second = fast["log"]
    assert first["launch_step"] == 4  # T = 4 s at 1 s per step
    assert first["step"] - first["launch_step"] > lead  # trained on while held
    assert second["launch_step"] == first["step"] + 4  # the clock restarted at the merge
    for e, f in zip(fast["log"], slow["log"]):
        assert e["replica_steps"] == f["replica_steps"]
    assert first["replica_steps"] == [4.0, 2.0]
    counts = second["replica_steps"]
    assert counts[0] == second["launch_step"] - first["launch_step"]
    # windows launch to launch, in each replica's clock: 1 s and 2 s per step
    assert fast["window_s"] == slow["window_s"] == max(counts[0] * 1.0, counts[1] * 2.0)


@pytest.mark.parametrize("S,T", [(2, 1), (1, 2)])
def test_nonblocking_budget_end_is_agreed_by_every_rank(S, T):
    dts = [1.0, 1.6, 3.0, 3.9]
    outs = _run(4, S, dts, dict(local_sgd_sync_time=3.0, **NONBLOCKING, **PEN_OFF), steps=80,
                budget=12, T=T)
    assert all(o["stopped_at"] is not None for o in outs)
    assert len({o["stopped_at"][1:] for o in outs}) == 1
    assert all(o["stopped_at"][2] for o in outs)
    assert len({o["synced"] for o in outs}) == 1 and outs[0]["points"][-1] >= 12
