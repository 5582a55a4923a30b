"""Tokenised corpus cache: text sources -> ``train.bin`` / ``val.bin`` token files.

:func:`prepare_tokens` is called by every rank at start-up. The first caller
builds a cache entry (tokenizer + token files); everybody else, including
later runs with the same settings, memory-maps the finished files. An entry
lives in ``cache_root/<key>/`` where ``key`` hashes everything that changes
the result, and it counts as complete only once ``meta.json`` exists, which is
written last, so a crash mid-build never leaves an entry that looks usable.

Building an entry: the validation split is decided on the text first, by whole
documents with families and near-duplicates kept on one side
(:mod:`editrain.data.split`); the BPE tokenizer is then trained on the training
side only; both sides are tokenised; the share of validation 32-token windows that
also occur in training is measured and recorded in ``meta.json``.

Layout of the token files: the documents of a split are concatenated, separated as
``data.eos`` says (``EOS_POLICIES``: by default one EOS token after every document), so
the files are flat 1-D arrays of ``uint16`` (vocab <= 65535) or ``uint32`` ids.

Documents are streamed through every pass, so corpora larger than memory can be tokenised:
what stays in memory is the split's metadata, about 330 bytes per document (its MinHash
signature, digest, family, name, as column arrays; :mod:`editrain.data.split`) and each
document's token count (8 bytes), one encoder batch (``_ENCODE_BATCH_CHARS``; a pass over a
large corpus is encoded by worker processes, :mod:`editrain.data.encode_pool`, a few small
batches each), the digests of the documents read (exact duplicates are not encoded), the
validation split's window hashes for the overlap measure, and the BPE trainer's state,
which grows with the text it sees: at most ``BPE_SAMPLE_BYTES`` (:func:`bpe_sample`). The
texts of the last documents a tail split may cut (``_RecentTexts``, about twice the
validation split) wait in files of the entry.
What the encoding frees is handed back to the kernel after every batch
(:func:`editrain.malloc.release_freed_memory`), so that the resident set follows this list.
A slow build shows one progress bar for the whole build on a terminal
(:mod:`editrain.data.progress`). An entry is built in a private directory
(``.KEY.HOST.PID``) and renamed into place when complete. A pre-tokenised corpus
(:mod:`editrain.data.pretokenized`) is copied into an entry without tokenising.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from editrain.errors import plain_count, plain_scalar, require, spelled
from editrain.malloc import release_freed_memory
from editrain.paths import shown
from editrain.safe_io import Int, Map, Num, Obj, Str, quote, read_json

from .encode_worker import edges, template_ids
from .overlap import window_overlap
from .pretokenized import (
    TokenFile,
    copy_checked,
    open_tokens,
    row_ids,
    tail_split,
    write_checked,
)
from .progress import BuildProgress
from .sources import (
    Document,
    iter_records,
    parse_sources,
    resolve_sources,
    source_fingerprint,
    source_size,
    token_row_batches,
)
from .split import (
    MAX_VAL_SHARE,
    NEAR_DUP_JACCARD,
    DocumentTable,
    SplitPlan,
    plan_split,
    plan_splits,
)
from .tokenizer import (
    check_vocab_size,
    eos_id,
    load_tokenizer,
    tokenizer_json_hash,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
)

__all__ = [
    "BPE_SAMPLE_BYTES",
    "DEFAULT_VAL_TOKENS",
    "EOS_POLICIES",
    "FORMAT_VERSION",
    "OVERLAP_MAX_WINDOWS",
    "OVERLAP_WINDOW",
    "VAL_DOCUMENTS_FILE",
    "TokenData",
    "check_data_options",
    "bpe_sample",
    "separator_id",
    "check_token_ids",
    "prepare_tokens",
    "token_dtype",
]

log = logging.getLogger(__name__)

# Bump whenever the bytes written for the same inputs would change (split rule,
# separator placement, tokenizer recipe), so stale entries are not reused.
# 3: one-permutation MinHash signatures (near-duplicates found by other hashes).
# 4: a draw of coarse families short of data.val_tokens is completed by one more family.
FORMAT_VERSION = 4

# Documents are encoded in groups of about this many characters: large enough
# for encode_batch to use several threads (it releases the GIL and splits a batch over
# its Rust thread pool), small enough to bound memory: the Encoding objects of a batch
# take about 25 bytes per character of text, whatever the corpus's size.
_ENCODE_BATCH_CHARS = 1 << 20
# Longer documents are encoded piecewise (_pieces): tokenizers holds far more memory for
# one long string than for the same text in short ones (a build's peak over the 40 largest
# Python files of a site-packages, 21 MB: 438 MiB with 1 MiB pieces, 254 with 256 KiB, 170
# with 64 KiB, against 153 for 20 MB of ordinary files; 2-core AMD EPYC), and one huge
# string would materialise a Python list with an int object per token.
# A worker process encodes alone (one thread): smaller batches keep each one's memory low.
_POOL_BATCH_CHARS = 1 << 18
_MAX_PIECE_CHARS = 1 << 16
# A pass over at least this much text is encoded in worker processes (encode_pool): their
# start (an interpreter, the tokenizer loaded) costs about a second, a few percent of such
# a pass; a smaller one is encoded in the build's process.
_POOL_MIN_CHARS = 16 << 20
# Where a piece may end: where a byte-level BPE with GPT-2's pre-tokenizer (editrain's own
# tokenizer) splits the text anyway, so that the pieces encode into exactly the tokens of
# the whole document. In order of preference: after a newline between two non-space
# characters (that newline is a pre-token of its own); before a space between two non-space
# characters (the space begins the next pre-token, " word"); between two ASCII characters
# of different kinds among letters, digits and punctuation (each kind is a run of its own;
# a quote only ends a run: "'s" is one pre-token). The last such place in the second half of
# the piece's range; without one, after any newline, else at the limit: tokens there, and at
# every cut with other tokenizers, may differ from encoding the whole string (the
# segmentation only, never the text).
_PUNCT = r"!-&(-/:-@\[-`{-~"  # ASCII punctuation but the quote
_PIECE_CUTS = (re.compile(r"(?<=\S)\n(?=\S)"), re.compile(r"(?<=\S)(?= \S)"),
               re.compile(rf"(?<=[{_PUNCT}])(?=[A-Za-z0-9])|(?<=[A-Za-z0-9])(?=[{_PUNCT}'])"
                          r"|(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])"))
# The validation floor is in tokens but the split is planned in bytes before the
# tokenizer exists: plan with this guess, then re-plan with the measured ratio if short.
_BYTES_PER_TOKEN_GUESS = 3.2
_SPLIT_ATTEMPTS = 3
BPE_SAMPLE_BYTES = 8_000_000
"""Most bytes of training text the BPE tokenizer is trained on when none is given. A
larger training side is sampled by whole documents (chosen by their hash, so the same
corpus always gives the same sample): the trainer's memory and time grow with the text it
sees (on 20 MB of Python, training on all of it took twice the encoding's time). 8 MB is
what the default corpus (``data.max_bytes``) has always trained on, so its tokens are
unchanged. A sample is drawn from the documents that stay on the training side of the
splits with larger validation targets too, up to twice the first (``_RESERVE_STEPS``), so
that when the validation split is planned again (its floor is in tokens, the first plan in
guessed bytes) the tokenizer is kept: it is trained again only if the final split's
validation side holds any text it was trained on."""
# Bumped when the rule above changes which text a sampled BPE sees (part of the cache key).
# 2: the sample also avoids the validation side of the split with twice the first target;
# 3: of the splits with targets up to twice the first, in _RESERVE_STEPS steps.
_BPE_SAMPLE_RULE = 3
# The larger targets a sampled BPE avoids: the first split's target times 1 + k / steps for
# k = 1 .. steps. A re-planned target may fall anywhere in between, and the greedy draw of
# families is not nested as the target grows (a larger target can leave out a family a
# smaller one takes). On 20 MB of a site-packages tree, 10 seeds x 8 re-planned targets
# from 1.05x to 1.95x: with the 2x split alone 18 of the 80 re-plans put sampled documents
# in validation (the tokenizer trained again), with 8 steps 3, with 16 none; 16 plans cost
# 0.15 s there (2-core AMD EPYC).
_RESERVE_STEPS = 16

# Relative cost of one character of corpus in each pass of a build, for the progress
# bar's estimate of the whole build (measured on a 2-core EPYC: reading 0.25 s, describing
# 0.75 s, BPE training 6 s, encoding 18 s per 20 MB of Python source).
_COST_READ = 0.05
_COST_DESCRIBE = 0.2
_COST_BPE = 1.5
_COST_ENCODE = 4.0

OVERLAP_WINDOW = 32
"""Window length (tokens) of the val/train overlap recorded in ``meta.json``."""
OVERLAP_MAX_WINDOWS = 1 << 19
"""Most validation windows the overlap in ``meta.json`` is measured on: a larger validation
split is sampled by window hash (see :func:`~editrain.data.overlap.window_overlap`), so the
measure's memory (about 40 bytes per window) stays bounded: 2^21 windows made it the
largest part of a 1 GB build's peak (+91 MiB, 2.9 M validation tokens; +49 MiB at 2^19).
The share's sampling error (one standard deviation) is then at most 0.07 percentage
point."""

VAL_DOCUMENTS_FILE = "val_documents.json"
"""Cache entry file listing ``[name, family, kind]`` of every validation document."""

DEFAULT_VAL_TOKENS = 65_536
"""Default floor of the validation split, in tokens (``data.val_tokens``)."""

EOS_POLICIES = ("append", "prepend", "none")
"""Values of ``data.eos``: where the end-of-text token goes. ``append``: after every
document; ``prepend``: before every document; ``none``: documents are concatenated without
a separator."""


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
        eos_id: Id of the document separator token; None where ``data.eos`` is ``none`` and
            the tokenizer has no end-of-text token.
        reused: True if an existing entry was used (this call tokenised nothing).
        meta: Contents of the entry's ``meta.json``.
    """

    train: np.memmap
    val: np.memmap
    vocab_size: int
    tokenizer_path: Path
    cache_dir: Path
    eos_id: int | None = 0
    reused: bool = False
    meta: dict = field(default_factory=dict)


def _check_eos(eos: str) -> None:
    if eos not in EOS_POLICIES:
        raise ValueError(f"data.eos: must be one of {', '.join(EOS_POLICIES)} (end-of-text "
                         f"token after every document, before it, or no separator), got {spelled(eos)}")


def separator_id(tok, eos_token: str | None, policy: str) -> int | None:
    """The end-of-text id that ``data.eos`` (``policy``) places between documents.

    A tokenizer without an end-of-text token is refused only where one is placed: with
    ``data.eos = none`` (and ``"stored"``, ids copied as they are) nothing is, so such a
    tokenizer builds, with no separator id (None).

    Raises:
        ValueError: ``append`` or ``prepend`` with a tokenizer that has no such token (the
            message starts with ``data.eos:`` and says what is allowed).
    """
    try:
        return eos_id(tok, eos_token)
    except ValueError as exc:
        if policy not in ("append", "prepend"):
            return None
        raise ValueError(
            f"data.eos: {spelled(policy)} puts an end-of-text token between documents, and {exc}; "
            f"or set data.eos to none (documents concatenated without a separator; allowed: "
            f"{', '.join(EOS_POLICIES)})") from None


def check_data_options(path: str | list[str], text_field: str = "text",
                       eos: str = "append", separator: str | None = None) -> None:
    """Check ``data.path``, ``data.text_field`` and ``data.eos`` without reading any data.

    Cheap enough for configuration validation before any process starts: the ``eos`` value,
    the form of every ``data.path`` entry, that paths exist and are of a supported kind, that
    glob patterns match, that ``hf:`` specs are well formed and that the optional packages
    needed are installed (see :func:`editrain.data.sources.parse_sources`). Whether a record
    source really has ``text_field``, or a Hugging Face dataset can be loaded, is only known
    once it is opened (:func:`prepare_tokens`).

    Args:
        path: The ``data.path`` spec.
        text_field: The ``data.text_field`` option.
        eos: The ``data.eos`` option.
        separator: The ``data.separator`` option.

    Raises:
        ValueError: The message starts with the option's name (``data.path:``,
            ``data.text_field:``, ``data.eos:``, ``data.separator:``) and says what is
            allowed.
    """
    _check_eos(eos)
    try:
        parse_sources(path, text_field, separator)
    except (OSError, ImportError) as exc:
        # A missing path or package (their messages name data.path), or an unreadable file.
        message = str(exc)
        raise ValueError(message if message.startswith("data.") else f"data.path: {message}"
                         ) from exc


SEED_MAX = int(np.iinfo(np.int64).max)
"""The largest ``data.split_seed``: numpy takes a seed as a non-negative int64."""


def _validate(vocab_size: int, val_fraction: float, val_tokens: int, split_seed: int,
              tokenizer_path: str | None, eos: str) -> None:
    # Checked as the configuration checks the options, in its words (errors.plain_scalar:
    # numpy integers are taken, as configs are sometimes built from arrays; bools are not).
    if tokenizer_path is None:
        check_vocab_size(vocab_size)
    val_fraction = plain_scalar(val_fraction, float, "data.val_fraction")
    require(0.0 < val_fraction < 0.5, "data.val_fraction",
            f"must be in (0, 0.5), got {val_fraction}")
    plain_count(val_tokens, "data.val_tokens", least=0)
    split_seed = plain_scalar(split_seed, int, "data.split_seed")
    require(0 <= split_seed <= SEED_MAX, "data.split_seed",
            f"must be in [0, 2^63 - 1] ({SEED_MAX}), got {split_seed}")
    _check_eos(eos)


def _cache_key(
    fingerprint: str,
    tokenizer_identity: list,
    max_bytes: int | None,
    split: dict,
    text_field: str,
    eos_token: str | None,
    eos: str,
    separator: str | None = None,
) -> str:
    fields = {
        "format": FORMAT_VERSION,
        "source": fingerprint,
        "tokenizer": tokenizer_identity,
        "max_bytes": max_bytes,
        "split": split,
        "text_field": text_field,
        "eos_token": eos_token,
        "eos": eos,
    }
    if separator is not None:  # unset: the keys of caches built before it existed
        fields["separator"] = separator
    blob = json.dumps(fields, sort_keys=True, ensure_ascii=True)
    # 32 hex chars (128 bits) keep directory names short while collisions
    # stay impossible in practice.
    return hashlib.sha256(blob.encode("ascii")).hexdigest()[:32]


# Ids read at a time from a token file (16 MB of uint32): what copying a split out of the
# encoded corpus, or scanning a cache file for ids out of range, holds in memory.
_ID_CHUNK = 1 << 22
META_MAX_BYTES = 16 << 20
"""The largest ``meta.json`` of a cache entry read (a few kilobytes are written)."""


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    """Every id of a cached token file is below the vocabulary size.

    A file damaged in place (same size, other bytes) would otherwise index past the
    embedding inside the workers. One pass of numpy's ``max``, in chunks so that memory
    stays flat.

    Args:
        tokens: the token ids (an array, a memory map or a :class:`TokenFile`).
        vocab_size: the tokenizer's vocabulary size recorded in ``meta.json``.
        path: the file, named in the error.

    Raises:
        ValueError: naming the file and saying to delete its cache entry.
    """
    top = max((int(tokens[i:i + _ID_CHUNK].max()) for i in range(0, len(tokens), _ID_CHUNK)),
              default=0)
    if top >= vocab_size:
        raise ValueError(
            f"data.cache_dir: the token cache file {shown(path)} is corrupted (token id "
            f"{top} >= vocabulary size {vocab_size}); delete {shown(path.parent)} to rebuild "
            f"it")


CHECKSUM_CHUNK = 8 << 20
"""Bytes hashed at a time by :func:`file_checksum` (memory stays flat at any file size)."""
CHECKSUM_FILES = ("train.bin", "val.bin", "tokenizer.json")
"""The files of a cache entry whose checksums ``meta.json`` records."""


def file_checksum(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in :data:`CHECKSUM_CHUNK` pieces (SHA-256 rather
    than BLAKE2b: with the SHA instructions of current x86 and ARM CPUs it hashes about
    twice as fast in CPython's hashlib).

    Args:
        path: the file.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHECKSUM_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def entry_checksums(entry: str | Path) -> dict[str, str]:
    """The checksums of a cache entry's files (:data:`CHECKSUM_FILES`), as ``meta.json``
    records them under ``checksums``: computed by the build once the files are written,
    verified by every job that opens the entry (:func:`verify_checksums`)."""
    return {name: file_checksum(Path(entry) / name) for name in CHECKSUM_FILES}


def verify_checksums(entry: str | Path, meta: dict) -> None:
    """Check an entry's files against the checksums its ``meta.json`` records.

    Raises:
        ValueError: a file's bytes changed since the build (named, with the fix).
    """
    recorded = meta.get("checksums")
    for name in CHECKSUM_FILES:
        path = Path(entry) / name
        if not isinstance(recorded, dict) or recorded.get(name) != file_checksum(path):
            raise ValueError(
                f"data.cache_dir: the token cache file {shown(path)} is corrupted (its "
                f"checksum differs from the one meta.json recorded at build time); delete "
                f"{shown(path.parent)} to rebuild it")


def open_prepared(entry: str | Path) -> TokenData | None:
    """The token cache entry ``entry`` (a :attr:`TokenData.cache_dir` that
    :func:`prepare_tokens` returned, in this job), memory-mapped and checked as a reused
    entry is, without fingerprinting the sources again; None if it is missing or broken.
    The launcher prepares the data once and hands its workers the entry: each worker
    would otherwise hash every source file again to find the same entry (the default
    corpus: the whole standard library, a quarter of a CPU second per worker)."""
    return _open_entry(Path(entry), reused=True)


_SIZE = Int(0, 2**53)
_KIND_COUNTS = Map(Obj({"documents": _SIZE, "bytes": _SIZE}, required=("documents", "bytes")))
META_SCHEMA = Obj({
    "format": Int(0, 1 << 20),
    "dtype": Str(16), "vocab_size": Int(1, 2**32), "eos_id": Int(0, 2**32 - 1, nullable=True),
    "train_tokens": Int(1, 2**53), "val_tokens": Int(1, 2**53),
    "checksums": Obj({name: Str(64, ok=lambda v: re.fullmatch("[0-9a-f]{64}", v) is not None,
                                expect="a SHA-256 in hex is expected")
                      for name in CHECKSUM_FILES}, required=CHECKSUM_FILES),
    "tokenizer": Str(16), "tokenizer_trained_on": Str(16, nullable=True),
    "split": Str(16), "documents": Int(0, 2**53, nullable=True),
    "groups": Int(0, 2**53, nullable=True), "val_documents": Int(0, 2**53, nullable=True),
    f"val_train_overlap_{OVERLAP_WINDOW}": Num(0.0, 1.0),
    "kinds": Obj({"duplicates_dropped": _SIZE, "train": _KIND_COUNTS, "val": _KIND_COUNTS}),
}, required=("format", "dtype", "vocab_size", "eos_id", "train_tokens", "val_tokens",
             "checksums"))
"""What a cache entry's ``meta.json`` must hold where editrain reads it (the entry's
arrays, ``editrain data``'s description): every count an integer in range (never a bool,
a float or a string: ``int()`` made ``true`` 1 and ``2.7`` 2), the dtype the one
:func:`token_dtype` gives for the vocabulary (``np.dtype`` of the file's text took any
dtype numpy knows: ``object``, ``>i8``), the end-of-text id inside the vocabulary."""


def _check_meta(meta: dict, meta_path: Path) -> None:
    """Refuse a ``meta.json`` of this format that is not what a build writes
    (:data:`META_SCHEMA`), in one line naming the file and the field, before anything is
    read from the entry: an entry's files are data anyone with write access to the cache
    can change.

    Raises:
        ValueError: ``data.cache_dir: FILE: field 'NAME': ...; delete DIR to rebuild it``.
    """
    fix = f"; delete {shown(meta_path.parent)} to rebuild it"
    try:
        META_SCHEMA.check(meta, shown(meta_path), "", ValueError)
    except ValueError as e:
        raise ValueError(f"data.cache_dir: {e}{fix}") from None
    expected = token_dtype(meta["vocab_size"]).name
    if meta["dtype"] != expected:
        raise ValueError(f"data.cache_dir: {shown(meta_path)}: field 'dtype': {expected} is expected "
                         f"for a vocabulary of {meta['vocab_size']} (found "
                         f"{quote(meta['dtype'])}){fix}")
    if meta["eos_id"] is not None and meta["eos_id"] >= meta["vocab_size"]:
        raise ValueError(f"data.cache_dir: {shown(meta_path)}: field 'eos_id': an id below the "
                         f"vocabulary size {meta['vocab_size']} is expected (found "
                         f"{meta['eos_id']}){fix}")


def _open_entry(entry: Path, reused: bool) -> TokenData | None:
    """Memory-map a complete entry, or return None if it is missing, incomplete or of
    another format (it is then rebuilt).

    Raises:
        ValueError: a ``meta.json`` of this format that is not what a build writes
            (:func:`_check_meta`), or files that changed since (checksums, ids).
    """
    meta_path = entry / "meta.json"
    try:
        meta = read_json(meta_path, max_bytes=META_MAX_BYTES, schema=Obj(), error=ValueError,
                         what="token cache meta.json")
    except ValueError:
        return None
    if type(meta.get("format")) is not int or meta["format"] != FORMAT_VERSION \
            or not isinstance(meta.get("checksums"), dict):
        return None  # another format, or built before checksums were recorded: rebuilt
    _check_meta(meta, meta_path)
    dtype = token_dtype(meta["vocab_size"])
    arrays = {}
    for split in ("train", "val"):
        path = entry / f"{split}.bin"
        n = meta[f"{split}_tokens"]
        # A size mismatch means the files were touched after meta.json was
        # written; treat the entry as incomplete so it gets rebuilt.
        if n <= 0 or not path.is_file() or path.stat().st_size != n * dtype.itemsize:
            return None
        arrays[split] = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    tok_path = entry / "tokenizer.json"
    if not tok_path.is_file():
        return None
    if reused:  # what we just wrote is trusted; a file found on disk is checked
        verify_checksums(entry, meta)
        for split, tokens in arrays.items():
            # Plain reads: a scan of the memory map would leave the file resident.
            with TokenFile(entry / f"{split}.bin", dtype, len(tokens)) as ids:
                check_token_ids(ids, meta["vocab_size"], entry / f"{split}.bin")
    return TokenData(
        train=arrays["train"],
        val=arrays["val"],
        vocab_size=meta["vocab_size"],
        tokenizer_path=tok_path,
        cache_dir=entry,
        eos_id=meta["eos_id"],
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
    """Split a long document into pieces of at most ``_MAX_PIECE_CHARS`` characters, each
    cut where the tokens do not change if it can be (see ``_PIECE_CUTS``)."""
    start = 0
    while len(doc) - start > _MAX_PIECE_CHARS:
        limit = start + _MAX_PIECE_CHARS
        end = None
        for where in _PIECE_CUTS:
            for found in where.finditer(doc, start + _MAX_PIECE_CHARS // 2, limit):
                end = found.end()
            if end is not None:
                break
        if end is None:
            cut = doc.rfind("\n", start, limit)
            end = cut + 1 if cut >= start else limit
        yield doc[start:end]
        start = end
    yield doc[start:]


class _DocumentEncoder:
    """Encodes documents, in order, into one open token file, ``eos`` placed as ``policy``
    (one of ``EOS_POLICIES``) says, and counts each document's tokens (separator included).

    Batches of about ``_ENCODE_BATCH_CHARS`` characters are encoded by a background thread:
    ``encode_batch_fast`` releases the GIL while its Rust threads work, so the caller keeps
    reading and describing the next documents meanwhile (a build with a given tokenizer
    describes and encodes in one pass). At most two batches wait for the thread, so memory
    stays bounded whatever the corpus's size; ids go to the file as one numpy array a batch.
    With ``workers`` > 0, batches of ``_POOL_BATCH_CHARS`` go to that many encoder processes
    instead (:class:`~editrain.data.encode_pool.EncoderPool`), and come back in order.
    """

    _QUEUED = 2  # batches waiting for the encoder thread at most

    def __init__(self, tok, eos: int | None, policy: str, dtype: np.dtype, out,
                 workers: int = 0) -> None:
        self._tok, self._out, self._dtype = tok, out, dtype
        head, tail = edges(eos, policy, *template_ids(tok))
        self._head, self._tail = np.array(head, dtype=dtype), np.array(tail, dtype=dtype)
        self._batch: list[str] = []
        self._owners: list[int] = []  # document index of every piece of the batch
        self._firsts: list[bool] = []  # whether the piece begins its document
        self._lasts: list[bool] = []  # whether the piece ends its document
        self._chars = 0
        self._docs = 0  # documents added
        # (first document, token counts of the documents from it) of every encoded batch:
        # 8 bytes per document, summed by close() (a document may span batches).
        self._counts: list[tuple[int, np.ndarray]] = []
        self._error: BaseException | None = None
        self._pool = None
        self._batch_chars = _POOL_BATCH_CHARS if workers else _ENCODE_BATCH_CHARS
        if workers:
            # Imported here: the pool's workers run that module, which must not be imported
            # by its package's __init__ first.
            from .encode_pool import EncoderPool

            self._pool = EncoderPool(tok.to_str(), eos, policy, dtype, workers, self._write)
            return
        self._queue: queue.Queue = queue.Queue(maxsize=self._QUEUED)
        self._thread = threading.Thread(target=self._work, name="editrain-encode", daemon=True)
        self._thread.start()

    def add(self, text: str) -> None:
        """Queue the next document (cut into ``_MAX_PIECE_CHARS`` pieces after newlines)."""
        doc = self._docs
        self._docs += 1
        pieces = list(_pieces(text))
        for j, piece in enumerate(pieces):
            self._batch.append(piece)
            self._owners.append(doc)
            self._firsts.append(j == 0)
            self._lasts.append(j == len(pieces) - 1)
            self._chars += len(piece)
            # A batch may end mid-document: firsts/lasts say where the separators go.
            if self._chars >= self._batch_chars:
                self._flush()

    def skip(self) -> None:
        """Count the next document as one of no tokens (an exact duplicate of an earlier
        one, which no split keeps)."""
        self._docs += 1

    def close(self) -> np.ndarray:
        """Encode what is left, wait for the thread or processes; return every document's
        token count."""
        self._flush()
        if self._pool is not None:
            self._pool.close()
        else:
            self._put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
        counts = np.zeros(self._docs, dtype=np.int64)
        for first, part in self._counts:
            counts[first : first + len(part)] += part
        return counts

    def abort(self) -> None:
        """Stop the encoder processes after a failure (the thread is a daemon)."""
        if self._pool is not None:
            self._pool.abort()

    def _flush(self) -> None:
        if self._batch and self._pool is not None:
            self._pool.send(self._batch, self._firsts, self._lasts, tag=self._owners)
        elif self._batch:
            self._put((self._batch, self._owners, self._firsts, self._lasts))
        self._batch, self._owners, self._firsts, self._lasts, self._chars = [], [], [], [], 0

    def _put(self, item) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._queue.put(item, timeout=0.1)  # wakes up to see a failed thread
                return
            except queue.Full:
                continue

    def _work(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                batch, owners, firsts, lasts = item
                parts: list[np.ndarray] = []
                sizes: list[int] = []  # tokens of every piece, separators included
                encoded = self._tok.encode_batch_fast(batch, add_special_tokens=False)
                for i, enc in enumerate(encoded):
                    ids = np.asarray(enc.ids, dtype=self._dtype)
                    if firsts[i]:
                        parts.append(self._head)
                    parts.append(ids)
                    if lasts[i]:
                        parts.append(self._tail)
                    sizes.append(len(ids) + firsts[i] * len(self._head)
                                 + lasts[i] * len(self._tail))
                self._write(np.concatenate(parts), sizes, owners)
                del batch, item, parts
                # The batch's encodings (about 25 bytes per character, in the tokenizer
                # threads' heaps) are freed now; without a trim the pages stay resident
                # wherever a block kept since (a description, a recent text) sits above
                # them, and the build's memory grew with the corpus.
                release_freed_memory()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's next add/close
            # The caller's puts time out and see it, so nothing waits on a dead thread.
            self._error = exc

    def _write(self, ids: np.ndarray, sizes, owners: list[int]) -> None:
        """Write one encoded batch (``sizes``: every piece's tokens, separators included;
        ``owners``: every piece's document)."""
        ids.tofile(self._out)
        # A batch holds consecutive documents: summed per document from its first.
        per_doc = np.zeros(owners[-1] - owners[0] + 1, dtype=np.int64)
        np.add.at(per_doc, np.asarray(owners) - owners[0], sizes)
        self._counts.append((owners[0], per_doc))


def _encode_to_file(tok, docs: Iterable[str], eos: int | None, policy: str, dtype: np.dtype,
                    out, workers: int = 0) -> int:
    """Encode ``docs`` into ``out``, separated by ``eos`` as ``policy`` (one of
    ``EOS_POLICIES``) says, in ``workers`` processes (0: in this one); return the number of
    tokens written."""
    encoder = _DocumentEncoder(tok, eos, policy, dtype, out, workers)
    try:
        for doc in docs:
            encoder.add(doc)
        return int(encoder.close().sum())
    except BaseException:
        encoder.abort()
        raise


def _split_texts(docs: Iterable[Document], plan: SplitPlan, side: int,
                 cut_part: list[bool] | None = None,
                 cut_train: list[int] | None = None) -> Iterator[str]:
    """The texts of one side of ``plan`` (0: training, 1: validation), in corpus order;
    whether the document a tail split cuts has text on this side is appended to
    ``cut_part``, and the characters of its training part to ``cut_train``, when they are
    passed."""
    for i, doc in enumerate(docs):
        parts = plan.parts(i, doc.text)
        text = parts[side]
        if i == plan.tail_doc:
            if cut_part is not None:
                cut_part.append(bool(text))
            if cut_train is not None:
                cut_train.append(len(parts[0]))
        if text:
            yield text


def _unit_interval(digests: np.ndarray) -> np.ndarray:
    """Every document's digest (``uint8[n, 20]``) as a number in [0, 1): a deterministic
    coin for sampling (its first 8 bytes, big-endian, over 2**64)."""
    top = np.ascontiguousarray(digests[:, :8]).view(">u8").ravel()
    return top.astype(np.float64) / 2.0**64


def _train_bytes(table: DocumentTable, *plans: SplitPlan) -> int:
    """Bytes of the documents on the training side of every plan of ``plans`` (a tail
    document counted whole)."""
    train = np.ones(len(table), dtype=bool)
    for plan in plans:
        mine = ~plan.drop & ~plan.val
        if plan.tail_doc >= 0 and not plan.drop[plan.tail_doc]:
            mine[plan.tail_doc] = True
        train &= mine
    return int(table.nbytes[train].sum())


def bpe_sample(docs: Iterable[Document], plan: SplitPlan, table: DocumentTable,
               limit: int, *, also: tuple[SplitPlan, ...] = (),
               taken: dict[int, int] | None = None) -> Iterator[str]:
    """The training texts the BPE tokenizer learns from: all of them when the training side
    has at most ``limit`` bytes, else a sample of whole documents of about ``limit`` bytes.

    A document is taken when its digest, read as a number in [0, 1), is below the share
    ``limit / training bytes`` (a document at least ``limit`` long always is), so the
    sample is spread over the whole corpus and the same for every run; the texts stop once
    ``limit`` characters were handed out. Memory and time of the trainer are then bounded
    by ``limit``, not by the corpus.

    Args:
        docs: One pass over the corpus, in order.
        plan: The split; only training parts are handed out.
        table: The corpus's :class:`~editrain.data.split.DocumentTable`.
        limit: Most characters handed out (:data:`BPE_SAMPLE_BYTES` in a build).
        also: More plans whose validation sides are left out too: what is handed out of a
            document is its text on the training side of every plan (each plan's training
            part of a document is a prefix of it, so the shortest of them).
        taken: When passed, filled with the characters handed out of every document taken,
            by index (each a prefix of the document), so that another plan can be checked
            against the sample (:func:`_sample_kept`).
    """
    plans = (plan, *also)
    share = limit / max(1, _train_bytes(table, *plans))
    coins = _unit_interval(table.digests)
    budget = limit
    for i, doc in enumerate(docs):
        text = min((p.parts(i, doc.text)[0] for p in plans), key=len)
        if not text or (share < 1 and len(text) < limit and coins[i] >= share):
            continue
        text = text[:budget]
        if taken is not None:
            taken[i] = len(text)
        yield text
        budget -= len(text)
        if budget <= 0:
            return


def _sample_kept(taken: dict[int, int], plan: SplitPlan, cut_train: int | None = None) -> bool:
    """Whether everything a BPE sample took (``taken``, from :func:`bpe_sample`: characters
    from the start of each document) is on the training side of ``plan``.

    The document a tail split cuts is on the training side up to its cut, which is known
    only from its text: ``cut_train`` is the length of its training part; while it is None
    (the text not read yet), only the other documents are checked."""
    if not taken:
        return True
    rows = np.fromiter(taken, dtype=np.int64, count=len(taken))
    if (plan.val[rows] | plan.drop[rows]).any():
        return False
    cut = plan.tail_doc if plan.mode == "tail" else -1
    return cut not in taken or cut_train is None or taken[cut] <= cut_train


def _encode_split(tok, texts: Iterable[str], eos: int | None, policy: str, dtype: np.dtype,
                  path: Path, workers: int = 0) -> int:
    """Encode ``texts`` into ``path`` (durably), in ``workers`` processes (0: in this one);
    return the number of tokens written."""
    with open(path, "wb") as out:
        n = _encode_to_file(tok, texts, eos, policy, dtype, out, workers)
        out.flush()
        os.fsync(out.fileno())
    return n


def _encoding_tokenizer(tok, eos_token: str | None, policy: str):
    """``(tokenizer, EOS id, vocabulary size, token dtype)`` of ``tok``, made ready to
    encode a corpus with separators as ``policy`` says (the EOS id: see
    :func:`separator_id`)."""
    eos = separator_id(tok, eos_token, policy)
    vsize = tokenizer_vocab_size(tok)
    # Text that happens to contain "<|endoftext|>" must stay text: separators are only the
    # ones inserted between documents here.
    tok.encode_special_tokens = True
    return tok, eos, vsize, token_dtype(vsize)


def _say_short_validation(n_val: int, val_tokens: int) -> None:
    """Warn that a split holds fewer validation tokens than ``data.val_tokens`` asked (the
    corpus is too small: validation is at most ``MAX_VAL_SHARE`` of it), instead of leaving
    the user to find it in ``meta.json``."""
    if 0 < n_val < val_tokens:
        log.warning("data.val_tokens: the validation split holds %d tokens, fewer than the "
                    "%d asked: validation is at most %d%% of the corpus, which is too small "
                    "for more", n_val, val_tokens, round(100 * MAX_VAL_SHARE))


def _encode_text(tok, text: str, eos: int | None, policy: str, dtype: np.dtype,
                 scratch: Path) -> np.ndarray:
    """The tokens of one document ``text`` as a build writes them (separator included; none
    for an empty text), through the scratch file ``scratch``, which is removed."""
    if not text:
        return np.zeros(0, dtype=dtype)
    try:
        with open(scratch, "wb") as out:
            encoder = _DocumentEncoder(tok, eos, policy, dtype, out)
            encoder.add(text)
            encoder.close()
        return np.fromfile(scratch, dtype=dtype)
    finally:
        scratch.unlink(missing_ok=True)


# Most characters of text _RecentTexts keeps (a tail split cutting further back reads the
# corpus again up to the document it cuts).
_RECENT_MAX_CHARS = 1 << 30
# The texts wait in files of about this many bytes, each removed once the window left it.
_RECENT_FILE_BYTES = 4 << 20


class _RecentTexts:
    """The texts of the last documents of a pass over the corpus, as far back as a tail
    split may cut, so that the cut document need not be read again.

    A tail split's validation part begins in the document whose successors hold fewer
    bytes than the split's target, ``max(val_fraction of the corpus, the floor)`` at most;
    every document with fewer than twice that (twice: a re-planned floor) in characters
    after it is kept (characters: never more than the bytes the plan counts), at most
    ``_RECENT_MAX_CHARS``. A document that leaves the window never comes back into reach:
    the characters after it grow at least as fast as the reach.

    The texts are kept on disk, in files ``PREFIX.N`` of about ``_RECENT_FILE_BYTES``
    (the window is 2% of the corpus with the default split: 20 MB held in memory at 1 GB
    was a third of what a build's memory grew by); a file is removed once no document of
    the window is in it, so the disk holds about the window. Memory: four ints a
    document of the window."""

    def __init__(self, val_fraction: float, floor_bytes: float, prefix: Path) -> None:
        self._fraction, self._floor = val_fraction, floor_bytes
        self._prefix = prefix
        # (file number, offset, UTF-8 bytes, characters) of every document of the window
        self._docs: deque[tuple[int, int, int, int]] = deque()
        self._first = 0  # index of the document _docs[0]
        self._chars = 0  # characters in the window
        self._seen = 0  # characters of every document so far
        self._file = -1  # number of the file written
        self._out = None
        self._removed = 0  # files below this number are removed

    def add(self, text: str) -> None:
        """The next document of the pass."""
        data = text.encode("utf-8", "surrogatepass")
        if self._out is None or self._out.tell() >= _RECENT_FILE_BYTES:
            if self._out is not None:
                self._out.close()
            self._file += 1
            self._out = open(self._path(self._file), "wb")  # noqa: SIM115 - closed above
        self._docs.append((self._file, self._out.tell(), len(data), len(text)))
        self._out.write(data)
        self._chars += len(text)
        self._seen += len(text)
        reach = min(_RECENT_MAX_CHARS, 2 * max(self._fraction * self._seen, self._floor))
        while len(self._docs) > 1 and self._chars - self._docs[0][3] >= reach:
            self._chars -= self._docs.popleft()[3]
            self._first += 1
        while self._removed < self._docs[0][0]:
            self._path(self._removed).unlink()
            self._removed += 1

    def get(self, index: int) -> str | None:
        """The text of document ``index``, or None when it left the window."""
        k = index - self._first
        if not 0 <= k < len(self._docs):
            return None
        number, offset, size, _ = self._docs[k]
        if number == self._file:
            self._out.flush()
        with open(self._path(number), "rb") as fh:
            fh.seek(offset)
            return fh.read(size).decode("utf-8", "surrogatepass")

    def close(self) -> None:
        """Remove the files."""
        if self._out is not None:
            self._out.close()
        for number in range(self._removed, self._file + 1):
            self._path(number).unlink(missing_ok=True)
        self._docs.clear()

    def _path(self, number: int) -> Path:
        return self._prefix.with_name(f"{self._prefix.name}.{number}")


def _cut_texts(plan: SplitPlan, corpus, recent: _RecentTexts | None) -> tuple[str, str]:
    """``(training part, validation part)`` of the document a tail split cuts in two;
    two empty texts when the plan cuts none. The document's text is taken from ``recent``
    when it is there, else found by reading the corpus up to it."""
    if plan.mode != "tail":
        return "", ""
    text = recent.get(plan.tail_doc) if recent is not None else None
    if text is not None:
        return plan.parts(plan.tail_doc, text)
    for i, doc in enumerate(corpus("reading the document cut by the split", _COST_READ)):
        if i == plan.tail_doc:
            return plan.parts(i, doc.text)
    raise RuntimeError(f"the corpus has no document {plan.tail_doc} any more")


def _copy_sides(all_path: Path, counts: np.ndarray, plan: SplitPlan, dtype: np.dtype,
                out: dict[str, Path], cut: tuple[np.ndarray, np.ndarray]) -> tuple[int, int]:
    """Write the training and validation files (``out``) from ``all_path``, every document
    encoded in corpus order with ``counts[i]`` tokens, as ``plan`` says (exact duplicates in
    neither; a tail split's cut document as its two parts ``cut``, encoded apart); return
    ``(training tokens, validation tokens)``.

    Consecutive documents of one side are copied as one range, in chunks of ``_ID_CHUNK``
    tokens, so memory stays flat and no Python runs per token or per document."""
    side = np.where(plan.drop, -1, plan.val.astype(np.int64))
    if plan.mode == "tail":
        side[plan.tail_doc] = 2  # a run of its own: its parts come from ``cut``
    ends = np.concatenate([[0], np.cumsum(counts)])
    starts_of_runs = np.concatenate([[0], np.flatnonzero(np.diff(side)) + 1])
    stops_of_runs = np.concatenate([starts_of_runs[1:], [len(side)]])
    written = {"train": 0, "val": 0}
    # Read with plain reads, not a memory map: its pages would stay resident (the whole
    # encoded corpus by the end of the copy).
    tokens = TokenFile(all_path, dtype, int(ends[-1]))
    files = {name: open(path, "wb") for name, path in out.items()}
    try:
        for a, b in zip(starts_of_runs.tolist(), stops_of_runs.tolist()):
            if side[a] < 0:
                continue
            if side[a] == 2:
                for name, part in zip(("train", "val"), cut):
                    part.astype(dtype).tofile(files[name])
                    written[name] += len(part)
                continue
            name = "val" if side[a] else "train"
            for lo in range(int(ends[a]), int(ends[b]), _ID_CHUNK):
                piece = tokens[lo:min(lo + _ID_CHUNK, int(ends[b]))]
                piece.tofile(files[name])
                written[name] += len(piece)
        for fh in files.values():
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        for fh in files.values():
            fh.close()
        tokens.close()
    return written["train"], written["val"]


def _build_entry(
    entry: Path,
    refs,
    source_spec,
    vocab_size: int,
    tokenizer_path: str | None,
    split: dict,
    max_bytes: int | None,
    eos_token: str | None,
    eos_policy: str,
    key: str,
    bar: BuildProgress,
    *,
    sample_bytes: int | None = None,
    train_bpe=None,
    pool_chars: int | None = None,
) -> None:
    """Build the cache entry ``entry`` from the text sources ``refs`` (see the module's
    docstring). ``sample_bytes`` (default :data:`BPE_SAMPLE_BYTES`) bounds the text an own
    BPE tokenizer is trained on, ``train_bpe`` (default
    :func:`~editrain.data.tokenizer.train_bpe_tokenizer`) trains it, ``pool_chars``
    (default ``_POOL_MIN_CHARS``) is the least text encoded in worker processes: all for
    tests."""
    sample_bytes = BPE_SAMPLE_BYTES if sample_bytes is None else sample_bytes
    train_bpe = train_bpe_tokenizer if train_bpe is None else train_bpe
    pool_chars = _POOL_MIN_CHARS if pool_chars is None else pool_chars

    def workers(share: float) -> int:
        """Encoder processes for a pass over ``share`` of the corpus (0: in this one)."""
        from .encode_pool import pool_workers

        chars = share * (bar.expected_chars or 0)
        return pool_workers() if chars >= pool_chars else 0

    t0 = time.monotonic()
    if entry.exists():
        # Leftovers of an interrupted build: never trust partially written files.
        shutil.rmtree(entry)
    entry.mkdir(parents=True)

    def corpus(label: str, cost: float) -> Iterator[Document]:
        """One pass over the corpus's documents, shown by the progress bar."""
        return bar.track(iter_records(refs, max_bytes), f"data: {label}", cost)

    def expect(sample_share: float) -> None:
        """Tell the bar the cost of the whole build, in corpus-sized passes: describing
        and encoding every document (one pass with a given tokenizer; with a BPE to train,
        the tokenizer's sample, then each side encoded in a pass of its own)."""
        bar.expect(_COST_DESCRIBE + _COST_ENCODE
                   + (3 * _COST_READ + _COST_BPE * sample_share if bpe else 0.0))

    bpe = tokenizer_path is None
    expect(min(1.0, sample_bytes / max(1, bar.expected_chars or sample_bytes)))
    # The signatures of full blocks of documents wait in a file of the entry while the
    # corpus is read (removed once the split is planned).
    spill = entry / f"signatures.tmp.{os.getpid()}"
    table = DocumentTable(spill=spill)
    all_path = entry / f"all.bin.tmp.{os.getpid()}"
    counts = None  # tokens of every document in all_path (None: not encoded yet)
    if bpe:
        # Pass 1: what the split needs of every document (sizes, families, kinds, MinHash).
        for doc in corpus("reading documents", _COST_DESCRIBE):
            table.add(doc)
    else:
        tok, eos, vsize, dtype = _encoding_tokenizer(load_tokenizer(tokenizer_path), eos_token,
                                                    eos_policy)
        log.info("tokenising corpus into %s", entry)
        # One pass describes and encodes every document: the split is planned afterwards
        # from the descriptions, and each side is then copied out of the encoded corpus.
        with open(all_path, "wb") as out:
            encoder = _DocumentEncoder(tok, eos, eos_policy, dtype, out, workers(1.0))
            recent = _RecentTexts(split["val_fraction"],
                                  split["val_tokens"] * _BYTES_PER_TOKEN_GUESS,
                                  entry / f"recent.tmp.{os.getpid()}")
            # Every split drops exact duplicates but their first copy: later copies are
            # not encoded (11% of the tokens of 1 GB of installed Python files).
            seen: set[bytes] = set()
            try:
                for doc in corpus("reading and tokenising", _COST_DESCRIBE + _COST_ENCODE):
                    digest = table.add(doc)
                    if digest in seen:
                        encoder.skip()
                    else:
                        seen.add(digest)
                        encoder.add(doc.text)
                    recent.add(doc.text)
                counts = encoder.close()
            except BaseException:
                encoder.abort()
                raise
            seen = None
    val_tokens = split["val_tokens"]
    bytes_per_token = _BYTES_PER_TOKEN_GUESS
    tok_file = entry / "tokenizer.json"
    tmp = {s: entry / f"{s}.bin.tmp.{os.getpid()}" for s in ("train", "val")}
    taken: dict[int, int] | None = None  # what a sampled BPE took of each document

    def train_tokenizer(plan: SplitPlan, sample_share: float):
        """``(tokenizer, EOS id, vocabulary size, dtype, taken)``: a BPE trained on the
        training side of ``plan`` only (validation text must stay unseen, down to which
        byte pairs got merged); ``taken`` says what its sample took of each document, None
        when it saw the whole training side."""
        also, took = (), None
        if _train_bytes(table, plan) > sample_bytes:
            # A sample: drawn from the documents that stay on the training side of the
            # plans with larger targets too, up to twice this one, so that a re-plan for
            # the floor (the byte guess short) most likely finds it on its training side
            # and keeps this tokenizer.
            target = plan.stats["target_bytes"]
            also = tuple(plan_splits(table, split["val_fraction"],
                                     [target + target * k // _RESERVE_STEPS
                                      for k in range(1, _RESERVE_STEPS + 1)], split["seed"]))
            took = {}
        log.info("training byte-level BPE tokenizer (vocab_size=%d)", vocab_size)
        texts = bpe_sample(corpus("training tokenizer", _COST_READ + _COST_BPE * sample_share),
                           plan, table, sample_bytes, also=also, taken=took)
        return (*_encoding_tokenizer(train_bpe(texts, vocab_size), eos_token,
                                                eos_policy), took)

    def encode_validation(plan: SplitPlan, val_share: float
                          ) -> tuple[int, list[bool], int | None]:
        """Encode the validation side of ``plan`` from its texts (a BPE trained for an
        earlier plan may not fit this one, and each would encode the whole corpus);
        ``(tokens, whether the cut document has a validation part, characters of its
        training part)``, the last two empty and None without a cut document."""
        log.info("tokenising corpus into %s", entry)
        cut_val: list[bool] = []
        cut_train: list[int] = []
        texts = _split_texts(corpus("tokenising validation",
                                    _COST_READ + _COST_ENCODE * val_share),
                             plan, 1, cut_val, cut_train)
        n = _encode_split(tok, texts, eos, eos_policy, dtype, tmp["val"], workers(val_share))
        return n, cut_val, cut_train[0] if cut_train else None

    for attempt in range(_SPLIT_ATTEMPTS):
        plan = plan_split(table, split["val_fraction"], int(val_tokens * bytes_per_token),
                          split["seed"])
        total = max(1, int(table.nbytes.sum()))
        val_share = plan.stats.get("val_bytes", 0) / total
        sample_share = min(1.0, sample_bytes / total)
        if attempt == 0:
            expect(sample_share)
        if bpe and taken is not None and _sample_kept(taken, plan):
            log.info("keeping the tokenizer: its sample is on the training side of the new "
                     "plan")
        elif bpe:
            tok, eos, vsize, dtype, taken = train_tokenizer(plan, sample_share)
        if counts is None:
            n_val, cut_val, cut_train = encode_validation(plan, val_share)
            if taken and not _sample_kept(taken, plan, cut_train):
                # The sample took more of the document this plan cuts than its training
                # part: a tokenizer trained within this plan (then its sample is by
                # construction), and the validation side encoded with it.
                log.info("the tokenizer's sample reaches into validation text; training it "
                         "again")
                tok, eos, vsize, dtype, taken = train_tokenizer(plan, sample_share)
                n_val, cut_val, _ = encode_validation(plan, val_share)
        else:
            parts = _cut_texts(plan, corpus, recent)
            cut_val = [bool(parts[1])]
            encode = functools.partial(_encode_text, tok, eos=eos, policy=eos_policy,
                                       dtype=dtype, scratch=entry / f"cut.bin.tmp.{os.getpid()}")
            cut = (encode(parts[0]), encode(parts[1]))
            n_val = int(counts[plan.val & ~plan.drop].sum()) + len(cut[1])
        val_bytes = plan.stats.get("val_bytes", 0)
        if n_val >= val_tokens or plan.stats.get("capped") or n_val == 0:
            break
        # The floor is in tokens, the plan in bytes: retry once the ratio is measured.
        bytes_per_token = 1.05 * val_bytes / n_val
        log.info("validation split has %d < data.val_tokens=%d tokens; re-planning "
                 "(attempt %d)", n_val, val_tokens, attempt + 2)
    _say_short_validation(n_val, val_tokens)
    if counts is not None:
        recent.close()  # the texts kept for the cut: planned, no longer needed
    if counts is None:
        n_train = _encode_split(tok, _split_texts(corpus("tokenising training", _COST_READ
                                                     + _COST_ENCODE * (1 - val_share)),
                                                  plan, 0),
                                eos, eos_policy, dtype, tmp["train"], workers(1 - val_share))
    else:
        n_train, n_val = _copy_sides(all_path, counts, plan, dtype, tmp, cut)
    all_path.unlink(missing_ok=True)
    if n_train == 0 or n_val == 0:
        raise ValueError(f"data.path: the corpus is too small to split ({n_train} training, "
                         f"{n_val} validation tokens)")
    if tokenizer_path is not None:
        # Copy the user's bytes verbatim so the entry's file hashes the same.
        _atomic_write_bytes(tok_file, Path(tokenizer_path).expanduser().read_bytes())
    else:
        _atomic_write_bytes(tok_file, tok.to_str().encode("utf-8"))
    for s in ("train", "val"):
        os.replace(tmp[s], entry / f"{s}.bin")
    # Which documents were held out, so anyone can check the split (and tests do); the
    # document a tail split cuts in two (before every other one held out) when its
    # validation part is not empty.
    held = np.flatnonzero(plan.val & ~plan.drop).tolist()
    if plan.mode == "tail" and any(cut_val):
        held.insert(0, plan.tail_doc)
    val_docs = [table.listing(i) for i in held]
    _atomic_write_bytes(entry / VAL_DOCUMENTS_FILE,
                        json.dumps(val_docs, ensure_ascii=True).encode("ascii"))
    # The table's memory (about 330 bytes per document) handed back before the overlap
    # measure's arrays are allocated (the largest part of a build's end).
    n_documents = len(table)
    table = val_docs = None
    spill.unlink(missing_ok=True)
    overlap = _measure_overlap(entry, dtype)

    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "source": _source_list(source_spec),
        "max_bytes": max_bytes,
        "val_fraction": float(split["val_fraction"]),
        "requested_val_tokens": int(val_tokens),
        "split_seed": int(split["seed"]),
        "tokenizer": "user" if tokenizer_path is not None else "bpe",
        "tokenizer_trained_on": None if tokenizer_path is not None else "train",
        "requested_vocab_size": vocab_size,
        "vocab_size": vsize,
        "eos_id": eos,
        "eos": eos_policy,
        "dtype": dtype.name,
        "documents": n_documents,
        "split": plan.mode,
        "groups": plan.groups,
        "near_duplicate_merges": plan.near_dup_merges,
        "val_documents": int(plan.val.sum()),
        "train_tokens": n_train,
        "val_tokens": n_val,
        f"val_train_overlap_{OVERLAP_WINDOW}": round(overlap, 6),
        "kinds": plan.stats,
        "build_seconds": round(time.monotonic() - t0, 3),
    }
    meta["checksums"] = entry_checksums(entry)  # verified by every job that opens it
    _fsync_dir(entry)
    # meta.json last: its presence is what marks the entry complete.
    _atomic_write_bytes(entry / "meta.json", json.dumps(meta, indent=1).encode("ascii"))
    _fsync_dir(entry)
    log.info(
        "token cache built: %d train / %d val tokens (%.1f%% of val %d-token windows seen in "
        "train) in %.1fs", n_train, n_val, 100 * overlap, OVERLAP_WINDOW, meta["build_seconds"],
    )


def _measure_overlap(entry: Path, dtype: np.dtype) -> float:
    """The val/train overlap of the entry's token files (:func:`window_overlap`), read in
    chunks with plain reads and estimated on at most :data:`OVERLAP_MAX_WINDOWS`
    validation windows, so that its memory does not grow with the corpus."""
    release_freed_memory()  # what planning and copying freed, before its arrays
    with (TokenFile(entry / "val.bin", dtype) as val,
          TokenFile(entry / "train.bin", dtype) as train):
        return window_overlap(val, train, OVERLAP_WINDOW, max_windows=OVERLAP_MAX_WINDOWS)


def _source_list(spec) -> list[str]:
    """``data.path`` as a list of strings, for ``meta.json``."""
    return [os.fspath(s) for s in ([spec] if isinstance(spec, (str, os.PathLike)) else spec)]


def _build_token_entry(entry: Path, ref, source_spec, tokenizer_path: str,
                       split: dict, eos_token: str | None, eos_policy: str, key: str) -> None:
    """A cache entry from a pre-tokenised corpus (:mod:`editrain.data.pretokenized`): its
    ids copied (as this tokenizer's dtype) and checked against the tokenizer's vocabulary;
    a single file's (or a table's rows') last tokens held out, a nanoGPT directory's splits
    kept."""
    t0 = time.monotonic()
    entry.mkdir(parents=True)
    tok = load_tokenizer(tokenizer_path)
    vsize = tokenizer_vocab_size(tok)
    dtype = token_dtype(vsize)
    eos = separator_id(tok, eos_token, eos_policy)
    path = ref.path
    if ref.kind == "token_rows":
        # The rows streamed once into one flat file (ids checked on the way), then split
        # like a flat file: memory holds one batch of rows.
        flat = entry / f"rows.bin.tmp.{os.getpid()}"
        with open(flat, "wb") as out:
            for rows in token_row_batches(ref):
                write_checked(row_ids(rows, eos, eos_policy), out, dtype,
                              vsize, ref.label)
        size = flat.stat().st_size // dtype.itemsize
        if size < 2:
            flat.unlink()
            raise ValueError(f"data.path: {shown(ref.label)} holds {size} token id(s) in column "
                             f"{spelled(ref.text_field)}: too few to split into training and "
                             f"validation")
        n_val = tail_split(size, split["val_fraction"], split["val_tokens"], MAX_VAL_SHARE)
        _say_short_validation(n_val, split["val_tokens"])
        sources = {"train": TokenFile(flat, dtype, size - n_val),
                   "val": TokenFile(flat, dtype, n_val, start=size - n_val)}
        names = {"train": ref.label, "val": ref.label}
        mode = "tail"
    elif path.is_dir():
        sources = {s: open_tokens(path / f"{s}.bin") for s in ("train", "val")}
        names = {s: path / f"{s}.bin" for s in ("train", "val")}
        mode = "given"
    else:
        ids = open_tokens(path)
        n_val = tail_split(len(ids), split["val_fraction"], split["val_tokens"],
                           MAX_VAL_SHARE)
        _say_short_validation(n_val, split["val_tokens"])
        sources = {"train": ids[:len(ids) - n_val], "val": ids[len(ids) - n_val:]}
        names = {"train": path, "val": path}
        mode = "tail"
    counts = {s: copy_checked(sources[s], entry / f"{s}.bin", dtype, vsize, names[s])
              for s in ("train", "val")}
    if ref.kind == "token_rows":
        for part in sources.values():
            part.close()
        flat.unlink()
    _atomic_write_bytes(entry / "tokenizer.json",
                        Path(tokenizer_path).expanduser().read_bytes())
    _atomic_write_bytes(entry / VAL_DOCUMENTS_FILE, b"[]")
    overlap = _measure_overlap(entry, dtype)
    meta = {
        "format": FORMAT_VERSION, "key": key, "source": _source_list(source_spec),
        "pretokenized": True, "max_bytes": None, "val_fraction": float(split["val_fraction"]),
        "requested_val_tokens": int(split["val_tokens"]), "split_seed": int(split["seed"]),
        "tokenizer": "user", "tokenizer_trained_on": None, "requested_vocab_size": vsize,
        "vocab_size": vsize, "eos_id": eos, "eos": eos_policy,
        "dtype": dtype.name, "documents": None, "split": mode, "groups": None,
        "near_duplicate_merges": 0, "val_documents": None, "train_tokens": counts["train"],
        "val_tokens": counts["val"], f"val_train_overlap_{OVERLAP_WINDOW}": round(overlap, 6),
        "kinds": {}, "build_seconds": round(time.monotonic() - t0, 3),
    }
    _fsync_dir(entry)
    meta["checksums"] = entry_checksums(entry)
    _atomic_write_bytes(entry / "meta.json", json.dumps(meta, indent=1).encode("ascii"))
    _fsync_dir(entry)


def _staging_dir(root: Path, key: str) -> Path:
    """A private directory to build entry ``key`` in (``.KEY.HOST.PID``), after removing
    what builds of this host that died left behind."""
    host = socket.gethostname()
    for old in root.glob(f".{key}.{host}.*"):
        pid = old.name.rsplit(".", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return root / f".{key}.{host}.{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _publish(staging: Path, entry: Path) -> None:
    """Move the finished build ``staging`` to ``entry`` in one rename.

    The flock that serialises builders does not reach across nodes on every shared file
    system; with the rename an entry appears whole or not at all, whoever builds it. When
    another node's build got there first, its entry (same inputs, same bytes) is kept."""
    if entry.exists() and _open_entry(entry, reused=True) is None:
        # An incomplete entry left by an interrupted build of an older version (they
        # built in place).
        shutil.rmtree(entry, ignore_errors=True)
    try:
        os.rename(staging, entry)
    except OSError:
        if _open_entry(entry, reused=True) is None:
            raise
    _fsync_dir(entry.parent)


def prepare_tokens(
    source: str | list[str],
    cache_root: str | Path,
    vocab_size: int = 8192,
    tokenizer_path: str | None = None,
    val_fraction: float = 0.01,
    max_bytes: int | None = None,
    *,
    val_tokens: int = DEFAULT_VAL_TOKENS,
    split_seed: int = 0,
    text_field: str = "text",
    eos_token: str | None = None,
    eos: str = "append",
    separator: str | None = None,
    progress: bool = True,
) -> TokenData:
    """Return the tokenised train/val split of ``source``, building it if needed.

    Safe to call from every rank and node at once: an ``fcntl.flock`` lock file in
    ``cache_root`` lets one process per host (every host, on a file system whose locks
    reach across nodes) build a missing entry while the others wait and then reuse it. A
    build happens in a private directory renamed into place when complete, so an entry is
    never seen half written, even where the lock does not reach across nodes (then two
    nodes may both build, and the first rename wins). ``editrain data`` before a
    multi-node job builds it once (``examples/slurm/train.sbatch`` does).

    The validation split holds out whole documents, families and near-duplicates
    together, stratified by kind: ``max(val_fraction of the bytes, val_tokens)``, at
    most 30% of the corpus (see :mod:`editrain.data.split`). If the corpus has too
    few documents for that (e.g. one big text file), its last bytes are used
    instead; ``meta["split"]`` records which (``"documents"`` or ``"tail"``).

    Args:
        source: ``data.path`` spec: ``"default"``, files, directories, glob patterns,
            ``hf:`` datasets, ``save_to_disk`` directories, or a list of those (see
            :func:`editrain.data.sources.parse_sources`).
        cache_root: Directory holding cache entries (created if missing).
        vocab_size: Target BPE vocabulary size; ignored with ``tokenizer_path``.
        tokenizer_path: Optional user ``tokenizer.json`` (``data.tokenizer``)
            used instead of training a BPE.
        val_fraction: Share of the corpus held out for validation, in (0, 0.5).
        val_tokens: Floor of the validation split in tokens (``data.val_tokens``).
        split_seed: Seed of the choice of validation documents (``data.split_seed``).
        max_bytes: Only read this many bytes of text (for small runs/tests).
        text_field: Field/column holding the text of ``.jsonl``/``.json``/``.parquet``
            files and Hugging Face datasets (``data.text_field``).
        eos_token: Name of the document separator in a user tokenizer;
            ``None`` auto-detects (see :func:`editrain.data.tokenizer.eos_id`).
        eos: Where the separator goes (``data.eos``, one of ``EOS_POLICIES``):
            ``"append"`` after every document, ``"prepend"`` before it, ``"none"`` nowhere.
        separator: Text that separates documents inside text files (``data.separator``;
            see :func:`editrain.data.sources.parse_sources`); None: a file is a document.
        progress: Show a progress bar on stderr when a build is slow and stderr is a
            terminal; False keeps it quiet.

    Returns:
        A :class:`TokenData` with memory-mapped splits.

    Raises:
        ValueError: Invalid ``vocab_size``/``val_fraction``/``eos``, a ``data.path``
            entry that is unsupported or cannot be loaded, a missing ``text_field``, an
            empty corpus, or a user tokenizer without the end-of-text token
            ``data.eos`` places (``append``, ``prepend``; the message names ``data.eos``).
        FileNotFoundError: A ``data.path`` or ``data.tokenizer`` path is missing.
        ImportError: A source needs ``pyarrow`` or ``datasets``, which is not installed.
    """
    _validate(vocab_size, val_fraction, val_tokens, split_seed, tokenizer_path, eos)
    split = {"val_fraction": float(val_fraction), "val_tokens": int(val_tokens),
             "seed": int(split_seed), "near_dup_jaccard": NEAR_DUP_JACCARD,
             "max_val_share": MAX_VAL_SHARE, "bytes_per_token_guess": _BYTES_PER_TOKEN_GUESS}
    vocab_size = int(vocab_size)
    if tokenizer_path is not None:
        tokenizer_path = os.fspath(tokenizer_path)
    refs = resolve_sources(source, text_field, separator)
    pretokenized = refs[0].kind in ("tokens", "token_rows")
    if pretokenized:
        if tokenizer_path is None:
            raise ValueError(f"data.tokenizer: the pre-tokenised corpus {shown(refs[0].label)} needs "
                             f"the tokenizer.json its ids come from (its vocabulary and EOS "
                             f"id); set data.tokenizer")
        # Nothing is read as text: the cap does not apply, nor the separator policy to
        # ids stored flat (rows of ids are documents: separated as data.eos says).
        max_bytes = None
        if refs[0].kind == "tokens":
            text_field, eos = "", "stored"
    if tokenizer_path is not None:
        # Loading validates the file (and the EOS token data.eos places) before any
        # waiting or building, so a bad path fails fast on every rank.
        user_tok = load_tokenizer(tokenizer_path)
        separator_id(user_tok, eos_token, eos)
        tok_identity = ["file", tokenizer_json_hash(tokenizer_path)]
        if any(template_ids(user_tok)):
            # its template goes once around a document, no longer around each piece of it
            # (keys of tokenizers without one are those of caches built before)
            tok_identity.append("template-once")
    else:
        # The sample bound and rule change the merges of corpora above the bound.
        tok_identity = ["bpe", vocab_size, BPE_SAMPLE_BYTES, _BPE_SAMPLE_RULE]
    key = _cache_key(
        source_fingerprint(refs, max_bytes),
        tok_identity,
        max_bytes,
        split,
        text_field,
        eos_token,
        eos,
        separator,
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
            staging = _staging_dir(root, key)
            try:
                if pretokenized:
                    _build_token_entry(staging, refs[0], source, tokenizer_path, split,
                                       eos_token, eos, key)
                else:
                    with BuildProgress(progress,
                                       expected_chars=source_size(refs, max_bytes)) as bar:
                        _build_entry(staging, refs, source, vocab_size, tokenizer_path, split,
                                     max_bytes, eos_token, eos, key, bar)
                _publish(staging, entry)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    data = _open_entry(entry, reused=False)
    if data is None:  # pragma: no cover - would mean the file system lost our writes
        raise RuntimeError(f"token cache entry {shown(entry)} is incomplete right after building it")
    return data
