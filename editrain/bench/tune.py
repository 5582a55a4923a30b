"""Tune: what closes the gap between EDiT and synchronous training at equal tokens.

A one-factor-at-a-time study around a base setting (EDiT with its defaults before this
study made its recipe them: no synchronous warm-up, H = the size's interval, Nesterov outer
SGD at lr 0.7 and momentum 0.9, the penalty on; pinned, so the study measures the same
base whatever the defaults): each factor is moved alone to each of its levels, every run is paired with
synchronous training on the same model, data, tokens and seed, and the table gives the
paired gap ``edit - sync`` (absolute and as a share of sync's loss). A last run combines
each factor's best level (the *recipe*) and measures its gap the same way. Factors:
synchronous warm-up length, H, outer learning rate and momentum, inner learning rate, the
penalty, tokens per parameter (longer runs; sync runs as long) and model shape (a shape
whose parameters are mostly in the blocks; sync on it too).
"""

from __future__ import annotations

from typing import Any

from editrain.bench.plots import pyplot, save_figure
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict
from editrain.bench.stats import gap_to_sync
from editrain.bench.tables import percent

TEXT = prose("tune")
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
"""The base's outer SGD (Nesterov; EDiT's default until the study's recipe replaced it)."""
BLOCKS_SHAPE = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 344}
"""A shape whose parameters are mostly in the blocks (73% at the quick size's 2,048-token
vocabulary, against 36% for the tiny preset)."""


def factors(bench: Bench, steps: int, interval: int) -> dict[str, list[tuple[str, dict]]]:
    """Each factor's levels as ``(label, option layer)``; the first level is the base."""
    lr = 3e-3  # train.lr's default

    def outer(lr_: float, momentum: float) -> dict[str, Any]:
        return {"sync": {"outer_optim_kwargs": {"lr": lr_, "momentum": momentum,
                                                "nesterov": momentum > 0}}}

    out: dict[str, list[tuple[str, dict]]] = {
        "warmup": [("0", {})] + [
            (f"{w}", {"sync": {"local_sgd_warmup_steps": w}})
            for w in sorted({max(1, steps // 10), max(2, steps // 4)})],
    }
    if bench.mode == "tiny":
        return {"warmup": out["warmup"][:2]}  # the smoke test: one level moved
    out.update({
        # The outer lr and momentum are one factor: the best lr depends on the momentum
        # (a recipe that took each from its own row combined two settings never measured
        # together, and did worse than either).
        "outer": [(f"lr{OUTER_LR}-m{OUTER_MOMENTUM}", {})] + [
            (f"lr{x}-m{m}", outer(x, m))
            for x, m in ((0.4, 0.9), (1.0, 0.9), (0.7, 0.5), (0.7, 0.0), (1.0, 0.0))],
        "H": [(f"{interval}", {})] + [
            (f"{h}", {"sync": {"local_sgd_sync_interval": h}})
            for h in (max(2, interval // 2), interval * 2)],
        "inner_lr": [(f"{lr:g}", {})] + [(f"{x:g}", {"train": {"lr": x}})
                                         for x in (lr / 2, lr * 2)],
        "penalty": [("on", {})] + [("off", {"sync": {"pseudo_gradnorm_reduce": False,
                                                     "skip_anomaly": False,
                                                     "clip_pseudo_grad": 0.0}})],
        "tokens": [("1x", {})] + [(f"{k}x", {"train": {"steps": steps * k,
                                                        "eval_every": steps * k}})
                                  for k in (2, 4)],
        "shape": [("tiny", {})] + [("blocks", {"model": dict(BLOCKS_SHAPE)})],
    })
    return out


SYNC_FACTORS = ("tokens", "shape")
"""Factors that change what synchronous training runs too (its own run per level); they are
not settings of the method, so the recipe keeps their base level."""


def _setup(bench: Bench) -> dict[str, Any]:
    steps, interval = bench.pick(12, 120, 2000), bench.pick(4, 10, 50)
    return {"steps": steps, "interval": interval,
            "seeds": int(bench.flags.get("seeds") or bench.pick(1, 2, 3)),
            "common": {"train": {"steps": steps, "eval_every": steps,
                                 "warmup_steps": bench.pick(2, 10, 100)},
                       "model": {"preset": "tiny"}},
            "base": {"sync": {"method": "edit", "local_sgd_sync_interval": interval,
                              "outer_optim_kwargs": {"lr": OUTER_LR,
                                                     "momentum": OUTER_MOMENTUM,
                                                     "nesterov": True}}},
            "grid": factors(bench, steps, interval), "rows": {}}


def _planned(ctx: Ctx) -> int:
    """Per seed: sync and edit at the base, every other level of every factor, the sync runs
    of the levels that change sync's run too, and the recipe."""
    grid = ctx.grid
    sync_levels = sum(len(grid[f]) - 1 for f in SYNC_FACTORS if f in grid)
    return ctx.seeds * (2 + sum(len(v) - 1 for v in grid.values()) + 2 * sync_levels + 1)


def _runs(ctx: Ctx):
    """The study's runs; the recipe's depend on the one-factor rows (``ctx.rows``)."""
    grid, base, seeds, rows = ctx.grid, ctx.base, ctx.seeds, ctx.rows
    sync = {"sync": {"method": "sync"}}

    def job(label: str, seed: int, *layers: dict) -> Job:
        return Job(f"{label}-seed{seed}", (ctx.common, *layers, {"train": {"seed": seed}}),
                   title=f"{label} seed {seed}")

    edit: dict[tuple[str, str], list[float | None]] = {}
    sync_of: dict[tuple[str, str], list[float | None]] = {}
    for seed in range(seeds):
        base_sync = _loss((yield job("sync", seed, sync)))
        edit.setdefault(("base", ""), []).append(_loss((yield job("edit", seed, base))))
        sync_of.setdefault(("base", ""), []).append(base_sync)
        for factor, levels in grid.items():
            for label, layer in levels[1:]:
                key = (factor, label)
                edit.setdefault(key, []).append(
                    _loss((yield job(f"edit-{factor}-{label}", seed, base, layer))))
                sync_of.setdefault(key, []).append(
                    _loss((yield job(f"sync-{factor}-{label}", seed, sync, layer)))
                    if factor in SYNC_FACTORS else base_sync)
    rows.update({key: _row(edit[key], sync_of[key]) for key in edit})
    ctx.recipe = _recipe(grid, rows)
    recipe_layers = recipe_options(grid, ctx.recipe)
    label = "+".join(f"{f}={v}" for f, v in ctx.recipe.items() if v != grid[f][0][0]) or "base"
    if recipe_layers:
        recipe_edit = []
        for seed in range(seeds):
            recipe_edit.append(_loss((yield job("edit-recipe", seed, base, *recipe_layers))))
    else:
        recipe_edit = list(edit[("base", "")])  # no level beat the base: the base's runs
    rows[("recipe", label)] = _row(recipe_edit, list(sync_of[("base", "")]))
    # The recipe at every other length and shape, against sync at that length and shape:
    # does what closes the gap at the base still close it with more tokens, another model?
    for factor in (f for f in SYNC_FACTORS if f in grid and recipe_layers):
        for lv, layer in grid[factor][1:]:
            runs_ = []
            for seed in range(seeds):
                runs_.append(_loss((yield job(f"edit-recipe-{factor}-{lv}", seed, base,
                                              *recipe_layers, layer))))
            rows[(f"recipe, {factor}", lv)] = _row(runs_, sync_of[(factor, lv)])


def _loss(run: Any) -> float | None:
    return run.final_val_loss if run.ok else None


def _judge(ctx: Ctx) -> Verdict:
    rows = ctx.rows
    base_row = rows[("base", "")]
    rec_key = next(k for k in rows if k[0] == "recipe")
    rec = rows[rec_key]
    said = TEXT["target"]
    target = {
        "name": said["name"],
        "met": None if rec["relative_gap"] is None else rec["relative_gap"] <= 0.02,
        "detail": fill(said["detail"], recipe=_pm(rec["gap"]),
                       recipe_share=percent(rec["relative_gap"]), base=_pm(base_row["gap"]),
                       base_share=percent(base_row["relative_gap"]))}
    best_key = min((k for k in rows if not k[0].startswith("recipe, ")
                    and k[0] not in SYNC_FACTORS and rows[k]["relative_gap"] is not None),
                   key=lambda k: rows[k]["relative_gap"], default=None)
    shortfalls = []
    if target["met"] is False:
        best = "" if best_key is None else (
            fill(said["best"], factor=best_key[0], level=best_key[1]).rstrip() + ", "
            f"{percent(rows[best_key]['relative_gap'])}")
        shortfalls.append(fill(said["shortfall"], recipe=percent(rec["relative_gap"]),
                               best=best))
    return Verdict(
        targets=[target], shortfalls=shortfalls,
        findings=_findings(ctx.grid, rows, base_row, rec, rec_key[1]),
        headline=[fill(TEXT["headline"], ctx=ctx, base=percent(base_row["relative_gap"]),
                       label=rec_key[1], recipe=percent(rec["relative_gap"]))])


def _notes(ctx: Ctx) -> list[str]:
    return fill(TEXT["notes"], ctx=ctx, lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                shape=", ".join(f"{k} {v}" for k, v in BLOCKS_SHAPE.items()))


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
    base = rows[("base", "")]["relative_gap"]
    out = {}
    for factor, levels in grid.items():
        best, best_gap = levels[0][0], base
        if factor not in SYNC_FACTORS:
            for label, _ in levels[1:]:
                g = rows[(factor, label)]["relative_gap"]
                if g is not None and (best_gap is None or g < best_gap):
                    best, best_gap = label, g
        out[factor] = best
    return out


def _findings(grid, rows, base_row, recipe_row, recipe_label) -> list[str]:
    said = TEXT["findings"]
    out = [fill(said["base"], gap=_pm(base_row["gap"]), share=percent(base_row["relative_gap"]))]
    for factor, levels in grid.items():
        parts = [f"{levels[0][0]} (base) {percent(base_row['relative_gap'])}"] + [
            f"{label} {percent(rows[(factor, label)]['relative_gap'])}" for label, _ in levels[1:]]
        out.append(f"{factor}: gap " + ", ".join(parts) + ".")
    out.append(fill(said["recipe"], label=recipe_label, gap=_pm(recipe_row["gap"]),
                    share=percent(recipe_row["relative_gap"])))
    for factor in SYNC_FACTORS:
        at = [(lv, r) for (f, lv), r in rows.items() if f == f"recipe, {factor}"]
        if at:
            out.append(f"The recipe at other {factor}: " + ", ".join(
                f"{lv} {percent(r['relative_gap'])} (base setting "
                f"{percent(rows[(factor, lv)]['relative_gap'])})" for lv, r in at) + ".")
    return out


def _plot(ctx: Ctx):
    """The relative gap at each level of each factor (one panel per factor)."""
    grid, rows = ctx.grid, ctx.rows
    plt = pyplot()
    n = len(grid)
    cols = min(4, n)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
    base = rows[("base", "")]
    for ax, (factor, levels) in zip(axes.flat, grid.items()):
        labels = [lv for lv, _ in levels]
        vals = [base["relative_gap"]] + [rows[(factor, lv)]["relative_gap"]
                                         for lv in labels[1:]]
        ax.bar(range(len(labels)), [100 * v if v is not None else 0.0 for v in vals],
               color=["tab:gray"] + ["tab:blue"] * (len(labels) - 1), label="one factor")
        recipe = [r for (f, _), r in rows.items() if f == "recipe"]
        at = [rows.get((f"recipe, {factor}", lv)) for lv in labels[1:]]
        if factor in SYNC_FACTORS and recipe and all(at):
            ys = [recipe[0]["relative_gap"]] + [r["relative_gap"] for r in at]
            ax.plot(range(len(labels)), [100 * v if v is not None else float("nan")
                                         for v in ys],
                    color="tab:green", marker="o", label="recipe")
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(factor)
        ax.axhline(2.0, color="tab:red", linestyle="--", linewidth=1)
        ax.set_ylabel("gap to sync (%)")
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    return save_figure(fig, ctx.bench.out_dir / "gap_by_factor.png")


def _pm(stats: dict[str, Any]) -> str:
    if stats.get("mean") is None:
        return "n/a"
    if stats.get("n", 0) < 2:
        return f"{stats['mean']:+.4f}" if "values" in stats else f"{stats['mean']:.4f}"
    sign = "+" if "values" in stats else ""
    return f"{stats['mean']:{sign}.4f} +- {stats['std']:.4f}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


SCENARIO = Scenario(
    name="tune",
    description=TEXT["description"],
    setup=_setup, runs=_runs, planned=_planned, judge=_judge, notes=_notes, plots=[_plot],
    checks=lambda ctx: [((ctx.common, ctx.base), None)] + [
        ((ctx.common, ctx.base, layer), None)
        for levels in ctx.grid.values() for _, layer in levels[1:]],
    measure=lambda ctx: {"rows": [{"factor": f, "level": lv, **row}
                                  for (f, lv), row in ctx.rows.items()],
                         "recipe": ctx.recipe},
    tables=[Table("Gap to synchronous training, one factor at a time", [
        ("factor", lambda row: row[0][0] if row[0][0] != "base" else "base (EDiT defaults)"),
        ("level", lambda row: row[0][1] or "-"),
        ("edit (mean +- std)", lambda row: _pm(row[1]["edit"])),
        ("sync (mean)", lambda row: _num(row[1]["sync"]["mean"])),
        ("gap edit - sync (paired)", lambda row: _pm(row[1]["gap"])),
        ("gap / sync", lambda row: percent(row[1]["relative_gap"])),
        ("per seed", lambda row: ", ".join(f"{v:+.4f}" for v in row[1]["gap"]["values"])
         or None)], rows=lambda ctx: ctx.rows.items())],
    settings=lambda ctx: {"steps": ctx.steps, "sync_interval": ctx.interval,
                          "seeds": ctx.seeds, "recipe": ctx.recipe,
                          "factors": {f: [lv for lv, _ in levels]
                                      for f, levels in ctx.grid.items()}},
    methods=lambda ctx: ("sync", "edit"),
)
