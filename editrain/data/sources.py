"""Document sources: where the training text comes from.

A *source spec* is what the user writes in the ``data.path`` option: the word
``"default"`` (the embedded corpus described below), a path to a file, or a
path to a directory, or a list of those. :func:`resolve_sources` turns the spec
into validated :class:`SourceRef` objects up front, so a typo fails before any
expensive work starts; :func:`iter_documents` then streams the documents.

Every document comes as a :class:`Document` record that also names its *family*
(documents that are likely to share text: the files of one package, one
directory) and its *kind* (``code`` or ``prose``); the validation split keeps
families whole and stratifies by kind (:mod:`editrain.data.split`).

The default corpus is the running interpreter's own standard library (``.py``
sources and the ``.txt``/``.rst`` notes that ship with it) plus the prose of
``pydoc_data.topics``. It ships with every Python, so a first run needs no
download and nothing is copied into the repository. Its documents are shuffled
with a fixed seed before the ``max_bytes`` cap applies, so a capped slice samples
the whole library (prose included), not an alphabetical prefix.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CODE_EXTENSIONS",
    "DEFAULT_SOURCE",
    "DEFAULT_SHUFFLE_SEED",
    "TEXT_EXTENSIONS",
    "Document",
    "SourceRef",
    "resolve_sources",
    "iter_documents",
    "iter_records",
    "source_fingerprint",
]

DEFAULT_SOURCE = "default"

# Extensions picked up when a directory is given. Anything else in the
# directory (binaries, images, caches) is ignored rather than decoded.
TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst", ".text")
# Extensions whose documents count as source code (everything else is prose) when
# the split stratifies by kind.
CODE_EXTENSIONS = (".py",)

# Seed of the default corpus's document shuffle. Fixed, so every rank, node and
# later run reads the same documents in the same order.
DEFAULT_SHUFFLE_SEED = 1234

# Files of the default corpus read as prose, next to the pydoc topics.
_STDLIB_PROSE_EXTENSIONS = (".txt", ".rst")

# Directory names skipped while walking the stdlib: test suites are huge,
# repetitive and full of deliberately odd code; site-packages is not stdlib.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
     # pydoc_data holds the topics as a Python literal: read as prose below instead
     # of a second, code-shaped copy of the same text.
     "pydoc_data"}
)

_KINDS = ("default", "text", "dir", "jsonl", "parquet")


@dataclass(frozen=True)
class Document:
    """One document and what the validation split needs to know about it.

    Args:
        text: The document's text.
        name: A stable identifier (``stdlib:email/parser.py``, ``pydoc:assert``,
            ``/data/x.jsonl:12``), unique within a corpus.
        family: Documents likely to share text have the same family (one stdlib
            package, one directory, one file); a family is never split between
            train and validation.
        kind: ``"code"`` or ``"prose"``; the split is stratified by kind.
    """

    text: str
    name: str
    family: str
    kind: str


def _kind_of(path: str) -> str:
    return "code" if path.lower().endswith(CODE_EXTENSIONS) else "prose"


@dataclass(frozen=True)
class SourceRef:
    """One validated document source.

    Args:
        kind: One of ``"default"``, ``"text"`` (a whole file is one document),
            ``"dir"`` (every text file below it is one document), ``"jsonl"``
            (one JSON object per line) or ``"parquet"`` (one row per document).
        path: Absolute path of the file or directory; ``None`` for the default
            corpus.
        text_field: Field (jsonl) or column (parquet) that holds the text.
    """

    kind: str
    path: Path | None = None
    text_field: str = "text"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown source kind {self.kind!r}; expected one of {_KINDS}")


def _stdlib_dir() -> Path:
    # os.py always lives at the top of the pure-Python stdlib, also inside a venv
    # (venvs link to the base interpreter's stdlib rather than copying it).
    return Path(os.path.dirname(os.path.abspath(os.__file__)))


def _stdlib_files() -> list[tuple[str, Path]]:
    """``(relative posix path, absolute path)`` of the stdlib's ``.py`` sources and
    ``.txt``/``.rst`` notes, sorted by relative path."""
    root = _stdlib_dir()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped trees.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith((".py", *_STDLIB_PROSE_EXTENSIONS)):
                full = Path(dirpath) / name
                found.append((full.relative_to(root).as_posix(), full))
    # Sorting by relative path makes the order independent of the file
    # system's directory listing order.
    found.sort(key=lambda item: item[0])
    return found


def _pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {key: topics[key] for key in sorted(topics)}


def _stdlib_family(rel: str) -> str:
    # A package's modules share idioms, helpers and boilerplate (the codec tables of
    # ``encodings`` are near copies of each other): the whole top-level package is
    # one family. A top-level module is its own family.
    return "stdlib:" + rel.split("/", 1)[0].removesuffix(".py")


def _default_entries() -> list[tuple[str, str, object]]:
    """``(name, family, topic text or file path)`` of the default corpus, in the
    seeded shuffled order in which it is read (and capped)."""
    entries: list[tuple[str, str, object]] = [
        (f"pydoc:{key}", f"pydoc:{key}", text) for key, text in _pydoc_topics().items()
    ]
    entries += [(f"stdlib:{rel}", _stdlib_family(rel), path) for rel, path in _stdlib_files()]
    # The sorted listing above is independent of the file system; the shuffle then
    # spreads a capped slice over the whole library instead of an alphabetical prefix.
    random.Random(DEFAULT_SHUFFLE_SEED).shuffle(entries)
    return entries


def _default_documents() -> Iterator[Document]:
    for name, family, item in _default_entries():
        if isinstance(item, str):
            yield Document(item, name, family, "prose")
            continue
        try:
            text = item.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            # A few stdlib files in some distributions are not UTF-8;
            # skipping them keeps the corpus identical for every reader.
            continue
        yield Document(text, name, family, _kind_of(name))


def _dir_files(root: Path) -> list[Path]:
    """Text files below ``root`` sorted by relative path; hidden entries skipped."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden directories are skipped so that a .git or .venv inside a data
        # directory does not silently become training data.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or not name.lower().endswith(TEXT_EXTENSIONS):
                continue
            full = Path(dirpath) / name
            found.append((full.relative_to(root).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return [p for _, p in found]


def _require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            'reading .parquet files needs pyarrow; install it with pip install "editrain[parquet]"'
        ) from exc
    return pq


def _classify(path: Path, text_field: str) -> SourceRef:
    if path.is_dir():
        return SourceRef("dir", path, text_field)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return SourceRef("jsonl", path, text_field)
    if suffix == ".parquet":
        # Fail at resolve time rather than in the middle of tokenisation.
        _require_pyarrow()
        return SourceRef("parquet", path, text_field)
    return SourceRef("text", path, text_field)


def resolve_sources(spec: str | Iterable[str], text_field: str = "text") -> list[SourceRef]:
    """Turn a ``data.path`` spec into validated sources.

    A single string is one source (it is not split on commas, since paths may
    contain them); pass a list for several. ``"default"`` selects the embedded
    stdlib corpus. Paths have ``~`` expanded and are made absolute.

    Args:
        spec: ``"default"``, a file or directory path, or a list of those.
        text_field: Field/column holding the text in ``.jsonl``/``.parquet``.

    Returns:
        One :class:`SourceRef` per entry, in the given order.

    Raises:
        FileNotFoundError: A path does not exist (the message names ``data.path``).
        ValueError: The spec is empty, or a directory holds no text files.
        ImportError: A ``.parquet`` source is given but pyarrow is missing.
    """
    entries = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not entries:
        raise ValueError("data.path is empty; give 'default' or at least one file or directory")
    refs: list[SourceRef] = []
    for entry in entries:
        entry = os.fspath(entry)
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"data.path entries must be non-empty strings, got {entry!r}")
        if entry == DEFAULT_SOURCE:
            refs.append(SourceRef("default", None, text_field))
            continue
        path = Path(entry).expanduser().absolute()
        if not path.exists():
            raise FileNotFoundError(f"data.path: {str(path)!r} does not exist")
        ref = _classify(path, text_field)
        if ref.kind == "dir" and not _dir_files(path):
            raise ValueError(
                f"data.path {str(path)!r} contains no text: no files with extensions "
                f"{', '.join(TEXT_EXTENSIONS)}"
            )
        refs.append(ref)
    return refs


def _read_text_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        # Strict on user data: silently replacing bytes would train on garbage.
        raise ValueError(f"data.path: {str(path)!r} is not valid UTF-8 ({exc})") from exc


def _dir_family(rel: str) -> str:
    # Files of one directory usually belong together (one project, one author).
    parent = rel.rpartition("/")[0]
    return parent if parent else rel


def _jsonl_documents(path: Path, field: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue  # tolerate blank lines, common at the end of files
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or field not in obj:
                raise ValueError(f"{path}:{lineno}: JSON object has no {field!r} field")
            text = obj[field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: field {field!r} must be a string, got {type(text).__name__}"
                )
            yield lineno, text


def _parquet_documents(path: Path, field: str) -> Iterator[tuple[int, str]]:
    pq = _require_pyarrow()
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise ValueError(f"{path}: parquet file has no {field!r} column")
    # Record batches keep memory bounded for files larger than RAM.
    row = 0
    for batch in pf.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is not None:
                yield row, text


def _ref_documents(ref: SourceRef) -> Iterator[Document]:
    if ref.kind == "default":
        yield from _default_documents()
    elif ref.kind == "text":
        name = str(ref.path)
        yield Document(_read_text_file(ref.path), name, name, _kind_of(name))
    elif ref.kind == "dir":
        for path in _dir_files(ref.path):
            rel = path.relative_to(ref.path).as_posix()
            yield Document(_read_text_file(path), f"{ref.path}/{rel}",
                           f"{ref.path}/{_dir_family(rel)}", _kind_of(rel))
    else:
        rows = (_jsonl_documents if ref.kind == "jsonl" else _parquet_documents)(
            ref.path, ref.text_field)
        # Rows of a jsonl/parquet file carry no structure to group them by: each row
        # is its own family (near-duplicates are still grouped by content).
        for row, text in rows:
            name = f"{ref.path}:{row}"
            yield Document(text, name, name, "prose")


def _truncate_utf8(text: str, max_len: int) -> str:
    # errors="ignore" drops a multi-byte character cut in half at the end, so
    # the result never exceeds max_len bytes and is still valid text.
    return text.encode("utf-8")[:max_len].decode("utf-8", errors="ignore")


def iter_documents(refs: list[SourceRef], max_bytes: int | None = None) -> Iterator[str]:
    """Stream the texts of :func:`iter_records` (same order, same cap)."""
    for doc in iter_records(refs, max_bytes):
        yield doc.text


def iter_records(refs: list[SourceRef], max_bytes: int | None = None) -> Iterator[Document]:
    """Stream the non-empty documents of ``refs`` in a deterministic order.

    Args:
        refs: Sources from :func:`resolve_sources`.
        max_bytes: If given, stop once this many UTF-8 bytes were produced; the
            document crossing the cap is truncated so the total never exceeds it.

    Yields:
        :class:`Document` records. Empty documents are skipped.

    Raises:
        ValueError: No text at all was produced (message names ``data.path``),
            or a source is malformed (bad jsonl line, non-UTF-8 file).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    produced = 0
    count = 0
    capped = False
    for ref in refs:
        for doc in _ref_documents(ref):
            text = doc.text
            if not text:
                continue
            if max_bytes is not None:
                size = len(text.encode("utf-8"))
                if produced + size > max_bytes:
                    text = _truncate_utf8(text, max_bytes - produced)
                    capped = True
                produced += len(text.encode("utf-8"))
            if text:
                count += 1
                yield doc if text is doc.text else Document(text, doc.name, doc.family, doc.kind)
            if capped:
                break
        if capped:
            break
    if count == 0:
        names = ", ".join(DEFAULT_SOURCE if r.path is None else str(r.path) for r in refs)
        raise ValueError(f"data.path ({names}) contains no text")


# Files up to this size are hashed whole; larger ones by samples (see _content_digest).
_FULL_HASH_BYTES = 64 << 20
_SAMPLE_BYTES = 1 << 20


def _content_digest(path: Path, size: int) -> str:
    """sha256 of a file's bytes; for files above 64 MB, of 1 MB samples at 65 evenly
    spaced offsets (first and last MB included), so multi-GB corpora cost a bounded
    read at every start while an edit anywhere in a small file always changes it."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= _FULL_HASH_BYTES:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        else:
            for i in range(65):
                fh.seek((size - _SAMPLE_BYTES) * i // 64)
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _file_entry(path: Path, name: str, with_mtime: bool = True) -> list:
    st = path.stat()
    entry = [name, st.st_size, _content_digest(path, st.st_size)]
    if with_mtime:
        # Large files are hashed by samples: the mtime catches edits between samples.
        entry.append(st.st_mtime_ns if st.st_size > _FULL_HASH_BYTES else None)
    return entry


def source_fingerprint(refs: list[SourceRef], max_bytes: int | None = None) -> str:
    """Content identity of ``refs`` for cache keys.

    Hashes the source list (kinds, paths, text fields), every file's size and the
    sha256 of its contents (sampled for files above 64 MB, whose mtime is then
    included too), and the cap. For the default corpus it covers the Python version,
    the stdlib directory, every file's contents and the pydoc topics, so editing a
    file, even at equal size, gives a new fingerprint.

    Args:
        refs: Sources from :func:`resolve_sources`.
        max_bytes: The cap that will be applied when reading.

    Returns:
        A hex sha256 digest.
    """
    parts: list = [["max_bytes", max_bytes], ["shuffle_seed", DEFAULT_SHUFFLE_SEED]]
    for ref in refs:
        if ref.kind == "default":
            root = _stdlib_dir()
            topics_hash = hashlib.sha256(
                json.dumps(_pydoc_topics(), ensure_ascii=True).encode("ascii")
            ).hexdigest()
            # No mtimes: reinstalling the same Python release yields the same text, so
            # the cache stays valid; the contents decide.
            files = [_file_entry(p, rel, with_mtime=False) for rel, p in _stdlib_files()]
            parts.append(["default", sys.version, str(root), topics_hash, files])
        elif ref.kind == "dir":
            files = [_file_entry(p, p.relative_to(ref.path).as_posix()) for p in _dir_files(ref.path)]
            parts.append(["dir", str(ref.path), files])
        else:
            parts.append([ref.kind, ref.text_field, _file_entry(ref.path, str(ref.path))])
    blob = json.dumps(parts, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("ascii")).hexdigest()
