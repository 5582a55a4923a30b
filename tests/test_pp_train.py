"""`editrain train --dist.pp_size`: the trainer on a ("sync", "pp", "shard", "tp") mesh.

Pipeline stages change how a replica computes, not what: every stage of a pipeline reads
the same batches (their data rank is the replica's shard), the step's loss is the last
stage's, clipping sums the gradient norm over every stage and evaluation runs the
validation split through the pipeline. A run with 2 stages per replica must follow the
run without stages step by step (to float noise: the microbatches' mean loss is rounded
differently from the whole batch's), resume bitwise from its own checkpoints, and resume
elastically on fewer replicas from the anchors. Bad settings are refused before any
worker starts, naming the option.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from editrain.checkpoint import list_checkpoints
from editrain.safe_load import read_metadata
from tests.test_checkpoint import (
    RESUME_VAL_TOL,
    final_val,
    rows,
    step_losses,
    train,
    train_here,  # noqa: F401 (a fixture: in-process train)
)
from tests.tolerance import RUN_LOSS_RTOL, rel_diff, worst_rel_diff

UNTIED = ["--model.tie_embeddings", "false"]
COMMON = [*UNTIED, "--steps", "10", "--sync.local_sgd_sync_interval", "4",
          "--train.grad_clip", "0.5", "--sync.clip_pseudo_grad", "0.5",
          "--sync.ewma_warmup_steps", "1", "--sync.outer_optim_class", "adam",
          "--train.eval_every", "5", "--checkpoint.every", "5", "--checkpoint.keep", "5"]
"""Clipping on (train.grad_clip 0.5 bites at these losses), the penalty's clipping and
detector, Adam as the outer optimizer (its per-unit step counter is a scalar the engine
saves per unit: the key that would collide between stages)."""
BLOCKS = ["--model.n_layers", "4"]
"""4 blocks, as interleaved 1F1B needs for 2 chunks per rank. A 1F1B case whose
interleaved twin has the same run without stages (edit_2x2 and interleaved_2x2,
tp_1x2x1x2 and interleaved_tp) has 4 blocks too, so that the ``runs`` fixture trains that
run once for both."""
PLAIN = ["--nproc", "2", "--shard-size", "1", *COMMON, *BLOCKS]
PP_RUN = ["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2", *COMMON, *BLOCKS]
"""2 replicas x 2 stages (1F1B, 2 microbatches by default), and the same 2 replicas
without stages."""
TOL = RUN_LOSS_RTOL  # relative: see its docstring


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


@pytest.fixture(scope="module")
def runs(cache: Path, tmp_path_factory):
    """``get(*args)``: the directory of a run with these arguments, trained on first use."""
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


AEDIT = [*UNTIED, "--steps", "10", "--method", "aedit", "--sim.step_schedule=[2,3]",
         "--sync.ewma_warmup_steps", "1", "--train.gradient_accumulation_steps", "2",
         "--train.grad_clip", "0.5", "--train.eval_every", "4"]
SHARDED = [*UNTIED, "--steps", "8", "--method", "diloco", "--sync.local_sgd_sync_interval",
           "3", "--train.grad_clip", "0.5", "--train.eval_every", "4"]
INTERLEAVED = ["--dist.pp_schedule", "interleaved-1f1b", "--dist.pp_stages_per_rank", "2",
               "--dist.pp_microbatches", "4"]
"""Interleaved 1F1B: 2 chunks per rank over 4 blocks (rank 0 holds blocks 0 and 2, rank 1
blocks 1 and 3), 4 microbatches (2 rounds)."""
TP_PLAIN = ["--nproc", "2", "--shard-size", "1", "--tp-size", "2", *SHARDED, *BLOCKS]
TP_PP = ["--nproc", "4", "--shard-size", "1", "--tp-size", "2", "--dist.pp_size", "2",
         *SHARDED, *BLOCKS]
"""One replica of 2 tp ranks without stages, and of 2 stages of 2 tp ranks each (1F1B)."""
CASES = {
    # name: (the run without stages, the same with 2 stages per replica)
    "edit_2x2": (PLAIN, PP_RUN),
    # A-EDiT (each replica evaluates over its own ranks: every stage of it), gradient
    # accumulation (2 micro-batches through the schedule as one batch), GPipe with one
    # microbatch per micro-batch
    "aedit_gpipe_accum": (["--nproc", "2", "--shard-size", "1", *AEDIT],
                          ["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2",
                           "--dist.pp_schedule", "gpipe", "--dist.pp_microbatches", "1",
                           *AEDIT]),
    # bf16 (FSDP2's mixed precision): bf16 activations and logits cross the stages (the
    # schedule's buffers are built in the compute dtype)
    "bf16_2x2": (["--nproc", "2", "--shard-size", "1", *SHARDED, "--train.precision", "bf16"],
                 ["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2", *SHARDED,
                  "--train.precision", "bf16"]),
    # interleaved 1F1B: the engine's layer-wise hooks see the chunks' forwards interleave
    "interleaved_2x2": (PLAIN, [*PP_RUN, *INTERLEAVED]),
    # one replica of 2 stages of 2 FSDP2 shards: clipping over DTensor pieces
    "sharded_1x2x2": (["--nproc", "2", "--shard-size", "2", *SHARDED],
                      ["--nproc", "4", "--shard-size", "2", "--dist.pp_size", "2",
                       *SHARDED]),
    # interleaved 1F1B on FSDP2 in bf16 (one replica of 2 ranks x 2 chunks of 2 shards)
    # and on tensor parallelism (2 ranks x 2 chunks of 2 tp ranks)
    "interleaved_sharded_bf16": (["--nproc", "2", "--shard-size", "2", *SHARDED, *BLOCKS,
                                  "--train.precision", "bf16"],
                                 ["--nproc", "4", "--shard-size", "2", "--dist.pp_size", "2",
                                  *SHARDED, *BLOCKS, *INTERLEAVED,
                                  "--train.precision", "bf16"]),
    "interleaved_tp": (TP_PLAIN, [*TP_PP, *INTERLEAVED]),
    # one replica of 2 stages of 2 tp ranks: a norm weight held alike by tp peers counts
    # once in the clipping norm, evaluation counts tp rank 0 of the last stage
    "tp_1x2x1x2": (TP_PLAIN, TP_PP),
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_pp_run_follows_the_run_without_pp(runs, name: str) -> None:
    plain, pp = (runs(*args) for args in CASES[name])
    # A-EDiT's 10 steps with plain outer SGD (its default since #35; Nesterov momentum
    # amplified the first outer steps) take the loss down by about 0.04 here.
    _assert_follows(name, plain, pp, learns=0.02 if name.startswith("aedit") else 0.05)


HF_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 512, "max_position_embeddings": 64, "tie_word_embeddings": False}
"""A tiny Hugging Face LlamaForCausalLM, untied (4 layers: 2 per stage)."""


def _default_preset() -> str:
    from editrain.config.schema import ModelSection

    return ModelSection().preset


def _hf_config(path: Path, **changes: object) -> str:
    path.write_text(json.dumps({**HF_LLAMA, **changes}))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("variant", ["2x2", "interleaved_sharded_bf16"])
def test_hf_pp_run_follows_the_run_without_pp(runs, tmp_path_factory, variant: str) -> None:
    """``--model.hf_config`` split into stages (HFStage): 2 replicas x 2 stages, and one
    replica of 2 ranks x 2 interleaved chunks of 2 FSDP2 shards in bf16; each follows
    the same Hugging Face model's run without stages, as the built-in Llama's do. Its
    0.02-std initialisation starts at the uniform loss and learns slowly through these
    clipped syncs: the validation loss drops 0.029 in 10 steps (with a 2-step warm-up),
    so "it learns" asks for 0.02 here."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    # The shape comes from the config.json: the base arguments' preset (tiny) is put back
    # to the default, as the loader refuses a preset set beside model.hf_config.
    config = [_hf_config(tmp_path_factory.mktemp("hf") / "config.json"), "--model.preset",
              _default_preset()]
    if variant == "2x2":
        hf = ["--model.hf_config", *config, *COMMON[len(UNTIED):],
              "--train.warmup_steps", "2"]
        plain = runs("--nproc", "2", "--shard-size", "1", *hf)
        pp = runs("--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2", *hf)
    else:
        # (the default warm-up: with a 2-step one bf16's rounding drifts the two runs
        # apart by 1.7e-4 (2.7e-5 relative) by step 8, too close to TOL; 9e-5 with it)
        hf = ["--model.hf_config", *config, *SHARDED[len(UNTIED):], "--train.precision",
              "bf16"]
        plain = runs("--nproc", "2", "--shard-size", "2", *hf)
        pp = runs("--nproc", "4", "--shard-size", "2", "--dist.pp_size", "2", *hf,
                  *INTERLEAVED)
    _assert_follows(f"hf_{variant}", plain, pp, learns=0.02)


def _assert_follows(name: str, plain: Path, pp: Path, learns: float = 0.05) -> None:
    """The pipelined run ``pp`` follows ``plain`` to TOL per step and per evaluation, on
    the same tokens, and learns (its final validation loss at least ``learns`` below the
    first)."""
    a, b = step_losses(plain), step_losses(pp)
    assert sorted(a) == sorted(b) and len(a) >= 8
    worst = worst_rel_diff(b, a)
    assert worst < TOL, f"{name}: step losses differ by {worst:.3g} relative"
    val_a = {r["step"]: r["val_loss"] for r in rows(plain) if "val_loss" in r}
    val_b = {r["step"]: r["val_loss"] for r in rows(pp) if "val_loss" in r}
    assert sorted(val_a) == sorted(val_b) and len(val_a) >= 3
    assert worst_rel_diff(val_b, val_a) < TOL
    assert rel_diff(final_val(pp), final_val(plain)) < TOL
    sa, sb = _summary(plain), _summary(pp)
    assert sb["pp_size"] == 2 and "pp_size" not in sa
    # the same tokens: the stages of a pipeline do not count twice
    assert sb["tokens_processed"] == sa["tokens_processed"]
    assert sb["tokens"] == sa["tokens"]
    assert sb["val_tokens"] == sa["val_tokens"]
    assert sb["num_syncs"] == sa["num_syncs"]
    assert final_val(pp) < val_b[0] - learns  # it learns


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pp_checkpoint_resumes_bitwise(cache: Path, tmp_path: Path, runs) -> None:
    """Saved mid-run (the first sync point after step 5) on a (2, 2, 1, 1) mesh; the
    resumed run equals the uninterrupted one bitwise. The engine's keys are global (each
    stage's units by their names in the whole model). A run with another pp size is
    refused."""
    full = runs(*PP_RUN)
    first = list_checkpoints(full)[0]
    marker = json.loads((first / "editrain.json").read_text())
    assert marker["topology"] == [2, 2, 1, 1] and marker["pp_size"] == 2
    keys = set(read_metadata(first).state_dict_metadata)
    units = {k.split(".")[2] for k in keys if k.startswith("engine.units.")}
    assert units == {"root", "tok_embeddings", "block0", "block1", "block2", "block3",
                     "output"}, units
    # every parameter of the whole model, once, under its own name
    model = {k.split(".", 2)[2] for k in keys if k.startswith("replica0.model.")}
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= model
    assert any(k.startswith("layers.0.") for k in model)
    assert any(k.startswith("layers.1.") for k in model)
    _resumes_bitwise(cache, tmp_path, full, PP_RUN, marker["step"])
    # (given explicitly: a resume takes what it does not give from the run it resumes)
    out = train(cache, tmp_path / "other", *PLAIN, "--dist.pp_size", "1", "--resume",
                str(first), check=False)
    assert out.returncode != 0
    assert "dist.pp_size: checkpoint has 2, this run has 1" in out.stderr


def _resumes_bitwise(cache: Path, tmp_path: Path, full: Path, args: tuple[str, ...] | list,
                     step: int) -> None:
    """Resumed from ``full``'s first checkpoint (saved at ``step``) with ``args``, the run
    equals ``full`` bitwise from there on."""
    resumed = tmp_path / "resumed"
    train(cache, resumed, *args, "--resume", str(list_checkpoints(full)[0]))
    a, b = step_losses(full), step_losses(resumed)
    assert sorted(b) == list(range(step + 1, 11)) and len(b) >= 2
    for s, loss in b.items():
        assert loss == a[s], (s, loss, a[s])  # bitwise
    assert final_val(resumed) == final_val(full)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_interleaved_checkpoint_resumes_bitwise(cache: Path, tmp_path: Path, runs) -> None:
    """Interleaved 1F1B (2 chunks per rank, rank 0 holding blocks 0 and 2): the engine's
    units are keyed by their blocks' indices in the whole model, the resumed run equals
    the uninterrupted one bitwise, and a run with another number of chunks per rank is
    refused."""
    args = CASES["interleaved_2x2"][1]
    full = runs(*args)
    first = list_checkpoints(full)[0]
    marker = json.loads((first / "editrain.json").read_text())
    assert marker["pp_stages_per_rank"] == 2
    keys = set(read_metadata(first).state_dict_metadata)
    units = {k.split(".")[2] for k in keys if k.startswith("engine.units.")}
    assert units == {"root", "tok_embeddings", "block0", "block1", "block2", "block3",
                     "output"}, units
    _resumes_bitwise(cache, tmp_path, full, args, marker["step"])
    one_chunk = [*PP_RUN, "--dist.pp_microbatches", "4", "--dist.pp_schedule", "1f1b",
                 "--dist.pp_stages_per_rank", "1"]  # given: a resume takes the run's else
    out = train(cache, tmp_path / "other", *one_chunk, "--resume", str(first), check=False)
    assert out.returncode != 0
    assert "dist.pp_stages_per_rank: checkpoint has 2, this run has 1" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sharded", [False, True], ids=["1x2x1", "1x2x2"])
def test_pp_checkpoint_resumes_elastically_on_fewer_replicas(cache: Path, tmp_path: Path,
                                                            runs, sharded: bool) -> None:
    """Saved on 2 replicas x 2 stages, resumed on 1 replica x 2 stages (of 1 rank, or of 2
    FSDP2 shards: DCP re-shards every stage's pieces): each stage reads
    its own units' state (the engine's plain state of a rank of the same stage); the global
    model comes back (the validation loss saved at that step, up to reduction order) and
    training goes on."""
    src = runs(*PP_RUN)
    first = list_checkpoints(src)[0]
    step = json.loads((first / "editrain.json").read_text())["step"]
    dst = tmp_path / "dst"
    mesh = ["--nproc", "4", "--shard-size", "2"] if sharded else ["--nproc", "2",
                                                                    "--shard-size", "1"]
    train(cache, dst, *mesh, "--dist.pp_size", "2", *COMMON, *BLOCKS, "--resume",
          str(first))
    resume_row = next(r for r in rows(dst) if r.get("event") == "elastic_resume")
    saved_val = next(r["val_loss"] for r in rows(src) if r.get("step") == step
                     and "val_loss" in r)
    assert resume_row["val_loss"] == pytest.approx(saved_val, abs=RESUME_VAL_TOL)
    assert sorted(step_losses(dst)) == list(range(step + 1, 11))
    assert final_val(dst) < saved_val + 0.05


# ---------------------------------------------------------------------------- bad input
BAD = {
    # (arguments, words the one error line must hold)
    "layers": (["--nproc", "6", "--shard-size", "1", "--dist.pp_size", "3", *UNTIED],
               ["dist.pp_size", "number of layers (2)", "got 3"]),
    "world": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "3",
               "--model.n_layers", "3", "--dist.pp_microbatches", "4", *UNTIED],
              ["dist.pp_size=3", "world size 4", "1, 2, 4"]),
    "shards": (["--nproc", "4", "--shard-size", "4", "--dist.pp_size", "2", *UNTIED],
               ["dist.shard_size=4", "dist.pp_size = 2", "1, 2"]),
    "tied": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2"],
             ["model.tie_embeddings", "untied", "dist.pp_size = 2"]),
    "microbatches": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2", *UNTIED,
                      "--dist.pp_microbatches", "3"],
                     ["dist.pp_microbatches (3)", "must divide", "batch size (4)"]),
    "microbatches_default": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2",
                              *UNTIED, "--train.batch_size", "3"],
                             ["dist.pp_microbatches", "0 means dist.pp_size (2)", "train.batch_size = 3"]),
    "1f1b": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2", *UNTIED,
              "--dist.pp_microbatches", "1"],
             ["dist.pp_schedule = '1f1b'", "dist.pp_microbatches >= dist.pp_size", "gpipe"]),
    "schedule": (["--dist.pp_schedule", "interleaved"],
                 ["dist.pp_schedule", "1f1b, gpipe", "interleaved"]),
    "pp_zero": (["--dist.pp_size", "0"], ["dist.pp_size", ">= 1"]),
    # --ft with stages: its own limits still hold, and sim.fail names a data rank
    # (replica x shard_size + shard: the stages of a replica-shard share it)
    "ft_sync": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2", *UNTIED, "--ft",
                 "--method", "sync"],
                ["dist.fault_tolerance=torchft", "sync.method=sync is synchronous"]),
    "ft_fail_rank": (["--nproc", "6", "--shard-size", "1", "--dist.pp_size", "2", *UNTIED,
                      "--ft", "--sim.fail", "3@2"],
                     ["sim.fail", "rank 3 does not exist", "from 0 to 2",
                      "3 replicas x 1 shards"]),
    "wsam": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2", *UNTIED,
              "--optim.sam", "wsam"], ["optim.sam", '"wsam"', "pipeline stages"]),
    # interleaved 1F1B
    "interleaved_chunks": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2",
                            *UNTIED, "--model.n_layers", "4",
                            "--dist.pp_schedule", "interleaved-1f1b"],
                           ["dist.pp_stages_per_rank", ">= 2", "'interleaved-1f1b'", "got 1"]),
    "chunks_without_interleaving": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size",
                                     "2", *UNTIED, "--dist.pp_stages_per_rank", "2"],
                                    ["dist.pp_stages_per_rank = 2", "'interleaved-1f1b'"]),
    "chunks_without_stages": (["--dist.pp_stages_per_rank", "2"],
                              ["dist.pp_stages_per_rank", "dist.pp_size > 1", "got 2"]),
    "interleaved_layers": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2",
                            *UNTIED, "--dist.pp_schedule", "interleaved-1f1b",
                            "--dist.pp_stages_per_rank", "2"],
                           ["dist.pp_stages_per_rank", "(2 x 2)", "number of layers (2)"]),
    "interleaved_rounds": (["--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2",
                            *UNTIED, "--model.n_layers", "4", "--train.batch_size", "10",
                            "--dist.pp_schedule", "interleaved-1f1b",
                            "--dist.pp_stages_per_rank", "2", "--dist.pp_microbatches", "5"],
                           ["dist.pp_schedule = 'interleaved-1f1b'", "multiple of its rounds",
                            "dist.pp_microbatches = 5", "fit: 1, 2, 10"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_pipeline_settings_fail_before_any_worker(name: str, cache: Path,
                                                      tmp_path: Path,
                                                      train_here) -> None:  # noqa: F811
    args, words = BAD[name]
    out = train_here(cache, tmp_path / "run", "--steps", "4", *args)
    assert out.returncode == 2, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.startswith("editrain: error: ")]
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not (tmp_path / "run").exists()


HF_BAD = {
    # (config changes, words the one error line must hold)
    "hf_tied": ({"tie_word_embeddings": True},
                ["model.hf_config", "dist.pp_size = 2", "untied",
                 "tie_word_embeddings = false"]),
    "hf_type": ({"model_type": "gpt2"},
                ["dist.pp_size > 1", "model_type llama, mistral, qwen2, qwen3", '"gpt2"']),
    "hf_layers": ({"num_hidden_layers": 1},
                  ["dist.pp_size", "number of layers (1)", "got 2"]),
}
"""``model.hf_config`` models that cannot be split into 2 stages."""


@pytest.mark.parametrize("raw", ["true", "2.0", '"2"', "1e400", "-3", "null", "[2]"])
def test_an_odd_layer_count_in_the_hf_config_is_refused_by_name(raw: str,
                                                                 tmp_path: Path) -> None:
    """num_hidden_layers is a field of a Hugging Face file, not an option: whatever JSON
    value it holds (a bool, a float, a string, 1e400 read as inf, null, a list), splitting
    the model into stages refuses it in one line naming the file and the field, never
    with a crash inside the check. (The strict reader of a Hugging Face config's numbers,
    editrain.models.hf_fields, now refuses these before the split's own check does, in its
    words; null, "not given" there, is transformers' to refuse for this field.)"""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from editrain.config import ConfigError, load_config

    layers = f'"num_hidden_layers": {HF_LLAMA["num_hidden_layers"]}'
    text = json.dumps(HF_LLAMA)
    assert layers in text
    path = tmp_path / "config.json"
    path.write_text(text.replace(layers, f'"num_hidden_layers": {raw}'))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model": {"hf_config": str(path)},
                           "dist": {"pp_size": 2, "nproc": 4, "shard_size": 1}})
    message = str(e.value)
    assert message.startswith(f"model.hf_config: \"{path}\": ") and "\n" not in message, message
    assert "num_hidden_layers" in message, message


@pytest.mark.parametrize("name", ["tied", "1f1b", "ft_fail_rank", "interleaved_rounds",
                                  "interleaved_chunks",
                                  *sorted(HF_BAD)])
def test_bad_pipeline_settings_on_the_command_line(name: str, tmp_path: Path) -> None:
    """The same, through the console script (the other cases run in this process), and
    the ``model.hf_config`` models that cannot be split."""
    from tests.test_cli import assert_fast, editrain, error_line, explain, tiny

    if name in HF_BAD:
        pytest.importorskip("transformers", reason="the hf extra is not installed")
        changes, words = HF_BAD[name]
        args = ["--model.hf_config", _hf_config(tmp_path / "config.json", **changes),
                "--nproc", "4", "--shard-size", "1", "--dist.pp_size", "2"]
    else:
        args, words = BAD[name]
    run_dir = tmp_path / "run"
    proc, elapsed = editrain("train", *tiny(tmp_path / "cache"), "--steps", "4", "--quiet",
                             "--run-dir", str(run_dir), *args, timeout=100)
    assert proc.returncode == 2, explain(proc)
    assert_fast(proc, elapsed)
    err = error_line(proc.stderr)
    for w in words:
        assert w in err, (w, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()
