"""Configuration: TOML files, command-line overrides, validation errors, TOML output and the
option surface (a frozen list, so options only change on purpose)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from editrain.config import (
    FLAGS,
    SHORTHANDS,
    Config,
    ConfigError,
    describe_options,
    dumps_toml,
    load_config,
    parse_overrides,
    to_dict,
    validate_world,
)
from editrain.sync.config import GTAConfig, SyncConfig


def cli(*argv: str) -> Config:
    """``load_config`` from command-line style arguments only."""
    overrides, rest = parse_overrides(list(argv))
    assert rest == []
    return load_config(None, overrides)


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def none_as_text(table: dict) -> dict:
    """A config table as TOML holds it: no null, so ``None`` is the string "none"."""
    return {k: "none" if v is None else v for k, v in table.items()}


# ---------------------------------------------------------------------------- loading
def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.train.steps == 80
    # Cheap evaluations during the run, the whole held-out split at the end.
    assert cfg.train.eval_tokens == 8192 and cfg.train.final_eval_tokens == 0
    assert cfg.dist.nproc == 4 and cfg.dist.shard_size == 2
    assert cfg.sync.method == "edit"
    assert cfg.quiet is False and cfg.overwrite is False and cfg.run_dir is None


def test_toml_file_sets_every_kind_of_value(tmp_path):
    path = write(tmp_path, """
quiet = true
run_dir = "runs/a"

[model]
preset = "tiny"
dim = 96

[train]
steps = 50
lr = 0.01
batch_size = 4

[data]
max_bytes = 300000

[sync]
method = "diloco"
outer_optim_kwargs = {lr = 0.5, momentum = 0.8, nesterov = true}

[sync.gta]
reducer = "gta"
density = 0.25

[sim]
straggler = ["1=2", "0=3@10-20"]
""")
    cfg = load_config(path)
    assert cfg.quiet is True and cfg.run_dir == "runs/a"
    assert cfg.model.preset == "tiny" and cfg.model.dim == 96
    assert (cfg.train.steps, cfg.train.lr, cfg.train.batch_size) == (50, 0.01, 4)
    assert cfg.data.max_bytes == 300000
    assert cfg.sync.method == "diloco"
    assert cfg.sync.outer_optim_kwargs == {"lr": 0.5, "momentum": 0.8, "nesterov": True}
    assert isinstance(cfg.sync.gta, GTAConfig)
    assert cfg.sync.gta.reducer == "gta" and cfg.sync.gta.density == 0.25
    assert cfg.sim.straggler == ["1=2", "0=3@10-20"]
    # Untouched options keep their defaults.
    assert cfg.train.seq_len == 64 and cfg.sync.gta.consensus_method == "sum"


def test_integer_is_accepted_for_a_float_option(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nlr = 1\n"))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_overrides_built_in_python_take_numpy_numbers_as_plain_ones():
    """``load_config``'s overrides from Python (the benchmarks build them) took no numpy
    integer ("expected an integer, got np.int64(50)"); now they are stored plain, as a
    file's values, and a bool is still no integer."""
    np = pytest.importorskip("numpy")
    cfg = load_config(None, {"train": {"steps": np.int64(50), "lr": np.float32(0.5)},
                             "sync": {"local_sgd_sync_interval": np.int16(5)}})
    assert type(cfg.train.steps) is int and cfg.train.steps == 50
    assert type(cfg.train.lr) is float and cfg.train.lr == 0.5
    assert type(cfg.sync.local_sgd_sync_interval) is int
    with pytest.raises(ConfigError, match=r"^train.steps: expected an integer, got true$"):
        load_config(None, {"train": {"steps": True}})


@pytest.mark.parametrize("argv", [["--train.steps=200"], ["--train.steps", "200"],
                                  ["--steps", "200"], ["--steps=200"]])
def test_cli_overrides_the_file(tmp_path, argv):
    path = write(tmp_path, "[train]\nsteps = 50\nlr = 0.01\n")
    overrides, rest = parse_overrides(argv)
    assert overrides == {"train": {"steps": 200}} and rest == []
    cfg = load_config(path, overrides)
    assert cfg.train.steps == 200
    assert cfg.train.lr == 0.01  # from the file, not overridden


@pytest.mark.parametrize("argv, said", [
    (["--overwite", "--steps", "5"], "--overwite: unknown option"),  # was: unexpected 5
    (["--steps", "5", "--overwite"], "--overwite: unknown option"),  # was: missing value
    (["--train.steps", "--quiet"], "--train.steps: missing value"),  # was: got '--quiet'
    (["--steps"], "--steps: missing value")])
def test_an_option_without_its_value_says_which_and_why(argv, said):
    """An option followed by the next option (or nothing) has no value: a misspelt flag is
    named as unknown, a real option as missing its value; the next option is never taken
    as the value."""
    with pytest.raises(ConfigError) as e:
        parse_overrides(argv)
    assert str(e.value).startswith(said)
    # values that only look like options are values
    assert parse_overrides(["--train.lr", "-1", "--data.separator", "--8<--"])[0] == {
        "train": {"lr": -1}, "data": {"separator": "--8<--"}}


def test_later_cli_value_wins():
    assert cli("--train.steps=10", "--steps", "20").train.steps == 20


def test_shorthands():
    overrides, rest = parse_overrides([
        "--steps", "7", "--nproc", "2", "--shard-size", "1", "--method", "diloco",
        "--seed", "3", "--run-dir", "out/run", "--quiet", "--overwrite",
    ])
    assert rest == []
    assert overrides == {
        "train": {"steps": 7, "seed": 3},
        "dist": {"nproc": 2, "shard_size": 1},
        "sync": {"method": "diloco"},
        "run_dir": "out/run",
        "quiet": True,
        "overwrite": True,
    }
    cfg = load_config(None, overrides)
    assert (cfg.train.steps, cfg.train.seed) == (7, 3)
    assert (cfg.dist.nproc, cfg.dist.shard_size) == (2, 1)
    assert cfg.sync.method == "diloco"
    assert cfg.run_dir == "out/run" and cfg.quiet and cfg.overwrite


def test_flags_take_an_explicit_value():
    assert cli("--quiet=false").quiet is False
    assert cli("--quiet=true").quiet is True
    cfg = cli("--quiet", "--dist.max_restarts", "2")
    assert cfg.quiet is True and cfg.dist.max_restarts == 2


def test_dashes_in_option_names_become_underscores():
    cfg = cli("--train.batch-size", "3", "--max-restarts", "1")
    assert cfg.train.batch_size == 3 and cfg.dist.max_restarts == 1


def test_positional_arguments_are_returned():
    overrides, rest = parse_overrides(["extra", "--steps", "5", "more"])
    assert overrides == {"train": {"steps": 5}}
    assert rest == ["extra", "more"]


def test_inline_table_option():
    cfg = cli("--sync.outer_optim_kwargs={lr=0.5, momentum=0.8, nesterov=true}")
    assert cfg.sync.outer_optim_kwargs == {"lr": 0.5, "momentum": 0.8, "nesterov": True}
    cfg = cli("--sync.outer_optim_kwargs", "{lr = 0.5}")
    assert cfg.sync.outer_optim_kwargs == {"lr": 0.5}


@pytest.mark.parametrize(("table", "dotted", "read"), [
    ("--model={preset='tiny', tie_embeddings=1}", "--model.tie_embeddings=1",
     lambda c: c.model.tie_embeddings),
    ("--model={preset='tiny', tie_embeddings=0}", "--model.tie_embeddings=0",
     lambda c: c.model.tie_embeddings),
    ("--model={preset='tiny', tie_embeddings='yes'}", "--model.tie_embeddings=yes",
     lambda c: c.model.tie_embeddings),
    ("--sync={cpu_offload=1}", "--sync.cpu_offload=1", lambda c: c.sync.cpu_offload),
    ("--sync={gta={reducer='gta', normalize=0}}", "--sync.gta.normalize=0",
     lambda c: c.sync.gta.normalize),
    ("--sync.gta={reducer='gta', normalize=1}", "--sync.gta.normalize=1",
     lambda c: c.sync.gta.normalize),
])
def test_a_sections_table_reads_a_flag_as_its_dotted_option_does(table, dotted, read):
    """``--model.tie_embeddings=1`` was taken (a flag's words 1/0, yes/no) while
    ``--model={tie_embeddings=1}`` was refused ("expected true or false, got 1"): one
    command line, one rule for both spellings."""
    given = ["--model.preset=tiny"] * ("preset" in table) + [
        "--sync.gta.reducer=gta"] * ("gta" in table)
    assert read(cli(table)) is read(cli(*given, dotted))


@pytest.mark.parametrize(("arg", "reason"), [
    ("--model={tie_embeddings=yes}", "Invalid value (at line 1, column 17)"),
    ("--model={n_layers=2", "Unclosed inline table"),
    ("--model={n_layers=2, n_layers=3}", "Duplicate inline table key 'n_layers'"),
    ("--sync.outer_optim_kwargs={lr=fast}", "Invalid value (at line 1, column 5)"),
    ("--sync={gta={normalize=no}}", "Invalid value"),
])
def test_an_inline_table_that_is_no_toml_says_why(arg, reason):
    """Inside braces, values are TOML, so the command line's ``yes`` or an unquoted word
    is not one: the table is read as text. The message said only "expected a table, got
    '{tie_embeddings=yes}'", which looks like one; it now gives TOML's reason, at the
    column of what the user wrote, and what a value there can be."""
    option = arg[2:].split("=")[0]
    with pytest.raises(ConfigError) as e:
        cli(arg)
    assert str(e.value).startswith(f"{option}: ") and "is not a TOML inline table" in str(e.value)
    assert reason in str(e.value) and "true or false" in str(e.value)


@pytest.mark.parametrize("argv", [["--model={tie_embeddings=2}"], ["--model.tie_embeddings=2"],
                                  ["--sync={gta={normalize=1.0}}"]])
def test_a_flag_that_is_no_word_is_refused_in_either_spelling(argv):
    with pytest.raises(ConfigError, match=r"^(model\.tie_embeddings|sync\.gta\.normalize): "
                                          r"expected true or false"):
        cli(*argv)


def test_nested_section_option():
    cfg = cli("--sync.gta.density=0.5", "--sync.gta.reducer", "gta")
    assert isinstance(cfg.sync.gta, GTAConfig)
    assert cfg.sync.gta.density == 0.5 and cfg.sync.gta.reducer == "gta"
    assert cfg.sync.gta.consensus_method == "sum"


def test_nested_override_merges_with_file(tmp_path):
    path = write(tmp_path, "[sync.gta]\nreducer = \"gta\"\ndensity = 0.3\n")
    cfg = load_config(path, parse_overrides(["--sync.gta.density=0.5"])[0])
    assert cfg.sync.gta.reducer == "gta" and cfg.sync.gta.density == 0.5


def test_none_and_lists_from_the_command_line():
    cfg = cli("--data.max_bytes", "none", "--sim.straggler", "1=2,0=3@5-10",
              "--sim.corrupt_replica", "1@3")
    assert cfg.data.max_bytes is None
    assert cfg.sim.straggler == ["1=2", "0=3@5-10"]
    assert cfg.sim.corrupt_replica == ["1@3"]
    cfg = cli("--sim.straggler", '["1=2", "0=3"]')
    assert cfg.sim.straggler == ["1=2", "0=3"]
    cfg = cli("--sim.straggler", "1=2")
    assert cfg.sim.straggler == ["1=2"]


@pytest.mark.parametrize("text", ["3,5", "[3, 5]", "3,5,"])
def test_list_of_integers_from_the_command_line(text):
    cfg = cli("--method", "aedit", "--sim.step_schedule", text)
    assert cfg.sim.step_schedule == [3, 5]


@pytest.mark.parametrize("argv, get, expected", [
    (["--run-dir", "123"], lambda c: c.run_dir, "123"),
    (["--run-dir", "2024-01-01"], lambda c: c.run_dir, "2024-01-01"),
    (["--run-dir", "1_000"], lambda c: c.run_dir, "1_000"),
    (["--sim.link_latency", "0.005"], lambda c: c.sim.link_latency, "0.005"),
    (["--data.text_field=true"], lambda c: c.data.text_field, "true"),
])
def test_text_options_keep_the_text_as_typed(argv, get, expected):
    """A string option must not be turned into a number, date or boolean first."""
    assert get(cli(*argv)) == expected


# ---------------------------------------------------------------------------- bad input
def expect_error(*names: str, argv=(), path=None):
    with pytest.raises(ConfigError) as info:
        overrides, _ = parse_overrides(list(argv))
        load_config(path, overrides)
    msg = str(info.value)
    for name in names:
        assert name in msg, f"{name!r} not in {msg!r}"
    return msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("argv, names", [
    (["--train.bogus", "3"], ["train.bogus", "steps", "batch_size", "lr"]),
    (["--bogus", "3"], ["bogus", "model", "train", "run_dir"]),
    (["--sync.gta.bogus=1"], ["sync.gta.bogus", "density"]),
    (["--optimizer.name", "adamw"], ["optimizer", "optim"]),
    (["--train.stepz=3"], ["train.stepz", "steps"]),
])
def test_unknown_option(argv, names):
    msg = expect_error(*names, argv=argv)
    assert "unknown option" in msg


def test_unknown_option_in_file(tmp_path):
    expect_error("data.vocab", "vocab_size", path=write(tmp_path, "[data]\nvocab = 3\n"))


@pytest.mark.parametrize("argv, names", [
    (["--train.steps", "abc"], ["train.steps", "integer"]),
    (["--train.steps", "1.5"], ["train.steps", "integer"]),
    (["--train.steps", "true"], ["train.steps", "integer"]),
    (["--train.lr", "fast"], ["train.lr", "number"]),
    (["--quiet=maybe"], ["quiet", "true or false"]),
    (["--sync.cpu_offload", "7"], ["sync.cpu_offload", "true or false"]),
    (["--sync.outer_optim_kwargs", "3"], ["sync.outer_optim_kwargs", "table"]),
    (["--sync.gta", "3"], ["sync.gta", "table"]),
    (["--train", "3"], ["train", "table"]),
    (["--train.precision", "[1]"], ["train.precision", "string"]),
])
def test_wrong_type(argv, names):
    expect_error(*names, argv=argv)


def test_wrong_type_in_file(tmp_path):
    expect_error("train.steps", "integer", path=write(tmp_path, '[train]\nsteps = "ten"\n'))


@pytest.mark.parametrize("option", ["train.steps", "train.batch_size", "train.seq_len",
                                    "train.gradient_accumulation_steps", "train.eval_every",
                                    "train.log_every"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_non_positive_counts(option, value):
    msg = expect_error(option, argv=[f"--{option}={value}"])
    assert ">= 1" in msg


@pytest.mark.parametrize("value", ["0", "-0.001", "0.0"])
def test_non_positive_lr(value):
    expect_error("train.lr", "> 0", argv=["--train.lr", value])


@pytest.mark.parametrize("argv, names", [
    (["--model.preset", "huge"], ["model.preset", "tiny", "small", "7b"]),
    (["--optim.name", "lion"], ["optim.name", "adamw", "agd", "sgd"]),
    (["--optim.sam", "sam"], ["optim.sam", "wsam"]),
    (["--method", "fedavg"], ["sync.method", "sync", "diloco", "edit", "aedit"]),
    (["--train.precision", "fp16"], ["train.precision", "fp32", "bf16"]),
    (["--dist.backend", "mpi"], ["dist.backend", "gloo", "nccl"]),
    (["--dist.device", "tpu"], ["dist.device", "cpu", "cuda"]),
    (["--sync.gta.density=0"], ["sync.gta.density", "(0, 1]"]),
    (["--sync.gta.density=1.5"], ["sync.gta.density", "(0, 1]"]),
    (["--sync.gta.reducer", "median"], ["sync.gta.reducer", "linear", "gta"]),
    (["--sync.local_sgd_sync_interval", "0"], ["sync.local_sgd_sync_interval", ">= 1"]),
    (["--data.vocab_size", "100"], ["data.vocab_size", "257"]),
    (["--data.val_fraction", "0.7"], ["data.val_fraction", "(0, 0.5)"]),
    (["--data.max_bytes", "0"], ["data.max_bytes", "> 0"]),
    (["--data.val_tokens", "-1"], ["data.val_tokens", ">= 0"]),
    (["--data.split_seed", "-3"], ["data.split_seed", "[0, 2^63 - 1]"]),
    (["--train.eval_tokens", "-5"], ["train.eval_tokens", ">= 0"]),
    (["--train.final_eval_tokens", "-1"], ["train.final_eval_tokens", ">= 0"]),
    (["--train.beta2", "1"], ["train.beta2", "[0, 1)"]),
    (["--train.warmup_steps", "-1"], ["train.warmup_steps", ">= 0"]),
    (["--dist.nproc", "0"], ["dist.nproc", ">= 1"]),
    (["--shard-size", "0"], ["dist.shard_size", ">= 1"]),
    (["--checkpoint.keep", "0"], ["checkpoint.keep", ">= 1"]),
    (["--sim.straggler", "1=x"], ["sim.straggler", "REPLICA=FACTOR"]),
    (["--sim.link_bandwidth", "fast"], ["sim.link_bandwidth", "100MB/s"]),
    (["--steps", "10", "--sync.local_sgd_warmup_steps", "10"],
     ["sync.local_sgd_warmup_steps", "train.steps"]),
])
def test_bad_values_name_the_option_and_what_is_allowed(argv, names):
    expect_error(*names, argv=argv)


def test_seq_len_larger_than_the_model_maximum():
    msg = expect_error("train.seq_len", "model.max_seq_len",
                       argv=["--model.preset", "tiny", "--train.seq_len", "1000"])
    assert "256" in msg  # the tiny preset's maximum
    # Raising the model's maximum makes the same length valid.
    cfg = cli("--model.preset", "tiny", "--train.seq_len", "1000", "--model.max_seq_len", "1024")
    assert cfg.train.seq_len == 1000


@pytest.mark.parametrize("world, shard, allowed", [(4, 3, "1, 2, 4"), (6, 4, "1, 2, 3, 6"),
                                                   (3, 2, "1, 3")])
def test_shard_size_must_divide_the_world_size(world, shard, allowed):
    cfg = cli("--nproc", str(world), "--shard-size", str(shard))  # valid on its own
    with pytest.raises(ConfigError) as info:
        validate_world(cfg, world)
    msg = str(info.value)
    assert "dist.shard_size" in msg and str(world) in msg and allowed in msg


@pytest.mark.parametrize("world, shard", [(4, 1), (4, 2), (4, 4), (8, 2), (1, 1)])
def test_shard_size_dividing_the_world_size_is_accepted(world, shard):
    validate_world(cli("--shard-size", str(shard)), world)


@pytest.mark.parametrize("sim, names", [
    ({"straggler": ["2=3"]}, ["sim.straggler", "replica 2", "2 replicas"]),
    ({"corrupt_replica": ["5@1"]}, ["sim.corrupt_replica", "replica 5"]),
])
def test_simulated_replicas_must_exist(sim, names):
    cfg = load_config(None, {"sim": sim})  # valid until the world size is known
    with pytest.raises(ConfigError) as info:
        validate_world(cfg, 4)  # 2 replicas x 2 shards
    for name in names:
        assert name in str(info.value)
    validate_world(load_config(None, {"sim": sim, "dist": {"shard_size": 1}}), 8)


def test_missing_config_file(tmp_path):
    expect_error("--config", "not found", path=tmp_path / "nope.toml")


def test_invalid_toml_file(tmp_path):
    expect_error("--config", "TOML", path=write(tmp_path, "[train\nsteps = 3\n"))


def test_flag_without_value_at_the_end():
    with pytest.raises(ConfigError, match="--train.steps"):
        parse_overrides(["--train.steps"])


# ---------------------------------------------------------------------------- TOML output
def busy_config() -> Config:
    """A configuration touching every kind of value (nested, inline table, lists, None)."""
    return cli(
        "--model.preset", "tiny", "--model.dim", "96", "--model.tie_embeddings", "false",
        "--data.max_bytes", "none", "--data.text_field", 'some "quoted" dir\\x',
        "--train.steps", "30", "--train.lr", "1e-4", "--optim.agd_delta", "1e-14",
        "--method", "diloco", "--sync.outer_optim_kwargs", "{lr=0.5, momentum=0.8, nesterov=true}",
        "--sync.gta.reducer", "gta", "--sync.gta.density", "0.5",
        "--sim.straggler", "1=2,0=3@5-10", "--sim.link_latency", "5ms",
        "--run-dir", "runs/x", "--quiet",
    )


def test_dumps_toml_parses_back_to_the_same_values():
    cfg = busy_config()
    data = to_dict(cfg)
    text = dumps_toml(data)
    assert text.isascii()
    parsed = tomllib.loads(text)
    for section in ("model", "data", "train", "optim", "dist", "sim", "checkpoint"):
        assert parsed[section] == none_as_text(data[section]), section
    assert parsed["sync"]["gta"] == none_as_text(data["sync"]["gta"])
    sync = {k: v for k, v in data["sync"].items() if k != "gta"}
    assert {k: v for k, v in parsed["sync"].items() if k != "gta"} == none_as_text(sync)
    assert parsed["data"]["max_bytes"] == "none" and parsed["resume"] == "none"
    assert parsed["run_dir"] == "runs/x" and parsed["quiet"] is True
    assert parsed["sync"]["outer_optim_kwargs"] == {"lr": 0.5, "momentum": 0.8, "nesterov": True}
    assert parsed["data"]["text_field"] == 'some "quoted" dir\\x'
    assert parsed["train"]["lr"] == 1e-4 and parsed["optim"]["agd_delta"] == 1e-14


@pytest.mark.parametrize("make", [Config, busy_config])
def test_dumps_toml_round_trips_through_load_config(tmp_path, make):
    cfg = make()
    path = write(tmp_path, dumps_toml(to_dict(cfg)), "config.toml")
    again = load_config(path)
    assert to_dict(again) == to_dict(cfg)
    assert again == cfg


def test_run_dir_config_toml_loads_back(tmp_path):
    """What the launcher writes into the run directory is a loadable configuration."""
    from editrain.launch.job import resolved
    from editrain.launch.run_dir import prepare_run_dir

    run_dir = tmp_path / "run"
    cfg = dataclasses.replace(busy_config(), run_dir=str(run_dir))
    prepare_run_dir(cfg, run_dir)
    loaded = load_config(run_dir / "config.toml")
    assert loaded == resolved(cfg)
    # The method's defaults were filled in, so the file says exactly what ran.
    assert loaded.sync.local_sgd_sync_interval is not None
    assert loaded.sync.outer_optim_kwargs == {"lr": 0.5, "momentum": 0.8, "nesterov": True}


# ---------------------------------------------------------------------------- option surface
FROZEN_OPTIONS = [
    "model.preset",
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_hidden",
    "model.max_seq_len",
    "model.tie_embeddings",
    "model.hf_config",
    "model.init_from",
    "data.path",
    "data.text_field",
    "data.eos",
    "data.separator",
    "data.tokenizer",
    "data.vocab_size",
    "data.val_fraction",
    "data.val_tokens",
    "data.split_seed",
    "data.max_bytes",
    "data.cache_dir",
    "train.steps",
    "train.batch_size",
    "train.seq_len",
    "train.gradient_accumulation_steps",
    "train.lr",
    "train.min_lr_ratio",
    "train.warmup_steps",
    "train.weight_decay",
    "train.beta1",
    "train.beta2",
    "train.grad_clip",
    "train.eval_every",
    "train.eval_tokens",
    "train.final_eval_tokens",
    "train.log_every",
    "train.wandb",
    "train.wandb_project",
    "train.seed",
    "train.precision",
    "optim.name",
    "optim.momentum",
    "optim.agd_delta",
    "optim.sam",
    "optim.rho",
    "optim.gamma",
    "optim.adaptive",
    "optim.decouple",
    "dist.nproc",
    "dist.shard_size",
    "dist.tp_size",
    "dist.pp_size",
    "dist.pp_schedule",
    "dist.pp_microbatches",
    "dist.pp_stages_per_rank",
    "dist.backend",
    "dist.device",
    "dist.max_restarts",
    "dist.threads_per_proc",
    "dist.comm_backend",
    "dist.fault_tolerance",
    "dist.ft_replicas",
    "dist.ft_replica_id",
    "dist.ft_lighthouse",
    "dist.ft_min_replicas",
    "dist.ft_heartbeat_timeout_s",
    "dist.ft_heartbeat_interval_s",
    "dist.ft_join_timeout_s",
    "dist.ft_timeout_s",
    "sync.method",
    "sync.local_sgd_sync_interval",
    "sync.local_sgd_warmup_steps",
    "sync.outer_optim_class",
    "sync.outer_optim_kwargs",
    "sync.cpu_offload",
    "sync.prefetch_depth",
    "sync.layerwise",
    "sync.clip_pseudo_grad",
    "sync.pseudo_gradnorm_reduce",
    "sync.weight_softmax_temperature",
    "sync.skip_anomaly",
    "sync.ewma_alpha",
    "sync.ewma_warmup_steps",
    "sync.ewma_threshold",
    "sync.local_sgd_sync_time",
    "sync.min_total_global_steps",
    "sync.use_step_weight",
    "sync.step_weight_ratio",
    "sync.overlap_steps",
    "sync.fragments",
    "sync.merge",
    "sync.merge_alpha",
    "sync.comm_dtype",
    "sync.error_feedback",
    "sync.error_decay",
    "sync.topk_chunk",
    "sync.topk_k",
    "sync.split_root",
    "sync.gta.reducer",
    "sync.gta.consensus_method",
    "sync.gta.sparsification_method",
    "sync.gta.normalize",
    "sync.gta.density",
    "sync.gta.int8_mask",
    "sim.link_bandwidth",
    "sim.link_latency",
    "sim.straggler",
    "sim.random_stall",
    "sim.corrupt_replica",
    "sim.fail",
    "sim.fail_restart_s",
    "sim.step_schedule",
    "sim.replica_offset",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.final",
    "checkpoint.export_final",
    "run_dir",
    "overwrite",
    "quiet",
    "resume",
]

FROZEN_SHORTHANDS = {
    "--steps": "train.steps",
    "--nproc": "dist.nproc",
    "--shard-size": "dist.shard_size",
    "--tp-size": "dist.tp_size",
    "--method": "sync.method",
    "--seed": "train.seed",
    "--run-dir": "run_dir",
    "--resume": "resume",
    "--max-restarts": "dist.max_restarts",
}

FROZEN_FLAGS = {"--quiet": "quiet", "--overwrite": "overwrite",
                "--ft": ("dist.fault_tolerance", "torchft")}


def test_no_new_options():
    """The option surface changes only on purpose: update this list in the same change."""
    names = [name for name, *_ in describe_options()]
    assert names == FROZEN_OPTIONS


def test_no_new_shorthands():
    assert SHORTHANDS == FROZEN_SHORTHANDS
    assert FLAGS == FROZEN_FLAGS
    for target in list(SHORTHANDS.values()) + list(FLAGS.values()):
        if isinstance(target, tuple):
            target = target[0]
        assert target in FROZEN_OPTIONS


def test_every_option_has_help_text():
    for name, tp, _default, doc in describe_options():
        assert doc.strip(), f"{name} has no help text"
        assert tp, name
        assert doc.isascii(), name


def test_every_option_is_settable_to_its_default():
    """describe_options and the parser agree: each listed option is accepted by name."""
    for name, _tp, default, _doc in describe_options():
        if default is None:
            continue
        overrides: dict = {}
        node = overrides
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = default
        assert load_config(None, overrides) == Config(), name



def test_cuda_backends_need_a_device_per_local_process(monkeypatch):
    from editrain.config import validation

    monkeypatch.setattr(validation, "cuda_device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cli("--dist.backend=nccl", "--nproc", "4").dist.backend == "nccl"
    with pytest.raises(ConfigError, match=r"dist.device=cuda: .*local process \(8\).*has 4"):
        cli("--dist.device=cuda", "--nproc", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # under torchrun: its local processes
    assert cli("--dist.device=cuda", "--nproc", "8").dist.device == "cuda"


def test_outer_optimizer_defaults_follow_the_docs():
    import warnings

    import torch

    from editrain.api import LocalSGDConfig, OuterOptimizerConfig, sync_config_from_reference

    def resolved(outer) -> dict:
        return sync_config_from_reference(LocalSGDConfig(), outer).resolve().outer_optim_kwargs

    # SGD however it is named, without kwargs: the method's own (edit and aedit: lr 1
    # without momentum, bench tune's recipe; diloco: Nesterov, DiLoCo's); without lr: 0.7
    assert resolved(OuterOptimizerConfig(torch.optim.SGD)) == {"lr": 0.7}
    for method in ("edit", "aedit"):
        assert SyncConfig(method=method).resolve().outer_optim_kwargs == {
            "lr": 1.0, "momentum": 0.0, "nesterov": False}
        assert SyncConfig(method=method).resolve().local_sgd_sync_interval == 20
    assert SyncConfig(method="diloco").resolve().outer_optim_kwargs == {
        "lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert SyncConfig(method="diloco").resolve().local_sgd_sync_interval == 10
    # another optimizer without kwargs gets none of them
    assert SyncConfig(method="edit", outer_optim_class="adam",
                      outer_optim_kwargs={"lr": 0.1}).resolve().outer_optim_kwargs == {"lr": 0.1}
    assert SyncConfig(method="edit", outer_optim_class="torch.optim:SGD",
                      outer_optim_kwargs={"momentum": 0.5}).resolve().outer_optim_kwargs == {
        "lr": 0.7, "momentum": 0.5}
    # another optimizer without lr: torch's default applies, and a warning says so
    with pytest.warns(UserWarning, match=r"no lr for the outer Adam: its own default lr"):
        SyncConfig(method="edit", outer_optim_class="adam").resolve()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SyncConfig(method="edit", outer_optim_class="adam",
                   outer_optim_kwargs={"lr": 0.1}).resolve()


# ---------------------------------------------------------------------------- issue #30
@pytest.mark.parametrize("value, ok", [(0, True), (2**63 - 1, True), (-1, False),
                                       (2**63, False)])
@pytest.mark.parametrize("option", ["train.seed", "data.split_seed"])
def test_seeds_are_non_negative_int64(option, value, ok):
    if ok:
        cli(f"--{option}={value}")
    else:
        expect_error(option, "2^63 - 1", argv=[f"--{option}={value}"])


def test_numbers_inside_tables_and_lists_are_checked():
    from editrain.sync.config import check_number

    check_number({"lr": 0.1, "betas": [0.9, 0.99], "nesterov": True, "name": "x"}, "opt")
    for value, where in (({"lr": float("nan")}, "opt.lr"),
                         ({"betas": [0.9, float("-inf")]}, r"opt.betas\[1\]"),
                         ({"a": {"b": 2**63}}, "opt.a.b"),
                         ([1, -(2**63) - 1], r"opt\[1\]")):
        with pytest.raises(ValueError, match=where):
            check_number(value, "opt")
    check_number([2**63 - 1, -(2**63)], "opt")  # the int64 range itself is fine


@pytest.mark.parametrize("kwargs, names", [
    ("{lr = nan}", ["sync.outer_optim_kwargs.lr", "finite"]),
    ("{lr = inf}", ["sync.outer_optim_kwargs.lr", "finite"]),
    ("{lr = 0}", ["sync.outer_optim_kwargs.lr", "> 0"]),
    ("{lr = 0.7, momentum = 1.0}", ["sync.outer_optim_kwargs.momentum", "[0, 1)"]),
    ("{lr = 0.7, dampening = 2}", ["sync.outer_optim_kwargs.dampening", "[0, 1]"]),
    ("{lr = 99999999999999999999}", ["sync.outer_optim_kwargs.lr", "2^63 - 1"]),
])
def test_outer_optimizer_arguments_are_finite_and_in_range(kwargs, names):
    expect_error(*names, argv=["--sync.outer_optim_kwargs", kwargs])


def test_outer_optimizer_arguments_in_range_are_accepted():
    cfg = cli("--sync.outer_optim_kwargs", "{lr = 0.7, momentum = 0.9, nesterov = true}")
    assert cfg.sync.outer_optim_kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def test_outer_optimizer_names_import_only_optimizer_packages(tmp_path, monkeypatch):
    import sys

    import torch

    from editrain.optim import AGD
    from editrain.sync.outer import resolve_optimizer_class

    assert resolve_optimizer_class("torch.optim.RMSprop") is torch.optim.RMSprop
    assert resolve_optimizer_class("torch.optim:Adagrad") is torch.optim.Adagrad
    assert resolve_optimizer_class("editrain.optim.AGD") is AGD
    sentinel = tmp_path / "ran"
    (tmp_path / "side_effect_optim.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("side_effect_optim.Opt", "side_effect_optim:Opt", "torch.optimx.Opt"):
        with pytest.raises(ValueError, match="refused.*SyncConfig\\(outer_optim_class="):
            resolve_optimizer_class(name)
    assert not sentinel.exists() and "side_effect_optim" not in sys.modules

    # The way to use another optimizer: the class itself, through the Python API.
    class Mine(torch.optim.SGD):
        pass

    cfg = SyncConfig(outer_optim_class=Mine, outer_optim_kwargs={"lr": 0.7})
    assert cfg.resolve().outer_optim_class is Mine


@pytest.mark.parametrize("overrides, units", [
    ({"model": {"preset": "tiny"}}, ["root", "block0", "block1"]),
    ({"model": {"preset": "1b"}}, ["root", "tok_embeddings"] + [f"block{i}" for i in range(16)]
     + ["output"]),
    ({"model": {"preset": "1b"}, "sync": {"split_root": False}},
     ["root"] + [f"block{i}" for i in range(16)]),
    ({"model": {"preset": "tiny", "n_layers": 5, "tie_embeddings": False}},
     ["root", "tok_embeddings"] + [f"block{i}" for i in range(5)] + ["output"]),
])
def test_sync_units_are_counted_as_the_engine_counts_them(overrides, units):
    from editrain.config import sync_units

    assert sync_units(load_config(None, overrides)) == units


def test_fragments_at_most_the_sync_units():
    cli("--model.preset", "tiny", "--sync.fragments", "3")
    msg = expect_error("sync.fragments", "(3: root, block0, block1)", "got 4",
                       argv=["--model.preset", "tiny", "--sync.fragments", "4"])
    assert "sync units" in msg
    # a deep model's blocks are shortened in the message
    msg = expect_error("sync.fragments", "root, tok_embeddings, block0 .. block15, output",
                       argv=["--model.preset", "1b", "--sync.local_sgd_sync_interval", "40",
                             "--sync.fragments", "20"])
    assert "(19:" in msg


def test_fragments_of_a_hugging_face_model(tmp_path):
    pytest.importorskip("transformers")
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "max_position_embeddings": 64, "tie_word_embeddings": False}))
    base = {"model": {"hf_config": str(path)}}
    load_config(None, {**base, "sync": {"fragments": 5}})
    with pytest.raises(ConfigError, match=r"sync.fragments: .*\(5: root, "
                                          r"hf.model.embed_tokens, block0, block1, hf.lm_head\)"):
        load_config(None, {**base, "sync": {"fragments": 6}})


@pytest.mark.parametrize("spec, world, ft, ok", [
    ("3@5", 4, False, True), ("4@5", 4, False, False),     # 2 replicas x 2 shards
    ("2@5", 3, True, True), ("3@5", 3, True, False),       # --ft: 3 replica groups of 1
])
def test_sim_fail_rank_must_exist(spec, world, ft, ok):
    shard = 1 if ft else 2
    overrides = {"sim": {"fail": spec}, "train": {"steps": 10},
                 "dist": {"nproc": world, "shard_size": shard}}
    if ft:
        pytest.importorskip("torchft")
        overrides["dist"]["fault_tolerance"] = "torchft"
    cfg = load_config(None, overrides)
    if ok:
        validate_world(cfg, world)
    else:
        with pytest.raises(ConfigError, match=rf"sim.fail: rank {spec[0]} does not exist.*"
                                              rf"from 0 to {world - 1}"):
            validate_world(cfg, world)


def test_sim_fail_rank_with_torchft_under_torchrun():
    """Under torchrun each replica group is a job of its own (its world: one group's
    ranks); RANK counts the data ranks of every group (dist.ft_replicas of them)."""
    pytest.importorskip("torchft")
    cfg = load_config(None, {"sim": {"fail": "5@3"}, "dist": {
        "fault_tolerance": "torchft", "ft_replicas": 3, "shard_size": 2}})
    validate_world(cfg, 2)  # 3 groups x 2 shards: ranks 0..5
    cfg = load_config(None, {"sim": {"fail": "6@3"}, "dist": {
        "fault_tolerance": "torchft", "ft_replicas": 3, "shard_size": 2}})
    with pytest.raises(ConfigError, match="from 0 to 5"):
        validate_world(cfg, 2)


@pytest.mark.parametrize("spec, ok", [("0@1", True), ("0@10", True), ("0@10:checkpoint", True),
                                      ("0@0", False), ("0@11", False)])
def test_sim_fail_step_must_come(spec, ok):
    argv = ["--steps", "10", "--sim.fail", spec]
    if ok:
        cli(*argv)
    else:
        expect_error("sim.fail", "train.steps = 10", argv=argv)


def test_fail_restart_is_bounded():
    ft = ("--ft", "--shard-size", "1")  # the restart delay applies to --ft's replica groups
    cli(*ft, "--sim.fail_restart_s", "3600")
    expect_error("sim.fail_restart_s", "[0, 3600]", argv=[*ft, "--sim.fail_restart_s", "3601"])


# ---------------------------------------------------------------------------- one error type
@pytest.mark.parametrize("make, option", [
    (lambda: SyncConfig(method="fedavg"), "sync.method"),
    (lambda: SyncConfig(outer_optim_class="os.system"), "sync.outer_optim_class"),
    (lambda: SyncConfig(outer_optim_kwargs={"lr": float("nan")}), "sync.outer_optim_kwargs.lr"),
    (lambda: SyncConfig(outer_optim_kwargs={"bogus": 1}), "sync.outer_optim_kwargs"),
    (lambda: GTAConfig(density=0), "sync.gta.density"),
])
def test_sync_config_raises_config_error(make, option):
    """The sync section built through the Python API fails like the rest of the config:
    ConfigError (still a ValueError), naming the option."""
    with pytest.raises(ConfigError, match=rf"^{option}: "):
        make()


def test_config_modules_raise_no_bare_value_error():
    """One error type: the configuration modules raise ConfigError only (through
    ``editrain.errors.require``), and a lower layer's ValueError is converted by
    ``as_config_error`` instead of by hand (no ``except ValueError`` of their own)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "editrain"
    paths = sorted((root / "config").glob("*.py")) + [root / "sync" / "config.py"]
    offenders = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                names = [getattr(node.exc.func, "id", "")]
            elif isinstance(node, ast.ExceptHandler) and node.type is not None:
                types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                names = [getattr(t, "id", "") for t in types]
            if "ValueError" in names:
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders


def test_require_and_as_config_error():
    from editrain.errors import as_config_error, require

    require(True, "train.lr", "must be > 0, got 1")
    with pytest.raises(ConfigError, match=r"^train.lr: must be > 0, got 0$"):
        require(False, "train.lr", "must be > 0, got 0")
    with pytest.raises(ConfigError, match=r"^model: dim \(66\)"):
        with as_config_error(prefix="model: "):
            raise ValueError("dim (66) must be divisible by n_heads (4)")
    with pytest.raises(ConfigError, match=r"^data.path: gone$"):
        with as_config_error(FileNotFoundError):
            raise FileNotFoundError("data.path: gone")
    with pytest.raises(KeyError):  # anything else passes through
        with as_config_error():
            raise KeyError("x")


def test_a_named_corpus_is_read_whole_unless_data_max_bytes_says_otherwise(tmp_path):
    """data.max_bytes = auto (the default) caps the embedded default corpus at 8 MB, as
    the main job and the benchmarks have always read it, and never a corpus data.path
    names: a 12 MB .jsonl lost a third of its documents, silently, to the old default."""
    from editrain.corpus import DEFAULT_CORPUS_BYTES, corpus_bytes

    assert DEFAULT_CORPUS_BYTES == 8_000_000
    corpus, a, b = (tmp_path / n for n in ("corpus.jsonl", "a.txt", "b.txt"))
    corpus.write_text('{"text": "x"}\n')
    a.write_text("a")
    b.write_text("b")
    cases = [({}, 8_000_000), ({"path": str(corpus)}, None),
             ({"path": str(corpus), "max_bytes": 1000}, 1000),
             ({"max_bytes": None}, None), ({"path": [str(a), str(b)]}, None),
             ({"path": ["default", str(a)]}, 8_000_000)]  # capped as it always was
    for data, cap in cases:
        assert corpus_bytes(load_config(None, {"data": data}).data) == cap, data
    assert load_config(None, {}).data.max_bytes == "auto"
    with pytest.raises(ConfigError, match="data.max_bytes: must be a number > 0, none or "
                                          "auto, got \"all\""):
        load_config(None, {"data": {"max_bytes": "all"}})


@pytest.mark.parametrize(("option", "least"), [
    ("train.steps", 1), ("train.batch_size", 1), ("train.seq_len", 1),
    ("train.gradient_accumulation_steps", 1), ("train.eval_every", 1),
    ("train.log_every", 1), ("dist.ft_min_replicas", 1), ("dist.pp_stages_per_rank", 1),
    ("train.warmup_steps", 0), ("data.val_tokens", 0), ("dist.max_restarts", 0)])
def test_every_count_of_the_run_config_is_worded_as_the_sync_configs(option, least):
    """The run's counts said "train.steps: must be > 0, got 0" where the sync config's
    and the Python API's (errors.plain_count) say "must be >= 1, got 0": one wording."""
    section, name = option.split(".")
    with pytest.raises(ConfigError) as e:
        load_config(None, {section: {name: least - 1}})
    assert str(e.value) == f"{option}: must be >= {least}, got {least - 1}"


def test_an_integer_beyond_any_float_for_a_number_option_is_refused_by_name(tmp_path):
    """A TOML integer has no bound: 400 nines for a float option (train.lr, a planner's
    cluster number, a model's rope_theta) is refused naming the option, one ConfigError
    line. Before, errors.plain_scalar's float() raised OverflowError, which the command
    line does not report: `editrain train --config` ended in a traceback."""
    from editrain.errors import ConfigError, plain_scalar
    from editrain.models.llama_config import preset_config
    from editrain.plan.inputs import Cluster

    huge = int("9" * 400)
    path = write(tmp_path, f"[train]\nlr = {huge}\n")
    with pytest.raises(ConfigError, match=r"^train\.lr: expected a number a float can "
                                          r"hold \(at most 1\.79\S+\), got 9{20}"):
        load_config(path, {})
    with pytest.raises(ConfigError, match=r"^cluster\.inter_node_gbps: expected a number"):
        Cluster(nodes=1, gpus_per_node=8, inter_node_gbps=huge, step_time_s=1.0)
    with pytest.raises(ConfigError, match=r"^rope_theta: expected a number"):
        preset_config("tiny", rope_theta=huge)
    assert plain_scalar(2**1000, float, "x") == float(2**1000)  # large, yet a float
