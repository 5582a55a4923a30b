"""Batch: EDiT's recipe against synchronous training as the batch grows, at equal tokens.

``docs/decisions.md`` read the recipe's remaining gap to synchronous training (+3.4% on the
tiny preset after 2,000 steps) as batch noise: 512 tokens per replica per step, where sync
averages every step's gradients over both replicas. The DiLoCo scaling study (Charles et
al. 2025) predicts that local SGD tolerates larger batches than data-parallel training, so
the gap should shrink as the batch grows. This scenario tests it: per model shape of
``bench scale`` and per batch, sync and ``bench convergence``'s ``edit-recipe`` train on the
same tokens, H staying 20 *steps* (fewer syncs for the same tokens at a larger batch).

Each method's inner learning rate is tuned per batch on a short grid with the same budget
for both (seed 0), and seeds 1.. run at each method's best rate, paired. The record is
written after each phase (the grid, then each further seed), so a cut-short invocation
leaves a usable partial study (``--reuse`` resumes it).
"""

from __future__ import annotations

import math
from typing import Any

from editrain.bench.convergence import RECIPE_GAP, RECIPE_H, variant_layers
from editrain.bench.options import seed_count
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench
from editrain.bench.scale import METHODS, RECIPE, SHAPES
from editrain.bench.scale import chosen_shapes as scale_shapes
from editrain.bench.scenario import WRITE, Ctx, Job, Scenario, Verdict, figure
from editrain.bench.stats import gap_to_sync
from editrain.bench.tables import md_table, mean_pm, percent

TEXT = prose("batch")
BASE_TOKENS = 512
"""Tokens per replica per step of the bench's runs (batch 8 x sequence 64): the batch the
learning-rate grid's centre is scaled from."""
BASE_LR = 3e-3
"""``train.lr``'s default, the grid's centre at ``BASE_TOKENS``."""
LR_FACTORS = (1.0, 2.0)
"""The grid: these times ``BASE_LR * sqrt(tokens / BASE_TOKENS)`` (Adam's square-root
rule), the same for both methods."""
EXTEND = 1
"""Points added beyond the grid's edge, one at a time, while a method's best rate is at an
edge (half the lowest, twice the highest): the same rule for both methods, so that neither
is compared at a rate the grid cut off."""
WITHIN = RECIPE_GAP
"""The gap (relative to sync's loss) under which the recipe counts as matching sync."""
BATCH_SHAPES = ("tiny", "blocks")
"""The model shapes of ``bench scale`` this scenario runs (``--shapes``)."""


def sizes(bench: Bench) -> tuple[tuple[int, ...], int, int]:
    """``(tokens per replica per step of each batch, tokens per replica per run, sequence
    length)`` at this size; every batch divides the run's tokens into whole steps."""
    seq = 64
    batches = bench.pick((128, 256, 512), (512, 2048, 8192), (512, 2048, 8192))
    # quick: 20 steps at the largest batch (320 at the smallest), what fits about 75 min
    # on a shared 2-core machine; full: 128.
    per_run = batches[-1] * bench.pick(4, 20, 128)
    return batches, per_run, seq


def grid_lrs(tokens: int) -> list[float]:
    """The learning-rate grid at ``tokens`` per replica per step."""
    centre = BASE_LR * math.sqrt(tokens / BASE_TOKENS)
    return [float(f"{centre * f:.3g}") for f in LR_FACTORS]


def run_layers(shape: str, method: str, seed: int, tokens: int, per_run: int, seq: int,
               lr: float) -> list[dict[str, Any]]:
    """The option layers of one run: ``per_run // tokens`` steps of ``tokens // seq``
    sequences, evaluation at the end only, the learning-rate warm-up a sixteenth of the
    run, the method's options (the recipe's H and quarter warm-up) and the shape."""
    steps = per_run // tokens
    common = {"train": {"steps": steps, "eval_every": steps, "batch_size": tokens // seq,
                        "seq_len": seq, "lr": lr, "warmup_steps": max(1, steps // 16)},
              "model": dict(SHAPES[shape])}
    return [common, *variant_layers(method, seed, steps, RECIPE_H[RECIPE])]


def chosen_shapes(bench: Bench) -> list[str]:
    """``--shapes A,B`` (of ``BATCH_SHAPES``), else all of them (tiny size: tiny only)."""
    return scale_shapes(bench, BATCH_SHAPES, BATCH_SHAPES)


def _setup(bench: Bench) -> dict[str, Any]:
    batches, per_run, seq = sizes(bench)
    # grid[shape, tokens, method][lr] = seed 0's loss; losses[shape, tokens, method] = per
    # seed; info[shape, tokens, method] = the syncs and wall time of its last finished run
    return {"batches": batches, "per_run": per_run, "seq": seq, "grid": {}, "losses": {},
            "info": {}, "seeds": seed_count(bench, 1, 3, 3),
            "shapes": chosen_shapes(bench), "seeds_done": 0}


def _train(ctx: Ctx, shape: str, method: str, seed: int, tokens: int, lr: float):
    """One run, for ``yield from``: its final loss (None when it failed)."""
    r = yield Job(f"{shape}-b{tokens}-{method}-lr{lr:g}-seed{seed}",
                  run_layers(shape, method, seed, tokens, ctx.per_run, ctx.seq, lr),
                  title=f"{shape} {tokens} tok/step {method} lr {lr:g} seed {seed}")
    if r.ok:
        ctx.info.setdefault((shape, tokens, method), {}).update(
            {"syncs": r.summary.get("num_syncs"), "wall_time_s": r.summary.get("wall_time_s")})
    return r.final_val_loss if r.ok else None


def _runs(ctx: Ctx):
    """Per shape, smallest first (a cut-short study has it whole): the grid at every batch,
    then each further seed at the best rates; the record is written after each phase."""
    for shape in ctx.shapes:
        for tokens in ctx.batches:
            for method in METHODS:
                g = {}
                for lr in grid_lrs(tokens):
                    g[lr] = yield from _train(ctx, shape, method, 0, tokens, lr)
                for _ in range(EXTEND):
                    beyond = next_lr(g)
                    if beyond is None:
                        break
                    g[beyond] = yield from _train(ctx, shape, method, 0, tokens, beyond)
                g = ctx.grid[shape, tokens, method] = dict(sorted(g.items()))
                ctx.losses[shape, tokens, method] = [g[best_lr(g)]]
        for seed in range(1, ctx.seeds + 1):
            ctx.seeds_done = seed
            if seed > 1:
                for tokens in ctx.batches:
                    for method in METHODS:
                        lr = best_lr(ctx.grid[shape, tokens, method])
                        ctx.losses[shape, tokens, method].append(
                            (yield from _train(ctx, shape, method, seed - 1, tokens, lr)))
            if shape != ctx.shapes[-1] or seed < ctx.seeds:  # the runner writes the last
                yield WRITE


def next_lr(losses_by_lr: dict[float, float | None]) -> float | None:
    """The rate beyond the grid's edge where the best rate is (half the lowest, twice the
    highest), or None when the best is inside the grid or nothing finished."""
    if not any(v is not None for v in losses_by_lr.values()) or len(losses_by_lr) < 2:
        return None
    best = best_lr(losses_by_lr)
    if best == min(losses_by_lr):
        return float(f"{best / 2:.3g}")
    if best == max(losses_by_lr):
        return float(f"{best * 2:.3g}")
    return None


def best_lr(losses_by_lr: dict[float, float | None]) -> float:
    """The grid's learning rate with the lowest loss (the first when none finished)."""
    done = {lr: v for lr, v in losses_by_lr.items() if v is not None}
    return min(done, key=done.get) if done else next(iter(losses_by_lr))


def batch_row(shape: str, tokens: int, per_run: int, grid: dict[str, dict[float, Any]],
              sync: list[float | None], edit: list[float | None],
              info: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One (shape, batch) record: steps, H in steps and tokens, each method's grid and
    chosen learning rate, both methods' losses per seed, the paired gap (recipe - sync) and
    the gap relative to sync's mean loss, with the smallest and largest per-seed relative
    gap (the spread)."""
    gaps = gap_to_sync(edit, sync)
    s = gaps["sync"]
    per_seed = [d / s["mean"] for d in gaps["gap"]["values"]] if s["mean"] else []
    h = RECIPE_H[RECIPE]
    return {"shape": shape, "tokens_per_step": tokens, "steps": per_run // tokens,
            "h_steps": h, "h_tokens": h * tokens,
            "warmup_sync_steps": (per_run // tokens) // 4,
            "grid": {m: {f"{lr:g}": v for lr, v in g.items()} for m, g in grid.items()},
            "lr": {m: best_lr(g) for m, g in grid.items()},
            "lr_at_edge": {m: len(g) > 1 and best_lr(g) in (min(g), max(g)) for m, g in
                           grid.items()},
            **gaps, "relative_gap_per_seed": per_seed,
            "relative_gap_range": [min(per_seed), max(per_seed)] if per_seed else None,
            "sync_per_seed": sync, "edit_per_seed": edit,
            "syncs": {m: info.get(m, {}).get("syncs") for m in METHODS},
            "wall_time_s": {m: info.get(m, {}).get("wall_time_s") for m in METHODS}}


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the rows: one line per shape and batch."""
    return md_table(
        ["shape", "tokens / replica / step", "steps", "H steps (tokens)", "syncs",
         "lr sync / recipe", "sync (mean +- std)", f"{RECIPE} (mean +- std)", "gap (paired)",
         "gap / sync", "per seed (range)"],
        [[r["shape"], r["tokens_per_step"], r["steps"], f"{r['h_steps']} ({r['h_tokens']:,})",
          r["syncs"][RECIPE], f"{r['lr']['sync']:g} / {r['lr'][RECIPE]:g}",
          mean_pm(r["sync"]), mean_pm(r["edit"]), mean_pm(r["gap"]), percent(r["relative_gap"]),
          None if r["relative_gap_range"] is None else
          f"{percent(r['relative_gap_range'][0])} .. {percent(r['relative_gap_range'][1])}"]
         for r in rows])


def grid_table(rows: list[dict[str, Any]]) -> str:
    """Seed 0's final validation loss at every learning rate of the grid (both methods)."""
    return md_table(
        ["shape", "tokens / replica / step", "method", "lr: loss (seed 0)", "chosen"],
        [[r["shape"], r["tokens_per_step"], m,
          ", ".join(f"{lr}: {'n/a' if v is None else f'{v:.4f}'}"
                    for lr, v in r["grid"][m].items()),
          f"{r['lr'][m]:g}" + (" (grid edge)" if r["lr_at_edge"][m] else "")]
         for r in rows for m in METHODS])


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Sentences: each batch's gap, whether it shrinks with the batch (smallest against
    largest batch of each shape) and which batches bring the recipe within ``WITHIN``."""
    out, said = [], TEXT["findings"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        done = [r for r in rows if r["shape"] == shape and r["relative_gap"] is not None]
        if not done:
            continue
        out.append(fill(said["gaps"], shape=shape, recipe=RECIPE, gaps="; ".join(
            f"{r['tokens_per_step']:,} tokens per replica per step {percent(r['relative_gap'])}"
            f" ({mean_pm(r['gap'])}, {r['gap']['n']} seed(s))" for r in done)))
        if len(done) >= 2:
            first, last = done[0], done[-1]
            trend = "shrinks" if last["relative_gap"] < first["relative_gap"] else "does not shrink"
            out.append(fill(said["trend"], shape=shape, trend=trend, first=first,
                            first_gap=percent(first["relative_gap"]),
                            last_gap=percent(last["relative_gap"]),
                            growth=last["tokens_per_step"] // first["tokens_per_step"],
                            first_syncs=first["syncs"][RECIPE], last_syncs=last["syncs"][RECIPE]))
            out.append(fill(said["sync"], shape=shape, losses=", ".join(
                f"{r['sync']['mean']:.3f} ({r['tokens_per_step']:,} tokens per step, "
                f"{r['steps']} steps)" for r in done)))
        within = [r for r in done if r["relative_gap"] <= WITHIN]
        out.append(fill(said["within" if within else "not_within"], shape=shape, within=WITHIN,
                        batches=", ".join(f"{r['tokens_per_step']:,}" for r in within)))
    return out


def _measure(ctx: Ctx) -> dict[str, Any]:
    """The rows of what has finished so far (``seeds_done`` seeds of the last shape begun;
    later shapes not begun are left out)."""
    return {"batches": [
        batch_row(shape, tokens, ctx.per_run,
                  {m: ctx.grid[shape, tokens, m] for m in METHODS},
                  ctx.losses[shape, tokens, "sync"], ctx.losses[shape, tokens, RECIPE],
                  {m: ctx.info.get((shape, tokens, m), {}) for m in METHODS})
        for shape in ctx.shapes for tokens in ctx.batches
        if (shape, tokens, "sync") in ctx.losses]}


def _settings(ctx: Ctx) -> dict[str, Any]:
    return {"tokens_per_replica_per_run": ctx.per_run, "seq_len": ctx.seq,
            "batches": list(ctx.batches), "seeds": ctx.seeds, "shapes": ctx.shapes,
            "lr_factors": list(LR_FACTORS), "lr_extend": EXTEND, "base_lr": BASE_LR,
            "recipe_interval_steps": RECIPE_H[RECIPE], "seeds_done": ctx.seeds_done}


def _judge(ctx: Ctx) -> Verdict:
    rows = ctx.results["batches"]
    found = findings(rows)
    complete = bool(rows) and all(r["relative_gap"] is not None for r in rows)
    target = {"name": fill(TEXT["target"], recipe=RECIPE, within=WITHIN),
              "met": any(r["relative_gap"] <= WITHIN for r in rows) if complete else None,
              "detail": "; ".join(f"{r['shape']} {r['tokens_per_step']}: "
                                  f"{percent(r['relative_gap'])}" for r in rows)}
    headline = fill(TEXT["headline"], seeds=ctx.seeds_done, rows="; ".join(
        f"{r['shape']} {r['tokens_per_step']:,} tok/step {percent(r['relative_gap'])}"
        for r in rows))
    return Verdict(targets=[target], findings=found, headline=[headline] if complete else [],
                   shortfalls=[f for f in found if "does not shrink" in f])


def _plot(ctx: Ctx):
    """The relative gap (mean per shape, each seed's as points) against the batch."""
    rows = ctx.results["batches"]
    if not any(r["relative_gap"] is not None for r in rows):
        return None
    with figure(ctx, "gap_by_batch.png", "tokens per replica per step (equal tokens per run)",
                "final val loss gap to sync (% of sync's)", size=(6, 4), grid=None,
                title=f"EDiT (recipe, H = {RECIPE_H[RECIPE]} steps) vs sync by batch") as ax:
        for shape in dict.fromkeys(r["shape"] for r in rows):
            done = [r for r in rows if r["shape"] == shape and r["relative_gap"] is not None]
            xs = [r["tokens_per_step"] for r in done]
            line = ax.plot(xs, [100 * r["relative_gap"] for r in done], "o-",
                           label=f"{shape}: {RECIPE} - sync (mean)")[0]
            for r in done:
                vals = r["relative_gap_per_seed"]
                ax.scatter([r["tokens_per_step"]] * len(vals), [100 * v for v in vals], s=12,
                           color=line.get_color(), alpha=0.5)
        ax.axhline(100 * WITHIN, color="red", linestyle="--", linewidth=1,
                   label=f"within {WITHIN:.0%}")
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xscale("log", base=2)
    return ctx.plot


SCENARIO = Scenario(
    name="batch",
    description=TEXT["description"],
    setup=_setup, runs=_runs, measure=_measure, judge=_judge, settings=_settings,
    plots=[_plot], methods=lambda ctx: METHODS,
    checks=lambda ctx: [(run_layers(shape, method, 0, tokens, ctx.per_run, ctx.seq, lr), None)
                        for shape in ctx.shapes for tokens in ctx.batches
                        for method in METHODS for lr in grid_lrs(tokens)],
    # (the plan leaves out the points EXTEND may add)
    planned=lambda ctx: (len(ctx.shapes) * len(ctx.batches) * len(METHODS)
                         * (len(LR_FACTORS) + ctx.seeds - 1)),
    tables=[lambda ctx: [
        ("Gap to synchronous training by batch, equal tokens", table(ctx.results["batches"])),
        ("Learning-rate grid (seed 0)", grid_table(ctx.results["batches"]))]],
    notes=lambda ctx: fill(
        TEXT["notes"], per_run=ctx.per_run, settings=_settings(ctx), recipe=RECIPE,
        h=RECIPE_H[RECIPE], n_factors=len(LR_FACTORS),
        factors=", ".join(f"{f:g}" for f in LR_FACTORS), base_lr=BASE_LR,
        base_tokens=BASE_TOKENS, extend=EXTEND, seeds_done=ctx.seeds_done,
        shapes="; ".join(f"{s} = {SHAPES[s]}" for s in ctx.shapes)),
)
