"""Trackers: the standard metric names (exact values from rows), the writer that feeds them,
the documented table, and a Weights & Biases run written offline by ``editrain train``."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from editrain.config import ConfigError, load_config
from editrain.metrics import MetricsWriter
from editrain.tracking import RUN_ID_FILE, STANDARD_METRICS, standard_metrics
from tests.cli import run_cli
from tests.test_cli import explain, tiny

ROOT = Path(__file__).resolve().parents[1]

STEP = {"step": 12, "tokens": 6144, "loss": 5.5, "lr": 0.002, "tokens_per_s": 4000.0,
        "step_time_s": 0.25, "compute_s": 0.125, "sync_wait_s": 0.0625, "grad_sync_s": 0.0,
        "wall_time_s": 3.0, "train_time_s": 2.5}
EDIT_SYNC = {"sync": 3, "step": 12, "units": 3, "sync_collectives": 4, "bytes_sent": 213656,
             "comm_time_s": 0.5, "wait_s": 0.0625, "hidden": 0.875,
             "norms": [[3.0, 4.0, 0.0], [1.0, 2.0, 2.0]],
             "weights": [[0.25, 0.5, 0.75], [0.75, 0.5, 0.25]],
             "outlier": [[False, True, False], [False, False, True]],
             "clip": [1.0, 0.5, 0.25], "replica_loss": [5.25, None]}


def test_a_step_row_with_its_sync_by_hand():
    got = standard_metrics({**STEP, "sync": EDIT_SYNC})
    assert got == {
        "train/loss": 5.5, "train/lr": 0.002, "train/tokens": 6144.0,
        "train/tokens_per_s": 4000.0, "train/step_time_s": 0.25, "train/compute_s": 0.125,
        "train/exposed_comm_s": 0.0625,
        "sync/index": 3.0, "sync/units": 3.0, "sync/staleness_steps": 0.0,
        "train/loss/replica0": 5.25,  # replica 1's is unknown (None): not logged
        "comm/bytes_sent": 213656.0, "comm/collectives": 4.0, "comm/time_s": 0.5,
        "comm/exposed_s": 0.0625, "comm/hidden": 0.875,
        "sync/pseudo_grad_norm/replica0": 5.0, "sync/pseudo_grad_norm/replica1": 3.0,
        "sync/weight/replica0": 0.5, "sync/weight/replica1": 0.5,
        "sync/outliers": 2.0, "sync/clipped_units": 2.0, "sync/clip_coef_min": 0.25,
    }


def test_streaming_and_fault_tolerant_rounds_by_hand():
    delayed = {"sync": 5, "step": 12, "units": 1, "launch_step": 10, "fragment": 1,
               "bytes_sent": 100, "hidden": None, "z": [[0.0], [math.nan]],
               "compression": 0.0078125, "staleness": 1}
    got = standard_metrics({**STEP, "sync": delayed})
    assert got["sync/staleness_steps"] == 2.0 and "comm/hidden" not in got
    assert got["comm/compression"] == 0.0078125 and got["sync/staleness_rounds"] == 1.0
    assert not any(k.startswith(("ft/", "sync/weight")) for k in got)
    ft = {"step": 12, "units": 3, "bytes_sent": 0, "committed": False, "healed": True,
          "quorum_size": 2, "members": [0, 1]}
    got = standard_metrics({**STEP, "sync": ft})
    assert (got["ft/committed"], got["ft/healed"], got["ft/quorum_size"]) == (0.0, 1.0, 2.0)


def test_evaluation_and_event_rows():
    assert standard_metrics({"step": 0, "tokens": 0, "val_loss": 6.25, "val_tokens": 1024,
                             "eval_time_s": 0.1, "wall_time_s": 0.0}) == \
        {"train/tokens": 0.0, "val/loss": 6.25, "val/tokens": 1024.0}
    assert standard_metrics({"event": "checkpoint", "step": 4, "bytes": 10}) == {}


def test_the_documented_table_is_the_code():
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = re.findall(r"^\| `([^`]+)` \|", text, re.M)
    assert documented == [name for name, _ in STANDARD_METRICS]
    patterns = [re.compile(re.escape(n).replace(re.escape("{r}"), r"\d+") + "$")
                for n in documented]
    for row in ({**STEP, "sim_stall_s": 0.3, "sync": {**EDIT_SYNC, "launch_step": 10,
                                                       "committed": True, "healed": False,
                                                       "quorum_size": 2}},
                {"step": 0, "val_loss": 6.0, "val_tokens": 10}):
        for name in standard_metrics(row):
            assert any(p.match(name) for p in patterns), name


class Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.closed = False

    def log(self, scalars, step):
        self.logged.append((step, scalars))

    def close(self):
        self.closed = True


def test_the_writer_feeds_its_trackers_the_standard_names(tmp_path):
    tracker = Recorder()
    writer = MetricsWriter(tmp_path, trackers=[tracker])
    writer.write({**STEP, "sync": EDIT_SYNC})
    writer.write({"event": "checkpoint", "step": 12, "path": "x"})
    writer.write({"step": 12, "val_loss": 5.0, "val_tokens": 8})
    writer.close()
    assert [step for step, _ in tracker.logged] == [12, 12]
    assert tracker.logged[0][1]["sync/pseudo_grad_norm/replica0"] == 5.0
    assert tracker.logged[1][1]["val/loss"] == 5.0 and tracker.closed
    silent = Recorder()
    MetricsWriter(tmp_path / "other", enabled=False, trackers=[silent]).write(STEP)
    assert silent.logged == []  # a rank that does not log feeds nothing


@pytest.mark.parametrize("value, message", [
    ("cloud", "train.wandb.*off, offline, online"),
])
def test_bad_wandb_mode_names_the_option(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"train": {"wandb": value}})


def test_wandb_missing_is_refused_before_launch(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train.wandb.*pip install 'editrain\[wandb\]'"):
        load_config(None, {"train": {"wandb": "offline"}})
    load_config(None, {"train": {"wandb": "off"}})  # off needs nothing


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_offline_wandb_run_holds_the_standard_metrics_and_resumes(tmp_path, data_cache):
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["OMP_NUM_THREADS"] = "1"
    run_dir = tmp_path / "run"
    args = ["train", *tiny(data_cache), "--nproc", "2", "--shard-size", "1",
            "--steps", "8", "--sync.local_sgd_sync_interval", "4", "--train.eval_every", "4",
            "--checkpoint.every", "4", "--train.wandb", "offline",
            "--train.wandb_project", "editrain-test", "--quiet", "--run-dir", str(run_dir)]
    proc = run_cli(args, env=env)
    assert proc.returncode == 0, explain(proc)
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    files = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, sorted(p.name for p in (run_dir / "wandb").iterdir())
    data = files[0].read_bytes()
    for name in ("train/loss", "val/loss", "comm/bytes_sent", "sync/pseudo_grad_norm/replica1",
                 "sync/weight/replica0", "editrain-test"):
        assert name.encode() in data, name
    # Resumed with more steps: the same W&B run goes on.
    more = [a if a != "8" else "12" for a in args]
    proc = run_cli([*more, "--resume", str(run_dir)], env=env)
    assert proc.returncode == 0, explain(proc)
    assert (run_dir / RUN_ID_FILE).read_text().strip() == run_id
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
