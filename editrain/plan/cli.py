"""``editrain plan``: the command line around the job model (table, plot, search, calibration).

Nothing here trains; a plan takes well under a second."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from editrain.errors import ConfigError, spelled
from editrain.paths import check_path

PLAN_HELP = """\
Predict a cluster's throughput per method before renting it: step time, tokens/s,
utilisation (compute time / wall time), exposed communication, bytes per round and memory
per GPU, and a plot of utilisation against the inter-node bandwidth. docs/planning.md
describes the model and its limits.

input: a TOML file with [cluster], [model] and [[method]] tables, and/or options:
  --cluster.FIELD=VALUE      e.g. --cluster.inter_node_gbps=10 (overrides the file)
  --model.FIELD=VALUE        e.g. --model.preset=7b --model.batch_size=64
  --method SPEC              repeatable: edit, or edit:H=64,fragments=4,overlap=1,codec=int8
                             (pipeline stages: edit:pp=4,pp_microbatches=8,pp_schedule=1f1b)

examples:
  editrain plan cluster.toml --method sync --method diloco:H=128 --method edit:H=128
  editrain plan cluster.toml --method edit --target 0.95      # cheapest H/P/tau/codec
  editrain plan --calibrate runs/edit --method edit:codec=int8 --cluster.inter_node_gbps=0.04
"""


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` sub-command to ``editrain``'s sub-parsers.

    Args:
        sub: the ``add_subparsers()`` object of the main parser.
    """
    p = sub.add_parser("plan", help="predict throughput per method on a cluster (no training)",
                       description=PLAN_HELP, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config", nargs="?", metavar="PLAN.toml",
                   help="[cluster], [model] and [[method]] tables")
    p.add_argument("--method", action="append", metavar="SPEC", dest="methods",
                   help="a method setting (repeatable; replaces the file's [[method]])")
    p.add_argument("--target", type=float, metavar="U",
                   help="search H, fragments, overlap and codec for the cheapest setting "
                        "reaching utilisation U (e.g. 0.95)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                   help="fit compute speed and link bandwidth / latency from runs' metrics")
    p.add_argument("--out", default="plan_results",
                   help="directory for plan.json, table.md and the plot (default plan_results)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def attach_values(argv: list[str]) -> list[str]:
    """``plan``'s arguments with every ``--cluster.X VALUE`` / ``--model.X VALUE`` written
    ``--cluster.X=VALUE``, before argparse sees them: its optional ``PLAN.toml`` positional
    would otherwise take the first such VALUE (``--model.preset 7b``: "file not found:
    '7b'")."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if (arg.startswith(("--cluster.", "--model.")) and "=" not in arg
                and i < len(argv) and not argv[i].startswith("--")):
            arg, i = f"{arg}={argv[i]}", i + 1
        out.append(arg)
    return out


def _overrides(extra: list[str]) -> dict[str, dict[str, Any]]:
    """``--cluster.x=v`` / ``--model.x v`` options into ``{"cluster": {...}, ...}``."""
    from editrain.plan.inputs import parse_scalar

    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(extra):
        arg = extra[i]
        i += 1
        name, eq, value = arg.partition("=")
        section, dot, key = name.removeprefix("--").partition(".")
        if not arg.startswith("--") or not dot or section not in ("cluster", "model"):
            raise ConfigError(f"plan: unexpected argument {spelled(arg)}; options look like "
                              "--cluster.inter_node_gbps=10 or --model.preset=7b")
        if not eq:
            if i >= len(extra):
                raise ConfigError(f"{name}: missing value (write {name}=VALUE)")
            value = extra[i]
            i += 1
        out.setdefault(section, {})[key.replace("-", "_")] = parse_scalar(value)
    return out


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    """Run ``editrain plan``; returns the exit code (errors raise ConfigError)."""
    from editrain.plan.inputs import PlanInputs, load_inputs
    from editrain.plan.model import model_shape, predict

    # The options first: a misspelt option (`--tar 0.9`) leaves its value to PLAN.toml,
    # and the option, not a file named 0.9, is what to report.
    overrides = _overrides(extra)
    check_path("plan --out", args.out, "out_dir")  # every path before any work
    if args.config is not None:
        check_path("plan: PLAN.toml", args.config, "in_file")
    for d in args.calibrate or ():
        check_path("plan --calibrate", d, "in_dir")
    out_dir = Path(args.out)
    record: dict[str, Any] = {}
    if args.calibrate:
        inputs, cal_text = _calibrated_inputs(args, overrides)
        record["calibration"] = cal_text
        if not args.json:
            print(cal_text)
    else:
        inputs = load_inputs(args.config, overrides, args.methods)
    assert isinstance(inputs, PlanInputs)
    shape = model_shape(inputs.model)
    preds = [predict(inputs.cluster, inputs.model, m, shape) for m in inputs.methods]
    record["cluster"] = vars(inputs.cluster)
    record["model"] = {**vars(inputs.model), "params": shape.params, "units": len(shape.units)}
    record["predictions"] = [p.row() for p in preds]
    text = [_header(inputs, shape), "", plan_table(preds)]
    for p in preds:
        text += [f"- {p.label}: {note}" for note in p.notes]
    if args.target is not None:
        from editrain.plan.search import search_target

        found = search_target(inputs.cluster, inputs.model, inputs.methods, args.target, shape)
        text += ["", f"Cheapest setting reaching utilisation {args.target:g} (smallest H, "
                 "then least overlap, widest codec, fewest fragments):", ""]
        rows = []
        record["search"] = {}
        for name, res in found.items():
            hit = res["found"]
            record["search"][name] = {"found": hit.row() if hit else None,
                                      "tried": res["tried"],
                                      "best": res["best"].row() if res["best"] else None}
            rows.append(hit if hit else None)
            if hit is None:
                best = res["best"]
                text.append(f"- {name}: none of {res['tried']} settings reaches it; best "
                            f"{best.label} at {best.utilisation:.3f}")
        hits = [r for r in rows if r is not None]
        if hits:
            text += ["", plan_table(hits)]
    page = "\n".join(text) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(page)
    (out_dir / "plan.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    if not args.no_plot:
        record["plot"] = str(plot_utilisation(inputs, out_dir / "utilisation_vs_bandwidth.png",
                                              shape))
    if args.json:
        print(json.dumps(record, indent=1, default=str))
    else:
        print(page + (f"\nplot: {record['plot']}" if "plot" in record else ""))
    return 0


def _calibrated_inputs(args: argparse.Namespace, overrides: dict[str, dict[str, Any]]):
    """The inputs of a calibrated plan and the calibration's text."""
    import dataclasses

    from editrain.plan.calibrate import calibrate
    from editrain.plan.inputs import GBIT, MethodSpec, PlanInputs, parse_method

    cal = calibrate(args.calibrate)
    cluster = cal.cluster(**overrides.get("cluster", {}))
    first = cal.samples[0]
    model = _model_over_run(first.model, overrides.get("model", {}))
    if args.methods:
        # The run's layout, its pipeline included, unless the setting gives its own pp.
        methods = []
        for m in args.methods:
            given = parse_method(m)
            run: dict[str, Any] = {"shard_size": first.shard_size}
            if first.method.pp > 1 and "pp" not in given:
                run.update(pp=first.method.pp, pp_schedule=first.method.pp_schedule,
                           pp_microbatches=first.method.pp_microbatches,
                           pp_stages_per_rank=first.method.pp_stages_per_rank)
            methods.append(MethodSpec(**{**run, **given}))
    else:
        methods = [dataclasses.replace(s.method, name=f"{Path(s.run_dir).name} (as run)")
                   for s in cal.samples]
    bw = cal.bandwidth_bytes_per_s
    flops, gpus = cal.measured_job()
    lines = [f"calibrated from {len(cal.samples)} run(s), {cal.rounds} sync round(s):",
             f"  compute per step {cal.step_time_s * 1000:.2f} ms, overhead per step "
             f"{cal.step_overhead_s * 1000:.2f} ms, straggler spread {cal.straggler_spread:.3f}",
             f"  the compute is the run's job's: {flops / 1e9:.4g} GFLOP per step on {gpus} "
             f"GPU(s) per replica, {flops / cal.step_time_s / gpus / 1e9:.4g} GFLOP/s per "
             "GPU achieved (another model, batch or layout is planned at that rate)",
             *([f"  pipeline stages: the runs' pipelined step is {cal.pipeline_factor:.4g}x "
                "the compute per step above (the schedule's bubble and the stages' "
                "imbalance; the plan adds them back for its pipeline); their rounds fit no "
                "link (each rank logs its own stage's only)"] if cal.pipeline_factor != 1
              else []),
             f"  compute slowdown per round beside the compute {cal.overlap_cpu_s * 1000:.2f} "
             f"ms (fitted {cal.overlap_fit}; the compute per step above is without it)",
             "  link: " + (f"{bw / 1e6:.3f} MB/s ({bw / GBIT:.4g} Gbit/s)" if bw
                           else "no rounds (unlimited)")
             + f", latency {cal.latency_s * 1000:.2f} ms per collective "
             + ("(fitted)" if cal.latency_fitted else "(assumed: the rounds cannot separate "
                "it)") + f", rms error {cal.residual_rms_s * 1000:.2f} ms per round"]
    if cal.own_bandwidth_bytes_per_s or cal.own_latency_s:
        own = cal.own_bandwidth_bytes_per_s
        lines.append("  beyond the simulated link, the machine's own cost: "
                     + (f"{own / 1e6:.3f} MB/s" if own else "no per-byte cost")
                     + f", {cal.own_latency_s * 1000:.2f} ms per collective")
    for s in cal.samples:
        if s.sim.get("link_bandwidth") not in (None, "none", ""):
            lines.append(f"  ({s.run_dir}: simulated link {s.sim.get('link_bandwidth')} + "
                         f"{s.sim.get('link_latency')})")
    lines += ["", cal.to_toml()]
    return PlanInputs(cluster, model, methods), "\n".join(lines)


def _model_over_run(run_model: Any, given: dict[str, Any]) -> Any:
    """The calibrated run's model with ``--model.X`` values over it. A value naming
    another model (``--model.preset=1b``, ``--model.hf_config=...``) plans that model on
    the calibrated hardware: the run's own model and shape overrides are left out (a
    preset keeps the run's vocabulary, a Hugging Face config has its own)."""
    from editrain.plan.inputs import MODEL_SOURCES, SHAPE_FIELDS, ModelSpec

    fields = vars(run_model)
    if any(name in given for name in MODEL_SOURCES):
        dropped = (*MODEL_SOURCES, *SHAPE_FIELDS,
                   *(() if {"preset", "params"} & set(given) else ("vocab_size",)))
        fields = {k: v for k, v in fields.items() if k not in dropped}
    return ModelSpec(**{**fields, **given})


def _header(inputs: Any, shape: Any) -> str:
    c, m = inputs.cluster, inputs.model
    speed = (f"{c.step_time_s * 1000:.1f} ms compute per step" if c.step_time_s else
             f"{c.gpu_peak_tflops:g} TFLOP/s x MFU {c.mfu:g}")
    speed += _scaled_compute_text(c, m, shape)
    if c.overlap_cpu_s:
        speed += f" (+ {c.overlap_cpu_s * 1000:.1f} ms per round beside it)"
    return (f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s), {speed}, inter-node "
            f"{c.inter_node_gbps:.4g} Gbit/s + {c.inter_node_latency_ms:g} ms, straggler "
            f"spread {c.straggler_spread:g}; model {m.label} "
            f"({shape.params / 1e6:,.1f}M parameters, {len(shape.units)} sync units), "
            f"{m.batch_size} x {m.seq_len} tokens per replica per step")


def _scaled_compute_text(cluster: Any, model: Any, shape: Any) -> str:
    """What the header adds when the measured compute per step belongs to another job
    than the planned model's (other FLOPs per step): that the predictions scale it, so
    that nobody reads the measured number as this model's. A setting whose layout alone
    differs says so in its own note (:func:`editrain.plan.model.predict`)."""
    from editrain.plan.model import step_flops

    if cluster.step_time_s is None or cluster.step_time_flops is None:
        return ""
    flops = step_flops(shape, model)
    if flops == cluster.step_time_flops:
        return ""
    return (f" measured on another job ({cluster.step_time_flops / 1e9:.4g} GFLOP per step "
            f"on {cluster.step_time_gpus} GPU(s) per replica), scaled to this model's "
            f"{flops / 1e9:.4g} GFLOP per step (x{flops / cluster.step_time_flops:.4g}; the "
            "same achieved FLOP/s per GPU assumed: a rough guide across very different "
            "sizes)")


def plan_table(preds: list[Any]) -> str:
    """The Markdown table of predictions (one row per setting).

    Args:
        preds: :class:`~editrain.plan.model.Prediction` objects.
    """
    from editrain.bench.tables import md_table

    # Pipeline stages add their degree and bubble; a plan without them reads as before.
    staged = any(p.layout.pp > 1 for p in preds)
    rows = []
    for p in preds:
        mem = f"{p.memory.gpu_bytes / 2**30:.3g}"
        if p.memory.host_bytes:
            mem += f" (+{p.memory.host_bytes / 2**30:.3g} host)"
        lay = p.layout
        shape = f"{lay.replicas}x{lay.shard_size}x{lay.tp}"
        extra = []
        if staged:
            shape = f"{lay.replicas}x{lay.pp}x{lay.shard_size}x{lay.tp}"
            extra = [p.bubble]
        rows.append([p.label, shape, *extra, p.wall_per_step_s * 1000, p.tokens_per_s,
                     p.utilisation, p.exposed_comm_s * 1000, p.straggler_wait_s * 1000,
                     p.bytes_per_round / 1e6, p.round_link_s * 1000, mem])
    head = (["replicas x pp x shards x tp", "pp bubble"] if staged
            else ["replicas x shards x tp"])
    return md_table(["setting", *head, "step ms", "tokens/s",
                     "utilisation", "exposed comm ms/step", "straggler wait ms/step",
                     "MB per round (node)", "link ms per round", "GiB per GPU"], rows)


def plot_utilisation(inputs: Any, path: Path, shape: Any) -> Path:
    """Utilisation against inter-node bandwidth, one line per setting, the cluster's own
    bandwidth marked.

    Args:
        inputs: the plan inputs.
        path: the PNG to write.
        shape: the model's shape.
    """
    from editrain.bench.plots import pyplot, save_figure
    from editrain.plan.search import utilisation_curve

    here = inputs.cluster.inter_node_gbps
    lo, hi = math.log10(here) - 3, math.log10(here) + 2
    xs = [10 ** (lo + (hi - lo) * i / 60) for i in range(61)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in inputs.methods:
        ax.plot(xs, utilisation_curve(inputs.cluster, inputs.model, m, xs, shape),
                label=m.label)
    ax.axvline(here, color="gray", linestyle="--", label=f"this cluster ({here:.3g} Gbit/s)")
    ax.set_xscale("log")
    ax.set_xlabel("inter-node bandwidth per node (Gbit/s)")
    ax.set_ylabel("utilisation (compute / wall)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


__all__ = ["PLAN_HELP", "add_plan_parser", "cmd_plan", "plan_table", "plot_utilisation"]
