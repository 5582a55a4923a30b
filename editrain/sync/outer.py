"""Per-unit outer state: the fp32 anchor of this rank's shard and the outer optimizer over it.

A *unit* is a group of parameters sharded together by FSDP2 (one transformer block, or the
root: embeddings, final norm, head). The anchor ``A`` is the flat fp32 concatenation of this
rank's local shards as of the last sync, so a unit's cross-replica traffic is one message of
``1/S`` of the unit.

When every rank of a replica holds a full copy of the model (DDP, ``S > 1``), a unit is
given a *part*: this rank then owns one contiguous ``1/S`` slice of the unit's flat
parameters, and the anchor, the outer state and the error feedback exist for that slice
only. Writing the slice back all-gathers every rank's slice over the replica and writes the
whole unit into the parameters, so all copies stay identical.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from editrain.errors import spelled
from editrain.sync.methods import NESTEROV_SGD

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")

_OUTER_NAMES = {
    "sgd": "torch.optim.SGD",
    "adam": "torch.optim.Adam",
    "adamw": "torch.optim.AdamW",
    "agd": "editrain.optim.AGD",
}


OPTIMIZER_MODULES = ("torch.optim", "editrain.optim")
"""The only modules (and their submodules) a dotted optimizer name may come from."""


def resolve_optimizer_class(name: str | type | None) -> type | None:
    """Map an outer optimizer name (or class, or dotted path) to a class; None/"none" -> None.

    A name never imports a module outside :data:`OPTIMIZER_MODULES` (a config file must not
    make us run code); any other optimizer is passed as the class itself.

    Args:
        name: "sgd", "adam", "adamw", "agd", "none", a dotted path in ``torch.optim`` or
            ``editrain.optim`` such as "torch.optim.RMSprop", or an ``Optimizer`` subclass.
    """
    if name is None or (isinstance(name, str) and name.lower() == "none"):
        return None
    if isinstance(name, type):
        if not issubclass(name, torch.optim.Optimizer):
            raise ValueError(f"sync.outer_optim_class: {name} is not a torch.optim.Optimizer")
        return name
    path = _OUTER_NAMES.get(name.lower(), name).replace(":", ".")  # module:Class too
    module_name, _, attr = path.rpartition(".")
    # A name comes from a config file or the command line: importing any other module
    # would run its import-time code. Only the optimizer packages are imported by name.
    if _DOTTED.fullmatch(path) and not any(module_name == m or module_name.startswith(m + ".")
                                           for m in OPTIMIZER_MODULES):
        raise ValueError(
            f"sync.outer_optim_class: refused {spelled(name)} (a name never imports a module "
            f"outside {' and '.join(OPTIMIZER_MODULES)}); allowed: none, "
            f"{', '.join(_OUTER_NAMES)} or a class of {' or '.join(OPTIMIZER_MODULES)} "
            f"(e.g. torch.optim.RMSprop); pass another optimizer class itself through the "
            f"Python API, e.g. SyncConfig(outer_optim_class=MyOptimizer)")
    cls = None
    if _DOTTED.fullmatch(path) and module_name:  # never import what is not a dotted name
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            cls = None
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise ValueError(
            f"sync.outer_optim_class: unknown optimizer {spelled(name)}; allowed: none, "
            f"{', '.join(_OUTER_NAMES)} or a torch.optim.Optimizer subclass of "
            f"{' or '.join(OPTIMIZER_MODULES)} as package.module.Class or package.module:Class"
        )
    return cls


OUTER_SGD_DEFAULTS = NESTEROV_SGD
"""DiLoCo's outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9): the SGD of a method
without its own (``methods.OUTER_SGD``), and the lr filled in where given kwargs have none."""


def outer_kwargs(cls: type | None, given: dict[str, Any] | None) -> dict[str, Any]:
    """The outer optimizer's keyword arguments with the documented defaults filled in: for
    SGD (however it was named) ``OUTER_SGD_DEFAULTS`` when none are given, and lr 0.7 when
    the given ones have no lr; for any other optimizer without an lr a warning says that
    torch's own default applies."""
    if cls is None:
        return dict(given or {})
    if cls is torch.optim.SGD:
        if given is None:
            return dict(OUTER_SGD_DEFAULTS)
        return {"lr": OUTER_SGD_DEFAULTS["lr"], **given}
    given = dict(given or {})
    if "lr" not in given:
        default = inspect.signature(cls).parameters.get("lr")
        shown = "none" if default is None else default.default
        warnings.warn(f"sync.outer_optim_kwargs has no lr for the outer {cls.__name__}: "
                      f"its own default lr ({shown}) applies, far from the documented outer "
                      f"lr {OUTER_SGD_DEFAULTS['lr']} of Nesterov SGD; set it explicitly",
                      UserWarning, stacklevel=3)
    return given


def check_outer(cls: type | None, kwargs: dict[str, Any]) -> None:
    """Construct the outer optimizer on a dummy parameter: its own checks of ``kwargs``
    (e.g. a negative lr, an unknown keyword) fail here, before any work starts."""
    if cls is None:
        return
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"sync.outer_optim_kwargs: {cls.__name__} rejects {spelled(kwargs)}: {e}"
                         ) from None


def _dtensor_type() -> type:
    """``DTensor``, imported when a parameter is first looked at: the launcher resolves the
    outer optimizer through this module without ever holding a DTensor, and importing
    ``torch.distributed.tensor`` costs it about a second before the workers start."""
    from torch.distributed.tensor import DTensor

    return DTensor


def local_view(p: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a parameter (the tensor FSDP2 all-gathers from)."""
    return p.to_local() if isinstance(p, _dtensor_type()) else p.data


def copies_in_replica(p: torch.Tensor, replica_size: int) -> int:
    """How many of a replica's ``replica_size`` ranks hold ``p``'s local tensor alike: the
    ranks divided by the pieces ``p`` is cut into (its ``Shard`` placements, FSDP2's
    strided ones over tensor-parallel shards included: whatever is not replicated). A plain
    tensor is held whole by every rank (a one-process replica, or tensor parallelism
    leaving a norm or an embedding replicated); FSDP2 over the whole replica cuts it into
    as many pieces as ranks."""
    pieces = 1
    if isinstance(p, _dtensor_type()):
        for dim, placement in enumerate(p.placements):
            if not placement.is_replicate():
                pieces *= p.device_mesh.size(dim)
    return max(1, replica_size // pieces)


class SyncUnit:
    """Anchor, outer optimizer and the sync arithmetic of one unit on one rank.

    Args:
        index: position of the unit in forward order (0 = root).
        name: human-readable name for metrics.
        params: the unit's parameters (FSDP2 ``DTensor``s or plain tensors).
        outer_cls: outer optimizer class, or None for plain averaging (``A <- A - delta``).
        outer_kwargs: its keyword arguments.
        cpu_offload: keep the anchor and outer state in CPU memory.
        error_feedback: keep an error-feedback buffer (quantised pseudo-gradients).
        part: ``(i, S)``: the parameters are a full copy held by each of ``S`` ranks, of
            which this rank is the ``i``-th; it syncs the ``i``-th contiguous slice of the
            flat unit (``ceil(n / S)`` elements, fewer or none at the end). None: the whole
            local tensors (FSDP2 shards, or a one-process replica's parameters).
        gather: with ``part``, the all-gather over the replica's ``S`` ranks (same-size
            tensors in, their flat concatenation in shard order out), called wherever the
            live parameters are written (a collective of the replica).
        copies: per parameter, how many ranks of the replica hold this rank's local
            tensor alike (see :func:`copies_in_replica`; more than 1 under tensor
            parallelism): statistics summed over the replica count each piece once, and
            the reductions treat the pieces held alike apart (:attr:`segments`).
        eager_replicas: the eager merge (``docs/streaming.md`` section 3c): the number of
            replicas ``R``; the anchor and outer state are then this replica's own. 0: no
            eager merge.
    """

    def __init__(
        self,
        index: int,
        name: str,
        params: Sequence[nn.Parameter],
        outer_cls: type | None,
        outer_kwargs: dict[str, Any],
        cpu_offload: bool,
        error_feedback: bool = False,
        part: tuple[int, int] | None = None,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        copies: Sequence[int] | None = None,
        eager_replicas: int = 0,
    ) -> None:
        self.index = index
        self.eager_replicas = eager_replicas
        self.name = name
        self.params = list(params)
        self.outer_cls = outer_cls
        self.outer_kwargs = dict(outer_kwargs)
        self.cpu_offload = cpu_offload
        self.numels = [local_view(p).numel() for p in self.params]
        self.full_numel = sum(self.numels)
        """Elements of the unit's local tensors (all of them, with or without a part)."""
        if part is not None and gather is None:
            raise ValueError(f"unit {name}: a part needs the replica's all-gather")
        self.part = part
        self.gather = gather
        self.chunk = self.full_numel
        """Elements of every rank's slice before the end is cut off (the gather's size)."""
        lo, hi = 0, self.full_numel
        if part is not None:
            mine, count = part
            self.chunk = -(-self.full_numel // count)
            lo = min(self.full_numel, mine * self.chunk)
            hi = min(self.full_numel, lo + self.chunk)
        self.span = (lo, hi)
        """This rank's elements ``[lo, hi)`` of the flat unit."""
        self.numel = hi - lo
        """Elements this rank syncs: the anchor's size."""
        # (parameter index, first, end) of the span, in the parameters' order
        self._pieces: list[tuple[int, int, int]] = []
        offset = 0
        for i, n in enumerate(self.numels):
            first, end = max(lo - offset, 0), min(hi - offset, n)
            if first < end:
                self._pieces.append((i, first, end))
            offset += n
        self.copies: list[int] | None = None
        """Per parameter, the replica's ranks holding its local tensor alike; None when
        every piece is held once."""
        self.segments: tuple[torch.Tensor, torch.Tensor] | None = None
        """Indices (into the flat unit) of the elements held alike by several ranks, and
        of the others; None when every piece is held once."""
        if copies is not None and any(c > 1 for c in copies):
            if part is not None:
                raise ValueError(f"unit {name}: a part and copies exclude each other")
            self.copies = list(copies)
            alike = torch.cat([torch.full((n,), c > 1) for n, c in zip(self.numels, copies)])
            self.segments = (alike.nonzero().flatten().to(self.device),
                             (~alike).nonzero().flatten().to(self.device))
        self.error_feedback = error_feedback
        self.anchor: torch.Tensor | None = None
        self.outer: torch.optim.Optimizer | None = None
        self.error: torch.Tensor | None = None
        """This replica's quantisation residual, added to the next pseudo-gradient."""
        self.launch: torch.Tensor | None = None
        """The live parameters when this unit's delayed sync was launched (until merged);
        with the eager merge, the round's pseudo-gradient ``D`` instead."""
        self.incoming: torch.Tensor | None = None
        """The eager merge: the reduced pseudo-gradient ``I`` of the round in flight, once
        its reduction is done (until merged)."""
        self.carry: torch.Tensor | None = None
        """The eager merge: the correction ``C`` waiting for the next outer step (None: 0)."""
        self.consensus: torch.Tensor | None = None
        """The eager merge: the global anchor ``G`` (docs/streaming.md section 3c), the same
        on every replica: the outer optimizer fed every merged round's ``I`` once, in
        order, from what the rounds put on the wire."""
        self.consensus_outer: torch.optim.Optimizer | None = None
        """The eager merge: the outer optimizer over :attr:`consensus` (its own state)."""

    # ------------------------------------------------------------------ state
    @property
    def device(self) -> torch.device:
        """Device of the live parameters."""
        return local_view(self.params[0]).device if self.params else torch.device("cpu")

    def square_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """float64 sum of squares of a flat unit vector, each element divided by the number
        of the replica's ranks holding it alike (summed over the replica: each counted
        once)."""
        sq = flat.double().square()
        if self.copies is None:
            return sq.sum()
        return torch.stack([piece.sum() / c
                            for piece, c in zip(sq.split(self.numels), self.copies)]).sum()

    def flat_params(self) -> torch.Tensor:
        """fp32 flat copy of the live local shards (with a part: of this rank's slice), on
        the parameters' device."""
        if not self.params:
            return torch.zeros(0, dtype=torch.float32)
        if self.part is None:
            return torch.cat([local_view(p).detach().reshape(-1).float() for p in self.params])
        if not self._pieces:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return torch.cat([local_view(self.params[i]).detach().reshape(-1)[a:b].float()
                          for i, a, b in self._pieces])

    def own_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice (a view) of a flat vector of the whole unit; without a part,
        ``full`` itself."""
        return full if self.part is None else full[self.span[0]:self.span[1]]

    def assemble(self, piece: torch.Tensor) -> torch.Tensor:
        """The flat vector of the whole unit from every rank's slice ``piece`` (all-gathered
        over the replica: every rank of it must call this at the same point); without a
        part, ``piece`` itself."""
        if self.part is None:
            return piece
        assert self.gather is not None
        if piece.numel() < self.chunk:  # the last slices are short: pad to one size
            piece = torch.cat([piece, piece.new_zeros(self.chunk - piece.numel())])
        return self.gather(piece)[:self.full_numel]

    def create_anchor(self) -> None:
        """``A = theta`` (end of warm-up) and a fresh outer optimizer over ``A``."""
        flat = self.flat_params()  # torch.cat: always a fresh tensor, never a view
        if self.cpu_offload:
            flat = flat.cpu()
            if torch.cuda.is_available():
                flat = flat.pin_memory()  # faster host<->device copies at each sync
        self.anchor = flat
        self.outer = self._new_outer(self.anchor)
        self.error = torch.zeros_like(flat) if self.error_feedback else None
        self.launch = self.incoming = self.carry = None
        self.consensus = self.consensus_outer = None
        if self.eager_replicas:
            self.consensus = flat.clone()
            self.consensus_outer = self._new_outer(self.consensus)

    def _new_outer(self, anchor: torch.Tensor) -> torch.optim.Optimizer | None:
        return self.outer_cls([anchor], **self.outer_kwargs) if self.outer_cls else None

    def pseudo_grad(self, theta: torch.Tensor | None = None) -> torch.Tensor:
        """``delta = A - theta`` on the parameters' device (fp32, flat).

        Args:
            theta: flat parameters to use instead of the live ones (a snapshot).
        """
        assert self.anchor is not None, "pseudo_grad() before create_anchor()"
        if theta is None:
            theta = self.flat_params()
        return self.anchor.to(theta.device, non_blocking=True) - theta

    @torch.no_grad()
    def merge(self, rule: str, alpha: float) -> None:
        """Merge the (new) anchor into the live parameters after a delayed sync.

        Args:
            rule: "blend" (``theta <- lerp(A, theta, alpha)``), "keep_local"
                (``theta <- A + (theta - theta_at_launch)``) or "eager"
                (:meth:`eager_merge`).
            alpha: the blend's share of the live parameters.
        """
        assert self.anchor is not None
        if rule == "eager":
            self.eager_merge()  # the live parameters stay
            return
        anchor = self.anchor.to(self.device, non_blocking=True)
        if rule == "keep_local":
            assert self.launch is not None, "keep_local merge without a launch snapshot"
            self.load_flat(self.flat_params().sub_(self.launch).add_(anchor))
        elif alpha == 0.0:
            self.load_flat(anchor)
        else:
            self.load_flat(torch.lerp(anchor, self.flat_params(), alpha))
        self.launch = None

    @torch.no_grad()
    def eager_launch(self) -> None:
        """The eager merge's launch (section 3c): ``D = A - theta`` is kept for the round's
        reduction, the outer step takes ``C + D / R`` (this replica's own share now), and
        ``theta <- A``. Main thread; the round's jobs read only ``D``."""
        delta = self.pseudo_grad()
        self.launch = delta
        step = delta / self.eager_replicas
        if self.carry is not None:
            step = self.carry.to(step.device) + step
            self.carry = None
        self.outer_step(step)
        self.write_back()

    @torch.no_grad()
    def eager_merge(self) -> None:
        """The eager merge of the round in flight: ``C <- C + I - D / R`` (the others'
        shares, and this replica's at its real weight instead of ``1 / R``); the live
        parameters stay. ``I`` is None when nobody was trusted for the unit (0)."""
        assert self.launch is not None, "eager merge without a round in flight"
        corr = -(self.launch / self.eager_replicas)
        if self.incoming is not None:
            self.consensus_step(self.incoming)
            corr = self.incoming.to(corr.device) + corr
        if self.carry is not None:
            corr = self.carry.to(corr.device) + corr
        self.carry = corr.to(self.anchor.device if self.anchor is not None else corr.device)
        self.launch = self.incoming = None

    @torch.no_grad()
    def consensus_step(self, reduced: torch.Tensor) -> None:
        """``G <- OuterOpt_G(G, I)``: a round's reduced pseudo-gradient enters the global
        anchor (the eager merge; every replica alike)."""
        assert self.consensus is not None
        _apply_outer(self.consensus, self.consensus_outer, reduced)

    @torch.no_grad()
    def global_view(self) -> torch.Tensor:
        """The eager merge's global model of this unit: ``G`` with the round in flight
        merged as sent (``OuterOpt_G(G, I)`` on a copy of ``G`` and of its optimizer
        state: what the merge will compute, bitwise), or ``G`` when no round is in flight
        or nobody was trusted in it. The round's jobs must be done (``I`` known)."""
        assert self.consensus is not None
        if self.launch is None or self.incoming is None:
            return self.consensus
        trial = self.consensus.clone()
        opt = None
        if self.consensus_outer is not None:
            opt = self._new_outer(trial)
            assert opt is not None
            state = self.consensus_outer.state.get(self.consensus, {})
            opt.state[trial] = {k: v.clone() if torch.is_tensor(v) else v
                                for k, v in state.items()}
        _apply_outer(trial, opt, self.incoming)
        return trial

    @torch.no_grad()
    def eager_end(self, reduced: torch.Tensor | None) -> None:
        """The eager merge's last, blocking round (the end of training): ``G <-
        OuterOpt_G(G, I)`` (no step when nobody was trusted: ``reduced`` None), then this
        replica's own anchor and outer state become ``G``'s, ``C <- 0`` and ``theta <-
        G``: every replica ends on one model without exchanging it."""
        assert self.anchor is not None and self.consensus is not None
        if reduced is not None:
            self.consensus_step(reduced)
        self.anchor.copy_(self.consensus)
        if self.outer is not None and self.consensus_outer is not None:
            state = self.consensus_outer.state.get(self.consensus, {})
            self.outer.state[self.anchor] = {k: v.clone() if torch.is_tensor(v) else v
                                             for k, v in state.items()}
        self.carry = None
        self.write_back()

    @torch.no_grad()
    def outer_step(self, reduced: torch.Tensor) -> None:
        """Apply the reduced pseudo-gradient to the anchor (outer step or plain averaging)."""
        assert self.anchor is not None
        _apply_outer(self.anchor, self.outer, reduced)

    @torch.no_grad()
    def write_back(self) -> None:
        """``theta <- A``: copy the anchor into the live local shards (no autograd)."""
        assert self.anchor is not None
        self.load_flat(self.anchor)

    @torch.no_grad()
    def load_flat(self, flat: torch.Tensor) -> None:
        """Copy a flat fp32 vector (this shard's layout) into the live local shards. With a
        part, ``flat`` is this rank's slice: the slices of the replica are all-gathered
        (:meth:`assemble`) and the whole unit is written, on every rank of the replica."""
        src = self.assemble(flat.to(self.device, non_blocking=True))
        offset = 0
        for p, n in zip(self.params, self.numels):
            local = local_view(p)
            local.copy_(src[offset:offset + n].view_as(local))
            offset += n

    def extra_bytes(self) -> dict[str, int]:
        """Bytes held by the anchor, outer state, error feedback and launch snapshot, split
        by device type."""
        out: dict[str, int] = {}
        tensors = [t for t in (self.anchor, self.error, self.launch, self.incoming, self.carry,
                               self.consensus) if t is not None]
        for outer in (self.outer, self.consensus_outer):
            if outer is not None:
                for state in outer.state.values():
                    tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        for t in tensors:
            out[t.device.type] = out.get(t.device.type, 0) + t.numel() * t.element_size()
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This rank's state of the unit as flat entries: ``anchor`` and ``outer.<key>``.

        Per-element entries are 1-D tensors of :attr:`numel` elements (this shard's layout);
        scalars are 0-d tensors or Python numbers. Empty before the anchor exists. The
        tensors are the live ones, not copies.
        """
        if self.anchor is None:
            return {}
        out: dict[str, Any] = {"anchor": self.anchor}
        if self.outer is not None:
            for key, value in self.outer.state.get(self.anchor, {}).items():
                out[f"outer.{key}"] = value
        # This replica's own entries (every other entry is identical on all replicas).
        if self.error is not None:
            out["replica.error_feedback"] = self.error
        if self.launch is not None:
            out["replica.launch"] = self.launch
        if self.eager_replicas:
            # The eager merge: anchor and outer state above are this replica's own, and so
            # are I and C; the shared entries hold the global anchor G and its outer state
            # (the same on every replica: what an elastic resume restarts from).
            for key in [k for k in out if not k.startswith("replica.")]:
                value = out.pop(key)
                if torch.is_tensor(value) and value.dim() > 0:
                    out[f"replica.{key}"] = value
                else:
                    # A scalar of this replica's own outer state (e.g. Adam's step, which
                    # G's optimizer counts apart): plain data, kept per rank.
                    out[f"replica.{key}"] = _plain_scalar(value)
            assert self.consensus is not None
            out["anchor"] = self.consensus
            if self.consensus_outer is not None:
                for key, value in self.consensus_outer.state.get(self.consensus, {}).items():
                    out[f"outer.{key}"] = value
            if self.incoming is not None:
                out["replica.incoming"] = self.incoming
            if self.carry is not None:
                out["replica.carry"] = self.carry
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` (empty: no anchor yet).

        Args:
            sd: the flat entries.

        Raises:
            ValueError: an anchor of another size, outer state without an outer optimizer,
                or an entry this unit does not know.
        """
        if not sd:
            self.anchor, self.outer = None, None
            return
        known = ("anchor", "replica.error_feedback", "replica.launch", "replica.anchor",
                 "replica.incoming", "replica.carry")
        unknown = [k for k in sd if k not in known and not k.startswith(("outer.",
                                                                          "replica.outer."))]
        if unknown:
            raise ValueError(f"unit {self.name}: unknown state entries {unknown}")
        if "anchor" not in sd:
            raise ValueError(f"unit {self.name}: state without an anchor ({', '.join(sd)})")
        anchor = sd["anchor"]
        if anchor.numel() != self.numel:
            raise ValueError(
                f"unit {self.name}: checkpoint anchor has {anchor.numel()} elements, "
                f"this shard has {self.numel}"
            )
        own = self.eager_replicas and "replica.anchor" in sd  # this replica's own state
        self.create_anchor()
        assert self.anchor is not None
        self.anchor.copy_(sd["replica.anchor" if own else "anchor"].reshape(-1))
        if self.consensus is not None:
            self.consensus.copy_(sd["anchor"].reshape(-1))
        if self.error is not None and "replica.error_feedback" in sd:
            self.error.copy_(sd["replica.error_feedback"].reshape(-1))
        if "replica.launch" in sd:
            self.launch = sd["replica.launch"].reshape(-1).to(self.device).float().clone()
        for key in ("incoming", "carry"):
            if self.eager_replicas and f"replica.{key}" in sd:
                setattr(self, key, sd[f"replica.{key}"].reshape(-1).float().clone().to(
                    self.device if key == "incoming" else self.anchor.device))
        shared = {k[len("outer."):]: v for k, v in sd.items() if k.startswith("outer.")}
        outer = dict(shared)
        if own:
            outer.update({k[len("replica.outer."):]: _from_plain_scalar(v)
                          for k, v in sd.items() if k.startswith("replica.outer.")})
        if not outer:
            return
        if self.outer is None:
            raise ValueError(f"unit {self.name}: the checkpoint has outer optimizer state "
                             f"({', '.join(outer)}) but no outer optimizer is configured")
        self.outer.state[self.anchor] = self._outer_state(outer, self.anchor)
        if self.consensus is not None and self.consensus_outer is not None:
            self.consensus_outer.state[self.consensus] = self._outer_state(shared,
                                                                           self.consensus)

    @staticmethod
    def _outer_state(entries: dict[str, Any], anchor: torch.Tensor) -> dict[str, Any]:
        """Loaded outer optimizer state for ``anchor``: per-element tensors moved to its
        device (copies, so two optimizers never share a buffer)."""
        return {k: (v.to(anchor.device if v.dim() > 0 else v.device, copy=True)
                    if torch.is_tensor(v) else v) for k, v in entries.items()}


def _apply_outer(anchor: torch.Tensor, outer: torch.optim.Optimizer | None,
                 reduced: torch.Tensor) -> None:
    """One outer step of ``anchor`` with the reduced pseudo-gradient as its gradient (plain
    averaging without an optimizer: ``anchor -= reduced``)."""
    reduced = reduced.to(anchor.device)
    if outer is None:
        anchor.sub_(reduced)
        return
    anchor.grad = reduced
    outer.step()
    anchor.grad = None


def _plain_scalar(value: Any) -> Any:
    """A scalar of an optimizer's state as JSON-able data: a 0-d tensor as its value and
    dtype (:func:`_from_plain_scalar` restores it), a Python number as it is."""
    if torch.is_tensor(value):
        return {"scalar": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _from_plain_scalar(value: Any) -> Any:
    """Inverse of :func:`_plain_scalar` (per-element tensors pass through)."""
    if isinstance(value, dict) and set(value) == {"scalar", "dtype"}:
        return torch.tensor(value["scalar"], dtype=getattr(torch, value["dtype"]))
    return value
