"""The engine's invariants, checked before any sync runs: every block is an FSDP2 unit of
its own (or nothing is sharded: every rank of a replica holds a full copy, the DDP path),
and every replica starts the local phase from the same parameters."""

from __future__ import annotations

import pytest
import torch

from tests.reference import batch, loss_on, make_model

pytestmark = pytest.mark.slow


def _sharding_worker(rank: int, world: int) -> dict[str, str | None]:
    from torch.distributed.fsdp import fully_shard

    from editrain.sync import SyncConfig, SyncEngine
    from editrain.topology import init_mesh

    info = init_mesh(shard_size=world)  # one replica of `world` ranks

    def attempt(shard_blocks: bool, shard_root: bool) -> str | None:
        model = make_model()
        if shard_blocks:
            for block in model.layers:
                fully_shard(block, mesh=info.shard_mesh)
        if shard_root:
            fully_shard(model, mesh=info.shard_mesh)
        try:
            SyncEngine(model, info.mesh, SyncConfig(method="edit"), blocks=model.layers).close()
        except ValueError as e:
            return str(e)
        return None

    return {"root only": attempt(False, True), "blocks only": attempt(True, False),
            "nothing": attempt(False, False), "both": attempt(True, True)}


def test_each_block_must_be_its_own_fsdp_unit():
    from editrain.spawn import run_ranks

    for out in run_ranks(_sharding_worker, 2):
        assert "block(s) 0 (layers.0), 1 (layers.1) are not FSDP2 units" in out["root only"]
        assert "the root module is not" in out["blocks only"]
        assert out["nothing"] is None  # full copies on the replica's ranks (the DDP path)
        assert out["both"] is None


def _agree_worker(rank: int, world: int, S: int, perturb: bool, warmup: int) -> str | None:
    from torch.distributed.fsdp import fully_shard

    from editrain.sync import SyncConfig, SyncEngine
    from editrain.topology import init_mesh

    info = init_mesh(shard_size=S)
    model = make_model()
    if perturb and info.replica == 1:
        with torch.no_grad():  # as if replica 1 had been initialised with another seed
            model.layers[1].attention.wq.weight.add_(0.01)
    for block in model.layers:
        fully_shard(block, mesh=info.shard_mesh)
    fully_shard(model, mesh=info.shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        engine = SyncEngine(model, info.mesh,
                            SyncConfig(method="edit", local_sgd_warmup_steps=warmup),
                            blocks=model.layers)
        for step in range(warmup + 1):
            loss_on(model, batch(rank, step, 0)).backward()
            engine.after_backward()
            opt.step()
            opt.zero_grad()
            engine.step()
        engine.close()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("warmup", [0, 2])
def test_replicas_must_start_the_local_phase_from_one_model(warmup):
    """A replica initialised differently is caught on every rank (2 replicas x 2 shards:
    no rank goes on alone, so nothing hangs), at construction or at the end of warm-up."""
    from editrain.spawn import run_ranks

    outs = run_ranks(_agree_worker, 4, 2, True, warmup)
    assert all(o is not None and "different parameters (units block1)" in o for o in outs), outs
    assert run_ranks(_agree_worker, 4, 2, False, warmup) == [None] * 4
