"""Bandwidth: cluster throughput as the simulated inter-replica link gets slower.

``sync`` (an all-reduce of the gradients every step), ``diloco`` (a blocking sync every H
steps), ``edit`` (a layer-wise sync every H steps, overlapped with the next forward) and
``edit-streaming`` (fragments that take turns, each reduced behind ``overlap_steps`` inner
steps, in int8), ``edit-sparse`` (the whole round but one step in flight, sparse 2-bit
pseudo-gradients) and ``edit-sparse-eager`` (the same with the whole round in flight and
the eager merge) run under links from unlimited down to 0.25 MB/s + 50 ms; the ceiling is
the same model and data with no communication at all. A sweep over the streaming options
(delay, fragments, wire dtype) runs at the 5 MB/s link. ``--links unlimited,1MB/s+50ms``
runs a subset of the links (the unlimited one is always needed: the ratios divide by it).
"""

from __future__ import annotations

from typing import Any

from editrain.bench.measures import over_repeats, replica_spreads, run_refs
from editrain.bench.options import pick_names, timed_train
from editrain.bench.plots import median_bars
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench, repeat_label
from editrain.bench.runs import Run
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict, differences, figure
from editrain.bench.stats import compare, spread
from editrain.bench.tables import cell, ms, ratio, spread_cell, spread_of
from editrain.config import ConfigError

TEXT = prose("bandwidth")
UNLIMITED = "unlimited"


def link_name(bw: str | None, lat: str | None) -> str:
    """``20MB/s+5ms`` or ``unlimited``."""
    if bw is None and lat is None:
        return UNLIMITED
    return "+".join(x for x in (bw, lat) if x)


STREAMING = {"overlap_steps": 4, "fragments": 4, "comm_dtype": "int8", "merge": "keep_local"}
"""The streaming settings of ``edit-streaming`` (the sweep shows the alternatives)."""
SPARSE = {"comm_dtype": "topk2", "merge": "keep_local"}
SPARSE_EAGER = {"comm_dtype": "topk2", "merge": "eager"}
ROUND_OVERLAP = {"edit-sparse": -1, "edit-sparse-eager": 0}
"""``overlap_steps`` of the sparse variants, relative to H: ``edit-sparse`` (H - 1) keeps
its round in flight for all but one step of the next round; ``edit-sparse-eager`` (H) the
whole round, this replica's own share applied at once (docs/streaming.md section 3c)."""
VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"method": "sync"},
    "diloco": {"method": "diloco"},
    "edit": {"method": "edit"},
    "edit-streaming": {"method": "edit", **STREAMING},
    "edit-sparse": {"method": "edit", **SPARSE},
    "edit-sparse-eager": {"method": "edit", **SPARSE_EAGER},
}
"""Each variant's sync options (the rows of the main table)."""
METHODS = tuple(VARIANTS)
SLOW_LINKS = (("1MB/s", "50ms"), ("0.25MB/s", "50ms"))
SLOW_TARGETS = {"1MB/s+50ms": 0.95, "0.25MB/s+50ms": 0.90}
"""The sparse target at the slow links: the best sparse variant keeps this share of its
unlimited-link speed."""
SWEEP_LINK = ("5MB/s", "5ms")
SWEEP_NAME = link_name(*SWEEP_LINK)
SWEEP: dict[str, dict[str, Any]] = {
    f"tau{t}-P{p}-{d}": {"method": "edit", "overlap_steps": t, "fragments": p, "comm_dtype": d}
    for t, p, d in ((0, 1, "int8"), (0, 4, "fp32"), (0, 4, "int8"), (4, 1, "fp32"),
                    (4, 1, "int8"), (4, 4, "fp32"), (2, 4, "int8"), (4, 4, "bf16"),
                    (4, 4, "int4"))
}
"""Streaming alternatives run at :data:`SWEEP_LINK` only (``edit`` is tau0-P1-fp32 and
``edit-streaming`` tau4-P4-int8 of this grid)."""
COMPARISONS = (("edit-sparse-eager", "edit-sparse"), ("edit-sparse", "edit-streaming"),
               ("edit-streaming", "edit"), ("edit-streaming", "sync"), ("edit", "diloco"),
               ("edit", "sync"), ("diloco", "sync"))
"""Pairs whose tokens/s are compared against the spread of the repeats, at every link."""


# ---- runs ---------------------------------------------------------------------------------
def _links(bench: Bench) -> list[tuple[str | None, str | None]]:
    """The simulated links to sweep (bandwidth, latency); None: unlimited. ``--links``
    picks a subset by name.

    Raises:
        ConfigError: ``--links`` names a link this scenario does not have, or leaves out
            the unlimited one.
    """
    full = [(None, None), ("20MB/s", "5ms"), SWEEP_LINK, ("1MB/s", "5ms"), *SLOW_LINKS]
    links = bench.pick([SWEEP_LINK], full, full)
    chosen = bench.flags.get("links")
    if not chosen:
        return links
    names = pick_names(chosen, [link_name(*x) for x in full], "--links", "link")
    if UNLIMITED not in names:
        raise ConfigError(f"bench --links: include {UNLIMITED}; every ratio divides by "
                          "the unlimited-link run")
    return [x for x in full if link_name(*x) in names]


def _setup(bench: Bench) -> dict[str, Any]:
    interval = bench.pick(8, 32, 32)
    links = _links(bench)
    return {"interval": interval, "local_steps": bench.pick(3 * interval, 4 * interval,
                                                            4 * interval),
            # Every step of sync is alike; at 1 MB/s one small-preset step takes ~20 s.
            "sync_steps": bench.pick(8, 16, 10), "skip": bench.pick(2, 4, 4), "links": links,
            "names": [link_name(*x) for x in links],
            "sweep": {} if bench.mode == "tiny" or SWEEP_LINK not in links else SWEEP,
            # The tiny preset (quick, tiny) has three units when tied: too few for four
            # fragments.
            "model": {} if bench.mode == "full" else {"model": {"tie_embeddings": False}}}


def _layers(ctx: Ctx, name: str, variant: dict[str, Any],
            link: tuple[str | None, str | None]) -> list[dict]:
    """The options of one run of a variant on a link."""
    steps = ctx.sync_steps if variant["method"] == "sync" else ctx.local_steps
    out: list[dict[str, Any]] = [
        {"train": timed_train(steps),
         "sync": dict(variant),
         "sim": {"link_bandwidth": link[0], "link_latency": link[1]}, **ctx.model}]
    if variant["method"] != "sync":
        out.append({"sync": {"local_sgd_sync_interval": ctx.interval}})
    if name in ROUND_OVERLAP:
        out.append({"sync": {"overlap_steps": ctx.interval + ROUND_OVERLAP[name]}})
    return out


def _ceiling(ctx: Ctx) -> list[dict]:
    return [*_layers(ctx, "edit", VARIANTS["edit"], (None, None)),
            {"sync": {"local_sgd_sync_interval": ctx.local_steps + 1}}]


def _rotated(items: list[Any], by: int) -> list[Any]:
    """``items`` rotated left by ``by`` places."""
    k = by % len(items) if items else 0
    return items[k:] + items[:k]


def _label(what: str, link: str) -> str:
    return f"{what}-{link.replace('/', '')}"


def _runs(ctx: Ctx) -> list[Job]:
    """Interleaved repeats, link-major inside each: a change of the machine's load during
    the scenario then hits every method at about the same links and repeats."""
    jobs = []
    for rep in range(ctx.bench.repeats):
        jobs.append(Job(repeat_label("ceiling", rep), _ceiling(ctx),
                        title=f"ceiling repeat {rep + 1}"))
        # The order of the links and of the methods rotates each repeat: a drift of the
        # machine's speed within a repeat then does not always land on the same link.
        for link, where in _rotated(list(zip(ctx.links, ctx.names)), rep):
            # (label prefix, name, sync options) of every run at this link
            runs = [(name, name, sync) for name, sync in _rotated(list(VARIANTS.items()), rep)]
            if link == SWEEP_LINK:
                runs += [(f"sweep-{name}", name, sync) for name, sync in ctx.sweep.items()]
            jobs += [Job(repeat_label(_label(prefix, where), rep),
                         _layers(ctx, name, sync, link), title=f"{name} {where} repeat {rep + 1}")
                     for prefix, name, sync in runs]
    return jobs


# ---- measures -----------------------------------------------------------------------------
def _repeats(ctx: Ctx, label: str) -> list[Run]:
    return [ctx.runs[repeat_label(label, rep)] for rep in range(ctx.bench.repeats)]


def _results(ctx: Ctx) -> dict[str, Any]:
    ceiling = over_repeats(_repeats(ctx, "ceiling"), ctx.skip)[0]
    ceiling_tps = [w.get("tokens_per_s") for w in ceiling]
    results: dict[str, Any] = {"ceiling": {
        "tokens_per_s": spread(ceiling_tps),
        "step_time_s": spread(w.get("step_time_s") for w in ceiling),
        "per_repeat": ceiling_tps}}
    ctx.errors = []

    def measured(method: str, label: str, what: str) -> dict[str, Any]:
        """The entry of one setting; its utilisation errors go to ``ctx.errors``."""
        entry, errors = _entry(method, _repeats(ctx, label), ctx.skip, ceiling)
        ctx.errors += [f"{what}: {e}" for e in errors]
        return entry

    for method in METHODS:
        results[method] = {n: measured(method, _label(method, n), f"{method} {n}")
                           for n in ctx.names}
        for entry in results[method].values():
            entry["vs_unlimited"] = _kept(entry, results[method].get(UNLIMITED))
    edit_base = results["edit"].get(UNLIMITED)
    for method in ("edit", "edit-streaming"):
        if SWEEP_NAME in results[method]:
            entry = results[method][SWEEP_NAME]
            entry["vs_edit_unlimited"] = _kept(entry, edit_base)
    results["sweep"] = {}
    for name, variant in ctx.sweep.items():
        entry = measured("edit", _label(f"sweep-{name}", SWEEP_NAME), name)
        entry["options"] = {k: v for k, v in variant.items() if k != "method"}
        entry["vs_edit_unlimited"] = _kept(entry, edit_base)
        results["sweep"][name] = entry
    results["comparisons"] = {
        n: [compare(a, b, results[a][n]["tokens_per_s"], results[b][n]["tokens_per_s"])
            for a, b in COMPARISONS] for n in ctx.names}
    return results


def _entry(method: str, runs: list[Run], skip: int,
           ceiling: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The numbers of one method on one link over its repeats (each against the ceiling's
    window of the same repeat), and the utilisation errors of its runs."""
    windows, per_replica, errors = over_repeats(runs, skip)
    local_sgd = method != "sync"

    def of(key: str) -> dict[str, Any]:
        return spread(w.get(key) for w in windows)

    steps = zip((w.get("step_time_s") for w in windows),
                (c.get("step_time_s") for c in ceiling))
    return {
        "tokens_per_s": of("tokens_per_s"),
        "step_time_s": of("step_time_s"),
        "vs_ceiling": spread(ratio(w.get("tokens_per_s"), c.get("tokens_per_s"))
                             for w, c in zip(windows, ceiling)),
        "overhead_vs_ceiling_s_per_step": spread(
            s - c for s, c in steps if s is not None and c is not None),
        "wait_s_per_step": of("wait_s_per_step" if local_sgd else "grad_sync_s_per_step"),
        "comm_time_s_per_step": of("comm_time_s_per_step") if local_sgd else None,
        "link_delay_s_per_step": of("link_delay_s_per_step") if local_sgd else None,
        "compute_s_per_step": of("compute_s_per_step"),
        "exposed": spread(
            w.get("wait_s_per_step") / w["comm_time_s_per_step"]
            for w in windows if local_sgd and w.get("comm_time_s_per_step")
            and w.get("wait_s_per_step") is not None),
        "replicas": replica_spreads(per_replica),
        "windows": windows,
        "load_before": [r.load_before for r in runs],
        **run_refs(runs),
    }, [e for repeat in errors for e in repeat]


def _kept(entry: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The spread of an entry's tokens/s over ``base``'s (an unlimited-link entry), repeat
    by repeat (the runs of one repeat ran close together)."""
    return spread(ratio(w.get("tokens_per_s"), b.get("tokens_per_s"))
                  for w, b in zip(entry["windows"], (base or {}).get("windows", [])))


def _med(s: dict[str, Any] | None) -> float | None:
    return None if not s else s.get("median")


# ---- tables -------------------------------------------------------------------------------

def _main_rows(ctx: Ctx) -> list[tuple[str, str, dict[str, Any]]]:
    """The ceiling, then one row per method and link (the methods the record has: one
    from before a variant was added lacks it)."""
    ceiling = {**ctx.results["ceiling"], "vs_ceiling": spread([1.0])}
    return [("ceiling (no comm)", UNLIMITED, ceiling)] + [
        (m, n, ctx.results[m][n]) for m in METHODS if m in ctx.results for n in ctx.names]


def _sweep_rows(ctx: Ctx) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The streaming sweep's variants, after plain edit and edit-streaming for reference."""
    results = ctx.results
    return [("edit", {}, results["edit"][SWEEP_NAME]),
            ("edit-streaming", STREAMING, results["edit-streaming"][SWEEP_NAME]),
            *((name, e.get("options") or STREAMING, e) for name, e in results["sweep"].items())]


def _utilisations(row: tuple) -> str | None:
    """Each replica's median utilisation, ``0.93/0.88``."""
    medians = [cell(r["utilisation"]["median"]) for r in row[-1].get("replicas", [])]
    return "/".join(medians) or None


MAIN_TABLE = Table("Throughput against link speed", [
    ("method", None), ("link", lambda row: row[1]), ("tokens/s", spread_of("tokens_per_s")),
    ("x unlimited", spread_of("vs_unlimited")), ("x ceiling", spread_of("vs_ceiling")),
    ("step ms", spread_of("step_time_s", 1000)),
    ("overhead vs ceiling ms/step", spread_of("overhead_vs_ceiling_s_per_step", 1000)),
    ("wait ms/step", spread_of("wait_s_per_step", 1000)),
    ("comm ms/step", spread_of("comm_time_s_per_step", 1000)),
    ("link delay ms/step", spread_of("link_delay_s_per_step", 1000)),
    ("utilisation per replica (median)", _utilisations)], rows=_main_rows)
SWEEP_TABLE = Table(f"Streaming options at {SWEEP_NAME}", [
    ("variant", None),
    ("overlap_steps", lambda row: row[1].get("overlap_steps", 0)),
    ("fragments", lambda row: row[1].get("fragments", 1)),
    ("comm_dtype", lambda row: row[1].get("comm_dtype", "fp32")),
    ("tokens/s", spread_of("tokens_per_s")), ("x edit unlimited", spread_of("vs_edit_unlimited")),
    ("x ceiling", spread_of("vs_ceiling")), ("wait ms/step", spread_of("wait_s_per_step", 1000)),
    ("comm ms/step", spread_of("comm_time_s_per_step", 1000)),
    ("exposed (wait / comm)", spread_of("exposed"))], rows=_sweep_rows)


def _sweep(ctx: Ctx) -> list[tuple[str, str]]:
    """The streaming sweep's table, when it ran."""
    return [SWEEP_TABLE.render(ctx)] if ctx.sweep and SWEEP_NAME in ctx.names else []


# ---- verdict ------------------------------------------------------------------------------
def _verdict(ctx: Ctx) -> Verdict:
    """edit's target, then streaming's and the sparse ones where their links ran (from
    the medians), the findings, and the shortfalls (edit's last)."""
    results, names = ctx.results, ctx.names
    edit, edit_shortfalls = _edit_target(results, names, ctx.interval)
    judged = []
    if UNLIMITED in names:
        judged = [_streaming_target(results)] if SWEEP_NAME in names else []
        judged += [_sparse_target(results, n, floor) for n, floor in SLOW_TARGETS.items()
                   if n in names]
    return Verdict(targets=[edit] + [t for t, _ in judged], findings=_findings(results, names),
                   shortfalls=[s for t, s in judged if t["met"] is False] + edit_shortfalls,
                   errors=ctx.errors,
                   headline=_headline(results, names, ctx.interval, ctx.bench.repeats))


def _target(kind: str, met: bool | None, detail: str, **names: Any) -> tuple[dict, str]:
    """A target check and the shortfall that says it is not met."""
    return ({"name": fill(TEXT["targets"][kind], **names), "met": met, "detail": detail},
            fill(TEXT["shortfalls"][kind], detail=detail, **names))


def _edit_target(results: dict[str, Any], names: list[str],
                 interval: int) -> tuple[dict[str, Any], list[str]]:
    """edit's target, checked at every link that slowed sync below 0.5x of its
    unlimited-link speed, and a shortfall per such link where edit kept less than 0.9x."""
    aims = TEXT["targets"]
    kept = [(n, _med(results["sync"][n]["vs_unlimited"]), _med(results["edit"][n]["vs_unlimited"]))
            for n in names if n != UNLIMITED]
    checked = [(n, s, e) for n, s, e in kept if s is not None and s < 0.5]
    if UNLIMITED not in names:
        met, detail = None, aims["edit_no_unlimited"]
    elif not checked:
        met, detail = None, aims["edit_no_slow_link"]
    else:
        met = any(e is not None and e >= 0.9 for _, _, e in checked)
        detail = "; ".join(fill(aims["edit_detail"], n=n, s=cell(s), e=cell(e))
                           for n, s, e in checked)
    shortfalls = [fill(TEXT["shortfalls"]["edit"], n=n, e=cell(e), s=cell(s))
                  for n, s, e in checked if e is None or e < 0.9]
    return {"name": fill(aims["edit"], interval=interval), "met": met,
            "detail": detail}, shortfalls


def _streaming_target(results: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """edit-streaming's target at the sweep's link, and its shortfall."""
    st, sy = results["edit-streaming"][SWEEP_NAME], results["sync"][SWEEP_NAME]
    keep, sync_keep, exposed = (_med(st["vs_unlimited"]), _med(sy["vs_unlimited"]),
                                _med(st["exposed"]))
    met = None if None in (keep, sync_keep) else (
        keep >= 0.95 and sync_keep <= 0.3 and exposed is not None and exposed <= 0.1)
    detail = fill(TEXT["targets"]["streaming_detail"], kept=spread_cell(st["vs_unlimited"]),
                  sync=spread_cell(sy["vs_unlimited"]), exposed=spread_cell(st["exposed"]))
    return _target("streaming", met, detail, link=SWEEP_NAME)


def _sparse_target(results: dict[str, Any], n: str,
                   floor: float) -> tuple[dict[str, Any], str]:
    """The sparse target at slow link ``n``, judged on the best sparse variant (the issue's
    target is for the best one), and its shortfall."""
    best = max(("edit-sparse", "edit-sparse-eager"),
               key=lambda m: _med(results[m][n]["vs_unlimited"]) or 0.0)
    sp = results[best][n]
    keep, exposed = _med(sp["vs_unlimited"]), _med(sp["exposed"])
    met = None if keep is None else keep >= floor and exposed is not None and exposed <= 0.05
    others = ", ".join(f"{m} {spread_cell(results[m][n]['vs_unlimited'])}x"
                       for m in ("edit-sparse", "edit-sparse-eager", "edit-streaming")
                       if m != best)
    detail = fill(TEXT["targets"]["sparse_detail"], best=best, others=others,
                  kept=spread_cell(sp["vs_unlimited"]), exposed=spread_cell(sp["exposed"]))
    return _target("sparse", met, detail, link=n, floor=floor)


def _findings(results: dict[str, Any], names: list[str]) -> list[str]:
    """Every method's speed and the differences at every link; how much communication
    the overlapping variants hid at the slowed links; what lies above the ceiling."""
    said, findings = TEXT["findings"], []
    slow = [n for n in names if n != UNLIMITED]
    for n in names:
        speeds = ", ".join(fill(said["speed"], m=m, ceiling=cell(_med(results[m][n]["vs_ceiling"])),
                                tokens=spread_cell(results[m][n]["tokens_per_s"])) for m in METHODS)
        findings.append(fill(said["speeds"], n=n, speeds=speeds))
        findings += [fill(said["difference"], n=n, c=c,
                          where="beyond" if c["beyond_spread"] else "within")
                     for c in results["comparisons"][n]
                     if c["beyond_spread"] is not None and c["difference"] is not None]
    for n in slow:
        for m in ("edit-streaming", "edit-sparse", "edit-sparse-eager"):
            st = results[m][n]
            w, c = _med(st["wait_s_per_step"]), _med(st["comm_time_s_per_step"])
            if w is not None and c:
                findings.append(fill(said["hidden"], n=n, m=m, wait=cell(ms(w)),
                                     comm=cell(ms(c)), hidden=max(0.0, 1 - w / c),
                                     kept=spread_cell(st["vs_unlimited"])))
    for n in slow:
        wait = _med(results["edit"][n]["wait_s_per_step"])
        comm = _med(results["edit"][n]["comm_time_s_per_step"])
        blocks = _med(results["diloco"][n]["wait_s_per_step"])
        if wait is not None and blocks is not None and comm:
            hidden = 1.0 - wait / comm
            findings.append(fill(said["edit_hidden"], n=n, wait=cell(ms(wait)),
                                 comm=cell(ms(comm)), hidden=max(0.0, hidden),
                                 blocks=cell(ms(blocks))))
            if hidden < 0.5:
                findings.append(fill(said["edit_exposed"], n=n, hidden=max(0.0, hidden)))
    above = [f"{m} {n} ({cell(_med(results[m][n]['vs_ceiling']))}x)" for m in METHODS
             for n in names if (_med(results[m][n]["vs_ceiling"]) or 0) > 1.0]
    if above:
        findings.append(fill(said["above_ceiling"], above=", ".join(above)))
    ceiling = results["ceiling"]["tokens_per_s"]
    drift = ceiling["max"] / ceiling["min"] - 1.0 if ceiling["n"] >= 2 and ceiling["min"] else 0
    if drift > 0.1:
        findings.append(fill(said["ceiling_drift"], drift=drift))
    return findings


def _headline(results: dict[str, Any], names: list[str], interval: int,
              repeats: int) -> list[str]:
    """The report's summary sentence: x unlimited per method at every slowed link."""
    slow = [n for n in names if n != UNLIMITED]
    if not slow or UNLIMITED not in names:
        return []
    parts = "; ".join(f"{m} " + " / ".join(spread_cell(results[m][n]["vs_unlimited"])
                                           for n in slow) for m in METHODS)
    return [fill(TEXT["headline"], links=" / ".join(slow), interval=interval, repeats=repeats,
                 parts=parts)]


def _notes(ctx: Ctx) -> list[str]:
    return fill(TEXT["notes"], ctx=ctx, preset=TEXT["preset_full" if ctx.bench.mode == "full"
                                                   else "preset_small"],
                ceiling_interval=ctx.local_steps + 1, sparse=_options_text(SPARSE),
                sparse_overlap=ctx.interval + ROUND_OVERLAP["edit-sparse"],
                sparse_eager=_options_text(SPARSE_EAGER), streaming=_options_text(STREAMING),
                sweep_name=SWEEP_NAME)


def _options_text(options: dict[str, Any]) -> str:
    """``overlap_steps 4, fragments 4, comm_dtype int8``."""
    return ", ".join(f"{k} {v}" for k, v in options.items())


# ---- plots --------------------------------------------------------------------------------
def _plot_throughput(ctx: Ctx):
    """tokens/s against the link (median, min-max bars), one line per method."""
    results, names = ctx.results, ctx.names
    with figure(ctx, "throughput_vs_link.png", "simulated inter-replica link",
                "tokens/s (cluster; median, min-max)") as ax:
        xs = list(range(len(names)))
        for method in METHODS:
            ys, bars = median_bars([results[method][n]["tokens_per_s"] for n in names])
            ax.errorbar(xs, ys, yerr=bars, marker="o", capsize=3, label=method)
        c = _med(results["ceiling"]["tokens_per_s"])
        if c:
            ax.axhline(c, color="gray", linestyle="--", label="ceiling (no communication)")
        ax.set_xticks(xs, names)
        ax.set_ylim(bottom=0)
    return ctx.plot


def _plot_split(ctx: Ctx):
    """Stacked ms/step (medians): ceiling step time, waiting for syncs, other overhead;
    triangles: communication time."""
    results, names = ctx.results, ctx.names
    with figure(ctx, "time_split.png", ylabel="ms per step (medians)", grid="y",
                size=(max(7, 1.1 * len(names) * len(METHODS)), 4.5)) as ax:
        base = ms(_med(results["ceiling"]["step_time_s"])) or 0.0
        xs: list[str] = []
        comm_labelled = False
        for i, (method, name) in enumerate((m, n) for m in METHODS for n in names):
            e = results[method][name]
            step = ms(_med(e["step_time_s"])) or 0.0
            wait = ms(_med(e["wait_s_per_step"])) or 0.0
            other = max(0.0, step - base - wait)
            for height, bottom, color, label in (
                    (base, None, "#9bbbd4", "compute (ceiling step)"),
                    (wait, base, "#d46a6a", "waiting for sync"),
                    (other, base + wait, "#e0c070", "other")):
                ax.bar(i, height, bottom=bottom, color=color, label=label if i == 0 else None)
            comm = _med(e["comm_time_s_per_step"])
            if comm is not None:
                ax.plot(i, ms(comm), "k^", label=None if comm_labelled
                        else "communication (incl. hidden)")
                comm_labelled = True
            xs.append(f"{method}\n{name}")
        ax.set_xticks(range(len(xs)), xs, fontsize=7)
    return ctx.plot


SCENARIO = Scenario(
    name="bandwidth",
    description=TEXT["description"],
    setup=_setup, runs=_runs, measure=_results, judge=_verdict, notes=_notes,
    tables=[MAIN_TABLE, differences("link", "tokens/s difference (medians)", lambda ctx: [
        (n, c) for n in ctx.names for c in ctx.results["comparisons"][n]]), _sweep],
    plots=[_plot_throughput, _plot_split], repeats=True,
    checks=lambda ctx: [(_ceiling(ctx), None)] + [
        (_layers(ctx, name, variant, ctx.links[-1]), None)
        for name, variant in [*VARIANTS.items(), *ctx.sweep.items()]],
    settings=lambda ctx: {
        "sync_interval": ctx.interval, "local_steps": ctx.local_steps,
        "sync_steps": ctx.sync_steps, "links": ctx.names, "skip_steps": ctx.skip,
        "repeats": ctx.bench.repeats, "streaming": STREAMING,
        "sparse": {**SPARSE, "overlap_steps": ctx.interval + ROUND_OVERLAP["edit-sparse"]},
        "sparse_eager": {**SPARSE_EAGER,
                         "overlap_steps": ctx.interval + ROUND_OVERLAP["edit-sparse-eager"]},
        "sweep": dict(ctx.sweep)},
    methods=lambda ctx: ("ceiling",) + METHODS,
)
