"""The README's headline table (``editrain bench report --readme``, bench/headline.py).

The committed README must hold exactly what the report writes from the committed results
under docs/benchmarks/, and every figure in the table is checked here, as rendered,
against the record it comes from (so re-running a benchmark means re-running the report
and updating the literals below). Synthetic records cover the choices the committed ones
do not exercise: flagged measurements, stale records, missing records, several runs of a
link, plots that are not there, a README without markers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from editrain.bench import SCENARIOS
from editrain.bench.headline import COLUMNS, headline_rows, readme_headline
from editrain.bench.report import (
    HEADLINE_END,
    HEADLINE_START,
    replace_headline,
    scenario_dirs,
    write_readme_headline,
)
from editrain.bench.results import load_record
from editrain.bench.stats import spread
from editrain.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"


def _committed() -> list[tuple[Path, dict[str, Any]]]:
    return [(d, load_record(d)) for d in scenario_dirs(BENCH, SCENARIOS)]


def _raw(name: str, *keys: str) -> Any:
    """A value of a committed ``results.json``, read straight from the file."""
    value = json.loads((BENCH / name / "results.json").read_text())
    for key in keys:
        value = value[key]
    return value


def _g(v: float) -> str:
    """4 significant digits, thousands grouped at 1000 and above (the report's rule)."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _spread(s: dict[str, Any]) -> str:
    return f"{_g(s['median'])} [{_g(s['min'])}-{_g(s['max'])}]"


def _pm(s: dict[str, Any]) -> str:
    return f"{s['mean']:.3f} +- {s['std']:.3f}"


def _diff(s: dict[str, Any]) -> str:
    return f"{s['mean']:+.3f} +- {s['std']:.3f}"


def test_readme_holds_the_report_of_the_committed_results():
    """README.md between its markers is exactly what `bench report --readme` writes."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count(HEADLINE_START) == 1 and readme.count(HEADLINE_END) == 1
    generated = readme_headline(_committed(), base=ROOT)
    assert replace_headline(readme, generated) == readme, (
        "README.md's headline is stale: run `editrain bench report --out docs/benchmarks "
        "--readme README.md`")
    assert generated.isascii()


# (editrain cell, peer cell) of every row, in order, as rendered from the committed results.
EXPECTED = [
    ("6.745 after 80 steps, 114 s end to end",
     "synchronous 6.413 (+5.2% for the default), 120 s end to end; 9.056 before training"),
    ("EDiT 5.640 +- 0.016", "DiLoCo 5.881 +- 0.085; synchronous 5.284 +- 0.008"),
    ("5.466 +- 0.013 (+3.4%)", "synchronous 5.284 +- 0.008"),
    ("streaming +0.092 +- 0.149; eager -0.168 +- 0.060; sparse 2-bit +0.354 +- 0.087",
     "EDiT 5.814 +- 0.053"),
    ("EDiT 0.01558", "DiLoCo 3.156"),
    ("A-EDiT (non-blocking) 0.9828 [0.9305-0.9917]x", "synchronous 0.5186 [0.5175-0.5384]x"),
    ("streaming EDiT 1.021 [0.7401-1.035]x",
     "DiLoCo 0.6357 [0.5484-0.6579]x; synchronous 0.05881 [0.05716-0.06187]x"),
    ("sparse 2-bit EDiT 0.9955 [0.8766-1.006]x", "DiLoCo 0.3708 [0.3671-0.4884]x"),
    ("sparse 2-bit EDiT 1.016 [0.9406-1.15]x / 0.8908 [0.7847-0.9337]x (2 runs)",
     "DiLoCo 0.178 [0.1684-0.2014]x / 0.159 [0.1498-0.1992]x"),
    ("sparse 2-bit EDiT 1.107 [0.9624-1.362]x", "int8 streaming EDiT 0.4493 [0.4193-0.4777]x"),
    ("eager-topk2 1.975 [1.914-2.035]x, loss 7.225 (all 2 repeats)",
     "torchft streaming DiLoCo, delay 4 1.058 [0.8189-1.296]x, loss 6.783 (all 2 repeats)"),
    ("eager-topk2 2.032 [1.2-2.863]x, loss 7.225 (all 2 repeats)",
     "torchft streaming DiLoCo, delay 4 0.9411 [0.8464-1.036]x, loss 6.783 (all 2 repeats)"),
    ("6.307 (all 5 repeats); 26,758 [25,665-28,208] tok/s",
     "6.307 (all 5 repeats); 25,523 [23,057-32,158] tok/s"),
    ("6.56 (all 5 repeats); 58,587 [54,685-60,393] tok/s",
     "6.56 (all 5 repeats); 47,647 [47,197-49,619] tok/s"),
    ("--ft 12.9% [-1.0% to 20.8%]", "restart from a checkpoint 39.3% [32.4% to 43.5%]"),
    ("594,518; 214.84 MiB", "the tokenizer's own `encode_batch` 766,113; 691.18 MiB"),
]


def test_rows_are_the_committed_results():
    """Each row's figures, as rendered, and the records they are read from; each literal is
    also derived here from the raw results.json, so a row reading the wrong key fails."""
    rows, _ = headline_rows(_committed())
    assert [(r.editrain, r.peer) for r in rows] == EXPECTED
    assert 10 <= len(rows) <= 16
    assert [[d.name for d in r.sources] for r in rows] == [
        ["default"], ["convergence-recipe"], ["convergence-recipe", "scale"],
        ["convergence-full-eager"], ["spikes"], ["stragglers"], ["bandwidth"],
        ["bandwidth-slow"], ["bandwidth-eager", "bandwidth-slow"], ["bandwidth-real-link"],
        ["bandwidth-real-link-peer-10mbit"], ["bandwidth-real-link-peer-1mbit"],
        ["peers"], ["peers-h4"], ["faults"], ["data"]]
    cells = [f"{r.editrain} | {r.peer} | {r.conditions}" for r in rows]
    default = _raw("default", "results", "default")
    assert f"{default['final_val_loss']:.3f}" in cells[0]
    assert f"{default['initial_val_loss']:.3f}" in cells[0]
    sync = _raw("default", "results", "sync")
    assert f"synchronous {sync['final_val_loss']:.3f}" in cells[0]
    assert f"({100 * (default['final_val_loss'] / sync['final_val_loss'] - 1):+.1f}% for" \
        in cells[0]
    assert f"{default['launch_s']:.0f} s end to end" in cells[0]
    assert f"{sync['launch_s']:.0f} s end to end" in cells[0]
    assert (f"({default['val_tokens']:,} tokens, {100 * default['split']['val_train_overlap']:.1f}%"
            " of its 32-token windows also in training)") in cells[0]
    conv = _raw("convergence-recipe", "results")
    for key in ("edit", "diloco", "sync"):
        assert _pm(conv[key]["final_val_loss"]) in cells[1], key
    assert _diff(conv["edit"]["paired_vs_diloco"]) in cells[1]
    assert _diff(conv["edit"]["paired_vs_sync"]) in cells[1]
    recipe = conv["edit-recipe"]
    assert _pm(recipe["final_val_loss"]) in cells[2] and _diff(recipe["paired_vs_sync"]) in \
        cells[2]
    assert f"({100 * recipe['paired_vs_sync']['mean'] / conv['sync']['final_val_loss']['mean']:+.1f}%)" \
        in cells[2]
    for shape in _raw("scale", "results", "shapes"):
        assert f"{100 * shape['relative_gap']:+.1f}% at {shape['params'] / 1e6:.1f}M" in cells[2]
    eager = _raw("convergence-full-eager", "results")
    for key in ("edit-streaming", "edit-eager", "edit-sparse"):
        assert _diff(eager[key]["paired_vs_edit"]) in cells[3], key
    assert _pm(eager["edit"]["final_val_loss"]) in cells[3]
    spikes = _raw("spikes", "results")
    assert f"EDiT {_g(spikes['edit']['peak_increase'])}" in cells[4]
    assert f"DiLoCo {_g(spikes['diloco']['peak_increase'])}" in cells[4]
    strag = _raw("stragglers", "results", "straggler")
    assert _spread(strag["aedit-nb"]["fraction_of_limit"]) in cells[5]
    assert _spread(strag["sync"]["fraction_of_limit"]) in cells[5]
    bw = _raw("bandwidth", "results")
    for key in ("edit-streaming", "diloco", "sync"):
        assert _spread(bw[key]["5MB/s+5ms"]["vs_unlimited"]) in cells[6], key
    slow, eager_bw = _raw("bandwidth-slow", "results"), _raw("bandwidth-eager", "results")
    for key in ("edit-sparse", "diloco"):
        assert _spread(slow[key]["1MB/s+50ms"]["vs_unlimited"]) in cells[7], key
        assert (f"{_spread(eager_bw[key]['0.25MB/s+50ms']['vs_unlimited'])}x / "
                f"{_spread(slow[key]['0.25MB/s+50ms']['vs_unlimited'])}x") in cells[8], key
    real = _raw("bandwidth-real-link", "results")
    for key in ("sparse-topk2", "streaming-int8"):
        assert _spread(real[key]["kept"]) in cells[9], key
    for i, rate in ((10, "10mbit"), (11, "1mbit")):
        peer = _raw(f"bandwidth-real-link-peer-{rate}", "results")
        for key in ("eager-topk2", "torchft-d4"):
            assert _spread(peer[key]["kept"]) in cells[i], key
            assert _g(peer[key][rate]["final_val_loss"]["median"]) in cells[i], key
        assert rows[i].what.startswith(f"Throughput kept on a real {rate} link")
    for i, name in ((12, "peers"), (13, "peers-h4")):
        res = _raw(name, "results")
        assert rows[i].what.endswith(
            f"H = {_raw(name, 'settings', 'sync_interval')}: validation loss; tokens/s")
        assert rows[i].editrain.endswith(f"{_spread(res['diloco']['tokens_per_s'])} tok/s")
        assert rows[i].peer.endswith(f"{_spread(res['torchft-diloco']['tokens_per_s'])} tok/s")
        assert rows[i].editrain.startswith(_g(res["diloco"]["final_val_loss"]["median"]))
        assert _raw(name, "targets")[0]["detail"] in cells[i]
    faults = _raw("faults", "results")
    assert f"--ft {100 * faults['ft-fail']['window_loss']['median']:.1f}%" in cells[14]
    assert f"checkpoint {100 * faults['restart-fail']['window_loss']['median']:.1f}%" in \
        cells[14]
    point = max(_raw("data", "results", "points"), key=lambda q: q["bytes"])
    assert rows[15].what.endswith(f"of {point['bytes'] / 1e6:.0f} MB of Python: tokens/s, "
                                  "peak memory")
    assert rows[15].editrain.startswith(f"{point['given_tokenizer']['tokens_per_s']:,.0f}; "
                                        f"{point['given_tokenizer']['peak_rss'] / 2**20:.2f} MiB")
    assert f"{point['limit']['tokens_per_s']:,.0f}; {point['limit']['peak_rss'] / 2**20:.2f}" \
        in rows[15].peer
    assert f"takes {_g(point['given_tokenizer']['time_vs_limit'])}x the limit's" in cells[15]


def test_table_shape_links_and_plots():
    """Four columns; every row links the results.json files it names; the three plots
    are the committed ones, linked relative to the README."""
    text = readme_headline(_committed(), base=ROOT)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    body = table[1:1 + len(EXPECTED)]
    assert all(line.count(" | ") == 3 for line in body)
    for line in body:
        for link in line.split("](")[1:]:
            path = ROOT / link.split(")")[0]
            assert path.name == "results.json" and path.is_file(), link
    shown = [part.split(")")[0] for part in text.split("](") if part.split(")")[0].endswith(
        ".png")]
    assert shown == ["docs/benchmarks/spikes/val_loss_spikes.png",
                     "docs/benchmarks/stragglers/fraction_of_limit.png",
                     "docs/benchmarks/bandwidth/throughput_vs_link.png"]
    assert all((ROOT / p).is_file() for p in shown)


def _rec(scenario: str, results: dict, mode: str = "quick", **extra: Any) -> dict:
    return {"scenario": scenario, "format": 2, "mode": mode, "results": results, **extra}


def test_synthetic_records(tmp_path):
    """Flagged measurements say so; stale and skipped records are ignored; rows without
    their record are left out; every run of a slow link is shown; peers rows go largest
    H first; nothing to show is a clear error."""
    d = tmp_path
    strag = _rec("stragglers", {"straggler": {
        "errors": [], "aedit": {"fraction_of_limit": spread([0.9, 0.95, 0.97])},
        "sync": {"fraction_of_limit": spread([0.5, 0.6, 0.55])}}}, repeats=3)
    rows, used = headline_rows([(d / "stragglers", strag)])
    assert [(r.editrain, r.peer) for r in rows] == [
        ("A-EDiT 0.95 [0.9-0.97]x", "synchronous 0.55 [0.5-0.6]x")]
    assert "median [min-max] of 3 repeats" in rows[0].conditions and used[0][1] is strag
    strag["results"]["straggler"]["errors"] = ["aedit repeat 1: 1.04x the measured limit"]
    rows, _ = headline_rows([(d / "stragglers", strag)])
    assert rows[0].editrain == "measurement error" and "0.95" not in rows[0].conditions
    stale = dict(_rec("spikes", {"diloco": {"peak_increase": 2.0},
                                 "edit": {"peak_increase": 0.1}}), format=1)
    with pytest.raises(ConfigError, match="yields a headline"):
        readme_headline([(d / "spikes", stale)])
    skipped = _rec("spikes", stale["results"], skipped="skipped: no torchft")
    assert headline_rows([(d / "spikes", skipped)])[0] == []

    def link(m: float) -> dict:
        return {"vs_unlimited": spread([m])}
    slow = [_rec("bandwidth", {"edit-sparse": {"0.25MB/s+50ms": link(x)},
                               "diloco": {"0.25MB/s+50ms": link(y)}},
                 settings={"sync_interval": 32}) for x, y in ((0.93, 0.2), (1.01, 0.18))]
    rows, _ = headline_rows([(d / "bandwidth-a", slow[0]), (d / "bandwidth-b", slow[1])])
    assert [(r.editrain, r.peer) for r in rows] == [
        ("sparse 2-bit EDiT 0.93x / 1.01x (2 runs)", "DiLoCo 0.2x / 0.18x")]
    assert [s.name for s in rows[0].sources] == ["bandwidth-a", "bandwidth-b"]

    def peers(h: int, theirs: float, ours: float) -> dict:
        loss = spread([6.0, 6.0])
        return _rec("peers", {"torchft-diloco": {"tokens_per_s": spread([theirs]),
                                                 "final_val_loss": loss},
                              "diloco": {"tokens_per_s": spread([ours]),
                                         "final_val_loss": loss}},
                    settings={"sync_interval": h},
                    targets=[{"met": True, "detail": "largest relative difference 4e-09"}])
    rows, _ = headline_rows([(d / "peers-h4", peers(4, 100.0, 123.0)),
                             (d / "peers", peers(16, 100.0, 95.0))])
    assert [r.what.split(", ")[1] for r in rows] == ["H = 16: validation loss; tokens/s",
                                                     "H = 4: validation loss; tokens/s"]
    assert [(r.editrain, r.peer) for r in rows] == [
        ("6 (all 2 repeats); 95 tok/s", "6 (all 2 repeats); 100 tok/s"),
        ("6 (all 2 repeats); 123 tok/s", "6 (all 2 repeats); 100 tok/s")]
    assert rows[0].conditions.endswith("loss largest relative difference 4e-09")


def test_plots_and_links_follow_the_files(tmp_path):
    """A plot appears only when its record lists it and the file is there; links are
    relative to the README's directory."""
    spikes = _rec("spikes", {"diloco": {"peak_increase": 2.36}, "edit": {"peak_increase": 0.016}},
                  settings={"scale": 20.0, "corrupt_syncs": [8, 12, 16], "steps": 100,
                            "sync_interval": 5}, plots=["val_loss_spikes.png"],
                  machine={"usable_cpus": 2})
    results = tmp_path / "bench" / "spikes"
    results.mkdir(parents=True)
    text = readme_headline([(results, spikes)], base=tmp_path)
    assert "![" not in text and "| EDiT 0.016 | DiLoCo 2.36 |" in text
    assert "x20 at 3 syncs" in text and "([spikes](bench/spikes/results.json))" in text
    assert text.startswith("Measured on one 2-core CPU machine, quick size")
    (results / "val_loss_spikes.png").write_bytes(b"png")
    text = readme_headline([(results, spikes)], base=tmp_path / "sub")
    assert text.endswith("| ![Validation loss with a corrupted replica]"
                         "(../bench/spikes/val_loss_spikes.png) |")


def test_cli_writes_the_table_between_the_markers(tmp_path):
    """`bench report --readme` replaces only what is between the markers; a README
    without markers fails before anything is written."""
    from editrain.cli import main

    root = tmp_path / "results" / "spikes"
    root.mkdir(parents=True)
    (root / "results.json").write_text(json.dumps(_rec(
        "spikes", {"diloco": {"peak_increase": 3.0}, "edit": {"peak_increase": 0.02}},
        settings={"scale": 20.0, "corrupt_syncs": [8], "steps": 100, "sync_interval": 5},
        command="editrain bench spikes --quick")))
    bare, page = tmp_path / "BARE.md", tmp_path / "page.md"
    bare.write_text("no markers here\n")
    assert main(["bench", "report", "--out", str(tmp_path / "results"), "--path", str(page),
                 "--readme", str(bare)]) == 2
    assert bare.read_text() == "no markers here\n" and not page.exists()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{HEADLINE_START}\nold 9.99\n{HEADLINE_END}\n\nend\n")
    assert main(["bench", "report", "--out", str(tmp_path / "results"), "--path", str(page),
                 "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# x\n\n{HEADLINE_START}\nMeasured on one ") and "old 9.99" not in text
    assert text.endswith(f"([spikes](results/spikes/results.json)) |\n{HEADLINE_END}\n\nend\n")
    assert "| EDiT 0.02 | DiLoCo 3 |" in text
    again = write_readme_headline(readme, [root])
    assert readme.read_text() == text and again in text
