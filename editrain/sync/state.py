"""The sync engine's checkpoint layout: its state as a topology-independent, DCP-ready tree.

The engine (:class:`editrain.sync.edit.SyncEngine`) owns this layout; callers only save the
tree its ``state_dict()`` returns and hand back what DCP loaded. Keys, as DCP flattens them,
relative to wherever the caller puts the tree::

    params.<fqn>.<entry>    per-element state of a unit, cut into the pieces of the
                            parameter ``<fqn>`` and laid out like it (a DTensor on the shard
                            mesh). Identical on every replica, so DCP stores it once and
                            re-shards it to any number of replicas or shards. Entries:
                            ``anchor``, ``outer.<key>`` (the outer optimizer's per-element
                            state, e.g. ``outer.momentum_buffer``); with the eager merge
                            the global anchor ``G`` and its outer state.
    replicas.<r>.<fqn>.<entry>
                            per-element state of replica ``r`` only, laid out the same way:
                            ``error_feedback`` (quantisation residual) and ``launch`` (the
                            parameters when a delayed sync in flight was launched); with
                            the eager merge also ``anchor`` and ``outer.<key>`` (each
                            replica's own), ``incoming`` and ``carry``. Kept when the number
                            of replicas is unchanged (``launch``, ``incoming``, ``carry``:
                            only on the saving topology), dropped otherwise.
    units.<index>.<entry>   per-unit scalar tensors (e.g. ``outer.step``), identical everywhere;
                            with pipeline stages ``units.<name>.<entry>``, by the unit's
                            name (global: ``block<index in the model>``), as a stage's unit
                            indices are its own and would collide with another stage's
    ranks.rank<NNNNN>       one rank's plain state (counters, detectors, RNG seed, topology) as
                            a uint8 tensor of JSON: nothing in the tree is pickled (with
                            pipeline stages it records the rank's ``stage``; an elastic
                            resume reads the plain state of a rank of the same stage)

Python numbers in a unit's state (an optimizer may keep its step as an ``int``) travel in the
per-rank JSON, so they come back with their type.

When the ranks of a replica hold full copies (DDP) and each syncs a slice of every unit
(``SyncUnit.part``), the slices are all-gathered over the replica at saving (every rank must
call ``state_dict()``), so the tree holds whole plain tensors laid out like the parameters,
the same as an unsharded model's; at loading each rank takes its own slice again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from editrain.errors import CheckpointError
from editrain.safe_io import Bool, Int, List, Num, Obj, Str, read_json_value
from editrain.sync.outer import SyncUnit, local_view

VERSION = 2
"""Layout version, stored in every rank's plain state (1 was the layout before the engine
owned its state: ``global.anchor.<fqn>`` / ``global.outer.<fqn>.<key>``)."""


_OWN = "replica."
"""Prefix of a unit's per-replica entries (see :meth:`SyncUnit.state_dict`)."""


def rank_key(rank: int) -> str:
    """The key of a rank's plain state under ``ranks``."""
    return f"rank{rank:05d}"


def json_tensor(obj: Any) -> torch.Tensor:
    """Plain data as a uint8 tensor of its JSON text (DCP saves tensors without pickling)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


_COUNT = Int(0, 2**53)
PLAIN_STATE_SCHEMA = Obj({
    "version": Int(0, 1 << 20), "topology": List(Int(1, 1 << 20), 4),
    **dict.fromkeys(("global_step", "steps_since_sync", "num_syncs", "num_skipped_syncs",
                     "num_syncs_forced", "next_index"), _COUNT),
    "synced_replica_steps": Num(0.0, 2.0**53), "progress_floor": Num(0.0, 2.0**53),
    "last_window_s": Num(0.0, 1e12),
    "spent": Bool(), "rng": Obj({"seed": Int(-(2**63), 2**64)}, required=("seed",)),
    "stateful_units": List(Int(0, 1 << 20), 1 << 20), "unit_names": List(Str(1024), 1 << 20),
    "stage": Int(0, 1 << 20),
}, required=("version", "topology", "stateful_units"))
"""What a rank's plain engine state must hold where the code reads it as a number: every
counter an integer in range (never a bool, a float, NaN or a string), the progress a finite
non-negative number, wherever present (a state saved by one rank for another layout may
leave some out). Checked when the state is unpacked, before anything is restored."""


def from_json_tensor(t: torch.Tensor, where: str = "checkpoint: the engine's plain state"
                     ) -> Any:
    """Inverse of :func:`json_tensor`, through editrain's one JSON reader (bounded nesting,
    a one-line :class:`~editrain.errors.CheckpointError` naming ``where``)."""
    return read_json_value(bytes(t.cpu().numpy().tobytes()), where)


def read_plain_state(t: torch.Tensor, rank: str) -> dict[str, Any]:
    """A saved rank's plain engine state, checked against :data:`PLAIN_STATE_SCHEMA`.

    Raises:
        CheckpointError: one line naming the rank's entry and the field.
    """
    where = f"checkpoint: the engine's plain state of {rank}"
    value = from_json_tensor(t, where)
    PLAIN_STATE_SCHEMA.check(value, where, "", CheckpointError)
    return value


class StateLayout:
    """Packs the units' flat state and the engine's plain state into the tree (and back).

    Args:
        units: the engine's units, in forward order.
        model: the root module (it names the parameters).
        rank: this process's global rank.
        topology: ``(replicas, shard_size)`` of the running job, ``(replicas,
            shard_size, tp_size)`` with tensor parallelism, or ``(replicas, pp_size,
            shard_size, tp_size)`` with pipeline stages.
    """

    def __init__(self, units: Sequence[SyncUnit], model: nn.Module, rank: int,
                 topology: tuple[int, ...]) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        self.units = list(units)
        self.fqns = [[names[id(p)] for p in u.params] for u in self.units]
        self.rank = rank
        self.topology = tuple(topology)
        self.replica = rank // math.prod(self.topology[1:])
        self.staged = len(self.topology) == 4
        """Pipeline stages: unit scalars keyed by unit name, plain state by stage."""
        self.stage = (rank // math.prod(self.topology[2:])) % self.topology[1] \
            if self.staged else 0

    def _unit_key(self, u: int) -> str:
        """Unit ``u``'s key under ``units``: its index, or with pipeline stages its name."""
        return self.units[u].name if self.staged else str(u)

    # ------------------------------------------------------------------ parameter layout
    def _to_params(self, flat: torch.Tensor, u: int) -> dict[str, torch.Tensor]:
        """Cut unit ``u``'s flat local vector into per-parameter tensors laid out like the
        parameters (DTensors on the shard mesh), so that DCP can re-shard them."""
        unit = self.units[u]
        device = unit.device
        flat = flat.to(device)
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for p, n, fqn in zip(unit.params, unit.numels, self.fqns[u]):
            piece = flat[offset:offset + n].view(local_view(p).shape)
            offset += n
            if isinstance(p, DTensor):
                piece = DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
            out[fqn] = piece
        return out

    def _from_params(self, tensors: Mapping[str, torch.Tensor], u: int) -> torch.Tensor:
        """Inverse of :meth:`_to_params`: this rank's flat vector of unit ``u``."""
        parts = []
        for fqn in self.fqns[u]:
            t = tensors[fqn]
            t = t.to_local() if isinstance(t, DTensor) else t
            parts.append(t.reshape(-1))
        return torch.cat(parts)

    # ------------------------------------------------------------------ save
    def pack(self, unit_states: Sequence[Mapping[str, Any]], plain: dict[str, Any]
             ) -> dict[str, Any]:
        """The tree to save.

        Args:
            unit_states: each unit's :meth:`SyncUnit.state_dict` (flat tensors by entry).
            plain: the engine's JSON-able state of this rank.
        """
        params: dict[str, dict[str, torch.Tensor]] = {}
        own: dict[str, dict[str, torch.Tensor]] = {}
        scalars: dict[str, dict[str, torch.Tensor]] = {}
        numbers: dict[str, dict[str, Any]] = {}
        for u, state in enumerate(unit_states):
            unit = self.units[u]
            for entry, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != unit.numel:
                        raise ValueError(f"unit {unit.name}: state {entry!r} has "
                                         f"{value.numel()} elements, the unit {unit.numel}; "
                                         "it cannot be laid out like the parameters")
                    target, name = ((own, entry[len(_OWN):]) if entry.startswith(_OWN)
                                    else (params, entry))
                    # Slices (full copies, DDP): the whole unit, gathered over the replica.
                    full = unit.assemble(value.detach().to(unit.device))
                    for fqn, piece in self._to_params(full, u).items():
                        target.setdefault(fqn, {})[name] = piece
                elif torch.is_tensor(value):
                    scalars.setdefault(self._unit_key(u), {})[entry] = value.detach().clone()
                else:
                    numbers.setdefault(str(u), {})[entry] = value
        plain = dict(plain, version=VERSION, topology=list(self.topology),
                     stateful_units=[u for u, s in enumerate(unit_states) if s],
                     unit_names=[u.name for u in self.units],
                     unit_numbers=numbers)
        if self.staged:
            plain["stage"] = self.stage
        tree: dict[str, Any] = {"ranks": {rank_key(self.rank): json_tensor(plain)}}
        if params:
            tree["params"] = params
        if own:
            tree["replicas"] = {str(self.replica): own}
        if scalars:
            tree["units"] = scalars
        return tree

    # ------------------------------------------------------------------ load
    def template(self, saved: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Empty tensors in this topology's layout for what ``saved`` holds (for ``dcp.load``).

        Args:
            saved: flattened key -> a tensor with the saved shape and dtype (the meta device
                will do), for every tensor a checkpoint holds under the tree.

        Raises:
            ValueError: ``saved`` holds no engine state.
        """
        params: dict[str, dict[str, torch.Tensor]] = {}
        own: dict[str, dict[str, torch.Tensor]] = {}
        for u, fqns in enumerate(self.fqns):
            if not fqns:
                continue
            for target, prefix in ((params, f"params.{fqns[0]}."),
                                   (own, f"replicas.{self.replica}.{fqns[0]}.")):
                for key, like in saved.items():
                    if not key.startswith(prefix):
                        continue
                    entry = key[len(prefix):]
                    zeros = torch.zeros(self.units[u].full_numel, dtype=like.dtype)
                    for fqn, piece in self._to_params(zeros, u).items():
                        target.setdefault(fqn, {})[entry] = piece
        scalars: dict[str, dict[str, torch.Tensor]] = {}
        for key, like in saved.items():
            if key.startswith("units."):
                _, u, entry = key.split(".", 2)
                scalars.setdefault(u, {})[entry] = torch.zeros(like.shape, dtype=like.dtype)
        ranks = {}
        wanted = {rank_key(self.rank), rank_key(0)}
        if self.staged:  # which rank saved this stage is known only once they are read
            wanted |= {key[len("ranks."):] for key in saved if key.startswith("ranks.")}
        for name in wanted:
            like = saved.get(f"ranks.{name}")
            if like is not None:
                ranks[name] = torch.zeros(like.shape, dtype=torch.uint8)
        if rank_key(0) not in ranks:
            raise ValueError("the saved state holds no sync engine state (no ranks.rank00000)")
        tree: dict[str, Any] = {"ranks": ranks}
        if params:
            tree["params"] = params
        if own:
            tree["replicas"] = {str(self.replica): own}
        if scalars:
            tree["units"] = scalars
        return tree

    def unpack(self, tree: Mapping[str, Any]
               ) -> tuple[list[dict[str, Any]], dict[str, Any], bool]:
        """Each unit's flat state, the plain state to restore, and whether the topology changed.

        On the saving topology the plain state is this rank's own; on another one (elastic)
        it is rank 0's, and the caller restarts the local phase.

        Raises:
            ValueError: a layout version or a number of units this code does not read.
        """
        ranks = tree["ranks"]
        # A tree saved by one rank without DCP (torch.save of its own state_dict()) holds
        # that rank's entry only: it stands in for rank 0's.
        head_key = rank_key(0) if rank_key(0) in ranks else rank_key(self.rank)
        if head_key not in ranks:
            raise ValueError(f"the state holds neither rank 0's nor this rank's "
                             f"({self.rank}) plain state: it was saved by another rank")
        first = from_json_tensor(ranks[head_key])
        if first.get("version") != VERSION:
            raise ValueError(f"sync engine state version {first.get('version')!r}; this "
                             f"editrain reads version {VERSION}")
        first = read_plain_state(ranks[head_key], head_key)
        elastic = tuple(first["topology"]) != self.topology or rank_key(self.rank) not in ranks
        if self.staged and elastic:
            # The plain state of the first saved rank of this stage (its units, detectors).
            for name in sorted(ranks):
                other = read_plain_state(ranks[name], name)
                if other.get("stage", 0) == self.stage:
                    first = other
                    break
            else:
                raise ValueError(f"the saved state holds no rank of pipeline stage "
                                 f"{self.stage}")
        plain = first if elastic else read_plain_state(ranks[rank_key(self.rank)],
                                                       rank_key(self.rank))
        params = tree.get("params", {})
        own = tree.get("replicas", {}).get(str(self.replica), {})
        if first["topology"][0] != self.topology[0]:
            own = {}  # another number of replicas: residuals of replicas that are gone
        scalars = tree.get("units", {})
        names = [u.name for u in self.units]
        saved_names = plain.get("unit_names", names)
        if saved_names != names:
            raise ValueError(
                f"the checkpoint's sync units are {saved_names}, this model's are {names}: "
                "it was sharded differently (sync.split_root shards embeddings and output "
                "head as units of their own; resume with the setting it was saved with)")
        stateful = set(plain["stateful_units"])
        if stateful and max(stateful) >= len(self.units):
            raise ValueError(f"the saved state has more than {len(self.units)} sync units")
        states: list[dict[str, Any]] = []
        for u, fqns in enumerate(self.fqns):
            state: dict[str, Any] = {}
            if fqns:
                unit = self.units[u]
                for entry in params.get(fqns[0], {}):
                    state[entry] = unit.own_part(
                        self._from_params({f: params[f][entry] for f in fqns}, u))
                for entry in own.get(fqns[0], {}):
                    if entry in ("launch", "incoming", "carry") and elastic:
                        continue  # rounds in flight are not carried across topologies
                    state[_OWN + entry] = unit.own_part(
                        self._from_params({f: own[f][entry] for f in fqns}, u))
            elif u in stateful:
                state["anchor"] = torch.zeros(0)  # a unit without parameters of its own
            state.update(scalars.get(self._unit_key(u), {}))
            state.update(plain["unit_numbers"].get(str(u), {}))
            states.append(state)
        return states, plain, elastic


def saved_replicas_and_shards(topology: Sequence[int]) -> tuple[int, int]:
    """``(R, S)`` of a saved topology: ``(R, S[, T])``, or ``(R, P, S, T)`` with stages."""
    shards = topology[2] if len(topology) == 4 else topology[1]
    return max(1, int(topology[0])), max(1, int(shards))


def global_model_keys(saved: Mapping[str, Any]) -> dict[str, str]:
    """Where a saved engine state holds the global model: parameter name -> key of its
    anchor (relative to the engine's tree, as :func:`editrain.checkpoint.saved_tensors`
    lists them). Empty when there are no global anchors (a method without a global model,
    or a run still in its warm-up). With the eager merge they are the global anchors ``G``
    (each replica's own anchors are its ``replicas.<r>`` entries).

    Args:
        saved: the keys of the engine's saved tensors (values are not read).
    """
    suffix = ".anchor"
    return {key[len("params."):-len(suffix)]: key for key in saved
            if key.startswith("params.") and key.endswith(suffix)}
