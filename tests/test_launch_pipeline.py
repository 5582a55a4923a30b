"""The launch as a pipeline (issue 52 item 4): the inputs checked into one frozen Job that
every later stage reads, the run directory's claim around the job, the summary's choice of
runs. The stages' behaviour end to end is in test_cli.py, test_launcher.py and
test_fault_tolerance.py; these check the stages one at a time, in this process."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from editrain import rundir
from editrain.config import load_config
from editrain.errors import ConfigError
from editrain.launch import summarise
from editrain.launch.job import Job, check_local, check_torchrun
from editrain.launch.run_dir import RunDirClaim


def test_the_local_job_is_checked_once_and_frozen(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, {"run_dir": str(run_dir), "dist": {"nproc": 4, "shard_size": 2,
                                                               "threads_per_proc": 3}})
    job = check_local(cfg)
    assert (job.run_dir, job.cfg.run_dir, job.world, job.threads) == (run_dir, str(run_dir),
                                                                       4, 3)
    assert (job.rank, job.restart, job.under_torchrun, job.ft) == (0, 0, False, False)
    assert job.cfg.dist == cfg.dist  # nothing else of the configuration changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.world = 2  # type: ignore[misc]
    assert not run_dir.exists()  # the check stage touches nothing


def test_a_world_that_does_not_fit_is_refused_before_the_run_directory_is_chosen(tmp_path):
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"),
                             "dist": {"nproc": 3, "shard_size": 2}})
    with pytest.raises(ConfigError, match="shard_size"):
        check_local(cfg)
    assert not (tmp_path / "run").exists()


def test_a_torchrun_job_reads_its_place_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RUN_ID": "abc",
                       "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(key, value)
    job = check_torchrun(load_config(None, {}))
    assert (job.run_dir, job.cfg.run_dir) == (Path("runs") / "abc", str(Path("runs") / "abc"))
    assert (job.world, job.rank, job.restart, job.under_torchrun) == (2, 1, 2, True)


def test_the_claim_writes_nothing_before_claim_and_releases_the_lock_after(tmp_path):
    run_dir = tmp_path / "run"
    job = check_local(load_config(None, {"run_dir": str(run_dir)}))
    with RunDirClaim(job) as claim:
        claim.check()
        assert not run_dir.exists()  # checked: nothing written
        record = claim.claim()
        assert claim.lock.held
        assert rundir.read_record(run_dir).run_id == record.run_id
        assert load_config(run_dir / "config.toml").run_dir == str(run_dir)
        with pytest.raises(ConfigError):  # a second job on the directory is refused
            rundir.RunLock(run_dir).acquire()
    assert not claim.lock.held
    rundir.RunLock(run_dir).acquire().release()  # free again once the job is over


def test_a_used_directory_is_locked_as_soon_as_the_claim_starts(tmp_path):
    run_dir = tmp_path / "run"
    job = check_local(load_config(None, {"run_dir": str(run_dir)}))
    with RunDirClaim(job) as claim:
        claim.claim()
    with RunDirClaim(job) as claim:  # editrain's lock file is there: taken at once
        assert claim.lock.held
    fresh = check_local(load_config(None, {"run_dir": str(tmp_path / "new")}))
    with RunDirClaim(fresh) as claim:  # nothing there yet: taken when it is claimed
        assert not claim.lock.held


def test_torchrun_ranks_wait_for_rank_0s_claim(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, {"run_dir": str(run_dir)})
    base = dict(cfg=dataclasses.replace(cfg, run_dir=str(run_dir)), run_dir=run_dir,
                world=2, under_torchrun=True)
    rank0, rank1 = Job(**base, rank=0), Job(**base, rank=1)
    done = []
    waiter = threading.Thread(target=lambda: (RunDirClaim(rank1).join(), done.append(
        (run_dir / "config.toml").exists())))
    waiter.start()
    time.sleep(0.3)
    assert not done  # still waiting: rank 0 has not claimed the directory
    with RunDirClaim(rank0) as claim:
        claim.join()
        assert claim.lock.held
        waiter.join(10)
    assert done == [True]


def test_a_torchrun_restart_keeps_the_directory_as_it_is(tmp_path):
    run_dir = tmp_path / "run"
    cfg = dataclasses.replace(load_config(None, {"run_dir": str(run_dir)}), run_dir=str(run_dir))
    with RunDirClaim(Job(cfg, run_dir, 1, under_torchrun=True)) as claim:
        claim.join()
    (run_dir / "config.toml").write_text("# the run's own\n")
    restarted = Job(cfg, run_dir, 1, restart=1, under_torchrun=True)
    with RunDirClaim(restarted) as claim:
        claim.join()
        assert claim.lock.held
    assert (run_dir / "config.toml").read_text() == "# the run's own\n"


def test_the_summary_plots_the_run_or_the_groups_that_wrote_metrics(tmp_path, monkeypatch):
    import editrain.metrics

    plotted = []
    monkeypatch.setattr(editrain.metrics, "plot_runs",
                        lambda runs, out: plotted.append((runs, out)) or [])
    run_dir = tmp_path / "run"
    cfg = load_config(None, {"run_dir": str(run_dir)})
    summarise(Job(cfg, run_dir, 2))
    ft = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, fault_tolerance="torchft",
                                                           nproc=6, shard_size=2))
    for r in (0, 2):
        (run_dir / f"replica{r}").mkdir(parents=True)
    (run_dir / "replica2" / "metrics.jsonl").write_text("")
    summarise(Job(ft, run_dir, 6))  # 3 groups of 2: only group 2 wrote metrics
    # the curves are drawn into the run directory, the groups' too
    assert plotted == [([run_dir], run_dir), ([run_dir / "replica2"], run_dir)]


class FakeGroup:
    """A replica group's process as :class:`editrain.launch.ft.ReplicaGroups` sees it."""

    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode  # None: still running
        self.killed = False

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed, self.exitcode = True, -9

    def join(self, timeout: float | None = None) -> None:
        pass


@pytest.fixture
def groups(tmp_path, monkeypatch):
    """Three replica groups of a --ft job, not started: their processes are set by hand."""
    from editrain.launch import ft

    monkeypatch.setenv("EDITRAIN_START_METHOD", "spawn")  # no fork server for this
    run_dir = tmp_path / "run"
    cfg = load_config(None, {"run_dir": str(run_dir), "dist": {
        "fault_tolerance": "torchft", "nproc": 3, "shard_size": 1, "max_restarts": 1},
        "sim": {"fail_restart_s": 0.0}})
    g = ft.ReplicaGroups(Job(cfg, run_dir, 3), "lighthouse:1", None)
    started = []
    monkeypatch.setattr(g, "start", lambda r: started.append(r) or g.procs.__setitem__(
        r, FakeGroup(None)))
    g.started = started
    return g


def test_a_dead_group_restarts_while_another_trains_and_only_once(groups):
    groups.procs = {0: FakeGroup(None), 1: FakeGroup(1), 2: FakeGroup(0)}
    groups.restart_dead()
    assert groups.started == [1] and groups.attempts == {0: 0, 1: 1, 2: 0}
    assert [(e["event"], e["replica"], e["exit_code"]) for e in groups.events] == [
        ("died", 1, 1)]
    assert groups.cfg.dist.ft_replicas == 3  # every group knows how many there are
    groups.procs[1] = FakeGroup(1)  # dies again: dist.max_restarts = 1 is spent
    groups.restart_dead()
    assert groups.started == [1] and 1 not in groups.procs


def test_a_dead_group_with_nobody_left_to_heal_from_is_given_up(groups):
    groups.procs = {0: FakeGroup(2), 1: FakeGroup(0)}
    groups.restart_dead()
    assert groups.started == [] and list(groups.procs) == [1]


def test_a_restarted_group_that_cannot_rejoin_is_stopped_after_the_grace(groups):
    groups.procs = {0: FakeGroup(0), 1: FakeGroup(None), 2: FakeGroup(None)}
    groups.attempts.update({1: 1, 2: 1})
    (groups.job.group_dir(2)).mkdir(parents=True)
    (groups.job.group_dir(2) / "summary.json").write_text("{}")  # done, still exiting
    assert groups.stop_late()  # every group done or late: the grace starts
    assert not groups.events
    groups.finished_at -= groups.cfg.dist.ft_heartbeat_timeout_s + 6  # the grace is over
    assert groups.stop_late()
    assert [(e["event"], e["replica"]) for e in groups.events] == [("stopped_late", 1)]
    assert list(groups.procs) == [0, 2]
    groups.procs = {0: FakeGroup(0), 1: FakeGroup(None)}
    groups.attempts[1] = 0  # a first attempt still trains: no grace, nothing stopped
    assert not groups.stop_late()
