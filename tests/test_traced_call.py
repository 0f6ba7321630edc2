"""A traced call is recorded in C where ``torchtrace._native`` is built (``_native.traced_call``), else by the Python
body it hands every uncommon case to: both record the same calls with the same attributes, raise the model's own
exceptions unchanged, and leave the model's outputs alone."""

from __future__ import annotations

import contextlib
import inspect
import time
from unittest import mock

import pytest
import torch
from test_device import Kernel, device_clock, simulated_cuda  # noqa: F401 - fixtures
from torch import nn

import torchtrace
from torchtrace._capture import device as device_module
from torchtrace._capture import stats as _stats
from torchtrace._capture import traced_forward as _traced_forward
from torchtrace._capture.batched import StatBatch
from torchtrace.testing import capture_spans

ERROR = ValueError("the model's own error")


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ERROR.with_traceback(None)  # the same object each time, its last traceback dropped (it would grow)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        attended, _ = self.attn(x, x, x, need_weights=False)  # keywords in, a tuple out
        return self.ff(self.norm(x + attended)) * scale


class Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        return self(self.layer(x), depth - 1) if depth else x


class Many(nn.Module):
    """More arguments than the compiled call keeps on its stack (16)."""

    def forward(self, *xs: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        return torch.stack(xs).sum(0) * weight


class Model(nn.Module):
    """Nested calls, keyword arguments, tuple and dict outputs, a call that raises and is handled by its caller, a
    module that calls itself, a call with many arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.fails = Fails()
        self.recursive = Recursive()
        self.many = Many()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x, scale=0.5)
        x = self.recursive(x)
        x = self.many(*([x] * 20), weight=0.05)
        with contextlib.suppress(ValueError):  # the caller handles its child's error
            self.fails(x)
        return {"logits": self.head(x), "hidden": x}


@pytest.fixture(params=["compiled", "python"])
def body(request, monkeypatch):
    """Which body records the calls: the compiled one (skipped where it is not built), or the Python one."""
    if request.param == "compiled" and _traced_forward.native_traced_call() is None:
        pytest.skip("torchtrace._native.traced_call is not used here")
    if request.param == "python":
        monkeypatch.setattr(_traced_forward, "_traced_call", None)
    return request.param


def model_and_input() -> tuple[Model, torch.Tensor]:
    torch.manual_seed(0)
    return Model().eval(), torch.randn(2, 5, 8)


def recorded(stats: bool = True) -> list[tuple]:
    """The calls of two forwards as (name, depth, parent's name, error, attributes)."""
    model, x = model_and_input()
    expected = model(x)
    with torchtrace.instrument(model, exporter="none", stats=stats) as handle:
        for _ in range(2):
            output = model(x)
            assert all(torch.equal(output[key], expected[key]) for key in expected)  # tracing changes nothing
        calls = handle.records
    names = {call.span_id: call.name for call in calls}
    return [
        (call.name, call.depth, names.get(call.parent_span_id), repr(call.error), call.attributes) for call in calls
    ]


@pytest.mark.parametrize("stats", [True, False], ids=["statistics", "spans"])
def test_both_bodies_record_the_same_calls(stats, monkeypatch):
    if _traced_forward.native_traced_call() is None:
        pytest.skip("torchtrace._native.traced_call is not used here")
    compiled = recorded(stats)
    monkeypatch.setattr(_traced_forward, "_traced_call", None)
    assert compiled == recorded(stats)
    assert [(name, depth, parent) for name, depth, parent, _, _ in compiled[:4]] == [
        ("Model", 0, None),
        ("blocks.0", 1, "Model"),
        ("blocks.0.attn", 2, "blocks.0"),
        ("blocks.0.norm", 2, "blocks.0"),
    ]
    assert [(name, depth, parent) for name, depth, parent, _, _ in compiled if name.startswith("recursive")] == [
        ("recursive", 1, "Model"), ("recursive.layer", 2, "recursive"), ("recursive", 2, "recursive"),
        ("recursive.layer", 3, "recursive"), ("recursive", 3, "recursive"),
    ] * 2  # fmt: skip
    assert [name for name, *_ in compiled].count("many") == 2
    failed = [call for call in compiled if call[0] == "fails"]
    assert len(failed) == 2 and all(error == repr(ERROR) for _, _, _, error, _ in failed)
    ff = next(attributes for name, _, _, _, attributes in compiled if name == "blocks.0.ff.2")
    assert ({"torchtrace.output.mean", "torchtrace.output.zero_fraction"} <= set(ff)) == stats


class Returns(nn.Module):
    """Returns what it is made with, a function of its input."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor):
        return self.make(x)


TUPLE_OUTPUTS = {
    "attention": lambda x: (x * 2, None),  # nn.MultiheadAttention(need_weights=False), Hugging Face blocks
    "two tensors": lambda x: (x + 1, x - 1, None),
    "named tuple": lambda x: torch.return_types.max((x, x.long())),  # a tuple subclass: the Python body
    "nested": lambda x: ((x, x + 1), None),  # "0.0", "0.1": the Python body
    "with a number": lambda x: (x, 3),  # the Python body
    "no tensor": lambda x: (None, None),
}


@pytest.mark.parametrize("make", list(TUPLE_OUTPUTS.values()), ids=list(TUPLE_OUTPUTS))
def test_a_tuple_output_is_summarised_as_by_the_python_body(make, monkeypatch):
    """A plain tuple of tensors and Nones is summarised in C (no Python frame); any other tuple by the Python body;
    both give the same attributes."""
    if _traced_forward.native_traced_call() is None:
        pytest.skip("torchtrace._native.traced_call is not used here")
    from torchtrace._capture.recorder import HookRecorder

    in_python = []
    summarise = HookRecorder._summarise_value
    monkeypatch.setattr(
        HookRecorder, "_summarise_value", lambda self, value: in_python.append(1) or summarise(self, value)
    )

    def attributes() -> list[dict]:
        model = nn.Sequential(Returns(make), Returns(lambda output: torch.ones(1)))  # the root returns a tensor
        with torchtrace.instrument(model, exporter="none") as handle:
            for _ in range(2):  # the first forward's calls go through Python (where each is to run is decided)
                in_python.clear()
                model(torch.arange(6.0).reshape(2, 3) - 2)
            return [call.attributes for call in handle.records if call.path == "0"]

    compiled = attributes()
    in_c = not in_python
    monkeypatch.setattr(_traced_forward, "_traced_call", None)
    assert compiled == attributes()  # the Python body's
    plain = make(torch.ones(1))
    assert in_c == (type(plain) is tuple and all(type(item) is torch.Tensor or item is None for item in plain)
                    and any(item is not None for item in plain))  # fmt: skip
    if in_c:
        assert "torchtrace.output.0.mean" in compiled[0]


def test_a_tuple_of_more_tensors_than_max_tensors_says_so_as_the_python_body_does(monkeypatch):
    if _traced_forward.native_traced_call() is None:
        pytest.skip("torchtrace._native.traced_call is not used here")

    def attributes() -> dict:
        model = nn.Sequential(Returns(lambda x: (x, x + 1, x + 2)))
        with torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(max_tensors=2)) as handle:
            model(torch.ones(2))
            return next(call.attributes for call in handle.records if call.path == "0")

    compiled = attributes()
    monkeypatch.setattr(_traced_forward, "_traced_call", None)
    assert compiled == attributes()
    assert "torchtrace.output.1.mean" in compiled and "torchtrace.output.2.mean" not in compiled


def test_the_body_in_use(body):
    model = nn.Linear(2, 2)
    outer = nn.Sequential(model)
    with torchtrace.instrument(outer, exporter="none"):
        called = _traced_forward._partial_func(model.forward)  # what the partial calls (.func shows the Python body)
        assert (called is _traced_forward._traced_call) == (body == "compiled")


def test_a_call_that_raises_raises_the_models_own_exception_with_its_traceback(body):
    model = nn.Sequential(nn.Linear(8, 8), Fails())
    with torchtrace.instrument(model, exporter="none") as handle:
        with pytest.raises(ValueError) as caught:
            model(torch.randn(2, 8))
        assert caught.value is ERROR
        assert caught.traceback[-1].name == "forward" and "raise ERROR" in str(caught.traceback[-1].statement)
        assert [(call.name, call.error) for call in handle.records] == [
            ("Sequential", ERROR),
            ("0", None),
            ("1", ERROR),
        ]


def test_a_statistic_that_fails_costs_only_itself(body, monkeypatch):
    def fails(self, tensor):
        raise RuntimeError("no statistics today")

    model, x = model_and_input()
    expected = model(x)
    with torchtrace.instrument(model, exporter="none") as handle:
        monkeypatch.setattr(_stats.StatComputer, "__call__", fails)
        output = model(x)
        assert all(torch.equal(output[key], expected[key]) for key in expected)
        linear = next(call for call in handle.records if call.name == "blocks.0.ff.0")
    assert linear.attributes["torchtrace.output.stats_error"] == "RuntimeError: no statistics today"
    assert linear.error is None


def test_both_bodies_time_a_forward_on_a_device_by_its_events(body, device_clock):  # noqa: F811 - the fixture
    """A forward on a (simulated) CUDA device: each call's span lasts what its events measured, not the host's
    clock."""
    model = nn.Sequential(Kernel(device_clock, 2.0), Kernel(device_clock, 3.0))
    with capture_spans(model) as captured:
        model(torch.zeros(2))
        durations = [(span.end_time - span.start_time) / 1e6 for span in captured.spans()]
    assert sorted(durations) == pytest.approx([2.0, 3.0, 5.0])


class DropsItsLayer(nn.Module):
    """Keeps its layer's forward, then lets go of the layer: untraced, the bound method keeps the layer alive."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.layer.forward
        del self.layer  # its last reference: a traced forward holds its module weakly
        return kept(x)


def test_both_bodies_time_calls_on_the_clock_the_forwards_hooks_use(body):
    """The compiled body reads perf_counter_ns's clock itself (no Python call): each call starts and ends between
    time.perf_counter_ns() read before and after the forward, nested inside the root's times (the root is timed by
    the Python hooks), in call order."""
    from torchtrace._pipeline.worker import WORKER

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Identity()), nn.Linear(4, 4))
    with torchtrace.instrument(model, exporter="none") as handle:
        handle._recorder._resolve = None  # the forward waits unresolved, its raw times for this test to read
        with WORKER._condition:
            before = time.perf_counter_ns()
            model(torch.randn(2, 4))
            after = time.perf_counter_ns()
            (forward,) = handle._dispatcher.buffer.take_all()
    starts, ends = forward.start, forward.end
    assert len(starts) == 6 and before <= starts[0] and ends[0] <= after  # "", 0, 1, 1.0, 1.1, 2
    assert all(starts[0] <= start <= end <= ends[0] for start, end in zip(starts[1:], ends[1:]))
    assert ends[1] <= starts[2] <= starts[3] <= ends[3] <= starts[4] <= ends[4] <= ends[2] <= starts[5]


def test_a_forward_kept_after_its_module_is_freed_says_so(body):
    untraced = DropsItsLayer()
    assert untraced(torch.ones(1, 2)).shape == (1, 2)
    model = DropsItsLayer()
    with torchtrace.instrument(model, exporter="none") as handle:
        with pytest.raises(ReferenceError, match=r"Linear\.forward was called after its module was freed"):
            model(torch.ones(1, 2))  # inside the traced forward: the compiled call hands it to the body
        assert [(call.name, call.error is not None) for call in handle.records] == [("DropsItsLayer", True)]


class Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


@pytest.mark.parametrize("replacement", ["function", "staticmethod", "callable"])
def test_a_class_forward_replaced_after_instrument_is_the_one_that_runs(body, replacement):
    """A library patching the class (an attention kernel swapped in; mock.patch.object in a test) after the model was
    traced: the traced module runs the class's forward as it is now, as an untraced module would, still traced."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 3))
    x = torch.randn(2, 4)

    def zeros(*args: torch.Tensor) -> torch.Tensor:  # a method's (self, x) or a static (x)
        return torch.zeros(args[-1].shape[0], 3)

    patched = {"function": zeros, "staticmethod": staticmethod(zeros), "callable": mock.Mock(side_effect=zeros)}
    with mock.patch.object(Scaled, "forward", patched[replacement]):
        expected = model(x)
    assert torch.equal(expected, torch.zeros(2, 3))
    unpatched = model(x)
    with torchtrace.instrument(model, exporter="none") as handle:
        with mock.patch.object(Scaled, "forward", patched[replacement]):
            assert torch.equal(model(x), expected)  # nested in the traced forward
            assert torch.equal(model[1](x), expected)  # on its own
        assert torch.equal(model(x), unpatched)  # and back again
        with mock.patch.object(Scaled, "forward", patched[replacement]):
            assert inspect.signature(model[1].forward) == inspect.signature(Scaled(4, 3).forward)  # what HF reads
        assert [call.path for call in handle.records] == ["", "0", "1", "1", "", "0", "1"]


def test_a_traced_sub_module_exports_on_its_own(body):
    """torch.export reads a partial forward's function's code (its non-strict fake inputs): the traced forward shows
    the Python body there, whichever body records the calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        exported = torch.export.export(model[0], (x,))
        targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
        assert targets == {"aten.linear.default"}  # no statistic, no clock read
        assert handle.records == []  # export's tracing run is not a forward of the model
        assert torch.equal(exported.module()(x), model[0](x))


# -- the compiled body's contract with Python: one definition each side, compared ---------------------------------


def _native_module():
    return pytest.importorskip("torchtrace._native", reason="the compiled extension is not built here")


def test_the_compiled_body_reads_the_context_the_recorder_builds():
    """C reads the context by index: its slots, in order, are the NamedTuple's fields."""
    assert _traced_forward.TracedCallContext._fields == _native_module().TRACED_CALL_CONTEXT


def test_the_compiled_body_reads_a_forwards_columns_in_the_order_python_keeps_them():
    """C appends to and stores into a forward's columns read by index from ``RawForward.columns``: the same
    objects as the named attributes the worker reads, in the order of FORWARD_COLUMNS."""
    assert _traced_forward.FORWARD_COLUMNS == _native_module().FORWARD_COLUMNS
    forward = torchtrace._capture.recorder.RawForward(None, 0, 0)
    assert len(forward.columns) == len(_traced_forward.FORWARD_COLUMNS)
    for name, column in zip(_traced_forward.FORWARD_COLUMNS, forward.columns):
        assert column is getattr(forward, name)


def test_every_attribute_the_compiled_body_reads_is_there_and_of_the_kind_it_reads(simulated_cuda):  # noqa: F811
    native = _native_module()
    seen = {}

    class Looks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            state = handle._recorder._local.state
            seen.update(local=handle._recorder._local, state=state, forward=state.forward, class_=type(self))
            return x

    model = nn.Sequential(Looks())
    with torchtrace.instrument(model, exporter="none") as handle:
        model(torch.ones(2))
    (timer,) = device_module._timers.values()  # the simulated CUDA device's: a DriverEventTimer
    rows = device_module.StatRows(torch.device("cpu"), device_module.RowPool())  # what launch_taken reserves in
    rows.reserve()
    owners = {"local": seen["local"], "state": seen["state"], "forward": seen["forward"],
              "compiler": torch.compiler, "class": seen["class_"], "rows": rows, "block": rows._blocks[0],
              "timer": timer, "event": timer._free[0], "computer": seen["state"].stats,
              "staging": _stats._Staging(torch.float32, 4), "batch": StatBatch(8, 1 << 20)}  # fmt: skip
    assert {where for where, _ in native.ATTRIBUTES_READ} == set(owners)
    for where, name in native.ATTRIBUTES_READ:
        assert hasattr(owners[where], name), f"_native.traced_call reads {where}.{name}, which is not there"
    for name in ("stack",):
        assert type(getattr(seen["state"], name)) is list  # read as exact lists, else handed to Python
    columns = seen["forward"].columns  # exact lists, then dicts: else the call is handed to Python
    assert [type(column) for column in columns] == [list] * 4 + [dict] * 3
    assert type(seen["state"].skip_depth) is int
    assert type(rows._used) is int and type(rows._blocks) is list  # read as an int and an exact list
    assert type(rows._blocks[0].values_address) is int and type(rows._blocks[0].counts_address) is int
    assert type(timer.marking) is tuple and len(timer.marking) == 5 and type(timer._free[0].handle) is int
    staging = owners["staging"]  # read as ints and an exact list, its values' length as its rows
    assert type(staging.count) is int and type(staging.address) is int and type(staging.row_bytes) is int
    assert type(staging.filled) is list and len(staging.values) == 16


def test_every_slot_the_compiled_hot_path_reads_of_its_own_classes_is_read_by_offset():
    """The per-thread state, the statistics computer, its staging, its batch queue, its rows and their blocks, the
    CUDA timer and its events are read many times a call: each of their slots that ``_native`` reads
    (ATTRIBUTES_READ) is bound, read by its offset in the instance rather than looked up by name; nothing else."""
    native = _native_module()
    from torchtrace._capture import batched, cuda_driver, device, recorder, stats

    owners = {"state": recorder._ThreadState, "computer": stats.StatComputer, "staging": stats._Staging,
              "batch": batched.StatBatch, "rows": device.StatRows, "block": device._Block,
              "timer": device.DriverEventTimer, "event": cuda_driver.DriverEvent}  # fmt: skip
    read = {(owners[where], name) for where, name in native.ATTRIBUTES_READ if where in owners}
    slots = {cls: {name for base in cls.__mro__ for name in getattr(base, "__slots__", ())} for cls in owners.values()}
    read = {(cls, name) for cls, name in read if name in slots[cls]}  # a method (StatComputer._device_rows) is not
    assert len(read) > 20
    assert set(native.bound_slots()) == read


@pytest.mark.parametrize(
    ("contract", "renamed"), [("TRACED_CALL_CONTEXT", ("clock", "clock_ns")), ("FORWARD_COLUMNS", ("end", "stop"))]
)
def test_an_extension_reading_another_context_is_refused_aloud(monkeypatch, contract, renamed):
    native = _native_module()
    old, new = renamed
    monkeypatch.setattr(native, contract, tuple(new if name == old else name for name in getattr(native, contract)))
    with pytest.warns(RuntimeWarning, match="another traced-call context"):
        assert _traced_forward._compiled_traced_call() is None
