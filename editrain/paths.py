"""The one check of a path a user gives, for every path option of every command.

A path option names what it must be (:data:`KINDS`): a directory editrain writes into
(created if missing), an existing directory it reads, an existing regular file it reads, or
a file it writes. :func:`check_path` looks at the file system once, before any work starts,
and refuses in one line naming the option: a ``--run-dir`` that is a regular file or
``/dev/null``, a directory under a regular file, a directory without write permission, a
``--config`` that is a directory or a device. :func:`check_path_text` is the part that
needs no file system: text that cannot name a file here (a NUL byte, a control character
such as a newline, text that is not valid Unicode), also used for path options whose value
is more than a path (``data.path`` takes ``hf:`` specs and globs too).

Kept import-light (the standard library and :mod:`editrain.errors`): the command line, the
configuration checks, ``editrain plan`` and ``editrain bench`` all call it, and commands
added later should too (``check_path("--out", args.out, "out_dir")``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from editrain.errors import ConfigError, spelled_text

KINDS = ("out_dir", "in_dir", "in_file", "in_path", "out_file")
"""What a path option names: ``out_dir`` a directory editrain creates or writes into,
``in_dir`` an existing directory it reads, ``in_file`` an existing regular file it reads,
``in_path`` either of those two, ``out_file`` a regular file it creates or replaces."""

SHOWN = 500
"""Characters of a path or refused text shown in a message: a path of a deep file system
is a few hundred characters and is shown whole, so that it can be copied from the message;
a longer text (a megabyte given as ``--run-dir``) is cut to its head and its length."""


def shown(text: str | os.PathLike[str]) -> str:
    """``text``, a path or a path option's value, as every message spells it: a TOML
    basic string (:func:`editrain.errors.spelled_text`), the spelling of every other text
    a user gave, cut to :data:`SHOWN` characters.

    One rule whether the path came from the command line or a file: always in double
    quotes, so that a path with spaces, or one that ends in a space, is one delimited
    word; control characters and other characters that do not print escaped (``\\n``,
    ``\\u00a0``), so that the message stays one line (the reason this once was Python's
    ``repr``, whose ``'...'`` is neither TOML nor what a shell reads back for a path
    holding a quote); printable characters of any script as they are. The result pastes
    into a TOML file as it is, and into a shell wherever the path holds no ``$``,
    backquote or ``!``.

    Every refusal that names a path spells it here, also where the path is the subject
    (``"/runs/a b": not a checkpoint``): a path is never shown bare, where a space, a colon
    or a newline in it would make the message ambiguous or break it over lines.
    """
    text = os.fspath(text)
    if len(text) <= SHOWN:
        return spelled_text(text)
    return f"{spelled_text(text[:SHOWN])}... ({len(text)} characters)"


def check_text(option: str, text: str) -> None:
    """Text any string option may hold: valid Unicode (a lone surrogate, what Python makes
    of bytes that are not UTF-8 on the command line, cannot be written to ``config.toml``
    or read back).

    Raises:
        ConfigError: naming the option.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{option}: must be valid Unicode text (it holds bytes that are "
                          f"not UTF-8), got {shown(text)}") from None


def check_path_text(option: str, text: str) -> None:
    """Text a path option may hold: not empty, valid Unicode, and no control characters
    (U+0000 to U+001F and U+007F: a NUL cannot be in a file name, and a newline or escape
    in one would break every one-line message and log that names the file).

    Raises:
        ConfigError: naming the option and the first offending character.
    """
    if not text:
        raise ConfigError(f"{option}: must not be empty")
    check_text(option, text)
    bad = next((c for c in text if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ConfigError(f"{option}: a path may not hold control characters (found "
                          f"U+{ord(bad):04X} in {shown(text)})")


def _what(p: Path) -> str:
    """What ``p`` is, in words, for a refusal (it exists)."""
    mode = p.stat().st_mode
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file or directory"


def _existing_parent(option: str, p: Path) -> Path:
    """The nearest ancestor of ``p`` (or ``p``) that exists; a link to nowhere on the way
    is refused (creating the directories would fail on it)."""
    q = p
    while not q.exists() and q != q.parent:
        if q.is_symlink():
            raise ConfigError(f"{option}: {shown(str(q))} is a link to a path that does "
                              f"not exist")
        q = q.parent
    return q


def check_path(option: str, path: str | os.PathLike[str], kind: str) -> Path:
    """Check a path option before any work starts; returns it with ``~`` expanded.

    Args:
        option: the option as the user wrote it (``--run-dir``, ``data.cache_dir``).
        path: its value.
        kind: one of :data:`KINDS`.

    Raises:
        ConfigError: one line naming the option, the path and what it must be.
    """
    if kind not in KINDS:
        raise ValueError(f"check_path: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    text = os.fspath(path)
    check_path_text(option, text)
    p = Path(text).expanduser()
    name = shown(text)
    try:
        if kind.startswith("in_"):
            if not p.exists():
                what = {"in_file": "file", "in_dir": "directory"}.get(kind, "path")
                raise ConfigError(f"{option}: {what} not found: {name}")
            ok = {"in_dir": p.is_dir(), "in_file": p.is_file()}.get(kind, p.is_dir()
                                                                     or p.is_file())
            if not ok:
                want = {"in_dir": "a directory", "in_file": "a regular file"}.get(
                    kind, "a regular file or a directory")
                raise ConfigError(f"{option}: {name} must be {want}, but it is {_what(p)}")
            if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
                raise ConfigError(f"{option}: {name} is not readable (no permission)")
            return p
        if p.exists():
            if kind == "out_dir" and not p.is_dir():
                raise ConfigError(f"{option}: {name} must be a directory (editrain writes "
                                  f"into it), but it is {_what(p)}")
            if kind == "out_file" and not p.is_file():
                raise ConfigError(f"{option}: {name} must be a regular file (editrain "
                                  f"writes it), but it is {_what(p)}")
            target = p if kind == "out_dir" else p.parent
            if not os.access(target, os.W_OK | os.X_OK):
                raise ConfigError(f"{option}: cannot write into {shown(str(target))} "
                                  f"(no permission)")
            return p
        base = _existing_parent(option, p)
        if not base.is_dir():
            raise ConfigError(f"{option}: cannot create {name}: {shown(str(base))} is "
                              f"{_what(base) if base.exists() else 'missing'}, not a directory")
        if not os.access(base, os.W_OK | os.X_OK):
            raise ConfigError(f"{option}: cannot create {name}: no permission to write "
                              f"into {shown(str(base))}")
        return p
    except OSError as e:  # a name too long, a loop of links, a file system that failed
        raise ConfigError(f"{option}: cannot use {name}: {e.strerror or e}") from None
