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
from editrain.bench.scenario import Ctx, Job, Scenario, Verdict, differences, figure
from editrain.bench.stats import compare, spread
from editrain.bench.tables import cell, md_table, ms, ratio, spread_cell
from editrain.config import ConfigError

TEXT = prose("bandwidth")
STREAMING = {"overlap_steps": 4, "fragments": 4, "comm_dtype": "int8", "merge": "keep_local"}
"""The streaming settings of ``edit-streaming`` (the sweep shows the alternatives)."""
SPARSE = {"comm_dtype": "topk2", "merge": "keep_local"}
"""The settings of ``edit-sparse``, whose ``overlap_steps`` is ``H - 1`` (the most a round
may stay in flight)."""
SPARSE_EAGER = {"comm_dtype": "topk2", "merge": "eager"}
"""The settings of ``edit-sparse-eager``, whose ``overlap_steps`` is ``H``: the whole round
in flight, this replica's own share applied at once (docs/streaming.md section 3c)."""
VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"method": "sync"},
    "diloco": {"method": "diloco"},
    "edit": {"method": "edit"},
    "edit-streaming": {"method": "edit", **STREAMING},
    "edit-sparse": {"method": "edit", **SPARSE},
    "edit-sparse-eager": {"method": "edit", **SPARSE_EAGER},
}
"""Each variant's sync options (the rows of the main table)."""
SLOW_LINKS = (("1MB/s", "50ms"), ("0.25MB/s", "50ms"))
"""The links of the sparse target (``edit-sparse`` >= 0.95x / 0.90x of its unlimited-link
speed)."""
SLOW_TARGETS = {"1MB/s+50ms": 0.95, "0.25MB/s+50ms": 0.90}
METHODS = tuple(VARIANTS)
SWEEP_LINK = ("5MB/s", "5ms")
SWEEP: dict[str, dict[str, Any]] = {
    f"tau{t}-P{p}-{d}": {"method": "edit", "overlap_steps": t, "fragments": p, "comm_dtype": d}
    for t, p, d in ((0, 1, "int8"), (0, 4, "fp32"), (0, 4, "int8"), (4, 1, "fp32"),
                    (4, 1, "int8"), (4, 4, "fp32"), (2, 4, "int8"), (4, 4, "bf16"),
                    (4, 4, "int4"))
}
"""Streaming alternatives run at :data:`SWEEP_LINK` only (``edit`` is tau0-P1-fp32 and
``edit-streaming`` tau4-P4-int8 of this grid)."""
UNLIMITED = "unlimited"
COMPARISONS = (("edit-sparse-eager", "edit-sparse"), ("edit-sparse", "edit-streaming"), ("edit-streaming", "edit"), ("edit-streaming", "sync"), ("edit", "diloco"),
               ("edit", "sync"), ("diloco", "sync"))
"""Pairs whose tokens/s are compared against the spread of the repeats, at every link."""


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
        raise ConfigError(f"bench --links: include {UNLIMITED!r}; every ratio divides by "
                          "the unlimited-link run")
    return [x for x in full if link_name(*x) in names]


def _rotated(items: list[Any], by: int) -> list[Any]:
    """``items`` rotated left by ``by`` places."""
    k = by % len(items) if items else 0
    return items[k:] + items[:k]


def link_name(bw: str | None, lat: str | None) -> str:
    """``20MB/s+5ms`` or ``unlimited``."""
    if bw is None and lat is None:
        return UNLIMITED
    return "+".join(x for x in (bw, lat) if x)


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


def _layers(ctx: Ctx, variant: dict[str, Any], steps: int | None, bw: str | None,
            lat: str | None) -> list[dict]:
    """The options of one run of a variant on a link (``steps`` None: the variant's)."""
    if steps is None:
        steps = ctx.sync_steps if variant["method"] == "sync" else ctx.local_steps
    out: list[dict[str, Any]] = [
        {"train": timed_train(steps),
         "sync": dict(variant),
         "sim": {"link_bandwidth": bw, "link_latency": lat}, **ctx.model}]
    if variant["method"] != "sync":
        out.append({"sync": {"local_sgd_sync_interval": ctx.interval}})
    if variant is VARIANTS["edit-sparse"]:
        out.append({"sync": {"overlap_steps": ctx.interval - 1}})
    if variant is VARIANTS["edit-sparse-eager"]:
        out.append({"sync": {"overlap_steps": ctx.interval}})
    return out


def _ceiling(ctx: Ctx) -> list[dict]:
    return [*_layers(ctx, VARIANTS["edit"], ctx.local_steps, None, None),
            {"sync": {"local_sgd_sync_interval": ctx.local_steps + 1}}]


def _runs(ctx: Ctx) -> list[Job]:
    """Interleaved repeats, link-major inside each: a change of the machine's load during
    the scenario then hits every method at about the same links and repeats."""
    jobs = []
    for rep in range(ctx.bench.repeats):
        jobs.append(Job(repeat_label("ceiling", rep), _ceiling(ctx),
                        title=f"ceiling repeat {rep + 1}"))
        # The order of the links and of the methods rotates each repeat: a drift of the
        # machine's speed within a repeat then does not always land on the same link.
        for (bw, lat), name in _rotated(list(zip(ctx.links, ctx.names)), rep):
            for method, variant in _rotated(list(VARIANTS.items()), rep):
                jobs.append(Job(repeat_label(f"{method}-{name.replace('/', '')}", rep),
                                _layers(ctx, variant, None, bw, lat),
                                title=f"{method} {name} repeat {rep + 1}"))
            if (bw, lat) == SWEEP_LINK:
                jobs += [Job(repeat_label(f"sweep-{label}-{name.replace('/', '')}", rep),
                             _layers(ctx, variant, ctx.local_steps, bw, lat),
                             title=f"{label} {name} repeat {rep + 1}")
                         for label, variant in ctx.sweep.items()]
    return jobs


def _repeats(ctx: Ctx, label: str) -> list[Run]:
    return [ctx.runs[repeat_label(label, rep)] for rep in range(ctx.bench.repeats)]


def _results(ctx: Ctx) -> dict[str, Any]:
    skip, names = ctx.skip, ctx.names
    windows = over_repeats(_repeats(ctx, "ceiling"), skip)[0]
    ceil_tps = [w.get("tokens_per_s") for w in windows]
    ceil_step = [w.get("step_time_s") for w in windows]
    results: dict[str, Any] = {"ceiling": {"tokens_per_s": spread(ceil_tps),
                                           "step_time_s": spread(ceil_step),
                                           "per_repeat": ceil_tps}}
    errors: list[str] = []
    for method in METHODS:
        results[method] = {n: _entry(method, _repeats(ctx, f"{method}-{n.replace('/', '')}"),
                                     skip, ceil_tps, ceil_step) for n in names}
        for n, entry in results[method].items():
            entry["vs_unlimited"] = _kept(entry, results[method].get(UNLIMITED))
            errors += [f"{method} {n}: {e}" for e in entry.pop("utilisation_errors")]
    sweep_name = link_name(*SWEEP_LINK)
    edit_base = results["edit"].get(UNLIMITED)
    results["sweep"] = {}
    for method in ("edit", "edit-streaming"):
        if sweep_name in results[method]:
            entry = results[method][sweep_name]
            entry["vs_edit_unlimited"] = _kept(entry, edit_base)
    for label, variant in ctx.sweep.items():
        entry = _entry("edit", _repeats(ctx, f"sweep-{label}-{sweep_name.replace('/', '')}"),
                       skip, ceil_tps, ceil_step)
        errors += [f"{label}: {e}" for e in entry.pop("utilisation_errors")]
        entry["options"] = {k: v for k, v in variant.items() if k != "method"}
        entry["vs_edit_unlimited"] = _kept(entry, edit_base)
        results["sweep"][label] = entry
    results["comparisons"] = {
        n: [compare(a, b, results[a][n]["tokens_per_s"], results[b][n]["tokens_per_s"])
            for a, b in COMPARISONS] for n in names}
    ctx.errors = errors
    return results


def _kept(entry: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The spread of an entry's tokens/s over ``base``'s (an unlimited-link entry), repeat
    by repeat (the runs of one repeat ran close together)."""
    return spread(ratio(w.get("tokens_per_s"), b.get("tokens_per_s"))
                  for w, b in zip(entry["windows"], (base or {}).get("windows", [])))


def _verdict(ctx: Ctx) -> Verdict:
    results, names = ctx.results, ctx.names
    targets, findings, shortfalls = _judge(results, names, ctx.interval)
    above = [f"{m} {n} ({cell(_med(results[m][n]['vs_ceiling']))}x)" for m in METHODS
             for n in names if (_med(results[m][n]["vs_ceiling"]) or 0) > 1.0]
    if above:
        findings.append(fill(TEXT["findings"]["above_ceiling"], above=", ".join(above)))
    ceiling = results["ceiling"]["tokens_per_s"]
    if ceiling["n"] >= 2 and ceiling["min"]:
        drift = ceiling["max"] / ceiling["min"] - 1.0
        if drift > 0.1:
            findings.append(fill(TEXT["findings"]["ceiling_drift"], drift=drift))
    return Verdict(targets=targets, findings=findings, shortfalls=shortfalls,
                   errors=ctx.errors,
                   headline=_headline(results, names, ctx.interval, ctx.bench.repeats))


def _notes(ctx: Ctx) -> list[str]:
    return fill(TEXT["notes"], ctx=ctx, preset=TEXT["preset_full" if ctx.bench.mode == "full"
                                                   else "preset_small"],
                ceiling_interval=ctx.local_steps + 1, sparse=_options_text(SPARSE),
                sparse_overlap=ctx.interval - 1, sparse_eager=_options_text(SPARSE_EAGER),
                streaming=_options_text(STREAMING), sweep_name=link_name(*SWEEP_LINK))


def _sweep(ctx: Ctx) -> list[tuple[str, str]]:
    """The streaming sweep's table, when it ran."""
    name = link_name(*SWEEP_LINK)
    return ([(f"Streaming options at {name}", _sweep_table(ctx.results, name))]
            if ctx.sweep and name in ctx.names else [])


def _entry(method: str, runs: list[Run], skip: int, ceil_tps: list[float | None],
           ceil_step: list[float | None]) -> dict[str, Any]:
    """The numbers of one method on one link, over its repeats."""
    windows, per_replica, errors = over_repeats(runs, skip)
    steps = [w.get("step_time_s") for w in windows]

    def of(key: str) -> dict[str, Any]:
        """The spread of a window field over the repeats."""
        return spread(w.get(key) for w in windows)

    return {
        "tokens_per_s": of("tokens_per_s"),
        "step_time_s": of("step_time_s"),
        "vs_ceiling": spread(ratio(w.get("tokens_per_s"), c)
                             for w, c in zip(windows, ceil_tps)),
        "overhead_vs_ceiling_s_per_step": spread(
            s - c for s, c in zip(steps, ceil_step) if s is not None and c is not None),
        "wait_s_per_step": of("wait_s_per_step" if method != "sync"
                              else "grad_sync_s_per_step"),
        "comm_time_s_per_step": of("comm_time_s_per_step") if method != "sync" else None,
        "link_delay_s_per_step": of("link_delay_s_per_step") if method != "sync" else None,
        "compute_s_per_step": of("compute_s_per_step"),
        "exposed": spread(
            w.get("wait_s_per_step") / w["comm_time_s_per_step"]
            for w in windows if method != "sync" and w.get("comm_time_s_per_step")
            and w.get("wait_s_per_step") is not None),
        "replicas": replica_spreads(per_replica),
        "utilisation_errors": [e for repeat in errors for e in repeat],
        "windows": windows,
        "load_before": [r.load_before for r in runs],
        **run_refs(runs),
    }


def _med(s: dict[str, Any] | None) -> float | None:
    """The median of a spread (None for a missing one)."""
    return None if not s else s.get("median")


def _table(results: dict[str, Any], names: list[str]) -> str:
    """The Markdown table: one row per method and link, plus the ceiling (the methods the
    record has: one from before a variant was added lacks it)."""
    c = results["ceiling"]
    rows: list[list[Any]] = [["ceiling (no comm)", UNLIMITED, spread_cell(c["tokens_per_s"]),
                              None, "1", spread_cell(c["step_time_s"], 1000), None, None, None,
                              None, None]]
    for method in [m for m in METHODS if m in results]:
        for name in names:
            e = results[method][name]
            util = "/".join(cell(r["utilisation"]["median"]) for r in e["replicas"]) or None
            rows.append([method, name, spread_cell(e["tokens_per_s"]),
                         spread_cell(e["vs_unlimited"]), spread_cell(e["vs_ceiling"]),
                         spread_cell(e["step_time_s"], 1000),
                         spread_cell(e["overhead_vs_ceiling_s_per_step"], 1000),
                         spread_cell(e["wait_s_per_step"], 1000),
                         spread_cell(e["comm_time_s_per_step"], 1000),
                         spread_cell(e["link_delay_s_per_step"], 1000), util])
    return md_table(["method", "link", "tokens/s", "x unlimited", "x ceiling", "step ms",
                     "overhead vs ceiling ms/step", "wait ms/step", "comm ms/step",
                     "link delay ms/step", "utilisation per replica (median)"], rows)


def _options_text(options: dict[str, Any]) -> str:
    """``overlap_steps 4, fragments 4, comm_dtype int8``."""
    return ", ".join(f"{k} {v}" for k, v in options.items())


def _sweep_table(results: dict[str, Any], link: str) -> str:
    """The streaming sweep at one link, with plain edit and edit-streaming for reference."""
    rows = []
    entries = [("edit", results["edit"][link]), ("edit-streaming",
                                                  results["edit-streaming"][link])]
    entries += list(results["sweep"].items())
    for label, e in entries:
        opts = e.get("options") or ({} if label == "edit" else STREAMING)
        rows.append([label, opts.get("overlap_steps", 0), opts.get("fragments", 1),
                     opts.get("comm_dtype", "fp32"), spread_cell(e["tokens_per_s"]),
                     spread_cell(e["vs_edit_unlimited"]),
                     spread_cell(e["vs_ceiling"]), spread_cell(e["wait_s_per_step"], 1000),
                     spread_cell(e["comm_time_s_per_step"], 1000), spread_cell(e["exposed"])])
    return md_table(["variant", "overlap_steps", "fragments", "comm_dtype", "tokens/s",
                     "x edit unlimited", "x ceiling", "wait ms/step", "comm ms/step",
                     "exposed (wait / comm)"], rows)


def _judge(results: dict[str, Any], names: list[str],
           interval: int) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The target check, the findings and the shortfalls, from the medians."""
    slow = [n for n in names if n != UNLIMITED]
    checked = []
    for n in slow:
        s = _med(results["sync"][n]["vs_unlimited"])
        e = _med(results["edit"][n]["vs_unlimited"])
        if s is not None and s < 0.5:
            checked.append((n, s, e))
    if UNLIMITED not in names:
        met, detail = None, "no unlimited-link runs at this size"
    elif not checked:
        met, detail = None, "no link slowed sync below 0.5x of its unlimited throughput"
    else:
        met = any(e is not None and e >= 0.9 for _, _, e in checked)
        detail = "; ".join(f"{n}: sync {cell(s)}x, edit {cell(e)}x" for n, s, e in checked)
    said, short, aims = TEXT["findings"], TEXT["shortfalls"], TEXT["targets"]
    targets = [{"name": fill(aims["edit"], interval=interval), "met": met, "detail": detail}]
    findings, shortfalls = [], []
    link = link_name(*SWEEP_LINK)
    if UNLIMITED in names and link in names:
        st, sy = results["edit-streaming"][link], results["sync"][link]
        keep, sync_keep, exposed = (_med(st["vs_unlimited"]), _med(sy["vs_unlimited"]),
                                    _med(st["exposed"]))
        ok = None if None in (keep, sync_keep) else (
            keep >= 0.95 and sync_keep <= 0.3 and exposed is not None and exposed <= 0.1)
        targets.append({
            "name": fill(aims["streaming"], link=link), "met": ok,
            "detail": fill(aims["streaming_detail"], kept=spread_cell(st["vs_unlimited"]),
                           sync=spread_cell(sy["vs_unlimited"]),
                           exposed=spread_cell(st["exposed"]))})
        if ok is False:
            shortfalls.append(fill(short["streaming"], link=link, detail=targets[-1]["detail"]))
    for n, floor in SLOW_TARGETS.items():
        if UNLIMITED not in names or n not in names:
            continue
        # The best sparse setting (the target is for the best one).
        best = max(("edit-sparse", "edit-sparse-eager"),
                   key=lambda m: _med(results[m][n]["vs_unlimited"]) or 0.0)
        sp = results[best][n]
        keep, exposed = _med(sp["vs_unlimited"]), _med(sp["exposed"])
        ok = None if keep is None else (keep >= floor and exposed is not None
                                        and exposed <= 0.05)
        targets.append({
            "name": fill(aims["sparse"], floor=floor, n=n),
            "met": ok,
            "detail": f"{best} {spread_cell(sp['vs_unlimited'])}x, exposed "
                      f"{spread_cell(sp['exposed'])}; "
                      + ", ".join(f"{m} {spread_cell(results[m][n]['vs_unlimited'])}x"
                                  for m in ("edit-sparse", "edit-sparse-eager",
                                            "edit-streaming") if m != best)})
        if ok is False:
            shortfalls.append(fill(short["sparse"], link=n, detail=targets[-1]["detail"]))
    for n, s, e in checked:
        if e is None or e < 0.9:
            shortfalls.append(fill(short["edit"], n=n, e=cell(e), s=cell(s)))
    for n in names:
        parts = [f"{m} {spread_cell(results[m][n]['tokens_per_s'])} tok/s"
                 f" ({cell(_med(results[m][n]['vs_ceiling']))}x ceiling)" for m in METHODS]
        findings.append(f"{n}: " + ", ".join(parts) + ".")
        for c in results["comparisons"][n]:
            if c["beyond_spread"] is not None and c["difference"] is not None:
                findings.append(fill(said["difference"], n=n, c=c,
                                     where="beyond" if c["beyond_spread"] else "within"))
    for n in slow:
        for m in ("edit-streaming", "edit-sparse", "edit-sparse-eager"):
            st = results[m][n]
            w, c = _med(st["wait_s_per_step"]), _med(st["comm_time_s_per_step"])
            if w is not None and c:
                findings.append(fill(said["hidden"], n=n, m=m, wait=cell(ms(w)),
                                     comm=cell(ms(c)), hidden=max(0.0, 1 - w / c),
                                     kept=spread_cell(st["vs_unlimited"])))
    for n in slow:
        e, d = results["edit"][n], results["diloco"][n]
        ew, ec, dw = _med(e["wait_s_per_step"]), _med(e["comm_time_s_per_step"]), \
            _med(d["wait_s_per_step"])
        if ew is not None and dw is not None and ec:
            hidden = 1.0 - ew / ec
            findings.append(fill(said["edit_hidden"], n=n, wait=cell(ms(ew)),
                                 comm=cell(ms(ec)), hidden=max(0.0, hidden),
                                 blocks=cell(ms(dw))))
            if hidden < 0.5:
                findings.append(fill(said["edit_exposed"], n=n, hidden=max(0.0, hidden)))
    return targets, findings, shortfalls


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
            ax.bar(i, base, color="#9bbbd4", label="compute (ceiling step)" if i == 0 else None)
            ax.bar(i, wait, bottom=base, color="#d46a6a", label="waiting for sync" if i == 0
                   else None)
            ax.bar(i, other, bottom=base + wait, color="#e0c070",
                   label="other" if i == 0 else None)
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
    tables=[lambda ctx: ("Throughput against link speed", _table(ctx.results, ctx.names)),
            differences("link", "tokens/s difference (medians)", lambda ctx: [
                (n, c) for n in ctx.names for c in ctx.results["comparisons"][n]]), _sweep],
    plots=[_plot_throughput, _plot_split], repeats=True,
    checks=lambda ctx: [(_ceiling(ctx), None)] + [
        (_layers(ctx, variant, None, *ctx.links[-1]), None)
        for variant in [*VARIANTS.values(), *ctx.sweep.values()]],
    settings=lambda ctx: {
        "sync_interval": ctx.interval, "local_steps": ctx.local_steps,
        "sync_steps": ctx.sync_steps, "links": ctx.names, "skip_steps": ctx.skip,
        "repeats": ctx.bench.repeats, "streaming": STREAMING,
        "sparse": {**SPARSE, "overlap_steps": ctx.interval - 1},
        "sparse_eager": {**SPARSE_EAGER, "overlap_steps": ctx.interval},
        "sweep": dict(ctx.sweep)},
    methods=lambda ctx: ("ceiling",) + METHODS,
)
