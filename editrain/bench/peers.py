"""Peers: torchft's DiLoCo side by side with editrain's ``diloco`` and ``edit``.

torchft (``pip install torchft``, or the ``peers`` extra) is driven for real: the scenario
starts a torchft lighthouse on localhost and one :mod:`editrain.bench.torchft_peer` worker
process per replica group, with a timeout so that a hang fails the run instead of
blocking. The four systems train the same model, data, H, inner and outer optimizer and
schedule, 2 replicas x 1 process; editrain's ``diloco`` runs twice, through the command
line and through the public library API in torchft's worker loop (``diloco-library``), so
both ways of using editrain are measured. Every repeat runs the four in turn
(interleaved). When torchft is not importable the scenario is skipped, with that reason in
``results.json``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from editrain.bench.machine import load_average
from editrain.bench.measures import over_repeats, replica_spreads, run_refs
from editrain.bench.options import timed_train
from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench, child_env, child_failure, repeat_label
from editrain.bench.runs import Run, read_run
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict
from editrain.bench.stats import compare, median, spread
from editrain.bench.tables import md_table, spread_cell, spread_of, verdict_cell
from editrain.config import ConfigError
from editrain.paths import shown

TEXT = prose("peers")
SYSTEMS = ("torchft-diloco", "diloco", "edit", "diloco-library")
TIMED_OUT = "torchft workers did not finish"
"""How the error of a run past its time limit begins."""
WORKER_SYSTEMS = {"torchft-diloco": "torchft", "diloco-library": "library"}
"""The systems run by :mod:`editrain.bench.torchft_peer` (its ``system``); the others are
``editrain train`` runs."""
COMPARISONS = (("diloco", "torchft-diloco"), ("edit", "torchft-diloco"), ("edit", "diloco"),
               ("diloco-library", "torchft-diloco"), ("diloco-library", "diloco"))
"""Pairs compared on final validation loss and tokens/s against the spread of repeats."""
SAME_START_TOLERANCE = 1e-3
"""Largest allowed difference of the initial validation losses (same model and data)."""
SAME_RESULT_TOLERANCE = 1e-3
"""editrain's ``diloco`` and torchft's DiLoCo compute the same algorithm: their final
validation losses must agree to this (relative) tolerance, up to floating-point order."""


def torchft_version() -> str | None:
    """torchft's version when it is importable, else None."""
    if importlib.util.find_spec("torchft") is None:
        return None
    try:
        return importlib.metadata.version("torchft")
    except Exception:
        return "unknown"


def _skipped_as(reason: str) -> dict[str, Any]:
    """The record of a skip: the peer's status."""
    return {"settings": {"torchft": None}, "methods": ["torchft-diloco"],
            "results": {"torchft-diloco": {"status": "skipped", "reason": reason}},
            "tables": [("Peers", md_table(["peer", "status"], [["torchft DiLoCo", reason]]))],
            "notes": [TEXT["skipped_note"]]}


# --------------------------------------------------------------------------- the runs
def _setup(bench: Bench) -> dict[str, Any]:
    steps = bench.pick(8, 96, 200)
    common = {"train": timed_train(steps),
              "sync": {"local_sgd_sync_interval": bench.pick(4, 16, 20)}}
    layers = {s: [common, {"sync": {"method": "edit" if s == "edit" else "diloco"}}]
              for s in SYSTEMS}
    for s in SYSTEMS:
        bench.check(*layers[s])
    cfg = bench.config(*layers["torchft-diloco"])
    h = cfg.sync.resolve().local_sgd_sync_interval
    if cfg.train.steps % h:
        raise ConfigError(fill(TEXT["steps_multiple"], steps=cfg.train.steps, h=h))
    if cfg.dist.shard_size != 1:
        raise ConfigError(fill(TEXT["shard_size"], shard_size=cfg.dist.shard_size))
    return {"steps": steps, "skip": bench.pick(2, 4, 4), "timeout_s": bench.pick(180, 900, 3600),
            "layers": layers, "cfg": cfg, "h": h, "found": torchft_version(),
            "threads": cfg.dist.threads_per_proc or max(1, (os.cpu_count() or 1)
                                                        // cfg.dist.nproc)}


def _runs(ctx: Ctx) -> list[Job]:
    """Every repeat runs the four systems in turn (interleaved); torchft's and the
    library's are :mod:`editrain.bench.torchft_peer` workers."""
    def worker(system: str):
        return lambda bench, job: run_torchft(
            bench, job.label, bench.options(*job.layers), ctx.cfg.dist.nproc, ctx.threads,
            ctx.timeout_s, job.title, system)

    return [Job(repeat_label(system, rep), ctx.layers[system],
                title=f"{system} repeat {rep + 1}",
                start=worker(WORKER_SYSTEMS[system]) if system in WORKER_SYSTEMS else None)
            for rep in range(ctx.bench.repeats) for system in SYSTEMS]


def run_torchft(bench: Bench, label: str, options: dict[str, Any], replicas: int,
                threads: int, timeout_s: float, title: str, system: str = "torchft") -> Run:
    """One run of :mod:`editrain.bench.torchft_peer` workers, one process per replica
    group, recorded on ``bench`` under ``runs/LABEL``: with ``system = "torchft"`` a
    lighthouse runs here too; with ``"library"`` the workers are editrain's library path,
    joined by the ``torchrun`` variables (a free loopback port).

    ``options`` are the nested training options (those of editrain's ``diloco`` run),
    ``threads`` the intra-op threads per worker and ``timeout_s`` the whole run's time
    limit, also the collective timeout. The run is read back like an editrain run;
    ``error`` is set when a worker failed or the time limit was hit (the workers are
    killed then). A torchft run that hits the time limit is run once more from scratch;
    ``retried`` holds the first attempt's error (the workers' stacks, dumped before the
    kill, are in its kept directory).
    """
    run_dir = bench.out_dir / "runs" / label
    load = load_average()
    bench.announce(title)
    retried: list[str] = []
    while True:
        t0 = time.perf_counter()
        error = _attempt(run_dir, options, replicas, threads, timeout_s, system)
        if not (error and error.startswith(TIMED_OUT) and system == "torchft" and not retried):
            break
        # torchft's workers hung (rarely, under load: once in many CI runs). Run it once
        # more from scratch, and keep the hung attempt's directory (the workers' stacks
        # are in its logs) and its error on the record.
        kept = run_dir.with_name(f"{label}.attempt1")
        shutil.rmtree(kept, ignore_errors=True)
        run_dir.rename(kept)
        retried.append(f"{error} (kept in {kept})")
        bench.log(f"{title}: {error}; running it again")
    run = read_run(label, run_dir, options, time.perf_counter() - t0, error)
    run.retried = retried
    return bench.record_run(run, load, title)


def _attempt(run_dir: Path, options: dict[str, Any], replicas: int, threads: int,
             timeout_s: float, system: str) -> str | None:
    """One attempt at :func:`run_torchft`'s run, in a fresh ``run_dir``; its error or None."""
    from editrain.spawn import free_port

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = child_env(threads)
    procs: list[subprocess.Popen] = []
    try:
        address = None
        if system == "torchft":
            # The lighthouse in its own process: its log goes to a file, a crash stays there.
            procs.append(_peer(["--serve-lighthouse", "[::]:0", "--replicas", str(replicas)],
                               run_dir / "lighthouse.log", env))
            address = _lighthouse_address(run_dir / "lighthouse.log", procs[0], timeout_s)
        port = str(free_port())
        workers = []
        for r in range(replicas):
            spec_path = run_dir / f"spec{r}.json"
            spec_path.write_text(json.dumps(
                {"options": options, "system": system, "replica": r, "replicas": replicas,
                 "lighthouse": address, "run_dir": str(run_dir), "threads": threads,
                 "timeout_s": timeout_s}, indent=1))
            torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                        "WORLD_SIZE": str(replicas), "LOCAL_RANK": str(r),
                        "LOCAL_WORLD_SIZE": str(replicas)}
            workers.append(_peer(["--spec", str(spec_path)], run_dir / f"worker{r}.log",
                                 {**env, **torchrun} if system == "library" else env))
            procs.append(workers[-1])
        return _wait(workers, run_dir, timeout_s)
    except RuntimeError as e:  # the lighthouse did not come up
        return str(e)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _peer(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``python -m editrain.bench.torchft_peer ARGS`` (a worker, or the lighthouse
    with ``--serve-lighthouse``), its output to ``log``."""
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "editrain.bench.torchft_peer", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


def _lighthouse_address(log: Path, proc: subprocess.Popen, timeout_s: float) -> str:
    """The address the lighthouse process prints (``lighthouse ready at ADDR``).

    Raises:
        RuntimeError: it exited or did not answer within ``timeout_s`` (at most 2 min).
    """
    deadline = time.monotonic() + min(timeout_s, 120.0)
    while time.monotonic() < deadline:
        ready = [x for x in log.read_text().splitlines() if x.startswith("lighthouse ready at ")]
        if ready:
            return ready[0].removeprefix("lighthouse ready at ").strip()
        if proc.poll() is not None:
            raise RuntimeError(f"the torchft lighthouse exited with status {proc.returncode} "
                               f"(see {shown(log)})")
        time.sleep(0.1)
    raise RuntimeError("the torchft lighthouse did not start within "
                       f"{min(timeout_s, 120.0):.0f} s")


def _wait(procs: list[subprocess.Popen], run_dir: Path, timeout_s: float) -> str | None:
    """Wait for the workers; the error (first failed worker, or the time limit) or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        for r, code in enumerate(codes):
            if code not in (None, 0):
                return f"torchft worker {r}: {child_failure(code, run_dir / f'worker{r}.log')}"
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)
    return _timed_out(procs, run_dir, timeout_s)


def _timed_out(procs: list[subprocess.Popen], run_dir: Path, timeout_s: float) -> str:
    """The error of a run past its time limit: which workers still ran and the last step
    each logged. Each of them gets SIGUSR1 first, so that its log ends with every thread's
    stack (the worker registers faulthandler for it); the caller kills them."""
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in running:
        try:
            procs[r].send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(2.0)  # time to write the stacks
    where = ", ".join(f"worker {r} after step {_last_step(run_dir, r)} "
                      f"(stacks in {run_dir / f'worker{r}.log'})" for r in running)
    return f"{TIMED_OUT} within {timeout_s:.0f} s (killed); {where}"


def _last_step(run_dir: Path, replica: int) -> int:
    """The last step replica ``replica`` logged in ``ranks/rank{R}.jsonl`` (0: none)."""
    path = run_dir / "ranks" / f"rank{replica}.jsonl"
    last = 0
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                last = int(json.loads(line).get("step", last))
            except (ValueError, AttributeError):
                continue  # a line cut by the kill
    return last


# ----------------------------------------------------------------------- the numbers
def _measure(ctx: Ctx) -> dict[str, Any]:
    """Every system's spreads over the repeats, the speed ratios and the comparisons; the
    measurement errors go to ``ctx.errors``."""
    results: dict[str, Any] = {}
    ctx.errors = []
    runs = {s: [ctx.runs[repeat_label(s, rep)] for rep in range(ctx.bench.repeats)]
            for s in SYSTEMS}
    for system, reps in runs.items():
        windows, per_replica, found = over_repeats(reps, ctx.skip)
        ctx.errors += [f"{system} repeat {k + 1}: {e}" for k, p in enumerate(found) for e in p]
        results[system] = {
            "final_val_loss": spread(r.final_val_loss for r in reps),
            "initial_val_loss": spread(r.initial_val_loss for r in reps),
            "val_tokens": median(r.summary.get("val_tokens") for r in reps),
            "tokens_per_s": spread(w.get("tokens_per_s") for w in windows),
            "num_syncs": median(r.summary.get("num_syncs") for r in reps),
            "replicas": replica_spreads(per_replica),
            "windows": windows,
            **run_refs(reps),
        }
    results["torchft-diloco"]["replica_final_val_loss"] = [
        _replica_final_losses(r) for r in runs["torchft-diloco"] if r.ok]
    starts = [results[s]["initial_val_loss"]["median"] for s in SYSTEMS]
    gap = (max(starts) - min(starts)) if all(v is not None for v in starts) else None
    results["initial_val_loss_gap"] = gap
    if gap is not None and gap > SAME_START_TOLERANCE:
        ctx.errors.append(fill(TEXT["different_start"], gap=gap))
    results["speed_ratios"] = _speed_ratios(results)
    results["comparisons"] = [
        compare(a, b, results[a][metric], results[b][metric],
                _tolerance(metric, results[b][metric]), metric=metric)
        for a, b in COMPARISONS for metric in ("final_val_loss", "tokens_per_s")]
    return results


def _replica_final_losses(run: Run) -> list[float]:
    """The final validation loss each torchft replica computed (equal: the global model)."""
    out = []
    for path in sorted(run.run_dir.glob("replica*.json")):
        value = json.loads(path.read_text()).get("final_val_loss")
        if isinstance(value, int | float):
            out.append(float(value))
    return out


def _speed_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """tokens/s of editrain's systems over torchft DiLoCo's: the ratio of the medians, and
    the ratio within every repeat (the runs of one repeat run back to back)."""
    ref = results["torchft-diloco"]
    out = {}
    for system in ("diloco", "edit", "diloco-library"):
        mine = results[system]["tokens_per_s"]
        paired = [a["tokens_per_s"] / b["tokens_per_s"]
                  for a, b in zip(results[system]["windows"], ref["windows"])
                  if a.get("tokens_per_s") and b.get("tokens_per_s")]
        ratio = (mine["median"] / ref["tokens_per_s"]["median"]
                 if mine.get("median") and ref["tokens_per_s"].get("median") else None)
        out[system] = {"median_ratio": ratio, "paired": paired}
    return out


def _tolerance(metric: str, reference: dict[str, Any]) -> float:
    """Gap below which two results count as equal: losses of deterministic runs (spread 0)
    to a relative 1e-6 (floating-point summation order), throughput exactly."""
    if metric != "final_val_loss" or reference.get("median") is None:
        return 0.0
    return 1e-6 * abs(reference["median"])


def _range(values: list[float]) -> str:
    """``min-max`` of ratios, or ``-`` when there are none."""
    return f"{min(values):.3f}-{max(values):.3f}" if values else "-"


# ----------------------------------------------------------------------- the verdict
def _targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """editrain's diloco ends at torchft DiLoCo's final loss in every repeat, through the
    command line and the library API alike; editrain's diloco, edit and diloco-library
    train at least as fast (medians)."""
    same = {"name": fill(TEXT["targets"]["same_loss"], tolerance=SAME_RESULT_TOLERANCE),
            "met": None, "detail": "a run failed"}
    theirs = results["torchft-diloco"]["final_val_loss"]["values"]
    ours = [results[s]["final_val_loss"]["values"] for s in ("diloco", "diloco-library")]
    if all(mine and len(mine) == len(theirs) for mine in ours):
        gap = max(abs(a - b) / abs(b) for mine in ours for a, b in zip(mine, theirs))
        same.update(met=gap <= SAME_RESULT_TOLERANCE,
                    detail=f"largest relative difference {gap:.2g}")
    fast = {"name": TEXT["targets"]["speed"], "met": None, "detail": "a run failed"}
    ratios = results["speed_ratios"]
    if all(r["median_ratio"] is not None for r in ratios.values()):
        fast.update(met=all(r["median_ratio"] >= 1.0 for r in ratios.values()),
                    detail="; ".join(f"{s} {r['median_ratio']:.3f}x (paired repeats "
                                     f"{_range(r['paired'])})" for s, r in ratios.items()))
    return [same, fast]


def _shortfalls(results: dict[str, Any]) -> list[str]:
    """editrain's systems slower than torchft's DiLoCo, or ending at a higher loss."""
    out, said = [], TEXT["shortfalls"]
    ref = results["torchft-diloco"]
    for c in results["comparisons"]:
        if c["b"] != "torchft-diloco" or c["difference"] is None or c["beyond_spread"] is False:
            continue
        if c["metric"] == "tokens_per_s" and c["difference"] < 0:
            out.append(fill(said["slower"], c=c,
                            mine=spread_cell(results[c["a"]]["tokens_per_s"]),
                            theirs=spread_cell(ref["tokens_per_s"]),
                            slower=-c["difference"] / ref["tokens_per_s"]["median"],
                            one=said["one_repeat"] if c["beyond_spread"] is None else "."))
        if c["metric"] == "final_val_loss" and c["difference"] > _tolerance(c["metric"], ref):
            out.append(fill(said["higher_loss"], c=c))
    return out


def _findings(results: dict[str, Any], repeats: int, steps: int, h: int) -> list[str]:
    """Plain sentences from the numbers."""
    out, said = [], TEXT["findings"]
    if results["initial_val_loss_gap"] is not None:
        out.append(fill(said["same_start"], gap=results["initial_val_loss_gap"]))
    syncs = results["torchft-diloco"]["num_syncs"]
    if syncs is not None:
        out.append(fill(said["syncs"], syncs=syncs, planned=steps // h))
    for system, r in results["speed_ratios"].items():
        if r["median_ratio"] is not None:
            out.append(fill(said["speed"], system=system, r=r, paired=_range(r["paired"])))
    for c in results["comparisons"]:
        if c["difference"] is None:
            continue
        verdict = ("" if c["beyond_spread"] is None else
                   (", beyond" if c["beyond_spread"] else ", within")
                   + f" the spread of {repeats} repeats")
        value = (f"{c['difference']:+.4g}" if c["metric"] == "final_val_loss"
                 else f"{c['difference']:+,.0f} tok/s")
        out.append(f"{c['a']} - {c['b']}: {c['metric']} {value}{verdict}.")
    return out


def _headline(results: dict[str, Any], repeats: int) -> list[str]:
    """The report's summary sentence."""
    parts = "; ".join(f"{s} {spread_cell(results[s]['final_val_loss'])} at "
                      f"{spread_cell(results[s]['tokens_per_s'])} tok/s" for s in SYSTEMS)
    return [fill(TEXT["headline"], repeats=repeats, parts=parts)]


def _notes(ctx: Ctx) -> list[str]:
    outer = ctx.cfg.sync.resolve()
    return fill(TEXT["notes"], ctx=ctx, cfg=ctx.cfg, outer=outer,
                outer_kwargs=json.dumps(outer.outer_optim_kwargs),
                tiny=TEXT["tiny_validation"] if ctx.bench.mode == "tiny" else "")



SCENARIO = Scenario(
    name="peers",
    description=TEXT["description"],
    unavailable=lambda: TEXT["unavailable"] if torchft_version() is None else None,
    skipped_as=_skipped_as, setup=_setup, runs=_runs, measure=_measure, repeats=True,
    methods=lambda ctx: SYSTEMS,
    checks=lambda ctx: [],  # setup checked every system's options (and the peer's limits)
    tables=[
        Table("torchft DiLoCo and editrain", [
            ("system", None), ("final val loss", spread_of("final_val_loss")),
            ("initial val loss", spread_of("initial_val_loss")),
            ("tokens/s", spread_of("tokens_per_s")), ("syncs", "num_syncs"),
            ("val tokens", "val_tokens"),
            ("utilisation per replica", lambda row: "/".join(
                spread_cell(r["utilisation"]) for r in row[1]["replicas"]) or None)],
            # a record from before a system was added has no row for it
            rows=lambda ctx: [(s, ctx.results[s]) for s in SYSTEMS if s in ctx.results]),
        Table("Differences against the spread of the repeats", [
            ("pair", lambda c: f"{c['a']} - {c['b']}"), ("metric", lambda c: c["metric"]),
            ("difference (medians)", lambda c: c["difference"]),
            ("beyond spread", lambda c: verdict_cell(c["beyond_spread"]))],
            rows=lambda ctx: ctx.results["comparisons"])],
    judge=lambda ctx: Verdict(
        targets=_targets(ctx.results),
        findings=_findings(ctx.results, ctx.bench.repeats, ctx.steps, ctx.h),
        shortfalls=_shortfalls(ctx.results), errors=ctx.errors,
        headline=_headline(ctx.results, ctx.bench.repeats)),
    notes=_notes,
    settings=lambda ctx: {"steps": ctx.steps, "sync_interval": ctx.h,
                          "repeats": ctx.bench.repeats, "torchft": ctx.found,
                          "threads_per_process": ctx.threads, "timeout_s": ctx.timeout_s,
                          "skip_steps": ctx.skip},
)
