"""A traced module's ``forward``: one Python call around the module's own forward, in place of a pre and a post hook.

Any forward hook sends ``nn.Module.__call__`` down its slow path (hook dictionaries merged and walked, backward-hook
setup); a module whose ``forward`` is an instance attribute keeps the fast path: empty pre + post hooks add several
times what this wrapper with an empty body adds a call (docs/performance.md; benchmarks/overhead.py's empty_hooks
variant is the hooks' floor). The instrumented model itself keeps torch's hooks (see ``_handle``): they run outside
a ``torch.compile``d region, which this wrapper, being the module's forward, cannot.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

_partial_func = functools.partial.func.__get__  # the function a partial calls, whatever a subclass shows as .func
_SLOW_BODY = 2  # the Python body's place in the compiled call's context (HookRecorder.traced_forward)


class TracedForward(functools.partial):
    """``module.forward`` while traced: ``body(context, module_ref, function, *args, **kwargs)``, where ``function``
    is the forward of the module's class (called with the module first), ``module_ref`` a weak reference (no
    reference cycle: a model dropped is freed at once, as an untraced one is) and ``context`` what the body needs
    (see ``HookRecorder.traced_forward``)."""

    __slots__ = ()

    @property
    def func(self) -> Callable[..., Any]:  # type: ignore[override]
        # What readers of a partial's function get (torch.export reads its __code__; dynamo inlines it): the Python
        # body, where the body called is the compiled one (a builtin: no code to read or inline). Calls go through
        # partial's own slot, never this attribute.
        body = _partial_func(self)
        return self.args[0][_SLOW_BODY] if body is _traced_call else body

    @property
    def __signature__(self) -> inspect.Signature:  # the module's own: HF's Trainer and generate() read it
        module = self.args[1]()
        if module is None:
            return inspect.signature(self.args[2])
        return inspect.signature(_bound(inspect.getattr_static(type(module), "forward"), module))

    def __repr__(self) -> str:  # not partial's, which would print the body's whole context
        return f"<torchtrace traced forward: {self.args[2].__qualname__}>"

    def __deepcopy__(self, memo: dict) -> TracedForward:
        # A traced module deep-copies untraced (its __getstate__ leaves this out: see copies), unless its
        # class deep-copies its instance dict itself (torch's parametrized modules): then the copy's forward must
        # run the copy, not the original (traced, as torch's deep-copied hooks trace it)
        copy = copy_in(memo, self.args[1])
        return self if copy is None else self.running(copy)

    def running(self, module: torch.nn.Module) -> TracedForward:
        """This traced forward for another module of the same class (a copy of this one's)."""
        return type(self)(_partial_func(self), self.args[0], weakref.ref(module), self.args[2])


def copy_in(memo: dict, module_ref: Any) -> torch.nn.Module | None:
    """The copy that ``copy.deepcopy`` (its ``memo``) made of the weakly held module, if it made one."""
    module = module_ref()
    return memo.get(id(module)) if module is not None else None


class EntriesHandle:
    """Removes entries set in a module's instance dict (as torch's RemovableHandle removes a hook); idempotent. An
    entry that another library set over ours since is left alone (a forward set over ours then runs ours inside it,
    untraced: the handle's recorder is disabled at remove)."""

    __slots__ = ("_module_ref", "_entries")

    def __init__(self, module: torch.nn.Module, entries: dict[str, Any]) -> None:
        self._module_ref = weakref.ref(module)
        self._entries = entries

    def remove(self) -> None:
        module = self._module_ref()
        if module is None:
            return
        for name, entry in self._entries.items():
            if module.__dict__.get(name) is entry:
                del module.__dict__[name]


def can_wrap(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` is a plain method of its class, bound to the module. Not so, the module keeps
    torch's hooks: a TorchScript module, a forward another library set on the instance (accelerate's offloading), a
    class attribute that is no function (a staticmethod, a partial: not called with the module)."""
    return (
        not isinstance(module, torch.jit.ScriptModule)
        and "forward" not in module.__dict__
        and isinstance(inspect.getattr_static(type(module), "forward", None), types.FunctionType)
    )


def wrap_forward(module: torch.nn.Module, body: Callable[..., Any], context: Any) -> EntriesHandle:
    """Makes ``body`` with its ``context`` the module's forward (see ``HookRecorder.traced_forward``);
    ``can_wrap(module)`` must hold."""
    traced = TracedForward(body, context, weakref.ref(module), inspect.getattr_static(type(module), "forward"))
    module.__dict__["forward"] = traced  # not nn.Module.__setattr__: a plain attribute, set without its checks
    return EntriesHandle(module, {"forward": traced})


def compiled_call(module: torch.nn.Module) -> Callable[..., Any] | None:
    """What ``module.compile()`` set: the module's call compiled (``torch.compile(module._call_impl)``), which
    ``nn.Module.__call__`` runs in place of its own while set; None for a module never compiled so."""
    return module.__dict__.get("_compiled_call_impl")


class TracedCompiledCall(functools.partial):
    """``module._compiled_call_impl`` while traced (a module compiled with ``module.compile()``):
    ``body(module_ref, compiled, *args, **kwargs)``, where ``compiled`` is the compiled call torch set. torch calls it
    from ``nn.Module.__call__`` before any compiled code runs, so the call is traced outside the compiled region,
    around it, and the module's forward, hooks and submodules stay untouched for dynamo (identical blocks compile to
    one graph, as untraced)."""

    __slots__ = ()

    @property
    def compiled(self) -> Callable[..., Any]:
        return self.args[1]

    def __repr__(self) -> str:
        return f"<torchtrace traced compiled call: {self.compiled!r}>"


class CompiledCallHandle:
    """Puts the compiled call back in place of ours (as ``EntriesHandle`` takes ours out); idempotent. A compiled
    call set over ours since (``module.compile()`` again) is left alone."""

    __slots__ = ("_module_ref", "_traced")

    def __init__(self, module: torch.nn.Module, traced: TracedCompiledCall) -> None:
        self._module_ref = weakref.ref(module)
        self._traced = traced

    def remove(self) -> None:
        module = self._module_ref()
        if module is not None and module.__dict__.get("_compiled_call_impl") is self._traced:
            module.__dict__["_compiled_call_impl"] = self._traced.compiled


def wrap_compiled_call(module: torch.nn.Module, body: Callable[..., Any]) -> CompiledCallHandle:
    """Makes ``body`` the module's compiled call, around the one ``module.compile()`` set (``compiled_call(module)``
    must not be None)."""
    traced = TracedCompiledCall(body, weakref.ref(module), compiled_call(module))
    module.__dict__["_compiled_call_impl"] = traced  # as nn.Module.__setattr__ sets it: a plain attribute
    return CompiledCallHandle(module, traced)


def class_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """What ``module.forward`` calls without ours, taking the module first: its class's forward as it is now, which a
    library (or ``mock.patch.object``) may have replaced since the module was traced."""
    forward = inspect.getattr_static(type(module), "forward")
    if isinstance(forward, types.FunctionType):
        return forward
    bound = _bound(forward, module)
    return lambda _module, *args, **kwargs: bound(*args, **kwargs)


def _bound(forward: Any, module: torch.nn.Module) -> Callable[..., Any]:
    """The class attribute ``forward`` bound to the module as attribute lookup binds it (``module.forward`` without
    ours)."""
    return forward.__get__(module, type(module)) if hasattr(type(forward), "__get__") else forward


class TracedCallContext(NamedTuple):
    """What ``_native.traced_call`` reads of a traced module, by position (C reads a tuple by index): these fields in
    this order are the C side's ``TRACED_CALL_CONTEXT``. Made once per module by ``HookRecorder.traced_forward``."""

    index: int  # the module's index in the recorder
    local: Any  # the recorder's thread-local (its ``state``: the thread's forward)
    slow: Callable[..., Any]  # the Python body: every case C hands over
    tensor: type  # torch.Tensor: an output C summarises itself
    output_stats: Callable[..., Any] | None  # the output's statistics alone (None: output_work runs through run_work)
    output_work: tuple  # what runs on an output
    run_work: Callable[..., Any]
    call_failed: Callable[..., Any]  # a call that raised
    pop_to: Callable[..., Any]  # a stack left unbalanced
    note_error: Callable[..., Any]  # a statistic that failed
    compiler: Any  # torch.compiler (its flag: torch.export tracing)
    clock: Callable[[], int]  # time.perf_counter_ns
    outputs_slot: int  # where a call's output statistics go
    mark_start: Callable[..., Any]  # a CUDA call's start event where C cannot mark it (end events: marked in C)
    first_parameter: dict  # module index -> its first own Parameter (or None), as the recorder looked it up
    max_tensors: int  # Stats.max_tensors: a tuple output with more tensors takes the Python body


# The columns of a forward (``RawForward``) that ``_native.traced_call`` appends to and stores into, in the order
# it reads them from ``RawForward.columns``: the C side's ``FORWARD_COLUMNS``.
FORWARD_COLUMNS = ("module", "parent", "start", "end", "output_stats", "start_events", "end_events")


def native_traced_call() -> Callable[..., Any] | None:
    """``_native.traced_call`` (a traced call recorded in C) where it is built and reads the context Python builds,
    else None: the Python body. Dynamo never meets it: it inlines what ``TracedForward.func`` shows, the Python
    body, which calls the module's forward alone inside a compiled region."""
    return _traced_call


def _compiled_traced_call() -> Callable[..., Any] | None:
    try:
        from torchtrace import _native
    except ImportError:  # not built: the Python body
        return None
    if (
        getattr(_native, "TRACED_CALL_CONTEXT", None) != TracedCallContext._fields
        or getattr(_native, "FORWARD_COLUMNS", None) != FORWARD_COLUMNS
    ):
        warnings.warn(
            "torchtrace: the compiled extension reads another traced-call context than this torchtrace builds "
            "(an extension left from another version?): traced calls run in Python, correct but slower; reinstall "
            "torchtrace to rebuild it",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return _native.traced_call


_traced_call = _compiled_traced_call()
