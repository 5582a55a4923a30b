"""Stragglers: throughput and loss when one replica is slow or replicas stall at random.

Two replicas; in the ``straggler`` case replica 1 computes 2x slower (``sim.straggler
1=2``), in the ``stall`` case every step of every replica stalls with probability 0.1 for
0.2 s (``sim.random_stall 0.1,0.2``). ``sync`` waits for the slowest replica every step,
``edit`` at every sync, ``aedit`` syncs on a wall-clock period so that each replica
contributes the steps it managed. Each method is reported as a fraction of the measured
limit: the sum of the replicas' solo speeds, each measured in its own single-replica run
with that replica's simulation, a round's solo runs all at once, over the same steps the
replica trained in the compared run (so with the same simulated stalls), the mean of the
rounds just before and just after the compared run (:mod:`editrain.bench.limits`). Per
replica, the utilisation (time computing, simulated slowdown included, over wall time)
comes from the per-rank logs.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.limits import SoloPlan, bracketed_limit, measured_limit, plan_solo_runs
from editrain.bench.measures import aedit_period, over_repeats, replica_spreads, run_refs
from editrain.bench.options import timed_train
from editrain.bench.plots import median_bars
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench, repeat_label
from editrain.bench.runs import Run
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict, differences, figure
from editrain.bench.stats import compare, median, spread
from editrain.bench.tables import cell, ratio, spread_cell, spread_of

TEXT = prose("stragglers")
METHODS = ("sync", "edit", "aedit", "aedit-nb")
GROUPS = (("edit", "sync"), ("aedit", "aedit-nb"))
"""Run order within a repeat: each pair between two rounds of solo runs (edit first: it
times A-EDiT's period)."""
NONBLOCKING = {"overlap_steps": 2, "merge": "keep_local"}
"""``aedit-nb``: A-EDiT with its sync behind 2 of each replica's steps (non-blocking)."""
CASES = {
    "straggler": {"sim": {"straggler": ["1=2"]}},
    "stall": {"sim": {"random_stall": "0.1,0.2"}},
}
MAX_DRIFT = 0.10
"""A repeat whose two bracketing limits differ by more than this (over their mean) is left
out of the fractions of the limit: the machine's speed changed under it by more than the
effects measured. The rule looks at the solo runs only, never at the compared run."""
COMPARISONS = (("aedit-nb", "aedit"), ("aedit-nb", "edit"), ("aedit", "edit"),
               ("aedit", "sync"), ("edit", "sync"))
"""Pairs whose fractions of the limit are compared against the spread of the repeats."""


def _setup(bench: Bench) -> dict[str, Any]:
    # A budget or interval given on the command line (--train.steps=..., longer windows
    # average out a noisy machine) sets the whole scenario: evaluation, plan, description.
    interval = bench.setting("sync.local_sgd_sync_interval",
                             {"sync": {"local_sgd_sync_interval": bench.pick(4, 16, 20)}})
    steps = bench.setting("train.steps", {"train": {"steps": bench.pick(16, 96, 200)}})
    common = {"train": timed_train(steps),
              "sync": {"local_sgd_sync_interval": interval}}
    cases = bench.pick(("straggler",), tuple(CASES), tuple(CASES))
    # tiny: A-EDiT's shortest period (0.2 s) is most of the budget, and a replica's
    # steps past the budget's last sync can pass its share: longer solo runs.
    plan_margin = bench.pick(2.0, 1.25, 1.25)
    for case in cases:  # before the solo plan reads the configuration: a clear error
        bench.check(common, CASES[case], {"sync": {"method": "aedit"}})
    return {"interval": interval, "steps": steps, "skip": bench.pick(2, 4, 4), "cases": cases,
            "common": common, "plan_margin": plan_margin, "periods": {}, "measured": {},
            "solo_plans": {case: plan_solo_runs(bench.config(common, CASES[case]),
                                                margin=plan_margin) for case in cases}}


def _runs(ctx: Ctx):
    """Per case, interleaved: solos, then per repeat edit, sync, solos, aedit, aedit-nb,
    solos; the limits of every compared run from the solo rounds around it."""
    for case in ctx.cases:
        plan, skip = ctx.solo_plans[case], ctx.skip
        runs: dict[str, list[Run]] = {m: [] for m in METHODS}
        rounds = [dict(zip(plan.layers, (yield _solo_round(ctx, case, 0))))]
        limits = [measured_limit(plan, rounds[-1], skip)]
        matched: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        for rep in range(ctx.bench.repeats):
            for group in GROUPS:
                for method in group:
                    sync = ({"method": "aedit", **NONBLOCKING} if method == "aedit-nb"
                            else {"method": method})
                    layers: list[dict[str, Any]] = [ctx.common, CASES[case], {"sync": sync}]
                    if sync["method"] == "aedit":
                        if case not in ctx.periods:  # timed once, then fixed for every repeat
                            ctx.periods[case] = aedit_period(runs["edit"][0], ctx.interval)
                        layers.append({"sync": {"local_sgd_sync_time": ctx.periods[case],
                                                "min_total_global_steps": 2}})
                    runs[method].append((yield Job(repeat_label(f"{case}-{method}", rep),
                                                   layers,
                                                   title=f"{case} {method} repeat {rep + 1}")))
                rounds.append(dict(zip(plan.layers,
                                       (yield _solo_round(ctx, case, len(rounds))))))
                limits.append(measured_limit(plan, rounds[-1], skip))
                for method in group:  # the solo runs just before and just after the pair
                    matched[method].append(bracketed_limit(plan, rounds[-2:],
                                                           runs[method][-1], skip))
        ctx.measured[case] = (runs, limits, matched)


def _solo_round(ctx: Ctx, case: str, n: int) -> list[Job]:
    """Round ``n`` of solo runs: every replica's, at once (the replicas share the machine in
    the compared runs too). The solo layer goes over the user's options too: whatever they
    change, a solo run stays one replica without communication, slowed like its replica."""
    plan = ctx.solo_plans[case]
    return [Job(repeat_label(f"{case}-{plan.labels[key]}", n), (ctx.common, CASES[case]),
                title=f"{case} {plan.labels[key]} round {n + 1}", last=plan.layers[key])
            for key in plan.layers]


def _results(ctx: Ctx) -> dict[str, Any]:
    results = {case: _case_results(*ctx.measured[case], ctx.solo_plans[case], ctx.skip)
               for case in ctx.cases}
    ctx.errors = [f"{case}: {e}" for case in ctx.cases for e in results[case]["errors"]]
    return results


def _verdict(ctx: Ctx) -> Verdict:
    targets, findings = _judge(ctx.results, ctx.cases, ctx.bench.repeats)
    return Verdict(targets=targets, findings=findings, errors=ctx.errors,
                   headline=_headline(ctx.results, ctx.cases, ctx.bench.repeats))


def _notes(ctx: Ctx) -> list[str]:
    periods = ", ".join(f"{ctx.periods[c]:.2f} s ({c})" for c in ctx.cases if c in ctx.periods)
    return fill(TEXT["notes"], ctx=ctx, periods=periods, max_drift=MAX_DRIFT,
                nonblocking=", ".join(f"{k} {v}" for k, v in NONBLOCKING.items()))


def _settings(ctx: Ctx) -> dict[str, Any]:
    return {"steps": ctx.steps, "sync_interval": ctx.interval, "cases": list(ctx.cases),
            "aedit_sync_time_s": ctx.periods, "skip_steps": ctx.skip,
            "repeats": ctx.bench.repeats, "solo_steps_margin": ctx.plan_margin,
            "run_order": [list(g) for g in GROUPS],
            "case_options": {c: CASES[c] for c in ctx.cases},
            "solo_runs": {c: {p.labels[k]: {"replicas": p.replicas_of(k), "sim": p.sims[k]}
                              for k in p.layers} for c, p in ctx.solo_plans.items()}}


def _case_results(runs: dict[str, list[Run]], limits: list[dict[str, Any]],
                  matched: dict[str, list[dict[str, Any]]], plan: SoloPlan,
                  skip: int) -> dict[str, Any]:
    """The numbers of one case: the solo runs, every method's spreads against its limit over
    the same steps, the comparisons."""
    solo_values = [x["tokens_per_s"] for x in limits]
    entry: dict[str, Any] = {
        "limit": {
            "tokens_per_s": spread(solo_values),
            "per_round": solo_values,
            "per_replica": [spread(x["per_replica"][i] for x in limits)
                            for i in range(len(plan.replica_keys))],
            "solo_runs": [plan.labels[k] for k in plan.replica_keys],
            "solo_utilisation": {plan.labels[k]: spread(x["utilisation"][plan.labels[k]]
                                                        for x in limits)
                                 for k in plan.layers},
        },
        "errors": [],
    }
    for method in METHODS:
        entry[method], errors = _method_results(method, runs[method], matched[method], skip)
        entry["errors"] += errors
    entry["comparisons"] = [compare(a, b, entry[a]["fraction_of_limit"],
                                    entry[b]["fraction_of_limit"]) for a, b in COMPARISONS]
    return entry


def _method_results(method: str, reps: list[Run], matched: list[dict[str, Any]],
                    skip: int) -> tuple[dict[str, Any], list[str]]:
    """One method's numbers over its repeats, each against the limit over the same steps
    (a repeat measured on an unsteady machine left out), and its measurement errors."""
    windows, per_replica, found = over_repeats(reps, skip)
    speeds = [w.get("tokens_per_s") for w in windows]
    steady = [x["drift"] is not None and x["drift"] <= MAX_DRIFT for x in matched]
    used = [x if ok else {**x, "tokens_per_s": None, "per_replica": [None] * len(x["per_replica"])}
            for x, ok in zip(matched, steady)]
    fractions = [ratio(s, x["tokens_per_s"]) for s, x in zip(speeds, used)]
    replicas = [{**r, "solo_tokens_per_s": spread(x["per_replica"][i] for x in used
                                                  if len(x["per_replica"]) > i),
                 "x_solo": spread(ratio(p[i]["tokens_per_s"], x["per_replica"][i])
                                  for p, x in zip(per_replica, used)
                                  if len(p) > i and len(x["per_replica"]) > i),
                 "steps": [x["steps"][i] for x in matched if len(x["steps"]) > i]}
                for i, r in enumerate(replica_spreads(per_replica))]
    errors = [f"{method} repeat {k + 1}: {e}" for k, p in enumerate(found) for e in p]
    errors += [fill(TEXT["above_limit"], method=method, k=k + 1, f=f)
               for k, f in enumerate(fractions) if f is not None and f > 1.0]
    aedit = "aedit" in method
    return {
        "tokens_per_s": spread(speeds),
        "limit_tokens_per_s": spread(x["tokens_per_s"] for x in used),
        "limit_per_repeat": [x["tokens_per_s"] for x in matched],
        "limit_brackets": [x["brackets"] for x in matched],
        "limit_drift": spread(x["drift"] for x in matched),
        "limit_drift_per_repeat": [x["drift"] for x in matched],
        "unsteady_repeats": [k + 1 for k, ok in enumerate(steady) if not ok],
        "fraction_of_limit": spread(fractions),
        "fraction_above_1": any(f is not None and f > 1.0 for f in fractions),
        "final_val_loss": spread(r.final_val_loss for r in reps),
        "wall_time_s": spread(r.summary.get("wall_time_s") for r in reps),
        "num_syncs": median(r.summary.get("num_syncs") for r in reps),
        "replicas": replicas,
        "per_replica_rows": [len(r.ranks) for r in reps],
        "wait_s_per_sync": median(_per_sync(r, "wait_s") for r in reps),
        "rendezvous_wait_s_per_sync": median(_per_sync(r, "rendezvous_wait_s")
                                             for r in reps) if aedit else None,
        "replica_steps": [_replica_steps(r) for r in reps] if aedit else None,
        "windows": windows,
        **run_refs(reps),
    }, errors


def _per_sync(run: Run, key: str) -> float | None:
    """Median of a sync-entry field over the syncs that ran inside training steps."""
    return median(s.get(key) for _, s in run.timed_syncs()) if run.ok else None


def _replica_steps(run: Run) -> list[float] | None:
    """A-EDiT: steps each replica did over the run (sum of the syncs' ``replica_steps``,
    the last round's, which the end's ``finish()`` completes, included)."""
    total: list[float] | None = None
    for s in run.sync_entries():
        counts = s.get("replica_steps")
        if counts:
            total = [a + b for a, b in zip(total, counts)] if total else list(counts)
    return total


def _fraction_cell(x: dict[str, Any]) -> str:
    """The x-limit cell: the spread, marked when any repeat was above 1."""
    text = spread_cell(x["fraction_of_limit"])
    if x["unsteady_repeats"]:
        text += f" (repeat(s) {', '.join(map(str, x['unsteady_repeats']))} left out: unsteady)"
    return text + " **MEASUREMENT ERROR: > 1**" if x["fraction_above_1"] else text


def _steps_text(x: dict[str, Any]) -> str | None:
    """A-EDiT's steps per replica in repeat 1 (``12/7``)."""
    steps = x["replica_steps"][0] if x["replica_steps"] else None
    return "/".join(f"{s:.0f}" for s in steps) if steps else None


def _replica_rows(ctx: Ctx) -> list[list[Any]]:
    """Per case: each replica's solo run, then each method's replicas."""
    rows = []
    for case in ctx.cases:
        e = ctx.results[case]
        for i, solo in enumerate(e["limit"]["per_replica"]):
            label = e["limit"]["solo_runs"][i]
            rows.append([case, f"{label} (all its steps)", i, spread_cell(solo), None, None,
                         None, spread_cell(e["limit"]["solo_utilisation"][label])])
        for m in METHODS:
            reps = e[m]["replicas"]
            if not reps:
                rows.append([case, m, "all", "n/a (no per-rank logs)", None, None, None, None])
            for r in reps:
                steps = r["steps"][0] if r["steps"] else None
                rows.append([case, m, r["replica"], spread_cell(r["tokens_per_s"]),
                             spread_cell(r["solo_tokens_per_s"]), spread_cell(r["x_solo"]),
                             f"{steps[0] + 1}-{steps[1]}" if steps else None,
                             spread_cell(r["utilisation"])])
    return rows



def _column(i: int):
    return lambda row: row[i]


TABLES = [
    Table("Throughput as a fraction of the measured limit", [
        ("case", _column(0)), ("method", _column(1)), ("tokens/s", spread_of("tokens_per_s")),
        ("measured limit (solo speeds, same steps)", spread_of("limit_tokens_per_s")),
        ("limit drift (before vs after)", spread_of("limit_drift")),
        ("x limit", lambda row: _fraction_cell(row[2])),
        ("final val loss", spread_of("final_val_loss")), ("wall s", spread_of("wall_time_s")),
        ("syncs", lambda row: row[2]["num_syncs"]),
        ("A-EDiT steps per replica (repeat 1)", lambda row: _steps_text(row[2]))],
        rows=lambda ctx: [(c, m, ctx.results[c][m]) for c in ctx.cases for m in METHODS]),
    Table("Per replica", [(h, _column(i)) for i, h in enumerate(
        ["case", "run", "replica", "tokens/s", "solo tokens/s, same steps", "x solo",
         "steps (repeat 1)", "utilisation"])], rows=_replica_rows),
    differences("case", "x limit difference (medians)", lambda ctx: [
        (case, c) for case in ctx.cases for c in ctx.results[case]["comparisons"]]),
]


def _judge(results: dict[str, Any], cases: tuple[str, ...],
           repeats: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The target checks (aedit-nb >= 0.95x and aedit >= 0.9x of the measured limit) and the
    findings of every case."""
    targets, findings = [], []
    for case in cases:
        targets += _targets(results[case], case, repeats)
        findings += _findings(results[case], case, repeats)
    if repeats < 2:
        findings.append(TEXT["findings"]["one_repeat"])
    return targets, findings


def _steady_median(x: dict[str, Any], repeats: int) -> float | None:
    """The median fraction of the limit, None unless a majority of the repeats were
    measured on a steady machine."""
    fraction = x["fraction_of_limit"]
    return fraction["median"] if fraction["n"] >= repeats // 2 + 1 else None


def _targets(e: dict[str, Any], case: str, repeats: int) -> list[dict[str, Any]]:
    """Non-blocking aedit's target (with a speed-up over edit for the straggler), then
    aedit's; none is judged on a case with a measurement error."""
    t, nb = TEXT["targets"], e["aedit-nb"]
    f_nb = _steady_median(nb, repeats)
    speedup = ratio(nb["tokens_per_s"]["median"], e["edit"]["tokens_per_s"]["median"])
    met_nb = None if f_nb is None or speedup is None else (
        f_nb >= 0.95 and (case != "straggler" or speedup >= 1.4))
    f = _steady_median(e["aedit"], repeats)
    detail = ", ".join(f"{m} {spread_cell(e[m]['fraction_of_limit'])}x" for m in METHODS)
    return [{"name": fill(t["nonblocking"], case=case,
                          speedup_target=t["speedup"] if case == "straggler" else ""),
             "met": None if e["errors"] else met_nb,
             "detail": fill(t["nonblocking_detail"], speedup=cell(speedup),
                            fraction=spread_cell(nb["fraction_of_limit"]))},
            {"name": fill(t["aedit"], case=case),
             "met": None if e["errors"] or f is None else f >= 0.9,
             "detail": fill(t["error"], detail=detail) if e["errors"] else detail}]


def _findings(e: dict[str, Any], case: str, repeats: int) -> list[str]:
    """How steady the machine was, where aedit waits, the differences, the losses."""
    said, enough = TEXT["findings"], repeats // 2 + 1
    drifts = spread(d for group in GROUPS  # one pair of brackets per group
                    for d in e[group[0]]["limit_drift_per_repeat"])
    left_out = "; ".join(f"{m} repeat(s) {', '.join(map(str, e[m]['unsteady_repeats']))}"
                         for m in METHODS if e[m]["unsteady_repeats"])
    few = min(e[m]["fraction_of_limit"]["n"] for m in ("aedit", "aedit-nb")) < enough
    findings = [fill(said["drift"], case=case, drifts=spread_cell(drifts),
                     left_out=fill(said["left_out"] if left_out else said["steady"],
                                   max_drift=MAX_DRIFT, repeats=left_out),
                     few=fill(said["few"], enough=enough) if few else "")]
    a = e["aedit"]
    if a["rendezvous_wait_s_per_sync"] is not None and a["wait_s_per_sync"] is not None:
        findings.append(fill(said["waits"], case=case,
                             rendezvous=a["rendezvous_wait_s_per_sync"] * 1000,
                             wait=a["wait_s_per_sync"] * 1000,
                             edit=cell((e["edit"]["wait_s_per_sync"] or 0) * 1000)))
    findings += [fill(said["difference"], case=case, c=c, repeats=repeats,
                      where="beyond" if c["beyond_spread"] else "within")
                 for c in e["comparisons"]
                 if c["beyond_spread"] is not None and c["difference"] is not None]
    losses = {m: e[m]["final_val_loss"]["median"] for m in METHODS}
    if any(v is not None for v in losses.values()):
        findings.append(fill(
            said["losses"], case=case,
            losses=", ".join(f"{m} {cell(v)}" for m, v in losses.items()),
            walls=", ".join(f"{m} {spread_cell(e[m]['wall_time_s'])} s" for m in METHODS)))
    return findings


def _headline(results: dict[str, Any], cases: tuple[str, ...], repeats: int) -> list[str]:
    """The report's summary sentences (none for a case with a measurement error)."""
    out = []
    for case in cases:
        e = results[case]
        if e["errors"]:
            out.append(fill(TEXT["headline"]["error"], case=case))
            continue
        parts = ", ".join(f"{m} {spread_cell(e[m]['fraction_of_limit'], 1.0)}"
                          for m in ("aedit-nb", "aedit", "edit", "sync"))
        out.append(fill(TEXT["headline"]["fractions"], case=case, repeats=repeats,
                        parts=parts))
    return out


def _plot(ctx: Ctx):
    """Throughput as a fraction of the measured limit (median, min-max bars)."""
    results, cases = ctx.results, ctx.cases
    with figure(ctx, "fraction_of_limit.png", grid="y",
                ylabel="throughput / measured limit (median, min-max)") as ax:
        width = 0.8 / len(METHODS)
        for j, m in enumerate(METHODS):
            ys, bars = median_bars([results[c][m]["fraction_of_limit"] for c in cases], 0.0)
            ax.bar([i + j * width for i in range(len(cases))], ys, width, yerr=bars,
                   capsize=3, label=m)
        ax.axhline(1.0, color="gray", linestyle="--", label="measured limit")
        ax.axhline(0.9, color="gray", linestyle=":", label="0.9x target")
        ax.set_xticks([i + width * (len(METHODS) - 1) / 2 for i in range(len(cases))], cases)
    return ctx.plot


SCENARIO = Scenario(
    name="stragglers",
    description=TEXT["description"],
    setup=_setup, runs=_runs, measure=_results, judge=_verdict, notes=_notes,
    settings=_settings, plots=[_plot], repeats=True, methods=lambda ctx: METHODS,
    checks=lambda ctx: [((ctx.common, CASES[case]), layer) for case in ctx.cases
                        for layer in ctx.solo_plans[case].layers.values()],
    planned=lambda ctx: sum(ctx.bench.repeats * len(METHODS)
                            + (len(GROUPS) * ctx.bench.repeats + 1) * len(p.layers)
                            for p in ctx.solo_plans.values()),
    tables=TABLES,
)
