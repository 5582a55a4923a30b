"""The planner's bytes for a gathered (sparse) codec grow with the replica count, as measured.

A sparse message cannot be summed on the way, so it is all-gathered: every replica receives
the other ``R - 1`` messages. ``editrain plan`` counts ``(R - 1)`` payloads per unit and
round; ``editrain train`` at ``R = 2`` and ``R = 4`` with ``topk2`` must send exactly that
(its bytes by cause, ``summary.json``), and ``docs/streaming.md`` names the replica counts
above which a codec that can be summed in an all-reduce would send less.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from editrain.plan.calibrate import read_config
from editrain.plan.inputs import Cluster, MethodSpec
from editrain.plan.model import gather_break_even_replicas, predict, unit_bytes
from tests.cli import run_cli


def test_a_sparse_message_is_received_from_every_other_replica():
    topk2 = MethodSpec(method="diloco", H=8, codec="topk2")
    fp32 = MethodSpec(method="diloco", H=8)
    n = 64 * 4096  # whole chunks: 128 bytes per 4096 values
    assert unit_bytes(topk2, n, 2) == 128 * 64
    # at R = 64 a replica receives 63 messages of 1/128 of the fp32 bytes each
    assert unit_bytes(topk2, n, 64) == pytest.approx(63 / 128 * 4 * n)
    assert unit_bytes(fp32, n, 64) == pytest.approx(2 * 63 / 64 * 4 * n)
    for R in (2, 4, 64, 255):
        assert unit_bytes(topk2, n, R) < unit_bytes(fp32, n, R)
    assert unit_bytes(topk2, n, 257) > unit_bytes(fp32, n, 257)
    # a summable codec of b bytes per value wins above R = 2 b / p (p = 1/32 for topk2)
    assert [gather_break_even_replicas("topk2", b) for b in (4, 2, 1, 0.5)] == \
        [256, 128, 64, 32]
    assert gather_break_even_replicas("int8", 2) == pytest.approx(2 * 2 / (1 + 4 / 128))


def _train(run_dir: Path, cache: Path, replicas: int) -> Path:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = run_cli(["train", "--model.preset", "tiny", "--data.max_bytes", "300000",
                    "--data.vocab_size", "512", "--data.val_tokens", "2048",
                    "--data.cache_dir", str(cache), "--nproc", str(replicas),
                    "--shard-size", "1", "--steps", "8", "--sync.method", "diloco",
                    "--sync.local_sgd_sync_interval", "4", "--sync.comm_dtype", "topk2",
                    "--train.eval_every", "1000", "--run-dir", str(run_dir), "--quiet"],
                   env=env, merged=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4])
def test_plan_counts_the_bytes_a_sparse_run_sends(replicas, tmp_path, data_cache):
    run_dir = _train(tmp_path / "run", data_cache, replicas)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_syncs"] == 2  # after steps 4 and 8: no forced round at the end
    measured = summary["cross_replica_bytes"]["rounds"] / summary["num_syncs"]
    method, model = read_config(run_dir)
    cluster = Cluster(nodes=replicas, gpus_per_node=1, inter_node_gbps=1.0,
                      step_time_s=0.01)
    predicted = predict(cluster, model, method, check_memory=False).bytes_per_round
    assert measured == predicted, (measured, predicted)
    # every byte is one of the R - 1 messages received: per replica it is R - 1 times one
    assert measured % (replicas - 1) == 0


def test_the_eager_merge_holds_the_global_anchor_too():
    """The eager merge keeps the global anchor G beside each replica's own (and the
    momentum of G's optimizer where the outer optimizer has one): one more fp32 copy."""
    from editrain.plan.inputs import ModelSpec
    from editrain.plan.model import layout, memory_per_rank, model_shape

    spec = ModelSpec(preset="tiny")
    shape = model_shape(spec)
    cluster = Cluster(nodes=2, gpus_per_node=1, inter_node_gbps=1.0, step_time_s=0.01)
    for momentum, extra in ((None, 1), (True, 2)):
        eager = MethodSpec(method="edit", H=8, overlap=8, eager=True, outer_momentum=momentum)
        mem = memory_per_rank(shape, spec, eager, layout(cluster, eager)).parts
        n = shape.params  # one GPU per replica
        assert mem["global_anchor"] == 4 * n
        assert sum(v for k, v in mem.items() if k.startswith("global_")) == extra * 4 * n
