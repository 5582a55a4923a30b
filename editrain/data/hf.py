"""Hugging Face datasets as document sources: ``hf:`` specs and ``save_to_disk`` directories.

Two forms of ``data.path`` entry read a :mod:`datasets` dataset (the ``hf`` extra):

* ``hf:NAME[:CONFIG][@SPLIT]`` calls ``datasets.load_dataset(NAME, CONFIG, split=SPLIT)``
  (split ``train`` by default). A dataset already in the local Hugging Face cache (where
  ``HF_HOME`` / ``HF_DATASETS_CACHE`` point) loads without a network; with
  ``HF_HUB_OFFLINE=1`` nothing is ever downloaded. ``NAME`` may also be a local directory of
  data files, which ``load_dataset`` reads offline.
* A directory written by ``Dataset.save_to_disk`` (it holds ``state.json`` and
  ``dataset_info.json``) or ``DatasetDict.save_to_disk`` (it holds ``dataset_dict.json``; pick
  the split with ``DIR@SPLIT``, ``train`` by default) is read with ``datasets.load_from_disk``.

Rows are read in batches of one column, so a dataset larger than memory streams from its
memory-mapped Arrow files. This module knows nothing of :class:`~editrain.data.sources.SourceRef`;
:mod:`editrain.data.sources` turns its results into documents.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from editrain.errors import spelled
from editrain.paths import shown
from editrain.safe_io import read_json_value

from .optional import require

__all__ = [
    "DEFAULT_SPLIT",
    "HF_PREFIX",
    "check_saved_split",
    "check_text_column",
    "hf_label",
    "hf_rows",
    "load_hf",
    "loaded_identity",
    "parse_hf_spec",
    "require_datasets",
    "saved_dataset_kind",
    "saved_split_dir",
]

HF_PREFIX = "hf:"
"""Prefix of a ``data.path`` entry naming a dataset for ``datasets.load_dataset``."""

DEFAULT_SPLIT = "train"
"""Split read when an ``hf:`` spec or a saved ``DatasetDict`` names none."""

_DICT_FILE = "dataset_dict.json"
_DATASET_FILES = ("state.json", "dataset_info.json")
_HF_SPEC_FORMS = "hf:NAME, hf:NAME:CONFIG, hf:NAME@SPLIT or hf:NAME:CONFIG@SPLIT"


def require_datasets(load: bool = True) -> Any:
    """The :mod:`datasets` module (``load=False``: only check that it is installed).

    Raises:
        ImportError: ``datasets`` is missing; the message says ``pip install "editrain[hf]"``.
    """
    return require("datasets", "hf", "reading Hugging Face datasets", load=load)


def parse_hf_spec(entry: str) -> tuple[str, str | None, str]:
    """Split ``hf:NAME[:CONFIG][@SPLIT]`` into its parts.

    The split is taken after the last ``@``, so slices such as ``train[:10%]`` work.

    Args:
        entry: A ``data.path`` entry starting with ``hf:``.

    Returns:
        ``(name, config or None, split)``; the split defaults to ``train``.

    Raises:
        ValueError: An empty part or whitespace (the message starts with ``data.path:``
            and lists the allowed forms).
    """
    body = entry[len(HF_PREFIX):]
    rest, at, split = body.rpartition("@") if "@" in body else (body, "", DEFAULT_SPLIT)
    name, colon, config = rest.partition(":")
    if not name or (colon and not config) or (at and not split) or any(
            c.isspace() for c in body):
        raise ValueError(f"data.path: {shown(entry)} is not a Hugging Face dataset spec; write "
                         f"{_HF_SPEC_FORMS} (e.g. hf:roneneldan/TinyStories@train)")
    return name, config or None, split


def hf_label(name: str, config: str | None, split: str) -> str:
    """The canonical ``hf:NAME[:CONFIG]@SPLIT`` text of a spec (names documents and errors)."""
    return f"{HF_PREFIX}{name}{':' + config if config else ''}@{split}"


def saved_dataset_kind(path: Path) -> str | None:
    """``"dict"`` for a ``DatasetDict.save_to_disk`` directory, ``"dataset"`` for a
    ``Dataset.save_to_disk`` one, None for any other directory (judged by its files)."""
    if (path / _DICT_FILE).is_file():
        return "dict"
    if all((path / name).is_file() for name in _DATASET_FILES):
        return "dataset"
    return None


def check_saved_split(path: Path, kind: str, split: str | None) -> str | None:
    """The split to read from a saved dataset directory.

    Args:
        path: The directory (see :func:`saved_dataset_kind`).
        kind: Its kind, ``"dict"`` or ``"dataset"``.
        split: The ``@SPLIT`` given in ``data.path``, or None.

    Returns:
        For a ``DatasetDict``, the split (``train`` when none was given); for a single
        ``Dataset``, None.

    Raises:
        ValueError: A split given for a single ``Dataset``, or a split the ``DatasetDict``
            lacks (the message lists its splits).
    """
    if kind == "dataset":
        if split is not None:
            raise ValueError(f"data.path: {shown(str(path))} holds a single saved Dataset, which "
                             f"has no splits; drop '@{split}'")
        return None
    try:
        text = (path / _DICT_FILE).read_bytes()
    except OSError as exc:
        raise ValueError(f"data.path: {shown(str(path / _DICT_FILE))} is unreadable ({exc})") from exc
    info = read_json_value(text, f"data.path: {shown(path / _DICT_FILE)}", error=ValueError)
    splits = info.get("splits") if isinstance(info, dict) else None
    if not isinstance(splits, list):
        raise ValueError(f"data.path: {shown(str(path / _DICT_FILE))} is unreadable (no list of "
                         "splits)")
    split = DEFAULT_SPLIT if split is None else split
    if split not in splits:
        raise ValueError(f"data.path: the saved DatasetDict {shown(str(path))} has no split "
                         f"{spelled(split)}; its splits: {', '.join(splits)} (choose with DIR@SPLIT)")
    return split


def saved_split_dir(path: Path, split: str | None) -> Path:
    """The directory of a saved dataset's data: ``path`` itself for a ``Dataset``, the
    subdirectory of ``split`` for a ``DatasetDict`` (``save_to_disk`` writes one per split)."""
    return path / split if split else path


def load_hf(label: str, *, name: str | None = None, config: str | None = None,
            split: str | None = None, saved: Path | None = None) -> Any:
    """Open a dataset: ``saved`` (a save_to_disk directory, plus the DatasetDict ``split``)
    or ``name``/``config``/``split`` for ``datasets.load_dataset``.

    Args:
        label: How ``data.path`` names the source, for errors.
        name: Dataset name or local data directory for ``load_dataset``.
        config: Its configuration, or None.
        split: The split to read.
        saved: A ``save_to_disk`` directory (then ``name``/``config`` are unused).

    Returns:
        A ``datasets.Dataset`` (memory-mapped, nothing read yet).

    Raises:
        ImportError: ``datasets`` is not installed.
        ValueError: The dataset cannot be loaded (not cached and no network, no such
            dataset or config, a broken directory): one line naming ``data.path``.
    """
    datasets = require_datasets()
    try:
        if saved is not None:
            return datasets.load_from_disk(str(saved_split_dir(saved, split)))
        return datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # datasets raises many types; all mean "cannot read this source"
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = ("" if saved is not None else
                 f"; hf: datasets come from the Hugging Face cache "
                 f"({shown(datasets.config.HF_DATASETS_CACHE)}, set by HF_HOME or HF_DATASETS_CACHE) "
                 f"or are downloaded when the Hub is reachable")
        raise ValueError(f"data.path: cannot load {shown(label)} ({type(exc).__name__}: {reason}){where}"
                         ) from exc


def check_text_column(ds: Any, field: str, label: str) -> None:
    """Raise unless ``ds`` has a text column ``field``.

    Raises:
        ValueError: The message starts with ``data.text_field:`` and lists the columns.
    """
    features = ds.features
    if field not in features:
        raise ValueError(f"data.text_field: {shown(label)} has no column {spelled(field)}; its columns: "
                         f"{', '.join(features) or 'none'}")
    if getattr(features[field], "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"data.text_field: column {spelled(field)} of {shown(label)} holds "
                         f"{features[field]}, not text; its columns: {', '.join(features)}")


def hf_rows(ds: Any, field: str, batch_rows: int) -> Iterator[tuple[int, str]]:
    """``(row index, text)`` of every row of ``ds`` whose ``field`` is not null.

    Only that column is read, ``batch_rows`` rows at a time, so memory stays bounded for any
    dataset size; the row index is the one of ``ds[row]``.
    """
    # with_format(None): plain Python strings even if the dataset was saved with a format.
    column = ds.select_columns([field]).with_format(None)
    row = 0
    for batch in column.iter(batch_size=batch_rows):
        for text in batch[field]:
            if text is not None:
                yield row, text
            row += 1


def loaded_identity(ds: Any) -> list:
    """What identifies the contents of a dataset opened by ``load_dataset``, for cache keys.

    Its cache files live in a directory named after the dataset's revision and the hash of
    its data files, so their paths, sizes and mtimes change whenever the data does; the
    dataset's own fingerprint and row count are added (and stand alone for a dataset held
    in memory, which has no cache files). No file is read, so a multi-GB dataset costs
    nothing here.
    """
    files = []
    for entry in ds.cache_files:
        st = os.stat(entry["filename"])
        files.append([entry["filename"], st.st_size, st.st_mtime_ns])
    # ``_fingerprint`` is how datasets itself identifies a dataset's state (it has no
    # public accessor); getattr keeps this working if a release renames it.
    return [getattr(ds, "_fingerprint", None), ds.num_rows, files]
