"""torch's state-dict hooks for optimizer wrappers that override its state-dict methods.

``torch.optim.Optimizer`` runs the hooks of ``register_state_dict_pre_hook`` and its three
siblings inside its own ``state_dict`` and ``load_state_dict``. A wrapper that overrides
both (to hand out an inner optimizer's state, plus its own) never reaches that code: the
hooks registered on it were silently skipped (WSAM), or their registries did not exist at
all and registering raised ``AttributeError`` (a wrapper that does not call
``Optimizer.__init__``). :class:`StateDictHooks` keeps the four registries on the wrapper and
runs them around the wrapper's own methods, as torch documents them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

StateDict = dict[str, Any]

_KINDS = ("state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post")


class StateDictHooks:
    """Mixin (put before ``torch.optim.Optimizer`` in the bases) giving an optimizer wrapper
    torch's four state-dict hook registrations, with torch's semantics:

    * ``state_dict`` pre hooks: ``hook(optimizer)``, before the state is built;
    * ``state_dict`` post hooks: ``hook(optimizer, state_dict)``, may change it in place or
      return a replacement;
    * ``load_state_dict`` pre hooks: ``hook(optimizer, state_dict)`` on a shallow copy of
      the caller's dict, may change it or return a replacement, which is what is loaded;
    * ``load_state_dict`` post hooks: ``hook(optimizer)``, after everything is loaded.

    The wrapper's ``state_dict`` returns ``self._state_dict_with_hooks(build)`` and its
    ``load_state_dict`` calls ``self._load_state_dict_with_hooks(state_dict, load)``.
    Hooks registered on an inner optimizer stay the inner optimizer's (they run when the
    wrapper calls the inner ``state_dict`` / ``load_state_dict``).
    """

    @property
    def _state_dict_hook_tables(self) -> dict[str, OrderedDict[int, Callable[..., Any]]]:
        # Made on first use, not in an __init__: a wrapper need not call a mixin's
        # __init__ (nor torch.optim.Optimizer's), and an object unpickled from before
        # the registries existed gets them too.
        tables = self.__dict__.get("_wrapper_state_dict_hooks")
        if tables is None:
            tables = {kind: OrderedDict() for kind in _KINDS}
            self.__dict__["_wrapper_state_dict_hooks"] = tables
        return tables

    def _add_state_dict_hook(self, kind: str, hook: Callable[..., Any], prepend: bool
                             ) -> RemovableHandle:
        table = self._state_dict_hook_tables[kind]
        handle = RemovableHandle(table)
        table[handle.id] = hook
        if prepend:
            table.move_to_end(handle.id, last=False)
        return handle

    def register_state_dict_pre_hook(self, hook: Callable[[Any], None],
                                     prepend: bool = False) -> RemovableHandle:
        """A hook called as ``hook(optimizer)`` before :meth:`state_dict` builds the state.

        Args:
            hook: the hook.
            prepend: run it before the hooks already registered (else after them).

        Returns:
            A handle whose ``remove()`` removes the hook.
        """
        return self._add_state_dict_hook("state_dict_pre", hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[[Any, StateDict], StateDict | None],
                                      prepend: bool = False) -> RemovableHandle:
        """A hook called as ``hook(optimizer, state_dict)`` after :meth:`state_dict` built
        the state; it may change ``state_dict`` in place or return a new one, which is then
        returned (and handed to the next hook).

        Args:
            hook: the hook.
            prepend: run it before the hooks already registered (else after them).

        Returns:
            A handle whose ``remove()`` removes the hook.
        """
        return self._add_state_dict_hook("state_dict_post", hook, prepend)

    def register_load_state_dict_pre_hook(
            self, hook: Callable[[Any, StateDict], StateDict | None], prepend: bool = False
    ) -> RemovableHandle:
        """A hook called as ``hook(optimizer, state_dict)`` before :meth:`load_state_dict`
        loads anything, ``state_dict`` a shallow copy of the caller's; it may change it in
        place or return a new one, which is then loaded (and handed to the next hook).

        Args:
            hook: the hook.
            prepend: run it before the hooks already registered (else after them).

        Returns:
            A handle whose ``remove()`` removes the hook.
        """
        return self._add_state_dict_hook("load_state_dict_pre", hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[[Any], None],
                                           prepend: bool = False) -> RemovableHandle:
        """A hook called as ``hook(optimizer)`` after :meth:`load_state_dict` loaded
        everything.

        Args:
            hook: the hook.
            prepend: run it before the hooks already registered (else after them).

        Returns:
            A handle whose ``remove()`` removes the hook.
        """
        return self._add_state_dict_hook("load_state_dict_post", hook, prepend)

    def _state_dict_with_hooks(self, build: Callable[[], StateDict]) -> StateDict:
        """``build()``'s state dict, with the state-dict pre and post hooks around it."""
        tables = self._state_dict_hook_tables
        for hook in list(tables["state_dict_pre"].values()):
            hook(self)
        state = build()
        for hook in list(tables["state_dict_post"].values()):
            replaced = hook(self, state)
            if replaced is not None:
                state = replaced
        return state

    def _load_state_dict_with_hooks(self, state_dict: StateDict,
                                    load: Callable[[StateDict], None]) -> None:
        """``load(state)`` with the load pre hooks before (on a shallow copy of
        ``state_dict``: the caller's dict is never changed) and the post hooks after."""
        tables = self._state_dict_hook_tables
        state = dict(state_dict)
        for hook in list(tables["load_state_dict_pre"].values()):
            replaced = hook(self, state)
            if replaced is not None:
                state = replaced
        load(state)
        for hook in list(tables["load_state_dict_post"].values()):
            hook(self)


__all__ = ["StateDictHooks"]
