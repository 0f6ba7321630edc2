"""What copies of a traced module are: each runs itself, never the original.

``pickle`` (``torch.save(model)``), ``copy.copy`` and ``copy.deepcopy`` take a module's state from its
``__getstate__``, looked up on the instance first. A traced module gets one there that returns the class's state
minus what torchtrace added: its traced ``forward`` (which holds the original module, so a shallow copy would run the
original) and torchtrace's hooks (local functions: nothing pickles them). A copy or a saved model is the untraced
model; trace it with ``instrument()`` of its own.

``nn.DataParallel`` copies each module's instance dict into a replica per GPU at every forward
(``_replicate_for_data_parallel``, also looked up on the instance first): a traced module's replica gets a traced
forward of its own, so it runs the replica's parameters on the replica's device, traced.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from torchtrace._capture.traced_forward import EntriesHandle, TracedCompiledCall, TracedForward, copy_in

# torch's forward-hook dicts, keyed by hook id: the hooks themselves, then the flags kept beside them
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


class _EntryOfModule:
    """An entry of a traced module's instance dict: holds the module weakly (no reference cycle through the module's
    own dict)."""

    __slots__ = ("module_ref",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module_ref = weakref.ref(module)

    def module(self) -> torch.nn.Module:
        module = self.module_ref()
        if module is None:
            raise ReferenceError("torchtrace: the traced module of this entry has been freed")
        return module

    def of(self, module: torch.nn.Module) -> _EntryOfModule:
        """The same entry for another module (a copy of this one's)."""
        raise NotImplementedError

    def __deepcopy__(self, memo: dict) -> _EntryOfModule:
        # reached only where a class deep-copies its instance dict itself (torch's parametrized modules): the
        # copy's entry is the copy's, as its traced forward is (TracedForward.__deepcopy__)
        copy = copy_in(memo, self.module_ref)
        return self if copy is None else self.of(copy)


class UntracedState(_EntryOfModule):
    """``module.__getstate__`` while traced: the module's own state without ``hook_ids`` and torchtrace's entries."""

    __slots__ = ("hook_ids",)

    def __init__(self, module: torch.nn.Module, hook_ids: frozenset[int]) -> None:
        super().__init__(module)
        self.hook_ids = hook_ids

    def of(self, module: torch.nn.Module) -> UntracedState:
        return UntracedState(module, self.hook_ids)

    def __call__(self) -> Any:
        module = self.module()
        state = type(module).__getstate__(module)
        if not isinstance(state, dict):  # a class with a state of its own making: nothing of ours is in it
            return state
        state = dict(state)  # the class's may be the instance dict itself: never edit that
        if isinstance(state.get("forward"), TracedForward):
            del state["forward"]
        if isinstance(state.get("_compiled_call_impl"), TracedCompiledCall):
            state["_compiled_call_impl"] = state["_compiled_call_impl"].compiled  # as module.compile() left it
        _drop_entries(state)
        for name in _HOOK_DICTS:
            hooks = state.get(name)
            if hooks and not self.hook_ids.isdisjoint(hooks):
                state[name] = type(hooks)((key, value) for key, value in hooks.items() if key not in self.hook_ids)
        return state


class TracedReplicas(_EntryOfModule):
    """``module._replicate_for_data_parallel`` while its forward is traced: torch's replica, with a traced forward
    that runs the replica (the instance dict's copy would run the original) and none of torchtrace's entries."""

    __slots__ = ()

    def of(self, module: torch.nn.Module) -> TracedReplicas:
        return TracedReplicas(module)

    def __call__(self) -> torch.nn.Module:
        module = self.module()
        replica = type(module)._replicate_for_data_parallel(module)
        traced = replica.__dict__.get("forward")
        if isinstance(traced, TracedForward):
            replica.__dict__["forward"] = traced.running(replica)
        _drop_entries(replica.__dict__)
        return replica


class CompileWatch(_EntryOfModule):
    """``module.compile`` while traced: torch's ``nn.Module.compile``, then ``on_compile(module)`` (weakly held: the
    handle's), which traces the module as a whole from then on (see ``selection.compiled_alone``). A module is
    compiled so before its first call: no call of it is checked for this."""

    __slots__ = ("on_compile",)

    def __init__(self, module: torch.nn.Module, on_compile: weakref.WeakMethod) -> None:
        super().__init__(module)
        self.on_compile = on_compile

    def of(self, module: torch.nn.Module) -> CompileWatch:
        return CompileWatch(module, self.on_compile)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        module = self.module()
        type(module).compile(module, *args, **kwargs)
        on_compile = self.on_compile()
        if on_compile is not None:
            on_compile(module)


# what a traced module's instance dict gets here
_ENTRIES = ("__getstate__", "_replicate_for_data_parallel", "compile")


def _drop_entries(entries: dict[str, Any]) -> None:
    for name in _ENTRIES:
        if isinstance(entries.get(name), _EntryOfModule):
            del entries[name]


def follow_copies(
    module: torch.nn.Module, hook_ids: frozenset[int], on_compile: weakref.WeakMethod | None = None
) -> EntriesHandle:
    """Makes copies of ``module`` run themselves: pickled or copied untraced, replicated traced (see above);
    ``hook_ids``: the ids of torchtrace's hooks on it; ``on_compile``: called after ``module.compile()`` (see
    ``CompileWatch``). An entry the instance already has of its own is kept (the module then pickles, or
    replicates, or compiles, as before)."""
    entries: dict[str, Any] = {"__getstate__": UntracedState(module, hook_ids)}
    if isinstance(module.__dict__.get("forward"), TracedForward):
        entries["_replicate_for_data_parallel"] = TracedReplicas(module)
    if on_compile is not None:
        entries["compile"] = CompileWatch(module, on_compile)
    entries = {name: entry for name, entry in entries.items() if name not in module.__dict__}
    module.__dict__.update(entries)  # not nn.Module.__setattr__: plain attributes, set without its checks
    return EntriesHandle(module, entries)
