"""Pipeline stages of the Llama and the pipeline runner (``editrain.pipeline``) equal the
unpipelined model.

Two gloo ranks each build the tiny Llama (untied embeddings, 4 layers: 2 blocks per stage)
from the same seed twice: one copy whole, one split into this rank's stage. After a
``train_step`` through the pipeline (GPipe and 1F1B, 2 and 4 microbatches) the last stage's
loss equals the whole model's loss on the same batch, and every parameter's gradient equals
the whole model's gradient (compared per stage by parameter name, the stage's names being
the model's) to 1e-6, the losses to 16 float32 ulps relative; a few AdamW steps keep the
losses and parameters equal (in float64, see the test); ``eval_loss`` equals the whole model's loss. One spawn runs every case, in
fp32 and in fp64; the tests below read its results. The rest needs no process group: the
split, the stages' forward, and the bad inputs.
"""

from __future__ import annotations

import pytest
import torch

from editrain.config import load_config
from editrain.models import Llama, causal_lm_loss, preset_config
from editrain.models.hf import HFCausalLM, transformers_available
from editrain.pipeline import (
    HF_PIPELINE_TYPES,
    HFStage,
    LlamaStage,
    PipelineRunner,
    build_stage,
    check_hf_pipeline,
    check_microbatches,
    stage_layers,
)
from editrain.spawn import run_ranks

TOL = 1e-6
"""Gradients and parameters, absolute: they are of order 1e-2 and below here, where 1e-6 is
tens of float32 ulps (the microbatches sum their gradients in another order than the whole
batch: a few roundings); a wrong microbatch or a missing stage moves them by 1e-3 and more."""
LOSS_RTOL = 16 * torch.finfo(torch.float32).eps
"""Losses, relative (``_rel_diff``): ``causal_lm_loss`` computes in float32 even for a
float64 model, and the mean of the microbatches' means rounds differently from the whole
batch's mean, a few float32 roundings of a loss near 5.5-8. An absolute 1e-6 there is one
or two ulps (spacing 4.8e-7 below 8, 9.5e-7 above) and held on an AVX2 CPU but not on an
AVX-512 one (1.43e-6 seen); 16 ulps relative (1.9e-6 relative, about 1.5e-5 at 8) covers
the kernels of either, and a wrong batch or stage moves a loss by 1e-3 and more."""
BATCH, SEQ, VOCAB = 4, 16, 256
ADAMW_STEPS = 3
CASES = [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]
HF_CASES = [("gpipe", 4), ("1f1b", 2), ("interleaved-1f1b", 2)]
INTERLEAVED = "interleaved-1f1b"
I_CASES = [(INTERLEAVED, 1), (INTERLEAVED, 2), (INTERLEAVED, 4)]
"""Interleaved 1F1B, 2 chunks per rank (4 layers: one block per chunk, rank 0 holding
blocks 0 and 2, rank 1 blocks 1 and 3), 1, 2 and 4 microbatches."""
"""A Hugging Face LlamaForCausalLM (4 layers, untied) through the same schedules."""
HF_FIELDS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
             "max_position_embeddings": 32, "tie_word_embeddings": False}


def _config(n_layers: int = 4, tied: bool = False):
    return preset_config("tiny", n_layers=n_layers, vocab_size=VOCAB, max_seq_len=32,
                         tie_embeddings=tied)


def _hf(model_type: str = "llama", seed: int = 0, **changes: object) -> HFCausalLM:
    """A tiny Hugging Face causal LM of ``model_type``, seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**HF_FIELDS, **changes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HFCausalLM(AutoModelForCausalLM.from_config(cfg).float())


def _build(kind: str) -> torch.nn.Module:
    return _hf() if kind == "hf" else Llama(_config(), seed=0)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return float("inf")
    return (a - b).abs().max().item()


def _rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return abs(a.item() - ref.item()) / abs(ref.item())


def _case(rank: int, pp_size: int, schedule: str, n_microbatches: int,
          dtype: torch.dtype, kind: str = "llama") -> dict:
    """One case on this rank: differences to the whole model built in this process."""
    whole = _build(kind).to(dtype)
    chunks = 2 if schedule == INTERLEAVED else 1
    stage = build_stage(_build(kind).to(dtype), rank, pp_size, chunks)
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
        out["loss"].append(None if loss is None else _rel_diff(loss, ref))
        out["grad"].append(max(_max_diff(p.grad, theirs[n].grad) for n, p in mine.items()))
        opt_mine.step()
        opt_theirs.step()
        out["param"].append(max(_max_diff(p, theirs[n]) for n, p in mine.items()))
    tokens, targets = _batch(ADAMW_STEPS)
    opt_mine.zero_grad(set_to_none=True)
    loss = runner.eval_loss(tokens, targets)
    with torch.no_grad():
        ref = causal_lm_loss(whole(tokens), targets)
    out["eval"] = None if loss is None else _rel_diff(loss, ref)
    out["eval_grads"] = [n for n, p in mine.items() if p.grad is not None]
    return out


def _all_cases(rank: int, world_size: int) -> dict:
    out = {(*case, dtype): _case(rank, world_size, *case, dtype)
           for case in [*CASES, *I_CASES] for dtype in (torch.float32, torch.float64)}
    if transformers_available():
        out.update({("hf", *case, dtype): _case(rank, world_size, *case, dtype, kind="hf")
                    for case in HF_CASES
                    for dtype in (torch.float32, torch.float64)})
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all_cases, 2)


def _ids(case: tuple[str, int]) -> str:
    return f"{case[0]}-{case[1]}mb"


F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize("case", [*CASES, *I_CASES], ids=_ids)
def test_the_last_stage_has_the_whole_models_loss(results, case):
    first, last = results[0][(*case, F32)], results[1][(*case, F32)]
    assert first["loss"] == [None] * ADAMW_STEPS
    assert last["loss"][0] < LOSS_RTOL, last["loss"]


@pytest.mark.parametrize("case", [*CASES, *I_CASES], ids=_ids)
def test_every_parameter_gets_the_whole_models_gradient(results, case):
    names = [r[(*case, F32)]["names"] for r in results]
    whole = sorted(n for n, _ in Llama(_config(), seed=0).named_parameters())
    assert sorted(names[0] + names[1]) == whole  # every parameter on exactly one stage
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
    for r in results:
        assert r[(*case, F32)]["grad"][0] < TOL, r[(*case, F32)]["grad"]


@pytest.mark.parametrize("case", [*CASES, *I_CASES], ids=_ids)
def test_adamw_steps_keep_the_pipeline_equal_to_the_whole_model(results, case):
    """In float64: Adam divides by sqrt(v) + eps, which turns fp32's 1e-8 rounding
    difference between microbatched and whole-batch gradients, where a gradient is near
    eps, into parameter differences of ~1e-5 after one step at lr 1e-2 (seen: up to 7e-5).
    The losses stay fp32 (causal_lm_loss computes in fp32)."""
    for r in results:
        assert max(r[(*case, F64)]["grad"]) < TOL, r[(*case, F64)]["grad"]
        assert max(r[(*case, F64)]["param"]) < TOL, r[(*case, F64)]["param"]
    assert max(results[1][(*case, F64)]["loss"]) < LOSS_RTOL, results[1][(*case, F64)]["loss"]


@pytest.mark.parametrize("case", [*CASES, *I_CASES], ids=_ids)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_eval_loss_is_the_whole_models_loss(results, case, dtype):
    assert results[0][(*case, dtype)]["eval"] is None
    assert results[1][(*case, dtype)]["eval"] < LOSS_RTOL
    for r in results:  # forward only: no parameter got a gradient
        assert r[(*case, dtype)]["eval_grads"] == []


@pytest.mark.parametrize("case", I_CASES, ids=_ids)
def test_interleaved_ranks_hold_every_other_chunk(results, case):
    """Interleaved 1F1B with 2 chunks per rank over 4 blocks: rank 0 holds the embeddings
    and blocks 0 and 2, rank 1 blocks 1 and 3 and the head (the equalities above hold
    for these cases too)."""
    blocks = [{n.split(".")[1] for n in r[(*case, F32)]["names"] if n.startswith("layers.")}
              for r in results]
    assert blocks == [{"0", "2"}, {"1", "3"}]
    assert "tok_embeddings.weight" in results[0][(*case, F32)]["names"]
    assert "output.weight" in results[1][(*case, F32)]["names"]


needs_transformers = pytest.mark.skipif(
    not transformers_available(),
    reason="transformers is not installed; Hugging Face stages need the hf extra "
           "(pip install -e '.[hf]')")


@needs_transformers
@pytest.mark.parametrize("case", HF_CASES, ids=_ids)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_hf_stages_equal_the_whole_hf_model(results, case, dtype):
    """A Hugging Face Llama in 2 stages: the last stage's loss, every parameter's gradient
    (each parameter on exactly one stage, under its name in the whole model) and, in
    float64, the parameters after AdamW steps equal the unpipelined model's; eval_loss too."""
    key = ("hf", *case, dtype)
    names = [r[key]["names"] for r in results]
    whole = sorted(n for n, _ in _hf().named_parameters())
    assert sorted(names[0] + names[1]) == whole
    assert "hf.model.embed_tokens.weight" in names[0] and "hf.lm_head.weight" in names[1]
    assert "hf.model.norm.weight" in names[1]
    assert results[0][key]["loss"] == [None] * ADAMW_STEPS
    steps = ADAMW_STEPS if dtype == F64 else 1  # fp32: see the AdamW test above
    assert max(results[1][key]["loss"][:steps]) < LOSS_RTOL, results[1][key]["loss"]
    for r in results:
        assert max(r[key]["grad"][:steps]) < TOL, r[key]["grad"]
        if dtype == F64:
            assert max(r[key]["param"]) < TOL, r[key]["param"]
        assert r[key]["eval_grads"] == []
    assert results[0][key]["eval"] is None and results[1][key]["eval"] < LOSS_RTOL


@needs_transformers
@pytest.mark.parametrize("model_type", HF_PIPELINE_TYPES)
@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_hf_stages_chained_in_one_process_give_the_models_logits(model_type, pp_size):
    """Every supported model type, with sliding-window attention where it has one (Mistral
    on every layer, Qwen2 past layer 1: a window of 5 tokens over 16 changes the logits,
    checked below), split into 1 to 3 stages: bitwise the whole model's logits."""
    changes = {"num_hidden_layers": 3}
    if model_type == "mistral":
        changes["sliding_window"] = 5
    if model_type == "qwen2":
        changes.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    model = _hf(model_type, **changes)
    tokens, _ = _batch(0)
    h = tokens
    for s in range(pp_size):
        stage = build_stage(model, s, pp_size)
        assert isinstance(stage, HFStage)
        h = stage(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
    if model_type in ("mistral", "qwen2"):  # the window matters: a full mask differs
        full = _hf(model_type, num_hidden_layers=3)
        assert (full(tokens) - model(tokens)).abs().max() > 1e-3


@needs_transformers
def test_hf_stages_share_the_models_parameters_under_its_names():
    model = _hf(num_hidden_layers=3)
    stages = [HFStage(model, s, 2) for s in range(2)]
    assert [list(s.layer_ids) for s in stages] == [[0, 1], [2]]
    assert [s.block_offset for s in stages] == [0, 2]
    whole = dict(model.named_parameters())
    seen = {}
    for stage in stages:
        assert stage.blocks() == [model.hf.model.layers[i] for i in stage.layer_ids]
        for name, p in stage.named_parameters():
            assert p is whole[name]
            seen[name] = p
    assert seen.keys() == whole.keys()
    assert stages[0].hf.lm_head is None and stages[0].hf.model.norm is None
    assert stages[1].hf.model.embed_tokens is None
    for stage in stages:  # the rotary tables: buffers, on every stage
        assert stage.hf.model.rotary_emb is model.hf.model.rotary_emb


@needs_transformers
def test_hf_tied_embeddings_and_other_model_types_are_refused():
    with pytest.raises(ValueError, match=r"dist\.pp_size = 2 needs untied .*"
                                         r"tie_word_embeddings"):
        HFStage(_hf(tie_word_embeddings=True), 0, 2)
    HFStage(_hf(tie_word_embeddings=True), 0, 1)  # one stage: the whole model
    with pytest.raises(ValueError, match=r"model_type llama, mistral, qwen2, qwen3; .*"
                                         r'"gpt2" \(use dist\.pp_size = 1\)'):
        check_hf_pipeline("gpt2")
    with pytest.raises(TypeError, match=r"editrain's Llama or a Hugging Face model"):
        build_stage(torch.nn.Linear(2, 2), 0, 2)


# ----------------------------------------------------------------------------- no spawn
def test_stage_layers_splits_evenly_earlier_stages_first():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert stage_layers(6, 1) == [range(0, 6)]


@pytest.mark.parametrize(("pp_size", "said"), [
    (0, "must be >= 1, got 0"), (-1, "must be >= 1, got -1"),
    (5, "must be at most the model's number of layers (4): every stage holds at least one "
        "block; got 5"),
    (2.0, "expected an integer, got 2.0"), (True, "expected an integer, got true")])
def test_stage_layers_refuses_a_bad_pp_size(pp_size, said):
    with pytest.raises(ValueError) as e:
        stage_layers(4, pp_size)
    assert str(e.value) == f"dist.pp_size: {said}"


@pytest.mark.parametrize(("option", "call"), [
    ("dist.pp_size", lambda v: stage_layers(4, v)),
    ("dist.pp_microbatches", lambda v: check_microbatches(4, v, "gpipe", 2)),
    ("dist.pp_stages_per_rank", lambda v: check_microbatches(4, 2, INTERLEAVED, 2, v)),
    ("dist.pp_size", lambda v: LlamaStage(Llama(_config(), seed=0), 0, v)),
    ("dist.pp_stages_per_rank",
     lambda v: LlamaStage(Llama(_config(), seed=0), 0, 2, stages_per_rank=v)),
])
def test_pipeline_sizes_take_numpy_integers_and_are_refused_as_the_options_are(option, call):
    """The pipeline's sizes refused numpy integers ("dist.pp_microbatches must be a
    positive integer, got np.int64(2)") that init_mesh and the config options take, and
    worded a bool or float their own way; one check now (errors.plain_scalar), in the
    words of the config option."""
    np = pytest.importorskip("numpy")
    call(np.int64(2))
    call(np.int32(2))
    for wrong in (True, 2.0, np.float64(2.0), "2"):
        with pytest.raises(ValueError) as e:
            call(wrong)
        with pytest.raises(ValueError) as config:
            load_config(None, {"dist": {option.split(".")[1]: wrong}})
        assert str(e.value) == str(config.value)
        assert str(e.value).startswith(f"{option}: expected an integer, got ")


def test_a_stage_keeps_its_numpy_sizes_as_plain_ints():
    np = pytest.importorskip("numpy")
    stage = LlamaStage(Llama(_config(), seed=0), np.int64(1), np.int64(2),
                       stages_per_rank=np.int64(1))
    assert [type(x) for x in (stage.stage, stage.pp_size, stage.stages_per_rank)] == [int] * 3


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
    with pytest.raises(ValueError, match=r"stage: must be in \[0, 1\] \(dist\.pp_size = 2\)"):
        LlamaStage(model, 2, 2)


def test_more_stages_than_layers_are_refused():
    model = Llama(_config(n_layers=2), seed=0)
    with pytest.raises(ValueError, match=r"dist\.pp_size"):
        LlamaStage(model, 0, 3)


@pytest.mark.parametrize(("batch", "n_mb", "schedule", "pp", "pattern"), [
    (4, 3, "gpipe", 2, r"dist\.pp_microbatches \(3\) must divide the batch size \(4\)"),
    (4, 0, "gpipe", 2, r"dist\.pp_microbatches: must be >= 1, got 0"),
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


# ------------------------------------------------------------------ interleaved, no spawn
def _chain(model: torch.nn.Module, pp_size: int, chunks: int, tokens: torch.Tensor
           ) -> torch.Tensor:
    """The pipeline's chunks in forward order in one process: chunk ``i`` of the
    pipeline is chunk ``i // pp_size`` of rank ``i % pp_size``."""
    stages = [build_stage(model, r, pp_size, chunks) for r in range(pp_size)]
    h = tokens
    for i in range(pp_size * chunks):
        h = stages[i % pp_size](h, chunk=i // pp_size)
    return h


@pytest.mark.parametrize("kind", ["llama", "hf"])
@pytest.mark.parametrize(("n_layers", "pp_size", "chunks"), [(4, 2, 2), (5, 2, 2), (6, 2, 3)])
def test_interleaved_chunks_chained_give_the_models_logits(kind, n_layers, pp_size, chunks):
    if kind == "hf" and not transformers_available():
        pytest.skip("transformers is not installed (the hf extra)")
    model = (_hf(num_hidden_layers=n_layers) if kind == "hf"
             else Llama(_config(n_layers=n_layers), seed=0))
    tokens, _ = _batch(0)
    torch.testing.assert_close(_chain(model, pp_size, chunks, tokens), model(tokens),
                               rtol=0, atol=0)


def test_interleaved_stage_holds_every_pp_size_th_chunk_under_the_models_names():
    model = Llama(_config(n_layers=5), seed=0)
    stages = [LlamaStage(model, r, 2, stages_per_rank=2) for r in range(2)]
    # 4 chunks of 5 blocks: [0, 1], [2], [3], [4]; rank 0 holds chunks 0 and 2
    assert [s.chunks for s in stages] == [[0, 2], [1, 3]]
    assert [s.chunk_layers for s in stages] == [[range(0, 2), range(3, 4)],
                                                [range(2, 3), range(4, 5)]]
    assert [s.block_ids for s in stages] == [[0, 1, 3], [2, 4]]
    assert stages[0].blocks() == [model.layers[i] for i in (0, 1, 3)]
    whole = dict(model.named_parameters())
    for stage in stages:
        names = dict(stage.named_parameters())
        assert all(p is whole[n] for n, p in names.items())
        # each chunk module owns exactly its chunk's parameters; together the stage's
        chunk_params = [list(c.parameters()) for c in stage.chunk_modules()]
        owned = [id(p) for ps in chunk_params for p in ps]
        assert sorted(owned) == sorted(id(p) for p in names.values())
        assert len(owned) == len(set(owned))
        # the chunk modules are not submodules: the stage's names and state stay the model's
        assert dict(stage.named_parameters()).keys() == names.keys()
        assert all(not k.startswith("_") for k in stage.state_dict())
    first_chunk = {id(p) for p in stages[0].chunk_modules()[0].parameters()}
    assert id(model.tok_embeddings.weight) in first_chunk
    last_chunk = {id(p) for p in stages[1].chunk_modules()[1].parameters()}
    assert id(model.output.weight) in last_chunk and id(model.norm.weight) in last_chunk


def test_interleaved_units_are_named_by_the_blocks_model_indices():
    from editrain.sync.setup import unit_modules

    model = Llama(_config(n_layers=4), seed=0)
    stages = [LlamaStage(model, r, 2, stages_per_rank=2) for r in range(2)]
    names = [[n for n, _ in unit_modules(s, s.blocks())] for s in stages]
    assert names == [["tok_embeddings", "block0", "block2"], ["block1", "block3", "output"]]


def test_chunk_forward_enters_the_stages_forward_hooks():
    """The sync engine's root unit is a forward pre-hook on the stage: every chunk's
    forward (what torch's schedule calls) runs through the stage's forward."""
    stage = LlamaStage(Llama(_config(n_layers=4), seed=0), 0, 2, stages_per_rank=2)
    seen = []
    stage.register_forward_pre_hook(lambda module, args: seen.append(module))
    tokens, _ = _batch(0)
    h = stage.chunk_modules()[0](tokens)
    stage.chunk_modules()[1](h)
    assert seen == [stage, stage]


@pytest.mark.parametrize(("args", "pattern"), [
    ((4, 2, "interleaved-1f1b", 2, 1), r"dist\.pp_stages_per_rank: must be >= 2 "
                                       r"with dist\.pp_schedule = 'interleaved-1f1b'"),
    ((4, 2, "1f1b", 2, 2), r"dist\.pp_stages_per_rank = 2 needs dist\.pp_schedule = "
                           r"'interleaved-1f1b'"),
    ((10, 5, "interleaved-1f1b", 2, 2), r"multiple of its rounds, .* = 2; got "
                                        r"dist\.pp_microbatches = 5 .*fit: 1, 2, 10\)"),
])
def test_bad_interleaved_settings_name_the_option(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_microbatches(*args)


def test_interleaved_microbatches_count_gradient_accumulation():
    check_microbatches(6, 3, "interleaved-1f1b", 2, 2)  # 3 microbatches: one round
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps x "
                                         r"dist\.pp_microbatches = 3 x 3 = 9"):
        check_microbatches(6, 3, "interleaved-1f1b", 2, 2, accumulation=3)
    for n in (1, 2, 4):  # what the spawned cases run
        check_microbatches(4, n, "interleaved-1f1b", 2, 2)


def test_interleaved_needs_a_block_per_chunk_and_a_known_chunk():
    with pytest.raises(ValueError, match=r"dist\.pp_size x dist\.pp_stages_per_rank "
                                         r"\(2 x 3\) must be at most .* layers \(4\)"):
        LlamaStage(Llama(_config(n_layers=4), seed=0), 0, 2, stages_per_rank=3)
    stage = LlamaStage(Llama(_config(n_layers=4), seed=0), 0, 2, stages_per_rank=2)
    with pytest.raises(ValueError, match=r"chunk: must be in \[0, 1\]"):
        stage(_batch(0)[0], chunk=2)

