"""Shared fixtures: every test starts from a clean environment and must leave no instrumentation behind."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from torchtrace._handle import _live_handles

if not torch.cuda.is_available():
    # Triton's interpreter runs the statistics kernel on the CPU (tests/test_device.py). It must be chosen before
    # triton is first imported; with a GPU the kernel is compiled and tested on it (tests/test_cuda.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _dispatch_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "torchtrace-dispatch" and thread.is_alive()}


@pytest.fixture(autouse=True)
def _clean_torchtrace_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TORCHTRACE_* variable of the developer's shell leaks into a test; tests set the ones they need."""
    for name in list(os.environ):
        if name.startswith("TORCHTRACE_"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _process_settings_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a test sets with ``torchtrace.configure()`` ends with it."""
    from torchtrace._core import settings

    monkeypatch.setattr(settings, "_configured", settings.Settings())


@pytest.fixture(autouse=True)
def _no_global_tracer_provider_left_behind():
    """OTel's global TracerProvider can be set once per process: a test that sets it (``torchtrace run`` called
    in-process does) would hand its provider, shut down by then, to every later test that asks for the global one."""
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    provider = trace._TRACER_PROVIDER
    yield
    if trace._TRACER_PROVIDER is not provider:
        trace._TRACER_PROVIDER = provider
        trace._TRACER_PROVIDER_SET_ONCE = Once()
        if provider is not None:
            trace._TRACER_PROVIDER_SET_ONCE.do_once(lambda: None)


@pytest.fixture(autouse=True)
def _no_leftover_instrumentation():
    """Fails a test that leaves a live TraceHandle (hooks still registered) or a running dispatch worker."""
    threads_before = _dispatch_threads()
    yield
    leftovers = list(_live_handles)
    for handle in leftovers:
        handle.remove()
    leaked_threads = _dispatch_threads() - threads_before
    if leftovers:
        pytest.fail(
            f"test left {len(leftovers)} torchtrace handle(s) live: call remove() or use `with instrument(...)`"
        )
    if leaked_threads:
        pytest.fail(f"test left {len(leaked_threads)} torchtrace dispatch worker(s) running (a handle never removed)")


# --- OTLP receiver fixtures (tests/otlp_receiver.py) go below this line -------------------------------------------


@pytest.fixture(autouse=True)
def _every_exported_trace_is_well_formed(monkeypatch: pytest.MonkeyPatch):
    """Checks the spans of every capture_spans() and every OTLP receiver of a test with torchtrace.testing's
    check_traces (parents present and holding their children in time, ids, attribute types) when it ends."""
    from otlp_receiver import _Collector

    from torchtrace.testing import CapturedSpans, check_traces

    sources: list = []
    for cls in (CapturedSpans, _Collector):
        monkeypatch.setattr(cls, "__init__", _recorded_in(sources, cls.__init__))
    yield
    for source in sources:
        spans = source.exporter.get_finished_spans() if isinstance(source, CapturedSpans) else source.spans()
        check_traces(spans)


def _recorded_in(sources: list, init):
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sources.append(self)

    return recording_init


@pytest.fixture
def reads_in_line(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread of each timing-event read made where a forward with device work is resolved (rather than by the
    compiled module's reader thread while the next forward runs)."""
    from torchtrace._pipeline import dispatcher

    threads: list[str] = []
    read = dispatcher.elapsed_since
    monkeypatch.setattr(
        dispatcher, "elapsed_since", lambda *args: threads.append(threading.current_thread().name) or read(*args)
    )
    return threads
