"""Batched statistics launches (``Stats(batch=N)``): device tensors queued and reduced N to a kernel launch.

Run on any machine: the Triton kernels interpreted on CPU tensors routed through the device rows (values), and the
CUDA host path on the simulated device (what is launched, and from where). A batch must never report statistics
other than those of the tensor its module returned, even where the model changes it in place afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from nan_models import InjectNaN
from opentelemetry.trace import StatusCode
from test_device import device_rows, gpt2_run, simulated_cuda, triton_kernel  # noqa: F401 (fixtures)
from test_statistics import assert_stats_match
from torch import nn

import torchtrace
from torchtrace._capture.batched import CHANGED_IN_PLACE, LEARNING_FORWARDS, StatBatch
from torchtrace.testing import capture_spans, check_traces

PREFIX = "torchtrace.output."


class Residual(nn.Module):
    """A block that changes its first layer's output in place after that layer returned (as ``out += identity``
    does in a ResNet) when ``in_place`` is set."""

    def __init__(self, width: int, in_place: bool) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.first(x)
        if self.in_place:
            out += x
        return self.second(out)


def returned_outputs(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each leaf's outputs as it returned them (copies), by module name, forward after forward."""
    outputs: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if not list(module.children()):
            module.register_forward_hook(
                lambda module, args, output, name=name: outputs.setdefault(name, []).append(output.detach().clone())
            )
    return outputs


@pytest.fixture
def batch_launches(triton_kernel, monkeypatch):  # noqa: F811
    """The tensors of each batched launch (interpreted), in order."""
    kernel = importlib.import_module("torchtrace._capture.triton_stats")
    launched = []
    launch = kernel._jit_batch

    def counted(key, programs, count, arguments):
        launched.append(count)
        launch(key, programs, count, arguments)

    monkeypatch.setattr(kernel, "_jit_batch", counted)
    return launched


def span_of(captured, name: str, forward: int):
    return [span for span in captured.spans() if span.attributes.get("torchtrace.module.path") == name][forward]


def traced_and_returned(
    model: nn.Module, forwards: int, make_input: Callable[[], torch.Tensor] = lambda: torch.randn(4, 16)
) -> list[tuple[int, Any, torch.Tensor]]:
    """(forward, a leaf's span attributes, the output it returned) of ``forwards`` batched forwards."""
    returned = returned_outputs(model)
    with capture_spans(model, stats=torchtrace.Stats(batch=8)) as captured:
        for _ in range(forwards):
            model(make_input())
        captured.handle.flush()
        return [
            (forward, span_of(captured, name, forward).attributes, output)
            for name, outputs in returned.items()
            for forward, output in enumerate(outputs)
        ]


def test_batched_statistics_are_torchs_for_every_forward(batch_launches):
    """A kind of tensor is launched one by one (and checked) in its first two forwards, then queued and reduced eight
    tensors to a launch: every span's statistics are torch's for the tensor its module returned."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(16, 16), nn.Tanh())])
    forwards = 5
    for _, attributes, output in traced_and_returned(model, forwards, lambda: torch.randn(4, 16) * 3 + 1):
        assert "torchtrace.output.stats_error" not in attributes
        assert_stats_match(attributes, output, prefix=PREFIX)
    # 12 tensors a forward: none batched while checked, then 8 + 4 a forward
    assert batch_launches == [8, 4] * (forwards - LEARNING_FORWARDS)


def test_a_kind_changed_in_place_after_its_module_returned_is_never_batched(batch_launches):
    """``out += x`` after a layer returned: found while its kind is checked, so that kind is launched one by one
    from then on, and no statistics are ever read from the changed values."""
    torch.manual_seed(0)
    model = nn.Sequential(Residual(16, in_place=True), Residual(16, in_place=True))
    for _, attributes, output in traced_and_returned(model, 4):
        assert_stats_match(attributes, output, prefix=PREFIX)
    assert batch_launches == []  # every output is of the one kind (4, 16) float32


def test_a_tensor_changed_in_place_after_it_was_queued_reports_that_instead_of_wrong_statistics(batch_launches):
    """A model that starts changing an output in place once its kind is queued (a branch taken later): that call's
    statistics say so, nothing else is lost, and its kind is launched one by one from then on."""
    torch.manual_seed(0)
    model = nn.Sequential(Residual(16, in_place=False), Residual(16, in_place=False))
    returned = returned_outputs(model)
    with capture_spans(model, stats=torchtrace.Stats(batch=8)) as captured:
        for _ in range(LEARNING_FORWARDS + 1):
            model(torch.randn(4, 16))
        queued_launches = len(batch_launches)
        model[0].in_place = True
        model(torch.randn(4, 16))
        model(torch.randn(4, 16))
        captured.handle.flush()
        changed = span_of(captured, "0.first", LEARNING_FORWARDS + 1).attributes
        assert changed["torchtrace.output.stats_error"] == CHANGED_IN_PLACE
        assert "torchtrace.output.mean" not in changed
        for name, outputs in returned.items():
            for forward, output in enumerate(outputs):
                if (name, forward) != ("0.first", LEARNING_FORWARDS + 1):
                    assert_stats_match(span_of(captured, name, forward).attributes, output, prefix=PREFIX)
    # the third forward's four tensors in one launch; the fourth forward's other three (the change is found when its
    # queue is reduced, at the forward's end); none after
    assert queued_launches == 1 and batch_launches == [4, 3]


def launches_a_forward(stubs, model: nn.Module, forwards: int, **options) -> list[tuple[int, int]]:
    """(kernel launches, tensors they reduce) of each forward on the simulated CUDA device."""
    counts = []
    with torchtrace.instrument(model, exporter="none", **options) as handle:
        for _ in range(forwards):
            before = stubs.counts()
            model(torch.randn(4, 16))
            handle.flush()
            after = stubs.counts()
            counts.append((after["launches"] - before["launches"], after["tensors"] - before["tensors"]))
    return counts


def test_a_batched_cuda_forward_launches_once_per_eight_tensors_from_c(simulated_cuda):  # noqa: F811
    """What a batched CUDA forward asks of the driver, pinned: its ten tensors launched one by one in the two checked
    forwards, then two launches a forward (eight tensors, then two); one a tensor under inference_mode, where tensors
    have no version to check, and where the tensors queued reach Stats.batch_mb."""
    model = nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(16, 16), nn.ReLU())])
    batched = torchtrace.Stats(batch=8)
    assert launches_a_forward(simulated_cuda, model, 5, stats=batched) == [(10, 10)] * 2 + [(2, 10)] * 3
    with torch.inference_mode():  # (the model's output is summarised again: its last child's tensor, unversioned)
        assert launches_a_forward(simulated_cuda, model, 4, stats=batched) == [(11, 11)] * 4
    small = torchtrace.Stats(batch=8, batch_mb=1e-6)  # 4 x 16 float32 tensors: 256 bytes each
    assert launches_a_forward(simulated_cuda, model, 4, stats=small) == [(10, 10)] * 4
    assert launches_a_forward(simulated_cuda, model, 3) == [(10, 10)] * 3  # the default: one launch a tensor


def test_a_batched_forward_on_the_short_path_runs_no_python_launch(simulated_cuda, monkeypatch):  # noqa: F811
    """After the checked forwards, a forward's queue is launched from C both when it fills and at the forward's end
    (what is left: two tensors of ten): StatBatch.launch, Python's path, is not called once."""
    python_launches = []
    launch = StatBatch.launch
    monkeypatch.setattr(StatBatch, "launch", lambda batch: python_launches.append(len(batch.entries)) or launch(batch))
    model = nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(16, 16), nn.ReLU())])
    counts = launches_a_forward(simulated_cuda, model, LEARNING_FORWARDS + 2, stats=torchtrace.Stats(batch=8))
    assert counts[LEARNING_FORWARDS:] == [(2, 10)] * 2 and python_launches == []


def test_the_compiled_end_of_forward_launch_leaves_anything_unusual_to_python():
    """``_native.launch_queued`` launches nothing and says so (False: ``StatBatch.launch`` then runs) for a queue with
    no plan yet, or whose entries are not a plain list."""
    native = pytest.importorskip("torchtrace._native")
    batch = StatBatch(8, 1 << 20)
    assert native.launch_queued(batch) is False  # nothing queued from C: no plan
    batch.entries = type("Entries", (list,), {})([("tensor",)])
    assert native.launch_queued(batch) is False and len(batch.entries) == 1


def test_the_batch_launch_from_c_passes_each_tensors_memory_and_row(simulated_cuda):  # noqa: F811
    """The queued tensors' addresses, rows and sizes reach the driver as the batch kernel's parameters."""
    native = importlib.import_module("torchtrace._native")
    kernel = importlib.import_module("torchtrace._capture.triton_stats")
    native_launch = kernel._batch_direct[(-1, torch.float32, True)]
    tensors = [torch.randn(n) for n in (5, 7, 9)]
    members = [(t.data_ptr(), 1000 + 32 * i, 2000 + 32 * i, t.numel()) for i, t in enumerate(tensors)]
    before = simulated_cuda.counts()
    kernel.launch_batch((-1, torch.float32, True), 0, members)
    after = simulated_cuda.counts()
    assert (after["launches"] - before["launches"], after["tensors"] - before["tensors"]) == (1, 3)
    x, values, counts, n, programs = simulated_cuda.launched()[-1]
    assert (x, values, counts, n, programs) == (*members[0], 1)  # 5 elements: one program
    arguments = [value for member in members + members[:1] * 5 for value in (*member, 1)]
    with pytest.raises(ValueError, match="more than 8 tensors"):
        native.launch_batch(native_launch, 1, 9, 0, arguments)
    with pytest.raises(TypeError, match="a list of 40 ints"):
        native.launch_batch(native_launch, 1, 3, 0, arguments[:-1])


def test_each_tensor_of_a_batch_is_read_by_programs_in_proportion_to_its_size():
    """A batch of one large tensor and small ones: the large one gets most of a full grid (it is read about as fast
    as by a launch of its own), each small one at least one program and never more than its blocks."""
    kernel = pytest.importorskip("torchtrace._capture.triton_stats")
    assert kernel.batch_shares([1 << 22, 1000, 5000, 1 << 20], 1024, 528) == [421, 1, 1, 105]
    assert kernel.batch_shares([3000] * 8, 1024, 528) == [3] * 8
    assert kernel.batch_shares([0, 7], 1024, 528) == [1, 1]


@pytest.mark.parametrize("batch", [0, 9, True, 2.5])
def test_a_batch_size_outside_one_to_eight_is_refused(batch):
    with pytest.raises(ValueError, match="batch"):
        torchtrace.instrument(nn.Linear(2, 2), exporter="none", stats=torchtrace.Stats(batch=batch))


def test_the_batch_size_and_bound_are_read_from_their_variables(monkeypatch):
    monkeypatch.setenv("TORCHTRACE_STATS_BATCH", "4")
    monkeypatch.setenv("TORCHTRACE_STATS_BATCH_MB", "8")
    with torchtrace.instrument(nn.Linear(2, 2), exporter="none") as handle:
        assert (handle.options.stats.batch, handle.options.stats.batch_mb) == (4, 8.0)


def test_the_compiled_queue_leaves_a_tensor_changed_since_it_was_queued_to_python_which_reports_it(
    simulated_cuda,  # noqa: F811
):
    """On the CUDA host path the queue is filled and launched in C; a queue holding a tensor changed since it was
    queued is launched by Python instead, which leaves that tensor out and says so on its span."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual(16, in_place=False) for _ in range(4)])  # eight outputs a forward
    with capture_spans(model, stats=torchtrace.Stats(batch=8)) as captured:
        for _ in range(LEARNING_FORWARDS + 1):
            model(torch.randn(4, 16))
        before = simulated_cuda.counts()
        model[1].in_place = True
        model(torch.randn(4, 16))
        after = simulated_cuda.counts()
        captured.handle.flush()
        errors = {
            span.attributes["torchtrace.module.path"]: span.attributes.get("torchtrace.output.stats_error")
            for span in captured.spans()[-len(list(model.modules())) :]
        }
    assert errors.pop("1.first") == CHANGED_IN_PLACE
    assert set(errors.values()) == {None}
    assert (after["launches"] - before["launches"], after["tensors"] - before["tensors"]) == (1, 7)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "generate"])
def test_gpt2_on_the_simulated_cuda_path_batches_its_statistics_and_loses_none(simulated_cuda, mode):  # noqa: F811
    """GPT-2 (from a small config) batched on the CUDA host path: outputs the untraced twin's, every call summarised
    and none failed, and once its kinds are checked a forward makes several times fewer statistics launches than
    tensors summarised."""
    model, twin, run = gpt2_run(mode)
    expected = [run(twin) for _ in range(4)]
    with capture_spans(model, stats=torchtrace.Stats(batch=8)) as captured:
        got = [run(model) for _ in range(LEARNING_FORWARDS + 1)]
        before = simulated_cuda.counts()
        got.append(run(model))
        after = simulated_cuda.counts()
        captured.handle.flush()
        spans = captured.spans()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    check_traces(spans)
    assert not [span.name for span in spans if any(key.endswith("stats_error") for key in span.attributes)]
    assert all(any(key.startswith(PREFIX) for key in span.attributes) for span in spans)
    launches, tensors = after["launches"] - before["launches"], after["tensors"] - before["tensors"]
    assert tensors > 3 * launches > 0, (launches, tensors)


class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) * 2  # a tensor of its own, also where x is of that dtype already


def mixed_precision_model() -> nn.Module:
    """Ten outputs a forward, float32 and bfloat16 in turn (as layers under autocast make)."""
    layers = [nn.Linear(16, 16)]
    for _ in range(3):
        layers += [Cast(torch.bfloat16), Cast(torch.float32), nn.Linear(16, 16)]
    return nn.Sequential(*layers)


def test_a_queue_of_two_dtypes_is_launched_once_for_each_with_torchs_statistics(batch_launches):
    torch.manual_seed(0)
    model = mixed_precision_model()
    for _, attributes, output in traced_and_returned(model, LEARNING_FORWARDS + 2):
        assert_stats_match(attributes, output, prefix=PREFIX, rel=1e-2 if output.dtype == torch.bfloat16 else 1e-5)
    # each forward: its first eight outputs (five float32, three bfloat16), then the last two (float32)
    assert batch_launches == [5, 3, 2] * 2


def test_the_compiled_queue_makes_one_launch_a_dtype(simulated_cuda):  # noqa: F811
    model = mixed_precision_model()
    assert (
        launches_a_forward(simulated_cuda, model, 4, stats=torchtrace.Stats(batch=8))[LEARNING_FORWARDS:]
        == [(3, 10)] * 2
    )


def test_a_batch_the_driver_refuses_reports_its_tensors_and_launches_their_kind_one_by_one(
    simulated_cuda,  # noqa: F811
    monkeypatch,
    caplog,
):
    """A queue of two dtypes whose bfloat16 launch the driver refuses: the float32 batch, launched before from C,
    is not launched again; the bfloat16 tensors' spans say the launch failed (one warning), and that kind is
    launched one by one from then on."""
    kernel = importlib.import_module("torchtrace._capture.triton_stats")
    key = (-1, torch.bfloat16, True)
    monkeypatch.setitem(
        kernel._batch_direct, key, kernel._batch_direct[key]._replace(launch=simulated_cuda.address("refuse"))
    )
    model = mixed_precision_model()
    with capture_spans(model, stats=torchtrace.Stats(batch=8)) as captured:
        counts = []
        for _ in range(LEARNING_FORWARDS + 2):
            before = simulated_cuda.counts()
            model(torch.randn(4, 16))
            after = simulated_cuda.counts()
            counts.append((after["launches"] - before["launches"], after["tensors"] - before["tensors"]))
        captured.handle.flush()
        failed = [
            span.attributes["torchtrace.module.path"]
            for span in captured.spans()
            if "launch failed" in span.attributes.get("torchtrace.output.stats_error", "")
        ]
    assert failed == ["1", "4", "7"]  # the bfloat16 outputs of the first batched forward
    assert simulated_cuda.count("refused") == 2  # from C, then once more from Python, which reports it
    # the batched forwards: 5 + 2 float32 tensors in two launches (the bfloat16 ones refused); then the 7 in one, the
    # bfloat16 ones one by one
    assert counts[LEARNING_FORWARDS:] == [(2, 7), (4, 10)]
    assert caplog.text.count("batched statistics launch failed") == 1


def test_a_failed_batch_launch_turns_only_its_own_kind_to_one_by_one(batch_launches, monkeypatch):
    """The bfloat16 batch fails to launch (interpreted: Python's path): its tensors say so and their kind is
    launched one by one from then on; the float32 batches of the same queue go on, with torch's statistics."""
    kernel = importlib.import_module("torchtrace._capture.triton_stats")
    jit_batch = kernel._jit_batch

    def refusing(key, programs, count, arguments):
        if key[1] == torch.bfloat16:
            raise RuntimeError("refused")
        jit_batch(key, programs, count, arguments)

    monkeypatch.setattr(kernel, "_jit_batch", refusing)
    torch.manual_seed(0)
    model = mixed_precision_model()
    for forward, attributes, output in traced_and_returned(model, LEARNING_FORWARDS + 2):
        if output.dtype == torch.bfloat16 and forward == LEARNING_FORWARDS:
            assert "refused" in attributes["torchtrace.output.stats_error"]
        else:
            assert_stats_match(attributes, output, prefix=PREFIX, rel=1e-2 if output.dtype == torch.bfloat16 else 1e-5)
    assert batch_launches == [5, 2, 7]  # float32: five and two, then all seven in one; bfloat16 never again


def test_a_queue_holding_another_devices_tensor_is_launched_by_python_on_that_device(simulated_cuda, monkeypatch):  # noqa: F811
    """C launches a full queue only on the current device; a queue holding a tensor of another device (a model split
    over GPUs, one thread) goes to Python, which makes that device current for its batch."""
    kernel = importlib.import_module("torchtrace._capture.triton_stats")
    elsewhere_key = (3, torch.float32, True)
    monkeypatch.setitem(kernel._batch_direct, elsewhere_key, kernel._batch_direct[(-1, torch.float32, True)])
    monkeypatch.setitem(kernel._programs, 3, 528)  # its grid
    switched = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: switched.append(index) or contextlib.nullcontext())
    model = nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(16, 16), nn.ReLU())])
    with torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(batch=8)) as handle:
        for _ in range(LEARNING_FORWARDS):
            model(torch.randn(4, 16))
        elsewhere, stats = torch.randn(64), {"_pending": None}  # as queued on device 3
        batch = handle._recorder._local.state.stats.batch
        batch.entries.append((elsewhere, elsewhere._version, [0], stats, elsewhere_key, 0, elsewhere.data_ptr(), 0, 0,
                              64))  # fmt: skip
        before = simulated_cuda.counts()
        model(torch.randn(4, 16))
        after = simulated_cuda.counts()
        handle.flush()
    assert switched == [3] and "stats_error" not in stats
    # the foreign tensor's launch, the seven queued beside it (Python's launch), the last three at the forward's end
    assert (after["launches"] - before["launches"], after["tensors"] - before["tensors"]) == (3, 11)


def test_nan_provenance_holds_when_the_statistics_came_from_a_batch(batch_launches):
    """A NaN first made by a layer of a forward whose statistics were batched: that layer's span is marked, the
    layers after it only pass it on, and the counts are torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), InjectNaN(), nn.ReLU())
    model[3].armed = False
    with capture_spans(model, stats=torchtrace.Stats(batch=8)) as captured:
        for _ in range(LEARNING_FORWARDS + 1):
            model(torch.randn(2, 4))
        launched = len(batch_launches)
        model[3].armed = True
        model(torch.randn(2, 4))
        captured.handle.flush()
        last = {name: captured.spans_named(name)[-1] for name in ("0", "1", "2", "3", "4", "Sequential")}
    assert len(batch_launches) > launched  # the armed forward's statistics were batched
    assert last["3"].status.status_code is StatusCode.ERROR
    assert last["3"].events[0].attributes["exception.type"] == "torchtrace._core.calls.NonFiniteError"
    for name in ("0", "1", "2", "4", "Sequential"):
        assert last[name].status.status_code is StatusCode.UNSET, name
    assert [last[name].attributes[f"{PREFIX}nan_count"] for name in ("2", "3", "4")] == [0, 1, 1]


def test_training_steps_batch_their_forward_statistics_and_keep_every_statistic(simulated_cuda):  # noqa: F811
    """Training with backward spans and an optimizer on the CUDA host path: the forwards' outputs are batched once
    their kinds are checked (into the step's rows, launched before the forward ends); gradients are launched one by
    one as before; no span misses or fails a statistic."""
    model = nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(16, 16), nn.ReLU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    launches = []
    with capture_spans(model, stats=torchtrace.Stats(batch=8), backward=True, optimizer=optimizer) as captured:
        for _ in range(LEARNING_FORWARDS + 2):
            before = simulated_cuda.counts()
            model(torch.randn(4, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            after = simulated_cuda.counts()
            launches.append((after["launches"] - before["launches"], after["tensors"] - before["tensors"]))
        captured.handle.flush()
        spans = captured.spans()
    assert not [span.name for span in spans if any(key.endswith("stats_error") for key in span.attributes)]
    forwards = [
        span
        for span in spans
        if span.attributes.get("torchtrace.module.type") == "Linear" and not span.name.endswith(" backward")
    ]
    assert len(forwards) == 5 * (LEARNING_FORWARDS + 2) and all(f"{PREFIX}mean" in s.attributes for s in forwards)
    # the same tensors every step; the forward's ten outputs take two launches instead of ten once batched
    assert {tensors for _, tensors in launches} == {launches[0][1]}
    assert [launched for launched, _ in launches[LEARNING_FORWARDS:]] == [launches[0][0] - 8] * 2


def test_a_batch_launched_from_c_shares_the_grid_as_python_computes_it(simulated_cuda, monkeypatch):  # noqa: F811
    """C computes each tensor's share of the grid itself (no Python at the launch): the same as batch_shares."""
    kernel = importlib.import_module("torchtrace._capture.triton_stats")
    monkeypatch.setitem(kernel._programs, -1, 40)  # a full grid of 40 programs on the simulated device
    model = nn.Sequential(*[layer for _ in range(2) for layer in (nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 16),
                                                                   nn.ReLU())])  # fmt: skip
    sizes = [4 * 4096, 4 * 4096, 4 * 16, 4 * 16] * 2  # a forward's eight outputs: one full queue, launched from C
    launches_a_forward(simulated_cuda, model, LEARNING_FORWARDS + 1, stats=torchtrace.Stats(batch=8))
    *_, n, programs = simulated_cuda.launched()[-1]  # the first member's
    assert (n, programs) == (sizes[0], kernel.batch_shares(sizes, kernel.BLOCK, 40)[0]) == (16384, 9)
