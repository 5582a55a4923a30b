"""The synchronous method (HSDP) on 2 replicas x 2 shards equals one process training on the
concatenated global batch with the same optimizer; and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from editrain.config import load_config
from editrain.optim.schedule import lr_at
from editrain.spawn import run_ranks
from tests.reference import batch, loss_on, make_inner, make_model

WORLD, SHARD = 4, 2
STEPS = 5
CASES = {
    "adamw": dict(inner="adamw", accum=1),
    "adamw_accum2": dict(inner="adamw", accum=2),
    "sgd": dict(inner="sgd", accum=1),
}


def _sync_worker(rank: int, world: int, shard: int, cases: dict) -> dict:
    """Every case on one (2, 2) mesh: fresh model, FSDP2 per block + root, the synchronous
    method, the inner optimizer, ``STEPS`` steps on this rank's batches."""
    from torch.distributed.fsdp import fully_shard

    from editrain.sync import SyncConfig, SyncEngine
    from editrain.topology import init_mesh

    info = init_mesh(shard_size=shard, backend="gloo", device_type="cpu")
    out = {}
    for name, case in cases.items():
        model = make_model()
        for block in model.layers:
            fully_shard(block, mesh=info.shard_mesh)
        fully_shard(model, mesh=info.shard_mesh)
        opt = make_inner(model.parameters(), case["inner"])
        engine = SyncEngine(model, info.mesh, SyncConfig(method="sync"), blocks=model.layers)
        accum = case["accum"]
        for step in range(STEPS):
            for micro in range(accum):
                (loss_on(model, batch(rank, step, micro)) / accum).backward()
            engine.after_backward()
            opt.step()
            opt.zero_grad()
            engine.step()
        engine.finish()
        out[name] = {
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "num_syncs": engine.num_syncs,
            "replica": info.replica,
        }
        engine.close()
    return out


def _single_process(inner: str, accum: int) -> dict[str, torch.Tensor]:
    """One model trained on the concatenation of all ranks' batches (mean loss)."""
    model = make_model()
    opt = make_inner(model.parameters(), inner)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accum):
            x = torch.cat([batch(r, step, micro) for r in range(WORLD)])
            (loss_on(model, x) / accum).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def distributed() -> list[dict]:
    return run_ranks(_sync_worker, WORLD, SHARD, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_sync_equals_one_process_on_the_global_batch(distributed, name):
    case = CASES[name]
    expected = _single_process(case["inner"], case["accum"])
    init = {n: p.detach() for n, p in make_model().named_parameters()}
    moved = max(float((expected[n] - init[n]).abs().max()) for n in expected)
    assert moved > 1e-3, "the reference did not train: the comparison would be vacuous"
    assert [o[name]["replica"] for o in distributed] == [0, 0, 1, 1]
    for rank, out in enumerate(distributed):
        params = out[name]["params"]
        assert params.keys() == expected.keys()
        # the tiny model's parameters (order 1 and below) after float32 steps on a gradient
        # averaged over 4 ranks against one process: PARAM_TOL's reasoning (tests/tolerance.py)
        for n, p in params.items():
            torch.testing.assert_close(p, expected[n], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=n, r=rank: f"rank {r}, {n}: {m}")


def test_sync_replicas_stay_identical(distributed):
    for name in CASES:
        first = distributed[0][name]["params"]
        for out in distributed[1:]:
            for n, p in out[name]["params"].items():
                assert torch.equal(p, first[n]), (name, n)


# ---------------------------------------------------------------------------- schedule
def schedule_cfg(**train):
    return load_config(None, {"train": {"lr": 1.0, "min_lr_ratio": 0.1, **train}})


def test_lr_warmup_is_linear():
    cfg = schedule_cfg(steps=12, warmup_steps=4)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_lr_cosine_decay_to_min_ratio():
    cfg = schedule_cfg(steps=12, warmup_steps=4)
    assert lr_at(4, cfg) == pytest.approx(1.0)  # peak right after warm-up
    assert lr_at(8, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: mid point
    assert lr_at(6, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(12, cfg) == pytest.approx(0.1)  # the end: min_lr_ratio * lr
    assert lr_at(100, cfg) == pytest.approx(0.1)  # never below the floor


def test_lr_decays_monotonically_after_warmup():
    cfg = schedule_cfg(steps=50, warmup_steps=10, lr=3e-3, min_lr_ratio=0.2)
    lrs = [lr_at(s, cfg) for s in range(10, 51)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(6e-4)
    assert all(0 < lr_at(s, cfg) <= 3e-3 for s in range(60))


def test_lr_without_warmup():
    cfg = schedule_cfg(steps=10, warmup_steps=0)
    assert lr_at(0, cfg) == pytest.approx(1.0)
    assert lr_at(5, cfg) == pytest.approx(0.55)
    assert lr_at(10, cfg) == pytest.approx(0.1)


def test_lr_min_ratio_one_is_constant_after_warmup():
    cfg = schedule_cfg(steps=10, warmup_steps=2, min_lr_ratio=1.0)
    assert [lr_at(s, cfg) for s in range(12)] == pytest.approx([0.5] + [1.0] * 11)


def test_lr_warmup_longer_than_the_run():
    cfg = schedule_cfg(steps=5, warmup_steps=10)
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
