"""Document sources: where the training text comes from.

A *source spec* is what the user writes in the ``data.path`` option: the word
``"default"`` (the embedded corpus described below), a text file, a ``.jsonl`` /
``.json`` / ``.parquet`` file of records, a directory of text files, a glob pattern of
those, a Hugging Face dataset (``hf:NAME[:CONFIG][@SPLIT]``, or a ``save_to_disk``
directory; see :mod:`editrain.data.hf`), or a list of any of these.
:func:`parse_sources` checks a spec without reading data (for configuration checks);
:func:`resolve_sources` also opens the record sources, so a typo or a missing text field
fails before any expensive work starts; :func:`iter_documents` then streams the documents.

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

import dataclasses
import glob
import hashlib
import io
import json
import logging
import os
import random
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from editrain.errors import spelled
from editrain.paths import shown
from editrain.safe_io import read_json_value

from .compressed import (
    COMPRESSIONS,
    check_compressed,
    compression,
    inner_suffix,
    open_binary,
    read_whole,
)
from .hf import (
    HF_PREFIX,
    check_saved_split,
    check_text_column,
    hf_label,
    hf_rows,
    load_hf,
    loaded_identity,
    parse_hf_spec,
    require_datasets,
    saved_dataset_kind,
    saved_split_dir,
)
from .optional import require
from .pretokenized import TOKEN_SUFFIXES, is_token_dir, open_tokens, token_files

__all__ = [
    "CODE_EXTENSIONS",
    "DEFAULT_SOURCE",
    "DEFAULT_SHUFFLE_SEED",
    "HF_FAMILY_ROWS",
    "SUPPORTED_SOURCES",
    "TEXT_EXTENSIONS",
    "Document",
    "SourceRef",
    "parse_sources",
    "resolve_sources",
    "iter_documents",
    "iter_records",
    "source_fingerprint",
    "source_size",
]

DEFAULT_SOURCE = "default"

log = logging.getLogger("editrain")

# Extensions of text files: read whole as one document when named in data.path, and the
# files picked up when a directory is given. Anything else in a directory (binaries,
# images, caches) is ignored rather than decoded.
TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst", ".text")
# The files a directory stands for: its text files, compressed or not (x.txt.gz).
DIR_EXTENSIONS = TEXT_EXTENSIONS + tuple(e + c for e in TEXT_EXTENSIONS for c in COMPRESSIONS)
# Extensions whose documents count as source code (everything else is prose) when
# the split stratifies by kind.
CODE_EXTENSIONS = (".py",)

SUPPORTED_SOURCES = (
    "'default' (the Python standard library and pydoc topics)",
    f"text files ({', '.join(TEXT_EXTENSIONS)})",
    "directories of such files (compressed or not)",
    ".jsonl and .json files (JSON Lines, or a JSON list of records)",
    ".parquet files",
    f"those text, .jsonl and .json files compressed ({', '.join(COMPRESSIONS)}: "
    "x.jsonl.gz, x.txt.zst...)",
    "Hugging Face datasets as hf:NAME[:CONFIG][@SPLIT]",
    "save_to_disk directories (DIR, or DIR@SPLIT for a DatasetDict)",
    "glob patterns of files and directories",
    "a pre-tokenised corpus, alone: a .bin of uint16 ids (nanoGPT), a .npy of integer ids, "
    "or a directory with nanoGPT's train.bin and val.bin (needs data.tokenizer)",
)
"""What a ``data.path`` entry may be (listed by the errors of unsupported entries)."""

HF_FAMILY_ROWS = 32
"""Rows of a Hugging Face dataset that form one family: neighbouring rows often come from
one source text (many datasets store a paragraph or a line per row), so they stay on one
side of the validation split."""

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

_KINDS = ("default", "text", "dir", "jsonl", "json", "parquet", "hf", "hf_disk", "tokens",
          "token_rows")
TOKEN_COLUMN = "input_ids"
"""``data.text_field`` value that reads a ``.parquet`` file or a ``save_to_disk`` directory
as a pre-tokenised corpus: each row's list of token ids (the column Hugging Face tokenizers
write) is a document."""
# Kinds whose documents are the rows of a table or the records of a file.
_ROW_KINDS = ("jsonl", "json", "parquet", "hf", "hf_disk")
_GLOB_CHARS = frozenset("*?[")
# Rows read per batch from parquet files and datasets: bounded memory, few round trips.
_ROW_BATCH = 1024
_TEXT_KINDS = ("text", "dir")
"""Kinds whose files are text that ``data.separator`` cuts into documents."""
_READ_CHUNK = 1 << 22
"""Bytes read at a time from a text file cut by ``data.separator``."""
RECORD_DEPTH = 256
"""The deepest nesting a corpus record may have (deeper: refused in one line, not a
RecursionError from the JSON parser)."""


@dataclass(frozen=True)
class Document:
    """One document and what the validation split needs to know about it.

    Args:
        text: The document's text.
        name: A stable identifier (``stdlib:email/parser.py``, ``pydoc:assert``,
            ``/data/x.jsonl:12``, ``hf:wikitext:wikitext-2-raw-v1@train:7``), unique
            within a corpus.
        family: Documents likely to share text have the same family (one stdlib
            package, one directory, one file, a block of ``HF_FAMILY_ROWS`` dataset
            rows); a family is never split between train and validation.
        kind: ``"code"`` or ``"prose"``; the split is stratified by kind.
    """

    text: str
    name: str
    family: str
    kind: str


def _kind_of(path: str) -> str:
    plain = path.lower()
    if Path(plain).suffix in COMPRESSIONS:  # x.py.gz is code
        plain = plain[:-len(Path(plain).suffix)]
    return "code" if plain.endswith(CODE_EXTENSIONS) else "prose"


@dataclass(frozen=True)
class SourceRef:
    """One validated document source.

    Args:
        kind: One of ``"default"``, ``"text"`` (a whole file is one document),
            ``"dir"`` (every text file below it is one document), ``"jsonl"``
            (one JSON object per line), ``"json"`` (a JSON list of objects),
            ``"parquet"`` (one row per document), ``"hf"`` (a dataset opened by
            ``datasets.load_dataset``) or ``"hf_disk"`` (a ``save_to_disk`` directory).
        path: Absolute path of the file or directory; ``None`` for the default
            corpus and ``hf`` sources.
        text_field: Field (json/jsonl) or column (parquet, datasets) that holds the text.
        name: ``hf``: the dataset name (or local data directory) for ``load_dataset``.
        config: ``hf``: the dataset configuration, or None.
        split: ``hf``: the split; ``hf_disk``: the split of a saved ``DatasetDict``
            (None for a saved ``Dataset``).
        separator: ``text`` and ``dir``: the text that separates documents inside a file
            (``data.separator``), or None: a file is one document.
    """

    kind: str
    path: Path | None = None
    text_field: str = "text"
    name: str | None = None
    config: str | None = None
    split: str | None = None
    separator: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown source kind {self.kind!r}; expected one of {_KINDS}")

    @property
    def label(self) -> str:
        """How ``data.path`` names this source: ``default``, the path (``@SPLIT`` added
        for a saved ``DatasetDict``) or ``hf:NAME[:CONFIG]@SPLIT``."""
        if self.kind == "default":
            return DEFAULT_SOURCE
        if self.kind == "hf":
            return hf_label(self.name, self.config, self.split)
        return str(self.path) + (f"@{self.split}" if self.split else "")


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


def _walk_files(root: Path, extensions: tuple[str, ...] | None) -> Iterator[tuple[str, Path]]:
    """``(relative posix path, path)`` of the files below ``root`` whose names end with one
    of ``extensions`` (None: every file), in file-system order; hidden entries skipped."""
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden directories are skipped so that a .git or .venv inside a data
        # directory does not silently become training data.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (extensions and not name.lower().endswith(extensions)):
                continue
            full = Path(dirpath) / name
            yield full.relative_to(root).as_posix(), full


def _dir_names(root: Path, extensions: tuple[str, ...] | None = DIR_EXTENSIONS) -> list[str]:
    """The relative posix paths of :func:`_walk_files`, sorted (independent of the file
    system's listing order). Names, not paths: a pass over a directory holds its listing
    to the end, and a Path object takes twice a name's memory (68k files: 15 vs 7 MB)."""
    return sorted(rel for rel, _ in _walk_files(root, extensions))


def _dir_files(root: Path, extensions: tuple[str, ...] | None = DIR_EXTENSIONS) -> list[Path]:
    """The files of :func:`_walk_files`, sorted by relative path (:func:`_dir_names`)."""
    return [root / rel for rel in _dir_names(root, extensions)]


def _require_pyarrow(load: bool = True):
    return require("pyarrow.parquet", "parquet", "reading .parquet files", load=load)


def _is_glob(entry: str) -> bool:
    # An existing path is taken literally even if its name holds glob characters.
    return (entry != DEFAULT_SOURCE and not entry.startswith(HF_PREFIX)
            and not _GLOB_CHARS.isdisjoint(entry) and not Path(entry).expanduser().exists())


def _expand(spec: str | os.PathLike | Iterable[str]) -> list[str]:
    """The entries of a ``data.path`` spec, each glob pattern replaced by its sorted matches
    (``**`` matches any depth)."""
    if isinstance(spec, (str, os.PathLike)):
        entries = [spec]
    elif isinstance(spec, Iterable):
        entries = list(spec)
    else:
        raise ValueError(f"data.path: must be a string or a list of strings, got {spelled(spec)}")
    if not entries:
        raise ValueError("data.path: empty; give 'default' or at least one file, directory, "
                         "glob pattern or hf: dataset")
    out: list[str] = []
    for entry in entries:
        if isinstance(entry, os.PathLike):
            entry = os.fspath(entry)
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"data.path: entries must be non-empty strings, got {spelled(entry)}")
        if not _is_glob(entry):
            out.append(entry)
            continue
        matches = sorted(glob.glob(os.path.expanduser(entry), recursive=True))
        if not matches:
            raise ValueError(f"data.path: the glob pattern {shown(entry)} matches no file or "
                             f"directory")
        out.extend(matches)
    return out


def _json_is_list(path: Path) -> bool:
    """Whether a ``.json`` file holds one JSON list (otherwise it is read as JSON Lines)."""
    with open_binary(path) as fh:
        while chunk := fh.read(1 << 12):
            head = chunk.removeprefix(_BOM).lstrip()
            if head:
                return head.startswith(b"[")
    return False


def _records_hint(root: Path, named: frozenset[Path] = frozenset()) -> str:
    """How to name the record files a directory holds, if it holds any (a directory stands
    for its text files; shards of records, C4's ``*.json.gz`` say, are named by a glob),
    less those another entry of ``data.path`` names (``named``)."""
    kinds: dict[str, int] = {}
    for _, p in _walk_files(root, None):
        if p in named:
            continue
        inner = inner_suffix(p)
        if inner in (".jsonl", ".json", ".parquet"):
            suffix = inner + (p.suffix.lower() if compression(p) else "")
            kinds[suffix] = kinds.get(suffix, 0) + 1
    if not kinds:
        return ""
    # every kind, the most common first: naming only that one left the others (a .jsonl
    # beside .json.gz shards, a .parquet) out of the corpus the advice made
    ordered = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))
    held = ", ".join(f"{count} {suffix} file{'s' if count > 1 else ''}"
                     for suffix, count in ordered)
    globs = ", ".join(shown(str(root / ("**/*" + suffix))) for suffix, _ in ordered)
    pattern = "a glob pattern" if len(ordered) == 1 else "glob patterns"
    return f"; it holds {held}: name them with {pattern}, {globs}"


_WARNED: set[str] = set()
"""The directories whose unread records, and the files whose lone surrogates, this process
has warned of (once each)."""
_BOM = b"\xef\xbb\xbf"
"""UTF-8's byte order mark: not text where a file starts with it."""
_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate left alone by a JSON escape (a pair is one character once parsed)."""


def _warn_of_unread_records(refs: list[SourceRef]) -> None:
    """Say (once per directory and process) which record files a directory entry holds
    that no entry reads: a directory stands for its text files, and records beside them
    are not dropped in silence. Those another entry names (a glob of the directory's
    ``*.jsonl``, say) are read, and left out of the warning, which named them too."""
    named = frozenset(r.path for r in refs if r.kind != "dir" and r.path is not None)
    for ref in refs:
        if ref.kind != "dir" or str(ref.path) in _WARNED:
            continue
        hint = _records_hint(ref.path, named)
        if hint:
            _WARNED.add(str(ref.path))
            log.warning("data.path: %s stands for its text files%s, if they belong to the "
                        "corpus too", ref.path, hint.replace("; it holds", ", not the"))


def _check_dir_compressed(root: Path) -> None:
    """:func:`check_compressed` of the first file of every compressed format among the
    files a directory stands for: a ``.zst`` file deep in a tree without ``zstandard`` is
    refused while ``data.path`` is checked, not once the build reaches it."""
    formats: set[str] = set()
    for _, path in _walk_files(root, DIR_EXTENSIONS):
        kind = compression(path)
        if kind is not None and kind not in formats:
            formats.add(kind)
            check_compressed(path)


def _classify(entry: str, text_field: str) -> SourceRef:
    """The :class:`SourceRef` of one glob-free entry, judged by its form, its extension or
    the files of its directory; no data is read."""
    if entry == DEFAULT_SOURCE:
        return SourceRef("default", None, text_field)
    if entry.startswith(HF_PREFIX):
        name, config, split = parse_hf_spec(entry)
        require_datasets(load=False)
        return SourceRef("hf", None, text_field, name=name, config=config, split=split)
    full = path = Path(entry).expanduser().absolute()
    split = None
    if not path.exists() and "@" in path.name:
        # DIR@SPLIT: one split of a saved DatasetDict.
        base, _, split = str(path).rpartition("@")
        path = Path(base)
    saved = saved_dataset_kind(path) if path.is_dir() else None
    if saved is not None:
        require_datasets(load=False)
        return SourceRef("token_rows" if text_field == TOKEN_COLUMN else "hf_disk", path,
                         text_field, split=check_saved_split(path, saved, split))
    if split is not None or not path.exists():
        hint = " ('@SPLIT' only follows a save_to_disk directory)" if split is not None else ""
        raise FileNotFoundError(f"data.path: {shown(str(full))} does not exist{hint}")
    if is_token_dir(path):
        return SourceRef("tokens", path, text_field)
    if path.is_dir():
        if next(_walk_files(path, DIR_EXTENSIONS), None) is None:
            raise ValueError(f"data.path: {shown(str(path))} contains no text: no files with "
                             f"extensions {', '.join(TEXT_EXTENSIONS)} (compressed or not), "
                             f"and it is not a save_to_disk directory{_records_hint(path)}")
        _check_dir_compressed(path)
        return SourceRef("dir", path, text_field)
    suffix = inner_suffix(path)
    if compression(path):
        if suffix not in (*TEXT_EXTENSIONS, ".jsonl", ".json"):
            raise ValueError(f"data.path: {shown(str(path))}: a compressed file is read as what "
                             f"its name says without {path.suffix} (text, .jsonl or .json), "
                             f"and that is {suffix or 'no extension'}; decompress it")
        check_compressed(path)
    if suffix in TOKEN_SUFFIXES:
        open_tokens(path)  # the form is checked here; the ids while the cache is written
        return SourceRef("tokens", path, text_field)
    if suffix in TEXT_EXTENSIONS:
        return SourceRef("text", path, text_field)
    if suffix == ".jsonl" or (suffix == ".json" and not _json_is_list(path)):
        return SourceRef("jsonl", path, text_field)
    if suffix == ".json":
        return SourceRef("json", path, text_field)
    if suffix == ".parquet":
        # Fail while checking the options rather than in the middle of tokenisation.
        _require_pyarrow(load=False)
        return SourceRef("token_rows" if text_field == TOKEN_COLUMN else "parquet", path,
                         text_field)
    raise ValueError(f"data.path: {shown(str(path))} is not a supported source (extension "
                     f"{suffix or 'none'}); supported: {'; '.join(SUPPORTED_SOURCES)}")


def parse_sources(spec: str | Iterable[str], text_field: str = "text",
                  separator: str | None = None) -> list[SourceRef]:
    """Check a ``data.path`` spec without reading any data.

    Checks the form of every entry, that paths exist and are of a supported kind, that
    glob patterns match, that ``hf:`` specs are well formed and that the optional packages
    the sources need are installed. A single string is one entry (it is not split on
    commas, since paths may contain them); pass a list for several. Paths have ``~``
    expanded and are made absolute.

    Args:
        spec: ``"default"``, a path, a glob pattern, an ``hf:`` spec, a ``save_to_disk``
            directory (``DIR@SPLIT`` for a split of a ``DatasetDict``), or a list of those
            (see ``SUPPORTED_SOURCES``).
        text_field: Field/column holding the text of record sources (``data.text_field``).
        separator: Text that separates documents inside text files and the files of
            directories (``data.separator``); None: every file is one document.

    Returns:
        One :class:`SourceRef` per distinct source in the given order, glob matches
        sorted; a source named twice (say by a path and a pattern) is read once.

    Raises:
        FileNotFoundError: A path does not exist (the message starts with ``data.path:``).
        ValueError: An empty spec, a pattern matching nothing, an unsupported file, a
            directory without text, a malformed ``hf:`` spec or a missing split (messages
            start with ``data.path:``), an empty ``text_field`` (``data.text_field:``), or
            an empty ``separator``, or one where no source is text files
            (``data.separator:``).
        ImportError: ``pyarrow`` or ``datasets`` is needed but not installed.
    """
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"data.text_field: must be a non-empty string naming the field "
                         f"(.jsonl/.json) or column (.parquet, Hugging Face datasets) that "
                         f"holds the text, got {spelled(text_field)}")
    if separator is not None and (not isinstance(separator, str) or not separator):
        raise ValueError(f"data.separator: must be non-empty text (or unset: a file is one "
                         f"document), got {spelled(separator)}")
    refs = list(dict.fromkeys(_classify(entry, text_field) for entry in _expand(spec)))
    _warn_of_unread_records(refs)
    if separator is not None:
        if not any(r.kind in _TEXT_KINDS for r in refs):
            raise ValueError(f"data.separator: cuts text files (a file or a directory of "
                             f"them) into documents, and data.path has none "
                             f"({', '.join(r.kind for r in refs)}); unset it")
        refs = [dataclasses.replace(r, separator=separator) if r.kind in _TEXT_KINDS else r
                for r in refs]
    tokens = [r for r in refs if r.kind in ("tokens", "token_rows")]
    if tokens and len(refs) > 1:
        raise ValueError(f"data.path: the pre-tokenised corpus {shown(tokens[0].label)} must be the "
                         f"only entry (its ids cannot be mixed with text or another token "
                         f"file); got {len(refs)} entries")
    return refs


def resolve_sources(spec: str | Iterable[str], text_field: str = "text",
                    separator: str | None = None) -> list[SourceRef]:
    """Turn a ``data.path`` spec into validated sources, ready to read.

    Does what :func:`parse_sources` does, then opens every record source (``.jsonl``,
    ``.json``, ``.parquet``, Hugging Face datasets) and reads its first record, so a
    missing text field or a dataset that cannot be loaded fails before any expensive work.

    Args:
        spec: As for :func:`parse_sources`.
        text_field: Field/column holding the text of record sources.
        separator: As for :func:`parse_sources`.

    Returns:
        The sources of :func:`parse_sources`.

    Raises:
        FileNotFoundError, ValueError, ImportError: As for :func:`parse_sources`; also
            ``ValueError`` for a record source without ``text_field`` (the message starts
            with ``data.text_field:``, names the source and lists its fields) or a dataset
            that cannot be loaded (not cached and no network, for instance).
    """
    refs = parse_sources(spec, text_field, separator)
    for ref in refs:
        if ref.kind == "token_rows":
            batches = token_row_batches(ref)
            try:
                next(batches, None)  # the column's presence and type
            finally:
                batches.close()
        if ref.kind in _ROW_KINDS:
            rows = _rows(ref)
            try:
                next(rows, None)
            finally:
                rows.close()
    return refs


def _read_text_file(path: Path) -> str:
    try:  # utf-8-sig: a byte order mark at the start is not text
        return read_whole(path).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        # Strict on user data: silently replacing bytes would train on garbage.
        raise ValueError(f"data.path: {shown(str(path))} is not valid UTF-8 ({exc})") from exc


def _separated_texts(path: Path, separator: str) -> Iterator[str]:
    """The documents of a text file cut at ``separator`` (which is not part of either),
    read in :data:`_READ_CHUNK` chunks, so that memory holds one document (and a chunk);
    documents that are only whitespace (say after a final separator) are left out.

    Raises:
        ValueError: a document that is not valid UTF-8 (its byte offset in the file).
    """
    sep = separator.encode("utf-8")
    buf, start, offset = bytearray(), 0, 0  # offset: file position of buf[0]
    with open_binary(path) as fh:
        read = getattr(fh, "read1", fh.read)
        while True:
            chunk = read(_READ_CHUNK)  # what one read gives (a pipe: what is there)
            buf += chunk
            if offset == 0 and buf.startswith(_BOM):
                del buf[:len(_BOM)]  # a byte order mark at the start is not text
                offset = len(_BOM)
            while (at := buf.find(sep, start)) >= 0 or (not chunk and buf):
                end = at if at >= 0 else len(buf)
                try:
                    text = buf[:end].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"data.path: {shown(str(path))} is not valid UTF-8 at "
                                     f"byte {offset + exc.start}") from None
                if text.strip():
                    yield text
                cut = min(len(buf), end + len(sep))
                del buf[:cut]
                offset, start = offset + cut, 0
            if not chunk:
                return
            start = max(0, len(buf) - len(sep) + 1)  # a separator may span two chunks


def _file_documents(path: Path, name: str, family: str, kind: str,
                    separator: str | None) -> Iterator[Document]:
    """One text file's documents: the whole file, or its ``separator``-cut pieces named
    ``NAME:INDEX`` (a single file's pieces are families of their own; the files of a
    directory keep the directory's family)."""
    if separator is None:
        yield Document(_read_text_file(path), name, family, kind)
        return
    for i, text in enumerate(_separated_texts(path, separator)):
        yield Document(text, f"{name}:{i}", f"{family}:{i}" if family == name else family,
                       kind)


def _dir_family(rel: str) -> str:
    # Files of one directory usually belong together (one project, one author).
    parent = rel.rpartition("/")[0]
    return parent if parent else rel


def _record_text(record: object, field: str, file: Path, at: str) -> object:
    """The ``field`` of one JSON record (its type is checked by the caller); ``at`` is
    where the record is in ``file`` (``:LINE`` or ``[INDEX]``)."""
    where = f"{shown(file)}{at}"
    if not isinstance(record, dict):
        raise ValueError(f"data.path: {where}: expected a JSON object, got "
                         f"{type(record).__name__}")
    if field not in record:
        raise ValueError(f"data.text_field: {where}: the JSON object has no {spelled(field)} field; "
                         f"its fields: {', '.join(record) or 'none'}")
    text = record[field]
    if isinstance(text, str) and _SURROGATE.search(text):
        # JSON may escape half of a UTF-16 pair alone (\ud800), which no UTF-8 text holds:
        # it stopped the build at the encoder without saying where. Replaced, as invalid
        # bytes are by a decoder that replaces them, and said once a file.
        if str(file) not in _WARNED:
            _WARNED.add(str(file))
            log.warning("data.path: %s: a lone UTF-16 surrogate escape (%r) replaced by "
                        "U+FFFD (and any others in this file)", f"{file}{at}",
                        _SURROGATE.search(text).group())
        text = _SURROGATE.sub("\ufffd", text)
    return text


def _jsonl_rows(path: Path, field: str) -> Iterator[tuple[int, object]]:
    """``(line number, text)`` of a JSON Lines file, read line by line."""
    with open_binary(path) as raw:
        fh = io.TextIOWrapper(raw, encoding="utf-8-sig")  # a byte order mark is not text
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue  # tolerate blank lines, common at the end of files
            record = read_json_value(line, f"data.path: {shown(path)}:{lineno}", error=ValueError,
                                     max_depth=RECORD_DEPTH)
            text = _record_text(record, field, path, f":{lineno}")
            if text is not None:  # a null text is left out, as in .parquet and datasets
                yield lineno, text


def _json_rows(path: Path, field: str) -> Iterator[tuple[int, object]]:
    """``(index, text)`` of a ``.json`` file holding a list of records. The file is parsed
    whole: corpora larger than memory belong in JSON Lines."""
    whole = read_whole(path)
    records = read_json_value(whole[len(_BOM):] if whole.startswith(_BOM) else whole,
                              f"data.path: {shown(path)}", error=ValueError,
                              max_depth=RECORD_DEPTH)
    if not isinstance(records, list):
        raise ValueError(f"data.path: {shown(path)}: expected a JSON list of records, got "
                         f"{type(records).__name__}")
    for index, record in enumerate(records):
        text = _record_text(record, field, path, f"[{index}]")
        if text is not None:  # a null text is left out, as in .parquet and datasets
            yield index, text


def _parquet_rows(path: Path, field: str) -> Iterator[tuple[int, object]]:
    """``(row number, text)`` of a parquet file's non-null ``field`` values."""
    pq = _require_pyarrow()
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"data.text_field: {shown(str(path))} has no column {spelled(field)}; its columns: "
                         f"{', '.join(names) or 'none'}")
    # Small record batches of one column keep memory bounded for files larger than RAM.
    row = 0
    for batch in pf.iter_batches(batch_size=_ROW_BATCH, columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is not None:
                yield row, text


def token_row_batches(ref: SourceRef) -> Iterator:
    """The ``input_ids`` column of a ``token_rows`` source (a ``.parquet`` file or a
    ``save_to_disk`` directory) as pyarrow list arrays of ``_ROW_BATCH`` rows: only that
    column is read, a batch at a time, so memory is bounded at any size.

    Raises:
        ValueError: naming ``data.text_field`` and the source: no such column, or one that
            does not hold lists of integers.
    """
    if ref.path.is_dir():
        ds = load_hf(ref.label, split=ref.split, saved=ref.path)
        names = list(ds.features)
        batches = (t.column(0) for t in ds.select_columns(
            [ref.text_field]).with_format("arrow").iter(batch_size=_ROW_BATCH)) \
            if ref.text_field in names else None
        schema_type = (ds.data.schema.field(ref.text_field).type
                       if ref.text_field in names else None)
    else:
        pf = _require_pyarrow().ParquetFile(ref.path)
        names = pf.schema_arrow.names
        batches = (b.column(0) for b in pf.iter_batches(batch_size=_ROW_BATCH,
                                                         columns=[ref.text_field])) \
            if ref.text_field in names else None
        schema_type = (pf.schema_arrow.field(ref.text_field).type
                       if ref.text_field in names else None)
    if batches is None:
        raise ValueError(f"data.text_field: {shown(ref.label)} has no column {spelled(ref.text_field)} (a "
                         f"pre-tokenised dataset's token ids); its columns: "
                         f"{', '.join(names) or 'none'}")
    item = getattr(schema_type, "value_type", None)
    if item is None or not (str(item).startswith("int") or str(item).startswith("uint")):
        raise ValueError(f"data.text_field: column {spelled(ref.text_field)} of {shown(ref.label)} holds "
                         f"{schema_type}, not lists of integer token ids")
    yield from batches


def _open_dataset(ref: SourceRef):
    """The ``datasets.Dataset`` of an ``hf``/``hf_disk`` source, its text column checked."""
    if ref.kind == "hf":
        ds = load_hf(ref.label, name=ref.name, config=ref.config, split=ref.split)
    else:
        ds = load_hf(ref.label, split=ref.split, saved=ref.path)
    check_text_column(ds, ref.text_field, ref.label)
    return ds


def _rows(ref: SourceRef) -> Iterator[tuple[int, object]]:
    """``(row, text)`` of a record source (one of ``_ROW_KINDS``); rows with a null text
    are left out, the row numbers say where each text is."""
    if ref.kind == "jsonl":
        return _jsonl_rows(ref.path, ref.text_field)
    if ref.kind == "json":
        return _json_rows(ref.path, ref.text_field)
    if ref.kind == "parquet":
        return _parquet_rows(ref.path, ref.text_field)
    return hf_rows(_open_dataset(ref), ref.text_field, _ROW_BATCH)


def _ref_documents(ref: SourceRef) -> Iterator[Document]:
    if ref.kind == "default":
        yield from _default_documents()
    elif ref.kind == "text":
        name = str(ref.path)
        yield from _file_documents(ref.path, name, name, _kind_of(name), ref.separator)
    elif ref.kind == "dir":
        for rel in _dir_names(ref.path):
            yield from _file_documents(ref.path / rel, f"{ref.path}/{rel}",
                                       f"{ref.path}/{_dir_family(rel)}", _kind_of(rel),
                                       ref.separator)
    else:
        # The rows of a file carry no structure to group them by: each is its own family
        # (near-duplicates are still grouped by content). Dataset rows are grouped in
        # blocks of neighbours (see HF_FAMILY_ROWS).
        block = HF_FAMILY_ROWS if ref.kind in ("hf", "hf_disk") else 1
        label = ref.label
        for row, text in _rows(ref):
            name = f"{label}:{row}"
            if not isinstance(text, str):
                raise ValueError(f"data.text_field: {shown(label)}:{row}: {spelled(ref.text_field)} holds "
                                 f"{type(text).__name__}, not text")
            first = row - row % block
            family = name if block == 1 else f"{label}:rows {first}-{first + block - 1}"
            yield Document(text, name, family, "prose")


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
        names = ", ".join(shown(r.label) for r in refs)
        raise ValueError(f"data.path: {names} contains no text")


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


def _tree_entries(root: Path, extensions: tuple[str, ...] | None) -> list[list]:
    """:func:`_file_entry` of every file of :func:`_dir_files`, named relative to ``root``."""
    return [_file_entry(p, p.relative_to(root).as_posix()) for p in _dir_files(root, extensions)]


def source_fingerprint(refs: list[SourceRef], max_bytes: int | None = None) -> str:
    """Content identity of ``refs`` for cache keys.

    Hashes the source list (kinds, paths, text fields), every file's size and the
    sha256 of its contents (sampled for files above 64 MB, whose mtime is then
    included too), and the cap. For the default corpus it covers the Python version,
    the stdlib directory, every file's contents and the pydoc topics, so editing a
    file, even at equal size, gives a new fingerprint. A ``save_to_disk`` directory is
    hashed like any directory (all its files); a dataset opened by ``load_dataset`` by its
    fingerprint, row count and cache files (see :func:`editrain.data.hf.loaded_identity`).

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
            parts.append(["dir", str(ref.path), _tree_entries(ref.path, DIR_EXTENSIONS)])
        elif ref.kind == "hf":
            parts.append(["hf", ref.label, ref.text_field, loaded_identity(_open_dataset(ref))])
        elif ref.kind == "hf_disk":
            parts.append(["hf_disk", ref.label, ref.text_field,
                          _tree_entries(saved_split_dir(ref.path, ref.split), None)])
        elif ref.kind == "token_rows" and ref.path.is_dir():
            parts.append(["token_rows", ref.label, _tree_entries(
                saved_split_dir(ref.path, ref.split), None)])
        elif ref.kind == "tokens":
            parts.append(["tokens", str(ref.path),
                          [_file_entry(p, p.name) for p in token_files(ref.path)]])
        else:
            parts.append([ref.kind, ref.text_field, _file_entry(ref.path, str(ref.path))])
    blob = json.dumps(parts, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("ascii")).hexdigest()


def source_size(refs: list[SourceRef], max_bytes: int | None = None) -> int | None:
    """Bytes of the files behind ``refs`` (at most ``max_bytes``), from the file system
    alone: what a build's progress bar expects before its first pass has counted the
    text. None when a source's size is not known without reading it (``hf:`` datasets,
    compressed files).

    Args:
        refs: Sources from :func:`resolve_sources`.
        max_bytes: The cap that will be applied when reading.
    """
    total = 0
    for ref in refs:
        if ref.kind == "default":
            files = [p for _, p in _stdlib_files()]
        elif ref.kind == "dir":
            files = _dir_files(ref.path, DIR_EXTENSIONS)
        elif ref.kind in ("hf", "hf_disk"):
            return None
        else:
            files = [ref.path]
        if any(compression(p) for p in files):  # its text's size is known once read
            return None
        total += sum(p.stat().st_size for p in files)
    return total if max_bytes is None else min(total, max_bytes)
