"""Exception types shared across layers, and the one way a configuration check raises one.

Kept import-light for the CLI. Every configuration check, in ``editrain.config`` and in
``editrain.sync.config``, is written as :func:`require` (the option, and what is allowed);
errors of lower layers (``ValueError`` naming the option) become :class:`ConfigError` through
:func:`as_config_error`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

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
