"""Reading DCP checkpoints without running code from them: metadata allowlist, tensor reads.

A ``torch.distributed.checkpoint`` directory is a pickled ``.metadata`` file and ``.distcp``
files of items; torch's stock reader unpickles the metadata with full pickle, and its stock
load planner decodes every non-tensor ("bytes") item with ``torch.load(weights_only=False)``:
a crafted checkpoint runs code of its author's choosing. What this module reads instead:

* ``.metadata`` through an unpickler that resolves only the classes DCP metadata is made of
  (:data:`METADATA_CLASSES` and torch dtypes), then checked field by field: every storage
  item is a plain file name in the checkpoint directory, with a non-negative offset and
  length and no stream transform;
* tensor items through DCP's own ``torch.load(weights_only=True)`` (see
  ``FileSystemReader.read_data``), never through full pickle;
* bytes items: :class:`SafeFileSystemReader` hands them only to a :class:`SafeLoadPlanner`,
  which refuses every one unless its caller named it decodable, and then decodes it with
  ``torch.load(weights_only=True)`` and keeps it only if it is plain data (numbers,
  strings, ``None`` and lists, tuples and dicts of them).

:func:`check_storage` also checks that every item recorded in the metadata lies within its
file, so a truncated checkpoint is reported before any process group reads it.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from editrain.errors import CheckpointError
from editrain.paths import shown
from editrain.safe_io import read_bytes, regular_size

__all__ = ["METADATA_CLASSES", "SafeFileSystemReader", "SafeLoadPlanner", "check_storage",
           "decode_plain", "read_bytes_item", "read_metadata"]

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"

_DCP = "torch.distributed.checkpoint."
METADATA_CLASSES = frozenset({
    (_DCP + "metadata", "Metadata"),
    (_DCP + "metadata", "TensorStorageMetadata"),
    (_DCP + "metadata", "BytesStorageMetadata"),
    (_DCP + "metadata", "ChunkStorageMetadata"),
    (_DCP + "metadata", "TensorProperties"),
    (_DCP + "metadata", "MetadataIndex"),
    (_DCP + "metadata", "StorageMeta"),
    (_DCP + "metadata", "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format
    (_DCP + "filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout by name (a table lookup)
    # StorageMeta.checkpoint_id is the path the checkpoint was written to (pathlib moved
    # its classes into pathlib._local in Python 3.13).
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "WindowsPath"), ("pathlib._local", "PureWindowsPath"),
})
"""``(module, name)`` of every class a DCP ``.metadata`` file may name (torch dtypes such as
``torch.float32`` are allowed besides). Found by listing the globals of real checkpoints'
metadata and reading ``torch/distributed/checkpoint/metadata.py``."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves the classes of :data:`METADATA_CLASSES` and torch dtypes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: DCP metadata holds no "
                              "such object")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("refusing a persistent id: DCP metadata holds none")


METADATA_MAX_BYTES = 1 << 30
"""The largest ``.metadata`` read when the caller gives no cap from the marker."""


def read_metadata(ckpt: str | Path, max_bytes: int = METADATA_MAX_BYTES) -> Metadata:
    """The checkpoint's DCP metadata, unpickled with the allowlist and checked field by field.

    Args:
        ckpt: the checkpoint directory.
        max_bytes: the largest file accepted (refused by its size before it is read;
            :func:`editrain.checkpoint.metadata_cap` derives it from the marker).

    Raises:
        CheckpointError: the file is missing, a link, not a regular file, too large,
            unreadable, names a class outside the allowlist or does not have the shape of
            DCP metadata (the message names the file).
    """
    path = Path(ckpt) / METADATA_FILE
    data = read_bytes(path, max_bytes, what="checkpoint metadata")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as e:
        raise CheckpointError(f"{shown(path)}: {e}") from None
    except Exception as e:  # truncated or garbled pickle: any of a dozen exception types
        raise CheckpointError(f"{shown(path)}: corrupt checkpoint metadata ({type(e).__name__}: "
                              f"{e})") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"{shown(path)}: not DCP metadata as editrain reads it: {problem}")
    return metadata


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)


def _metadata_problem(md: Any) -> str | None:
    """What makes ``md`` unusable as DCP metadata, or None. (Everything ``dcp.load`` and
    :func:`check_storage` rely on: types, sizes, file names, offsets.)"""
    if not isinstance(md, Metadata):
        return f"a {type(md).__name__}, not a Metadata"
    if not isinstance(md.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            return f"key {fqn!r} is not a string"
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            return f"{fqn}: a {type(item).__name__}, not tensor or bytes metadata"
        props = item.properties
        if not (isinstance(props, TensorProperties) and isinstance(props.dtype, torch.dtype)
                and _is_size(item.size) and isinstance(item.chunks, list)):
            return f"{fqn}: malformed tensor metadata"
        for chunk in item.chunks:
            if not (isinstance(chunk, ChunkStorageMetadata) and _is_size(chunk.offsets)
                    and _is_size(chunk.sizes) and len(chunk.offsets) == len(item.size)
                    and len(chunk.sizes) == len(item.size)):
                return f"{fqn}: malformed chunk metadata"
    if not isinstance(md.storage_data, dict):
        return "storage_data is not a dict"
    for index, info in md.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)):
            return f"storage key {index!r} is not a MetadataIndex"
        # DCP's storage info class is private to torch: its fields are checked instead (the
        # unpickler built nothing but allowlisted classes).
        name = getattr(info, "relative_path", None)
        # A bare file name of this directory: nothing above it, nothing beside .distcp files.
        if not (isinstance(name, str) and name == Path(name).name and "\\" not in name
                and name.endswith(DATA_SUFFIX)):
            return f"{index.fqn}: storage file {name!r} is not a {DATA_SUFFIX} file name"
        for field in (getattr(info, "offset", None), getattr(info, "length", None)):
            if type(field) is not int or field < 0:
                return f"{index.fqn}: storage offset/length {field!r} is not a count of bytes"
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:  # decompression and the like: editrain writes none
            return f"{index.fqn}: storage transforms {transforms!r}"
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        return f"storage_meta is a {type(md.storage_meta).__name__}"
    return None


def check_storage(ckpt: str | Path, metadata: Metadata) -> None:
    """Every item the metadata records is stored: each tensor chunk and bytes item has a
    storage entry, and every entry lies within its file.

    Args:
        ckpt: the checkpoint directory.
        metadata: its :func:`read_metadata`.

    Raises:
        CheckpointError: a ``.distcp`` file is missing or truncated, or an item has no
            storage entry (the message names the file or the item).
    """
    ckpt = Path(ckpt)
    stored = set(metadata.storage_data)  # MetadataIndex compares by fqn and offset only
    for fqn, item in metadata.state_dict_metadata.items():
        wanted = ([MetadataIndex(fqn)] if isinstance(item, BytesStorageMetadata) else
                  [MetadataIndex(fqn, chunk.offsets) for chunk in item.chunks])
        for index in wanted:
            if index not in stored:
                raise CheckpointError(f"{shown(ckpt / METADATA_FILE)}: cannot read checkpoint data: "
                                      f"item {fqn} has no storage entry")
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            path = ckpt / name
            # A link (possibly to outside the checkpoint), a FIFO or a directory: refused.
            sizes[name] = (regular_size(path, what="checkpoint data file")
                           if os.path.lexists(path) else -1)
        size = sizes[name]
        if size < 0:
            raise CheckpointError(f"{shown(ckpt / name)}: cannot read checkpoint data: the file "
                                  f"is missing (it holds {index.fqn})")
        end = info.offset + info.length
        if end > size:
            raise CheckpointError(f"{shown(ckpt / name)}: cannot read checkpoint data: the file "
                                  f"is truncated ({size} bytes; {index.fqn} is stored at bytes "
                                  f"{info.offset}..{end})")


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return False


def decode_plain(data: bytes | io.BytesIO, where: str) -> Any:
    """A bytes item (``torch.save`` of a value) decoded with ``torch.load(weights_only=True)``
    (torch's unpickler of primitives and tensors), kept only if it is plain data.

    Args:
        data: the item's bytes.
        where: what to name in an error (the item).

    Raises:
        CheckpointError: the item is not a ``torch.save`` file of plain data (a pickle of any
            other object is refused by the unpickler before anything is built).
    """
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        value = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as e:
        # torch's message wraps the reason in advice about weights_only: keep the reason.
        advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
        lines = [line.strip() for line in str(e).split("WeightsUnpickler error:")[-1]
                 .splitlines() if line.strip()]
        reason = next((line for line in lines if not line.startswith(advice)),
                      type(e).__name__)
        raise CheckpointError(f"{where}: refusing a non-tensor item that is not plain data "
                              f"({reason[:200]})") from None
    if not _is_plain(value):
        raise CheckpointError(f"{where}: refusing a non-tensor item that is not plain data "
                              f"(a {type(value).__name__})")
    return value


def read_bytes_item(ckpt: str | Path, metadata: Metadata, fqn: str) -> Any:
    """A non-tensor item of a checkpoint, read from its file and decoded with
    :func:`decode_plain` (what a :class:`SafeLoadPlanner` would keep), without DCP.

    Args:
        ckpt: the checkpoint directory.
        metadata: its :func:`read_metadata` (and :func:`check_storage` passed).
        fqn: the item's flattened key.

    Raises:
        CheckpointError: the item is not stored or not plain data (the message names the
            file).
    """
    path, data = _read_stored(ckpt, metadata, MetadataIndex(fqn))
    return decode_plain(data, f"{shown(path)}: item {fqn}")


def _read_stored(ckpt: str | Path, metadata: Metadata, index: MetadataIndex,
                 max_bytes: int | None = None) -> tuple[Path, bytes]:
    """The file and the bytes of one stored item (``max_bytes``: refused unread if more)."""
    info = metadata.storage_data.get(index)
    if info is None:
        raise CheckpointError(f"{shown(Path(ckpt) / METADATA_FILE)}: item {index.fqn} has no "
                              "storage entry")
    path = Path(ckpt) / info.relative_path
    if max_bytes is not None and info.length > max_bytes:
        raise CheckpointError(f"{shown(path)}: item {index.fqn} takes {info.length} bytes, more "
                              f"than the {max_bytes} it may hold")
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            return path, f.read(info.length)
    except OSError as e:
        raise CheckpointError(f"{shown(path)}: cannot read checkpoint data "
                              f"({e.strerror or e})") from None


def read_tensor_item(ckpt: str | Path, metadata: Metadata, fqn: str,
                     max_bytes: int) -> torch.Tensor:
    """A one-chunk tensor item of a checkpoint (as one rank saved it), read from its file
    with ``torch.load(weights_only=True)``, without DCP: what a launcher checks before any
    worker starts.

    Args:
        ckpt: the checkpoint directory.
        metadata: its :func:`read_metadata` (and :func:`check_storage` passed).
        fqn: the item's flattened key.
        max_bytes: the most bytes its storage may take; a larger entry is refused unread.

    Raises:
        CheckpointError: the item is not a one-chunk tensor, is larger than ``max_bytes``,
            or does not decode to the tensor the metadata describes (the message names the
            file).
    """
    item = metadata.state_dict_metadata.get(fqn)
    if not isinstance(item, TensorStorageMetadata) or len(item.chunks) != 1:
        raise CheckpointError(f"{shown(Path(ckpt) / METADATA_FILE)}: item {fqn} is not a tensor "
                              "saved whole by one rank")
    path, data = _read_stored(ckpt, metadata, MetadataIndex(fqn, item.chunks[0].offsets),
                              max_bytes)
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a corrupt file
        raise CheckpointError(f"{shown(path)}: item {fqn} does not decode as a tensor "
                              f"({type(e).__name__})") from None
    if (not isinstance(tensor, torch.Tensor) or tensor.dtype != item.properties.dtype
            or tuple(tensor.shape) != tuple(item.size)):
        raise CheckpointError(f"{shown(path)}: item {fqn} is not the tensor its metadata describes")
    return tensor


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads metadata with :func:`read_metadata` and gives bytes
    items to a :class:`SafeLoadPlanner` only (tensors: DCP's ``weights_only`` reads).

    Args:
        path: the checkpoint directory.
        max_metadata_bytes: the largest ``.metadata`` read (see :func:`read_metadata`).
    """

    def __init__(self, path: str | Path, max_metadata_bytes: int = METADATA_MAX_BYTES) -> None:
        super().__init__(path)
        self._dir = Path(path)
        self._max_metadata = max_metadata_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (:func:`read_metadata`).

        Args:
            args, kwargs: DCP's; ``rank`` (per-rank metadata files) is refused: editrain
                writes one global ``.metadata``.
        """
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{shown(self._dir)}: no per-rank metadata is read")
        metadata = read_metadata(self._dir, self._max_metadata)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, after checking that no bytes item goes to a planner that would
        unpickle it with full pickle.

        Args:
            plan: the load plan.
            planner: the load planner.
        """
        if not isinstance(planner, SafeLoadPlanner):
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    raise CheckpointError(f"{shown(self._dir)}: refusing non-tensor item "
                                          f"{item.storage_index.fqn} (only a SafeLoadPlanner "
                                          "may decode one)")
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that never unpickles a bytes item with full pickle.

    Args:
        decodable: which bytes items (by flattened key) may be decoded, with
            :func:`decode_plain`; every other bytes item the load asks for is refused when
            the plan is made. None: none.
    """

    def __init__(self, decodable: Callable[[str], bool] | None = None) -> None:
        super().__init__()
        self._decodable = decodable or (lambda fqn: False)

    def create_local_plan(self) -> Any:
        """DCP's plan, refusing bytes items that are not decodable."""
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO and not self._decodable(item.storage_index.fqn):
                raise CheckpointError(f"refusing non-tensor checkpoint item "
                                      f"{item.storage_index.fqn}: it would be unpickled")
        return plan

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Decode a bytes item safely (:func:`decode_plain`) into the state dict.

        Args:
            read_item: DCP's read item.
            value: its bytes.
        """
        fqn = read_item.dest_index.fqn
        if not self._decodable(fqn):
            raise CheckpointError(f"refusing non-tensor checkpoint item {fqn}")
        obj = decode_plain(value, fqn)
        # Where the key sits in the nested state dict (DCP flattened it for the plan).
        if self.flatten_state_dict:
            node, path = self.original_state_dict, self.mappings[fqn]
        else:
            node, path = self.state_dict, (fqn,)
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = obj
