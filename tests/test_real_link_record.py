"""The record of scripts/real_link.sh (editrain.bench.real_link) on synthetic run directories:
tokens/s kept, wall time taken (evaluations included) and bytes by cause on the shaped link."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from editrain.bench import real_link


def _run(path: Path, seconds_per_step: float, wall: float, sent: dict[str, int]) -> None:
    """A finished 8-step run: 1,000 tokens a step, a sync every 2 steps."""
    path.mkdir(parents=True)
    rows = []
    for step in range(1, 9):
        row = {"step": step, "tokens": 1000 * step, "loss": 5.0,
               "train_time_s": seconds_per_step * step, "wall_time_s": seconds_per_step * step}
        if step % 2 == 0:
            row["sync"] = {"sync": step // 2, "step": step, "wait_s": 0.0, "comm_time_s": 0.1,
                           "link_delay_s": 0.0, "sync_time_s": 0.1}
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({
        "steps": 8, "wall_time_s": wall, "cross_replica_bytes": sent}))


def test_the_record_has_speed_wall_time_and_bytes(tmp_path):
    sent = {"rounds": 1000, "evaluation": 32, "total": 1032}
    for rep, (fast, slow, wall_fast, wall_slow) in enumerate(
            [(0.1, 0.1, 10.0, 11.0), (0.1, 0.125, 10.0, 12.6)], start=1):
        _run(tmp_path / f"eager-topk2-unshaped-r{rep}", fast, wall_fast, sent)
        _run(tmp_path / f"eager-topk2-1mbit-r{rep}", slow, wall_slow, sent)
    assert real_link.main([str(tmp_path), "--rate", "1mbit", "--repeats", "2",
                           "--settings", "eager-topk2", "--preset", "small", "--H", "10",
                           "--steps", "8", "--eval-every", "4"]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    got = record["results"]["eager-topk2"]
    assert got["kept"]["values"] == pytest.approx([1.0, 0.8])
    assert got["wall_ratio"]["values"] == pytest.approx([1.1, 1.26])
    assert got["cross_replica_bytes"]["total"]["median"] == 1032
    assert "PRESET=small H=10 STEPS=8 EVAL_EVERY=4 RATE=1mbit" in record["command"]
    met = {t["name"].split(" ")[1]: t["met"] for t in record["targets"]}
    assert met == {"keeps": False, "takes": True}  # 0.9x kept; 1.18x the wall time
    table = (tmp_path / "table.md").read_text()
    assert "wall x unshaped" in table and "by cause" in table
    assert "small preset" in table and "H = 10, 8 steps, an evaluation every 4" in table
