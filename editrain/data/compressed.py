"""Compressed corpus files (``.gz``, ``.bz2``, ``.xz``, ``.zst``), read as streams.

``.gz``, ``.bz2`` and ``.xz`` are read with the standard library, ``.zst`` with the
``zstandard`` package (the ``zstd`` extra).

A compressed file is the file its name has without the last suffix (``c4-00000.json.gz`` is
JSON Lines, ``pile-00.jsonl.zst`` too, ``book.txt.xz`` a text file), decompressed while it
is read: JSON Lines a line at a time and text cut by ``data.separator`` a chunk at a time,
so memory holds one record or document whatever the file's size. A file read whole (a
text file as one document, a ``.json`` list) is refused past :data:`WHOLE_MAX_BYTES` of
decompressed text, so a small file cannot fill the memory. A file that is not what its
suffix says, or is cut short, is refused in one line naming it.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

from .optional import require

__all__ = ["COMPRESSIONS", "WHOLE_MAX_BYTES", "check_compressed", "compression",
           "inner_suffix", "open_binary", "read_whole"]

COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
"""The suffixes of the compressed files a ``data.path`` entry may name, and their formats."""
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
        ImportError: ``.zst`` without ``zstandard``, with the ``pip install`` command.
    """
    if compression(path) == "zstd":
        require("zstandard", "zstd", "reading .zst files", load=False)


def _errors() -> tuple[type[BaseException], ...]:
    """What the decompressors raise on data that is not theirs or is cut short."""
    kinds: list[type[BaseException]] = [OSError, EOFError, lzma.LZMAError, zlib.error]
    try:
        import zstandard

        kinds.append(zstandard.ZstdError)
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
        if kind == "zstd":
            zstandard = require("zstandard", "zstd", "reading .zst files")
            fh = stack.enter_context(zstandard.ZstdDecompressor().stream_reader(
                raw, read_across_frames=True))
        else:
            opener = {"gzip": gzip.GzipFile, "bzip2": bz2.BZ2File, "xz": lzma.LZMAFile}[kind]
            fh = stack.enter_context(opener(fileobj=raw) if kind == "gzip" else opener(raw))
        try:
            yield fh
        except _errors() as e:  # raised by a read of the body: the data is damaged
            raise ValueError(f"data.path: {str(path)!r} is not a complete {kind} file "
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
        raise ValueError(f"data.path: {str(path)!r} decompresses to more than "
                         f"{WHOLE_MAX_BYTES} bytes, read whole as one document or list; "
                         "cut it into documents with data.separator, or use JSON Lines")
    return b"".join(chunks)
