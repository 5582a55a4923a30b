"""Scale: EDiT's gap to synchronous training as the model grows, at equal tokens.

``bench tune``'s recipe (``edit-recipe`` of ``bench convergence``) against synchronous
training on model shapes of growing size, each pair on the same data, tokens and seeds as
``bench convergence`` (the same run length, evaluation and options; on the tiny preset the
runs are convergence's, so ``--reuse`` can read those back). The table gives, per shape,
the parameters (and the share in the transformer blocks), tokens per parameter, both
losses and the paired gap; the plot the gap against the parameters.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.convergence import RECIPE_GAP, RECIPE_H, common_options, variant_layers
from editrain.bench.options import pick_names, seed_count
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict, figure
from editrain.bench.stats import gap_to_sync, seed_losses
from editrain.bench.tables import mean_pm, per_seed, percent
from editrain.bench.tune import BLOCKS_SHAPE

TEXT = prose("scale")
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"preset": "tiny"},
    "blocks": {"preset": "tiny", **BLOCKS_SHAPE},
    "small": {"preset": "small"},
}
"""Model option layers of each shape, smallest first: at the default 8,192-token
vocabulary ``tiny`` has 0.6M parameters (12% in the transformer blocks, the rest in the
embedding), ``blocks`` 1.8M (41%) and ``small`` 5.0M (58%)."""
DEFAULT_SHAPES = ("tiny", "blocks")
"""The shapes run without ``--shapes`` (``small`` takes about 27 min a run at the full
size on 2 cores)."""
RECIPE = "edit-recipe"
"""The convergence variant compared with sync."""
METHODS = ("sync", RECIPE)


def chosen_shapes(bench: Bench, allowed: tuple[str, ...] = tuple(SHAPES),
                  default: tuple[str, ...] = DEFAULT_SHAPES) -> list[str]:
    """``--shapes A,B`` (of ``allowed``, in its order), else ``default`` (the tiny size:
    the tiny preset only).

    Raises:
        ConfigError: ``--shapes`` names a shape this scenario does not have.
    """
    chosen = bench.flags.get("shapes")
    if not chosen:
        return ["tiny"] if bench.mode == "tiny" else list(default)
    return pick_names(chosen, allowed, "--shapes", "shape")


def parameter_counts(bench: Bench, *layers: dict[str, Any]) -> dict[str, int]:
    """``{"params", "block_params"}`` of the model a run with ``layers`` builds (on the meta
    device: no memory, no weights)."""
    import torch

    from editrain.config.model import model_config
    from editrain.models import Llama

    with torch.device("meta"):
        model = Llama(model_config(bench.config(*layers)))
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for b in model.blocks() for p in b.parameters())
    return {"params": total, "block_params": blocks}


def _setup(bench: Bench) -> dict[str, Any]:
    common, steps, interval, _ = common_options(bench)
    seeds, shapes = seed_count(bench, 1, 2, 3), chosen_shapes(bench)
    if bench.mode == "full":
        bench.log(fill(TEXT["full_size"], runs=len(shapes) * 2 * seeds, steps=steps,
                       shapes=len(shapes), seeds=seeds))
    return {"common": common, "steps": steps, "interval": interval, "seeds": seeds,
            "shapes": shapes}


def _job(ctx: Ctx, shape: str, method: str, seed: int) -> Job:
    return Job(f"{shape}-{method}-seed{seed}", [
        ctx.common, *variant_layers(method, seed, ctx.steps, ctx.interval),
        {"model": dict(SHAPES[shape])}], title=f"{shape} {method} seed {seed}")


def _results(ctx: Ctx) -> dict[str, Any]:
    rows = []
    for shape in ctx.shapes:
        runs = {m: [ctx.runs[f"{shape}-{m}-seed{s}"] for s in range(ctx.seeds)] for m in METHODS}
        done = [r for pair in zip(*runs.values()) for r in pair if r.ok]
        rows.append(shape_row(shape, parameter_counts(ctx.bench, *_job(ctx, shape, "sync", 0).layers),
                              done[-1].summary.get("tokens") if done else None,
                              *(seed_losses(runs[m]) for m in METHODS)))
    return {"shapes": rows}


def shape_row(shape: str, counts: dict[str, int], tokens: int | None,
              sync: list[float | None], edit: list[float | None]) -> dict[str, Any]:
    """One shape's record: parameters, tokens per parameter, both methods' losses (mean +-
    std and per seed) and the paired gap, absolute and relative to sync's mean."""
    return {"shape": shape, "params": counts["params"], "block_params": counts["block_params"],
            "block_share": counts["block_params"] / counts["params"],
            "tokens": tokens,
            "tokens_per_param": (tokens / counts["params"]) if tokens else None,
            **gap_to_sync(edit, sync), "sync_per_seed": sync, "edit_per_seed": edit}


def _judge(ctx: Ctx) -> Verdict:
    rows = ctx.results["shapes"]
    done = [r for r in rows if r["relative_gap"] is not None]
    largest = done[-1] if done else None
    target = {"name": fill(TEXT["target"]["name"], recipe=RECIPE, gap=RECIPE_GAP),
              "met": None if largest is None else largest["relative_gap"] <= RECIPE_GAP,
              "detail": "no shape finished" if largest is None else
              f"{largest['shape']}: {percent(largest['relative_gap'])} ({mean_pm(largest['gap'])})"}
    headline = fill(TEXT["headline"], ctx=ctx, shapes="; ".join(
        f"{r['shape']} ({r['params'] / 1e6:.1f}M parameters) {percent(r['relative_gap'])}"
        for r in rows))
    findings = _findings(rows)
    return Verdict(targets=[target], findings=findings,
                   headline=[headline] if rows and len(done) == len(rows) else [],
                   shortfalls=[f for f in findings if "grows" in f])


def _findings(rows: list[dict[str, Any]]) -> list[str]:
    """Sentences from the rows: each shape's gap, and whether it shrinks as the model
    grows (the first finished shape against the last)."""
    done = [r for r in rows if r["relative_gap"] is not None]
    said = TEXT["findings"]
    out = [fill(said["shape"], r=r, recipe=RECIPE, gap=mean_pm(r["gap"]),
                share=percent(r["relative_gap"])) for r in done]
    if len(done) >= 2:
        first, last = done[0], done[-1]
        trend = "shrinks" if last["relative_gap"] < first["relative_gap"] else "grows"
        out.append(fill(said["trend"], trend=trend, first=first, last=last,
                        first_share=percent(first["relative_gap"]),
                        last_share=percent(last["relative_gap"]),
                        growth=last["params"] / first["params"]))
    return out


def _shape_text(layer: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in layer.items() if k != "preset")
    return f"the {layer['preset']} preset" + (f" with {extra}" if extra else "")


def _plot(ctx: Ctx):
    """The relative gap (mean, with each seed's) against the parameters."""
    rows = ctx.results["shapes"]
    if not rows:
        return None
    with figure(ctx, "gap_by_size.png", "parameters", "final val loss gap to sync (% of sync's)",
                size=(6, 4), grid=None, xscale="log",
                title="EDiT (recipe) vs sync by model size, equal tokens") as ax:
        done = [r for r in rows if r["relative_gap"] is not None]
        ax.plot([r["params"] for r in done], [100 * r["relative_gap"] for r in done], "o-",
                label=f"{RECIPE} - sync (mean)")
        for r in done:
            ax.scatter([r["params"]] * len(r["gap"]["values"]),
                       [100 * v / r["sync"]["mean"] for v in r["gap"]["values"]], s=12,
                       color="grey")
            ax.annotate(r["shape"], (r["params"], 100 * r["relative_gap"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.axhline(100 * RECIPE_GAP, color="red", linestyle="--", linewidth=1,
                   label=f"target {RECIPE_GAP:.0%}")
        ax.axhline(0, color="black", linewidth=0.5)
    return ctx.plot


SCENARIO = Scenario(
    name="scale",
    description=TEXT["description"],
    setup=_setup, measure=_results, judge=_judge, plots=[_plot],
    # Smallest shape first: a cut-short invocation has the small shapes.
    runs=lambda ctx: [_job(ctx, shape, m, seed) for shape in ctx.shapes
                      for seed in range(ctx.seeds) for m in METHODS],
    tables=[Table("Gap to synchronous training by model size", [
        ("shape", "shape"), ("parameters", "params"),
        ("in blocks", lambda r: f"{r[1]['block_share']:.0%}"),
        ("tokens / parameter", lambda r: None if r[1]["tokens_per_param"] is None
         else f"{r[1]['tokens_per_param']:.2f}"),
        ("sync (mean +- std)", lambda r: mean_pm(r[1]["sync"])),
        (f"{RECIPE} (mean +- std)", lambda r: mean_pm(r[1]["edit"])),
        ("gap (paired)", lambda r: mean_pm(r[1]["gap"])),
        ("gap / sync", lambda r: percent(r[1]["relative_gap"])),
        ("per seed", lambda r: per_seed(r[1]["gap"]))],
        rows=lambda ctx: [(None, r) for r in ctx.results["shapes"]])],
    notes=lambda ctx: fill(TEXT["notes"], ctx=ctx, recipe=RECIPE, warmup=ctx.steps // 4,
                           h=RECIPE_H[RECIPE], shapes="; ".join(
                               f"{s} = {_shape_text(SHAPES[s])}" for s in ctx.shapes)),
    settings=lambda ctx: {"steps": ctx.steps, "seeds": ctx.seeds, "shapes": ctx.shapes,
                          "recipe_interval": RECIPE_H[RECIPE],
                          "warmup_sync_steps": ctx.steps // 4},
    methods=lambda ctx: METHODS,
)
