"""What a traced module pickles and copies as: the module without torchtrace.

``pickle`` (``torch.save(model)``), ``copy.copy`` and ``copy.deepcopy`` take a module's state from its
``__getstate__``, looked up on the instance first. A traced module gets one there that returns the class's state
minus what torchtrace added: its traced ``forward`` (which holds the original module, so a shallow copy would run the
original) and torchtrace's hooks (local functions: nothing pickles them). A copy or a saved model is the untraced
model; trace it with ``instrument()`` of its own.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from torchtrace._traced_forward import TracedForward

# torch's forward-hook dicts, keyed by hook id: the hooks themselves, then the flags kept beside them
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


class UntracedState:
    """``module.__getstate__`` while traced: the module's own state without ``hook_ids`` and a traced forward.
    Holds the module weakly (no reference cycle through the module's own ``__dict__``)."""

    __slots__ = ("module_ref", "hook_ids")

    def __init__(self, module: torch.nn.Module, hook_ids: frozenset[int]) -> None:
        self.module_ref = weakref.ref(module)
        self.hook_ids = hook_ids

    def __deepcopy__(self, memo: dict) -> UntracedState:
        # reached only where a class deep-copies its instance dict itself (torch's parametrized modules): the
        # copy's state is the copy's (its traced forward is copied the same way: TracedForward.__deepcopy__)
        module = self.module_ref()
        copy = memo.get(id(module)) if module is not None else None
        return self if copy is None else UntracedState(copy, self.hook_ids)

    def __call__(self) -> Any:
        module = self.module_ref()
        if module is None:
            raise ReferenceError("the traced module this state belonged to has been freed")
        state = type(module).__getstate__(module)
        if not isinstance(state, dict):  # a class with a state of its own making: nothing of ours is in it
            return state
        state = dict(state)  # the class's may be the instance dict itself: never edit that
        if isinstance(state.get("forward"), TracedForward):
            del state["forward"]
        if state.get("__getstate__") is self:
            del state["__getstate__"]
        for name in _HOOK_DICTS:
            hooks = state.get(name)
            if hooks and not self.hook_ids.isdisjoint(hooks):
                state[name] = type(hooks)((key, value) for key, value in hooks.items() if key not in self.hook_ids)
        return state


class StateHandle:
    """Removes an ``UntracedState`` (as torch's RemovableHandle removes a hook); idempotent. One that another
    library set over ours since is left alone."""

    __slots__ = ("_state",)

    def __init__(self, state: UntracedState) -> None:
        self._state = state

    def remove(self) -> None:
        module = self._state.module_ref()
        if module is not None and module.__dict__.get("__getstate__") is self._state:
            del module.__dict__["__getstate__"]


def untraced_state(module: torch.nn.Module, hook_ids: frozenset[int]) -> StateHandle | None:
    """Makes ``module`` pickle and copy as itself untraced; ``hook_ids``: the ids of torchtrace's hooks on it. None
    where the instance already has a ``__getstate__`` of its own (kept: the module then pickles as before)."""
    if "__getstate__" in module.__dict__:
        return None
    state = UntracedState(module, hook_ids)
    module.__dict__["__getstate__"] = state  # not nn.Module.__setattr__: a plain attribute, set without its checks
    return StateHandle(state)
