"""Hostile command lines: an argument that is accepted but means something other than what
the user wrote is refused by name, exit status 2, before any work and with nothing written.

The members of that class found by a sweep of every command (:mod:`editrain.argv` states
the rules): an option abbreviated to a prefix (argparse's default read ``--conf`` as
``--config`` and ``plan --tar`` as ``--target``), a command that ignored its arguments
(``editrain options --bogus``), a misspelt bench option that made the results directory
before failing, a section given as a table that dropped the options given before it
(``--train.lr=0.1 --train={steps=6}``), booleans whose spellings were read differently on
the command line (``--quiet=1`` refused, ``--quiet=yes`` taken), and environment variables
read loosely (``EDITRAIN_BENCH_TINY=false`` turned the tiny size on; an
``OMP_NUM_THREADS`` that is no number was passed over for editrain's own choice). An option
given twice keeps its last value, under every spelling and in every command (documented).

The commands run in-process (:func:`editrain.cli.main`) with the work itself replaced by a
stub that fails the test: a refused command must never reach it.
"""

from __future__ import annotations

import re
import shlex

import pytest

from editrain import cli
from editrain.argv import CommandParser, env_count, env_int, env_switch, rayon_threads
from editrain.config import ConfigError, load_config, parse_overrides


class _WorkStarted(Exception):
    """Raised by the stubs standing in for a command's work."""


def _no_work(*args, **kwargs):
    raise _WorkStarted("the command started its work")


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Every command's work replaced by :func:`_no_work`; the working directory empty."""
    import editrain.bench.scenario
    import editrain.corpus
    import editrain.hf_checkpoint
    import editrain.launch
    import editrain.sample

    for module, name in [(editrain.launch, "run_local"), (editrain.launch, "run_under_torchrun"),
                         (editrain.corpus, "prepare_data"), (editrain.bench.scenario, "execute"),
                         (editrain.hf_checkpoint, "export_checkpoint"),
                         (editrain.sample, "load_for_sampling")]:
        monkeypatch.setattr(module, name, _no_work)
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "EDITRAIN_BENCH_TINY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "plan.toml").write_text(
        '[cluster]\nnodes = 2\ngpus_per_node = 8\ninter_node_gbps = 10\n'
        'gpu_peak_tflops = 300\nmfu = 0.4\n[model]\npreset = "1b"\n[[method]]\nname = "edit"\n')
    return tmp_path


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """``editrain ARGV`` in-process: its exit status and its last line of stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


REFUSED = [
    # an option abbreviated to a prefix: argparse took it for the option it starts
    (["train", "--conf", "plan.toml"], "unknown option conf;"),
    (["data", "--jso"], "--jso: unknown option"),
    (["export", "ckpt", "out", "--rep", "2"], "export: unexpected argument(s) --rep 2"),
    (["export", "ckpt", "out", "--max-shard=1GB"], "unexpected argument(s) --max-shard=1GB"),
    (["sample", "ckpt", "--prompt", "a", "--max-new", "5"],
     "sample: unexpected argument(s) --max-new 5"),
    (["bench", "default", "--qui"], "--qui: unknown option"),
    (["plan", "plan.toml", "--tar", "0.9"], 'plan: unexpected argument "--tar"'),
    (["plan", "plan.toml", "--no-pl"], 'plan: unexpected argument "--no-pl"'),
    (["data", "--config", "plan.toml", "--js"], "--js: unknown option"),
    # a command that took arguments it ignored
    (["options", "--bogus"], "options: unexpected argument(s) --bogus"),
    (["options", "train"], "options: unexpected argument(s) train"),
    # a misspelt bench option: refused before the results directory is made
    (["bench", "default", "--tiny", "--repe", "2", "--out", "res"], "unknown option repe;"),
    # a switch given a value
    (["bench", "default", "--quick=0"], "argument --quick: ignored explicit argument '0'"),
    (["bench", "default", "--tiny=0"], "bench --tiny: takes no value"),
    (["train", "--ft=1"], "--ft: takes no value"),
    (["train", "--quiet=on"], 'quiet: expected true or false, got "on"'),
]


@pytest.mark.parametrize("argv,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_command_line_that_would_mean_something_else_is_refused_by_name(
        argv, message, no_work, capsys):
    code, line = _run(argv, capsys)
    assert code == 2, line
    assert message in line
    assert sorted(p.name for p in no_work.iterdir()) == ["ckpt", "plan.toml"]  # nothing written


@pytest.mark.parametrize("text,value", [
    ("--quiet=1", True), ("--quiet=0", False), ("--quiet=yes", True), ("--quiet=no", False),
    ("--quiet=true", True), ("--quiet=False", False), ("--quiet", True),
])
def test_a_boolean_option_reads_its_spellings_alike(text, value):
    """``--quiet=1`` was a TOML number, which no boolean takes, while ``--quiet=yes`` was
    a word the configuration reads as true: every spelling the configuration reads is read
    the same on the command line."""
    assert load_config(None, parse_overrides([text])[0]).quiet is value


def test_a_switch_turned_off_on_the_command_line_is_off_before_the_configuration_reads_it():
    """Callers read the parsed options before the configuration does: ``editrain bench``
    drops the options that do not apply to a run (``drop_inapplicable``) by them. A switch
    turned off as ``--sync.skip_anomaly=false`` was kept as the text "false", which reads
    as on there: the scenario's anomaly-detector options stayed on runs whose detector is
    off, and every run was refused (``bench spikes --sync.skip_anomaly=false``)."""
    from editrain.bench.options import merge, split_extra
    from editrain.config.applicability import drop_inapplicable

    for word in ("false", "no", "0"):
        _, overrides = split_extra([f"--sync.skip_anomaly={word}"])
        assert overrides == {"sync": {"skip_anomaly": False}}
        raw = drop_inapplicable(merge({"sync": {"method": "edit", "ewma_alpha": 0.2}},
                                      overrides))
        assert "ewma_alpha" not in raw["sync"]
        assert load_config(None, raw).sync.skip_anomaly is False
    # a word no switch takes is still refused by the configuration, naming the option
    with pytest.raises(ConfigError, match="quiet"):
        load_config(None, parse_overrides(["--quiet=maybe"])[0])


def test_the_command_parser_refuses_prefixes(capsys):
    parser = CommandParser(prog="p")
    parser.add_argument("--rate")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("run").add_argument("--steps")
    assert parser.parse_args(["--rate", "1"]).rate == "1"
    for argv in (["--rat", "1"], ["run", "--ste", "1"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
    assert "unrecognized arguments: --ste 1" in capsys.readouterr().err


LAST_WINS = [
    (["--steps", "5", "--steps", "6"], lambda c: c.train.steps, 6),
    (["--steps", "5", "--train.steps=6"], lambda c: c.train.steps, 6),
    (["--train.steps=6", "--steps", "5"], lambda c: c.train.steps, 5),
    (["--quiet", "--quiet=false"], lambda c: c.quiet, False),
    (["--ft", "--dist.fault_tolerance=none"], lambda c: c.dist.fault_tolerance, "none"),
    # a section given as a table keeps the options given before it (it dropped them)
    (["--train.lr=0.1", "--train={steps=6}"], lambda c: (c.train.lr, c.train.steps), (0.1, 6)),
    (["--train={steps=6, lr=0.2}", "--train.lr=0.1"], lambda c: (c.train.lr, c.train.steps),
     (0.1, 6)),
    (["--sync.gta.reducer=gta", "--sync={gta={density=0.5}}"],
     lambda c: (c.sync.gta.reducer, c.sync.gta.density), ("gta", 0.5)),
    # a table given to an option that holds one replaces it, as any option's value does
    (["--sync.outer_optim_kwargs={momentum=0.8}", "--sync.outer_optim_kwargs={lr=0.5}"],
     lambda c: c.sync.outer_optim_kwargs, {"lr": 0.5}),
]


@pytest.mark.parametrize("argv,get,value", LAST_WINS, ids=[" ".join(a) for a, _, _ in LAST_WINS])
def test_an_option_given_twice_keeps_its_last_value(argv, get, value):
    assert get(load_config(None, parse_overrides(argv)[0])) == value


def test_every_command_keeps_the_last_value_of_an_option_given_twice(no_work, capsys,
                                                                     monkeypatch):
    """argparse's options, bench flags and plan fields follow the same rule as training
    options."""
    from editrain.bench.options import split_extra
    from editrain.plan.cli import _overrides

    parser = cli.build_parser()
    args, _ = parser.parse_known_args(["export", "a", "b", "--dtype", "float16", "--dtype",
                                       "bfloat16"])
    assert args.dtype == "bfloat16"
    flags, overrides = split_extra(["--repeats", "2", "--repeats", "3", "--steps", "5",
                                    "--train.steps", "6"])
    assert flags == {"repeats": 3} and overrides == {"train": {"steps": 6}}
    assert _overrides(["--cluster.nodes=2", "--cluster.nodes", "3"]) == {"cluster": {"nodes": 3}}


def test_real_link_refuses_an_abbreviated_option(tmp_path, capsys):
    """``--repe 1`` was read as ``--repeats 1``."""
    from editrain.bench import real_link

    with pytest.raises(SystemExit) as e:
        real_link.main([str(tmp_path), "--rate", "1Gbit", "--repe", "1", "--settings", "x"])
    assert e.value.code == 2
    assert "required: --repeats" in capsys.readouterr().err  # --repe is not --repeats


@pytest.mark.parametrize("text,mode", [("", "full"), ("0", "full"), ("false", "full"),
                                       ("no", "full"), ("off", "full"), ("1", "tiny"),
                                       ("true", "tiny"), ("YES", "tiny")])
def test_editrain_bench_tiny_reads_false_as_false(text, mode, no_work, monkeypatch, capsys):
    """``EDITRAIN_BENCH_TINY=false`` turned the tiny size on (any text but 0 did)."""
    import editrain.bench.scenario

    sizes = []
    monkeypatch.setattr(editrain.bench.scenario, "execute",
                        lambda scenario, bench: sizes.append(bench.mode) or {})
    monkeypatch.setenv("EDITRAIN_BENCH_TINY", text)
    assert _run(["bench", "default", "--out", "res"], capsys)[0] == 0
    assert sizes == [mode]
    assert env_switch("EDITRAIN_BENCH_TINY") is (mode == "tiny")


def test_editrain_bench_tiny_junk_is_refused_before_the_bench_starts(no_work, monkeypatch,
                                                                      capsys):
    monkeypatch.setenv("EDITRAIN_BENCH_TINY", "maybe")
    code, line = _run(["bench", "default", "--out", "res"], capsys)
    assert code == 2 and "EDITRAIN_BENCH_TINY=maybe: expected 1 or 0" in line
    assert not (no_work / "res").exists()


@pytest.mark.parametrize("text", ["junk", "0", "-2", "1.5", "99999999999999999999", "٣"])
def test_omp_num_threads_that_is_no_thread_count_is_refused_by_name(text, monkeypatch):
    """Such a value was passed over for editrain's own thread count without a word."""
    from editrain.spawn import worker_threads

    monkeypatch.setenv("OMP_NUM_THREADS", text)
    with pytest.raises(ConfigError, match="^OMP_NUM_THREADS=.*expected a whole number"):
        worker_threads(load_config(None, {}), local_world=2)


@pytest.mark.parametrize("text,threads", [("3", 3), (" 3 ", 3), ("4,2", 4)])
def test_omp_num_threads_the_user_set_wins(text, threads, monkeypatch):
    from editrain.spawn import worker_threads

    monkeypatch.setenv("OMP_NUM_THREADS", text)
    assert worker_threads(load_config(None, {}), local_world=2) == threads


def test_an_empty_omp_num_threads_is_not_set(monkeypatch):
    from editrain.spawn import worker_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert worker_threads(load_config(None, {}), local_world=1) >= 1


def test_rayon_num_threads_junk_is_refused_by_name(monkeypatch):
    from editrain.data.encode_pool import pool_workers

    monkeypatch.setenv("RAYON_NUM_THREADS", "many")
    with pytest.raises(ConfigError, match="^RAYON_NUM_THREADS=many: "):
        pool_workers(cpus=4)
    monkeypatch.setenv("RAYON_NUM_THREADS", "2")
    assert pool_workers(cpus=4) == 2
    assert env_count("RAYON_NUM_THREADS", "") is None


ENV_AS_SET = (("many", "RAYON_NUM_THREADS=many"), ("-1", "RAYON_NUM_THREADS=-1"),
              ("2 4", "RAYON_NUM_THREADS='2 4'"), ("it's", "RAYON_NUM_THREADS='it'\"'\"'s'"),
              ("1\t2", "RAYON_NUM_THREADS=$'1\\t2'"),
              ("9" * 50, "RAYON_NUM_THREADS=" + "9" * 40 + "... (50 characters)"))
"""An environment variable's value that is refused, and how the message names it: as a
shell sets it (quoted only where the shell needs it, a control character as bash's
``$'...'`` escapes it, on one line), not as Python prints a string (``'many'``)."""


@pytest.mark.parametrize("text,said", ENV_AS_SET, ids=[t for t, _ in ENV_AS_SET])
def test_a_refused_environment_variable_is_named_as_a_shell_sets_it(text, said, monkeypatch):
    monkeypatch.setenv("RAYON_NUM_THREADS", text)
    with pytest.raises(ConfigError) as got:
        rayon_threads()
    assert str(got.value).startswith(f"{said}: expected a whole number from 0 "), got.value


@pytest.mark.parametrize("text", ["0", " 0 ", "00"])
def test_rayon_num_threads_0_is_rayons_own_default_not_refused(text, monkeypatch):
    """Rayon (the tokenizer's threads) reads 0 as "one thread per CPU", its default, so a
    job environment that sets it so is valid: it bounds nothing, as if unset."""
    from editrain.data.encode_pool import pool_workers

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setenv("RAYON_NUM_THREADS", text)
    assert pool_workers(cpus=4) == 4


RAYON_JUNK = ["many", "-1", "1.5", "2,2", "\u0663", "99999999999999999999"]
"""``RAYON_NUM_THREADS`` values that are no thread count (0 is rayon's default: taken)."""


@pytest.mark.parametrize("text", RAYON_JUNK)
def test_rayon_num_threads_junk_is_refused_when_editrain_data_starts(text, no_work,
                                                                   monkeypatch, capsys):
    """Read only by a token cache build, junk there was refused minutes into the build
    (after the corpus was read and a tokenizer trained); ``editrain data`` now refuses it
    at its start, as every environment variable of :mod:`editrain.argv`."""
    monkeypatch.setenv("RAYON_NUM_THREADS", text)
    code, line = _run(["data"], capsys)
    assert code == 2 and f"RAYON_NUM_THREADS={shlex.quote(text)}: expected a whole number" in line, line


@pytest.mark.parametrize("text", RAYON_JUNK)
def test_rayon_num_threads_junk_is_refused_by_the_train_jobs_check(text, monkeypatch,
                                                                  tmp_path):
    """``editrain train``'s data stage may build the cache: its job check (local or under
    torchrun, where OMP_NUM_THREADS and the launcher's variables are read) refuses junk
    before the run directory or any process is touched."""
    from editrain.launch.job import check_local, check_torchrun

    cfg = load_config(None, {"run_dir": str(tmp_path / "run"),
                             "dist": {"nproc": 1, "shard_size": 1}})
    for var, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("TORCHELASTIC_RESTART_COUNT", "0"),
                       ("RAYON_NUM_THREADS", text)):
        monkeypatch.setenv(var, value)
    for check in (check_local, check_torchrun):
        with pytest.raises(ConfigError, match=rf"^RAYON_NUM_THREADS={re.escape(shlex.quote(text))}: "):
            check(cfg)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RAYON_NUM_THREADS", "0")
    assert rayon_threads() is None and check_local(cfg).world == 1


@pytest.mark.parametrize("text", ["inf", "1e400", "nan", "5e6,", "0"])
def test_bench_data_sizes_that_are_no_sizes_are_refused_by_name(text, monkeypatch):
    """``inf`` ended in an OverflowError traceback."""
    from editrain.bench.data import SIZES_ENV, corpus_sizes

    monkeypatch.setenv(SIZES_ENV, text)
    with pytest.raises(ValueError, match=f"^{SIZES_ENV}=.*: expected comma-separated positive"):
        corpus_sizes("tiny")


@pytest.mark.parametrize("name,text", [("WORLD_SIZE", "two"), ("WORLD_SIZE", "0"),
                                       ("RANK", "-1"), ("RANK", "1.0"),
                                       ("TORCHELASTIC_RESTART_COUNT", "x")])
def test_a_launcher_variable_that_is_no_whole_number_is_refused_by_name(name, text,
                                                                       monkeypatch, tmp_path):
    """torchrun's variables reach a worker's job check: junk there (a hand-made launch, a
    wrapper script's typo) said only "invalid literal for int() with base 10"."""
    from editrain.launch.job import check_torchrun

    for var, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("TORCHELASTIC_RESTART_COUNT", "0"),
                       (name, text)):
        monkeypatch.setenv(var, value)
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"),
                             "dist": {"nproc": 1, "shard_size": 1}})
    with pytest.raises(ConfigError, match=rf"^{name}={re.escape(text)}: expected a whole "
                                          rf"number from"):
        check_torchrun(cfg)


def test_an_unset_launcher_variable_without_a_default_says_who_sets_it(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="MASTER_PORT is not set; the launcher"):
        env_int("MASTER_PORT", minimum=1)
    monkeypatch.setenv("MASTER_PORT", " 29500 ")
    assert env_int("MASTER_PORT", minimum=1) == 29500
    monkeypatch.setenv("RANK", "")
    assert env_int("RANK", 0) == 0
