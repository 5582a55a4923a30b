"""Spikes: validation-loss spikes from corrupted replicas, with and without the penalty.

At a few syncs after the anomaly detector's warm-up, replica 1's pseudo-gradient is
multiplied by a large factor just before the sync (``--sim.corrupt_replica 1@K:SCALE``,
a learning-rate burst or a bad batch). DiLoCo averages it in; EDiT's pseudo-gradient
penalty (EWMA anomaly elimination, norm-softmax weights, clipping) should keep it out. Each
penalty part is switched off in turn to see what it contributes.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.plots import pyplot, save_figure
from editrain.bench.runner import Bench
from editrain.bench.runs import Run
from editrain.bench.tables import cell, md_table

NAME = "spikes"
DESCRIPTION = (
    "Validation-loss spikes caused by corrupting replica 1's pseudo-gradient at several "
    "syncs (`--sim.corrupt_replica 1@K:SCALE`), for `diloco`, `edit` and `edit` with each "
    "penalty part switched off in turn; the peak increase of the validation loss over a "
    "clean run of the same method."
)
VARIANTS: dict[str, dict[str, Any]] = {
    "diloco": {"sync": {"method": "diloco"}},
    "edit": {"sync": {"method": "edit"}},
    "edit-no-skip_anomaly": {"sync": {"method": "edit", "skip_anomaly": False}},
    "edit-no-gradnorm_weights": {"sync": {"method": "edit", "pseudo_gradnorm_reduce": False}},
    "edit-no-clip": {"sync": {"method": "edit", "clip_pseudo_grad": 0.0}},
}
SCALE = 20.0


def run(bench: Bench) -> dict[str, Any]:
    """Run the scenario; returns the record written to ``results.json``."""
    interval = bench.pick(2, 5, 10)
    warmup = bench.pick(3, 5, 5)
    corrupt_at = bench.pick([5], [8, 12, 16], [8, 12, 16])
    alpha = 0.2
    steps = (max(corrupt_at) + 4) * interval
    variants = bench.pick(("diloco", "edit"), tuple(VARIANTS), tuple(VARIANTS))
    clean_ablations = bench.mode == "full"
    common = {"train": {"steps": steps, "eval_every": interval,
                        "warmup_steps": min(10, steps // 5)},
              "sync": {"local_sgd_sync_interval": interval, "ewma_warmup_steps": warmup,
                       "ewma_alpha": alpha}}
    corrupt = {"sim": {"corrupt_replica": [f"1@{k}:{SCALE:g}" for k in corrupt_at]}}
    for v in variants:
        bench.check(common, VARIANTS[v], corrupt)
    # What the runs really use (options given on the command line win).
    alpha = bench.setting("sync.ewma_alpha", common)
    warmup = bench.setting("sync.ewma_warmup_steps", common)
    threshold = bench.setting("sync.ewma_threshold", common)

    clean: dict[str, Run] = {}
    bad: dict[str, Run] = {}
    for v in variants:
        if v in ("diloco", "edit") or clean_ablations:
            clean[v] = bench.train(f"{v}-clean", common, VARIANTS[v])
        bad[v] = bench.train(f"{v}-corrupt", common, VARIANTS[v], corrupt)

    results: dict[str, Any] = {}
    for v in variants:
        ref_name = v if v in clean else "edit"
        results[v] = _measure(clean.get(ref_name), bad[v], corrupt_at, interval)
        results[v]["clean_reference"] = f"{ref_name}-clean"
    table = _table(results, variants)
    targets, findings = _judge(results, variants)
    plots = [_plot(bench, clean, bad, corrupt_at, interval)]
    notes = [
        f"2 replicas, {steps} steps, sync every H = {interval} steps, validation at every "
        f"sync. Replica 1's pseudo-gradient is scaled by {SCALE:g} just before syncs "
        f"{', '.join(map(str, corrupt_at))} (0-based sync index; sync k ends step "
        f"(k + 1) x H).",
        f"Anomaly detector: `sync.ewma_warmup_steps = {warmup}` syncs, "
        f"`sync.ewma_alpha = {alpha}`, `sync.ewma_threshold = {threshold}` (the "
        "detector's statistics start from its first observations; a short warm-up sees "
        "few of them).",
        "Peak increase: the largest (corrupted - clean) validation loss over the evaluations "
        "from the first corrupted sync on, at equal steps; relative = over the clean loss "
        "there. Jump: validation loss right after a corrupted sync minus right before it "
        "(the evaluation at the previous sync), largest over the corrupted syncs.",
        "Ablations (`edit-no-...`) are compared with "
        + ("their own clean runs." if clean_ablations else
           "the clean `edit` run (without an anomaly, switching one penalty part off changes "
           "the clean run very little; full size runs their own clean runs)."),
        "Excluded: units of replica 1 the detector flagged at the corrupted syncs (out of "
        "all units); false alarms: flags at any other sync or replica.",
    ]
    settings = {"steps": steps, "sync_interval": interval, "corrupt_syncs": corrupt_at,
                "scale": SCALE, "ewma_warmup_steps": warmup, "ewma_alpha": alpha,
                "variants": {v: VARIANTS[v] for v in variants}}
    return bench.finish(settings=settings, methods=variants, results=results,
                        tables=[("Validation-loss spikes", table)], targets=targets,
                        findings=findings, notes=notes, plots=plots, description=DESCRIPTION,
                        headline=[f"Replica 1's pseudo-gradient x{SCALE:g} at syncs "
                                  f"{', '.join(map(str, corrupt_at))}: peak validation-loss "
                                  "increase over a clean run "
                                  + ", ".join(f"{v} {cell(results[v]['peak_increase'])}"
                                              for v in variants) + "."])


def _evals_by_step(run: Run | None) -> dict[int, float]:
    """Validation loss by step of a run (empty for a missing or failed run)."""
    if run is None or not run.ok:
        return {}
    return {int(r["step"]): float(r["val_loss"]) for r in run.evals
            if r.get("val_loss") is not None and "step" in r}


def _measure(clean: Run | None, bad: Run, corrupt_at: list[int],
             interval: int) -> dict[str, Any]:
    """Peak increase over the clean run, jumps at corrupted syncs, detector flags."""
    c, b = _evals_by_step(clean), _evals_by_step(bad)
    first = (min(corrupt_at) + 1) * interval
    diffs = {s: b[s] - c[s] for s in b if s in c and s >= first}
    peak_step = max(diffs, key=diffs.get) if diffs else None
    peak = max(0.0, diffs[peak_step]) if peak_step is not None else None
    jumps = []
    for k in corrupt_at:
        after, before = (k + 1) * interval, k * interval
        if after in b and before in b:
            jumps.append(b[after] - b[before])
    excluded, units, false_alarms = 0, 0, 0
    for r in bad.rows:
        s = r.get("sync")
        if not isinstance(s, dict) or s.get("outlier") is None:
            continue
        flags = s["outlier"]
        idx = s.get("sync")
        for rep, row in enumerate(flags):
            for f in row:
                if idx in corrupt_at and rep == 1:
                    units += 1
                    excluded += bool(f)
                else:
                    false_alarms += bool(f)
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


def _table(results: dict[str, Any], variants: tuple[str, ...]) -> str:
    """The Markdown table: one row per variant."""
    rows = []
    for v in variants:
        e = results[v]
        rows.append([v, e["peak_increase"], e["peak_relative"], e["max_jump"],
                     e["final_val_loss"], e["clean_final_val_loss"],
                     None if e["corrupted_units"] is None
                     else f"{e['excluded_units']}/{e['corrupted_units']}",
                     e["false_alarms"]])
    return md_table(["method", "peak val-loss increase", "relative", "max jump at a "
                     "corrupted sync", "final val loss", "clean final val loss",
                     "excluded", "false alarms"], rows)


def _judge(results: dict[str, Any],
           variants: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[str]]:
    """The target check (edit's peak < 25% of diloco's) and the findings."""
    d, e = results["diloco"]["peak_increase"], results["edit"]["peak_increase"]
    if d is None or e is None:
        met, detail = None, "a run failed"
    elif d <= 0:
        met, detail = None, "the corruption did not raise diloco's validation loss"
    else:
        met = e < 0.25 * d
        detail = f"edit {e:.4f} vs diloco {d:.4f} ({e / d:.0%} of diloco's)"
    targets = [{"name": "edit's peak validation-loss increase < 25% of diloco's", "met": met,
                "detail": detail}]
    findings = []
    for v in variants:
        x = results[v]
        if x["peak_increase"] is not None:
            findings.append(f"{v}: peak increase {cell(x['peak_increase'])} "
                            f"({cell(x['peak_relative'])} relative), largest jump at a "
                            f"corrupted sync {cell(x['max_jump'])}.")
    return targets, findings


def _plot(bench: Bench, clean: dict[str, Run], bad: dict[str, Run], corrupt_at: list[int],
          interval: int):
    """Validation loss against steps, corrupted (solid) and clean (dashed) runs."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for v, r in bad.items():
        pts = sorted(_evals_by_step(r).items())
        if pts:
            line, = ax.plot(*zip(*pts), marker="o", markersize=2.5, label=f"{v} (corrupted)")
            ref = _evals_by_step(clean.get(v))
            if ref:
                ax.plot(*zip(*sorted(ref.items())), linestyle="--", color=line.get_color(),
                        alpha=0.6, label=f"{v} (clean)")
    for k in corrupt_at:
        ax.axvline((k + 1) * interval, color="red", alpha=0.25)
    ax.set_xlabel("step (red: corrupted syncs)")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    return save_figure(fig, bench.out_dir / "val_loss_spikes.png")
