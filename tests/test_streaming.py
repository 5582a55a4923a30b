"""Streaming EDiT against the reference simulator (docs/streaming.md).

Delayed outer updates (both merge rules), staggered fragments, split root units and
quantised pseudo-gradients with error feedback: the distributed engine on 2 replicas x 2
shards (one spawn for every case) must match ``tests/reference.py`` to 1e-5 (but for
isolated elements of float noise: ``reference_mismatches``), and every replica must end on
the same model.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import ref_config, reference, reference_mismatches, topology_runs
from tests.tolerance import PARAM_TOL

pytestmark = pytest.mark.slow

TOL = PARAM_TOL  # parameters against the reference: see its docstring
PEN_ON = dict(pseudo_gradnorm_reduce=True, weight_softmax_temperature=0.02, skip_anomaly=True,
              ewma_alpha=0.5, ewma_warmup_steps=2, ewma_threshold=3.0, clip_pseudo_grad=0.05)
PEN_OFF = dict(pseudo_gradnorm_reduce=False, skip_anomaly=False, clip_pseudo_grad=0.0)
UNTIED = dict(tied=False, split_root=True)


def _case(method: str, steps: int, H: int = 4, finish_force: bool = True, **sync) -> dict:
    return dict(sync=dict(method=method, local_sgd_sync_interval=H, **sync), steps=steps,
                finish_force=finish_force, **UNTIED)


CASES = {
    # tau = 0, P = 1, fp32 with the split root: the layer-wise sync of before, per unit
    "plain": dict(_case("edit", 9, **PEN_ON), trace=True),
    # one fragment in flight at a time (tau < H / P)
    "t1_p2": _case("edit", 11, overlap_steps=1, fragments=2, **PEN_ON),
    "t2_keep": _case("diloco", 11, overlap_steps=2, merge="keep_local"),
    "blend_half": _case("edit", 10, overlap_steps=1, merge="blend", merge_alpha=0.5, **PEN_OFF),
    # several fragments in flight at once (tau >= H / P), staggered every step
    "t3_p4": dict(_case("edit", 12, overlap_steps=3, fragments=4, merge="keep_local",
                        **PEN_ON), trace=True),
    # fragments with the synchronous (tau = 0) layer-wise sync, no forced end
    "p2_sync": _case("edit", 8, fragments=2, finish_force=False, **PEN_ON),
    # quantised pseudo-gradients with and without error feedback
    "int8": dict(_case("edit", 11, overlap_steps=1, fragments=2, comm_dtype="int8",
                       **PEN_ON), trace=True),
    "int8_offload": _case("diloco", 9, comm_dtype="int8", cpu_offload=True),
    "int4_noef": _case("diloco", 9, comm_dtype="int4", error_feedback=False),
    "bf16": _case("edit", 9, overlap_steps=2, comm_dtype="bf16", **PEN_OFF),
    # A-EDiT's step weights with quantised pseudo-gradients (forced step schedule)
    "aedit_int8": dict(sync=dict(method="aedit", comm_dtype="int8", **PEN_ON), steps=3,
                       schedule=[2, 3], finish_force=False, **UNTIED),
    # non-blocking A-EDiT: rendezvous and reduction behind 1 or 2 of each replica's steps
    "aedit_nb1": dict(sync=dict(method="aedit", overlap_steps=1, merge="keep_local",
                                **PEN_ON), steps=3, schedule=[3, 5], finish_force=True,
                      trace=True, **UNTIED),
    "aedit_nb2_int8": dict(sync=dict(method="aedit", overlap_steps=2, merge="keep_local",
                                     comm_dtype="int8", **PEN_OFF), steps=3, schedule=[4, 3],
                           finish_force=True, **UNTIED),
    # sparse 2-bit codes with decayed error feedback, delayed fragments and the penalty
    "topk2": _case("edit", 11, overlap_steps=1, fragments=2, comm_dtype="topk2",
                   topk_chunk=256, topk_k=12, **PEN_ON),
    # eager merges (section 3c): a whole round in flight (tau = H), the own share at once
    "eager": _case("edit", 11, overlap_steps=4, merge="eager", **PEN_ON,
                   outer_optim_kwargs={"lr": 0.7, "momentum": 0.9, "nesterov": True}),
    "eager_p2_int8": _case("edit", 11, overlap_steps=4, fragments=2, merge="eager",
                           comm_dtype="int8", **PEN_ON),
    "eager_topk2": _case("diloco", 10, overlap_steps=4, fragments=2, merge="eager",
                         comm_dtype="topk2", topk_chunk=256, topk_k=12),
    "aedit_eager": dict(sync=dict(method="aedit", overlap_steps=2, merge="eager", **PEN_ON),
                        steps=3, schedule=[3, 4], finish_force=True, **UNTIED),
    # the same run in fp32, int8 and the default sparse codec, for the bytes on the wire
    "bytes_fp32": _case("diloco", 8, fragments=2),
    "bytes_int8": _case("diloco", 8, fragments=2, comm_dtype="int8"),
    "bytes_topk2": _case("diloco", 8, fragments=2, comm_dtype="topk2"),
    # ... and with GTA's magnitude sparsification, whose kept values are gathered sparse
    "bytes_gta05": _case("diloco", 8, fragments=2, gta=dict(
        reducer="gta", sparsification_method="magnitude", density=0.5)),
    "bytes_gta01": _case("diloco", 8, fragments=2, gta=dict(
        reducer="gta", sparsification_method="magnitude", density=0.1)),
}
# 2 replicas x 1 shard: the mesh's sync group spans the world, which the caller also uses
# (here after every step) while a delayed round's collectives run on the engine's thread.
CASES_2X1 = {
    "world_allreduce": dict(_case("edit", 12, overlap_steps=3, fragments=2,
                                  comm_dtype="int8", **PEN_ON), world_allreduce=True),
    # 1-bit codes, small chunks, a decay of its own, the sync of before
    "topk1": _case("edit", 9, comm_dtype="topk1", topk_chunk=64, topk_k=6, error_decay=0.8,
                   **PEN_ON),
    # eager merges with two fragments in flight on the world-spanning sync group
    "eager_p2": dict(_case("edit", 12, overlap_steps=4, fragments=2, merge="eager",
                           **PEN_ON), world_allreduce=True),
}
TOPOLOGIES = {(2, 2): CASES, (2, 1): CASES_2X1}


@pytest.fixture(scope="module")
def runs():
    return topology_runs(TOPOLOGIES)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(runs, name):
    outs = runs(2, 2)[name]
    bad = reference_mismatches(outs, reference(ref_config(CASES[name], 2, 2)), TOL)
    assert not bad, (name, bad)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["finish_force"]])
def test_every_replica_ends_on_the_global_model(runs, name):
    outs = runs(2, 2)[name]
    for o in outs[1:]:
        for key, p in o["params"].items():
            assert torch.equal(p, outs[0]["params"][key]), (name, key)


def test_units_are_split_and_fragments_interleave(runs):
    o = runs(2, 2)["t1_p2"][0]
    # norm (root), tok_embeddings, 2 blocks, output: no unit holds most of the bytes
    assert len(o["unit_numels"]) == 5
    assert max(o["unit_numels"]) < 0.5 * sum(o["unit_numels"])
    fragments = {e["fragment"]: e["units"] for e in o["log"] if "fragment" in e
                 and e["step"] < 11}
    assert fragments == {0: 3, 1: 2}  # units 0, 2, 4 and 1, 3


def test_delayed_rounds_merge_tau_steps_after_launch(runs):
    for name, tau in (("t1_p2", 1), ("t2_keep", 2), ("t3_p4", 3)):
        log = runs(2, 2)[name][0]["log"]
        steps = CASES[name]["steps"]
        # merged during training; at the end finish(force=True) merges the rest at once
        delayed = [e for e in log if e["step"] < steps]
        assert len(delayed) >= 2 and all(e["step"] - e["launch_step"] == tau
                                         for e in delayed), name
        assert all(e["step"] == steps for e in log[len(delayed):]), name
        # rounds are numbered in launch order
        assert [e["sync"] for e in log] == list(range(len(log)))


def test_round_metrics(runs):
    for name in ("t1_p2", "int8", "plain"):
        for e in runs(2, 2)[name][0]["log"]:
            assert e["bytes_sent"] > 0 and e["comm_time_s"] >= 0
            assert e["work_s"] > 0 and e["wait_s"] >= 0
            assert e["hidden"] is None or 0.0 <= e["hidden"] <= 1.0
            assert math.isfinite(e["sync_time_s"])


def test_int8_sends_at_most_0_3_of_fp32(runs):
    got = runs(2, 2)
    fp32 = sum(e["bytes_sent"] for e in got["bytes_fp32"][0]["log"])
    int8 = sum(e["bytes_sent"] for e in got["bytes_int8"][0]["log"])
    assert len(got["bytes_fp32"][0]["log"]) == len(got["bytes_int8"][0]["log"]) >= 4
    assert int8 <= 0.3 * fp32, (int8, fp32)
    assert int8 >= 0.25 * fp32  # one byte per value plus a 4-byte scale per 128 values


def test_default_sparse_codec_sends_under_a_hundredth_of_fp32(runs):
    """Counted bytes of every round, statistics included, at the default chunk and k."""
    got = runs(2, 2)
    fp32 = sum(e["bytes_sent"] for e in got["bytes_fp32"][0]["log"])
    topk2 = sum(e["bytes_sent"] for e in got["bytes_topk2"][0]["log"])
    assert len(got["bytes_fp32"][0]["log"]) == len(got["bytes_topk2"][0]["log"]) >= 4
    assert topk2 <= fp32 / 100, (topk2, fp32)
    for e in got["bytes_topk2"][0]["log"]:
        assert 0 < e["compression"] <= 1 / 100
    for e in got["bytes_fp32"][0]["log"]:
        assert e["compression"] == pytest.approx(1.0)


def test_gta_magnitude_sends_what_it_keeps(runs):
    """GTA's sparse transport: every replica's kept values (4 bytes) and positions (at most
    14 bits in these shards) are all-gathered, so the bytes follow the density instead of
    3 fp32 all-reduces of the whole shard (3x the mean's bytes)."""
    got = runs(2, 2)
    sent = {name: sum(e["bytes_sent"] for e in got[name][0]["log"])
            for name in ("bytes_fp32", "bytes_gta05", "bytes_gta01")}
    assert len({len(got[name][0]["log"]) for name in sent}) == 1
    fp32 = sent["bytes_fp32"]
    for name, density in (("bytes_gta05", 0.5), ("bytes_gta01", 0.1)):
        # R = 2: the all-gather of a message counts it once, like the mean's all-reduce.
        assert density * fp32 < sent[name] <= density * (1 + 14 / 32) * fp32 + 256, (
            name, sent[name], fp32)
        for e in got[name][0]["log"]:
            assert 0 < e["compression"] < density * 1.5
    assert sent["bytes_gta01"] < 0.15 * fp32


def test_staleness_counts_rounds_launched_before_the_merge(runs):
    # t3_p4: tau = 3 steps, a fragment launched every step: 3 later rounds are launched
    # before a round merges (fewer at the forced end); tau = 0 merges before the next one.
    log = runs(2, 2)["t3_p4"][0]["log"]
    during = [e["staleness"] for e in log if e["step"] < CASES["t3_p4"]["steps"]]
    assert during and set(during) == {3}
    assert {e["staleness"] for e in runs(2, 2)["plain"][0]["log"]} == {0}


def test_quantisation_changes_the_result(runs):
    """The quantised runs must differ from fp32 (the reference tolerance alone would not
    notice a quantiser that did nothing)."""
    got = runs(2, 2)
    a = got["bytes_fp32"][0]["params"]
    for name in ("bytes_int8", "bytes_topk2"):
        b = got[name][0]["params"]
        assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-6, name


def test_caller_collectives_never_collide_with_delayed_rounds(runs):
    """Regression: the engine once ran its cross-replica collectives on the mesh's sync
    group, which is the world group for S = 1; a loss all-reduce in the training loop
    while a delayed round was in flight then deadlocked."""
    outs = runs(2, 1)["world_allreduce"]
    assert not reference_mismatches(
        outs, reference(ref_config(CASES_2X1["world_allreduce"], 2, 1)), TOL)
    assert len(outs[0]["log"]) >= 4


def order_mismatches(traces: list[list[tuple]], R: int, S: int) -> list[str]:
    """Where ranks that share a group issued different collective sequences: ranks of one
    sync group (same shard index) must issue identical sequences; ranks of one replica the
    same kinds in the same order and identical shard-group collectives."""
    bad = []
    for r in range(R):
        for s in range(S):
            rank = r * S + s
            twin = s  # replica 0's rank with the same shard index
            if traces[rank] != traces[twin]:
                bad.append(f"rank {rank} vs rank {twin} (sync group {s})")
            head = r * S  # the replica's first rank
            kinds = [(g, op) for g, op, *_ in traces[rank]]
            if kinds != [(g, op) for g, op, *_ in traces[head]] or (
                    [e for e in traces[rank] if e[0] == "shard"]
                    != [e for e in traces[head] if e[0] == "shard"]):
                bad.append(f"rank {rank} vs rank {head} (replica {r})")
    return bad


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.get("trace")])
def test_every_rank_issues_the_same_collectives_in_the_same_order(runs, name):
    """The rule NCCL needs (docs/architecture.md, "Collective order"): the communication
    thread's collectives form the same sequence on every rank of a group."""
    traces = [o["trace"] for o in runs(2, 2)[name]]
    assert all(len(t) > 10 for t in traces)
    assert {g for t in traces for g, *_ in t} == {"sync", "shard"}
    assert order_mismatches(traces, 2, 2) == []
    # the check sees a swap of two collectives on one rank
    swapped = [list(t) for t in traces]
    i = next(k for k in range(len(swapped[3]) - 1) if swapped[3][k] != swapped[3][k + 1])
    swapped[3][i], swapped[3][i + 1] = swapped[3][i + 1], swapped[3][i]
    assert order_mismatches(swapped, 2, 2) != []


@pytest.mark.parametrize("name", ["eager_p2"])
def test_eager_on_2x1_matches_reference(runs, name):
    outs = runs(2, 1)[name]
    bad = reference_mismatches(outs, reference(ref_config(CASES_2X1[name], 2, 1)), TOL)
    assert not bad, (name, bad)


def test_eager_rounds_stay_in_flight_a_whole_round(runs):
    """Each eager round is merged H steps after its launch (just before its fragment
    launches again); with two fragments the other fragment launched in between."""
    for name, stale in (("eager", 0), ("eager_p2_int8", 1)):
        log = runs(2, 2)[name][0]["log"]
        steps = CASES[name]["steps"]
        delayed = [e for e in log if e["step"] < steps]
        assert len(delayed) >= 1 and all(e["step"] - e["launch_step"] == 4
                                         for e in delayed), (name, delayed)
        assert all(e["staleness"] == stale for e in delayed), name


def test_topk1_on_2x1_matches_reference(runs):
    outs = runs(2, 1)["topk1"]
    bad = reference_mismatches(outs, reference(ref_config(CASES_2X1["topk1"], 2, 1)), TOL)
    assert not bad, bad
