"""Spikes: validation-loss spikes from corrupted replicas, with and without the penalty.

At a few syncs after the anomaly detector's warm-up, replica 1's pseudo-gradient is
multiplied by a large factor just before the sync (``--sim.corrupt_replica 1@K:SCALE``,
a learning-rate burst or a bad batch). DiLoCo averages it in; EDiT's pseudo-gradient
penalty (EWMA anomaly elimination, norm-softmax weights, clipping) should keep it out. Each
penalty part is switched off in turn to see what it contributes.
"""

from __future__ import annotations

import math
from typing import Any

from editrain.bench.prose import fill, prose
from editrain.bench.runs import Run
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict, figure
from editrain.bench.stats import measured
from editrain.bench.tables import cell

TEXT = prose("spikes")
VARIANTS: dict[str, dict[str, Any]] = {
    "diloco": {"sync": {"method": "diloco"}},
    "edit": {"sync": {"method": "edit"}},
    "edit-no-skip_anomaly": {"sync": {"method": "edit", "skip_anomaly": False}},
    "edit-no-gradnorm_weights": {"sync": {"method": "edit", "pseudo_gradnorm_reduce": False}},
    "edit-no-clip": {"sync": {"method": "edit", "clip_pseudo_grad": 0.0}},
}
SCALE = 20.0


def _setup(bench: Any) -> dict[str, Any]:
    interval, corrupt_at = bench.pick(2, 5, 10), bench.pick([5], [8, 12, 16], [8, 12, 16])
    steps = (max(corrupt_at) + 4) * interval
    common = {"train": {"steps": steps, "eval_every": interval,
                        "warmup_steps": min(10, steps // 5)},
              "sync": {"local_sgd_sync_interval": interval,
                       "ewma_warmup_steps": bench.pick(3, 5, 5), "ewma_alpha": 0.2}}
    return {"interval": interval, "corrupt_at": corrupt_at, "steps": steps, "common": common,
            "variants": bench.pick(("diloco", "edit"), tuple(VARIANTS), tuple(VARIANTS)),
            "corrupt": {"sim": {"corrupt_replica": [f"1@{k}:{SCALE:g}" for k in corrupt_at]}},
            # Ablations run their own clean run at the full size only.
            "clean": lambda v: v in ("diloco", "edit") or bench.mode == "full",
            # What the runs really use (options given on the command line win).
            **{key: bench.setting(f"sync.{key}", common)
               for key in ("ewma_alpha", "ewma_warmup_steps", "ewma_threshold")}}


def _runs(ctx: Ctx) -> list[Job]:
    jobs = []
    for v in ctx.variants:
        if ctx.clean(v):
            jobs.append(Job(f"{v}-clean", (ctx.common, VARIANTS[v])))
        jobs.append(Job(f"{v}-corrupt", (ctx.common, VARIANTS[v], ctx.corrupt)))
    return jobs


def _results(ctx: Ctx) -> dict[str, Any]:
    out = {}
    for v in ctx.variants:
        ref = v if ctx.clean(v) else "edit"
        out[v] = _measure(ctx.runs.get(f"{ref}-clean"), ctx.runs[f"{v}-corrupt"],
                          ctx.corrupt_at, ctx.interval)
        out[v]["clean_reference"] = f"{ref}-clean"
    return out


def _notes(ctx: Ctx) -> list[str]:
    return fill(TEXT["notes"], ctx=ctx, scale=SCALE, syncs=", ".join(map(str, ctx.corrupt_at)),
                ablations=TEXT["ablations_full" if ctx.bench.mode == "full"
                               else "ablations_small"])


def _evals_by_step(run: Run | None) -> dict[int, float]:
    """Validation loss by step of a run (empty for a missing or failed run); an
    evaluation whose step is no integer >= 0 or whose loss is no finite number is no
    measurement (:func:`editrain.bench.stats.measured`; ``int()`` made a step of 9.5 step
    9, ``float()`` a loss of ``true`` 1)."""
    if run is None or not run.ok:
        return {}
    return {r["step"]: measured(r["val_loss"], -math.inf) for r in run.evals
            if type(r.get("step")) is int and r["step"] >= 0
            and measured(r.get("val_loss"), -math.inf) is not None}


def _measure(clean: Run | None, bad: Run, corrupt_at: list[int],
             interval: int) -> dict[str, Any]:
    """Peak increase over the clean run, jumps at corrupted syncs, detector flags."""
    c, b = _evals_by_step(clean), _evals_by_step(bad)
    first = (min(corrupt_at) + 1) * interval
    diffs = {s: b[s] - c[s] for s in b if s in c and s >= first}
    peak_step = max(diffs, key=diffs.get) if diffs else None
    peak = max(0.0, diffs[peak_step]) if peak_step is not None else None
    jumps = [b[(k + 1) * interval] - b[k * interval] for k in corrupt_at
             if (k + 1) * interval in b and k * interval in b]
    excluded = units = false_alarms = 0
    for entry in bad.sync_entries():  # every round the detector judged, the end's included
        for replica, flags in enumerate(entry.get("outlier") or []):
            if entry.get("sync") in corrupt_at and replica == 1:
                units += len(flags)
                excluded += sum(map(bool, flags))
            else:
                false_alarms += sum(map(bool, flags))
    return {
        "peak_increase": peak,
        "peak_relative": (peak / c[peak_step]) if peak is not None and c.get(peak_step)
        else None,
        "peak_step": peak_step,
        "max_jump": max(jumps) if jumps else None,
        "final_val_loss": bad.final_val_loss,
        "clean_final_val_loss": clean.final_val_loss if clean is not None else None,
        "excluded_units": excluded if units else None,
        "corrupted_units": units or None,
        "false_alarms": false_alarms if units else None,
        "error": bad.error,
    }


def _judge(ctx: Ctx) -> Verdict:
    """The target check (edit's peak < 25% of diloco's), the findings and the headline."""
    results = ctx.results
    d, e = results["diloco"]["peak_increase"], results["edit"]["peak_increase"]
    if d is None or e is None:
        met, detail = None, "a run failed"
    elif d <= 0:
        met, detail = None, TEXT["no_rise"]
    else:
        met = e < 0.25 * d
        detail = fill(TEXT["detail"], e=e, d=d, share=e / d)
    findings = [fill(TEXT["finding"], v=v, peak=cell(x["peak_increase"]),
                     relative=cell(x["peak_relative"]), jump=cell(x["max_jump"]))
                for v, x in results.items() if x["peak_increase"] is not None]
    return Verdict(
        targets=[{"name": TEXT["target"], "met": met, "detail": detail}],
        findings=findings,
        headline=[fill(TEXT["headline"], scale=SCALE, syncs=", ".join(map(str, ctx.corrupt_at)),
                       peaks=", ".join(f"{v} {cell(x['peak_increase'])}"
                                       for v, x in results.items()))])


def _plot(ctx: Ctx):
    """Validation loss against steps, corrupted (solid) and clean (dashed) runs."""
    with figure(ctx, "val_loss_spikes.png", "step (red: corrupted syncs)", "validation loss",
                size=(7.5, 4.5)) as ax:
        for v in ctx.variants:
            pts = sorted(_evals_by_step(ctx.runs[f"{v}-corrupt"]).items())
            if pts:
                line, = ax.plot(*zip(*pts), marker="o", markersize=2.5,
                                label=f"{v} (corrupted)")
                ref = _evals_by_step(ctx.runs.get(f"{v}-clean"))
                if ref:
                    ax.plot(*zip(*sorted(ref.items())), linestyle="--",
                            color=line.get_color(), alpha=0.6, label=f"{v} (clean)")
        for k in ctx.corrupt_at:
            ax.axvline((k + 1) * ctx.interval, color="red", alpha=0.25)
    return ctx.plot


SCENARIO = Scenario(
    name="spikes",
    description=TEXT["description"],
    setup=_setup, runs=_runs, measure=_results, judge=_judge, notes=_notes, plots=[_plot],
    tables=[Table("Validation-loss spikes", [
        ("method", None), ("peak val-loss increase", "peak_increase"),
        ("relative", "peak_relative"), ("max jump at a corrupted sync", "max_jump"),
        ("final val loss", "final_val_loss"), ("clean final val loss", "clean_final_val_loss"),
        ("excluded", lambda row: None if row[1]["corrupted_units"] is None
         else f"{row[1]['excluded_units']}/{row[1]['corrupted_units']}"),
        ("false alarms", "false_alarms")])],
    settings=lambda ctx: {
        "steps": ctx.steps, "sync_interval": ctx.interval, "corrupt_syncs": ctx.corrupt_at,
        "scale": SCALE, "ewma_warmup_steps": ctx.ewma_warmup_steps,
        "ewma_alpha": ctx.ewma_alpha, "variants": {v: VARIANTS[v] for v in ctx.variants}},
    methods=lambda ctx: ctx.variants,
)
