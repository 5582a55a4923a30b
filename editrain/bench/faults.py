"""Faults: one replica dies mid-run; the fault-tolerant mode against restart-from-checkpoint.

Four runs per repeat, interleaved, all ``edit`` on 2 replicas x 1 process with the same
step budget: ``ft`` (``--ft``, no failure), ``ft-fail`` (``--ft``, replica 1 killed after
step F and started again: it heals from replica 0, which never stops), ``plain`` (the
plain mode, no failure) and ``restart-fail`` (the plain mode, the same kill, torch elastic
restarts every worker from the last checkpoint: ``--max-restarts 1``). What a failure costs
is measured against the no-failure run of the same mode in the same repeat:

* **useful tokens**: tokens that went into the final model. The step budget for every
  replica in the plain mode (steps redone after the restart count once); in the
  fault-tolerant mode each replica group's steps of its last attempt, plus the dead
  attempt's steps up to its last sync (later ones died with it).
* **useful throughput** = useful tokens / wall time of the whole launch; its loss against
  the no-failure run of the same mode, and the time lost (extra wall time).
* **useful tokens in a fixed window**: the same, counted only up to ``W`` seconds after
  each run's first training step, ``W`` ending when the first rank of any of the repeat's
  runs has finished its step budget (from the per-step rows' clock:
  ``ranks/rank{R}.jsonl``), so that within the window no replica is held back by the
  budget: a survivor that runs faster alone gets the credit, which a fixed step budget
  would hide (a window as long as the no-failure run let the survivor gain nothing, only
  lose). A step row is useful unless its attempt died and the step came after that
  attempt's last sync (``--ft``) or last checkpoint (restart). This is the issue's "tokens
  in a fixed wall time". The loss is also given per replica: the survivor's (what the
  failure cost the replicas that did not fail) and the dead replica's.
* The issue's check, "the fault-tolerant mode loses at most the dead replica's share of
  the window": the window loss of ``ft-fail`` against ``ft`` compared with the dead
  replica's share, ``lost / W / replicas``, where ``lost`` is the time whose work of the
  dead replica is gone: its downtime (from its death, as the launcher saw it, to its
  rejoin, the ``ft_join`` row's time) plus its steps since its last sync (done, then lost
  with it; at the no-failure run's step time). The downtime-only share is reported too.
  The check is on the median over repeats of the per-repeat difference, as every target
  of the suite; how many repeats held on their own is reported with it (on a busy 2-core
  machine a run's speed varies from run to run by as much as the margin, or more).
"""

from __future__ import annotations

from typing import Any

from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench, repeat_label
from editrain.bench.runs import Run
from editrain.bench.scenario import Ctx, Job, Scenario, Table, Verdict
from editrain.bench.stats import measured, spread
from editrain.bench.tables import spread_cell
from editrain.errors import ConfigError, plain_count
from editrain.metrics import is_measured, read_jsonl, replica_of
from editrain.paths import shown

TEXT = prose("faults")
SYSTEMS = ("ft", "ft-fail", "plain", "restart-fail")
FAILURES = (("ft-fail", "ft"), ("restart-fail", "plain"))
"""Each failed run and the no-failure run of the same mode it is measured against."""
REPLICAS = 2


def _unavailable() -> str | None:
    from editrain.sync.ft import torchft_available

    return None if torchft_available() else TEXT["unavailable"]


def _setup(bench: Bench) -> dict[str, Any]:
    # Long enough that the dead replica is back well before the end (a restart takes a
    # few seconds of process start-up): quick ~25 s of training per run.
    steps, interval = bench.pick(24, 600, 2000), bench.pick(4, 20, 20)
    fail_at = steps // 3 + interval // 2  # mid-window: the dead replica loses local steps
    ckpt_every = bench.pick(8, 100, 200)
    restart_s = 0.0  # both modes restart the dead processes at once (torch elastic does)
    # Failure detection: the lighthouse drops a replica whose heartbeats (every 50 ms)
    # stopped for 0.25 s; heartbeats come from torchft's native threads, not the training
    # loop, so a busy live replica keeps sending them.
    heartbeat_s, beat_every_s = 0.25, 0.05
    common = {"train": {"steps": steps, "eval_every": steps},
              "sync": {"method": "edit", "local_sgd_sync_interval": interval,
                       "local_sgd_warmup_steps": 0},
              "dist": {"nproc": REPLICAS, "shard_size": 1,
                       "ft_heartbeat_timeout_s": heartbeat_s,
                       "ft_heartbeat_interval_s": beat_every_s}}
    fail = {"sim": {"fail": f"{REPLICAS - 1}@{fail_at}", "fail_restart_s": restart_s}}
    ft = {"dist": {"fault_tolerance": "torchft"}}
    return {"steps": steps, "interval": interval, "fail_at": fail_at, "ckpt_every": ckpt_every,
            "restart_s": restart_s, "heartbeat_s": heartbeat_s, "beat_every_s": beat_every_s,
            "layers": {"ft": [common, ft], "ft-fail": [common, ft, fail], "plain": [common],
                       "restart-fail": [common, fail, {"dist": {"max_restarts": 1},
                                                       "checkpoint": {"every": ckpt_every}}]}}


def _results(ctx: Ctx) -> dict[str, Any]:
    return _summarise([_measure({s: ctx.runs[repeat_label(s, i)] for s in SYSTEMS},
                                ctx.fail_at, ctx.interval, ctx.ckpt_every)
                       for i in range(ctx.bench.repeats)])


# ---------------------------------------------------------------------------- measures
def _tokens_per_rank_step(run: Run) -> int:
    """Tokens one rank trains on per step, from the run's resolved ``config.toml``: each
    option a TOML integer >= 1 as training read it, else refused naming the option and
    the file (``int()`` of the product took ``true`` as 1 and truncated a float; a missing
    batch of 0 divided by zero in the measures)."""
    t = run.config.get("train", {})
    try:
        return (plain_count(t.get("batch_size"), "train.batch_size")
                * plain_count(t.get("seq_len"), "train.seq_len")
                * plain_count(t.get("gradient_accumulation_steps", 1),
                              "train.gradient_accumulation_steps"))
    except ConfigError as e:
        raise ConfigError(f"bench faults: {shown(run.run_dir / 'config.toml')}: {e}") from None


def _ft_numbers(run: Run, fail_at: int | None, interval: int) -> dict[str, Any]:
    """Useful tokens, final loss and the dead replica's downtime of a ``--ft`` run.

    The summary's fields were checked when it was read (:func:`editrain.bench.runs.read_run`
    against :data:`editrain.metrics.SUMMARY_SCHEMA`: a group's ``tokens_processed`` an
    integer, an event named, its ``unix_time`` a number where it has one); an ``ft_join``
    row whose ``unix_time`` is no number is skipped, as the metrics readers skip a row they
    cannot read."""
    s = run.summary
    groups = s.get("per_replica", {})
    useful = sum(g.get("tokens_processed", 0) for g in groups.values())
    out: dict[str, Any] = {"final_val_loss": s.get("final_val_loss"),
                           "heals": sum(g.get("healed_at") is not None for g in groups.values())}
    if fail_at is not None:
        # The dead attempt's steps up to its last sync are in the model; later ones died.
        useful += (fail_at // interval) * interval * _tokens_per_rank_step(run)
        died = [e["unix_time"] for e in s.get("events", [])
                if e.get("event") == "died" and "unix_time" in e]
        paths = [run.run_dir / f"replica{r}" / "metrics.jsonl" for r in groups]
        joins = [measured(row.get("unix_time")) for path in paths if path.is_file()
                 for row in read_jsonl(path) if row.get("event") == "ft_join"]
        joins = [t for t in joins if t is not None]
        if died and joins:  # the dead replica is the last group: its rejoin is read last
            out["downtime_s"] = joins[-1] - died[0]
    out["useful_tokens"] = useful
    return out


def _rank_logs(run: Run) -> list[list[dict[str, Any]]]:
    """Every rank's step rows in file order (both attempts), from either layout; event rows
    (the bytes by cause at the end of a rank's log) left out, and so is a row that does
    not fit :data:`editrain.metrics.ROW_SCHEMA` (a step that is no integer >= 0, a
    ``unix_time`` or ``step_time_s`` that is no finite number >= 0) or lacks one of the
    three (no measurement, as :func:`editrain.bench.runs.read_run` skips it: a string step
    crashed the attempts' order with a TypeError, a missing step time with a KeyError)."""
    paths = sorted(run.run_dir.glob("replica*/ranks/rank*.jsonl")) or \
        sorted(run.run_dir.glob("ranks/rank*.jsonl"))
    return [[r for r in read_jsonl(p) if _is_timed_step(r)] for p in paths]


TIMED_STEP_KEYS = ("step", "unix_time", "step_time_s")
"""What a rank's row holds for the faults window to place its step in time."""


def _is_timed_step(row: dict[str, Any]) -> bool:
    """Whether ``row`` is a step row the window reads: a measurement
    (:func:`editrain.metrics.is_measured`) with its step, clock and step time."""
    return ("event" not in row and all(row.get(key) is not None for key in TIMED_STEP_KEYS)
            and is_measured(row))


def _useful_rows(rows: list[dict[str, Any]], cutoff: int) -> list[dict[str, Any]]:
    """The rows of one rank whose steps are in the final model: a new attempt starts where
    the step does not follow the last one (a restart goes back, a heal jumps ahead); an
    attempt that is not the last keeps only its steps up to ``cutoff`` (its last sync or
    checkpoint)."""
    attempts: list[list[dict[str, Any]]] = []
    for row in rows:
        if not attempts or row["step"] != attempts[-1][-1]["step"] + 1:
            attempts.append([])
        attempts[-1].append(row)
    out = [r for a in attempts[:-1] for r in a if r["step"] <= cutoff]
    return out + (attempts[-1] if attempts else [])


def _window(run: Run, cutoff: int) -> tuple[list[float], dict[int, list[float]]]:
    """The times, from the run's first step, at which each rank finished its budget (its
    last row), and per replica the times of its ranks' useful step rows."""
    logs = [rows for rows in _rank_logs(run) if rows]
    if not logs:
        return [], {}
    start = min(rows[0]["unix_time"] - rows[0]["step_time_s"] for rows in logs)
    times: dict[int, list[float]] = {}
    for rows in logs:
        times.setdefault(replica_of(rows, 0), []).extend(
            r["unix_time"] - start for r in _useful_rows(rows, cutoff))
    return [rows[-1]["unix_time"] - start for rows in logs], times


def _measure(runs: dict[str, Run], fail_at: int, interval: int, ckpt_every: int
             ) -> dict[str, dict[str, Any]]:
    """One repeat's numbers per system, with ratios against its own no-failure run."""
    out: dict[str, dict[str, Any]] = {}
    cutoffs = {"ft": 0, "ft-fail": fail_at // interval * interval, "plain": 0,
               "restart-fail": fail_at // ckpt_every * ckpt_every}
    windows = {s: _window(run, cutoffs[s]) for s, run in runs.items() if run.ok}
    ends = [end for run_ends, _ in windows.values() for end in run_ends]
    span = min(ends) if ends else 0.0  # W: until the first rank of any run is done
    for s, run in runs.items():
        if not run.ok:
            out[s] = {"error": run.error}
            continue
        nums = (_ft_numbers(run, fail_at if s == "ft-fail" else None, interval)
                if s.startswith("ft") else
                {"final_val_loss": run.summary.get("final_val_loss"),
                 "useful_tokens": run.summary.get("steps", 0) * REPLICAS
                 * _tokens_per_rank_step(run)})
        nums["wall_s"] = run.launch_s
        nums["useful_tokens_per_s"] = nums["useful_tokens"] / run.launch_s
        if span > 0:
            per_step = _tokens_per_rank_step(run)
            by_replica = {r: sum(t <= span for t in ts) * per_step
                          for r, ts in sorted(windows[s][1].items())}
            nums["window_s"] = span
            nums["window_tokens"] = sum(by_replica.values())
            nums["window_tokens_by_replica"] = by_replica
        out[s] = nums
    for failed, clean in FAILURES:
        a, b = out.get(failed, {}), out.get(clean, {})
        if "wall_s" in a and "wall_s" in b:
            a["time_lost_s"] = a["wall_s"] - b["wall_s"]
            a["throughput_loss"] = 1.0 - a["useful_tokens_per_s"] / b["useful_tokens_per_s"]
        if a.get("window_tokens") and b.get("window_tokens"):
            a["window_loss"] = 1.0 - a["window_tokens"] / b["window_tokens"]
    ftf, clean = out.get("ft-fail", {}), out.get("ft", {})
    a, b = ftf.get("window_tokens_by_replica"), clean.get("window_tokens_by_replica") or {}
    if a and b.get(0) and b.get(REPLICAS - 1):  # each replica against itself without failure
        for who, replica in (("survivor", 0), ("dead", REPLICAS - 1)):
            ftf[f"{who}_window_loss"] = 1.0 - a.get(replica, 0) / b[replica]
    if "downtime_s" in ftf and span > 0 and "ft" in windows:
        ftf["downtime_share"] = min(ftf["downtime_s"], span) / span / REPLICAS
        steps = int(clean["useful_tokens"] / REPLICAS / _tokens_per_rank_step(runs["ft"]))
        step_s = max(windows["ft"][0]) / steps  # the no-failure run's time per step
        unsynced_s = (fail_at - cutoffs["ft-fail"]) * step_s
        ftf["dead_share"] = min(ftf["downtime_s"] + unsynced_s, span) / span / REPLICAS
    rf = out.get("restart-fail", {})
    if "wall_s" in rf:
        rf["redone_steps"] = fail_at - (fail_at // ckpt_every) * ckpt_every
    return out


def _summarise(per_repeat: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    keys = ("wall_s", "useful_tokens", "useful_tokens_per_s", "final_val_loss",
            "time_lost_s", "throughput_loss", "window_s", "window_tokens", "window_loss",
            "survivor_window_loss", "dead_window_loss", "downtime_s", "downtime_share",
            "dead_share", "redone_steps")
    results: dict[str, Any] = {"per_repeat": per_repeat}
    for s in SYSTEMS:
        rows = [rep.get(s, {}) for rep in per_repeat]
        results[s] = {k: spread(r.get(k) for r in rows) for k in keys
                      if any(k in r for r in rows)}
        errors = [r["error"] for r in rows if "error" in r]
        if errors:
            results[s]["errors"] = errors
    # The check, repeat by repeat: the loss against the dead replica's share.
    checks = [(rep["ft-fail"]["window_loss"], rep["ft-fail"]["dead_share"])
              for rep in per_repeat
              if "window_loss" in rep.get("ft-fail", {})
              and "dead_share" in rep.get("ft-fail", {})]
    results["ft_check"] = {"loss_minus_share": spread(a - b for a, b in checks),
                           "held": sum(a <= b for a, b in checks), "repeats": len(checks)}
    return results


# ---------------------------------------------------------------------------- output
def _get(results: dict[str, Any], s: str, k: str) -> dict[str, Any] | None:
    return results.get(s, {}).get(k)


def _spread(key: str, scale: float = 1.0):
    """A cell: the spread of ``key`` of the row's run (``row[0]``), scaled."""
    return lambda row: spread_cell(_get(row[1], row[0], key), scale)


TABLES = [
    Table("One failure", [
        ("run", None), ("wall time (s)", _spread("wall_s")),
        ("useful tokens", _spread("useful_tokens")),
        ("useful tokens/s", _spread("useful_tokens_per_s")),
        ("final val loss", _spread("final_val_loss"))],
        rows=lambda ctx: [(s, ctx.results) for s in SYSTEMS]),
    Table("Cost of the failure", [
        ("failure", lambda row: f"{row[0]} vs {row[2]}"),
        ("time lost (s)", _spread("time_lost_s")),
        ("useful throughput lost, step budget (%)", _spread("throughput_loss", 100)),
        ("useful tokens lost in the window W (%)", _spread("window_loss", 100)),
        ("dead replica's share of W (%)", _spread("dead_share", 100)),
        ("of which downtime only (%)", _spread("downtime_share", 100)),
        ("survivor's tokens lost in W (%)", _spread("survivor_window_loss", 100)),
        ("dead replica's tokens lost in W (%)", _spread("dead_window_loss", 100)),
        ("downtime (s)", _spread("downtime_s")), ("steps redone", _spread("redone_steps"))],
        rows=lambda ctx: [(failed, ctx.results, clean) for failed, clean in FAILURES]),
]


def _target(results: dict[str, Any]) -> dict[str, Any]:
    check = results["ft_check"]
    n, held = check["repeats"], check["held"]
    diff = check["loss_minus_share"]
    said = TEXT["target"]
    name = said["name"]
    if not n:
        return {"name": name, "met": None, "detail": said["none"]}
    survivor = _get(results, "ft-fail", "survivor_window_loss")
    return {"name": name, "met": diff["median"] <= 0,
            "detail": fill(said["detail"], diff=spread_cell(diff, 100), held=held, n=n,
                           survivor=spread_cell(survivor, 100))}


def _findings(results: dict[str, Any]) -> list[str]:
    out, said = [], TEXT["findings"]
    ft, rs = results.get("ft-fail", {}), results.get("restart-fail", {})
    if (ft.get("window_loss") or {}).get("n") and (rs.get("window_loss") or {}).get("n"):
        share = (ft.get("dead_share") or {}).get("median")
        out.append(fill(said["window"], ft=ft, rs=rs, share="." if share is None else
                        fill(said["share"], share=share)))
    survivor, dead = ft.get("survivor_window_loss"), ft.get("dead_window_loss")
    if (survivor or {}).get("n") and (dead or {}).get("n"):
        out.append(fill(said["per_replica"], survivor=survivor, dead=dead,
                        low=survivor["min"] * 100, high=survivor["max"] * 100))
    if ft.get("throughput_loss") and rs.get("throughput_loss"):
        out.append(fill(said["throughput"], ft=ft, rs=rs))
    clean_ft, clean_plain = results.get("ft", {}), results.get("plain", {})
    if clean_ft.get("useful_tokens_per_s") and clean_plain.get("useful_tokens_per_s"):
        ratio = (clean_ft["useful_tokens_per_s"]["median"]
                 / clean_plain["useful_tokens_per_s"]["median"])
        out.append(fill(said["clean"], ratio=ratio))
    if ft.get("time_lost_s") and rs.get("time_lost_s"):
        out.append(fill(said["time_lost"], ft=ft, rs=rs))
    return out


def _headline(results: dict[str, Any]) -> list[str]:
    ft, rs = results.get("ft-fail", {}), results.get("restart-fail", {})
    a, b = (ft.get("window_loss") or {}).get("median"), (rs.get("window_loss") or {}).get("median")
    if a is None or b is None:
        return []
    return [fill(TEXT["headline"], a=a, b=b)]


SCENARIO = Scenario(
    name="faults",
    description=TEXT["description"],
    unavailable=_unavailable, setup=_setup, measure=_results, tables=TABLES,
    notes=lambda ctx: fill(TEXT["notes"], ctx=ctx, replicas=REPLICAS, dead=REPLICAS - 1),
    runs=lambda ctx: [Job(repeat_label(s, rep), ctx.layers[s], title=f"{s} repeat {rep + 1}")
                      for rep in range(ctx.bench.repeats) for s in SYSTEMS],
    checks=lambda ctx: [(ctx.layers[s], None) for s in SYSTEMS],
    judge=lambda ctx: Verdict(targets=[_target(ctx.results)], findings=_findings(ctx.results),
                              headline=_headline(ctx.results)),
    settings=lambda ctx: {
        "replicas": REPLICAS, "steps": ctx.steps, "sync_interval": ctx.interval,
        "heartbeat_timeout_s": ctx.heartbeat_s, "heartbeat_interval_s": ctx.beat_every_s,
        "fail": f"replica {REPLICAS - 1} after step {ctx.fail_at}",
        "restart_delay_s": ctx.restart_s, "checkpoint_every": ctx.ckpt_every,
        "repeats": ctx.bench.repeats},
    methods=lambda ctx: list(SYSTEMS), repeats=True,
)
