"""The rules every editrain command line follows, in one place.

* An option is written in full: argparse's default reads a unique prefix (``--over`` for
  ``--overwrite``), so an option added later could turn an old script's prefix ambiguous,
  or into another option. :class:`CommandParser` turns that off; the options editrain
  parses itself (``--section.key``) never took prefixes.
* An option given twice: the last value stands, for every option and spelling
  (``--steps 5 ... --steps 6``, ``--steps 5 --train.steps=6``: 6), so that a script's
  defaults can be followed by the user's own (``editrain train $DEFAULTS "$@"``). A section
  given as a table (``--train={steps=6}``) sets the options it names, as a TOML table does,
  and keeps the others given before it.
* A switch takes no value: argparse refuses ``--json=no`` itself; ``--quiet=false`` and
  ``--overwrite=false`` are the options ``quiet`` and ``overwrite`` given a value.
* An environment variable editrain reads is read strictly too (:func:`env_switch`,
  :func:`env_count`): ``EDITRAIN_BENCH_TINY=false`` used to turn the tiny size on (any
  text but ``0`` did), and an ``OMP_NUM_THREADS`` that was no number was passed over for
  editrain's own choice without a word. A variable is read at the start of the commands
  that use it (:func:`rayon_threads` by ``editrain data`` and ``editrain train``), not
  first deep inside their work. Unset or empty is "not set"; anything else is a
  value or an error naming the variable.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from editrain.errors import ConfigError, spelled_env


class CommandParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that reads options written in full only (see the
    module docstring). Its sub-command parsers (``add_subparsers().add_parser``) are
    CommandParsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                "0": False, "false": False, "no": False, "off": False}
"""The values an on-off environment variable takes (any case)."""

LARGEST_COUNT = 2**31 - 1
"""The largest count an environment variable may give (torch and OpenMP keep thread counts
in a C ``int``)."""


def env_switch(name: str) -> bool:
    """Whether the on-off environment variable ``name`` is on: unset or empty is off.

    Raises:
        ConfigError: naming the variable, for a value not in :data:`SWITCH_WORDS`.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return False
    if text.lower() not in SWITCH_WORDS:
        raise ConfigError(f"{spelled_env(name, text)}: expected 1 or 0 (also true/false, yes/no, "
                          f"on/off), or unset")
    return SWITCH_WORDS[text.lower()]


def env_count(name: str, text: str | None = None, least: int = 1,
              least_means: str = "") -> int | None:
    """The count the environment variable ``name`` gives (``text``: its value, default
    read from the environment); None when it is unset or empty.

    Args:
        least: the smallest count taken (0 where a variable reads 0 as "the default").
        least_means: what ``least`` means, for the message (e.g. `` (rayon's default)``).

    Raises:
        ConfigError: naming the variable, for anything but a whole number from ``least``
            to :data:`LARGEST_COUNT`.
    """
    text = (os.environ.get(name, "") if text is None else text).strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit() and least <= int(text) <= LARGEST_COUNT):
        raise ConfigError(f"{spelled_env(name, text)}: expected a whole number from "
                          f"{least}{least_means} to {LARGEST_COUNT}, or unset")
    return int(text)


RAYON_THREADS = "RAYON_NUM_THREADS"
"""The tokenizer's (rayon's) thread count, which bounds a token cache build's encoder
processes (:func:`editrain.data.encode_pool.pool_workers`)."""


def rayon_threads() -> int | None:
    """The bound :data:`RAYON_THREADS` puts on a token cache build's encoders; None where it
    bounds nothing: unset, empty or 0 (rayon's own default, a thread per CPU).

    The commands that may build a cache (``editrain data``, ``editrain train``) read it at
    their start, as ``OMP_NUM_THREADS`` is read by the job's check, so that junk is refused
    before any work: read only by the build, it was refused minutes into a build (after
    the corpus was read and the tokenizer trained).

    Raises:
        ConfigError: naming the variable, for anything but a whole number from 0 to
            :data:`LARGEST_COUNT`.
    """
    count = env_count(RAYON_THREADS, least=0,
                      least_means=" (rayon's default: a thread per CPU)")
    return count or None


def env_int(name: str, default: int | None = None, minimum: int = 0) -> int:
    """The whole number the environment variable ``name`` holds: a launcher's (torchrun's
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
    editrain's own ``EDITRAIN_FT_*``), or ``default`` when it is unset or empty.

    Raises:
        ConfigError: naming the variable, for anything but a whole number from ``minimum``
            to :data:`LARGEST_COUNT` (a bare ``int()`` said only "invalid literal"), or for
            an unset variable without a default.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        if default is None:
            raise ConfigError(f"{name} is not set; the launcher (torchrun, editrain train) "
                              f"sets it")
        return default
    if not (text.isascii() and text.isdigit() and minimum <= int(text) <= LARGEST_COUNT):
        raise ConfigError(f"{spelled_env(name, text)}: expected a whole number from {minimum} to "
                          f"{LARGEST_COUNT}")
    return int(text)


__all__ = ["LARGEST_COUNT", "RAYON_THREADS", "SWITCH_WORDS", "CommandParser", "env_count",
           "env_int", "env_switch", "rayon_threads"]
