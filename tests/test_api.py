"""The library API: block discovery, reference configs, the engine factory, public docstrings
and the engine state inside a user's own DCP checkpoint (2 gloo processes)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from torch import nn

import editrain
from editrain.api import LocalSGDConfig, OuterOptimizerConfig, edit, sync_config_from_reference
from editrain.config import field_docs
from editrain.spawn import run_ranks
from editrain.sync.config import GTAConfig, SyncConfig
from editrain.units import BLOCK_PATHS, find_blocks


# ----------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TitanStyle(nn.Module):
    """Blocks at ``model.layers`` (editrain's Llama, torchtitan)."""

    def __init__(self, vocab: int = 16, dim: int = 8, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class HFStyle(nn.Module):
    """Blocks at ``model.model.layers`` (Hugging Face causal LMs)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TitanStyle()


class GPT2Style(nn.Module):
    """Blocks at ``model.transformer.h``."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(Block(4) for _ in range(3))


class Nameless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(Block(4) for _ in range(2))


# ----------------------------------------------------------------------------- find_blocks
def test_find_blocks_known_layouts():
    from editrain.models import Llama, preset_config

    llama = Llama(preset_config("tiny", vocab_size=300), seed=0)
    assert find_blocks(llama) == list(llama.layers)
    titan = TitanStyle()
    assert find_blocks(titan) == list(titan.layers)
    hf = HFStyle()
    assert find_blocks(hf) == list(hf.model.layers)
    gpt2 = GPT2Style()
    assert find_blocks(gpt2) == list(gpt2.transformer.h)


def test_find_blocks_explicit_list_and_path():
    m = Nameless()
    assert find_blocks(m, list(m.stages)) == list(m.stages)
    assert find_blocks(m, "stages") == list(m.stages)
    with pytest.raises(ValueError, match="not a non-empty list"):
        find_blocks(m, "nothing.here")
    with pytest.raises(ValueError, match="listed twice"):
        find_blocks(m, [m.stages[0], m.stages[0]])
    with pytest.raises(ValueError, match="not a submodule"):
        find_blocks(m, [Block(4)])
    with pytest.raises(ValueError, match="nested inside another block"):
        find_blocks(m, [m.stages[0], m.stages[0].fc])
    with pytest.raises(ValueError, match="is empty"):
        find_blocks(m, [])


def test_find_blocks_error_names_every_path():
    with pytest.raises(ValueError) as err:
        find_blocks(Nameless())
    msg = str(err.value)
    assert "Nameless" in msg and "model.blocks()" in msg
    for path in BLOCK_PATHS:
        assert f"model.{path}" in msg
    assert "blocks=" in msg  # says how to pass them explicitly


# ----------------------------------------------------------------------------- configs
def test_reference_defaults_map_to_off():
    cfg = sync_config_from_reference(LocalSGDConfig()).resolve()
    assert cfg.method == "edit" and cfg.layerwise
    assert cfg.local_sgd_sync_interval == 1 and cfg.local_sgd_warmup_steps == 0
    # The reference's None / False defaults stay off (the "edit" method defaults are on).
    assert cfg.clip_pseudo_grad == 0.0
    assert cfg.pseudo_gradnorm_reduce is False and cfg.skip_anomaly is False
    assert cfg.outer_optim_class == "none" and cfg.outer_optim_kwargs == {}
    assert cfg.weight_softmax_temperature == 1.0
    assert cfg.min_total_global_steps == 100 and cfg.use_step_weight is False
    assert cfg.gta.reducer is None


def test_reference_readme_example():
    """The configuration of the reference README's FSDP example."""
    cfg = sync_config_from_reference(
        LocalSGDConfig(local_sgd_sync_interval=10, local_sgd_warmup_steps=100,
                       clip_pseudo_grad=10.0, pseudo_gradnorm_reduce=True, skip_anomaly=True,
                       ewma_warmup_steps=10),
        OuterOptimizerConfig(outer_optim_class=torch.optim.SGD,
                             outer_optim_kwargs={"lr": 0.7, "momentum": 0.8, "nesterov": True}),
        GTAConfig(reducer="gta"),
    )
    from editrain.sync.outer import resolve_optimizer_class

    assert resolve_optimizer_class(cfg.outer_optim_class) is torch.optim.SGD
    assert cfg.outer_optim_kwargs == {"lr": 0.7, "momentum": 0.8, "nesterov": True}
    assert (cfg.local_sgd_sync_interval, cfg.local_sgd_warmup_steps) == (10, 100)
    assert cfg.clip_pseudo_grad == 10.0 and cfg.pseudo_gradnorm_reduce and cfg.skip_anomaly
    assert cfg.ewma_warmup_steps == 10 and cfg.gta.reducer == "gta"


def test_reference_async_and_optimizer_forms():
    cfg = sync_config_from_reference(
        LocalSGDConfig(use_async=True, local_sgd_sync_time=30, min_total_global_steps=5,
                       use_step_weight=True, weight_softmax_temperature=0.5),
        OuterOptimizerConfig("adamw", {"lr": 0.1}))
    assert cfg.method == "aedit" and cfg.use_async
    assert cfg.local_sgd_sync_time == 30.0 and cfg.min_total_global_steps == 5
    assert cfg.use_step_weight and cfg.weight_softmax_temperature == 0.5
    assert cfg.outer_optim_class == "adamw"

    class Local(torch.optim.SGD):  # not importable by its path: kept as a class
        pass

    cfg = sync_config_from_reference(LocalSGDConfig(), OuterOptimizerConfig(Local, {"lr": 1}))
    assert cfg.outer_optim_class is Local


def test_reference_config_validation():
    with pytest.raises(ValueError, match="local_sgd_sync_interval"):
        LocalSGDConfig(local_sgd_sync_interval=0)
    with pytest.raises(ValueError, match="ewma_alpha"):
        LocalSGDConfig(ewma_alpha=2.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        LocalSGDConfig(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="outer_optim_class"):
        OuterOptimizerConfig(outer_optim_class="no_such_optimizer")
    with pytest.raises(ValueError, match="outer_optim_kwargs"):
        OuterOptimizerConfig(outer_optim_class="sgd", outer_optim_kwargs=[1])


@pytest.mark.parametrize("make,message", [
    # a computed warm-up of 2.5 steps never ended (the step counter never equals it): the
    # first sync crashed with "sync before anchors exist"
    (lambda: SyncConfig(local_sgd_warmup_steps=2.5),
     "sync.local_sgd_warmup_steps: expected an integer, got 2.5"),
    (lambda: SyncConfig(method="diloco", local_sgd_sync_interval=2.5),  # synced every 3
     "sync.local_sgd_sync_interval: expected an integer, got 2.5"),
    (lambda: SyncConfig(skip_anomaly="false"),  # a true string: the detector was on
     'sync.skip_anomaly: expected true or false, got "false"'),
    (lambda: SyncConfig(ewma_alpha=True), "sync.ewma_alpha: expected a number, got true"),
    (lambda: GTAConfig(density="0.5"), 'sync.gta.density: expected a number, got "0.5"'),
    (lambda: LocalSGDConfig(use_async="false"),  # was A-EDiT
     'LocalSGDConfig.use_async: expected true or false, got "false"'),
    (lambda: LocalSGDConfig(local_sgd_warmup_steps=12.5),
     "LocalSGDConfig.local_sgd_warmup_steps: expected an integer, got 12.5"),
])
def test_configs_built_in_python_check_their_types(make, message):
    """A config built in Python is checked as the config files' loader checks one: each
    bool, int and float option holds its type, and the error names it."""
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == message


def test_configs_built_in_python_take_ints_for_floats_and_none_where_allowed():
    config = SyncConfig(ewma_threshold=3, local_sgd_sync_interval=None, clip_pseudo_grad=None)
    assert config.resolve().local_sgd_sync_interval == 20  # edit's default
    assert LocalSGDConfig(clip_pseudo_grad=1, local_sgd_sync_time=30).clip_pseudo_grad == 1


def _plain(value: Any) -> bool:
    """Exactly a Python bool, int, float, str or None (no numpy or other subclass)."""
    return value is None or type(value) in (bool, int, float, str)


def test_configs_built_in_python_take_numpy_numbers_and_store_plain_ones():
    """``np.arange`` yields ``np.int64`` and a computed lr is often ``np.float32``: both
    were refused ("expected an integer, got np.int64(4)"), and an ``np.float64`` was taken
    but kept, to reach the engine's json state and the run record as numpy."""
    np = pytest.importorskip("numpy")
    sync = SyncConfig(method="diloco", local_sgd_sync_interval=np.arange(1, 5)[3],
                      local_sgd_warmup_steps=np.int32(2), ewma_alpha=np.float32(0.25),
                      ewma_threshold=np.int64(3), local_sgd_sync_time=np.float64(30.0),
                      outer_optim_kwargs={"lr": np.float32(0.5), "momentum": np.float64(0.9),
                                          "nesterov": True},
                      gta=GTAConfig(density=np.float64(0.5)))
    assert sync.local_sgd_sync_interval == 4 and sync.local_sgd_warmup_steps == 2
    assert sync.ewma_alpha == 0.25 and sync.ewma_threshold == 3.0
    assert sync.outer_optim_kwargs == {"lr": 0.5, "momentum": pytest.approx(0.9),
                                       "nesterov": True}
    for value in [*dataclasses.asdict(sync).values(), *sync.outer_optim_kwargs.values(),
                  *dataclasses.asdict(sync.gta).values()]:
        if not isinstance(value, dict):
            assert _plain(value), value
    assert type(sync.ewma_threshold) is float  # an int given for a float, as a file's
    assert type(sync.resolve().local_sgd_sync_interval) is int
    reference = LocalSGDConfig(local_sgd_sync_interval=np.int64(4), ewma_alpha=np.float32(0.5),
                               min_total_global_steps=np.uint8(7))
    assert type(reference.local_sgd_sync_interval) is int
    assert type(reference.min_total_global_steps) is int
    assert type(reference.ewma_alpha) is float
    assert sync_config_from_reference(reference).local_sgd_sync_interval == 4


def test_numpy_numbers_in_outer_kwargs_are_range_checked():
    """A numpy lr of 0 skipped the outer optimizer's range check (not an int or float)."""
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError) as e:
        SyncConfig(method="diloco", outer_optim_kwargs={"lr": np.float32(0.0)})
    assert str(e.value).startswith("sync.outer_optim_kwargs.lr: must be > 0")
    with pytest.raises(ValueError, match="sync.outer_optim_kwargs.lr: must be a finite"):
        SyncConfig(method="diloco", outer_optim_kwargs={"lr": np.float64("nan")})


@pytest.mark.parametrize("make, message", [
    (lambda np: SyncConfig(local_sgd_warmup_steps=True),
     "sync.local_sgd_warmup_steps: expected an integer, got true"),
    (lambda np: SyncConfig(local_sgd_warmup_steps=np.True_),
     "sync.local_sgd_warmup_steps: expected an integer, got np.True_ (a numpy.bool: pass a "
     "plain Python value, e.g. value.item())"),
    (lambda np: LocalSGDConfig(local_sgd_sync_interval=np.float64(2.5)),
     "LocalSGDConfig.local_sgd_sync_interval: expected an integer, got np.float64(2.5)"),
    (lambda np: SyncConfig(ewma_alpha=np.bool_(False)),
     "sync.ewma_alpha: expected a number, got np.False_ (a numpy.bool: pass a plain Python "
     "value, e.g. value.item())"),
    # a tensor is no config value, not even a 0-dim one (it may sit on a GPU): refused,
    # saying what to pass
    (lambda np: SyncConfig(local_sgd_warmup_steps=torch.tensor(3)),
     "sync.local_sgd_warmup_steps: expected an integer, got tensor(3) (a torch.Tensor: pass "
     "a plain Python value, e.g. value.item())"),
    (lambda np: GTAConfig(density=np.array(0.5)),
     "sync.gta.density: expected a number, got array(0.5) (a numpy.ndarray: pass a plain "
     "Python value, e.g. value.item())"),
])
def test_configs_built_in_python_refuse_bools_and_tensors_for_numbers(make, message):
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError) as e:
        make(np)
    assert str(e.value) == message


@pytest.mark.parametrize("option,least", [
    ("local_sgd_sync_interval", 1), ("local_sgd_warmup_steps", 0), ("overlap_steps", 0),
    ("fragments", 1), ("topk_chunk", 1), ("topk_k", 1)])
def test_every_count_of_the_sync_config_is_checked_in_the_same_words(option, least):
    """overlap_steps, fragments, topk_chunk and topk_k checked their type again by hand,
    worded their own way ("sync.fragments: must be an integer >= 1, got 0") beside every
    other count's "must be >= 1, got 0"; their type is errors.plain_scalar's (check_types),
    as every option's: one wording for the type, one for the range."""
    np = pytest.importorskip("numpy")
    base = dict(comm_dtype="topk2") if option.startswith("topk") else {}
    with pytest.raises(ValueError) as e:
        SyncConfig(**base, **{option: least - 1})
    assert str(e.value) == f"sync.{option}: must be >= {least}, got {least - 1}"
    for wrong in (least + 0.5, True, np.float64(least)):
        with pytest.raises(ValueError) as e:
            SyncConfig(**base, **{option: wrong})
        said = "true" if wrong is True else repr(wrong)  # as a file writes it; numpy's repr
        assert str(e.value) == f"sync.{option}: expected an integer, got {said}"


def test_edit_factory_rejects_mixed_configs():
    model = TitanStyle()
    with pytest.raises(ValueError, match="not both"):
        edit(model, None, SyncConfig(), local_sgd_config=LocalSGDConfig())
    with pytest.raises(ValueError, match="once"):
        edit(model, None, LocalSGDConfig(), local_sgd_config=LocalSGDConfig())
    with pytest.raises(ValueError, match="go with a LocalSGDConfig"):
        edit(model, None, SyncConfig(), gta_config=GTAConfig())
    with pytest.raises(TypeError, match="SyncConfig or a LocalSGDConfig"):
        edit(model, None, {"method": "edit"})


# ----------------------------------------------------------------------------- docstrings
def _own(obj: object) -> bool:
    return (getattr(obj, "__module__", "") or "").startswith("editrain")


def _has_params(fn: object) -> bool:
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return any(p.name not in ("self", "cls") for p in sig.parameters.values())


def _doc(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    name = getattr(obj, "__name__", "")
    if inspect.isclass(obj) and doc.startswith(f"{name}("):
        return ""  # the signature dataclasses write when a class has no docstring
    return doc


def test_every_public_name_is_documented():
    """``editrain.__all__`` and the public methods of its classes: docstrings everywhere,
    ``Args:`` on callables with parameters (config classes document fields one by one)."""
    offenders: list[str] = []
    for name in editrain.__all__:
        obj = getattr(editrain, name)
        if name == "__version__":
            continue
        if not _doc(obj):
            offenders.append(f"{name}: no docstring")
            continue
        if inspect.isclass(obj):
            if dataclasses.is_dataclass(obj):
                documented = field_docs(obj)
                for f in dataclasses.fields(obj):
                    if f.name not in documented and f.name not in _doc(obj):
                        offenders.append(f"{name}.{f.name}: field not documented")
            elif _has_params(obj.__init__) and "Args:" not in _doc(obj):
                offenders.append(f"{name}: no Args: section")
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                target = member.fget if isinstance(member, property) else member
                if not (inspect.isfunction(target) or isinstance(member, property)):
                    continue
                if not _own(target) or not _doc(target):
                    offenders.append(f"{name}.{attr}: no docstring")
        elif callable(obj) and _has_params(obj) and "Args:" not in _doc(obj):
            offenders.append(f"{name}: no Args: section")
    assert not offenders, "undocumented public API:\n  " + "\n  ".join(offenders)


def test_exports_resolve_lazily_and_completely():
    assert set(editrain.__all__) - {"__version__"} == set(editrain._EXPORTS)
    for name in editrain.__all__:
        assert getattr(editrain, name) is not None
    assert set(editrain.__all__) <= set(dir(editrain))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        editrain.nope  # noqa: B018


# ----------------------------------------------------------------------------- DCP round trip
SAVE_AT, TOTAL = 5, 9


def _batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(16, (4, 9), generator=gen)


def _dcp_worker(rank: int, world: int, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    # Penalty on with a short detector warm-up, Nesterov outer SGD: every kind of state.
    config = SyncConfig(method="edit", local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                        ewma_warmup_steps=1, ewma_alpha=0.5, clip_pseudo_grad=1.0,
                        outer_optim_kwargs={"lr": 0.7, "momentum": 0.9, "nesterov": True})

    def build():
        torch.manual_seed(0)
        model = TitanStyle(dim=8, n=2)
        editrain.parallelize(model, info)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        return model, opt, editrain.edit(model, info, config)

    def train(model, opt, engine, steps) -> list[float]:
        losses = []
        for step in steps:
            x = _batch(step, rank)
            loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            engine.after_backward()
            opt.step()
            opt.zero_grad()
            engine.step()
            losses.append(loss.item())
        return losses

    def user_state(model, opt, engine, template=None):
        # Replicas differ between syncs: each replica's live state under its own key.
        return {f"replica{info.replica}": {"model": get_model_state_dict(model),
                                           "optim": get_optimizer_state_dict(model, opt)},
                "editrain": template if template is not None
                else editrain.engine_state_dict(engine, model)}

    def snapshot(model):
        return [p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone()
                for p in model.parameters()]

    model, opt, engine = build()
    train(model, opt, engine, range(SAVE_AT))
    pending = engine.sync_pending
    dcp.save(user_state(model, opt, engine), checkpoint_id=ckpt)
    tail = train(model, opt, engine, range(SAVE_AT, TOTAL))
    engine.finish(force=True)
    expected = snapshot(model), engine.num_syncs
    engine.close()

    model, opt, engine = build()
    template = editrain.engine_state_template(engine, model, ckpt)
    state = user_state(model, opt, engine, template)
    dcp.load(state, checkpoint_id=ckpt)
    mine = state[f"replica{info.replica}"]
    set_model_state_dict(model, mine["model"])
    set_optimizer_state_dict(model, opt, mine["optim"])
    editrain.load_engine_state_dict(engine, model, state["editrain"])
    resumed = train(model, opt, engine, range(SAVE_AT, TOTAL))
    engine.finish(force=True)
    got = snapshot(model), engine.num_syncs
    outer_keys = sorted(engine.units[1].outer.state[engine.units[1].anchor])
    engine.close()
    same_params = all(torch.equal(a, b) for a, b in zip(expected[0], got[0]))
    return {"pending": pending, "tail": tail, "resumed": resumed, "same_params": same_params,
            "syncs": (expected[1], got[1]), "outer_keys": outer_keys}


def test_engine_state_in_user_dcp_checkpoint_resumes_bitwise(tmp_path):
    results = run_ranks(_dcp_worker, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["pending"], "the save point should have a layer-wise sync armed"
        assert r["outer_keys"] == ["momentum_buffer"]
        assert r["resumed"] == r["tail"]  # bitwise: float equality of every loss
        assert r["same_params"]
        assert r["syncs"][0] == r["syncs"][1] >= 3
    assert results[0]["tail"] != results[1]["tail"]  # replicas really trained apart


def _attach_worker(rank: int, world: int) -> dict[str, Any]:
    """The same run twice: the loop calls after_backward() and step(), or the engine is
    attached to the optimizer and the loop calls neither."""
    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    config = SyncConfig(method="edit", local_sgd_sync_interval=2, local_sgd_warmup_steps=2)
    out: dict[str, Any] = {}
    for attached in (False, True):
        torch.manual_seed(0)
        model = TitanStyle(dim=8, n=2)
        editrain.parallelize(model, info)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        engine = editrain.edit(model, info, config)
        handles = engine.attach(opt) if attached else []
        for step in range(7):
            x = _batch(step, rank)
            nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1),
                                        x[:, 1:].flatten()).backward()
            if not attached:
                engine.after_backward()
            opt.step()
            opt.zero_grad()
            if not attached:
                engine.step()
        engine.finish(force=True)
        out[f"attached={attached}"] = ([p.detach().clone() for p in model.parameters()],
                                       engine.num_syncs, engine.global_step)
        engine.close()
    # close() removed the optimizer's hooks too: the optimizer steps on without the engine,
    # and a loop call on the closed engine is refused with a clear error.
    x = _batch(7, rank)
    nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    out["after_close"] = {"global_step": engine.global_step, "hooks": len(handles)}
    for call in (engine.step, engine.after_backward, engine.finish):
        try:
            call()
        except RuntimeError as e:
            out["after_close"][call.__name__] = str(e)
    return out


def test_an_engine_attached_to_the_optimizer_trains_like_the_explicit_loop():
    for r in run_ranks(_attach_worker, 2):
        plain, attached = r["attached=False"], r["attached=True"]
        assert plain[1:] == attached[1:] == (3, 7)
        assert all(torch.equal(a, b) for a, b in zip(plain[0], attached[0]))
        closed = r["after_close"]
        assert closed["global_step"] == 7 and closed["hooks"] == 2
        for call in ("step", "after_backward", "finish"):
            assert closed[call].startswith(f"engine.{call}(): the engine is closed"), closed


def _parallelize_worker(rank: int, world: int) -> dict[str, bool]:
    from torch.distributed.tensor import DTensor

    import editrain
    from editrain.models import Llama, preset_config

    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")

    def sharded(**kwargs) -> bool:
        model = Llama(preset_config("tiny"), seed=0)
        editrain.parallelize(model, info, model.blocks(), **kwargs)
        kinds = {isinstance(p, DTensor) for p in model.parameters()}
        assert len(kinds) == 1  # all or nothing
        return kinds.pop()

    return {"fp32": sharded(), "bf16": sharded(precision="bf16"),
            "forced": sharded(shard=True), "refused": sharded(shard=False, precision="bf16")}


def test_one_process_replica_is_left_unsharded():
    """Shard size 1 in fp32: plain parameters (no FSDP2 tax); bf16 keeps FSDP2 for its
    mixed-precision casting; ``shard`` overrides the choice."""
    from editrain.spawn import run_ranks

    out, = run_ranks(_parallelize_worker, 1)
    assert out == {"fp32": False, "bf16": True, "forced": True, "refused": False}


class PartlyTrained(nn.Module):
    """Frozen embeddings, a layer only replica 0 uses, a layer nobody uses."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(8) for _ in range(2))
        self.extra = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.embed(tokens)
        if use_extra:
            h = h + self.extra(h)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _missing_grads_worker(rank: int, world: int) -> dict[str, Any]:
    """Warm-up steps of AdamW with weight decay on 2 replicas of PartlyTrained."""
    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    torch.manual_seed(0)
    model = PartlyTrained()
    editrain.parallelize(model, info)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    engine = editrain.edit(model, info, SyncConfig(method="edit", local_sgd_sync_interval=2,
                                                   local_sgd_warmup_steps=3))
    out: dict[str, Any] = {}
    for step in range(3):
        x = _batch(step, rank)
        nn.functional.cross_entropy(model(x[:, :-1], use_extra=rank == 0).flatten(0, 1),
                                    x[:, 1:].flatten()).backward()
        if step == 0:
            g = model.extra.weight.grad
            out["extra_own"] = None if g is None else g.clone()
        engine.after_backward()
        if step == 0:
            out["extra_avg"] = model.extra.weight.grad.clone()
            out["none_after"] = [n for n, p in model.named_parameters() if p.grad is None]
        opt.step()
        opt.zero_grad()
        engine.step()
    out["moved"] = sorted(n for n, p in model.named_parameters()
                          if not torch.equal(p.detach(), start[n]))
    engine.close()
    return out


def test_warmup_averaging_leaves_frozen_and_unused_parameters_alone():
    """Warm-up averaging treats a missing gradient as DDP does: zero where another replica
    has one (the average), None where no replica has one (frozen or unused), so AdamW's
    weight decay and momentum leave those parameters exactly as they were. Before, every
    missing gradient became a zero gradient and AdamW moved them."""
    first, second = run_ranks(_missing_grads_worker, 2)
    for r in (first, second):
        assert r["none_after"] == ["embed.weight", "unused.weight", "unused.bias"]
        assert r["moved"] == ["extra.bias", "extra.weight", "head.weight", "layers.0.fc.bias",
                              "layers.0.fc.weight", "layers.1.fc.bias", "layers.1.fc.weight"]
        # bitwise: g + 0 and g / 2 are exact
        assert torch.equal(r["extra_avg"], first["extra_own"] / 2)
    assert second["extra_own"] is None


def _second_engine_worker(rank: int, world: int) -> dict[str, Any]:
    """A second engine on a model whose engine is live is refused; once that one is
    closed (explicitly or by its with block) the model takes a new one."""
    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    torch.manual_seed(0)
    model = TitanStyle(dim=8, n=2)
    editrain.parallelize(model, info)
    config = SyncConfig(method="diloco", local_sgd_sync_interval=1)
    out: dict[str, Any] = {"refused": []}
    first = editrain.edit(model, info, config)
    for target, blocks in ((model, None), (model.layers, list(model.layers))):
        try:
            editrain.edit(target, info, config, blocks=blocks).close()
        except RuntimeError as e:
            out["refused"].append(str(e))
    first.close()
    with editrain.edit(model, info, config) as second:  # the closed engine's model
        x = _batch(0, rank)
        nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        second.step()
        out["second_syncs"] = second.num_syncs
    third = editrain.edit(model, info, config)  # after the with block closed it
    out["third_open"] = not third.closed
    third.close()
    return out


def test_a_second_live_engine_on_one_model_is_refused():
    out, = run_ranks(_second_engine_worker, 1)
    assert len(out["refused"]) == 2, out  # the model, and its blocks under another root
    for message in out["refused"]:
        assert "already has a live sync engine" in message and "engine.close()" in message
        assert "\n" not in message
    assert out["second_syncs"] == 1 and out["third_open"]


class NormedBlock(nn.Module):
    """A block with BatchNorm: running statistics (float) and a step counter (int64) that
    every training forward changes, and a non-persistent scratch buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.register_buffer("scratch", torch.zeros(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x).flatten(0, 1)).view_as(x)
        if self.training:
            self.scratch.copy_(h.detach()[0, 0])  # this replica's own, never synced
        return x + torch.tanh(h)


class Normed(TitanStyle):
    def __init__(self) -> None:
        super().__init__(dim=8, n=2)
        self.layers = nn.ModuleList(NormedBlock(8) for _ in range(2))


def _buffers_worker(rank: int, world: int) -> dict[str, Any]:
    """Each method trains 2 replicas of Normed on different data, then finish(force=True)."""
    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    out: dict[str, Any] = {}
    for method, steps in (("diloco", 3), ("edit", 4), ("sync", 2)):
        torch.manual_seed(0)
        model = Normed()
        editrain.parallelize(model, info)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        config = SyncConfig(method=method) if method == "sync" else SyncConfig(
            method=method, local_sgd_sync_interval=2, local_sgd_warmup_steps=0)
        with editrain.edit(model, info, config) as engine:
            engine.attach(opt)
            for step in range(steps):
                x = _batch(step, rank)
                nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1),
                                            x[:, 1:].flatten()).backward()
                opt.step()
                opt.zero_grad()
            before = {n: b.clone() for n, b in model.named_buffers()}
            engine.finish(force=True)
            out[method] = {"before": before, "synced": engine.buffers.names,
                           "after": {n: b.clone() for n, b in model.named_buffers()}}
    return out


def test_every_sync_leaves_the_replicas_with_the_same_buffers():
    """Before, BatchNorm's running statistics (and any buffer a forward changes) stayed each
    replica's own, even after finish(force=True): the global model evaluated differently
    on every replica. Now floating buffers are averaged and the others taken from replica
    0 at every sync; non-persistent buffers (derived, as Llama's rotary tables) are not."""
    first, second = run_ranks(_buffers_worker, 2)
    for method in ("diloco", "edit", "sync"):
        a, b = first[method], second[method]
        assert a["synced"] == [f"layers.{i}.norm.{n}" for i in range(2) for n in
                               ("running_mean", "running_var", "num_batches_tracked")]
        stat = "layers.0.norm.running_mean"
        assert not torch.equal(a["before"][stat], b["before"][stat]), method  # trained apart
        for name in a["synced"]:
            assert torch.equal(a["after"][name], b["after"][name]), (method, name)
        # bitwise the mean of what the replicas held (no forward between: the same sum of
        # two and halving, gloo's sum of two being the one rounding of a + b)
        assert torch.equal(a["after"][stat], (a["before"][stat] + b["before"][stat]) / 2)
        assert torch.equal(a["after"]["layers.0.norm.num_batches_tracked"],
                           a["before"]["layers.0.norm.num_batches_tracked"])
        assert not torch.equal(a["after"]["layers.0.scratch"], b["after"]["layers.0.scratch"])


def _three_replica_buffers_worker(rank: int, world: int) -> dict[str, Any]:
    """BufferSync over 3 replicas of one module: a buffer they agree on, one they do not."""
    from editrain.sync.buffers import BufferSync
    from editrain.sync.comm import CommPath

    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    module = nn.Module()
    module.register_buffer("same", torch.full((4,), 0.123456789))
    module.register_buffer("apart", torch.full((4,), 0.1 * (rank + 1)))
    comm = CommPath(info.mesh.get_group("sync"), info.mesh.get_group("shard"),
                    torch.device("cpu"))
    try:
        BufferSync(module, comm, replica=rank).sync()
    finally:
        comm.close()
    return {n: b.clone() for n, b in module.named_buffers()}


def test_buffers_the_replicas_agree_on_stay_bitwise():
    """A buffer every replica holds the same value of is kept as it is: over 3 replicas the
    sum of three float32 0.123456789s divided by 3 is one ulp off it, and a mean at every sync
    moved a constant buffer; one they differ on is their mean, on every replica."""
    got = run_ranks(_three_replica_buffers_worker, 3)
    same = torch.full((4,), 0.123456789)
    assert ((same + same + same) / 3 != same).all()  # what the plain mean gave
    for out in got:
        assert torch.equal(out["same"], same)
        assert torch.equal(out["apart"], got[0]["apart"])
        assert torch.allclose(out["apart"], torch.full((4,), 0.2))  # (0.1+0.2+0.3)/3


def _nonblocking_buffers_worker(rank: int, world: int) -> dict[str, Any]:
    """Non-blocking A-EDiT on Normed, replicas at 2 and 3 steps per window: each merges a
    round at a step of its own."""
    from editrain.sync import StepScheduleTrigger

    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    torch.manual_seed(0)
    model = Normed()
    editrain.parallelize(model, info)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    schedule = [2, 3]
    config = SyncConfig(method="aedit", overlap_steps=2, local_sgd_warmup_steps=0)
    with editrain.edit(model, info, config, trigger=StepScheduleTrigger(schedule)) as engine:
        engine.attach(opt)
        for step in range(4 * schedule[info.replica]):
            x = _batch(step, rank)
            nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1),
                                        x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        engine.finish(force=True)
        return {"syncs": engine.num_syncs,
                "buffers": {n: b.clone() for n, b in model.named_buffers()
                            if n in engine.buffers.names}}


@pytest.mark.timeout(90)
def test_nonblocking_aedit_syncs_buffers_at_the_end_only():
    """A buffer sync after each merge deadlocked non-blocking A-EDiT: a replica that merged
    and launched at one boundary queued the next rendezvous before the buffers, the other
    the buffers first. The buffers agree at finish(force=True)."""
    first, second = run_ranks(_nonblocking_buffers_worker, 2)
    assert first["syncs"] == second["syncs"] >= 3
    for name, value in first["buffers"].items():
        assert torch.equal(value, second["buffers"][name]), name


class _NoPeers:
    """A fault-tolerant cross-replica group that is never asked for a collective: the
    engine is only built (before any quorum, a replica is alone)."""

    size = 1

    def __init__(self, replica: int) -> None:
        self.replica, self.replicas = replica, 2

    def register_state(self, key: str, state_dict: Any, load_state_dict: Any) -> None:
        pass


def _ft_buffers_worker(rank: int, world: int) -> dict[str, list[str]]:
    """The warnings of engines built in the fault-tolerant mode (replica 0 and 1) and in the
    plain mode over Normed, and in the fault-tolerant mode over a model without buffers."""
    import logging

    info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu")
    config = SyncConfig(method="diloco", local_sgd_sync_interval=2, local_sgd_warmup_steps=0)
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("editrain").addHandler(handler)
    out: dict[str, list[str]] = {}
    try:
        for case, make, cross in (("ft_replica0", Normed, _NoPeers(0)),
                                  ("ft_replica1", Normed, _NoPeers(1)),
                                  ("plain", Normed, None),
                                  ("ft_no_buffers", TitanStyle, _NoPeers(0))):
            said.clear()
            model = make()
            editrain.parallelize(model, info)
            with editrain.edit(model, info, config, cross_replica=cross) as engine:
                out[case] = [*said, f"left alone: {engine.buffers.left_alone}"]
    finally:
        logging.getLogger("editrain").removeHandler(handler)
    return out


def test_ft_warns_once_that_floating_buffers_stay_each_replicas_own():
    """The fault-tolerant mode does not sync buffers (a round's vote may differ between
    replicas, and a heal carries no buffers): a model with floating persistent buffers
    (BatchNorm's running statistics) used to train there without a word, each replica's
    global model evaluating on statistics of its own. Now the first rank of replica 0
    warns once, naming the option, when the engine is built; a replica other than 0, the
    plain mode (which syncs them) and a model without persistent buffers (editrain's
    Llama: its rotary tables are not persistent) say nothing."""
    from editrain.models import Llama, preset_config
    from editrain.sync.buffers import persistent_buffer_names

    out, = run_ranks(_ft_buffers_worker, 1)
    floating = [f"layers.{i}.norm.{n}" for i in range(2) for n in ("running_mean", "running_var")]
    warning, = out["ft_replica0"][:-1]
    assert warning.startswith("dist.fault_tolerance = 'torchft' (--ft): the model's floating "
                              "persistent buffers (layers.0.norm.running_mean, "
                              "layers.0.norm.running_var, layers.1.norm.running_mean and 1 "
                              "more) are not synced across replica groups"), warning
    assert out["ft_replica0"][-1] == out["ft_replica1"][-1] == f"left alone: {floating}"
    assert out["ft_replica1"] == [f"left alone: {floating}"]
    assert out["plain"] == ["left alone: []"]
    assert out["ft_no_buffers"] == ["left alone: []"]
    assert persistent_buffer_names(Llama(preset_config("tiny", vocab_size=64))) == []


def test_ft_buffer_warning_comes_from_the_first_rank_of_each_stage():
    """With pipeline stages each stage's model holds the buffers of its own layers: the
    fault-tolerant warning about them comes from the first rank (shard 0, tp 0) of every
    stage of replica group 0, once per stage, and names the stage. Before, only global
    rank 0 (stage 0) could warn: buffers of a later stage were never named."""
    from editrain.sync.buffers import unsynced_buffers_warning, warns_for_its_stage
    from editrain.topology import Topology

    topo = Topology(world_size=8, shard_size=2, pp_size=2)  # 2 replicas x 2 stages x 2
    assert [r for r in range(8) if warns_for_its_stage(topo, r, topo.replica_of(r))] == [0, 2]
    # a fault-tolerant group's job is one replica: its own index decides
    group = Topology(world_size=4, shard_size=1, tp_size=2, pp_size=2)
    assert [r for r in range(4) if warns_for_its_stage(group, r, 0)] == [0, 2]
    assert not any(warns_for_its_stage(group, r, 1) for r in range(4))
    flat = Topology(world_size=2, shard_size=2)
    assert [r for r in range(2) if warns_for_its_stage(flat, r, 0)] == [0]
    said = unsynced_buffers_warning(["norm.running_mean"], stage=1)
    assert "buffers (pipeline stage 1) (norm.running_mean) are not synced" in said
