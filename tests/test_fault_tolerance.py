"""The fault-tolerant mode (torchft): replicas as separate jobs that survive a death."""

from __future__ import annotations

import pytest
import torch

from tests.reference import ref_config, reference

pytest.importorskip("torchft")

from tests.ft_workers import run_groups  # noqa: E402

EDIT = {"method": "edit", "local_sgd_sync_interval": 2, "local_sgd_warmup_steps": 0}


@pytest.mark.timeout(300)
def test_no_failure_equals_the_reference(tmp_path):
    """3 replica groups x 1 rank, edit with the penalty and clipping: the same model as the
    reference simulator (which is what the plain mode matches)."""
    case = {"sync": EDIT, "steps": 6}
    outs = run_groups(3, 1, case, tmp_path)
    ref = reference(ref_config(case, R=3, S=1))
    for r, ranks in outs.items():
        for name, p in ranks[0]["params"].items():
            assert float((p - ref[r][name]).abs().max()) < 1e-5, (r, name)
        committed = [e for e in ranks[0]["rounds"] if e["committed"] and e["units"]]
        assert len(committed) == 3 and all(e["quorum_size"] == 3 for e in committed)


@pytest.mark.timeout(300)
def test_a_replica_dies_the_others_keep_syncing_and_it_rejoins(tmp_path):
    """Replica 2 dies after step 5 (mid local phase) and restarts at once: replicas 0 and 1
    never restart and never go back a step; they sync as a quorum of 2 while it is gone;
    the restarted replica heals from a peer in its first round and holds the survivors'
    global model after it; every replica ends on one model."""
    case = {"sync": EDIT, "steps": 40, "die": (2, 5), "step_sleep": 0.25,
            "heartbeat_timeout_s": 1.5}
    outs = run_groups(3, 1, case, tmp_path)
    survivors = [outs[0][0], outs[1][0]]
    back = outs[2][0]
    for out in survivors:
        steps = out["steps_seen"]
        assert steps[0] == 0 and all(b == a + 1 for a, b in zip(steps, steps[1:])), steps
        assert out["heals"] == 0
        sizes = [e["quorum_size"] for e in out["rounds"] if e["committed"] and e["units"]]
        assert 2 in sizes and sizes[-1] == 3, sizes
        assert any(e["left"] == [2] for e in out["rounds"])
        assert any(e["joined"] == [2] for e in out["rounds"])
    # The restarted replica: healed in its first round, at the survivors' step.
    first = back["rounds"][0]
    assert back["heals"] == 1 and first["healed"] and first["committed"]
    assert back["steps_seen"][0] == first["global_step"] > 5
    same = [e for e in survivors[0]["rounds"] if e["sync"] == first["sync"]]
    assert len(same) == 1 and same[0]["committed"] and same[0]["global_step"] == first["global_step"]
    for name, p in first["params"].items():
        assert torch.equal(p, same[0]["params"][name]), name
    # It contributed nothing there (its pseudo-gradient is zero), the two survivors did.
    assert same[0]["contributors"] == [0, 1] and same[0]["members"] == [0, 1, 2]
    # Final model identical everywhere.
    for out in (survivors[1], back):
        for name, p in out["params"].items():
            assert torch.equal(p, survivors[0]["params"][name]), name


@pytest.mark.timeout(300)
def test_a_replica_dying_inside_a_sync_fails_that_round_on_every_survivor(tmp_path):
    """Replica 2 dies between the collectives of sync 3 (after the rendezvous and the first
    unit): the survivors' round fails and is applied by neither; they sync again without
    it at the next interval and end on one model with the restarted replica."""
    case = {"sync": {**EDIT, "clip_pseudo_grad": 0.0}, "steps": 30, "die_in_sync": (2, 3, 3),
            "step_sleep": 0.25, "heartbeat_timeout_s": 1.5}
    outs = run_groups(3, 1, case, tmp_path)
    survivors = [outs[0][0], outs[1][0]]
    for out in survivors:
        by_sync = {e["sync"]: e for e in out["rounds"]}
        failed = by_sync[3]
        assert not failed["committed"] and "error" in failed and failed["units"] == 3
        assert failed["global_step"] == 6
        # It is retried at the next step boundary (the window is over), without replica 2.
        assert by_sync[4]["committed"] and by_sync[4]["members"] == [0, 1]
        assert by_sync[4]["global_step"] == 7
        steps = out["steps_seen"]
        assert all(b == a + 1 for a, b in zip(steps, steps[1:]))
    # Nothing of the failed round was applied: after it each survivor still holds its own
    # local parameters (a committed round writes the same anchors into both).
    after = [{e["sync"]: e for e in out["rounds"]}[3]["params"] for out in survivors]
    assert not all(torch.equal(p, after[1][n]) for n, p in after[0].items())
    after = [{e["sync"]: e for e in out["rounds"]}[4]["params"] for out in survivors]
    assert all(torch.equal(p, after[1][n]) for n, p in after[0].items())
    for out in (survivors[1], outs[2][0]):
        for name, p in out["params"].items():
            assert torch.equal(p, survivors[0]["params"][name]), name
    assert outs[2][0]["heals"] == 1
