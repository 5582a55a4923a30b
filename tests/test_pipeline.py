"""Pipeline stages of the Llama and the pipeline runner (``editrain.pipeline``) equal the
unpipelined model.

Two gloo ranks each build the tiny Llama (untied embeddings, 4 layers: 2 blocks per stage)
from the same seed twice: one copy whole, one split into this rank's stage. After a
``train_step`` through the pipeline (GPipe and 1F1B, 2 and 4 microbatches) the last stage's
loss equals the whole model's loss on the same batch, and every parameter's gradient equals
the whole model's gradient (compared per stage by parameter name, the stage's names being
the model's) to 1e-6; a few AdamW steps keep the losses and parameters equal (in float64,
see the test); ``eval_loss`` equals the whole model's loss. One spawn runs every case, in
fp32 and in fp64; the tests below read its results. The rest needs no process group: the
split, the stages' forward, and the bad inputs.
"""

from __future__ import annotations

import pytest
import torch

from editrain.models import Llama, causal_lm_loss, preset_config
from editrain.pipeline import (
    LlamaStage,
    PipelineRunner,
    check_microbatches,
    stage_layers,
)
from editrain.spawn import run_ranks

TOL = 1e-6
BATCH, SEQ, VOCAB = 4, 16, 256
ADAMW_STEPS = 3
CASES = [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]


def _config(n_layers: int = 4, tied: bool = False):
    return preset_config("tiny", n_layers=n_layers, vocab_size=VOCAB, max_seq_len=32,
                         tie_embeddings=tied)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return float("inf")
    return (a - b).abs().max().item()


def _case(rank: int, pp_size: int, schedule: str, n_microbatches: int,
          dtype: torch.dtype) -> dict:
    """One case on this rank: differences to the whole model built in this process."""
    cfg = _config()
    whole = Llama(cfg, seed=0).to(dtype)
    stage = LlamaStage(Llama(cfg, seed=0).to(dtype), rank, pp_size)
    runner = PipelineRunner(stage, batch_size=BATCH, seq_len=SEQ,
                            n_microbatches=n_microbatches, schedule=schedule)
    mine = dict(stage.named_parameters())
    theirs = dict(whole.named_parameters())
    opt_mine = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.01)
    opt_theirs = torch.optim.AdamW(whole.parameters(), lr=1e-2, weight_decay=0.01)
    out: dict = dict(names=sorted(mine), loss=[], grad=[], param=[])
    for step in range(ADAMW_STEPS):
        tokens, targets = _batch(step)
        opt_mine.zero_grad()
        opt_theirs.zero_grad()
        loss = runner.train_step(tokens, targets)
        ref = causal_lm_loss(whole(tokens), targets)
        ref.backward()
        out["loss"].append(None if loss is None else abs(loss.item() - ref.item()))
        out["grad"].append(max(_max_diff(p.grad, theirs[n].grad) for n, p in mine.items()))
        opt_mine.step()
        opt_theirs.step()
        out["param"].append(max(_max_diff(p, theirs[n]) for n, p in mine.items()))
    tokens, targets = _batch(ADAMW_STEPS)
    opt_mine.zero_grad(set_to_none=True)
    loss = runner.eval_loss(tokens, targets)
    with torch.no_grad():
        ref = causal_lm_loss(whole(tokens), targets)
    out["eval"] = None if loss is None else abs(loss.item() - ref.item())
    out["eval_grads"] = [n for n, p in mine.items() if p.grad is not None]
    return out


def _all_cases(rank: int, world_size: int) -> dict:
    return {(*case, dtype): _case(rank, world_size, *case, dtype)
            for case in CASES for dtype in (torch.float32, torch.float64)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all_cases, 2)


def _ids(case: tuple[str, int]) -> str:
    return f"{case[0]}-{case[1]}mb"


F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_last_stage_has_the_whole_models_loss(results, case):
    first, last = results[0][(*case, F32)], results[1][(*case, F32)]
    assert first["loss"] == [None] * ADAMW_STEPS
    assert last["loss"][0] < TOL, last["loss"]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_parameter_gets_the_whole_models_gradient(results, case):
    names = [r[(*case, F32)]["names"] for r in results]
    whole = sorted(n for n, _ in Llama(_config(), seed=0).named_parameters())
    assert sorted(names[0] + names[1]) == whole  # every parameter on exactly one stage
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
    for r in results:
        assert r[(*case, F32)]["grad"][0] < TOL, r[(*case, F32)]["grad"]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_adamw_steps_keep_the_pipeline_equal_to_the_whole_model(results, case):
    """In float64: Adam divides by sqrt(v) + eps, which turns fp32's 1e-8 rounding
    difference between microbatched and whole-batch gradients, where a gradient is near
    eps, into parameter differences of ~1e-5 after one step at lr 1e-2 (seen: up to 7e-5).
    The losses stay fp32 (causal_lm_loss computes in fp32)."""
    for r in results:
        assert max(r[(*case, F64)]["grad"]) < TOL, r[(*case, F64)]["grad"]
        assert max(r[(*case, F64)]["param"]) < TOL, r[(*case, F64)]["param"]
    assert max(results[1][(*case, F64)]["loss"]) < TOL, results[1][(*case, F64)]["loss"]


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_eval_loss_is_the_whole_models_loss(results, case, dtype):
    assert results[0][(*case, dtype)]["eval"] is None
    assert results[1][(*case, dtype)]["eval"] < TOL
    for r in results:  # forward only: no parameter got a gradient
        assert r[(*case, dtype)]["eval_grads"] == []


# ----------------------------------------------------------------------------- no spawn
def test_stage_layers_splits_evenly_earlier_stages_first():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert stage_layers(6, 1) == [range(0, 6)]


@pytest.mark.parametrize("pp_size", [0, 5, -1, 2.0, True])
def test_stage_layers_refuses_a_bad_pp_size(pp_size):
    with pytest.raises(ValueError, match=r"dist\.pp_size .*from 1 to .*\(4\)"):
        stage_layers(4, pp_size)


def test_stages_share_the_models_parameters_under_its_names():
    model = Llama(_config(n_layers=3), seed=0)
    stages = [LlamaStage(model, s, 2) for s in range(2)]
    assert [list(s.layer_ids) for s in stages] == [[0, 1], [2]]
    whole = dict(model.named_parameters())
    seen = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p is whole[name]
            seen[name] = p
    assert seen.keys() == whole.keys()
    assert stages[0].norm is None and stages[0].output is None
    assert stages[1].tok_embeddings is None


@pytest.mark.parametrize(("n_layers", "pp_size", "tied"), [(4, 2, False), (3, 3, False),
                                                           (2, 1, True)])
def test_stages_chained_in_one_process_give_the_models_logits(n_layers, pp_size, tied):
    model = Llama(_config(n_layers=n_layers, tied=tied), seed=0)
    tokens, _ = _batch(0)
    h = tokens
    for s in range(pp_size):
        h = LlamaStage(model, s, pp_size)(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


def test_tied_embeddings_are_refused_for_several_stages():
    model = Llama(_config(tied=True), seed=0)
    with pytest.raises(ValueError, match=r"dist\.pp_size = 2 .*tie_embeddings"):
        LlamaStage(model, 0, 2)


def test_a_stage_index_out_of_range_is_refused():
    model = Llama(_config(), seed=0)
    with pytest.raises(ValueError, match=r"stage must be .* 0 to 1 \(dist\.pp_size = 2\)"):
        LlamaStage(model, 2, 2)


def test_more_stages_than_layers_are_refused():
    model = Llama(_config(n_layers=2), seed=0)
    with pytest.raises(ValueError, match=r"dist\.pp_size"):
        LlamaStage(model, 0, 3)


@pytest.mark.parametrize(("batch", "n_mb", "schedule", "pp", "pattern"), [
    (4, 3, "gpipe", 2, r"dist\.pp_microbatches \(3\) must divide the batch size \(4\)"),
    (4, 0, "gpipe", 2, r"dist\.pp_microbatches must be a positive integer"),
    (4, 1, "1f1b", 2, r"dist\.pp_schedule = '1f1b' needs dist\.pp_microbatches >= "
                      r"dist\.pp_size \(2\)"),
    (4, 2, "zb", 2, r"dist\.pp_schedule must be one of gpipe, 1f1b"),
])
def test_bad_microbatches_and_schedules_name_the_option(batch, n_mb, schedule, pp, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_microbatches(batch, n_mb, schedule, pp)


def test_gpipe_takes_fewer_microbatches_than_stages():
    check_microbatches(4, 1, "gpipe", 2)
    check_microbatches(4, 4, "1f1b", 4)


def test_the_runner_checks_microbatches_before_it_needs_a_process_group():
    stage = LlamaStage(Llama(_config(), seed=0), 0, 2)
    with pytest.raises(ValueError, match=r"dist\.pp_microbatches \(3\)"):
        PipelineRunner(stage, batch_size=4, seq_len=SEQ, n_microbatches=3, schedule="gpipe")
    with pytest.raises(ValueError, match=r"dist\.pp_schedule = '1f1b'"):
        PipelineRunner(stage, batch_size=4, seq_len=SEQ, n_microbatches=1, schedule="1f1b")
