"""Issue 48, classes 5, 6 and 7: strings written back, paths that are not what they should
be, configuration shapes and applicability. Each class is walked as a class (Hypothesis over
arbitrary text and shapes; every path kind against every kind of wrong path; every option
against every method and mode), and the issue's examples are among the cases."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import tomllib
import types
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from editrain.config import Config, ConfigError, dumps_toml, load_config, to_dict
from editrain.config.applicability import ALWAYS, APPLIES, check_applicable, option_names
from editrain.config.inputs import PATH_OPTIONS, SHOWN_AS, check_text_options
from editrain.config.toml_io import toml_key, toml_string
from editrain.errors import CheckpointError, RunDirError
from editrain.metrics import to_json
from editrain.paths import KINDS, check_path
from editrain.sync.config import METHODS
from tests.cli import run_cli

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
CONTROL = st.characters(min_codepoint=0, max_codepoint=0x1F) | st.just("\x7f")
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


def _string_options() -> list[str]:
    """Every option whose value may be a string (``str``, ``str | None``, ``list[str]``)."""
    out = []
    for name in option_names():
        tp: typing.Any = Config
        for part in name.split("."):
            tp = typing.get_type_hints(tp)[part]
        args = (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType)
                else (tp,))
        if any(a is str or a == list[str] for a in args):
            out.append(name)
    return out


STRING_OPTIONS = _string_options()
LIST_OPTIONS = ("sim.straggler", "sim.corrupt_replica")
"""String options that are lists only."""


def _set(cfg: Config, option: str, value: typing.Any) -> None:
    """Set ``option`` on ``cfg`` without any check (the checks are what is tested)."""
    *parents, last = option.split(".")
    node: typing.Any = cfg
    for part in parents:
        node = getattr(node, part)
    object.__setattr__(node, last, value)


# ---------------------------------------------------------------------------- class 5
def test_the_string_options_are_found():
    for name in ("run_dir", "resume", "data.path", "data.cache_dir", "train.wandb_project",
                 "sync.outer_optim_class", "sim.straggler"):
        assert name in STRING_OPTIONS


@FAST
@given(text=st.text())
@example(text="runs/a\nb")  # the example: a newline in --run-dir
@example(text='q"uo\\te\t\r\x00\x1b\x7f\u00e9\u2028\U0001F600')
def test_any_text_round_trips_through_toml(text):
    assert tomllib.loads(f"v = {toml_string(text)}")["v"] == text
    assert toml_string(text).isascii()  # the same bytes in any locale
    assert tomllib.loads(f"{toml_key(text or 'k')} = 1") == {text or "k": 1}


@FAST
@given(option=st.sampled_from(STRING_OPTIONS), text=st.text())
def test_every_string_option_round_trips_through_config_toml_and_json(option, text):
    """config.toml (the launcher writes dumps_toml(to_dict(cfg))) and the JSON of the run
    record and metrics.jsonl give back every string option equal."""
    cfg = Config()
    _set(cfg, option, [text] if option in LIST_OPTIONS else text)
    data = to_dict(cfg)
    back = tomllib.loads(dumps_toml(data))
    node_in, node_out = data, back
    for part in option.split("."):
        node_in, node_out = node_in[part], node_out[part]
    assert node_out == node_in
    assert json.loads(to_json({"path": text})) == {"path": text}  # metrics.jsonl rows
    assert json.loads(json.dumps({"run_dir": text}, indent=1)) == {"run_dir": text}  # record


@FAST
@given(option=st.sampled_from(STRING_OPTIONS),
       text=st.tuples(st.text(), SURROGATE, st.text()).map("".join))
def test_text_that_is_not_unicode_is_refused_by_name(option, text):
    """Bytes that are not UTF-8 on a command line become lone surrogates: no TOML file can
    hold them, so they are refused before launch, naming the option."""
    cfg = Config()
    _set(cfg, option, [text] if option in LIST_OPTIONS else text)
    with pytest.raises(ConfigError) as info:
        check_text_options(cfg)
    name = SHOWN_AS.get(option, option)
    assert str(info.value).startswith(name) and "\n" not in str(info.value)


@FAST
@given(option=st.sampled_from(sorted(PATH_OPTIONS) + ["data.path"]),
       text=st.tuples(st.text(), CONTROL, st.text()).map("".join))
@example(option="run_dir", text="runs/a\nb")
def test_a_control_character_in_a_path_option_is_refused_before_launch(option, text):
    section, _, key = option.rpartition(".")
    overrides = {section: {key: text}} if section else {key: text}
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    msg = str(info.value)
    assert msg.startswith(SHOWN_AS.get(option, option)) and "\n" not in msg, msg


def test_odd_run_dir_round_trips_through_a_real_run(tmp_path, data_cache):
    """A run directory named with quotes, a backslash, '#', '=' and non-ASCII text trains,
    and config.toml, the run record and metrics.jsonl all give it back equal."""
    from tests.test_cli import explain, tiny

    run_dir = tmp_path / 'r "q" \\ #x = y \u00e9\u2603\U0001F600'
    proc = run_cli(["train", *tiny(data_cache), "--nproc", "1", "--shard-size", "1",
                    "--steps", "2", "--train.eval_every", "2", "--checkpoint.every", "2",
                    "--run-dir", str(run_dir)], env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, explain(proc)
    text = (run_dir / "config.toml").read_bytes()
    assert text.isascii()
    assert tomllib.loads(text.decode())["run_dir"] == str(run_dir)
    assert load_config(run_dir / "config.toml").run_dir == str(run_dir)
    json.loads((run_dir / "editrain-run.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [r["path"] for r in rows if r.get("event") == "checkpoint"]
    assert saved and all(Path(p).parent.parent == run_dir for p in saved)


def test_newline_in_run_dir_is_one_line_exit_2(tmp_path):
    proc = run_cli(["train", "--run-dir", str(tmp_path / "a\nb"), "--steps", "1"])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--run-dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "a\nb").exists()


# ---------------------------------------------------------------------------- class 6
def _wrong_paths(tmp_path: Path) -> dict[str, str]:
    """One of every kind of path that is not what an option wants."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    paths = {"file": tmp_path / "file", "dir": tmp_path / "dir", "device": Path("/dev/null"),
             "under_file": tmp_path / "file" / "sub", "missing": tmp_path / "missing" / "x",
             "dangling": tmp_path / "dangling"}
    return {**{k: str(v) for k, v in paths.items()}, "empty": ""}


ACCEPTS = {
    "out_dir": {"dir", "missing"},
    "in_dir": {"dir"},
    "in_file": {"file"},
    "in_path": {"file", "dir"},
    "out_file": {"file", "missing"},
}
"""Which of :func:`_wrong_paths` each kind takes (``missing``: its parent is created)."""


@pytest.mark.parametrize("kind", KINDS)
def test_check_path_walks_every_kind_of_path(kind, tmp_path):
    assert set(ACCEPTS) == set(KINDS)
    for what, path in _wrong_paths(tmp_path).items():
        if what in ACCEPTS[kind]:
            check_path("--opt", path, kind)
            continue
        with pytest.raises(ConfigError) as info:
            check_path("--opt", path, kind)
        msg = str(info.value)
        assert msg.startswith("--opt: ") and "\n" not in msg, (what, msg)


def _as_nobody(fn) -> None:
    """Run ``fn`` in a child process without root's permission bypass (as nobody when this
    process is root), so that a directory's mode is what decides."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            fn()
            code = 0
        except BaseException as e:  # said on stderr: the parent only sees the exit code
            print(f"as nobody: {e!r}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_directory_without_write_permission_is_refused():
    # Not under pytest's tmp_path: its parent is private to root, and nobody must reach it.
    top = Path(tempfile.mkdtemp(prefix="editrain-perm-"))
    top.chmod(0o755)
    locked = top / "locked"
    locked.mkdir()
    locked.chmod(0o555)

    def check() -> None:
        for path, kind in ((locked, "out_dir"), (locked / "new", "out_dir"),
                           (locked / "f.md", "out_file")):
            try:
                check_path("--run-dir", path, kind)
            except ConfigError as e:
                assert "permission" in str(e), e
            else:
                raise AssertionError(f"{path} ({kind}) was accepted")

    try:
        _as_nobody(check)
    finally:
        shutil.rmtree(top)


IN_FILE, IN_DIR, OUT = ("dir", "device", "under_file"), ("file", "device", "under_file"), \
    ("file", "device", "under_file")
COMMANDS = {
    "train --run-dir": (lambda p: ["train", "--run-dir", p], "--run-dir", OUT),
    "train --resume": (lambda p: ["train", "--resume", p], "--resume", IN_DIR),
    "train --config": (lambda p: ["train", "--config", p], "--config", IN_FILE),
    "train data.cache_dir": (lambda p: ["train", "--data.cache_dir", p], "data.cache_dir", OUT),
    "train data.tokenizer": (lambda p: ["train", "--data.tokenizer", p], "data.tokenizer",
                             ("device", "under_file")),
    "train model.hf_config": (lambda p: ["train", "--model.hf_config", p], "model.hf_config",
                              IN_FILE),
    "data --config": (lambda p: ["data", "--config", p], "--config", IN_FILE),
    "data data.cache_dir": (lambda p: ["data", "--data.cache_dir", p], "data.cache_dir", OUT),
    "plot RUN_DIR": (lambda p: ["plot", p], "RUN_DIR", IN_DIR),
    "plot --out": (lambda p: ["plot", "RUN", "--out", p], "--out", OUT),
    "plan --out": (lambda p: ["plan", "--out", p], "--out", OUT),
    "plan PLAN.toml": (lambda p: ["plan", p], "PLAN.toml", IN_FILE),
    "plan --calibrate": (lambda p: ["plan", "--calibrate", p], "--calibrate", IN_DIR),
    "bench --out": (lambda p: ["bench", "default", "--out", p], "--out", OUT),
    "export CHECKPOINT": (lambda p: ["export", p, "OUT"], "CHECKPOINT", IN_DIR),
    "export OUT": (lambda p: ["export", "RUN", p], "OUT", OUT),
    "sample PATH": (lambda p: ["sample", p, "--prompt", "x"], "CHECKPOINT_OR_HF_DIR", IN_DIR),
    "bench report --path": (lambda p: ["bench", "report", "--path", p], "--path",
                            ("dir", "device", "under_file")),
}
"""Every path option of every command: the command line around the path, the name its
refusal must carry, and the wrong paths tried."""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_refuses_a_wrong_path_in_one_line(command, tmp_path):
    """A regular file where a directory goes (the issue's example), a directory where a
    file goes, /dev/null, a path under a file: exit 2, one line naming the option, no
    traceback."""
    paths = _wrong_paths(tmp_path)
    run = tmp_path / "RUN"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    argv, name, wrong = COMMANDS[command]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for what in wrong:
        proc = run_cli(argv(paths[what]), env=env, cwd=tmp_path, timeout=60)
        where = f"{command} with {what}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        assert proc.returncode == 2, where
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, where
        assert proc.stderr.startswith("editrain: error: ") and name in proc.stderr, where


# ---------------------------------------------------------------------------- class 7
TOML_SCALAR = (st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.booleans()
               | st.floats(allow_nan=False) | st.text(max_size=8))
TOML_VALUE = st.recursive(TOML_SCALAR, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                          max_leaves=6)
SECTION_KEYS = [f.name for f in dataclasses.fields(Config)]


@settings(max_examples=300, deadline=None)
@given(raw=st.dictionaries(
    st.sampled_from(SECTION_KEYS) | st.text(max_size=6),
    TOML_VALUE | st.dictionaries(st.sampled_from(option_names()).map(
        lambda n: n.split(".")[-1]) | st.text(max_size=6), TOML_VALUE, max_size=3),
    max_size=3))
@example(raw={"train": [{"steps": 3}]})  # the issue's [[train]]
@example(raw={"sync": {"gta": [{"density": 0.5}]}})  # [[sync.gta]]
@example(raw={"sync": {"outer_optim_kwargs": [{"lr": 1}]}})
@example(raw={"train": {"steps": {"x": 1}}})  # [train.steps]
def test_any_shape_is_accepted_or_refused_by_name(raw):
    """Whatever shape a TOML file gives a key (scalar, table, array, array of tables, at
    any depth), the configuration is built or refused with one ConfigError line naming the
    key; nothing else escapes."""
    try:
        load_config(None, raw)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).split(":")[0], e


VALUES_AS_WRITTEN = (
    ("[train]\nsteps = true", "train.steps: expected an integer, got true"),
    ("[train]\nsteps = false", "train.steps: expected an integer, got false"),
    ('[train]\nsteps = "8"', 'train.steps: expected an integer, got "8"'),
    ("[train]\nsteps = 2.5", "train.steps: expected an integer, got 2.5"),
    ("[train]\nsteps = inf", "train.steps: expected an integer, got inf"),
    ("[train]\nsteps = [1, true]", "train.steps: expected an integer, got [1, true]"),
    ("[train]\nlr = \"it's\"", 'train.lr: expected a number, got "it\'s"'),
    ("[train]\nlr = {a = 1}", "train.lr: expected a number, got {a = 1}"),
    ('[sync]\nlayerwise = "on"', 'sync.layerwise: expected true or false, got "on"'),
    ("[sync]\nlayerwise = 1", "sync.layerwise: expected true or false, got 1"),
    ("[data]\ntext_field = true", "data.text_field: expected a string, got true"),
    ('[data]\ntext_field = ["données"]',
     'data.text_field: expected a string, got ["données"]'),
    ('[data]\ntext_field = ["a\\u2028b\\u007f"]',
     'data.text_field: expected a string, got ["a\\u2028b\\u007f"]'),
    ("[sync]\nouter_optim_kwargs = [1]",
     "sync.outer_optim_kwargs: expected a table such as {lr = 0.7}, got [1]"),
)
"""A config file's value that its option refuses, and the message: the value as the file
wrote it (TOML's ``true``, ``"8"``, ``inf``, ``{a = 1}``), not as Python prints it
(``True``, ``'8'``, ``{'a': 1}``), which the user of a file never wrote."""


@pytest.mark.parametrize("text,said", VALUES_AS_WRITTEN, ids=[t for t, _ in VALUES_AS_WRITTEN])
def test_a_refused_config_value_is_quoted_as_the_file_wrote_it(tmp_path, text, said):
    assert _refusal_of(tmp_path, text) == said


def _refusal_of(tmp_path, text: str) -> str:
    """The message of the ConfigError that a config file holding ``text`` is refused with."""
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as got:
        load_config(str(path))
    return str(got.value)


CHOICES_AS_WRITTEN = (
    ('[train]\nprecision = "fp8"', 'train.precision: allowed: fp32, bf16; got "fp8"'),
    ('[dist]\npp_size = 2\npp_schedule = "zigzag"', 'dist.pp_schedule: allowed: 1f1b, gpipe, '
     'interleaved-1f1b; got "zigzag"'),
    ('[model]\npreset = "huge"', 'model.preset: unknown preset "huge"; allowed: '),
    ('[sync]\nmethod = "fedavg"', 'sync.method: unknown method "fedavg"; allowed: '),
    ('[sync]\ncomm_dtype = "fp8"', 'sync.comm_dtype: unknown dtype "fp8"; allowed: '),
    ('[sync]\nmerge = "avg"', 'sync.merge: unknown rule "avg"; allowed: '),
    ('[sync.gta]\nreducer = "sum"', 'sync.gta.reducer: unknown reducer "sum"; allowed: '),
    ('[sync.gta]\nconsensus_method = "most"',
     'sync.gta.consensus_method: unknown method "most"; allowed: '),
    ('[sync]\ntopk_k = 8', 'sync.topk_k: applies to the sparse codecs (sync.comm_dtype = '
     'topk2 or topk1), but comm_dtype is "fp32": leave it unset'),
    ('[sync]\nmerge_alpha = 0.5\noverlap_steps = 1', 'sync.merge_alpha: is the share of the '
     'local parameters in merge = "blend", but the merge is "keep_local": '),
    ('[sync]\nouter_optim_class = "os.system"', 'sync.outer_optim_class: refused "os.system" '),
    ('[sync]\nouter_optim_class = "torch.optim.Nope"',
     'sync.outer_optim_class: unknown optimizer "torch.optim.Nope"; '),
    ("[sync]\nouter_optim_kwargs = {lr = -1}",
     "sync.outer_optim_kwargs: SGD rejects {lr = -1}: "),
    ('[sync]\nmethod = "diloco"\nprefetch_depth = 2', "sync.prefetch_depth: applies only where "
     "sync.method = post_local_sgd or diloco or edit or aedit and sync.layerwise is on (rounds "
     "synced unit by unit in the forward) (here sync.layerwise is false for "),
    ('[sync]\nmethod = "diloco"\nlocal_sgd_sync_time = 1.0', "sync.local_sgd_sync_time: applies "
     "only where sync.method = aedit and sim.step_schedule is unset (the wall-clock trigger it "
     'replaces) (here sync.method is "diloco"); '),
    ('[data]\neos = "maybe"', "data.eos: must be one of append, prepend, none (end-of-text token "
     'after every document, before it, or no separator), got "maybe"'),
    ('[data]\nmax_bytes = "all"', 'data.max_bytes: must be a number > 0, none or auto, got "all"'),
    ('[sim]\nstraggler = ["1:2"]', 'sim.straggler: cannot parse "1:2"; expected '),
    ('[sim]\nstraggler = ["1=2", "1=3"]', 'sim.straggler: entries "1=2" and "1=3" both slow '),
    ('[sim]\ncorrupt_replica = ["1@2", "0@2"]',
     'sim.corrupt_replica: entries "1@2" and "0@2" both corrupt sync 2'),
    ('[sim]\nlink_latency = "1e999s"', 'sim.link_latency: "1e999s" is out of range; '),
    ('[sim]\nlink_bandwidth = "1e999MB/s"', 'sim.link_bandwidth: "1e999MB/s" is out of range; '),
    ('[train]\nsteps = 10\n[sim]\nfail = "0@1000"', "sim.fail: step 1000 never comes: STEP must "
     "be in [1, train.steps = 10] (the worker dies after that step), got \"0@1000\""),
    ('[sim]\nlink_bandwith = "1MB/s"', "unknown option sim.link_bandwith (did you mean "),
    ('[sync]\n"link bandwidth" = 1', 'unknown option sync."link bandwidth"; allowed in [sync]: '),
)
"""A config file's choice, text option or option name that is refused, and the start of
the message: the value as the file wrote it (``"fp8"``, a table ``{lr = -1}``, a key
``sync."link bandwidth"`` as a dotted TOML key), not as Python prints it (``'fp8'``,
``{'lr': -1}``, ``'sync.link bandwidth'``)."""


@pytest.mark.parametrize("text,said", CHOICES_AS_WRITTEN, ids=[t for t, _ in CHOICES_AS_WRITTEN])
def test_a_refused_choice_or_name_is_quoted_as_the_file_wrote_it(tmp_path, text, said):
    message = _refusal_of(tmp_path, text)
    assert message.startswith(said), message


def test_a_refused_python_value_is_quoted_as_a_file_would_write_it():
    """The Python API's values take the same spelling (a bool ``true``, a string in double
    quotes, ``None`` JSON's ``null``); an object no file holds keeps its ``repr``."""
    np = pytest.importorskip("numpy")
    from editrain.errors import plain_scalar

    for value, said in ((True, "true"), ("8", '"8"'), (None, "null"), ([None], "[null]"),
                        (float("nan"), "nan"), (-float("inf"), "-inf"),
                        (np.float64(2.5), repr(np.float64(2.5)))):
        with pytest.raises(ConfigError) as got:
            plain_scalar(value, int, "train.steps")
        assert str(got.value) == f"train.steps: expected an integer, got {said}"


def test_array_of_tables_file_is_refused(tmp_path):
    for text, option in (("[[train]]\nsteps = 3\n", "train"),
                         ("[[sync.gta]]\ndensity = 0.5\n", "sync.gta"),
                         ("[sync]\nmethod = [\"edit\"]\n", "sync.method"),
                         ("run_dir = {a = 1}\n", "run_dir")):
        path = tmp_path / "c.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"^{option}: expected"):
            load_config(path)


EXPECTED_METHODS: dict[str, set[str]] = {
    **{k: set(METHODS) for k in ("method", "split_root")},
    **{k: {"post_local_sgd", "diloco", "edit"} for k in ("local_sgd_sync_interval",
                                                          "fragments")},
    **{k: {"aedit"} for k in ("local_sgd_sync_time", "min_total_global_steps",
                              "use_step_weight", "step_weight_ratio")},
}
"""Sync options that do not apply to every local-SGD method (the rest: all but sync)."""

_EDIT_PENALTY = ("edit", "aedit")
EXPECTED_SWITCHED_ON: dict[str, typing.Callable[[str], bool]] = {
    # the anomaly detector, the norm softmax and layer-wise rounds are on by default under
    # edit and aedit only; post-local SGD has no outer optimizer; no method has a delayed
    # merge without sync.overlap_steps; A-EDiT's step weights are on by default
    **{k: (lambda m: m in _EDIT_PENALTY) for k in (
        "ewma_alpha", "ewma_warmup_steps", "ewma_threshold", "weight_softmax_temperature",
        "prefetch_depth")},
    "outer_optim_kwargs": lambda m: m != "post_local_sgd",
    "merge": lambda m: False,
    "step_weight_ratio": lambda m: True,
}
"""Sync options that tune a part another option switches on: whether, with every other
option at its default, that part is on under a method."""


def _sync_applies(key: str, method: str) -> bool:
    """Whether ``sync.<key>`` applies under ``method`` with the other options at their
    defaults."""
    if method not in EXPECTED_METHODS.get(key, set(METHODS) - {"sync"}):
        return False
    return EXPECTED_SWITCHED_ON.get(key, lambda m: True)(method)

CONTEXTS: dict[str, dict[str, typing.Any]] = {
    **{f"method={m}": {"sync.method": m} for m in METHODS},
    "ft": {"dist.fault_tolerance": "torchft"},
    "pipeline": {"dist.pp_size": 2},
    "sgd": {"optim.name": "sgd"},
    "agd": {"optim.name": "agd"},
    "wsam": {"optim.sam": "wsam"},
    "wandb": {"train.wandb": "offline"},
    "tokenizer": {"data.tokenizer": "tok.json"},
    "hf_config": {"model.hf_config": "config.json"},
}
"""Settings under which options start or stop applying (on top of the defaults, method
edit)."""


def _expected(option: str, context: str) -> bool:
    """Whether ``option`` applies under ``context``: the issue's table, written out here
    independently of editrain's."""
    section, _, key = option.partition(".")
    method = CONTEXTS[context].get("sync.method", "edit")
    if section == "sync":
        return _sync_applies(key, method)
    if option in ("sim.corrupt_replica",):
        return method != "sync"
    if option == "sim.step_schedule":
        return method == "aedit"
    if option == "sim.fail_restart_s" or (section == "dist" and key.startswith("ft_")):
        return context == "ft"
    if option in ("dist.pp_schedule", "dist.pp_microbatches", "dist.pp_stages_per_rank"):
        return context == "pipeline"
    if option == "optim.momentum":
        return context == "sgd"
    if option == "optim.agd_delta":
        return context == "agd"
    if option in ("optim.rho", "optim.gamma", "optim.adaptive", "optim.decouple"):
        return context == "wsam"
    if option == "train.wandb_project":
        return context == "wandb"
    if option == "data.vocab_size":
        return context != "tokenizer"
    if section == "model" and key not in ("hf_config", "init_from"):
        return context != "hf_config"
    return True


def test_the_table_covers_every_option():
    assert set(APPLIES) == set(option_names())


@pytest.mark.parametrize("context", sorted(CONTEXTS))
def test_applicability_exhaustively(context):
    """Every option x every method and mode: an option set away from its default is
    refused exactly where it does not apply, naming the option and where it applies."""

    class Other:  # a value equal to no default
        def __eq__(self, other):
            return False

        __hash__ = None

    for option in option_names():
        if option in CONTEXTS[context]:
            continue
        cfg = Config()
        for key, value in CONTEXTS[context].items():
            _set(cfg, key, value)
        check_applicable(cfg)  # the context alone is fine
        _set(cfg, option, Other())
        if _expected(option, context):
            check_applicable(cfg)
            continue
        with pytest.raises(ConfigError) as info:
            check_applicable(cfg)
        msg = str(info.value)
        assert msg.startswith(f"{option}: applies only where ") and APPLIES[option].where \
            in msg, msg
        assert APPLIES[option] is not ALWAYS


SYNC_VALUES = {
    "local_sgd_sync_interval": 5, "local_sgd_warmup_steps": 2, "outer_optim_class": "sgd",
    "outer_optim_kwargs": {"lr": 0.5}, "cpu_offload": True, "prefetch_depth": 2,
    "layerwise": False, "clip_pseudo_grad": 3.0, "pseudo_gradnorm_reduce": True,
    "weight_softmax_temperature": 2.0, "skip_anomaly": True, "ewma_alpha": 0.5,
    "ewma_warmup_steps": 3, "ewma_threshold": 2.0, "local_sgd_sync_time": 5.0,
    "min_total_global_steps": 2, "use_step_weight": False, "step_weight_ratio": 0.25,
    "overlap_steps": 1, "fragments": 2, "merge": "blend", "merge_alpha": 0.5,
    "comm_dtype": "bf16", "error_feedback": False, "error_decay": 0.5, "topk_chunk": 64,
    "topk_k": 4, "split_root": False, "gta": {"reducer": "gta"},
}
"""A real value away from its default for every sync option but the method."""


@pytest.mark.parametrize("method", METHODS)
def test_every_sync_option_through_the_command_line(method):
    """Real values through load_config: a sync option that does not apply to the method is
    refused by the applicability table; one that applies is never refused by it."""
    assert set(SYNC_VALUES) | {"method"} == {f.name for f in dataclasses.fields(Config().sync)}
    for key, value in SYNC_VALUES.items():
        try:
            load_config(None, {"sync": {"method": method, key: value}, "train": {"steps": 50}})
            refused = None
        except ConfigError as e:
            refused = str(e)
        applies = _sync_applies(key, method)
        if applies:
            assert refused is None or "applies only where" not in refused, (key, refused)
        else:
            assert refused is not None, f"sync.{key} = {value!r} accepted with {method}"
            assert f"sync.{key}" in refused or "sync.method" in refused, refused


@pytest.mark.parametrize("method, options, switch", [
    ("diloco", {"ewma_alpha": 0.5}, {"skip_anomaly": True}),
    ("post_local_sgd", {"ewma_threshold": 2.0}, {"skip_anomaly": True}),
    ("edit", {"ewma_warmup_steps": 3}, None),
    ("edit", {"weight_softmax_temperature": 2.0, "pseudo_gradnorm_reduce": False},
     {"pseudo_gradnorm_reduce": True}),
    ("diloco", {"prefetch_depth": 2}, {"layerwise": True}),
    ("post_local_sgd", {"outer_optim_kwargs": {"lr": 0.5}}, {"outer_optim_class": "sgd"}),
    ("edit", {"merge": "blend"}, {"overlap_steps": 1}),
    ("aedit", {"use_step_weight": False, "step_weight_ratio": 0.25},
     {"use_step_weight": True}),
    ("edit", {"gta": {"density": 0.5}}, {"gta": {"reducer": "gta", "density": 0.5}}),
])
def test_a_tuning_of_a_part_that_is_off_is_refused(method, options, switch):
    """An option that tunes a part another option switches off (the anomaly detector's
    EWMA without skip_anomaly, diloco's default; prefetching without layer-wise rounds; the
    outer optimizer's settings without one; a merge without a delayed round; GTA's density
    without the GTA reducer) was accepted and did nothing; it is refused naming the
    switch, and accepted once the part is on."""
    over = {"sync": {"method": method, **options}, "train": {"steps": 50}}
    key = next(k for k in options if k not in (switch or {}) or k == "gta")
    if switch is None:  # on by default under this method
        load_config(None, over)
        return
    with pytest.raises(ConfigError, match=rf"^sync\.{key}: applies only where .*; leave it "
                                          r"unset$"):
        load_config(None, over)
    load_config(None, {**over, "sync": {**over["sync"], **switch}})


def test_a_sync_time_under_a_step_schedule_is_refused():
    """``sim.step_schedule`` replaces A-EDiT's wall-clock trigger, so
    ``sync.local_sgd_sync_time`` set with it did nothing (the run synced after the fixed
    step counts); it is refused naming the schedule, and accepted without it."""
    over = {"sync": {"method": "aedit", "local_sgd_sync_time": 5.0},
            "sim": {"step_schedule": [2, 2]}, "train": {"steps": 50}}
    with pytest.raises(ConfigError, match=r"^sync\.local_sgd_sync_time: applies only where "
                                          r".*sim\.step_schedule is unset.*\[2, 2\].*; leave "
                                          r"it unset$"):
        load_config(None, over)
    load_config(None, {**over, "sim": {}})
    load_config(None, {**over, "sync": {"method": "aedit"}})  # the schedule alone


@FAST
@given(replica=st.integers(0, 3), a=st.integers(0, 20), b=st.integers(0, 20),
       c=st.integers(0, 20), d=st.integers(0, 20), other=st.integers(0, 3))
def test_straggler_entries_are_checked_against_each_other(replica, a, b, c, d, other):
    """Two entries slow one replica over overlapping steps: refused, naming both; disjoint
    ranges or different replicas: accepted."""
    lo1, hi1 = min(a, b), max(a, b) + 1
    lo2, hi2 = min(c, d), max(c, d) + 1
    specs = [f"{replica}=2@{lo1}-{hi1}", f"{other}=3@{lo2}-{hi2}"]
    clash = replica == other and lo1 < hi2 and lo2 < hi1
    try:
        load_config(None, {"sim": {"straggler": specs}, "train": {"steps": 50}})
        assert not clash, specs
    except ConfigError as e:
        assert clash and str(e).startswith("sim.straggler") and specs[0] in str(e), e


def test_contradicting_list_entries_are_refused(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    (tmp_path / "b.txt").write_text("more text\n")
    for overrides, option in (
            ({"sim": {"straggler": ["1=2", "1=3@5-10"]}}, "sim.straggler"),
            ({"sim": {"corrupt_replica": ["1@2", "0@2"]}}, "sim.corrupt_replica"),
            ({"data": {"path": ["default", "default"]}}, "data.path[1]"),
            ({"data": {"path": [str(corpus), str(corpus / "a.txt")]}}, "data.path[1]"),
            ({"data": {"path": [str(tmp_path / "b.txt"), str(corpus / ".." / "b.txt")]}},
             "data.path[1]")):
        with pytest.raises(ConfigError, match="^" + re.escape(option)):
            load_config(None, overrides)
    load_config(None, {"sim": {"straggler": ["1=2@0-5", "1=3@5-10", "0=2"],
                               "corrupt_replica": ["1@2", "1@3"]},
                       "data": {"path": [str(corpus), str(tmp_path / "b.txt")]}})


@pytest.mark.parametrize("method", METHODS)
def test_options_laid_over_every_method_keep_only_what_applies(method):
    """The benchmarks lay one set of options over runs of every method: drop_inapplicable
    keeps exactly the options that apply (the table above), so each run is accepted."""
    from editrain.config.applicability import drop_inapplicable

    raw = {"sync": {"method": method, "local_sgd_sync_interval": 4, "local_sgd_sync_time": 5.0,
                    "ewma_warmup_steps": 3},
           "dist": {"ft_timeout_s": 30.0}, "optim": {"momentum": 0.5},
           "sim": {"fail_restart_s": 1.0}, "train": {"steps": 50}}
    out = drop_inapplicable(raw)
    assert raw["sync"]["local_sgd_sync_interval"] == 4  # the input is not changed
    kept = {f"{s}.{k}" for s, v in out.items() for k in v}
    given = {f"{s}.{k}" for s, v in raw.items() for k in v}
    assert kept == {o for o in given if o in ("sync.method", "train.steps")
                    or _expected(o, f"method={method}")}
    load_config(None, out)


# ------------------------------------------------- a path and a text, as the user wrote them
PATHS_AS_WRITTEN = (
    ("my run", '"{base}/my run"'),
    ("it's", '"{base}/it\'s"'),
    ('say "hi"', '"{base}/say \\"hi\\""'),
    ("back\\slash", '"{base}/back\\\\slash"'),
    ("caf\u00e9 \u65e5\u672c", '"{base}/caf\u00e9 \u65e5\u672c"'),
    ("no\u00a0break", '"{base}/no\\u00a0break"'),
    ("trailing ", '"{base}/trailing "'),
)
"""A file name and how a message names the path: a TOML basic string (what ``data.path =``
in a file writes), with a printable character of any script as it is and one that does not
print (a no-break space) escaped. Python's ``repr`` wrote ``'.../back\\\\slash'``, which
TOML (a literal string) and a shell read back with two backslashes, and ``'...\\xa0...'``
in a spelling no user types; ``it's`` was already in double quotes (pinned)."""


@pytest.mark.parametrize("name,said", PATHS_AS_WRITTEN, ids=[n for n, _ in PATHS_AS_WRITTEN])
def test_a_path_is_named_as_a_toml_file_writes_it(tmp_path, name, said):
    from editrain.data import resolve_sources

    base = str(tmp_path)
    shown = said.format(base=base)
    assert tomllib.loads(f"p = {shown}\n")["p"] == f"{base}/{name}"  # pastes into TOML
    with pytest.raises(ConfigError) as got:
        load_config(f"{base}/{name}")
    assert str(got.value) == f"--config: file not found: {shown}"
    with pytest.raises(FileNotFoundError) as got:
        resolve_sources(f"{base}/{name}")
    assert str(got.value) == f"data.path: {shown} does not exist"
    (tmp_path / name).write_text("")
    with pytest.raises(ConfigError) as got:
        check_path("--run-dir", f"{base}/{name}", "out_dir")
    assert str(got.value) == f"--run-dir: {shown} must be a directory (editrain writes into " \
                             "it), but it is a regular file"


def test_a_path_with_a_control_character_is_refused_on_one_line_it_pastes_from():
    """The refusal of a newline or DEL in a path names the path on one line, escaped as a
    TOML basic string escapes it (DEL too, which JSON's spelling left raw)."""
    for text, shown in (("a\nb", '"a\\nb"'), ("a\tb", '"a\\tb"'), ("a\x7fb", '"a\\u007fb"')):
        with pytest.raises(ConfigError) as got:
            check_path("--run-dir", text, "out_dir")
        code = f"U+{ord(text[1]):04X}"
        assert str(got.value) == (f"--run-dir: a path may not hold control characters (found "
                                  f"{code} in {shown})")
        assert tomllib.loads(f"p = {shown}\n")["p"] == text
    with pytest.raises(ConfigError) as got:
        load_config(None, {"train": {"precision": "f\x7fp8"}})
    assert str(got.value).endswith('got "f\\u007fp8"'), str(got.value)


def test_a_long_path_is_shown_whole_up_to_a_bound():
    """A path of a deep file system (a few hundred characters) is shown whole, so that it
    can be copied from the message; ``repr`` cut it at 120."""
    from editrain.paths import SHOWN, shown

    deep = "/data/" + "/".join(["a_directory_of_some_depth"] * 12) + "/corpus.txt"
    assert 120 < len(deep) <= SHOWN and shown(deep) == f'"{deep}"'
    assert shown("x" * (SHOWN + 1)) == f'"{"x" * SHOWN}"... ({SHOWN + 1} characters)'


def _refusal(call: typing.Callable[[], object]) -> str:
    with pytest.raises((ValueError, TypeError)) as got:
        call()
    return str(got.value)


def _cases() -> list[tuple[str, typing.Callable[[], object], str]]:
    """Refusals of a value a config file, the command line or a file gave, reached through
    the functions that check it last (the configuration's own checks name most of them
    first), and the words that name the value."""
    import torch

    from editrain.data import resolve_sources
    from editrain.optim import build_optimizer, wrap_sam
    from editrain.plan.inputs import Cluster, parse_method
    from editrain.sync.reducers import GTAReducer, build_reducer

    params = [torch.nn.Parameter(torch.zeros(1))]
    return [
        ("optim", lambda: build_optimizer("lion", params),
         'optimizer name must be one of adamw, agd, sgd, got "lion"'),
        ("sam", lambda: wrap_sam("sam", torch.optim.SGD(params, lr=0.1)),
         'SAM wrapper name must be null or one of none, wsam, got "sam"'),
        ("reducer", lambda: build_reducer("sum"),
         'reducer must be null or one of linear, mean, gta, got "sum"'),
        ("reducer-options", lambda: build_reducer("mean", density=0.5),
         'options density only apply to reducer = "gta", but reducer = "mean"; set '
         'reducer = "gta" or remove them'),
        ("consensus", lambda: GTAReducer(consensus_method="most"),
         'consensus_method must be one of sum, count, got "most"'),
        ("sparsification", lambda: GTAReducer(sparsification_method="top"),
         'sparsification_method must be null or one of magnitude, random, rescaled_random, '
         'got "top"'),
        ("density", lambda: GTAReducer(density=0.5),
         "density = 0.5 has no effect without a sparsification_method"),
        ("plan-choice", lambda: Cluster(nodes=2, gpus_per_node=1, inter_node_gbps=8.0,
                                       step_time_s=0.1, latency_per="ring"),
         'cluster.latency_per: must be one of hop, collective, got "ring"'),
        ("plan-method", lambda: parse_method("edit:H"),
         'method: "edit:H": expected NAME:key=value,key=value (every entry a key and its '
         'value), got entry "H"'),
        ("text-field", lambda: resolve_sources("default", text_field=""),
         'data.text_field: must be a non-empty string naming the field (.jsonl/.json) or '
         'column (.parquet, Hugging Face datasets) that holds the text, got ""'),
        ("hf-spec", lambda: resolve_sources("hf:a b"),
         'data.path: "hf:a b" is not a Hugging Face dataset spec'),
    ]


def test_a_value_refused_past_the_configuration_checks_is_quoted_as_written():
    """The refusals below the configuration's checks (the optimizer and reducer builders,
    the planner's file and ``--method``, the data sources) quoted with ``repr``: ``got
    'lion'``, ``reducer='mean'``, a list of choices as ``['adamw', 'agd', 'sgd']``."""
    for name, call, said in _cases():
        message = _refusal(call)
        assert said in message and "'" not in message.replace("it's", ""), (name, message)


# ------------------------------------------- a path named in a refusal: always paths.shown
AWKWARD_NAMES = ("my run", "a: b", "line\nbreak", "tab\tand\x7fdel")
"""Directory names a message once showed bare: a space (where does the path end?), a
colon (which ``:`` ends the path in ``PATH: problem``?), a newline (the message is no
longer one line) and other control characters (they reach the terminal raw)."""


def _path_refusals() -> list[tuple[str, typing.Callable[[Path], object],
                                   typing.Callable[[Path], Path], str]]:
    """``(case, call, path named, how)``: a refusal reached with a directory ``d`` of an
    awkward name, the path it names, and where: ``subject`` (``"PATH": problem``, after any
    option) or ``inside`` (anywhere in the message)."""
    from editrain.checkpoint import resolve_resume
    from editrain.data import resolve_sources
    from editrain.hf_checkpoint import _prepare_out
    from editrain.metrics import read_metrics
    from editrain.models.hf import read_hf_config
    from editrain.models.hf_dir import inspect_weights, read_config
    from editrain.rundir import MARKER, RunLock, check, read_marker

    def held_twice(d: Path) -> None:
        first = RunLock(d).acquire()
        try:
            RunLock(d).acquire()
        finally:
            first.release()

    def run_dir_with_a_run(d: Path) -> None:
        (d / "metrics.jsonl").write_text("")
        check(d, overwrite=False, resume=[])

    def corrupt_marker(d: Path) -> None:
        (d / MARKER).write_text("{")
        read_marker(d)

    def export_over_a_file(d: Path) -> None:
        (d / "out").write_text("")
        _prepare_out(d / "out")

    def export_over_other_files(d: Path) -> None:
        (d / "out").mkdir()
        (d / "out" / "mine.txt").write_text("")
        _prepare_out(d / "out")

    def record_without_text(d: Path) -> None:
        (d / "docs.jsonl").write_text('{"body": "x"}\n')
        resolve_sources(str(d / "docs.jsonl"))

    def bad_hf_config(d: Path) -> None:
        (d / "config.json").write_text("{")
        read_hf_config(d)

    def no_weights(d: Path) -> None:
        (d / "config.json").write_text('{"model_type": "llama"}')
        inspect_weights(d)

    return [
        ("resume-not-a-checkpoint", resolve_resume, lambda d: d, "inside"),
        ("checkpoint-without-marker", read_marker, lambda d: d / MARKER, "subject"),
        ("checkpoint-corrupt-marker", corrupt_marker, lambda d: d / MARKER, "subject"),
        ("run-dir-held", held_twice, lambda d: d, "inside"),
        ("run-dir-holds-a-run", run_dir_with_a_run, lambda d: d, "inside"),
        ("export-over-a-file", export_over_a_file, lambda d: d / "out", "inside"),
        ("export-over-other-files", export_over_other_files, lambda d: d / "out", "inside"),
        ("hf-dir-without-config", read_config, lambda d: d, "inside"),
        ("hf-dir-bad-config", bad_hf_config, lambda d: d / "config.json", "subject"),
        ("hf-dir-without-weights", no_weights, lambda d: d, "inside"),
        ("data-record-without-text", record_without_text, lambda d: d / "docs.jsonl",
         "subject"),
        ("metrics-missing", read_metrics, lambda d: d / "metrics.jsonl", "subject"),
    ]


@pytest.mark.parametrize("name", AWKWARD_NAMES, ids=["space", "colon", "newline", "control"])
@pytest.mark.parametrize("case", [c[0] for c in _path_refusals()])
def test_a_refusal_names_its_path_as_paths_shown_spells_it_on_one_line(tmp_path, name, case):
    """Every refusal that names a path spells it with :func:`editrain.paths.shown` (a TOML
    basic string: quoted, a newline escaped), the subject of ``PATH: problem`` too: before,
    a checkpoint, run, export, model and data directory was named bare, so ``my run: ...``
    read as two words and a name with a newline broke the message over two lines."""
    from editrain.paths import shown

    _, call, named, how = next(c for c in _path_refusals() if c[0] == case)
    d = tmp_path / name
    d.mkdir()
    with pytest.raises((ValueError, OSError, CheckpointError, RunDirError)) as got:
        call(d)
    message = str(got.value)
    assert "\n" not in message and "\t" not in message and "\x7f" not in message, message
    spelled = shown(str(named(d)))
    assert spelled in message, message
    if how == "subject":  # after the option it names, if any, and before a line: ":1"
        assert re.match(rf"([\w.-]+: )?{re.escape(spelled)}(:\d+)?: ", message), message
