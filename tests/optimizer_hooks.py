"""torch.optim.Optimizer's hook registrations, checked on an optimizer wrapper whose
``state_dict`` / ``load_state_dict`` are its own (tests/test_ddp.py, tests/test_optim.py).

torch runs the state-dict hooks inside ``Optimizer.state_dict`` / ``load_state_dict``; a
wrapper overriding both skipped them, or had no registries at all (AttributeError).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

REGISTRATIONS = ("register_load_state_dict_post_hook", "register_load_state_dict_pre_hook",
                 "register_state_dict_post_hook", "register_state_dict_pre_hook",
                 "register_step_post_hook", "register_step_pre_hook")
"""Every ``register_*`` of torch.optim.Optimizer (torch 2.13); a new one fails
:func:`check_every_registration` until the wrappers are checked for it."""


def check_every_registration(opt: torch.optim.Optimizer) -> None:
    """Each ``register_*`` of torch.optim.Optimizer returns a handle on ``opt``."""
    names = tuple(sorted(n for n in dir(torch.optim.Optimizer) if n.startswith("register_")))
    assert names == REGISTRATIONS, f"torch.optim.Optimizer's registrations changed: {names}"
    for name in names:
        handle = getattr(opt, name)(lambda *args: None)
        assert isinstance(handle, RemovableHandle), name
        handle.remove()


def check_state_dict_hooks(opt: torch.optim.Optimizer) -> None:
    """The four state-dict hooks run around ``opt``'s own methods as torch documents them:
    pre hooks in order (``prepend`` first), a post hook may change the dict in place or
    return a replacement, a load pre hook gets a shallow copy and may return the dict
    that is loaded, a load post hook sees the loaded state, a removed hook is not run."""
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre") if o is opt else None)
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre first"), prepend=True)
    removed = opt.register_state_dict_pre_hook(lambda o: calls.append("removed"))
    removed.remove()

    def mark(o: Any, state: dict) -> None:
        state["marked"] = True

    def replace(o: Any, state: dict) -> dict:
        return {**state, "replaced": state["marked"]}

    opt.register_state_dict_post_hook(mark)
    opt.register_state_dict_post_hook(replace)
    saved = opt.state_dict()
    assert calls == ["pre first", "pre"]
    assert saved["marked"] and saved["replaced"]

    lr = opt.param_groups[0]["lr"]
    seen: dict[str, Any] = {}

    def copy_and_change(o: Any, state: dict) -> dict:
        seen["a copy"] = state is not saved
        state["touched"] = True  # the caller's dict stays as it was
        groups = [dict(g, lr=lr * 3) for g in state["param_groups"]]
        return {**state, "param_groups": groups}

    opt.register_load_state_dict_pre_hook(copy_and_change)
    opt.register_load_state_dict_post_hook(
        lambda o: seen.setdefault("lr after", o.param_groups[0]["lr"]))
    opt.load_state_dict(saved)
    assert seen == {"a copy": True, "lr after": lr * 3}
    assert "touched" not in saved and saved["param_groups"][0]["lr"] == lr
    assert opt.param_groups[0]["lr"] == lr * 3  # the hook's dict is what was loaded
