"""bench batch: the study's run options, learning-rate grid and record logic (no training)."""

from __future__ import annotations

import pytest

from editrain.bench import batch
from editrain.bench.runner import Bench
from editrain.config import ConfigError


def _bench(tmp_path, mode="quick", **flags):
    return Bench("batch", mode, tmp_path, flags=flags)


def test_equal_tokens_at_every_batch(tmp_path):
    bench = _bench(tmp_path)
    batches, per_run, seq = batch.sizes(bench)
    assert batches == (512, 2048, 8192)
    assert per_run == 8192 * 20
    for tokens in batches:
        for method in batch.METHODS:
            cfg = bench.config(*batch.run_layers("tiny", method, 1, tokens, per_run, seq, 0.01))
            # the same tokens per replica per run, whatever the batch
            assert cfg.train.batch_size * cfg.train.seq_len == tokens
            assert cfg.train.steps * tokens == per_run
            assert cfg.train.lr == 0.01
            assert cfg.train.seed == 1
            if method == "sync":
                assert cfg.sync.method == "sync"
            else:  # the recipe: H = 20 steps, a quarter of the run synchronous
                assert cfg.sync.local_sgd_sync_interval == 20
                assert cfg.sync.local_sgd_warmup_steps == cfg.train.steps // 4
                assert cfg.sync.outer_optim_kwargs["lr"] == 1.0
                assert cfg.sync.outer_optim_kwargs["momentum"] == 0.0


def test_grid_scales_with_square_root_of_batch():
    assert batch.grid_lrs(512) == [0.003, 0.006]
    assert batch.grid_lrs(2048) == [0.006, 0.012]
    assert batch.grid_lrs(8192) == [0.012, 0.024]


def test_best_lr_skips_failed_runs():
    assert batch.best_lr({0.003: 5.1, 0.006: 4.9}) == 0.006
    assert batch.best_lr({0.003: 5.1, 0.006: None}) == 0.003
    assert batch.best_lr({0.003: None, 0.006: None}) == 0.003


def test_grid_extends_beyond_the_edge_where_the_best_is():
    assert batch.next_lr({0.003: 5.0, 0.006: 5.1}) == 0.0015
    assert batch.next_lr({0.012: 6.2, 0.024: 6.1}) == 0.048
    assert batch.next_lr({0.0015: 5.2, 0.003: 5.0, 0.006: 5.1}) is None  # inside
    assert batch.next_lr({0.003: None, 0.006: None}) is None
    assert batch.next_lr({0.003: 5.0}) is None  # a one-point grid has no edge to pass


def _row(tokens=2048):
    grid = {"sync": {0.006: 5.0, 0.012: 4.8}, batch.RECIPE: {0.006: 5.3, 0.012: 5.2}}
    return batch.batch_row("tiny", tokens, 8192 * 32, grid, [4.8, 5.0, 4.6],
                           [5.2, 5.1, 4.6], {"sync": {"syncs": 0, "wall_time_s": 10.0},
                                             batch.RECIPE: {"syncs": 5, "wall_time_s": 9.0}})


def test_batch_row_exact_values():
    r = _row()
    assert r["steps"] == 128 and r["h_steps"] == 20 and r["h_tokens"] == 40960
    assert r["warmup_sync_steps"] == 32
    assert r["lr"] == {"sync": 0.012, batch.RECIPE: 0.012}
    assert r["lr_at_edge"] == {"sync": True, batch.RECIPE: True}
    assert r["gap"]["values"] == pytest.approx([0.4, 0.1, 0.0])
    assert r["gap"]["mean"] == pytest.approx(0.5 / 3)
    assert r["sync"]["mean"] == pytest.approx(4.8)
    assert r["relative_gap"] == pytest.approx(0.5 / 3 / 4.8)
    assert r["relative_gap_range"] == pytest.approx([0.0, 0.4 / 4.8])
    assert r["syncs"] == {"sync": 0, batch.RECIPE: 5}


def test_row_with_failed_seed_pairs_only_finished_ones():
    grid = {"sync": {0.003: 5.0}, batch.RECIPE: {0.003: 5.1}}
    r = batch.batch_row("tiny", 512, 8192 * 32, grid, [5.0, None], [5.1, 5.3], {})
    assert r["gap"]["values"] == pytest.approx([0.1])
    assert r["relative_gap"] == pytest.approx(0.1 / 5.0)
    assert r["syncs"] == {"sync": None, batch.RECIPE: None}


def test_table_and_findings_from_rows():
    small = _row(512)
    large = _row(8192)
    large["relative_gap"] = -0.01
    text = batch.table([small, large])
    assert "20 (10,240)" in text and "20 (163,840)" in text
    assert "+3.5%" in text and "-1.0%" in text
    assert "+0.0% .. +8.3%" in text
    found = batch.findings([small, large])
    assert any("the gap shrinks from +3.5% to -1.0% as the batch grows 16x" in f
               for f in found)
    assert "tiny: at equal tokens sync itself ends at 4.800 (512 tokens per step, 512 steps)" \
        ", 4.800 (8,192 tokens per step, 32 steps)" in "".join(found)
    assert found[-1] == "tiny: the recipe is within 2% of sync (or better) at 8,192 tokens " \
                        "per replica per step."
    grid = batch.grid_table([small])
    assert "0.006: 5.0000, 0.012: 4.8000" in grid and "0.012 (grid edge)" in grid


def test_findings_say_when_no_batch_is_within():
    r = _row(512)
    assert batch.findings([r])[-1] == "tiny: the recipe is not within 2% of sync at any " \
                                      "batch tried."


def test_shapes_flag(tmp_path):
    assert batch.chosen_shapes(_bench(tmp_path)) == ["tiny", "blocks"]
    assert batch.chosen_shapes(_bench(tmp_path, mode="tiny")) == ["tiny"]
    assert batch.chosen_shapes(_bench(tmp_path, shapes="blocks,tiny")) == ["tiny", "blocks"]
    with pytest.raises(ConfigError, match="--shapes: unknown shape"):
        batch.chosen_shapes(_bench(tmp_path, shapes="small"))
