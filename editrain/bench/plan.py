"""Plan: the planner's predictions against measured runs on held-out settings.

Three groups of runs, each with its own hardware: the simulated 5 MB/s + 5 ms link, a 2x
straggler, random stalls. A group's calibration runs give ``editrain plan --calibrate``
the compute per step, the step overhead, the replicas' speeds and the machine's own
communication cost beyond the simulated link; its held-out runs (other methods, H, links,
overlap, fragments, codecs, A-EDiT) are predicted by ``editrain.plan`` from their settings
alone, then measured: tokens/s, utilisation and the communication the training thread
waited for.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from editrain.bench.measures import replica_stats, steady_throughput
from editrain.bench.options import timed_train
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench
from editrain.bench.runs import Run
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict, figure
from editrain.bench.tables import cell, ms

TEXT = prose("plan")
DESCRIPTION = TEXT["description"]
CAL_LINK = ("5MB/s", "5ms")
FAST_LINK = ("20MB/s", "5ms")
SLOW_LINK = ("1MB/s", "5ms")
STRAGGLER = {"straggler": ["1=2"]}
STALL = {"random_stall": "0.1,0.2"}
EDIT = {"method": "edit"}
INT8 = {"method": "edit", "fragments": 4, "comm_dtype": "int8"}

Spec = tuple[dict[str, Any], "tuple[str, str] | None", dict[str, Any]]
"""A run: (sync options, (bandwidth, latency) or None for an unlimited link, sim options)."""
# Per group, in the order they run: ("cal", label, spec) calibration runs and ("held",
# label, spec) held-out runs. A group's hardware is its calibration runs' (on this shared
# machine a replica that sleeps, a simulated straggler or stall, frees a core for the
# other); every held-out run lies between two calibration runs, whose mean compute speed
# it is predicted with (the machine's speed drifts), while the link is fitted on all of
# the group's calibration runs.
GROUPS: dict[str, list[tuple[str, str, Spec]]] = {
    "link": [
        ("cal", "cal-edit-fp32", (EDIT, CAL_LINK, {})),
        ("held", "diloco-20MBs", ({"method": "diloco"}, FAST_LINK, {})),
        ("held", "edit-1MBs", (EDIT, SLOW_LINK, {})),
        ("cal", "cal-edit-P4-int8", (INT8, CAL_LINK, {})),
        ("held", "edit-tau2-P4-int8-1MBs", ({"method": "edit", "overlap_steps": 2,
                                             "fragments": 4, "comm_dtype": "int8"},
                                            SLOW_LINK, {})),
        ("held", "edit-tau4-P4-int4-5MBs", ({"method": "edit", "overlap_steps": 4,
                                             "fragments": 4, "comm_dtype": "int4"},
                                            CAL_LINK, {})),
        ("held", "sync-20MBs", ({"method": "sync"}, FAST_LINK, {})),
        ("cal", "cal-edit-fp32-again", (EDIT, CAL_LINK, {})),
    ],
    "straggler": [
        ("cal", "cal-edit-straggler2x", (EDIT, None, STRAGGLER)),
        ("held", "aedit-straggler2x", ({"method": "aedit"}, None, STRAGGLER)),
        ("held", "aedit-nb-straggler2x", ({"method": "aedit", "overlap_steps": 2}, None,
                                          STRAGGLER)),
        ("cal", "cal-edit-straggler2x-again", (EDIT, None, STRAGGLER)),
    ],
    "stall": [
        ("cal", "cal-edit-stalls", (EDIT, None, STALL)),
        ("held", "sync-stalls", ({"method": "sync"}, None, STALL)),
        ("held", "diloco-H4-stalls", ({"method": "diloco", "local_sgd_sync_interval": 4},
                                      None, STALL)),
        ("cal", "cal-edit-stalls-again", (EDIT, None, STALL)),
    ],
}
TINY = {"link": ("cal-edit-fp32", "diloco-20MBs", "cal-edit-fp32-again"),
        "straggler": ("cal-edit-straggler2x", "aedit-straggler2x")}


def _setup(bench: Bench) -> dict[str, Any]:
    tiny = bench.mode == "tiny"
    return {"interval": bench.pick(8, 16, 16), "steps": bench.pick(24, 128, 256),
            "sync_steps": bench.pick(10, 32, 64), "skip": bench.pick(2, 4, 4), "done": {},
            "groups": {g: [x for x in seq if not tiny or x[1] in TINY[g]]
                       for g, seq in GROUPS.items() if not tiny or g in TINY},
            # The tiny preset has three units when tied: too few for four fragments.
            "model": {} if bench.mode == "full" else {"model": {"tie_embeddings": False}}}


def _layers(ctx: Ctx, sync: dict[str, Any], link: tuple[str, str] | None,
            sim: dict[str, Any]) -> list[dict[str, Any]]:
    # sync pays the link at every step: fewer steps on a slow link.
    n = ctx.sync_steps if sync["method"] == "sync" and link else ctx.steps
    bw, lat = link if link else (None, None)
    first: dict[str, Any] = {
        "train": timed_train(n),
        "sync": {}, "sim": {"link_bandwidth": bw, "link_latency": lat, **sim}, **ctx.model}
    if sync["method"] != "sync":
        first["sync"]["local_sgd_sync_interval"] = ctx.interval
    if sync["method"] == "aedit":
        first["sync"]["min_total_global_steps"] = 2
    return [first, {"sync": dict(sync)}]


def _runs(ctx: Ctx):
    """Every group's runs in order; A-EDiT's window from the calibration run before it."""
    from editrain.plan.calibrate import calibrate

    for group, seq in ctx.groups.items():
        done = ctx.done[group] = []
        last_cal = None
        for kind, label, (sync, link, sim) in seq:
            if sync["method"] == "aedit" and last_cal is not None:
                # A-EDiT's window: H steps of the fast replica, as the stragglers benchmark.
                c = calibrate([last_cal.run_dir], skip=ctx.skip)
                sync = {**sync, "local_sgd_sync_time":
                        round(ctx.interval * (c.samples[0].compute_s + c.step_overhead_s), 4)}
            r = yield Job(label, _layers(ctx, sync, link, sim), title=f"{group}: {label}")
            done.append((kind, label, (sync, link, sim), r))
            if kind == "cal" and r.ok:
                last_cal = r


def _results(ctx: Ctx) -> dict[str, Any]:
    results: dict[str, Any] = {"groups": {}, "held_out": {}, "in_sample": {}}
    machine = None  # the first group whose runs measured the machine's own communication
    for group, seq in ctx.groups.items():
        straggler = bool(seq[0][2][2].get("straggler"))
        got = group_rows(ctx.done[group], ctx.skip, straggler, machine)
        if got is None:
            results["groups"][group] = {"error": "no calibration run finished"}
            continue
        whole, held, own = got
        if machine is None and _measured_own(whole):
            machine = whole
        for key, rows in (("held_out", held), ("in_sample", own)):
            for row in rows.values():
                row["group"] = group
            results[key].update(rows)
        results["groups"][group] = {"calibration": _calibration_record(whole),
                                    "straggler": straggler}
    if not any(e.get("ok") for e in results["held_out"].values()):
        ctx.skipped = "skipped: no held-out run could be predicted"
    return results


def _measured_own(cal: Any) -> bool:
    """Whether a calibration's runs measured the machine's own communication cost."""
    return bool(cal.own_bandwidth_bytes_per_s or cal.own_latency_s)


def _own_from(cal: Any, source: Any) -> Any:
    """``cal`` with the machine's own communication cost of ``source``."""
    return dataclasses.replace(cal, own_bandwidth_bytes_per_s=source.own_bandwidth_bytes_per_s,
                               own_latency_s=source.own_latency_s)


def _link_name(link: tuple[str, str] | None) -> str:
    return "+".join(link) if link else "unlimited"


def group_rows(done: list[tuple[str, str, Spec, Run]], skip: int, straggler: bool,
               machine: Any = None) -> tuple[Any, dict[str, Any], dict[str, Any]] | None:
    """Predict every run of a group from its calibration runs and compare.

    Args:
        done: ``(kind, label, spec, run)`` in the order the runs ran (``kind``: ``cal`` or
            ``held``).
        skip: steps left out at the start of each run.
        straggler: whether the group's spread is the replicas' (a straggler group).
        machine: a calibration whose runs measured the machine's own cost per collective
            and per byte (the ``link`` group's, whose simulated link separates it from
            the rest), used where this group's runs cannot: on an unlimited link their
            rounds are too few and too alike to fit it. None: the group's own.

    Returns:
        ``(calibration on all of the group's calibration runs, held-out rows, calibration
        runs' own rows)``, or None when no calibration run finished.
    """
    from editrain.plan.calibrate import calibrate

    cal_runs = [(i, r) for i, (kind, _, _, r) in enumerate(done) if kind == "cal" and r.ok]
    if not cal_runs:
        return None
    whole = calibrate([r.run_dir for _, r in cal_runs], skip=skip)
    if machine is not None and not _measured_own(whole):
        whole = _own_from(whole, machine)
    held: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for i, (kind, label, (_sync, link, sim), r) in enumerate(done):
        # The calibration runs just before and after (the run itself for a calibration
        # run): their compute speed, overhead and spread; the link from the whole group.
        near = [r] if kind == "cal" else (
            [x for j, x in cal_runs if j < i][-1:] + [x for j, x in cal_runs if j > i][:1])
        out = held if kind == "held" else own
        if not r.ok or not near:
            out[label] = {"ok": False, "error": r.error, "link": _link_name(link)}
            continue
        cal = _own_from(calibrate([x.run_dir for x in near], skip=skip), whole)
        out[label] = _compare(cal, r, link, sim, skip, straggler)
        out[label]["calibrated_on"] = [x.label for x in near]
    return whole, held, own


def _predict(cal: Any, run_dir: Any, link: tuple[str, str] | None, sim: dict[str, Any],
             straggler: bool, step_time_s: float | None = None) -> Any:
    """The planner's prediction of one run from its settings and the calibration (the
    run's own metrics are not read, only its ``config.toml``). ``step_time_s``: a
    measured mean compute per step instead (the diagnostic; it holds the rounds' CPU
    slowdown already, so none is added)."""
    from editrain.plan.calibrate import read_config
    from editrain.plan.model import predict
    from editrain.sim import parse_bandwidth, parse_duration

    method, model = read_config(run_dir)
    bw, lat = (parse_bandwidth(link[0]), parse_duration(link[1])) if link else (None, 0.0)
    prob, seconds = map(float, (sim.get("random_stall") or "0,0").split(","))
    cluster = cal.cluster(**cal.with_link(bw, lat),
                          straggler_spread=cal.straggler_spread if straggler else 0.0,
                          stall_prob=prob, stall_s=seconds,
                          step_time_s=step_time_s or cal.step_time_s,
                          overlap_cpu_s=0.0 if step_time_s else cal.overlap_cpu_s)
    return predict(cluster, model, method)


def _compare(cal: Any, run: Run, link: tuple[str, str] | None, sim: dict[str, Any],
             skip: int, straggler: bool = False) -> dict[str, Any]:
    """Predicted and measured numbers of one run."""
    from editrain.plan.calibrate import read_run

    entry: dict[str, Any] = {"link": _link_name(link), "sim": sim, "ok": run.ok,
                             "error": run.error}
    if not run.ok:
        return entry
    pred = _predict(cal, run.run_dir, link, sim, straggler)
    window = steady_throughput(run, skip)
    utils = _window_utilisation(run, window, skip, pred.method.method == "aedit")
    wait = "grad_sync_s_per_step" if pred.method.method == "sync" else "wait_s_per_step"
    measured = {"tokens_per_s": window.get("tokens_per_s"),
                "utilisation": statistics.fmean(utils) if utils else None,
                "exposed_comm_s": window.get(wait), "step_time_s": window.get("step_time_s")}
    own_compute = read_run(run.run_dir, skip).compute_s
    # A diagnostic, not the prediction: the same with this run's own mean compute per
    # step, i.e. the model's error without the machine's drift between runs.
    matched = _predict(cal, run.run_dir, link, sim, straggler, own_compute)
    entry.update({
        "setting": pred.label,
        # For reading the errors only (not used by the prediction): how fast this run
        # computed against the calibration it was predicted with.
        "compute_s": {"calibrated": pred.compute_s, "measured": own_compute},
        "compute_matched": {"tokens_per_s": matched.tokens_per_s,
                            "utilisation": matched.utilisation},
        "predicted": {"tokens_per_s": pred.tokens_per_s, "utilisation": pred.utilisation,
                      "exposed_comm_s": pred.exposed_comm_s,
                      "step_time_s": pred.wall_per_step_s,
                      "bytes_per_round": pred.bytes_per_round},
        "measured": measured,
        "tokens_ratio": (pred.tokens_per_s / measured["tokens_per_s"]
                         if measured["tokens_per_s"] else None),
        "utilisation_diff": (pred.utilisation - measured["utilisation"]
                             if measured["utilisation"] is not None else None),
    })
    return entry


def _window_utilisation(run: Run, window: dict[str, Any], skip: int,
                        per_replica_steps: bool) -> list[float]:
    """Each rank's busy time (compute + simulated slowdown) over its wall time in the
    steady window of whole sync cycles, so that tokens/s and utilisation cover the same
    steps. A-EDiT's replicas count their steps apart: there, each rank's window from its
    step ``skip`` to its end (``replica_stats``)."""
    if per_replica_steps or not window:
        return [r["utilisation"] for r in replica_stats(run, skip)
                if r.get("utilisation") is not None]
    lo, hi = window["from_step"], window["to_step"]
    out = []
    for rows in run.ranks.values():
        by_step = {r["step"]: r for r in rows}
        if lo not in by_step or hi not in by_step:
            continue
        seconds = by_step[hi]["wall_time_s"] - by_step[lo]["wall_time_s"]
        busy = sum((r.get("compute_s") or 0.0) + (r.get("sim_stall_s") or 0.0)
                   for r in rows if lo < r["step"] <= hi)
        if seconds > 0:
            out.append(busy / seconds)
    return out


CALIBRATION_FIELDS = ("step_time_s", "step_overhead_s", "bandwidth_bytes_per_s", "latency_s",
                      "own_bandwidth_bytes_per_s", "own_latency_s", "straggler_spread",
                      "overlap_cpu_s", "overlap_fit", "residual_rms_s", "rounds")
"""The fields of a calibration the record keeps (with the runs it was fitted on)."""


def _calibration_record(cal: Any) -> dict[str, Any]:
    return {**{key: getattr(cal, key) for key in CALIBRATION_FIELDS},
            "runs": [s.run_dir for s in cal.samples]}


def _at(*path: str, then: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], Any]:
    """A column's cell: the value at ``path`` in a ``(name, entry)`` row's entry, passed
    through ``then``; empty for a run that failed."""
    def get(row: tuple[str, dict[str, Any]]) -> Any:
        value = row[1]
        if not value.get("ok", True):
            return None
        for key in path:
            value = value[key]
        return then(value)
    return get


def _matched_ratio(e: dict[str, Any]) -> float | None:
    measured = e["measured"]["tokens_per_s"]
    return e["compute_matched"]["tokens_per_s"] / measured if measured else None


COMPARISON = [
    ("run", None), ("link", "link"), ("tokens/s predicted", _at("predicted", "tokens_per_s")),
    ("measured", _at("measured", "tokens_per_s")), ("ratio", _at("tokens_ratio")),
    ("utilisation predicted", _at("predicted", "utilisation")),
    ("measured", _at("measured", "utilisation")), ("difference", _at("utilisation_diff")),
    ("exposed comm ms/step predicted", _at("predicted", "exposed_comm_s", then=ms)),
    ("measured", _at("measured", "exposed_comm_s", then=ms)),
    ("compute ms/step predicted / this run (not used)", _at("compute_s", then=lambda c: (
        f"{ms(c['calibrated']):.1f} / {ms(c['measured']):.1f}"))),
    ("ratio with this run's compute (diagnostic)", _at(then=_matched_ratio))]
"""The columns of a table of predicted against measured, one row per run."""


def _per_mb(v: float | None) -> float | None:
    return v / 1e6 if v else None


def _fitted(key: str, then: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], Any]:
    return _at("calibration", key, then=then)


CALIBRATION_TABLE = Table("Calibration per group (all of its calibration runs)", [
    ("group", None), ("compute ms/step (no round beside)", _fitted("step_time_s", ms)),
    ("ms per round beside the compute (fit)", _at("calibration", then=lambda c: (
        f"{ms(c['overlap_cpu_s']):.1f} ({c['overlap_fit']})"))),
    ("overhead ms/step", _fitted("step_overhead_s", ms)),
    ("straggler spread", _fitted("straggler_spread")),
    ("link MB/s (fit, simulated link included)", _fitted("bandwidth_bytes_per_s", _per_mb)),
    ("latency ms/collective", _fitted("latency_s", ms)),
    ("machine's own per-byte cost as MB/s", _fitted("own_bandwidth_bytes_per_s", _per_mb)),
    ("machine's own ms/collective", _fitted("own_latency_s", ms)),
    ("fit rms ms/round", _fitted("residual_rms_s", ms)), ("rounds fitted", _fitted("rounds"))],
    # groups without a calibration (none of their calibration runs finished) left out
    rows=lambda ctx: [(g, e) for g, e in ctx.results["groups"].items() if "calibration" in e])


def _judge(rows: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Targets (medians over the held-out runs), findings and headline."""
    ok = {k: e for k, e in rows.items() if e.get("ok") and e.get("tokens_ratio")}
    errs = [abs(e["tokens_ratio"] - 1) for e in ok.values()]
    udiff = [abs(e["utilisation_diff"]) for e in ok.values()
             if e.get("utilisation_diff") is not None]
    aims, said, targets = TEXT["targets"], TEXT["findings"], []
    for aim, errors, limit in (("tokens", errs, 0.10), ("utilisation", udiff, 0.05)):
        med = statistics.median(errors) if errors else None
        targets.append({"name": aims[aim], "met": None if med is None else med <= limit,
                        "detail": fill(aims[f"{aim}_detail"], med=cell(med), n=len(errors),
                                       worst=cell(max(errors) if errors else None))})
    findings = [fill(said["run"], k=k, e=e, predicted=cell(ms(e["predicted"]["exposed_comm_s"])),
                     measured=cell(ms(e["measured"]["exposed_comm_s"])))
                for k, e in ok.items() if e["measured"]["utilisation"] is not None]
    matched = [abs(_matched_ratio(e) - 1) for e in ok.values() if e.get("compute_matched")]
    if matched:
        drift = [abs(e["compute_s"]["measured"] / e["compute_s"]["calibrated"] - 1)
                 for e in ok.values() if e.get("compute_s")]
        findings.append(fill(said["compute"], drift=statistics.median(drift),
                             worst_drift=max(drift), matched=statistics.median(matched),
                             worst_matched=max(matched)))
    bad = [k for k, e in ok.items() if abs(e["tokens_ratio"] - 1) > 0.10]
    if bad:
        findings.append(fill(said["off"], runs=", ".join(
            f"{k} ({ok[k]['tokens_ratio']:.3f}x)" for k in bad)))
    headline = [fill(TEXT["headline"], med_t=statistics.median(errs), n=len(errs),
                     worst=max(errs), med_u=cell(statistics.median(udiff)),
                     worst_u=cell(max(udiff)))] if errs and udiff else []
    return targets, findings, headline


def _verdict(ctx: Ctx) -> Verdict:
    targets, findings, headline = _judge(ctx.results["held_out"])
    return Verdict(targets=targets, findings=findings, headline=headline)


def _plot(ctx: Ctx):
    """Predicted against measured tokens/s, one point per held-out run."""
    rows = ctx.results["held_out"]
    with figure(ctx, "predicted_vs_measured.png", "measured tokens/s", "predicted tokens/s",
                size=(6, 5)) as ax:
        pts = [(e["measured"]["tokens_per_s"], e["predicted"]["tokens_per_s"], k)
               for k, e in rows.items() if e.get("ok") and e["measured"]["tokens_per_s"]]
        for x, y, k in pts:
            ax.scatter([x], [y], label=k)
        if pts:
            hi = 1.1 * max(max(x, y) for x, y, _ in pts)
            ax.plot([0, hi], [0, hi], color="gray", linestyle="--", label="predicted = measured")
            ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="gray", alpha=0.15,
                            label="within 10%")
            ax.set_xlim(0, hi)
            ax.set_ylim(0, hi)
    return ctx.plot


SCENARIO = Scenario(
    name="plan",
    description=DESCRIPTION,
    setup=_setup, runs=_runs, measure=_results, judge=_verdict, plots=[_plot],
    notes=lambda ctx: fill(TEXT["notes"], ctx=ctx, preset=TEXT[
        "preset_full" if ctx.bench.mode == "full" else "preset_small"]),
    checks=lambda ctx: [(_layers(ctx, {**sync, "local_sgd_sync_time": 1.0}
                                 if sync["method"] == "aedit" else sync, link, sim), None)
                        for seq in ctx.groups.values() for _, _, (sync, link, sim) in seq],
    planned=lambda ctx: sum(len(seq) for seq in ctx.groups.values()),
    tables=[Table("Predicted against measured, held-out settings", COMPARISON,
                  rows=lambda ctx: ctx.results["held_out"].items()),
            Table("Predicted against measured, the calibration runs themselves", COMPARISON,
                  rows=lambda ctx: ctx.results["in_sample"].items()),
            CALIBRATION_TABLE],
    settings=lambda ctx: {"sync_interval": ctx.interval, "steps": ctx.steps,
                          "sync_steps": ctx.sync_steps, "skip": ctx.skip,
                          "groups": {g: [f"{k} {label}" for k, label, _ in seq]
                                     for g, seq in ctx.groups.items()}},
    methods=lambda ctx: list(ctx.results["held_out"]),
)

__all__ = ["DESCRIPTION", "GROUPS", "SCENARIO", "group_rows"]
