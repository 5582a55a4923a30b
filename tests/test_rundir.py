"""A run directory belongs to one run: the lock, the run record, timelines (branches) of
checkpoints and their rotation, and ``--overwrite`` removing only what editrain wrote.

The unit tests build checkpoint directories by hand (a marker is what rotation and the
timeline read); the command-line tests train for real through the console script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from editrain import rundir
from editrain.checkpoint import MARKER, list_checkpoints, resolve_resume, rotate
from editrain.config import load_config
from editrain.errors import RunDirError
from editrain.launch.run_dir import check_run_dir, prepare_run_dir
from tests.test_cli import editrain, error_line, explain, tiny


def fake_ckpt(run_dir: Path, step: int, branch: str | None, run_id: str | None = "r1") -> Path:
    p = run_dir / "checkpoints" / f"step_{step:08d}"
    p.mkdir(parents=True)
    (p / MARKER).write_text(json.dumps({"step": step, "branch": branch, "run_id": run_id}))
    return p


# ---------------------------------------------------------------------------- the lock
def test_a_second_lock_on_a_run_directory_is_refused_and_names_the_holder(tmp_path):
    first = rundir.RunLock(tmp_path / "run").acquire()
    with pytest.raises(RunDirError, match=rf"in use by another editrain job \(pid {os.getpid()}"):
        rundir.RunLock(tmp_path / "run").acquire()
    first.release()
    with rundir.RunLock(tmp_path / "run") as again:
        assert again.held
    assert not again.held


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    """The kernel releases a flock when its holder dies, kill -9 included."""
    run = tmp_path / "run"
    code = ("import sys, time; from editrain.rundir import RunLock; "
            f"RunLock({str(run)!r}).acquire(); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            rundir.RunLock(run).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    rundir.RunLock(run).acquire().release()  # the stale lock file is no obstacle


def test_a_torchrun_replica_groups_lock_refuses_only_a_second_job_as_that_group(tmp_path):
    """The replica groups of a fault-tolerant run started as torchrun jobs share the run
    directory: each holds its own group's lock, so a second job as group 0 is refused
    (naming --dist.ft_replica_id) while group 1's job and the run's own lock (which the
    groups take in turn, a moment each) are free; a local job on the directory is refused
    while a group trains there."""
    run = tmp_path / "run"
    group0 = rundir.RunLock(run, 0).acquire()
    with pytest.raises(RunDirError, match=r"--dist.ft_replica_id: replica group 0 of .* is in "
                                          rf"use by another editrain job \(pid {os.getpid()}"):
        rundir.RunLock(run, 0).acquire()
    with rundir.RunLock(run, 1), rundir.RunLock(run):
        assert rundir.running_groups(run) == [0, 1]
        assert rundir.running_groups(run, but=1) == [0]
    assert rundir.running_groups(run) == [0]
    with pytest.raises(RunDirError, match="in use by the torchrun job.* replica group.* 0"):
        check_run_dir(cfg_for(run), run)
    check_run_dir(cfg_for(run), run, replica=0)  # its own lock is no other job's
    assert not any(p.name.startswith("replica") for p in run.iterdir())  # no run entry
    group0.release()
    assert rundir.running_groups(run) == []
    check_run_dir(cfg_for(run), run)


def test_a_replica_group_joining_a_run_must_have_its_options_apart_from_its_own(tmp_path):
    """A torchrun job of a replica group that starts while others train joins their run:
    its options must be the run's (config.toml, which holds no group's id), apart from
    the group's identity and its machine's own (lighthouse address, cache); another
    value is refused naming the option and both values."""
    from editrain.launch.run_dir import refuse_other_options

    run = tmp_path / "run"
    ft = {"dist": {"fault_tolerance": "torchft", "ft_replicas": 2, "shard_size": 1}}
    prepare_run_dir(cfg_for(run, **ft, train={"steps": 8}), run, replica=0)
    assert "ft_replica_id" not in (run / "config.toml").read_text()
    same = {"dist": {**ft["dist"], "ft_replica_id": 1, "ft_lighthouse": "http://h:1"},
            "data": {"cache_dir": str(tmp_path / "cache")}, "train": {"steps": 8}}
    refuse_other_options(cfg_for(run, **same), run)
    with pytest.raises(RunDirError, match=r"\(train.seed: this group 3, the run 0; "
                                          r"train.steps: this group 6, the run 8\)"):
        refuse_other_options(cfg_for(run, **{**same, "train": {"steps": 6, "seed": 3}}), run)


# ---------------------------------------------------------------------------- rotation
def test_rotation_deletes_only_the_current_timeline_oldest_first_by_step(tmp_path):
    run = tmp_path / "run"
    other = [fake_ckpt(run, s, "old") for s in (40, 60)]      # another timeline
    start = fake_ckpt(run, 20, "B")                           # resumed from
    mine = [fake_ckpt(run, s, "B") for s in (30, 50, 100_000_000)]  # names sort wrongly
    gone = rotate(run, 1, mine[-1], {"branch": "B", "resumed_from": [str(start)]})
    assert gone == mine[:2]
    assert all(p.exists() for p in (*other, start, mine[-1]))
    # keep 2: the newest two of the timeline stay, here the resumed-from one among them
    fake = fake_ckpt(run, 100_000_001, "B")
    assert rotate(run, 2, fake, {"branch": "B"}) == [start]
    assert list_checkpoints(run)[-1] == fake  # by step, not by name


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    run = tmp_path / "run"
    later = fake_ckpt(run, 9, None)  # a library run without a record: branch None
    written = fake_ckpt(run, 3, None)
    assert rotate(run, 1, written, None) == []
    assert later.exists() and written.exists()


# ---------------------------------------------------------------------------- timelines
def cfg_for(run: Path, **over):
    return load_config(None, {"run_dir": str(run), **over})


def test_resuming_an_older_checkpoint_starts_a_new_timeline_and_sets_the_later_aside(tmp_path):
    run = tmp_path / "run"
    record = prepare_run_dir(cfg_for(run), run)
    ckpts = [fake_ckpt(run, s, record.branch, record.run_id) for s in (2, 4, 6)]
    (run / "metrics.jsonl").write_text('{"step": 6}\n')
    assert resolve_resume(run) == ckpts[-1]

    record2 = prepare_run_dir(cfg_for(run, resume=str(ckpts[0])), run)
    assert record2.run_id == record.run_id and record2.branch != record.branch
    assert record2.resumed_from == [str(ckpts[0].resolve())]
    aside = run / "checkpoints" / "abandoned" / record.branch
    assert sorted(p.name for p in aside.iterdir()) == [ckpts[1].name, ckpts[2].name]
    assert list_checkpoints(run) == [ckpts[0]]
    assert resolve_resume(run) == ckpts[0]  # --resume RUN never picks the abandoned ones
    last = rundir.read_record(run).history[-1]
    assert last["branch"] == record2.branch and len(last["set_aside"]) == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 6}  # kept; the new timeline's start is appended
    assert rows[1]["event"] == "timeline" and rows[1]["from_step"] == 2

    # Resuming the newest checkpoint of the current timeline continues it.
    newest = fake_ckpt(run, 8, record2.branch, record.run_id)
    record3 = prepare_run_dir(cfg_for(run, resume=str(run)), run)
    assert record3.branch == record2.branch and record3.resumed_from == [str(newest.resolve())]
    assert rundir.lineage_of(run)["branch"] == record2.branch
    assert rundir.lineage_of(run / "replica0")["branch"] == record2.branch


def test_resuming_into_a_directory_of_another_run_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    rec_a = prepare_run_dir(cfg_for(a), a)
    ckpt = fake_ckpt(a, 5, rec_a.branch, rec_a.run_id)
    prepare_run_dir(cfg_for(b), b)
    (b / "metrics.jsonl").write_text('{"step": 1}\n')
    fake_ckpt(b, 9, "b-branch", "b-run")
    before = sorted(str(p.relative_to(b)) for p in b.rglob("*"))
    with pytest.raises(RunDirError, match="already holds another run"):
        check_run_dir(cfg_for(b, resume=str(ckpt)), b)
    with pytest.raises(RunDirError, match="--overwrite"):
        prepare_run_dir(cfg_for(b, resume=str(ckpt)), b)
    assert sorted(str(p.relative_to(b)) for p in b.rglob("*")) == before
    # Into an empty directory: the same run, a new timeline there; a's later checkpoint
    # stays where it is (it was set aside in a, and --resume a then picked step 5).
    later = fake_ckpt(a, 7, rec_a.branch, rec_a.run_id)
    c = tmp_path / "c"
    rec_c = prepare_run_dir(cfg_for(c, resume=str(ckpt)), c)
    assert rec_c.run_id == rec_a.run_id and rec_c.branch != rec_a.branch
    assert list_checkpoints(a) == [ckpt, later] and resolve_resume(a) == later
    assert not (a / "checkpoints" / "abandoned").exists()
    # --overwrite of the run being resumed, in its own directory: refused, not ignored
    with pytest.raises(RunDirError, match="--overwrite: .* holds the run --resume continues"):
        check_run_dir(cfg_for(a, resume=str(ckpt), overwrite=True), a)
    # ... and of a directory of the same run whose checkpoint lies elsewhere: replaced
    same = tmp_path / "same"
    prepare_run_dir(cfg_for(same, resume=str(ckpt)), same)
    (same / "metrics.jsonl").write_text('{"step": 1}\n')
    prepare_run_dir(cfg_for(same, resume=str(ckpt), overwrite=True), same)
    assert not (same / "metrics.jsonl").exists()
    # With --overwrite, b's run is replaced.
    rec_b = prepare_run_dir(cfg_for(b, resume=str(ckpt), overwrite=True), b)
    assert rec_b.run_id == rec_a.run_id and not (b / "checkpoints").exists()
    assert not (b / "metrics.jsonl").exists()


def test_overwrite_removes_only_what_editrain_wrote(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ranks").mkdir()
    (run / "ranks" / "my_notes.md").write_text("mine")  # the user's, before any run
    (run / "keep.txt").write_text("mine too")
    with pytest.raises(RunDirError, match="ranks with files editrain did not write"):
        prepare_run_dir(cfg_for(run, overwrite=True), run)
    (run / "ranks" / "my_notes.md").unlink()
    (run / "ranks").rmdir()
    record = prepare_run_dir(cfg_for(run), run)
    assert "config.toml" in record.owned and "keep.txt" not in record.owned
    (run / "ranks").mkdir()
    (run / "ranks" / "rank0.jsonl").write_text("{}\n")
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    prepare_run_dir(cfg_for(run, overwrite=True), run)
    assert sorted(p.name for p in run.iterdir()) == [
        rundir.LOCK, "config.toml", rundir.RECORD, "keep.txt"]


def test_a_corrupt_run_record_is_named(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.RECORD).write_text("{not json")
    with pytest.raises(RunDirError, match=rundir.RECORD):
        check_run_dir(cfg_for(run), run)


# ---------------------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def cache_dir(data_cache) -> Path:
    return data_cache


def train(cache: Path, run: Path, *args: str):
    proc, _ = editrain("train", *tiny(cache), "--nproc", "2", "--shard-size", "1",
                       "--method", "diloco", "--sync.local_sgd_sync_interval", "2",
                       "--train.eval_every", "100", "--quiet", "--run-dir", str(run), *args,
                       timeout=240)
    return proc


@pytest.mark.timeout(600)
def test_resume_from_an_older_checkpoint_keeps_both_timelines(cache_dir, tmp_path):
    """Finding 3: resuming from an older checkpoint with checkpoint.keep 1 used to delete
    the checkpoint just written and the one resumed from, then crash; with keep 2 a later
    --resume RUN continued the abandoned timeline."""
    run = tmp_path / "run"
    proc = train(cache_dir, run, "--steps", "6", "--checkpoint.every", "2",
                 "--checkpoint.keep", "3")
    assert proc.returncode == 0, explain(proc)
    first = rundir.read_record(run)
    old = list_checkpoints(run)
    assert [p.name for p in old] == [f"step_{s:08d}" for s in (2, 4, 6)]

    proc = train(cache_dir, run, "--steps", "6", "--checkpoint.every", "2",
                 "--checkpoint.keep", "1", "--resume", str(old[0]))
    assert proc.returncode == 0, explain(proc)
    assert "new timeline" in proc.stderr
    record = rundir.read_record(run)
    assert record.run_id == first.run_id and record.branch != first.branch
    now = list_checkpoints(run)
    assert [p.name for p in now] == ["step_00000002", "step_00000006"]  # resumed-from stays
    markers = [json.loads((p / MARKER).read_text()) for p in now]
    assert markers[0]["branch"] == first.branch and markers[1]["branch"] == record.branch
    aside = run / "checkpoints" / "abandoned" / first.branch
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000004", "step_00000006"]
    assert resolve_resume(run) == now[-1]  # a later --resume RUN takes the new timeline


@pytest.mark.timeout(300)
def test_cli_refuses_a_second_job_and_another_runs_directory(cache_dir, tmp_path):
    """Findings 2 and 4 through the console script: a job on a directory another job holds
    is refused, and so is resuming into a directory that holds another run; neither
    touches what is there."""
    a = tmp_path / "a"
    proc = train(cache_dir, a, "--steps", "2")
    assert proc.returncode == 0, explain(proc)
    snapshot = {p: p.read_bytes() for p in a.rglob("*") if p.is_file() and p.name != rundir.LOCK}

    code = ("import sys, time; from editrain.rundir import RunLock; "
            f"RunLock({str(a)!r}).acquire(); print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        proc = train(cache_dir, a, "--steps", "4", "--resume", str(a))
        assert proc.returncode == 2, explain(proc)
        assert f"in use by another editrain job (pid {holder.pid}" in error_line(proc.stderr)
        assert time.monotonic() - t0 < 60
    finally:
        holder.kill()
        holder.wait()

    b = tmp_path / "b"
    prepare_run_dir(cfg_for(b), b)
    (b / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    b_files = {p: p.read_bytes() for p in b.rglob("*") if p.is_file() and p.name != rundir.LOCK}
    proc = train(cache_dir, b, "--steps", "4", "--resume", str(list_checkpoints(a)[-1]))
    assert proc.returncode == 2, explain(proc)
    assert "already holds another run" in error_line(proc.stderr)
    assert {p: p.read_bytes() for p in b.rglob("*")
            if p.is_file() and p.name != rundir.LOCK} == b_files
    assert {p: p.read_bytes() for p in a.rglob("*")
            if p.is_file() and p.name != rundir.LOCK} == snapshot


def test_cli_overwrite_never_deletes_a_users_files(cache_dir, tmp_path):
    """Finding 10 through the console script: --overwrite used to delete checkpoints/,
    ranks/ and tb/ recursively whoever wrote them."""
    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "my_plots.ipynb").write_text("mine")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "README").write_text("my notes on these checkpoints")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = train(cache_dir, run, "--steps", "2", "--overwrite")
    assert proc.returncode == 2, explain(proc)
    line = error_line(proc.stderr)
    assert "--overwrite" in line and "tb, checkpoints" in line and "did not write" in line
    assert (run / "tb" / "my_plots.ipynb").read_text() == "mine"
    assert (run / "checkpoints" / "README").exists() and (run / "metrics.jsonl").exists()
