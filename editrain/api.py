"""The public library API: EDiT in your own training loop, with your own model.

Five calls wrap any loop (see ``examples/custom_loop.py``)::

    info = editrain.init_mesh(shard_size=2)              # ("sync", "shard") DeviceMesh
    blocks = editrain.parallelize(model, info)           # FSDP2 per block + root
    opt = torch.optim.AdamW(model.parameters())
    with editrain.edit(model, info, editrain.SyncConfig(method="edit")) as engine:
        for batch in data:
            loss_fn(model(batch)).backward()
            engine.after_backward()
            opt.step(); opt.zero_grad()
            engine.step()
        engine.finish(force=True)                          # every replica ends on the global model
    editrain.shutdown()                                    # every rank, after the engine closed

The engine can also be configured with the EDiT reference's own classes
(:class:`LocalSGDConfig`, :class:`OuterOptimizerConfig`, :class:`GTAConfig`), and its state
saved alongside the user's own ``torch.distributed.checkpoint`` state dict
(:func:`engine_state_dict`, :func:`engine_state_template`, :func:`load_engine_state_dict`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from editrain.checkpoint import saved_tensors
from editrain.errors import CheckpointError, spelled
from editrain.sync.config import GTAConfig, SyncConfig, check_types
from editrain.sync.edit import EDiT, SyncEngine
from editrain.sync.outer import resolve_optimizer_class
from editrain.sync.setup import root_leaf_units
from editrain.topology import PP_DIM, SHARD_DIM, TP_DIM, MeshInfo, init_mesh
from editrain.units import find_blocks

# ================================================================== reference-style config


@dataclass
class LocalSGDConfig:
    """The EDiT reference's ``LocalSGDConfig``: same names, same defaults, same meaning.

    Convert it with :func:`sync_config_from_reference` (or pass it to :func:`edit`). The
    reference's ``None`` defaults mean "off" and map to editrain's off values.
    """

    use_async: bool = False
    """Use A-EDiT (time-based syncs, method "aedit") instead of EDiT (method "edit")."""
    local_sgd_sync_interval: int = 1
    """EDiT: inner steps between two syncs."""
    local_sgd_sync_time: float = 600.0
    """A-EDiT: seconds between two syncs."""
    min_total_global_steps: int = 100
    """A-EDiT: skip a sync when all replicas together did fewer inner steps since the last."""
    use_step_weight: bool = False
    """A-EDiT: also weight replicas by their number of inner steps since the last sync."""
    step_weight_ratio: float = 0.5
    """A-EDiT: share of the step weights in the mixed replica weights, in [0, 1]."""
    local_sgd_warmup_steps: int = 0
    """Synchronous steps before the local phase starts."""
    gradient_accumulation_steps: int = 1
    """Informational: editrain counts optimizer steps (one ``engine.step()`` each), so
    gradient accumulation needs no setting here."""
    clip_pseudo_grad: float | None = None
    """Clip each unit's reduced pseudo-gradient to this norm (None: off)."""
    pseudo_gradnorm_reduce: bool = False
    """Weight replicas by softmax(-norm / T) of their pseudo-gradient norms."""
    weight_softmax_temperature: float | None = None
    """T of that softmax (None: 1.0)."""
    skip_anomaly: bool = False
    """Exclude replicas whose pseudo-gradient norm is an EWMA outlier."""
    ewma_alpha: float = 0.02
    """Anomaly detector: EWMA smoothing factor in (0, 1]."""
    ewma_warmup_steps: int = 120
    """Anomaly detector: syncs observed before it may flag anything."""
    ewma_threshold: float = 3.0
    """Anomaly detector: z-score threshold."""
    cpu_offload: bool = False
    """Keep anchors and outer optimizer state in CPU memory between syncs."""
    is_debug: bool = False
    """Informational: editrain never prints from the engine; every sync's clip factors,
    weights and anomaly flags are in ``engine.pop_sync_log()``."""

    def __post_init__(self) -> None:
        check_types(self, "LocalSGDConfig")  # e.g. use_async="false" would mean A-EDiT
        if self.gradient_accumulation_steps < 1:
            raise ValueError("LocalSGDConfig.gradient_accumulation_steps: must be >= 1, got "
                             f"{self.gradient_accumulation_steps}")
        sync_config_from_reference(self)  # every other value is checked by SyncConfig


@dataclass
class OuterOptimizerConfig:
    """The EDiT reference's ``OuterOptimizerConfig``: the optimizer over the anchors."""

    outer_optim_class: type[torch.optim.Optimizer] | str | None = None
    """A ``torch.optim.Optimizer`` subclass, or a name ("sgd", "adam", "adamw", "agd", a
    dotted path); None: plain model averaging."""
    outer_optim_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the outer optimizer, e.g. {"lr": 0.7, "momentum": 0.8,
    "nesterov": True}."""

    def __post_init__(self) -> None:
        try:
            resolve_optimizer_class(self.outer_optim_class)
        except ValueError as e:
            raise ValueError(f"OuterOptimizerConfig.{e}") from None
        if not isinstance(self.outer_optim_kwargs, dict):
            raise ValueError("OuterOptimizerConfig.outer_optim_kwargs: must be a dict, got "
                             f"{type(self.outer_optim_kwargs).__name__}")


def _optimizer_name(cls: type | str | None) -> str | type:
    """A config value for ``SyncConfig.outer_optim_class``: a name, a dotted path, or (for a
    class that cannot be imported by its path) the class itself."""
    if cls is None:
        return "none"
    if isinstance(cls, str):
        return cls
    path = f"{cls.__module__}.{cls.__qualname__}"
    try:
        if resolve_optimizer_class(path) is cls:
            return path
    except ValueError:
        pass
    return cls  # e.g. a class defined inside a function; the engine accepts it as is


def sync_config_from_reference(
    local_sgd: LocalSGDConfig,
    outer: OuterOptimizerConfig | None = None,
    gta: GTAConfig | None = None,
) -> SyncConfig:
    """Translate the EDiT reference's three config objects into one :class:`SyncConfig`.

    The method is "aedit" when ``use_async`` is set, else "edit" (layer-wise sync). Values
    the reference leaves at ``None`` are off here: no clipping, no outer optimizer (plain
    averaging), temperature 1.0. Unlike ``SyncConfig(method="edit")``, whose penalty and
    outer optimizer defaults are on, nothing is switched on that the reference config
    leaves off.

    Args:
        local_sgd: the reference's ``LocalSGDConfig``.
        outer: the reference's ``OuterOptimizerConfig``; None means plain averaging.
        gta: the reducer options; None means the weighted mean.

    Returns:
        A validated :class:`SyncConfig`.

    Raises:
        ValueError: a value out of range (the message names the option).
    """
    ls = local_sgd
    outer = outer if outer is not None else OuterOptimizerConfig()
    try:
        return SyncConfig(
            method="aedit" if ls.use_async else "edit",
            local_sgd_sync_interval=ls.local_sgd_sync_interval,
            local_sgd_warmup_steps=ls.local_sgd_warmup_steps,
            outer_optim_class=_optimizer_name(outer.outer_optim_class),  # type: ignore[arg-type]
            outer_optim_kwargs=dict(outer.outer_optim_kwargs),
            cpu_offload=ls.cpu_offload,
            layerwise=True,
            clip_pseudo_grad=0.0 if ls.clip_pseudo_grad is None else float(ls.clip_pseudo_grad),
            pseudo_gradnorm_reduce=ls.pseudo_gradnorm_reduce,
            weight_softmax_temperature=(1.0 if ls.weight_softmax_temperature is None
                                        else float(ls.weight_softmax_temperature)),
            skip_anomaly=ls.skip_anomaly,
            ewma_alpha=ls.ewma_alpha,
            ewma_warmup_steps=ls.ewma_warmup_steps,
            ewma_threshold=float(ls.ewma_threshold),
            local_sgd_sync_time=float(ls.local_sgd_sync_time),
            min_total_global_steps=ls.min_total_global_steps,
            use_step_weight=ls.use_step_weight,
            step_weight_ratio=ls.step_weight_ratio,
            gta=gta if gta is not None else GTAConfig(),
        )
    except ValueError as e:
        raise ValueError(f"LocalSGDConfig: {e}") from None


# ================================================================== sharding and the engine


def _device_mesh(mesh: DeviceMesh | MeshInfo) -> DeviceMesh:
    return mesh.mesh if isinstance(mesh, MeshInfo) else mesh


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | MeshInfo,
    blocks: Sequence[nn.Module] | str | None = None,
    precision: str | MixedPrecisionPolicy = "fp32",
    split_root: bool = True,
    shard: bool | None = None,
) -> list[nn.Module]:
    """Shard ``model`` with FSDP2 the way EDiT needs: one unit per block, plus the root.

    On a ``("sync", "shard", "tp")`` mesh the blocks are first split over ``tp`` by
    :func:`editrain.models.tensor_parallel.tensor_parallel` (the built-in Llama and Hugging
    Face Llama-family blocks); FSDP2 then shards over ``shard`` as usual.

    With pipeline stages (a ``("sync", "pp", "shard", "tp")`` mesh) pass this rank's stage
    (e.g. :class:`editrain.pipeline.LlamaStage`) as ``model``: its blocks and its own
    embeddings or head are sharded over the stage's ``shard`` ranks, and :func:`edit` on
    it builds the engine of that stage.

    A replica of one process (shard size 1) in fp32 is left unsharded by default: its
    parameters stay ordinary tensors, so a step costs what a bare training loop costs
    (FSDP2 on one rank only adds work: ~20% on forward and backward and a 2x slower
    optimizer step, measured). The engine syncs a plain model the same way, with the root
    (embeddings and output head included) as one unit. bf16 keeps FSDP2, whose
    ``MixedPrecisionPolicy`` does the casting.

    With ``split_root`` every ``nn.Embedding`` and ``nn.Linear`` outside the blocks whose
    parameters no other module uses (the token embeddings and an untied output head) is a
    unit of its own too, so the root unit no longer carries most of the bytes: the engine
    syncs each such unit separately, and a layer-wise sync waits for the output head only
    when the forward reaches it.

    Works for any model with a list of blocks (see :func:`editrain.find_blocks`). Call it
    once, with the same initial weights on every rank, before building the optimizer.

    Args:
        model: the root module; its parameters become ``DTensor`` shards.
        mesh: the ``("sync", "shard")`` or ``("sync", "shard", "tp")`` mesh, or the
            :class:`MeshInfo` of :func:`init_mesh`; FSDP2 shards over ``"shard"`` only.
        blocks: the blocks, their attribute path, or None to find them.
        precision: "fp32", "bf16" (bf16 compute, fp32 parameters and gradient reduction) or
            an explicit ``MixedPrecisionPolicy``.
        split_root: shard embeddings and output head as units of their own.
        shard: apply FSDP2 (True), leave the model as it is (False), or decide (None:
            shard unless the replica has one rank and ``precision`` is fp32).

    Returns:
        The blocks, in forward order (pass them on to :func:`edit`).
    """
    if isinstance(precision, MixedPrecisionPolicy):
        mp = precision
    elif precision in ("fp32", "bf16"):
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if precision == "bf16" else None,
            reduce_dtype=torch.float32,
        )
    else:
        raise ValueError(f"precision: allowed fp32, bf16 or a MixedPrecisionPolicy; "
                         f"got {spelled(precision)}")
    found = find_blocks(model, blocks)
    device_mesh = _device_mesh(mesh)
    names = device_mesh.mesh_dim_names or ()
    if TP_DIM in names and (PP_DIM not in names or device_mesh[TP_DIM].size() > 1):
        # Tensor parallelism first (over "tp"); FSDP2 then shards the DTensors over "shard".
        # (A pipeline mesh always has a "tp" dim: of size 1 it splits nothing.)
        from editrain.models.tensor_parallel import tensor_parallel

        tensor_parallel(found, device_mesh[TP_DIM])
    shard_mesh = device_mesh[SHARD_DIM]
    if shard is None:
        shard = shard_mesh.size() > 1 or mp.param_dtype is not None
    if not shard:
        return found
    for block in found:
        fully_shard(block, mesh=shard_mesh, mp_policy=mp)
    if split_root:
        for module in root_leaf_units(model, found):
            fully_shard(module, mesh=shard_mesh, mp_policy=mp)
    fully_shard(model, mesh=shard_mesh, mp_policy=mp)
    return found




def edit(
    model: nn.Module,
    mesh: DeviceMesh | MeshInfo,
    config: SyncConfig | LocalSGDConfig | None = None,
    *,
    blocks: Sequence[nn.Module] | str | None = None,
    local_sgd_config: LocalSGDConfig | None = None,
    outer_optim_config: OuterOptimizerConfig | None = None,
    gta_config: GTAConfig | None = None,
    **engine_kwargs: Any,
) -> SyncEngine:
    """Build the :class:`SyncEngine` from a :class:`SyncConfig` or the reference's classes.

    Args:
        model: the root module, already sharded (see :func:`parallelize`), or unsharded
            with a full copy on every rank of a replica, e.g. wrapped in
            ``DistributedDataParallel`` over the replica's group (``docs/api.md``, "The
            DDP path").
        mesh: the ``("sync", "shard")`` or ``("sync", "shard", "tp")`` mesh, or its
            :class:`MeshInfo`.
        config: a :class:`SyncConfig` (any method), a :class:`LocalSGDConfig`, or None
            (the default ``SyncConfig()``: EDiT with its recommended settings).
        blocks: the blocks, their attribute path, or None to find them.
        local_sgd_config: the reference's ``LocalSGDConfig`` (instead of ``config``).
        outer_optim_config: the reference's ``OuterOptimizerConfig`` (with a
            ``LocalSGDConfig`` only).
        gta_config: the reference's ``GTAConfig`` (with a ``LocalSGDConfig`` only; put it
            in ``SyncConfig.gta`` otherwise).
        **engine_kwargs: passed on to :class:`SyncEngine` (``link_delay``, ``trigger``,
            ``before_sync``, ``seed``).

    Returns:
        The engine; use it as a context manager or call ``close()`` at the end.

    Raises:
        ValueError: conflicting or invalid configuration.
    """
    if isinstance(config, LocalSGDConfig):
        if local_sgd_config is not None:
            raise ValueError("pass the LocalSGDConfig once: as config or as local_sgd_config")
        config, local_sgd_config = None, config
    if local_sgd_config is not None:
        if config is not None:
            raise ValueError("pass either a SyncConfig or the reference's LocalSGDConfig, "
                             "not both")
        sync = sync_config_from_reference(local_sgd_config, outer_optim_config, gta_config)
    else:
        if outer_optim_config is not None or gta_config is not None:
            raise ValueError("outer_optim_config and gta_config go with a LocalSGDConfig; "
                             "with a SyncConfig set outer_optim_class/outer_optim_kwargs/gta "
                             "on it")
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig or a LocalSGDConfig, got "
                            f"{type(config).__name__}")
        sync = config if config is not None else SyncConfig()
    if isinstance(model, FSDPModule):
        # A forward under no_grad leaves the root unsharded (no backward reshards it); the
        # engine must capture the sharded DTensor parameters, never the temporary ones.
        model.reshard()
    return SyncEngine(model, _device_mesh(mesh), sync, blocks=find_blocks(model, blocks),
                      **engine_kwargs)


# ================================================================== checkpoints


def _check_model(engine: SyncEngine, model: nn.Module) -> None:
    if model is not engine.model:
        raise ValueError("model: pass the model the engine was built on")


def engine_state_dict(engine: SyncEngine, model: nn.Module) -> dict[str, Any]:
    """The engine's state as tensors for ``torch.distributed.checkpoint``, to save.

    Put the result under one key of your own DCP state dict (``"editrain"`` unless you
    tell :func:`engine_state_template` otherwise) and save it with ``dcp.save`` on every
    rank. The anchors and outer optimizer state are laid out like the parameters
    (``DTensor``) and identical on every replica, so DCP stores them once; the plain
    counters (steps, sync clock, anomaly detectors) are one small tensor per rank under a
    per-rank key. The same as ``engine.state_dict()``.

    Args:
        engine: the running engine.
        model: the sharded model the engine was built on.

    Returns:
        The engine's tree (layout: :mod:`editrain.sync.state`).
    """
    _check_model(engine, model)
    return engine.state_dict()


def engine_state_template(
    engine: SyncEngine,
    model: nn.Module,
    checkpoint_id: str | os.PathLike,
    key: str = "editrain",
) -> dict[str, Any]:
    """Empty tensors shaped like the engine state stored in a checkpoint, for ``dcp.load``.

    What a checkpoint holds depends on when it was taken (before the end of warm-up there
    are no anchors; the outer optimizer's state appears with its first step), so the
    template is built from the checkpoint's metadata. Put it under the same key as at
    saving, load, then call :func:`load_engine_state_dict`.

    Args:
        engine: the freshly built engine (same model and method as at saving).
        model: the sharded model.
        checkpoint_id: the checkpoint directory written by ``dcp.save``.
        key: the key of your DCP state dict that holds the engine state.

    Raises:
        CheckpointError: the checkpoint holds no engine state under ``key``.
    """
    _check_model(engine, model)
    saved = saved_tensors(checkpoint_id, key)
    try:
        return engine.state_dict_template(saved)
    except ValueError as e:
        raise CheckpointError(f"{checkpoint_id}: no editrain engine state under {key!r} "
                              f"({len(saved)} tensors found there): {e}") from None


def load_engine_state_dict(engine: SyncEngine, model: nn.Module, state: dict[str, Any]) -> bool:
    """Restore the engine from a state loaded into :func:`engine_state_template`'s tensors.

    Call it after ``dcp.load`` and after restoring the model and optimizer. On the topology
    that saved it training continues exactly as if it had never stopped; on another one
    every replica restarts from the global model (see ``SyncEngine.load_state_dict``).

    Args:
        engine: the freshly built engine.
        model: the sharded model.
        state: the ``key`` entry of the loaded DCP state dict.

    Returns:
        Whether the topology changed (an elastic resume).
    """
    _check_model(engine, model)
    return engine.load_state_dict(state)


__all__ = [
    "EDiT",
    "GTAConfig",
    "LocalSGDConfig",
    "MeshInfo",
    "OuterOptimizerConfig",
    "SyncConfig",
    "SyncEngine",
    "edit",
    "engine_state_dict",
    "engine_state_template",
    "find_blocks",
    "init_mesh",
    "load_engine_state_dict",
    "parallelize",
    "sync_config_from_reference",
]
