"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, atomic, exact, elastic.

Layout of one checkpoint directory ``RUN_DIR/checkpoints/step_00000100/``::

    .metadata, __*.distcp     DCP: tensors only (every rank writes its own shards)
    rank_00000.json ...       per-rank plain data: data position, RNG states, counters, and
                              (``optim``) the non-tensor state of its replica's optimizer
    editrain.json             format, topology, config, data identity, step, save time;
                              written LAST = "complete"

What the tensors hold, under stable keys:

* ``replica{i}.model`` / ``replica{i}.optim``: replica ``i``'s live parameters and the
  tensors of its inner optimizer state (replicas differ between syncs, so each is saved).
  The optimizer's ``param_groups`` (learning rate, betas, ...) and any non-tensor state
  value are in the ``optim`` entry of the rank JSON instead, as typed JSON;
* ``engine.*``: the sync engine's own state, exactly as its ``state_dict()`` returns it and
  read back through its ``state_dict_template()`` / ``load_state_dict()``. The engine lays
  it out so that it re-shards to any topology (elastic resume); this module does not look
  inside, it only checks that the tree holds tensors only.

A checkpoint is written into ``step_X.tmp`` and renamed when every rank is done; a directory
without ``editrain.json`` is never loaded.

What loading trusts: nothing in the files is run. ``.metadata`` is unpickled with an
allowlist of the classes DCP metadata is made of and checked field by field; tensors are
read by DCP with ``torch.load(weights_only=True)``; a non-tensor ("bytes") DCP item, which
DCP would unpickle with full pickle, is refused. The one exception is format 2, which
stored ``param_groups`` as such items: those items alone are decoded, with
``torch.load(weights_only=True)``, and kept only if they are plain data (see
:mod:`editrain.safe_load`). editrain's own state is JSON. Before any worker starts,
:func:`preflight_resume` checks that the files are complete (every item within its file,
every rank's JSON readable) and that this run fits the checkpoint (model, method, sequence
length, the token stream the saved data positions index).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from editrain.errors import CheckpointError
from editrain.paths import shown
from editrain.rundir import checkpoint_progress, list_checkpoints, replica_groups
from editrain.rundir import read_marker as _read_marker_file
from editrain.safe_io import (
    Bool,
    Int,
    List,
    Num,
    Obj,
    Str,
    make_dir,
    quote,
    read_json,
    regular_size,
    write_atomic,
)
from editrain.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_storage,
    read_bytes_item,
    read_metadata,
    read_tensor_item,
)
from editrain.sync.state import VERSION as ENGINE_STATE_VERSION
from editrain.sync.state import read_plain_state

log = logging.getLogger("editrain")

MARKER = "editrain.json"
CKPT_DIR = "checkpoints"
RANK_PREFIX = "rank_"
"""A rank's plain state is ``rank_{rank:05d}.json`` in the checkpoint (see :func:`rank_file`)."""
FORMAT = 3
"""Checkpoint format, stored in the marker. 1 (no ``format`` field) kept the engine's tensors
under ``global.*``; 2 stores the engine's own state dict under ``engine``; 3 keeps the
optimizer's non-tensor state (``param_groups``) out of DCP, in the rank JSON, so that DCP
holds tensors only."""
READ_FORMATS = (2, 3)
"""Formats this editrain resumes (2: its ``param_groups`` items are decoded safely)."""
ENGINE_KEY = "engine"
OPTIM_KEY = "optim"
"""The rank JSON's entry for the non-tensor state of the rank's replica's optimizer."""
_LEGACY_BYTES = re.compile(r"replica\d+\.optim\.param_groups\..+")
"""The non-tensor DCP items format 2 wrote (and the only ones loading decodes)."""


# ---------------------------------------------------------------------------- discovery
def checkpoint_root(run_dir: str | Path) -> Path:
    """``RUN_DIR/checkpoints``."""
    return Path(run_dir) / CKPT_DIR


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint directory from ``--resume`` (a run directory or a checkpoint path)."""
    p = Path(path)
    if (p / MARKER).is_file():
        return p
    if p.is_dir() and (p / CKPT_DIR).is_dir():
        found = list_checkpoints(p)
        if found:
            return found[-1]
        raise CheckpointError(f"--resume: {shown(p)} has no complete checkpoint in "
                              f"{shown(p / CKPT_DIR)}")
    if p.is_dir() and p.name.startswith("step_"):
        raise CheckpointError(f"--resume: {shown(p)} is incomplete (no {MARKER}); it was not "
                              "finished and cannot be used")
    if any((g / CKPT_DIR).is_dir() for g in replica_groups(p)):
        raise CheckpointError(f"--resume: {shown(p)} is a --ft run (each replica group's "
                              "checkpoints are in replica*/checkpoints/): resume it with --ft")
    raise CheckpointError(f"--resume: {shown(p)} is neither a run directory with checkpoints "
                          "nor a checkpoint directory")


def rank_file(ckpt: Path, rank: int) -> Path:
    """The file of rank ``rank``'s plain state in checkpoint ``ckpt`` (``rank_00000.json``)."""
    return ckpt / f"{RANK_PREFIX}{rank:05d}.json"


def saved_ranks(ckpt: Path) -> list[int]:
    """The ranks whose plain state ``ckpt`` holds, in order."""
    stems = (p.stem[len(RANK_PREFIX):] for p in ckpt.glob(f"{RANK_PREFIX}*.json"))
    return sorted(int(s) for s in stems if s.isdigit())


def rank_states(ckpt: Path) -> list[dict[str, Any]]:
    """Every saved rank's plain state (as :func:`save_checkpoint` wrote its
    ``rank_state``, with the optimizer's entry as typed JSON), in rank order: what an
    elastic resume re-partitions the data positions from (each read bounded and checked
    as :func:`check_files` does)."""
    if not os.path.lexists(ckpt / MARKER):  # plain files of no checkpoint: bounded reads
        return [read_json(rank_file(ckpt, r), max_bytes=rank_json_cap({}), schema=Obj(),
                          what="rank state") for r in saved_ranks(ckpt)]
    marker = read_marker(ckpt)
    return [_read_rank_json(rank_file(ckpt, r), 0, marker) for r in saved_ranks(ckpt)]


def read_marker(ckpt: Path) -> dict[str, Any]:
    """The ``editrain.json`` of a complete checkpoint: a regular file of at most
    :data:`editrain.rundir.MARKER_MAX_BYTES`, checked field by field
    (:data:`editrain.rundir.MARKER_SCHEMA`)."""
    return _read_marker_file(ckpt)


# ---------------------------------------------------------------------------- what may be read
RANK_JSON_BASE_BYTES = 1 << 20
"""A rank's JSON holds RNG states (7 KB), counters, its data position and its optimizer's
``param_groups``: at most this plus :data:`RANK_JSON_UNIT_BYTES` per unit of the model."""
RANK_JSON_UNIT_BYTES = 64 << 10
METADATA_BASE_BYTES = 1 << 20
METADATA_CHUNK_BYTES = 64 << 10
"""``.metadata`` lists every tensor's chunks: at most this much per unit of the model and
rank of the saving topology, beyond :data:`METADATA_BASE_BYTES`."""


def _units(marker: Mapping[str, Any]) -> int:
    units = marker.get("num_units")
    return units if isinstance(units, int) and units > 0 else 1024


def _world(marker: Mapping[str, Any]) -> int:
    topology = marker.get("topology")
    return math.prod(topology) if topology else 1


def rank_json_cap(marker: Mapping[str, Any]) -> int:
    """The largest rank JSON a checkpoint with this marker can hold (bytes)."""
    return RANK_JSON_BASE_BYTES + RANK_JSON_UNIT_BYTES * _units(marker)


def metadata_cap(marker: Mapping[str, Any]) -> int:
    """The largest ``.metadata`` a checkpoint with this marker can hold (bytes)."""
    return METADATA_BASE_BYTES + METADATA_CHUNK_BYTES * _units(marker) * _world(marker)


def open_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check what a checkpoint directory holds before anything in it is read, and return
    its marker: the directory is not a link (:func:`read_marker` refuses one), holds only
    regular files (no link, so nothing resolves outside it; no FIFO, device or
    directory), and its marker is within :data:`editrain.rundir.MARKER_MAX_BYTES`.

    Raises:
        CheckpointError: one line naming the entry.
    """
    marker = read_marker(ckpt)
    for p in sorted(ckpt.iterdir()):
        regular_size(p, what="checkpoint file")  # a link, FIFO or directory: refused
    return marker


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
def first_failure(e: BaseException) -> BaseException:
    """What failed inside DCP's ``CheckpointException`` (a ``BaseException`` holding each
    rank's exception and traceback): an editrain error raised on purpose by any rank, else
    the lowest rank's; any other exception itself."""
    failures = [f[0] if isinstance(f, tuple) else f
                for _, f in sorted(getattr(e, "failures", {}).items())]
    failures = [f for f in failures if isinstance(f, BaseException)]
    ours = [f for f in failures if isinstance(f, CheckpointError)]
    return (ours or failures or [e])[0]


def saved_tensors(checkpoint_id: str | os.PathLike, key: str) -> dict[str, torch.Tensor]:
    """What a DCP checkpoint holds under ``key``: each tensor's flattened key (without the
    leading ``key.``) -> an empty tensor on the meta device with the saved shape and dtype.

    This is what a state's owner needs to build the tensors ``dcp.load`` fills, when what
    was saved depends on when it was saved (see ``SyncEngine.state_dict_template``).

    Args:
        checkpoint_id: the checkpoint directory.
        key: the top-level key of the state dict that holds the state.
    """
    return _tensors_under(read_metadata(checkpoint_id), key)


def _tensors_under(metadata: Metadata, key: str) -> dict[str, torch.Tensor]:
    """:func:`saved_tensors` of metadata already read."""
    prefix = f"{key}."
    return {
        name[len(prefix):]: torch.empty(tuple(md.size), dtype=md.properties.dtype,
                                        device="meta")
        for name, md in metadata.state_dict_metadata.items()
        if name.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


# ---------------------------------------------------------------------------- plain JSON
# The optimizer's non-tensor state goes to JSON with its Python types kept: ``betas`` is a
# tuple, a non-finite float is a float, dict keys may be ints. Every JSON object is a tag
# (``{"tuple": [...]}``, ``{"dict": {...}}`` with string keys, ``{"items": [[k, v], ...]}``
# with others, ``{"float": "inf"}``), so decoding is unambiguous and builds nothing else.
def to_typed_json(value: Any, where: str = "value") -> Any:
    """``value`` (None, bool, int, float, str, and lists, tuples and dicts of them) as JSON
    data that :func:`from_typed_json` turns back into an equal value of the same types.

    Args:
        value: the plain data.
        where: what to name in an error.

    Raises:
        TypeError: ``value`` holds anything else (a tensor, an object).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list):
        return [to_typed_json(v, where) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [to_typed_json(v, where) for v in value]}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {"dict": {k: to_typed_json(v, f"{where}.{k}") for k, v in value.items()}}
    if isinstance(value, Mapping):
        return {"items": [[to_typed_json(k, where), to_typed_json(v, f"{where}.{k}")]
                          for k, v in value.items()]}
    raise TypeError(f"{where}: a {type(value).__name__} cannot be stored as plain data")


def from_typed_json(data: Any) -> Any:
    """Inverse of :func:`to_typed_json`.

    Args:
        data: parsed JSON.

    Raises:
        ValueError: ``data`` is not what :func:`to_typed_json` writes.
    """
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_typed_json(v) for v in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, body), = data.items()
        if tag == "tuple" and isinstance(body, list):
            return tuple(from_typed_json(v) for v in body)
        if tag == "dict" and isinstance(body, dict):
            return {k: from_typed_json(v) for k, v in body.items()}
        if tag == "items" and isinstance(body, list) and all(
                isinstance(kv, list) and len(kv) == 2 for kv in body):
            return {from_typed_json(k): from_typed_json(v) for k, v in body}
        if tag == "float" and body in ("inf", "-inf", "nan"):
            return float(body)
    raise ValueError(f"not typed JSON: {str(data)[:80]}")


def _split_optim(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer state dict (``get_optimizer_state_dict``) as (its tensors, for DCP;
    everything else: ``param_groups``, non-tensor per-parameter values, for JSON)."""
    tensors: dict[str, Any] = {"state": {}}
    plain: dict[str, Any] = {"state": {}}
    for key, value in state.items():
        if key != "state":
            plain[key] = value
            continue
        for fqn, entries in value.items():
            for name, v in entries.items():
                side = tensors if torch.is_tensor(v) else plain
                side["state"].setdefault(fqn, {})[name] = v
    return tensors, plain


def _merge_optim(tensors: dict[str, Any], plain: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`_split_optim`."""
    merged = dict(tensors, state={k: dict(v) for k, v in tensors.get("state", {}).items()})
    for key, value in plain.items():
        if key != "state":
            merged[key] = value
            continue
        for fqn, entries in value.items():
            merged["state"].setdefault(fqn, {}).update(entries)
    return merged


def _require_tensors(tree: Any, where: str) -> None:
    """Every leaf of a tree DCP will save is a tensor (DCP pickles anything else, and
    loading refuses pickled items)."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            _require_tensors(value, f"{where}.{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            _require_tensors(value, f"{where}.{i}")
    elif not torch.is_tensor(tree):
        raise TypeError(f"checkpoint: {where} is a {type(tree).__name__}; DCP items must be "
                        "tensors (plain data belongs in the rank JSON)")


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
                    before_commit: Any = None, lineage: dict[str, Any] | None = None,
                    progress: float | None = None) -> Saved:
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
        progress: A-EDiT's progress in synchronous steps, which ``step`` labels rounded;
            stored in the marker for the readers that compare it
            (:func:`editrain.rundir.checkpoint_progress`). None: the label is the step.
    """
    t0 = time.perf_counter()
    rank = dist.get_rank()
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rank == 0:
        if tmp.is_symlink():
            tmp.unlink()  # not followed: only the link goes
        elif tmp.exists():
            shutil.rmtree(tmp)  # a previous attempt that died half-way
        make_dir(root, root=Path(run_dir))
        make_dir(tmp, root=Path(run_dir))
    dist.barrier()
    # The model's state dict first: it reshards FSDP modules, whose registered parameters
    # are then the ones the optimizer holds (the optimizer's state dict maps them by id).
    model_state = get_model_state_dict(model)
    optim, optim_plain = _split_optim(get_optimizer_state_dict(model, _base(optimizer)))
    state = {
        f"replica{replica}": {"model": model_state, "optim": optim},
        ENGINE_KEY: engine.state_dict(),
    }
    _require_tensors(state, "state")
    # The writer named, not found from the path: DCP would import fsspec to try its writer
    # too (0.1 s and more per process where fsspec is installed); a run directory is local.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
    if OPTIM_KEY in rank_state:
        raise ValueError(f"rank_state may not use the key {OPTIM_KEY!r} (the optimizer's)")
    own = dict(rank_state)
    own[OPTIM_KEY] = to_typed_json(optim_plain, "optimizer state")
    write_atomic(rank_file(tmp, rank), json.dumps(own), root=run_dir, fsync=False)
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if rank == 0:
        lineage = lineage or {}
        marker = dict(meta, step=step, saved_at=time.time(), run_id=lineage.get("run_id"),
                      branch=lineage.get("branch"))
        if progress is not None:
            marker["progress"] = float(progress)
        write_atomic(tmp / MARKER, json.dumps(marker, indent=1), root=run_dir)
        # A checkpoint of the same label (the final one at a periodic one's step) is
        # replaced only once the new one is complete on disk.
        old = final.with_name(final.name + ".old")
        if final.is_symlink():
            final.unlink()  # someone's link in editrain's place: never written through
        if final.exists():
            if old.is_symlink():
                old.unlink()
            elif old.exists():
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
    ``written`` and the one(s) this job resumed from are never deleted.

    Returns:
        The deleted checkpoint directories.
    """
    lineage = lineage or {}
    branch = lineage.get("branch")
    protected = {written.resolve()}
    protected |= {Path(p).resolve() for p in lineage.get("resumed_from") or []}
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


_STREAM_IDS: dict[tuple, dict[str, Any]] = {}
"""Token stream identities of memory-mapped splits, by file (computed once per process)."""
_FULL_DIGEST_BYTES = 64 << 20
_SAMPLE_BYTES = 1 << 20


def stream_identity(tokens: np.ndarray) -> dict[str, Any]:
    """What identifies a train split's token stream, which a saved data position indexes.

    Args:
        tokens: the split (``TokenData.train``).

    Returns:
        ``tokens`` (the count) and ``sha256``: of all its bytes up to 64 MiB, else of 1 MiB
        samples at 65 evenly spaced offsets (a bounded read at every start; another corpus
        or tokenizer changes the tokens everywhere, so samples see it).
    """
    raw = np.ascontiguousarray(tokens).reshape(-1).view(np.uint8)
    filename = getattr(tokens, "filename", None)
    key = (str(filename), getattr(tokens, "offset", 0), raw.nbytes, str(tokens.dtype))
    if filename is not None and key in _STREAM_IDS:
        return _STREAM_IDS[key]
    h = hashlib.sha256(f"{tokens.dtype.str}:{len(tokens)}".encode())
    if raw.nbytes <= _FULL_DIGEST_BYTES:
        h.update(raw)
    else:
        for i in range(65):
            start = (raw.nbytes - _SAMPLE_BYTES) * i // 64
            h.update(raw[start:start + _SAMPLE_BYTES])
    identity = {"tokens": int(len(tokens)), "sha256": h.hexdigest()}
    if filename is not None:
        _STREAM_IDS[key] = identity
    return identity


def run_meta(cfg: Any, vocab_size: int, topology: tuple[int, ...] | None = None,
             data: Any = None) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (compared on resume).

    Args:
        cfg: the run's configuration.
        vocab_size: the tokenizer's vocabulary size.
        topology: ``(replicas, shards[, tp])`` of the job, or None (not known yet).
        data: the prepared corpus (``TokenData``), or None: then the token stream is not
            recorded (nor compared).
    """
    import dataclasses

    from editrain.config import model_config, to_dict
    from editrain.config.model import hf_option, hf_source
    from editrain.config.size import hf_layers
    from editrain.models.hf import read_hf_config

    source = hf_source(cfg)
    if source:
        model = dict(read_hf_config(source, hf_option(cfg)))
        model.pop("transformers_version", None)
        num_units = hf_layers(model) + 1
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
        "pp_size": int(getattr(getattr(cfg, "dist", None), "pp_size", 1)),
        "pp_stages_per_rank": int(getattr(getattr(cfg, "dist", None),
                                          "pp_stages_per_rank", 1)),
        "seq_len": int(cfg.train.seq_len),
        "train_seed": int(cfg.train.seed),
        "train_data": stream_identity(data.train) if data is not None else None,
        "config": to_dict(cfg),
    }


def preflight_resume(resume: str | Path, cfg: Any, vocab_size: int, data: Any = None) -> Path:
    """Find the checkpoint and check it fits this run and is complete, before any worker
    starts: the marker against this run (:func:`check_compatible`), then the files
    (:func:`check_files`).

    Args:
        resume: ``--resume`` (a run directory or a checkpoint directory).
        cfg: this run's configuration.
        vocab_size: its tokenizer's vocabulary size.
        data: its prepared corpus (``TokenData``), to compare the token stream; None skips
            that comparison.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: the first problem found, in one line naming the file or option
            (several incompatibilities: one line each).
    """
    ckpt = resolve_resume(resume)
    marker = open_checkpoint(ckpt)
    problems = check_compatible(marker, run_meta(cfg, vocab_size, data=data))
    nothing_left = steps_left_problem(marker, cfg)
    if nothing_left:
        problems.append(nothing_left)
    if problems:
        raise _incompatible(ckpt, problems)
    check_files(ckpt, marker)
    return ckpt


def steps_left_problem(marker: dict[str, Any], cfg: Any) -> str | None:
    """Why a ``--resume`` of the checkpoint whose marker is ``marker`` would train nothing
    (``train.steps`` not beyond its step: it evaluated again, wrote that step's checkpoint
    again and repeated its rows in the metrics), or None. A-EDiT's checkpoints are labelled
    by the run's progress rounded to a step (its budget is ``train.steps`` of that
    progress), so the progress itself is compared where the marker records it: a progress
    of 7.5, labelled 8, still has half a step left under ``train.steps`` 8. Checked by
    the launcher before any worker starts (:func:`preflight_resume`) and by every rank of a
    torchrun job before the run directory is claimed
    (:meth:`editrain.launch.run_dir.RunDirClaim.join`); not for a worker's restart, which
    resumes the latest checkpoint of a run that may have finished."""
    step, steps = marker.get("step"), cfg.train.steps
    if not isinstance(step, int):
        return None
    progress = checkpoint_progress(marker)
    if steps <= progress:
        at = f"step {step}" if progress == step else f"progress {progress:g}"
        return (f"train.steps: {steps} is not beyond the checkpoint's {at}, so the "
                f"resumed run would train nothing; give a larger --train.steps")
    return None


def refuse_no_steps_left(ckpt: Path, cfg: Any) -> None:
    """:func:`steps_left_problem` of the checkpoint ``ckpt``, raised.

    Raises:
        CheckpointError: ``train.steps`` is not beyond the checkpoint's step.
    """
    problem = steps_left_problem(open_checkpoint(ckpt), cfg)
    if problem:
        raise _incompatible(ckpt, [problem])


def _incompatible(ckpt: Path, problems: list[str]) -> CheckpointError:
    if len(problems) == 1:
        return CheckpointError(f"cannot resume from {shown(ckpt)}: {problems[0]}")
    return CheckpointError(f"cannot resume from {shown(ckpt)}:\n  " + "\n  ".join(problems))


def _decodable(marker: dict[str, Any]) -> Callable[[str], bool] | None:
    """Which non-tensor DCP items loading may decode (safely): format 2's
    ``param_groups``; none in later formats."""
    if marker.get("format", 1) == 2:
        return lambda fqn: _LEGACY_BYTES.fullmatch(fqn) is not None
    return None


def _check_items(ckpt: Path, marker: dict[str, Any], metadata: Metadata) -> None:
    """Refuse non-tensor items that loading would not decode, and check the storage."""
    decodable = _decodable(marker) or (lambda fqn: False)
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata) and not decodable(fqn):
            raise CheckpointError(
                f"{shown(ckpt / '.metadata')}: refusing non-tensor item {fqn}: editrain's format "
                f"{marker.get('format', 1)} checkpoints hold tensors only there, and reading "
                "it would unpickle it")
    check_storage(ckpt, metadata)


_COUNT = Int(0, 2**53)
_SECONDS = Num(0.0, 1e12)
_MT_STATE = 625
"""A Mersenne Twister state as ``random.getstate()[1]``: 624 words and a position."""
_CPU_RNG_BYTES = 5056
"""``torch.get_rng_state()``'s size (the Mersenne Twister and its normal-sample cache)."""


def _b64_of(size: int):
    def ok(text: str) -> bool:
        try:
            return len(base64.b64decode(text, validate=True)) == size
        except ValueError:
            return False
    return ok


RANK_STATE_SCHEMA = Obj({
    "step": _COUNT, "next_eval": _COUNT, "next_ckpt": _COUNT, "last_eval": _COUNT,
    "finished": Bool(), "wall_time_s": _SECONDS, "off_train_s": _SECONDS,
    "data": Obj({
        "epoch": Int(0, 2**40), "position": _COUNT, "rank": Int(0, 1 << 20),
        "world_size": Int(1, 1 << 20), "seed": Int(-(2**63), 2**64),
        "num_windows": Int(1, 2**53), "seq_len": Int(1, 1 << 30),
        "consumed_layouts": List(List(max_len=2), 1 << 16),
    }, required=("epoch", "position", "rank", "world_size", "seed", "num_windows")),
    "rng": Obj({"cpu": Str(8192, ok=_b64_of(_CPU_RNG_BYTES),
                           expect=f"base64 of {_CPU_RNG_BYTES} bytes is expected"),
                "cuda": Str(1 << 16)}, required=("cpu",)),
    "sim_rng": List(Int(0, 2**32 - 1), length=_MT_STATE),
    "tp": Int(0, 1 << 20), "stage": Int(0, 1 << 20), "ft_committed": _COUNT,
    "tokens": _COUNT,
}, required=("step", "next_eval", "next_ckpt", "last_eval", "finished", "wall_time_s",
             "data", "rng", "sim_rng"))
"""What a rank's JSON must hold (the trainer's ``rank_state``; the optimizer's entry is
checked by decoding it): every counter an integer in range (never a bool, a float, NaN or
a string), every time a finite non-negative number."""


def _every(marker: Mapping[str, Any], section: str, key: str) -> int:
    """``[section] key`` of the configuration the checkpoint was saved with (0 if absent)."""
    value = ((marker.get("config") or {}).get(section) or {}).get(key)
    return value if type(value) is int and value > 0 else 0


def _rank_state_problem(state: dict[str, Any], marker: Mapping[str, Any]) -> str | None:
    """What makes a rank's counters inconsistent with its checkpoint's marker, or None."""
    label = marker["step"]
    step = state["step"]
    replicas = (marker.get("topology") or [1])[0]
    if marker.get("method") == "aedit":
        # A-EDiT labels checkpoints by progress; a replica runs at its own pace around it.
        if step > 64 * max(replicas, 1) * (label + 1):
            return (f"field 'step': {step} is far beyond the checkpoint's progress {label} "
                    f"for {replicas} replicas")
    elif step != label:
        return f"field 'step': {step}, but the checkpoint is of step {label}"
    if state["last_eval"] > step:
        return f"field 'last_eval': {state['last_eval']} is after the step {step}"
    for key, section, option in (("next_ckpt", "checkpoint", "every"),
                                 ("next_eval", "train", "eval_every")):
        every = _every(marker, section, option)
        if every and state[key] > label + every + 1:
            return (f"field {key!r}: {state[key]} is beyond the next one due after step "
                    f"{label} ({section}.{option} = {every})")
    data = state["data"]
    if data["position"] > data["num_windows"]:
        return (f"field 'data.position': {data['position']} is beyond the "
                f"{data['num_windows']} windows of the stream")
    seq_len = marker.get("seq_len")
    if "seq_len" in data and seq_len is not None and data["seq_len"] != seq_len:
        return f"field 'data.seq_len': {data['seq_len']}, the marker's train.seq_len {seq_len}"
    if state["sim_rng"][-1] > _MT_STATE - 1:
        return f"field 'sim_rng': position {state['sim_rng'][-1]} is beyond {_MT_STATE - 1}"
    return None


def _read_rank_json(path: Path, fmt: int, marker: Mapping[str, Any]) -> dict[str, Any]:
    """A rank's plain state: a regular file within :func:`rank_json_cap`, checked against
    :data:`RANK_STATE_SCHEMA` and the marker, and (format 3 on) its optimizer entry checked
    decodable. ``fmt`` 0: the marker's format."""
    fmt = fmt or int(marker.get("format", 1))
    try:
        state = read_json(path, max_bytes=rank_json_cap(marker), schema=Obj(),
                          what="rank state")
    except CheckpointError as e:  # read_json's refusal, which names the file first
        why = str(e).removeprefix(f"{shown(path)}: ")
        raise CheckpointError(f"{shown(path)}: missing or corrupt rank state: {why}") from None
    if fmt >= 3:
        try:
            optim = from_typed_json(state[OPTIM_KEY])
            if not isinstance(optim, dict) or not isinstance(optim.get("param_groups"), list):
                raise ValueError("no param_groups")
        except (KeyError, ValueError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{shown(path)}: corrupt rank state: its {OPTIM_KEY!r} entry (the "
                                  f"optimizer's param_groups) is missing or malformed "
                                  f"({quote(str(e))})") from None
        state[OPTIM_KEY] = optim
    RANK_STATE_SCHEMA.check(state, shown(path), "", CheckpointError)
    problem = _rank_state_problem(state, marker)
    if problem:
        raise CheckpointError(f"{shown(path)}: {problem}")
    return state


def check_files(ckpt: Path, marker: dict[str, Any] | None = None) -> None:
    """Check that a complete checkpoint's files are there, whole and safe to load.

    ``.metadata`` unpickles with the allowlist; it holds no non-tensor item that loading
    would refuse (format 2's ``param_groups`` items are decoded now, safely); every item
    lies within its ``.distcp`` file; the JSON of every rank of the saving topology parses.

    Args:
        ckpt: the checkpoint directory.
        marker: its :func:`read_marker` (read when None).

    Raises:
        CheckpointError: the first problem, in one line naming the file.
    """
    marker = open_checkpoint(ckpt) if marker is None else marker
    fmt = int(marker.get("format", 1))
    metadata = read_metadata(ckpt, max_bytes=metadata_cap(marker))
    _check_items(ckpt, marker, metadata)
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            read_bytes_item(ckpt, metadata, fqn)  # refuses anything but plain data
    topology = marker.get("topology")
    if topology:
        ranks = range(math.prod(int(n) for n in topology))
    else:  # a marker without a topology: whatever ranks wrote, rank 0 at least
        ranks = saved_ranks(ckpt) or [0]
    for r in ranks:
        _read_rank_json(rank_file(ckpt, r), fmt, marker)
    _check_engine_states(ckpt, marker, metadata)


_ENGINE_RANK = re.compile(rf"{ENGINE_KEY}\.ranks\.(rank\d{{5}})")
_TORCH_SAVE_BYTES = 4096
"""What ``torch.save`` adds around a small tensor's bytes (its zip container), at most."""


def _check_engine_states(ckpt: Path, marker: Mapping[str, Any], metadata: Metadata) -> None:
    """Every rank's plain engine state in the checkpoint (the ``engine.ranks.rankNNNNN``
    tensors: JSON text as bytes), read without DCP and checked as the engine will check it
    when it unpacks it (:data:`editrain.sync.state.PLAIN_STATE_SCHEMA`, the layout
    version), so a hostile counter is refused before any worker starts rather than in
    every worker."""
    cap = rank_json_cap(marker) + _TORCH_SAVE_BYTES
    for fqn in metadata.state_dict_metadata:
        m = _ENGINE_RANK.fullmatch(fqn)
        if m is None:
            continue
        state = read_plain_state(read_tensor_item(ckpt, metadata, fqn, cap), m.group(1))
        if state["version"] != ENGINE_STATE_VERSION:
            raise CheckpointError(
                f"{shown(ckpt / '.metadata')}: item {fqn}: the sync engine's state is version "
                f"{state['version']}; this editrain reads version {ENGINE_STATE_VERSION}")


def _tp_size(topology: list[int] | None) -> int:
    """The tp size of a ``(replicas, shards[, tp])`` or ``(replicas, stages, shards, tp)``
    topology."""
    if topology and len(topology) == 4:
        return int(topology[3])
    return int(topology[2]) if topology and len(topology) > 2 else 1


def _pp_size(topology: list[int] | None) -> int:
    """The pipeline stages of a topology (only a 4-D one has more than one)."""
    return int(topology[1]) if topology and len(topology) == 4 else 1


def replicas_and_shards(topology: list[int] | tuple[int, ...]) -> tuple[int, int]:
    """``(replicas, shard_size)`` of a ``(R, S)``, ``(R, S, T)`` or, with pipeline
    stages, ``(R, P, S, T)`` topology."""
    if len(topology) == 4:
        return int(topology[0]), int(topology[2])
    return int(topology[0]), int(topology[1])


def stage_head_rank(topology: list[int] | tuple[int, ...], stage: int) -> int:
    """The first rank of ``stage`` in replica 0 of ``topology`` (0 without stages): whose
    plain state an elastic resume reads for that stage."""
    if len(topology) != 4:
        return 0
    return stage * int(topology[2]) * int(topology[3])


def check_compatible(marker: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """Differences that make a checkpoint unusable for this run: format, model shape,
    method, tp size, and what the saved data positions index (sequence length, data seed,
    the train split's tokens). A field the marker lacks (an older editrain's) is not
    compared.

    Args:
        marker: the checkpoint's :func:`read_marker`.
        meta: this run's :func:`run_meta`.

    Returns:
        One line per problem, each naming the option, each value spelled as the markers
        hold it (JSON: ``null``, ``true``, ``"edit"``).
    """
    problems = []
    if marker.get("format", 1) not in READ_FORMATS:
        problems.append(f"format: checkpoint has format {marker.get('format', 1)}, this "
                        f"editrain reads formats {', '.join(map(str, READ_FORMATS))} (start "
                        "a new run)")
    for key in ("method", "vocab_size", "num_units"):
        old, new = marker.get(key), meta.get(key)
        if old != new:
            problems.append(f"{key}: checkpoint has {quote(old)}, this run has {quote(new)}")
    for key, size_of, what in (("tp_size", _tp_size, "the tp size"),
                               ("pp_size", _pp_size, "the pipeline stages")):
        old = marker.get(key, size_of(marker.get("topology")))
        new = meta.get(key, size_of(meta.get("topology")))
        if old != new:
            problems.append(f"dist.{key}: checkpoint has {old}, this run has {new} (a "
                            f"checkpoint resumes with {what} it was saved with; replicas "
                            "and shards may change)")
    old_v, new_v = marker.get("pp_stages_per_rank", 1), meta.get("pp_stages_per_rank", 1)
    if old_v != new_v:
        problems.append(f"dist.pp_stages_per_rank: checkpoint has {old_v}, this run has "
                        f"{new_v} (each rank's blocks and engine state follow the chunks it "
                        "holds)")
    if _fault_tolerance(marker) == "torchft" and _fault_tolerance(meta) != "torchft":
        problems.append("dist.fault_tolerance: the checkpoint is one replica group's of a "
                        "--ft run (the data positions it holds are that group's alone); "
                        "resume that run with --ft (editrain train --ft --resume RUN_DIR): "
                        "a --ft run does not resume as a plain job")
    old_model, new_model = marker.get("model") or {}, meta.get("model") or {}
    for key in sorted(set(old_model) | set(new_model)):
        if old_model.get(key) != new_model.get(key):
            problems.append(f"model.{key}: checkpoint has {quote(old_model.get(key))}, "
                            f"this run has {quote(new_model.get(key))}")
    problems += _stream_problems(marker, meta)
    return problems


def _fault_tolerance(record: dict[str, Any]) -> str | None:
    """``dist.fault_tolerance`` of a marker's or a run's configuration (None: not recorded)."""
    dist = (record.get("config") or {}).get("dist")
    return dist.get("fault_tolerance") if isinstance(dist, dict) else None


def _stream_problems(marker: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """The saved data positions index windows of ``seq_len`` tokens of the train split in
    an order drawn from the seed: a resume needs all three unchanged (exact and elastic)."""
    problems = []
    old, new = marker.get("seq_len"), meta.get("seq_len")
    if old is not None and new is not None and old != new:
        problems.append(f"train.seq_len: checkpoint has {old}, this run has {new} (the saved "
                        "data positions count windows of the checkpoint's length)")
    old, new = marker.get("train_seed"), meta.get("train_seed")
    if old is not None and new is not None and old != new:
        problems.append(f"train.seed: checkpoint has {old}, this run has {new} (the saved "
                        "data positions follow the order that seed shuffles)")
    old, new = marker.get("train_data") or {}, meta.get("train_data") or {}
    if old and new and (old.get("tokens"), old.get("sha256")) != (new.get("tokens"),
                                                                   new.get("sha256")):
        what = (f"{old.get('tokens')} tokens, this run's {new.get('tokens')}"
                if old.get("tokens") != new.get("tokens") else
                f"{old.get('tokens')} tokens, as does this run's, but other ones")
        problems.append(f"data: the checkpoint's train split has {what} (another data.path, "
                        "data.max_bytes, data.tokenizer, data.vocab_size or split setting); "
                        "its saved data positions would index another token stream")
    return problems


def load_checkpoint(ckpt: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    engine: Any, replica: int, rank: int, meta: dict[str, Any],
                    stage: int = 0) -> tuple[dict[str, Any] | None, dict[str, Any]]:
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
        stage: this rank's pipeline stage (an elastic resume reads the non-tensor optimizer
            state of the same stage's first rank of replica 0).

    Returns:
        ``(rank_state or None, marker)``.

    Raises:
        CheckpointError: the checkpoint does not fit this run, or its files are incomplete,
            corrupt, or hold a non-tensor DCP item that loading would have to unpickle
            (only format 2's ``param_groups`` items are decoded, safely).
    """
    marker = open_checkpoint(ckpt)
    problems = check_compatible(marker, meta)
    if problems:
        raise _incompatible(ckpt, problems)
    fmt = int(marker.get("format", 1))
    # Checked here too: a restart after a worker died resumes without the preflight.
    metadata = read_metadata(ckpt, max_bytes=metadata_cap(marker))
    _check_items(ckpt, marker, metadata)
    same = marker.get("topology") == meta.get("topology")
    src = replica if same else 0
    # Format 3: the optimizer's non-tensor state is in the JSON of a rank of the replica
    # read (elastic: replica 0, whose rank 0 is the saving job's rank 0).
    head = 0 if same else stage_head_rank(marker.get("topology") or [], stage)
    own = _read_rank_json(rank_file(ckpt, rank if same else head), fmt, marker)
    model_state = get_model_state_dict(model)  # first: see save_checkpoint
    live = get_optimizer_state_dict(model, _base(optimizer))
    optim = _split_optim(live)[0] if fmt >= 3 else live
    opts = StateDictOptions(strict=True)
    try:
        state: dict[str, Any] = {
            f"replica{src}": {"model": model_state, "optim": optim},
            ENGINE_KEY: engine.state_dict_template(_tensors_under(metadata, ENGINE_KEY)),
        }
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt, metadata_cap(marker)),
                 planner=SafeLoadPlanner(_decodable(marker)))
    except CheckpointError:
        raise
    except dcp.CheckpointException as e:  # a BaseException, holding each rank's failure
        failure = first_failure(e)
        if isinstance(failure, CheckpointError):
            raise CheckpointError(str(failure)) from None
        raise CheckpointError(f"{shown(ckpt)}: cannot read checkpoint data: {failure!r}") from e
    except Exception as e:
        # Corrupt or truncated files: say so, never continue silently.
        raise CheckpointError(f"{shown(ckpt)}: cannot read checkpoint data: {e!r}") from e
    optim = state[f"replica{src}"]["optim"]
    if fmt >= 3:
        optim = _merge_optim(optim, own[OPTIM_KEY])
    set_model_state_dict(model, state[f"replica{src}"]["model"], options=opts)
    set_optimizer_state_dict(model, _base(optimizer), optim, options=opts)
    if optimizer is not _base(optimizer):
        # Loading replaced the base optimizer's param_groups list, which a wrapper (WSAM)
        # shares with it (the LR schedule writes the wrapper's): its own load_state_dict
        # shares them again. The state is the one just loaded, so nothing else changes.
        optimizer.load_state_dict(_base(optimizer).state_dict())
    if engine.load_state_dict(state[ENGINE_KEY]) != (not same):
        raise CheckpointError(f"{shown(ckpt)}: the engine state and the marker disagree on "
                              "the topology that saved the checkpoint")
    if not same:
        return None, marker
    own.pop(OPTIM_KEY, None)
    return own, marker
