"""Tune: what closes the gap between EDiT and synchronous training at equal tokens.

A one-factor-at-a-time study around a base setting (EDiT with its defaults before this
study made its recipe them: no synchronous warm-up, H = the size's interval, Nesterov outer
SGD at lr 0.7 and momentum 0.9, the penalty on; pinned, so the study measures the same
base whatever the defaults): each factor is moved alone to each of its levels, every run is
paired with synchronous training on the same model, data, tokens and seed, and the table
gives the paired gap ``edit - sync`` (absolute and as a share of sync's loss). A last run
combines each factor's best level (the *recipe*) and measures its gap the same way.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.options import seed_count
from editrain.bench.plots import pyplot, save_figure
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict
from editrain.bench.stats import gap_to_sync, seed_losses
from editrain.bench.tables import per_seed, percent

TEXT = prose("tune")
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
"""The base's outer SGD (Nesterov; EDiT's default until the study's recipe replaced it)."""
BLOCKS_SHAPE = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 344}
"""A shape whose parameters are mostly in the blocks (73% at the quick size's 2,048-token
vocabulary, against 36% for the tiny preset)."""
SYNC = {"sync": {"method": "sync"}}
SYNC_FACTORS = ("tokens", "shape")
"""Factors that change what synchronous training runs too (its own run per level); they are
not settings of the method, so the recipe keeps their base level."""


def factors(bench: Bench, steps: int, interval: int) -> dict[str, list[tuple[str, dict]]]:
    """Each factor's levels as ``(label, option layer)``; the first level is the base."""
    lr = 3e-3  # train.lr's default

    def outer(lr_: float, momentum: float) -> dict[str, Any]:
        return {"sync": {"outer_optim_kwargs": {"lr": lr_, "momentum": momentum,
                                                "nesterov": momentum > 0}}}

    warmup = [("0", {})] + [(f"{w}", {"sync": {"local_sgd_warmup_steps": w}})
                            for w in sorted({max(1, steps // 10), max(2, steps // 4)})]
    if bench.mode == "tiny":
        return {"warmup": warmup[:2]}  # the smoke test: one level moved
    return {
        "warmup": warmup,
        # The outer lr and momentum are one factor: the best lr depends on the momentum
        # (a recipe that took each from its own row combined two settings never measured
        # together, and did worse than either).
        "outer": [(f"lr{OUTER_LR}-m{OUTER_MOMENTUM}", {})] + [
            (f"lr{x}-m{m}", outer(x, m))
            for x, m in ((0.4, 0.9), (1.0, 0.9), (0.7, 0.5), (0.7, 0.0), (1.0, 0.0))],
        "H": [(f"{interval}", {})] + [(f"{h}", {"sync": {"local_sgd_sync_interval": h}})
                                      for h in (max(2, interval // 2), interval * 2)],
        "inner_lr": [(f"{lr:g}", {})] + [(f"{x:g}", {"train": {"lr": x}})
                                         for x in (lr / 2, lr * 2)],
        "penalty": [("on", {}), ("off", {"sync": {"pseudo_gradnorm_reduce": False,
                                                  "skip_anomaly": False,
                                                  "clip_pseudo_grad": 0.0}})],
        "tokens": [("1x", {})] + [(f"{k}x", {"train": {"steps": steps * k,
                                                        "eval_every": steps * k}})
                                  for k in (2, 4)],
        "shape": [("tiny", {}), ("blocks", {"model": dict(BLOCKS_SHAPE)})],
    }


def _setup(bench: Bench) -> dict[str, Any]:
    steps, interval = bench.pick(12, 120, 2000), bench.pick(4, 10, 50)
    return {"steps": steps, "interval": interval,
            "seeds": seed_count(bench, 1, 2, 3),
            "common": {"train": {"steps": steps, "eval_every": steps,
                                 "warmup_steps": bench.pick(2, 10, 100)},
                       "model": {"preset": "tiny"}},
            "base": {"sync": {"method": "edit", "local_sgd_sync_interval": interval,
                              "outer_optim_kwargs": {"lr": OUTER_LR,
                                                     "momentum": OUTER_MOMENTUM,
                                                     "nesterov": True}}},
            "grid": factors(bench, steps, interval), "rows": {}}


def _moved(grid: dict[str, list[tuple[str, dict]]]) -> list[tuple[str, str, dict]]:
    """``(factor, level, layer)`` of every level but the base's."""
    return [(f, label, layer) for f, levels in grid.items() for label, layer in levels[1:]]


def _planned(ctx: Ctx) -> int:
    """Per seed: sync and edit at the base, every other level of every factor, the sync runs
    of the levels that change sync's run too, and the recipe."""
    moved = _moved(ctx.grid)
    return ctx.seeds * (2 + len(moved) + 2 * sum(f in SYNC_FACTORS for f, _, _ in moved) + 1)


def _runs(ctx: Ctx):
    """The one-factor runs, seed by seed; then the recipe's, which depend on their rows
    (``ctx.rows``)."""
    grid, base, rows = ctx.grid, ctx.base, ctx.rows

    def job(label: str, seed: int, *layers: dict) -> Job:
        return Job(f"{label}-seed{seed}", (ctx.common, *layers, {"train": {"seed": seed}}),
                   title=f"{label} seed {seed}")

    def row(edit: str, sync: str) -> dict[str, Any]:
        """The paired row of two labels' runs (every seed)."""
        return _row(*(seed_losses([ctx.runs[f"{label}-seed{s}"] for s in range(ctx.seeds)])
                      for label in (edit, sync)))

    for seed in range(ctx.seeds):
        yield job("sync", seed, SYNC)
        yield job("edit", seed, base)
        for factor, level, layer in _moved(grid):
            yield job(f"edit-{factor}-{level}", seed, base, layer)
            if factor in SYNC_FACTORS:
                yield job(f"sync-{factor}-{level}", seed, SYNC, layer)
    rows[("base", "")] = row("edit", "sync")
    for factor, level, _ in _moved(grid):
        rows[(factor, level)] = row(f"edit-{factor}-{level}", f"sync-{factor}-{level}"
                                    if factor in SYNC_FACTORS else "sync")
    ctx.recipe = _recipe(grid, rows)
    recipe = recipe_options(grid, ctx.recipe)
    label = "+".join(f"{f}={v}" for f, v in ctx.recipe.items() if v != grid[f][0][0]) or "base"
    if recipe:
        for seed in range(ctx.seeds):
            yield job("edit-recipe", seed, base, *recipe)
    # (no level beat the base: the recipe is the base, its runs the base's)
    rows[("recipe", label)] = row("edit-recipe" if recipe else "edit", "sync")
    # The recipe at every other length and shape, against sync at that length and shape:
    # does what closes the gap at the base still close it with more tokens, another model?
    for factor, level, layer in _moved(grid) if recipe else ():
        if factor in SYNC_FACTORS:
            for seed in range(ctx.seeds):
                yield job(f"edit-recipe-{factor}-{level}", seed, base, *recipe, layer)
            rows[(f"recipe, {factor}", level)] = row(f"edit-recipe-{factor}-{level}",
                                                     f"sync-{factor}-{level}")


def _row(edit: list[float | None], sync: list[float | None]) -> dict[str, Any]:
    """Losses, the paired gap and the gap relative to sync's mean loss."""
    return {**gap_to_sync(edit, sync), "edit_per_seed": edit, "sync_per_seed": sync}


def recipe_options(grid: dict[str, list[tuple[str, dict]]], recipe: dict[str, str]
                   ) -> list[dict[str, Any]]:
    """The option layers of a recipe: each factor at its chosen level, nothing for a factor
    at its base level. Factors never set the same option (the outer lr and momentum are
    one factor), so the layers compose without one overriding another."""
    return [layer for f, label in recipe.items()
            for lab, layer in grid[f] if lab == label and label != grid[f][0][0]]


def _recipe(grid: dict[str, list[tuple[str, dict]]],
            rows: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
    """Per factor, the level with the smallest mean relative gap (the base's level when no
    other does better). Tokens and shape are not settings of the method: the recipe keeps
    the base's."""
    out = {}
    for factor, levels in grid.items():
        gaps = {levels[0][0]: rows[("base", "")]["relative_gap"]}
        if factor not in SYNC_FACTORS:
            gaps.update((label, rows[(factor, label)]["relative_gap"]) for label, _ in levels[1:])
        known = {label: gap for label, gap in gaps.items() if gap is not None}
        out[factor] = min(known, key=known.get, default=levels[0][0])
    return out


def _judge(ctx: Ctx) -> Verdict:
    rows, said = ctx.rows, TEXT["target"]
    base = rows[("base", "")]
    label, recipe = next((k[1], r) for k, r in rows.items() if k[0] == "recipe")
    share = recipe["relative_gap"]
    target = {"name": said["name"], "met": None if share is None else share <= 0.02,
              "detail": fill(said["detail"], recipe=_pm(recipe["gap"]), recipe_share=percent(share),
                             base=_pm(base["gap"]), base_share=percent(base["relative_gap"]))}
    shortfalls = []
    if target["met"] is False:
        tried = [k for k in rows if not k[0].startswith("recipe, ")
                 and k[0] not in SYNC_FACTORS and rows[k]["relative_gap"] is not None]
        best = min(tried, key=lambda k: rows[k]["relative_gap"], default=None)
        shortfalls.append(fill(said["shortfall"], recipe=percent(share), best="" if best is None
                               else fill(said["best"], setting=" ".join(best).rstrip(),
                                         gap=percent(rows[best]["relative_gap"]))))
    return Verdict(targets=[target], shortfalls=shortfalls,
                   findings=_findings(ctx.grid, rows, label),
                   headline=[fill(TEXT["headline"], ctx=ctx, base=percent(base["relative_gap"]),
                                  label=label, recipe=percent(share))])


def _findings(grid: dict[str, list[tuple[str, dict]]], rows: dict[tuple[str, str], Any],
              label: str) -> list[str]:
    said, base = TEXT["findings"], rows[("base", "")]
    recipe = rows[("recipe", label)]
    out = [fill(said["base"], gap=_pm(base["gap"]), share=percent(base["relative_gap"]))]
    for factor, levels in grid.items():
        out.append(fill(said["factor"], factor=factor, base=levels[0][0],
                        base_share=percent(base["relative_gap"]), levels="".join(
                            f", {lv} {percent(rows[(factor, lv)]['relative_gap'])}"
                            for lv, _ in levels[1:])))
    out.append(fill(said["recipe"], label=label, gap=_pm(recipe["gap"]),
                    share=percent(recipe["relative_gap"])))
    for factor in SYNC_FACTORS:
        at = [(lv, r) for (f, lv), r in rows.items() if f == f"recipe, {factor}"]
        if at:
            out.append(fill(said["recipe_at"], factor=factor, levels=", ".join(
                f"{lv} {percent(r['relative_gap'])} (base setting "
                f"{percent(rows[(factor, lv)]['relative_gap'])})" for lv, r in at)))
    return out


def _notes(ctx: Ctx) -> list[str]:
    return fill(TEXT["notes"], ctx=ctx, lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                shape=", ".join(f"{k} {v}" for k, v in BLOCKS_SHAPE.items()))


def _plot(ctx: Ctx):
    """The relative gap at each level of each factor (one panel per factor), with the
    recipe's at the lengths and shapes it ran at."""
    grid, rows = ctx.grid, ctx.rows
    cols = min(4, len(grid))
    nrows = -(-len(grid) // cols)
    fig, axes = pyplot().subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
    recipe = next(r for (f, _), r in rows.items() if f == "recipe")
    for ax, (factor, levels) in zip(axes.flat, grid.items()):
        labels = [lv for lv, _ in levels]
        gaps = [rows[("base", "")]] + [rows[(factor, lv)] for lv in labels[1:]]
        ax.bar(range(len(labels)), [100 * (r["relative_gap"] or 0.0) for r in gaps],
               color=["tab:gray"] + ["tab:blue"] * (len(labels) - 1), label="one factor")
        at = [rows.get((f"recipe, {factor}", lv)) for lv in labels[1:]]
        if factor in SYNC_FACTORS and all(at):
            ys = [r["relative_gap"] for r in [recipe, *at]]
            ax.plot(range(len(labels)), [float("nan") if v is None else 100 * v for v in ys],
                    color="tab:green", marker="o", label="recipe")
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(factor)
        ax.axhline(2.0, color="tab:red", linestyle="--", linewidth=1)
        ax.set_ylabel("gap to sync (%)")
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(grid):]:
        ax.set_visible(False)
    fig.tight_layout()
    return save_figure(fig, ctx.bench.out_dir / "gap_by_factor.png")


def _pm(stats: dict[str, Any]) -> str:
    """``mean +- std``, signed for a paired difference (a record with ``values``)."""
    if stats.get("mean") is None:
        return "n/a"
    sign = "+" if "values" in stats else ""
    if stats.get("n", 0) < 2:
        return f"{stats['mean']:{sign}.4f}"
    return f"{stats['mean']:{sign}.4f} +- {stats['std']:.4f}"


SCENARIO = Scenario(
    name="tune",
    description=TEXT["description"],
    setup=_setup, runs=_runs, planned=_planned, judge=_judge, notes=_notes, plots=[_plot],
    checks=lambda ctx: [((ctx.common, ctx.base), None)] + [
        ((ctx.common, ctx.base, layer), None) for _, _, layer in _moved(ctx.grid)],
    measure=lambda ctx: {"rows": [{"factor": f, "level": lv, **row}
                                  for (f, lv), row in ctx.rows.items()],
                         "recipe": ctx.recipe},
    tables=[Table("Gap to synchronous training, one factor at a time", [
        ("factor", lambda row: row[0][0] if row[0][0] != "base" else "base (EDiT defaults)"),
        ("level", lambda row: row[0][1] or "-"),
        ("edit (mean +- std)", lambda row: _pm(row[1]["edit"])),
        ("sync (mean)", lambda row: "n/a" if row[1]["sync"]["mean"] is None
         else f"{row[1]['sync']['mean']:.4f}"),
        ("gap edit - sync (paired)", lambda row: _pm(row[1]["gap"])),
        ("gap / sync", lambda row: percent(row[1]["relative_gap"])),
        ("per seed", lambda row: per_seed(row[1]["gap"]))], rows=lambda ctx: ctx.rows.items())],
    settings=lambda ctx: {"steps": ctx.steps, "sync_interval": ctx.interval,
                          "seeds": ctx.seeds, "recipe": ctx.recipe,
                          "factors": {f: [lv for lv, _ in levels]
                                      for f, levels in ctx.grid.items()}},
    methods=lambda ctx: ("sync", "edit"),
)
