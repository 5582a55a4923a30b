"""Benchmark sizes, the training options every run shares, and the bench command line.

Sizes. Every scenario has three:

* ``tiny``: smoke-test settings (a handful of steps, one seed, one repeat, fewer variants),
  used by ``tests/test_bench.py``; ``--tiny`` on the command line or
  ``EDITRAIN_BENCH_TINY=1``.
* ``quick`` (``--quick``): the tiny model preset on ~1.5 MB of the default corpus, a few
  minutes per scenario on 2 cores, 3 interleaved repeats where timings are compared.
* ``full``: the small preset on the default corpus size (``convergence``: the tiny preset
  for 2,000 steps), 5 interleaved repeats; takes much longer.

Topology. Training runs use 2 replicas x 1 shard (``dist.nproc=2``, ``dist.shard_size=1``):
one process per core on the 2-core reference machine, so wall-clock numbers are not
distorted by two processes sharing one core. Any option can be overridden for every run of
a scenario by appending it to the command, e.g. ``editrain bench convergence --quick
--dist.nproc 4 --dist.shard_size 2``; the overrides are recorded in ``results.json``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from editrain.config import ConfigError, parse_overrides
from editrain.config.toml_io import check_option_names
from editrain.errors import spelled

MODES = ("tiny", "quick", "full")
"""The benchmark sizes, smallest first."""

REPEATS = {"tiny": 1, "quick": 3, "full": 5}
"""Interleaved repeats of every timed run, per size (``--repeats N`` overrides)."""

DEFAULT_ROOT = Path("bench_results")
"""Where results go without ``--out``: one sub-directory per scenario."""

SIZE_FLAGS = {"--tiny": "tiny", "--full": "full"}
"""Bench flags without a value: a size (``--quick`` is the CLI's own flag; no size flag
means the full size)."""

SWITCH_FLAGS = {"--reuse": "reuse"}
"""Bench flags without a value that are not sizes: ``--reuse`` (convergence, tune, scale,
batch: read back the finished runs of an earlier invocation into the same ``--out`` whose
options are this invocation's, instead of running them again)."""

VALUE_FLAGS = {"--seeds": int, "--repeats": int, "--path": str, "--readme": str,
               "--links": str, "--methods": str, "--shapes": str}
"""Bench flags with a value, and the value's type: ``--seeds N`` (convergence, optimizers),
``--repeats N`` (timed scenarios), ``--links A,B`` (bandwidth: a subset of its links),
``--methods A,B`` (convergence: a subset of its variants), ``--shapes A,B`` (scale, batch: a
subset of the model shapes), ``--path FILE`` and ``--readme FILE`` (report). Everything else
is a training option."""


def base_overrides(mode: str) -> dict[str, Any]:
    """Training options shared by every run of every scenario in ``mode`` (``tiny``,
    ``quick`` or ``full``), as a nested dict; ValueError for another mode."""
    if mode not in MODES:
        raise ValueError(f"unknown benchmark mode {spelled(mode)}; allowed: {', '.join(MODES)}")
    small_data = {"max_bytes": 1_500_000, "vocab_size": 2048, "val_fraction": 0.03}
    eval_tokens = 2048 if mode == "tiny" else 0
    return {
        "model": {"preset": "small" if mode == "full" else "tiny"},
        "data": {} if mode == "full" else small_data,
        # Evaluations cover the whole validation split, except at the smoke-test size.
        "train": {"batch_size": 8, "seq_len": 64, "eval_tokens": eval_tokens,
                  "final_eval_tokens": eval_tokens},
        "dist": {"nproc": 2, "shard_size": 1},
        "checkpoint": {"final": False, "every": 0},
    }


def timed_train(steps: int) -> dict[str, Any]:
    """The ``train`` options of a timed run of ``steps`` steps: one evaluation, at the end
    (outside every measured window), and a learning-rate warm-up of a quarter of the run
    (at most 10 steps)."""
    return {"steps": steps, "eval_every": steps, "warmup_steps": min(10, steps // 4)}


def merge(*layers: dict[str, Any] | None) -> dict[str, Any]:
    """Deep merge of nested option dicts (None skipped); later layers win. A new dict: the
    inputs are not changed."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in (layer or {}).items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = merge(out[k], v)
            else:
                out[k] = v
    return out


def split_extra(extra: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split the arguments after ``editrain bench SCENARIO [--quick] [--out DIR]`` into
    bench flags (:data:`SIZE_FLAGS`, :data:`SWITCH_FLAGS`, :data:`VALUE_FLAGS`) and the
    training options applied to every run (``--section.key=value``): ``(flags, overrides)``.

    Raises:
        ConfigError: an argument that is neither, a missing value, a value given to a flag
            that takes none (``--tiny=0``), or a count below 1. A flag given twice keeps
            its last value, as every option does (:mod:`editrain.argv`).
    """
    flags: dict[str, Any] = {}
    rest: list[str] = []
    args = iter(extra)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in SIZE_FLAGS or name in SWITCH_FLAGS:
            if eq:  # `--tiny=0` must not turn the tiny size on
                raise ConfigError(f"bench {name}: takes no value, got {spelled(arg)}; leave it out "
                                  f"or give it alone")
            flags[SIZE_FLAGS.get(name) or SWITCH_FLAGS[name]] = True
        elif name in VALUE_FLAGS:
            if not eq and (value := next(args, None)) is None:
                raise ConfigError(f"bench {name}: missing value")
            flags[name[2:]] = _flag_value(name, value)
        else:
            rest.append(arg)
    overrides, positional = parse_overrides(rest)
    if positional:
        raise ConfigError(f"bench: unexpected argument(s) {' '.join(positional)}; training "
                          "options look like --train.steps=100")
    # Every run's options are checked before its run, but a misspelt option (a misspelt
    # bench flag: `--repe 2`) must fail before the results directory is made.
    check_option_names(overrides)
    return flags, overrides


def seed_count(bench: Any, tiny: int, quick: int, full: int) -> int:
    """A scenario's seeds: ``--seeds N``, else ``tiny``, ``quick`` or ``full`` by the bench's
    size (``bench``: the :class:`~editrain.bench.runner.Bench`)."""
    return int(bench.flags.get("seeds") or bench.pick(tiny, quick, full))


def pick_names(value: str, allowed: Sequence[str], flag: str, what: str) -> list[str]:
    """The names a comma-separated flag value picks, in ``allowed``'s order.

    Raises:
        ConfigError: ``bench FLAG: unknown WHAT(s) ...; allowed: ...`` for a name not in
            ``allowed`` or an empty list.
    """
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ConfigError(f"bench {flag}: unknown {what}(s) {', '.join(unknown) or '(none)'}"
                          f"; allowed: {', '.join(allowed)}")
    return [n for n in allowed if n in names]


def _flag_value(name: str, value: str) -> Any:
    """A bench flag's value converted to its type (counts must be >= 1)."""
    if VALUE_FLAGS[name] is str:
        return value
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"bench {name}: expected an integer, got {spelled(value)}") from None
    if number < 1:
        raise ConfigError(f"bench {name}: must be >= 1, got {number}")
    return number


def command_line(scenario: str, quick: bool, out_dir: str | None, extra: Sequence[str]) -> str:
    """The ``editrain bench`` command equivalent to a call of ``run_scenario`` (``extra``:
    the further arguments as given; ``out_dir`` None: no ``--out``)."""
    argv = ["editrain", "bench", scenario]
    if quick:
        argv.append("--quick")
    if out_dir is not None:
        argv += ["--out", str(out_dir)]
    return shlex.join(argv + list(extra))


__all__ = ["DEFAULT_ROOT", "MODES", "REPEATS", "SIZE_FLAGS", "VALUE_FLAGS", "base_overrides",
           "command_line", "merge", "pick_names", "seed_count", "split_extra", "timed_train"]
