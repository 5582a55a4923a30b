"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, atomic, exact, elastic.

Layout of one checkpoint directory ``RUN_DIR/checkpoints/step_00000100/``::

    .metadata, __*.distcp     DCP tensor data (every rank writes its own shards)
    rank_00000.json ...       per-rank plain data: data position, RNG states, counters
    editrain.json             format, topology, config, step, save time; written LAST = "complete"

What the tensors hold, under stable keys:

* ``replica{i}.model`` / ``replica{i}.optim``: replica ``i``'s live parameters and inner
  optimizer state (replicas differ between syncs, so each is saved);
* ``engine.*``: the sync engine's own state, exactly as its ``state_dict()`` returns it and
  read back through its ``state_dict_template()`` / ``load_state_dict()``. The engine lays
  it out so that it re-shards to any topology (elastic resume); this module does not look
  inside.

A checkpoint is written into ``step_X.tmp`` and renamed when every rank is done; a directory
without ``editrain.json`` is never loaded. Loading unpickles nothing but DCP's own metadata
classes (a restricted unpickler) and tensors (``weights_only``); editrain's own state is JSON.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from editrain.errors import CheckpointError

log = logging.getLogger("editrain")

MARKER = "editrain.json"
CKPT_DIR = "checkpoints"
FORMAT = 2
"""Checkpoint format, stored in the marker. 1 (no ``format`` field) kept the engine's tensors
under ``global.*``; 2 stores the engine's own state dict under ``engine``."""
ENGINE_KEY = "engine"


# ---------------------------------------------------------------------------- safe loading
_ALLOWED_PREFIXES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
_ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
            ("builtins", "frozenset"), ("torch._utils", "_rebuild_tensor_v2"),
            ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: its own dataclasses, dtypes, sizes. Nothing that runs
    code of the checkpoint author's choosing."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_PREFIXES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in ("device", "layout", "memory_format"):
            return getattr(torch, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name} from checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through a restricted unpickler."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._dir = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        data = (self._dir / ".metadata").read_bytes()
        metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self._dir}: .metadata is not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------------- discovery
def checkpoint_root(run_dir: str | Path) -> Path:
    """``RUN_DIR/checkpoints``."""
    return Path(run_dir) / CKPT_DIR


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run's current timeline (``checkpoints/step_*``; those set
    aside in ``checkpoints/abandoned/`` are not listed), oldest first (by step)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")
            and p.name[len("step_"):].isdigit() and (p / MARKER).is_file()]
    return sorted(done, key=lambda p: int(p.name[len("step_"):]))


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint directory from ``--resume`` (a run directory or a checkpoint path)."""
    p = Path(path)
    if (p / MARKER).is_file():
        return p
    if p.is_dir() and (p / CKPT_DIR).is_dir():
        found = list_checkpoints(p)
        if found:
            return found[-1]
        raise CheckpointError(f"--resume: {p} has no complete checkpoint in {p / CKPT_DIR}")
    if p.is_dir() and p.name.startswith("step_"):
        raise CheckpointError(f"--resume: {p} is incomplete (no {MARKER}); it was not "
                              "finished and cannot be used")
    raise CheckpointError(f"--resume: {p} is neither a run directory with checkpoints nor a "
                          "checkpoint directory")


def read_marker(ckpt: Path) -> dict[str, Any]:
    """The ``editrain.json`` of a complete checkpoint."""
    try:
        return json.loads((ckpt / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}: unreadable {MARKER}: {e}") from None


# ---------------------------------------------------------------------------- plain state
def rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA) RNG states as base64 strings."""
    out = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    def tensor(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


# ---------------------------------------------------------------------------- metadata
def saved_tensors(checkpoint_id: str | os.PathLike, key: str) -> dict[str, torch.Tensor]:
    """What a DCP checkpoint holds under ``key``: each tensor's flattened key (without the
    leading ``key.``) -> an empty tensor on the meta device with the saved shape and dtype.

    This is what a state's owner needs to build the tensors ``dcp.load`` fills, when what
    was saved depends on when it was saved (see ``SyncEngine.state_dict_template``).

    Args:
        checkpoint_id: the checkpoint directory.
        key: the top-level key of the state dict that holds the state.
    """
    metadata = SafeFileSystemReader(checkpoint_id).read_metadata()
    prefix = f"{key}."
    return {
        name[len(prefix):]: torch.empty(tuple(md.size), dtype=md.properties.dtype,
                                        device="meta")
        for name, md in metadata.state_dict_metadata.items()
        if name.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


# ---------------------------------------------------------------------------- save / load
@dataclass
class Saved:
    """Where and how a checkpoint was written."""

    path: Path
    seconds: float
    bytes: int


def save_checkpoint(run_dir: str | Path, step: int, *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, engine: Any, replica: int,
                    rank_state: dict[str, Any], meta: dict[str, Any], keep: int,
                    before_commit: Any = None, lineage: dict[str, Any] | None = None
                    ) -> Saved:
    """Collective: every rank of the world calls it at the same point of training.

    Args:
        run_dir: the run directory.
        step: the label (the step or progress counter the checkpoint is taken at).
        model, optimizer: the live model and inner optimizer.
        engine: the sync engine (anything with ``state_dict()``; see :func:`load_checkpoint`).
        replica: this rank's replica index.
        rank_state: this rank's plain-data state (data position, RNG, counters).
        meta: plain data describing the run (topology, config), stored in the marker.
        keep: how many complete checkpoints of the current timeline to keep (the one
            resumed from is never deleted by this job; see :func:`rotate`).
        before_commit: optional callable run after the data is written and before the
            checkpoint is marked complete (fault-injection tests kill a worker there).
        lineage: the job's ``run_id``, ``branch`` and ``resumed_from``
            (:func:`editrain.rundir.lineage_of`), stored in the marker; rotation deletes
            only checkpoints of this branch.
    """
    t0 = time.perf_counter()
    rank = dist.get_rank()
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # a previous attempt that died half-way
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {
        f"replica{replica}": {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, _base(optimizer)),
        },
        ENGINE_KEY: engine.state_dict(),
    }
    dcp.save(state, checkpoint_id=str(tmp))
    (tmp / f"rank_{rank:05d}.json").write_text(json.dumps(rank_state))
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if rank == 0:
        lineage = lineage or {}
        marker = dict(meta, step=step, saved_at=time.time(), run_id=lineage.get("run_id"),
                      branch=lineage.get("branch"))
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        # A checkpoint of the same label (the final one at a periodic one's step) is
        # replaced only once the new one is complete on disk.
        old = final.with_name(final.name + ".old")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        if old.exists():
            shutil.rmtree(old)
        rotate(run_dir, keep, final, lineage)
    dist.barrier()
    size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    return Saved(final, time.perf_counter() - t0, size)


def rotate(run_dir: str | Path, keep: int, written: Path,
           lineage: dict[str, Any] | None = None) -> list[Path]:
    """Delete the oldest checkpoints of the current timeline beyond ``keep``.

    Only checkpoints whose marker names the current branch (``lineage["branch"]``; None for
    a library user's run without a record) are candidates, ordered by step; the one just
    ``written`` and the one this job resumed from are never deleted.

    Returns:
        The deleted checkpoint directories.
    """
    lineage = lineage or {}
    branch = lineage.get("branch")
    protected = {written.resolve()}
    if lineage.get("resumed_from"):
        protected.add(Path(lineage["resumed_from"]).resolve())
    mine = []
    for ckpt in list_checkpoints(run_dir):
        try:
            marker = read_marker(ckpt)
        except CheckpointError:
            continue  # not ours to judge: leave it
        if marker.get("branch") == branch:
            mine.append((int(marker.get("step", -1)), ckpt))
    mine.sort(key=lambda sc: sc[0])
    doomed = [c for _, c in mine[:-keep] if c.resolve() not in protected] if keep else []
    for ckpt in doomed:
        shutil.rmtree(ckpt, ignore_errors=True)
    return doomed


def _base(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that owns the state (WSAM wraps a base optimizer)."""
    return getattr(optimizer, "base_optimizer", optimizer)


def run_meta(cfg: Any, vocab_size: int, topology: tuple[int, ...] | None = None
             ) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (compared on resume)."""
    import dataclasses

    from editrain.config import model_config, to_dict

    if getattr(cfg.model, "hf_config", None):
        model = json.loads(Path(cfg.model.hf_config).read_text())
        model.pop("transformers_version", None)
        num_units = int(model.get("num_hidden_layers", model.get("n_layer", 0))) + 1
    else:
        model = dataclasses.asdict(model_config(cfg, vocab_size=vocab_size))
        num_units = model["n_layers"] + 1
    return {
        "format": FORMAT,
        "model": model,
        "method": cfg.sync.method,
        "vocab_size": vocab_size,
        "num_units": num_units,
        "topology": list(topology) if topology else None,
        "tp_size": int(getattr(getattr(cfg, "dist", None), "tp_size", 1)),
        "config": to_dict(cfg),
    }


def preflight_resume(resume: str | Path, cfg: Any, vocab_size: int) -> Path:
    """Find the checkpoint and check it fits this run, before any worker starts."""
    ckpt = resolve_resume(resume)
    problems = check_compatible(read_marker(ckpt), run_meta(cfg, vocab_size))
    if problems:
        raise CheckpointError(f"cannot resume from {ckpt}:\n  " + "\n  ".join(problems))
    return ckpt


def _tp_size(topology: list[int] | None) -> int:
    """The tp size of a ``(replicas, shards[, tp])`` topology."""
    return int(topology[2]) if topology and len(topology) > 2 else 1


def check_compatible(marker: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """Differences that make a checkpoint unusable for this run (model shape, method)."""
    problems = []
    if marker.get("format", 1) != meta.get("format", FORMAT):
        problems.append(f"format: checkpoint has format {marker.get('format', 1)}, this "
                        f"editrain reads format {meta.get('format', FORMAT)} (start a new run)")
    for key in ("method", "vocab_size", "num_units"):
        old, new = marker.get(key), meta.get(key)
        if old != new:
            problems.append(f"{key}: checkpoint has {old!r}, this run has {new!r}")
    old_tp = marker.get("tp_size", _tp_size(marker.get("topology")))
    new_tp = meta.get("tp_size", _tp_size(meta.get("topology")))
    if old_tp != new_tp:
        problems.append(f"dist.tp_size: checkpoint has {old_tp}, this run has {new_tp} (a "
                        "checkpoint resumes with the tp size it was saved with; replicas "
                        "and shards may change)")
    old_model, new_model = marker.get("model") or {}, meta.get("model") or {}
    for key in sorted(set(old_model) | set(new_model)):
        if old_model.get(key) != new_model.get(key):
            problems.append(f"model.{key}: checkpoint has {old_model.get(key)!r}, "
                            f"this run has {new_model.get(key)!r}")
    return problems


def load_checkpoint(ckpt: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    engine: Any, replica: int, rank: int, meta: dict[str, Any]
                    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Load a checkpoint into the live objects.

    Same topology: everything is restored exactly and this rank's plain state is returned.
    Different topology (elastic): every replica gets replica 0's parameters and inner
    optimizer state, then the engine restores its own state, re-sharded, and restarts every
    replica from the global model; the returned rank state is None (the caller
    re-partitions the data and resets local counters).

    Args:
        ckpt: a complete checkpoint directory.
        model, optimizer: the live model and inner optimizer, built as for training.
        engine: the sync engine: ``state_dict_template(saved)`` gives the tensors to load
            its state into (``saved`` from :func:`saved_tensors`), ``load_state_dict(state)``
            restores it.
        replica: this rank's replica index.
        rank: this rank.
        meta: :func:`run_meta` of this run.

    Returns:
        ``(rank_state or None, marker)``.
    """
    marker = read_marker(ckpt)
    problems = check_compatible(marker, meta)
    if problems:
        raise CheckpointError(f"cannot resume from {ckpt}:\n  " + "\n  ".join(problems))
    same = marker.get("topology") == meta.get("topology")
    src = replica if same else 0
    opts = StateDictOptions(strict=True)
    try:
        state: dict[str, Any] = {
            f"replica{src}": {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, _base(optimizer)),
            },
            ENGINE_KEY: engine.state_dict_template(saved_tensors(ckpt, ENGINE_KEY)),
        }
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt))
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        # Corrupt or truncated files: say so, never continue silently.
        raise CheckpointError(f"{ckpt}: cannot read checkpoint data: {e!r}") from e
    set_model_state_dict(model, state[f"replica{src}"]["model"], options=opts)
    set_optimizer_state_dict(model, _base(optimizer), state[f"replica{src}"]["optim"],
                             options=opts)
    if engine.load_state_dict(state[ENGINE_KEY]) != (not same):
        raise CheckpointError(f"{ckpt}: the engine state and the marker disagree on the "
                              "topology that saved the checkpoint")
    if not same:
        return None, marker
    path = ckpt / f"rank_{rank:05d}.json"
    try:
        return json.loads(path.read_text()), marker
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}: missing or corrupt {path.name}: {e}") from None
