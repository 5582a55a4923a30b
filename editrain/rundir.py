"""A run directory belongs to one run: its identity, its timeline, its lock, what it owns.

``RUN_DIR/editrain-run.json`` (the *run record*, written by the launcher before any worker
starts) holds:

* ``run_id``: one training run, kept across resumes (also when a run is resumed into
  another directory);
* ``branch``: the timeline the current job writes. A new run starts one; resuming from an
  older checkpoint than the run's newest starts another, whose parent is the checkpoint
  resumed from. Every checkpoint's marker carries ``run_id`` and ``branch``, and rotation
  only ever deletes checkpoints of the current branch (see :mod:`editrain.checkpoint`);
* ``resumed_from``: the checkpoint(s) the current job started from (one per replica group
  in the fault-tolerant mode; never rotated away by it);
* ``owned``: the entries of the directory editrain created, so ``--overwrite`` removes
  those and nothing else;
* ``history``: one line per job (branch, start, when its command started, what it resumed
  from, what it set aside, and the ``config.toml`` it replaced: each job writes its own,
  see :func:`editrain.launch.run_dir.prepare_run_dir`).

When a job resumes from an older checkpoint, the newer checkpoints of the abandoned
timeline are moved to ``checkpoints/abandoned/<branch>/``: kept, never rotated, never
picked by ``--resume RUN_DIR`` (which takes the newest checkpoint of ``checkpoints/``).

``RUN_DIR/.editrain.lock`` is held (``flock``) by the job's launcher for the whole job: a
second job on the same directory is refused. The kernel releases the lock when its holder
exits in any way (``kill -9`` included), so a stale lock file from a dead process is
detected by simply taking the lock. (``flock`` on network file systems may be local to a
node; a multi-node job takes it on the node of rank 0.) The replica groups of a
fault-tolerant run started as torchrun jobs of their own share the run directory: each
holds its group's lock (:func:`group_lock_name`) for the job, and the run's lock only a
moment, to write the run's files (see :meth:`editrain.launch.run_dir.RunDirClaim.join`).
The groups started together are one *start* of the run, claimed once (its history line
lists them: :func:`current_start`); each group's checkpoints and timeline are its own
(:func:`join_start`).

``RUN_DIR/logs`` (:func:`logs_dir`; per replica group of a fault-tolerant run
``RUN_DIR/replica{r}/logs``) holds the workers' tracebacks and torch elastic's own log.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from editrain.argv import env_int
from editrain.errors import CheckpointError, RunDirError
from editrain.paths import shown
from editrain.safe_io import (
    Int,
    List,
    Num,
    Obj,
    Str,
    check_no_links,
    cut_partial_line,
    make_dir,
    open_write,
    read_json,
    write_atomic,
)
from editrain.tracking import RUN_ID_FILE

log = logging.getLogger("editrain")

RECORD = "editrain-run.json"
LOCK = ".editrain.lock"
CKPT_DIR = "checkpoints"
ABANDONED = "abandoned"
MARKER = "editrain.json"

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "loss_vs_tokens.png",
             "loss_vs_time.png", "ranks", "tb", "checkpoints", "logs", ".link", "wandb",
             "tokenizer", "export", RUN_ID_FILE)
"""Entries of a run directory that editrain writes (besides ``replica{r}/`` of a
fault-tolerant run, the record and the lock)."""


def _is_replica_dir(name: str) -> bool:
    return name.startswith("replica") and name[len("replica"):].isdigit()


def group_index(path: str | Path) -> int | None:
    """``r`` for a fault-tolerant run's replica group directory ``replica{r}`` (one holding
    checkpoints or metrics), else None."""
    p = Path(path)
    if not _is_replica_dir(p.name) or not any(
            (p / n).exists() for n in (CKPT_DIR, "metrics.jsonl")):
        return None
    return int(p.name[len("replica"):])


def replica_groups(run_dir: str | Path) -> list[Path]:
    """The replica groups' directories of a fault-tolerant run (``RUN_DIR/replica{r}/``, each
    a run directory of its own), in group order; empty for any other directory."""
    p = Path(run_dir)
    if not p.is_dir():
        return []
    found = [c for c in p.iterdir() if _is_replica_dir(c.name) and c.is_dir()]
    return sorted(found, key=lambda c: int(c.name[len("replica"):]))


def run_entries(run_dir: Path) -> list[str]:
    """The editrain entries present in ``run_dir`` (what makes it hold a run)."""
    if not run_dir.is_dir():
        return []
    names = [n for n in RUN_FILES if os.path.lexists(run_dir / n)]
    names += sorted(p.name for p in run_dir.iterdir() if _is_replica_dir(p.name))
    return names


# ---------------------------------------------------------------------------- the record
@dataclass
class RunRecord:
    """What ``editrain-run.json`` holds (see the module docstring)."""

    run_id: str
    branch: str
    resumed_from: list[str] = field(default_factory=list)
    owned: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)

    def lineage(self) -> dict[str, Any]:
        """What a checkpoint of the current job carries and its rotation needs."""
        return {"run_id": self.run_id, "branch": self.branch,
                "resumed_from": self.resumed_from}


def resumed_run_dir(resume: str | Path) -> Path | None:
    """The run directory a ``--resume`` path names: the run of a checkpoint in its
    ``checkpoints/``, or the path itself when it is a run directory (it has checkpoints or
    a run record); None otherwise."""
    p = Path(resume)
    if (p / MARKER).is_file() and p.parent.name == CKPT_DIR:
        return p.parent.parent
    if (p / CKPT_DIR).is_dir() or (p / RECORD).is_file():
        return p
    return None


def new_id() -> str:
    """A fresh run or branch identifier."""
    return uuid.uuid4().hex[:16]


RECORD_MAX_BYTES = 16 << 20
"""The largest run record read (a job adds a line of a few hundred bytes to its history)."""
_ID = Str(64)
RECORD_SCHEMA = Obj({
    "run_id": _ID, "branch": _ID,
    "resumed_from": List(Str(), 4096, nullable=True),
    "owned": List(Str(255), 4096),
    "history": List(Obj(), 1 << 16),
}, required=("run_id", "branch"))
"""What ``editrain-run.json`` must be (:func:`editrain.safe_io.read_json`)."""


def read_record(run_dir: str | Path) -> RunRecord | None:
    """The run record of ``run_dir``, or None if it has none (a new directory, or a run of
    an editrain older than the record)."""
    path = Path(run_dir) / RECORD
    if not os.path.lexists(path):
        return None
    try:
        data = read_json(path, max_bytes=RECORD_MAX_BYTES, schema=RECORD_SCHEMA,
                         error=RunDirError, what="run record")
    except RunDirError as e:
        raise RunDirError(f"--run-dir: {e}; it is editrain's record of the run in that "
                          "directory: restore it, or choose another directory") from None
    return RunRecord(run_id=data["run_id"], branch=data["branch"],
                     resumed_from=list(data.get("resumed_from") or []),
                     owned=list(data.get("owned", [])), history=list(data.get("history", [])))


def write_record(run_dir: Path, record: RunRecord) -> None:
    """Write the record atomically (temporary file, fsync, rename; no link followed)."""
    write_atomic(run_dir / RECORD, json.dumps(asdict(record), indent=1), root=run_dir)


def record_of(run_dir: str | Path) -> RunRecord | None:
    """The run record that governs ``run_dir``: its own, or for a fault-tolerant replica
    group's ``RUN_DIR/replica{r}`` its parent's; None without one."""
    p = Path(run_dir)
    for d in (p, p.parent) if _is_replica_dir(p.name) else (p,):
        record = read_record(d)
        if record is not None:
            return record
    return None


def lineage_of(run_dir: str | Path) -> dict[str, Any] | None:
    """The current job's lineage for a worker whose run directory is ``run_dir`` (a
    fault-tolerant replica group's ``RUN_DIR/replica{r}`` reads its parent's record)."""
    record = record_of(run_dir)
    return record.lineage() if record is not None else None


COMMAND_STARTED = "command_started"
"""The key of a job's history line holding the Unix time its ``editrain train`` command
started (the trainer's ``done:`` line counts the job's end-to-end time from it)."""


def command_started(run_dir: str | Path) -> float | None:
    """The Unix time the current job's command started (:data:`COMMAND_STARTED` of the
    record's last history line), or None where it is not known (a library call, a run
    without a record)."""
    record = record_of(run_dir)
    started = record.history[-1].get(COMMAND_STARTED) if record and record.history else None
    return float(started) if isinstance(started, int | float) and not isinstance(
        started, bool) else None


# ---------------------------------------------------------------------------- the lock
def group_lock_name(replica: int) -> str:
    """The lock file of replica group ``replica`` of a fault-tolerant run whose groups are
    jobs of their own (torchrun): ``RUN_DIR/.editrain.replica{r}.lock``. It lies beside the
    run's lock rather than in ``replica{r}/``: taking it must not make the directory look
    like it holds a run before the group has checked the directory."""
    return f".editrain.replica{replica}.lock"


_GROUP_LOCK = re.compile(r"\.editrain\.replica(\d+)\.lock")


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.editrain.lock`` for the life of a job, or with
    ``replica``, on replica group ``replica``'s own lock (:func:`group_lock_name`): the
    lock of one torchrun job of a fault-tolerant run, which shares the run directory
    with the other groups' jobs and owns only its ``replica{r}/``.

    Args:
        run_dir: the run directory (created if missing).
        replica: the replica group whose lock this is (None: the run's).
    """

    def __init__(self, run_dir: str | Path, replica: int | None = None) -> None:
        self.path = Path(run_dir) / (LOCK if replica is None else group_lock_name(replica))
        self.replica = replica
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self, wait_s: float = 0.0) -> RunLock:
        """Take the lock (creating the directory and the lock file if needed) or raise
        :class:`RunDirError` naming the job that holds it.

        Args:
            wait_s: how long to wait for a holder to let go (0: refused at once). The
                replica groups of a torchrun ``--ft`` run take the run's lock in turn, a
                moment each, to write the run's shared files.
        """
        holder = self.try_acquire(wait_s)
        if holder is not None:
            raise RunDirError(self._refusal(holder))
        return self

    def try_acquire(self, wait_s: float = 0.0) -> str | None:
        """Take the lock as :meth:`acquire` does, but where another job holds it for all of
        ``wait_s`` return what that job wrote in it (its pid and host) instead of raising:
        a caller that can try again later tells that moment's state from a lock that
        cannot be taken at all (a link, not a regular file), which still raises.

        Returns:
            None once this object holds the lock, else the holder.
        """
        import fcntl

        make_dir(self.path.parent, root=self.path.parent)  # the run directory: may be a link
        check_no_links(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                         0o644)
        except OSError as e:
            raise RunDirError(f"--run-dir: cannot open the lock {shown(self.path)} ({e.strerror}; "
                              "editrain never follows a link there)") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunDirError(f"--run-dir: {shown(self.path)} is not a regular file; it is "
                              "editrain's lock of the run directory (move it away)")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
                os.close(fd)
                return holder
        os.set_inheritable(fd, False)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return None

    def _refusal(self, holder: str) -> str:
        run_dir = self.path.parent
        if self.replica is None:
            return (f"--run-dir: {shown(run_dir)} is in use by another editrain job ({holder}); "
                    "wait for it to end or choose another directory")
        return (f"--dist.ft_replica_id: replica group {self.replica} of {shown(run_dir)} is in "
                f"use by another editrain job ({holder}); wait for it to end, or start this job "
                "as another replica group")

    def release(self) -> None:
        """Give the lock back (the file stays: removing it would race with a new holder)."""
        if self._fd is not None:
            import fcntl

            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def running_groups(run_dir: str | Path, but: int | None = None) -> list[int]:
    """The replica groups of a fault-tolerant run whose torchrun jobs hold their locks
    (:func:`group_lock_name`) in ``run_dir`` now, ``but`` left out (this job's own).

    Look only while holding the run's lock: every group takes its own under it, so a look
    (which takes each free lock for a moment) never makes a starting group's fail.
    """
    import fcntl

    p = Path(run_dir)
    if not p.is_dir():
        return []
    found = []
    for entry in sorted(p.iterdir()):
        match = _GROUP_LOCK.fullmatch(entry.name)
        if match is None or int(match.group(1)) == but or _kind(entry) != "file":
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            found.append(int(match.group(1)))
        finally:
            os.close(fd)
    return sorted(found)


# ---------------------------------------------------------------------------- ownership
_STEP = re.compile(r"step_\d+(\.tmp|\.old|\.\d+)?")
_CKPT_FILE = re.compile(r"(\.metadata|[^/]+\.distcp|rank_\d+\.json|editrain\.json)(\.tmp)?")
_LOG_FILE = re.compile(r"rank\d+\.(log|error\.json)|launcher\.log")
_FILES_IN = {
    "ranks": re.compile(r"rank\d+\.jsonl"),
    "tb": re.compile(r"events\.out\.tfevents\..+"),
    ".link": re.compile(r"[^/]+\.state"),
    "logs": _LOG_FILE,
    # the run's tokenizer files and checkpoint.export_final's Hugging Face directory
    # (editrain.hf_checkpoint: RUN_TOKENIZER_DIR, export_checkpoint), with the leftovers
    # of their atomic writes
    "tokenizer": re.compile(r"(tokenizer\.json|tokenizer_config\.json|"
                            r"special_tokens_map\.json|generation_config\.json|"
                            r"model_token_ids\.json)(\.tmp)?"),
    "export": re.compile(r"(config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                         r"model\.safetensors\.index\.json|tokenizer\.json|"
                         r"tokenizer_config\.json|special_tokens_map\.json|generation_config\.json|"
                         r"README\.md|"
                         r"editrain_export\.json)(\.partial)?(\.tmp)?"),
}
"""Directories of a run that hold only files editrain writes, and those files' names."""
_WALK_LIMIT = 1 << 16
"""Most entries :func:`foreign_entry` looks at in one directory tree."""


def _kind(path: Path) -> str:
    """``"link"``, ``"dir"``, ``"file"`` (regular) or ``"other"``, without following a link."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "other"
    if stat.S_ISLNK(mode):
        return "link"
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _children(path: Path) -> list[Path]:
    children = sorted(path.iterdir())
    if len(children) > _WALK_LIMIT:
        raise RunDirError(f"--overwrite: {shown(path)} holds {len(children)} entries, more than "
                          "editrain writes there; move it away first")
    return children


def _foreign_in_checkpoint_dir(path: Path, depth: int = 0) -> Path | None:
    """The first entry of ``checkpoints/`` (or of its ``abandoned/<branch>/``) that is not a
    checkpoint directory of regular DCP, rank and marker files."""
    for p in _children(path):
        kind = _kind(p)
        if depth == 0 and p.name == ABANDONED and kind == "dir":
            for branch in _children(p):
                found = (_foreign_in_checkpoint_dir(branch, 1) if _kind(branch) == "dir"
                         else branch)
                if found is not None:
                    return found
            continue
        if kind != "dir" or not _STEP.fullmatch(p.name):
            return p
        for f in _children(p):
            if _kind(f) != "file" or not _CKPT_FILE.fullmatch(f.name):
                return f
    return None


def foreign_entry(path: Path) -> Path | None:
    """The first thing inside the run entry ``path`` that editrain would not have written
    there (a link anywhere, a file of a name editrain does not write, a directory where it
    writes none), or None when ``path`` holds only editrain's own files.

    ``wandb/`` is W&B's: only its own entry is checked (not a link).
    """
    name, kind = path.name, _kind(path)
    if kind == "link" or kind == "other":
        return path
    if kind == "file":
        return None if name in RUN_FILES and name not in _FILES_IN and name != CKPT_DIR \
            else path
    if name == "wandb":
        return None
    if name == CKPT_DIR:
        return _foreign_in_checkpoint_dir(path)
    if name in _FILES_IN:
        pattern = _FILES_IN[name]
        return next((p for p in _children(path)
                     if _kind(p) != "file" or not pattern.fullmatch(p.name)), None)
    if _is_replica_dir(name):
        for p in _children(path):
            found = foreign_entry(p) if p.name in RUN_FILES else p
            if found is not None:
                return found
        return None
    return path


def first_link(path: Path) -> Path | None:
    """The first symbolic link at or below ``path`` (links are not followed; W&B's own
    ``wandb/`` is not looked into), or None."""
    if _kind(path) == "link":
        return path
    if path.name == "wandb" or _kind(path) != "dir":
        return None
    seen = 0
    for top, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            seen += 1
            if seen > _WALK_LIMIT * 16:
                return None  # a run directory this large was not checked to the end
            if os.path.islink(os.path.join(top, name)):
                return Path(top) / name
    return None


def removable(run_dir: Path, record: RunRecord | None) -> tuple[list[str], list[str]]:
    """``(editrain's entries that --overwrite removes, run entries it must not touch)``.

    An entry is editrain's when the record lists it as owned (or, without a record, a run
    of an older editrain's) and it holds only what editrain writes there
    (:func:`foreign_entry`): an owned directory holding a user's file is not removed.
    """
    ours, foreign = [], []
    for name in run_entries(run_dir):
        owned = record is None or name in record.owned
        (ours if owned and foreign_entry(run_dir / name) is None else foreign).append(name)
    return ours, foreign


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# ---------------------------------------------------------------------------- checking
@dataclass
class Claim:
    """What :func:`check` found and :func:`claim` will do (nothing is touched in between)."""

    run_dir: Path
    record: RunRecord | None
    """The directory's record before this job, if any."""
    existing: list[str]
    """Run entries already there."""
    replace: bool
    """Whether this job replaces the run that is there (``--overwrite``)."""
    resume: list[Path]
    """The checkpoint(s) resumed from (one per replica group in the fault-tolerant mode)."""
    resume_marker: dict[str, Any] | None = None


MARKER_MAX_BYTES = 4 << 20
"""The largest checkpoint marker read (the run's configuration and model shape: kilobytes)."""
_POS = Int(1, 1 << 20)
MARKER_SCHEMA = Obj({
    "format": Int(1, 1000),
    "step": Int(0, 2**53),
    "topology": List(_POS, 4, nullable=True),
    "tp_size": _POS, "pp_size": _POS, "pp_stages_per_rank": _POS,
    "num_units": Int(1, 1 << 20, nullable=True),
    "vocab_size": Int(1, 1 << 30, nullable=True),
    "seq_len": Int(1, 1 << 30, nullable=True),
    "train_seed": Int(-(2**63), 2**64, nullable=True),
    "method": Str(64, nullable=True),
    "model": Obj(nullable=True),
    "config": Obj(nullable=True),
    "train_data": Obj({"tokens": Int(0, 2**53), "sha256": Str(64)}, nullable=True),
    "run_id": Str(64, nullable=True), "branch": Str(64, nullable=True),
    "saved_at": Num(0.0, 1e12, nullable=True),
    "progress": Num(0.0, 2.0**53, nullable=True),
}, required=("step",))
"""What a checkpoint's ``editrain.json`` must be: every counter and size an integer in
range (never a bool, a float or a string), checked before anything else reads it."""


def checkpoint_progress(marker: dict[str, Any]) -> float:
    """The run's progress in synchronous steps at a checkpoint (its marker, checked by
    :func:`read_marker`): A-EDiT's ``progress``, which may be fractional, where the marker
    records it; else the label ``step`` (every other method's step, and A-EDiT's progress
    rounded in checkpoints written before ``progress`` was recorded). The label is a
    directory name only: compared with ``train.steps`` or an evaluation's due step, a
    progress of 7.5 labelled 8 looked like step 8."""
    progress = marker.get("progress")
    return float(progress) if progress is not None else float(marker["step"])


def read_marker(ckpt: Path) -> dict[str, Any]:
    """The ``editrain.json`` of a checkpoint, checked against :data:`MARKER_SCHEMA`.

    Raises:
        CheckpointError: missing, a link, too large, not JSON or not a marker (one line
            naming the file and the field).
    """
    if Path(ckpt).is_symlink():
        raise CheckpointError(f"{shown(ckpt)}: the checkpoint directory is a symbolic link; "
                              "editrain reads a checkpoint only where it lies (give the "
                              "directory the link points to)")
    marker = read_json(Path(ckpt) / MARKER, max_bytes=MARKER_MAX_BYTES, schema=MARKER_SCHEMA,
                       what="checkpoint marker")
    topology = marker.get("topology")
    if topology is not None and not 2 <= len(topology) <= 4:
        raise CheckpointError(f"{shown(Path(ckpt) / MARKER)}: field 'topology': 2 to 4 sizes are "
                              f"expected (found {len(topology)})")
    return marker


_marker = read_marker


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def check(run_dir: Path, *, overwrite: bool, resume: list[Path], join: bool = False) -> Claim:
    """Decide whether this job may use ``run_dir``; touches nothing.

    Refused (:class:`RunDirError`): a directory holding a run, unless this job resumes that
    same run or ``--overwrite`` is given; ``--overwrite`` of entries editrain did not write.

    Args:
        run_dir: the run directory.
        overwrite: ``--overwrite``.
        resume: the checkpoint directories to resume from (empty for a new run).
        join: this job joins the run the directory holds (a torchrun job of a
            fault-tolerant run's replica group that starts while the run's other groups
            train, :func:`join_start`): the run is never replaced (``overwrite`` does not
            apply to it), a group that resumes must resume a checkpoint of that run, one
            that does not starts its group afresh in it; the other checks are a claim's.
    """
    record = read_record(run_dir)
    existing = run_entries(run_dir)
    marker = _marker(resume[0]) if resume else None
    if join:
        overwrite = False
        if record is None:
            raise RunDirError(f"--run-dir: {shown(run_dir)} has no run record ({RECORD}), though "
                              "replica groups of a fault-tolerant run train there; start "
                              "this group once they have ended, or in another directory")
    same_run = join and not resume
    if resume and (existing or record is not None):
        ckpt_run = marker.get("run_id") if marker else None
        if record is not None and ckpt_run is not None:
            same_run = ckpt_run == record.run_id
        else:
            # Checkpoints of an older editrain carry no identity: the same run only if the
            # checkpoint lies in this directory.
            same_run = all(_inside(c, run_dir) for c in resume)
    if same_run and overwrite:  # it was ignored without a word
        if any(_inside(c, run_dir) for c in resume):
            raise RunDirError(f"--overwrite: {shown(run_dir)} holds the run --resume continues, and "
                              f"overwriting it would remove the checkpoint resumed; drop "
                              f"--overwrite to continue the run there, or resume into "
                              f"another directory")
        same_run = False  # a checkpoint from elsewhere: the directory is replaced as asked
    if join and not same_run:
        raise RunDirError(f"--resume: {shown(resume[0])} is a checkpoint of another run than the "
                          f"one the replica groups training in {shown(run_dir)} continue; resume this "
                          "group from the run's own checkpoint (--resume RUN_DIR), or start "
                          "it once they have ended")
    if existing and not same_run and not overwrite:
        what = "another run" if resume else "a run"
        how = ("choose an empty directory (or the run's own) with --run-dir, or pass "
               "--overwrite to replace it" if resume else
               "choose another directory, resume it with --resume, or pass --overwrite to "
               "replace it")
        raise RunDirError(f"--run-dir: {shown(run_dir)} already holds {what} "
                          f"({', '.join(existing)}); {how}")
    replace = bool(existing) and not same_run
    if not replace:
        # Everything this job writes into: editrain never writes a link, so a link there is
        # someone else's, and writing through it would reach outside the run directory.
        for name in existing:
            link = first_link(run_dir / name)
            if link is not None:
                raise RunDirError(f"--run-dir: {shown(link)} is a symbolic link; editrain writes "
                                  "only regular files and directories in a run directory and "
                                  "never follows a link (remove it, or choose another "
                                  "directory)")
    if replace:
        if any(_inside(c, run_dir) for c in resume):
            raise RunDirError(f"--overwrite: {shown(run_dir)} would be replaced, but the "
                              f"checkpoint to resume ({shown(resume[0])}) lies inside it; resume into another "
                              "directory")
        _, foreign = removable(run_dir, record)
        if foreign:
            found = [foreign_entry(run_dir / n) for n in foreign]
            where = ", ".join(shown(p.relative_to(run_dir)) for p in found
                              if p is not None and p != run_dir / p.name)
            raise RunDirError(
                f"--overwrite: {shown(run_dir)} holds {', '.join(foreign)} with files editrain did "
                f"not write{f' ({where})' if where else ''}; move them away first (editrain "
                "removes only what it wrote)")
    return Claim(run_dir, record, existing, replace, list(resume), marker)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run's current timeline (``checkpoints/step_*``; those set
    aside in ``checkpoints/abandoned/`` are not listed), oldest first (by step). (Here,
    without torch, for the readers of a run that need none: ``editrain plan``.)"""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    # A link named step_* is listed (and refused by check_checkpoint_dir when resumed).
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")
            and p.name[len("step_"):].isdigit() and (p / MARKER).is_file()]
    return sorted(done, key=lambda p: int(p.name[len("step_"):]))


def newer_checkpoints(ckpt: Path, roots: list[Path], step: int) -> list[Path]:
    """Complete checkpoints under ``roots`` with a later step than ``step`` (a timeline that
    resuming from ``ckpt`` abandons)."""
    out = []
    for root in roots:
        if not root.is_dir():
            continue
        for p in sorted(root.iterdir()):
            if (p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
                    and (p / MARKER).is_file() and p.resolve() != ckpt.resolve()):
                if _marker(p)["step"] > step:
                    out.append(p)
    return out


def claim(c: Claim, note: dict[str, Any] | None = None, replica: int | None = None,
          groups: int = 0) -> RunRecord:
    """Make ``c.run_dir`` this job's: replace the old run if decided, set newer checkpoints
    of an abandoned timeline aside, write the record. Call with the lock held.

    Args:
        c: what :func:`check` found.
        note: more for this job's line of the history (the options it changes in the
            run's configuration: :func:`editrain.launch.run_dir.config_change`).
        replica: this job is that replica group of a fault-tolerant run, started by
            torchrun, that claims the run for a start of its groups
            (:func:`current_start`): it sets
            aside only its own later checkpoints (``replica{r}/checkpoints``), since every
            other group resumes its own checkpoint and keeps its own timeline
            (:func:`join_start`), and its history line lists the groups of the start.
        groups: the run's replica groups (0: not a fault-tolerant run): their directories
            ``replica{r}/``, which the groups create, are editrain's (``--overwrite``
            removes them).
    """
    run_dir = c.run_dir
    record = c.record
    if c.replace:
        ours, _ = removable(run_dir, record)
        for name in ours:
            _remove(run_dir / name)
        if (run_dir / RECORD).exists():
            (run_dir / RECORD).unlink()
        log.warning("--overwrite: removed %s from %s", ", ".join(ours), run_dir)
        record = None
    before = set(run_entries(run_dir))
    owned = set(record.owned) if record is not None else set()
    if record is not None or c.replace or not before:
        # Whatever this job will create is editrain's. (A directory with run entries but
        # no record is a run of an older editrain resumed here: adopt its entries.)
        owned |= {n for n in RUN_FILES if n not in before}
    else:
        owned |= before | {n for n in RUN_FILES if n not in before}
    owned |= {n for n in (f"replica{r}" for r in range(groups)) if n not in before}
    event: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "pid": os.getpid()}
    if not c.resume:
        rec = RunRecord(run_id=new_id(), branch=new_id())
    else:
        marker = c.resume_marker or {}
        step = int(marker.get("step", -1))  # checked by read_marker
        run_id = marker.get("run_id") or (record.run_id if record is not None else new_id())
        # Only this run directory's own timelines are left: a checkpoint of another
        # directory resumed here forks it, and that run keeps its later checkpoints.
        roots = sorted({p.parent for p in c.resume if _inside(p, run_dir)}
                       | _checkpoint_roots(run_dir)) if replica is None else [
            run_dir / f"replica{replica}" / CKPT_DIR]
        newer = newer_checkpoints(c.resume[0], roots, step)
        branch = marker.get("branch")
        continues = (branch is not None and record is not None and branch == record.branch
                     and not newer)
        rec = RunRecord(run_id=run_id, branch=branch if continues else new_id(),
                        resumed_from=[str(p.resolve()) for p in c.resume])
        event.update(resumed_from=str(c.resume[0]), from_step=step,
                     from_branch=branch)
        if newer:
            moved = _set_aside(newer, branch or "unknown")
            event["set_aside"] = [str(p) for p in moved]
            log.warning("resuming from %s (step %d) starts a new timeline: the later "
                        "checkpoints of the one it leaves were moved aside, kept and never "
                        "resumed by --resume RUN_DIR: %s", c.resume[0], step,
                        ", ".join(str(p) for p in moved))
    event["branch"] = rec.branch
    if replica is not None:
        event[FT_GROUPS] = [replica]
    event.update(note or {})
    rec.owned = sorted(owned)
    rec.history = (list(record.history) if record is not None else []) + [event]
    make_dir(run_dir, root=run_dir)
    write_record(run_dir, rec)
    if c.resume and rec.branch != (record.branch if record is not None else None):
        # Readers of metrics.jsonl see where the new timeline starts (rows up to the last
        # step logged before are marked "replayed" by the trainer).
        _append_event(run_dir / "metrics.jsonl",
                      {"event": "timeline", "step": event["from_step"], **event})
    return rec


# ------------------------------------------------- a fault-tolerant run's torchrun groups
FT_GROUPS = "ft_groups"
"""The key of a history line listing the replica groups of a fault-tolerant run, each a
torchrun job of its own, that took part in the start it records: the group that claimed
the run first, then each group that joined it (:func:`join_start`)."""
FT_ENDED = "ft_groups_ended"
"""The key of that line listing those of its groups whose job is over: it ended (its rank
0 returned), or a new job of the group started since (:func:`note_group`)."""
FT_FINISHED = "ft_groups_finished"
"""The key of that line mapping each of its groups whose job finished the run (trained to
the end of its budget; its rank 0 returned) to that budget, ``train.steps``. It is the
evidence that the group has nothing left to train, which its checkpoints may not give: a
run that saves none, or none at its last step. A new job of the group that takes part in
the start again clears it (:func:`note_group`)."""


def current_start(record: RunRecord | None) -> dict[str, Any] | None:
    """The history line of the run's latest job when that job is a start of a
    fault-tolerant run's replica groups as torchrun jobs (it lists :data:`FT_GROUPS`);
    None otherwise (no record, the latest job a plain one or editrain's own ``--ft``
    launcher's).

    The groups of one start claim the run once: the first to start claims it (a history
    line, the run's ``config.toml``), the others join that start; a group that torchrun
    restarts, or whose job died and was started again, joins the start it was in. A new
    start (a claim, which may begin a new timeline) is made only once none of the groups
    of the current one trains or may yet come back."""
    line = record.history[-1] if record is not None and record.history else None
    return line if isinstance(line, dict) and isinstance(line.get(FT_GROUPS), list) else None


def awaited_groups(run_dir: Path, record: RunRecord | None,
                   but: int | None = None) -> list[int]:
    """The groups of the current start (:func:`current_start`) of the run in ``run_dir``
    whose job is not over (:data:`FT_ENDED`) and whose directory ``replica{r}/`` is there,
    ``but`` left out: while none of them holds its lock (look under the run's lock, as for
    :func:`running_groups`), torchrun may be restarting it, or its job died.

    A group without its directory is not awaited: it wrote nothing a new start could
    remove or set aside, and moving its directory out of the run directory is how a user
    drops a group that will not be started again (the run has fewer groups now, its
    machine is gone), which would otherwise be awaited by every start."""
    start = current_start(record)
    if start is None:
        return []
    ended = set(start.get(FT_ENDED) or [])
    return [g for g in start[FT_GROUPS] if g != but and g not in ended
            and os.path.lexists(Path(run_dir) / f"replica{g}")]


def in_current_start(record: RunRecord | None, replica: int) -> bool:
    """Whether group ``replica`` takes part in the run's current start
    (:func:`current_start`) and its job is not over: a job of it that torchrun restarts
    is that job again, and rejoins the start as it left it. A group refused before it
    joined, or whose start is over, is not in it."""
    start = current_start(record)
    return (start is not None and replica in start[FT_GROUPS]
            and replica not in (start.get(FT_ENDED) or []))


def note_group(run_dir: Path, replica: int, *, ended: bool,
               finished_steps: int | None = None) -> None:
    """Note in the current start's line (:func:`current_start`) that group ``replica``'s
    job takes part in it, or with ``ended`` that it is over (its job ended, or a new job of
    the group is starting); with ``finished_steps`` too, that its job finished the run
    trained to that ``train.steps`` (:data:`FT_FINISHED`). A job that takes part clears
    what an earlier job of the group finished: it may not. Nothing for a run whose latest
    job is no such start. Call holding the run's lock."""
    record = read_record(run_dir)
    start = current_start(record)
    if record is None or start is None:
        return
    members, over = list(start[FT_GROUPS]), list(start.get(FT_ENDED) or [])
    finished = dict(finished_groups(record))
    if ended:
        if replica not in members or (replica in over and finished_steps is None):
            return
        over += [] if replica in over else [replica]
        if finished_steps is not None:
            finished[replica] = int(finished_steps)
    else:
        if replica in members and replica not in over:
            return
        members += [] if replica in members else [replica]
        over = [g for g in over if g != replica]
        finished.pop(replica, None)
    start[FT_GROUPS], start[FT_ENDED] = members, sorted(over)
    if finished or FT_FINISHED in start:
        start[FT_FINISHED] = {str(g): s for g, s in sorted(finished.items())}
    write_record(run_dir, record)


def finished_groups(record: RunRecord | None) -> dict[int, int]:
    """The groups of the run's current start whose job finished the run, each with the
    ``train.steps`` it trained to (:data:`FT_FINISHED`); empty where there is no such start
    or a record of an older editrain holds none. An entry that is not a group's index and
    a whole number of steps is left out (the record is a file users may edit)."""
    start = current_start(record)
    entries = start.get(FT_FINISHED) if start is not None else None
    if not isinstance(entries, dict):
        return {}
    return {int(g): s for g, s in entries.items()
            if isinstance(g, str) and g.isascii() and g.isdigit() and isinstance(s, int)
            and not isinstance(s, bool)}


def join_start(c: Claim, replica: int) -> list[Path]:
    """Join replica group ``replica`` (a torchrun job of a fault-tolerant run) to the run's
    current start, which another group claimed (:func:`current_start`; ``c`` from
    :func:`check` with ``join``). The group's timeline is its own: resuming one of its
    checkpoints older than its latest sets its own later ones aside
    (``replica{r}/checkpoints/abandoned/<branch>/``), as a claim does; nothing of another
    group is touched. The checkpoint it resumes is added to the record's ``resumed_from``
    (never rotated away), and the group to the start's line. Call holding the run's lock.

    Returns:
        The checkpoints set aside.
    """
    record = c.record
    if record is None:  # check(join=True) refuses it first
        raise RunDirError(f"--run-dir: {shown(c.run_dir)} has no run record to join")
    moved: list[Path] = []
    if c.resume:
        marker = c.resume_marker or {}
        step = int(marker.get("step", -1))
        newer = newer_checkpoints(c.resume[0], [c.run_dir / f"replica{replica}" / CKPT_DIR],
                                  step)
        if newer:
            moved = _set_aside(newer, marker.get("branch") or "unknown")
            log.warning("replica group %d: resuming from %s (step %d) leaves the later "
                        "checkpoints of its own timeline; moved aside, kept and never "
                        "resumed by --resume RUN_DIR: %s", replica, c.resume[0], step,
                        ", ".join(str(p) for p in moved))
        resumed = str(c.resume[0].resolve())
        if resumed not in record.resumed_from:
            record.resumed_from.append(resumed)
    start = current_start(record)
    if start is not None and moved:
        start["set_aside"] = list(start.get("set_aside") or []) + [str(p) for p in moved]
    write_record(c.run_dir, record)
    note_group(c.run_dir, replica, ended=False)
    return moved


def _append_event(path: Path, row: dict[str, Any]) -> None:
    """Append one row to an existing ``metrics.jsonl`` (no worker runs yet)."""
    if not os.path.lexists(path):
        return
    cut_partial_line(path, root=path.parent)
    with open_write(path, "a", root=path.parent) as f:
        f.write(json.dumps(row) + "\n")


def _inside(path: Path, run_dir: Path) -> bool:
    """Whether ``path`` is inside ``run_dir`` (links resolved)."""
    return path.resolve().is_relative_to(run_dir.resolve())


def _checkpoint_roots(run_dir: Path) -> set[Path]:
    roots = {run_dir / CKPT_DIR}
    if run_dir.is_dir():
        roots |= {p / CKPT_DIR for p in run_dir.iterdir()
                  if p.is_dir() and _is_replica_dir(p.name)}
    return roots


def _set_aside(ckpts: list[Path], branch: str) -> list[Path]:
    """Move checkpoints to ``<their checkpoints dir>/abandoned/<branch>/``."""
    moved = []
    for p in ckpts:
        dest = p.parent / ABANDONED / branch / p.name
        n = 1
        while dest.exists():
            dest = dest.with_name(f"{p.name}.{n}")
            n += 1
        make_dir(dest.parent, root=p.parent.parent)
        os.replace(p, dest)
        moved.append(dest)
    return moved


LOGS = "logs"
"""The run's log directory (``RUN_DIR/logs``, per replica group ``RUN_DIR/replica{r}/logs``):
``rank{R}.log`` (the traceback of a worker's error, see :func:`editrain.spawn.errors_logged`),
``rank{R}.error.json`` (torch elastic's error file of the worker's latest attempt) and
``launcher.log`` (torch elastic's own log, kept off the terminal)."""


def logs_dir(cfg: Any, run_dir: str | Path) -> Path:
    """Where a job's logs go (see :data:`LOGS`).

    Args:
        cfg: the run's configuration (a fault-tolerant run's replica group writes into its
            own ``replica{r}`` directory, as its trainer does).
        run_dir: the run directory.
    """
    base = Path(run_dir)
    if cfg.dist.fault_tolerance == "torchft":
        from editrain.sync.ft import REPLICA_ENV

        replica = cfg.dist.ft_replica_id
        if replica < 0 and os.environ.get(REPLICA_ENV, "").isdigit():
            replica = env_int(REPLICA_ENV)
        if replica >= 0:
            base = base / f"replica{replica}"
    return base / LOGS
