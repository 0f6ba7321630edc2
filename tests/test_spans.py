"""One span per module call: the tree follows the calls, the times are the real call times, the caller's span is
the parent, threads do not mix, and an exception is recorded on the spans it passed through and reaches the caller
unchanged."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
import torch
from instrumented import traced_modules
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import StatusCode
from seed_models import TestForHook
from torch import nn

import torchtrace
from torchtrace._core.calls import Calls
from torchtrace.testing import capture_spans

HOOK_TREE = {"TestForHook": {"linear_1": {}, "linear_2": {}, "relu": {}, "relu6": {}}}


def hook_input() -> torch.Tensor:
    return torch.full((2, 2), 0.1)


def parent_id(span) -> int | None:
    return span.parent.span_id if span.parent is not None else None


# -- span trees ---------------------------------------------------------------------------------------------------


def test_hook_model_gives_one_span_per_module_under_the_model_span():
    model = TestForHook()
    with capture_spans(model) as captured:
        model(hook_input())
        assert captured.tree() == HOOK_TREE
        assert captured.span("linear_1").attributes["torchtrace.output.mean"] == pytest.approx(1.2)
        assert captured.span("linear_2").attributes["torchtrace.output.mean"] == pytest.approx(3.4)
        assert captured.span("relu6").attributes["torchtrace.output.mean"] == pytest.approx(3.4)
        root = captured.span("TestForHook")
        for name in ("linear_1", "linear_2", "relu", "relu6"):
            assert parent_id(captured.span(name)) == root.context.span_id


def test_span_attributes_name_the_module_path_and_type():
    model = TestForHook()
    with capture_spans(model) as captured:
        model(hook_input())
        linear = captured.span("linear_1").attributes
        root = captured.span("TestForHook").attributes
    assert (linear["torchtrace.module.path"], linear["torchtrace.module.type"]) == ("linear_1", "Linear")
    assert (root["torchtrace.module.path"], root["torchtrace.module.type"]) == ("", "TestForHook")


def test_nested_sequential_spans_follow_the_module_nesting():
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 2), nn.Tanh()))
    with capture_spans(model) as captured:
        model(torch.randn(5, 3))
        assert captured.tree() == {
            "Sequential": {
                "0": {"0.0": {}, "0.1": {}},
                "1": {"1.0": {}, "1.1": {}},
            }
        }


class CallsTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(2, 2)

    def forward(self, x):
        return self.block(self.block(x))


def test_a_module_called_twice_gives_two_spans_in_call_order():
    model = CallsTwice()
    x = torch.randn(1, 2)
    with capture_spans(model) as captured:
        model(x)
        assert captured.tree() == {"CallsTwice": {"block": {}, "block#2": {}}}
        first, second = captured.spans_named("block")
    assert first.context.span_id != second.context.span_id
    assert first.end_time <= second.start_time
    with torch.no_grad():
        once = model.block(x)
    assert first.attributes["torchtrace.output.mean"] == pytest.approx(once.mean().item())
    assert second.attributes["torchtrace.output.mean"] == pytest.approx(model.block(once).mean().item())


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class SharedChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(2, 2)
        self.a = Wrapper(shared)
        self.b = Wrapper(shared)

    def forward(self, x, use_b_only: bool = False):
        return self.b(x) if use_b_only else self.b(self.a(x))


def test_a_shared_module_is_parented_by_whichever_module_called_it():
    model = SharedChild()
    with capture_spans(model) as captured:
        model(torch.randn(1, 2))
        # the shared Linear is named by its first path ("a.inner"), but each call sits under its caller
        assert captured.tree() == {"SharedChild": {"a": {"a.inner": {}}, "b": {"a.inner": {}}}}
        captured.clear()
        model(torch.randn(1, 2), use_b_only=True)
        assert captured.tree() == {"SharedChild": {"b": {"a.inner": {}}}}


class Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = nn.Linear(2, 2)

    def forward(self, x, depth: int):
        return self.leaf(x) if depth == 0 else self(x, depth - 1)


def test_a_recursive_module_nests_one_span_per_call():
    model = Recursive()
    with capture_spans(model) as captured:
        model(torch.randn(1, 2), 2)
        assert captured.tree() == {"Recursive": {"Recursive": {"Recursive": {"leaf": {}}}}}


def test_every_forward_is_its_own_tree():
    model = TestForHook()
    with capture_spans(model) as captured:
        model(hook_input())
        model(hook_input())
        roots = captured.spans_named("TestForHook")
        assert len(roots) == 2
        assert roots[0].context.trace_id != roots[1].context.trace_id
        assert captured.tree() == {"TestForHook": HOOK_TREE["TestForHook"], "TestForHook#2": HOOK_TREE["TestForHook"]}


# -- timing -------------------------------------------------------------------------------------------------------


class Sleeps(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


def test_span_times_are_the_real_call_times():
    model = nn.Sequential(Sleeps(0.02), nn.ReLU(), Sleeps(0.01))
    with capture_spans(model) as captured:
        before = time.time_ns()
        model(torch.ones(3))
        after = time.time_ns()
        root = captured.span("Sequential")
        children = [captured.span(name) for name in ("0", "1", "2")]

    assert before <= root.start_time <= root.end_time <= after
    for child in children:
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    # siblings run one after the other, in call order
    for earlier, later in zip(children, children[1:], strict=False):
        assert earlier.end_time <= later.start_time
    # a module that sleeps 20 ms lasts at least 20 ms (and not absurdly longer)
    assert 20_000_000 <= children[0].end_time - children[0].start_time < 2_000_000_000
    assert 10_000_000 <= children[2].end_time - children[2].start_time < 2_000_000_000
    assert root.end_time - root.start_time >= 30_000_000


# -- parents: the caller's span, or a new trace ---------------------------------------------------------------------


def test_the_model_span_is_a_child_of_the_callers_current_span():
    model = TestForHook()
    with capture_spans(model) as captured:
        with captured.tracer.start_as_current_span("request") as request:
            model(hook_input())
        root = captured.span("TestForHook")
        assert root.parent.span_id == request.get_span_context().span_id
        assert root.context.trace_id == request.get_span_context().trace_id
        assert all(span.context.trace_id == root.context.trace_id for span in captured.spans())
        assert captured.tree() == {"request": HOOK_TREE}


def test_without_a_current_span_the_model_span_starts_a_new_trace():
    model = TestForHook()
    with capture_spans(model) as captured:
        with captured.tracer.start_as_current_span("earlier") as earlier:
            pass
        model(hook_input())
        root = captured.span("TestForHook")
    assert root.parent is None
    assert root.context.trace_id != earlier.get_span_context().trace_id


def test_a_caller_span_from_another_provider_is_still_the_parent():
    model = TestForHook()
    other = TracerProvider().get_tracer("other")
    with capture_spans(model) as captured:
        with other.start_as_current_span("outer") as outer:
            model(hook_input())
        root = captured.span("TestForHook")
    assert root.parent.span_id == outer.get_span_context().span_id
    assert root.context.trace_id == outer.get_span_context().trace_id


def test_concurrent_threads_each_nest_under_their_own_request_span():
    threads_count, forwards = 8, 5
    model = TestForHook()
    barrier = threading.Barrier(threads_count)
    errors: list[BaseException] = []

    with capture_spans(model) as captured:

        def work(index: int) -> None:
            try:
                barrier.wait()
                for _ in range(forwards):
                    with captured.tracer.start_as_current_span(f"request-{index}"):
                        model(torch.full((2, 2), float(index)))
            except BaseException as error:  # surfaced below
                errors.append(error)

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not errors
        spans = captured.spans()

    by_id = {span.context.span_id: span for span in spans}

    def request_of(span):
        while not span.name.startswith("request-"):
            span = by_id[span.parent.span_id]  # every module span has a captured ancestor chain
        return span

    module_spans = [span for span in spans if not span.name.startswith("request-")]
    assert len(module_spans) == threads_count * forwards * 5
    for span in module_spans:
        request = request_of(span)
        assert span.context.trace_id == request.context.trace_id
        if span.name == "linear_1":
            # thread i feeds full((2, 2), i): Linear(2, 2) with unit weights gives 2i + 1 everywhere
            index = int(request.name.removeprefix("request-"))
            assert span.attributes["torchtrace.output.mean"] == pytest.approx(2 * index + 1)
    for request in (span for span in spans if span.name.startswith("request-")):
        (child,) = children_of(request, spans)
        assert child.name == "TestForHook"
        assert sorted(span.name for span in children_of(child, spans)) == ["linear_1", "linear_2", "relu", "relu6"]


def children_of(parent, spans) -> list:
    return [span for span in spans if span.parent is not None and span.parent.span_id == parent.context.span_id]


# -- exceptions ---------------------------------------------------------------------------------------------------


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = True
        self.raised: BaseException | None = None
        self.exception_type: type[BaseException] = ValueError

    def forward(self, x):
        if self.armed:
            self.raised = self.exception_type("boom: bad shape")
            raise self.raised
        return x


class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(2, 2)
        self.block = nn.Sequential(nn.ReLU(), Boom())
        self.after = nn.Linear(2, 2)

    def forward(self, x):
        return self.after(self.block(self.before(x)))


def test_an_exception_marks_the_raising_span_and_its_ancestors_and_reaches_the_caller_unchanged():
    model = Faulty()
    boom = model.block[1]
    with capture_spans(model) as captured:
        with pytest.raises(ValueError, match="boom: bad shape") as caught:
            model(torch.randn(1, 2))
        assert caught.value is boom.raised
        assert captured.tree() == {"Faulty": {"before": {}, "block": {"block.0": {}, "block.1": {}}}}

        for name in ("block.1", "block", "Faulty"):
            span = captured.span(name)
            assert span.status.status_code is StatusCode.ERROR, name
            assert "ValueError" in span.status.description and "boom: bad shape" in span.status.description
            (event,) = [event for event in span.events if event.name == "exception"]
            assert event.attributes["exception.type"] == "ValueError"
            assert event.attributes["exception.message"] == "boom: bad shape"
        for name in ("before", "block.0"):
            assert captured.span(name).status.status_code is StatusCode.UNSET
            assert not captured.span(name).events

        # the next forward is traced normally
        captured.clear()
        boom.armed = False
        model(torch.randn(1, 2))
        assert captured.tree() == {"Faulty": {"before": {}, "block": {"block.0": {}, "block.1": {}}, "after": {}}}
        assert all(span.status.status_code is StatusCode.UNSET for span in captured.spans())


class Unprintable(ValueError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


@pytest.mark.parametrize("exporter", ["sdk", "file"])
def test_an_exception_whose_str_raises_still_gives_complete_spans(exporter, tmp_path):
    model = Faulty()
    model.block[1].exception_type = Unprintable
    if exporter == "sdk":
        with capture_spans(model) as captured:
            with pytest.raises(Unprintable):
                model(torch.randn(1, 2))
            span = captured.span("block.1")
            assert captured.tree() == {"Faulty": {"before": {}, "block": {"block.0": {}, "block.1": {}}}}
            assert span.status.description == "Unprintable: <unprintable Unprintable object>"
            assert span.events[0].attributes["exception.message"] == "<unprintable Unprintable object>"
            assert captured.handle.sink_errors == 0
        return
    trace_file = tmp_path / "traces.jsonl"
    with torchtrace.instrument(model, exporter="file", trace_file=str(trace_file)) as handle:
        with pytest.raises(Unprintable):
            model(torch.randn(1, 2))
        handle.flush()
        assert (handle.exported_spans, handle.failed_spans, handle.sink_errors) == (5, 0, 0)
    spans = [span for line in trace_file.read_text().splitlines()
             for span in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]]  # fmt: skip
    assert {span["name"] for span in spans} == {"Faulty", "before", "block", "block.0", "block.1"}


class Catches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.boom = Boom()
        self.fallback = nn.Identity()

    def forward(self, x):
        try:
            return self.boom(x)
        except ValueError:
            return self.fallback(x)


def test_a_users_raising_pre_hook_on_a_child_leaves_the_parents_span_intact():
    def refuse(module, args):  # the user's pre-hook, registered before ours: ours never runs for this call
        raise ValueError("refused")

    model = Catches()
    model.boom.armed = False
    model.boom.register_forward_pre_hook(refuse)
    with capture_spans(model) as captured:
        model(torch.randn(1, 2))  # Catches falls back when its child raises
        assert captured.tree() == {"Catches": {"fallback": {}}}  # one forward: the child never opened
        assert captured.span("Catches").status.status_code is StatusCode.UNSET


def test_an_exception_caught_inside_the_model_only_marks_the_module_that_raised():
    model = Catches()
    with capture_spans(model) as captured:
        model(torch.ones(2))
        assert captured.tree() == {"Catches": {"boom": {}, "fallback": {}}}
        assert captured.span("boom").status.status_code is StatusCode.ERROR
        assert captured.span("fallback").status.status_code is StatusCode.UNSET
        assert captured.span("Catches").status.status_code is StatusCode.UNSET


def test_a_keyboard_interrupt_mid_forward_does_not_stop_later_forwards_from_being_traced():
    model = Faulty()
    boom = model.block[1]
    boom.exception_type = KeyboardInterrupt
    with capture_spans(model) as captured:
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(1, 2))
        boom.armed = False
        model(torch.randn(1, 2))
        # torch runs no hook for a KeyboardInterrupt: the open forward is closed as interrupted when the model is
        # next called, and delivered before the new forward, which is traced in full.
        assert captured.tree() == {
            "Faulty": {"before": {}, "block": {"block.0": {}, "block.1": {}}},
            "Faulty#2": {"before": {}, "block": {"block.0": {}, "block.1": {}}, "after": {}},
        }
        interrupted = [span for span in captured.spans() if span.status.status_code is StatusCode.ERROR]
        assert sorted(span.name for span in interrupted) == ["Faulty", "block", "block.1"]


class ReturnsNone(nn.Module):
    def forward(self, x):
        return None


def test_a_module_returning_none_inside_an_except_block_is_not_an_error():
    model = ReturnsNone()
    with capture_spans(model) as captured:
        try:
            raise RuntimeError("handled by the caller, unrelated to the model")
        except RuntimeError:
            assert model(torch.ones(1)) is None
        span = captured.span("ReturnsNone")
    assert span.status.status_code is StatusCode.UNSET
    assert not span.events


def test_instrument_is_importable_from_the_package_and_the_testing_helper_removes_hooks():
    model = TestForHook()
    with capture_spans(model) as captured:
        assert isinstance(captured.handle, torchtrace.TraceHandle)
    assert traced_modules(model) == []


# -- what is not traced holds on to nothing --------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"sample_every": 2}, {}], ids=["unsampled", "disabled"])
def test_an_untraced_forward_keeps_no_reference_to_its_tensors_or_model(options):
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(2, 2))
    handle = torchtrace.instrument(model, exporter="none", **options)
    if not options:
        handle.disable()
    model(torch.randn(1, 2))  # sample_every=2: the first forward is traced, the second not
    x = torch.randn(1, 2)
    output = model(x)
    refs = [weakref.ref(x), weakref.ref(output), weakref.ref(model)]
    del x, output, model
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
    handle.remove()


def test_torch_jit_trace_of_an_instrumented_model_records_only_the_model():
    model = nn.Sequential(nn.Linear(4, 5000), nn.ReLU())  # outputs past the small-tensor path: torch ops
    x = torch.randn(2, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no false "runs under torch.compile"
            traced = torch.jit.trace(model, x, check_trace=False)
        assert handle.records == []  # jit.trace's recording run is not traced: its graph holds the model only
        assert "aten::linalg_vector_norm" not in str(traced.graph)
        assert torch.equal(traced(x), model(x))


# -- the per-layer summary -----------------------------------------------------------------------------------------


def test_a_recursive_module_is_timed_once_in_the_summary():
    class Recursive(nn.Module):
        def forward(self, x, depth: int = 3):
            time.sleep(0.002)
            return self(x, depth - 1) if depth else x

    model = Recursive()
    with torchtrace.instrument(model, exporter="none") as handle:
        model(torch.ones(1))
        (row,) = handle.summary_rows()
        outermost = max(call.duration_ns for call in handle.records) / 1e6
    assert row.calls == 4
    assert row.share == pytest.approx(1.0)  # not 250%: the inner calls are inside the outer one
    assert row.total_ms == pytest.approx(outermost)


def test_the_summary_p95_is_the_nearest_rank_percentile():
    import numpy as np

    from torchtrace._core.calls import ModuleCall
    from torchtrace._sinks.summary import SummarySink

    durations_ms = [1.0] * 19 + [100.0]
    summary = SummarySink()
    summary([ModuleCall("layer", "Linear", 1, 1, i + 1, 0, 0, int(ms * 1e6)) for i, ms in enumerate(durations_ms)])
    (row,) = summary.rows()
    assert row.p95_ms == float(np.percentile(durations_ms, 95, method="inverted_cdf"))  # 1.0, not the 100 ms outlier
    assert row.mean_ms == pytest.approx(np.mean(durations_ms))


def test_the_summary_of_part_of_a_forward_equals_the_summary_of_its_calls():
    """A forward cut in two (a view of its columns, as a request's worth of calls is) is summarised as its calls
    are: the durations of the calls in the view only, and no outermost call in the second part."""
    from torchtrace._sinks.summary import SummarySink

    delivered = []
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    with torchtrace.instrument(model, exporter="none", sinks=[delivered.append]):
        for _ in range(3):
            model(torch.randn(1, 4))
    forwards = [segment for calls in delivered for segment in calls.segments]
    for part in (slice(0, 3), slice(3, 7)):
        from_columns, from_calls = SummarySink(), SummarySink()
        for forward in forwards:
            from_columns(Calls([forward[part]]))
            from_calls([*forward[part]])
        assert from_columns.rows() == from_calls.rows()
        assert [row.calls for row in from_columns.rows()] == [3] * (part.stop - part.start)


@pytest.mark.parametrize("columns", ["compiled", "python"])
def test_the_summary_from_columns_equals_the_summary_of_the_records(columns, monkeypatch):
    """The summary adds up forwards' durations per module in numpy (made as int64 bytes by the compiled module, or
    in Python without it); the records' ModuleCalls take the per-call path. 1,100 forwards wrap the 1,024-duration
    ring of every layer; the shared ReLU (two calls a forward) takes the per-call path of a forward that calls a
    module twice."""
    from torchtrace._pipeline import dispatcher as _dispatch
    from torchtrace._sinks.summary import SummarySink

    if columns == "compiled" and _dispatch._call_columns is None:
        pytest.skip("torchtrace._native is not built here")
    if columns == "python":
        monkeypatch.setattr(_dispatch, "_call_columns", None)

    torch.manual_seed(0)
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(4, 4), relu, nn.Linear(4, 4), relu)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for traced_model in (model, plain):
        with torchtrace.instrument(
            traced_model, exporter="none", records=torchtrace.Records(max_records=10_000)
        ) as handle:
            for i in range(1100):
                traced_model(torch.randn(1, 4))
                if i % 97 == 0:
                    handle.flush()  # drains of different sizes
            handle.flush()
            reference = SummarySink()
            reference(list(handle.records))
            assert len(handle.records) == 1100 * len(list(traced_model.modules())) + 1100 * (traced_model is model)
            assert handle.summary_rows() == reference.rows()
