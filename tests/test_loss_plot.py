"""The loss plots' data (editrain.metrics): the smoothed training curve (TensorBoard's
debiased moving average) and the sync marks, exact values; and the plot drawn from a run."""

from __future__ import annotations

import json
import math

import pytest

from editrain.metrics import SMOOTHING, loss_series, plot_runs, smooth_ema

# (pytest.approx's default on a few float64 operations: tests/README.md class 6)


def test_ema_is_debiased_from_the_first_point():
    # m = 0.5, 1.25, 2.125 divided by 1 - 0.5 ** n = 0.5, 0.75, 0.875
    assert smooth_ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 5 / 3, 17 / 7])
    assert smooth_ema([4.0] * 6, SMOOTHING) == pytest.approx([4.0] * 6)  # no pull to 0
    assert smooth_ema([7.0, 6.0, 8.0], 0.0) == [7.0, 6.0, 8.0]
    assert smooth_ema([], 0.9) == []


def test_ema_follows_tensorboards_weight():
    # weight 0.9: the second point is (0.09 * 6 + 0.1 * 7) / 0.19, not 0.1 * 7 + 0.9 * 6
    got = smooth_ema([6.0, 7.0], 0.9)
    assert got == pytest.approx([6.0, (0.9 * 0.1 * 6.0 + 0.1 * 7.0) / (1 - 0.9 ** 2)])
    assert got[1] == pytest.approx(6.0 + 0.1 / 0.19)


def test_a_non_finite_loss_is_drawn_as_is_and_skipped_by_the_average():
    got = smooth_ema([1.0, math.nan, 3.0], 0.5)
    assert got[0] == 1.0 and math.isnan(got[1])
    assert got[2] == pytest.approx((0.25 + 1.5) / 0.75)


@pytest.mark.parametrize("weight", [1.0, -0.1])
def test_a_weight_outside_0_1_is_refused(weight):
    with pytest.raises(ValueError, match=r"smoothing weight must be in \[0, 1\)"):
        smooth_ema([1.0], weight)


def _rows() -> list[dict]:
    """Six logged steps of 100 tokens, syncs logged at steps 2 and 4 (the first not
    committed: still a sync attempt on the plot), evaluations at 0 and 4."""
    rows = [{"step": 0, "tokens": 0, "wall_time_s": 0.5, "val_loss": 6.5}]
    losses = [6.4, 6.0, 6.2, 5.6, 5.9, 5.5]
    for step, loss in enumerate(losses, 1):
        r = {"step": step, "tokens": 100 * step, "wall_time_s": 1.0 + step, "loss": loss}
        if step in (2, 4):
            r["sync"] = {"committed": step == 4, "units": [0, 1]}
        if step == 4:
            r["val_loss"] = 5.8
        rows.append(r)
    return rows


def test_series_hold_the_raw_and_smoothed_loss_the_evaluations_and_the_syncs():
    s = loss_series(_rows(), "tokens", weight=0.5)
    assert s["train_x"] == [100, 200, 300, 400, 500, 600]
    assert s["train_y"] == [6.4, 6.0, 6.2, 5.6, 5.9, 5.5]
    assert s["smooth_y"] == smooth_ema(s["train_y"], 0.5)
    assert s["smooth_y"][:2] == pytest.approx([6.4, (0.25 * 6.4 + 0.5 * 6.0) / 0.75])
    assert s["val_x"] == [0, 400] and s["val_y"] == [6.5, 5.8]
    assert s["sync_x"] == [200, 400]
    t = loss_series(_rows(), "wall_time_s")
    assert t["sync_x"] == [3.0, 5.0] and t["val_x"] == [0.5, 5.0]
    assert t["smooth_y"] == smooth_ema(t["train_y"], SMOOTHING)


def test_a_run_without_syncs_or_losses_has_empty_series():
    rows = [{"step": 1, "tokens": 10, "loss": 5.0, "sync": None}, {"step": 2, "tokens": 20}]
    s = loss_series(rows, "tokens")
    assert s["sync_x"] == [] and s["val_x"] == [] and s["train_x"] == [10]


def test_plot_runs_draws_both_plots(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    written = plot_runs([run], tmp_path / "out")
    assert [p.name for p in written] == ["loss_vs_tokens.png", "loss_vs_time.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
