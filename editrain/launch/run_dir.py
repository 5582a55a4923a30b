"""The run directory stage of a launch: locked, checked, then claimed (record and config).

See :mod:`editrain.rundir`. The directory is locked for the whole job, checked before any
work, and claimed once the data and the checkpoint are known usable.

A directory holding a different run is refused unless ``--overwrite``, a directory another
job is using is refused, and the job holds the directory's lock until it ends; claiming it
writes the run record (identity, timeline) and the resolved configuration of the job
(``RUN_DIR/config.toml``: the latest job's; the options it changes over the one it
replaces are kept in the record's history).

The replica groups of a fault-tolerant run started as torchrun jobs of their own share
one run directory: each job locks its own group, the first to start claims the run, and
the others join it (:meth:`RunDirClaim.join`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from editrain import rundir
from editrain.config import SECTIONS, Config, dumps_toml, to_dict, toml_value
from editrain.config.applicability import drop_inapplicable
from editrain.config.toml_io import RUN_CONFIG_MAX_BYTES
from editrain.errors import RunDirError
from editrain.launch.job import Job, resolved
from editrain.launch.torchrun_claim import (
    CLAIM_TOKEN,
    CLAIMED,
    REJOINED,
    LaunchStore,
    group_token,
    note_group_claim,
    own_claim,
    recorded_token,
)
from editrain.paths import shown
from editrain.safe_io import read_bytes, read_json_value, read_toml_value, write_atomic

log = logging.getLogger("editrain")

TORCHRUN_WAIT_S = 120
"""How long a torchrun rank other than 0 waits for rank 0's decision about the run
directory (a replica group's rank longer: :func:`decision_wait_s`)."""
GROUP_RESTART_WAIT_S = 180
"""How long a torchrun job of a fault-tolerant run's replica group waits for the groups
of the run's current start that have not ended and hold no lock (torchrun may be
restarting them) before it claims the run anew (see :meth:`RunDirClaim.join`)."""
GROUP_POLL_S = 1.0
"""How often it looks for them meanwhile."""
RUN_LOCK_WAIT_S = 60
"""How long a torchrun job of a fault-tolerant run's replica group waits for the run's
lock, which the other groups' jobs hold a moment each (to claim the run, to gather its
summary) and editrain's own ``--ft`` launcher for its whole job."""


def _options_word(cfg: Config) -> str:
    """This rank's options that every rank must share, as it sends them to rank 0 with
    its ask for the decision (JSON)."""
    from editrain.runtime import comparable_options

    return json.dumps(comparable_options(cfg), default=str, sort_keys=True)


def _refuse_other_options(cfg: Config, sent: dict[int, str]) -> None:
    """Rank 0 of a torchrun attempt, before it checks or writes anything in the run
    directory: refuse (ConfigError, shared with every rank) the options another rank sent
    (``sent``: rank -> :func:`_options_word`) where they differ from its own.

    The same check after the process group is up
    (:func:`editrain.runtime.check_ranks_agree`) came after rank 0 had claimed the run
    directory: a node started with another ``--steps`` was refused on every rank, yet
    left ``config.toml`` and the run's record behind, so the corrected command was then
    refused too ("already holds a run"). It still runs, for ranks that reached no store."""
    from editrain.errors import ConfigError
    from editrain.runtime import refuse_other_options

    # (read back as the other ranks' are: the same JSON types on both sides)
    mine = read_json_value(_options_word(cfg), "rank 0's options", error=ConfigError)
    for rank in sorted(sent):
        if sent[rank]:
            refuse_other_options(rank, read_json_value(
                sent[rank], f"the options rank {rank} sent through torchrun's store",
                error=ConfigError), mine)


def decision_wait_s(replica: int | None) -> float:
    """How long a torchrun rank other than 0 waits for rank 0's decision: rank 0 of a
    fault-tolerant run's replica group (``replica``) may first wait for the run's lock
    (to rejoin, then to join) and for the groups torchrun may be restarting."""
    if replica is None:
        return TORCHRUN_WAIT_S
    return TORCHRUN_WAIT_S + GROUP_RESTART_WAIT_S + 2 * RUN_LOCK_WAIT_S


def resume_checkpoints(cfg: Config, replica: int | None = None) -> list[Path]:
    """The checkpoint(s) ``--resume`` names: one, or for a fault-tolerant run one per
    replica group of the launcher's (``RUN_DIR/replica{r}``), or with ``replica`` (a
    torchrun job, which is that one group) that group's alone; empty without
    ``--resume``."""
    if not cfg.resume:
        return []
    from editrain.checkpoint import resolve_resume  # imports torch: not for a fresh run
    from editrain.fault import replica_run_dir

    if cfg.dist.fault_tolerance != "torchft":
        return [resolve_resume(cfg.resume)]
    groups = [replica] if replica is not None else range(
        max(1, cfg.dist.nproc // cfg.dist.replica_size))
    return [resolve_resume(replica_run_dir(cfg.resume, r)) for r in groups]


def torchrun_group(job: Job) -> int | None:
    """The replica group a torchrun job of a fault-tolerant run is
    (:func:`editrain.fault.ft_identity`); None for any other job (the local launcher's
    ``--ft`` job holds every group).

    Raises:
        ConfigError: a fault-tolerant torchrun job that does not know its replica group.
    """
    if not (job.ft and job.under_torchrun):
        return None
    from editrain.fault import ft_identity

    return ft_identity(job.cfg, job.world)[0]


def _refuse_nothing_left(cfg: Config, replica: int | None) -> None:
    """A torchrun job's ``--resume`` with no step left (``train.steps`` not beyond the
    checkpoint's step) is refused before the run directory is claimed: the claim rewrites
    ``config.toml`` and the record, and the next plain ``--resume`` would take the refused
    job's options; the workers would then evaluate again, write the checkpoint's step
    again and append its rows to the metrics a second time. (Editrain's own launcher
    refuses it in its preflight, for every replica group of a ``--ft`` run.) Rank 0
    checks it as part of its decision, which the other ranks share
    (:meth:`RunDirClaim.join`); without torchrun's store each rank checks it on its own.

    A fault-tolerant torchrun job is one replica group (``replica``): it checks the
    checkpoint its trainer resumes, its own ``replica{r}``'s (the other groups are other
    jobs, which check theirs).

    Raises:
        CheckpointError: the first checkpoint ``--resume`` names that leaves no step.
    """
    from editrain.checkpoint import refuse_no_steps_left

    for ckpt in resume_checkpoints(cfg, replica):
        refuse_no_steps_left(ckpt, cfg)


def ended_run_problem(cfg: Config, run_dir: Path, replica: int) -> str | None:
    """Why replica group ``replica`` (a torchrun job of a fault-tolerant run) has nothing
    to rejoin in ``run_dir``, or None.

    A group trains only once it has met every other group in its first quorum (a start, a
    resume, a torchrun restart alike: :meth:`~editrain.sync.edit.SyncEngine.join`). Where
    every other group's job is over (none holds its lock) and it finished the run under
    this job's ``train.steps`` (:func:`_finished_at`), none of them can come back to meet
    it: such a group used to wait out the quorum timeout (600 s), fail, and be restarted
    by torchrun to wait again. A group with steps left, or that may yet be started again,
    is waited for as before. So is every group where this job's ``--resume`` names a
    checkpoint of its own other than its latest: that starts a new timeline, which the
    other groups may join from checkpoints of their own. Looked at when a group's job
    starts and, by one waiting in its first quorum, while it waits
    (:func:`ended_run_watch`). Call holding the run's lock.
    """
    groups = [g for g in range(_groups(cfg)) if g != replica]
    if not groups or rundir.running_groups(run_dir, but=replica):
        return None
    own = rundir.list_checkpoints(run_dir / f"replica{replica}")
    if own and any(ckpt.resolve() != own[-1].resolve()
                   for ckpt in resume_checkpoints(cfg, replica)):
        return None
    finished = rundir.finished_groups(rundir.read_record(run_dir))
    ends = {}
    for g in groups:
        end = _finished_at(cfg, run_dir, g, finished.get(g))
        if end is None:
            return None
        ends[g] = end
    last = max(step for step, _ in ends.values())
    return (f"--dist.ft_replica_id: the run in {shown(run_dir)} has ended at step {last}: replica "
            f"group(s) {', '.join(map(str, groups))} finished it (train.steps "
            f"{cfg.train.steps}; {_ends_said(ends)}) and their jobs are over, so replica "
            f"group {replica} has no group to meet in its first quorum: nothing to rejoin. "
            f"To train on, resume every group with a larger --train.steps "
            f"(--resume {shown(run_dir)})")


LOOK_LOCK_WAIT_S = 1.0
"""How long rank 0's look at the run's end (:func:`ended_run_watch`) waits for the run's
lock: it looks again at a later attempt, and the group's other ranks wait for its answer."""


def ended_run_watch(job: Job) -> Callable[[], str | None] | None:
    """What a torchrun job of a fault-tolerant run's replica group looks at while it waits
    in its first quorum (:class:`editrain.fault.RunEndWatch`): on rank 0, whether the run
    ended for its group (:func:`ended_run_problem`, under the run's lock, as at the
    group's start); on the other ranks nothing (they take rank 0's answer). None for any
    other job: only such a group waits for jobs of other groups that may all end first.

    A look that finds the run's lock held by another job (:meth:`~editrain.rundir.
    RunLock.try_acquire`: a group claiming or joining the start, one gathering the run's
    summary) says nothing this time, after :data:`LOOK_LOCK_WAIT_S`, and the group goes on
    waiting: a busy lock is no sign that the run ended. It used to wait the start's
    :data:`RUN_LOCK_WAIT_S` for it, the group's other ranks idle in the broadcast, and
    then end the group's job with the lock's refusal."""
    replica = torchrun_group(job)
    if replica is None:
        return None
    if job.rank != 0:
        return _nothing_seen

    def look() -> str | None:
        lock = rundir.RunLock(job.run_dir)
        if lock.try_acquire(wait_s=LOOK_LOCK_WAIT_S) is not None:
            return None
        with lock:
            return ended_run_problem(job.cfg, job.run_dir, replica)

    return look


def _nothing_seen() -> None:
    """The look of a rank that does not look (:func:`ended_run_watch`)."""
    return None


def _finished_at(cfg: Config, run_dir: Path, group: int, finished_steps: int | None
                 ) -> tuple[int, bool] | None:
    """Where ``group`` finished the run with no step left under this job's
    ``train.steps``, and whether its latest checkpoint says so; None where it may have
    steps left. Its latest checkpoint at the end is the evidence that outlives every
    start; a run that saves no checkpoint (or none at its last step) has its job's end,
    ``finished_steps``, noted in the run's current start
    (:func:`editrain.rundir.finished_groups`)."""
    from editrain.checkpoint import steps_left_problem

    latest = rundir.list_checkpoints(run_dir / f"replica{group}")
    if latest:
        marker = rundir.read_marker(latest[-1])
        if steps_left_problem(marker, cfg) is not None:
            return marker["step"], True
    if finished_steps is not None and finished_steps >= cfg.train.steps:
        return finished_steps, False
    return None


def _ends_said(ends: dict[int, tuple[int, bool]]) -> str:
    """The evidence of each group's end, for :func:`ended_run_problem`'s message."""
    if all(by_checkpoint for _, by_checkpoint in ends.values()):
        return "their latest checkpoints: " + ", ".join(
            f"group {g} step {step}" for g, (step, _) in ends.items())
    return "where they ended: " + ", ".join(
        f"group {g} step {step} ("
        + ("its latest checkpoint" if by_checkpoint else "its job finished the run; no "
           "checkpoint of that step") + ")" for g, (step, by_checkpoint) in ends.items())


def check_run_dir(cfg: Config, run_dir: Path, replica: int | None = None) -> rundir.Claim:
    """Whether this job may use ``run_dir`` (:func:`editrain.rundir.check`): a directory
    holding a run is refused unless this job resumes that same run or ``--overwrite`` is
    given, and ``--overwrite`` never removes what editrain did not write; the run's
    ``config.toml``, which this job replaces, must be one it can keep
    (:func:`kept_config`); a directory where replica groups of a torchrun ``--ft`` job
    still train is refused, and so is its ``--overwrite`` while one may yet come back
    (:func:`refuse_overwrite_of_awaited_groups`). Touches nothing.

    ``replica``: this job is that replica group of a fault-tolerant run, started by
    torchrun (it resumes its own group's checkpoint; its own lock is not another job's).
    Call it holding the run's lock where groups may run (:func:`editrain.rundir.running_groups`).
    """
    running = rundir.running_groups(run_dir, but=replica)
    if running:
        raise RunDirError(
            f"--run-dir: {shown(run_dir)} is in use by the torchrun job(s) of replica group(s) "
            f"{', '.join(map(str, running))} of a fault-tolerant run; wait for them to end, "
            "or choose another directory")
    checked = rundir.check(run_dir, overwrite=cfg.overwrite,
                           resume=resume_checkpoints(cfg, replica))
    if checked.replace:
        refuse_overwrite_of_awaited_groups(run_dir, checked.record, replica)
    else:
        kept_config(run_dir / CONFIG_FILE)
    return checked


def refuse_overwrite_of_awaited_groups(run_dir: Path, record: rundir.RunRecord | None,
                                       replica: int | None) -> None:
    """``--overwrite`` of a run whose current start has replica groups (torchrun jobs)
    that have not ended, hold no lock and still have their ``replica{r}/``
    (:func:`editrain.rundir.awaited_groups`; ``replica``, this job's own group, left out)
    is refused, whichever job asks (a plain job, editrain's own ``--ft`` launcher, a
    group's job): torchrun may be restarting such a group, and the overwrite would remove
    the directory it writes into. The way out for a group that will never be started
    again is the user's explicit act of moving its directory away.

    Raises:
        RunDirError: such groups, named with their directories.
    """
    awaited = rundir.awaited_groups(run_dir, record, but=replica)
    if not awaited:
        return
    dirs = ", ".join(shown(run_dir / f"replica{g}") for g in awaited)
    raise RunDirError(
        f"--overwrite: replica group(s) {', '.join(map(str, awaited))} of the run in "
        f"{shown(run_dir)} have not ended and hold no lock (torchrun may be restarting them, or "
        f"their jobs died), and --overwrite would remove what they write; start every group "
        f"of the run again together, or, for a group that will not be started again (fewer "
        f"groups now, its machine gone), move its directory out of the run directory "
        f"({dirs}): a group without one is not awaited; or choose another directory")


def prepare_run_dir(cfg: Config, run_dir: Path, lock: rundir.RunLock | None = None,
                    started_at: float | None = None,
                    replica: int | None = None,
                    torchrun_claim: str | None = None) -> rundir.RunRecord:
    """Make ``run_dir`` this job's: checked again under the directory's lock, the old run
    replaced if ``--overwrite``, a timeline abandoned by resuming an older checkpoint set
    aside, the run record and ``config.toml`` written.

    ``config.toml`` is the configuration of the run's latest job: a job that resumes the
    run writes its own over the earlier one, so that the next plain ``--resume RUN_DIR``
    (which takes the run's ``config.toml`` as its base) continues with the settings the
    run last ran with (after ``--resume RUN --nproc 1 --steps 28``, that nproc and those
    steps; before, the first job's came back). The options it changes over the file it
    replaces are kept in the job's line of the record's ``history`` (:func:`config_change`).

    Args:
        cfg: the configuration.
        run_dir: the run directory (created if missing).
        lock: the job's lock on ``run_dir``, held by the caller for the whole job; without
            one, the directory is locked while it is prepared.
        started_at: the Unix time the job's command started (:attr:`Job.started_at`),
            kept in its history line (``command_started``) for the trainer's end-to-end
            time; None: not known.
        replica: this job is that replica group of a fault-tolerant run, started by
            torchrun, and the first of the run's groups to start (see
            :meth:`RunDirClaim.join`): it sets aside only its own later checkpoints, and
            its history line lists the groups of the start and what the machine-local
            inputs hold (:func:`input_digests`), for the groups that join it.
        torchrun_claim: the token of a plain torchrun launch's attempt
            (:class:`editrain.launch.torchrun_claim.LaunchStore`), kept in its history
            line, so that torchrun's restarts of the launch tell its claim from another
            job's.

    Returns:
        The run record of this job.
    """
    own = lock is None
    lock = lock or rundir.RunLock(run_dir)
    try:
        if not lock.held:
            lock.acquire()
        checked = check_run_dir(cfg, run_dir, replica)
        text = config_text(cfg, run_dir)
        path = run_dir / CONFIG_FILE
        before = None if checked.replace else kept_config(path)  # (checked: readable)
        # The record first, with what this job changes: a job that dies between the two
        # writes leaves the old file and the line naming the changes, never neither.
        note = config_change(before, text)
        if started_at is not None:
            note[rundir.COMMAND_STARTED] = started_at
        if torchrun_claim is not None:
            note[CLAIM_TOKEN] = torchrun_claim
        if replica is not None:
            note[INPUTS] = input_digests(cfg)
            split = (checked.resume_marker or {}).get("train_data")
            if split:
                note[TRAIN_DATA] = split
        record = rundir.claim(checked, note=note, replica=replica, groups=_groups(cfg))
        if before != text.encode():
            write_atomic(path, text, root=run_dir)
        return record
    finally:
        if own:
            lock.release()


CONFIG_FILE = "config.toml"
"""The run's configuration: the latest job's (see :func:`prepare_run_dir`)."""


def _groups(cfg: Config) -> int:
    """The replica groups of a fault-tolerant run (0 for any other): ``dist.ft_replicas``,
    which a torchrun job of one group must set, else the local launcher's."""
    if cfg.dist.fault_tolerance != "torchft":
        return 0
    return cfg.dist.ft_replicas or max(1, cfg.dist.nproc // cfg.dist.replica_size)


def join_run(cfg: Config, run_dir: Path, replica: int) -> None:
    """Join replica group ``replica`` (a torchrun job of a fault-tolerant run) to the run
    the other groups train in ``run_dir``: it must run their configuration
    (:func:`refuse_other_options`) on inputs that hold what theirs hold
    (:func:`refuse_other_inputs`), and the directory is checked as a claim checks it
    (:func:`editrain.rundir.check`: a checkpoint resumed must be this run's, no link where
    the group writes); then the group joins the run's current start
    (:func:`editrain.rundir.join_start`), writing none of the run's files. Call holding the
    run's lock.

    Raises:
        RunDirError: any of these refused.
    """
    refuse_other_options(cfg, run_dir)
    checked = rundir.check(run_dir, overwrite=False, resume=resume_checkpoints(cfg, replica),
                           join=True)
    refuse_other_inputs(cfg, run_dir, checked)
    rundir.join_start(checked, replica)


INPUTS = "ft_inputs"
"""The key of a torchrun ``--ft`` start's history line holding what its first group's
model and tokenizer paths hold (:func:`input_digests`), for the groups that join it
(:func:`refuse_other_inputs`)."""


def input_digests(cfg: Config) -> dict[str, str | None]:
    """What the options naming a model's or tokenizer's files hold, by option
    (:func:`editrain.runtime.input_digest`): their paths may differ between the machines of
    a fault-tolerant run's groups (each machine's own hub cache, say), as between the
    nodes of one job, what they hold may not."""
    from editrain.config import to_dict
    from editrain.runtime import NODE_PATH_OPTIONS, input_digest

    flat = _options(to_dict(cfg))
    return {name: input_digest(flat.get(name)) for name in NODE_PATH_OPTIONS}


def refuse_other_inputs(cfg: Config, run_dir: Path, checked: rundir.Claim) -> None:
    """A group joining the run's start must build its model from files that hold what the
    first group's did (:func:`input_digests`, kept in the start's history line), and a
    group that resumes must resume a checkpoint of the same train split as the first
    group's (the checkpoints' ``train_data``; each group's own resume checks its split
    against its checkpoint's, so every group then reads the same token stream, whatever
    ``data.path`` is on its machine).

    Raises:
        RunDirError: an input that differs, named with both paths (or both splits).
    """
    start = rundir.current_start(checked.record) or {}
    theirs = start.get(INPUTS)
    if isinstance(theirs, dict):
        from editrain.config import to_dict

        flat = _options(to_dict(cfg))
        for name, digest in input_digests(cfg).items():
            if name in theirs and theirs[name] != digest:
                raise RunDirError(
                    f"--run-dir: this group's {name} ({shown(str(flat.get(name)))}) holds other "
                    f"files than the first group's of the run in {shown(run_dir)}; its path may "
                    "differ between machines, what it holds may not")
    split = start.get(TRAIN_DATA)
    mine = (checked.resume_marker or {}).get("train_data")
    if isinstance(split, dict) and isinstance(mine, dict) and split != mine:
        raise RunDirError(
            f"--resume: {shown(checked.resume[0])} was trained on another train split "
            f"({mine.get('tokens')} tokens) than the checkpoint the first group of the run "
            f"in {shown(run_dir)} resumed ({split.get('tokens')} tokens; another data.path, "
            "data.tokenizer or split setting): every group must read the same token stream")


TRAIN_DATA = "ft_train_data"
"""The key of a torchrun ``--ft`` start's history line holding the train split
(``train_data`` of its marker) of the checkpoint the first group resumed."""


def config_text(cfg: Config, run_dir: Path) -> str:
    """The ``config.toml`` of a job: its configuration resolved, less what the method or
    mode does not use (a method's resolved sync interval under ``sync``, say), since the
    file must load back as the run's configuration and the loader refuses an option set
    where it does nothing."""
    data = drop_inapplicable(to_dict(resolved(cfg)))
    # The job's own flags are not the run's configuration: `--config RUN/config.toml
    # --run-dir NEW` must start a run, not resume this one's checkpoint or overwrite.
    data.update(run_dir=str(run_dir), resume=None, overwrite=False)
    # Nor is the replica group a torchrun job of a fault-tolerant run is: every group's
    # job shares the run's file.
    data.get("dist", {}).pop("ft_replica_id", None)
    return dumps_toml(data)


GROUP_OPTIONS = {
    "dist.ft_replica_id": "which replica group the job is",
    "dist.ft_lighthouse": "how the job's machine reaches the lighthouse",
    "dist.nproc": "ignored under torchrun (the groups' count is dist.ft_replicas)",
    "dist.threads_per_proc": "the job's machine's cores",
    "data.cache_dir": "the token cache of the job's machine",
    "data.path": "a path on the job's machine (the train split a checkpoint resumed was "
                 "trained on is compared: refuse_other_inputs)",
    "data.tokenizer": "a path on the job's machine (what it holds is compared)",
    "model.hf_config": "a path on the job's machine (what it holds is compared)",
    "model.init_from": "a path on the job's machine (what it holds is compared)",
}
"""Options that may differ between the torchrun jobs of one fault-tolerant run's replica
groups (why, by option); every other option must be the run's
(:func:`refuse_other_options`)."""


def refuse_other_options(cfg: Config, run_dir: Path) -> None:
    """A torchrun job of a fault-tolerant run's replica group that joins the groups
    training there (which wrote the run's ``config.toml``) must run their configuration:
    the same options, apart from :data:`GROUP_OPTIONS`.

    Raises:
        RunDirError: the run has no readable ``config.toml``, or this job sets an option
            otherwise than the run (named, with both values).
    """
    run = kept_config(run_dir / CONFIG_FILE)
    if run is None:
        raise RunDirError(f"--run-dir: {shown(run_dir)} has no {CONFIG_FILE}, though replica groups "
                          "of a fault-tolerant run train there; start this group once they "
                          "have ended, or in another directory")
    try:
        theirs = _options(read_toml_value(run.decode("utf-8", "replace"), CONFIG_FILE,
                                          error=ValueError))
    except ValueError as e:
        raise RunDirError(f"--run-dir: {shown(run_dir / CONFIG_FILE)} cannot be read as the "
                          f"run's configuration ({e})") from None
    ours = _options(read_toml_value(config_text(cfg, run_dir), CONFIG_FILE, error=ValueError))
    differ = [name for name in sorted(theirs.keys() | ours.keys())
              if name not in GROUP_OPTIONS and theirs.get(name) != ours.get(name)]
    if differ:
        said = "; ".join(f"{name}: this group {_shown(ours.get(name))}, the run "
                         f"{_shown(theirs.get(name))}" for name in differ)
        raise RunDirError(
            f"--run-dir: {shown(run_dir)} holds a fault-tolerant run whose replica groups train "
            f"there with other options than this group's ({said}); start every group with "
            f"the run's options (only {', '.join(GROUP_OPTIONS)} may differ)")


def kept_config(path: Path) -> bytes | None:
    """The run's ``config.toml`` as it is before this job replaces it (None: there is none).

    Raises:
        RunDirError: it cannot be read (not a regular file, larger than editrain writes):
            replacing it would lose it, with nothing of it (its options, or its text) in
            the run record.
    """
    if not os.path.lexists(path):
        return None
    try:
        return read_bytes(path, RUN_CONFIG_MAX_BYTES, error=RunDirError,
                          what="run's configuration")
    except RunDirError as e:
        raise RunDirError(f"--resume: {e}; it would be replaced by this job's configuration "
                          "and cannot be kept in the run record: move it away first") from None


def config_change(before: bytes | None, text: str) -> dict[str, Any]:
    """What a job's history line keeps of the ``config.toml`` it replaces:
    ``config_changed``, each option whose value this job changed, ``"OLD -> NEW"`` with
    both values in TOML (``unset`` where one side has none). Empty when there is nothing to
    replace or no option changed.

    The old file's text is not kept: it is about 4 KB, and the record grew by that on every
    resume that changed an option (``config_before``, as records of an older editrain still
    hold). Nothing is lost by leaving it out: the run's ``config.toml`` is the latest job's,
    and each history line's changes, read from the last line back, give every earlier
    job's options (the job's own flags, its run directory and ``--resume``, are not the
    run's configuration and are not compared). Only a file that is not TOML (not one
    editrain wrote) is kept as text, ``config_before``: its options cannot be compared, so
    its text is the one record of them (at most :data:`RUN_CONFIG_MAX_BYTES`, and once:
    the job writes a file of its own)."""
    if before is None or before == text.encode():
        return {}
    old_text = before.decode("utf-8", "replace")
    try:
        old = read_toml_value(old_text, CONFIG_FILE, error=ValueError)
    except ValueError:
        return {"config_before": old_text}  # a file editrain did not write: not compared
    new = read_toml_value(text, CONFIG_FILE, error=ValueError)
    a, b = _options(old), _options(new)
    changed = {name: f"{_shown(a.get(name))} -> {_shown(b.get(name))}"
               for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name)}
    return {"config_changed": changed} if changed else {}


def _options(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every option of a configuration's sections by its dotted name (the job's own flags,
    its run directory and ``--resume``, are not the run's configuration)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not prefix and key not in SECTIONS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_options(value, name + "."))
        else:
            out[name] = value
    return out


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    try:
        return toml_value(value)
    except TypeError:  # a TOML date of a file editrain did not write
        return str(value)


class RunDirClaim:
    """A job's hold on its run directory, from the check to the end of the job (a context
    manager: the directory's lock, if taken, is released on the way out).

    A local launch takes the lock at once when editrain has used the directory before
    (so a second job on it is refused before any work), checks it (:meth:`check`), and
    claims it once its inputs are known usable (:meth:`claim`). Under torchrun the
    ranks :meth:`join` it; a torchrun job of a fault-tolerant run's replica group holds
    only its group's lock for the job (see :meth:`join`).

    Args:
        job: the checked job.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.lock = rundir.RunLock(job.run_dir)

    def __enter__(self) -> RunDirClaim:
        if not self.job.under_torchrun and (self.job.run_dir / rundir.LOCK).exists():
            self.lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()

    def check(self) -> None:
        """Refuse the directory unless this job may use it (:func:`check_run_dir`);
        nothing is written."""
        check_run_dir(self.job.cfg, self.job.run_dir)

    def claim(self, torchrun_claim: str | None = None) -> rundir.RunRecord:
        """Make the directory this job's (:func:`prepare_run_dir`, under the lock;
        ``torchrun_claim``: the token of a torchrun launch's attempt)."""
        return prepare_run_dir(self.job.cfg, self.job.run_dir, self.lock,
                               self.job.started_at, torchrun_claim=torchrun_claim)

    def join(self) -> bool | None:
        """Under torchrun: rank 0 decides about the run directory for the attempt
        (:meth:`_decide_as_rank0`) and tells the other ranks through torchrun's store;
        they wait for its word (:meth:`_await_rank0`) before they act, and share its
        refusal. A fault-tolerant run's replica group is a job of its own
        (:meth:`_join_run`).

        Returns:
            Whether this attempt goes on with its launch's run (rank 0's
            :data:`~editrain.launch.torchrun_claim.REJOINED`: the trainer resumes the run's
            latest checkpoint) or made a new claim (False: ``--resume`` only), the same on
            every rank; None without torchrun's store, where the other ranks cannot have
            rank 0's decision and every rank goes by its restart count, as before
            (:class:`editrain.train.Trainer`).
        """
        launch = LaunchStore.connect()
        if self.job.rank == 0:
            decision = self._decide_as_rank0(launch)
        else:
            decision = self._await_rank0(launch)
        return None if launch.store is None else decision == REJOINED

    def _decide_as_rank0(self, launch: LaunchStore) -> str:
        """Rank 0: check and claim the directory (:meth:`_claim_as_rank0`), or for a
        replica group join the run (:meth:`_join_run`), and publish the outcome for the
        attempt's other ranks: went on, or the refusal (raised here too). Returns the
        decision."""
        job = self.job
        replica = torchrun_group(job)
        launch.open_attempt(readers=job.world - 1)
        try:
            _refuse_other_options(job.cfg, launch.options_sent(readers=job.world - 1))
            decision = (self._claim_as_rank0(launch) if replica is None
                        else self._join_run(replica, launch))
        except Exception as e:
            launch.refuse(e, readers=job.world - 1)
            raise
        launch.decide(decision, readers=job.world - 1)
        return decision

    def _await_rank0(self, launch: LaunchStore) -> str | None:
        """A rank other than 0: wait for rank 0's decision for this attempt (returned), and
        raise its refusal. The run directory holds a run already when it is another run,
        this launch's own (a restart), or one rank 0 is about to replace (``--overwrite``):
        the rank must not go on while rank 0 may still refuse it, set a timeline aside
        or remove the old run.

        Without torchrun's store (:meth:`LaunchStore.connect`) the rank waits, as it did
        before, only for rank 0's ``config.toml`` (rank 0 writes it last), having checked
        its own ``--resume`` for a step left; None: no decision."""
        job = self.job
        replica = torchrun_group(job)
        if launch.store is not None:
            return launch.decision(job.rank, decision_wait_s(replica), job.run_dir,
                                   options=_options_word(job.cfg))
        if job.restart == 0:  # before rank 0 writes anything
            _refuse_nothing_left(job.cfg, replica)
        deadline = time.monotonic() + TORCHRUN_WAIT_S
        while not (job.run_dir / CONFIG_FILE).exists():
            if time.monotonic() > deadline:
                raise RunDirError(
                    f"--run-dir: rank {job.rank} saw no config.toml from rank 0 in "
                    f"{shown(job.run_dir)} within {TORCHRUN_WAIT_S} s: the run directory must "
                    f"be on storage every node sees, at the same path")
            time.sleep(0.1)
        return None

    def _claim_as_rank0(self, launch: LaunchStore) -> str:
        """Rank 0 of a plain torchrun job: checks and claims the directory, unless
        torchrun restarted the workers of the launch whose claim the directory holds
        (:meth:`_restarted_own_run`), which go on with it as it is. A restart of a refused
        attempt is checked again, as the first attempt was: it used to take the record
        of the run it was refused for as its own launch's and train into that run.

        Returns:
            The decision (:data:`~editrain.launch.torchrun_claim.CLAIMED` or
            :data:`~editrain.launch.torchrun_claim.REJOINED`).
        """
        job = self.job
        if self._is_restart(launch):
            self.lock.acquire()
            if self._restarted_own_run(launch):
                return REJOINED
        token = launch.mark(job.run_dir)  # before the checks: a refusal leaves it unclaimed
        _refuse_nothing_left(job.cfg, None)
        if not self.lock.held:
            self.lock.acquire()
        self.claim(token)
        return CLAIMED

    def _is_restart(self, launch: LaunchStore) -> bool:
        """Whether this attempt is a restart of its launch: torch elastic counted it
        (``TORCHELASTIC_RESTART_COUNT`` above 0), or an earlier attempt of this launch put
        its token for the run directory in torchrun's store. torch elastic does not count
        a restart caused by a change of the nodes taking part (a node joined, or another
        node's workers failed while this node's were healthy): the count is 0 again, and
        the token alone tells it. Such an attempt used to be refused (a failure torch
        elastic counts, spending one of ``--max-restarts``), as a rejoin at count 0 would
        have resumed on some ranks only; every rank now resumes by rank 0's decision
        (:meth:`join`), so it rejoins its launch's run as a counted restart does. Checked
        as a first attempt, it would be refused as another run, or with ``--overwrite``
        remove its own launch's run, checkpoints and all. Without a store (or a first
        attempt) the count alone decides, as before."""
        return self.job.restart > 0 or launch.latest(self.job.run_dir) is not None

    def _restarted_own_run(self, launch: LaunchStore) -> bool:
        """Whether the run directory's latest claim is this launch's
        (:func:`editrain.launch.torchrun_claim.own_claim`: its token in torchrun's store
        and in the record). Where that cannot be told (no store, or a store that holds no
        token of the launch), a claim of a torchrun launch is taken as this one's, said
        in a warning: checking it again would refuse this launch's own run, or with
        ``--overwrite`` remove it."""
        job = self.job
        recorded = recorded_token(rundir.read_record(job.run_dir))
        return self._own(launch, recorded, f"the run in {job.run_dir}")

    def _own(self, launch: LaunchStore, recorded: str | None, what: str) -> bool:
        """Whether ``recorded`` (the record's token of the claim a restart would go on
        with) is this launch's (:func:`editrain.launch.torchrun_claim.own_claim`); where
        that cannot be told, True, with a warning naming ``what``."""
        job = self.job
        own = own_claim(launch.latest(job.run_dir), recorded)
        if own is None:
            log.warning("torchrun restart %d: %s is taken as this launch's without a "
                        "check: its record holds a torchrun launch's claim, and %s",
                        job.restart, what, launch.why_not or
                        "torchrun's store holds no token of this launch to compare it with")
        return own is not False

    def _join_run(self, replica: int, launch: LaunchStore) -> str:
        """Rank 0 of a torchrun job of a fault-tolerant run's replica group ``replica``:
        the groups' jobs share the run directory, each owning its ``replica{r}/``.

        The group holds its own lock for the job (a second job as the same group is
        refused). The groups of one start of the run claim it once
        (:func:`editrain.rundir.current_start`): under the run's lock, a moment, the first
        group claims the run directory as a local job does (record, ``config.toml``), and
        a group that starts while others train joins their start (:func:`join_run`),
        writing none of the run's files. A group that torchrun restarts, counted or not
        (:meth:`_is_restart`), rejoins the start as it left it when it takes part in it,
        has not ended and was joined by this launch (:meth:`_rejoin`); a restarted job of
        any other group (its first job was refused, or its start is over) is checked as a
        new one is. While a group of the current start holds no lock and has not ended,
        torchrun may be restarting it: a new group's job waits for it (up to
        :data:`GROUP_RESTART_WAIT_S`) and joins the start once it is back, rather than
        claiming the run anew under a group that still trains.

        Returns:
            The decision (:data:`~editrain.launch.torchrun_claim.CLAIMED`: claimed or
            joined; :data:`~editrain.launch.torchrun_claim.REJOINED`).
        """
        job = self.job
        self.lock = rundir.RunLock(job.run_dir, replica)
        if self._is_restart(launch) and self._rejoin(replica, launch):
            return REJOINED
        # A first job, or not a restart of this launch's group in the run's start (its
        # first job was refused, torchrun restarts a refused job too; or its start is
        # over): checked as a first job is. Its token is in the store before the checks:
        # a refusal leaves one that no start holds.
        token = launch.mark(job.run_dir)
        _refuse_nothing_left(job.cfg, replica)
        deadline = time.monotonic() + GROUP_RESTART_WAIT_S
        waited = False
        while not self._start_or_join(replica, time.monotonic() > deadline, token):
            if not waited and not job.cfg.quiet:
                log.warning("replica group %d: waiting up to %d s for the other groups of "
                            "the run in %s, whose jobs have not ended and hold no lock "
                            "(torchrun may be restarting them; a group that will not be "
                            "started again is not awaited once its replica{r}/ is moved out "
                            "of the run directory)", replica, GROUP_RESTART_WAIT_S,
                            job.run_dir)
            waited = True
            time.sleep(GROUP_POLL_S)
        return CLAIMED

    def _rejoin(self, replica: int, launch: LaunchStore) -> bool:
        """A job of group ``replica`` that torchrun restarted: when the group takes part
        in the run's current start and has not ended (:func:`editrain.rundir.in_current_start`),
        and this launch's rank 0 claimed or joined the start as the group (its token in
        torchrun's store and in the start's line: :func:`group_token`), the run is as the
        group left it and the job rejoins the start unchecked (True, holding the group's
        lock); otherwise False. A launch refused before it joined (a refusal before
        its group's earlier job was noted over: the wait for the run's lock, a
        ``--resume`` with no step left) used to rejoin the start of the group's earlier
        job, unchecked, when torchrun restarted it. Where the store cannot tell, the
        job rejoins, with a warning (:meth:`_own`)."""
        job = self.job
        with rundir.RunLock(job.run_dir).acquire(wait_s=RUN_LOCK_WAIT_S):
            record = rundir.read_record(job.run_dir)
            if not (rundir.in_current_start(record, replica) and self._own(
                    launch, group_token(record, replica),
                    f"replica group {replica}'s place in the start of the run in "
                    f"{job.run_dir}")):
                return False
            if ended_run_problem(job.cfg, job.run_dir, replica):
                return False  # checked as a new job, and refused (_start_or_join)
            self.lock.acquire()
            return True

    def _start_or_join(self, replica: int, waited_enough: bool, token: str) -> bool:
        """One look under the run's lock (see :meth:`_join_run`): join the start the
        other groups train in, or claim the run when none of the current start's groups
        can come back (or ``waited_enough``), keeping this launch's ``token`` for the
        group in the start's line (:func:`note_group_claim`); False (this group's lock
        released again) to wait for them."""
        job = self.job
        with rundir.RunLock(job.run_dir).acquire(wait_s=RUN_LOCK_WAIT_S) as run_lock:
            self.lock.acquire()  # refused if another job is this group
            # This group's earlier job in the start is over (this one holds the group's
            # lock): noted before the checks below, so that if they refuse this job,
            # torchrun's restart of it is checked again instead of rejoining the start
            # unchecked as a member that has not ended (_rejoin). A job that passes joins
            # or claims the start as a member again.
            rundir.note_group(job.run_dir, replica, ended=True)
            ended = ended_run_problem(job.cfg, job.run_dir, replica)
            if ended:
                raise RunDirError(ended)
            if rundir.running_groups(job.run_dir, but=replica):
                join_run(job.cfg, job.run_dir, replica)
                note_group_claim(job.run_dir, replica, token)
                return True
            awaited = rundir.awaited_groups(job.run_dir, rundir.read_record(job.run_dir),
                                            but=replica)
            if waited_enough or not awaited:
                # Setting a timeline aside moves nothing of theirs; --overwrite, which
                # would remove what a group that is slow to restart still writes, is
                # refused by the check (refuse_overwrite_of_awaited_groups).
                prepare_run_dir(job.cfg, job.run_dir, run_lock, job.started_at, replica)
                note_group_claim(job.run_dir, replica, token)
                return True
            self.lock.release()
            return False
