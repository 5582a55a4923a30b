"""Stragglers: throughput and loss when one replica is slow or replicas stall at random.

Two replicas; in the ``straggler`` case replica 1 computes 2x slower (``sim.straggler
1=2``), in the ``stall`` case every step of every replica stalls with probability 0.1 for
0.2 s (``sim.random_stall 0.1,0.2``). ``sync`` waits for the slowest replica every step,
``edit`` at every sync, ``aedit`` syncs on a wall-clock period so that each replica
contributes the steps it managed. Each method is reported as a fraction of the physical
limit: the sum of the replicas' solo speeds.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.common import (
    Bench,
    Run,
    cell,
    md_table,
    median,
    pyplot,
    ratio,
    save_figure,
    steady_throughput,
)

NAME = "stragglers"
METHODS = ("sync", "edit", "aedit")
DESCRIPTION = (
    "Two replicas, one a 2x straggler (`--sim.straggler 1=2`), or random stalls on both "
    "(`--sim.random_stall 0.1,0.2`): tokens per second of the cluster and validation loss "
    "for `sync`, `edit` and `aedit` at an equal token budget, each as a fraction of the "
    "physical limit (the sum of the replicas' solo speeds)."
)
CASES = {
    "straggler": {"sim": {"straggler": ["1=2"]}},
    "stall": {"sim": {"random_stall": "0.1,0.2"}},
}


def run(bench: Bench) -> dict[str, Any]:
    """Run the scenario; returns the record written to ``results.json``."""
    interval = bench.pick(4, 16, 20)
    steps = bench.pick(16, 96, 200)
    skip = bench.pick(2, 4, 4)
    cases = bench.pick(("straggler",), tuple(CASES), tuple(CASES))
    common = {"train": {"steps": steps, "eval_every": steps,
                        "warmup_steps": min(10, steps // 4)},
              "sync": {"local_sgd_sync_interval": interval}}
    for case in cases:
        bench.check(common, CASES[case], {"sync": {"method": "aedit"}})

    results: dict[str, Any] = {}
    periods: dict[str, float] = {}
    for case in cases:
        runs: dict[str, Run] = {}
        for method in ("edit", "sync", "aedit"):  # edit first: it times A-EDiT's period
            layers: list[dict[str, Any]] = [common, CASES[case], {"sync": {"method": method}}]
            if method == "aedit":
                periods[case] = _period(runs.get("edit"), interval)
                layers.append({"sync": {"local_sgd_sync_time": periods[case],
                                        "min_total_global_steps": 2}})
            runs[method] = bench.train(f"{case}-{method}", *layers)
        options = bench.options(common, CASES[case])
        limit = _limit(runs, options)
        entry: dict[str, Any] = {"limit": limit}
        for method in METHODS:
            r = runs[method]
            w = steady_throughput(r, skip) if r.ok else {}
            entry[method] = {
                "tokens_per_s": w.get("tokens_per_s"),
                "fraction_of_limit": ratio(w.get("tokens_per_s"), limit.get("tokens_per_s")),
                "final_val_loss": r.final_val_loss,
                "tokens": r.summary.get("tokens"),
                "wall_time_s": r.summary.get("wall_time_s"),
                "num_syncs": r.summary.get("num_syncs"),
                "wait_s_per_step": w.get("wait_s_per_step"),
                "wait_s_per_sync": _per_sync(r, "wait_s"),
                "rendezvous_wait_s_per_sync": _per_sync(r, "rendezvous_wait_s")
                if method == "aedit" else None,
                "window": w,
                "replica_steps": _replica_steps(r) if method == "aedit" else None,
                "error": r.error,
            }
        results[case] = entry

    table = _table(results, cases)
    targets, findings = _judge(results, cases)
    plots = [_plot(bench, results, cases)]
    notes = [
        f"2 replicas, {steps} steps of budget (equal tokens for every method: A-EDiT also "
        f"ends on the token budget), `edit` syncs every H = {interval} steps, `aedit` every "
        + ", ".join(f"{periods[c]:.2f} s ({c})" for c in cases if c in periods)
        + " (H times the median step time of the fast replica in the `edit` run), with "
        "`sync.min_total_global_steps = 2`. Evaluation only at the end.",
        "Throughput: tokens between two rows of metrics.jsonl over the wall time between "
        f"them, from the first to the last sync inside a training step after step {skip} "
        f"(`sync`: from step {skip} to the end). Rank 0 (replica 0, the fast replica in the "
        "straggler case) writes the metrics; tokens count every replica's steps.",
        "Physical limit = sum over replicas of tokens per replica step / solo step time. "
        "Replica 0's solo step time is the median `step_time_s - sim_stall_s` of its steps "
        "without a sync in the `edit` and `aedit` runs; a straggler replica with factor f "
        "adds (f - 1) x the median `compute_s` (the simulator sleeps that long), random "
        "stalls add probability x stall seconds to every replica. Computed, not measured "
        "with separate solo runs: the same processes, cores and contention as the real run.",
        "The time budget is equal tokens: `wall s` is the time each method needed for it.",
    ]
    settings = {"steps": steps, "sync_interval": interval, "cases": list(cases),
                "aedit_sync_time_s": periods, "skip_steps": skip,
                "case_options": {c: CASES[c] for c in cases}}
    return bench.finish(settings=settings, methods=METHODS, results=results,
                        tables=[("Throughput as a fraction of the physical limit", table)],
                        targets=targets, findings=findings, notes=notes, plots=plots,
                        description=DESCRIPTION)


def _period(edit_run: Run | None, interval: int) -> float:
    """A-EDiT's sync period: H times the fast replica's median step time in ``edit``."""
    step = None
    if edit_run is not None and edit_run.ok:
        step = median(r.get("step_time_s", 0.0) - r.get("sim_stall_s", 0.0)
                      for r in edit_run.rows if "sync" not in r)
    return round(max(0.2, interval * (step or 0.1)), 3)


def _limit(runs: dict[str, Run], options: dict[str, Any]) -> dict[str, Any]:
    """Sum of the replicas' solo speeds, from replica 0's steps in the local-SGD runs of a
    case whose runs used ``options`` (their simulation settings)."""
    from editrain.config import load_config
    from editrain.sim import parse_sim

    cfg = load_config(None, options)
    plan = parse_sim(cfg.sim)
    rows = [r for m in ("edit", "aedit") if runs[m].ok for r in runs[m].rows[2:]
            if "sync" not in r and not r.get("sync_wait_s")]
    base = median(r["step_time_s"] - r.get("sim_stall_s", 0.0) for r in rows)
    compute = median(r.get("compute_s") for r in rows)
    if base is None or compute is None:
        return {"tokens_per_s": None}
    t = cfg.train
    per_step = t.batch_size * t.seq_len * t.gradient_accumulation_steps * cfg.dist.shard_size
    replicas = cfg.dist.nproc // cfg.dist.shard_size
    solo = []
    for rep in range(replicas):
        factor = 1.0
        for s in plan.stragglers:
            if s.replica == rep:
                factor *= s.factor  # always active in this scenario (no step range)
        solo.append(base + (factor - 1.0) * compute + plan.stall_prob * plan.stall_seconds)
    return {"tokens_per_s": sum(per_step / s for s in solo), "solo_step_time_s": solo,
            "replica0_step_time_s": base, "replica0_compute_s": compute,
            "tokens_per_replica_step": per_step}


def _per_sync(run: Run, key: str) -> float | None:
    """Median of a sync-entry field over the syncs that ran inside training steps."""
    if not run.ok:
        return None
    return median(s.get(key) for _, s in run.timed_syncs())


def _replica_steps(run: Run) -> list[float] | None:
    """A-EDiT: steps each replica did over the run (sum of the syncs' ``replica_steps``)."""
    total: list[float] | None = None
    for r in run.rows:
        counts = (r.get("sync") or {}).get("replica_steps")
        if counts:
            total = [a + b for a, b in zip(total, counts)] if total else list(counts)
    return total


def _table(results: dict[str, Any], cases: tuple[str, ...]) -> str:
    """The Markdown table: the limit and one row per method, per case."""
    rows = []
    for case in cases:
        e = results[case]
        rows.append([case, "physical limit", e["limit"].get("tokens_per_s"), 1.0, None, None,
                     None, None])
        for m in METHODS:
            x = e[m]
            steps = x["replica_steps"]
            rows.append([case, m, x["tokens_per_s"], x["fraction_of_limit"],
                         x["final_val_loss"], x["wall_time_s"], x["num_syncs"],
                         "/".join(f"{s:.0f}" for s in steps) if steps else None])
    return md_table(["case", "method", "tokens/s", "x limit", "final val loss", "wall s",
                     "syncs", "A-EDiT steps per replica"], rows)


def _judge(results: dict[str, Any],
           cases: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[str]]:
    """The target checks (aedit >= 0.9x of the limit) and the findings."""
    targets, findings = [], []
    for case in cases:
        e = results[case]
        f = e["aedit"]["fraction_of_limit"]
        targets.append({"name": f"{case}: aedit reaches >= 0.9x of the physical limit",
                        "met": None if f is None else f >= 0.9,
                        "detail": f"aedit {cell(f)}x, edit {cell(e['edit']['fraction_of_limit'])}x"
                                  f", sync {cell(e['sync']['fraction_of_limit'])}x"})
        a = e["aedit"]
        if a["rendezvous_wait_s_per_sync"] is not None and a["wait_s_per_sync"] is not None:
            findings.append(
                f"{case}: at a sync aedit waits {a['rendezvous_wait_s_per_sync'] * 1000:.0f} ms "
                f"(median) at the rendezvous, where every replica first finishes the step it "
                f"is in, plus {a['wait_s_per_sync'] * 1000:.0f} ms for the layer-wise sync; "
                f"edit waits {cell((e['edit']['wait_s_per_sync'] or 0) * 1000)} ms per sync "
                "for the slowest replica's whole window.")
        losses = {m: e[m]["final_val_loss"] for m in METHODS if e[m]["final_val_loss"]}
        if losses:
            findings.append(f"{case}: final validation loss "
                            + ", ".join(f"{m} {v:.4f}" for m, v in losses.items())
                            + "; wall time to the budget "
                            + ", ".join(f"{m} {cell(e[m]['wall_time_s'])} s" for m in METHODS)
                            + ".")
    return targets, findings


def _plot(bench: Bench, results: dict[str, Any], cases: tuple[str, ...]):
    """Throughput as a fraction of the physical limit, per case and method."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(METHODS)
    for j, m in enumerate(METHODS):
        ys = [results[c][m]["fraction_of_limit"] or 0.0 for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=m)
    ax.axhline(1.0, color="gray", linestyle="--", label="physical limit")
    ax.axhline(0.9, color="gray", linestyle=":", label="0.9x target")
    ax.set_xticks([i + width * (len(METHODS) - 1) / 2 for i in range(len(cases))], cases)
    ax.set_ylabel("throughput / physical limit")
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, bench.out_dir / "fraction_of_limit.png")
