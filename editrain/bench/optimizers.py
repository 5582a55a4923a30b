"""Optimizers: AdamW vs AGD vs AdamW + WSAM as the inner optimizer, equal steps, several seeds.

Synchronous training (the method is not what is compared here), the same model, data and
seeds for every optimizer. AGD's learning rate is a tenth of AdamW's and its delta 1e-14,
as the AGD authors suggest for transformers. WSAM costs two forward/backward passes per
step, so its wall time is reported next to its loss.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.options import seed_count
from editrain.bench.prose import fill, prose
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict
from editrain.bench.stats import mean_std
from editrain.bench.tables import best_first, spread_columns

TEXT = prose("optimizers")
LR = 3e-3
VARIANTS: dict[str, dict[str, Any]] = {
    "adamw": {"optim": {"name": "adamw"}},
    "agd": {"optim": {"name": "agd", "agd_delta": 1e-14}, "train": {"lr": LR / 10}},
    "adamw+wsam": {"optim": {"name": "adamw", "sam": "wsam", "rho": 0.05, "gamma": 0.9}},
}


def _setup(bench: Any) -> dict[str, Any]:
    steps = bench.pick(8, 150, 300)
    return {"seeds": seed_count(bench, 1, 3, 3), "steps": steps,
            "common": {"train": {"steps": steps, "lr": LR, "eval_every": max(1, steps // 5)},
                       "sync": {"method": "sync"}}}


def _measure(ctx: Ctx) -> dict[str, Any]:
    out = {}
    for name in VARIANTS:
        runs = [ctx.runs[f"{name}-seed{s}"] for s in range(ctx.seeds)]
        out[name] = {"final_val_loss": mean_std(r.final_val_loss for r in runs),
                     "wall_time_s": mean_std(r.summary.get("wall_time_s") for r in runs if r.ok),
                     "per_seed": [r.final_val_loss for r in runs]}
    return out


def _judge(ctx: Ctx) -> Verdict:
    means = {k: v["final_val_loss"]["mean"] for k, v in ctx.results.items()
             if v["final_val_loss"]["mean"] is not None}
    findings, said = [], TEXT["findings"]
    if means:
        best = min(means, key=means.get)
        findings.append(fill(said["lowest"], best=best, loss=means[best], all=best_first(means)))
    wsam, adamw = (ctx.results[k]["wall_time_s"]["mean"] for k in ("adamw+wsam", "adamw"))
    if wsam and adamw:
        findings.append(fill(said["wsam"], cost=wsam / adamw))
    return Verdict(findings=findings)


SCENARIO = Scenario(
    name="optimizers",
    description=TEXT["description"],
    setup=_setup,
    runs=lambda ctx: [Job(f"{name}-seed{s}", (ctx.common, v, {"train": {"seed": s}}))
                      for name, v in VARIANTS.items() for s in range(ctx.seeds)],
    measure=_measure,
    tables=[Table("Final validation loss", [
        ("optimizer", None),
        ("final val loss (mean)", lambda row: row[1]["final_val_loss"]["mean"]),
        ("std", lambda row: row[1]["final_val_loss"]["std"]), *spread_columns("per_seed"),
        ("wall s (mean)", lambda row: row[1]["wall_time_s"]["mean"])])],
    judge=_judge,
    settings=lambda ctx: {"steps": ctx.steps, "seeds": ctx.seeds, "lr": LR, "agd_lr": LR / 10},
    notes=lambda ctx: TEXT["notes"],
)
