"""Hostile files and odd inputs (issue 48, classes 1-4, 8, 9, 11): every class walked, not
only its examples.

1. Run-directory writes never follow a link: every writer of a run directory, with a link
   where it writes a file or at a directory it writes into, leaves the link's target as it
   was and refuses in one line naming the link.
2. Reads from checkpoints are bounded and trust no file type: a 2 GiB sparse rank JSON or
   a 1 GiB ``.metadata`` is refused by its size at once; a ``step_*`` directory or a
   ``.distcp`` that is a link, or a FIFO, is refused.
3. Every counter read from a checkpoint is checked (type, range, consistency with the
   marker) before any worker starts.
4. One JSON reader: any JSON shape in a marker, rank state or run record is read or
   refused in one bounded line naming the file, never a traceback; deep nesting too.
8. ``--overwrite`` removes an owned directory only when it holds nothing but editrain's
   files.
9. The token cache's files are checked against the checksums of its ``meta.json``.
11. A resumed run keeps its checkpoint schedule.

The unit tests call the writers and readers directly (Hypothesis walks the shapes); the
command-line tests use one real checkpoint written once per module.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from editrain import rundir
from editrain.checkpoint import (
    RANK_STATE_SCHEMA,
    _read_rank_json,
    check_files,
    list_checkpoints,
    rank_file,
    read_marker,
)
from editrain.errors import CheckpointError, ConfigError, RunDirError
from editrain.metrics import MetricsWriter, RankLog, plot_runs, read_jsonl
from editrain.paths import shown
from editrain.safe_io import (
    check_no_links,
    cut_partial_line,
    make_dir,
    open_write,
    read_json,
    write_atomic,
)
from editrain.train import next_after

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


def _outside(tmp_path: Path) -> tuple[Path, Path]:
    """A file and a directory outside the run directory, with known contents."""
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    victim = out / "victim.txt"
    victim.write_text("precious\n")
    (out / "dir").mkdir(exist_ok=True)
    return victim, out / "dir"


def _untouched(victim: Path, folder: Path) -> None:
    assert victim.read_text() == "precious\n"
    assert list(folder.iterdir()) == []


# ---------------------------------------------------------------------------- class 1
def _record(run: Path) -> None:
    rundir.write_record(run, rundir.RunRecord(run_id="r", branch="b"))


def _metrics(run: Path) -> None:
    w = MetricsWriter(run, tensorboard=False, trackers=[])
    w.write({"step": 1, "loss": 1.0})
    w.close()


def _ranklog(run: Path) -> None:
    log = RankLog(run, 0)
    log.write({"step": 1})
    log.close()


def _config(run: Path) -> None:
    write_atomic(run / "config.toml", "a = 1\n", root=run)


def _event(run: Path) -> None:
    rundir._append_event(run / "metrics.jsonl", {"event": "timeline"})


def _lock(run: Path) -> None:
    rundir.RunLock(run).acquire().release()


def _link_state(run: Path) -> None:
    from editrain.sim import SharedLink

    SharedLink(run / ".link" / "r0.state", 1e6, 0.0).reserve(10)


def _error_log(run: Path) -> None:
    from editrain.spawn import errors_logged

    with pytest.raises(KeyError), errors_logged(run / "logs", 0, 1):
        raise KeyError("boom")
    path = run / "logs" / "rank0.log"
    if path.is_symlink() or not path.is_file():  # refused (errors_logged swallows it)
        raise RunDirError(f"{path.parent if path.parent.is_symlink() else path}: no log "
                          "written through the link")


def _plots(run: Path) -> None:
    (run / "metrics.jsonl").write_text('{"step": 1, "tokens": 1, "loss": 2.0, '
                                       '"wall_time_s": 1.0}\n')
    plot_runs([run])


def _wandb_id(run: Path) -> None:
    from editrain.tracking import RUN_ID_FILE

    write_atomic(run / RUN_ID_FILE, "abc\n", root=run)


def _run_tokenizer(run: Path) -> None:
    from tokenizers import Tokenizer, models

    from editrain.hf_checkpoint import save_run_tokenizer

    src = run.parent / "src-tokenizer.json"  # read: its end of text names the run's
    Tokenizer(models.WordLevel({"<|endoftext|>": 0}, unk_token="<|endoftext|>")).save(str(src))
    save_run_tokenizer(run, src, None)


WRITERS = {
    # writer: (the file it writes, the directory it writes into or None)
    _record: ("editrain-run.json", None),
    _metrics: ("metrics.jsonl", None),
    _ranklog: ("ranks/rank0.jsonl", "ranks"),
    _config: ("config.toml", None),
    _lock: (".editrain.lock", None),
    _link_state: (".link/r0.state", ".link"),
    _error_log: ("logs/rank0.log", "logs"),
    _plots: ("loss_vs_tokens.png", None),
    _wandb_id: ("wandb-run-id", None),
    _run_tokenizer: ("tokenizer/tokenizer.json", "tokenizer"),
}


CASES = [(w, "file") for w in WRITERS] + [(w, "dir") for w, (_, d) in WRITERS.items() if d]


@pytest.mark.parametrize(("writer", "where"), CASES,
                         ids=[f"{w.__name__}-{where}" for w, where in CASES])
def test_no_run_directory_writer_follows_a_link(tmp_path, writer, where):
    """A link where the writer writes its file, or at the directory it writes into (a
    directory of the run directory: the run directory itself is the user's choice): the
    target stays as it was and the writer refuses, naming the link."""
    name, folder = WRITERS[writer]
    run = tmp_path / "run"
    run.mkdir()
    victim, outside_dir = _outside(tmp_path)
    if where == "file":
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).symlink_to(victim)
        link = run / name
    else:
        (run / folder).symlink_to(outside_dir, target_is_directory=True)
        link = run / folder
    with pytest.raises(RunDirError) as e:
        writer(run)
    assert str(link) in str(e.value) and "\n" not in str(e.value)
    _untouched(victim, outside_dir)
    assert link.is_symlink()


def test_the_example_metrics_link_is_refused_by_resume_before_any_work(tmp_path):
    """Issue 48's example: RUN_DIR/metrics.jsonl a link to a file outside; a resume of
    that run is refused by the run-directory check, before anything is written."""
    run = tmp_path / "run"
    run.mkdir()
    victim, outside_dir = _outside(tmp_path)
    _record(run)
    (run / "metrics.jsonl").symlink_to(victim)
    ckpt = run / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    rec = rundir.read_record(run)
    (ckpt / "editrain.json").write_text(json.dumps({"step": 4, "run_id": rec.run_id}))
    with pytest.raises(RunDirError, match="metrics.jsonl\" is a symbolic link"):
        rundir.check(run, overwrite=False, resume=[ckpt])
    _untouched(victim, outside_dir)


_PART = st.sampled_from(["a", "b", "c"])


@FAST
@given(parts=st.lists(_PART, min_size=1, max_size=4), link_at=st.integers(0, 3),
       how=st.sampled_from(["open", "atomic", "mkdir"]), dangling=st.booleans())
def test_safe_io_never_writes_through_a_link_anywhere_below_the_root(
        tmp_path_factory, parts, link_at, how, dangling):
    """Any path below the root, with a link at any component: the write is refused and
    nothing outside changes (a dangling link is not created through either)."""
    base = tmp_path_factory.mktemp("w")
    root = base / "run"
    root.mkdir()
    victim, outside_dir = _outside(base)
    link_at = min(link_at, len(parts) - 1)
    target_file = root.joinpath(*parts)
    link = root.joinpath(*parts[:link_at + 1])
    link.parent.mkdir(parents=True, exist_ok=True)
    is_last = link == target_file
    target = (base / "nowhere") if dangling else (victim if is_last and how != "mkdir"
                                                  else outside_dir)
    link.symlink_to(target)
    with pytest.raises(RunDirError, match="symbolic link|not a directory|cannot"):
        if how == "open":
            open_write(target_file, "a", root=root).close()
        elif how == "atomic":
            write_atomic(target_file, "x", root=root)
        else:
            make_dir(target_file, root=root)
    _untouched(victim, outside_dir)
    assert not (base / "nowhere").exists()


def test_a_fifo_where_editrain_writes_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")
    t0 = time.monotonic()
    with pytest.raises(RunDirError, match="cannot open|not a regular file"):
        open_write(tmp_path / "metrics.jsonl", "a", root=tmp_path)
    assert time.monotonic() - t0 < 2


def test_cut_partial_line_reads_only_the_tail_and_keeps_whole_rows(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = "".join(json.dumps({"step": i, "pad": "x" * 300}) + "\n" for i in range(500))
    path.write_text(rows + '{"step": 500, "pa')
    cut_partial_line(path, root=tmp_path)
    assert path.read_text() == rows
    cut_partial_line(path, root=tmp_path)  # whole already: unchanged
    assert path.read_text() == rows
    path.write_text("no newline at all")
    cut_partial_line(path, root=tmp_path)
    assert path.read_text() == ""


@pytest.mark.parametrize("writer", list(WRITERS), ids=lambda w: w.__name__)
def test_a_run_directory_that_is_itself_a_link_is_the_users_choice(tmp_path, writer):
    """The run directory may be a link (to a larger disk): every writer writes there."""
    real = tmp_path / "disk" / "run"
    real.mkdir(parents=True)
    (tmp_path / "run").symlink_to(real, target_is_directory=True)
    writer(tmp_path / "run")
    name, _ = WRITERS[writer]
    assert (real / name).is_file() and not (real / name).is_symlink()


def test_check_no_links_looks_only_below_the_root(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    check_no_links(tmp_path / "alias" / "x", root=tmp_path / "alias")  # the user's link: ok
    with pytest.raises(RunDirError):
        check_no_links(tmp_path / "alias" / "x", root=tmp_path)


# ---------------------------------------------------------------------------- class 4
def _json_values():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=True, allow_infinity=True),
                        st.text(max_size=30))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from(["step", "format", "topology", "run_id", "branch",
                                         "owned", "history", "num_units", "x"]) | st.text(
                                             max_size=8), inner, max_size=5)), max_leaves=20)


def _one_bounded_line(message: str, path: Path) -> None:
    assert "\n" not in message
    assert str(path) in message
    assert len(message) < len(str(path)) + 400, message


@FAST
@given(value=_json_values())
def test_any_json_shape_in_a_marker_is_read_or_refused_in_one_bounded_line(
        tmp_path_factory, value):
    ckpt = tmp_path_factory.mktemp("c") / "step_00000004"
    ckpt.mkdir()
    (ckpt / "editrain.json").write_text(json.dumps(value))
    try:
        marker = read_marker(ckpt)
    except CheckpointError as e:
        _one_bounded_line(str(e), ckpt / "editrain.json")
        return
    assert isinstance(marker, dict) and type(marker["step"]) is int and marker["step"] >= 0


@FAST
@given(value=_json_values())
def test_any_json_shape_in_a_run_record_is_read_or_refused_in_one_bounded_line(
        tmp_path_factory, value):
    run = tmp_path_factory.mktemp("r")
    (run / rundir.RECORD).write_text(json.dumps(value))
    try:
        rec = rundir.read_record(run)
    except RunDirError as e:
        _one_bounded_line(str(e), run / rundir.RECORD)
        return
    assert isinstance(rec.run_id, str) and all(isinstance(n, str) for n in rec.owned)


@pytest.mark.parametrize("text", ["[1,2,3]", "[" * 200_000 + "]" * 200_000, '"x"', "null",
                                  "{", '{"step": NaN}', '{"step": true}', '{"step": "4"}',
                                  '{"step": 1e18}', '{"step": -1}', "\xff\xfe"])
def test_the_issue_examples_of_malformed_markers_are_one_line(tmp_path, text):
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    (ckpt / "editrain.json").write_bytes(text.encode("utf-8", "surrogateescape")
                                         if text != "\xff\xfe" else b"\xff\xfe")
    with pytest.raises(CheckpointError) as e:
        read_marker(ckpt)
    _one_bounded_line(str(e.value), ckpt / "editrain.json")


def test_a_huge_string_is_never_echoed(tmp_path):
    """A 50 MB string in a marker field: the refusal quotes its head and its length."""
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    (ckpt / "editrain.json").write_text(json.dumps({"step": 4, "run_id": "x" * 3_000_000}))
    with pytest.raises(CheckpointError) as e:
        read_marker(ckpt)
    assert len(str(e.value)) < 400 and "3000000 characters" in str(e.value)
    (ckpt / "editrain.json").write_text(json.dumps({"step": 4, "run_id": "x" * (50 << 20)}))
    with pytest.raises(CheckpointError, match="more than the") as e:
        read_marker(ckpt)
    assert len(str(e.value)) < 400


def test_metrics_rows_of_any_shape_are_skipped_not_fatal(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('[1,2,3]\n{"step": 1}\n' + "[" * 100_000 + "\n" + '"s"\n{"step": 2}\n'
                    + "x" * (2 << 20) + "\n{\"step\": 3}\n")
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    with pytest.raises(RunDirError, match="symbolic link"):
        read_jsonl(link)


def test_the_other_json_readers_share_the_bounds(tmp_path):
    """Benchmark results and the engine's plain state (JSON in a checkpoint tensor) go
    through the same reader: deep nesting, a list where an object belongs, a link."""
    import torch

    from editrain.bench.results import RESULTS_FILE, load_record
    from editrain.sync.state import from_json_tensor, json_tensor

    (tmp_path / RESULTS_FILE).write_text("[1,2,3]")
    with pytest.raises(ValueError, match="a JSON object is expected"):
        load_record(tmp_path)
    (tmp_path / RESULTS_FILE).unlink()
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / RESULTS_FILE).symlink_to(tmp_path / "real.json")
    with pytest.raises(ValueError, match="symbolic link"):
        load_record(tmp_path)
    assert from_json_tensor(json_tensor({"a": [1, 2]})) == {"a": [1, 2]}
    deep = torch.frombuffer(bytearray(b"[" * 100_000 + b"]" * 100_000), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="nested deeper"):
        from_json_tensor(deep)


def test_every_json_a_user_can_hand_us_goes_through_the_bounded_reader():
    """Class 4 walked over the code, not the cases: no module parses JSON itself
    (``json.load``/``json.loads``) but ``editrain.safe_io``, so every file a user can hand
    us (a run's files, a model directory's config.json, index, tokenizer_config.json and
    safetensors headers, a corpus's records, a dataset's split list, a planner config) is
    depth-bounded with one-line errors. The benchmarks alone read JSON they wrote
    themselves in the same invocation."""
    assert not _parsers_outside_safe_io("json", skip="bench/")


def _parsers_outside_safe_io(module: str, skip: str | None = None) -> list[str]:
    """``FILE:LINE`` of every ``MODULE.load``/``MODULE.loads`` in editrain outside
    ``safe_io.py`` (and the modules under ``skip``)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "editrain"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "safe_io.py" or (skip and rel.startswith(skip)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("load", "loads")
                    and isinstance(node.value, ast.Name) and node.value.id == module):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_every_toml_goes_through_the_bounded_reader():
    """The same class for TOML (``tomllib`` recurses once per nesting level): no module
    parses TOML itself but ``editrain.safe_io``, so ``--config``, a run's ``config.toml``
    (resume, plot, plan --calibrate), a planner configuration and a command-line value are
    depth-bounded with one-line errors."""
    assert not _parsers_outside_safe_io("tomllib")


DEEP_TOML = "x = " + "[" * 100_000 + "]" * 100_000


def test_toml_nested_too_deep_is_one_line_everywhere(tmp_path, capsys):
    from editrain.cli import main
    from editrain.config import load_config
    from editrain.config.toml_io import load_resumed_config, parse_scalar
    from editrain.plan.calibrate import read_config
    from editrain.plan.inputs import load_inputs
    from editrain.safe_io import read_toml_value

    deep = tmp_path / "deep.toml"
    deep.write_text(DEEP_TOML)
    said = "not TOML editrain reads: nested deeper than 64 levels"
    with pytest.raises(ConfigError, match=f"^--config: .*deep.toml\"?: {said}$"):
        load_config(deep)
    with pytest.raises(ConfigError, match=f"^plan: .*deep.toml\": {said}$"):
        load_inputs(deep)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(DEEP_TOML)
    with pytest.raises(ConfigError, match=f"^--resume: .*: {said}; give the run's options"):
        load_resumed_config(str(run), {})
    with pytest.raises(ConfigError, match=f"^plan: .*config.toml\": {said}$"):
        read_config(run)
    # a command-line value nested that deep is a string, refused by the option's type
    assert parse_scalar("[" * 5000 + "]" * 5000) == "[" * 5000 + "]" * 5000
    assert main(["train", "--train.steps", "[" * 5000 + "]" * 5000]) == 2
    err = capsys.readouterr().err
    assert err.startswith("editrain: error: train.steps: expected an integer") and len(err) < 1200
    # 64 levels are read, the document's table the first; 65 are not (JSON's bound)
    assert read_toml_value("x = " + "[" * 63 + "]" * 63, "t")["x"] is not None
    with pytest.raises(CheckpointError, match="nested deeper than 64"):
        read_toml_value("x = " + "[" * 64 + "]" * 64, "t")
    with pytest.raises(ValueError, match="^t: not UTF-8 text"):
        read_toml_value(b"x = '\xff'", "t", error=ValueError)
    with pytest.raises(ValueError, match=r"^t: not valid TOML \(.*\); do this$"):
        read_toml_value("x = [", "t", error=ValueError, hint="; do this")


def test_a_config_file_is_read_bounded_and_a_link_to_it_followed(tmp_path):
    from editrain.config import load_config
    from editrain.config.toml_io import CONFIG_MAX_BYTES

    mine = tmp_path / "mine.toml"
    mine.write_text("[train]\nsteps = 7\n")
    (tmp_path / "link.toml").symlink_to(mine)  # a user's own link: followed
    assert load_config(tmp_path / "link.toml").train.steps == 7
    with open(tmp_path / "big.toml", "wb") as f:
        f.truncate(CONFIG_MAX_BYTES + 1)
    with pytest.raises(ConfigError, match="^--config: .*big.toml\": the configuration has "):
        load_config(tmp_path / "big.toml")


def test_an_error_message_never_echoes_an_unbounded_value(capsys):
    """A refusal quotes what it refuses, and a value (on the command line, in a config
    file, a checkpoint's marker) can be megabytes: every word of a message is cut to
    LONGEST_WORD characters and its length, the message to LONGEST_MESSAGE, at the
    exception (ConfigError, CheckpointError) and where the CLI prints any error."""
    import pickle

    from editrain.cli import main
    from editrain.errors import LONGEST_MESSAGE, LONGEST_WORD, bounded

    value = "x" * 50_000
    assert main(["train", "--train.steps", value]) == 2
    err = capsys.readouterr().err
    assert err == (f"editrain: error: train.steps: expected an integer, got "
                   f"\"{value[:LONGEST_WORD - 11]}... (50002 characters)\n")
    assert main(["train", "--data.path", value]) == 2  # an OSError's own text: a path
    assert len(capsys.readouterr().err) < LONGEST_WORD + 200
    for text in ("a" * 50_000, "b " * 50_000, "c" * LONGEST_WORD, "d" * (LONGEST_WORD + 1),
                 "short: kept as it is"):
        once = bounded(text)
        assert bounded(once) == once and len(once) <= LONGEST_MESSAGE
        assert once == text or len(text) > LONGEST_WORD
    assert bounded("c" * LONGEST_WORD) == "c" * LONGEST_WORD
    for kind in (ConfigError, CheckpointError):
        e = kind(f"opt: {value}")
        assert len(str(e)) < LONGEST_WORD + 40
        assert str(pickle.loads(pickle.dumps(e))) == str(e)  # sent between processes


def test_model_directory_json_nested_too_deep_is_one_line(tmp_path):
    from editrain.models.hf import read_hf_config
    from editrain.models.hf_dir import inspect_weights, read_config, special_tokens

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "config.json").write_text('{"model_type": "llama", "x": ' + deep + "}")
    for read, option in ((read_config, "model.init_from"), (read_hf_config, "model.hf_config")):
        with pytest.raises(ValueError) as e:
            read(tmp_path)
        assert str(e.value) == (f"{option}: {shown(tmp_path / 'config.json')}: not JSON editrain "
                                "reads: nested deeper than 64 levels")
    (tmp_path / "tokenizer_config.json").write_text(deep)
    with pytest.raises(ValueError, match=r"^data.tokenizer: .*tokenizer_config.json\": not JSON "
                                         r"editrain reads: nested deeper"):
        special_tokens(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(deep)
    with pytest.raises(ValueError, match=r"^model.init_from: .*index.json\": not JSON editrain "
                                         r"reads: nested deeper"):
        inspect_weights(tmp_path)
    import struct

    header = deep.encode()
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match=r"^model.init_from: .*model.safetensors\" is corrupt "
                                         r"\(its safetensors header: .*nested deeper"):
        inspect_weights(tmp_path)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2.7, 1], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": ["2", 1], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2, 1], "data_offsets": ["0", 8]},
    {"dtype": "F32", "shape": [2, 1], "data_offsets": [0.0, 8]},
    {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8, 9]},
    {"dtype": "F32", "shape": "21", "data_offsets": [0, 8]},
    {"dtype": ["F32"], "shape": [2, 1], "data_offsets": [0, 8]},
    [1, 2],
])
def test_a_safetensors_header_is_read_strictly(tmp_path, entry):
    """A tensor's shape and byte range were read with ``int()``: a dimension of ``true``
    was 1, ``2.7`` 2, ``"2"`` 2, an offset ``"0"`` 0, and a list as the dtype ended in a
    TypeError. Each is refused in one line naming the option, the file and the tensor."""
    import struct

    from editrain.models.hf_dir import read_safetensors_header

    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ValueError) as info:
        read_safetensors_header(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"model.init_from: {shown(path)}"), msg
    assert '"w"' in msg, msg
    good = json.dumps({"w": {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(good)) + good + bytes(8))
    assert read_safetensors_header(path)["w"].shape == (2, 1)


# ---------------------------------------------------------------------------- classes 2, 3
MARKER = {"format": 3, "step": 8, "topology": [2, 1], "num_units": 3, "method": "diloco",
          "seq_len": 32, "config": {"checkpoint": {"every": 4}, "train": {"eval_every": 4}}}


def _rank_state(step: int = 8) -> dict:
    import base64

    return {
        "step": step, "next_eval": 12, "next_ckpt": 12, "last_eval": 8, "finished": False,
        "wall_time_s": 1.5, "off_train_s": 0.1,
        "data": {"epoch": 0, "position": 16, "rank": 0, "world_size": 2, "seed": 0,
                 "num_windows": 100, "seq_len": 32, "consumed_layouts": []},
        "rng": {"cpu": base64.b64encode(bytes(5056)).decode()},
        "sim_rng": [0] * 624 + [624],
        "optim": {"dict": {"param_groups": [{"dict": {"lr": 0.001}}]}},
    }


def test_a_valid_rank_state_is_read(tmp_path):
    path = tmp_path / "rank_00000.json"
    path.write_text(json.dumps(_rank_state()))
    state = _read_rank_json(path, 3, MARKER)
    assert state["step"] == 8 and state["optim"] == {"param_groups": [{"lr": 0.001}]}


HOSTILE = st.one_of(st.just(10**18), st.just(-1), st.just(True), st.just(False),
                    st.just(float("nan")), st.just(float("inf")), st.just(2.5), st.just("8"),
                    st.none(), st.just([]), st.just({}), st.integers(-(2**80), 2**80),
                    st.text(max_size=5))
FIELDS = ["step", "next_eval", "next_ckpt", "last_eval", "finished", "wall_time_s",
          "off_train_s", "data.epoch", "data.position", "data.num_windows", "data.seq_len",
          "data.world_size", "rng.cpu", "sim_rng", "sim_rng.624", "sim_rng.0", "tp",
          "ft_committed", "optim"]


def _set(state: dict, field: str, value) -> None:
    *path, last = field.split(".")
    node = state
    for key in path:
        node = node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


@FAST
@given(field=st.sampled_from(FIELDS), value=HOSTILE)
def test_every_counter_of_a_rank_state_is_checked(tmp_path_factory, field, value):
    """A hostile value in any field: refused in one line naming the file and the field,
    unless the value is one the run could really have saved there."""
    path = tmp_path_factory.mktemp("r") / "rank_00000.json"
    state = _rank_state()
    _set(state, field, value)
    path.write_text(json.dumps(state))
    try:
        got = _read_rank_json(path, 3, MARKER)
    except CheckpointError as e:
        _one_bounded_line(str(e), path)
        assert field.split(".")[0] in str(e)
        return
    # Accepted: then it is plausible for this marker.
    assert got["step"] == 8
    RANK_STATE_SCHEMA.check(got | {"optim": None}, str(path), "", CheckpointError)
    assert 0 <= got["next_ckpt"] <= 8 + 4 + 1 and 0 <= got["next_eval"] <= 8 + 4 + 1
    assert got["data"]["position"] <= got["data"]["num_windows"]


@pytest.mark.parametrize("step", [10**18, float("nan"), -4, True, "8", 7])
def test_the_issue_examples_of_a_rank_step(tmp_path, step):
    path = tmp_path / "rank_00000.json"
    state = _rank_state()
    state["step"] = step
    path.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="'step'"):
        _read_rank_json(path, 3, MARKER)


def test_a_sparse_2_gib_rank_json_is_refused_by_its_size_at_once(tmp_path):
    path = tmp_path / "rank_00000.json"
    with open(path, "wb") as f:
        f.truncate(2 << 30)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="more than the"):
        _read_rank_json(path, 3, MARKER)
    assert time.monotonic() - t0 < 1.0


def test_a_rank_json_that_is_a_fifo_or_a_link_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "rank_00000.json")
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="not a regular file"):
        _read_rank_json(tmp_path / "rank_00000.json", 3, MARKER)
    assert time.monotonic() - t0 < 2
    real = tmp_path / "real.json"
    real.write_text(json.dumps(_rank_state()))
    (tmp_path / "rank_00001.json").symlink_to(real)
    with pytest.raises(CheckpointError, match="symbolic link"):
        _read_rank_json(tmp_path / "rank_00001.json", 3, MARKER)


@FAST
@given(size=st.integers(0, 1 << 20), what=st.sampled_from(["file", "dir", "link"]))
def test_read_json_refuses_by_size_and_type_before_reading(tmp_path_factory, size, what):
    d = tmp_path_factory.mktemp("j")
    path = d / "x.json"
    if what == "file":
        with open(path, "wb") as f:
            f.truncate(size)
    elif what == "dir":
        path.mkdir()
    else:
        (d / "t").write_text("{}")
        path.symlink_to(d / "t")
    cap = 4096
    try:
        read_json(path, max_bytes=cap)
    except CheckpointError as e:
        _one_bounded_line(str(e), path)
        assert what != "file" or size > cap or "JSON" in str(e)
        return
    raise AssertionError(f"accepted a {what} of {size} bytes")


# ---------------------------------------------------------------------------- class 8
def _owned_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    (run / "ranks" / "rank0.jsonl").write_text("{}\n")
    (run / "logs").mkdir()
    (run / "logs" / "rank0.log").write_text("x")
    (run / "metrics.jsonl").write_text("{}\n")
    ck = run / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    for name in ("editrain.json", ".metadata", "__0_0.distcp", "rank_00000.json"):
        (ck / name).write_text("x")
    rundir.write_record(run, rundir.RunRecord(
        run_id="r", branch="b", owned=["ranks", "logs", "metrics.jsonl", "checkpoints"]))
    return run


def test_overwrite_removes_an_owned_run_that_holds_only_editrains_files(tmp_path):
    run = _owned_run(tmp_path)
    claim = rundir.check(run, overwrite=True, resume=[])
    rundir.claim(claim)
    assert sorted(p.name for p in run.iterdir()) == [rundir.RECORD]


USER_FILES = st.sampled_from([
    "ranks/my_analysis.py", "logs/notes.txt", "checkpoints/step_00000004/mine.py",
    "checkpoints/README", "checkpoints/abandoned/b1/step_00000002/x.bin",
    "ranks/sub/rank1.jsonl", "checkpoints/step_00000004/sub/editrain.json"])


@FAST
@given(user_file=USER_FILES)
def test_overwrite_refuses_an_owned_directory_holding_a_users_file(tmp_path_factory,
                                                                   user_file):
    """Issue 48's example (ranks/my_analysis.py) and its neighbours: refused by name, and
    nothing is deleted."""
    run = _owned_run(tmp_path_factory.mktemp("o"))
    path = run / user_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("mine")
    with pytest.raises(RunDirError) as e:
        rundir.check(run, overwrite=True, resume=[])
    assert user_file.split("/")[0] in str(e.value)
    assert str(Path(user_file).parent) in str(e.value) or user_file in str(e.value)
    assert path.read_text() == "mine" and (run / "ranks" / "rank0.jsonl").is_file()


def test_overwrite_refuses_a_link_inside_an_owned_directory(tmp_path):
    run = _owned_run(tmp_path)
    victim, outside_dir = _outside(tmp_path)
    (run / "logs" / "rank1.log").symlink_to(victim)
    with pytest.raises(RunDirError, match="logs/rank1.log"):
        rundir.check(run, overwrite=True, resume=[])
    _untouched(victim, outside_dir)


# ---------------------------------------------------------------------------- class 11
@given(due=st.integers(0, 10**6), point=st.floats(0, 10**6), every=st.integers(0, 1000))
def test_next_after_is_the_first_due_point_past_the_point(due, point, every):
    got = next_after(due, point, every)
    expected = due
    if every:
        while expected <= point:
            expected += every
    assert got == expected


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def run8(data_cache, tmp_path_factory) -> Path:
    """A run of 8 steps, checkpoint every 4, written once (2 workers, tiny model)."""
    from tests.test_cli import editrain, explain, tiny

    run = tmp_path_factory.mktemp("run8") / "run"
    proc, _ = editrain("train", *tiny(data_cache), "--nproc", "2", "--shard-size", "1",
                       "--method", "diloco", "--sync.local_sgd_sync_interval", "2",
                       "--train.batch_size", "4", "--train.seq_len", "32",
                       "--train.eval_every", "4", "--train.eval_tokens", "1024",
                       "--checkpoint.every", "4", "--checkpoint.keep", "3", "--quiet",
                       "--steps", "8", "--run-dir", str(run))
    assert proc.returncode == 0, explain(proc)
    return run


def _copy_run(run8: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run8, dst, symlinks=True)
    return dst


def test_a_resumed_run_keeps_its_checkpoint_schedule(run8, data_cache, tmp_path):
    """Issue 48's example: 8 steps with --checkpoint.every 4, resumed with --steps 12:
    checkpoints at 4, 8 and 12, not at an off-schedule step."""
    from tests.test_cli import editrain, explain, tiny

    run = _copy_run(run8, tmp_path)
    proc, _ = editrain("train", *tiny(data_cache), "--nproc", "2", "--shard-size", "1",
                       "--method", "diloco", "--sync.local_sgd_sync_interval", "2",
                       "--train.batch_size", "4", "--train.seq_len", "32",
                       "--train.eval_every", "4", "--train.eval_tokens", "1024",
                       "--checkpoint.every", "4", "--checkpoint.keep", "3", "--quiet",
                       "--steps", "12", "--run-dir", str(run), "--resume", str(run))
    assert proc.returncode == 0, explain(proc)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = [r["step"] for r in rows if r.get("event") == "checkpoint"]
    assert saved == [4, 8, 12], saved
    evals = [r["step"] for r in rows if "val_loss" in r and not r.get("replayed")]
    assert evals == [0, 4, 8, 12], evals
    assert [int(p.name[5:]) for p in list_checkpoints(run)] == [4, 8, 12]


@pytest.mark.timeout(120)
def test_a_marker_claiming_more_layers_than_its_weights_is_refused_before_a_build(
        run8, tmp_path):
    """A checkpoint's marker edited to claim 10**5 layers (the most a model's description may
    give; 10**9 is refused by the reader of its numbers): export and sample refuse it in
    one line before they build the model it describes on the meta device (to find its tied
    parameters, or to check its shapes): a build takes about a millisecond a layer."""
    from editrain.config import ConfigError
    from editrain.hf_checkpoint import export_checkpoint
    from editrain.sample import load_for_sampling

    run = _copy_run(run8, tmp_path)
    ckpt = list_checkpoints(run)[-1]
    marker = json.loads((ckpt / "editrain.json").read_text())
    marker["model"]["n_layers"] = 10**5
    (ckpt / "editrain.json").write_text(json.dumps(marker))
    for command in (lambda: export_checkpoint(run, tmp_path / "out"),
                    lambda: load_for_sampling(run)):
        with pytest.raises(ConfigError, match=r"editrain.json\" has n_layers = .*, but its "
                                              r"weights hold 2 layers") as e:
            command()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_resume_with_no_step_left_is_refused_before_any_worker(run8, data_cache, tmp_path):
    """--resume of a run whose latest checkpoint is at step 8 with --steps 8 trained
    nothing, evaluated again, wrote step 8's checkpoint again and appended its rows to
    metrics.jsonl a second time, without a word."""
    run = _copy_run(run8, tmp_path)
    before = (run / "metrics.jsonl").read_bytes()
    assert _resume_error(run, data_cache, steps=8).endswith(
        "train.steps: 8 is not beyond the checkpoint's step 8, so the resumed run would "
        "train nothing; give a larger --train.steps")
    assert (run / "metrics.jsonl").read_bytes() == before


@pytest.mark.timeout(200)
def test_a_resume_with_no_step_left_is_refused_under_torchrun(run8, data_cache, tmp_path):
    """The same resume as a torchrun job, whose workers editrain's launcher does not
    start: every rank refuses it before the run directory is claimed, metrics.jsonl, the
    checkpoint, config.toml and the run's record untouched (the claim rewrites the last
    two: the next plain --resume would take the refused job's options). Both ranks print
    the refusal: rank 0 decides, rank 1 waits for its decision in torchrun's store, and
    rank 0 exits only once rank 1 has read it. Before, each rank checked on its own and
    torchrun stopped rank 1 as soon as rank 0 exited, so whether rank 1 printed it was a
    race (it lost it once in CI)."""
    from tests.test_cli import tiny

    run = _copy_run(run8, tmp_path)
    ckpt = list_checkpoints(run)[-1]
    before = {p: p.read_bytes() for p in [run / "metrics.jsonl", run / "config.toml",
                                          run / rundir.RECORD, *ckpt.rglob("*")]
              if p.is_file()}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "editrain", "train",
         *tiny(data_cache), "--shard-size", "1", "--method", "diloco",
         "--sync.local_sgd_sync_interval", "2", "--train.batch_size", "4",
         "--train.seq_len", "32", "--train.eval_tokens", "1024", "--quiet", "--steps", "8",
         "--run-dir", str(run), "--resume", str(run)],
        capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert proc.stderr.count("train.steps: 8 is not beyond the checkpoint's step 8, so the "
                             "resumed run would train nothing") == 2, proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in before} == before


def _torchrun_env() -> dict[str, str]:
    """This process's environment less its own torchrun variables, one thread a worker."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _files(run: Path) -> dict[Path, bytes]:
    """Every file of a run directory and its bytes (its lock file, which a job that only
    asks for the directory writes its pid into, left out)."""
    return {p: p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != rundir.LOCK}


@pytest.mark.timeout(200)
def test_a_refused_torchrun_job_is_refused_again_when_torchrun_restarts_it(
        run8, data_cache, tmp_path):
    """A plain torchrun job (--max-restarts 1, neither --resume nor --overwrite) into a
    directory holding another run is refused, and torchrun restarts it: the restart is
    refused the same way, and no file of the other run changes. Before, the restarted rank
    0 took the other run's record for its own job's claim (a restart skipped the check)
    and trained into that run: its metrics, checkpoints and config.toml.

    Both ranks of each attempt print the refusal: rank 1 waits for rank 0's decision (the
    directory's config.toml is there from the start) and shares its refusal. Before, rank
    1 went on into its worker at once, and torchrun stopped it without a word once rank 0
    was refused."""
    from tests.test_cli import tiny

    run = _copy_run(run8, tmp_path)
    before = _files(run)
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "-m", "editrain", "train", *tiny(data_cache), "--shard-size", "1", "--method",
         "diloco", "--sync.local_sgd_sync_interval", "2", "--train.batch_size", "4",
         "--train.seq_len", "32", "--train.eval_tokens", "1024", "--quiet", "--steps", "4",
         "--checkpoint.every", "2", "--run-dir", str(run)],
        capture_output=True, text=True, env=_torchrun_env(), timeout=180)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"--run-dir: {shown(run)} already holds a run") == 4, \
        proc.stderr[-3000:]
    assert _files(run) == before


@pytest.mark.timeout(200)
def test_a_torchrun_restart_goes_on_with_its_own_launchs_run(data_cache, tmp_path):
    """The restart the check above must not break: a worker of a plain torchrun job dies
    after its step 4 checkpoint (sim.fail), torchrun restarts it, and it goes on with its
    launch's own run from that checkpoint, unchecked and unclaimed again (one history
    line). torchrun's store is what tells it so: the record's token is the one the launch
    put there (the restart says no warning of a claim it could not compare)."""
    from editrain.launch.torchrun_claim import CLAIM_TOKEN
    from tests.test_cli import tiny

    run = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
         "-m", "editrain", "train", *tiny(data_cache), "--shard-size", "1", "--method",
         "diloco", "--sync.local_sgd_sync_interval", "2", "--train.batch_size", "4",
         "--train.seq_len", "32", "--train.eval_tokens", "1024", "--quiet", "--steps", "8",
         "--checkpoint.every", "4", "--sim.fail", "0@6", "--run-dir", str(run)],
        capture_output=True, text=True, env=_torchrun_env(), timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"resuming from {run / 'checkpoints' / 'step_00000004'}" in out, out[-3000:]
    assert "without a check" not in out, out[-3000:]
    (line,) = rundir.read_record(run).history
    assert isinstance(line[CLAIM_TOKEN], str)
    assert [p.name for p in list_checkpoints(run)][-1] == "step_00000008"


def _resume_error(run: Path, data_cache: Path, steps: int = 12) -> str:
    from tests.test_cli import editrain, error_line, tiny

    proc, _ = editrain("train", *tiny(data_cache), "--nproc", "2", "--shard-size", "1",
                       "--method", "diloco", "--sync.local_sgd_sync_interval", "2",
                       "--train.batch_size", "4", "--train.seq_len", "32",
                       "--train.eval_tokens", "1024", "--quiet", "--steps", str(steps),
                       "--run-dir", str(run), "--resume", str(run), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr
    return error_line(proc.stderr)


@pytest.mark.parametrize("damage", ["step_1e18", "step_nan", "marker_list", "marker_deep",
                                    "metrics_link", "step_dir_link", "distcp_link",
                                    "ranks_dir_link", "checkpoints_dir_link",
                                    "sparse_rank", "sparse_metadata", "engine_step_1e18",
                                    "engine_syncs_nan"])
def test_hostile_checkpoints_and_run_dirs_end_in_one_line_before_any_worker(
        run8, data_cache, tmp_path, damage):
    run = _copy_run(run8, tmp_path)
    ckpt = list_checkpoints(run)[-1]
    victim, outside_dir = _outside(tmp_path)
    rank0 = rank_file(ckpt, 0)
    if damage.startswith("step_") and damage != "step_dir_link":
        state = json.loads(rank0.read_text())
        state["step"] = 10**18 if damage == "step_1e18" else float("nan")
        rank0.write_text(json.dumps(state))
        expect = "'step'"
    elif damage == "marker_list":
        (ckpt / "editrain.json").write_text("[1,2,3]")
        expect = "a JSON object is expected"
    elif damage == "marker_deep":
        (ckpt / "editrain.json").write_text("[" * 200_000 + "]" * 200_000)
        expect = "nested deeper"
    elif damage == "metrics_link":
        (run / "metrics.jsonl").unlink()
        (run / "metrics.jsonl").symlink_to(victim)
        expect = "metrics.jsonl\" is a symbolic link"
    elif damage.endswith("_dir_link") and damage != "step_dir_link":
        name = damage[:-len("_dir_link")]
        moved = tmp_path / f"{name}-elsewhere"
        shutil.move(str(run / name), moved)
        (run / name).symlink_to(moved, target_is_directory=True)
        expect = f"{name}\" is a symbolic link"
    elif damage == "step_dir_link":
        moved = tmp_path / "elsewhere"
        shutil.move(str(ckpt), moved)
        ckpt.symlink_to(moved, target_is_directory=True)
        expect = "is a symbolic link"
    elif damage == "distcp_link":
        data = next(ckpt.glob("*.distcp"))
        outside = tmp_path / data.name
        shutil.move(str(data), outside)
        data.symlink_to(outside)
        expect = "symbolic link"
    elif damage.startswith("engine_"):
        field = "global_step" if damage == "engine_step_1e18" else "num_syncs"
        value = 10**18 if damage == "engine_step_1e18" else float("nan")
        _rewrite_engine_state(ckpt, lambda s: s.__setitem__(field, value))
        expect = f"plain state of rank00000: field {field!r}"
    elif damage == "sparse_rank":
        with open(rank0, "r+b") as f:
            f.truncate(2 << 30)
        expect = "more than the"
    else:
        with open(ckpt / ".metadata", "r+b") as f:
            f.truncate(1 << 30)
        expect = "more than the"
    rows_before = (run / "metrics.jsonl").read_bytes() if damage != "metrics_link" else b""
    t0 = time.monotonic()
    line = _resume_error(run, data_cache)
    assert expect in line, line
    assert len(line) < 600, line
    assert time.monotonic() - t0 < 60
    _untouched(victim, outside_dir)
    if damage != "metrics_link":  # refused before the run directory was claimed
        assert (run / "metrics.jsonl").read_bytes() == rows_before


def test_check_files_passes_an_intact_checkpoint(run8):
    for ckpt in list_checkpoints(run8):
        check_files(ckpt)


def _rewrite_engine_state(ckpt: Path, change) -> None:
    """Change rank 0's plain engine state inside a DCP checkpoint as a hostile editor
    would: the new tensor appended to its ``.distcp`` file, ``.metadata`` pointed at it."""
    import dataclasses
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from editrain.safe_load import read_metadata
    from editrain.sync.state import from_json_tensor, json_tensor

    md = read_metadata(ckpt)
    fqn = "engine.ranks.rank00000"
    item = md.state_dict_metadata[fqn]
    index = MetadataIndex(fqn, item.chunks[0].offsets)
    info = md.storage_data[index]
    path = ckpt / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        state = from_json_tensor(torch.load(io.BytesIO(f.read(info.length)),
                                            weights_only=True))
    change(state)
    new = json_tensor(state)
    buf = io.BytesIO()
    torch.save(new, buf)
    with open(path, "ab") as f:
        offset = f.tell()
        f.write(buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset,
                                                 length=len(buf.getvalue()))
    item.size = new.shape
    item.chunks[0] = ChunkStorageMetadata(offsets=item.chunks[0].offsets, sizes=new.shape)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("field", ["global_step", "steps_since_sync", "num_syncs",
                                   "num_skipped_syncs", "num_syncs_forced", "next_index",
                                   "synced_replica_steps", "version"])
@pytest.mark.parametrize("value", [10**18, -1, 1.5, float("nan"), "8", None])
def test_check_files_refuses_an_engine_counter_out_of_range(run8, tmp_path, field, value):
    """Issue 48 class 3: the engine's own counters (inside the DCP files, not the rank
    JSON) are checked by the launcher's check_files too, not first in every worker."""
    if field == "synced_replica_steps" and value == 1.5:
        value = 2.0**60  # a float is a valid progress; beyond 2^53 is not
    run = _copy_run(run8, tmp_path)
    ckpt = list_checkpoints(run)[-1]
    check_files(ckpt)
    _rewrite_engine_state(ckpt, lambda s: s.__setitem__(field, value))
    with pytest.raises(CheckpointError) as info:
        check_files(ckpt)
    msg = str(info.value)
    assert "\n" not in msg and "rank00000" in msg
    assert repr(field) in msg or (field == "version" and "version" in msg), msg


# ---------------------------------------------------------------------------- class 9
def test_the_token_cache_detects_bytes_changed_in_place(run8, data_cache, tmp_path):
    """train.bin overwritten in the middle with in-range ids, same size: the job that
    opens the cache refuses it, naming the file; the intact copy opens."""
    from editrain.data.dataset import open_prepared

    entry = next(p for p in data_cache.iterdir()
                 if p.is_dir() and (p / "meta.json").is_file())
    meta = json.loads((entry / "meta.json").read_text())
    assert set(meta["checksums"]) == {"train.bin", "val.bin", "tokenizer.json"}
    copy_dir = tmp_path / entry.name
    shutil.copytree(entry, copy_dir)
    assert open_prepared(copy_dir) is not None
    import numpy as np

    train = copy_dir / "train.bin"
    tokens = np.fromfile(train, dtype=meta["dtype"])
    mid = len(tokens) // 2
    tokens[mid:mid + 4] = (tokens[mid:mid + 4].astype(np.int64) + 1) % meta["vocab_size"]
    tokens.tofile(train)  # same size, every id in range
    assert train.stat().st_size == (entry / "train.bin").stat().st_size
    with pytest.raises(ValueError, match=r"train\.bin\" is corrupted \(its checksum"):
        open_prepared(copy_dir)
    stale = copy.deepcopy(meta)
    del stale["checksums"]
    (copy_dir / "meta.json").write_text(json.dumps(stale))
    assert open_prepared(copy_dir) is None  # built before checksums: rebuilt, not trusted


_META_DROP = object()
META_CASES = [
    *[("vocab_size", v) for v in (True, 2.7, "12", -1, 2**40, None, _META_DROP)],
    *[("train_tokens", v) for v in (True, 2.7, "12", 0, -5, [4])],
    ("val_tokens", 1.0),
    *[("dtype", v) for v in ("object", ">i8", "V16", "U3", "uint32", "int16", 7)],
    *[("eos_id", v) for v in (True, 1.0, "0", 10**9, -1)],
    ("documents", 2.5), ("groups", True), ("val_documents", "3"),
    ("val_train_overlap_32", "0.5"), ("val_train_overlap_32", 7),
    ("kinds", {"train": {"py": {"documents": True, "bytes": 1}}}),
    ("kinds", {"val": {"py": {"documents": 1, "bytes": 2.5}}}),
    ("checksums", {"train.bin": 5, "val.bin": "x", "tokenizer.json": None}),
]


@pytest.mark.parametrize(("field", "value"), META_CASES,
                         ids=[f"{f} missing" if v is _META_DROP else f"{f}={v!r}"[:40]
                              for f, v in META_CASES])
def test_the_token_cache_reads_its_meta_json_strictly(run8, data_cache, tmp_path, field, value):
    """A ``meta.json`` of this format was read with ``int()`` and ``np.dtype()``: a JSON
    ``true`` became a vocabulary of 1, ``2.7`` tokens 2, ``"12"`` 12, and any dtype numpy
    knows (``object``, ``>i8``) was memory-mapped. Each field is checked by its JSON
    type and range (the dtype the one a build writes for the vocabulary), and a bad one is
    refused in one line naming the file and the field, before anything is read."""
    from editrain.data.dataset import open_prepared

    entry = next(p for p in data_cache.iterdir()
                 if p.is_dir() and (p / "meta.json").is_file())
    copy_dir = tmp_path / entry.name
    shutil.copytree(entry, copy_dir)
    meta = json.loads((copy_dir / "meta.json").read_text())
    if value is _META_DROP:
        del meta[field]
    else:
        meta[field] = value
    (copy_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as info:
        open_prepared(copy_dir)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"data.cache_dir: {shown(copy_dir / 'meta.json')}: "), msg
    assert f"'{field}" in msg and "to rebuild it" in msg, msg


@pytest.mark.parametrize("fmt", [4.0, True, "4", None])
def test_a_token_cache_of_no_format_of_ours_is_rebuilt(run8, data_cache, tmp_path, fmt):
    """``format`` was compared with ``!=``: ``4.0`` passed as format 4. Only the integer
    is this editrain's format; any other is another format's entry, rebuilt."""
    from editrain.data.dataset import FORMAT_VERSION, open_prepared

    assert FORMAT_VERSION == 4
    entry = next(p for p in data_cache.iterdir()
                 if p.is_dir() and (p / "meta.json").is_file())
    copy_dir = tmp_path / entry.name
    shutil.copytree(entry, copy_dir)
    meta = json.loads((copy_dir / "meta.json").read_text())
    meta["format"] = fmt
    (copy_dir / "meta.json").write_text(json.dumps(meta))
    assert open_prepared(copy_dir) is None


def test_check_files_refuses_another_engine_state_version(run8, tmp_path):
    run = _copy_run(run8, tmp_path)
    ckpt = list_checkpoints(run)[-1]
    _rewrite_engine_state(ckpt, lambda s: s.__setitem__("version", 1))
    with pytest.raises(CheckpointError, match="version 1; this editrain reads version 2"):
        check_files(ckpt)


def test_a_checkpoints_values_are_quoted_as_its_marker_holds_them():
    """A resume refused for a changed option quoted the marker's values in Python's
    spelling (``checkpoint has None``, ``'diloco'``): the marker is JSON."""
    from editrain.checkpoint import FORMAT, check_compatible

    base = {"format": FORMAT, "vocab_size": 512, "num_units": 3}
    old = dict(base, method="diloco", model={"n_kv_heads": None, "tie_embeddings": True})
    new = dict(base, method="edit", model={"n_kv_heads": 2, "tie_embeddings": False})
    assert check_compatible(old, new) == [
        'method: checkpoint has "diloco", this run has "edit"',
        "model.n_kv_heads: checkpoint has null, this run has 2",
        "model.tie_embeddings: checkpoint has true, this run has false"]


def test_a_json_files_value_is_quoted_as_json_by_its_schema(tmp_path):
    from editrain.safe_io import Int, Obj, read_json

    path = tmp_path / "state.json"
    for text, found in (("true", "true"), ("null", "null"), ('"3"', '"3"'), ("1e400", "1e+400")):
        path.write_text('{"step": ' + text + "}")
        with pytest.raises(CheckpointError, match=rf"\(found {re.escape(found)}\)$"):
            read_json(path, max_bytes=1000, schema=Obj({"step": Int()}))


def _valid_record() -> dict:
    """A benchmark record with every field the report and the headline read."""
    return {"format": 2, "scenario": "spikes", "mode": "quick", "command": "editrain bench",
            "started": "2026-01-01 00:00:00", "elapsed_s": 12.5, "repeats": None,
            "description": "d", "size_caveat": True, "skipped": "skipped: why",
            "tables": [{"title": "t", "markdown": "| a |"}], "measurement_errors": ["e"],
            "targets": [{"name": "n", "met": None, "detail": "x"}], "findings": ["f"],
            "shortfalls": ["s"], "notes": ["n"], "plots": ["p.png"], "headline": ["h"],
            "runs": {"edit": {"ok": False, "error": "died", "retried": ["once"]}},
            "machine": {"usable_cpus": 2, "cpu_count": 4, "cuda": False,
                        "git_commit": None, "load_average": [0.5, 0.4, 0.3],
                        "load_during_runs": [0.5, 1.5]},
            "settings": {"rate": "10mbit", "sync_interval": 8, "scale": 20.0,
                         "corrupt_syncs": [8, 12]},
            "results": {"edit": {"peak_increase": 0.1}}, "user_overrides": {}}


BAD_RECORD_FIELDS = (
    # (field, bad value, the field the refusal names)
    ("format", "2", "format"), ("format", True, "format"), ("format", 2.0, "format"),
    ("format", 0, "format"), ("scenario", 5, "scenario"), ("mode", ["quick"], "mode"),
    ("elapsed_s", "12", "elapsed_s"), ("elapsed_s", math.nan, "elapsed_s"),
    ("elapsed_s", -1, "elapsed_s"), ("elapsed_s", True, "elapsed_s"),
    ("repeats", "3", "repeats"), ("repeats", 2.5, "repeats"), ("skipped", True, "skipped"),
    ("size_caveat", "false", "size_caveat"), ("command", ["x"], "command"),
    ("tables", [{"title": 1, "markdown": ""}], "tables[0].title"),
    ("tables", {"a": 1}, "tables"),
    ("targets", [{"name": "x", "met": "yes"}], "targets[0].met"),
    ("targets", [{"met": True}], "targets[0].name"),
    ("findings", [1], "findings[0]"), ("notes", "text", "notes"), ("plots", [None], "plots[0]"),
    ("headline", [True], "headline[0]"), ("measurement_errors", [{}], "measurement_errors[0]"),
    ("runs", {"a": {"ok": "true"}}, "runs.a.ok"), ("runs", {"a": []}, "runs.a"),
    ("machine", {"usable_cpus": "4"}, "machine.usable_cpus"),
    ("machine", {"load_during_runs": [1, "2"]}, "machine.load_during_runs[1]"),
    ("machine", {"load_during_runs": [1]}, "machine.load_during_runs"),
    ("machine", {"load_average": [math.nan]}, "machine.load_average[0]"),
    ("machine", {"cuda": 1}, "machine.cuda"),
    ("settings", {"rate": 10}, "settings.rate"),
    ("settings", {"sync_interval": "8"}, "settings.sync_interval"),
    ("results", [], "results"),
)


@pytest.mark.parametrize("field,value,named", BAD_RECORD_FIELDS,
                         ids=[f"{f}-{v!r}" for f, v, _ in BAD_RECORD_FIELDS])
def test_a_benchmark_records_fields_are_read_strictly(tmp_path, field, value, named):
    """``results.json`` is read against RESULTS_SCHEMA: a field the report or the headline
    reads that holds what no benchmark writes is refused in one line naming the file and
    the field. Before, it was read with an empty schema: ``int("2")`` made a format of
    ``"2"`` current, a string ``elapsed_s`` or a bool ``skipped`` crashed the page deep in
    its formatting."""
    from editrain.bench.results import RESULTS_FILE, load_record

    (tmp_path / RESULTS_FILE).write_text(json.dumps(_valid_record()))
    assert load_record(tmp_path) == _valid_record()
    (tmp_path / RESULTS_FILE).write_text(json.dumps({**_valid_record(), field: value}))
    with pytest.raises(ValueError) as got:
        load_record(tmp_path)
    message = str(got.value)
    assert "\n" not in message and message.startswith(f"{shown(tmp_path / RESULTS_FILE)}: field "
                                                      f"'{named}'"), message


@pytest.mark.parametrize("rate,bits", [("10mbit", 1e7), ("500kbit", 5e5), ("1.5gbit", 1.5e9),
                                       ("64bit", 64.0), ("10MBIT", 1e7), ("nanmbit", 0.0),
                                       ("infmbit", 0.0), ("1_0mbit", 0.0), ("-5mbit", 0.0),
                                       (" 10mbit", 0.0), ("1e3kbit", 0.0), ("mbit", 0.0)])
def test_a_records_tc_rate_is_read_as_tc_writes_it(rate, bits):
    """A record's ``settings.rate`` is a tc rate (digits, an optional fraction, a unit);
    ``float()`` also read ``nan``, ``inf``, ``1_0`` and a sign, which ordered the real-link
    rows by NaN or infinity."""
    from editrain.bench.headline import _rate_bits

    assert _rate_bits({"settings": {"rate": rate}}) == bits


BAD_STATISTICS = (
    ({"edit": {"tokens_per_s": {"median": [1], "min": 1.0, "max": 2.0, "n": 2}}},
     "results.edit.tokens_per_s.median"),
    ({"edit": {"loss": {"mean": {"a": 1}, "std": 0.1, "n": 3}}}, "results.edit.loss.mean"),
    ({"edit": {"loss": {"mean": 1.0, "std": True, "n": 3}}}, "results.edit.loss.std"),
    ({"rows": [{"x": {"median": 1.0, "min": "0.5", "max": 2.0}}]}, "results.rows[0].x.min"),
    ({"edit": {"tokens_per_s": {"median": 1.0, "n": 2.5}}}, "results.edit.tokens_per_s.n"),
    ({"edit": {"tokens_per_s": {"median": 1.0, "n": -1}}}, "results.edit.tokens_per_s.n"),
)
"""A statistic of a scenario's own ``results`` that is no number: the page's and the
headline's arithmetic (``median * scale``, ``min < x``) failed with a TypeError on each."""


@pytest.mark.parametrize("results,named", BAD_STATISTICS,
                         ids=[named for _, named in BAD_STATISTICS])
def test_a_records_statistics_are_numbers(tmp_path, results, named):
    from editrain.bench.results import RESULTS_FILE, load_record

    good = {**_valid_record(), "results": {"edit": {"tokens_per_s": {
        "median": 1.5, "min": 1.0, "max": None, "n": 2}, "loss": {"mean": 4.0, "std": 0.0,
                                                                  "n": 1}}}}
    (tmp_path / RESULTS_FILE).write_text(json.dumps(good))
    assert load_record(tmp_path) == good
    (tmp_path / RESULTS_FILE).write_text(json.dumps({**_valid_record(), "results": results}))
    with pytest.raises(ValueError) as got:
        load_record(tmp_path)
    assert str(got.value).startswith(f"{shown(tmp_path / RESULTS_FILE)}: field '{named}'"), got.value


def _ft_summary() -> dict:
    """A fault-tolerant run's ``summary.json`` as the launcher writes it (two groups, the
    second died once and healed)."""
    group = {"steps": 12, "tokens": 240, "final_val_loss": 5.0, "wall_time_s": 2.0,
             "tokens_processed": 120, "healed_at": None, "cross_replica_bytes": {"total": 8}}
    return {"fault_tolerance": "torchft", "replicas": 2, "finished_replicas": 2,
            "wall_time_s": 2.5, "tokens_processed": 240, "final_val_loss": 5.0, "steps": 12,
            "vocab_size": None,
            "events": [{"event": "start", "replica": 1, "attempt": 0, "time_s": 0.1,
                        "unix_time": 1000.0},
                       {"event": "died", "replica": 1, "attempt": 0, "exit_code": -9,
                        "time_s": 0.7, "unix_time": 1000.6},
                       {"event": "stopped_late", "replica": 1, "attempt": 1, "time_s": 2.0}],
            "per_replica": {"0": group, "1": {**group, "healed_at": 10}}}


BAD_SUMMARY_FIELDS = (
    ("per_replica.1.tokens_processed", "120"), ("per_replica.1.tokens_processed", True),
    ("per_replica.1.steps", None), ("per_replica.0.cross_replica_bytes.total", "8"),
    ("events[1].unix_time", "late"), ("events[1].unix_time", math.nan),
    ("events[1].event", None), ("events[0]", "died"), ("steps", True), ("steps", 12.5),
    ("wall_time_s", "2.5"), ("final_val_loss", [5.0]), ("per_replica", [1]),
)
"""A field of a run's ``summary.json`` the benchmarks and the launcher do arithmetic on,
holding what editrain never writes there (``None``: the field missing)."""


def _set_field(record: dict, dotted: str, value) -> None:
    """Set (``None``: delete) the field ``dotted`` (``a.b``, ``a[1].b``) of ``record``."""
    *path, last = [k for k in re.split(r"[.\[\]]+", dotted) if k]
    where = record
    for key in path:
        where = where[int(key)] if isinstance(where, list) else where[key]
    key = int(last) if isinstance(where, list) else last
    if value is None:
        del where[key]
    else:
        where[key] = value


@pytest.mark.parametrize("field,value", BAD_SUMMARY_FIELDS,
                         ids=[f"{f}-{v!r}" for f, v in BAD_SUMMARY_FIELDS])
def test_a_run_summarys_fields_are_read_strictly(tmp_path, field, value):
    """``summary.json`` is read against ``metrics.SUMMARY_SCHEMA`` by the benchmarks (as
    ``results.json`` is against its schema): a field that holds what no editrain writes is
    refused in one line naming the file and the field. Before, ``json.loads`` took it
    whole: the faults scenario summed a string ``tokens_processed`` (a TypeError) or a
    ``true`` one (as 1 token), and an event without its name or time was a KeyError."""
    from editrain.bench.runs import read_run

    (tmp_path / "summary.json").write_text(json.dumps(_ft_summary()))
    assert read_run("r", tmp_path, {}).summary == _ft_summary()
    summary = _ft_summary()
    _set_field(summary, field, value)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError) as got:
        read_run("r", tmp_path, {})
    message = str(got.value)
    assert "\n" not in message and message.startswith(
        f"{shown(tmp_path / 'summary.json')}: field '{field}'"), message


def test_a_replica_groups_summary_is_read_strictly(tmp_path):
    """The fault-tolerant launcher's summary of its groups: a group's missing ``steps``
    (a KeyError) or string ``tokens_processed`` (a TypeError in the sum) is refused naming
    the group's file and the field."""
    from editrain.launch.ft import summarise_groups

    for r in (0, 1):
        (tmp_path / f"replica{r}").mkdir()
        (tmp_path / f"replica{r}" / "summary.json").write_text(json.dumps(
            _ft_summary()["per_replica"][str(r)]))
    assert summarise_groups(tmp_path, 2, [])["tokens_processed"] == 240
    for field, value in (("steps", None), ("tokens_processed", "120")):
        group = _ft_summary()["per_replica"]["1"]
        _set_field(group, field, value)
        (tmp_path / "replica1" / "summary.json").write_text(json.dumps(group))
        with pytest.raises(RunDirError, match=rf"^{re.escape(shown(tmp_path / 'replica1' / 'summary.json'))}: "
                                              rf"field '{field}'"):
            summarise_groups(tmp_path, 2, [])


def test_a_summary_an_older_editrain_wrote_with_a_nan_loss_is_read(tmp_path):
    """An editrain before strict JSON output (3bbf73e) wrote a loss the run did not have
    as JSON's ``NaN`` (a resume whose budget was already done, a diverged run, a
    fault-tolerant run no group finished), where one now writes ``null``. Its run
    directory is read as it was before the summary schema: by the benchmarks, by the
    fault-tolerant launcher (a group of a resumed run that has not rewritten its own
    summary yet) and by ``plan --calibrate``, which were refused ("field 'final_val_loss':
    a finite number ... expected") though ``null`` is taken and the field means the same."""
    from editrain.bench.runs import read_run
    from editrain.launch.ft import summarise_groups
    from editrain.plan.calibrate import run_vocab_size

    summary = _ft_summary()
    summary["final_val_loss"] = summary["per_replica"]["1"]["final_val_loss"] = math.nan
    summary["vocab_size"] = 347
    text = json.dumps(summary, indent=1)
    assert '"final_val_loss": NaN' in text  # as json.dumps wrote it
    (tmp_path / "summary.json").write_text(text)
    assert math.isnan(read_run("r", tmp_path, {}).summary["final_val_loss"])
    assert run_vocab_size(tmp_path, {}) == 347
    for r, group in summary["per_replica"].items():
        (tmp_path / f"replica{r}").mkdir()
        (tmp_path / f"replica{r}" / "summary.json").write_text(json.dumps(group))
    assert summarise_groups(tmp_path, 2, [])["tokens_processed"] == 240
    with pytest.raises(ValueError, match="field 'final_val_loss'"):  # still a number or none
        summary["final_val_loss"] = math.inf
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        read_run("r", tmp_path, {})


HOSTILE_REPLICAS = (True, False, 2.7, "1", [1], -1, None, math.nan)
"""A rank row's ``replica`` that is no replica index (JSON's ``true``, a fraction, text,
a list, a negative, ``null``, NaN)."""


@pytest.mark.parametrize("value", HOSTILE_REPLICAS, ids=[repr(v) for v in HOSTILE_REPLICAS])
def test_a_rank_rows_replica_that_is_no_replica_leaves_the_ranks_own(tmp_path, value):
    """``Run.replicas`` took ``int()`` of a rank's ``replica``: ``true`` made rank 3
    replica 1, 2.7 replica 2, ``"1"`` was parsed, a list was a TypeError. Such a value is
    no replica, as a ``rank`` that is none leaves the file's own: the rank is its own
    replica, as one whose rows say none."""
    from editrain.bench.faults import _window
    from editrain.bench.runs import Run

    rows = {rank: [{"rank": rank, "replica": rank // 2, "step": 1, "unix_time": 10.0,
                    "step_time_s": 0.1, "wall_time_s": 0.1}] for rank in range(4)}
    assert Run("r", tmp_path, {}, ranks=rows).replicas() == {0: [0, 1], 1: [2, 3]}
    rows[3][0]["replica"] = value
    assert Run("r", tmp_path, {}, ranks=rows).replicas() == {0: [0, 1], 1: [2], 3: [3]}
    # The faults scenario's window reads the same field from the rank files.
    for rank, got in rows.items():
        path = tmp_path / f"replica{rank // 2}" / "ranks" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in got))
    assert sorted(_window(Run("r", tmp_path, {}), 0)[1]) == [0, 1]


HOSTILE_STEP_ROWS = (
    {"step": "3", "unix_time": 10.3, "step_time_s": 0.1},
    {"step": True, "unix_time": 10.3, "step_time_s": 0.1},
    {"unix_time": 10.3, "step_time_s": 0.1},
    {"step": 3, "unix_time": 10.3},
    {"step": 3, "unix_time": "10.3", "step_time_s": 0.1},
    {"step": 3, "unix_time": 10.3, "step_time_s": [0.1]},
    {"step": 3, "unix_time": math.nan, "step_time_s": 0.1},
    {"step": 3, "unix_time": 10.3, "step_time_s": True},
)
"""A rank row of the faults scenario's window with a field it reads that editrain never
writes so (a string step crashed the attempts' order, a missing one or a missing step time
was a KeyError, a string clock a TypeError, ``true`` a step time of 1 s)."""


@pytest.mark.parametrize("bad", HOSTILE_STEP_ROWS, ids=[repr(r) for r in HOSTILE_STEP_ROWS])
def test_a_faults_rank_row_that_cannot_be_read_is_no_measurement(tmp_path, bad):
    """The faults scenario's window and downtime skip a row they cannot read (as the
    metrics readers do): the result is that of the run without it."""
    from editrain.bench.faults import _ft_numbers, _window
    from editrain.bench.runs import Run

    rows = [{"rank": 0, "replica": 0, "step": s, "unix_time": 10.0 + s / 10,
             "step_time_s": 0.1} for s in (1, 2, 3, 4)]
    path = tmp_path / "ranks" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = _window(Run("r", tmp_path, {}), 0)
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows[:2], bad, *rows[2:]]))
    assert _window(Run("r", tmp_path, {}), 0) == want
    # The dead group's ft_join row: a clock that is no number is no rejoin time.
    summary = _ft_summary()
    (tmp_path / "replica1").mkdir()
    joins = [{"event": "ft_join", "step": 10, "unix_time": bad.get("unix_time", "x")},
             {"event": "ft_join", "step": 10, "unix_time": 1001.0}]
    if isinstance(joins[0]["unix_time"], float) and math.isfinite(joins[0]["unix_time"]):
        joins[0]["unix_time"] = True  # (a row whose clock is good: make it bad)
    (tmp_path / "replica1" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in joins[::-1]))
    config = {"train": {"batch_size": 2, "seq_len": 5}}
    got = _ft_numbers(Run("r", tmp_path, {}, summary=summary, config=config), 6, 4)
    assert got["downtime_s"] == pytest.approx(0.4)


def _bench_run_rows() -> tuple[list[dict], dict[int, list[dict]]]:
    """The rows of a two-replica run of 8 steps as the trainer writes them: step 0's
    evaluation, a step's row per step (a round every 2 steps, with each replica's steps
    and the penalty's outlier flags), the final evaluation; each rank's own rows."""
    metrics = [{"step": 0, "tokens": 0, "val_loss": 6.0, "val_tokens": 1024,
                "eval_time_s": 0.2, "wall_time_s": 0.0}]
    ranks: dict[int, list[dict]] = {0: [], 1: []}
    for step in range(1, 9):
        t = 0.1 * step
        row = {"step": step, "tokens": 64 * step, "loss": 5.0 - step / 10, "lr": 1e-3,
               "step_time_s": 0.1, "wall_time_s": t + 0.2, "train_time_s": t,
               "compute_s": 0.08, "sync_wait_s": 0.01, "grad_sync_s": 0.0,
               "sim_stall_s": 0.005 * (step % 3)}
        if step % 2 == 0:
            row["sync"] = {"sync": step // 2 - 1, "step": step, "wait_s": 0.01 * step,
                           "sync_time_s": 0.02, "rendezvous_wait_s": 0.0,
                           "comm_time_s": 0.015, "link_delay_s": 0.0, "bytes_sent": 4096,
                           "sync_collectives": 2, "replica_steps": [2.0, 2.0],
                           "outlier": [[False, False], [False, step == 4]]}
        metrics.append(row)
        for rank in (0, 1):
            ranks[rank].append({"rank": rank, "replica": rank, "shard": 0, "step": step,
                                "unix_time": 1000 + t, "tokens": 32 * step, "loss": 5.0,
                                "wall_time_s": t + 0.2, "step_time_s": 0.1,
                                "compute_s": 0.08 + 0.001 * step * rank, "sync_wait_s": 0.01,
                                "grad_sync_s": 0.0, "sim_stall_s": 0.002 * step})
    metrics.append({"step": 8, "tokens": 512, "val_loss": 4.0, "val_tokens": 1024,
                    "eval_time_s": 0.2, "wall_time_s": 1.2, "end": True})
    return metrics, ranks


def _write_bench_run(run_dir: Path, metrics: list[dict], ranks: dict[int, list[dict]]):
    """A run directory holding ``metrics`` and ``ranks`` and a finished run's summary."""
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    for rank, rows in ranks.items():
        (run_dir / "ranks" / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps(
        {"steps": 8, "tokens": 512, "final_val_loss": 4.0, "wall_time_s": 1.2,
         "train_time_s": 0.8}))


def _bench_measures(run_dir: Path) -> dict:
    """What the benchmarks' scenarios measure on the run in ``run_dir``."""
    from editrain.bench import default, overlap, plan, spikes, stragglers
    from editrain.bench.limits import _span_speed
    from editrain.bench.measures import aedit_period, replica_stats, steady_throughput, val_curve
    from editrain.bench.runs import read_run

    run = read_run("r", run_dir, {})
    window = steady_throughput(run, 1)
    return {"window": window, "replicas": replica_stats(run, 1),
            "aedit_period": aedit_period(run, 4), "overlap": overlap._measure(run),
            "replica_steps": stragglers._replica_steps(run),
            "spikes": spikes._measure(run, run, [1], 2), "default": default._run_result(run),
            "utilisation": plan._window_utilisation(run, window, 1, False),
            "limit": [_span_speed(rows, 2, 8) for rows in run.ranks.values()],
            "val_curve": val_curve(run)}


HOSTILE_BENCH_ROWS = (
    ("metrics", 8, "tokens", "512"), ("metrics", 8, "tokens", True),
    ("metrics", 8, "tokens", 2.5), ("metrics", 8, "train_time_s", "0.8"),
    ("metrics", 8, "train_time_s", True), ("metrics", 6, "train_time_s", -1.0),
    ("metrics", 7, "step_time_s", "0.1"), ("metrics", 7, "sim_stall_s", True),
    ("metrics", 5, "compute_s", -0.08), ("metrics", 5, "loss", "4.5"),
    ("metrics", 4, "sync", "round 1"), ("metrics", 4, "sync.wait_s", "0.04"),
    ("metrics", 4, "sync.replica_steps", ["2", 2.0]),
    ("metrics", 4, "sync.outlier", [True, False]),
    ("evaluation", 0, "eval_time_s", "0.2"), ("evaluation", 0, "val_tokens", "1024"),
    ("evaluation", 8, "val_loss", True),
    ("rank", 8, "wall_time_s", "1.0"), ("rank", 8, "wall_time_s", True),
    ("rank", 8, "tokens", "256"), ("rank", 5, "compute_s", "0.09"),
    ("rank", 5, "sim_stall_s", True), ("rank", 5, "step", 5.5),
)
"""A row of a run the benchmarks read, one of whose fields holds what editrain never writes
there: ``(file, step, field, value)``, ``metrics`` a step's row of ``metrics.jsonl``,
``evaluation`` an evaluation's row of its own, ``rank`` rank 1's row (a string's tokens or
clock was a TypeError in the throughput window or the per-rank window, ``true`` counted as
1 token or second, a list of flags that are no lists a TypeError in the spikes' count)."""


@pytest.mark.parametrize("where,step,field,value", HOSTILE_BENCH_ROWS,
                         ids=[f"{w}{s}-{f}-{v!r}" for w, s, f, v in HOSTILE_BENCH_ROWS])
def test_a_bench_row_that_cannot_be_read_is_no_measurement(tmp_path, where, step, field,
                                                           value):
    """The benchmarks read a run's rows against one schema (``metrics.ROW_SCHEMA``, where
    ``bench.runs.read_run`` reads them): a row whose field is not what editrain writes is
    skipped, as the metrics readers skip a row they cannot read, so every scenario's
    numbers are those of the run without that row. Before, the throughput window
    subtracted a string's tokens, the per-rank window a string's clock (TypeErrors) and
    ``true`` counted as 1."""
    metrics, ranks = _bench_run_rows()
    rows = ranks[1] if where == "rank" else metrics
    at = next(i for i, r in enumerate(rows) if r["step"] == step
              and ("loss" in r or where != "metrics") and ("loss" not in r or where != "evaluation"))
    _write_bench_run(tmp_path / "without", metrics if where == "rank" else
                     [*metrics[:at], *metrics[at + 1:]],
                     {**ranks, 1: [*ranks[1][:at], *ranks[1][at + 1:]]} if where == "rank"
                     else ranks)
    want = _bench_measures(tmp_path / "without")
    _set_field(rows[at], field, value)
    _write_bench_run(tmp_path / "run", metrics, ranks)
    assert _bench_measures(tmp_path / "run") == want


def test_a_trained_runs_rows_fit_the_row_schema(run8):
    """What the trainer writes to ``metrics.jsonl`` and the rank files is what the
    benchmarks and ``plan --calibrate`` measure (a mismatch would leave every row out)."""
    from editrain.metrics import current_rows, measured_rows, read_metrics, read_rank_steps
    from editrain.plan.calibrate import ROW_SCHEMA

    rows = current_rows(read_metrics(run8))
    ranks = read_rank_steps(run8)
    assert len(rows) > 8 and any("sync" in r for r in rows) and len(ranks) == 2
    for got in (rows, *ranks.values()):
        assert measured_rows(got) == got and measured_rows(got, ROW_SCHEMA) == got


def test_a_trained_runs_summary_fits_its_schema(run8):
    """What the trainer writes to ``summary.json`` is what the strict reader takes (the
    schema is of the writer's fields: a mismatch would refuse every benchmark run)."""
    from editrain.bench.runs import read_run

    run = read_run("run8", run8, {})
    assert run.ok and run.summary["steps"] == 8 and run.replicas() == {0: [0], 1: [1]}
