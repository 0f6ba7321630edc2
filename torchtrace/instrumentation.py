"""Zero-code instrumentation: ``TorchInstrumentor``, an OpenTelemetry ``BaseInstrumentor``.

Registered under the ``opentelemetry_instrumentor`` entry point (``torch``), so ``opentelemetry-instrument python
serve.py`` traces every model ``serve.py`` runs, and ``torchtrace run serve.py`` does the same without
opentelemetry-distro.

How: one global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``). The first time a
*top-level* module is called (a module called outside any other module's forward) it is handed to
``torchtrace.instrument()``, and the hooks just registered on it are run for that very call, so the first forward
is traced too. Afterwards the global hook costs one weak-set lookup per module call. Modules first called inside
another module's forward are its submodules (or helpers): they are traced as part of it, never on their own.

Options come from ``TORCHTRACE_*`` variables (as for ``instrument()``), or from keyword arguments of
``TorchInstrumentor().instrument(**options)``; ``tracer_provider`` from kwargs, else the global one.

    from torchtrace.instrumentation import TorchInstrumentor
    TorchInstrumentor().instrument()           # every model called from now on is traced
    ...
    TorchInstrumentor().uninstrument()         # hooks out, pending spans delivered
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from collections.abc import Collection
from typing import Any

import torch
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from torchtrace import _handle

__all__ = ["TorchInstrumentor"]

_logger = logging.getLogger(__name__)
_instruments = ("torch >= 2.3",)
_CALL_IMPL_CODE = torch.nn.Module._call_impl.__code__


def _inside_another_forward(module: torch.nn.Module) -> bool:
    """True when a module other than ``module`` is running its forward on this thread (a frame walk)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE and frame.f_locals.get("self") is not module:
            return True
        frame = frame.f_back
    return False


class TorchInstrumentor(BaseInstrumentor):
    """Traces every top-level ``torch.nn.Module`` called while instrumented, with ``torchtrace.instrument()``.

    Keyword arguments of ``instrument()``: ``tracer_provider`` (else the global one) and any option of
    ``torchtrace.instrument()`` (``exporter``, ``include``, ``stats``, ...); unset options come from ``TORCHTRACE_*``
    variables. ``handles`` are the ``TraceHandle`` of every model traced so far (live ones).
    """

    def __init__(self) -> None:
        if hasattr(self, "_lock"):
            return  # BaseInstrumentor is a singleton: every TorchInstrumentor() is the same object
        self._lock = threading.RLock()
        self._hook: Any = None
        self._options: dict[str, Any] = {}
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # decided: traced, covered or skipped
        # model -> the pre-hooks instrument() added, for calls that began before they existed
        self._root_hooks: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()
        self._handles: list[_handle.TraceHandle] = []
        self._at_exit_registered = False
        self.errors = 0  # instrument() failures (invalid TORCHTRACE_* variables...): logged, model runs untraced

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    @property
    def handles(self) -> list[_handle.TraceHandle]:
        with self._lock:
            return [handle for handle in self._handles if handle in _handle._live_handles]

    @property
    def traced_handles(self) -> list[_handle.TraceHandle]:
        """Every model's handle, also of models already gone (a script's ``main()`` returned): for the summaries
        at exit. The oldest gone ones are forgotten past ``MAX_GONE_HANDLES``."""
        with self._lock:
            return list(self._handles)

    def _instrument(self, **kwargs: Any) -> None:
        options = {key: value for key, value in kwargs.items() if value is not None}
        # validate now (raises here, not at the first forward): same merge as instrument() does
        from torchtrace._config import resolve_options

        resolve_options(**options)
        with self._lock:
            self._options = options
            self._seen = weakref.WeakSet()
            self._root_hooks = weakref.WeakKeyDictionary()
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._on_module_call)
            if not self._at_exit_registered:
                # registered after any TracerProvider set up before instrument() (opentelemetry-instrument's is):
                # atexit runs last-in first-out, so pending calls reach the provider before it shuts down
                atexit.register(self._uninstrument_at_exit)
                self._at_exit_registered = True

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            handles, self._handles = self._handles, []
            self._seen = weakref.WeakSet()
            self._root_hooks = weakref.WeakKeyDictionary()
            self._options = {}
        for handle in handles:
            handle.remove()

    def _uninstrument_at_exit(self) -> None:
        if self.is_instrumented_by_opentelemetry:
            try:
                self.uninstrument()
            except Exception:
                _logger.exception("torchtrace: uninstrumenting at exit failed")

    def _traceable(self, module: torch.nn.Module) -> bool:
        """Whether a module called outside any traced forward is a model of its own (under the lock)."""
        if module in _handle._instrumented or _inside_another_forward(module):
            return False  # instrumented by the user, or a part of the model being called
        if not any(True for _ in module.children()) and not any(True for _ in module.parameters()):
            return False  # a stateless leaf (a loss or activation made in the loop): not a model, not worth a trace
        for handle in self._handles:
            model = handle.model
            if model is not None and _contains(model, module):
                return False  # a submodule of a traced model, called on its own: traced with its model only
        # a model containing models traced earlier on their own: trace it as a whole instead
        for handle in [h for h in self._handles if h.model is not None and _contains(module, h.model)]:
            self._handles.remove(handle)
            handle.remove()
        return True

    def _keep(self, handle: _handle.TraceHandle) -> None:
        self._handles.append(handle)
        gone = [h for h in self._handles if h.model is None]
        for old in gone[:-MAX_GONE_HANDLES]:
            self._handles.remove(old)

    # -- the global pre-hook ----------------------------------------------------------------------------------------

    def _on_module_call(self, module: torch.nn.Module, args: tuple) -> None:
        if module in self._seen:  # the common case: one lookup
            return
        try:
            self._first_call(module, args)
        except Exception:  # never break the user's forward
            self.errors += 1
            _logger.exception("torchtrace: could not instrument %s; it runs untraced", type(module).__name__)

    def _first_call(self, module: torch.nn.Module, args: tuple) -> None:
        with self._lock:
            if self._hook is None:
                return
            new_hooks = self._root_hooks.get(module)  # instrumented by another thread while this one waited
            if new_hooks is None:
                if module in self._seen:
                    return
                if not self._traceable(module):
                    self._seen.add(module)
                    return
                pre_hooks_before = set(module._forward_pre_hooks)
                handle = _handle.instrument(module, **self._options)
                self._keep(handle)
                new_hooks = [(k, hook) for k, hook in module._forward_pre_hooks.items() if k not in pre_hooks_before]
                self._root_hooks[module] = new_hooks
                for sub in module.modules():  # last: other threads' calls wait on the lock until the hooks exist
                    self._seen.add(sub)
        # torch read this module's pre-hooks before calling us: run the new ones so this first call is traced too
        for key, hook in new_hooks:
            if key in module._forward_pre_hooks_with_kwargs:
                hook(module, args, {})  # the global hook does not see keyword arguments
            else:
                hook(module, args)


MAX_GONE_HANDLES = 32  # handles of models already gone, kept for the exit summaries


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(sub is inner for sub in outer.modules())
