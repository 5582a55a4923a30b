"""A model that cannot fit is refused before any process starts (``editrain.config.size``).

The counts are checked against real models (editrain's Llama exactly, transformers'
architectures as lower bounds, both built on the meta device); the refusal against a given
memory size, and end to end: ``editrain train`` with a shape of 10**8 layers, or a
``model.init_from`` directory whose ``config.json`` claims 10**5 layers (the most a config
may give; more is refused by the reader of its numbers), ends in one line
with exit 2 within seconds, before the corpus is read or a run directory exists (both took
more than 13 minutes without ending before).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from editrain.config import load_config, validate_world
from editrain.config import size as size_mod
from editrain.config.size import (
    check_fits,
    hf_parameters_at_least,
    host_memory,
    least_parameters,
    llama_parameters,
    weight_layers,
)
from editrain.errors import ConfigError
from editrain.models import Llama
from editrain.models.llama_config import preset_config
from tests.cli import run_cli

GIB = 2**30


@pytest.mark.parametrize("shape", [
    dict(name="tiny"), dict(name="small"), dict(name="tiny", tie_embeddings=False),
    dict(name="tiny", n_heads=8, n_kv_heads=2, ffn_hidden=100, n_layers=3),
    dict(name="1b"), dict(name="7b", vocab_size=32000)])
def test_llama_count_is_exact(shape):
    mcfg = preset_config(**shape)
    with torch.device("meta"):
        model = Llama(mcfg)
    assert llama_parameters(mcfg) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch, extra", [
    ("LlamaConfig", {"tie_word_embeddings": False}), ("Qwen2Config", {}),
    ("GPT2Config", {"n_embd": 48, "n_layer": 3, "n_head": 4}),
    ("MistralConfig", {"num_key_value_heads": 1})])
def test_hugging_face_bound_is_below_the_real_count(arch, extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, arch)(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    bound = hf_parameters_at_least(config.to_dict())
    width = config.to_dict().get("n_embd") or 32
    assert bound == width * (300 + 3)  # the embedding and one map per layer ...
    assert 0 < bound <= real  # ... never more than the model holds


def test_the_least_parameters_name_the_option():
    assert least_parameters(load_config(None, {}))[1] == "model.preset"
    params, option, rope, positions = least_parameters(
        load_config(None, {"model": {"preset": "tiny", "n_layers": 7, "dim": 128}}))
    assert option == "model.dim, model.n_layers"
    mcfg = preset_config("tiny", vocab_size=257, n_layers=7, dim=128)
    assert params == llama_parameters(mcfg)  # the vocabulary at its least: 257
    assert (rope, positions) == (4 * mcfg.max_seq_len * mcfg.head_dim, mcfg.max_seq_len)


def _cfg(**model):
    return load_config(None, {"model": model})


def test_refused_when_the_build_alone_exceeds_memory():
    cfg = _cfg(preset="tiny")
    params = least_parameters(cfg)[0]
    check_fits(cfg, 4, memory=GIB)  # 0.6M parameters fit in a GiB
    with pytest.raises(ConfigError) as e:
        check_fits(_cfg(preset="tiny", n_layers=10**8), 4, memory=GIB)
    msg = str(e.value)
    assert msg.startswith("model.n_layers: the model has at least ") and "\n" not in msg
    assert "more than this machine's 1.0 GiB" in msg
    # the bound: one rank's fp32 build, or on a CPU the local ranks' shards and gradients
    cpu = dict(dist={"device": "cpu", "nproc": 4, "shard_size": 2})
    cfg = load_config(None, {"model": {"preset": "tiny"}, **cpu})
    _, _, rope, _ = least_parameters(cfg)
    need = max(4 * params + rope, 4 * 8 * params // 2)
    check_fits(cfg, 4, memory=need)
    with pytest.raises(ConfigError, match="model.preset: .* 4 local ranks"):
        check_fits(cfg, 4, memory=need - 1)


def test_on_a_gpu_only_the_host_build_counts(monkeypatch):
    cfg = load_config(None, {"model": {"preset": "tiny"}, "dist": {"device": "auto"}})
    params, _, rope, _ = least_parameters(cfg)
    one_build = 4 * params + rope
    monkeypatch.setattr(size_mod, "_no_gpu", lambda: False)
    check_fits(cfg, 4, memory=one_build)  # the shards live on the GPUs
    monkeypatch.setattr(size_mod, "_no_gpu", lambda: True)
    with pytest.raises(ConfigError):
        check_fits(cfg, 4, memory=one_build)  # auto is the CPU here: 4 ranks' shards


def test_no_gpu_is_decided_without_torch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert size_mod._no_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert size_mod._no_gpu()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    gpu = any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()
    assert size_mod._no_gpu() is not gpu


def test_rope_tables_are_counted_and_named():
    with pytest.raises(ConfigError, match=r"model.max_seq_len: .* RoPE tables of 5.8 TiB "
                                          r"for 100,000,000,000 positions"):
        check_fits(_cfg(preset="tiny", max_seq_len=10**11), 1, memory=GIB)


def test_host_memory_takes_a_lower_container_limit(tmp_path, monkeypatch):
    physical = host_memory()
    assert physical and physical >= GIB
    limit = tmp_path / "memory.max"
    limit.write_text(f"{GIB}\n")
    monkeypatch.setattr(size_mod, "CGROUP_LIMITS", (str(limit),))
    assert host_memory() == min(physical, GIB)
    limit.write_text("max\n")  # cgroup v2's "no limit"
    monkeypatch.setattr(size_mod, "CGROUP_LIMITS", (str(limit), str(tmp_path / "none")))
    assert host_memory() == physical or physical < GIB


def test_world_check_uses_local_world_size(monkeypatch):
    """Under torchrun the ranks of this machine are LOCAL_WORLD_SIZE, not the world."""
    cfg = load_config(None, {"model": {"preset": "tiny"}, "dist": {"device": "cpu"}})
    seen = []
    monkeypatch.setattr("editrain.config.size.check_fits",
                        lambda c, local, memory=None: seen.append(local))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    validate_world(cfg, 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    validate_world(cfg, 4)
    assert seen == [2, 4]


def test_weight_layers_count_the_indices_under_one_prefix():
    assert weight_layers(["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b",
                          "model.layers.1.a", "lm_head.weight"]) == 2
    assert weight_layers(["transformer.h.0.attn", "transformer.h.11.mlp",
                          "transformer.wte"]) == 2
    assert weight_layers(["w"]) == 0


def test_fragments_check_builds_no_model_when_every_block_is_a_unit(monkeypatch):
    def no_build(cfg):
        raise AssertionError("built the model")

    monkeypatch.setattr("editrain.config.validation.sync_units", no_build)
    load_config(None, {"model": {"preset": "tiny", "n_layers": 6}, "sync": {"fragments": 6}})
    with pytest.raises(AssertionError):  # more fragments than blocks: counted on the model
        load_config(None, {"model": {"preset": "tiny", "n_layers": 6}, "sync": {"fragments": 7}})


def _refused_fast(args: list[str], tmp: Path, start: str) -> str:
    run = tmp / "run"
    t0 = time.monotonic()
    out = run_cli(["train", *args, "--run-dir", str(run),
                   "--data.cache_dir", str(tmp / "cache")], timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip()
    assert err.startswith(f"editrain: error: {start}") and "\n" not in err, err
    assert not run.exists() and not (tmp / "cache").exists()
    assert took < 60, took  # not a timing claim: the unfixed command never ended
    return err


def test_a_shape_too_large_is_refused_before_launch(tmp_path):
    err = _refused_fast(["--model.n_layers", "100000000"], tmp_path, "model.n_layers: ")
    assert "parameters" in err and "host memory" in err


def test_a_config_json_claiming_more_layers_than_its_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=64)
    good = tmp_path / "good"
    transformers.LlamaForCausalLM(config).save_pretrained(good, max_shard_size="20KB")
    for layers, name in ((10**5, "llama"), (3, "llama3")):
        bad = tmp_path / name
        shutil.copytree(good, bad)
        data = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**data, "num_hidden_layers": layers}))
        with pytest.raises(ConfigError, match=rf"model.init_from: .*config.json\" has "
                                              rf"num_hidden_layers = {layers:,}, but its "
                                              r"weights hold 2 layers"):
            load_config(None, {"model": {"init_from": str(bad)}})
    err = _refused_fast(["--model.init_from", str(tmp_path / "llama")], tmp_path / "t",
                        "model.init_from: ")
    assert "num_hidden_layers = 100,000" in err


# ------------------------------------------------------------------- sample and export
def _main(capsys, *argv) -> tuple[int, str, str]:
    from editrain.cli import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama directory with a tokenizer that names its end of text."""
    transformers = pytest.importorskip("transformers")
    from tests.test_examples import write_corpus
    from tests.test_hf_io import _save_tokenizer

    root = tmp_path_factory.mktemp("size")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    _save_tokenizer(root / "llama", write_corpus(root / "corpus.txt", lines=300))
    return root / "llama"


def _edited(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**data, **fields}))
    return dst


def test_sample_refuses_a_config_json_that_does_not_fit_its_weights(hf_dir, tmp_path,
                                                                   capsys):
    deep = _edited(hf_dir, tmp_path / "deep", num_hidden_layers=10**5)
    t0 = time.monotonic()
    code, _, err = _main(capsys, "sample", deep, "--prompt", "x")
    assert code == 2 and err.count("\n") == 1, err
    assert "sample: " in err and "num_hidden_layers = 100,000, but its weights hold 2 " \
        "layers" in err
    wide = _edited(hf_dir, tmp_path / "wide", intermediate_size=10**9)
    code, _, err = _main(capsys, "sample", wide, "--prompt", "x")
    assert code == 2 and err.count("\n") == 1, err
    assert 'tensor "model.layers.0.mlp.gate_proj.weight" has shape [64, 32], the model its ' \
        "description builds needs [1000000000, 32]" in err
    assert time.monotonic() - t0 < 60  # neither model was built for real


def test_a_checkpoints_marker_is_checked_against_its_tensors():
    """sample and export build (or describe) the model of a checkpoint's marker: its layers
    and every shape are compared with the checkpoint's tensors first."""
    from editrain.errors import CheckpointError
    from editrain.hf_checkpoint import checkpoint_model

    mcfg = preset_config("tiny", vocab_size=300, n_layers=2)
    tensors = {n: p.detach() for n, p in Llama(mcfg, seed=0).named_parameters()}
    fields = {k: getattr(mcfg, k) for k in ("vocab_size", "dim", "n_layers", "n_heads",
                                            "n_kv_heads", "ffn_hidden", "max_seq_len",
                                            "tie_embeddings")}
    model, window = checkpoint_model({"model": fields}, tensors, Path("ck"), "sample")
    assert window == mcfg.max_seq_len and model.state_dict().keys() >= tensors.keys()
    with pytest.raises(ConfigError, match=r'^export: "ck/editrain.json" has n_layers = '
                                          r"100,000, but its weights hold 2 layers"):
        checkpoint_model({"model": {**fields, "n_layers": 10**5}}, tensors, Path("ck"),
                         "export", real=False)
    with pytest.raises(CheckpointError, match=r'^sample: "ck": tensor "tok_embeddings.weight" '
                                              r"has shape \[300, 64\], the model its "
                                              r"description builds needs \[300, 4096\]"):
        checkpoint_model({"model": {**fields, "dim": 4096, "n_heads": 64, "n_kv_heads": 64}},
                         tensors, Path("ck"), "sample")
    # a field the Llama does not have, a value or a RoPE scaling it refuses: one line
    for bad, said in (({"foo": 1}, "unexpected keyword argument 'foo'"),
                      ({"n_heads": -1}, "n_heads: must be >= 1, got -1"),
                      ({"rope_scaling": {"factor": 2}}, "rope_scaling must hold exactly")):
        with pytest.raises(CheckpointError) as e:
            checkpoint_model({"model": {**fields, **bad}}, tensors, Path("ck"), "sample")
        assert str(e.value).startswith('sample: "ck/editrain.json": its model is not one '
                                       "editrain's Llama can be (") and said in str(e.value)


def test_sample_of_an_empty_prompt_starts_a_new_document(hf_dir, capsys):
    from editrain.sample import generate, load_for_sampling

    loaded = load_for_sampling(hf_dir)
    assert loaded.eos_id is not None
    new = generate(loaded.model, [loaded.eos_id], 6, eos_id=loaded.eos_id,
                   max_len=loaded.max_len)
    code, out, err = _main(capsys, "sample", hf_dir, "--prompt", "", "--max_new_tokens", "6")
    assert code == 0, err
    assert out == loaded.tokenizer.decode(new) + "\n"


@pytest.mark.parametrize("seed", ["-1", str(2**63), str(10**23)])
def test_sample_seed_out_of_range_is_refused_by_name(hf_dir, capsys, seed):
    code, _, err = _main(capsys, "sample", hf_dir, "--prompt", "x", "--seed", seed)
    assert code == 2 and err.startswith("editrain: error: sample --seed: must be in [0, ")


def test_a_llama_from_init_from_or_a_resume_counts_only_its_shards(hf_dir, tmp_path, monkeypatch):
    """``model.init_from`` of a Llama builds on the meta device and each rank materialises
    its shards only (editrain.build.materialise): the host bound is 4P / (shard x tp x
    pp)."""
    from editrain.config.model import builds_on_meta

    monkeypatch.setattr(size_mod, "_no_gpu", lambda: False)
    dist = {"device": "auto", "nproc": 4, "shard_size": 4}
    cfg = load_config(None, {"model": {"init_from": str(hf_dir)}, "dist": dist})
    assert builds_on_meta(cfg)
    params, option, rope, _ = least_parameters(cfg)
    assert option == "model.init_from"
    check_fits(cfg, 4, memory=4 * params // 4 + rope)
    with pytest.raises(ConfigError, match="every rank materialises its shards in fp32"):
        check_fits(cfg, 4, memory=4 * params // 4 + rope - 1)
    # a resume of it, or of a preset's run, too (the checkpoint's weights fill the shards);
    # a preset's run at its start builds the whole model, seeded
    resumed = dataclasses.replace(cfg, resume=str(tmp_path / "ckpt"))
    assert builds_on_meta(resumed)
    check_fits(resumed, 4, memory=4 * params // 4 + rope)
    preset = load_config(None, {"model": {"preset": "tiny"}, "dist": dist})
    p, _, r, _ = least_parameters(preset)
    assert not builds_on_meta(preset)
    with pytest.raises(ConfigError, match="builds the whole model in fp32 before sharding"):
        check_fits(preset, 4, memory=4 * p // 4 + r)
    assert builds_on_meta(dataclasses.replace(preset, resume=str(tmp_path / "ckpt")))
