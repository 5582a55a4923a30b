"""Checks of what a user typed that span the whole configuration: text, paths and lists.

* :func:`check_text_options`: every string of the configuration (every option, list entry
  and table key or value) is text that ``config.toml``, the run record and
  ``metrics.jsonl`` can hold and give back equal (valid Unicode), and the path options
  hold no control characters (:func:`editrain.paths.check_path_text`);
* :func:`check_list_options`: the entries of a list option do not contradict each other
  (two stragglers on one replica's same steps, two corruptions at one sync, one source
  twice);
* :func:`check_path_options`: every path option is what it must be on the file system
  (:func:`editrain.paths.check_path`), for the commands that use the configuration.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from editrain.config.schema import Config
from editrain.errors import as_config_error, require, spelled
from editrain.paths import check_path, check_path_text, check_text, shown
from editrain.sim import parse_sim

PATH_OPTIONS: dict[str, str] = {
    "run_dir": "out_dir",
    "resume": "in_dir",
    "data.cache_dir": "out_dir",
    "data.tokenizer": "in_path",
    "model.hf_config": "in_file",
    "model.init_from": "in_dir",
}
"""The configuration's path options and what each must be (:data:`editrain.paths.KINDS`);
``data.path`` also takes ``hf:`` specs and globs, so only its text is checked here (its
sources are checked by :func:`editrain.data.check_data_options`)."""

SHOWN_AS = {"run_dir": "--run-dir", "resume": "--resume"}
"""Options named as their command-line shorthand in messages."""


HUB_OPTIONS = ("model.init_from", "data.tokenizer", "model.hf_config")
"""The options that also take ``hf:ORG/NAME[@REVISION]``, a model of the Hugging Face hub
cache (:func:`editrain.models.hf_dir.hub_snapshot`): its snapshot directory, or for
``model.hf_config`` (a file) that directory's ``config.json``."""


def resolve_hub_models(cfg: Config) -> Config:
    """``cfg`` with every ``hf:ORG/NAME[@REVISION]`` of :data:`HUB_OPTIONS` replaced by the
    snapshot directory of the hub cache it names (the run then records that directory, so
    a resume reads the same files)."""
    from editrain.models.hf_dir import HUB_PREFIX, hub_snapshot

    for option in HUB_OPTIONS:
        section, key = option.split(".")
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, str) and value.startswith(HUB_PREFIX):
            with as_config_error():
                path = hub_snapshot(value, option)
            if option == "model.hf_config":
                path = str(Path(path) / "config.json")
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(
                getattr(cfg, section), **{key: path})})
    return cfg


def _walk(value: Any, option: str):
    """Every string inside ``value`` (dataclasses, lists, table keys and values), with the
    name of where it is."""
    if isinstance(value, str):
        yield option, value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{option}.{f.name}" if option else f.name)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(k, f"{option} (a key)")
            yield from _walk(v, f"{option}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _walk(v, f"{option}[{i}]")


def check_text_options(cfg: Config) -> None:
    """Every string of ``cfg`` is valid Unicode, and path options hold no control
    characters (see the module docstring).

    Raises:
        ConfigError: naming the option (``data.path[1]`` for a list entry).
    """
    for option, text in _walk(cfg, ""):
        base = option.split("[")[0]
        name = SHOWN_AS.get(base, option)
        if base in PATH_OPTIONS or base == "data.path":
            check_path_text(name, text)
        else:
            check_text(name, text)


def check_list_options(cfg: Config) -> None:
    """Entries of one list option that contradict each other are refused: a replica slowed
    twice over the same steps (``sim.straggler``), a sync corrupted twice
    (``sim.corrupt_replica``: one replica per sync), a ``data.path`` source listed twice,
    or a file inside a directory also listed (its documents would be read twice).

    Raises:
        ConfigError: naming the option and both entries.
    """
    s = cfg.sim
    with as_config_error():
        plan = parse_sim(s)
    for i, a in enumerate(plan.stragglers):
        for j in range(i):
            b = plan.stragglers[j]
            a_end = float("inf") if a.stop is None else a.stop
            b_end = float("inf") if b.stop is None else b.stop
            require(a.replica != b.replica or a.start >= b_end or b.start >= a_end,
                    "sim.straggler",
                    f"entries {spelled(s.straggler[j])} and {spelled(s.straggler[i])} "
                    f"both slow replica {a.replica} over the same steps; give each replica "
                    f"one factor per range of steps")
    seen: dict[int, str] = {}
    for spec in s.corrupt_replica:
        sync = int(spec.strip().split("@")[1].split(":")[0])
        require(sync not in seen, "sim.corrupt_replica",
                f"entries {spelled(seen.get(sync))} and {spelled(spec)} both corrupt sync "
                f"{sync}; one replica per sync")
        seen[sync] = spec
    if isinstance(cfg.data.path, list):
        seen: list[tuple[int, str, Path | None]] = []
        for i, entry in enumerate(cfg.data.path):
            here = _on_disk(entry)
            for j, other, there in seen:
                same = entry == other or (here is not None and there is not None and (
                    here == there or here.is_relative_to(there) or there.is_relative_to(here)))
                require(not same, f"data.path[{i}]",
                        f"{shown(entry)} reads documents data.path[{j}] ({shown(other)}) "
                        f"reads too: each document would be read twice")
            seen.append((i, entry, here))


def _on_disk(entry: str) -> Path | None:
    """A ``data.path`` entry that names a file or directory, resolved (links followed);
    None for ``default``, ``hf:`` specs, globs and what does not exist."""
    if entry == "default" or entry.startswith("hf:") or any(c in entry for c in "*?["):
        return None
    path = Path(entry.split("@")[0]).expanduser()
    return path.resolve() if path.exists() else None


def check_path_options(cfg: Config, skip: tuple[str, ...] = ()) -> None:
    """Every path option of ``cfg`` that is set (but ``skip``) is what it must be on the
    file system (:data:`PATH_OPTIONS`); run before any work by the commands that take a
    configuration.

    Raises:
        ConfigError: one line naming the option.
    """
    for option, kind in PATH_OPTIONS.items():
        if option in skip:
            continue
        node: Any = cfg
        for part in option.split("."):
            node = getattr(node, part, None)
        if node is not None:
            check_path(SHOWN_AS.get(option, option), node, kind)
