"""Scenarios as declarations (issue 52 item 5): each converted scenario, executed by the one
runner on synthetic runs, writes the same record and plots as the scenario module did
before it became a declaration.

The golden records under ``tests/golden/bench/`` were written by the scenario modules as
they were before the conversion (``python -m tests.test_bench_declared`` regenerates them
from whatever the modules are now: only do that for a change of what a scenario measures).
The runs are synthetic: :class:`FakeBench` answers every training job with a run directory
made up from the job's options and label (deterministic: a hash of the label), so a
scenario's whole pipeline (its runs, measures, tables, targets, findings, notes, headline
and plots) runs in well under a second, without training anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from editrain.bench import run_scenario
from editrain.bench.runner import Bench
from editrain.bench.runs import Run
from editrain.config import load_config, to_dict

GOLDEN = Path(__file__).parent / "golden" / "bench"
SCENARIOS = ("optimizers", "spikes", "overlap", "convergence", "tune", "scale", "memory",
             "default", "faults", "stragglers", "bandwidth", "peers", "batch", "data", "plan")
"""The scenarios whose whole pipeline runs on synthetic runs (memory's spawned
measurement, default's read-back of the corpus split and data's corpora, builds and limit
are made up too, by :data:`STAND_INS`; plan's runs are written out, :data:`RUN_FILES`;
the others' smoke tests cover them)."""
RUN_FILES = ("plan",)
"""The scenarios that read their runs back from the run directories (``bench plan``
calibrates the planner on them): :class:`FakeBench` writes each made-up run's
``config.toml``, ``metrics.jsonl`` and rank logs there."""
VOLATILE = ("elapsed_s", "started", "machine", "argv", "command")
"""Record fields that depend on when and where it ran."""


def _noise(label: str, salt: str) -> float:
    """A number in [0, 1) fixed by the label (the same in every interpreter)."""
    return (zlib.crc32(f"{label}/{salt}".encode()) % 10_000) / 10_000


def fake_run(label: str, run_dir: Path, options: dict[str, Any]) -> Run:
    """A finished run made up from its options: step rows with syncs every H steps,
    evaluations every ``eval_every`` steps, per-rank rows and a summary."""
    cfg = load_config(None, options)
    sync = cfg.sync.resolve()
    steps, every = cfg.train.steps, max(1, cfg.train.eval_every)
    nproc, shard = cfg.dist.nproc, cfg.dist.shard_size
    interval = 1 if sync.method == "sync" else sync.local_sgd_sync_interval
    speed = 0.05 * (1 + _noise(label, "speed"))
    rate = 0.01 * (1 + _noise(label, "loss"))
    config = to_dict(cfg)
    config["sync"] = asdict(sync)
    run = Run(label=label, run_dir=run_dir, overrides=options, config=config,
              launch_s=steps * speed + 3.0)

    def val(step: int) -> float:
        return 9.0 - rate * step + 0.05 * _noise(label, f"val{step}")

    for step in range(1, steps + 1):
        row = {"step": step, "loss": val(step) + 0.1, "tokens": step * 1024,
               "wall_time_s": step * speed, "train_time_s": step * speed * 0.9,
               "step_time_s": speed * (1 + 0.2 * _noise(label, f"t{step}")),
               "compute_s": speed * 0.7}
        if step % interval == 0:
            k = step // interval - 1
            row["sync"] = {"step": step - 1 if run.layerwise else step, "sync": k,
                           "wait_s": speed * _noise(label, f"w{k}"),
                           "sync_time_s": speed * (1 + _noise(label, f"s{k}")),
                           "comm_time_s": speed * 0.5, "link_delay_s": speed * 0.1,
                           "bytes_sent": 4096 * (1 + k % 3),
                           "outlier": [[False, False], [k % 4 == 1, False]]}
        run.rows.append(row)
        if step % every == 0 or step == steps:
            run.evals.append({"step": step, "val_loss": val(step), "tokens": step * 1024,
                              "wall_time_s": step * speed, "val_tokens": 2048,
                              "eval_time_s": 0.25})
    run.evals.insert(0, {"step": 0, "val_loss": val(0), "tokens": 0, "wall_time_s": 0.0,
                         "val_tokens": 2048, "eval_time_s": 0.25})
    for rank in range(nproc):
        run.ranks[rank] = [{"rank": rank, "replica": rank // shard, "shard": rank % shard,
                            "step": s, "tokens": s * 512, "wall_time_s": s * speed,
                            "step_time_s": speed, "compute_s": speed * 0.7,
                            "sync_wait_s": 0.0} for s in range(1, steps + 1)]
    run.summary = {"final_val_loss": val(steps), "tokens": steps * 1024, "steps": steps,
                   "wall_time_s": steps * speed + 2.0, "train_time_s": steps * speed * 0.9,
                   "num_syncs": steps // interval, "val_tokens": 2048}
    if cfg.dist.fault_tolerance == "torchft":  # the --ft summary: each group's tokens
        run.summary["per_replica"] = {str(r): {"tokens_processed": steps * 512}
                                      for r in range(nproc // shard)}
    return run


def fake_memory(world: int, presets: list[str]) -> list[list[dict[str, Any]]]:
    """Every rank's rows of ``bench memory``'s measurement, made up: the outer state of
    ``variant`` on a rank is about a full copy over ``world``."""
    full = {"tiny": 1 << 20, "small": 5 << 20}
    return [[{"preset": p, "variant": v, "extra": {"cpu": full[p] // world + rank * 64},
              "extra_total": full[p] // world + rank * 64 + 8 * i,
              "local_param_bytes": full[p] // (2 * world), "model_param_bytes": full[p] // 2,
              "syncs": 1, "anchors_on_cpu": True}
             for p in presets for i, v in enumerate(("diloco", "edit", "edit+cpu_offload"))]
            for rank in range(world)]


def fake_peer_run(bench, label, options, replicas, threads, timeout_s, title, system="torchft"):
    """``bench peers``' run of torchft's (or the library's) workers, made up like a
    training run."""
    return bench.record_run(fake_run(label, bench.out_dir / "runs" / label, options), None,
                            title)


def fake_data_measures() -> dict[str, Any]:
    """``bench data``'s measurements made up (no corpus written, no tokenizer trained, no
    process started): each round's numbers fixed by the corpus size, the measure and the
    round; the first size's first own-BPE round fails, as a killed build would."""
    rounds: dict[str, int] = {}

    def measured(kind: str, corpus: Path, rate: float) -> dict[str, Any]:
        key = f"{kind}/{corpus.name}"
        k = rounds[key] = rounds.get(key, -1) + 1
        if key == "bpe/corpus-20000000" and k == 0:
            return {"ok": False, "error": "exit status -9: killed"}
        tokens = int(corpus.name.split("-")[1]) // 4
        seconds = tokens / rate * (1 + 0.2 * _noise(key, str(k)))
        out = {"ok": True, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "peak_rss": int(150e6 * (1 + 0.3 * _noise(key, f"m{k}"))),
               "cpu_seconds": 1.9 * seconds}
        if kind != "limit":
            out.update(documents=tokens // 900, build_seconds=0.9 * seconds,
                       train_tokens=tokens - tokens // 100, val_tokens=tokens // 100)
        return out

    return {"make_corpus": lambda root, size: size,
            "_seed_tokenizer": lambda corpus, out: out,
            "measure_limit": lambda tokenizer, corpus, workers: {
                **measured("limit", corpus, 4e5), "workers": workers},
            "measure_build": lambda corpus, cache, tokenizer: measured(
                "bpe" if tokenizer is None else "given", corpus, 3e5)}


STAND_INS = {"memory": lambda: {"_spawn": fake_memory},
             "peers": lambda: {"run_torchft": fake_peer_run},
             "default": lambda: {"_split_facts": lambda run: {"documents": 12,
                                                             "split": "made up",
                                                             "val_tokens": 2048}},
             "data": fake_data_measures}
"""Scenario -> the functions of its module that stand in for what it measures here (by
name; ``data``'s also take ``os.cpu_count`` and ``os.getloadavg`` as 2 CPUs at 0.5)."""


def write_fake_run(run: Run) -> None:
    """The files of ``run``'s directory that the planner's calibration reads."""
    from editrain.config.toml_io import dumps_toml

    (run.run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run.run_dir / "config.toml").write_text(dumps_toml(run.config))
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.rows))
    for rank, rows in run.ranks.items():
        (run.run_dir / "ranks" / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))


class FakeBench(Bench):
    """A :class:`Bench` whose training jobs are :func:`fake_run` answers."""

    def train(self, label, *layers, title=None, last=None):
        """Make up the run instead of training it."""
        options = self._run_options(self.out_dir / "runs" / label, layers, last)
        run = fake_run(label, self.out_dir / "runs" / label, options)
        if self.scenario in RUN_FILES:
            write_fake_run(run)
        return self.record_run(run, None, title)

    def train_together(self, jobs):
        """Make up each run of a group started together."""
        return [self.train(label, *layers, title=title, last=last)
                for label, layers, last, title in jobs]


def run_fake(name: str, out: Path) -> dict[str, Any]:
    """Scenario ``name`` at the quick size on synthetic runs: its record, less the fields
    that depend on the time and machine, and a digest of each plot."""
    import importlib

    from editrain.bench import runner

    module = importlib.import_module(f"editrain.bench.{name}")
    stand_ins = STAND_INS[name]() if name in STAND_INS else {}
    saved = runner.Bench, {attr: getattr(module, attr) for attr in stand_ins}
    machine = os.cpu_count, os.getloadavg
    runner.Bench = FakeBench  # run_scenario builds its Bench through the runner module
    for attr, stand_in in stand_ins.items():
        setattr(module, attr, stand_in)
    if name == "data":  # its worker count and the load it records
        os.cpu_count, os.getloadavg = (lambda: 2), (lambda: (0.5, 0.5, 0.5))
    try:
        record = run_scenario(name, quick=True, out_dir=str(out), extra=["--seeds", "2"])
    finally:
        runner.Bench = saved[0]
        for attr, original in saved[1].items():
            setattr(module, attr, original)
        os.cpu_count, os.getloadavg = machine
    for key in VOLATILE:
        record.pop(key, None)
    for r in record["runs"].values():
        r.pop("launch_s", None)
        r.pop("load_before", None)
        r.pop("run_dir", None)
    record["plot_digests"] = {p: hashlib.sha256((out / p).read_bytes()).hexdigest()
                              for p in record["plots"]}
    # plan's calibrations name their run directories, under this call's own folder
    return json.loads(json.dumps(record).replace(str(out), "<out>"))


@pytest.mark.parametrize("name", SCENARIOS)
def test_declared_scenario_writes_the_modules_record(name, tmp_path):
    """The declaration, executed by the one runner, gives the record (every number, table,
    finding, note, target, headline and run) and the plots the module gave."""
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    got = run_fake(name, tmp_path / name)
    plots_want, plots_got = want.pop("plot_digests"), got.pop("plot_digests")
    assert got == want
    assert plots_got == plots_want


def _tiny_scenario(**changes: Any):
    """A two-run scenario declared here: runs ``a`` then ``b`` (``b``'s seed from ``a``)."""
    from editrain.bench.scenario import Job, Scenario, Table, Verdict

    def runs(ctx):
        first = yield Job("a", ({"train": {"steps": 4, "eval_every": 2}},))
        yield Job("b", ({"train": {"steps": 4, "eval_every": 2,
                                   "seed": first.summary["steps"]}},), title="second")

    fields = dict(
        name="tiny-declared", description="two runs", setup=lambda bench: {"k": 3},
        runs=runs, planned=lambda ctx: 2,
        checks=lambda ctx: [(({"train": {"steps": 4}},), None)],
        measure=lambda ctx: {label: {"steps": r.summary["steps"], "k": ctx.k}
                             for label, r in ctx.runs.items()},
        tables=[Table("Steps", [("run", None), ("steps", "steps"),
                                ("k x steps", lambda row: row[1]["k"] * row[1]["steps"])])],
        judge=lambda ctx: Verdict(findings=[f"{len(ctx.runs)} runs"], headline=["h"]),
        notes=lambda ctx: ["n"], settings=lambda ctx: {"k": ctx.k})
    return Scenario(**(fields | changes))


def test_the_runner_executes_a_declaration(tmp_path):
    """execute() checks, runs the generator's jobs (sending each run back), measures,
    renders the declared table, judges and writes the record."""
    from editrain.bench.scenario import execute

    bench = FakeBench("tiny-declared", "tiny", tmp_path)
    record = execute(_tiny_scenario(), bench)
    assert list(record["runs"]) == ["a", "b"]
    assert record["runs"]["b"]["summary"]["steps"] == 4
    assert record["results"] == {"a": {"steps": 4, "k": 3}, "b": {"steps": 4, "k": 3}}
    assert record["tables"] == [{"title": "Steps", "markdown":
                                 "| run | steps | k x steps |\n|---|---:|---:|\n"
                                 "| a | 4 | 12 |\n| b | 4 | 12 |\n"}]
    assert record["findings"] == ["2 runs"] and record["headline"] == ["h"]
    assert record["notes"] == ["n"] and record["settings"] == {"k": 3}
    assert record["methods"] == ["a", "b"] and record["repeats"] is None
    assert json.loads((tmp_path / "results.json").read_text()) == record


def test_the_runner_records_a_skipped_declaration(tmp_path):
    """A scenario that cannot run here, or whose measure finds nothing, is recorded as
    skipped with the reason, and nothing else is judged."""
    from editrain.bench.scenario import execute

    unavailable = execute(_tiny_scenario(unavailable=lambda: "skipped: no peer"),
                          FakeBench("tiny-declared", "tiny", tmp_path / "u"))
    assert unavailable["skipped"] == "skipped: no peer" and not unavailable["runs"]
    assert unavailable["results"] == {"status": "skipped", "reason": "skipped: no peer"}
    assert unavailable["tables"][0]["markdown"].endswith(
        "| tiny-declared | skipped: no peer |\n")

    def nothing(ctx):
        ctx.skipped = "skipped: nothing to compare"
        return {"ran": len(ctx.runs)}

    empty = execute(_tiny_scenario(measure=nothing),
                    FakeBench("tiny-declared", "tiny", tmp_path / "e"))
    assert empty["skipped"] == "skipped: nothing to compare"
    assert empty["results"] == {"ran": 2} and empty["tables"] == [] and not empty["findings"]


COMMITTED = Path(__file__).parent.parent / "docs" / "benchmarks"
REGENERATED = sorted(d.name for d in COMMITTED.iterdir() if (d / "results.json").is_file()
                     and not d.name.startswith("bandwidth-real-link"))
"""Every committed result whose tables a declaration renders again from the record's numbers:
all but ``bandwidth-real-link*``, the records of ``scripts/real_link.sh``
(:mod:`editrain.bench.real_link`, below), which is no scenario. Records from before a
variant, system or reference was added regenerate with the rows they have."""
REAL_LINK = sorted(d.name for d in COMMITTED.glob("bandwidth-real-link*"))


def test_every_committed_record_has_its_tables_regenerated():
    """The two lists below are the directory's: every committed record is in one of them
    (a parametrized test over an empty list would pass without running)."""
    records = [d.name for d in COMMITTED.iterdir() if (d / "results.json").is_file()]
    assert len(records) >= 25
    assert sorted(REGENERATED + REAL_LINK) == sorted(records)


@pytest.mark.parametrize("name", REGENERATED)
def test_declared_tables_regenerate_the_committed_tables(name):
    """Each declared table, given the committed record's numbers (and the settings it
    reads), renders exactly the table committed in that record."""
    import importlib

    from editrain.bench.results import load_record
    from editrain.bench.scenario import Ctx, Table

    record = load_record(COMMITTED / name)
    settings = record["settings"]
    ctx = Ctx(results=record["results"], seeds=settings.get("seeds"),
              cases=tuple(settings.get("cases", ())), interval=settings.get("sync_interval"),
              periods=settings.get("aedit_sync_time_s") or [], presets=settings.get("presets"),
              names=settings.get("links"), sweep=settings.get("sweep") or {})
    if record["scenario"] == "tune":
        ctx.rows = {(r["factor"], r["level"]): r for r in record["results"]["rows"]}
    scenario = importlib.import_module(f"editrain.bench.{record['scenario']}").SCENARIO
    got = []
    for table in scenario.tables:
        made = table.render(ctx) if isinstance(table, Table) else table(ctx)
        got += made if isinstance(made, list) else [made]
    assert got == [(t["title"], t["markdown"]) for t in record["tables"]]


@pytest.mark.parametrize("name", REAL_LINK)
def test_real_link_tables_regenerate_the_committed_tables(name):
    """``scripts/real_link.sh``'s records too: the tables from the record's numbers are the
    committed ones (the first record, from before wall time and bytes were measured, has
    no columns for them)."""
    from editrain.bench.real_link import record_tables
    from editrain.bench.results import load_record

    record = load_record(COMMITTED / name)
    assert record_tables(record["results"], record["settings"]["rate"]) == [
        (t["title"], t["markdown"]) for t in record["tables"]]


def test_committed_pages_are_their_records():
    """Every committed ``table.md`` is the page its ``results.json`` renders to."""
    from editrain.bench.results import TABLE_FILE, load_record, render_page

    dirs = [d for d in sorted(COMMITTED.iterdir()) if (d / "results.json").is_file()]
    assert len(dirs) >= 20
    for d in dirs:
        assert render_page(load_record(d)) == (d / TABLE_FILE).read_text(), d.name


if __name__ == "__main__":  # regenerate the golden records from the modules as they are
    import tempfile

    GOLDEN.mkdir(parents=True, exist_ok=True)
    for scenario in sys.argv[1:] or SCENARIOS:
        with tempfile.TemporaryDirectory() as tmp:
            rec = run_fake(scenario, Path(tmp) / scenario)
        (GOLDEN / f"{scenario}.json").write_text(json.dumps(rec, indent=1, sort_keys=True)
                                                 + "\n")
        print(f"wrote {GOLDEN / scenario}.json")
