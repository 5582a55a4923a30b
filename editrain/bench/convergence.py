"""Convergence: validation loss against tokens for every method at an equal token budget.

Every method trains the same model on the same data with the same seeds and tokens; the
tables give the final validation loss over seeds and, per seed, the paired difference
against each of ``REFERENCES``; the plot the loss against tokens (mean over seeds).
``bench scale`` and ``bench batch`` build their runs with :func:`variant_layers` (on the
tiny preset scale's runs are this scenario's, so ``--reuse`` reads them back); the helpers
of the paired comparison that tune, scale, batch and optimizers share are here too.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.measures import aedit_period, val_curve
from editrain.bench.options import pick_names, seed_count
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict, figure
from editrain.bench.stats import mean_std, median, paired_differences
from editrain.bench.tables import best_first, mean_pm, per_seed, spread_columns

TEXT = prose("convergence")
STREAMING = {"fragments": 3, "comm_dtype": "int8"}
"""Streaming settings (the tiny preset has 3 sync units: root, 2 blocks); overlap_steps is
H / 8 (at least 1), the share of the bandwidth scenario's 4 of 32."""
RECIPE_SYNC: dict[str, Any] = {"method": "edit", "outer_optim_class": "sgd",
                               "outer_optim_kwargs": {"lr": 1.0, "momentum": 0.0}}
"""The recipe's outer optimizer, spelled out (independent of EDiT's defaults); the warm-up
and H are set per run (``RECIPE_H``)."""
VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"method": "sync"},
    "post_local_sgd": {"method": "post_local_sgd"},
    "diloco": {"method": "diloco"},
    "edit": {"method": "edit"},
    "aedit": {"method": "aedit"},
    "edit-streaming": {"method": "edit", **STREAMING, "merge": "keep_local"},
    "edit-streaming-blend": {"method": "edit", **STREAMING, "merge": "blend"},
    "edit-streaming-int4": {"method": "edit", **STREAMING, "merge": "keep_local",
                            "comm_dtype": "int4"},
    "aedit-nonblocking": {"method": "aedit", "overlap_steps": 2, "merge": "keep_local"},
    "edit-topk2": {"method": "edit", "comm_dtype": "topk2"},
    "edit-sparse": {"method": "edit", "comm_dtype": "topk2", "merge": "keep_local"},
    "edit-eager": {"method": "edit", "merge": "eager"},
    "edit-sparse-eager": {"method": "edit", "comm_dtype": "topk2", "merge": "eager"},
    "edit-recipe": RECIPE_SYNC,
    "edit-recipe-h10": RECIPE_SYNC,
}
"""Each variant's sync options (``overlap_steps`` and the recipe's H and warm-up are set per
run by :func:`variant_layers`; the record's notes say what each variant is). The recipe's
inner learning rate is left out: sync shares it, and alone it moved the gap by 0.1%."""
RECIPE_H: dict[str, int] = {"edit-recipe": 20, "edit-recipe-h10": 10}
"""H of each recipe variant (20: the tuning study's best level; ``edit-recipe-h10``: syncs
twice as often); the other variants use the scenario's H."""
METHODS = tuple(VARIANTS)
REFERENCES = ("diloco", "sync", "edit", "edit-streaming")
"""Methods every other method is compared with, seed by seed (those that ran)."""
COMPARED = ("edit", "aedit", "aedit-nonblocking", *(m for m in METHODS if m.startswith("edit-")))
"""The methods whose paired differences the findings spell out, in this order."""
RECIPE_GAP = 0.02
"""The recipe's target: EDiT within 2% of synchronous training's validation loss."""


def common_options(bench: Bench) -> tuple[dict[str, Any], int, int, int]:
    """The options every run of the scenario shares at this size, with the run length, the
    local-SGD methods' H and the evaluation interval: ``(options, steps, H, eval_every)``."""
    steps, eval_every = bench.pick(12, 120, 2000), bench.pick(4, 10, 100)
    common = {"train": {"steps": steps, "eval_every": eval_every,
                        "warmup_steps": bench.pick(2, 10, 100)},
              # The tiny preset at every size: a credible number of steps fits in an hour.
              "model": {"preset": "tiny"}}
    return common, steps, bench.pick(4, 10, 50), eval_every


def variant_layers(method: str, seed: int, steps: int, interval: int) -> list[dict[str, Any]]:
    """The option layers of one variant's run (after the scenario's common options): the
    seed and the variant's sync options, the scenario's H for local SGD (``interval``), the
    recipe's H and warm-up (a quarter of ``steps``); A-EDiT's period is the caller's."""
    sync = dict(VARIANTS[method])
    if "fragments" in sync:
        sync["overlap_steps"] = max(1, interval // 8)
    if method == "edit-sparse":
        sync["overlap_steps"] = interval - 1
    if sync.get("merge") == "eager":
        sync["overlap_steps"] = interval  # a whole round in flight
    layers: list[dict[str, Any]] = [{"train": {"seed": seed}, "sync": sync}]
    if sync["method"] != "sync":
        layers.append({"sync": {"local_sgd_sync_interval": interval}})
    if method in RECIPE_H:
        layers.append({"sync": {"local_sgd_sync_interval": RECIPE_H[method],
                                "local_sgd_warmup_steps": steps // 4}})
    return layers


def chosen_variants(bench: Bench) -> list[str]:
    """The variants to run: ``--methods A,B`` (in this scenario's order), else every one
    (the tiny size: the five methods only; the streaming variants need H > 4 steps).

    Raises:
        ConfigError: ``--methods`` names a variant this scenario does not have.
    """
    chosen = bench.flags.get("methods")
    if not chosen:
        return [m for m in METHODS if bench.mode != "tiny" or "-" not in m]
    return pick_names(chosen, METHODS, "--methods", "variant")


def _setup(bench: Bench) -> dict[str, Any]:
    common, steps, interval, eval_every = common_options(bench)
    seeds, variants = seed_count(bench, 1, 1, 3), chosen_variants(bench)
    if bench.mode == "full":
        bench.log(fill(TEXT["full_size"], runs=seeds * len(variants), steps=steps,
                       variants=len(variants), seeds=seeds))
    return {"common": common, "steps": steps, "interval": interval, "eval_every": eval_every,
            "seeds": seeds, "variants": variants, "periods": []}


def _runs(ctx: Ctx):
    """Every variant of a seed before the next seed; A-EDiT's period from that seed's EDiT."""
    for seed in range(ctx.seeds):
        edit_run = None
        for method in ctx.variants:
            layers = [ctx.common, *variant_layers(method, seed, ctx.steps, ctx.interval)]
            if VARIANTS[method]["method"] == "aedit":
                period = aedit_period(edit_run, ctx.interval)
                if method == "aedit":
                    ctx.periods.append(period)
                layers.append({"sync": {"local_sgd_sync_time": period}})
            r = yield Job(f"{method}-seed{seed}", layers, title=f"{method} seed {seed}")
            if method == "edit" and r.ok:
                edit_run = r


def _results(ctx: Ctx) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for method in ctx.variants:
        runs = [ctx.runs[f"{method}-seed{s}"] for s in range(ctx.seeds)]
        ok = [r for r in runs if r.ok]
        wall = mean_std(r.summary.get("wall_time_s") for r in ok)["mean"]
        tokens = ok[0].summary.get("tokens") if ok else None
        curve = _mean_curve([val_curve(r) for r in ok])
        results[method] = {
            "final_val_loss": mean_std(r.final_val_loss for r in ok),
            "final_val_loss_per_seed": [r.final_val_loss for r in runs],
            "initial_val_loss": median(r.initial_val_loss for r in ok),
            "val_tokens": ok[0].summary.get("val_tokens") if ok else None,
            "tokens": tokens, "wall_time_s": wall,
            "tokens_per_s": (tokens / wall) if tokens and wall else None,
            "num_syncs": median(r.summary.get("num_syncs") for r in ok),
            "curve_tokens": [c[0] for c in curve], "curve_val_loss": [c[1] for c in curve],
            "failed_seeds": [i for i, r in enumerate(runs) if not r.ok],
        }
    for method in ctx.variants:
        for ref in (r for r in REFERENCES if r in results):
            results[method][f"paired_vs_{ref}"] = paired_differences(
                results[method]["final_val_loss_per_seed"],
                results[ref]["final_val_loss_per_seed"])
    return results


def _mean_curve(curves: list[list[tuple[float, float, float]]]) -> list[tuple[float, float]]:
    """Mean validation loss over seeds on the first curve's token points."""
    import numpy as np

    curves = [c for c in curves if c]
    if not curves:
        return []
    grid = np.array([c[0] for c in curves[0]])
    mean = np.mean([np.interp(grid, [p[0] for p in c], [p[2] for p in c]) for c in curves], axis=0)
    return [(float(x), float(y)) for x, y in zip(grid, mean)]


def _paired(results: dict[str, Any], methods):
    """``(method, reference, difference)`` of each of ``methods`` against each reference
    that ran (a record from before a reference was added has no differences against it)."""
    return [(m, ref, results[m][f"paired_vs_{ref}"]) for m in methods if m in results
            for ref in REFERENCES if m != ref and f"paired_vs_{ref}" in results[m]]


def _judge(ctx: Ctx) -> Verdict:
    results, seeds = ctx.results, ctx.seeds
    findings, worse = _findings(results, seeds)
    return Verdict(
        targets=[_target(results, seeds)] + [recipe_target(results, v) for v in RECIPE_H
                                             if v in results],
        findings=findings, headline=_headline(results, seeds, ctx.steps),
        shortfalls=[worse[m] for m in ("edit", "aedit") if m in worse])


def _findings(results: dict[str, Any], seeds: int) -> tuple[list[str], dict[str, str]]:
    """Plain sentences comparing the methods, generated from the numbers, and (method ->
    sentence) those of the methods whose loss got worse while training went on."""
    said = TEXT["findings"]
    means = {m: r["final_val_loss"]["mean"] for m, r in results.items()
             if r["final_val_loss"]["mean"] is not None}
    out = [fill(said["best_first"], losses=best_first(means))] if means else []
    for a, ref, d in _paired(results, COMPARED):
        if d["mean"] is None:
            continue
        text = fill(said["compared"], a=a, ref=ref, size=abs(d["mean"]),
                    verdict="better" if d["mean"] < 0 else "worse")
        if seeds > 1:
            text += fill(said["paired"], d=d, agree="every seed agrees" if d["same_sign"]
                         else "the seeds disagree")
        out.append(text + ".")
    worse = {m: _got_worse(m, r) for m, r in results.items()}
    worse = {m: text for m, text in worse.items() if text}
    out += worse.values()
    ref = (results.get("sync") or {}).get("tokens")
    got = (results.get("aedit") or {}).get("tokens")
    if ref and got and got != ref:
        out.append(fill(said["aedit_tokens"], got=got, ref=ref, change=got / ref - 1))
    if seeds == 1:
        out.append(said["one_seed"])
    return out, worse


def _got_worse(method: str, result: dict[str, Any]) -> str | None:
    """The finding that ``method``'s loss ended more than 0.02 above its best, or None."""
    curve = list(zip(result["curve_tokens"], result["curve_val_loss"]))
    if len(curve) < 3:
        return None
    best_tokens, best = min(curve, key=lambda p: p[1])
    if curve[-1][1] <= best + 0.02:
        return None
    return fill(TEXT["findings"]["got_worse"], m=method, above=curve[-1][1] - best, best=best,
                best_tokens=best_tokens)


def _headline(results: dict[str, Any], seeds: int, steps: int) -> list[str]:
    """The report's summary: the losses, the recipes' targets, streaming EDiT's gaps."""
    if any(r["final_val_loss"]["mean"] is None for r in results.values()):
        return []
    losses = ", ".join(f"{m} {mean_pm(r['final_val_loss'])}" for m, r in results.items())
    e = results.get("edit") or {}
    pairs = "; ".join(f"edit - {ref} per seed {mean_pm(e[f'paired_vs_{ref}'])}"
                      for ref in ("diloco", "sync") if f"paired_vs_{ref}" in e)
    said = TEXT["headline"]
    out = [fill(said["losses"], steps=steps, seeds=seeds, losses=losses,
                pairs=f"; {pairs}" if pairs else "")]
    for variant in RECIPE_H:
        t = recipe_target(results, variant)
        if t["met"] is not None:
            out.append(fill(said["recipe"], h=RECIPE_H[variant], detail=t["detail"]))
    if all(m in results for m in ("edit-streaming", "edit", "diloco")):
        s = results["edit-streaming"]
        out.append(fill(said["streaming"], vs_edit=mean_pm(s["paired_vs_edit"]),
                        streaming=_streaming_text(), vs_diloco=mean_pm(s["paired_vs_diloco"])))
    return out


def _target(results: dict[str, Any], seeds: int) -> dict[str, Any]:
    """edit no worse than diloco: the mean paired difference is at most its std over seeds
    (at most 0.5% of diloco's loss with one seed)."""
    name = TEXT["targets"]["edit"]
    if "edit" not in results or "diloco" not in results:
        return {"name": name, "met": None, "detail": "edit or diloco was not run"}
    d = results["edit"]["paired_vs_diloco"]
    ref = results["diloco"]["final_val_loss"]["mean"]
    if d["mean"] is None or ref is None:
        return {"name": name, "met": None, "detail": "a run failed"}
    tol = (d["std"] or 0.0) if seeds > 1 else 0.005 * ref
    return {"name": name, "met": d["mean"] <= tol,
            "detail": fill(TEXT["targets"]["edit_detail"], pm=mean_pm(d), d=d, tol=tol)}


def recipe_target(results: dict[str, Any], variant: str = "edit-recipe") -> dict[str, Any]:
    """``variant`` (a recipe variant) within ``RECIPE_GAP`` of sync's final validation loss
    (the mean of the per-seed paired differences, relative to sync's mean) and below
    diloco's."""
    h = f" (H = {RECIPE_H[variant]})" if variant in RECIPE_H else ""
    name = fill(TEXT["targets"]["recipe"], variant=variant, h=h, gap=RECIPE_GAP)
    r = results.get(variant) or {}
    vs_sync, vs_diloco = r.get("paired_vs_sync"), r.get("paired_vs_diloco")
    if not vs_sync or not vs_diloco or vs_sync["mean"] is None or vs_diloco["mean"] is None:
        return {"name": name, "met": None, "detail": f"sync, diloco or {variant} did not run"}
    gap = vs_sync["mean"] / results["sync"]["final_val_loss"]["mean"]
    return {"name": name, "met": gap <= RECIPE_GAP and vs_diloco["mean"] < 0,
            "detail": fill(TEXT["targets"]["recipe_detail"], variant=variant, gap=gap,
                           vs_sync=mean_pm(vs_sync), vs_diloco=mean_pm(vs_diloco))}


def _streaming_text() -> str:
    return ", ".join(f"{k} {v}" for k, v in STREAMING.items())


def _notes(ctx: Ctx) -> list[str]:
    periods = f" ({', '.join(f'{p:.2f}' for p in ctx.periods)} s)" if ctx.periods else ""
    return fill(TEXT["notes"], ctx=ctx, last_seed=ctx.seeds - 1, periods=periods,
                tiny=TEXT["tiny_validation"] if ctx.bench.mode == "tiny" else "",
                one_seed=TEXT["one_seed_note"] if ctx.seeds == 1 else "",
                overlap=max(1, ctx.interval // 8), sparse_overlap=ctx.interval - 1,
                streaming=_streaming_text(), warmup=ctx.steps // 4,
                recipe_h=RECIPE_H["edit-recipe"])


def _h(ctx: Ctx, method: str) -> str:
    """The H column: 1 for sync, A-EDiT's time period, the recipe's H or the scenario's."""
    if method == "sync":
        return "1"
    if method == "aedit" and ctx.periods:
        return f"~{ctx.interval} (time: {ctx.periods[0]:.2f} s)"
    return str(RECIPE_H.get(method, ctx.interval))


def _plot(ctx: Ctx):
    """Validation loss against tokens (mean over seeds), one line per method."""
    with figure(ctx, "val_loss_vs_tokens.png", "tokens (all replicas)",
                "validation loss (mean over seeds)", title="convergence at equal tokens") as ax:
        for method, res in ctx.results.items():
            if res["curve_tokens"]:
                ax.plot(res["curve_tokens"], res["curve_val_loss"], marker="o", markersize=3,
                        label=method)
    return ctx.plot


SCENARIO = Scenario(
    name="convergence",
    description=TEXT["description"],
    setup=_setup, runs=_runs, measure=_results, judge=_judge, notes=_notes, plots=[_plot],
    checks=lambda ctx: [((ctx.common, {"sync": {"local_sgd_sync_interval": ctx.interval}}),
                         None)],
    planned=lambda ctx: ctx.seeds * len(ctx.variants),
    tables=[
        Table("Final validation loss at equal tokens", [
            ("method", None), ("H", lambda row: row[2]),
            ("final val loss (mean +- std)", lambda row: mean_pm(row[1]["final_val_loss"])),
            *spread_columns("final_val_loss_per_seed"),
            ("tokens", "tokens"), ("wall s (mean)", "wall_time_s"), ("syncs", "num_syncs")],
              rows=lambda ctx: [(m, e, _h(ctx, m)) for m, e in ctx.results.items()]),
        Table("Paired differences per seed (method - reference; negative: method better)", [
            ("method", lambda row: row[0]), ("vs", lambda row: row[1]),
            ("difference (mean +- std)", lambda row: mean_pm(row[2])),
            ("per seed", lambda row: per_seed(row[2])),
            ("same sign", lambda row: row[2]["same_sign"] if row[3] else "n/a (1 seed)")],
              rows=lambda ctx: [(*p, ctx.seeds > 1) for p in _paired(ctx.results, ctx.results)])],
    settings=lambda ctx: {"steps": ctx.steps, "sync_interval": ctx.interval,
                          "eval_every": ctx.eval_every, "seeds": ctx.seeds,
                          "aedit_sync_time_s": ctx.periods},
    methods=lambda ctx: tuple(ctx.variants),
)
