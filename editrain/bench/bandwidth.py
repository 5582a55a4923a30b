"""Bandwidth: cluster throughput as the simulated inter-replica link gets slower.

``sync`` (an all-reduce of the gradients every step), ``diloco`` (a blocking sync every H
steps) and ``edit`` (a layer-wise sync every H steps, overlapped with the next forward) run
under links from unlimited down to a few MB/s; the ceiling is the same model and data with
no communication at all.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.common import (
    Bench,
    cell,
    md_table,
    pyplot,
    ratio,
    save_figure,
    steady_throughput,
)

NAME = "bandwidth"
METHODS = ("sync", "diloco", "edit")
DESCRIPTION = (
    "Tokens per second of the whole cluster for `sync`, `diloco` and `edit` as the simulated "
    "cross-replica link gets slower (`sim.link_bandwidth` + `sim.link_latency`), against the "
    "ceiling of no communication at all, with the time per step split into computation, "
    "waiting for the sync and communication hidden behind computation."
)
UNLIMITED = "unlimited"


def _links(bench: Bench) -> list[tuple[str | None, str | None]]:
    """The simulated links to sweep (bandwidth, latency); None: unlimited."""
    full = [(None, None), ("100MB/s", "5ms"), ("20MB/s", "5ms"), ("5MB/s", "5ms")]
    return bench.pick([("5MB/s", "5ms")], full, full)


def link_name(bw: str | None, lat: str | None) -> str:
    """``20MB/s+5ms`` or ``unlimited``."""
    if bw is None and lat is None:
        return UNLIMITED
    return "+".join(x for x in (bw, lat) if x)


def run(bench: Bench) -> dict[str, Any]:
    """Run the scenario; returns the record written to ``results.json``."""
    interval = bench.pick(8, 32, 32)
    local_steps = bench.pick(3 * interval, 4 * interval, 5 * interval)
    sync_steps = bench.pick(8, 24, 30)
    skip = bench.pick(2, 4, 4)
    links = _links(bench)

    def layers(method: str, steps: int, bw: str | None, lat: str | None) -> list[dict]:
        """The options of one run of ``method`` on a link."""
        out: list[dict[str, Any]] = [
            {"train": {"steps": steps, "eval_every": steps, "warmup_steps": min(10, steps // 4)},
             "sync": {"method": method},
             "sim": {"link_bandwidth": bw, "link_latency": lat}}]
        if method != "sync":
            out.append({"sync": {"local_sgd_sync_interval": interval}})
        return out

    ceiling_layers = layers("edit", local_steps, None, None)
    ceiling_layers.append({"sync": {"local_sgd_sync_interval": local_steps + 1}})
    bench.check(*ceiling_layers)
    for method in METHODS:
        bench.check(*layers(method, sync_steps, *links[-1]))

    ceiling_runs = [bench.train("ceiling", *ceiling_layers)]
    # Link-major order: a change of the machine's load during the scenario then hits every
    # method at about the same links instead of one method's whole sweep.
    runs: dict[tuple[str, str], Any] = {}
    for bw, lat in links:
        for method in METHODS:
            steps = sync_steps if method == "sync" else local_steps
            name = link_name(bw, lat)
            runs[method, name] = bench.train(f"{method}-{name.replace('/', '')}",
                                             *layers(method, steps, bw, lat))
    if bench.mode != "tiny":  # the ceiling again at the end: did the machine's speed drift?
        ceiling_runs.append(bench.train("ceiling-end", *ceiling_layers))
    windows = [steady_throughput(r, skip) for r in ceiling_runs if r.ok]
    speeds = [w["tokens_per_s"] for w in windows if w.get("tokens_per_s")]
    steps_s = [w["step_time_s"] for w in windows if w.get("step_time_s")]
    ceil_tps = sum(speeds) / len(speeds) if speeds else None
    ceil_step = sum(steps_s) / len(steps_s) if steps_s else None
    drift = speeds[-1] / speeds[0] - 1.0 if len(speeds) == 2 else None
    results: dict[str, Any] = {"ceiling": {"tokens_per_s": ceil_tps, "step_time_s": ceil_step,
                                           "runs_tokens_per_s": speeds, "drift": drift}}
    for method in METHODS:
        results[method] = {link_name(*x): _entry(method, runs[method, link_name(*x)], skip,
                                                 ceil_tps, ceil_step) for x in links}
        base = results[method].get(UNLIMITED, {}).get("tokens_per_s")
        for entry in results[method].values():
            entry["vs_unlimited"] = ratio(entry["tokens_per_s"], base)

    names = [link_name(*x) for x in links]
    table = _table(results, names)
    targets, findings, shortfalls = _judge(results, names, interval)
    if drift is not None and abs(drift) > 0.1:
        findings.append(f"The ceiling measured at the end differs by {drift:+.0%} from the one "
                        "at the start: the machine's speed changed during the scenario, so "
                        "ratios between runs carry that much noise.")
    plots = [_plot_throughput(bench, results, names), _plot_split(bench, results, names)]
    notes = [
        f"2 replicas; `edit` and `diloco` sync every H = {interval} steps and train "
        f"{local_steps} steps; `sync` trains {sync_steps} steps (every step is alike). "
        "Evaluation only at the end, outside the measured window.",
        "Throughput: tokens added between two rows of metrics.jsonl divided by the wall time "
        "between them. For local SGD the window runs from the first to the last sync that "
        f"happened inside a training step after step {skip} (whole sync cycles, so each "
        f"method pays for exactly its share of syncs); for `sync` and the ceiling from step "
        f"{skip} to the end.",
        f"Ceiling: `edit` with H = {local_steps + 1} > steps on an unlimited link, i.e. no "
        "communication during training at all (the final sync after the last step is not "
        "timed); run first and (except at the tiny size) again last, the mean of both is "
        "the reference"
        + (f"; the machine's speed drifted by {drift:+.0%} between them" if drift is not None
           else "") + ". Runs go link by link (sync, diloco, edit at each link), so a drift "
        "of the machine's load spreads over all methods.",
        "Per step: wait = sum of the syncs' `wait_s` (the training thread blocked), comm = "
        "sum of `comm_time_s` (time inside collectives on the communication thread, "
        "including simulated link delay, partly hidden behind computation for `edit`), "
        "divided by the steps of the window. Overhead vs ceiling = step time - ceiling step "
        "time.",
        "`sync`: the gradient all-reduce runs inside `after_backward()`; the metrics hold no "
        "sync entries and `compute_s` includes it, so its wait and comm columns are n/a and "
        "its communication cost shows only as overhead vs the ceiling.",
        "The link model sleeps latency + bytes / bandwidth per cross-replica message on the "
        "communication thread; the shard group (intra-replica) is not slowed.",
    ]
    settings = {"sync_interval": interval, "local_steps": local_steps, "sync_steps": sync_steps,
                "links": names, "skip_steps": skip}
    return bench.finish(settings=settings, methods=("ceiling",) + METHODS, results=results,
                        tables=[("Throughput against link speed", table)], targets=targets,
                        findings=findings, notes=notes, plots=plots, description=DESCRIPTION,
                        shortfalls=shortfalls)


def _entry(method: str, r: Any, skip: int, ceil_tps: float | None,
           ceil_step: float | None) -> dict[str, Any]:
    """The numbers of one run."""
    w = steady_throughput(r, skip) if r.ok else {}
    step = w.get("step_time_s")
    return {
        "tokens_per_s": w.get("tokens_per_s"),
        "step_time_s": step,
        "vs_ceiling": ratio(w.get("tokens_per_s"), ceil_tps),
        "overhead_vs_ceiling_s_per_step": (step - ceil_step) if step is not None
        and ceil_step is not None else None,
        "wait_s_per_step": w.get("wait_s_per_step") if method != "sync"
        else w.get("grad_sync_s_per_step"),
        "comm_time_s_per_step": w.get("comm_time_s_per_step") if method != "sync" else None,
        "link_delay_s_per_step": w.get("link_delay_s_per_step") if method != "sync" else None,
        "compute_s_per_step": w.get("compute_s_per_step"),
        "window": w,
        "load_before": r.load_before,
        "error": r.error,
    }


def _ms(v: float | None) -> float | None:
    """Seconds to milliseconds (None stays None)."""
    return None if v is None else v * 1000.0


def _table(results: dict[str, Any], names: list[str]) -> str:
    """The Markdown table: one row per method and link, plus the ceiling."""
    c = results["ceiling"]
    rows: list[list[Any]] = [["ceiling (no comm)", UNLIMITED, c["tokens_per_s"], None, 1.0,
                              _ms(c["step_time_s"]), None, None, None, None]]
    for method in METHODS:
        for name in names:
            e = results[method][name]
            rows.append([method, name, e["tokens_per_s"], e["vs_unlimited"], e["vs_ceiling"],
                         _ms(e["step_time_s"]), _ms(e["overhead_vs_ceiling_s_per_step"]),
                         _ms(e["wait_s_per_step"]), _ms(e["comm_time_s_per_step"]),
                         _ms(e["link_delay_s_per_step"])])
    return md_table(["method", "link", "tokens/s", "x unlimited", "x ceiling", "step ms",
                     "overhead vs ceiling ms/step", "wait ms/step", "comm ms/step",
                     "link delay ms/step"], rows)


def _judge(results: dict[str, Any], names: list[str],
           interval: int) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The target check, the findings and the shortfalls, from the numbers."""
    slow = [n for n in names if n != UNLIMITED]
    checked = []
    for n in slow:
        s = results["sync"][n]["vs_unlimited"]
        e = results["edit"][n]["vs_unlimited"]
        if s is not None and s < 0.5:
            checked.append((n, s, e))
    if UNLIMITED not in names:
        met, detail = None, "no unlimited-link runs at this size"
    elif not checked:
        met, detail = None, "no link slowed sync below 0.5x of its unlimited throughput"
    else:
        met = any(e is not None and e >= 0.9 for _, _, e in checked)
        detail = "; ".join(f"{n}: sync {cell(s)}x, edit {cell(e)}x" for n, s, e in checked)
    targets = [{"name": f"edit (H = {interval}) keeps >= 0.9x of its unlimited-link throughput "
                        "at a link where sync falls below 0.5x", "met": met,
                "detail": detail}]
    findings, shortfalls = [], []
    for n, s, e in checked:
        if e is None or e < 0.9:
            shortfalls.append(f"{n}: edit keeps only {cell(e)}x of its unlimited-link "
                              f"throughput (sync {cell(s)}x).")
    for n in names:
        parts = [f"{m} {cell(results[m][n]['tokens_per_s'])} tok/s"
                 f" ({cell(results[m][n]['vs_ceiling'])}x ceiling)" for m in METHODS]
        findings.append(f"{n}: " + ", ".join(parts) + ".")
    for n in slow:
        e, d = results["edit"][n], results["diloco"][n]
        if e["wait_s_per_step"] is not None and d["wait_s_per_step"] is not None \
                and e["comm_time_s_per_step"]:
            hidden = 1.0 - e["wait_s_per_step"] / e["comm_time_s_per_step"]
            findings.append(
                f"{n}: edit waits {cell(_ms(e['wait_s_per_step']))} ms/step for "
                f"{cell(_ms(e['comm_time_s_per_step']))} ms/step of communication "
                f"({max(0.0, hidden):.0%} hidden behind the forward); diloco blocks "
                f"{cell(_ms(d['wait_s_per_step']))} ms/step.")
            if hidden < 0.5:
                shortfalls.append(
                    f"{n}: edit hides only {max(0.0, hidden):.0%} of its sync communication "
                    "behind computation (see the overlap scenario); its advantage here comes "
                    "from syncing every H steps, not from the layer-wise overlap.")
    return targets, findings, shortfalls


def _plot_throughput(bench: Bench, results: dict[str, Any], names: list[str]):
    """tokens/s against the link, one line per method, the ceiling dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = list(range(len(names)))
    for method in METHODS:
        ys = [results[method][n]["tokens_per_s"] for n in names]
        ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=method)
    c = results["ceiling"]["tokens_per_s"]
    if c:
        ax.axhline(c, color="gray", linestyle="--", label="ceiling (no communication)")
    ax.set_xticks(xs, names)
    ax.set_xlabel("simulated inter-replica link")
    ax.set_ylabel("tokens/s (cluster)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return save_figure(fig, bench.out_dir / "throughput_vs_link.png")


def _plot_split(bench: Bench, results: dict[str, Any], names: list[str]):
    """Stacked ms/step: ceiling step time, waiting for syncs, other overhead; dots: comm."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(names) * len(METHODS)), 4.5))
    base = _ms(results["ceiling"]["step_time_s"]) or 0.0
    xs: list[str] = []
    comm_labelled = False
    for i, (method, name) in enumerate((m, n) for m in METHODS for n in names):
        e = results[method][name]
        step = _ms(e["step_time_s"]) or 0.0
        wait = _ms(e["wait_s_per_step"]) or 0.0
        if method == "sync" and e["wait_s_per_step"] is None:
            wait = max(0.0, step - base)  # not in the metrics: the whole excess
        other = max(0.0, step - base - wait)
        ax.bar(i, base, color="#9bbbd4", label="compute (ceiling step)" if i == 0 else None)
        ax.bar(i, wait, bottom=base, color="#d46a6a", label="waiting for sync" if i == 0
               else None)
        ax.bar(i, other, bottom=base + wait, color="#e0c070", label="other" if i == 0 else None)
        if e["comm_time_s_per_step"] is not None:
            ax.plot(i, _ms(e["comm_time_s_per_step"]), "k^",
                    label=None if comm_labelled else "communication (incl. hidden)")
            comm_labelled = True
        xs.append(f"{method}\n{name}")
    ax.set_xticks(range(len(xs)), xs, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, bench.out_dir / "time_split.png")
