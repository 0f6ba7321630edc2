"""Off the hot path: turns raw forwards into ``ModuleCall`` records and hands each batch to every sink.

Runs on a background worker every ``export_interval_ms``, and synchronously on ``flush()`` or when records are
read. A failing sink is logged and counted; it never stops the others or reaches user code.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import INVALID_SPAN_CONTEXT

from torchtrace._buffer import RecordBuffer
from torchtrace._calls import ModuleCall, Sink
from torchtrace._hooks import ModuleInfo, RawForward
from torchtrace._stats import resolve

_logger = logging.getLogger(__name__)

OUTPUT_PREFIX = "torchtrace.output"
INPUT_PREFIX = "torchtrace.input"
ATTRIBUTE_PREFIX = "torchtrace.module_attribute"


class CallInterrupted(BaseException):
    """Stands in for an exception torch did not show the hooks (e.g. KeyboardInterrupt)."""


_prefixed_keys: dict[tuple, tuple[str, ...]] = {}  # (prefix, tensor name, stat keys) -> attribute keys


def _stat_attributes(attributes: dict, prefix: str, summaries: dict[str, dict] | None) -> None:
    if not summaries:
        return
    for name, stats in summaries.items():
        if name == "_truncated":
            attributes[f"{prefix}.truncated"] = True
            continue
        if "_pending" in stats:
            resolve(stats)
        cache_key = (prefix, name, *stats)
        keys = _prefixed_keys.get(cache_key)
        if keys is None:
            if len(_prefixed_keys) > 10_000:  # output structures with ever-new keys: stay bounded
                _prefixed_keys.clear()
            base = f"{prefix}.{name}" if name else prefix
            keys = _prefixed_keys[cache_key] = tuple(f"{base}.{key}" for key in stats)
        attributes.update(zip(keys, stats.values()))


def resolve_forward(forward: RawForward, modules: Sequence[ModuleInfo]) -> list[ModuleCall]:
    """One raw forward -> its calls, parents before children, ids assigned. Runs once per traced call: lean."""
    parent = forward.parent if forward.parent is not None else INVALID_SPAN_CONTEXT
    if parent.is_valid:
        trace_id, root_parent_id = parent.trace_id, parent.span_id
        flags, trace_state = int(parent.trace_flags), parent.trace_state
    else:
        trace_id, root_parent_id, flags, trace_state = random.getrandbits(128) or 1, 0, 1, None
    offset = forward.clock_offset_ns
    thread_id = forward.thread_id
    getrandbits = random.getrandbits
    calls: list[ModuleCall] = []
    append = calls.append
    for (
        module,
        start,
        end,
        parent_position,
        _,
        outputs,
        inputs,
        error,
        output_value,
        input_value,
        attrs,
        tensors,
    ) in forward.entries:
        info = modules[module]
        attributes: dict[str, Any] = {"torchtrace.module.path": info.path, "torchtrace.module.type": info.type_name}
        if outputs:
            _stat_attributes(attributes, OUTPUT_PREFIX, outputs)
        if inputs:
            _stat_attributes(attributes, INPUT_PREFIX, inputs)
        if attrs:
            for name, value in attrs.items():
                if isinstance(value, (str, bool, int, float)):
                    attributes[f"{ATTRIBUTE_PREFIX}.{name}"] = value
        if error is not None and error == "interrupted":
            error = CallInterrupted("call interrupted")
        if parent_position >= 0:
            parent_call = calls[parent_position]
            depth, parent_id, remote = parent_call.depth + 1, parent_call.span_id, False
        else:
            depth, parent_id, remote = 0, root_parent_id, root_parent_id != 0
        append(
            ModuleCall(  # positional: keywords cost a microsecond per call here
                info.path,
                info.type_name,
                depth,
                trace_id,
                getrandbits(64) or 1,
                parent_id,
                start + offset,
                (end if end is not None else start) + offset,
                attributes,
                error,
                thread_id,
                remote,
                flags,
                trace_state,
                output_value,
                input_value,
                tensors,
                attrs,
            )
        )
    return calls


class Dispatcher:
    """Drains the record buffer into the sinks, on a worker thread and on demand."""

    def __init__(
        self, buffer: RecordBuffer, modules: Sequence[ModuleInfo], sinks: Sequence[Sink], interval_s: float
    ) -> None:
        self.buffer = buffer
        self.modules = modules
        self.sinks = list(sinks)
        self.interval_s = interval_s
        self.sink_errors = 0
        self._lock = threading.Lock()  # one drain at a time keeps batches in order
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None

    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="torchtrace-dispatch", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        self._stop.set()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout=10)
        self.drain()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.drain()

    def drain(self) -> int:
        """Processes everything buffered so far; returns the number of calls handed to the sinks."""
        with self._lock:
            forwards = self.buffer.take_all()
            if not forwards:
                return 0
            calls: list[ModuleCall] = []
            for forward in forwards:
                calls.extend(resolve_forward(forward, self.modules))
            for sink in self.sinks:
                try:
                    sink(calls)
                except Exception:
                    self.sink_errors += 1
                    _logger.exception("torchtrace: sink %r failed on %d calls", sink, len(calls))
            return len(calls)
