"""Compressed corpus files (``.gz``, ``.bz2``, ``.xz``, ``.zst``), read as streams.

``.gz``, ``.bz2`` and ``.xz`` are read with the standard library (whose ``bz2`` and
``lzma`` modules a Python may be built without), ``.zst`` with the ``zstandard`` package
(the ``zstd`` extra). Each is imported when a file of its format is checked or read, and
a missing one is refused while ``data.path`` is checked (:func:`check_compressed`, for
every format a directory holds too), before anything is read or written.

A compressed file is the file its name has without the last suffix (``c4-00000.json.gz`` is
JSON Lines, ``pile-00.jsonl.zst`` too, ``book.txt.xz`` a text file), decompressed while it
is read: JSON Lines a line at a time and text cut by ``data.separator`` a chunk at a time,
so memory holds one record or document whatever the file's size. A file read whole (a
text file as one document, a ``.json`` list) is refused past :data:`WHOLE_MAX_BYTES` of
decompressed text, so a small file cannot fill the memory. A file that is not what its
suffix says, or is cut short, is refused in one line naming it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

from editrain.paths import shown

from .optional import require

__all__ = ["COMPRESSIONS", "WHOLE_MAX_BYTES", "check_compressed", "compression",
           "inner_suffix", "open_binary", "read_whole"]

COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
"""The suffixes of the compressed files a ``data.path`` entry may name, and their formats."""
_READERS = {"gzip": ("gzip", None), "bzip2": ("bz2", None), "xz": ("lzma", None),
            "zstd": ("zstandard", "zstd")}
"""The module that reads each format, and the ``editrain`` extra that installs it (None:
Python's own, missing only from a Python built without its library)."""
WHOLE_MAX_BYTES = 1 << 30
"""The most text a compressed file read whole may decompress to (a larger corpus belongs in
JSON Lines, or cut into documents by ``data.separator``, which are streamed)."""


def compression(path: Path) -> str | None:
    """The format of a compressed file by its suffix (``gzip``...), or None."""
    return COMPRESSIONS.get(path.suffix.lower())


def inner_suffix(path: Path) -> str:
    """The suffix that says what the file holds once decompressed (``.jsonl`` of
    ``x.jsonl.gz``; a file that is not compressed: its own suffix)."""
    return Path(path.stem).suffix.lower() if compression(path) else path.suffix.lower()


def check_compressed(path: Path) -> None:
    """Refuse, before any work, a compressed file whose decompressor is not installed.

    Raises:
        ImportError: the message starts with ``data.path:``, names the file and says what
            to install (``.zst`` without ``zstandard``: the ``pip install`` command).
    """
    kind = compression(path)
    if kind is not None:
        _reader(kind, path, load=False)


def _reader(kind: str, path: Path, load: bool = True):
    """The module that decompresses ``kind`` (None with ``load=False`` for a package that
    is only looked up; see :func:`~editrain.data.optional.require`)."""
    module, extra = _READERS[kind]
    suffix = next(s for s, k in COMPRESSIONS.items() if k == kind)
    purpose = f"reading {suffix} files ({shown(str(path))})"
    if extra is not None:
        return require(module, extra, purpose, load=load)
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"data.path: {purpose} needs Python's {module} module, which "
                          f"this Python was built without; decompress the files, or use "
                          f"a Python built with it") from None


def _errors() -> tuple[type[BaseException], ...]:
    """What the decompressors raise on data that is not theirs or is cut short."""
    kinds: list[type[BaseException]] = [OSError, EOFError]
    for module, name in (("zlib", "error"), ("lzma", "LZMAError"), ("zstandard", "ZstdError")):
        try:
            kinds.append(getattr(importlib.import_module(module), name))
        except ImportError:
            pass
    return tuple(kinds)


@contextmanager
def open_binary(path: Path) -> Iterator[IO[bytes]]:
    """``path``'s bytes, decompressed as its suffix says (a file that is not compressed:
    as it is).

    Raises:
        ValueError: what it holds is not that format, or is cut short (``data.path:`` and
            the file, in one line), raised where the stream is read.
    """
    kind = compression(path)
    with ExitStack() as stack:
        raw = stack.enter_context(open(path, "rb"))
        if kind is None:
            yield raw
            return
        reader = _reader(kind, path)
        if kind == "zstd":
            fh = stack.enter_context(reader.ZstdDecompressor().stream_reader(
                raw, read_across_frames=True))
        elif kind == "gzip":
            fh = stack.enter_context(reader.GzipFile(fileobj=raw))
        else:
            fh = stack.enter_context((reader.BZ2File if kind == "bzip2" else reader.LZMAFile)(raw))
        try:
            yield fh
        except _errors() as e:  # raised by a read of the body: the data is damaged
            raise ValueError(f"data.path: {shown(str(path))} is not a complete {kind} file "
                             f"({str(e)[:120] or type(e).__name__})") from None


def read_whole(path: Path) -> bytes:
    """All of a file's (decompressed) bytes: at most :data:`WHOLE_MAX_BYTES` of a
    compressed one.

    Raises:
        ValueError: a compressed file that decompresses to more, or that is damaged.
    """
    if compression(path) is None:
        return path.read_bytes()
    chunks, size = [], 0
    with open_binary(path) as fh:
        while size <= WHOLE_MAX_BYTES and (chunk := fh.read(1 << 24)):
            chunks.append(chunk)
            size += len(chunk)
    if size > WHOLE_MAX_BYTES:
        raise ValueError(f"data.path: {shown(str(path))} decompresses to more than "
                         f"{WHOLE_MAX_BYTES} bytes, read whole as one document or list; "
                         "cut it into documents with data.separator, or use JSON Lines")
    return b"".join(chunks)
