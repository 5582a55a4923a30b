"""`editrain train --dist.tp_size`: the trainer on a ("sync", "shard", "tp") mesh.

Tensor parallelism changes how a replica computes, not what: a run with tp_size 2 reads the
same batches (tp peers share a data rank), clips gradients and evaluates over the same
ranks' data, so it must follow the run without tensor parallelism step by step (to float
noise), and resume bitwise from its own checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from editrain.checkpoint import list_checkpoints
from tests.test_checkpoint import RESUME_VAL_TOL, final_val, rows, step_losses, train
from tests.tolerance import RUN_LOSS_RTOL, rel_diff, worst_rel_diff

# Each case: (topology without tp, the same with tp 2, further arguments). Gradient
# clipping is on (train.grad_clip 0.5 bites at these losses); WSAM's norm is clipped too.
COMMON = ["--steps", "10", "--sync.local_sgd_sync_interval", "4", "--train.grad_clip", "0.5",
          "--sync.clip_pseudo_grad", "0.5", "--sync.ewma_warmup_steps", "1",
          "--train.eval_every", "5", "--checkpoint.every", "5", "--checkpoint.keep", "5"]
CASES = {
    "2x1": (["--nproc", "2", "--shard-size", "1"], ["--nproc", "4", "--shard-size", "1"], []),
    # (diloco's anomaly detector is off by default: on here, as COMMON tunes it)
    "1x2": (["--nproc", "2", "--shard-size", "2"], ["--nproc", "4", "--shard-size", "2"],
            ["--method", "diloco", "--sync.skip_anomaly", "true"]),
    "wsam": (["--nproc", "2", "--shard-size", "1"], ["--nproc", "4", "--shard-size", "1"],
             ["--optim.sam", "wsam"]),
}
TOL = RUN_LOSS_RTOL  # relative: see its docstring


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


TP_RUN = ["--nproc", "4", "--shard-size", "1", "--tp-size", "2", *COMMON]
"""The run on a (2, 1, 2) mesh: case 2x1's run with tp, the run the checkpoint tests resume."""


@pytest.fixture(scope="module")
def runs(cache: Path, tmp_path_factory):
    """``get(*args)``: the directory of a run with these arguments, trained on first use
    only. The tests read its metrics and summary; the two that resume from its first
    checkpoint both take the first (a resume moves the later ones aside)."""
    done: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        if args not in done:
            run = tmp_path_factory.mktemp("run") / "run"
            train(cache, run, *args)
            done[args] = run
        return done[args]

    return get


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_tp_run_follows_the_run_without_tp(runs, name: str) -> None:
    plain_topo, tp_topo, extra = CASES[name]
    plain = runs(*plain_topo, *COMMON, *extra)
    tp = runs(*tp_topo, "--tp-size", "2", *COMMON, *extra)
    a, b = step_losses(plain), step_losses(tp)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    worst = worst_rel_diff(b, a)
    assert worst < TOL, f"{name}: step losses differ by {worst:.3g} relative"
    assert rel_diff(final_val(tp), final_val(plain)) < TOL
    sa, sb = _summary(plain), _summary(tp)
    assert sb["tp_size"] == 2 and sa["tp_size"] == 1
    # the same tokens: tp peers do not count twice, and evaluation covers the same split
    assert sb["tokens_processed"] == sa["tokens_processed"]
    assert sb["val_tokens"] == sa["val_tokens"]
    assert final_val(tp) < 6.1  # it learns (about 6.24 = log 512 at the start; 6.04 with
    # EDiT's plain outer SGD, below 6.0 with Nesterov momentum, which speeds the first
    # rounds of 10 steps up)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp_checkpoint_resumes_bitwise(cache: Path, tmp_path: Path, runs) -> None:
    """Saved mid-run (the first sync point after step 5) on a (2, 1, 2) mesh with the penalty and clipping; the resumed run
    equals the uninterrupted one bitwise. A run with another tp size is refused."""
    args = TP_RUN
    full = runs(*args)
    first = list_checkpoints(full)[0]
    marker = json.loads((first / "editrain.json").read_text())
    assert marker["topology"] == [2, 1, 2] and marker["tp_size"] == 2
    resumed = tmp_path / "resumed"
    train(cache, resumed, *args, "--resume", str(first))
    a, b = step_losses(full), step_losses(resumed)
    assert sorted(b) == list(range(marker["step"] + 1, 11)) and len(b) >= 2
    for step, loss in b.items():
        assert loss == a[step], (step, loss, a[step])  # bitwise
    assert final_val(resumed) == final_val(full)
    out = train(cache, tmp_path / "other", "--nproc", "2", "--shard-size", "1", "--tp-size",
                "1", *COMMON, "--resume", str(first), check=False)  # given: else the run's
    assert out.returncode != 0
    assert "dist.tp_size: checkpoint has 2, this run has 1" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp_checkpoint_resumes_elastically_with_tp_fixed(cache: Path, tmp_path: Path,
                                                         runs) -> None:
    """Saved on (2, 1, 2), resumed on (1, 2, 2): DCP re-shards the tp-split and the
    FSDP2-sharded pieces; the global model comes back (the same validation loss up to
    reduction order) and training goes on."""
    src = runs(*TP_RUN)
    first = list_checkpoints(src)[0]
    step = json.loads((first / "editrain.json").read_text())["step"]
    dst = tmp_path / "dst"
    train(cache, dst, "--nproc", "4", "--shard-size", "2", "--tp-size", "2", *COMMON,
          "--resume", str(first))
    resume_row = next(r for r in rows(dst) if r.get("event") == "elastic_resume")
    saved_val = next(r["val_loss"] for r in rows(src) if r.get("step") == step
                     and "val_loss" in r)
    assert resume_row["val_loss"] == pytest.approx(saved_val, abs=RESUME_VAL_TOL)
    assert sorted(step_losses(dst)) == list(range(step + 1, 11))
    assert final_val(dst) < saved_val + 0.05
