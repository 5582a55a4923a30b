"""Benchmark scenarios: a smoke test per scenario at the tiny size (every method produces
numbers, the result files exist), plus the pure helpers (throughput window, argument
splitting, the report) on synthetic data.

The smoke tests start real training jobs (a dozen or so steps each); the timing numbers
they produce mean nothing on a busy machine, only their presence is checked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from editrain.bench import SCENARIOS, run_scenario
from editrain.bench.common import (
    Bench,
    Run,
    md_table,
    merge,
    split_extra,
    steady_throughput,
)
from editrain.config import ConfigError


def _num(v) -> bool:
    """A finite number (not a bool)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One data cache for every smoke test (the tokenizer is trained once)."""
    return str(tmp_path_factory.mktemp("bench-cache"))


def _run(name: str, tmp_path: Path, cache: str) -> tuple[dict, Path]:
    """Run a scenario at the tiny size; check the files every scenario writes."""
    out = tmp_path / name
    record = run_scenario(name, quick=True, out_dir=str(out),
                          extra=["--data.cache_dir", cache], tiny=True)
    assert (out / "results.json").is_file() and (out / "table.md").is_file()
    saved = json.loads((out / "results.json").read_text())
    assert saved["scenario"] == name and saved["mode"] == "tiny"
    assert saved["machine"]["cpu_count"] >= 1 and saved["machine"]["torch"]
    assert saved["command"].startswith(f"editrain bench {name} --quick")
    assert "--tiny" in saved["command"]
    table = (out / "table.md").read_text()
    assert "Command: `editrain bench" in table and "Machine:" in table
    for plot in saved["plots"]:
        assert (out / plot).is_file() and (out / plot).stat().st_size > 0
    assert record["results"] == saved["results"] or record["scenario"] == name
    return saved, out


def _runs_ok(saved: dict) -> None:
    """Every training run of the scenario finished."""
    failed = {k: v["error"] for k, v in saved["runs"].items() if not v["ok"]}
    assert not failed, failed


# ---------------------------------------------------------------------------- smoke tests
@pytest.mark.timeout(600)
def test_optimizers_smoke(tmp_path, cache):
    """AdamW, AGD and AdamW + WSAM each end with a finite validation loss."""
    saved, _ = _run("optimizers", tmp_path, cache)
    _runs_ok(saved)
    assert saved["methods"] == ["adamw", "agd", "adamw+wsam"]
    for m in saved["methods"]:
        assert _num(saved["results"][m]["final_val_loss"]["mean"]), m


@pytest.mark.timeout(600)
def test_convergence_smoke(tmp_path, cache):
    """Every method has a final validation loss and a curve."""
    saved, out = _run("convergence", tmp_path, cache)
    _runs_ok(saved)
    assert saved["methods"] == ["sync", "post_local_sgd", "diloco", "edit", "aedit"]
    for m in saved["methods"]:
        res = saved["results"][m]
        assert _num(res["final_val_loss"]["mean"]), m
        assert res["final_val_loss"]["n"] == 1 and res["curve_tokens"], m
    assert saved["settings"]["seeds"] == 1
    assert saved["targets"] and "met" in saved["targets"][0]


@pytest.mark.timeout(600)
def test_bandwidth_smoke(tmp_path, cache):
    """Every method has a throughput at every link; local SGD a time split."""
    saved, _ = _run("bandwidth", tmp_path, cache)
    _runs_ok(saved)
    res = saved["results"]
    assert _num(res["ceiling"]["tokens_per_s"]) and res["ceiling"]["tokens_per_s"] > 0
    for m in ("sync", "diloco", "edit"):
        assert set(res[m]) == set(saved["settings"]["links"])
        for link, e in res[m].items():
            assert _num(e["tokens_per_s"]) and e["tokens_per_s"] > 0, (m, link)
            assert _num(e["vs_ceiling"]), (m, link)
    for m in ("diloco", "edit"):  # local SGD: the sync metrics are split out
        for e in res[m].values():
            assert _num(e["comm_time_s_per_step"]) and _num(e["wait_s_per_step"])


@pytest.mark.timeout(600)
def test_stragglers_smoke(tmp_path, cache):
    """Every method has a throughput, a fraction of the limit and a loss."""
    saved, _ = _run("stragglers", tmp_path, cache)
    _runs_ok(saved)
    for case in saved["settings"]["cases"]:
        e = saved["results"][case]
        assert _num(e["limit"]["tokens_per_s"])
        for m in ("sync", "edit", "aedit"):
            assert _num(e[m]["tokens_per_s"]) and _num(e[m]["fraction_of_limit"]), (case, m)
            assert _num(e[m]["final_val_loss"]), (case, m)
        assert sum(e["aedit"]["replica_steps"]) > 0


@pytest.mark.timeout(600)
def test_spikes_smoke(tmp_path, cache):
    """Every variant has a peak increase and a jump; the detector saw the sync."""
    saved, _ = _run("spikes", tmp_path, cache)
    _runs_ok(saved)
    for v in saved["methods"]:
        e = saved["results"][v]
        assert _num(e["peak_increase"]) and _num(e["final_val_loss"]), v
        assert _num(e["max_jump"]), v
    # edit's detector looked at the corrupted replica at the corrupted sync
    assert saved["results"]["edit"]["corrupted_units"] > 0


@pytest.mark.timeout(600)
def test_memory_smoke(tmp_path):
    """The outer state per rank is twice the parameter shard and full copy / S."""
    saved, _ = _run("memory", tmp_path, str(tmp_path / "unused-cache"))
    res = saved["results"]["tiny"]
    full = res["full_copy_bytes"]
    assert full > 0
    for s, e in res["by_shard"].items():
        assert e["edit_bytes_per_rank"] > 0 and e["edit_cpu_offload_bytes_per_rank"] > 0
        # anchor + Nesterov momentum: twice the parameter shard, 1/S of the full copy
        assert e["edit_bytes_per_rank"] == 2 * e["local_param_bytes"]
        assert abs(e["edit_bytes_per_rank"] * int(s) / full - 1) < 0.05
    assert saved["targets"][0]["met"] is True


@pytest.mark.timeout(600)
def test_overlap_smoke(tmp_path, cache):
    """Every run has per-sync medians."""
    saved, _ = _run("overlap", tmp_path, cache)
    _runs_ok(saved)
    for label in saved["methods"]:
        e = saved["results"][label]
        assert _num(e["median_wait_s"]) and _num(e["median_sync_time_s"]), label
        assert e["syncs"] >= 1, label
    assert saved["settings"]["units"]["count"] == 3  # root + 2 blocks of the tiny preset


def test_peers_without_torchft(tmp_path, monkeypatch):
    """Without torchft the scenario is skipped, not failed."""
    import editrain.bench.peers as peers

    monkeypatch.setattr(peers, "torchft_version", lambda: None)
    saved, _ = _run("peers", tmp_path, str(tmp_path))
    assert saved["skipped"].startswith("skipped: torchft not installed")
    assert saved["results"]["torchft-diloco"]["status"] == "skipped"


# ---------------------------------------------------------------------------- helpers
def _rows(step_s: float, syncs: dict[int, tuple[int, float]], steps: int,
          tokens_per_step: int = 100) -> list[dict]:
    """Synthetic rows: ``syncs`` maps row step -> (entry step, wait seconds)."""
    rows, wall = [], 0.0
    for step in range(1, steps + 1):
        wait = syncs.get(step, (0, 0.0))[1]
        wall += step_s + wait
        row = {"step": step, "tokens": step * tokens_per_step, "loss": 1.0,
               "wall_time_s": wall, "step_time_s": step_s + wait, "compute_s": step_s}
        if step in syncs:
            row["sync"] = {"step": syncs[step][0], "wait_s": wait, "comm_time_s": wait,
                           "link_delay_s": 0.0, "sync_time_s": wait}
        rows.append(row)
    return rows


def test_steady_throughput_counts_whole_sync_cycles():
    """The throughput window holds whole sync cycles; finish() syncs are left out."""
    # Blocking sync every 4 steps (entry step == row step), 0.2 s each, 0.1 s per step.
    blocking = Run("d", Path("."), {}, rows=_rows(0.1, {s: (s, 0.2) for s in (4, 8, 12, 16)},
                                                  16), config={"sync": {"layerwise": False}})
    w = steady_throughput(blocking, skip=2)
    assert (w["from_step"], w["to_step"], w["syncs"]) == (4, 16, 3)
    assert w["tokens_per_s"] == pytest.approx(100 / 0.15)
    # Layer-wise: the sync armed at step 4k runs in step 4k + 1; the one at step 16 is run
    # by finish() after the last row (entry step == row step) and must not count.
    rows = _rows(0.1, {5: (4, 0.2), 9: (8, 0.2), 13: (12, 0.2), 16: (16, 0.2)}, 16)
    rows[-1]["wall_time_s"] -= 0.2  # finish() runs after the row's clock stopped
    layerwise = Run("e", Path("."), {}, rows=rows, config={"sync": {"layerwise": True}})
    assert [i for i, _ in layerwise.timed_syncs()] == [4, 8, 12]
    w = steady_throughput(layerwise, skip=2)
    assert (w["from_step"], w["to_step"], w["syncs"]) == (5, 13, 2)
    assert w["tokens_per_s"] == pytest.approx(100 / 0.15)
    assert w["wait_s_per_step"] == pytest.approx(0.05)
    # No syncs: from step `skip` to the end.
    plain = Run("s", Path("."), {}, rows=_rows(0.1, {}, 10), config={})
    w = steady_throughput(plain, skip=3)
    assert (w["from_step"], w["to_step"]) == (3, 10)
    assert w["tokens_per_s"] == pytest.approx(1000.0)


def test_split_extra_and_merge():
    """Bench flags and training options are told apart; merge is deep."""
    flags, over = split_extra(["--tiny", "--seeds", "3", "--model.preset=small",
                               "--path", "x.md", "--train.steps", "5"])
    assert flags == {"tiny": True, "seeds": 3, "path": "x.md"}
    assert over == {"model": {"preset": "small"}, "train": {"steps": 5}}
    with pytest.raises(ConfigError):
        split_extra(["stray"])
    with pytest.raises(ConfigError):
        split_extra(["--seeds", "0"])
    assert merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}, None) == {"a": {"b": 1, "c": 3}}


def test_unknown_scenario_and_bad_option_fail_before_running(tmp_path):
    """Bad input is a clean error before any run starts."""
    from editrain.cli import main

    assert main(["bench", "nonsense", "--out", str(tmp_path / "x")]) == 2
    assert main(["bench", "convergence", "--tiny", "--out", str(tmp_path / "y"),
                 "--train.no_such_option", "1"]) == 2
    assert not (tmp_path / "y" / "runs").exists()
    assert set(SCENARIOS) >= {"convergence", "bandwidth", "stragglers", "spikes", "memory",
                              "overlap", "peers"}


def test_report_assembles_tables(tmp_path):
    """The report holds every section, its command, targets and plots."""
    from editrain.bench.report import write_benchmarks_md

    dirs = []
    for name, met in (("memory", True), ("spikes", False)):
        bench = Bench(name, "quick", tmp_path / name, command=f"editrain bench {name} --quick")
        (tmp_path / name / "plot.png").write_bytes(b"png")
        bench.finish(settings={}, methods=["edit"], results={"edit": {"x": 1.0}},
                     tables=[("Numbers", md_table(["method", "x"], [["edit", 1.0]]))],
                     targets=[{"name": f"{name} target", "met": met, "detail": "d"}],
                     findings=[f"{name} finding"], notes=["how"],
                     plots=[tmp_path / name / "plot.png"], description=f"{name} measures.")
        dirs.append(tmp_path / name)
    path = write_benchmarks_md(dirs, path=tmp_path / "docs" / "benchmarks.md")
    text = path.read_text()
    assert "## memory" in text and "## spikes" in text
    assert "`editrain bench spikes --quick`" in text
    assert "Target not met: spikes target" in text
    assert "memory finding" in text and "| edit | 1 |" in text
    assert "](../memory/plot.png)" in text  # image links point at the results directory
    assert text.isascii()
