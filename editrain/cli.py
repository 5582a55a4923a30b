"""Command line: ``editrain train | data | export | sample | plot | bench | plan | options``.

``editrain train`` without torchrun spawns local workers through torch's elastic launcher;
under torchrun it joins the existing process group.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from editrain.argv import CommandParser, rayon_threads
from editrain.config import ConfigError, describe_options, load_config, parse_overrides
from editrain.config.inputs import check_path_options
from editrain.config.schema import SEED_MAX
from editrain.config.toml_io import load_resumed_config
from editrain.errors import CheckpointError, bounded, spelled
from editrain.paths import check_path, shown
from editrain.spawn import (
    Interrupted,
    LaunchError,
    import_torch,
    raise_interrupted,
    stop_signal_received,
    stop_signals_seen,
)

log = logging.getLogger("editrain")

TRAIN_HELP = """\
Train a model. Any option can be set in a TOML file (--config) and overridden on the
command line as --section.key=value (or --section.key value). Sections: model, data,
train, optim, dist, sync, sim, checkpoint. `editrain options` lists every option.

shorthands:
  --steps N           train.steps          --method NAME   sync.method
  --nproc N           dist.nproc           --shard-size S  dist.shard_size
  --seed N            train.seed           --run-dir DIR   run directory
  --resume PATH       resume a run         --max-restarts  dist.max_restarts
  --quiet             no progress bar      --overwrite     reuse a run directory
  --ft                dist.fault_tolerance=torchft: replicas as separate jobs that
                      survive a replica's death (pip install 'editrain[ft]')

Options are written in full (no prefix stands for one); an option given twice keeps its
last value, under any of its names (--steps 5 --train.steps=6: 6 steps).

methods: sync, post_local_sgd, diloco, edit (default), aedit

examples:
  editrain train                                   # 2 replicas x 2 shards on the CPU
  editrain train --method diloco --steps 300
  editrain train --sim.link_bandwidth 20MB/s --sync.prefetch_depth 2
  editrain train --ft --nproc 3 --shard-size 1 --sim.fail 2@40   # replica 2 dies, rejoins
  torchrun --nnodes 2 --nproc-per-node 8 -m editrain train --config my.toml

exit status: 0 done; 2 bad input or an editrain error in a worker (one line; the worker's
traceback in RUN_DIR/logs/); 1 a worker crashed; 130 Ctrl-C; 143 SIGTERM.
"""


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that set RANK)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ)


def config_from_args(args: argparse.Namespace, extra: list[str], command: str):
    """The validated configuration of ``--config FILE`` and ``--section.key=value`` options."""
    overrides, rest = parse_overrides(extra)
    if rest:
        raise ConfigError(f"{command}: unexpected argument(s) {' '.join(rest)}; options look "
                          f"like --train.steps=100 (see `editrain {command} --help`)")
    if args.config is None and isinstance(overrides.get("resume"), str):
        # --resume RUN without --config: that run's configuration, the options given here
        # over it (a resumed run is that run, not a default one with its checkpoint; and
        # `editrain data --resume RUN` prepares that run's corpus, not the default one)
        cfg, source = load_resumed_config(overrides["resume"], overrides)
        if source is not None:
            logging.info("resume: the configuration of %s, with the options given here "
                         "over it", source)
    else:
        cfg = load_config(args.config, overrides)
    # Every path option checked on the file system before any work (editrain data writes
    # no run directory; a --resume it reads the configuration of must exist).
    check_path_options(cfg, skip=() if command == "train" else ("run_dir",))
    return cfg


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from editrain import launch

    cfg = config_from_args(args, extra, "train")
    if cfg.quiet:
        logging.getLogger().setLevel(logging.WARNING)
    if under_torchrun():
        launch.run_under_torchrun(cfg, args.started_at)
    else:
        launch.run_local(cfg, args.started_at)
    return 0


def cmd_data(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from editrain.corpus import describe_data, format_data, prepare_data

    rayon_threads()  # a build's encoders read it: junk refused before any work
    cfg = config_from_args(args, extra, "data")
    if args.json:
        logging.getLogger().setLevel(logging.WARNING)  # stdout carries the JSON only
    info = describe_data(prepare_data(cfg))
    print(json.dumps(info, indent=1) if args.json else format_data(info))
    return 0


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    from editrain.metrics import has_losses, plot_runs
    from editrain.rundir import replica_groups

    if extra:
        raise ConfigError(f"plot: unexpected argument(s) {' '.join(extra)}")
    for d in args.run_dirs:
        check_path("plot: RUN_DIR", d, "in_dir")
    if args.out is not None:
        check_path("plot --out", args.out, "out_dir")
    runs: list[Path] = []
    for d in map(Path, args.run_dirs):
        # A fault-tolerant run's replica groups keep their metrics apart: one curve each.
        groups = [g for g in replica_groups(d) if (g / "metrics.jsonl").is_file()]
        if not (d / "metrics.jsonl").is_file() and not groups:
            raise ConfigError(f"plot: {shown(d)} holds no metrics.jsonl (nor replica*/metrics.jsonl, "
                              "a fault-tolerant run's)")
        runs += [d] if (d / "metrics.jsonl").is_file() else groups
    drawn = [r for r in runs if has_losses(r)]
    empty = [f"plot: {r}/metrics.jsonl holds no loss yet (the run has not finished a step)"
             for r in runs if r not in drawn]
    if not drawn:
        raise ConfigError(empty[0])
    for line in empty:  # the other runs are drawn
        print(f"editrain: {line}; left out", file=sys.stderr)
    for p in plot_runs(drawn, args.out if args.out is not None else args.run_dirs[0]):
        print(p)
    return 0


DEFAULT_SHARD_SIZE = "2GiB"
"""``editrain export``'s largest safetensors file."""
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, option: str) -> int:
    """``"5GB"`` (10**9 bytes a GB, as ``save_pretrained`` counts), ``"500MiB"`` (2**20 a
    MiB) or a number of bytes -> bytes, at least one.

    Raises:
        ConfigError: naming ``option``: not such a size.
    """
    import re
    from fractions import Fraction

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text) if len(text) < 64 else None
    unit = m.group(2).lower() if m else None
    size = Fraction(m.group(1)) * _SIZE_UNITS[unit] if m and unit in _SIZE_UNITS else 0
    if size < 1:
        raise ConfigError(f"{option}: {spelled(text)} is not a size of at least 1 byte (a number and "
                          f"B, KB, MB, GB, TB, KiB, MiB, GiB or TiB: 5GB, 500MiB)")
    return int(size)


def _os_error_line(e: OSError) -> str:
    """An ``OSError`` that reached :func:`main` as one line: the file it names spelled as
    every message spells a path (:func:`editrain.paths.shown`), then what went wrong."""
    name = e.filename
    if not name or not isinstance(name, str | bytes | os.PathLike):
        return str(e)
    return f"{shown(os.fsdecode(name))}: {e.strerror or e}"


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    import_torch()  # a Ctrl-C in torch's import stops the command after it, not inside
    from editrain.hf_checkpoint import export_checkpoint

    if extra:
        raise ConfigError(f"export: unexpected argument(s) {' '.join(extra)}")
    if args.replica is not None and args.replica < 0:
        raise ConfigError(f"export --replica: must be >= 0, got {args.replica}")
    max_shard_bytes = parse_size(args.max_shard_size, "export --max-shard-size")
    check_path("export: CHECKPOINT", args.checkpoint, "in_dir")
    check_path("export: OUT", args.out, "out_dir")
    done = export_checkpoint(args.checkpoint, args.out, replica=args.replica, dtype=args.dtype,
                             max_shard_bytes=max_shard_bytes)
    print(f"exported {done.checkpoint} ({done.source}) to {done.out}")
    return 0


def cmd_sample(args: argparse.Namespace, extra: list[str]) -> int:
    import_torch()  # a Ctrl-C in torch's import stops the command after it, not inside
    from editrain.sample import continuation, generate, load_for_sampling

    if extra:
        raise ConfigError(f"sample: unexpected argument(s) {' '.join(extra)}")
    for name in ("max_new_tokens", "top_k"):
        if getattr(args, name) < 0:
            raise ConfigError(f"sample --{name.replace('_', '-')}: must be >= 0, got "
                              f"{getattr(args, name)}")
    if not args.temperature >= 0:  # NaN too
        raise ConfigError(f"sample --temperature: must be >= 0, got {args.temperature}")
    if not 0 <= args.seed <= SEED_MAX:
        raise ConfigError(f"sample --seed: must be in [0, {SEED_MAX}], got {args.seed}")
    from editrain.models.hf_dir import HUB_PREFIX

    if not args.path.startswith(HUB_PREFIX):  # else a model of the hub cache, by its id
        check_path("sample: CHECKPOINT_OR_HF_DIR", args.path, "in_dir")
    loaded = load_for_sampling(args.path, replica=args.replica)
    prompt = loaded.tokenizer.encode(args.prompt).ids
    if not prompt and loaded.eos_id is not None:  # a new document: after an end of text
        prompt = [loaded.eos_id]
    new = generate(loaded.model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, eos_id=loaded.eos_id,
                   max_len=loaded.max_len)
    print(args.prompt + continuation(loaded.tokenizer, prompt, new))
    return 0


def cmd_options(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:  # `editrain options --train` lists every option, not train's: say so
        raise ConfigError(f"options: unexpected argument(s) {' '.join(extra)}; it takes none "
                          "(it lists every option)")
    for name, tp, default, doc in describe_options():
        print(f"--{name}  ({tp}, default {default!r})\n      {doc}")
    return 0


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from editrain.bench import run_scenario

    if args.out is not None:
        check_path("bench --out", args.out, "out_dir")
    run_scenario(args.scenario, quick=args.quick, out_dir=args.out, extra=extra)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # CommandParser: options written in full, each given once (editrain.argv); its
    # sub-command parsers are CommandParsers too.
    parser = CommandParser(
        prog="editrain",
        description="Communication-efficient LLM training with EDiT / A-EDiT local SGD on "
                    "FSDP2 (plus synchronous, Post-Local SGD and DiLoCo baselines).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("train", help="train a model (local workers or under torchrun)",
                       description=TRAIN_HELP, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with any of the sections")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("data", help="tokenise the corpus into the cache and show its splits",
                       description="Build (or reuse) the token cache of the configured corpus "
                                   "ahead of a job, so one node tokenises and the others reuse "
                                   "it, and print the splits: documents, tokens, kinds, the "
                                   "share of validation 32-token windows found in train.bin and "
                                   "the cache path. Takes the same --config and --data.* "
                                   "options as train, and --resume RUN_DIR: that run's "
                                   "configuration (with the options given over it).")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with any of the sections")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_data)
    p = sub.add_parser("plot", help="loss-vs-tokens and loss-vs-time PNGs of runs",
                       description="Draw loss curves of one or more run directories.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", help="output directory (default: the first run directory)")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("export", help="write a checkpoint's model as a Hugging Face directory",
                       description="Write the model of CHECKPOINT (a checkpoint directory, or "
                                   "a run directory: its latest) into OUT as a Hugging Face "
                                   "directory: config.json, safetensors, the run's tokenizer "
                                   "and a README naming run, method and step. By default the "
                                   "global model (the anchors the replicas agree on). OUT "
                                   "must be new, empty or an earlier export.")
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--replica", type=int, default=None, metavar="R",
                   help="export replica R's live weights instead of the global model")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the weights' dtype in OUT (default float32: as trained; bfloat16 "
                        "halves the files, as most published models are)")
    p.add_argument("--max-shard-size", "--max_shard_size", default=DEFAULT_SHARD_SIZE,
                   metavar="SIZE", help="the largest safetensors file (e.g. 5GB, 500MiB; "
                   f"default {DEFAULT_SHARD_SIZE}); more weights go to several files and "
                   "model.safetensors.index.json. The export holds one file's tensors in "
                   "memory at a time.")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("sample", help="generate text from a checkpoint or a Hugging Face "
                       "directory (CPU, one process)",
                       description="Continue a prompt with the model of a checkpoint (its "
                                   "global model, or --replica R) or of a Hugging Face "
                                   "directory (or hf:ORG/NAME[@REVISION], a model in the "
                                   "Hugging Face hub cache): greedy at --temperature 0, else "
                                   "sampling with an optional --top-k, seeded.")
    p.add_argument("path", metavar="CHECKPOINT_OR_HF_DIR")
    p.add_argument("--prompt", required=True, help="the text to continue (empty: a new "
                   "document, after the tokenizer's end-of-text token)")
    p.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=100, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy")
    p.add_argument("--top-k", "--top_k", type=int, default=0, metavar="K",
                   help="0 (default): no cut")
    p.add_argument("--seed", type=int, default=0, metavar="S", help=f"0 .. {SEED_MAX}")
    p.add_argument("--replica", type=int, default=None, metavar="R",
                   help="a checkpoint's replica R instead of its global model")
    p.set_defaults(func=cmd_sample)
    p = sub.add_parser("options", help="list every configuration option with its default",
                       description="List every option, its type, default and meaning.")
    p.set_defaults(func=cmd_options)
    p = sub.add_parser("bench", help="run a benchmark scenario side by side",
                       description="Run the methods side by side on one scenario and write "
                                   "results.json, a Markdown table and plots.")
    p.add_argument("scenario", help="default, convergence, tune, scale, batch, bandwidth, "
                   "stragglers, "
                   "spikes, memory, overlap, optimizers, peers, faults, plan, all, or report "
                   "(writes docs/benchmarks.md); "
                   "further options: --full (the credible size: minutes to hours), --tiny "
                   "(smoke-test size), --repeats N (interleaved repeats; default 1 tiny, 3 "
                   "quick, 5 full), --seeds N, --links A,B (bandwidth), --methods A,B "
                   "(convergence), --shapes A,B (scale, batch), --reuse (convergence, tune, scale, "
                   "batch: read back the finished "
                   "runs of an earlier, e.g. interrupted, invocation into the same --out "
                   "whose options are this one's), --path FILE and --readme FILE (report: "
                   "also "
                   "rewrite the README's headline between its bench-headline markers), and "
                   "any --section.key=value applied to every run")
    p.add_argument("--quick", action="store_true", help="the quick size, between --tiny and "
                   "the full size that is the default (tiny model, small data: minutes on 2 "
                   "cores)")
    p.add_argument("--out", help="results directory (default bench_results/<scenario>)")
    p.set_defaults(func=cmd_bench)
    from editrain.plan.cli import add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None, started_at: float | None = None) -> int:
    """The ``editrain`` command; returns its exit code.

    Whatever fails comes back as one ``editrain: error: ...`` line: exit code 2 for bad
    input or files (also when only a worker could see it: the line names the rank and where
    its traceback is), 1 for a worker that crashed or died. Ctrl-C, SIGTERM and SIGHUP stop
    every worker and end with ``editrain: interrupted`` (130) or ``editrain: stopped by
    SIGTERM`` (143; SIGHUP: 129).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        started_at: the Unix time the command started (``editrain.entry``: before its
            imports); default now. ``editrain train`` reports its time from it.
    """
    started_at = time.time() if started_at is None else started_at
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # editrain's own lines are INFO; torch's loggers stay at torch's default (WARNING, or
    # what TORCH_LOGS says: torch sets them when its import completes). Set here too for a
    # Ctrl-C that cuts torch's import short: its exit handlers (FakeTensor cache statistics)
    # would otherwise log at this INFO level after the one line the interrupt prints.
    if "torch" not in sys.modules:  # an imported torch has set its loggers already
        logging.getLogger("torch").setLevel(logging.WARNING)
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # its optional PLAN.toml must not take an option's value
        from editrain.plan.cli import attach_values

        argv = ["plan", *attach_values(argv[1:])]
    args, extra = parser.parse_known_args(argv)
    args.started_at = started_at
    # Ctrl-C, SIGTERM and SIGHUP raise Interrupted (spawn.raise_interrupted), so that a
    # launcher stops its workers on the way out. Not under torchrun (torchrun is the
    # launcher there), and not where the signal is ignored (nohup) or handled by a caller.
    seen = stop_signals_seen()
    restore = {}
    if not under_torchrun() and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL,
                                                              signal.default_int_handler):
                restore[sig] = signal.signal(sig, raise_interrupted)
    try:
        return args.func(args, extra)
    except BaseException as e:  # noqa: BLE001 (what is not reported here is raised again)
        return _report(e, stop_signal_received(seen))
    finally:
        for sig, handler in restore.items():
            signal.signal(sig, handler)


def _report(e: BaseException, stop_signal: int | None) -> int:
    """Print the one line for what ended a command and return its exit code; raise again
    what is neither a stop nor an error the command line reports.

    Args:
        e: the exception.
        stop_signal: the signal that stopped the command, if one did. Whatever exception
            then ends it is the stop: the exception a signal handler raises lands on any
            line, and code there can replace it with one of its own.
    """
    if isinstance(e, (Interrupted, KeyboardInterrupt)) or stop_signal is not None:
        if isinstance(e, Interrupted):
            stopped = e
        else:
            stopped = Interrupted(signal.SIGINT if isinstance(e, KeyboardInterrupt)
                                  else stop_signal)
        with contextlib.suppress(OSError):  # a terminal that hung up (SIGHUP)
            # On a line of its own: after the terminal's "^C", or after a worker that was
            # stopped while it wrote to the shared stderr.
            print(f"\neditrain: {stopped}", file=sys.stderr)
        return stopped.exit_code
    if isinstance(e, BrokenPipeError):  # `editrain options | head`
        sys.stderr.close()
        return 0
    if isinstance(e, (ConfigError, FileNotFoundError, ValueError, CheckpointError)):
        print(f"editrain: error: {bounded(str(e))}", file=sys.stderr)
        return 2
    if isinstance(e, OSError):  # a path the checks could not foresee (a full disk ...)
        print(f"editrain: error: {bounded(_os_error_line(e))}", file=sys.stderr)
        return 2
    if isinstance(e, LaunchError):
        print(f"editrain: error: {bounded(str(e))}", file=sys.stderr)
        return e.exit_code
    raise e


if __name__ == "__main__":
    sys.exit(main())
