"""The DDP path: an optimizer wrapper for loops written for the EDiT reference's DDP mode.

The reference runs EDiT on ``DistributedDataParallel`` with an optimizer wrapper
(``StatefulPostLocalSGDOptimizer``) whose ``step()`` also averages the model and whose
``state_dict()`` also holds the averager's state. editrain's engine does the syncing; this
wrapper only puts the engine's calls where such a loop expects them::

    info = editrain.init_mesh(shard_size=2)               # R replicas x 2 ranks
    model = DistributedDataParallel(model, process_group=info.shard_mesh.get_group())
    engine = editrain.edit(model, info, editrain.SyncConfig(method="edit"))
    opt = editrain.StatefulPostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), engine)
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step()                                        # inner step + engine.step()
        opt.zero_grad()
    engine.finish(force=True)

DDP averages gradients within the replica (its process group must be the replica's own,
never the world); each of the ``S`` ranks of a replica syncs a ``1/S`` slice of every unit
across replicas and the replica all-gathers the result (see ``docs/api.md``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from editrain.optim.hooks import StateDictHooks
from editrain.sync.edit import SyncEngine
from editrain.sync.state import rank_key

STATE_KEY = "editrain"
"""The key of the engine's state in :meth:`StatefulPostLocalSGDOptimizer.state_dict`."""


class StatefulPostLocalSGDOptimizer(StateDictHooks, torch.optim.Optimizer):
    """An inner optimizer whose ``step()`` also does the sync engine's book-keeping, and
    whose state dict also holds the engine's state (the reference's DDP optimizer wrapper).

    ``step()`` runs, in order: ``engine.after_backward()`` (during warm-up it averages the
    gradients across replicas; skipped when :meth:`after_backward` was already called for
    this step, e.g. before clipping the gradients), the inner ``optim.step()``, and
    ``engine.step()`` (counts the step; arms or runs a sync). ``param_groups`` and ``state``
    are the inner optimizer's, so learning-rate schedulers work on the wrapper; step hooks
    registered on the wrapper run around all of it, and its state-dict hooks
    (``register_state_dict_pre_hook`` and the three others of ``torch.optim.Optimizer``)
    around its own :meth:`state_dict` / :meth:`load_state_dict`, the engine's state
    included. (torch's DCP helpers
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` take the inner optimizer,
    ``opt.optim``, with :func:`editrain.engine_state_dict` for the engine: given the
    wrapper, their initialisation of an empty state would call :meth:`step`, which
    counts a step.)

    Args:
        optim: the inner optimizer over the model's parameters (the DDP-wrapped model's).
        engine: the engine built by :func:`editrain.edit` on the same model.
    """

    def __init__(self, optim: torch.optim.Optimizer, engine: SyncEngine) -> None:
        # torch.optim.Optimizer.__init__ is not called on purpose: the inner optimizer owns
        # the parameter groups and the state; the wrapper shares them.
        self.optim = optim
        self.engine = engine
        self._averaged = False
        # The wrapper's own step hooks (torch's registries are made by the __init__ not
        # called here): run around the whole step, the engine's book-keeping included.
        self._step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    # Read through to the inner optimizer every time, never copied: its load_state_dict()
    # replaces its param_groups list, and a copy taken here would go on holding the old
    # one (a learning-rate scheduler on the wrapper would then set learning rates that the
    # inner optimizer no longer reads).
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's parameter groups (learning rates and other options)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's default options."""
        return self.optim.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optim.defaults = defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-parameter state."""
        return self.optim.state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"

    def after_backward(self) -> None:
        """Average the gradients across replicas now if the engine is in warm-up (once per
        step, after the last backward); call it before clipping gradients, and
        :meth:`step` will not average them again."""
        self.engine.after_backward()
        self._averaged = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The inner step and the engine's book-keeping (see the class docstring).

        Args:
            closure: passed on to the inner optimizer's ``step`` (its gradients are not
                averaged across replicas during warm-up: call :meth:`after_backward`
                inside it for that).

        Returns:
            What the inner ``step`` returns.
        """
        args: tuple[Any, ...] = () if closure is None else (closure,)
        kwargs: dict[str, Any] = {}
        for hook in list(self._step_pre_hooks.values()):
            changed = hook(self, args, kwargs)
            if changed is not None:
                if not (isinstance(changed, tuple) and len(changed) == 2):
                    raise RuntimeError(f"a step pre-hook must return None or (args, kwargs), "
                                       f"got {changed!r}")
                args, kwargs = changed
        closure = kwargs.get("closure", args[0] if args else None)
        if not self._averaged and closure is None:
            self.engine.after_backward()
        self._averaged = False
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.engine.step()
        for hook in list(self._step_post_hooks.values()):
            hook(self, args, kwargs)
        return loss

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """A hook called before each :meth:`step` as ``hook(optimizer, args, kwargs)``
        (``optimizer`` is this wrapper); it may return ``(args, kwargs)`` to replace the
        step's arguments (the ``closure``), as :class:`torch.optim.Optimizer`'s do.

        Args:
            hook: the hook.

        Returns:
            A handle whose ``remove()`` removes the hook.
        """
        return _register(self._step_pre_hooks, hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """A hook called after each :meth:`step`, the engine's book-keeping included (a
        sync that step ran is done), as ``hook(optimizer, args, kwargs)``.

        Args:
            hook: the hook.

        Returns:
            A handle whose ``remove()`` removes the hook.
        """
        return _register(self._step_post_hooks, hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``.

        Args:
            set_to_none: set the gradients to None instead of zero.
        """
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The inner optimizer's ``add_param_group``.

        Args:
            param_group: the parameters and their options.
        """
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the engine's state under ``"editrain"``.

        The engine's state is ``engine.state_dict()``: anchors, outer optimizer state,
        detectors and counters (with DDP the anchors' slices are all-gathered, whole, laid
        out like the parameters). Every rank must call it at the same step boundary (it
        completes a sync in progress and gathers over the replica). Save each rank's own
        (e.g. ``torch.save(opt.state_dict(), f"opt{rank}.pt")``), with the model's state:
        between syncs the replicas' models differ, and the counters are per rank. For DCP
        checkpoints that also resume on another topology, use
        :func:`editrain.engine_state_dict` instead.
        """
        return self._state_dict_with_hooks(self._build_state_dict)

    def _build_state_dict(self) -> dict[str, Any]:
        out = self.optim.state_dict()
        out[STATE_KEY] = self.engine.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this rank (after the model's
        parameters have been restored); training then continues exactly as it would have.

        Args:
            state_dict: this rank's saved state dict.

        Raises:
            ValueError: the state has no engine state, or another rank saved it.
        """
        # Load pre hooks see (and may replace) the whole dict, the engine's entry included,
        # before it is checked: a hook may adapt a state saved in another layout.
        self._load_state_dict_with_hooks(state_dict, self._load_checked)

    def _load_checked(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        engine_state = state.pop(STATE_KEY, None)
        if engine_state is None:
            raise ValueError(f"the state dict has no {STATE_KEY!r} entry (engine state): it "
                             "was not saved by StatefulPostLocalSGDOptimizer.state_dict(); "
                             "load a plain optimizer state with opt.optim.load_state_dict()")
        if rank_key(self.engine.rank) not in engine_state.get("ranks", {}):
            raise ValueError(f"this state dict was saved by another rank than rank "
                             f"{self.engine.rank}: save opt.state_dict() on every rank and "
                             "load each rank's own")
        self.optim.load_state_dict(state)
        self.engine.load_state_dict(engine_state)
        self._averaged = False


def _register(table: OrderedDict[int, Callable[..., Any]], hook: Callable[..., Any]
              ) -> RemovableHandle:
    """Add ``hook`` to ``table``; the handle's ``remove()`` takes it out again."""
    handle = RemovableHandle(table)
    table[handle.id] = hook
    return handle


__all__ = ["STATE_KEY", "StatefulPostLocalSGDOptimizer"]
