"""A run directory belongs to one run: the lock, the run record, timelines (branches) of
checkpoints and their rotation, and ``--overwrite`` removing only what editrain wrote.

The unit tests build checkpoint directories by hand (a marker is what rotation and the
timeline read); the command-line tests train for real through the console script."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from editrain import rundir
from editrain.checkpoint import MARKER, list_checkpoints, resolve_resume, rotate
from editrain.config import load_config
from editrain.errors import RunDirError
from editrain.launch.run_dir import check_run_dir, prepare_run_dir
from tests.rank_threads import each_rank_in_a_thread
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


def group_job(run: Path, r: int, restart: int = 0, replicas: int = 2, **over):
    """The job of replica group ``r`` of a fault-tolerant run started by torchrun
    (``replicas`` groups of one rank each), as its rank 0 sees it."""
    from editrain.launch.job import Job

    ft = {"fault_tolerance": "torchft", "ft_replicas": replicas, "shard_size": 1,
          "ft_replica_id": r, "ft_lighthouse": "http://h:1"}
    return Job(cfg_for(run, dist=ft, **over), run, world=1, under_torchrun=True,
               restart=restart)


def group_ckpt(run: Path, r: int, step: int, **marker) -> Path:
    """A checkpoint of group ``r``'s own timeline, of the run's current job."""
    record = rundir.read_record(run)
    p = run / f"replica{r}" / "checkpoints" / f"step_{step:08d}"
    p.mkdir(parents=True)
    (p / MARKER).write_text(json.dumps({"step": step, "run_id": record.run_id,
                                        "branch": record.branch, **marker}))
    return p


def start_groups(run: Path, *groups: int, **over) -> list:
    """Rank 0 of each group's job joins the run directory (in this order); returns their
    claims, each holding its group's lock."""
    from editrain.launch.run_dir import RunDirClaim

    claims = [RunDirClaim(group_job(run, r, **over)) for r in groups]
    for claim in claims:
        try:
            claim.join()
        except RunDirError:
            claim.lock.release()  # as run_under_torchrun's `with RunDirClaim` does
            raise
    return claims


def end_groups(run: Path, claims: list) -> None:
    """The groups' jobs end as rank 0 ends them (launch.summarise): lock released, end
    noted."""
    for claim in claims:
        claim.lock.release()
        with rundir.RunLock(run):
            rundir.note_group(run, claim.lock.replica, ended=True)


def finish_groups(run: Path, claims: list, steps: int) -> None:
    """The groups' jobs finish the run, trained to ``steps``, as rank 0 ends them
    (launch.summarise after its workers returned): lock released, end noted, with the
    steps it finished."""
    for claim in claims:
        claim.lock.release()
        with rundir.RunLock(run):
            rundir.note_group(run, claim.lock.replica, ended=True, finished_steps=steps)


def test_a_torchrun_group_that_claims_the_run_first_sets_aside_no_other_groups_checkpoint(
        tmp_path):
    """Each replica group started by torchrun resumes its own checkpoint: the one that
    claims the run first (here group 1, at its step 20) sets aside only its own later
    checkpoints, never another group's. Before, its claim set aside every replica{r}/
    checkpoint later than its own step: group 0's step 40 went to abandoned/ and both
    groups resumed step 20, whichever group happened to start first deciding."""
    run = tmp_path / "run"
    end_groups(run, start_groups(run, 0, 1))
    for r, step in ((0, 20), (0, 40), (1, 20)):  # group 1 was down when group 0 saved 40
        group_ckpt(run, r, step)
    claims = start_groups(run, 1, 0, resume=str(run), train={"steps": 100})
    assert resolve_resume(run / "replica0").name == "step_00000040"
    assert resolve_resume(run / "replica1").name == "step_00000020"
    assert not (run / "replica0" / "checkpoints" / "abandoned").exists()
    record = rundir.read_record(run)
    assert len(record.history) == 2 and record.history[-1]["ft_groups"] == [1, 0]
    assert sorted(Path(p).name for p in record.resumed_from) == ["step_00000020",
                                                                 "step_00000040"]
    end_groups(run, claims)


def test_a_joining_torchrun_group_sets_aside_only_its_own_later_checkpoints(tmp_path):
    """A group that joins the run's start and resumes an older checkpoint of its own
    leaves its own later ones (set aside, as a claim does), nothing of the others'."""
    run = tmp_path / "run"
    end_groups(run, start_groups(run, 0, 1))
    for r, step in ((0, 20), (0, 40), (1, 20), (1, 40)):
        group_ckpt(run, r, step)
    first = start_groups(run, 0, resume=str(run))
    older = run / "replica1" / "checkpoints" / "step_00000020"
    second = start_groups(run, 1, resume=str(older))
    assert resolve_resume(run / "replica0").name == "step_00000040"
    assert resolve_resume(run / "replica1") == older
    assert [p.name for p in (run / "replica1" / "checkpoints" / "abandoned").rglob("step_*")] \
        == ["step_00000040"]
    end_groups(run, first + second)


@pytest.mark.parametrize("fresh", [{"resume": "RUN"}, {"overwrite": True}])
def test_a_torchrun_group_started_while_another_is_restarted_by_torchrun_joins_its_start(
        tmp_path, monkeypatch, fresh):
    """Group 1's job died; group 0's rank 0 died too and torchrun is restarting it (no
    group holds its lock meanwhile). A new job of group 1 (--resume RUN, as the docs say,
    or the --overwrite of a script that starts every group) waits for group 0 and joins
    the start it is in once torchrun has restarted it: no second claim of the run (a
    history line, a new timeline, group 0's later checkpoints set aside, the run
    removed). Before, group 1 claimed the run as its first group."""
    import threading

    from editrain.launch import run_dir

    monkeypatch.setattr(run_dir, "GROUP_POLL_S", 0.05, raising=False)
    run = tmp_path / "run"
    group0, group1 = start_groups(run, 0, 1)
    ckpts = [group_ckpt(run, 0, s) for s in (20, 40)] + [group_ckpt(run, 1, 20)]
    group1.lock.release()  # group 1's job died
    group0.lock.release()  # group 0's rank 0 died: torchrun restarts it
    over = {k: str(run) if v == "RUN" else v for k, v in fresh.items()}
    new1 = run_dir.RunDirClaim(group_job(run, 1, **over))
    errors = []
    thread = threading.Thread(target=lambda: _catching(errors, new1.join))
    thread.start()
    deadline = time.monotonic() + 10
    while 1 not in (rundir.current_start(rundir.read_record(run)) or {}).get(
            "ft_groups_ended", []):  # group 1's new job waits
        assert time.monotonic() < deadline and thread.is_alive(), errors
        time.sleep(0.02)
    restarted = run_dir.RunDirClaim(group_job(run, 0, restart=1))
    restarted.join()
    thread.join(timeout=10)
    assert not thread.is_alive() and not errors, errors
    assert all(p.is_dir() for p in ckpts)
    record = rundir.read_record(run)
    assert len(record.history) == 1
    assert record.history[0]["ft_groups"] == [0, 1]
    assert record.history[0]["ft_groups_ended"] == []
    end_groups(run, [restarted, new1])


def _catching(errors: list, call) -> None:
    try:
        call()
    except Exception as e:  # the test's thread: reported by the test
        errors.append(e)


def test_torchrun_groups_restarted_together_start_the_run_anew(tmp_path, monkeypatch):
    """Every group of a start whose jobs died (a cluster's time limit) is started again:
    each new job notes its group's earlier job over, so the first of them claims the run
    anew at once (a new history line, the options it may change) and the others join;
    a lone group whose peers never come back claims it after GROUP_RESTART_WAIT_S (and
    its --overwrite is refused then: the others may be slow to restart)."""
    import threading

    from editrain.launch import run_dir

    monkeypatch.setattr(run_dir, "GROUP_POLL_S", 0.05, raising=False)
    run = tmp_path / "run"
    for claim in start_groups(run, 0, 1):
        group_ckpt(run, claim.lock.replica, 4)
        claim.lock.release()  # killed: no end noted
    claims = [run_dir.RunDirClaim(group_job(run, r, resume=str(run), train={"steps": 9}))
              for r in (0, 1)]
    errors = []
    threads = [threading.Thread(target=lambda c=c: _catching(errors, c.join)) for c in claims]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors and not any(t.is_alive() for t in threads), errors
    record = rundir.read_record(run)
    assert len(record.history) == 2
    assert sorted(record.history[-1]["ft_groups"]) == [0, 1]
    assert "train.steps" in record.history[-1]["config_changed"]
    for claim in claims:
        claim.lock.release()  # killed again
    monkeypatch.setattr(run_dir, "GROUP_RESTART_WAIT_S", 0.2)
    with pytest.raises(RunDirError, match=r"--overwrite: replica group\(s\) 0 of the run .* "
                                          "have not ended and hold no lock"):
        start_groups(run, 1, overwrite=True)  # never removes what a group may still write
    (alone,) = start_groups(run, 1, resume=str(run), train={"steps": 9})
    assert len(rundir.read_record(run).history) == 3
    alone.lock.release()


def test_a_joining_torchrun_group_is_checked_as_a_claim_is(tmp_path):
    """A group that joins the run's start runs the checks of a claim on what it resumes
    and where it writes: a checkpoint of another run is refused (as it is with no group
    running), as is a link in its replica{r}/. Before, a joining group only compared its
    options."""
    other = tmp_path / "other"
    end_groups(other, start_groups(other, 0))
    group_ckpt(other, 1, 20)
    run = tmp_path / "run"
    (group0,) = start_groups(run, 0)
    with pytest.raises(RunDirError, match=r"--resume: .*other/replica1/checkpoints/"
                                          r"step_00000020\" is a checkpoint of another run"):
        start_groups(run, 1, resume=str(other))
    (run / "replica1").mkdir()
    (run / "replica1" / "metrics.jsonl").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunDirError, match=r"replica1/metrics.jsonl\" is a symbolic link"):
        start_groups(run, 1)
    assert len(rundir.read_record(run).history) == 1
    end_groups(run, [group0])


def test_overwrite_of_a_fault_tolerant_run_removes_its_replica_groups(tmp_path):
    """The replica groups' directories of a --ft run are editrain's: --overwrite removes
    them (their own files only). Before, the record never listed them as editrain's and
    --overwrite of any --ft run was refused ("files editrain did not write")."""
    run = tmp_path / "run"
    (group0,) = start_groups(run, 0)
    group_ckpt(run, 0, 10)
    (run / "replica0" / "metrics.jsonl").write_text('{"step": 1}\n')
    end_groups(run, [group0])
    (group1,) = start_groups(run, 1, overwrite=True)
    assert not (run / "replica0").exists()
    end_groups(run, [group1])
    ft = {"fault_tolerance": "torchft", "shard_size": 1, "nproc": 2}
    prepare_run_dir(cfg_for(run, dist=ft, overwrite=True), run)  # the local launcher's
    (run / "replica1" / "checkpoints").mkdir(parents=True)
    prepare_run_dir(cfg_for(run, dist=ft, overwrite=True), run)
    assert not (run / "replica1").exists()


def test_a_torchrun_group_must_name_the_runs_group_count(tmp_path, monkeypatch):
    """dist.ft_replicas is required under torchrun: derived from dist.nproc (which
    torchrun ignores, and which may differ between the groups' jobs) each group would
    count the groups its own way."""
    from editrain.errors import ConfigError
    from editrain.launch.job import check_torchrun

    monkeypatch.setenv("WORLD_SIZE", "1")
    ft = {"fault_tolerance": "torchft", "shard_size": 1, "ft_replica_id": 0}
    with pytest.raises(ConfigError, match="dist.ft_replicas: a replica group"):
        check_torchrun(cfg_for(tmp_path / "run", dist=ft))
    check_torchrun(cfg_for(tmp_path / "run", dist={**ft, "ft_replicas": 2}))


def test_a_joining_group_may_read_its_inputs_elsewhere_but_not_other_ones(tmp_path):
    """The paths of a group's model and tokenizer files are its machine's: they may differ
    from the first group's, what they hold may not; data.path may differ too (a resumed
    checkpoint's train split is compared)."""
    from tests.test_hf import TINY

    def hf_config(where: str, layers: int) -> str:
        path = tmp_path / where / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**TINY, "num_hidden_layers": layers}))
        return str(path.parent)

    def inputs(config: str, corpus: str) -> dict:
        (tmp_path / corpus).write_text("the same text on every machine\n")
        return {"model": {"hf_config": config}, "data": {"path": str(tmp_path / corpus)}}

    run = tmp_path / "run"
    (group0,) = start_groups(run, 0, **inputs(hf_config("a", 2), "corpus-a.txt"))
    (group1,) = start_groups(run, 1, **inputs(hf_config("b", 2), "corpus-b.txt"))
    group1.lock.release()
    with pytest.raises(RunDirError, match=r"this group's model.hf_config \(\S+/c\"\) "
                                          r"holds other files"):
        start_groups(run, 1, **inputs(hf_config("c", 3), "corpus-b.txt"))
    end_groups(run, [group0])


def test_a_joining_group_must_resume_a_checkpoint_of_the_first_groups_train_split(tmp_path):
    """Its data.path may differ from the first group's, the token stream may not: a group
    resuming a checkpoint of another train split than the first group's is refused."""
    run = tmp_path / "run"
    end_groups(run, start_groups(run, 0, 1))
    split = {"tokens": 1000, "sha256": "a" * 64}
    group_ckpt(run, 0, 4, train_data=split)
    group_ckpt(run, 1, 4, train_data={**split, "sha256": "b" * 64})
    (group0,) = start_groups(run, 0, resume=str(run))
    with pytest.raises(RunDirError, match=r"--resume: \S+/replica1/checkpoints/step_00000004\" "
                                          r"was trained on another train split"):
        start_groups(run, 1, resume=str(run))
    end_groups(run, [group0])



def test_a_local_overwrite_is_refused_while_a_torchrun_group_may_be_restarting(tmp_path):
    """Group 0 of a torchrun start holds no lock and has not ended (torchrun is restarting
    it); group 1 ended. A local --overwrite (editrain's own --ft launcher, or a plain job)
    is refused as a group's --overwrite is, naming the group and its directory, and removes
    nothing; once group 0 has ended it replaces the run. Before, the local claim only
    refused groups holding their lock: it removed replica0/ ("--overwrite: removed
    config.toml, replica0")."""
    run = tmp_path / "run"
    group0, group1 = start_groups(run, 0, 1)
    ckpt = group_ckpt(run, 0, 20)
    group0.lock.release()  # torchrun is restarting group 0
    end_groups(run, [group1])
    ft = {"fault_tolerance": "torchft", "shard_size": 1, "nproc": 2}
    refusal = (r"--overwrite: replica group\(s\) 0 of the run in \S+ have not ended and hold "
               r"no lock .* move its directory out of the run directory \(\S+/run/replica0\"\)")
    for cfg in (cfg_for(run, dist=ft, overwrite=True), cfg_for(run, overwrite=True)):
        with rundir.RunLock(run) as lock:
            with pytest.raises(RunDirError, match=refusal):
                check_run_dir(cfg, run)
            with pytest.raises(RunDirError, match=refusal):
                prepare_run_dir(cfg, run, lock)
    assert ckpt.is_dir() and (run / "config.toml").is_file()
    assert len(rundir.read_record(run).history) == 1
    end_groups(run, [group0])  # its job ended after all
    prepare_run_dir(cfg_for(run, dist=ft, overwrite=True), run)
    assert not (run / "replica0").exists()


def test_a_torchrun_restart_of_a_refused_group_is_checked_again(tmp_path):
    """torchrun (--max-restarts >= 1) restarts a group whose rank 0 was refused: the
    restarted job is checked again, as a first job is (here the --resume checkpoint of
    another run), since the group never joined the start. A restart of a group that takes
    part in the start still rejoins it as it left it. Before, every restarted job with a
    run record there was accepted unchecked and added to the start."""
    other = tmp_path / "other"
    end_groups(other, start_groups(other, 0))
    group_ckpt(other, 1, 20)
    run = tmp_path / "run"
    (group0,) = start_groups(run, 0)
    for restart in (0, 1):
        with pytest.raises(RunDirError, match=r"--resume: \S+/other/replica1/checkpoints/"
                                              r"step_00000020\" is a checkpoint of another run"):
            start_groups(run, 1, restart=restart, resume=str(other))
    assert rundir.read_record(run).history[-1]["ft_groups"] == [0]
    group0.lock.release()  # group 0's rank 0 died: torchrun restarts it
    (again,) = start_groups(run, 0, restart=1, resume=str(other))  # rejoins unchecked
    record = rundir.read_record(run)
    assert len(record.history) == 1 and record.history[0]["ft_groups"] == [0]
    assert record.resumed_from == []
    end_groups(run, [again])


def test_a_torchrun_restart_of_a_group_whose_start_ended_is_checked_again(tmp_path):
    """A restarted job of a group whose start is over (every group ended) is a new job
    of the run: with other options and neither --resume nor --overwrite it is refused, as
    its first job was. Before, the restart was accepted and re-added to the ended start
    (no history line, config.toml not rewritten)."""
    run = tmp_path / "run"
    end_groups(run, start_groups(run, 0, 1))
    group_ckpt(run, 0, 20)
    for restart in (0, 1):
        with pytest.raises(RunDirError, match=r"--run-dir: \S+/run\" already holds a run "
                                              r"\(config.toml, replica0\)"):
            start_groups(run, 0, restart=restart, train={"steps": 7})
    start = rundir.current_start(rundir.read_record(run))
    assert start["ft_groups"] == [0, 1] and start["ft_groups_ended"] == [0, 1]


def test_a_group_started_after_the_others_finished_the_run_is_told_at_once(tmp_path):
    """Group 1's job died at its step 4; group 0 trained on alone and finished the run
    (its final checkpoint at train.steps 6, its job ended). torchrun's restart of group 1,
    or a new job of it with --resume RUN, has no group left to meet in its first quorum:
    it is refused at once, naming the step the run ended at. Before, it waited out the
    quorum timeout (600 s), failed, and torchrun restarted it to wait again. With a larger
    --train.steps the other group may be resumed too, and with an older checkpoint of its
    own named a new timeline begins: those still start (and wait for the others)."""
    run = tmp_path / "run"
    steps = {"train": {"steps": 6}}
    group0, group1 = start_groups(run, 0, 1, **steps)
    group_ckpt(run, 0, 6)
    for step in (2, 4):
        group_ckpt(run, 1, step)
    group1.lock.release()  # group 1's job died (torchrun restarts it)
    end_groups(run, [group0])  # group 0 finished the run
    ended = (r"--dist.ft_replica_id: the run in \S+/run\" has ended at step 6: replica "
             r"group\(s\) 0 finished it \(train.steps 6; their latest checkpoints: group 0 "
             r"step 6\) .* nothing to rejoin")
    with pytest.raises(RunDirError, match=ended):
        start_groups(run, 1, restart=1, **steps)  # torchrun's restart
    with pytest.raises(RunDirError, match=ended):
        start_groups(run, 1, resume=str(run), **steps)  # a new job, --resume RUN
    record = rundir.read_record(run)  # nothing claimed; group 1's earlier job noted over
    assert len(record.history) == 1 and record.history[0]["ft_groups_ended"] == [0, 1]
    end_groups(run, start_groups(run, 1, resume=str(run / "replica1" / "checkpoints" /
                                                     "step_00000002"), **steps))
    end_groups(run, start_groups(run, 1, resume=str(run), train={"steps": 8}))
    assert len(rundir.read_record(run).history) == 3


def test_a_group_started_after_the_others_finished_a_run_without_checkpoints_is_told(
        tmp_path):
    """As above, where the run saves no checkpoint (or none at its last step): group 0
    finished the run (its job returned, which its end notes with the steps it trained to)
    and group 1's job had died. Group 1 started again is refused at once, naming where
    group 0 ended. Before, only a checkpoint at train.steps told that a group had
    finished: without one the group waited out the quorum timeout (600 s). A group whose
    job ended without finishing the run (a new job of it was refused), or a job with a
    larger --train.steps, is not told so."""
    run = tmp_path / "run"
    steps = {"train": {"steps": 6}}
    group0, group1 = start_groups(run, 0, 1, **steps)
    group1.lock.release()  # group 1's job died
    finish_groups(run, [group0], steps=6)
    ended = (r"--dist.ft_replica_id: the run in \S+/run\" has ended at step 6: replica "
             r"group\(s\) 0 finished it \(train.steps 6; where they ended: group 0 step 6 "
             r"\(its job finished the run; no checkpoint of that step\)\) .* nothing to "
             r"rejoin")
    with pytest.raises(RunDirError, match=ended):
        start_groups(run, 1, restart=1, **steps)  # torchrun's restart
    group_ckpt(run, 0, 4)  # its latest checkpoint is not at the end: the end still counts
    with pytest.raises(RunDirError, match=ended):
        start_groups(run, 1, **steps)  # a new job
    with pytest.raises(RunDirError) as larger:
        start_groups(run, 1, train={"steps": 8})
    assert "has ended" not in str(larger.value)
    assert rundir.finished_groups(rundir.read_record(run)) == {0: 6}


def test_only_rank_0_of_a_torchrun_group_looks_at_the_runs_end(tmp_path):
    """While a torchrun group waits in its first quorum its rank 0 looks at the run
    directory with the start-up check (nothing while another group trains; the refusal
    once every other group finished the run); its other ranks look at nothing (they take
    rank 0's answer), and a job that is no such group has nothing to look at."""
    import dataclasses

    from editrain.launch.job import Job
    from editrain.launch.run_dir import ended_run_watch

    run = tmp_path / "run"
    steps = {"train": {"steps": 6}}
    group0, group1 = start_groups(run, 0, 1, **steps)
    job = group_job(run, 1, **steps)
    look, other_rank = ended_run_watch(job), ended_run_watch(dataclasses.replace(job, rank=1))
    assert look() is None  # group 0 trains
    finish_groups(run, [group0], steps=6)
    assert re.match(r"--dist.ft_replica_id: the run in \S+ has ended at step 6", look())
    assert other_rank() is None
    assert ended_run_watch(Job(cfg_for(run), run, world=1, under_torchrun=True)) is None
    end_groups(run, [group1])


def test_a_look_at_the_runs_end_that_finds_the_run_busy_looks_again_later(tmp_path,
                                                                          monkeypatch):
    """Rank 0's look between the attempts of a group's first quorum finds the run's lock
    held by another job (a group claiming or joining the start, one gathering the run's
    summary): it says nothing this time, at once, and looks again at its next attempt.
    Before, it waited for the lock as long as a start does (60 s, the group's other ranks
    idle in the broadcast meanwhile) and then ended the group's job with the lock's
    refusal, though the group was waiting for groups that may well still come."""
    import time

    from editrain.launch import run_dir as run_dir_module
    from editrain.launch.run_dir import ended_run_watch

    monkeypatch.setattr(run_dir_module, "RUN_LOCK_WAIT_S", 0.2)  # a start's wait, shortened
    run = tmp_path / "run"
    steps = {"train": {"steps": 6}}
    group0, group1 = start_groups(run, 0, 1, **steps)
    look = ended_run_watch(group_job(run, 1, **steps))
    finish_groups(run, [group0], steps=6)
    with rundir.RunLock(run):  # another job holds the run's lock
        t0 = time.monotonic()
        assert look() is None
        assert time.monotonic() - t0 < 5
    assert re.match(r"--dist.ft_replica_id: the run in \S+ has ended at step 6", look())
    end_groups(run, [group1])


def test_a_group_that_did_not_finish_the_run_is_not_taken_as_finished(tmp_path):
    """A group's job that ended without finishing the run (its new job was started, and
    noted the earlier one over) is no evidence that the run ended; a new job of a group
    that finished takes part in the start again, and clears its end: it may not finish."""
    run = tmp_path / "run"
    group0, group1 = start_groups(run, 0, 1)
    group1.lock.release()  # group 1's job died
    end_groups(run, [group0])  # ended, not finished (no steps noted)
    with pytest.raises(RunDirError) as refused:
        start_groups(run, 1)
    assert "has ended" not in str(refused.value)
    assert rundir.finished_groups(rundir.read_record(run)) == {}
    run2 = tmp_path / "run2"
    group0, group1 = start_groups(run2, 0, 1)
    finish_groups(run2, [group0], steps=4)
    assert rundir.finished_groups(rundir.read_record(run2)) == {0: 4}
    with rundir.RunLock(run2):
        rundir.note_group(run2, 0, ended=False)  # a new job of group 0 joins the start
    assert rundir.finished_groups(rundir.read_record(run2)) == {}
    assert rundir.in_current_start(rundir.read_record(run2), 0)
    end_groups(run2, [group1])


def test_a_group_that_will_not_be_started_again_is_dropped_by_moving_its_directory(
        tmp_path, monkeypatch):
    """A run of three torchrun groups, all killed, is started again with two: group 2 of
    the last start is awaited, so their --overwrite is refused (naming replica2/, and how
    to drop it), and removes nothing; once the user moved replica2/ out of the run
    directory, group 2 is no longer awaited and the two groups replace the run (the moved
    directory is untouched). Before, every such start waited GROUP_RESTART_WAIT_S and was
    refused, advising to start every group again."""
    import threading

    from editrain.launch import run_dir

    monkeypatch.setattr(run_dir, "GROUP_POLL_S", 0.02)
    monkeypatch.setattr(run_dir, "GROUP_RESTART_WAIT_S", 0.3)
    run = tmp_path / "run"
    for claim in start_groups(run, 0, 1, 2, replicas=3):
        group_ckpt(run, claim.lock.replica, 10)
        claim.lock.release()  # killed: no end noted
    run_id = rundir.read_record(run).run_id

    def start_two() -> tuple[list, list]:
        claims = [run_dir.RunDirClaim(group_job(run, r, overwrite=True)) for r in (0, 1)]
        errors = []

        def join(claim) -> None:
            try:
                claim.join()
            except RunDirError as e:
                claim.lock.release()  # the refused job ends
                errors.append(e)

        threads = [threading.Thread(target=join, args=(c,)) for c in claims]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert not any(t.is_alive() for t in threads)
        return claims, errors

    claims, errors = start_two()
    assert len(errors) == 2 and all(re.match(
        r"--overwrite: replica group\(s\) 2 of the run in \S+ have not ended .* move its "
        r"directory out of the run directory \(\S+/run/replica2\"\): a group without one is "
        r"not awaited", str(e)) for e in errors), errors
    assert all((run / f"replica{r}" / "checkpoints" / "step_00000010").is_dir()
               for r in range(3))
    (run / "replica2").rename(tmp_path / "replica2.kept")
    monkeypatch.setattr(run_dir, "GROUP_RESTART_WAIT_S", 10)
    claims, errors = start_two()
    assert not errors, errors
    record = rundir.read_record(run)
    assert record.run_id != run_id and len(record.history) == 1  # a new run
    assert sorted(record.history[0]["ft_groups"]) == [0, 1]
    assert not (run / "replica0").exists() and not (run / "replica1").exists()
    assert (tmp_path / "replica2.kept" / "checkpoints" / "step_00000010").is_dir()
    end_groups(run, claims)

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


@pytest.mark.parametrize("other_running", [True, False])
def test_a_refused_new_job_of_a_group_whose_job_died_is_checked_again_on_restart(
        tmp_path, other_running):
    """A group whose job died (never ended: killed, its machine rebooted) is started again
    with other options: refused, whether it would join group 0 training or claim the run.
    Its torchrun restart must be refused too; it rejoined the start unchecked, as a member
    that had not ended, and trained with the refused options (found by review)."""
    run = tmp_path / "run"
    g0, g1 = start_groups(run, 0, 1)
    g1.lock.release()  # group 1's job died
    if not other_running:
        end_groups(run, [g0])
    for restart in (0, 1):
        with pytest.raises(RunDirError):
            start_groups(run, 1, restart=restart, train={"steps": 7})
    assert "steps = 7" not in (run / "config.toml").read_text()


# --------------------------------------------------- torchrun restarts of a plain job
def plain_torchrun_job(run: Path, restart: int = 0, **over):
    """Rank 0's job of a plain (not fault-tolerant) torchrun job of one rank."""
    from editrain.launch.job import Job

    return Job(cfg_for(run, **over), run, world=1, under_torchrun=True, restart=restart)


def join_as_rank0(run: Path, restart: int = 0, **over) -> bool | None:
    """Rank 0 of a plain torchrun job joins ``run`` (its lock released on the way out, as
    when the worker dies); returns its decision (``RunDirClaim.join``)."""
    from editrain.launch.run_dir import RunDirClaim

    with RunDirClaim(plain_torchrun_job(run, restart, **over)) as claim:
        return claim.join()


@pytest.fixture
def torchrun_store(monkeypatch):
    """Start a torchrun launch's store, as the elastic agent does for its workers
    (``TORCHELASTIC_USE_AGENT_STORE``, ``MASTER_ADDR``, ``MASTER_PORT``); call it again
    for another launch (a store of its own)."""
    import torch.distributed as dist

    servers = []

    def start():
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        servers.append(server)
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(server.port))
        return server

    yield start
    servers.clear()


@pytest.mark.parametrize(("stored", "recorded", "own"), [
    ("a", "a", True),      # this launch's token in the record: its own claim
    ("a", "b", False),     # another launch's claim, or a claim since this launch's
    (None, None, False),   # a line of no torchrun launch (a local job's): never this one's
    ("a", None, False),
    (None, "b", None),     # some launch's claim, none of this launch's to compare
])
def test_own_claim_compares_the_launchs_token_with_the_records(stored, recorded, own):
    from editrain.launch.torchrun_claim import own_claim

    assert own_claim(stored, recorded) is own


def test_a_torchrun_restart_rejoins_only_its_own_launchs_claim(tmp_path, torchrun_store):
    """torchrun restarts a launch's workers after a failure (--max-restarts), a refused
    first attempt's too. A restart whose store holds the token of the record's latest
    claim goes on with the run as it is; a restart of another launch (refused: the
    directory holds a run of an earlier torchrun launch) is refused again, on every
    restart. Before, any restart took a record's presence for its own launch's claim: the
    refused job was accepted and trained into the other run."""
    from editrain.launch.torchrun_claim import CLAIM_TOKEN, LaunchStore

    run = tmp_path / "run"
    torchrun_store()  # launch a
    join_as_rank0(run, train={"steps": 8})
    record = rundir.read_record(run)
    token = record.history[-1][CLAIM_TOKEN]
    assert LaunchStore.connect().latest(run) == token
    join_as_rank0(run, restart=1, train={"steps": 8})  # a's workers restarted: its run
    assert rundir.read_record(run).history == record.history

    torchrun_store()  # launch b: other options, neither --resume nor --overwrite
    for restart in (0, 1, 2):
        with pytest.raises(RunDirError, match=r"already holds a run"):
            join_as_rank0(run, restart=restart, train={"steps": 7})
    assert rundir.read_record(run).history == record.history


def test_a_torchrun_restart_checks_a_run_that_another_job_claimed_since(
        tmp_path, torchrun_store):
    """A launch's workers died and another job claimed the directory meanwhile (a local
    --overwrite): the restart, counted or not, is checked as a first attempt, and
    refused."""
    from editrain.launch.torchrun_claim import CLAIM_TOKEN

    run = tmp_path / "run"
    torchrun_store()
    join_as_rank0(run)
    prepare_run_dir(cfg_for(run, overwrite=True, train={"steps": 7}), run)
    assert CLAIM_TOKEN not in rundir.read_record(run).history[-1]
    for restart in (1, 0):
        with pytest.raises(RunDirError, match=r"already holds a run"):
            join_as_rank0(run, restart=restart)


def test_without_torchruns_store_a_restart_keeps_a_torchrun_claim_and_says_so(
        tmp_path, monkeypatch, caplog):
    """Without torchrun's store (etcd rendezvous: TORCHELASTIC_USE_AGENT_STORE False) a
    restart cannot compare its launch's token: it goes on with a torchrun launch's claim
    as it is, as before, and says why in a warning; a run of a job that is no torchrun
    launch (no token: a local job's) is checked and refused even so."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    run = tmp_path / "run"
    join_as_rank0(run, train={"steps": 8})
    history = rundir.read_record(run).history
    with caplog.at_level("WARNING", logger="editrain"):
        join_as_rank0(run, restart=1, train={"steps": 7})
    assert rundir.read_record(run).history == history
    assert "taken as this launch's without a check" in caplog.text
    assert "TORCHELASTIC_USE_AGENT_STORE is not True" in caplog.text

    local = tmp_path / "local"
    prepare_run_dir(cfg_for(local), local)
    with pytest.raises(RunDirError, match=r"already holds a run"):
        join_as_rank0(local, restart=1, train={"steps": 7})


# ------------------------------------------------- rank 0's decision, shared by every rank
def ranked_job(run: Path, rank: int, restart: int = 0, **over):
    """Rank ``rank``'s job of a plain torchrun job of two ranks."""
    from editrain.launch.job import Job

    return Job(cfg_for(run, **over), run, world=2, rank=rank, under_torchrun=True,
               restart=restart)


def join_in_thread(job, decisions: list | None = None) -> tuple:
    """``RunDirClaim(job).join()`` in a thread of its own; returns the thread and the list
    its error goes to (what join returned goes to ``decisions``, if given)."""
    import threading

    from editrain.launch.run_dir import RunDirClaim

    errors: list = []
    returned = [] if decisions is None else decisions

    def join() -> None:
        with RunDirClaim(job) as claim:
            _catching(errors, lambda: returned.append(claim.join()))

    thread = threading.Thread(target=join)
    thread.start()
    return thread, errors


def test_the_other_ranks_wait_for_rank_0s_decision_and_share_its_refusal(
        tmp_path, torchrun_store):
    """The directory holds another run, so config.toml is there from the start: rank 1
    waits for rank 0's decision all the same, and is refused as rank 0 is (same error,
    same line). Before, rank 1 waited only for config.toml and went on at once, into its
    worker, while rank 0 was still checking and then refused; torchrun killed rank 1
    without a word (or, on another node, it hung in the process group's start). A
    later attempt's rank 1 waits for that attempt's decision, not the refusal before it;
    a claim lets it go on."""
    run = tmp_path / "run"
    prepare_run_dir(cfg_for(run, train={"steps": 8}), run)  # another run, config.toml
    torchrun_store()
    rank1, errors1 = join_in_thread(ranked_job(run, 1))
    time.sleep(0.5)
    assert rank1.is_alive(), errors1  # config.toml is there: it waits for rank 0
    rank0, errors0 = join_in_thread(ranked_job(run, 0))
    for thread in (rank0, rank1):
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert [type(e) for e in errors0 + errors1] == [RunDirError, RunDirError]
    assert str(errors1[0]) == str(errors0[0])
    assert re.match(r"--run-dir: \S+/run\" already holds a run", str(errors1[0]))

    rank1, errors1 = join_in_thread(ranked_job(run, 1, restart=1, overwrite=True))
    time.sleep(0.5)
    assert rank1.is_alive(), errors1  # attempt 0's refusal is not attempt 1's decision
    rank0, errors0 = join_in_thread(ranked_job(run, 0, restart=1, overwrite=True))
    for thread in (rank0, rank1):
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert not errors0 and not errors1, errors0 + errors1


@pytest.mark.parametrize(("error", "raised", "line"), [
    (FileNotFoundError("no file x"), FileNotFoundError, "no file x"),
    (OSError(28, "No space left on device"), RunDirError,
     r"--run-dir: rank 0 failed while it checked \S+ \(OSError: \[Errno 28\] No space "
     r"left on device\); see its output"),
])
def test_any_failure_of_rank_0_ends_the_other_ranks(tmp_path, torchrun_store, error, raised,
                                                    line):
    """Rank 0 refused with a user's error: the other ranks raise the same (the same one
    line); any other failure of rank 0 reaches them as a RunDirError naming it, rather than
    a wait until they time out."""
    import threading

    from editrain.launch.torchrun_claim import LaunchStore

    torchrun_store()
    rank0, rank1 = LaunchStore.connect(), LaunchStore.connect()
    refusing = threading.Thread(target=rank0.refuse, args=(error,), kwargs={"readers": 1})
    refusing.start()
    with pytest.raises(raised, match=line):
        rank1.decision(1, 5, tmp_path)
    refusing.join(timeout=20)


def test_without_torchruns_store_the_other_ranks_wait_for_config_toml(tmp_path, monkeypatch):
    """Without torchrun's store the other ranks fall back to waiting for rank 0's
    config.toml (and say so when it never comes)."""
    from editrain.launch import run_dir

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setattr(run_dir, "TORCHRUN_WAIT_S", 0.3)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(RunDirError, match=r"rank 1 saw no config.toml from rank 0"):
        run_dir.RunDirClaim(ranked_job(run, 1)).join()
    prepare_run_dir(cfg_for(run), run)
    run_dir.RunDirClaim(ranked_job(run, 1)).join()


def test_a_torchrun_restart_rejoins_only_a_start_its_own_launch_joined(
        tmp_path, torchrun_store, monkeypatch):
    """Group 1's job (launch a) died in the run's start; a new launch b of group 1 is
    refused before its group's earlier job is noted over (here the wait for the run's
    lock timed out), and torchrun restarts b with options the run does not have: the
    restart is checked, and refused. Before, it found group 1 in the start, not ended and
    unlocked, took it for its own and rejoined the start unchecked. A restart of launch a
    itself rejoins as before."""
    from editrain.launch import run_dir

    run = tmp_path / "run"
    torchrun_store()
    (group0,) = start_groups(run, 0)
    launch_a = torchrun_store()
    (group1,) = start_groups(run, 1)
    group1.lock.release()  # group 1's job died: torchrun (launch a) may restart it

    torchrun_store()  # launch b of group 1
    monkeypatch.setattr(run_dir, "RUN_LOCK_WAIT_S", 0.2)
    with rundir.RunLock(run), pytest.raises(RunDirError, match=r"in use by another"):
        start_groups(run, 1)  # the run's lock is busy: refused before any note
    assert rundir.in_current_start(rundir.read_record(run), 1)
    with pytest.raises(RunDirError, match=r"train.steps: this group 7, the run "):
        start_groups(run, 1, restart=1, train={"steps": 7})
    history = rundir.read_record(run).history
    assert len(history) == 1 and "steps = 7" not in (run / "config.toml").read_text()

    (group1_b,) = start_groups(run, 1)  # b's restart with the run's options joins
    group1_b.lock.release()
    monkeypatch.setenv("MASTER_PORT", str(launch_a.port))
    with pytest.raises(RunDirError, match=r"train.steps"):
        start_groups(run, 1, restart=1, train={"steps": 7})  # a's place was taken by b
    end_groups(run, [group0])


@pytest.mark.parametrize("options", [{"overwrite": True}, {}])
def test_a_restart_torch_elastic_did_not_count_rejoins_its_launchs_run(
        tmp_path, torchrun_store, monkeypatch, options):
    """torch elastic restarts the workers without counting a restart when the nodes that
    take part change (a node joins an elastic job; on a job of several nodes, the nodes
    whose own workers were healthy when another's failed): TORCHELASTIC_RESTART_COUNT is
    then 0 again on that node, yet the launch's store holds the token of its own claim.
    Such a rank 0 rejoins its launch's run as it is (REJOINED: every rank resumes its
    latest checkpoint), as a counted restart does. Before, it was refused, spending one of
    torchrun's --max-restarts (and earlier still it was checked as a first attempt: with
    --overwrite it replaced its own launch's run, checkpoints and all)."""
    run = tmp_path / "run"
    torchrun_store()
    assert join_as_rank0(run, train={"steps": 8}) is False  # the first claim
    committed_checkpoints(run / rundir.CKPT_DIR, 4)
    history = rundir.read_record(run).history
    assert join_as_rank0(run, restart=0, train={"steps": 8}, **options) is True
    assert rundir.read_record(run).history == history
    assert checkpoint_resumed(run, monkeypatch, rejoined=True, count=0) == "step_4"
    assert join_as_rank0(run, restart=1, train={"steps": 8}, **options) is True  # counted
    assert rundir.read_record(run).history == history


def test_a_groups_restart_torch_elastic_did_not_count_rejoins_its_start(
        tmp_path, torchrun_store, monkeypatch):
    """The same for a torchrun job of a fault-tolerant run's replica group: its launch
    joined the start as the group, and its workers come back with
    TORCHELASTIC_RESTART_COUNT 0. The job rejoins the start (holding the group's lock, its
    --overwrite not applied: the group's checkpoints stay, and it resumes the latest).
    Before, it was refused, spending one of torchrun's --max-restarts."""
    run = tmp_path / "run"
    torchrun_store()
    (group0,) = start_groups(run, 0, replicas=1)
    committed_checkpoints(run / "replica0" / rundir.CKPT_DIR, 4)
    group0.lock.release()  # its workers died
    history = rundir.read_record(run).history
    (group0,) = start_groups(run, 0, replicas=1, overwrite=True)
    assert group0.lock.held
    assert rundir.read_record(run).history == history
    assert checkpoint_resumed(run, monkeypatch, rejoined=True, count=0,
                              ft=True) == "step_4"
    group0.lock.release()
    (group0,) = start_groups(run, 0, restart=1, replicas=1, overwrite=True)  # counted
    assert rundir.read_record(run).history == history
    end_groups(run, [group0])


@pytest.mark.parametrize("rank1_restart", [0, 1])
def test_the_other_ranks_wait_for_this_attempts_decision_whatever_their_restart_count(
        tmp_path, torchrun_store, rank1_restart):
    """An attempt torch elastic did not count (a change of the nodes taking part) has the
    restart count of the attempt before it, and on a job of several nodes the counts
    differ between nodes (a node whose workers failed counts, a node restarted as healthy
    does not). Rank 1 waits for the decision of rank 0 of its own attempt all the same
    (here: rank 0 rejoined its launch's run). Before, the decision's key was the restart
    count: rank 1 went on at once on the earlier attempt's 'claimed' (same count), or
    waited for a key rank 0 never wrote (another count) until it timed out."""
    run = tmp_path / "run"
    torchrun_store()
    first = [join_in_thread(ranked_job(run, r)) for r in (1, 0)]
    for thread, errors in first:
        thread.join(timeout=20)
        assert not thread.is_alive() and not errors, errors

    decisions: list = []
    rank1, errors1 = join_in_thread(ranked_job(run, 1, restart=rank1_restart,
                                               overwrite=True), decisions)
    time.sleep(0.5)
    assert rank1.is_alive(), errors1  # no decision of this attempt yet
    rank0, errors0 = join_in_thread(ranked_job(run, 0, restart=0, overwrite=True),
                                    decisions)
    for thread in (rank0, rank1):
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert not errors0 + errors1, errors0 + errors1
    assert decisions == [True, True]  # this attempt's: rank 0 rejoined (uncounted)


def joined_attempt(run: Path, counts: dict[int, int], **over) -> dict[int, object]:
    """One attempt of a two-rank torchrun job: each rank (of ``counts``: rank -> its
    TORCHELASTIC_RESTART_COUNT) joins ``run`` in a thread of its own, in the order given;
    returns what each rank's ``RunDirClaim.join()`` returned (or raised)."""
    return joined_jobs({rank: ranked_job(run, rank, restart=restart, **over)
                        for rank, restart in counts.items()})


def joined_jobs(jobs: dict[int, Any]) -> dict[int, object]:
    """Each rank's job (rank -> job) joins its run directory in a thread of its own, in
    the order given; what each ``RunDirClaim.join()`` returned (or raised)."""
    from editrain.launch.run_dir import RunDirClaim

    def join(rank: int, job: Any) -> object:
        with RunDirClaim(job) as claim:
            return claim.join()

    joined, finished = each_rank_in_a_thread(join, jobs, stagger_s=0.2, timeout_s=20)
    assert finished
    return joined


def test_every_rank_resumes_as_rank_0_decided_whatever_its_restart_count(
        tmp_path, torchrun_store, monkeypatch):
    """Whether an attempt's workers resume the run's latest checkpoint is rank 0's decision
    (RunDirClaim.join returns it on every rank, and the trainer follows it), not each
    rank's TORCHELASTIC_RESTART_COUNT: after rank 0's node failed, its count is 1 and the
    healthy node's is still 0 (torch elastic restarts its workers uncounted). Before, join
    returned nothing and each trainer went by its own count: rank 0 resumed the run's
    latest checkpoint, rank 1 started over. A new claim (the run replaced since) resumes
    none on any rank, whatever its count; without torchrun's store nothing is decided
    (None: every rank goes by its count, as before)."""
    run = tmp_path / "run"
    torchrun_store()
    assert joined_attempt(run, {1: 0, 0: 0}) == {0: False, 1: False}  # the first claim
    assert joined_attempt(run, {1: 0, 0: 1}) == {0: True, 1: True}  # rank 0's node failed
    assert joined_attempt(run, {1: 1, 0: 1}) == {0: True, 1: True}

    prepare_run_dir(cfg_for(run, overwrite=True, train={"steps": 7}), run)  # a local job
    assert joined_attempt(run, {1: 1, 0: 1}, overwrite=True) == {0: False, 1: False}

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert joined_attempt(run, {1: 1, 0: 1}) == {0: None, 1: None}


def test_a_torchrun_worker_is_told_rank_0s_decision(tmp_path, monkeypatch):
    """run_under_torchrun hands what RunDirClaim.join returned to the worker
    (run_worker's ``rejoined``), which the trainer resumes by; a job that is no replica
    group of a fault-tolerant run gets no look at the run's end (``run_ended``)."""
    import editrain.train
    from editrain.launch import run_dir, run_under_torchrun

    told: dict = {}
    monkeypatch.setenv("RANK", "1")  # (rank 0 would plot the run)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for decision in (True, False, None):
        monkeypatch.setattr(run_dir.RunDirClaim, "join", lambda self, d=decision: d)
        monkeypatch.setattr(editrain.train, "run_worker",
                            lambda cfg, path, rejoined=None, run_ended=None: told.update(
                                rejoined=rejoined, watched=run_ended is not None))
        run_under_torchrun(cfg_for(tmp_path / "run"))
        assert told == {"rejoined": decision, "watched": False}


def test_a_torchrun_group_notes_its_end_while_it_holds_its_lock(tmp_path, monkeypatch):
    """Rank 0 of a replica group's torchrun job summarises the run (and notes there that
    the group finished it) before it lets go of the group's lock. Before, it let go first:
    a new job of the same group could start in between, join the run, and then be noted
    as finished by the old job's summary."""
    import editrain.launch
    import editrain.train
    from editrain.launch import run_dir, run_under_torchrun

    run = tmp_path / "run"
    job = group_job(run, 0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    def join(self):  # what _join_run leaves: the group's lock held for the job
        self.lock = rundir.RunLock(run, 0).acquire()

    held: list[bool] = []

    def summarise(_job):
        other_job = rundir.RunLock(run, 0)  # a new job of group 0 trying to start
        held.append(other_job.try_acquire() is not None)
        if not held[-1]:
            other_job.release()

    monkeypatch.setattr(run_dir.RunDirClaim, "join", join)
    monkeypatch.setattr(editrain.train, "run_worker", lambda *a, **k: {})
    monkeypatch.setattr(editrain.launch, "summarise", summarise)
    run_under_torchrun(job.cfg)
    assert held == [True]
    assert rundir.RunLock(run, 0).try_acquire() is None  # released at the job's end


@pytest.mark.parametrize(("rejoined", "count", "resumed"), [
    (True, 0, "step_8"),  # rank 0 rejoined; this rank's node restarted uncounted
    (False, 1, None),     # rank 0 made a new claim: --resume only (none here)
    (None, 1, "step_8"),  # not told (the local launcher): a counted restart resumes
    (None, 0, None),
])
def test_the_trainer_resumes_the_runs_checkpoint_as_told(tmp_path, monkeypatch, rejoined,
                                                         count, resumed):
    """The trainer resumes the run's latest checkpoint when rank 0 rejoined the run
    (``rejoined``), whatever this rank's TORCHELASTIC_RESTART_COUNT; only where it is not
    told does the count decide. Before, the count decided on every rank."""
    run = tmp_path / "run"
    committed_checkpoints(run / rundir.CKPT_DIR, 4, 8)
    assert checkpoint_resumed(run, monkeypatch, rejoined, count) == resumed


@pytest.mark.parametrize(("rejoined", "count", "said"), [
    (True, 0, "rejoining this launch's run after a restart torch elastic did not count "
              "(a change of the nodes taking part): resuming from "),
    (True, 2, "worker restart 2: resuming from "),
    (None, 1, "worker restart 1: resuming from "),
])
def test_the_resume_line_says_what_restarted_the_attempt(tmp_path, monkeypatch, caplog,
                                                         rejoined, count, said):
    """An attempt that rejoins its launch's run after a restart torch elastic did not
    count (a change of the nodes taking part) says so. Before, it logged "worker restart 0:
    resuming from ...": a restart count of 0, as if nothing had restarted."""
    import logging

    run = tmp_path / "run"
    committed_checkpoints(run / rundir.CKPT_DIR, 4, 8)
    with caplog.at_level(logging.WARNING, logger="editrain"):
        assert checkpoint_resumed(run, monkeypatch, rejoined, count) == "step_8"
    lines = [r.getMessage() for r in caplog.records if r.name == "editrain"]
    assert lines == [said + str(run / rundir.CKPT_DIR / "step_8")], lines
    assert not any("worker restart 0" in line for line in lines)


def committed_checkpoints(ckpt_dir: Path, *steps: int) -> None:
    """Committed (marked) checkpoint directories ``step_{s}`` in ``ckpt_dir``."""
    for step in steps:
        (ckpt_dir / f"step_{step}").mkdir(parents=True)
        (ckpt_dir / f"step_{step}" / rundir.MARKER).write_text("{}")


def checkpoint_resumed(run: Path, monkeypatch, rejoined: bool | None, count: int,
                       ft: bool = False) -> str | None:
    """The name of the checkpoint a trainer of ``run`` told ``rejoined`` at restart count
    ``count`` resumes (replica group 0's own with ``ft``), or None."""
    from editrain.train import Trainer

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
    monkeypatch.delenv("EDITRAIN_FT_ATTEMPT", raising=False)
    trainer = object.__new__(Trainer)  # (its resume choice alone: no process group)
    trainer.cfg, trainer.ft, trainer.replica = cfg_for(run), ft, 0
    trainer.run_dir = run / "replica0" if ft else run
    trainer.is_logger, trainer.rejoined = True, rejoined
    ckpt = trainer._checkpoint_to_resume()
    return ckpt.name if ckpt else None


def test_a_rank_given_other_options_is_refused_before_rank_0_writes_anything(
        tmp_path, torchrun_store):
    """Each rank sends rank 0 its options with its ask for the decision, and rank 0
    compares them with its own before it checks or claims the run directory: a node
    started with another --steps is refused on every rank, naming the option, and nothing
    is written. Before, the options were compared once the process group was up, after
    rank 0 had claimed the directory: config.toml and the record stayed behind, and the
    corrected command was refused as "already holds a run"."""
    from editrain.errors import ConfigError

    run = tmp_path / "run"
    torchrun_store()
    joined = joined_attempt_options(run, {1: {"train": {"steps": 14}}, 0: {}})
    assert [type(joined[r]) for r in (0, 1)] == [ConfigError, ConfigError]
    assert str(joined[0]) == str(joined[1])
    assert "train.steps = 14 (rank 0: 12)" in str(joined[1])
    assert not run.exists()
    assert joined_attempt_options(run, {1: {}, 0: {}}) == {0: False, 1: False}


def joined_attempt_options(run: Path, options: dict[int, dict]) -> dict[int, object]:
    """:func:`joined_attempt` with each rank's own options (rank -> options), every
    rank at restart count 0."""
    return joined_jobs({rank: ranked_job(run, rank, **{"train": {"steps": 12}, **over})
                        for rank, over in options.items()})
