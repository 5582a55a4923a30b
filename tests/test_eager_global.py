"""The eager merge's global model without dense exchanges (docs/streaming.md section 3c).

Every replica keeps the global anchor ``G`` (fed every round's reduced pseudo-gradient once,
at the merge); an evaluation takes ``G`` with the round in flight merged as sent, the end of
training puts every replica on ``G``. The distributed engine on 2 replicas (one spawn for
every case) must match the reference simulator at the end and at every evaluation in the
middle of the run, send nothing across replicas for it, and train bitwise as it does
without evaluations and checkpoints.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import (
    ref_config,
    reference_mismatches,
    run_reference,
    topology_runs,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # one spawn of four runs

TOL = 1e-5
PEN_ON = dict(pseudo_gradnorm_reduce=True, weight_softmax_temperature=0.02, skip_anomaly=True,
              ewma_alpha=0.5, ewma_warmup_steps=2, ewma_threshold=3.0, clip_pseudo_grad=0.05)
def _evals(steps: int) -> dict:
    """Evaluations (one before any merge, one right at a merge and launch, one mid-round, one
    at the end) and a checkpoint's engine state in the middle of the run."""
    return dict(global_at=(2, 4, 5, 8, steps), state_at=(6,))


def _case(method: str, steps: int, **sync) -> dict:
    return dict(sync=dict(method=method, local_sgd_sync_interval=4, overlap_steps=4,
                          fragments=2, merge="eager", **sync),
                steps=steps, finish_force=True, tied=False, split_root=True)


BASE = {
    # Nesterov momentum: G's optimizer state is copied for the evaluation's trial step
    "momentum": _case("edit", 11, **PEN_ON,
                      outer_optim_kwargs={"lr": 0.7, "momentum": 0.9, "nesterov": True}),
    # the sparse 2-bit codec with its own defaults (plain SGD at lr 2);
    # it ends right after fragment 0's launch: those units end on G without a last round
    "topk2": _case("diloco", 10, comm_dtype="topk2", topk_chunk=256, topk_k=12),
}
CASES = {**BASE, **{f"{name}_evals": dict(case, **_evals(case["steps"]))
                    for name, case in BASE.items()}}


@pytest.fixture(scope="module")
def runs():
    return topology_runs({(2, 1): CASES})(2, 1)


@pytest.fixture(scope="module")
def refs():
    """Per evaluated case: the reference's final parameters and its global models."""
    out = {}
    for name in BASE:
        probe: dict = {}
        cfg = ref_config(CASES[f"{name}_evals"], 2, 1,
                         global_at=CASES[f"{name}_evals"]["global_at"])
        out[name] = (run_reference(cfg, probe), probe["global"])
    return out


@pytest.mark.parametrize("name", list(BASE))
def test_matches_the_reference_with_evaluations_and_checkpoints(runs, refs, name):
    outs = runs[f"{name}_evals"]
    final, globals_ = refs[name]
    assert not reference_mismatches(outs, final, TOL)
    for k in CASES[f"{name}_evals"]["global_at"]:
        got = [{"params": o["globals"][k], "replica": o["replica"]} for o in outs]
        bad = reference_mismatches(got, globals_[k], TOL)
        assert not bad, (name, k, bad)


@pytest.mark.parametrize("name", list(BASE))
def test_every_replica_evaluates_and_ends_on_one_model(runs, name):
    a, b = runs[f"{name}_evals"]
    for k in CASES[f"{name}_evals"]["global_at"]:
        for key, p in a["globals"][k].items():
            assert torch.equal(p, b["globals"][k][key]), (name, k, key)
    for key, p in a["params"].items():
        assert torch.equal(p, b["params"][key]), (name, key)


@pytest.mark.parametrize("name", list(BASE))
def test_evaluations_and_checkpoints_change_nothing_and_send_nothing(runs, name):
    """The run with evaluations and a checkpoint trains bitwise as the run without them and
    sends exactly the same bytes across replicas, for every cause; nothing is sent to make
    the replicas agree on a model (consensus) or to evaluate."""
    plain, evals = runs[name], runs[f"{name}_evals"]
    for p, e in zip(plain, evals):
        for key, value in p["params"].items():
            assert torch.equal(value, e["params"][key]), (name, key)
        assert p["ledger"] == e["ledger"], name
        assert e["ledger"]["consensus"] == e["ledger"]["evaluation"] == 0
        assert e["ledger"]["checkpoints"] == 0
        assert e["ledger"]["rounds"] > 0
        assert e["ledger"]["total"] == sum(v for k, v in e["ledger"].items() if k != "total")
