"""The DDP path: full model copies on the ranks of a replica, each syncing a slice.

One spawn of 2 replicas x 2 ranks (gloo) runs every case: the same model and data once
with FSDP2 over each replica and once wrapped in ``DistributedDataParallel`` over the
replica's own group. The DDP path must match the FSDP2 path (and the reference simulator)
to ~1e-5, send one model's worth of bytes per replica across replicas (as FSDP2 does), keep
the copies of a replica bitwise identical at every step, and resume bitwise from the
optimizer wrapper's state dict.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import editrain
from editrain.ddp import STATE_KEY
from editrain.spawn import run_ranks
from editrain.sync.outer import SyncUnit
from editrain.sync.state import rank_key
from editrain.topology import init_mesh
from tests.optimizer_hooks import check_every_registration, check_state_dict_hooks
from tests.reference import (
    batch,
    loss_on,
    make_inner,
    make_model,
    max_diff,
    max_diff_runs,
    ref_config,
    reference,
)
from tests.tolerance import PARAM_TOL

# The tests that read the runs share one 4-process spawn (every case on both paths): slow.
slow = pytest.mark.slow

R, S = 2, 2
TOL = PARAM_TOL  # parameters against the reference: see its docstring
PEN_ON = dict(pseudo_gradnorm_reduce=True, weight_softmax_temperature=0.02, skip_anomaly=True,
              ewma_alpha=0.5, ewma_warmup_steps=2, ewma_threshold=3.0, clip_pseudo_grad=0.05)


def _case(method: str, steps: int, warmup: int = 1, H: int = 2, tied: bool = True,
          **sync) -> dict:
    return dict(sync=dict(method=method, local_sgd_warmup_steps=warmup,
                          local_sgd_sync_interval=H, **sync),
                steps=steps, finish_force=True, tied=tied, split_root=not tied)


# Each case runs on both paths; the DDP path's results are compared with the FSDP2 path's.
CASES = {
    # the penalty (softmax weights, anomaly detector) and clipping on; warm-up averages
    # gradient slices across replicas first
    "edit": _case("edit", 9, **PEN_ON),
    "diloco": _case("diloco", 8),
    # embeddings and output head as units of their own, no warm-up
    "edit_split": _case("edit", 8, warmup=0, tied=False, **PEN_ON),
    # a delayed, fragmented round: the merges write the parameters from the main thread
    "streaming": _case("edit", 10, H=4, tied=False, overlap_steps=1, fragments=2,
                       merge="keep_local", **PEN_ON),
}
# The optimizer wrapper: saved after SAVE_AT steps (a sync armed, outer state present),
# resumed in a fresh model, engine and optimizer; both run to RESUME_TOTAL steps.
RESUME = _case("edit", 0, **PEN_ON)
SAVE_AT, RESUME_TOTAL = 5, 9


# ----------------------------------------------------------------------------- workers
def _build(info, case: dict, mode: str):
    """The model (``mode`` "fsdp" or "ddp"), the module the loop calls, and the engine."""
    model = make_model(tied=case["tied"])
    if mode == "fsdp":
        editrain.parallelize(model, info, split_root=case["split_root"], shard=True)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, process_group=info.shard_mesh.get_group())
    engine = editrain.edit(wrapped, info, editrain.SyncConfig(
        split_root=case["split_root"], **case["sync"]))
    return model, wrapped, engine


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(info, rank: int, case: dict, mode: str) -> dict:
    model, wrapped, engine = _build(info, case, mode)
    opt = make_inner(wrapped.parameters(), "adamw")
    per_step = []
    for step in range(case["steps"]):
        loss_on(wrapped, batch(rank, step, 0)).backward()
        engine.after_backward()
        opt.step()
        opt.zero_grad()
        engine.step()
        if mode == "ddp":
            per_step.append(_flat(model))
    engine.finish(force=True)
    if mode == "ddp":
        per_step.append(_flat(model))
    log = engine.pop_sync_log()
    out = {"params": _full(model), "replica": info.replica, "num_syncs": engine.num_syncs,
           "bytes": sum(e["bytes_sent"] for e in log), "per_step": per_step,
           "unit_numels": [u.numel for u in engine.units]}
    engine.close()
    return out


def _wrapper_run(info, rank: int, resume_from: bytes | None) -> tuple[dict, bytes | None]:
    """Train with the optimizer wrapper to RESUME_TOTAL steps: from the start (saving at
    SAVE_AT), or from a saved state."""
    model, wrapped, engine = _build(info, RESUME, "ddp")
    opt = editrain.StatefulPostLocalSGDOptimizer(make_inner(wrapped.parameters(), "adamw"),
                                                 engine)
    # A schedule on the wrapper, as a reference loop has: it must still reach the inner
    # optimizer after opt.load_state_dict() (which replaces the inner param_groups).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    first, saved = 0, None
    # Step hooks on the wrapper (torch.optim.Optimizer's API): the pre hook sees the
    # engine before the step counts, the post hook after; a removed hook stops.
    seen: dict[str, list[int]] = {"pre": [], "post": []}
    pre = opt.register_step_pre_hook(
        lambda o, args, kwargs: seen["pre"].append(o.engine.global_step))
    opt.register_step_post_hook(lambda o, args, kwargs: seen["post"].append(
        o.engine.global_step))
    if resume_from is not None:
        state = torch.load(io.BytesIO(resume_from), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        first = SAVE_AT
    for step in range(first, RESUME_TOTAL):
        if step == SAVE_AT and resume_from is None:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buf)
            saved = buf.getvalue()
        loss_on(wrapped, batch(rank, step, 0)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step == first + 1:
            pre.remove()
    engine.finish(force=True)
    out = {"params": _full(model), "num_syncs": engine.num_syncs,
           "inner_lr": opt.optim.param_groups[0]["lr"], "hooks": seen, "first": first}
    engine.close()
    return out, saved


def _checks(info) -> dict:
    """Block discovery through a DDP wrapper; a wrapper over the world is refused."""
    model = make_model()
    found = editrain.find_blocks(DistributedDataParallel(
        model, process_group=info.shard_mesh.get_group()))
    world = DistributedDataParallel(make_model(), process_group=dist.group.WORLD)
    try:
        editrain.edit(world, info)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"blocks_found": [b is m for b, m in zip(found, model.layers)]
            + [len(found) == len(model.layers)], "refused": refused}


def _worker(rank: int, world: int) -> dict:
    info = init_mesh(shard_size=S)
    out = {"checks": _checks(info)}
    for name, case in CASES.items():
        out[name] = {mode: _train(info, rank, case, mode) for mode in ("fsdp", "ddp")}
    continuous, saved = _wrapper_run(info, rank, None)
    resumed, _ = _wrapper_run(info, rank, saved)
    out["resume"] = {"continuous": continuous, "resumed": resumed}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_worker, R * S)


def _outs(runs: list[dict], name: str, mode: str) -> list[dict]:
    return [r[name][mode] for r in runs]


# ----------------------------------------------------------------------------- tests
def _copies(S: int, shapes: list[tuple[int, ...]]) -> tuple[list[SyncUnit], torch.Tensor]:
    """One unit per rank of a replica of ``S`` full copies (in one process), and a new
    flat value of the unit; ``gather`` stands in for the replica's all-gather: the padded
    slices of every rank of that new value, with the caller's own in its place."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    target = torch.randn(sum(p.numel() for p in params))
    units: list[SyncUnit] = []

    def gather_for(i: int):
        def gather(piece: torch.Tensor) -> torch.Tensor:
            parts = []
            for j, u in enumerate(units):
                mine = piece if j == i else u.own_part(target)
                parts.append(torch.cat([mine, mine.new_zeros(u.chunk - mine.numel())]))
            return torch.cat(parts)
        return gather

    for i in range(S):
        copy = [torch.nn.Parameter(p.detach().clone()) for p in params]
        units.append(SyncUnit(0, "root", copy, torch.optim.SGD, {"lr": 1.0}, False,
                              part=(i, S), gather=gather_for(i)))
    return units, target


@pytest.mark.parametrize("S,shapes,numels", [
    (3, [(4,), (3, 2), (1,)], [4, 4, 3]),  # slices across parameter boundaries, a short last
    (4, [(2,)], [1, 1, 0, 0]),             # more ranks than elements: empty slices
    (2, [(3, 2), (5,)], [6, 5]),
])
def test_slices_cover_the_unit_once_and_write_back_whole(S, shapes, numels):
    units, target = _copies(S, shapes)
    assert [u.numel for u in units] == numels
    full = torch.cat([p.detach().reshape(-1) for p in units[0].params])
    assert torch.equal(torch.cat([u.flat_params() for u in units]), full)
    for u in units:
        assert torch.equal(u.own_part(full), u.flat_params())
        u.create_anchor()
        assert u.anchor is not None and u.anchor.numel() == u.numel
        assert u.state_dict()["anchor"].numel() == u.numel
    # writing this rank's slice of the new value writes the whole unit (gathered)
    for u in units:
        u.load_flat(u.own_part(target))
        got = torch.cat([p.detach().reshape(-1) for p in u.params])
        assert torch.equal(got, target)
        assert torch.equal(u.assemble(u.own_part(target)), target)


def test_a_part_needs_the_gather():
    with pytest.raises(ValueError, match="all-gather"):
        SyncUnit(0, "root", [torch.nn.Parameter(torch.ones(2))], None, {}, False, part=(0, 2))


@slow
@pytest.mark.parametrize("name", list(CASES))
def test_ddp_path_equals_fsdp_path(runs, name):
    ddp, fsdp = _outs(runs, name, "ddp"), _outs(runs, name, "fsdp")
    assert ddp[0]["num_syncs"] >= 3 and ddp[0]["num_syncs"] == fsdp[0]["num_syncs"]
    diff = max_diff_runs(ddp, fsdp)
    assert diff < TOL, f"{name}: max |ddp - fsdp| = {diff:.3g}"
    # each rank owns half of every unit: the slices cover it once
    numels = [d["unit_numels"] for d in ddp[:S]]
    assert [sum(n) for n in zip(*numels)] == [sum(f) for f in zip(
        *[f["unit_numels"] for f in fsdp[:S]])]
    ref = reference(ref_config(CASES[name], R, S))
    assert max_diff(ddp, ref) < TOL, f"{name}: DDP path against the reference"


@slow
def test_one_model_of_bytes_per_replica(runs):
    model_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    for name in CASES:
        ddp, fsdp = _outs(runs, name, "ddp"), _outs(runs, name, "fsdp")
        for r in range(R):
            mine = slice(r * S, (r + 1) * S)
            sent = sum(o["bytes"] for o in ddp[mine])
            assert sent == sum(o["bytes"] for o in fsdp[mine]), name
    # DiLoCo sends nothing but the pseudo-gradients: with R = 2 a ring all-reduce sends
    # each byte once, so a replica sends exactly one model per sync (not S models)
    ddp = _outs(runs, "diloco", "ddp")
    syncs = ddp[0]["num_syncs"]
    for r in range(R):
        assert sum(o["bytes"] for o in ddp[r * S:(r + 1) * S]) == syncs * model_bytes


@slow
def test_copies_of_a_replica_identical_at_every_step(runs):
    for name in CASES:
        ddp = _outs(runs, name, "ddp")
        for r in range(R):
            a, b = ddp[r * S], ddp[r * S + 1]
            assert len(a["per_step"]) == CASES[name]["steps"] + 1
            for step, (x, y) in enumerate(zip(a["per_step"], b["per_step"])):
                assert torch.equal(x, y), f"{name}: replica {r} copies differ after step {step}"
        # and every replica ends on the same (global) model
        assert max_diff_runs(ddp[:S], ddp[S:]) == 0.0, name


@slow
def test_blocks_found_through_ddp_and_world_wrapper_refused(runs):
    for r in runs:
        assert all(r["checks"]["blocks_found"])
        assert "replica's own group" in r["checks"]["refused"]


@slow
def test_optimizer_wrapper_resumes_bitwise(runs):
    for r in runs:
        cont, res = r["resume"]["continuous"], r["resume"]["resumed"]
        assert cont["num_syncs"] >= 3 and res["num_syncs"] == cont["num_syncs"]
        assert res["inner_lr"] == cont["inner_lr"]  # the schedule goes on after the load
        for n, p in cont["params"].items():
            assert torch.equal(p, res["params"][n]), n


def test_step_hooks_on_the_optimizer_wrapper(runs):
    """register_step_pre_hook / register_step_post_hook on the wrapper (they raised
    AttributeError: torch's registries come from the Optimizer.__init__ the wrapper does
    not call). Pre hooks run before the engine counts the step, post hooks after it; a
    removed hook is not called again."""
    for r in runs:
        for run in r["resume"].values():
            first = run["first"]
            assert run["hooks"]["pre"] == [first, first + 1]
            assert run["hooks"]["post"] == list(range(first + 1, RESUME_TOTAL + 1))


class _StateOnlyEngine:
    """The engine calls the wrapper's state_dict / load_state_dict make, without a mesh:
    the hooks around them are the wrapper's own book-keeping."""

    rank = 0

    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"ranks": {rank_key(self.rank): {"global_step": 3}}}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


def _wrapper_over_a_fake_engine() -> editrain.StatefulPostLocalSGDOptimizer:
    params = [torch.nn.Parameter(torch.ones(2))]
    return editrain.StatefulPostLocalSGDOptimizer(torch.optim.SGD(params, lr=0.5),
                                                  _StateOnlyEngine())


def test_state_dict_hooks_on_the_optimizer_wrapper():
    """register_state_dict_pre_hook and the three other state-dict registrations raised
    AttributeError on the wrapper (torch's registries come from the Optimizer.__init__ it
    does not call); they now run around the wrapper's own state_dict / load_state_dict,
    the engine's state included, as torch documents them."""
    opt = _wrapper_over_a_fake_engine()
    check_every_registration(opt)
    check_state_dict_hooks(opt)
    assert opt.engine.loaded == [opt.engine.state_dict()]
    # the post hooks see the engine's entry; a load pre hook runs before the entry is
    # checked, so it may adapt a state saved without it
    opt = _wrapper_over_a_fake_engine()
    opt.register_state_dict_post_hook(lambda o, state: state.pop(STATE_KEY) and None)
    plain = opt.state_dict()
    assert STATE_KEY not in plain
    with pytest.raises(ValueError, match="no 'editrain' entry"):
        opt.load_state_dict(plain)
    opt.register_load_state_dict_pre_hook(
        lambda o, state: {**state, STATE_KEY: o.engine.state_dict()})
    opt.load_state_dict(plain)
    assert len(opt.engine.loaded) == 1
