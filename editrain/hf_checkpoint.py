"""Hugging Face model directories in and out: ``model.init_from`` and ``editrain export``.

In: :func:`load_hf_weights` fills the parameters of the already-sharded model (FSDP2
DTensors, tensor-parallel pieces, a pipeline stage's blocks) from a directory's safetensors
through DCP's ``HuggingFaceStorageReader``. The state dict handed to ``dcp.load`` is keyed by
the Hugging Face names and its values are the model's own parameters, so every rank reads
only the slices it holds, and the whole model never exists on one rank.

Out: :func:`export_checkpoint` reads one model of an editrain checkpoint (the global model,
the anchors, by default; one replica's live weights on request) and writes a directory that
``transformers`` loads offline: ``config.json``, safetensors (shards and their index when
there are several), the run's tokenizer files and a short README naming the run.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from editrain.checkpoint import (
    CKPT_DIR,
    ENGINE_KEY,
    MARKER,
    first_failure,
    list_checkpoints,
    open_checkpoint,
    saved_tensors,
)
from editrain.errors import CheckpointError, RunDirError, spelled
from editrain.models.hf_dir import (
    INDEX_FILE,
    SINGLE_FILE,
    HFWeights,
    hf_int,
    hf_parameters,
    inspect_weights,
    listed_files_only,
    read_config,
    tokenizer_file,
)
from editrain.models.hf_llama import llama_config_to_hf, to_hf_name
from editrain.models.hf_tokens import (
    GENERATION_FILE,
    TOKEN_ID_KEYS,
    check_special_ids,
    config_special_ids,
    tokenizer_special_ids,
)
from editrain.models.llama import LlamaConfig
from editrain.paths import shown
from editrain.rundir import RECORD, RUN_FILES, group_index, replica_groups
from editrain.safe_io import (
    List,
    Obj,
    Str,
    check_no_links,
    make_dir,
    open_write,
    read_bytes,
    read_json,
    read_json_value,
    write_atomic,
)
from editrain.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from editrain.spawn import one_line
from editrain.sync.state import global_model_keys

__all__ = [
    "EXPORT_RECORD",
    "RUN_TOKENIZER_DIR",
    "Exported",
    "export_checkpoint",
    "find_checkpoint",
    "load_hf_weights",
    "ModelWeights",
    "marker_model",
    "model_weights",
    "save_run_tokenizer",
    "tied_aliases",
]

EXPORT_RECORD = "editrain_export.json"
"""Written into every export: the files it wrote (all a later export may replace)."""
RUN_TOKENIZER_DIR = "tokenizer"
"""``RUN_DIR/tokenizer/``: the run's tokenizer files, which an export copies."""
TOKENIZER_MAX_BYTES = 256 << 20
"""The largest tokenizer file an export copies (a large vocabulary's tokenizer.json is tens
of MB)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   GENERATION_FILE)
"""What a run keeps of its tokenizer's model directory and an export writes beside the
weights: the tokenizer, and how the model generates (its end-of-text ids: Llama 3 names
several there)."""
MODEL_IDS_FILE = "model_token_ids.json"
"""In ``RUN_DIR/tokenizer/`` where the run's tokenizer is its ``model.init_from``
directory's: that directory's ``config.json`` special-token ids, which an export writes
back (the tokenizer's own may differ: Llama 3 Instruct ends a turn with one token and
names three that end a text). Not copied into an export."""
CONFIG_MAX_BYTES = 16 << 20
"""The largest ``config.json`` / ``generation_config.json`` an export reads ids from."""


# ---------------------------------------------------------------------------- in
def load_hf_weights(model: nn.Module, path: str | Path, weights: HFWeights | None = None
                    ) -> int:
    """Load a Hugging Face directory's weights into ``model`` in place (collective: every
    rank of the default process group calls it, when there is one).

    Args:
        model: editrain's Llama or :class:`~editrain.models.hf.HFCausalLM`, or a pipeline
            stage of one, sharded or not; its parameters are overwritten.
        path: the directory (checked by :func:`editrain.models.hf_dir.inspect_weights`).
        weights: its inspection, if already made.

    Returns:
        The number of parameter tensors loaded on this rank.

    Raises:
        ValueError: a parameter the directory lacks or has in another shape (one line
            naming ``model.init_from``).
    """
    weights = weights or inspect_weights(path)
    params = hf_parameters(model)
    for name, p in params.items():
        info = weights.tensors.get(name)
        if info is None or tuple(info.shape) != tuple(p.shape):
            found = "no such tensor" if info is None else f"shape {list(info.shape)}"
            raise ValueError(f"model.init_from: {shown(path)} has {found} for {spelled(name)}, the model "
                             f"needs {list(p.shape)}")
    # The values are the parameters themselves (detached views of the same storage, and
    # for a DTensor its local shard): DCP copies each rank's slices straight into them.
    state = {name: p.detach() for name, p in params.items()}
    with torch.no_grad(), warnings.catch_warnings(), listed_files_only(weights) as where:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(where),
                 no_dist=not dist.is_initialized())
    return len(state)


def save_run_tokenizer(run_dir: str | Path, tokenizer_json: str | Path,
                       source_dir: str | Path | None = None,
                       model_dir: str | Path | None = None) -> Path:
    """Keep the run's tokenizer in ``RUN_DIR/tokenizer/`` for ``editrain export``.

    Args:
        run_dir: the run directory.
        tokenizer_json: the tokenizer the run uses (the token cache's copy).
        source_dir: the model directory the tokenizer came from (``data.tokenizer`` or
            ``model.init_from``), whose ``tokenizer_config.json``,
            ``special_tokens_map.json`` and ``generation_config.json`` are kept too; None:
            a trained BPE, whose ``tokenizer_config.json`` is written here.
        model_dir: the ``model.init_from`` directory, whose ``generation_config.json`` is
            kept in preference to ``source_dir``'s (the model's own generation settings),
            and whose special-token ids are kept (:data:`MODEL_IDS_FILE`) where it is
            ``source_dir``.
    """
    out = make_dir(Path(run_dir) / RUN_TOKENIZER_DIR, root=run_dir)

    def copy(src: Path, name: str) -> None:  # into the run directory: never through a link
        with open(src, "rb") as fin, open_write(out / name, "w", root=run_dir,
                                                binary=True) as fout:
            shutil.copyfileobj(fin, fout)

    copy(Path(tokenizer_json), "tokenizer.json")
    copied = False
    if source_dir is not None:
        for name in TOKENIZER_FILES[1:-1]:
            if (Path(source_dir) / name).is_file():
                copy(Path(source_dir) / name, name)
                copied = True
    if not copied:
        write_atomic(out / "tokenizer_config.json", json.dumps(
            _tokenizer_config(Path(tokenizer_json)), indent=1) + "\n")
    for where in (model_dir, source_dir):
        if where is not None and (Path(where) / GENERATION_FILE).is_file():
            if _same_dir(where, source_dir):  # its ids name this tokenizer's tokens
                copy(Path(where) / GENERATION_FILE, GENERATION_FILE)
            else:
                _keep_generation_config(Path(where) / GENERATION_FILE, out, run_dir)
            break
    _record_model_ids(out, run_dir, source_dir, model_dir)
    return out


def _tokenizer_config(tokenizer_json: Path) -> dict[str, str | None]:
    """The ``tokenizer_config.json`` of a tokenizer that came without one (a BPE editrain
    trained, a ``data.tokenizer`` file alone): its end-of-text token, the one the corpus
    separated documents with (the first of
    :data:`~editrain.data.tokenizer.EOS_FALLBACK_TOKENS` it holds: ``<|endoftext|>`` for
    editrain's BPE, ``</s>`` for a Llama 2 tokenizer), also as its begin-of-text and
    unknown token; ``null`` when it holds none of them, and for the pad token. Naming a
    token the tokenizer lacks made every export of the run fail; leaving one out lets
    transformers 5 put its own default there (``<|endoftext|>``), which it adds past the
    vocabulary where the tokenizer lacks it."""
    from tokenizers import Tokenizer

    from editrain.data.tokenizer import EOS_FALLBACK_TOKENS

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = next((name for name in EOS_FALLBACK_TOKENS if tok.token_to_id(name) is not None),
               None)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos,
            "unk_token": eos, "pad_token": None}


def _keep_generation_config(path: Path, out: Path, run_dir: str | Path) -> None:
    """Keep the ``model.init_from`` directory's ``generation_config.json`` beside another
    tokenizer (``data.tokenizer``, or a BPE editrain trained): its sampling settings and
    lengths are the model's, its special-token ids are replaced by the run's tokenizer's
    (:func:`~editrain.models.hf_tokens.tokenizer_special_ids`; ``null`` where that names
    a token it lacks, which export then refuses), since they name another tokenizer's
    tokens. Where its tokenizer is the run's, the file is kept as it is (Llama 3 Instruct's
    list of end-of-text ids included)."""
    data = read_bytes(path, CONFIG_MAX_BYTES, what="generation config")
    value = read_json_value(data, shown(path), error=ValueError)
    if not isinstance(value, dict):
        raise ValueError(f"{shown(path)} is not a JSON object")
    try:
        ids = tokenizer_special_ids(out)
    except ValueError:
        ids = dict.fromkeys(TOKEN_ID_KEYS)
    write_atomic(out / GENERATION_FILE, json.dumps({**value, **ids}, indent=2) + "\n",
                 root=run_dir)


def _same_dir(a: str | Path | None, b: str | Path | None) -> bool:
    """Whether two paths name the same directory (neither None)."""
    return (a is not None and b is not None
            and Path(a).expanduser().resolve() == Path(b).expanduser().resolve())


def _record_model_ids(out: Path, run_dir: str | Path, source_dir: str | Path | None,
                      model_dir: str | Path | None) -> None:
    """Write :data:`MODEL_IDS_FILE` where the tokenizer is the ``model.init_from``
    directory's; otherwise remove one an earlier job of the run directory wrote (its ids
    would name another tokenizer's tokens)."""
    record = out / MODEL_IDS_FILE
    if _same_dir(source_dir, model_dir):
        ids = config_special_ids(read_config(model_dir))
        write_atomic(record, json.dumps(ids, indent=1) + "\n", root=run_dir)
    elif record.is_symlink() or record.is_file():
        record.unlink()


# ---------------------------------------------------------------------------- out
@dataclass
class Exported:
    """What :func:`export_checkpoint` wrote."""

    out: Path
    checkpoint: Path
    source: str
    """``anchors`` (the global model) or ``replica R``."""
    files: list[str]


def find_checkpoint(path: str | Path, option: str = "export", replica: int | None = None
                    ) -> tuple[Path, int | None]:
    """A complete checkpoint and the replica to read in it (None: its global model).

    ``path`` is a checkpoint, a run directory (its latest checkpoint) or a fault-tolerant
    run's directory, whose replica groups keep their checkpoints apart
    (``replica{r}/checkpoints/``): there the global model, which the groups agree on, is read
    from the latest checkpoint of any group (the lowest group at equal steps), and
    ``replica=R`` reads group ``R``'s latest checkpoint, where that replica is replica 0.

    Raises:
        CheckpointError: one line naming ``option``: none of these, incomplete, or a group
            the run does not have.
    """
    p = Path(path).expanduser()
    if (p / MARKER).is_file():
        return p, replica
    found = list_checkpoints(p) if p.is_dir() else []
    if found:
        return found[-1], replica
    groups = {int(g.name[len("replica"):]): list_checkpoints(g) for g in replica_groups(p)}
    if replica is not None and groups:
        if not groups.get(replica):
            have = ", ".join(str(r) for r, c in groups.items() if c) or "none"
            raise CheckpointError(f"{option} --replica: {shown(p)} is a fault-tolerant run whose "
                                  f"replica group {replica} has no checkpoint (groups with "
                                  f"checkpoints: {have})")
        return groups[replica][-1], 0
    latest = [c[-1] for c in groups.values() if c]  # in group order: max keeps the first
    if latest:
        return max(latest, key=lambda c: int(c.name[len("step_"):])), None
    raise CheckpointError(f"{option}: {shown(p)} is neither a complete checkpoint (with {MARKER}) "
                          f"nor a run directory with one in {CKPT_DIR}/ (or in replica*/{CKPT_DIR}/, "
                          f"a fault-tolerant run's)")


def _marker_llama(model_cfg: Mapping[str, Any], ckpt: Path, command: str) -> LlamaConfig:
    """The :class:`LlamaConfig` a checkpoint's marker records.

    Raises:
        CheckpointError: a field the Llama does not have (a marker edited, or written by
            another editrain) or a value it refuses, in one line naming ``command`` and the
            file.
    """
    try:
        return LlamaConfig(**model_cfg)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{command}: {shown(ckpt / MARKER)}: its model is not one editrain's "
                              f"Llama can be ({e})") from None


def marker_model(marker: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(whether the checkpoint's model is editrain's Llama, its configuration)."""
    model = dict(marker.get("model") or {})
    return "dim" in model and "n_layers" in model, model


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """The names under which a model holds a parameter it holds under another name too (tied
    weights: a Hugging Face model's head that is its embedding), each mapped to the first
    name, which ``named_parameters()`` gives and the sync engine's anchors are saved under."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            aliases[name] = first[id(p)]
    return aliases


def _marker_aliases(marker: Mapping[str, Any], ckpt: Path, command: str) -> dict[str, str]:
    """:func:`tied_aliases` of the model a checkpoint's marker describes, built on the meta
    device (nothing allocated)."""
    from editrain.models.hf import HFCausalLM
    from editrain.models.llama import Llama

    llama, model_cfg = marker_model(marker)
    with torch.device("meta"):
        model = (Llama(_marker_llama(model_cfg, ckpt, command)) if llama
                 else HFCausalLM.from_config_dict(model_cfg))
    return tied_aliases(model)


@dataclass(frozen=True)
class ModelWeights:
    """Where one model of a checkpoint is (:func:`model_weights`): what its tensors are,
    before any is read.

    Attributes:
        ckpt: the checkpoint directory.
        keys: the model's parameter name -> the tensor's key in the checkpoint.
        meta: the model's parameter name -> a tensor on the meta device of the saved shape
            and dtype.
        source: which model it is, for messages (the global model, a replica).
        command: the command the messages name.
    """

    ckpt: Path
    keys: dict[str, str]
    meta: dict[str, torch.Tensor]
    source: str
    command: str

    def load(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors of ``names`` (default: all), whole, on the host: only these are
        read from the files (an export reads one output shard at a time).

        Raises:
            CheckpointError: the files cannot be read (corrupt, truncated).
        """
        names = list(self.keys) if names is None else list(names)
        state = {self.keys[n]: torch.empty(self.meta[n].shape, dtype=self.meta[n].dtype)
                 for n in names}
        try:
            with warnings.catch_warnings():  # one process on purpose: no_dist says so already
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, storage_reader=SafeFileSystemReader(self.ckpt),
                         planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, dcp.CheckpointException) as e:  # corrupt or truncated files
            failure = first_failure(e)
            raise CheckpointError(f"{self.command}: cannot read {shown(self.ckpt)}: "
                                  f"{one_line(repr(failure))} (damaged or cut short)") from None
        return {n: state[self.keys[n]] for n in names}


def model_weights(ckpt: Path, replica: int | None = None, command: str = "export",
                  marker: Mapping[str, Any] | None = None) -> ModelWeights:
    """Locate one model of a checkpoint under the model's parameter names (a tied parameter
    once, under its first name: :func:`tied_aliases`), reading no tensor.

    Args:
        ckpt: a complete checkpoint directory.
        replica: None: the global model (the sync engine's anchors; replica 0's weights
            where there are none: a method without a global model, or a run still in its
            warm-up, whose replicas then agree); else that replica's live weights.
        command: the command the messages name (``export``, ``sample``).
        marker: the checkpoint's marker, if the caller has opened it already.

    Raises:
        CheckpointError: the replica does not exist, or the global model lacks a parameter.
        ConfigError: the marker describes more layers than the weights hold (refused before
            a model is built from it to find the tied parameters).
    """
    from editrain.config.size import check_weights_match

    marker = open_checkpoint(ckpt) if marker is None else marker
    metadata = read_metadata(ckpt)
    group = group_index(ckpt.parent.parent)  # a fault-tolerant run's replica group
    source = f"replica {replica}" if group is None else f"replica {group} (replica group {group} of a fault-tolerant run)"
    keys: dict[str, str] = {}
    if replica is None:
        engine = saved_tensors(ckpt, ENGINE_KEY)
        keys = {name: f"{ENGINE_KEY}.{key}" for name, key in global_model_keys(engine).items()}
        source = "the global model (the anchors)"
        if not keys:
            replica, source = 0, "replica 0 (the checkpoint holds no global model)"
    anchors = bool(keys)
    live = saved_tensors(ckpt, f"replica{replica or 0}.model")
    if not keys:
        keys = {name: f"replica{replica}.model.{name}" for name in live}
    if not keys:
        saved = sorted({k.split(".")[0] for k in metadata.state_dict_metadata
                        if k.startswith("replica")})
        hint = "" if group is None else (
            f"; a replica group of a fault-tolerant run holds its own replica as replica 0: "
            f"name the run's directory with --replica {group} for this one")
        raise CheckpointError(f"{command} --replica: {shown(ckpt)} holds no replica {replica} "
                              f"(it holds {', '.join(saved) or 'none'}){hint}")
    # the model read: before a model is built from the marker to find its tied parameters
    check_weights_match(marker_model(marker)[1], keys, shown(ckpt / MARKER), option=command)
    aliases = _marker_aliases(marker, ckpt, command)
    missing = sorted(set(live) - set(keys) - set(aliases)) if anchors and live else []
    if missing:
        raise CheckpointError(f"{command}: {shown(ckpt)} has no global copy of {spelled(missing[0])}")
    keys = {name: key for name, key in keys.items() if name not in aliases}
    sizes = metadata.state_dict_metadata
    meta = {name: torch.empty(tuple(sizes[key].size), dtype=sizes[key].properties.dtype,
                              device="meta") for name, key in keys.items()}
    return ModelWeights(ckpt, keys, meta, source, command)


def read_model_weights(ckpt: Path, replica: int | None = None, command: str = "export",
                       marker: Mapping[str, Any] | None = None
                       ) -> tuple[dict[str, torch.Tensor], str]:
    """One model of a checkpoint (:func:`model_weights`), every tensor read whole: ``(tensors,
    source)``; ``source`` says which model was read."""
    weights = model_weights(ckpt, replica, command, marker)
    return weights.load(), weights.source


def build_checked(make: Callable[[], nn.Module], shapes: Mapping[str, Any], where: str,
                  command: str, names: Callable[[nn.Module], Mapping[str, Any]] | None = None,
                  real: bool = True) -> nn.Module:
    """``make()``, once the model it builds on the meta device has the shapes the weights
    have: a description whose widths disagree with its weights is refused before a real
    build allocates them.

    Args:
        make: builds the model.
        shapes: the weights' tensor name -> shape.
        where: the weights, for the message, as :func:`editrain.paths.shown` spells
            them.
        command: the command the message names.
        names: a model's parameters under the weights' names (default:
            :func:`~editrain.models.hf_dir.hf_parameters`, Hugging Face names).
        real: build the model for real once it is checked (else return the meta one).

    Raises:
        CheckpointError: a parameter whose tensor has another shape.
    """
    with torch.device("meta"):
        meta = make()
    for name, p in (names or hf_parameters)(meta).items():
        have = shapes.get(name)
        if have is not None and tuple(have) != tuple(p.shape):
            raise CheckpointError(f"{command}: {where}: tensor {spelled(name)} has shape "
                                  f"{list(have)}, the model its description builds needs "
                                  f"{list(p.shape)}")
    return make() if real else meta


def checkpoint_model(marker: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                     ckpt: Path, command: str, real: bool = True) -> tuple[nn.Module, int]:
    """The model a checkpoint's marker describes, checked against the checkpoint's model
    tensors (:func:`read_model_weights`: the model's own names) before it is built: its
    layers (:func:`~editrain.config.size.check_weights_match`), then every parameter's
    shape (:func:`build_checked`). Returns ``(model, longest window)``.

    Raises:
        ConfigError, CheckpointError: one line naming ``command``.
    """
    from editrain.config.size import check_weights_match
    from editrain.models.hf import HFCausalLM
    from editrain.models.llama import Llama

    llama, model_cfg = marker_model(marker)
    # editrain's Llama checks its own fields first (a CheckpointError in the Llama's words)
    cfg = _marker_llama(model_cfg, ckpt, command) if llama else None
    check_weights_match(model_cfg, tensors, shown(ckpt / MARKER), option=command)
    shapes = {n: t.shape for n, t in tensors.items()}

    def own(model: nn.Module) -> dict[str, Any]:
        return dict(model.named_parameters())

    if cfg is not None:
        return build_checked(lambda: Llama(cfg), shapes, shown(ckpt), command, own,
                             real), cfg.max_seq_len
    model = build_checked(lambda: HFCausalLM.from_config_dict(model_cfg), shapes, shown(ckpt),
                          command, own, real)
    return model, hf_int(model_cfg, "positions") or 2048


def _hf_name(name: str) -> str:
    """A model parameter's name in the Hugging Face directory."""
    return name[3:] if name.startswith("hf.") else to_hf_name(name)


def _plan_shards(weights: ModelWeights, dtype: torch.dtype, max_shard_bytes: int
                 ) -> list[tuple[str, list[str]]]:
    """The safetensors files of an export and the parameters each holds, in order: at most
    ``max_shard_bytes`` a file in ``dtype`` (one tensor larger than that: a file of its
    own)."""
    item = dtype.itemsize
    plan: list[list[str]] = [[]]
    size = 0
    for name, t in weights.meta.items():
        n = t.numel() * item
        if plan[-1] and size + n > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += n
    files = [SINGLE_FILE] if len(plan) == 1 else [
        f"model-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(1, len(plan) + 1)]
    return list(zip(files, plan))


def _write_shards(out: Path, weights: ModelWeights, dtype: torch.dtype,
                  plan: list[tuple[str, list[str]]]) -> dict[str, str]:
    """Write each file of ``plan`` as ``out/FILE.partial``, reading only that file's tensors
    from the checkpoint (an export needs the memory of one file, not of the model);
    returns the Hugging Face name of every tensor -> its file. A tied parameter is written
    once (:func:`model_weights`), as ``save_pretrained`` writes it: transformers ties the
    head to the embedding again when it loads."""
    from safetensors.torch import save

    weight_map = {}
    for file, names in plan:
        shard = {_hf_name(name): t.to(dtype).contiguous()
                 for name, t in weights.load(names).items()}
        _write(out, file + PARTIAL, save(shard, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(shard, file))
        del shard
    return weight_map


def _publish_weights(out: Path, weights: ModelWeights, dtype: torch.dtype,
                     plan: list[tuple[str, list[str]]], earlier: list[str]) -> list[str]:
    """Write the weights (:func:`_write_shards`), then, every one written, put them in place
    of an earlier export's files and write the index of several; returns the files."""
    weight_map = _write_shards(out, weights, dtype, plan)
    files = [file for file, _ in plan]
    staged = {file + PARTIAL for file in files}
    _remove(out, [f for f in earlier if f not in staged and f != EXPORT_RECORD])
    for file in files:
        os.replace(out / (file + PARTIAL), out / file)
    if len(files) > 1:
        total = sum(t.numel() for t in weights.meta.values()) * dtype.itemsize
        _write(out, INDEX_FILE, json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
        files.append(INDEX_FILE)
    return files


PARTIAL = ".partial"
"""The suffix of an export's weight files until every one of them is written."""


def _write(out: Path, name: str, data: str | bytes) -> None:
    """One file of an export: written whole beside its place and renamed over it, never
    through a link (a link already at ``out/name`` is refused by name, not followed)."""
    try:
        write_atomic(out / name, data, root=out)
    except RunDirError as e:
        raise CheckpointError(f"export: {e}") from None


EXPORT_DIR = "export"
"""``RUN_DIR/export``: where ``checkpoint.export_final`` exports, the one entry of a run
directory an export may be."""


def _check_out_place(out: Path) -> None:
    """``out`` lies in no directory that editrain keeps for a run: a checkpoint directory
    (one with anything else in it is refused by ``--resume``, and rotation deletes it with
    the export), nor a run's ``checkpoints/``, ``ranks/``, ``logs/``, ``tokenizer/``...
    (:data:`~editrain.rundir.RUN_FILES`; ``--overwrite`` deletes them, or refuses to while
    they hold the export). ``RUN_DIR/export`` itself is where ``export_final`` writes.

    Raises:
        CheckpointError: naming the directory and the run.
    """
    target = out.resolve()
    for inner, outer in zip([target, *target.parents], target.parents, strict=False):
        if inner != target and (inner / MARKER).is_file():
            raise CheckpointError(f"export: OUT {shown(out)} lies inside the checkpoint "
                                  f"{shown(inner)}, "
                                  "which then no longer resumes (and rotation deletes); "
                                  "choose a directory outside the run's checkpoints")
        if inner.name in RUN_FILES and ((outer / CKPT_DIR).is_dir()
                                        or (outer / RECORD).is_file()) \
                and not (inner == target and inner.name == EXPORT_DIR):
            raise CheckpointError(f"export: OUT {shown(out)} lies in {shown(inner)}, which editrain "
                                  f"keeps for the run in {shown(outer)} (--overwrite deletes its files, or "
                                  f"is refused while it holds others); choose another "
                                  f"directory, e.g. {shown(outer / EXPORT_DIR)}")


def _prepare_out(out: Path) -> list[str]:
    """``out`` empty, absent (then made), or an earlier export, whose files are returned
    (names inside ``out`` only); nothing is removed yet."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export: {shown(out)} exists and is not a directory")
    if not out.exists() or not any(out.iterdir()):
        out.mkdir(parents=True, exist_ok=True)
        return []
    record = out / EXPORT_RECORD
    if not os.path.lexists(record):
        raise CheckpointError(f"export: {shown(out)} is not empty and is not an earlier export (no "
                              f"{EXPORT_RECORD}); choose an empty or new directory")
    files = read_json(record, max_bytes=1 << 20, what="export record",
                      schema=Obj({"files": List(Str(255), 1 << 16)}, required=("files",)),
                      error=CheckpointError)["files"]
    return [Path(str(name)).name for name in files]  # never anything outside ``out``


def _remove(out: Path, names: Iterable[str]) -> None:
    """Remove the export's own files ``names`` from ``out`` (regular files only)."""
    for name in names:
        p = out / name
        if p.is_file() and not p.is_symlink():
            p.unlink()


def _tokenizer(run_dir: Path, cfg: Mapping[str, Any]) -> Path | None:
    """The run's tokenizer files: ``RUN_DIR/tokenizer/``, else the model directory the
    run's configuration names (``data.tokenizer``, ``model.init_from``)."""
    own = run_dir / RUN_TOKENIZER_DIR
    if (own / "tokenizer.json").is_file():
        return own
    for where in ((cfg.get("data") or {}).get("tokenizer"),
                  (cfg.get("model") or {}).get("init_from")):
        if where and Path(where).is_dir() and tokenizer_file(where) is not None:
            return Path(where)
    return None


def _json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object file an export reads ids from (bounded, never through a link)."""
    return read_json(path, max_bytes=CONFIG_MAX_BYTES, schema=Obj(), what=what,
                     error=CheckpointError)


def _original_ids(tok_dir: Path, run_cfg: Mapping[str, Any]
                  ) -> tuple[dict[str, Any], Path] | None:
    """The special-token ids of the ``model.init_from`` directory whose tokenizer the run
    uses, and the file they come from: the run's record of them (:data:`MODEL_IDS_FILE`),
    or the directory's ``config.json`` where the run's tokenizer is read from that
    directory itself (a run older than the record). None: the tokenizer is another's."""
    record = tok_dir / MODEL_IDS_FILE
    if record.is_file():
        return config_special_ids(_json_object(record, "token-id record")), record
    if _same_dir(tok_dir, (run_cfg.get("model") or {}).get("init_from")):
        config = tok_dir / "config.json"
        return config_special_ids(_json_object(config, "model config")), config
    return None


def _special_ids(tok_dir: Path | None, run_cfg: Mapping[str, Any], vocab_size: int
                 ) -> dict[str, Any]:
    """``config.json``'s special-token ids.

    The ``model.init_from`` directory's where the run's tokenizer is that directory's (the
    export then loads with the ids it started from: its round trip); else the tokenizer's
    own special tokens (:func:`~editrain.models.hf_tokens.tokenizer_special_ids`), ``null``
    for those it names none of and all three without a tokenizer: a config class's
    default (Llama's 1 and 2) is never left to stand for the tokenizer's.

    Raises:
        CheckpointError: an id that is not a token of the model's vocabulary, or a special
            token the tokenizer lacks, in one line naming the file.
    """
    if tok_dir is None:
        return dict.fromkeys(TOKEN_ID_KEYS)
    original = _original_ids(tok_dir, run_cfg)
    try:
        if original is not None:
            ids, where = original
        else:
            ids, where = tokenizer_special_ids(tok_dir), tok_dir
        check_special_ids(ids, vocab_size, str(where))
    except ValueError as e:
        raise CheckpointError(f"export: {e}") from None
    return ids


def _generation_config(tok_dir: Path, vocab_size: int) -> bytes:
    """The export's ``generation_config.json``: the run's copy as it is (training kept it
    with ids of the run's tokenizer: :func:`save_run_tokenizer`), checked.

    Raises:
        CheckpointError: a file that is no JSON object, or an id that is not a token of the
            model's vocabulary.
    """
    path = tok_dir / GENERATION_FILE
    data = read_bytes(path, CONFIG_MAX_BYTES, what="generation config")
    value = read_json_value(data, shown(path), error=CheckpointError)
    if not isinstance(value, dict):
        raise CheckpointError(f"export: {shown(path)} is not a JSON object")
    try:
        check_special_ids(value, vocab_size, str(path))
    except ValueError as e:
        raise CheckpointError(f"export: {e}") from None
    return data


def _export_config(llama: bool, model_cfg: Mapping[str, Any], ckpt: Path,
                   tok_dir: Path | None, run_cfg: Mapping[str, Any], dtype: str
                   ) -> dict[str, Any]:
    """The export's ``config.json`` (the Llama's mapped, another architecture's the run's
    own) with its special-token ids (:func:`_special_ids`)."""
    if llama:
        config = llama_config_to_hf(_marker_llama(model_cfg, ckpt, "export"))
    else:  # the ids of the directory it came from, replaced by the ones that hold here
        config = {k: v for k, v in model_cfg.items() if k not in TOKEN_ID_KEYS}
    config.update(_special_ids(tok_dir, run_cfg, hf_int(config, "vocab")))
    # transformers 4 reads torch_dtype, 5 dtype: the weights' own, or it would load
    # float32 weights in the dtype the source model was saved in
    config.update(torch_dtype=dtype, dtype=dtype)
    return config


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
"""The dtypes ``editrain export --dtype`` writes the weights in (float32: as trained)."""


def export_checkpoint(path: str | Path, out: str | Path, replica: int | None = None,
                      max_shard_bytes: int = 2 * 2**30, dtype: str = "float32") -> Exported:
    """Write a checkpoint's model as a Hugging Face directory (one process, no workers).

    Args:
        path: a checkpoint directory, or a run directory (its latest checkpoint).
        out: the directory to write: new, empty, or an earlier export (only the files that
            export wrote are replaced; nothing else is ever deleted).
        replica: None: the global model (the anchors); else that replica's live weights.
        max_shard_bytes: the largest safetensors file; more weights go to several shards
            and ``model.safetensors.index.json``.
        dtype: what the weights are written in (:data:`EXPORT_DTYPES`; the
            ``config.json`` says it, so that transformers loads them in it).

    Raises:
        CheckpointError: one line: no checkpoint, a replica it lacks, unreadable files, an
            ``out`` that holds other files.
    """
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"export --dtype: {spelled(dtype)} is not one of "
                              f"{', '.join(EXPORT_DTYPES)}")
    ckpt, replica = find_checkpoint(path, replica=replica)
    marker = open_checkpoint(ckpt)  # regular files only, no link, bounded marker
    out = Path(out).expanduser()
    _check_out_place(out)
    llama, model_cfg = marker_model(marker)
    weights = model_weights(ckpt, replica, "export", marker)
    checkpoint_model(marker, weights.meta, ckpt, "export", real=False)  # config.json fits them
    source = weights.source
    run_dir = ckpt.parent.parent
    run_cfg = marker.get("config") or {}
    tok_dir = _tokenizer(run_dir, run_cfg)
    carried = [n for n in TOKENIZER_FILES if tok_dir is not None and (tok_dir / n).is_file()]
    # every file but the weights made before anything is written: a refusal leaves OUT as
    # it was
    config = _export_config(llama, model_cfg, ckpt, tok_dir, run_cfg, dtype)
    generation = (_generation_config(tok_dir, hf_int(config, "vocab"))
                  if tok_dir is not None and GENERATION_FILE in carried else None)
    earlier = _prepare_out(out)
    plan = _plan_shards(weights, EXPORT_DTYPES[dtype], max_shard_bytes)
    # Before anything is written, a record of all this attempt may leave: one that fails (a
    # damaged checkpoint, a full disk, Ctrl-C) leaves an earlier export to the next, which
    # then replaces it. The earlier export's files stay as they are until every weight is
    # written, under names of their own.
    staged = [file + PARTIAL for file, _ in plan]
    own = {*earlier, *staged, *(f for f, _ in plan), *([INDEX_FILE] if len(plan) > 1 else []),
           "config.json", "README.md", *carried}
    for name in sorted(own | {EXPORT_RECORD}):  # a link put there is refused, not replaced
        try:
            check_no_links(out / name, out)
        except RunDirError as e:
            raise CheckpointError(f"export: {e}") from None
    _write(out, EXPORT_RECORD, json.dumps({"files": sorted(own), "complete": False}) + "\n")
    files = _publish_weights(out, weights, EXPORT_DTYPES[dtype], plan, earlier)
    _write(out, "config.json", json.dumps(config, indent=1) + "\n")
    files.append("config.json")
    for name in carried:
        _write(out, name, generation if name == GENERATION_FILE
               else read_bytes(tok_dir / name, TOKENIZER_MAX_BYTES))
        files.append(name)
    method = marker.get("method", "?")
    step = marker.get("step", "?")
    _write(out, "README.md",
        f"# Exported by editrain\n\n"
        f"- run: {marker.get('run_id') or run_dir}\n"
        f"- method: {method}\n"
        f"- step: {step}\n"
        f"- weights: {source}, in {dtype}\n"
        f"- checkpoint: {ckpt}\n"
        f"- topology (replicas, shards[, tp]): {marker.get('topology')}\n\n"
        f"Load it with `transformers.AutoModelForCausalLM.from_pretrained(<this directory>)`"
        f" and `AutoTokenizer.from_pretrained(<this directory>)`.\n")
    files.append("README.md")
    _write(out, EXPORT_RECORD, json.dumps(
        {"files": files, "checkpoint": str(ckpt), "step": step, "method": method,
         "source": source, "dtype": dtype}, indent=1) + "\n")
    return Exported(out, ckpt, source, files)
