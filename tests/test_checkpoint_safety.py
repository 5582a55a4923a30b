"""Loading a checkpoint never runs code from it, and a resume is checked before any worker.

A real checkpoint is written once by the CLI (2 workers, tiny model); the tests copy it and
craft or damage the copy: a pickle payload appended to a ``.distcp`` file and pointed at by
a rewritten ``.metadata`` (the payload would create a sentinel file), a ``.metadata`` naming
a forbidden global, truncated and missing files, corrupt rank JSON, another sequence
length, seed or corpus. Resuming goes through ``editrain.cli.main`` in this process with
worker start-up replaced by an exception, so a refusal is known to come before any worker.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from editrain import cli
from editrain.checkpoint import (
    FORMAT,
    OPTIM_KEY,
    SafeFileSystemReader,
    check_compatible,
    check_files,
    from_typed_json,
    list_checkpoints,
    to_typed_json,
)
from editrain.errors import CheckpointError
from editrain.safe_load import METADATA_CLASSES, SafeLoadPlanner, read_metadata
from tests.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
TOK_KEY = "replica0.model.tok_embeddings.weight"
LEGACY_KEY = "replica0.optim.param_groups.0.lr"


def _args(cache: Path) -> list[str]:
    return ["--model.preset", "tiny", "--data.max_bytes", "400000", "--data.vocab_size", "512",
            "--data.cache_dir", str(cache), "--train.batch_size", "4", "--train.seq_len", "32",
            "--train.eval_tokens", "1024", "--nproc", "2", "--shard-size", "1",
            "--method", "diloco", "--sync.local_sgd_sync_interval", "2", "--quiet"]


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


@pytest.fixture(scope="module")
def saved(cache: Path, tmp_path_factory) -> Path:
    """A complete checkpoint written by the CLI (format 3)."""
    run = tmp_path_factory.mktemp("src") / "run"
    out = run_cli(["train", *_args(cache), "--steps", "4", "--run-dir", str(run)],
                  env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    return list_checkpoints(run)[-1]


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """A private copy of the checkpoint, to craft or damage."""
    copy = tmp_path / "copy" / "checkpoints" / saved.name
    shutil.copytree(saved, copy)
    return copy


class WorkersStarted(Exception):
    """Raised instead of starting workers: the preflight let the resume through."""


@pytest.fixture
def no_workers(monkeypatch):
    import torch.distributed.launcher.api as launcher_api

    def refuse(*args, **kwargs):
        raise WorkersStarted

    monkeypatch.setattr(launcher_api, "elastic_launch", refuse)
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


def resume(cache: Path, ckpt: Path, tmp_path: Path, capsys, *extra: str) -> str:
    """``editrain train --resume ckpt`` in this process; returns its one error line."""
    code = cli.main(["train", *_args(cache), "--steps", "8", "--run-dir",
                     str(tmp_path / "resumed"), "--resume", str(ckpt), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith("editrain: error: ")]
    assert len(errors) == 1, err
    assert errors[0] == len(lines) - 1 and "Traceback" not in err, err  # one line, the last
    return lines[errors[0]]


class _Payload:
    """Unpickling this runs ``touch SENTINEL``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.sentinel)}",))


def _load_metadata(ckpt: Path):
    return pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: plain pickle


def _point_at(ckpt: Path, fqn: str, data: bytes, fmt: int | None = None) -> None:
    """Append ``data`` to a ``.distcp`` file and make ``fqn`` a bytes item stored there."""
    md = _load_metadata(ckpt)
    target = ckpt / "__0_0.distcp"
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(data)
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    md.storage_data[MetadataIndex(fqn)] = _StorageInfo(target.name, offset, len(data))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    if fmt is not None:
        marker = json.loads((ckpt / "editrain.json").read_text())
        marker["format"] = fmt
        (ckpt / "editrain.json").write_text(json.dumps(marker))


# ---------------------------------------------------------------------------- what is saved
def test_a_checkpoint_stores_tensors_only_in_dcp(saved: Path) -> None:
    """No item DCP would unpickle: param_groups live in each rank's JSON, with their
    Python types (betas stays a tuple)."""
    md = read_metadata(saved)
    assert not [k for k, v in md.state_dict_metadata.items()
                if isinstance(v, BytesStorageMetadata)]
    assert json.loads((saved / "editrain.json").read_text())["format"] == FORMAT == 3
    for rank in (0, 1):
        state = json.loads((saved / f"rank_{rank:05d}.json").read_text())
        groups = from_typed_json(state[OPTIM_KEY])["param_groups"]
        assert isinstance(groups[0]["betas"], tuple) and isinstance(groups[0]["lr"], float)
        assert "tok_embeddings.weight" in groups[0]["params"]


def test_typed_json_keeps_python_types() -> None:
    value = {"betas": (0.9, 0.95), "lr": 1.0, "step": 3, 7: float("inf"), "x": [None, True],
             "tuple": {"dict": 1}}
    back = from_typed_json(json.loads(json.dumps(to_typed_json(value))))
    assert back == value
    assert type(back["lr"]) is float and type(back["step"]) is int
    assert isinstance(back["betas"], tuple)
    with pytest.raises(TypeError, match="Tensor"):
        to_typed_json({"lr": torch.tensor(1.0)})
    with pytest.raises(ValueError):
        from_typed_json({"betas": [1, 2]})  # an untagged object is not what is written


# ---------------------------------------------------------------------------- crafted files
# torch's own warnings about what these tests do on purpose: DCP loads on one process
# (no_dist=True), and the crafted payload is a pickle of protocol 4, not torch.save's 2.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_crafted_bytes_item_is_refused_and_never_unpickled(cache, ckpt, tmp_path, capsys,
                                                           no_workers) -> None:
    sentinel = tmp_path / "pwned"
    _point_at(ckpt, TOK_KEY, pickle.dumps(_Payload(sentinel)))

    # The crafted checkpoint is a real attack: torch's stock reader and planner run it.
    state = {"replica0": {"model": {"tok_embeddings.weight": torch.zeros(512, 64)}}}
    with pytest.raises(dcp.CheckpointException):  # after the payload ran
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    assert sentinel.exists(), "the crafted checkpoint does not exercise the attack"
    sentinel.unlink()

    # The CLI refuses it before any worker starts, in one line naming the file.
    line = resume(cache, ckpt, tmp_path, capsys)
    assert str(ckpt / ".metadata") in line and TOK_KEY in line and "refusing" in line
    # A worker (a restart skips the preflight) refuses it too: the reader and the planner.
    for planner in (None, SafeLoadPlanner()):
        with pytest.raises((CheckpointError, dcp.CheckpointException), match="refusing"):
            dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), planner=planner,
                     no_dist=True)
    assert not sentinel.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                            "ignore:Detected pickle protocol 4:UserWarning")
def test_format2_param_groups_are_decoded_only_as_plain_data(cache, saved, ckpt, tmp_path,
                                                             capsys, no_workers) -> None:
    """Format 2 stored param_groups as pickled items: they are decoded with
    ``weights_only=True``, so a payload there is refused, and plain values load."""
    sentinel = tmp_path / "pwned"
    _point_at(ckpt, LEGACY_KEY, pickle.dumps(_Payload(sentinel)), fmt=2)
    line = resume(cache, ckpt, tmp_path, capsys)
    assert str(ckpt / "__0_0.distcp") in line and LEGACY_KEY in line, line
    assert "not plain data" in line
    legacy = SafeLoadPlanner(lambda fqn: fqn == LEGACY_KEY)
    state = {"replica0": {"optim": {"param_groups": [{"lr": 0.0}]}}}
    with pytest.raises((CheckpointError, dcp.CheckpointException), match="not plain data"):
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), planner=legacy,
                 no_dist=True)
    assert not sentinel.exists()

    # What format 2 really holds there (torch.save of a plain value) passes and loads.
    good = tmp_path / "good" / "checkpoints" / saved.name
    shutil.copytree(saved, good)
    buf = io.BytesIO()
    torch.save(0.25, buf)
    _point_at(good, LEGACY_KEY, buf.getvalue(), fmt=2)
    check_files(good)
    dcp.load(state, storage_reader=SafeFileSystemReader(good), planner=legacy, no_dist=True)
    assert state["replica0"]["optim"]["param_groups"][0]["lr"] == 0.25
    # ... but not in format 3, which holds tensors only.
    marker = json.loads((good / "editrain.json").read_text())
    with pytest.raises(CheckpointError, match=f"refusing non-tensor item {LEGACY_KEY}"):
        check_files(good, dict(marker, format=3))


def test_metadata_with_a_forbidden_global_is_refused(cache, ckpt, tmp_path, capsys,
                                                     no_workers) -> None:
    sentinel = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(sentinel)))
    line = resume(cache, ckpt, tmp_path, capsys)
    assert str(ckpt / ".metadata") in line and "refusing to unpickle" in line
    assert "system" in line and not sentinel.exists()


def test_metadata_allowlist_names_exact_classes(ckpt, tmp_path) -> None:
    """Not module prefixes: protocol 4 resolves dotted names, so a prefix rule would let
    ``torch.distributed.checkpoint.filesystem`` + ``os.system`` through."""
    sentinel = tmp_path / "pwned"
    cmd = f"touch {shlex.quote(str(sentinel))}".encode()

    def text(s: bytes) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s  # SHORT_BINUNICODE

    evil = (b"\x80\x04" + text(b"torch.distributed.checkpoint.filesystem") + text(b"os.system")
            + b"\x93" + text(cmd) + b"\x85R.")  # STACK_GLOBAL, TUPLE1, REDUCE, STOP
    (ckpt / ".metadata").write_bytes(evil)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        SafeFileSystemReader(ckpt).read_metadata()
    assert not sentinel.exists()
    assert all("." not in name for _, name in METADATA_CLASSES)


# ---------------------------------------------------------------------------- preflight
def test_an_intact_checkpoint_passes_the_preflight(cache, ckpt, tmp_path, no_workers) -> None:
    """The control for the tests below; another topology (elastic) passes too."""
    with pytest.raises(WorkersStarted):
        cli.main(["train", *_args(cache), "--steps", "8", "--run-dir", str(tmp_path / "a"),
                  "--resume", str(ckpt)])
    with pytest.raises(WorkersStarted):
        cli.main(["train", *_args(cache), "--steps", "8", "--run-dir", str(tmp_path / "b"),
                  "--resume", str(ckpt), "--nproc", "1"])


def _truncate(path: Path, by: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - by)


@pytest.mark.parametrize("damage,expect", [
    (lambda c: _truncate(c / "__1_0.distcp", 100), ("__1_0.distcp", "truncated")),
    (lambda c: (c / "__0_0.distcp").unlink(), ("__0_0.distcp", "missing")),
    (lambda c: _truncate(c / ".metadata", 500), (".metadata", "corrupt checkpoint metadata")),
    (lambda c: (c / ".metadata").write_bytes(b"not a pickle"), (".metadata", "corrupt")),
    (lambda c: (c / "rank_00001.json").write_text("{\"step\": "),
     ("rank_00001.json", "corrupt")),
    (lambda c: (c / "rank_00001.json").unlink(), ("rank_00001.json", "missing")),
    (lambda c: (c / "rank_00000.json").write_text("{\"step\": 4}"),
     ("rank_00000.json", "param_groups")),
], ids=["truncated-distcp", "missing-distcp", "truncated-metadata", "garbage-metadata",
        "corrupt-rank-json", "missing-rank-json", "rank-json-without-optimizer"])
def test_damaged_checkpoint_fails_in_the_preflight(cache, ckpt, tmp_path, capsys, no_workers,
                                                   damage, expect) -> None:
    damage(ckpt)
    line = resume(cache, ckpt, tmp_path, capsys)
    name, words = expect
    assert str(ckpt / name) in line and words in line, line


@pytest.mark.parametrize("option,value,words", [
    ("--train.seq_len", "64", "train.seq_len: checkpoint has 32, this run has 64"),
    ("--train.seed", "7", "train.seed: checkpoint has 0, this run has 7"),
])
def test_a_resume_that_would_misread_the_data_is_refused(cache, ckpt, tmp_path, capsys,
                                                         no_workers, option, value,
                                                         words) -> None:
    line = resume(cache, ckpt, tmp_path, capsys, option, value)
    assert str(ckpt) in line and words in line, line


def test_a_resume_on_another_corpus_is_refused(cache, ckpt, tmp_path, capsys,
                                               no_workers) -> None:
    code = cli.main(["train", *_args(cache), "--steps", "8", "--run-dir",
                     str(tmp_path / "resumed"), "--resume", str(ckpt),
                     "--data.max_bytes", "300000"])
    err = capsys.readouterr().err
    assert code == 2 and "data: the checkpoint's train split has" in err, err
    assert "data.max_bytes" in err and "Traceback" not in err


def test_stream_checks_compare_only_what_both_record() -> None:
    base = {"format": FORMAT, "method": "edit", "vocab_size": 512, "num_units": 3, "model": {}}
    new = dict(base, seq_len=32, train_seed=0, train_data={"tokens": 100, "sha256": "a"})
    assert check_compatible(dict(base), new) == []  # an older marker: nothing to compare
    assert check_compatible(dict(new), new) == []
    other = dict(new, train_data={"tokens": 100, "sha256": "b"})
    problems = check_compatible(other, new)
    assert len(problems) == 1 and "other ones" in problems[0] and "data.path" in problems[0]
    assert check_compatible(dict(base, format=2), new) == []  # format 2 still resumes


def test_tp_and_pp_sizes_must_match_read_from_the_topology_where_not_recorded() -> None:
    """The tp size and the pipeline stages must be the saved ones; an older marker without
    the fields has them read from its topology ((R, S, T) or (R, P, S, T))."""
    base = {"format": FORMAT, "method": "edit", "vocab_size": 512, "num_units": 3, "model": {}}
    new = dict(base, topology=[2, 2, 1, 2], tp_size=2, pp_size=2)
    assert check_compatible(dict(base, topology=[2, 2, 1, 2]), new) == []
    assert check_compatible(dict(base, topology=[4, 2, 2, 2]), new) == []  # R, S may change
    problems = check_compatible(dict(base, topology=[2, 2, 2]), new)
    assert problems == ["dist.pp_size: checkpoint has 1, this run has 2 (a checkpoint "
                        "resumes with the pipeline stages it was saved with; replicas and "
                        "shards may change)"], problems
    problems = check_compatible(dict(base, topology=[2, 2, 2, 1]), new)
    assert problems == ["dist.tp_size: checkpoint has 1, this run has 2 (a checkpoint "
                        "resumes with the tp size it was saved with; replicas and shards "
                        "may change)"], problems
    assert len(check_compatible(dict(base, tp_size=4, pp_size=1), new)) == 2


# ---------------------------------------------------------------------------- exactness
def _step_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows
            if "loss" in r and "event" not in r and not r.get("replayed")}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optim", [["--optim.sam", "wsam"], ["--optim.name", "agd"],
                                   ["--optim.name", "sgd"]], ids=["wsam", "agd", "sgd"])
def test_optimizers_resume_bitwise_with_json_param_groups(cache, tmp_path, optim) -> None:
    """param_groups come back from JSON; a wrapper (WSAM) shares its base optimizer's
    groups again after loading, so the learning-rate schedule reaches the base optimizer."""
    common = [*_args(cache), "--steps", "8", "--checkpoint.every", "4", "--checkpoint.keep",
              "5", *optim]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(run_dir: Path, *extra: str) -> None:
        out = run_cli(["train", *common, "--run-dir", str(run_dir), *extra], env=env,
                      timeout=500)
        assert out.returncode == 0, out.stderr[-4000:]

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(full)
    first = list_checkpoints(full)[0]
    assert first.name == "step_00000004"
    run(resumed, "--resume", str(first))
    a, b = _step_losses(full), _step_losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    assert all(b[step] == a[step] for step in b), (a, b)  # bitwise
