"""Optimizers: AdamW vs AGD vs AdamW + WSAM as the inner optimizer, equal steps, several seeds.

Synchronous training (the method is not what is compared here), the same model, data and
seeds for every optimizer. AGD's learning rate is a tenth of AdamW's and its delta 1e-14,
as the AGD authors suggest for transformers. WSAM costs two forward/backward passes per
step, so its wall time is reported next to its loss.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.runner import Bench
from editrain.bench.stats import mean_std
from editrain.bench.tables import cell, md_table

NAME = "optimizers"
DESCRIPTION = (
    "Inner optimizers side by side: AdamW, AGD (lr / 10, delta 1e-14) and AdamW wrapped by "
    "WSAM (rho 0.05, gamma 0.9), synchronous training, equal steps, the same seeds; final "
    "validation loss (mean and spread over seeds) and wall time."
)
LR = 3e-3
VARIANTS: dict[str, dict[str, Any]] = {
    "adamw": {"optim": {"name": "adamw"}},
    "agd": {"optim": {"name": "agd", "agd_delta": 1e-14}, "train": {"lr": LR / 10}},
    "adamw+wsam": {"optim": {"name": "adamw", "sam": "wsam", "rho": 0.05, "gamma": 0.9}},
}


def run(bench: Bench) -> dict[str, Any]:
    """Run the scenario; returns the record written to ``results.json``."""
    seeds = int(bench.flags.get("seeds") or bench.pick(1, 3, 3))
    steps = bench.pick(8, 150, 300)
    common = {"train": {"steps": steps, "lr": LR, "eval_every": max(1, steps // 5)},
              "sync": {"method": "sync"}}
    for v in VARIANTS.values():
        bench.check(common, v)
    runs = {name: [bench.train(f"{name}-seed{s}", common, v, {"train": {"seed": s}})
                   for s in range(seeds)]
            for name, v in VARIANTS.items()}

    results: dict[str, Any] = {}
    rows = []
    for name, rs in runs.items():
        vals = mean_std(r.final_val_loss for r in rs)
        wall = mean_std(r.summary.get("wall_time_s") for r in rs if r.ok)
        results[name] = {"final_val_loss": vals, "wall_time_s": wall,
                         "per_seed": [r.final_val_loss for r in rs]}
        rows.append([name, cell(vals["mean"]), cell(vals["std"]), cell(vals["min"]),
                     cell(vals["max"]), f"{vals['n']}/{seeds}", cell(wall["mean"])])
    table = md_table(["optimizer", "final val loss (mean)", "std", "min", "max", "seeds ok",
                      "wall s (mean)"], rows)
    means = {k: v["final_val_loss"]["mean"] for k, v in results.items()
             if v["final_val_loss"]["mean"] is not None}
    findings = []
    if means:
        best = min(means, key=means.get)
        findings.append(f"Lowest mean final validation loss: {best} ({means[best]:.4f}); "
                        + ", ".join(f"{k} {v:.4f}" for k, v in sorted(means.items(),
                                                                      key=lambda kv: kv[1])))
    if "adamw+wsam" in results and "adamw" in results:
        w, a = results["adamw+wsam"]["wall_time_s"]["mean"], results["adamw"]["wall_time_s"]["mean"]
        if w and a:
            findings.append(f"WSAM's two passes per step cost {w / a:.2f}x AdamW's wall time.")
    return bench.finish(
        settings={"steps": steps, "seeds": seeds, "lr": LR, "agd_lr": LR / 10},
        methods=list(VARIANTS), results=results, tables=[("Final validation loss", table)],
        findings=findings, description=DESCRIPTION,
        notes=["Equal inner steps, not equal wall time: WSAM does two forward/backward "
               "passes per step.",
               "No hyper-parameter search: AdamW's lr is the trainer default, AGD uses a "
               "tenth of it as its authors suggest; a tuned AGD or WSAM may do better."],
    )
