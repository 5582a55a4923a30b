"""The shipped example configurations (``examples/configs/*.toml``) load, validate and run.

Every file must load and pass every check before any process starts (``load_config``,
``validate``, and ``validate_world`` with the world of ``dist.nproc`` local workers that
``editrain train`` would start), also on the tiny preset the run tests use. Two of them,
the default and the slow link, train a few steps through the command line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from editrain.config import Config, load_config, validate, validate_world
from editrain.errors import ConfigError
from tests.test_cli import editrain, explain, rows_of, tiny

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
FILES = sorted(CONFIGS.glob("*.toml"))
NEEDS = {"fault_tolerant.toml": "torchft"}
"""Optional packages an example needs (its validation checks that they are installed)."""


def test_the_promised_examples_are_shipped():
    assert {f.name for f in FILES} == {"default.toml", "slow_link.toml", "stragglers.toml",
                                       "fault_tolerant.toml", "tensor_parallel.toml",
                                       "very_slow_link.toml", "recipe.toml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("preset", [None, "tiny"])
def test_example_loads_and_validates(path: Path, preset: str | None):
    if path.name in NEEDS:
        pytest.importorskip(NEEDS[path.name])
    cfg = load_config(path, {"model": {"preset": preset}} if preset else None)
    validate(cfg)
    validate_world(cfg, cfg.dist.nproc)


def test_examples_say_what_they_promise():
    """Each file sets what its name says (and the default file only the defaults)."""
    assert load_config(CONFIGS / "default.toml") == Config()
    slow = load_config(CONFIGS / "slow_link.toml")
    assert slow.sim.link_bandwidth and slow.sim.link_latency
    assert slow.sync.fragments > 1 and slow.sync.overlap_steps > 0
    assert slow.sync.comm_dtype == "int8"
    recipe = load_config(CONFIGS / "recipe.toml")  # bench tune's recipe (docs/benchmarks.md)
    assert recipe.sync.method == "edit" and recipe.sync.local_sgd_sync_interval == 20
    assert recipe.sync.local_sgd_warmup_steps == recipe.train.steps // 4
    assert recipe.sync.outer_optim_kwargs == {"lr": 1.0, "momentum": 0.0}
    assert recipe.train.lr == 2 * Config().train.lr
    sparse = load_config(CONFIGS / "very_slow_link.toml")
    assert sparse.sync.comm_dtype == "topk2" and sparse.sim.link_bandwidth
    assert sparse.sync.overlap_steps == sparse.sync.local_sgd_sync_interval - 1
    late = load_config(CONFIGS / "stragglers.toml")
    assert late.sync.method == "aedit" and late.sim.straggler
    tp = load_config(CONFIGS / "tensor_parallel.toml")
    assert tp.dist.tp_size == 2 and tp.dist.nproc // tp.dist.replica_size == 2
    pytest.importorskip(NEEDS["fault_tolerant.toml"])
    ft = load_config(CONFIGS / "fault_tolerant.toml")
    assert ft.dist.fault_tolerance == "torchft"


def test_a_broken_example_names_the_option(tmp_path):
    """An edited copy with a typo fails with the option's name, before anything runs."""
    text = (CONFIGS / "slow_link.toml").read_text().replace("link_bandwidth", "link_bandwith")
    broken = tmp_path / "slow_link.toml"
    broken.write_text(text)
    with pytest.raises(ConfigError, match=r"unknown option sim\.link_bandwith "):
        load_config(broken)


@pytest.fixture(scope="module")
def cache_dir(data_cache) -> Path:
    return data_cache


@pytest.mark.parametrize("name", ["default", "slow_link"])
def test_example_trains_through_the_cli(name: str, tmp_path: Path, cache_dir: Path):
    """``editrain train --config FILE`` on the tiny preset, 2 replicas of one process (half
    the CPU of the files' 4): 12 steps (a sync at step 10; the slow link's fragments sync
    every 5 steps), no checkpoint."""
    run_dir = tmp_path / name
    proc, _ = editrain("train", "--config", str(CONFIGS / f"{name}.toml"), *tiny(cache_dir),
                       "--nproc", "2", "--shard-size", "1", "--steps", "12",
                       "--train.warmup_steps", "2", "--train.eval_every", "100",
                       "--checkpoint.final", "false", "--quiet", "--run-dir", str(run_dir),
                       timeout=110)
    assert proc.returncode == 0, explain(proc)
    steps = [r for r in rows_of(run_dir) if "loss" in r and "val_loss" not in r]
    assert steps and steps[-1]["step"] == 12, steps[-3:]
    ran = load_config(run_dir / "config.toml")
    assert ran.model.preset == "tiny"
    given = load_config(CONFIGS / f"{name}.toml")  # the file's settings ran
    assert ran.sim == given.sim
    assert (ran.sync.method, ran.sync.fragments, ran.sync.overlap_steps, ran.sync.comm_dtype) \
        == (given.sync.method, given.sync.fragments, given.sync.overlap_steps,
            given.sync.comm_dtype)
