"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, atomic, exact, elastic.

Layout of one checkpoint directory ``RUN_DIR/checkpoints/step_00000100/``::

    .metadata, __*.distcp     DCP tensor data (every rank writes its own shards)
    rank_00000.json ...       per-rank plain data: data position, RNG states, counters
    editrain.json             topology, config, step, save time; written LAST = "complete"

What the tensors hold, under stable keys:

* ``replica{i}.model`` / ``replica{i}.optim``: replica ``i``'s live parameters and inner
  optimizer state (replicas differ between syncs, so each is saved);
* ``global.anchor.<fqn>`` / ``global.outer.<fqn>.<state>``: the anchors (the global model)
  and the outer optimizer state, identical on every replica, saved once, as DTensors laid
  out like the parameters, so that they re-shard to any topology (elastic resume).

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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from editrain.errors import CheckpointError

log = logging.getLogger("editrain")

MARKER = "editrain.json"
CKPT_DIR = "checkpoints"


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
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")
            and not p.name.endswith(".tmp") and (p / MARKER).is_file()]
    return sorted(done, key=lambda p: p.name)


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


# ---------------------------------------------------------------------------- tensors
def _param_fqns(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _as_param_layout(flat: torch.Tensor, unit: Any, device: torch.device,
                     fqns: dict[int, str]) -> dict[str, torch.Tensor]:
    """Split a unit's flat local vector into per-parameter tensors laid out like the
    parameters (DTensors on the shard mesh), so DCP can re-shard them."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    flat = flat.to(device)
    for p, n in zip(unit.params, unit.numels):
        local_shape = p.to_local().shape if isinstance(p, DTensor) else p.shape
        piece = flat[offset:offset + n].view(local_shape)
        offset += n
        if isinstance(p, DTensor):
            piece = DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
        out[fqns[id(p)]] = piece
    return out


def _from_param_layout(tensors: dict[str, torch.Tensor], unit: Any,
                       fqns: dict[int, str]) -> torch.Tensor:
    parts = []
    for p in unit.params:
        t = tensors[fqns[id(p)]]
        t = t.to_local() if isinstance(t, DTensor) else t
        parts.append(t.reshape(-1).float())
    return torch.cat(parts) if parts else torch.zeros(0)


def _outer_layout(unit: Any) -> dict[str, str]:
    """Kinds of the outer optimizer's state entries: "vector" (per element) or "scalar"."""
    if unit.outer is None or not unit.outer.state:
        return {}
    state = next(iter(unit.outer.state.values()))
    return {k: ("vector" if torch.is_tensor(v) and v.numel() == unit.numel and v.dim() > 0
                else "scalar") for k, v in state.items()}


def global_state(engine: Any, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """Anchors and outer state in parameter layout (identical on every replica)."""
    fqns = _param_fqns(model)
    out: dict[str, Any] = {"anchor": {}, "outer": {}}
    for unit in engine.units:
        if unit.anchor is None:
            continue
        out["anchor"].update(_as_param_layout(unit.anchor, unit, device, fqns))
        if unit.outer is None or not unit.outer.state:
            continue
        state = unit.outer.state[unit.anchor]
        for key, kind in _outer_layout(unit).items():
            if kind == "vector":
                for fqn, t in _as_param_layout(state[key], unit, device, fqns).items():
                    out["outer"].setdefault(fqn, {})[key] = t
            else:
                v = state[key]
                out["outer"].setdefault(f"unit{unit.index}", {})[key] = (
                    v.detach().clone() if torch.is_tensor(v) else torch.tensor(v))
    return out


def load_global_state(engine: Any, model: torch.nn.Module, gstate: dict[str, Any],
                      layouts: dict[str, dict[str, str]]) -> None:
    """Rebuild anchors and outer state from :func:`global_state` tensors (any topology)."""
    fqns = _param_fqns(model)
    for unit in engine.units:
        if not unit.params or fqns[id(unit.params[0])] not in gstate["anchor"]:
            continue
        anchor = _from_param_layout(gstate["anchor"], unit, fqns)
        unit.load_state_dict({"anchor": anchor, "outer": None})
        layout = layouts.get(str(unit.index), {})
        if unit.outer is None or not layout:
            continue
        state: dict[str, Any] = {}
        for key, kind in layout.items():
            if kind == "vector":
                per_param = {fqns[id(p)]: gstate["outer"][fqns[id(p)]][key] for p in unit.params}
                state[key] = _from_param_layout(per_param, unit, fqns).to(unit.anchor.device)
            else:
                state[key] = gstate["outer"][f"unit{unit.index}"][key].clone()
        unit.outer.state[unit.anchor] = state


def _global_template(engine: Any, model: torch.nn.Module, device: torch.device,
                     layouts: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Empty tensors with the current topology's layout, for DCP to load into."""
    fqns = _param_fqns(model)
    out: dict[str, Any] = {"anchor": {}, "outer": {}}
    for unit in engine.units:
        zeros = torch.zeros(unit.numel, dtype=torch.float32)
        out["anchor"].update(_as_param_layout(zeros, unit, device, fqns))
        for key, kind in layouts.get(str(unit.index), {}).items():
            if kind == "vector":
                for fqn, t in _as_param_layout(zeros.clone(), unit, device, fqns).items():
                    out["outer"].setdefault(fqn, {})[key] = t
            else:
                out["outer"].setdefault(f"unit{unit.index}", {})[key] = torch.zeros(())
    return out


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
                    before_commit: Any = None) -> Saved:
    """Collective: every rank of the world calls it at the same point of training.

    Args:
        run_dir: the run directory.
        step: the label (the step or progress counter the checkpoint is taken at).
        model, optimizer, engine: the live objects.
        replica: this rank's replica index.
        rank_state: this rank's plain-data state (data position, RNG, counters).
        meta: plain data describing the run (topology, config), stored in the marker.
        keep: how many complete checkpoints to keep.
        before_commit: optional callable run after the data is written and before the
            checkpoint is marked complete (fault-injection tests kill a worker there).
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
    device = engine.device
    state = {
        f"replica{replica}": {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, _base(optimizer)),
        },
        "global": global_state(engine, model, device),
    }
    dcp.save(state, checkpoint_id=str(tmp))
    (tmp / f"rank_{rank:05d}.json").write_text(json.dumps(rank_state))
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if rank == 0:
        marker = dict(meta, step=step, saved_at=time.time(),
                      outer_layouts={str(u.index): _outer_layout(u) for u in engine.units})
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    return Saved(final, time.perf_counter() - t0, size)


def _base(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that owns the state (WSAM wraps a base optimizer)."""
    return getattr(optimizer, "base_optimizer", optimizer)


def run_meta(cfg: Any, vocab_size: int, topology: tuple[int, int] | None = None
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
        "model": model,
        "method": cfg.sync.method,
        "vocab_size": vocab_size,
        "num_units": num_units,
        "topology": list(topology) if topology else None,
        "config": to_dict(cfg),
    }


def preflight_resume(resume: str | Path, cfg: Any, vocab_size: int) -> Path:
    """Find the checkpoint and check it fits this run, before any worker starts."""
    ckpt = resolve_resume(resume)
    problems = check_compatible(read_marker(ckpt), run_meta(cfg, vocab_size))
    if problems:
        raise CheckpointError(f"cannot resume from {ckpt}:\n  " + "\n  ".join(problems))
    return ckpt


def check_compatible(marker: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """Differences that make a checkpoint unusable for this run (model shape, method)."""
    problems = []
    for key in ("method", "vocab_size", "num_units"):
        old, new = marker.get(key), meta.get(key)
        if old != new:
            problems.append(f"{key}: checkpoint has {old!r}, this run has {new!r}")
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
    Different topology (elastic): every replica starts from the anchors (the global model)
    with replica 0's inner optimizer state; outer state is re-sharded; the returned rank
    state is None (the caller re-partitions the data and resets local counters).

    Returns:
        ``(rank_state or None, marker)``.
    """
    marker = read_marker(ckpt)
    problems = check_compatible(marker, meta)
    if problems:
        raise CheckpointError(f"cannot resume from {ckpt}:\n  " + "\n  ".join(problems))
    same = marker.get("topology") == meta.get("topology")
    src = replica if same else 0
    device = engine.device
    layouts = marker.get("outer_layouts", {})
    opts = StateDictOptions(strict=True)
    state: dict[str, Any] = {
        f"replica{src}": {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, _base(optimizer)),
        },
    }
    has_anchor = bool(marker.get("has_anchor"))
    if has_anchor:
        state["global"] = _global_template(engine, model, device, layouts)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt))
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        # Corrupt or truncated files: say so, never continue silently.
        raise CheckpointError(f"{ckpt}: cannot read checkpoint data: {e!r}") from e
    set_model_state_dict(model, state[f"replica{src}"]["model"], options=opts)
    set_optimizer_state_dict(model, _base(optimizer), state[f"replica{src}"]["optim"],
                             options=opts)
    if has_anchor:
        load_global_state(engine, model, state["global"], layouts)
    if not same:
        if has_anchor:
            # Elastic: every replica restarts from the global model (the anchors).
            with torch.no_grad():
                for unit in engine.units:
                    if unit.anchor is not None:
                        unit.write_back()
        return None, marker
    path = ckpt / f"rank_{rank:05d}.json"
    try:
        return json.loads(path.read_text()), marker
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}: missing or corrupt {path.name}: {e}") from None
