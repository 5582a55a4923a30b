"""The eager merge's global anchor G on one unit (docs/streaming.md section 3c): what an
evaluation sees is what the merge computes, bitwise; the end puts the replica on G; a
checkpoint keeps G and its optimizer apart from the replica's own, scalars included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from editrain.sync.outer import SyncUnit
from editrain.sync.state import StateLayout

ADAM = dict(lr=0.1, betas=(0.5, 0.9))
NESTEROV = dict(lr=0.7, momentum=0.9, nesterov=True)


def _unit(model: nn.Module, cls: type, kwargs: dict) -> SyncUnit:
    unit = SyncUnit(0, "root", list(model.parameters()), cls, kwargs, cpu_offload=False,
                    eager_replicas=2)
    unit.create_anchor()
    return unit


def _train(model: nn.Module, shift: float) -> None:
    with torch.no_grad():
        model.weight.sub_(shift * torch.arange(6.0).view(2, 3))


@pytest.mark.parametrize("cls, kwargs", [(torch.optim.SGD, NESTEROV), (torch.optim.Adam, ADAM),
                                         (None, {})])
def test_the_global_view_is_what_the_merge_computes(cls, kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    unit = _unit(model, cls, kwargs)
    start = unit.consensus.clone()
    assert torch.equal(unit.global_view(), start)  # nothing in flight: G
    for shift, incoming in ((0.01, 0.3), (0.02, -0.2)):
        _train(model, shift)
        unit.eager_launch()
        assert torch.equal(unit.global_view(), unit.consensus)  # I not known yet: G
        unit.incoming = torch.full((6,), incoming)
        seen = unit.global_view().clone()
        state_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in
                        (unit.consensus_outer.state.get(unit.consensus, {}).items()
                         if unit.consensus_outer else [])}
        unit.eager_merge()
        assert torch.equal(seen, unit.consensus)  # bitwise what the merge gave
        # the evaluation's trial step left G's optimizer state alone before the merge
        if unit.consensus_outer is not None and state_before:
            assert any(not torch.equal(v, unit.consensus_outer.state[unit.consensus][k])
                       for k, v in state_before.items() if torch.is_tensor(v))
    assert not torch.equal(unit.consensus, start)
    # plain averaging: G is the start minus every I
    if cls is None:
        torch.testing.assert_close(unit.consensus, start - 0.1)


def test_nobody_trusted_leaves_g_alone_and_the_end_puts_theta_on_g():
    model = nn.Linear(3, 2, bias=False)
    unit = _unit(model, torch.optim.SGD, NESTEROV)
    _train(model, 0.01)
    unit.eager_launch()
    g = unit.consensus.clone()
    unit.incoming = None  # nobody trusted: I = 0, no outer step of G
    assert torch.equal(unit.global_view(), g)
    unit.eager_merge()
    assert torch.equal(unit.consensus, g)
    _train(model, 0.02)
    unit.eager_end(torch.full((6,), 0.1))  # the last, blocking round
    assert not torch.equal(unit.consensus, g)
    assert torch.equal(unit.anchor, unit.consensus) and unit.carry is None
    assert torch.equal(model.weight.detach().reshape(-1), unit.consensus)
    own = unit.outer.state[unit.anchor]["momentum_buffer"]
    mine = unit.consensus_outer.state[unit.consensus]["momentum_buffer"]
    assert torch.equal(own, mine) and own.data_ptr() != mine.data_ptr()


def test_a_checkpoint_keeps_g_and_the_replicas_own_state_apart():
    """Adam's step is a 0-d tensor: the replica's own (2 launches) and G's (1 merge) differ
    and both come back; the shared entries are G's, an elastic resume starts from them."""
    model = nn.Linear(3, 2, bias=False)
    unit = _unit(model, torch.optim.Adam, ADAM)
    for shift in (0.01, 0.02):
        _train(model, shift)
        unit.eager_launch()
        if unit.incoming is None and shift == 0.01:
            unit.incoming = torch.full((6,), 0.3)
            unit.eager_merge()
    unit.incoming = torch.full((6,), -0.1)  # the second round in flight, reduced
    assert float(unit.outer.state[unit.anchor]["step"]) == 2
    assert float(unit.consensus_outer.state[unit.consensus]["step"]) == 1
    tree = StateLayout([unit], model, rank=0, topology=(2, 1)).pack(
        [unit.state_dict()], {"global_step": 2})
    assert torch.equal(tree["params"]["weight"]["anchor"].reshape(-1), unit.consensus)
    for topology, own in (((2, 1), True), ((4, 1), False)):
        states, _, _ = StateLayout([unit], model, rank=0, topology=topology).unpack(tree)
        fresh = SyncUnit(0, "root", list(model.parameters()), torch.optim.Adam, ADAM,
                         cpu_offload=False, eager_replicas=topology[0])
        fresh.load_state_dict(states[0])
        assert torch.equal(fresh.consensus, unit.consensus), topology
        g_state = fresh.consensus_outer.state[fresh.consensus]
        assert float(g_state["step"]) == 1 and torch.is_tensor(g_state["step"])
        assert torch.equal(g_state["exp_avg"],
                           unit.consensus_outer.state[unit.consensus]["exp_avg"])
        mine = fresh.outer.state[fresh.anchor]
        if own:
            assert torch.equal(fresh.anchor, unit.anchor)
            assert float(mine["step"]) == 2 and torch.is_tensor(mine["step"])
            assert mine["step"].dtype == unit.outer.state[unit.anchor]["step"].dtype
            assert torch.equal(fresh.global_view(), unit.global_view())
        else:  # another replica count: every replica restarts from G
            assert torch.equal(fresh.anchor, unit.consensus)
            assert float(mine["step"]) == 1
