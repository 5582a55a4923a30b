"""Hugging Face models: the adapter, ``--model.hf_config`` validation, and an end-to-end
``editrain train`` of a tiny ``LlamaForCausalLM`` on 2 replicas x 2 shards (gloo)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from editrain.config import ConfigError, load_config
from editrain.models.hf import HFCausalLM, check_hf_config, check_vocab
from tests.cli import run_cli
from tests.test_examples import write_corpus

pytest.importorskip(
    "transformers",
    reason="transformers is not installed; the Hugging Face adapter needs the hf extra "
           "(pip install -e '.[hf]')",
)

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "max_position_embeddings": 64, "tie_word_embeddings": False}


def write_config(path: Path, **changes: object) -> Path:
    path.write_text(json.dumps({**TINY, **changes}))
    return path


def test_adapter_logits_blocks_and_seed(tmp_path):
    cfg = write_config(tmp_path / "config.json")
    model = HFCausalLM.from_config_file(cfg, tokenizer_vocab_size=300, seed=3)
    assert model.blocks() == list(model.hf.model.layers) and len(model.blocks()) == 2
    logits = model(torch.randint(300, (2, 7)))
    assert logits.shape == (2, 7, 320) and logits.dtype == torch.float32
    again = HFCausalLM.from_config_file(tmp_path, seed=3)  # a directory holding config.json
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    before = torch.get_rng_state()
    HFCausalLM.from_config_file(cfg, seed=4)
    assert torch.equal(before, torch.get_rng_state())  # the global RNG is left alone


def test_vocab_must_cover_the_tokenizer(tmp_path):
    cfg = write_config(tmp_path / "config.json", vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size 256 .* smaller than the tokenizer's"):
        HFCausalLM.from_config_file(cfg, tokenizer_vocab_size=300)
    check_vocab(300, 300)


def test_hf_config_validation(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.hf_config: file not found"):
        check_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        check_hf_config(bad)
    bad.write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="model_type"):
        check_hf_config(bad)
    cfg = write_config(tmp_path / "config.json")
    with pytest.raises(ValueError, match="max_position_embeddings = 64"):
        check_hf_config(cfg, seq_len=65)
    check_hf_config(cfg, seq_len=64)
    # Through the run configuration: errors name the option, before any process starts.
    with pytest.raises(ConfigError, match="model.hf_config: file not found"):
        load_config(overrides={"model": {"hf_config": str(tmp_path / "missing.json")}})
    with pytest.raises(ConfigError, match="remove model.dim"):
        load_config(overrides={"model": {"hf_config": str(cfg), "dim": 64}})
    with pytest.raises(ConfigError, match="train.seq_len"):
        load_config(overrides={"model": {"hf_config": str(cfg)}, "train": {"seq_len": 128}})
    ok = load_config(overrides={"model": {"hf_config": str(cfg)}})
    assert ok.model.hf_config == str(cfg)


NO_BLOCKS = (r"describes a MambaForCausalLM, whose layers are in none of the places editrain "
             r"looks for a causal LM's transformer blocks \(model.layers, transformer.h, "
             r"model.decoder.layers, gpt_neox.layers, transformer.blocks\); editrain trains "
             r"the architectures laid out that way \(Llama, Qwen2")


@pytest.mark.parametrize("config, refusal", [
    ({"model_type": "mamba", "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 2,
      "state_size": 4}, NO_BLOCKS),
    ({"model_type": "t5", "vocab_size": 320, "d_model": 32, "d_ff": 64, "num_layers": 2,
      "num_heads": 4, "d_kv": 8}, r"describes no causal LM transformers can build \(.*T5Config"
                                  r".*\); editrain trains the decoder-only models "
                                  r"AutoModelForCausalLM builds$"),
])
def test_an_architecture_editrain_cannot_train_is_refused_before_launch(
        tmp_path, config, refusal):
    """A ``model.hf_config`` that transformers builds no causal LM from (T5), or whose model
    keeps its layers where editrain finds no transformer blocks (Mamba's
    ``backbone.layers``), is refused while the configuration is checked, in one line naming
    the option and what editrain trains. Both passed validation; every rank then failed
    once the corpus was tokenised (Mamba with find_blocks' advice for the Python API,
    ``blocks=model.my_layers``, which the command line has no option for)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"^model.hf_config: \"{path}\" {refusal}") as e:
        load_config(overrides={"model": {"hf_config": str(path)}})
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_train_hf_llama_end_to_end(tmp_path):
    cfg = write_config(tmp_path / "config.json")
    corpus = write_corpus(tmp_path / "corpus.txt")
    run = tmp_path / "run"
    cmd = ["train", "--model.hf_config", str(cfg),
           "--nproc", "4", "--shard-size", "2", "--steps", "30", "--quiet",
           "--data.path", str(corpus), "--data.vocab_size", "300",
           "--data.cache_dir", str(tmp_path / "cache"),
           "--train.seq_len", "32", "--train.batch_size", "8", "--train.eval_tokens", "1024",
           "--train.eval_every", "10", "--train.warmup_steps", "2",
           "--sync.local_sgd_sync_interval", "5", "--checkpoint.final", "false",
           "--run-dir", str(run)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_cli(cmd, env=env, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) >= 3 and val[-1] < val[0] - 1.0, val
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["num_syncs"] >= 5
    assert (summary["replicas"], summary["shard_size"]) == (2, 2)
    assert any("sync" in r for r in rows)


def test_gpt2_style_names_are_read_as_transformers_maps_them(tmp_path):
    """GPT-2's config.json names its limits ``n_positions``, ``n_head``, ``n_layer``
    (transformers' ``attribute_map``): a ``train.seq_len`` beyond ``n_positions`` is refused
    before launch (it was an IndexError in every worker), and ``dist.tp_size`` is checked
    against its 4 heads (it read 1)."""
    from editrain.config.model import heads

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 320, "n_embd": 32,
                                "n_layer": 2, "n_head": 4, "n_positions": 32}))
    with pytest.raises(ConfigError, match=r"train.seq_len: 64 exceeds n_positions = 32 of "
                                          r"model.hf_config .* \(raise it there or lower "
                                          r"train.seq_len\)"):
        load_config(None, {"model": {"hf_config": str(path)}, "train": {"seq_len": 64}})
    cfg = load_config(None, {"model": {"hf_config": str(path)}, "train": {"seq_len": 32}})
    assert heads(cfg) == (4, 4)
