"""TOML in and out: a :class:`Config` from a file and overrides, and a config written as TOML.

:func:`load_config` reads the file, merges the command-line overrides (nested dicts from
:func:`editrain.config.overrides.parse_overrides`) over it, builds the dataclasses with
every key and type checked against the schema, and validates the result.
:func:`dumps_toml` writes what :func:`load_config` reads back (the run directory's
``config.toml``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

from editrain.config.applicability import check_applicable, drop_inapplicable
from editrain.config.inputs import check_list_options, check_text_options, resolve_hub_models
from editrain.config.schema import SECTIONS, Config
from editrain.config.validation import validate
from editrain.errors import ConfigError, plain_scalar, require, spelled, spelled_option
from editrain.paths import check_path, shown


def parse_scalar(text: str) -> Any:
    """Parse a CLI value as TOML (numbers, booleans, lists, inline tables), else a string
    (:func:`editrain.safe_io.parse_toml_scalar`)."""
    from editrain.safe_io import parse_toml_scalar

    return parse_toml_scalar(text)


BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
"""The words a true-or-false option reads (any case), from a file or the command line."""


def _coerce(value: Any, tp: Any, option: str) -> Any:
    """Check/convert ``value`` against a field's annotated type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() == "none"
                             and type(None) in args):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, option)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{option}: bad value {spelled(value)}")
    if tp is bool:
        if isinstance(value, str):
            require(value.lower() in BOOL_WORDS, option,
                    f"expected true or false, got {spelled(value)}")
            return BOOL_WORDS[value.lower()]
        require(isinstance(value, bool), option, f"expected true or false, got {spelled(value)}")
        return value
    if tp is int or tp is float:  # overrides built in Python may hold numpy numbers
        return plain_scalar(value, tp, option)
    if tp is str:
        require(isinstance(value, str), option, f"expected a string, got {spelled(value)}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # "a,b" from the command line; items typed like values
            value = [v if item is str else parse_scalar(v) for v in value.split(",") if v]
        require(isinstance(value, list), option, f"expected a list, got {spelled(value)}")
        return [_coerce(v, item, option) for v in value]
    if (origin is dict or dataclasses.is_dataclass(tp)) and isinstance(value, str) \
            and value.lstrip().startswith("{"):
        raise ConfigError(f"{option}: {_not_a_table(value)}")
    if origin is dict:
        require(isinstance(value, dict), option,
                f"expected a table such as {{lr = 0.7}}, got {spelled(value)}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        require(isinstance(value, dict), option, f"expected a table, got {spelled(value)}")
    return value


def _not_a_table(text: str) -> str:
    """Why ``text``, written as an inline table on the command line, is not one: the TOML
    parser's reason, at a column of ``text`` (not of the line it was parsed in). A command
    line's ``yes`` or an unquoted word is fine as a whole value (``--model.tie_embeddings
    yes``) but not inside a table, where the value is TOML; before, the message only said
    that a table was expected, and showed one."""
    from editrain.safe_io import read_toml_value

    prefix = "v = "
    try:
        read_toml_value(prefix + text, "value", error=ConfigError)
    except ConfigError as e:
        reason = str(e).removeprefix("value: not valid TOML (").removesuffix(")")
        reason = re.sub(r"column (\d+)", lambda m: f"column {int(m[1]) - len(prefix)}", reason)
        return (f"{spelled(text)} is not a TOML inline table ({reason}); inside braces, values are "
                f"TOML: true or false, numbers, quoted text")
    return f"expected a table, got {spelled(text)}"  # parses: as a table it would not be text


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from nested dict ``raw``, validating keys and types."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        option = f"{prefix}{key}"
        check_known_option(cls, key, prefix)
        tp = hints[key]
        value = _coerce(value, tp, option)
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _build(tp, value, option + ".")
        kwargs[key] = value
    return cls(**kwargs)  # SyncConfig and GTAConfig check themselves (ConfigError)


def check_known_option(cls: type, key: str, prefix: str) -> None:
    """Refuse ``key`` unless it is a field of dataclass ``cls`` (the section ``prefix``).

    Raises:
        ConfigError: ``unknown option PREFIX.KEY`` (as TOML writes a dotted key:
            :func:`editrain.errors.spelled_option`), with the section's options.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    if key not in names:
        close = [k for k in names if k.startswith(key[:3])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown option {spelled_option(prefix, key)}{hint}; allowed in "
                          f"[{prefix.rstrip('.') or 'top level'}]: {', '.join(names)}")


def check_option_names(raw: dict[str, Any], cls: type | None = None, prefix: str = "") -> None:
    """Refuse a name in the nested options ``raw`` that is no option of ``cls`` (default
    :class:`Config`), before its values are checked: for a caller that lays ``raw`` over
    other options later (``editrain bench``), where a misspelt option must fail before
    anything is written.

    Raises:
        ConfigError: as :func:`check_known_option`.
    """
    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        check_known_option(cls, key, prefix)
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            check_option_names(value, hints[key], f"{prefix}{key}.")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid over ``base``, table by table (a nested override keeps its siblings)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


CONFIG_MAX_BYTES = 16 << 20
"""The largest ``--config`` file read (a configuration is a few kilobytes)."""
RUN_CONFIG_MAX_BYTES = 1 << 20
"""The largest ``config.toml`` a resumed run's configuration is read from."""


def resumed_run_config(resume: str) -> Path | None:
    """The ``config.toml`` of the run ``--resume`` names (a run directory, or a checkpoint
    in its ``checkpoints/``; a ``--ft`` run's replica group or its checkpoint: the run's),
    or None where there is none."""
    from editrain.rundir import group_index, resumed_run_dir  # no torch yet

    p = Path(resume).expanduser()
    run = resumed_run_dir(p) or p
    if group_index(run) is not None and not (run / "config.toml").is_file():
        run = run.parent  # a --ft run's replica group: the run's configuration is above it
    found = run / "config.toml"
    return found if found.is_file() else None


def load_resumed_config(resume: str, overrides: dict[str, Any]) -> tuple[Config, Path | None]:
    """The configuration of a job that resumes a run without ``--config``: the run's own
    ``config.toml`` (its latest job's: every job writes its own there,
    :func:`editrain.launch.run_dir.prepare_run_dir`; its sections, not its run directory,
    ``resume``, ``overwrite`` or ``quiet``), with ``overrides`` over it, so that
    ``--resume RUN --train.steps 200`` continues that run, with the settings it last ran
    with, rather than a default one. Returns the configuration and the file it came from
    (None: the run has no ``config.toml``, and the defaults stand).

    Raises:
        ConfigError: the file cannot be read as a run's configuration (named with
            ``--resume``).
    """
    from editrain.safe_io import read_toml

    path = resumed_run_config(resume)
    if path is None:
        return load_config(None, overrides), None
    saved = read_toml(path, max_bytes=RUN_CONFIG_MAX_BYTES, option="--resume",
                      where=f"--resume: {shown(str(path))} is not the TOML editrain writes",
                      error=ConfigError, what="run's configuration",
                      hint="; give the run's options with --config")
    sections = {k: v for k, v in saved.items() if k in SECTIONS and isinstance(v, dict)}
    try:  # the run's own, valid by construction under the rules it was written with: an
        # option that did nothing then and is refused now (sync.prefetch_depth of a diloco
        # run, say) is left out, as it changed nothing
        read = {k: v for k, v in to_dict(_build(Config, sections, "")).items() if k in SECTIONS}
        run = to_dict(load_config(None, drop_inapplicable(read)))
    except ConfigError as e:
        raise ConfigError(f"--resume: {shown(str(path))}: {e}") from None
    base = {k: v for k, v in run.items() if k in SECTIONS}
    # sim.fail is a fault of the job that was (it killed a worker once): the resumed job,
    # a new one, fails only where told so again (it died at the same step on every resume)
    base["sim"] = {k: v for k, v in base.get("sim", {}).items() if k != "fail"}
    # What the run set and the options given here make inapplicable goes (pp_microbatches
    # of a run resumed with --dist.pp_size 1, say); what is given here stays, and is
    # refused where it does nothing, as for any job.
    kept = drop_inapplicable(_merge(base, overrides))
    return load_config(None, _merge(kept, overrides)), path


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build a validated :class:`Config` from an optional TOML file and CLI overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        from editrain.safe_io import read_toml

        p = check_path("--config", path, "in_file")
        # the user's file: a link to it is followed (their choice), its size bounded
        raw = read_toml(p, max_bytes=CONFIG_MAX_BYTES, where=f"--config: {shown(str(p))}",
                        option="--config", error=ConfigError, what="configuration",
                        follow=True)
    raw = _merge(raw, overrides or {})
    cfg = _build(Config, raw, "")
    check_text_options(cfg)  # first: a NUL in a path would fail any file check obscurely
    cfg = resolve_hub_models(cfg)  # hf:ORG/NAME: its directory in the hub cache
    validate(cfg)
    check_applicable(cfg)
    check_list_options(cfg)
    return cfg


def to_dict(obj: Any) -> Any:
    """Plain nested dict of a config (None values kept)."""
    return dataclasses.asdict(obj)


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string that reads back equal, in ASCII whatever the text:
    quotes and backslashes escaped, control characters and every non-ASCII character as
    ``\\uXXXX`` / ``\\UXXXXXXXX`` (so ``config.toml`` is the same bytes in any locale).

    Raises:
        ConfigError: a lone surrogate, which no TOML (or UTF-8) file can hold; the
            configuration's checks refuse it first (:mod:`editrain.config.inputs`).
    """
    out = ['"']
    for c in text:
        n = ord(c)
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif 0x20 <= n < 0x7F:
            out.append(c)
        elif 0xD800 <= n <= 0xDFFF:
            raise ConfigError(f"cannot write {shown(text)} as TOML: a lone surrogate "
                              f"(U+{n:04X})")
        elif n <= 0xFFFF:
            out.append(f"\\u{n:04X}")
        else:
            out.append(f"\\U{n:08X}")
    out.append('"')
    return "".join(out)


def toml_key(key: str) -> str:
    """A table key: bare where TOML allows it (letters, digits, ``_`` and ``-``), else
    quoted as :func:`toml_string`."""
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else toml_string(key)


def toml_value(v: Any) -> str:
    """One value written as TOML (``None`` has no TOML form)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(str(k))} = {toml_value(x)}" for k, x in v.items()
                                if x is not None) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def dumps_toml(data: dict[str, Any]) -> str:
    """Serialise a nested dict of plain values as TOML.

    TOML has no null: an option set to ``None`` is written as ``"none"`` (which
    :func:`load_config` reads back as ``None``; omitting it would bring back a non-None
    default such as ``data.max_bytes``). ``None`` inside inline tables is omitted.
    """
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for k, v in data.items():
        if isinstance(v, dict) and k in SECTIONS + ("gta",):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {toml_value('none' if v is None else v)}")

    def emit(name: str, table: dict[str, Any]) -> None:
        lines.append("")
        lines.append(f"[{name}]")
        subs = []
        for k, v in table.items():
            if isinstance(v, dict) and k == "gta":
                subs.append((f"{name}.{k}", v))
            else:
                lines.append(f"{k} = {toml_value('none' if v is None else v)}")
        for sub_name, sub in subs:
            emit(sub_name, sub)

    for name, table in tables:
        emit(name, table)
    return "\n".join(lines).lstrip("\n") + "\n"
