"""A local Hugging Face model directory: its config, its safetensors weights, its tokenizer.

What :func:`inspect_weights` accepts is checked without running anything from the files and
without reading the tensors: only ``*.safetensors`` files are weights (a pickle-based
``pytorch_model.bin``, ``*.pt`` or ``*.ckpt`` is refused with the reason, never opened),
every weight file must lie in the directory (a symlink resolving elsewhere is refused, but
for a snapshot of the Hugging Face hub cache, whose files are links into the repository's
``blobs/``), every JSON file is parsed with a bounded nesting depth, and
each file's header is validated by hand (8-byte length, bounded JSON, every tensor's byte
range inside the file and as long as its shape and dtype say) before the safetensors
library or DCP opens it. Every error is one line that names the option it came from.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from editrain.errors import spelled
from editrain.models.hf_fields import (
    HF_COUNT_MAX,
    HF_FLAG_KEYS,
    HF_KEYS,
    HF_LAYERS_MAX,
    HF_POSITIVE_KEYS,
    check_hf_numbers,
    hf_count,
    hf_flag,
    hf_int,
    hf_key,
    hf_object,
    hf_positive,
)
from editrain.models.hf_llama import to_hf_name
from editrain.paths import shown
from editrain.safe_io import quote, read_json_value

if TYPE_CHECKING:  # annotations only: the file checks run without torch (editrain data)
    from torch import Tensor, nn

__all__ = [
    "HEADER_LIMIT",
    "HF_COUNT_MAX",
    "HF_FLAG_KEYS",
    "HF_KEYS",
    "HF_LAYERS_MAX",
    "HF_POSITIVE_KEYS",
    "HUB_PREFIX",
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFWeights",
    "TensorInfo",
    "check_hf_numbers",
    "check_tensors",
    "hf_count",
    "hf_flag",
    "hf_int",
    "hf_key",
    "hf_object",
    "hf_parameters",
    "hf_positive",
    "hub_snapshot",
    "inspect_weights",
    "listed_files_only",
    "read_config",
    "read_safetensors_header",
    "special_tokens",
    "tokenizer_file",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_LIMIT = 100 * 2**20
"""Largest safetensors header accepted (the safetensors library's own limit): a corrupt
length field must not make us read gigabytes of "JSON"."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files that are Python pickles: loading one runs code from the file."""

# Bytes per element of each safetensors dtype.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, as its header describes it."""

    dtype: str
    shape: tuple[int, ...]
    file: str


@dataclass
class HFWeights:
    """The weights of a model directory: every tensor name -> where and what it is."""

    root: Path
    files: list[str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def _fail(option: str, msg: str) -> ValueError:
    return ValueError(f"{option}: {msg}")


def _named(name: str) -> str:
    """A tensor's or shard's name, as the JSON its file holds spells it (a safetensors
    header, ``model.safetensors.index.json``), whole: the longest a hub model has is well
    under the bound."""
    return quote(name, limit=300)


def read_config(path: str | Path, option: str = "model.init_from") -> dict[str, Any]:
    """``DIR/config.json`` as a dict (with a ``model_type``).

    Raises:
        ValueError: one line naming ``option``: no directory, no config, bad JSON, a
            number editrain reads that is not one (:func:`check_hf_numbers`).
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise _fail(option, f"{shown(root)} is not a directory (expected a Hugging Face model "
                    "directory with config.json and *.safetensors)")
    cfg = root / "config.json"
    if not cfg.is_file():
        raise _fail(option, f"{shown(root)} has no config.json")
    data = _json(cfg, option)
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise _fail(option, f"{shown(cfg)} has no \"model_type\"; it is not a Hugging Face config")
    check_hf_numbers(data, f"{option}: {shown(cfg)}")
    return data


def _json(path: Path, option: str) -> Any:
    """A JSON file of a model directory, parsed with a bounded nesting depth
    (:func:`editrain.safe_io.read_json_value`): one line naming ``option`` otherwise."""
    try:
        text = path.read_bytes()
    except OSError as e:
        raise _fail(option, f"{shown(path)}: cannot read it ({e.strerror})") from None
    return read_json_value(text, f"{option}: {shown(path)}", error=ValueError)


def _inside(root: Path, p: Path, option: str) -> Path:
    real = p.resolve()
    for base in _trusted_roots(root):
        if real == base or base in real.parents:
            return real
    raise _fail(option, f"{shown(p)} is a link to {shown(real)}, outside {shown(root)} (and not into its Hugging "
                "Face cache's blobs/); copy the file into the directory")


def _trusted_roots(root: Path) -> list[Path]:
    """Where a model directory's files may resolve to: the directory itself, and for a
    snapshot of the Hugging Face hub cache (``models--ORG--NAME/snapshots/REVISION``, whose
    files are links to ``../../blobs/HASH``) that repository's ``blobs/``."""
    trusted = [root.resolve()]
    here = root.absolute()
    blobs = here.parent.parent / "blobs"
    if here.parent.name == "snapshots" and here.parent.parent.name.startswith("models--") \
            and blobs.is_dir() and not blobs.is_symlink():
        trusted.append(blobs.resolve())
    return trusted


def _integers(value: Any) -> bool:
    """Whether ``value`` is a list of JSON integers (never a bool, a float or a string)."""
    return isinstance(value, list) and all(type(v) is int for v in value)


def read_safetensors_header(path: Path, option: str = "model.init_from"
                            ) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, from its header, each checked against the file.

    Raises:
        ValueError: one line naming ``option`` and the file: too short, a header length
            beyond the file or :data:`HEADER_LIMIT`, bad JSON, an unknown dtype, a byte
            range outside the data or of the wrong size, ranges that overlap.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _fail(option, f"{shown(path)} is truncated ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > HEADER_LIMIT or 8 + n > size:
            raise _fail(option, f"{shown(path)} is truncated or corrupt (header of {n} bytes in a "
                        f"file of {size})")
        raw = f.read(n)
    try:
        header = read_json_value(raw, "header", error=ValueError)
    except ValueError as e:
        raise _fail(option, f"{shown(path)} is corrupt (its safetensors {e})") from None
    if not isinstance(header, dict):
        raise _fail(option, f"{shown(path)} is corrupt (its safetensors header is not an object)")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        # Sizes and offsets as the header writes them, JSON integers: int() made a
        # dimension of true 1, of 2.7 2 and of "12" 12 (and an offset of "0" 0).
        if not (isinstance(entry, dict) and _integers(entry.get("shape"))
                and _integers(entry.get("data_offsets")) and len(entry["data_offsets"]) == 2):
            raise _fail(option, f"{shown(path)} is corrupt (bad header entry for {_named(name)}: its shape "
                        f"and data_offsets must be lists of JSON integers, found "
                        f"{quote(entry)})")
        dtype, shape = entry.get("dtype"), list(entry["shape"])
        begin, end = entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES or any(d < 0 for d in shape):
            raise _fail(option, f"{shown(path)}: tensor {_named(name)} has dtype {quote(dtype)} and shape "
                        f"{shape}, which safetensors does not define")
        want = math.prod(shape) * _DTYPE_BYTES[dtype]
        if not 0 <= begin <= end <= data_size or end - begin != want:
            raise _fail(option, f"{shown(path)} is truncated or corrupt (tensor {_named(name)} at bytes "
                        f"{begin}..{end} of {data_size}, needs {want})")
        spans.append((begin, end, name))
        out[name] = TensorInfo(dtype, tuple(shape), path.name)
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise _fail(option, f"{shown(path)} is corrupt (tensors {_named(a)} and {_named(b)} overlap)")
    return out


def inspect_weights(path: str | Path, option: str = "model.init_from") -> HFWeights:
    """The safetensors weights of a model directory, checked (see the module's docstring).

    One ``model.safetensors``, else the shards ``model.safetensors.index.json`` names; as
    for transformers, any other ``*.safetensors`` file is not weights of the model (the
    original checkpoint's ``consolidated.safetensors`` of a Mistral repository, an index's
    shards beside ``model.safetensors``) and is never read (:func:`listed_files_only`).

    Raises:
        ValueError: one line naming ``option``: no weights, pickle files only, a weight
            file outside the directory, a shard missing, a tensor the index places in
            another file or does not list, a bad header.
    """
    root = Path(path).expanduser()
    index = root / INDEX_FILE
    if (root / SINGLE_FILE).is_file():  # transformers, too, reads it before any index
        files, weight_map = [SINGLE_FILE], None
    elif index.exists():
        _inside(root, index, option)
        data = _json(index, option)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise _fail(option, f"{shown(index)} is not a safetensors index (no weight_map)")
        weight_map = {tname: _shard_name(root, name, index, option)
                      for tname, name in weight_map.items()}
        files = sorted(set(weight_map.values()))
    else:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise _fail(option, f"{shown(root)} has only {shown(pickles[0])}, a pickle-based weight file "
                        "that could run code when loaded, so editrain never loads one; "
                        "convert it to safetensors (save_pretrained(..., "
                        "safe_serialization=True))")
        raise _fail(option, f"{shown(root)} has no weights ({SINGLE_FILE} or {INDEX_FILE} with "
                    "its shards)")
    weights = HFWeights(root, files)
    for name in files:
        real = _inside(root, root / name, option)
        for tname, info in read_safetensors_header(real, option).items():
            if tname in weights.tensors:
                raise _fail(option, f"tensor {_named(tname)} is in both "
                            f"{shown(weights.tensors[tname].file)} and {shown(name)}")
            if weight_map is not None and tname not in weight_map:
                raise _fail(option, f"{shown(name)} holds {_named(tname)}, which {INDEX_FILE} does not "
                            "list")
            if weight_map is not None and weight_map[tname] != name:
                raise _fail(option, f"{shown(name)} holds {_named(tname)}, which {INDEX_FILE} places in "
                            f"{shown(weight_map[tname])}")
            weights.tensors[tname] = TensorInfo(info.dtype, info.shape, name)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(weights.tensors))
        if missing:
            raise _fail(option, f"{INDEX_FILE} places {_named(missing[0])} in "
                        f"{shown(weight_map[missing[0]])}, which does not hold it")
    return weights


def _shard_name(root: Path, name: Any, index: Path, option: str) -> str:
    """A file the index names, as a name in ``root`` (``./model-1.safetensors`` is
    ``model-1.safetensors``, as transformers reads it)."""
    import posixpath

    plain = posixpath.normpath(name) if isinstance(name, str) else None
    if (plain is None or "/" in plain or not plain.endswith(".safetensors")
            or not (root / plain).is_file()):
        raise _fail(option, f"{shown(index)} names the shard {_named(name)}, which is not a safetensors "
                    f"file of {shown(root)}")
    return plain


@contextlib.contextmanager
def listed_files_only(weights: HFWeights) -> Iterator[str]:
    """A directory that holds the model's weight files and nothing else, for DCP's
    ``HuggingFaceStorageReader``, which reads every ``*.safetensors`` file of the directory
    it is given: ``weights.root`` itself when that holds no other, else a temporary
    directory of links to them (removed after the block)."""
    root = weights.root
    present = {p.name for p in root.iterdir() if p.name.endswith(".safetensors")}
    if present == set(weights.files):
        yield str(root)
        return
    with tempfile.TemporaryDirectory(prefix="editrain-weights-") as view:
        for name in weights.files:
            os.symlink((root / name).resolve(), Path(view) / name)
        yield view


HUB_PREFIX = "hf:"
"""``hf:ORG/NAME[@REVISION]``: a model of the Hugging Face hub cache, by its id."""


def hub_snapshot(spec: str, option: str) -> str:
    """The local directory of ``hf:ORG/NAME[@REVISION]`` in the Hugging Face hub cache
    (where ``HF_HUB_CACHE``, else ``HF_HOME``, puts it), found with ``huggingface_hub``'s
    own lookup and never downloaded: the snapshot of ``REVISION`` (a branch, tag or commit;
    default ``main``).

    Raises:
        ValueError: one line naming ``option``: a malformed id, or a model the cache does
            not hold (with where the cache is and how to fill it).
    """
    repo, _, revision = spec[len(HUB_PREFIX):].partition("@")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # tokenizers depends on it; a broken install may still lack it
        raise _fail(option, f"{spelled(spec)} needs the huggingface_hub package (pip install "
                    "huggingface_hub)") from None
    try:
        validate_repo_id(repo)
    except Exception as e:  # HFValidationError (its module moved between versions)
        raise _fail(option, f"{spelled(spec)} is not hf:ORG/NAME[@REVISION] "
                    f"({str(e).splitlines()[0][:200]})") from None
    try:
        return snapshot_download(repo, revision=revision or None, local_files_only=True)
    except Exception:  # LocalEntryNotFoundError, RevisionNotFoundError...
        at = f"@{revision}" if revision else ""
        raise _fail(option, f"{repo}{at} is not in the Hugging Face cache "
                    f"({shown(constants.HF_HUB_CACHE)}, set by HF_HOME or HF_HUB_CACHE); editrain "
                    f"never downloads: fetch it first (hf download {repo}"
                    f"{f' --revision {revision}' if revision else ''})") from None


def tokenizer_file(path: str | Path) -> Path | None:
    """``DIR/tokenizer.json`` when a directory has one, else None."""
    p = Path(path).expanduser() / "tokenizer.json"
    return p if p.is_file() else None


def _token_text(data: dict[str, Any], key: str, where: Path) -> str | None:
    """A special token's text as ``tokenizer_config.json`` / ``special_tokens_map.json``
    write it: a string, or an AddedToken object whose ``content`` is one; None where the
    field is absent, null or empty. Anything else (``5``, ``true``, ``["</s>"]``) is
    refused, not skipped: skipped, the end of text would silently become another token."""
    value = data.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    if text is None or isinstance(text, str):
        return text or None
    raise ValueError(f"data.tokenizer: {shown(where)}: {key} is {quote(value)}; expected the "
                     "token's text (a string, or an object whose \"content\" is one), or null")


def special_tokens(path: str | Path) -> dict[str, str]:
    """The special tokens a model directory declares: ``eos``, ``bos``, ``pad`` (those it
    names), from ``tokenizer_config.json``, else ``special_tokens_map.json``.

    Raises:
        ValueError: one of the files is not valid JSON, or names a token by something
            other than its text (names ``data.tokenizer``, the file and the field).
    """
    root = Path(path).expanduser()
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later one wins
        f = root / name
        if not f.is_file():
            continue
        data = _json(f, "data.tokenizer")
        if not isinstance(data, dict):
            raise ValueError(f"data.tokenizer: {shown(f)} is not a JSON object")
        for kind in ("eos", "bos", "pad"):
            text = _token_text(data, f"{kind}_token", f)
            if text is not None:
                out[kind] = text
    return out


def hf_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The parameters of ``model`` under their Hugging Face names, each parameter once.

    editrain's Llama (or a pipeline stage of it, which keeps the model's names) is renamed
    by :func:`editrain.models.hf_llama.to_hf_name`; a Hugging Face model wrapped by
    :class:`editrain.models.hf.HFCausalLM` (or a stage of one) keeps its own names without
    the wrapper's ``hf.`` prefix. A tied output head is the embedding's parameter and is
    listed once, under the embedding's name, as ``save_pretrained`` writes it.
    """
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        out[name[3:] if name.startswith("hf.") else to_hf_name(name)] = p
    return out


def check_tensors(weights: HFWeights, expected: dict[str, tuple[int, ...]],
                  option: str = "model.init_from") -> None:
    """The directory holds exactly the tensors the model needs, each of its shape.

    Args:
        weights: what :func:`inspect_weights` found.
        expected: Hugging Face name -> shape of every parameter of the model.

    Raises:
        ValueError: one line naming ``option``: a tensor missing, of another shape, or one
            the model has no parameter for (it would be dropped silently).
    """
    root = weights.root
    extra = sorted(set(weights.tensors) - set(expected))
    for name, shape in expected.items():
        info = weights.tensors.get(name)
        if info is None and extra:
            # e.g. GPT-NeoX's embed_out (lm_head now), Mixtral's per-expert w1/w2/w3 (one
            # fused tensor now): transformers converts such files as it loads them
            raise _fail(option, f"{shown(root)} has no tensor {_named(name)}, which the model of "
                        f"its config.json needs, but {len(extra)} it has no parameter for "
                        f"({_named(extra[0])}, ...): the hub's layout of this architecture, which "
                        "transformers renames or merges as it loads it, while editrain reads "
                        "the model's own names; convert it once: load it with transformers "
                        "and write NEW/model.safetensors with safetensors.torch.save_model, "
                        "beside copies of its config.json and tokenizer files")
        if info is None:
            raise _fail(option, f"{shown(root)} has no tensor {_named(name)}, which the model of "
                        "its config.json needs")
        if tuple(info.shape) != tuple(shape):
            raise _fail(option, f"tensor {_named(name)} in {shown(root / info.file)} has shape "
                        f"{list(info.shape)}, the model of its config.json needs "
                        f"{list(shape)} (a shape or vocabulary mismatch)")
    if extra:
        raise _fail(option, f"{shown(root)} holds the tensor {_named(extra[0])}, which the model of its "
                    "config.json has no parameter for")
