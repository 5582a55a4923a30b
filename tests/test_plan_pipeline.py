"""The planner's pipeline stages (editrain/plan/pipeline.py): the schedule's bubble, the
stages' split of the units, memory and bytes against hand-computed cases, the inputs'
errors, ``editrain plan`` with a pp method, calibration from a pp run, and pp = 1
predicting bitwise what the planner predicted before it had stages
(tests/golden/plan_pp1.json, recorded before the change)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from editrain.cli import main
from editrain.errors import ConfigError
from editrain.plan.calibrate import calibrate
from editrain.plan.inputs import GBIT, Cluster, MethodSpec, ModelSpec
from editrain.plan.model import Layout, Shape, layer_activation_bytes, model_shape, predict
from editrain.plan.pipeline import (
    bubble_fraction,
    check_pipeline,
    in_flight,
    link_groups,
    pipelined_step_s,
    schedule_factor,
    stage_blocks,
    stage_units,
)
from tests.test_plan import write_synthetic_run

GOLDEN = Path(__file__).resolve().parent / "golden" / "plan_pp1.json"

# ---------------------------------------------------------------------------- pp = 1
CLUSTERS = {
    "flops": dict(nodes=4, gpus_per_node=8, gpu_peak_tflops=312.0, mfu=0.4,
                  inter_node_gbps=25.0, inter_node_latency_ms=0.05, straggler_spread=0.1),
    "measured": dict(nodes=2, gpus_per_node=2, inter_node_gbps=0.04, step_time_s=0.03,
                     step_overhead_s=0.002, stall_prob=0.05, stall_s=0.1,
                     overlap_cpu_s=0.01, latency_per="collective"),
    "scaled": dict(nodes=2, gpus_per_node=4, inter_node_gbps=1.0, step_time_s=0.05,
                   step_time_flops=1e12, step_time_gpus=2),
}
MODELS = {
    "small": dict(preset="small", seq_len=256, batch_size=16),
    "1b": dict(preset="1b", seq_len=2048, batch_size=64, micro_batch=1,
               activation_checkpointing=True),
    "counted": dict(params=1e8, layers=8, vocab_size=1000, seq_len=512, batch_size=8,
                    dtype="fp32"),
}
METHODS = [
    dict(method="sync"), dict(method="sync", grad_overlap=True),
    dict(method="post_local_sgd", H=8), dict(method="diloco", H=16),
    dict(method="edit", H=32), dict(method="edit", H=32, fragments=4, overlap=2, codec="int8"),
    dict(method="edit", H=16, overlap=16, eager=True, codec="topk2"),
    dict(method="edit", H=8, cpu_offload=True, codec="int4", ft=True),
    dict(method="edit", H=8, shard_size=2, tp=2),
    dict(method="diloco", H=8, shard_size=4, tp=1, codec="bf16"),
    dict(method="aedit", H=16), dict(method="aedit", H=16, overlap=2, sync_time_s=0.5),
]


def test_pp1_predicts_bitwise_what_the_planner_predicted_before_stages():
    """Every number of 102 settings (every method, measured and FLOP-rate compute, scaled
    compute, stragglers, stalls, shards, tp, codecs, eager, ft, offload) equals the one
    recorded before the planner had pipeline stages: bitwise (tests/README.md class 1,
    the same float64 operations on the same inputs)."""
    old = json.loads(GOLDEN.read_text())
    seen = 0
    for cn, c in CLUSTERS.items():
        for mn, m in MODELS.items():
            for i, meth in enumerate(METHODS):
                if cn == "measured" and meth.get("shard_size", 1) * meth.get("tp", 1) > 2:
                    continue
                pred = predict(Cluster(**c), ModelSpec(**m), MethodSpec(**meth),
                               check_memory=False)
                got = {**pred.row(), "memory_parts": pred.memory.parts,
                       "host_parts": pred.memory.host, "notes": pred.notes}
                want = old[f"{cn}/{mn}/{i}"]
                assert {k: got[k] for k in want} == want, f"{cn}/{mn}/{i}"
                assert (got["pp"], got["bubble"], got["bubble_s"], got["pp_transfer_s"]) \
                    == (1, 0.0, 0.0, 0.0)
                seen += 1
    assert seen == len(old) == 102


# ---------------------------------------------------------------------------- schedule
def test_bubble_by_hand():
    # 4 stages, 8 microbatches: 3 of the 11 microbatch times idle; interleaved with 2
    # chunks per rank the idle time halves: 3 / (16 + 3).
    assert bubble_fraction(4, 8) == 3 / 11
    assert bubble_fraction(4, 8, 2) == 3 / 19
    assert bubble_fraction(1, 8) == 0.0
    # Equal ranks of 1 s each: (M + p - 1) / M of it, 1 + 3/8; interleaved 1 + 3/16.
    assert pipelined_step_s([1.0] * 4, 8) == 1.375
    assert pipelined_step_s([1.0] * 4, 8, 2) == 1.1875
    # An unequal pipeline runs at its slowest rank's pace; the others fill and drain.
    assert pipelined_step_s([1.0, 1.0, 2.0], 4) == 2.0 + 2.0 / 4


def test_in_flight_per_schedule():
    assert in_flight("gpipe", 4, 8, 1, 0) == 8  # every forward before any backward
    assert [in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2, 1, 0) == 2  # never more than the microbatches
    assert in_flight("interleaved-1f1b", 4, 8, 2, 0) == 4 + 3 / 2


@pytest.mark.parametrize("layers,pp,v", [(8, 4, 1), (7, 3, 1), (10, 2, 2), (9, 2, 3),
                                         (5, 5, 1)])
def test_stage_blocks_split_as_training_splits(layers, pp, v):
    from editrain.pipeline import stage_layers

    runs = stage_layers(layers, pp * v)
    want = [[b for k in range(v) for b in runs[r + k * pp]] for r in range(pp)]
    assert stage_blocks(layers, pp, v) == want


def test_stage_units_put_embeddings_first_and_output_last():
    shape = model_shape(ModelSpec(preset="tiny", tie_embeddings=False, vocab_size=512))
    names = [[shape.units[u][0] for u in units] for units in stage_units(shape, 2)]
    assert names == [["tok_embeddings", "block0"], ["root", "block1", "output"]]


# ---------------------------------------------------------------------------- predict
def blocks_shape(layers=8, params=1000, dim=64) -> Shape:
    """Blocks only, all alike: the stages are balanced."""
    return Shape([(f"block{i}", params) for i in range(layers)], [1.0 / layers] * layers,
                 dim, layers, 1, 0, False)


SPEC = dict(params=8000.0, layers=8, dim=64, seq_len=16, batch_size=8)


def one_node(**kw) -> Cluster:
    """Two nodes of 4 GPUs, a measured step of 1 s (every planned job's own)."""
    return Cluster(**{**dict(nodes=2, gpus_per_node=4, inter_node_gbps=8.0,
                             step_time_s=1.0), **kw})


@pytest.mark.parametrize("schedule,v,ideal_factor", [("gpipe", 1, 1 + 3 / 8),
                                                     ("1f1b", 1, 1 + 3 / 8),
                                                     ("interleaved-1f1b", 2, 1 + 3 / 16)])
def test_predicted_step_holds_the_bubble_and_the_transfers(schedule, v, ideal_factor):
    """4 balanced stages on one node, 8 microbatches of 1 sequence: the step with every
    GPU busy (1 s) times the schedule's factor, plus 2 (4 v - 1) transfers of one
    microbatch's activation (1 x 16 x 64 bf16 values) on the intra-node link."""
    method = MethodSpec(method="diloco", H=8, pp=4, shard_size=1, pp_microbatches=8,
                        pp_schedule=schedule, pp_stages_per_rank=v)
    pred = predict(one_node(), ModelSpec(**SPEC), method, blocks_shape())
    one = 5e-6 + 16 * 64 * 2 / (1600 * GBIT)
    assert pred.layout == Layout(2, 1, 1, 4)
    assert pred.bubble_s == ideal_factor - 1.0
    # (a few float64 operations in another order: tests/README.md class 6)
    assert pred.pp_transfer_s == pytest.approx(2 * (4 * v - 1) * one)
    assert pred.compute_s == pytest.approx(ideal_factor + 2 * (4 * v - 1) * one)
    assert pred.bubble == pytest.approx((ideal_factor - 1.0) / pred.compute_s)
    row = pred.row()
    assert (row["pp"], row["bubble_s"]) == (4, ideal_factor - 1.0)


def test_memory_follows_the_stage_and_its_microbatches_in_flight():
    """Each rank holds 2 of the 8 blocks (2000 parameters, bf16) and the activations of
    the microbatches its schedule keeps: 1F1B's first rank 4, GPipe's every rank all 8."""
    spec = ModelSpec(**SPEC)
    act = 2 * layer_activation_bytes(blocks_shape(), spec, 1, 1)  # 2 layers, 1 sequence
    for schedule, held in (("1f1b", 4), ("gpipe", 8)):
        method = MethodSpec(method="edit", pp=4, shard_size=1, pp_microbatches=8,
                            pp_schedule=schedule)
        mem = predict(one_node(), spec, method, blocks_shape()).memory
        assert mem.parts["parameters"] == 2000 * 2
        assert mem.parts["optimizer"] == 2000 * 12
        assert mem.parts["anchor"] == 2000 * 4
        assert mem.parts["activations"] == act * held
        assert "logits" not in mem.parts  # the first rank's (the busiest) has none


def test_bytes_per_round_follow_the_stages_links():
    """edit fp32 over 2 replicas: 2 (R - 1) / R x 4 bytes per value, 4000 per unit of
    1000. All 4 stages on one node share its link: the whole model's 32,000 bytes, as
    without stages. One stage per node (1 GPU per node): each node carries its own
    stage's 2 units, 8,000 bytes, in parallel, and the blocking round waits 1/4 as long."""
    spec, method = ModelSpec(**SPEC), dict(method="diloco", H=8, shard_size=1,
                                           pp_microbatches=8)
    shared = predict(one_node(), spec, MethodSpec(**method, pp=4), blocks_shape())
    assert shared.bytes_per_round == 32000.0
    apart_cluster = Cluster(nodes=8, gpus_per_node=1, inter_node_gbps=8.0, step_time_s=1.0)
    apart = predict(apart_cluster, spec, MethodSpec(**method, pp=4), blocks_shape())
    assert apart.bytes_per_round == 8000.0
    assert apart.round_link_s == pytest.approx(shared.round_link_s / 4)  # class 6
    assert link_groups(apart_cluster, apart.layout) == [[0], [1], [2], [3]]
    assert link_groups(one_node(), shared.layout) == [[0, 1, 2, 3]]
    # Stages of 2 GPUs on nodes of 4: two stages per node.
    assert link_groups(one_node(), Layout(1, 2, 1, 4)) == [[0, 1], [2, 3]]


def test_schedule_factor_of_a_balanced_pipeline():
    spec, shape = ModelSpec(**SPEC), blocks_shape()
    method = MethodSpec(method="edit", pp=4, shard_size=1, pp_microbatches=8)
    pipe = check_pipeline(shape, spec, method, Layout(2, 1, 1, 4))
    assert schedule_factor(shape, spec, pipe) == 1.375
    assert pipe.microbatches == 8 and pipe.sequences == 1


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fields,match", [
    (dict(pp=0), r"method.pp: must be >= 1"),
    (dict(pp=2, pp_schedule="zb"), r"method.pp_schedule: must be one of gpipe, 1f1b, "
                                   r"interleaved-1f1b"),
    (dict(pp=4, pp_microbatches=2), r"method.pp_microbatches: pp_schedule = 1f1b needs at "
                                    r"least pp \(4\) microbatches, got 2"),
    (dict(pp=2, pp_schedule="interleaved-1f1b"), r"method.pp_stages_per_rank: must be >= 2"),
    (dict(pp=2, pp_schedule="gpipe", pp_stages_per_rank=2),
     r"method.pp_stages_per_rank: must be 1 with pp_schedule = gpipe"),
    (dict(pp_stages_per_rank=2), r"method.pp_stages_per_rank: needs pipeline stages"),
    (dict(pp_microbatches=4), r"method.pp_microbatches: needs pipeline stages"),
])
def test_bad_pipeline_options_name_the_option(fields, match):
    with pytest.raises(ConfigError, match=match):
        MethodSpec(method="edit", **fields)


@pytest.mark.parametrize("spec,method,match", [
    (dict(preset="tiny"), dict(pp=2), r"method.pp: 2 stages need untied embeddings"),
    (SPEC, dict(pp=4, pp_schedule="interleaved-1f1b", pp_stages_per_rank=3),
     r"method.pp: pp x pp_stages_per_rank \(4 x 3\) must be at most the model's layers \(8\)"),
    ({**SPEC, "batch_size": 5}, dict(pp=2, shard_size=2),
     r"model.batch_size: 5 sequences do not split evenly over the 2 shards"),
    ({**SPEC, "micro_batch": 3}, dict(pp=4, shard_size=1), r"model.micro_batch: must divide "
                                                           r"the 8 sequences"),
    (SPEC, dict(pp=4, shard_size=1, pp_microbatches=3, pp_schedule="gpipe"),
     r"method.pp_microbatches: pp_microbatches = 3 must divide the 8 sequences"),
    ({**SPEC, "batch_size": 6}, dict(pp=4, shard_size=1),
     r"pp_microbatches = 0 means pp \(4\) microbatches, which must divide the 6"),
    ({**SPEC, "batch_size": 9},
     dict(pp=4, shard_size=1, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2,
          pp_microbatches=9),
     r"interleaved-1f1b needs a step's microbatches \(9 x 1 accumulation steps = 9\) to "
     r"be a multiple of its rounds, max\(1, 9 // pp\) = 2"),
    (SPEC, dict(pp=4, shard_size=1, H=8, fragments=3, pp_microbatches=8),
     r"method.fragments: 3 is more than the 2 sync units of the smallest pipeline stage"),
])
def test_pipeline_that_training_refuses_is_refused(spec, method, match):
    with pytest.raises(ConfigError, match=match):
        predict(one_node(), ModelSpec(**spec), MethodSpec(method="edit", **method),
                check_memory=False)


def test_interleaved_rounds_rule_matches_trainings():
    """The planner's interleaved-1F1B microbatch rule is training's
    (editrain.pipeline.check_microbatches), counted on a step's microbatches."""
    from editrain.pipeline import check_microbatches

    for m, accumulation in ((6, 2), (4, 3), (8, 1), (5, 1), (9, 1), (9, 2), (7, 2)):
        try:
            check_microbatches(m, m, "interleaved-1f1b", 4, 2, accumulation=accumulation)
            trained = True
        except ValueError:
            trained = False
        spec = ModelSpec(**{**SPEC, "micro_batch": m, "batch_size": m * accumulation})
        method = MethodSpec(method="edit", pp=4, shard_size=1, pp_microbatches=m,
                            pp_schedule="interleaved-1f1b", pp_stages_per_rank=2)
        try:
            check_pipeline(blocks_shape(), spec, method, Layout(2, 1, 1, 4))
            planned = True
        except ConfigError:
            planned = False
        assert planned == trained, (m, accumulation)


# ---------------------------------------------------------------------------- CLI
def test_cli_plans_a_pipelined_method(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["plan", "--cluster.nodes=2", "--cluster.gpus_per_node=8",
                 "--cluster.gpu_peak_tflops=312", "--cluster.mfu=0.4",
                 "--cluster.inter_node_gbps=25", "--model.preset=1b",
                 "--model.tie_embeddings=false", "--model.batch_size=64",
                 "--method", "edit:H=32", "--method", "edit:H=32,pp=2,pp_microbatches=4",
                 "--out", str(out), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "| setting | replicas x pp x shards x tp | pp bubble |" in text
    assert "| edit H=32 pp=2 1f1b m=4 | 2x2x4x1 |" in text
    assert "| edit H=32 | 2x1x8x1 | 0 |" in text
    rows = json.loads((out / "plan.json").read_text())["predictions"]
    assert (rows[0]["pp"], rows[0]["bubble"]) == (1, 0.0)
    assert rows[1]["pp"] == 2 and 0 < rows[1]["bubble"] < 1
    assert rows[1]["tokens_per_s"] < rows[0]["tokens_per_s"]  # the bubble costs time


def test_cli_table_without_stages_is_unchanged(tmp_path, capsys):
    assert main(["plan", "--cluster.nodes=2", "--cluster.gpus_per_node=1",
                 "--cluster.inter_node_gbps=8", "--cluster.step_time_s=0.1",
                 "--model.preset=tiny", "--method", "edit", "--out", str(tmp_path),
                 "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "| setting | replicas x shards x tp | step ms |" in text
    assert "bubble" not in text


# ---------------------------------------------------------------------------- calibration
def test_calibrate_from_a_pipelined_run_takes_the_bubble_out(tmp_path):
    """The same measured steps read as a 2-stage run (2 replicas of 2 ranks): the compute
    per step is the pipelined step over the schedule's factor, the replicas are nproc /
    (pp x shard x tp), the rounds (stage 0's only) fit no link, and the run's own setting
    is predicted at its measured pipelined step again."""
    for name, pp in (("flat", ""), ("staged", "pp_size = 2\n")):
        write_synthetic_run(tmp_path / name)
        config = tmp_path / name / "config.toml"
        text = config.read_text().replace('preset = "tiny"\n',
                                          'preset = "tiny"\ntie_embeddings = false\n')
        if pp:
            text = text.replace("nproc = 2\nshard_size = 1\n",
                                f"nproc = 4\nshard_size = 1\n{pp}")
        config.write_text(text)
    flat, staged = calibrate([tmp_path / "flat"]), calibrate([tmp_path / "staged"])
    sample = staged.samples[0]
    assert (sample.replicas, sample.method.pp, sample.method.microbatches) == (2, 2, 2)
    factor = schedule_factor(model_shape(sample.model), sample.model,
                             check_pipeline(model_shape(sample.model), sample.model,
                                            sample.method, Layout(2, 1, 1, 2)))
    assert staged.pipeline_factor == factor > 1
    assert staged.step_time_s == flat.step_time_s / factor
    assert staged.bandwidth_bytes_per_s is None and staged.rounds == 0
    assert staged.measured_job()[1] == 2
    cluster = staged.cluster(overlap_cpu_s=0.0, inter_node_gbps=1.0)
    assert cluster.gpus_per_node == 2 and cluster.nodes == 2
    pred = predict(cluster, sample.model, sample.method)
    # (the step times the factor again: float64 roundings, tests/README.md class 6)
    assert pred.compute_s - pred.pp_transfer_s == pytest.approx(flat.step_time_s)
