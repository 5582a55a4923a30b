"""Pre-tokenised corpora: token ids already on disk, used without tokenising again.

Three forms are accepted as ``data.path`` (alone, not in a list with text sources):

- a flat ``.bin`` file of ``uint16`` ids (nanoGPT's format, what ``np.array(ids,
  dtype=np.uint16).tofile(path)`` writes): its last tokens become the validation split;
- a ``.npy`` file holding a 1-D integer array (any integer dtype; the header says which):
  split the same way;
- a directory holding nanoGPT's ``train.bin`` and ``val.bin``: the splits as given;
- a ``.parquet`` file or a ``save_to_disk`` dataset directory read with
  ``data.text_field=input_ids``: each row's list of ids is a document, separated as
  ``data.eos`` says, read one batch of rows at a time; its last tokens are held out as for
  a flat file (``pyarrow``, or ``datasets`` for a directory, installed by the extras).

The ids must come from ``data.tokenizer`` (required: it gives the vocabulary, the EOS id and
the tokenizer saved with the run) and lie in ``[0, vocabulary size)``. The form (size a
whole number of ids, dtype, shape) is checked while the options are checked; the ids
themselves while the cache entry is written, in one chunked pass, before any worker starts.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from editrain.paths import shown

from .optional import require

__all__ = ["BIN_DTYPE", "NANOGPT_SPLITS", "TOKEN_SUFFIXES", "TokenFile", "copy_checked",
           "is_token_dir", "open_tokens", "row_ids", "tail_split", "token_files",
           "write_checked"]

BIN_DTYPE = np.dtype(np.uint16)
"""dtype of a ``.bin`` file (nanoGPT writes ``uint16``)."""
TOKEN_SUFFIXES = (".bin", ".npy")
"""Extensions of pre-tokenised files."""
NANOGPT_SPLITS = ("train.bin", "val.bin")
"""Files of a nanoGPT data directory, one per split."""
_COPY_CHUNK = 1 << 24  # ids converted and checked at a time (32 MB of uint16)


class TokenFile:
    """A flat file of token ids, read-only, sliced with plain reads (``os.pread``).

    Slicing (step 1 only) returns a new array holding just that range, so a pass over a
    file of any size holds one chunk in memory. A memory map of the same file would give
    the same values, but every page a pass touches stays in the process's resident set
    until the kernel needs it back: the build's resident memory then grew with the corpus
    (its token files are read whole to copy the splits out and measure the overlap). The
    page cache that reads fill is the kernel's, not the process's.

    Args:
        path: The file.
        dtype: dtype of its ids.
        count: Number of ids (default: from ``start`` to the end of the file).
        start: Index of the file's id that is this object's first.
    """

    def __init__(self, path: str | os.PathLike, dtype, count: int | None = None,
                 start: int = 0) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._fd = -1
        self._fd = os.open(self.path, os.O_RDONLY)
        self._base = int(start) * self.dtype.itemsize
        self._len = ((os.fstat(self._fd).st_size - self._base) // self.dtype.itemsize
                     if count is None else int(count))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("TokenFile: only slices (step 1) can be read")
        start, stop, step = key.indices(self._len)
        if step != 1:
            raise TypeError("TokenFile: only slices (step 1) can be read")
        size = max(0, stop - start) * self.dtype.itemsize
        data = bytearray(size)
        view, offset, got = memoryview(data), self._base + start * self.dtype.itemsize, 0
        while got < size:  # pread may return fewer bytes than asked (never past the end)
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n == 0:
                raise OSError(f"{shown(self.path)}: shorter than {self._len} ids")
            got += n
        return np.frombuffer(data, dtype=self.dtype)

    def close(self) -> None:
        """Close the file (slicing afterwards fails)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> TokenFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_token_dir(path: Path) -> bool:
    """Whether ``path`` is a directory holding nanoGPT's ``train.bin`` and ``val.bin``."""
    return path.is_dir() and all((path / name).is_file() for name in NANOGPT_SPLITS)


def open_tokens(path: Path) -> np.ndarray:
    """Memory-map a pre-tokenised file after checking its form (nothing is read but a
    ``.npy`` header).

    Raises:
        ValueError: naming ``data.path`` and the file: a ``.bin`` whose size is not a whole
            number of ``uint16`` ids, an empty file, or a ``.npy`` that is not a 1-D array
            of integers.
    """
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise ValueError(f"data.path: {shown(str(path))} is not a readable .npy array of "
                             f"token ids ({exc})") from exc
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"data.path: {shown(str(path))} holds a {arr.ndim}-D {arr.dtype} "
                             f"array; a pre-tokenised .npy must be a 1-D array of integer "
                             f"token ids")
    else:
        size = path.stat().st_size
        if size % BIN_DTYPE.itemsize:
            raise ValueError(f"data.path: {shown(str(path))} has {size} bytes, not a whole number "
                             f"of uint16 token ids (a .bin is nanoGPT's flat uint16 file; "
                             f"other dtypes go in a .npy)")
        arr = (np.memmap(path, dtype=BIN_DTYPE, mode="r") if size
               else np.zeros(0, dtype=BIN_DTYPE))
    if len(arr) == 0:
        raise ValueError(f"data.path: {shown(str(path))} holds no token ids")
    return arr


def token_files(path: Path) -> list[Path]:
    """The files of a pre-tokenised source: the file itself, or a directory's splits."""
    return [path / name for name in NANOGPT_SPLITS] if path.is_dir() else [path]


def tail_split(n: int, val_fraction: float, val_tokens: int, max_share: float) -> int:
    """Tokens of a single pre-tokenised file held out at its end: ``max(val_fraction * n,
    val_tokens)``, at most ``max_share`` of the file, at least 1 and at most ``n - 1``.

    Raises:
        ValueError: the file has fewer than 2 ids (nothing to split).
    """
    if n < 2:
        raise ValueError(f"data.path: a pre-tokenised file of {n} token id(s) is too small "
                         f"to split into training and validation")
    want = max(int(np.ceil(val_fraction * n)), int(val_tokens))
    return int(min(max(1, min(want, int(max_share * n))), n - 1))


def row_ids(rows, eos: int | None, policy: str) -> np.ndarray:
    """The ids of a batch of pre-tokenised rows (a pyarrow list array, one document a row)
    as one flat ``int64`` array, ``eos`` placed as ``policy`` says (``"append"``: after
    every row, ``"prepend"``: before it, ``"none"``). Null and empty rows are left out, as
    empty texts are. Vectorised: no Python runs per row or per id."""
    pc = require("pyarrow.compute", "parquet", "reading pre-tokenised rows")
    lengths = pc.fill_null(pc.list_value_length(rows), 0).to_numpy(zero_copy_only=False)
    values = pc.list_flatten(rows).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    lengths = lengths[lengths > 0]  # list_flatten has no ids of null or empty rows either
    if policy == "none" or len(lengths) == 0:
        return values
    ends = np.cumsum(lengths)
    return np.insert(values, ends if policy == "append" else ends - lengths, eos)


def copy_checked(src: np.ndarray, out_path: Path, dtype: np.dtype, vocab_size: int,
                 name: Path) -> int:
    """Write ``src`` (ids) into ``out_path`` as ``dtype``, in chunks, checking that every
    id lies in ``[0, vocab_size)``; return the number of ids written.

    Raises:
        ValueError: naming ``data.path``, the file ``name`` and the id out of range.
    """
    with open(out_path, "wb") as out:
        for start in range(0, len(src), _COPY_CHUNK):
            write_checked(np.asarray(src[start:start + _COPY_CHUNK]), out, dtype, vocab_size,
                          name)
    return len(src)


def write_checked(chunk: np.ndarray, out, dtype: np.dtype, vocab_size: int,
                  name: Path | str) -> None:
    """Append the ids ``chunk`` to the open file ``out`` as ``dtype`` after checking that
    they lie in ``[0, vocab_size)``.

    Raises:
        ValueError: naming ``data.path``, the source ``name`` and the id out of range.
    """
    if not len(chunk):
        return
    low, high = int(chunk.min()), int(chunk.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"data.path: {shown(str(name))} holds token id {bad}, outside the "
                         f"tokenizer's vocabulary [0, {vocab_size}) (data.tokenizer: "
                         f"the ids must come from it)")
    chunk.astype(dtype, copy=False).tofile(out)
