"""The sync engine owns its state: ``state_dict()`` through DCP into a fresh engine gives the
same anchors, outer optimizer state and counters, bit for bit, on a 2 x 2 gloo topology; the
same checkpoint loads elastically into 4 x 1; the layout refuses what it cannot read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

WORLD = 4


class Tiny(nn.Module):
    """Embedding, two blocks, head; 15 rows so that two shards are uneven (8 + 7)."""

    def __init__(self, vocab: int = 15, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def _build(shard_size: int):
    import editrain
    from editrain.sync.config import SyncConfig

    info = editrain.init_mesh(shard_size=shard_size, backend="gloo", device_type="cpu")
    torch.manual_seed(0)
    model = Tiny()
    editrain.parallelize(model, info)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    # Penalty on, a short detector warm-up, outer AdamW: per-element vectors (exp_avg,
    # exp_avg_sq) and a 0-d scalar (step) in the outer state.
    config = SyncConfig(method="edit", local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                        ewma_warmup_steps=1, ewma_alpha=0.5, clip_pseudo_grad=1.0,
                        outer_optim_class="adamw", outer_optim_kwargs={"lr": 0.3})
    return info, model, opt, editrain.edit(model, info, config, seed=7)


def _train(model, opt, engine, rank: int, steps: int) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randint(15, (4, 9), generator=gen)
        loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        engine.after_backward()
        opt.step()
        opt.zero_grad()
        engine.step()


def _unit_states(engine) -> list[dict]:
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in u.state_dict().items()}
            for u in engine.units]


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(
        torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype if torch.is_tensor(x[k])
        else x[k] == y[k] for k in x) for x, y in zip(a, b, strict=True))


def _counters(engine) -> dict:
    names = ("global_step", "steps_since_sync", "num_syncs", "num_skipped_syncs",
             "num_syncs_forced", "sync_pending", "pending_counts", "synced_replica_steps",
             "last_window_counts", "last_window_s", "seed")
    out = {name: getattr(engine, name) for name in names}
    out["detectors"] = engine.detectors.state_dict()
    return out


def _round_trip_worker(rank: int, world: int, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from editrain.checkpoint import saved_tensors

    info, model, opt, engine = _build(shard_size=2)
    # Warm-up step 1, then a sync every 2 steps: two done, the third armed at the save.
    _train(model, opt, engine, rank, 7)
    state = engine.state_dict()
    dcp.save({"engine": state}, checkpoint_id=ckpt)
    before, counters = _unit_states(engine), _counters(engine)
    # The global model at the save point, per parameter, for the elastic check below.
    full = {fqn: entries["anchor"].full_tensor() for fqn, entries in state["params"].items()}
    engine.close()

    _, model2, _, fresh = _build(shard_size=2)
    assert not fresh.has_anchors  # warm-up: a fresh engine has nothing yet
    template = fresh.state_dict_template(saved_tensors(ckpt, "engine"))
    dcp.load({"engine": template}, checkpoint_id=ckpt)
    elastic = fresh.load_state_dict(template)
    result = {
        "elastic_same_topology": elastic,
        "units_equal": _same(before, _unit_states(fresh)),
        "counters_equal": counters == _counters(fresh),
        "outer_keys": sorted(before[1]),
        "counters": (counters["num_syncs"], counters["sync_pending"]),
    }
    fresh.close()

    # Elastic: the same checkpoint into 4 replicas x 1 shard, on the same processes.
    _, model3, _, wide = _build(shard_size=1)
    template = wide.state_dict_template(saved_tensors(ckpt, "engine"))
    dcp.load({"engine": template}, checkpoint_id=ckpt)
    result["elastic"] = wide.load_state_dict(template)
    names = {id(p): n for n, p in model3.named_parameters()}
    # (the root holds nothing here: parallelize shards embedding and head on their own)
    expected = [torch.cat([full[names[id(p)]].reshape(-1) for p in u.params] or [torch.zeros(0)])
                for u in wide.units]
    result["elastic_anchor_equal"] = all(
        torch.equal(u.anchor, e) for u, e in zip(wide.units, expected, strict=True))
    result["elastic_params_are_anchors"] = all(
        torch.equal(u.flat_params(), u.anchor) for u in wide.units)
    result["elastic_counters"] = (wide.global_step, wide.num_syncs, wide.steps_since_sync,
                                  wide.sync_pending)
    wide.close()
    return result


def test_engine_state_dict_round_trips_bitwise_and_elastically(tmp_path):
    from editrain.spawn import run_ranks

    results = run_ranks(_round_trip_worker, WORLD, str(tmp_path / "ckpt"))
    for r in results:
        assert r["elastic_same_topology"] is False
        assert r["units_equal"], "anchors or outer state differ after the round trip"
        assert r["counters_equal"]
        assert r["outer_keys"] == ["anchor", "outer.exp_avg", "outer.exp_avg_sq", "outer.step"]
        assert r["counters"] == (2, True)
        assert r["elastic"] is True
        assert r["elastic_anchor_equal"], "the anchors did not re-shard exactly"
        assert r["elastic_params_are_anchors"]
        assert r["elastic_counters"] == (7, 2, 0, False)  # the local phase restarts


def test_unit_state_refuses_what_it_cannot_restore():
    from editrain.sync.outer import SyncUnit

    p = nn.Parameter(torch.arange(4.0))
    plain = SyncUnit(0, "root", [p], None, {}, cpu_offload=False)
    with pytest.raises(ValueError, match="no outer optimizer"):
        plain.load_state_dict({"anchor": torch.zeros(4), "outer.momentum_buffer": torch.ones(4)})
    with pytest.raises(ValueError, match="4 elements|this shard has 4"):
        plain.load_state_dict({"anchor": torch.zeros(3)})
    with pytest.raises(ValueError, match="unknown state entries"):
        plain.load_state_dict({"anchor": torch.zeros(4), "error_feedback": torch.zeros(4)})
    plain.load_state_dict({})
    assert plain.anchor is None and plain.state_dict() == {}

    outer = SyncUnit(0, "root", [p], torch.optim.SGD, {"lr": 1.0, "momentum": 0.5},
                     cpu_offload=False)
    outer.create_anchor()
    outer.outer_step(torch.ones(4))
    saved = {k: v.clone() for k, v in outer.state_dict().items()}
    assert sorted(saved) == ["anchor", "outer.momentum_buffer"]
    copy = SyncUnit(0, "root", [p], torch.optim.SGD, {"lr": 1.0, "momentum": 0.5},
                    cpu_offload=False)
    copy.load_state_dict(saved)
    assert torch.equal(copy.anchor, outer.anchor)
    assert torch.equal(copy.state_dict()["outer.momentum_buffer"], saved["outer.momentum_buffer"])


def test_layout_version_is_checked():
    from editrain.sync.state import StateLayout, json_tensor

    layout = StateLayout([], nn.Linear(2, 2), rank=0, topology=(1, 1))
    with pytest.raises(ValueError, match="version"):
        layout.unpack({"ranks": {"rank00000": json_tensor({"global_step": 3})}})
    with pytest.raises(ValueError, match="no sync engine state"):
        layout.template({})


def test_error_feedback_is_kept_per_replica_and_reset_when_the_replica_count_changes():
    """A sparse or quantised codec's residual belongs to its replica: restored as saved on
    the same number of replicas (also with another shard size), dropped on another number
    (its replica may be gone), while the shared anchor always comes back."""
    from editrain.sync.outer import SyncUnit
    from editrain.sync.state import StateLayout

    model = nn.Linear(3, 2, bias=False)
    unit = SyncUnit(0, "root", list(model.parameters()), None, {}, cpu_offload=False,
                    error_feedback=True)
    unit.create_anchor()
    unit.error.copy_(torch.arange(6.0) / 7)
    tree = StateLayout([unit], model, rank=2, topology=(2, 2)).pack(
        [unit.state_dict()], {"global_step": 5})
    assert torch.equal(tree["replicas"]["1"]["weight"]["error_feedback"].reshape(-1),
                       unit.error)
    tree["ranks"]["rank00000"] = tree["ranks"].pop("rank00002")  # rank 0's plain state
    for topology, rank, kept in (((2, 1), 1, True), ((2, 2), 3, True), ((1, 2), 0, False),
                                 ((4, 1), 1, False)):
        states, _, elastic = StateLayout([unit], model, rank=rank, topology=topology).unpack(
            tree)
        assert elastic  # another topology than the saving one
        assert torch.equal(states[0]["anchor"], unit.anchor)
        if kept:
            assert torch.equal(states[0]["replica.error_feedback"], unit.error), topology
        else:
            assert "replica.error_feedback" not in states[0], topology


def test_eager_state_is_per_replica_and_restored_on_the_same_replica_count():
    """The eager merge: each replica's own anchor, outer momentum, round in flight (D, I) and
    correction C are saved under that replica; restored as saved on the saving topology;
    on another shard size the anchor and momentum stay the replica's own but the round in
    flight is dropped; on another number of replicas only the shared entries remain."""
    from editrain.sync.outer import SyncUnit
    from editrain.sync.state import StateLayout

    model = nn.Linear(3, 2, bias=False)
    sgd = dict(lr=0.7, momentum=0.9, nesterov=True)

    def make() -> SyncUnit:
        return SyncUnit(0, "root", list(model.parameters()), torch.optim.SGD, sgd,
                        cpu_offload=False, eager_replicas=2)

    unit = make()
    unit.create_anchor()
    with torch.no_grad():
        model.weight.copy_(unit.anchor.view(2, 3) - torch.arange(6.0).view(2, 3) / 10)
    unit.eager_launch()  # D = A - theta; own share applied; theta <- A
    # (float32 defaults, values up to 0.5: A - (A - x) rounds x by an ulp of A, class 3)
    torch.testing.assert_close(unit.launch, torch.arange(6.0) / 10)
    unit.incoming = torch.full((6,), 0.25)
    unit.eager_merge()  # C = I - D / 2
    torch.testing.assert_close(unit.carry, 0.25 - torch.arange(6.0) / 20)
    unit.eager_launch()  # a second round in flight: D = 0 (theta == A), C consumed
    assert unit.carry is None and torch.equal(unit.launch, torch.zeros(6))
    unit.incoming = torch.full((6,), -1.0)
    unit.carry = torch.full((6,), 3.0)  # as if a later merge left one (A-EDiT)
    momentum = unit.outer.state[unit.anchor]["momentum_buffer"]
    tree = StateLayout([unit], model, rank=2, topology=(2, 2)).pack(
        [unit.state_dict()], {"global_step": 5})
    own = tree["replicas"]["1"]["weight"]
    assert set(own) == {"anchor", "outer.momentum_buffer", "launch", "incoming", "carry"}
    tree["ranks"]["rank00000"] = tree["ranks"]["rank00002"]  # rank 0's plain state
    # Another replica's values in the shared entries (DCP keeps one replica's copy).
    tree["params"]["weight"]["anchor"] = torch.zeros(2, 3)
    for topology, rank, kept, in_flight in (((2, 2), 2, True, True), ((2, 1), 1, True, False),
                                            ((4, 1), 1, False, False)):
        states, _, _ = StateLayout([unit], model, rank=rank, topology=topology).unpack(tree)
        fresh = make()
        fresh.load_state_dict(states[0])
        if kept:
            assert torch.equal(fresh.anchor, unit.anchor), topology
            assert torch.equal(fresh.outer.state[fresh.anchor]["momentum_buffer"], momentum)
        else:
            assert torch.equal(fresh.anchor, torch.zeros(6)), topology
        if in_flight:
            assert torch.equal(fresh.launch, unit.launch)
            assert torch.equal(fresh.incoming, unit.incoming)
            assert torch.equal(fresh.carry, unit.carry)
        else:
            assert fresh.launch is None and fresh.incoming is None and fresh.carry is None
