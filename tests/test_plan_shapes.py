"""The planner's model is the one training builds from the same options.

``editrain plan`` (a plan file, ``--model.X`` options, ``--calibrate RUN``) and the
benchmark's predictions (``editrain.bench.plan``, through :func:`read_config`) used to take
the shape from the preset's name alone: a run trained with ``--model.n_layers 6`` was
planned with the preset's 2 blocks, and a ``model.hf_config`` or ``model.init_from`` run as
the default ``small`` preset. Each test compares the plan's parameters and sync units with
the model training's own builder makes (:func:`editrain.config.model.meta_model` on the
meta device: no memory, no weights).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from editrain.cli import main
from editrain.config import Config
from editrain.config.model import meta_model, sync_units
from editrain.config.schema import ModelSection
from editrain.errors import ConfigError
from editrain.launch.run_dir import config_text
from editrain.plan.calibrate import calibrate, read_config
from editrain.plan.inputs import ModelSpec
from editrain.plan.model import model_shape
from tests.test_plan import write_overlap_run

RUN_VOCAB = 900
"""The vocabulary the synthetic runs' tokenizer has (their summary.json's)."""


def llama_dir(path, **changes):
    """A Hugging Face LlamaForCausalLM directory's config.json (transformers' own writer)."""
    from transformers import LlamaConfig

    fields = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=5,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=128, tie_word_embeddings=False)
    LlamaConfig(**{**fields, **changes}).save_pretrained(path)
    return path


def training_config(model: ModelSection) -> Config:
    """The configuration of the synthetic run (write_overlap_run's layout: 2 replicas of
    one rank, H = 8), with ``model`` and the run's vocabulary."""
    cfg = Config()
    return dataclasses.replace(
        cfg, model=model, data=dataclasses.replace(cfg.data, vocab_size=RUN_VOCAB),
        dist=dataclasses.replace(cfg.dist, nproc=2, shard_size=1),
        sync=dataclasses.replace(cfg.sync, method="edit", local_sgd_sync_interval=8))


def write_run(path, model: ModelSection) -> Config:
    """A run directory whose config.toml is the one ``editrain train`` writes for
    ``model`` (:func:`config_text`), with a summary.json naming the tokenizer's
    vocabulary."""
    write_overlap_run(path)
    cfg = training_config(model)
    (path / "config.toml").write_text(config_text(cfg, path))
    (path / "summary.json").write_text(json.dumps({"vocab_size": RUN_VOCAB}))
    return cfg


def built(cfg: Config) -> tuple[int, int]:
    """(parameters, sync units) of the model training builds from ``cfg``."""
    return sum(p.numel() for p in meta_model(cfg).parameters()), len(sync_units(cfg))


MODELS = {
    "n_layers and dim": lambda tmp: ModelSection(preset="tiny", n_layers=6, dim=96),
    "untied with ffn_hidden and heads": lambda tmp: ModelSection(
        preset="tiny", tie_embeddings=False, ffn_hidden=200, n_heads=8, n_kv_heads=4),
    "hf_config": lambda tmp: ModelSection(
        hf_config=str(llama_dir(tmp / "hf") / "config.json")),
    "hf_config with its own head_dim": lambda tmp: ModelSection(
        hf_config=str(llama_dir(tmp / "hf", head_dim=32) / "config.json")),
    "init_from": lambda tmp: ModelSection(init_from=str(llama_dir(tmp / "hf"))),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_calibration_plans_the_model_the_run_trained(tmp_path, name):
    cfg = write_run(tmp_path / "run", MODELS[name](tmp_path))
    params, units = built(cfg)
    cal = calibrate([tmp_path / "run"])
    shape = model_shape(cal.samples[0].model)
    assert (shape.params, len(shape.units)) == (params, units)
    # The benchmark's predictions read a run's model the same way.
    _, model = read_config(tmp_path / "run")
    assert model_shape(model).params == params


def test_a_hugging_face_models_vocabulary_is_its_config_files(tmp_path):
    """The run's tokenizer (900) is smaller than the config's 1000 rows, which the model
    keeps: the plan must not shrink the embedding to the tokenizer's size."""
    write_run(tmp_path / "run", MODELS["hf_config"](tmp_path))
    _, model = read_config(tmp_path / "run")
    assert model.vocab_size is None and model_shape(model).vocab == 1000


def test_plan_options_override_the_presets_shape(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["plan", "--cluster.nodes=2", "--cluster.gpus_per_node=1",
                 "--cluster.inter_node_gbps=10", "--cluster.step_time_s=0.1",
                 "--model.preset=tiny", "--model.layers=6", "--model.dim=96",
                 "--model.vocab_size=900", "--method", "edit", "--out", str(out),
                 "--no-plot", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    cfg = training_config(ModelSection(preset="tiny", n_layers=6, dim=96))
    assert (record["model"]["params"], record["model"]["units"]) == built(cfg)


def test_plan_file_with_init_from(tmp_path):
    directory = llama_dir(tmp_path / "hf")
    cfg = training_config(ModelSection(init_from=str(directory)))
    assert model_shape(ModelSpec(init_from=str(directory))).params == built(cfg)[0]


def test_calibrating_another_model_on_the_runs_hardware(tmp_path, capsys):
    """--model.preset over a hf_config run plans the preset (the run's file left out)."""
    write_run(tmp_path / "run", MODELS["hf_config"](tmp_path))
    assert main(["plan", "--calibrate", str(tmp_path / "run"), "--model.preset=tiny",
                 "--out", str(tmp_path / "out"), "--no-plot", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["model"]["preset"] == "tiny" and record["model"]["hf_config"] is None


@pytest.mark.parametrize("fields, message", [
    ({"hf_config": "HF", "layers": 3}, "model.layers: the model's shape comes from "
     "model.hf_config"),
    ({"init_from": "DIR", "vocab_size": 512}, "model.vocab_size: the model's shape comes "
     "from model.init_from"),
    ({"preset": "tiny", "heads": 3}, "model: dim (64) must be divisible by n_heads (3)"),
    ({"params": 1e6, "layers": 2, "kv_heads": 1}, "model.kv_heads: overrides a preset's"),
    ({"preset": "tiny", "init_from": "DIR"}, "model: give exactly one of preset, "
     "hf_config, init_from or params"),
])
def test_shapes_training_would_refuse_are_refused(tmp_path, fields, message):
    directory = llama_dir(tmp_path / "hf")
    paths = {"HF": str(directory / "config.json"), "DIR": str(directory)}
    with pytest.raises(ConfigError) as e:
        ModelSpec(**{k: paths.get(v, v) if isinstance(v, str) else v
                     for k, v in fields.items()})
    assert str(e.value).startswith(message)
