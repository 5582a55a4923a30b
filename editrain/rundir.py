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
* ``history``: one line per job (branch, start, what it resumed from, what it set aside).

When a job resumes from an older checkpoint, the newer checkpoints of the abandoned
timeline are moved to ``checkpoints/abandoned/<branch>/``: kept, never rotated, never
picked by ``--resume RUN_DIR`` (which takes the newest checkpoint of ``checkpoints/``).

``RUN_DIR/.editrain.lock`` is held (``flock``) by the job's launcher for the whole job: a
second job on the same directory is refused. The kernel releases the lock when its holder
exits in any way (``kill -9`` included), so a stale lock file from a dead process is
detected by simply taking the lock. (``flock`` on network file systems may be local to a
node; a multi-node job takes it on the node of rank 0.)

``RUN_DIR/logs`` (:func:`logs_dir`; per replica group of a fault-tolerant run
``RUN_DIR/replica{r}/logs``) holds the workers' tracebacks and torch elastic's own log.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from editrain.errors import CheckpointError, RunDirError
from editrain.tracking import RUN_ID_FILE

log = logging.getLogger("editrain")

RECORD = "editrain-run.json"
LOCK = ".editrain.lock"
CKPT_DIR = "checkpoints"
ABANDONED = "abandoned"
MARKER = "editrain.json"

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "loss_vs_tokens.png",
             "loss_vs_time.png", "ranks", "tb", "checkpoints", "logs", ".link", "wandb",
             RUN_ID_FILE)
"""Entries of a run directory that editrain writes (besides ``replica{r}/`` of a
fault-tolerant run, the record and the lock)."""


def _is_replica_dir(name: str) -> bool:
    return name.startswith("replica") and name[len("replica"):].isdigit()


def run_entries(run_dir: Path) -> list[str]:
    """The editrain entries present in ``run_dir`` (what makes it hold a run)."""
    if not run_dir.is_dir():
        return []
    names = [n for n in RUN_FILES if (run_dir / n).exists()]
    names += sorted(p.name for p in run_dir.iterdir() if p.is_dir() and _is_replica_dir(p.name))
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


def new_id() -> str:
    """A fresh run or branch identifier."""
    return uuid.uuid4().hex[:16]


def read_record(run_dir: str | Path) -> RunRecord | None:
    """The run record of ``run_dir``, or None if it has none (a new directory, or a run of
    an editrain older than the record)."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return RunRecord(run_id=str(data["run_id"]), branch=str(data["branch"]),
                         resumed_from=[str(p) for p in data.get("resumed_from") or []],
                         owned=[str(n) for n in data.get("owned", [])],
                         history=list(data.get("history", [])))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunDirError(f"--run-dir: {path} is unreadable ({e}); it is editrain's record "
                          "of the run in that directory: restore it, or choose another "
                          "directory") from None


def write_record(run_dir: Path, record: RunRecord) -> None:
    """Write the record atomically (temporary file, fsync, rename)."""
    tmp = run_dir / (RECORD + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(asdict(record), indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / RECORD)


def lineage_of(run_dir: str | Path) -> dict[str, Any] | None:
    """The current job's lineage for a worker whose run directory is ``run_dir`` (a
    fault-tolerant replica group's ``RUN_DIR/replica{r}`` reads its parent's record)."""
    p = Path(run_dir)
    for d in (p, p.parent) if _is_replica_dir(p.name) else (p,):
        record = read_record(d)
        if record is not None:
            return record.lineage()
    return None


# ---------------------------------------------------------------------------- the lock
class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.editrain.lock`` for the life of a job.

    Args:
        run_dir: the run directory (created if missing).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock (creating the directory and the lock file if needed) or raise
        :class:`RunDirError` naming the job that holds it."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"--run-dir: {self.path.parent} is in use by another editrain job ({holder}); "
                "wait for it to end or choose another directory") from None
        os.set_inheritable(fd, False)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return self

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


# ---------------------------------------------------------------------------- ownership
def _only(path: Path, ok) -> bool:
    """Whether every entry directly in the directory ``path`` satisfies ``ok(entry)``."""
    return all(ok(p) for p in path.iterdir())


def _looks_like_editrains(path: Path) -> bool:
    """For a directory without a record (written by an older editrain, or a user's): whether
    the entry ``path`` holds only what editrain writes there."""
    name = path.name
    if path.is_file():
        return name in RUN_FILES
    if not path.is_dir():
        return False
    if name == CKPT_DIR:
        return _only(path, lambda p: p.is_dir() and (p.name.startswith("step_")
                                                      or p.name == ABANDONED))
    if name == "ranks":
        return _only(path, lambda p: p.is_file() and p.name.startswith("rank")
                     and p.name.endswith(".jsonl"))
    if name == "tb":
        return _only(path, lambda p: p.is_file() and p.name.startswith("events.out.tfevents"))
    if name == ".link":
        return _only(path, lambda p: p.is_file() and p.name.endswith(".state"))
    if name == "logs":
        return _only(path, lambda p: p.is_file())
    if _is_replica_dir(name):
        return _only(path, lambda p: p.name in RUN_FILES and _looks_like_editrains(p))
    return False


def removable(run_dir: Path, record: RunRecord | None) -> tuple[list[str], list[str]]:
    """``(editrain's entries that --overwrite removes, run entries it must not touch)``.

    With a record, what it lists as owned; without one, the entries whose contents are only
    what editrain writes there.
    """
    ours, foreign = [], []
    for name in run_entries(run_dir):
        owned = name in record.owned if record is not None else False
        (ours if owned or _looks_like_editrains(run_dir / name) else foreign).append(name)
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


def _marker(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: unreadable {MARKER}: {e}") from None


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def check(run_dir: Path, *, overwrite: bool, resume: list[Path]) -> Claim:
    """Decide whether this job may use ``run_dir``; touches nothing.

    Refused (:class:`RunDirError`): a directory holding a run, unless this job resumes that
    same run or ``--overwrite`` is given; ``--overwrite`` of entries editrain did not write.

    Args:
        run_dir: the run directory.
        overwrite: ``--overwrite``.
        resume: the checkpoint directories to resume from (empty for a new run).
    """
    record = read_record(run_dir)
    existing = run_entries(run_dir)
    marker = _marker(resume[0]) if resume else None
    same_run = False
    if resume and (existing or record is not None):
        ckpt_run = marker.get("run_id") if marker else None
        if record is not None and ckpt_run is not None:
            same_run = ckpt_run == record.run_id
        else:
            # Checkpoints of an older editrain carry no identity: the same run only if the
            # checkpoint lies in this directory.
            same_run = all(_inside(c, run_dir) for c in resume)
    if existing and not same_run and not overwrite:
        what = "another run" if resume else "a run"
        how = ("choose an empty directory (or the run's own) with --run-dir, or pass "
               "--overwrite to replace it" if resume else
               "choose another directory, resume it with --resume, or pass --overwrite to "
               "replace it")
        raise RunDirError(f"--run-dir: {run_dir} already holds {what} "
                          f"({', '.join(existing)}); {how}")
    replace = bool(existing) and not same_run
    if replace:
        if any(_inside(c, run_dir) for c in resume):
            raise RunDirError(f"--overwrite: {run_dir} would be replaced, but the checkpoint "
                              f"to resume ({resume[0]}) lies inside it; resume into another "
                              "directory")
        _, foreign = removable(run_dir, record)
        if foreign:
            raise RunDirError(
                f"--overwrite: {run_dir} holds {', '.join(foreign)} with files editrain did "
                "not write; move them away first (editrain removes only what it wrote)")
    return Claim(run_dir, record, existing, replace, list(resume), marker)


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
                if int(_marker(p).get("step", -1)) > step:
                    out.append(p)
    return out


def claim(c: Claim) -> RunRecord:
    """Make ``c.run_dir`` this job's: replace the old run if decided, set newer checkpoints
    of an abandoned timeline aside, write the record. Call with the lock held."""
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
    event: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "pid": os.getpid()}
    if not c.resume:
        rec = RunRecord(run_id=new_id(), branch=new_id())
    else:
        marker = c.resume_marker or {}
        step = int(marker.get("step", -1))
        run_id = marker.get("run_id") or (record.run_id if record is not None else new_id())
        roots = sorted({p.parent for p in c.resume} | _checkpoint_roots(run_dir))
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
    rec.owned = sorted(owned)
    rec.history = (list(record.history) if record is not None else []) + [event]
    run_dir.mkdir(parents=True, exist_ok=True)
    write_record(run_dir, rec)
    if c.resume and rec.branch != (record.branch if record is not None else None):
        # Readers of metrics.jsonl see where the new timeline starts (rows up to the last
        # step logged before are marked "replayed" by the trainer).
        _append_event(run_dir / "metrics.jsonl",
                      {"event": "timeline", "step": event["from_step"], **event})
    return rec


def _append_event(path: Path, row: dict[str, Any]) -> None:
    """Append one row to an existing ``metrics.jsonl`` (no worker runs yet)."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):  # a writer killed mid-row
            f.truncate(data.rfind(b"\n") + 1)
        f.seek(0, os.SEEK_END)
        f.write((json.dumps(row) + "\n").encode())


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
        dest.parent.mkdir(parents=True, exist_ok=True)
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
            replica = int(os.environ[REPLICA_ENV])
        if replica >= 0:
            base = base / f"replica{replica}"
    return base / LOGS
