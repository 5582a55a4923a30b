"""Generate ``docs/configuration.md`` from the configuration dataclasses.

Every option, its type, default and help text come from :func:`editrain.config.describe_options`
(the one-line docstrings under the fields), the per-method defaults from
:data:`editrain.sync.methods.METHOD_DEFAULTS`, so the page cannot drift from the code.
Regenerate it with::

    python -m editrain.docs            # writes docs/configuration.md
    python -m editrain.docs --check    # exit status 1 if the committed page is out of date
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

from editrain.argv import CommandParser
from editrain.config import (
    Config,
    ConfigError,
    describe_options,
    load_config,
    parse_overrides,
    toml_value,
    validate_world,
)
from editrain.sync.config import METHODS, GTAConfig
from editrain.sync.methods import METHOD_DEFAULTS, SYNC_OPTION_METHODS

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

USED_BY: dict[str, tuple[str, ...]] = {
    **{f"sync.{k}": v for k, v in SYNC_OPTION_METHODS.items() if k not in ("method", "gta")},
    **{f"sync.gta.{f.name}": SYNC_OPTION_METHODS["gta"] for f in dataclasses.fields(GTAConfig)},
    "sim.step_schedule": SYNC_OPTION_METHODS["local_sgd_sync_time"],
    "sim.corrupt_replica": SYNC_OPTION_METHODS["gta"],
}
"""The methods that read each ``sync.*`` option (but ``sync.method``) and each method-bound
option of another section: the applicability table's
(:mod:`editrain.config.applicability`, which refuses such an option set under another
method), so the reference and the checks cannot disagree."""


def used_by(option: str) -> tuple[str, ...]:
    """The methods that read ``option``.

    Args:
        option: a dotted option name such as ``"sync.prefetch_depth"``.
    """
    return USED_BY.get(option, METHODS)


def _value(v: Any) -> str:
    """A default as it would be written in TOML (``none`` for None)."""
    return "none" if v is None else toml_value(v)


def _default(option: str, default: Any) -> str:
    """The default, spelled out per method when the method decides it."""
    name = option.removeprefix("sync.")
    if not option.startswith("sync.") or default is not None:
        return f"`{_value(default)}`"
    by_value: dict[str, list[str]] = {}
    for method in used_by(option):
        if name in METHOD_DEFAULTS[method]:
            by_value.setdefault(_value(METHOD_DEFAULTS[method][name]), []).append(method)
    if not by_value:
        return f"`{_value(default)}`"
    return "per method: " + "; ".join(f"`{v}` ({', '.join(ms)})" for v, ms in by_value.items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section_titles() -> dict[str, str]:
    """Section prefix -> the first line of its dataclass docstring."""
    out = {"": "Run-level options."}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                out[prefix + f.name] = (tp.__doc__ or "").strip().splitlines()[0]
                walk(tp, prefix + f.name + ".")

    walk(Config, "")
    return out


BAD_INPUTS = (
    "--train.lr=inf", "--train.lr=0", "--train.steps=0", "--train.precision=fp8",
    "--train.seq_len=100000", "--optim.name=lion", "--model.preset=huge",
    "--dist.shard_size=0", "--dist.backend=mpi", "--dist.comm_backend=mpi",
    "--data.eos=maybe", "--data.vocab_size=100", "--sync.method=fedavg",
    "--sync.outer_optim_class=os.system", "--sync.outer_optim_kwargs={lr=-1}",
    "--sync.outer_optim_kwargs={bogus=1}", "--sync.gta.density=0",
    "--sync.ewma_threshold=-inf", "--sync.fragments=0", "--sync.comm_dtype=fp8",
    "--sim.straggler=1:2", "--checkpoint.keep=0", "--dist.fault_tolerance=always",
    "--train.seed=-1", "--train.seed=9223372036854775808",
    "--train.batch_size=99999999999999999999", "--sync.outer_optim_kwargs={lr=nan}",
    "--sync.outer_optim_kwargs={momentum=1.5}", "--sync.outer_optim_class=mymodule.MyOptimizer",
    "--sim.straggler=1=1e999", "--sim.link_latency=1e999s", "--sim.link_bandwidth=1e999MB/s",
    "--sim.random_stall=0.5,1e9", "--sim.fail=9@5", "--sim.fail=1@1000",
    "--model.preset=tiny --sync.fragments=4", "--sync.topk_k=8",
    "--sync.comm_dtype=topk2 --sync.topk_k=5000",
)
"""Bad inputs whose messages ``docs/configuration.md`` lists (produced by the validation
itself, so the page cannot drift from the code). An entry may hold several arguments,
separated by spaces."""


def bad_input_messages() -> list[tuple[str, str]]:
    """``(argument, the one-line error)`` for every entry of :data:`BAD_INPUTS`: the checks
    of :func:`~editrain.config.load_config`, then those that need the world size
    (:func:`~editrain.config.validate_world` with ``dist.nproc`` workers), as ``editrain
    train`` runs them before it reads the corpus."""
    out = []
    for arg in BAD_INPUTS:
        try:
            overrides, _ = parse_overrides(arg.split())
            cfg = load_config(None, overrides)
            validate_world(cfg, cfg.dist.nproc)
        except ConfigError as e:
            out.append((arg, str(e)))
        else:
            raise AssertionError(f"{arg} was accepted")
    return out


def render_configuration() -> str:
    """The Markdown text of ``docs/configuration.md``.

    Returns:
        The page, ending with a newline.
    """
    titles = _section_titles()
    groups: dict[str, list[tuple[str, str, Any, str]]] = {}
    for row in describe_options():
        groups.setdefault(row[0].rpartition(".")[0], []).append(row)
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m editrain.docs` from the config dataclasses; do not edit."
        " -->",
        "",
        "Every option can be set in a TOML file (`editrain train --config run.toml`, one table",
        "per section) or on the command line as `--section.key=value`; `editrain options`",
        "prints the same list. Options under `sync` keep the names of the EDiT reference",
        "implementation. A default of `none` on a `sync` option means the method decides: the",
        "per-method values are listed. *Methods* names the methods that read the option.",
        "",
        "On the command line every option is written in full (no prefix stands for it:",
        "`--over` is not `--overwrite`). An option given twice keeps its last value, under",
        "any of its names (`--steps 5 --train.steps=6` trains 6 steps), so a script's defaults",
        "can be followed by the user's own; a section given as a table (`--train={steps=6}`)",
        "sets the options it names and keeps the others. A true-or-false option given on the",
        "command line reads `true`/`false`, `yes`/`no` and `1`/`0` (any case), inside a",
        "section's table too (`--model={tie_embeddings=1}` is `--model.tie_embeddings=1`).",
        "",
        "Example files to start from, each loaded and checked by `tests/test_example_configs.py`:",
        "`examples/configs/default.toml` (every main option at its default),",
        "`slow_link.toml` (streaming EDiT over a simulated slow link), `very_slow_link.toml`",
        "(sparse 2-bit pseudo-gradients behind almost a whole round), `stragglers.toml`",
        "(A-EDiT with a simulated straggler), `fault_tolerant.toml` (`dist.fault_tolerance =",
        "torchft`), `tensor_parallel.toml` (`dist.tp_size = 2`) and `recipe.toml` (the",
        "settings that closed EDiT's gap to synchronous training in `editrain bench tune`).",
        "",
        "Regenerate this page with `python -m editrain.docs` after changing a config class",
        "(`tests/test_docs.py` fails while it is out of date).",
    ]
    order = sorted(groups, key=lambda p: (p == "", list(titles).index(p) if p in titles else 0))
    for prefix in order:
        lines += ["", f"## `[{prefix}]`" if prefix else "## Top level", "",
                  titles.get(prefix, ""), "",
                  "| option | type | default | methods | meaning |",
                  "| --- | --- | --- | --- | --- |"]
        for option, tp, default, doc in groups[prefix]:
            methods = used_by(option)
            who = "all" if methods == METHODS else ", ".join(methods)
            lines.append(f"| `{option}` | `{_cell(tp)}` | {_cell(_default(option, default))} "
                         f"| {who} | {_cell(doc)} |")
    lines += ["", "## Bad input", "",
              "Every value is checked before any process starts, each section by its own checks",
              "(`editrain/config/validation.py`; `sync` by `SyncConfig` itself): `editrain train`",
              "then prints one line naming the option and what is allowed, exits with status 2,",
              "and writes nothing (no run directory). Numbers",
              "must be finite, also inside tables and lists (`sync.outer_optim_kwargs`), and",
              "integers at most 2^63 - 1; seeds are in [0, 2^63 - 1]; the outer optimizer is",
              "constructed once on a dummy parameter, so torch's own checks of its arguments",
              "apply, and a name imports nothing outside `torch.optim` and `editrain.optim` (a",
              "config never runs code: pass another class itself through the Python API);",
              "`sync.fragments` is at most the model's sync units; `sim.fail` names an existing",
              "data rank and a step of the run; `dist.backend=nccl`, `dist.device=cuda` and",
              "`dist.comm_backend=nccl` need one CUDA device per local process; `data.path`",
              "entries must exist, globs must match and files must be of a supported kind.",
              "An option set away from its default where it does nothing is refused, naming",
              "where it applies (the *methods* column; also `optim.momentum` without",
              "`optim.name = sgd`, `dist.ft_*` without `--ft`, `dist.pp_*` without stages,",
              "and a tuning of a part another option switches off: `sync.ewma_*` without",
              "`sync.skip_anomaly`, `sync.weight_softmax_temperature` without",
              "`sync.pseudo_gradnorm_reduce`, `sync.prefetch_depth` without",
              "`sync.layerwise`, `sync.outer_optim_kwargs` without an outer optimizer,",
              "`sync.merge` without `sync.overlap_steps`, `sync.step_weight_ratio` without",
              "`sync.use_step_weight`, `sync.gta`'s fields without its GTA reducer,",
              "`sync.local_sgd_sync_time` with `sim.step_schedule` (which replaces the",
              "clock), each switch as the method sets it by default:",
              "`editrain/config/applicability.py`); so are list entries that contradict each",
              "other (one replica slowed twice over the same steps, one sync corrupted twice,",
              "one source listed twice). Every path option is checked on the file system (a",
              "`--run-dir` that is a file, `/dev/null`, under a file or not writable is refused)",
              "and may hold no control characters; any other string is written back to",
              "`config.toml` escaped, and reads back equal. A model that cannot fit this",
              "machine's memory is refused, naming the shape option that made it so (every rank",
              "builds the whole model in fp32 on the host before sharding it; on a CPU device",
              "the local ranks then hold their shards and gradients: `editrain/config/size.py`),",
              "and a `model.init_from` `config.json` with more layers than its safetensors hold",
              "is refused before the model is built from it. Every number editrain reads",
              "from a Hugging Face `config.json` (`model.init_from`, `model.hf_config`, a",
              "checkpoint's description of its model) passes one strict reader",
              "(`editrain/models/hf_fields.py`): a count is a JSON integer from 1 to",
              "2,147,483,647 (layers: 100,000), never `true`, `2.0`, `\"4\"` or `[4]`; a",
              "real number is positive and finite (`1e400` is infinite); a flag is `true` or",
              "`false`; `null` is the field not given, except in a field the model's",
              "transformers config class types as a number or a flag without None",
              "(`num_hidden_layers`, `vocab_size`...: transformers would refuse the None, so",
              "it is refused first; `sliding_window`, `num_key_value_heads` may be `null`), and",
              "in a key the class does not declare whose null transformers' modeling code",
              "reads past its own default (`is_causal` in every family, a Qwen2's `head_dim`, a",
              "`rope_theta` that `rope_parameters` does not give: `NULL_READ_PAST_DEFAULT`);",
              "editrain's own Llama reader refuses the same nulls. A tokenizer file names a",
              "special",
              "token by its text. Each refusal names the option, the file and the field. Once",
              "the corpus is tokenised (still before any worker starts), `train.batch_size` must",
              "be at most the windows of one data rank's share of the corpus, and a reused",
              "token cache file must hold no token id beyond the vocabulary. Examples",
              "(generated by running the validation with `dist.nproc` workers):", "",
              "| argument | message |", "| --- | --- |"]
    lines += [f"| `{_cell(arg)}` | {_cell(msg)} |" for arg, msg in bad_input_messages()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` verify) the configuration reference.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success, 1 if ``--check`` found the file out of date.
    """
    p = CommandParser(prog="python -m editrain.docs", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the page to write")
    p.add_argument("--check", action="store_true", help="only check that --out is up to date")
    args = p.parse_args(argv)
    text = render_configuration()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m editrain.docs", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
