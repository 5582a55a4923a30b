"""Command-line options: ``--section.key=value``, ``--section.key value``, shorthands and flags.

:func:`parse_overrides` turns them into the nested dict that
:func:`editrain.config.toml_io.load_config` lays over the TOML file. A value is read as TOML
(numbers, booleans, lists, inline tables), except for a string option, which keeps the text
as typed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from editrain.config.schema import Config
from editrain.config.toml_io import BOOL_WORDS, parse_scalar
from editrain.errors import require

SHORTHANDS = {
    "--steps": "train.steps",
    "--nproc": "dist.nproc",
    "--shard-size": "dist.shard_size",
    "--tp-size": "dist.tp_size",
    "--method": "sync.method",
    "--seed": "train.seed",
    "--run-dir": "run_dir",
    "--resume": "resume",
    "--max-restarts": "dist.max_restarts",
}
"""Short names of frequent options: ``--steps 300`` is ``--train.steps 300``."""
FLAGS: dict[str, str | tuple[str, Any]] = {
    "--quiet": "quiet", "--overwrite": "overwrite",
    "--ft": ("dist.fault_tolerance", "torchft"),
}
"""Flags without a value: the option they set to True, or (option, value)."""


def _option_types(dotted: str) -> tuple[Any, ...]:
    """The types ``dotted`` may hold (those of a union, or the one annotated); empty for a
    name that is no option of :class:`Config`."""
    tp: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return ()
        tp = typing.get_type_hints(tp).get(part)
    if tp is None:
        return ()
    return (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType)
            else (tp,))


def _is_text_option(dotted: str) -> bool:
    """Whether ``dotted`` names a string (or list-of-strings) option of :class:`Config`."""
    args = _option_types(dotted)
    # a number or a word (data.max_bytes: 300000 or auto) takes the number as a number
    return any(a is str or a == list[str] for a in args) and int not in args


def _is_bool_option(dotted: str) -> bool:
    """Whether ``dotted`` names a true-or-false option of :class:`Config`."""
    return bool in _option_types(dotted)


def _is_option(dotted: str) -> bool:
    """Whether ``dotted`` names an option (or section) of :class:`Config`."""
    tp: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp) or part not in typing.get_type_hints(tp):
            return False
        tp = typing.get_type_hints(tp)[part]
    return True


def _looks_like_option(arg: str) -> bool:
    """``--name...``: the next option, never a value (``-1``, ``--8<--`` are values)."""
    return arg.startswith("--") and arg[2:3].isalpha()


def _parse_value(dotted: str, text: str) -> Any:
    """A CLI value for option ``dotted``: TOML, except that a string option keeps the text as
    typed (``--run-dir 2024-01-01`` or ``--sim.link_latency 0.005`` are not a date/number),
    and a true-or-false option reads its words (true, yes, 1; false, no, 0) alike, where
    TOML would make ``1`` a number that no bool takes. The word becomes a bool here, not
    later: callers read the options before the configuration does (``editrain bench``'s
    ``drop_inapplicable``, where the text "false" would read as on). Any other text stays
    text, for the configuration to refuse by name (``none``: unset, where that is allowed)."""
    if _is_bool_option(dotted):
        return BOOL_WORDS.get(text.lower(), text)
    value = parse_scalar(text)
    if not isinstance(value, str | list) and _is_text_option(dotted):
        return text
    if isinstance(value, dict) and _is_section(dotted):
        return _table_words(dotted, value)
    return value


def _table_words(dotted: str, table: dict[str, Any]) -> dict[str, Any]:
    """A section's inline table from the command line (``--model={tie_embeddings=1}``)
    read by the rule of its dotted options (``--model.tie_embeddings=1``): a true-or-false
    option's ``1`` / ``0``, a number in TOML, is its word. One command line, one rule: the
    table refused what the dotted option took. Nested sections are read alike."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        inner = f"{dotted}.{key}"
        if isinstance(value, dict) and _is_section(inner):
            value = _table_words(inner, value)
        elif type(value) is int and _is_bool_option(inner):
            value = BOOL_WORDS.get(str(value), value)
        out[key] = value
    return out


def _is_section(dotted: str) -> bool:
    """Whether ``dotted`` names a section of :class:`Config` (``train``, ``sync.gta``)."""
    return any(dataclasses.is_dataclass(a) for a in _option_types(dotted))


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``raw[a][b][c] = value`` for ``dotted`` = ``a.b.c``; a table given to a section
    is laid over what the section holds (see :func:`_lay_over`)."""
    parts = dotted.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        require(isinstance(node, dict), f"--{dotted}", f"{p} is not a section")
    _lay_over(node, parts[-1], value, dotted)


def _lay_over(node: dict[str, Any], key: str, value: Any, dotted: str) -> None:
    """``node[key] = value``, except that a table given to a section (``--train={steps=6}``)
    sets the options it names and keeps the others given before it, as every option given
    twice keeps its last value: replacing the section dropped them without a word
    (``--train.lr=0.1 --train={steps=6}`` trained at the default rate). A table given to
    an option that holds one (``sync.outer_optim_kwargs``) replaces it."""
    held = node.get(key)
    if not (isinstance(value, dict) and isinstance(held, dict) and _is_section(dotted)):
        node[key] = value
        return
    for name, inner in value.items():
        _lay_over(held, name, inner, f"{dotted}.{name}")


def parse_overrides(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Turn ``--section.key=value`` / ``--section.key value`` / shorthands into a nested dict.

    Returns the nested overrides and the arguments that were not options (positional).

    Raises:
        ConfigError: an option without its value, or a value given to a fixed flag.

    An option given twice (under any of its names: ``--steps``, ``--train.steps``) keeps
    the last value; a section given as a table (``--train={steps=6}``) sets the options it
    names and keeps those given before it (:mod:`editrain.argv`).
    """
    raw: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            rest.append(arg)
            continue
        name, eq, value = arg.partition("=")
        if name in FLAGS and isinstance(FLAGS[name], tuple):
            path, fixed = FLAGS[name]
            _set_path(raw, path, fixed)
            require(not eq, name, f"takes no value (it sets {path}={fixed})")
            continue
        if name in FLAGS:
            _set_path(raw, FLAGS[name], True if not eq else _parse_value(FLAGS[name], value))
            continue
        dotted = SHORTHANDS.get(name, name[2:].replace("-", "_"))
        if not eq:
            # No value follows (the end, or the next option): a misspelt flag says so
            # rather than 'missing value', or taking the next option as its value
            # (`--overwite --steps 5`: 'unexpected argument(s) 5')
            given = i < len(argv) and not _looks_like_option(argv[i])
            require(given or _is_option(dotted), name,
                    "unknown option (`editrain options` lists every option)")
            require(given, name, "missing value")
            value = argv[i]
            i += 1
        _set_path(raw, dotted, _parse_value(dotted, value))
    return raw, rest
