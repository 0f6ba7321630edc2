"""The record stream: one resolved ``ModuleCall`` per traced module call.

The hot path (``_hooks``) leaves raw entries in a buffer; ``_dispatch`` resolves each finished forward into
``ModuleCall`` objects (ids assigned, timestamps on the epoch clock, statistics turned into attributes) and hands
the batch to every sink: span builder, OTLP encoder, in-memory records, summary, metrics.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]


def error_message(error: BaseException) -> str:
    """``str(error)``, or a placeholder when the exception's ``__str__`` itself raises (a user's class may)."""
    try:
        return str(error)
    except Exception:
        return f"<unprintable {type(error).__name__} object>"


def error_text(error: BaseException) -> str:
    """How an error reads in a span's status, a ``stats_error`` attribute or a log line: "ValueError: message"."""
    return f"{type(error).__name__}: {error_message(error)}"


def exception_event_attributes(error: BaseException) -> dict[str, str]:
    """The attributes of the SDK's ``record_exception`` event, without the deprecated ``exception.escaped`` (and
    without calling ``str(error)`` unguarded, as the SDK does)."""
    etype = type(error)
    module, qualname = etype.__module__, etype.__qualname__
    return {
        "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
        "exception.message": error_message(error),
        "exception.stacktrace": "".join(traceback.format_exception(error)),
    }


@dataclass(slots=True, eq=False)
class ModuleCall:
    """One finished call of one module: what a span and a record are made of."""

    path: str  # module path inside the instrumented model ("" is shown as the model's class name)
    type_name: str  # e.g. "torch.nn.modules.linear.Linear" shortened to "Linear"
    depth: int  # 0 for the outermost traced call of a forward
    trace_id: int  # 128-bit
    span_id: int  # 64-bit, never 0
    parent_span_id: int  # 64-bit; 0 only for a root with no parent context
    start_ns: int  # epoch nanoseconds (time.time_ns clock)
    end_ns: int
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    error: BaseException | None = None  # the exception the call raised, if it did
    thread_id: int = 0
    parent_is_remote: bool = False  # the parent is the caller's OTel span, not one of ours
    trace_flags: int = 1  # W3C flags of the trace (sampled bit set)
    trace_state: Any = None  # opentelemetry.trace.TraceState of the parent context, if any
    output_value: Any = None  # result of the user's function_on_output, if given
    input_value: Any = None  # result of the user's function_on_input, if given
    tensors: dict[str, Any] | None = None  # opt-in captured tensors (see capture_tensors)
    module_attributes: dict[str, Any] | None = None  # values of the module_attributes option after the call
    kind: str = "forward"  # "forward" | "backward" (a module's backward) | "step" | "phase" (backward, optimizer)

    @property
    def name(self) -> str:
        """Span name, bounded by the model's size: the module path (its class name for the model itself),
        "<path> backward" for a module's backward, and the step / phase name for the others."""
        if self.kind == "forward":
            return self.path or self.type_name
        if self.kind == "backward":
            return f"{self.path or self.type_name} backward"
        return self.type_name

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class NonFiniteError(ArithmeticError):
    """A module produced NaN or Inf: marks the first such call of a forward / backward (span status ERROR with an
    ``exception`` event naming the tensor); raised by ``TraceHandle.step()`` with ``on_nonfinite="raise"``."""

    def __init__(self, message: str, call: ModuleCall | None = None) -> None:
        super().__init__(message)
        self.call = call


# A sink receives each batch of finished calls, in start order per forward, off the hot path.
Sink = Callable[[Sequence[ModuleCall]], None]
