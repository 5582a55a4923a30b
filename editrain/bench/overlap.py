"""Overlap: how long the forward waits at a layer-wise sync, against the prefetch depth.

``edit`` syncs unit by unit inside the next forward; with prefetch depth ``d`` the
collectives of the next ``d`` units are in flight while the current unit computes. Under a
slow link, the forward's wait at a sync step is compared with the time ``diloco`` blocks
for the same sync at the step boundary, on the same model.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.options import timed_train
from editrain.bench.prose import fill, prose
from editrain.bench.runs import Run
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict, figure
from editrain.bench.stats import median
from editrain.bench.tables import cell, entry_cell, ms

TEXT = prose("overlap")
LINK = ("20MB/s", "5ms")
SYNC_FIELDS = ("wait_s", "sync_time_s", "comm_time_s", "link_delay_s", "bytes_sent")
"""The per-sync fields whose medians are measured (``median_<field>``)."""


def _setup(bench: Any) -> dict[str, Any]:
    interval = bench.pick(4, 8, 10)
    steps = bench.pick(3 * interval, 7 * interval, 8 * interval)
    common = {"train": timed_train(steps),
              "sync": {"local_sgd_sync_interval": interval},
              "sim": {"link_bandwidth": LINK[0], "link_latency": LINK[1]}}
    return {"interval": interval, "steps": steps, "common": common,
            "depths": bench.pick((1,), (0, 1, 2, 3), (0, 1, 2, 3))}


def _runs(ctx: Ctx) -> list[Job]:
    return [Job("diloco", (ctx.common, {"sync": {"method": "diloco"}}))] + [
        Job(f"edit-prefetch{d}", (ctx.common, {"sync": {"method": "edit", "prefetch_depth": d}}))
        for d in ctx.depths]


def _results(ctx: Ctx) -> dict[str, Any]:
    results = {label: _measure(r) for label, r in ctx.runs.items()}
    blocking = results["diloco"]["median_sync_time_s"]
    for e in results.values():
        e["wait_vs_diloco"] = (e["median_wait_s"] / blocking
                               if e["median_wait_s"] is not None and blocking else None)
    ctx.units = _unit_bytes(ctx.bench, ctx.common)
    return results


def _notes(ctx: Ctx) -> list[str]:
    notes = fill(TEXT["notes"], ctx=ctx, link=LINK)
    return notes + [fill(TEXT["units_note"], units=ctx.units)] if ctx.units else notes


def _measure(run: Run) -> dict[str, Any]:
    """Medians of the per-sync fields of one run (None for a failed run).

    The syncs that ran inside a training step, less the first (it also absorbs the
    replicas' start-up skew) and the last (``finish()``'s, blocking for every method)."""
    rows = run.rows if run.ok else []
    last_step = rows[-1]["step"] if rows else None
    timed = [(i, s) for i, s in run.timed_syncs() if s.get("step") != last_step][1:] \
        if rows else []
    with_sync = {i for i, r in enumerate(rows) if "sync" in r}
    plain = median(r.get("step_time_s") for i, r in enumerate(rows)
                   if i not in with_sync and i >= 2)
    sync_step = median(rows[i].get("step_time_s") for i, _ in timed)
    options = run.config if run.ok else run.overrides
    return {**{f"median_{key}": median(s.get(key) for _, s in timed) for key in SYNC_FIELDS},
            "sync_step_overhead_s": sync_step - plain if sync_step is not None
            and plain is not None else None,
            "median_step_time_s": plain, "syncs": len(timed),
            "prefetch_depth": options.get("sync", {}).get("prefetch_depth"), "error": run.error}


def _unit_bytes(bench: Any, common: dict[str, Any]) -> dict[str, Any] | None:
    """Number of sync units and the root unit's share of the bytes, for this model."""
    try:
        from editrain.config import load_config, model_config
        from editrain.models import Llama

        cfg = load_config(None, bench.options(common))
        model = Llama(model_config(cfg))
        blocks = model.blocks()
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        total = sum(p.numel() for p in model.parameters())
        root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
        return {"count": 1 + len(blocks), "root_share": root / total, "params": total}
    except Exception:  # informational only
        return None


def _judge(ctx: Ctx) -> Verdict:
    """The target check and the findings, from the numbers."""
    results, units = ctx.results, ctx.units
    blocking = results["diloco"]["median_sync_time_s"]
    waits = {d: results[f"edit-prefetch{d}"]["median_wait_s"] for d in ctx.depths}
    overlapped = {d: w for d, w in waits.items() if d >= 1 and w is not None}
    if blocking is None or not overlapped:
        met, detail = None, TEXT["no_target"]
    else:
        best = min(overlapped, key=overlapped.get)
        met = overlapped[best] < blocking
        detail = fill(TEXT["detail"], best=best, wait=overlapped[best] * 1000,
                      blocking=blocking * 1000)
    findings, said = [], TEXT["findings"]
    if blocking is not None:
        parts = [f"depth {d}: {cell(ms(w))} ms ({cell(w / blocking if w else None)}x)"
                 for d, w in waits.items()]
        findings.append(fill(said["waits"], blocking=blocking * 1000, parts=", ".join(parts)))
    known = [(d, w) for d, w in waits.items() if w is not None]
    if len(known) >= 2:
        decreasing = all(b[1] <= a[1] * 1.05 for a, b in zip(known, known[1:]))
        findings.append(said["falls" if decreasing else "not_falls"])
    # The root unit's transfer is never hidden: a shortfall as well as a finding.
    hidden = [fill(said["root"], units=units)] if units and units["root_share"] > 0.3 else []
    return Verdict(targets=[{"name": TEXT["target"], "met": met, "detail": detail}],
                   findings=findings + hidden, shortfalls=hidden)


def _plot(ctx: Ctx):
    """edit's wait against the prefetch depth, diloco's blocking time dashed."""
    with figure(ctx, "wait_vs_prefetch.png",
                "prefetch depth (units in flight ahead of the computing one)",
                "ms per sync (median)") as ax:
        ys = [ms(ctx.results[f"edit-prefetch{d}"]["median_wait_s"]) for d in ctx.depths]
        ax.plot(list(ctx.depths), [float("nan") if y is None else y for y in ys], marker="o",
                label="edit: forward wait at a sync step")
        b = ms(ctx.results["diloco"]["median_sync_time_s"])
        if b is not None:
            ax.axhline(b, color="gray", linestyle="--", label="diloco: blocking sync")
        ax.set_xticks(list(ctx.depths))
        ax.set_ylim(bottom=0)
    return ctx.plot



SCENARIO = Scenario(
    name="overlap",
    description=TEXT["description"],
    setup=_setup, runs=_runs, measure=_results, judge=_judge, notes=_notes, plots=[_plot],
    checks=lambda ctx: [((ctx.common, {"sync": {"method": "edit",
                                                "prefetch_depth": max(ctx.depths)}}), None)],
    tables=[Table("Wait at a sync step", [
        ("method", None),
        ("prefetch depth", lambda row: "blocking" if row[0] == "diloco"
         else row[1]["prefetch_depth"]),
        ("wait ms (median)", entry_cell("median_wait_s", ms)),
        ("wait / diloco blocking", "wait_vs_diloco"),
        ("sync time ms", entry_cell("median_sync_time_s", ms)),
        ("comm ms", entry_cell("median_comm_time_s", ms)),
        ("link delay ms", entry_cell("median_link_delay_s", ms)),
        ("sync-step overhead ms", entry_cell("sync_step_overhead_s", ms)),
        ("plain step ms", entry_cell("median_step_time_s", ms)), ("syncs", "syncs")])],
    settings=lambda ctx: {"steps": ctx.steps, "sync_interval": ctx.interval,
                          "link": "+".join(LINK), "prefetch_depths": list(ctx.depths),
                          "units": ctx.units},
    methods=lambda ctx: ["diloco"] + [f"edit-prefetch{d}" for d in ctx.depths],
)
