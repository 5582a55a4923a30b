"""Strict JSON in every file of a run (issue #30): a NaN or infinite number is written as
null, never as the bare ``NaN`` / ``Infinity`` that Python's ``json`` writes by default and
that strict parsers (JavaScript, jq, most JSON libraries) reject."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from editrain.metrics import MetricsWriter, RankLog, to_json


def strict_loads(text: str):
    """``json.loads`` that fails on ``NaN``, ``Infinity`` and ``-Infinity``."""
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_to_json_writes_non_finite_numbers_as_null():
    obj = {"loss": float("nan"), "rows": [1.5, float("inf"), (float("-inf"), 2)],
           "nested": {"x": {"y": float("nan")}}, "ok": True, "n": 3, "s": "NaN"}
    text = to_json(obj, indent=1)
    assert strict_loads(text) == {"loss": None, "rows": [1.5, None, [None, 2]],
                                  "nested": {"x": {"y": None}}, "ok": True, "n": 3, "s": "NaN"}
    assert to_json({"a": 1}, separators=(",", ":")) == '{"a":1}'


def test_to_json_refuses_what_it_cannot_clean():
    class Number(float):  # a float subclass encoded as its own repr: still cleaned
        pass

    assert to_json([Number("nan")]) == "[null]"
    with pytest.raises(TypeError):
        to_json({"x": object()})


def test_metrics_and_rank_rows_are_strict_json(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"step": 1, "loss": float("nan"), "val_loss": float("inf"), "lr": 0.1})
    writer.close()
    log = RankLog(tmp_path, rank=0)
    log.write({"step": 1, "step_time_s": float("nan")})
    log.close()
    rows = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": None, "val_loss": None, "lr": 0.1}]
    ranks = (tmp_path / "ranks" / "rank0.jsonl").read_text().splitlines()
    assert [strict_loads(line) for line in ranks] == [{"step": 1, "step_time_s": None}]


def test_fault_tolerant_summary_is_strict_json(tmp_path: Path):
    """``editrain train --ft``'s summary.json, here with no finished replica group (its
    final loss is NaN) and with one whose own summary holds a null loss."""
    from editrain.launch.ft import summarise_groups

    events = [{"event": "died", "replica": 0, "time_s": float("nan")}]
    summary = summarise_groups(tmp_path, 2, events, float("inf"))
    text = (tmp_path / "summary.json").read_text()
    data = strict_loads(text)
    assert data["final_val_loss"] is None and data["wall_time_s"] is None
    assert data["events"][0]["time_s"] is None
    assert summary["finished_replicas"] == 0

    (tmp_path / "replica1").mkdir()
    (tmp_path / "replica1" / "summary.json").write_text(to_json(
        {"steps": 4, "tokens_processed": 8, "final_val_loss": float("nan")}))
    summarise_groups(tmp_path, 2, [], 1.0)
    data = strict_loads((tmp_path / "summary.json").read_text())
    assert data["final_val_loss"] is None and data["steps"] == 4


@pytest.mark.parametrize("step", ["5", True, -1, float("nan"), float("inf"), [5], None])
def test_a_rank_row_whose_step_is_no_step_is_no_measurement(tmp_path, step):
    """A rank file's row whose ``step`` is no number >= 0 is left out, as
    ``current_rows`` leaves out such a row of ``metrics.jsonl``; before, a string step
    ended in a TypeError when the rows were ordered, and a ``rank`` of ``"1"`` or ``true``
    was taken as rank 1 by ``int()``."""
    from editrain.metrics import current_rows, read_rank_steps

    (tmp_path / "ranks").mkdir()
    rows = [{"rank": 0, "step": s, "wall_time_s": float(s)} for s in (1, 2, 3)]
    hostile = [rows[0], {"rank": 0, "step": step, "wall_time_s": 9.0}, *rows[1:]]
    (tmp_path / "ranks" / "rank0.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in hostile))
    assert read_rank_steps(tmp_path) == {0: rows}
    assert current_rows([{**r, "loss": 1.0} for r in hostile]) == \
        [{**r, "loss": 1.0} for r in rows]


@pytest.mark.parametrize("rank", ["1", True, 1.5, -1])
def test_a_rank_rows_rank_that_is_no_rank_leaves_the_files_own(tmp_path, rank):
    from editrain.metrics import read_rank_steps

    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank0.jsonl").write_text(
        json.dumps({"rank": rank, "step": 1, "wall_time_s": 1.0}) + "\n")
    assert list(read_rank_steps(tmp_path)) == [0]
