"""Exception types shared across layers, and the one way a configuration check raises one.

Kept import-light for the CLI. Every configuration check, in ``editrain.config`` and in
``editrain.sync.config``, is written as :func:`require` (the option, and what is allowed);
errors of lower layers (``ValueError`` naming the option) become :class:`ConfigError` through
:func:`as_config_error`. The type of a bool, integer or float option, wherever it is set (a
config file, a config dataclass built in Python, ``init_mesh``'s sizes), is checked by
:func:`plain_scalar`, so that one rule has one wording; a count's type and its least
value by :func:`plain_count`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
import shlex
import sys
from collections.abc import Iterator
from typing import Any

LONGEST_WORD = 1000
"""Most characters an error message shows of one word (a run of non-space characters: a
value, a path): a refusal quotes what it refuses, and a value can be megabytes long; a path
of a deep file system is a few hundred."""
LONGEST_MESSAGE = 8000
"""Most characters of an error message (the longest that editrain words is a few hundred,
plus the paths and values it names)."""
_LONG_WORD = re.compile(rf"\S{{{LONGEST_WORD + 1},}}")


def bounded(text: str) -> str:
    """``text`` as an error message shows it: every word longer than :data:`LONGEST_WORD`
    cut to its head and its length, then the whole cut to :data:`LONGEST_MESSAGE` characters
    (idempotent: a message bounded twice, as an exception sent between processes is, reads
    the same)."""
    text = _LONG_WORD.sub(lambda m: f"{m.group()[:LONGEST_WORD - 10]}... "
                                    f"({len(m.group())} characters)", text)
    if len(text) > LONGEST_MESSAGE:
        text = f"{text[:LONGEST_MESSAGE - 40]}... ({len(text)} characters)"
    return text


class ConfigError(ValueError):
    """A configuration value (or combination) that cannot work (its message
    :func:`bounded`)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(bounded(str(message)), *args)


class RunDirError(ConfigError):
    """A run directory this job may not use (another run's, locked by another job)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or incompatible (its message
    :func:`bounded`)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(bounded(str(message)), *args)


def require(cond: bool, option: str, allowed: str) -> None:
    """Raise :class:`ConfigError` ``"OPTION: ALLOWED"`` unless ``cond`` holds.

    Args:
        cond: whether the value is acceptable.
        option: the option's dotted name (``train.lr``), or the setting that is refused
            (``dist.device=cuda``).
        allowed: what is allowed, and the value that was given.
    """
    if not cond:
        raise ConfigError(f"{option}: {allowed}")


def spelled(value: Any) -> str:
    """``value`` as a configuration file writes it, for a message that refuses it: TOML's
    spelling (``true``, ``"x"``, ``2.5``, ``inf``, ``[1, 2]``, ``{lr = 0.7}``), which is
    also JSON's for all but a table and a non-finite number, and ``null`` for ``None``
    (TOML has none; a Python caller reads it as well as a JSON one). Python's own spelling
    (``True``, ``'x'``, ``None``) named a value the user of a file never wrote. An object
    no file holds (a numpy scalar, a tensor: a Python caller's) keeps its ``repr``."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) is int:
        return str(value)
    if type(value) is float:
        return repr(value) if math.isfinite(value) or math.isnan(value) else (
            "inf" if value > 0 else "-inf")
    if type(value) is str:
        return spelled_text(value)
    if type(value) in (list, tuple):
        return "[" + ", ".join(spelled(item) for item in value) + "]"
    if type(value) is dict:
        return "{" + ", ".join(f"{_spelled_key(key)} = {spelled(item)}"
                               for key, item in value.items()) + "}"
    return repr(value)


_TEXT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
                 "\f": "\\f", "\r": "\\r"}
"""The characters a TOML basic string writes with a short escape."""
_NEEDS_A_LOOK = re.compile(r'["\\\x00-\x1f\x7f-\uffff\U00010000-\U0010ffff]')
"""A character :func:`spelled_text` may escape: a quote, a backslash, a control character,
or any character beyond ASCII (kept when printable); plain ASCII is copied as it is, so a
long text is spelled at the speed of ``re.sub``."""


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if char in _TEXT_ESCAPES:
        return _TEXT_ESCAPES[char]
    if char.isprintable():  # a letter, a digit, a symbol of any script: as it is
        return char
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def spelled_text(text: str) -> str:
    r"""``text`` as a TOML basic string, for a message that names it: in double quotes,
    ``"`` and ``\`` escaped, and every character Python does not print (a control
    character, a line or paragraph separator, a space other than U+0020, a format
    character, a lone surrogate) as its escape (``\n``, ``\t``, ``\u00a0``), so that
    the message stays one line and two texts that look alike (a no-break space, a trailing
    tab) are told apart. A printable character of any script is kept as it is: a
    directory named in Greek or Japanese reads as its name, not as a row of ``\uXXXX``.

    This is the spelling of every text a user gave, a string option's value and a path
    alike (:func:`editrain.paths.shown`): it is what a TOML file writes (``data.path =
    "/corpora/my text"`` pastes into one), and pasted into a shell it is the same text
    wherever it holds no ``$``, backquote or ``!``, since the shell's double quotes undo
    ``\"`` and ``\\`` as TOML's do. A shell's own quoting was not taken: its
    ``'it'"'"'s'`` is no TOML, and an unquoted word is none either.
    """
    return '"' + _NEEDS_A_LOOK.sub(_escaped, text) + '"'


def _spelled_key(key: Any) -> str:
    """A table's key as TOML writes it: bare where it may be, else quoted."""
    text = str(key)
    return text if text and re.fullmatch(r"[A-Za-z0-9_-]+", text) else spelled_text(text)


def spelled_option(section: str, key: Any) -> str:
    """The option ``key`` of the section ``section`` (dotted, ``"sync."``; ``""`` at the top
    level) as TOML writes a dotted key and the command line takes it after ``--``:
    ``sync.link_bandwith``, with a key that cannot be bare quoted (``sync."a b"``), so that
    a message names the option as the user wrote it (Python's ``'sync.a b'`` was neither)."""
    return section + _spelled_key(key)


def spelled_env(name: str, text: str, limit: int = 40) -> str:
    """The environment variable ``name`` set to ``text`` as a shell sets it, for a message
    that refuses it: ``RAYON_NUM_THREADS=many``, quoted only where the shell needs it
    (``OMP_NUM_THREADS='2 4'``), a control character escaped as bash's ``$'...'`` writes it
    (one line); at most ``limit`` characters of the value, a longer one followed by its
    length (``RAYON_NUM_THREADS=999...9... (50 characters)``: cut without a word, it read
    as the whole value). Python's ``'many'`` quoted a word the user never quoted."""
    cut = f"... ({len(text)} characters)" if len(text) > limit else ""
    text = text[:limit]
    if text.isprintable():
        return f"{name}={shlex.quote(text)}{cut}"
    escaped = text.encode("unicode_escape").decode("ascii").replace("'", "\\'")
    return f"{name}=$'{escaped}'{cut}"


SCALAR_KINDS: dict[type, tuple[type, str]] = {
    bool: (bool, "true or false"),
    int: (numbers.Integral, "an integer"),
    float: (numbers.Real, "a number"),
}
"""The option types :func:`plain_scalar` checks: the abstract type each accepts (numpy's
integer and float scalars are registered as ``numbers.Integral`` / ``numbers.Real``), and
how it is named."""


def plain_scalar(value: Any, kind: type, option: str) -> Any:
    """``value`` as the plain Python ``bool``, ``int`` or ``float`` an option of type
    ``kind`` holds, or a :class:`ConfigError`.

    Python users pass numpy scalars all the time (``np.arange`` yields ``np.int64``, a
    computed learning rate is often ``np.float32``); they are taken, and stored as plain
    numbers, so that every later use (json state, checkpoints, TOML, the run record,
    comparisons on resume, a mesh's shape and rank lists) sees the type a config file
    gives. A bool is never a number here (``True`` as an interval is a slip, not 1; numpy's
    bools are not taken either), a float is never an integer (``2.0`` divides like 2 but a
    warm-up of 2.5 steps never ends), and an array or tensor is never a scalar, not even
    with zero dimensions: a tensor may live on an accelerator or carry autograd history,
    and converting it here would hide a device sync in a constructor; the message says to
    pass ``.item()``.

    Args:
        value: the option's value (not ``None``).
        kind: ``bool``, ``int`` or ``float``: the option's type.
        option: the option's dotted name, for the message.

    Raises:
        ConfigError: ``"OPTION: expected TYPE, got VALUE"`` (VALUE as a file writes it:
            :func:`spelled`), with what to pass instead for an array or tensor; for a float
            option, an integer too large for a float.
    """
    accepted, name = SCALAR_KINDS[kind]
    if isinstance(value, accepted) and (kind is bool or not isinstance(value, bool)):
        try:
            return kind(value)
        except OverflowError:  # a TOML or Python integer beyond any float (no bound)
            raise ConfigError(f"{option}: expected {name} a float can hold (at most "
                              f"{sys.float_info.max:g}), got {spelled(value)}") from None
    hint = ""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):  # tensor, array
        kind_name = f"{type(value).__module__}.{type(value).__qualname__}"
        hint = f" (a {kind_name}: pass a plain Python value, e.g. value.item())"
    raise ConfigError(f"{option}: expected {name}, got {spelled(value)}{hint}")


def plain_count(value: Any, option: str, least: int = 1) -> int:
    """``value`` as the plain ``int`` a count option holds, at least ``least``, or a
    :class:`ConfigError`: :func:`plain_scalar`'s type rule, then the range in the words
    every count of the configuration uses, so that a size given to a Python entry point
    (``init_mesh``, a pipeline stage, a model config) is refused as the config file's
    option would be.

    Args:
        value: the count (numpy integers taken, stored as ``int``).
        option: the option's dotted name, for the message.
        least: the smallest count allowed.

    Raises:
        ConfigError: ``"OPTION: expected an integer, got VALUE"`` or ``"OPTION: must be >=
            LEAST, got VALUE"``.
    """
    count = plain_scalar(value, int, option)
    require(count >= least, option, f"must be >= {least}, got {count}")
    return count


@contextlib.contextmanager
def as_config_error(*kinds: type[Exception], prefix: str = "") -> Iterator[None]:
    """Re-raise a lower layer's ``ValueError`` (or ``kinds``) as :class:`ConfigError`.

    The lower layers' messages already name the option; ``prefix`` is put before them
    where they do not. A :class:`ConfigError` passes through unchanged.
    """
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, *kinds) as e:
        raise ConfigError(f"{prefix}{e}") from None
