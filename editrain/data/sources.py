"""Document sources: where the training text comes from.

A *source spec* is what the user writes in the ``data.path`` option: the word
``"default"`` (the embedded corpus described below), a path to a file, or a
path to a directory, or a list of those. :func:`resolve_sources` turns the spec
into validated :class:`SourceRef` objects up front, so a typo fails before any
expensive work starts; :func:`iter_documents` then streams the documents.

The default corpus is the running interpreter's own standard library (``.py``
sources) plus the prose of ``pydoc_data.topics``. It ships with every Python,
so a first run needs no download and nothing is copied into the repository.
Topics and source files are interleaved (topic 0, file 0, topic 1, file 1,
...) so that a small ``max_bytes`` slice still mixes English prose and code.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_SOURCE",
    "TEXT_EXTENSIONS",
    "SourceRef",
    "resolve_sources",
    "iter_documents",
    "source_fingerprint",
]

DEFAULT_SOURCE = "default"

# Extensions picked up when a directory is given. Anything else in the
# directory (binaries, images, caches) is ignored rather than decoded.
TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst", ".text")

# Directory names skipped while walking the stdlib: test suites are huge,
# repetitive and full of deliberately odd code; site-packages is not stdlib.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)

_KINDS = ("default", "text", "dir", "jsonl", "parquet")


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
    """Return ``(relative posix path, absolute path)`` of stdlib ``.py`` files, sorted."""
    root = _stdlib_dir()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped trees.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                full = Path(dirpath) / name
                found.append((full.relative_to(root).as_posix(), full))
    # Sorting by relative path makes the order independent of the file
    # system's directory listing order.
    found.sort(key=lambda item: item[0])
    return found


def _pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _default_documents() -> Iterator[str]:
    topics = _pydoc_topics()
    files = _stdlib_files()
    for i in range(max(len(topics), len(files))):
        if i < len(topics):
            yield topics[i]
        if i < len(files):
            try:
                yield files[i][1].read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                # A few stdlib files in some distributions are not UTF-8;
                # skipping them keeps the corpus identical for every reader.
                continue


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


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
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
            yield text


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    pq = _require_pyarrow()
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise ValueError(f"{path}: parquet file has no {field!r} column")
    # Record batches keep memory bounded for files larger than RAM.
    for batch in pf.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _ref_documents(ref: SourceRef) -> Iterator[str]:
    if ref.kind == "default":
        yield from _default_documents()
    elif ref.kind == "text":
        yield _read_text_file(ref.path)
    elif ref.kind == "dir":
        for path in _dir_files(ref.path):
            yield _read_text_file(path)
    elif ref.kind == "jsonl":
        yield from _jsonl_documents(ref.path, ref.text_field)
    else:
        yield from _parquet_documents(ref.path, ref.text_field)


def _truncate_utf8(text: str, max_len: int) -> str:
    # errors="ignore" drops a multi-byte character cut in half at the end, so
    # the result never exceeds max_len bytes and is still valid text.
    return text.encode("utf-8")[:max_len].decode("utf-8", errors="ignore")


def iter_documents(refs: list[SourceRef], max_bytes: int | None = None) -> Iterator[str]:
    """Stream the non-empty documents of ``refs`` in a deterministic order.

    Args:
        refs: Sources from :func:`resolve_sources`.
        max_bytes: If given, stop once this many UTF-8 bytes were produced; the
            document crossing the cap is truncated so the total never exceeds it.

    Yields:
        Document texts. Empty documents are skipped.

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
            if not doc:
                continue
            if max_bytes is not None:
                size = len(doc.encode("utf-8"))
                if produced + size > max_bytes:
                    doc = _truncate_utf8(doc, max_bytes - produced)
                    capped = True
                produced += len(doc.encode("utf-8"))
            if doc:
                count += 1
                yield doc
            if capped:
                break
        if capped:
            break
    if count == 0:
        names = ", ".join(DEFAULT_SOURCE if r.path is None else str(r.path) for r in refs)
        raise ValueError(f"data.path ({names}) contains no text")


def _stat_entry(path: Path, name: str) -> list:
    st = path.stat()
    return [name, st.st_size, st.st_mtime_ns]


def source_fingerprint(refs: list[SourceRef], max_bytes: int | None = None) -> str:
    """Cheap content identity of ``refs`` for cache keys.

    Uses paths, sizes and modification times (never the file contents), so it
    costs one ``stat`` per file. For the default corpus it covers the Python
    version, the stdlib directory, every candidate file's size and the pydoc
    topics, so a different interpreter gives a different fingerprint.

    Args:
        refs: Sources from :func:`resolve_sources`.
        max_bytes: The cap that will be applied when reading.

    Returns:
        A hex sha256 digest.
    """
    parts: list = [["max_bytes", max_bytes]]
    for ref in refs:
        if ref.kind == "default":
            root = _stdlib_dir()
            topics_hash = hashlib.sha256(
                json.dumps(_pydoc_topics(), ensure_ascii=True).encode("ascii")
            ).hexdigest()
            # mtimes are left out on purpose: reinstalling the same Python
            # release yields the same text, so the cache should stay valid.
            files = [[rel, p.stat().st_size] for rel, p in _stdlib_files()]
            parts.append(["default", sys.version, str(root), topics_hash, files])
        elif ref.kind == "dir":
            files = [
                _stat_entry(p, p.relative_to(ref.path).as_posix()) for p in _dir_files(ref.path)
            ]
            parts.append(["dir", str(ref.path), files])
        else:
            parts.append([ref.kind, ref.text_field, _stat_entry(ref.path, str(ref.path))])
    blob = json.dumps(parts, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("ascii")).hexdigest()
