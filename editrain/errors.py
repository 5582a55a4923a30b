"""Exception types shared across layers, and the one way a configuration check raises one.

Kept import-light for the CLI. Every configuration check, in ``editrain.config`` and in
``editrain.sync.config``, is written as :func:`require` (the option, and what is allowed);
errors of lower layers (``ValueError`` naming the option) become :class:`ConfigError` through
:func:`as_config_error`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ConfigError(ValueError):
    """A configuration value (or combination) that cannot work."""


class RunDirError(ConfigError):
    """A run directory this job may not use (another run's, locked by another job)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or incompatible."""


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
