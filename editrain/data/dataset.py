"""Tokenised corpus cache: text sources -> ``train.bin`` / ``val.bin`` token files.

:func:`prepare_tokens` is called by every rank at start-up. The first caller
builds a cache entry (tokenizer + token files); everybody else, including
later runs with the same settings, memory-maps the finished files. An entry
lives in ``cache_root/<key>/`` where ``key`` hashes everything that changes
the result, and it counts as complete only once ``meta.json`` exists, which is
written last, so a crash mid-build never leaves an entry that looks usable.

Layout of the token files: each document's tokens are followed by one EOS
token, and the documents of a split are concatenated, so the files are flat
1-D arrays of ``uint16`` (vocab <= 65535) or ``uint32`` ids.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .sources import iter_documents, resolve_sources, source_fingerprint
from .tokenizer import (
    MIN_VOCAB_SIZE,
    eos_id,
    load_tokenizer,
    tokenizer_json_hash,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
)

__all__ = ["FORMAT_VERSION", "TokenData", "prepare_tokens", "token_dtype"]

log = logging.getLogger(__name__)

# Bump whenever the bytes written for the same inputs would change (split rule,
# separator placement, tokenizer recipe), so stale entries are not reused.
FORMAT_VERSION = 1

# Documents are encoded in groups of about this many characters: large enough
# for encode_batch to use several threads, small enough to bound memory.
_ENCODE_BATCH_CHARS = 4 << 20
# Longer documents are encoded piecewise, cut after a newline, because one huge
# string would materialise a Python list with an int object per token.
# Tokens at a cut may differ from encoding the whole string; that only changes
# how the text is segmented, never the text itself.
_MAX_PIECE_CHARS = 1 << 20
# Tokens copied per step when splitting the stream into train/val.
_COPY_CHUNK = 1 << 24


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype used on disk for ids of a ``vocab_size`` vocabulary.

    Args:
        vocab_size: Number of ids of the tokenizer.

    Returns:
        ``uint16`` for ``vocab_size <= 65535``, else ``uint32``.
    """
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


@dataclass
class TokenData:
    """A ready-to-use tokenised corpus.

    Args:
        train: Read-only 1-D memmap of training token ids.
        val: Read-only 1-D memmap of validation token ids.
        vocab_size: Number of ids the model's embedding must cover (the real
            tokenizer size, which can be below the requested ``vocab_size``
            when the corpus is too small to learn that many merges).
        tokenizer_path: The ``tokenizer.json`` saved in the entry.
        cache_dir: The cache entry directory.
        eos_id: Id of the document separator token.
        reused: True if an existing entry was used (this call tokenised nothing).
        meta: Contents of the entry's ``meta.json``.
    """

    train: np.memmap
    val: np.memmap
    vocab_size: int
    tokenizer_path: Path
    cache_dir: Path
    eos_id: int = 0
    reused: bool = False
    meta: dict = field(default_factory=dict)


def _validate(vocab_size: int, val_fraction: float, tokenizer_path: str | None) -> None:
    # numpy integers are accepted too (configs are sometimes built from arrays).
    if tokenizer_path is None and (
        not isinstance(vocab_size, (int, np.integer)) or vocab_size < MIN_VOCAB_SIZE
    ):
        raise ValueError(
            f"data.vocab_size must be an int >= {MIN_VOCAB_SIZE} "
            f"(256 byte tokens + end-of-text), got {vocab_size!r}"
        )
    if not (0.0 < float(val_fraction) < 0.5):
        raise ValueError(f"data.val_fraction must be in (0, 0.5), got {val_fraction!r}")


def _cache_key(
    fingerprint: str,
    tokenizer_identity: list,
    max_bytes: int | None,
    val_fraction: float,
    text_field: str,
    eos_token: str | None,
) -> str:
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "source": fingerprint,
            "tokenizer": tokenizer_identity,
            "max_bytes": max_bytes,
            "val_fraction": float(val_fraction),
            "text_field": text_field,
            "eos_token": eos_token,
        },
        sort_keys=True,
        ensure_ascii=True,
    )
    # 32 hex chars (128 bits) keep directory names short while collisions
    # stay impossible in practice.
    return hashlib.sha256(blob.encode("ascii")).hexdigest()[:32]


def _open_entry(entry: Path, reused: bool) -> TokenData | None:
    """Memory-map a complete entry, or return None if it is missing or broken."""
    meta_path = entry / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT_VERSION:
        return None
    dtype = np.dtype(meta["dtype"])
    arrays = {}
    for split in ("train", "val"):
        path = entry / f"{split}.bin"
        n = int(meta[f"{split}_tokens"])
        # A size mismatch means the files were touched after meta.json was
        # written; treat the entry as incomplete so it gets rebuilt.
        if n <= 0 or not path.is_file() or path.stat().st_size != n * dtype.itemsize:
            return None
        arrays[split] = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    tok_path = entry / "tokenizer.json"
    if not tok_path.is_file():
        return None
    return TokenData(
        train=arrays["train"],
        val=arrays["val"],
        vocab_size=int(meta["vocab_size"]),
        tokenizer_path=tok_path,
        cache_dir=entry,
        eos_id=int(meta["eos_id"]),
        reused=reused,
        meta=meta,
    )


def _fsync_dir(path: Path) -> None:
    # Makes the renames durable, so a power loss cannot resurrect a meta.json
    # whose data files were never flushed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _pieces(doc: str) -> Iterator[str]:
    """Split a very long document after newlines into encodable pieces."""
    start = 0
    while len(doc) - start > _MAX_PIECE_CHARS:
        cut = doc.rfind("\n", start, start + _MAX_PIECE_CHARS)
        # No newline in range (e.g. minified text): cut hard at the limit.
        end = cut + 1 if cut >= start else start + _MAX_PIECE_CHARS
        yield doc[start:end]
        start = end
    yield doc[start:]


def _encode_to_file(tok, docs: Iterable[str], eos: int, dtype: np.dtype, out) -> list[int]:
    """Encode ``docs`` (each followed by EOS) into ``out``; return tokens per document."""
    lengths: list[int] = []
    batch: list[str] = []
    owners: list[int] = []  # document index of each piece in ``batch``
    ends: list[bool] = []  # whether the piece is the last one of its document
    batch_chars = 0

    def flush() -> None:
        nonlocal batch, owners, ends, batch_chars
        if not batch:
            return
        flat: list[int] = []
        for i, enc in enumerate(tok.encode_batch_fast(batch)):
            flat.extend(enc.ids)
            lengths[owners[i]] += len(enc.ids) + int(ends[i])
            if ends[i]:
                flat.append(eos)
        np.asarray(flat, dtype=dtype).tofile(out)
        batch, owners, ends, batch_chars = [], [], [], 0

    for doc_index, doc in enumerate(docs):
        lengths.append(0)
        pieces = list(_pieces(doc))
        for j, piece in enumerate(pieces):
            batch.append(piece)
            owners.append(doc_index)
            ends.append(j == len(pieces) - 1)
            batch_chars += len(piece)
            # Flushing may happen mid-document; ``ends`` tells flush() where
            # the EOS separators go.
            if batch_chars >= _ENCODE_BATCH_CHARS:
                flush()
    flush()
    return lengths


def _choose_val_documents(lengths: np.ndarray, val_fraction: float) -> np.ndarray | None:
    """Boolean mask of validation documents, or None to fall back to a token split.

    ``k = max(1, round(n * f))`` documents at evenly spaced indices form the
    validation set, so it samples the whole corpus (beginning, middle, end)
    and is identical on every build. When there are too few documents for
    that to come near the requested fraction (a single big text file, or a few
    files of very different size) the caller splits the token stream instead.
    """
    n = len(lengths)
    if n < 2:
        return None
    k = max(1, round(n * val_fraction))
    idx = ((np.arange(k) + 0.5) * n / k).astype(np.int64)
    mask = np.zeros(n, dtype=bool)
    mask[idx] = True
    if lengths[mask].sum() > 2 * val_fraction * lengths.sum():
        return None
    return mask


def _copy_range(src: np.ndarray, start: int, end: int, out) -> None:
    for s in range(start, end, _COPY_CHUNK):
        np.asarray(src[s : min(end, s + _COPY_CHUNK)]).tofile(out)


def _split_to_files(
    all_path: Path, dtype: np.dtype, lengths: np.ndarray, val_fraction: float, entry: Path
) -> dict:
    """Write ``train.bin`` and ``val.bin`` from the full stream; return split stats."""
    total = int(lengths.sum())
    stream = np.memmap(all_path, dtype=dtype, mode="r", shape=(total,))
    mask = _choose_val_documents(lengths, val_fraction)
    tmp = {s: entry / f"{s}.bin.tmp.{os.getpid()}" for s in ("train", "val")}
    with open(tmp["train"], "wb") as f_train, open(tmp["val"], "wb") as f_val:
        if mask is None:
            # Tail split: the val set is the last ceil(f * total) tokens; f < 0.5
            # keeps the train part non-empty.
            n_val = max(1, math.ceil(val_fraction * total))
            _copy_range(stream, 0, total - n_val, f_train)
            _copy_range(stream, total - n_val, total, f_val)
            stats = {"split": "tokens", "val_documents": 0}
        else:
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            # Copy maximal runs of consecutive documents of the same split,
            # so the loop runs per run, not per document.
            change = np.flatnonzero(mask[1:] != mask[:-1]) + 1
            bounds = np.concatenate([[0], change, [len(lengths)]])
            for a, b in zip(bounds[:-1], bounds[1:]):
                out = f_val if mask[a] else f_train
                _copy_range(stream, int(offsets[a]), int(offsets[b]), out)
            stats = {"split": "documents", "val_documents": int(mask.sum())}
        for fh in (f_train, f_val):
            fh.flush()
            os.fsync(fh.fileno())
    del stream
    sizes = {s: tmp[s].stat().st_size // dtype.itemsize for s in tmp}
    for s in ("train", "val"):
        os.replace(tmp[s], entry / f"{s}.bin")
    stats.update(train_tokens=int(sizes["train"]), val_tokens=int(sizes["val"]))
    return stats


def _build_entry(
    entry: Path,
    refs,
    source_spec,
    vocab_size: int,
    tokenizer_path: str | None,
    val_fraction: float,
    max_bytes: int | None,
    eos_token: str | None,
    key: str,
) -> None:
    t0 = time.monotonic()
    if entry.exists():
        # Leftovers of an interrupted build: never trust partially written files.
        shutil.rmtree(entry)
    entry.mkdir(parents=True)

    tok_file = entry / "tokenizer.json"
    if tokenizer_path is not None:
        tok = load_tokenizer(tokenizer_path)
        # Copy the user's bytes verbatim so the entry's file hashes the same.
        _atomic_write_bytes(tok_file, Path(tokenizer_path).expanduser().read_bytes())
    else:
        log.info("training byte-level BPE tokenizer (vocab_size=%d)", vocab_size)
        tok = train_bpe_tokenizer(iter_documents(refs, max_bytes), vocab_size)
        _atomic_write_bytes(tok_file, tok.to_str().encode("utf-8"))

    eos = eos_id(tok, eos_token)
    vsize = tokenizer_vocab_size(tok)
    dtype = token_dtype(vsize)
    # Text that happens to contain "<|endoftext|>" must stay text: separators
    # are only the ones inserted between documents here.
    tok.encode_special_tokens = True

    all_path = entry / f"all.bin.tmp.{os.getpid()}"
    log.info("tokenising corpus into %s", entry)
    with open(all_path, "wb") as out:
        lengths = np.asarray(
            _encode_to_file(tok, iter_documents(refs, max_bytes), eos, dtype, out), dtype=np.int64
        )
    try:
        stats = _split_to_files(all_path, dtype, lengths, val_fraction, entry)
    finally:
        all_path.unlink(missing_ok=True)

    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "source": [
            os.fspath(s)
            for s in ([source_spec] if isinstance(source_spec, (str, os.PathLike)) else source_spec)
        ],
        "max_bytes": max_bytes,
        "val_fraction": float(val_fraction),
        "tokenizer": "user" if tokenizer_path is not None else "bpe",
        "requested_vocab_size": vocab_size,
        "vocab_size": vsize,
        "eos_id": eos,
        "dtype": dtype.name,
        "documents": int(len(lengths)),
        "build_seconds": round(time.monotonic() - t0, 3),
        **stats,
    }
    _fsync_dir(entry)
    # meta.json last: its presence is what marks the entry complete.
    _atomic_write_bytes(entry / "meta.json", json.dumps(meta, indent=1).encode("ascii"))
    _fsync_dir(entry)
    log.info(
        "token cache built: %d train / %d val tokens in %.1fs",
        stats["train_tokens"],
        stats["val_tokens"],
        meta["build_seconds"],
    )


def prepare_tokens(
    source: str | list[str],
    cache_root: str | Path,
    vocab_size: int = 8192,
    tokenizer_path: str | None = None,
    val_fraction: float = 0.01,
    max_bytes: int | None = None,
    *,
    text_field: str = "text",
    eos_token: str | None = None,
) -> TokenData:
    """Return the tokenised train/val split of ``source``, building it if needed.

    Safe to call from every rank at once: an ``fcntl.flock`` lock file in
    ``cache_root`` lets exactly one process build a missing entry while the
    others wait and then reuse it. (flock needs a local or flock-capable
    shared file system; on multi-node jobs use a per-node ``cache_root`` or
    build once before launching.)

    The validation split takes whole documents at evenly spaced indices (about
    ``val_fraction`` of them, at least one). If the corpus has too few
    documents for that (e.g. one big text file), the last ``val_fraction`` of
    the token stream is used instead; ``meta["split"]`` records which.

    Args:
        source: ``data.path`` spec: ``"default"``, file/directory paths, or a list.
        cache_root: Directory holding cache entries (created if missing).
        vocab_size: Target BPE vocabulary size; ignored with ``tokenizer_path``.
        tokenizer_path: Optional user ``tokenizer.json`` (``data.tokenizer``)
            used instead of training a BPE.
        val_fraction: Share of the corpus held out for validation, in (0, 0.5).
        max_bytes: Only read this many bytes of text (for small runs/tests).
        text_field: Field/column holding the text in jsonl/parquet sources.
        eos_token: Name of the document separator in a user tokenizer;
            ``None`` auto-detects (see :func:`editrain.data.tokenizer.eos_id`).

    Returns:
        A :class:`TokenData` with memory-mapped splits.

    Raises:
        ValueError: Invalid ``vocab_size``/``val_fraction``, empty corpus, or
            a user tokenizer without an end-of-text token.
        FileNotFoundError: A ``data.path`` or ``data.tokenizer`` path is missing.
    """
    _validate(vocab_size, val_fraction, tokenizer_path)
    vocab_size = int(vocab_size)
    if tokenizer_path is not None:
        tokenizer_path = os.fspath(tokenizer_path)
    refs = resolve_sources(source, text_field)
    if tokenizer_path is not None:
        # Loading validates the file (and the EOS token) before any waiting or
        # building, so a bad path fails fast on every rank.
        eos_id(load_tokenizer(tokenizer_path), eos_token)
        tok_identity = ["file", tokenizer_json_hash(tokenizer_path)]
    else:
        tok_identity = ["bpe", vocab_size]
    key = _cache_key(
        source_fingerprint(refs, max_bytes),
        tok_identity,
        max_bytes,
        val_fraction,
        text_field,
        eos_token,
    )
    root = Path(cache_root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key

    # Fast path without the lock: meta.json is renamed into place only after
    # everything else is durable, so seeing it means the entry is complete.
    data = _open_entry(entry, reused=True)
    if data is not None:
        return data

    with open(root / f"{key}.lock", "a+b") as lock:
        # The lock file is never deleted: unlinking it while another process
        # waits on it would let two builders run at once.
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            data = _open_entry(entry, reused=True)
            if data is not None:
                return data  # another process built it while we waited
            _build_entry(
                entry,
                refs,
                source,
                vocab_size,
                tokenizer_path,
                val_fraction,
                max_bytes,
                eos_token,
                key,
            )
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    data = _open_entry(entry, reused=False)
    if data is None:  # pragma: no cover - would mean the file system lost our writes
        raise RuntimeError(f"token cache entry {entry} is incomplete right after building it")
    return data
