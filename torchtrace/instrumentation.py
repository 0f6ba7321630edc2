"""Zero-code instrumentation: ``TorchInstrumentor``, an OpenTelemetry ``BaseInstrumentor``.

Registered under the ``opentelemetry_instrumentor`` entry point (``torch``), so ``opentelemetry-instrument python
serve.py`` traces every model ``serve.py`` runs, and ``torchtrace run serve.py`` does the same without
opentelemetry-distro.

How: ``torch.nn.Module.__call__`` is wrapped (as OpenTelemetry's instrumentors wrap a library's entry point). The
first time a *top-level* module is called (a module called outside any other module's forward) it is handed to
``torchtrace.instrument()`` before torch runs the call, so the first forward is traced like any other. Afterwards
the wrapper costs one set lookup per module call. Not a global forward pre-hook: any global hook sends every module
call of the process down ``nn.Module``'s slow path, the traced models' own calls included (zero-code tracing of
benchmarks/overhead.py's cheap model cost clearly more that way; see docs/zero-code.md). Modules first called inside
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
from collections.abc import Callable, Collection
from typing import Any

import torch
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from torchtrace import _handle

__all__ = ["TorchInstrumentor"]

_logger = logging.getLogger(__name__)
_instruments = ("torch >= 2.3",)
_CALL_IMPL_CODE = torch.nn.Module._call_impl.__code__
_MODULE_CALL = torch.nn.Module.__call__  # what the wrapper calls (torch's, or whatever was there before us)
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_on_first_call: Callable[[torch.nn.Module], None] | None = None  # the instrumentor's, while instrumented
_seen: dict[int, weakref.ref] = {}  # id -> weak reference of every module decided: traced, covered or skipped


def _watched_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``torch.nn.Module.__call__`` while instrumented: a module not seen before is decided on (and instrumented)
    before torch runs its call. Inside a compiled region the call is torch's alone."""
    if not _dynamo_compiling() and _on_first_call is not None and id(self) not in _seen:
        _on_first_call(self)
    return _MODULE_CALL(self, *args, **kwargs)


def _see(module: torch.nn.Module) -> None:
    """Marks a module decided, until it is freed (its id may then be reused)."""
    key = id(module)
    _seen[key] = weakref.ref(module, lambda _, key=key: _seen.pop(key, None))


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
        self._options: dict[str, Any] = {}
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
        from torchtrace._core.options import resolve_options

        resolve_options(**options)
        global _on_first_call
        with self._lock:
            self._options = options
            _seen.clear()
            _on_first_call = self._on_module_call
            if torch.nn.Module.__call__ is _MODULE_CALL:
                torch.nn.Module.__call__ = _watched_call
            if not self._at_exit_registered:
                # registered after any TracerProvider set up before instrument() (opentelemetry-instrument's is):
                # atexit runs last-in first-out, so pending calls reach the provider before it shuts down
                atexit.register(self._uninstrument_at_exit)
                self._at_exit_registered = True

    def _uninstrument(self, **kwargs: Any) -> None:
        global _on_first_call
        with self._lock:
            _on_first_call = None
            if torch.nn.Module.__call__ is _watched_call:  # one set over ours since stays, and calls through ours
                torch.nn.Module.__call__ = _MODULE_CALL
            _seen.clear()
            handles, self._handles = self._handles, []
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

    # -- a module's first call -------------------------------------------------------------------------------------

    def _on_module_call(self, module: torch.nn.Module) -> None:
        try:
            self._first_call(module)
        except Exception:  # never break the user's forward
            self.errors += 1
            _logger.exception("torchtrace: could not instrument %s; it runs untraced", type(module).__name__)

    def _first_call(self, module: torch.nn.Module) -> None:
        with self._lock:  # threads calling a model for the first time at once: one instruments, the others wait
            if _on_first_call is None or id(module) in _seen:
                return
            if not self._traceable(module):
                _see(module)
                return
            try:
                self._keep(_handle.instrument(module, **self._options))
            finally:  # traced, or refused (logged once): decided either way, not tried again at each call
                for sub in module.modules():
                    _see(sub)


MAX_GONE_HANDLES = 32  # handles of models already gone, kept for the exit summaries


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(sub is inner for sub in outer.modules())
