"""A calibrated compute per step is converted to the planned job's, not copied.

``editrain plan --calibrate RUN`` measures the run's compute per step; planning another
model (``--model.layers``, ``--model.preset``...), batch or replica size on that hardware
used to give every setting the run's own step time (a model of twice the blocks computed
as fast as the run's). The machine's achieved FLOP/s per GPU is what carries over: the
planned compute is the measured one times the FLOPs-per-step ratio over the GPUs-per-replica
ratio, and exactly the measured one for the run's own job. The run here is a real one
(``editrain train``, the tiny preset, one process, ten steps: a few seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from editrain.cli import main
from editrain.errors import ConfigError
from editrain.plan.calibrate import calibrate, read_config
from editrain.plan.inputs import Cluster, MethodSpec, load_inputs
from editrain.plan.model import model_shape, predict
from tests.cli import run_cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    """A tiny edit run of one replica (a real one: its measured compute per step)."""
    path = tmp_path_factory.mktemp("calibrated") / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = run_cli(["train", "--model.preset", "tiny", "--data.max_bytes", "300000",
                    "--data.vocab_size", "512", "--data.val_tokens", "2048",
                    "--data.cache_dir", str(data_cache), "--nproc", "1", "--shard-size", "1",
                    "--steps", "10", "--sync.local_sgd_sync_interval", "4",
                    "--train.eval_every", "1000", "--run-dir", str(path), "--quiet"],
                   env=env, merged=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return path


def step_flops_by_hand(model) -> float:
    """Training FLOPs of one replica's step: tokens x the shape's FLOPs per token."""
    shape = model_shape(model)
    return model.batch_size * model.seq_len * shape.flops_per_token(model.seq_len)


def plan_json(run_dir, tmp_path, capsys, *options: str) -> dict:
    assert main(["plan", "--calibrate", str(run_dir), *options, "--out",
                 str(tmp_path / "out"), "--no-plot", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_runs_own_job_is_planned_at_its_measured_compute(run_dir, tmp_path, capsys):
    """The run's own settings: every number as without the measured job's FLOPs (the plan
    before the conversion existed), bit for bit."""
    cal = calibrate([run_dir])
    method, model = read_config(run_dir)
    unconverted = cal.cluster(step_time_flops=None, step_time_gpus=None)
    before = predict(unconverted, model, method).row()
    after = predict(cal.cluster(), model, method).row()
    assert after == before
    record = plan_json(run_dir, tmp_path, capsys)
    (row,) = record["predictions"]
    assert {k: row[k] for k in before if k != "label"} == \
        {k: v for k, v in before.items() if k != "label"}
    # blocking: no round beside the compute, the compute is the measured step itself
    record = plan_json(run_dir, tmp_path, capsys, "--method", "diloco")
    assert record["predictions"][0]["compute_s"] == cal.step_time_s


@pytest.mark.parametrize("options, changes", [
    (["--model.layers=4"], {"layers": 4}),  # twice the tiny preset's blocks
    (["--model.batch_size=24"], {"batch_size": 24}),  # three times the run's 8
    (["--model.preset=small", "--model.seq_len=128"], {"preset": "small", "seq_len": 128}),
])
def test_another_model_or_batch_scales_the_compute_by_its_flops(run_dir, tmp_path, capsys,
                                                                options, changes):
    cal = calibrate([run_dir])
    _, run_model = read_config(run_dir)
    planned = dataclasses.replace(run_model, **changes)
    ratio = step_flops_by_hand(planned) / step_flops_by_hand(run_model)
    assert ratio > 1.5
    # diloco's rounds are blocking: nothing beside the compute, the compute alone
    record = plan_json(run_dir, tmp_path, capsys, *options, "--method", "diloco")
    assert record["predictions"][0]["compute_s"] == pytest.approx(cal.step_time_s * ratio,
                                                                  rel=1e-12)


def test_activation_checkpointing_and_a_wider_replica_scale_the_compute(run_dir, tmp_path,
                                                                        capsys):
    """4/3 of the FLOPs with activation checkpointing; a replica of two GPUs (same batch
    per replica) computes each step in half the time."""
    cal = calibrate([run_dir])
    record = plan_json(run_dir, tmp_path, capsys, "--model.activation_checkpointing=true",
                       "--method", "diloco")
    assert record["predictions"][0]["compute_s"] == pytest.approx(cal.step_time_s * 4 / 3,
                                                                  rel=1e-12)
    record = plan_json(run_dir, tmp_path, capsys, "--cluster.gpus_per_node=2",
                       "--method", "diloco:shard_size=2")
    (row,) = record["predictions"]
    assert (row["replicas"], row["shard_size"]) == (1, 2)
    assert row["compute_s"] == pytest.approx(cal.step_time_s / 2, rel=1e-12)


def test_the_header_says_when_the_compute_was_scaled(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["plan", "--calibrate", str(run_dir), "--method", "diloco", "--out",
                 str(out), "--no-plot"]) == 0
    own = capsys.readouterr().out
    assert "GFLOP/s per GPU achieved" in own  # the calibration's rate
    assert "scaled" not in own.split("[model]")[-1]  # the run's own job: nothing scaled
    assert main(["plan", "--calibrate", str(run_dir), "--model.layers=4", "--method",
                 "diloco", "--out", str(out), "--no-plot"]) == 0
    page = (out / "table.md").read_text()
    header = page.splitlines()[0]
    assert "measured on another job" in header and "scaled to this model's" in header
    assert "same achieved FLOP/s per GPU assumed" in header
    assert "- diloco H=32: compute scaled from the measured job's" in page
    assert main(["plan", "--calibrate", str(run_dir), "--model.layers=4", "--method",
                 "aedit", "--out", str(out), "--no-plot"]) == 0  # A-EDiT's own prediction
    assert "- aedit H=32: compute scaled from the measured job's" in \
        (out / "table.md").read_text()
    # a layout of its own is said in the setting's note (the header's model is the run's)
    assert main(["plan", "--calibrate", str(run_dir), "--cluster.gpus_per_node=2",
                 "--method", "diloco:shard_size=2", "--out", str(out), "--no-plot"]) == 0
    page = (out / "table.md").read_text()
    assert "scaled to this model's" not in page.splitlines()[0]
    assert "x0.5 (" in page and "on 2 GPU(s) per replica against its" in page


def test_the_calibrated_plan_file_scales_too(run_dir, tmp_path):
    """The [cluster] table calibration prints names the measured job, so that the file
    reused as a plan converts the compute as --calibrate does."""
    cal = calibrate([run_dir])
    path = tmp_path / "calibrated.toml"
    path.write_text(cal.to_toml())
    same = load_inputs(path, methods=["diloco"])
    more = load_inputs(path, {"model": {"layers": 4}}, ["diloco"])
    ratio = step_flops_by_hand(more.model) / step_flops_by_hand(same.model)
    assert predict(same.cluster, same.model, same.methods[0]).compute_s == cal.step_time_s
    assert predict(more.cluster, more.model, more.methods[0]).compute_s == \
        pytest.approx(cal.step_time_s * ratio, rel=1e-12)


def test_overhead_and_round_cost_are_not_scaled(run_dir):
    """The step overhead (the step boundary's bookkeeping) and the CPU cost of a round
    beside the compute (measured to follow the rounds, not their bytes) carry over as
    they are; only the compute is converted."""
    cal = calibrate([run_dir])
    cluster = cal.cluster(overlap_cpu_s=0.004)
    _, run_model = read_config(run_dir)
    bigger = dataclasses.replace(run_model, layers=4)
    method = MethodSpec(method="edit", H=4, overlap=1, shard_size=1)
    ratio = step_flops_by_hand(bigger) / step_flops_by_hand(run_model)
    pred = predict(cluster, bigger, method)
    beside = 0.004 * method.overlapping_rounds_per_step
    assert pred.compute_s == pytest.approx(cal.step_time_s * ratio + beside, rel=1e-12)
    assert cluster.step_overhead_s == cal.step_overhead_s


@pytest.mark.parametrize("change, message", [
    ({"step_time_flops": 1e9}, "cluster.step_time_gpus: missing: give it with "
     "step_time_flops"),
    ({"step_time_gpus": 2}, "cluster.step_time_flops: missing: give it with step_time_gpus"),
    ({"step_time_flops": 1e9, "step_time_gpus": 1, "step_time_s": None, "mfu": 0.4,
      "gpu_peak_tflops": 10}, "cluster.step_time_flops: describes the job step_time_s was "
     "measured on"),
    ({"step_time_flops": -1.0, "step_time_gpus": 1}, "cluster.step_time_flops: must be > 0"),
    ({"step_time_flops": 1e9, "step_time_gpus": 0}, "cluster.step_time_gpus: must be >= 1"),
])
def test_the_measured_job_is_checked(change, message):
    with pytest.raises(ConfigError) as e:
        Cluster(**{"nodes": 2, "gpus_per_node": 1, "inter_node_gbps": 1.0,
                   "step_time_s": 0.1, **change})
    assert str(e.value).startswith(message)
