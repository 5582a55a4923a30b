"""Engine acceptance: the distributed EDiT engine against the single-process reference.

Every topology is spawned once (a module-scoped fixture) and runs all of its cases in that
one process group; each test then checks the results it needs. The reference simulator and
the distributed worker live in ``tests/reference.py`` (see docs/algorithm.md sections 3-5).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import max_diff, max_diff_runs, ref_config, reference, topology_runs
from tests.tolerance import PARAM_TOL

# Every test reads the runs of one spawn per topology (about 30 s in all): slow.
pytestmark = pytest.mark.slow

TOL = PARAM_TOL  # parameters against the reference: see its docstring

# EDiT without the penalty and with DiLoCo's outer optimizer (EDiT's own default since #35
# is SGD at lr 1 without momentum; the edit_on cases run it) is DiLoCo, layer-wise.
PEN_OFF = dict(pseudo_gradnorm_reduce=False, skip_anomaly=False, clip_pseudo_grad=0.0,
               outer_optim_kwargs={"lr": 0.7, "momentum": 0.9, "nesterov": True})
# alpha 0.5 lets the detector's mean catch up within two syncs, so it judges real norms
# (with alpha 0.02 and a two-sync warm-up every replica would look like an outlier).
# A low softmax temperature makes the replica weights clearly unequal (T = 1 gives ~0.5 each
# for these norms, which would hide a wrong weighting).
PEN_ON = dict(pseudo_gradnorm_reduce=True, weight_softmax_temperature=0.02, skip_anomaly=True,
              ewma_alpha=0.5, ewma_warmup_steps=2, ewma_threshold=3.0, clip_pseudo_grad=0.05)
LR1 = {"lr": 1.0, "momentum": 0.0}
DELAY = 0.05


def _case(method: str, steps: int, H: int | None = 2, warmup: int = 0, **kw) -> dict:
    sync = dict(method=method, local_sgd_warmup_steps=warmup, **kw.pop("sync", {}))
    if H is not None:
        sync["local_sgd_sync_interval"] = H
    return dict(sync=sync, steps=steps, **kw)


# Each acceptance axis (method, penalty, cpu_offload, warm-up, accumulation) is covered on
# at least one topology; every acceptance case runs >= 3 syncs.
CASES_2X2 = {
    "pls": _case("post_local_sgd", 7, warmup=1),
    "diloco": _case("diloco", 6, accum=2, sync=dict(cpu_offload=True)),
    "diloco_w1": _case("diloco", 7, warmup=1),
    "edit_off": _case("edit", 7, warmup=1, sync=dict(PEN_OFF, prefetch_depth=1)),
    "edit_off_p0": _case("edit", 7, warmup=1, sync=dict(PEN_OFF, prefetch_depth=0)),
    "edit_off_p2": _case("edit", 7, warmup=1, sync=dict(PEN_OFF, prefetch_depth=2)),
    "edit_off_eval": _case("edit", 7, warmup=1, eval_forward=True, sync=PEN_OFF),
    # syncs after steps 3 and 6, then finish(force=True) syncs the last 2 local steps
    "edit_force": _case("edit", 8, H=3, finish_force=True, sync=PEN_ON),
    "edit_on": _case("edit", 8, warmup=2, accum=2, sync=dict(PEN_ON, cpu_offload=True)),
    "edit_on_delay": _case("edit", 8, warmup=2, accum=2, link_delay=DELAY,
                           sync=dict(PEN_ON, cpu_offload=True)),
    # equivalences
    "sync_sgd": _case("sync", 4, H=None, inner="sgd"),
    "pls_h1_sgd": _case("post_local_sgd", 4, H=1, inner="sgd"),
    "pls_h2": _case("post_local_sgd", 6),
    "diloco_lr1": _case("diloco", 6, sync=dict(outer_optim_kwargs=LR1)),
    # two warm-up steps, then one local SGD step and no sync (defect 6)
    "local_sgd": _case("edit", 3, H=50, warmup=2, inner="sgd", sync=PEN_OFF),
    # record_loss: each replica's mean loss travels with the rounds (with the statistics,
    # or on its own without them); the same runs as "diloco_w1" and "edit_force"
    "diloco_w1_loss": _case("diloco", 7, warmup=1, record_loss=True),
    "edit_force_loss": _case("edit", 8, H=3, finish_force=True, sync=PEN_ON,
                             record_loss=True),
}
CASES_4X1 = {
    "pls": _case("post_local_sgd", 6, accum=2, sync=dict(cpu_offload=True)),
    "diloco": _case("diloco", 7, warmup=1),
    "edit_on": _case("edit", 7, warmup=1, sync=PEN_ON),
    "edit_off": _case("edit", 9, H=3, accum=2, sync=dict(PEN_OFF, cpu_offload=True)),
    # no FSDP2 at all (a one-process replica is left unsharded): the same arithmetic
    "edit_on_plain": _case("edit", 7, warmup=1, sync=PEN_ON, unsharded=True),
    "diloco_plain_split": _case("diloco", 7, unsharded=True, tied=False, split_root=True),
}
CASES_1X4 = {
    "pls": _case("post_local_sgd", 8, warmup=2),
    "diloco": _case("diloco", 6, sync=dict(cpu_offload=True)),
    "edit_on": _case("edit", 7, warmup=1, accum=2, sync=PEN_ON),
    "edit_off": _case("edit", 6, sync=PEN_OFF),
}
TOPOLOGIES = {(2, 2): CASES_2X2, (4, 1): CASES_4X1, (1, 4): CASES_1X4}


@pytest.fixture(scope="module")
def runs():
    """``runs(R, S)``: results of every case of that topology (one spawn per topology)."""
    return topology_runs(TOPOLOGIES)


def _ref(R: int, S: int, name: str, **overrides):
    return reference(ref_config(TOPOLOGIES[(R, S)][name], R, S, **overrides))


# ------------------------------------------------------------------------ 1. acceptance
@pytest.mark.parametrize("R,S", [(2, 2), (4, 1), (1, 4)])
def test_matches_reference(runs, R, S):
    got = runs(R, S)
    for name, case in TOPOLOGIES[(R, S)].items():
        outs = got[name]
        sk = case["sync"]
        if sk["method"] == "sync" or name == "local_sgd":
            continue
        assert outs[0]["num_syncs"] >= 3, name
        assert all(o["num_syncs"] == outs[0]["num_syncs"] for o in outs), name
        for o in outs:
            for p in o["params"].values():
                assert torch.isfinite(p).all(), name
        diff = max_diff(outs, _ref(R, S, name))
        assert diff < TOL, f"{R}x{S} {name}: max |dist - ref| = {diff:.3g}"


def test_replicas_identical_after_final_sync(runs):
    got = runs(2, 2)
    for name in ("pls", "diloco", "edit_off", "edit_on"):
        outs = got[name]
        assert max_diff_runs(outs[:2], outs[2:]) == 0.0, name


def test_sync_method_matches_reference(runs):
    diff = max_diff(runs(2, 2)["sync_sgd"], _ref(2, 2, "sync_sgd"))
    assert diff < TOL, diff


# ------------------------------------------------------------------------ 2. equivalences
def test_post_local_sgd_h1_equals_sync(runs):
    got = runs(2, 2)
    assert got["pls_h1_sgd"][0]["num_syncs"] == 4
    assert got["sync_sgd"][0]["num_syncs"] == 0
    # Averaging the models after each SGD step equals stepping on the averaged gradient
    # up to a few float32 roundings per step of order-1 parameters (1e-6: 8 ulps at 1).
    assert max_diff_runs(got["pls_h1_sgd"], got["sync_sgd"]) < 1e-6


def test_diloco_lr1_equals_post_local_sgd(runs):
    got = runs(2, 2)
    assert got["diloco_lr1"][0]["num_syncs"] == got["pls_h2"][0]["num_syncs"] == 3
    assert max_diff_runs(got["diloco_lr1"], got["pls_h2"]) == 0.0  # bitwise
    # ... and the default DiLoCo outer step (Nesterov, lr 0.7) really is different.
    assert max_diff_runs(got["diloco"], got["pls_h2"]) > 1e-4


@pytest.mark.parametrize("name", ["edit_off_p0", "edit_off", "edit_off_p2"])
def test_edit_without_penalty_equals_diloco(runs, name):
    got = runs(2, 2)
    assert got[name][0]["num_syncs"] == got["diloco_w1"][0]["num_syncs"] == 3
    assert max_diff_runs(got[name], got["diloco_w1"]) == 0.0  # bitwise


# ------------------------------------------------------------------------ 3. local phase
@pytest.mark.parametrize("R,S", [(2, 2), (4, 1)])
def test_no_cross_replica_traffic_between_syncs(runs, R, S):
    got = runs(R, S)
    for name, case in TOPOLOGIES[(R, S)].items():
        for o in got[name]:
            if case["sync"].get("local_sgd_sync_interval", 1) > 1:
                assert o["between"], name  # the local phase was observed
            assert o["between"] == [0] * len(o["between"]), name
            warmup = case["sync"]["local_sgd_warmup_steps"]
            if case["sync"]["method"] == "sync":
                warmup = case["steps"]
            # warm-up is HSDP: one gradient all-reduce per unit and step over the sync group;
            # the last warm-up step also gathers the checksums of the replicas' parameters
            # (they must start the local phase from one model)
            expected = [len(o["unit_numels"])] * warmup
            if warmup and case["sync"]["method"] != "sync":
                expected[-1] += 1
            assert o["warm"] == expected, name


def test_one_replica_has_no_sync_group_traffic(runs):
    for name, outs in runs(1, 4).items():
        for o in outs:
            assert o["between"] == [0] * len(o["between"]), name
            assert not any(o["warm"]), name
            assert all(e["sync_collectives"] == 0 for e in o["log"]), name


# ------------------------------------------------------------------------ 4. anchors
def test_anchors_created_at_end_of_warmup(runs):
    outs = runs(2, 2)["edit_on"]  # warm-up 2
    for o in outs:
        # probes: before step 1, then after every step
        assert o["anchor_none"][:3] == [True, True, False]
        assert not any(o["anchor_none"][3:])
        assert o["anchor_diff"][2] == 0.0  # A = theta right after the last warm-up step
        assert o["anchor_diff"][3] > 0.0  # the first local step moves theta away from A
    for o in runs(2, 2)["diloco"]:  # no warm-up: anchors from the start
        assert o["anchor_none"][0] is False and o["anchor_diff"][0] == 0.0


@pytest.mark.parametrize("name", ["edit_off", "edit_on"])
def test_anchors_from_step_zero_would_not_match(runs, name):
    outs = runs(2, 2)[name]
    assert max_diff(outs, _ref(2, 2, name)) < TOL
    # The reference implementation's defect 4: anchors at step 0, so the first outer step
    # replays the warm-up progress. That is measurably another trajectory.
    assert max_diff(outs, _ref(2, 2, name, anchors_at_start=True)) > 1e-3


# ------------------------------------------------------------------------ 5. local grads
def test_local_gradients_are_the_shard_group_mean(runs):
    outs = runs(2, 2)["local_sgd"]
    assert all(o["num_syncs"] == 0 for o in outs)
    # reference: the local gradient is the mean over the replica's S ranks' batches
    after = _ref(2, 2, "local_sgd")
    # no sync: only the S-rank gradient mean rounds differently (8 float32 ulps at 1)
    assert max_diff(outs, after) < 1e-6
    # Defect 6 (divisor kept at S * R after warm-up): the local SGD step R times too small.
    warm = _ref(2, 2, "local_sgd", steps=2)
    assert max_diff(outs, warm) > 1e-4  # the local step did move the parameters
    small = [{n: w[n] + (a[n] - w[n]) / 2 for n in w} for w, a in zip(warm, after)]
    assert max_diff(outs, small) > 100 * max_diff(outs, after)
    # the replicas trained on different data in the local step
    assert max_diff_runs(outs[:2], outs[2:]) > 1e-4


# ------------------------------------------------------------------------ 6. sync metrics
@pytest.mark.parametrize("R,S", [(2, 2), (4, 1)])
def test_sync_log_metrics(runs, R, S):
    for name in ("edit_on", "diloco"):
        for o in runs(R, S)[name]:
            log = o["log"]
            L = len(o["unit_numels"])
            assert len(log) == o["num_syncs"] >= 3
            # Bytes transmitted by a ring: all-reduce 2 (R - 1) / R of the message, all-gather
            # (R - 1) times it (docs/streaming.md section 5).
            largest = 2 * (R - 1) * 4 * max(o["unit_numels"]) // R
            stats = (R - 1) * 8 * L if name == "edit_on" else 0  # float64 norm per unit
            for i, e in enumerate(log):
                assert e["sync"] == i and e["units"] == L
                assert e["bytes_sent"] > 0
                # each unit's fp32 shard once, plus the batched statistics: nothing else
                sent = sum(2 * (R - 1) * 4 * n // R for n in o["unit_numels"])
                assert e["bytes_sent"] == sent + stats, (name, i)
                assert 0 < e["max_message_bytes"] <= largest
                assert e["max_message_bytes"] == largest
                assert e["hidden"] is None or 0.0 <= e["hidden"] <= 1.0
                assert e["work_s"] > 0
                for key in ("wait_s", "comm_time_s", "sync_time_s", "work_s"):
                    assert math.isfinite(e[key]) and e[key] >= 0.0, key
                assert e["link_delay_s"] == 0.0
            if name == "edit_on":
                assert all(len(e["weights"]) == R and len(e["weights"][0]) == L for e in log)


# ------------------------------------------------------------------------ 7. slow link
def test_simulated_link_delay(runs):
    got = runs(2, 2)
    slow, fast = got["edit_on_delay"], got["edit_on"]
    for o in slow:
        assert len(o["log"]) == 3
        for e in o["log"]:
            assert e["sync_collectives"] > 0
            # the simulator sums DELAY per collective in float64: a few roundings
            assert e["link_delay_s"] == pytest.approx(DELAY * e["sync_collectives"], rel=1e-9)
            assert e["comm_time_s"] >= e["link_delay_s"]
            # the delay is real wall time, spent inside the sync
            assert e["sync_time_s"] >= e["link_delay_s"]
    # the math does not depend on the link
    assert max_diff_runs(slow, fast) == 0.0


# ------------------------------------------------------------------------ eval forwards
def test_eval_forward_does_not_trigger_the_sync(runs):
    got = runs(2, 2)
    for o in got["edit_off_eval"]:
        # an eval-mode forward ran while each of the 3 syncs was pending, and left it pending
        assert o["eval_pending"].count(True) == 3
        assert o["num_syncs"] == 3
    assert max_diff_runs(got["edit_off_eval"], got["edit_off"]) == 0.0


# ------------------------------------------------------------------------ forced finish
def test_forced_finish_syncs_a_partial_window(runs):
    outs = runs(2, 2)["edit_force"]
    for o in outs:
        assert o["syncs_before_finish"] == 2
        assert o["num_syncs"] == 3 and o["num_syncs_forced"] == 1
    assert max_diff_runs(outs[:2], outs[2:]) == 0.0
    assert max_diff(outs, _ref(2, 2, "edit_force")) < TOL


# ------------------------------------------------------------------------ replica losses
@pytest.mark.parametrize("name", ["diloco_w1", "edit_force"])
def test_each_replica_loss_travels_with_its_round(runs, name):
    """``record_loss``: every round's log entry gives each replica's mean loss over the steps
    since the previous round (over its shard ranks), and the training is unchanged."""
    got = runs(2, 2)
    plain, outs = got[name], got[name + "_loss"]
    for a, b in zip(plain, outs):  # the same arithmetic, bit for bit
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert [e.get("norms") for e in a["log"]] == [e.get("norms") for e in b["log"]]
        assert "replica_loss" not in str(a["log"])
    warmup = TOPOLOGIES[(2, 2)][name]["sync"]["local_sgd_warmup_steps"]
    for o in outs:
        log = o["log"]
        assert len(log) >= 3
        previous = warmup
        for entry in log:
            want = []
            for r in range(2):
                ranks = [p for p in outs if p["replica"] == r]
                means = [sum(p["losses"][previous:entry["step"]]) /
                         (entry["step"] - previous) for p in ranks]
                want.append(sum(means) / len(means))
            # float64 means of the same float32 losses, summed in another order: a few
            # float64 roundings (1e-16 relative each)
            assert entry["replica_loss"] == pytest.approx(want, rel=1e-12), entry["sync"]
            previous = entry["step"]
        assert log[0]["replica_loss"][0] != log[0]["replica_loss"][1]  # each its own
