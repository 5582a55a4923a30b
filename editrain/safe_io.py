"""Files of run and checkpoint directories: written without following links, read bounded.

Every file editrain writes in a run directory (``metrics.jsonl``, ``config.toml``, the run
record, ``summary.json``, logs, plots, a checkpoint's marker and rank JSON, the lock, the
simulated link's state, the token cache's files) is opened here:

* :func:`open_write` / :func:`write_atomic` create or open a file with ``O_NOFOLLOW`` (a
  symbolic link where editrain writes is refused, never followed) and only if it is a
  regular file (a FIFO or a device is refused without blocking on it);
* :func:`make_dir` creates the directories editrain writes into and refuses a link or a
  non-directory on the way, from the directory the caller owns (``root``: the run
  directory; the run directory itself may be a link the user made) down.

Every JSON file editrain reads back (a checkpoint's marker and rank state, the run record,
metrics rows, a token cache's ``meta.json``, calibration and bench results) goes through
:func:`read_json`: a regular file (not followed if a link), refused by its size from
``fstat`` before a byte is read, parsed with a bounded nesting depth, then checked against a
schema (:class:`Field` and friends) whose errors name the file and the field and quote at
most :data:`QUOTE_CHARS` characters of a bad value. Every TOML text (``--config``, a run's
``config.toml``, a planner configuration, a command-line value) goes through
:func:`read_toml_value`, with the same bound on its nesting.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from editrain.errors import CheckpointError, RunDirError
from editrain.paths import shown

__all__ = ["MAX_DEPTH", "QUOTE_CHARS", "Bool", "Field", "Int", "List", "Map", "Num", "Obj", "Str",
           "check_no_links", "make_dir", "open_write", "quote", "read_bytes", "read_json",
           "parse_toml_scalar", "read_json_value", "read_toml", "read_toml_value", "regular_size",
           "write_atomic"]

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects (tables) a JSON or TOML file editrain reads may
have (its own are at most a few levels deep)."""
QUOTE_CHARS = 60
"""Most characters of a value that an error message quotes."""

_WRITE_MODES = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "r+": os.O_RDWR,
    "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
    "c+": os.O_RDWR | os.O_CREAT,
}


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``value`` as the JSON text that reads back as it (``true``, ``null``, ``"4"``, not
    Python's ``True``, ``None``, ``'4'``: a refusal quotes what the file says), cut to
    ``limit`` characters: a refusal never echoes an unbounded value (a 50 MB string in a
    file is quoted by its head and its length, a long list by its length).

    Every value this quotes was read from a JSON file (a model's ``config.json``, a
    tokenizer's files, a checkpoint's marker, a token cache's ``meta.json``); a value of a
    TOML file or the command line is quoted in TOML's spelling instead
    (:func:`editrain.errors.spelled`; a path by :func:`editrain.paths.shown`, a TOML
    basic string too).
    """
    if isinstance(value, str) and len(value) > limit:
        return f"{_json_text(value[:limit])}... ({len(value)} characters)"
    text = _json_text(value)
    return text if len(text) <= limit else text[:limit] + "..."


_LONG = 8
"""Most entries of a list or an object that :func:`quote` spells out."""


def _json_text(value: Any) -> str:
    """The JSON text of a parsed value (lists and objects of more than :data:`_LONG`
    entries by their length). A float JSON readers made infinite (``1e400``) is spelled
    ``1e+400``, which reads back as it; NaN, which no JSON number is, as ``NaN`` (what
    Python's reader takes); what no JSON file holds (a caller's own object) by ``repr``."""
    if isinstance(value, (list, tuple, dict)) and len(value) > _LONG:
        return f"a {'object' if isinstance(value, dict) else 'list'} of {len(value)} entries"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_json_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_json_text(str(key))}: {_json_text(item)}"
                               for key, item in value.items()) + "}"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("1e+400" if value > 0 else "-1e+400")
    if value is None or isinstance(value, (bool, int, float, str)):
        return json.dumps(value)  # ASCII, control characters escaped: one line
    return repr(value)


# ---------------------------------------------------------------------------- writing
def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def _below(path: Path, root: Path | None) -> list[Path]:
    """The directories from just below ``root`` down to ``path`` (``path`` included); only
    ``path`` when ``root`` is None or not above it."""
    if root is None:
        return [path]
    try:
        rel = path.relative_to(root)
    except ValueError:
        return [path]
    if rel == Path("."):
        return []
    out, cur = [], root
    for part in rel.parts:
        cur = cur / part
        out.append(cur)
    return out


def check_no_links(path: str | Path, root: str | Path | None = None) -> None:
    """Refuse (:class:`RunDirError`) a symbolic link at ``path`` or at any directory
    between ``root`` (excluded) and it.

    Args:
        path: a file or directory editrain writes.
        root: the directory the caller owns (its run directory); None: ``path`` only.
    """
    path = Path(path)
    for p in _below(path, Path(root) if root is not None else None):
        if _is_link(p):
            raise RunDirError(f"{shown(p)}: is a symbolic link; editrain writes only regular files "
                              "and directories there and never follows a link (remove it)")


def make_dir(path: str | Path, root: str | Path | None = None) -> Path:
    """Create the directory ``path`` (and its missing parents) and check that neither it
    nor any directory between ``root`` and it is a link or something other than a
    directory.

    Args:
        path: the directory.
        root: the directory the caller owns (created if missing, may itself be a link).

    Raises:
        RunDirError: a link or a non-directory on the way (one line naming it).
    """
    path = Path(path)
    base = Path(root) if root is not None else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    chain = _below(path, base)
    if not chain:  # the root itself: the caller's choice, a link or not
        return path
    if base is None or chain[0].parent != base:
        path.parent.mkdir(parents=True, exist_ok=True)  # no root above it: only it checked
    for p in chain:
        try:
            os.mkdir(p)
        except FileExistsError:
            pass
        except OSError as e:
            raise RunDirError(f"{shown(p)}: cannot create the directory ({e.strerror})") from None
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):
            raise RunDirError(f"{shown(p)}: is a symbolic link; editrain writes only into "
                              "directories it finds or creates there, never through a link "
                              "(remove it)")
        if not stat.S_ISDIR(mode):
            raise RunDirError(f"{shown(p)}: is not a directory; editrain writes a directory there "
                              "(move it away)")
    return path


def open_write(path: str | Path, mode: str = "w", *, root: str | Path | None = None,
               binary: bool = False, perm: int = 0o644) -> IO[Any]:
    """Open a file for writing without following a link; only a regular file.

    Args:
        path: the file.
        mode: ``"w"`` (create or truncate), ``"a"`` (create or append), ``"r+"`` (an
            existing file, read and write), ``"a+"`` (create, read, append) or ``"c+"``
            (create if missing, read and write anywhere).
        root: the run directory (directories between it and ``path`` are checked too).
        binary: a binary file object instead of UTF-8 text.
        perm: the permission bits of a new file.

    Raises:
        RunDirError: ``path`` (or a directory on the way) is a link, or not a regular file.
    """
    path = Path(path)
    if root is not None:  # without one, the file itself (O_NOFOLLOW) is all that is checked
        check_no_links(path.parent, root)
    flags = _WRITE_MODES[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, perm)
    except OSError as e:
        if _is_link(path):
            raise RunDirError(f"{shown(path)}: is a symbolic link; editrain writes only regular "
                              "files there and never follows a link (remove it)") from None
        raise RunDirError(f"{shown(path)}: cannot open for writing ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirError(f"{shown(path)}: is not a regular file; editrain writes a regular file "
                          "there (move it away)")
    os.set_blocking(fd, True)
    pymode = {"w": "w", "a": "a", "r+": "r+", "a+": "a+", "c+": "r+"}[mode] + (
        "b" if binary else "")
    return os.fdopen(fd, pymode) if binary else os.fdopen(fd, pymode, encoding="utf-8")


def write_atomic(path: str | Path, data: str | bytes, *, root: str | Path | None = None,
                 fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary file beside it, written
    without following links, then renamed over it). A link at ``path`` is refused, not
    replaced, so that what a user pointed there is reported rather than lost.

    Args:
        path: the file.
        data: its new contents (text is written as UTF-8).
        root: the run directory (see :func:`open_write`).
        fsync: flush the data to the disk before the rename.
    """
    path = Path(path)
    check_no_links(path, root)
    tmp = path.with_name(path.name + ".tmp")
    if _is_link(tmp) or tmp.is_file():
        tmp.unlink()  # a previous writer's leftover; unlinking a link touches no target
    with open_write(tmp, "w", root=root, binary=True) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- reading
def regular_size(path: str | Path, *, error: type[Exception] = CheckpointError,
                 what: str = "file") -> int:
    """The size of ``path`` from ``lstat``, which must be a regular file (a link, a FIFO,
    a directory or a device is refused).

    Args:
        path: the file.
        error: the exception type to raise.
        what: what the file is, for the message.
    """
    try:
        st = os.lstat(path)
    except OSError as e:
        raise error(f"{shown(path)}: cannot read the {what} ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{shown(path)}: the {what} is a symbolic link; editrain reads only regular "
                    "files there")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{shown(path)}: the {what} is not a regular file")
    return st.st_size


def read_bytes(path: str | Path, max_bytes: int, *, error: type[Exception] = CheckpointError,
               what: str = "file") -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, refused by its size before
    anything is read (a link is not followed).

    Args:
        path: the file.
        max_bytes: the largest size accepted.
        error: the exception type to raise.
        what: what the file is, for the message.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if _is_link(Path(path)):
            raise error(f"{shown(path)}: the {what} is a symbolic link; editrain reads only "
                        "regular files there") from None
        raise error(f"{shown(path)}: cannot read the {what} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{shown(path)}: the {what} is not a regular file")
        if st.st_size > max_bytes:
            raise error(f"{shown(path)}: the {what} has {st.st_size} bytes, more than the "
                        f"{max_bytes} it can hold; refusing to read it")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if os.read(fd, 1):  # grew while read: not what fstat said
            raise error(f"{shown(path)}: the {what} changed while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _depth(value: Any) -> int:
    """The nesting depth of parsed JSON or TOML (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def read_json_value(text: str | bytes, where: str, *, error: type[Exception] = CheckpointError,
                    max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text with a bounded nesting depth.

    Args:
        text: the text.
        where: the file (and line) for a message.
        error: the exception type to raise.
        max_depth: the deepest nesting accepted.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{where}: not JSON editrain reads: nested deeper than {max_depth} "
                    "levels") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{where}: not valid JSON ({str(e)[:120]})") from None
    if _depth(value) > max_depth:
        raise error(f"{where}: not JSON editrain reads: nested deeper than {max_depth} levels")
    return value


def read_toml_value(text: str | bytes, where: str, *, error: type[Exception] = CheckpointError,
                    max_depth: int = MAX_DEPTH, hint: str = "") -> dict[str, Any]:
    """Parse TOML text with a bounded nesting depth (``tomllib`` recurses once per level of
    arrays and inline tables: a file nested 100,000 deep would end in a RecursionError).

    Args:
        text: the text (bytes: UTF-8, as TOML is).
        where: what the message names first (the option and the file).
        error: the exception type to raise.
        max_depth: the deepest nesting accepted.
        hint: appended to every message (what to do instead).

    Raises:
        ``error``: one line, ``WHERE: WHY[HINT]``.
    """
    try:
        value = tomllib.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (TOML is; byte {e.start}){hint}") from None
    except RecursionError:
        value = None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where}: not valid TOML ({str(e)[:120]}){hint}") from None
    if value is None or _depth(value) > max_depth:
        raise error(f"{where}: not TOML editrain reads: nested deeper than {max_depth} "
                    f"levels{hint}")
    return value


def read_toml(path: str | Path, *, max_bytes: int, where: str, option: str = "",
              error: type[Exception] = CheckpointError, what: str = "file", hint: str = "",
              follow: bool = False) -> dict[str, Any]:
    """The one reader of every TOML file editrain reads: :func:`read_bytes` (a regular file
    within ``max_bytes``), then :func:`read_toml_value`.

    Args:
        path: the file.
        max_bytes: its largest accepted size.
        where: what a parse error names first (the option and the file).
        option: put before a read error's message (``--config``), when given.
        error: the exception type to raise.
        what: what the file is, for a read error.
        hint: appended to a parse error (what to do instead).
        follow: read through a symbolic link (a file the user named: theirs to link);
            otherwise a link is refused.
    """
    try:
        data = read_bytes(Path(path).resolve() if follow else path, max_bytes, error=error,
                          what=what)
    except error as e:
        if not option:
            raise
        raise error(f"{option}: {e}") from None
    return read_toml_value(data, where, error=error, hint=hint)


def parse_toml_scalar(text: str) -> Any:
    """A command-line value as TOML (a number, a boolean, a list, an inline table), or the
    text itself when it is none (the option's check then says what it takes)."""
    try:
        return read_toml_value(f"v = {text}", "value", error=ValueError)["v"]
    except ValueError:
        return text


def read_json(path: str | Path, *, max_bytes: int, schema: Field | None = None,
              error: type[Exception] = CheckpointError, what: str = "file") -> Any:
    """The one reader of every JSON file editrain reads back (see the module docstring).

    Args:
        path: the file.
        max_bytes: its largest accepted size (checked from ``fstat`` before reading).
        schema: what the value must be (:class:`Obj`, ...); None: any JSON.
        error: the exception type to raise.
        what: what the file is, for the message.

    Raises:
        ``error``: one line naming the file (and the field) and what is wrong.
    """
    data = read_bytes(path, max_bytes, error=error, what=what)
    where = shown(path)
    value = read_json_value(data, where, error=error)
    if schema is not None:
        schema.check(value, where, "", error)
    return value


# ---------------------------------------------------------------------------- schemas
class Field:
    """A schema for one JSON value: :meth:`check` raises naming the file and the field.

    Args:
        nullable: whether ``null`` is accepted.
    """

    def __init__(self, nullable: bool = False) -> None:
        self.nullable = nullable

    def check(self, value: Any, where: str, field: str, error: type[Exception]) -> None:
        """Raise ``error`` unless ``value`` fits.

        Args:
            value: the parsed value.
            where: the file.
            field: the dotted field name ("" for the whole file).
            error: the exception type.
        """
        if value is None and self.nullable:
            return
        problem = self.problem(value)
        if problem:
            name = f"field {field!r}" if field else "its contents"
            raise error(f"{where}: {name}: {problem} (found {quote(value)})")
        self.check_inside(value, where, field, error)

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` itself, or None."""
        return None

    def check_inside(self, value: Any, where: str, field: str, error: type[Exception]) -> None:
        """Check the members of a container."""


class Int(Field):
    """An integer (never a bool, a float or a string) in ``[lo, hi]``."""

    def __init__(self, lo: int = 0, hi: int = 2**53, nullable: bool = False) -> None:
        super().__init__(nullable)
        self.lo, self.hi = lo, hi

    def problem(self, value: Any) -> str | None:
        if type(value) is not int or not self.lo <= value <= self.hi:
            return f"an integer from {self.lo} to {self.hi} is expected"
        return None


class Num(Field):
    """A finite number (int or float, not a bool) in ``[lo, hi]``."""

    def __init__(self, lo: float = 0.0, hi: float = 1e18, nullable: bool = False) -> None:
        super().__init__(nullable)
        self.lo, self.hi = lo, hi

    def problem(self, value: Any) -> str | None:
        if (type(value) not in (int, float) or not math.isfinite(value)
                or not self.lo <= value <= self.hi):
            return f"a finite number from {self.lo:g} to {self.hi:g} is expected"
        return None


class Bool(Field):
    """``true`` or ``false``."""

    def problem(self, value: Any) -> str | None:
        return None if type(value) is bool else "true or false is expected"


class Str(Field):
    """A string of at most ``max_len`` characters (optionally passing ``ok``)."""

    def __init__(self, max_len: int = 4096, nullable: bool = False,
                 ok: Callable[[str], bool] | None = None, expect: str = "") -> None:
        super().__init__(nullable)
        self.max_len, self.ok, self.expect = max_len, ok, expect

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, str) or len(value) > self.max_len:
            return f"a string of at most {self.max_len} characters is expected"
        if self.ok is not None and not self.ok(value):
            return self.expect or "not an accepted value"
        return None


class List(Field):
    """A list of at most ``max_len`` items, each fitting ``item`` (exactly ``length`` items
    when given)."""

    def __init__(self, item: Field | None = None, max_len: int = 1 << 20,
                 nullable: bool = False, length: int | None = None) -> None:
        super().__init__(nullable)
        self.item, self.max_len, self.length = item, max_len, length

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, list):
            return "a list is expected"
        if self.length is not None and len(value) != self.length:
            return f"a list of {self.length} items is expected"
        if len(value) > self.max_len:
            return f"a list of at most {self.max_len} items is expected"
        return None

    def check_inside(self, value: Any, where: str, field: str, error: type[Exception]) -> None:
        if self.item is not None:
            for i, v in enumerate(value):
                self.item.check(v, where, f"{field}[{i}]", error)


class Obj(Field):
    """A JSON object: ``fields`` (name -> schema) are checked where present, ``required``
    must be present; other keys are allowed (an older or newer editrain's) unless
    ``closed``.
    """

    def __init__(self, fields: Mapping[str, Field] | None = None, required: tuple[str, ...] = (),
                 nullable: bool = False, closed: bool = False) -> None:
        super().__init__(nullable)
        self.fields, self.required, self.closed = dict(fields or {}), required, closed

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, dict):
            return "a JSON object is expected"
        return None

    def check_inside(self, value: Any, where: str, field: str, error: type[Exception]) -> None:
        prefix = f"{field}." if field else ""
        for name in self.required:
            if name not in value:
                raise error(f"{where}: field {prefix + name!r} is missing")
        for name, v in value.items():
            schema = self.fields.get(name)
            if schema is not None:
                schema.check(v, where, prefix + name, error)
            elif self.closed:
                raise error(f"{where}: unexpected field {quote(prefix + name)}")


class Map(Field):
    """A JSON object used as a table (its keys are data: a corpus's kinds, a file's
    names): at most ``max_len`` keys, each value fitting ``value``."""

    def __init__(self, value: Field, max_len: int = 1 << 16, nullable: bool = False) -> None:
        super().__init__(nullable)
        self.value, self.max_len = value, max_len

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, dict) or len(value) > self.max_len:
            return f"a JSON object of at most {self.max_len} entries is expected"
        return None

    def check_inside(self, value: Any, where: str, field: str, error: type[Exception]) -> None:
        prefix = f"{field}." if field else ""
        for name, v in value.items():
            self.value.check(v, where, prefix + name, error)


def cut_partial_line(path: str | Path, *, root: str | Path | None = None) -> None:
    """Cut off a last line without its newline (a writer killed mid-row) from an existing
    JSON-lines file, so that the next row appended does not fuse with it; reads only the
    file's tail.

    Args:
        path: the file (nothing happens if it does not exist).
        root: the run directory (see :func:`open_write`).
    """
    path = Path(path)
    if not os.path.lexists(path):
        return
    with open_write(path, "r+", root=root, binary=True) as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:  # back to the last newline, a chunk at a time
            start = max(0, pos - (1 << 16))
            f.seek(start)
            cut = f.read(pos - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)
