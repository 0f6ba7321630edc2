"""On a real CUDA device: statistics from the Triton kernel and from torch ops equal torch's, module durations come
from CUDA events, and a traced forward, backward and step make no synchronizing call. Skipped without a GPU
(tests/test_device.py runs the same code paths on the CPU)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from nan_models import bad_backward_model
from opentelemetry.trace import StatusCode
from test_statistics import assert_stats_match, output_attributes
from torch import nn

import torchtrace
from torchtrace._capture import cuda_driver as _cuda_driver
from torchtrace._capture import device as _device
from torchtrace._capture.stats import evenly_spaced
from torchtrace.testing import capture_spans

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# torch's warning per synchronizing call (turning the debug mode on also warns, once, that it is a prototype)
SYNC_WARNING = "called a synchronizing CUDA operation"


@pytest.fixture(params=["triton", "triton_jit", "torch_ops"])
def stats_path(request, monkeypatch):
    """The ways a GPU tensor is reduced: the compiled Triton kernel launched directly, the same kernel launched
    through Triton's JIT (another Triton's calling convention), torch ops (no Triton)."""
    if request.param == "torch_ops":
        monkeypatch.setattr(_device, "fused_kernel", lambda x: None)
    elif (kernel := _device.fused_kernel(torch.empty(1, device="cuda"))) is None:
        pytest.skip("Triton is not installed (or TORCHTRACE_TRITON=0)")
    elif request.param == "triton_jit":
        monkeypatch.setattr(kernel, "launch_directly", False)
    yield request.param
    if request.param != "torch_ops":  # a failing kernel falls back to torch ops silently but for one warning
        assert _device._triton is not False, "the Triton kernel failed on this GPU: see the warning in the log"
    if request.param == "triton":
        assert kernel.launch_directly, "this Triton's compiled kernels take other arguments: launches cost more"


def test_the_triton_kernel_itself_runs_on_this_gpu():
    kernel = pytest.importorskip("torchtrace._capture.triton_stats")
    tensor = torch.randn(3, 5000, device="cuda") * 2 + 1
    values = torch.tensor(_device.RAW_START + (0.0, 0.0), device="cuda")
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    kernel.reduce_row(tensor, values, counts, True)
    n = tensor.numel()
    mean, std, low, high, norm = _device.finish_raw(values[:6].tolist(), n, 0, 0)
    expected = tensor.double()
    assert mean == pytest.approx(float(expected.mean()), rel=1e-4)
    assert std == pytest.approx(float(expected.std()), rel=1e-4)
    assert (low, high) == (pytest.approx(float(expected.min())), pytest.approx(float(expected.max())))
    assert norm == pytest.approx(float(expected.norm()), rel=1e-4)
    assert counts[:3].tolist() == [0, 0, n]


def test_torchtrace_triton_0_keeps_the_kernel_out(monkeypatch):
    monkeypatch.setenv("TORCHTRACE_TRITON", "0")
    monkeypatch.setattr(_device, "_triton", None)  # read when the first CUDA tensor is summarised
    assert _device.fused_kernel(torch.empty(1, device="cuda")) is None
    tensor = torch.randn(64, 100, device="cuda")
    assert_stats_match({**output_attributes(tensor), "device": "cpu"}, tensor.cpu(), rel=1e-4)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])  # attention's output
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])  # a view 2 or 4 bytes into its storage
@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 1e-4), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_cuda_statistics_equal_torchs(stats_path, dtype, rel, offset, transposed):
    torch.manual_seed(0)
    tensor = (torch.randn(64 * 1000 + offset) * 3 + 1).to("cuda", dtype)[offset:].view(64, 1000)
    tensor[0, :100] = 0
    if transposed:
        tensor = tensor.t()
    for _ in range(2):  # the first launch of a kind compiles (or finds) the kernel; the second launches it directly
        got = output_attributes(tensor)
        assert got["device"] == "cuda:0"
        got["device"] = "cpu"
        assert_stats_match(got, tensor.cpu(), rel=rel)


def test_cuda_statistics_of_a_sample_equal_torchs_on_that_sample(stats_path):
    torch.manual_seed(0)
    tensor = torch.randn(300, 301, device="cuda") * 2 + 3
    got = output_attributes(tensor, stats=torchtrace.Stats(sample=1000))
    sample = tensor.reshape(-1)[:: -(-tensor.numel() // 1000)].cpu()
    assert got["sampled"] == sample.numel()
    assert_stats_match({**got, "device": "cpu", "shape": tuple(sample.shape)}, sample, rel=1e-4)


def test_cuda_statistics_of_a_sampled_transposed_tensor_are_those_of_every_nth_element_of_its_memory(stats_path):
    """Attention's transposed output (batch_first), sampled: the fused kernel reads every n-th element of its block
    of memory, as for a contiguous tensor (torch ops over a strided view where Triton is not used)."""
    torch.manual_seed(0)
    tensor = (torch.randn(300, 7, 301, device="cuda") * 2 + 3).transpose(0, 1)
    got = output_attributes(tensor, stats=torchtrace.Stats(sample=1000))
    stride = -(-tensor.numel() // 1000)
    if stats_path == "torch_ops":  # a strided view, evenly along each dimension
        sample = evenly_spaced(tensor, stride).cpu().reshape(-1)
    else:
        sample = tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset()).cpu()[::stride]
    assert got["sampled"] == sample.numel()
    assert_stats_match({**got, "device": "cpu", "shape": tuple(sample.shape)}, sample, rel=1e-4)


def test_cuda_statistics_of_nan_and_inf(stats_path):
    tensor = torch.tensor([1.0, float("nan"), float("inf"), 3.0], device="cuda")
    got = output_attributes(tensor)
    assert (got["nan_count"], got["inf_count"]) == (1, 1)


@pytest.mark.parametrize("launch", ["c", "jit"])
def test_batched_cuda_statistics_equal_torchs_with_no_synchronizing_call(monkeypatch, launch):
    """Stats(batch=8) under no_grad: from the third forward on, the outputs are queued from C and reduced eight to a
    launch (from C, or through Triton's JIT); every span's statistics are torch's, and the queued forwards make no
    synchronizing call."""
    kernel = pytest.importorskip("torchtrace._capture.triton_stats")
    if _device.fused_kernel(torch.empty(1, device="cuda")) is None:
        pytest.skip("Triton is not installed (or TORCHTRACE_TRITON=0)")
    if launch == "jit":
        monkeypatch.setattr(kernel, "launch_directly", False)
    launched = []
    launch_batch = kernel.launch_batch

    def counted(key, stream, members):
        launched.append(len(members))
        launch_batch(key, stream, members)

    monkeypatch.setattr(kernel, "launch_batch", counted)
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.GELU())]).cuda()
    inputs = [torch.randn(32, 64, device="cuda") * 3 + 1 for _ in range(5)]
    with capture_spans(model, stats=torchtrace.Stats(batch=8)) as captured, torch.no_grad():
        for x in inputs[:3]:
            model(x)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for x in inputs[3:]:
                    model(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        captured.handle.flush()
        spans = captured.spans()
    assert not [warning for warning in caught if SYNC_WARNING in str(warning.message)]
    # the third forward and the two counted ones (12 outputs each): eight, then four at the forward's end; from C once
    # the batch kernel is compiled (the third forward's first batch compiles it), a full queue and the forward's rest
    # without Python
    assert launched == ([8, 4] * 3 if launch == "jit" else [8])
    assert launch == "jit" or kernel._batch_direct[(0, torch.float32, True)] is not None
    with torch.no_grad():
        for forward, x in enumerate(inputs):
            for name, module in model.named_children():
                x = module(x)
                span = [s for s in spans if s.attributes.get("torchtrace.module.path") == name][forward]
                got = {key.removeprefix("torchtrace.output."): value for key, value in span.attributes.items()}
                assert "stats_error" not in got
                assert_stats_match({**got, "device": "cpu"}, x.cpu(), rel=1e-4)


def test_a_traced_training_step_makes_no_synchronizing_call(stats_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 8)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device="cuda")
    with torchtrace.instrument(
        model, exporter="none", backward=True, optimizer=optimizer, training=torchtrace.Training(param_stats=True)
    ):

        def step() -> None:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # warm-up: pools, Triton compilation
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(3):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [str(warning.message) for warning in caught if SYNC_WARNING in str(warning.message)]
    assert syncs == []


class Sleep(nn.Module):
    """Occupies the GPU for a fixed number of cycles; the host only launches it."""

    def forward(self, x):
        torch.cuda._sleep(2_000_000)
        return x + 1


def _alone_ms(module: nn.Module, x: torch.Tensor, runs: int = 10) -> float:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000)  # a busy stream: `start` then times the kernel, not the host's launch gap
        start.record()
        module(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@pytest.fixture(params=["driver", "torch"])
def event_backend(request, monkeypatch):
    """Timing events through the CUDA driver (keeping the GIL), or torch.cuda.Event where the driver library
    cannot be loaded."""
    monkeypatch.setattr(_device, "_timers", {})
    if request.param == "torch":
        monkeypatch.setattr(_cuda_driver, "_driver", False)
    else:
        assert _cuda_driver.driver() is not None, "the CUDA driver library could not be loaded"
    yield request.param
    kinds = {type(event) for timer in _device._timers.values() for event in timer._free}
    assert kinds == {_cuda_driver.DriverEvent if request.param == "driver" else torch.cuda.Event}


def test_module_durations_are_device_time_within_five_percent(event_backend):
    model = nn.Sequential(Sleep(), nn.Linear(8, 8)).cuda()
    x = torch.randn(4, 8, device="cuda")
    alone = []
    with capture_spans(model) as captured:
        model(x)  # warm-up: pools, kernel compilation
        captured.handle.flush()
        captured.clear()
        for _ in range(5):  # interleaved: a GPU's clock changing over the test hits both alike
            captured.handle.disable()
            alone.append(_alone_ms(model[0], x, runs=2))
            captured.handle.enable()
            for _ in range(2):
                model(x)
        spans = captured.spans_named("0")
        durations = [(span.end_time - span.start_time) / 1e6 for span in spans]
        assert statistics.median(durations) == pytest.approx(statistics.median(alone), rel=0.05)
        root = captured.spans_named("Sequential")[-1]
        assert root.attributes["torchtrace.module.type"] == "Sequential"
    # the host clock would have measured the launch: microseconds, not the GPU's milliseconds
    torchtrace.configure(cuda_events=False)
    with capture_spans(model) as captured:
        model(x)
        span = captured.spans_named("0")[-1]
        assert (span.end_time - span.start_time) / 1e6 < statistics.median(alone) / 2


def test_reading_event_times_on_the_worker_lets_the_models_thread_run():
    """The worker reads a forward's event times (``elapsed_since``: a few microseconds each, two per traced call)
    with the GIL released, so the model's thread, which needs the GIL back after every torch op, is not held up for
    the whole read. A thread counting beside the read shows no gap as long as the read; holding the GIL, it would."""
    cuda = _cuda_driver.driver()
    if cuda is None or _device._elapsed_since is None:
        pytest.skip("no CUDA driver library, or torchtrace._native not built")
    device = torch.device("cuda", torch.cuda.current_device())
    events = [_cuda_driver.DriverEvent(device, cuda) for _ in range(4000)]
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    for event in events:
        event.record(stream)
    torch.cuda.synchronize()
    ticks: list[int] = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter_ns())

    counter = threading.Thread(target=count)
    counter.start()
    try:
        while not ticks:
            time.sleep(0.001)
        start = time.perf_counter_ns()
        offsets = _device.elapsed_since(events[0], events[1:])
        end = time.perf_counter_ns()
    finally:
        stop.set()
        counter.join()
    assert len(offsets) == len(events) - 1 and all(offset >= 0 for offset in offsets)
    during = [tick for tick in ticks if start <= tick <= end]
    gaps = [later - earlier for earlier, later in zip([start, *during], [*during, end])]
    assert max(gaps) < (end - start) / 2, f"the counter stopped for {max(gaps)} of the read's {end - start} ns"


def test_back_to_back_forwards_have_their_events_read_off_the_models_thread(monkeypatch, reads_in_line):
    """On a GPU, each forward's events are read by the compiled module's reader thread while the next forward runs:
    the model's thread reads none itself, and each span's device duration is that of its kernel."""
    from torchtrace._pipeline import device_times, dispatcher

    monkeypatch.setattr(dispatcher, "BACK_TO_BACK_NS", 10**12)  # the test's own waits are no pause
    submitted = []
    submit = device_times.submit
    monkeypatch.setattr(device_times, "submit", lambda forward: submitted.append(forward) or submit(forward))
    model = nn.Sequential(Sleep(), nn.Linear(8, 8)).cuda()
    x = torch.randn(4, 8, device="cuda")
    alone = _alone_ms(model[0], x, runs=3)
    with capture_spans(model) as captured:
        for _ in range(3):
            torch.cuda._sleep(1_000_000)  # a busy stream: the span times the kernel, not its launch
            model(x)
            torch.cuda.synchronize()  # the reader reads it meanwhile
            time.sleep(0.01)
        durations = [(span.end_time - span.start_time) / 1e6 for span in captured.spans_named("0")]
    assert len(submitted) == 3 and reads_in_line == []  # not one read on the model's thread (nor at the flush)
    assert durations == [pytest.approx(alone, rel=0.05)] * 3


def test_a_forward_on_a_side_stream_is_timed_on_that_stream(event_backend):
    model = nn.Sequential(Sleep(), nn.Linear(8, 8)).cuda()
    x = torch.randn(4, 8, device="cuda")
    alone = _alone_ms(model[0], x, runs=3)
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    with capture_spans(model) as captured:
        for stream in (side, other, side):  # the timer follows the current stream, also back to one seen before
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1_000_000)  # a busy stream, as for `alone`: the span times the kernel, not a launch
                model(x)
            torch.cuda.current_stream().wait_stream(stream)
        durations = [(span.end_time - span.start_time) / 1e6 for span in captured.spans_named("0")]
    # events on the idle default stream would time nothing: about zero instead of the sleep's milliseconds
    assert durations == [pytest.approx(alone, rel=0.05)] * 3


def test_backward_spans_on_cuda_hold_gradient_statistics_and_nan_provenance():
    model = bad_backward_model().cuda()
    with capture_spans(model, backward=True) as captured:
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        captured.handle.step()
        assert captured.span("1 backward").status.status_code is StatusCode.ERROR
        last = captured.span("2 backward").attributes
        assert last["torchtrace.grad_output.0.norm"] == pytest.approx(2**0.5)  # d(sum)/d(out) is all ones


def test_cuda_graph_capture_of_a_traced_model_is_not_traced_and_replays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU()).cuda()
    static_input = torch.randn(4, 16, device="cuda")
    with capture_spans(model) as captured:
        model(static_input)  # traced, and warms up before capture
        captured.handle.flush()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = model(static_input)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(static_output, model(static_input))
        assert len(captured.spans_named("Sequential")) == 2  # the warm-up and the last eager call, not the capture


def test_the_workers_event_queries_do_not_break_a_graph_capture_on_another_thread():
    """In CUDA's default (global) capture mode an event query from any thread invalidates the capture: the thread
    reading device work is in thread-local mode, as torch's NCCL watchdog is."""
    model = nn.Sequential(nn.Linear(16, 16)).cuda()
    other = nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda")
    with torchtrace.instrument(
        model, exporter="none", limits=torchtrace.Limits(export_interval_ms=10**6)
    ) as handle:  # the worker sleeps
        other(x)
        model(x)  # traced: waits in the buffer
        torch.cuda.synchronize()
        drained = []

        def read_device_work() -> None:
            _cuda_driver.tolerate_graph_captures()  # what the worker thread does before its first drain
            drained.append(handle._dispatcher.drain(wait=False))

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = other(x)
            reader = threading.Thread(target=read_device_work)
            reader.start()
            reader.join()
        graph.replay()
        torch.cuda.synchronize()
        assert drained == [2]
        assert torch.allclose(static_output, other(x))


def test_the_capture_mode_exchange_gives_the_threads_mode_back():
    modes = []

    def exchange() -> None:  # a fresh thread: CUDA's default (global) mode
        modes.append(_cuda_driver.exchange_capture_mode(_cuda_driver.THREAD_LOCAL_CAPTURE))
        modes.append(_cuda_driver.exchange_capture_mode(modes[0]))

    thread = threading.Thread(target=exchange)
    thread.start()
    thread.join()
    assert modes == [0, _cuda_driver.THREAD_LOCAL_CAPTURE]  # CU_STREAM_CAPTURE_MODE_GLOBAL, then ours


def test_reading_device_work_at_a_forwards_end_does_not_break_a_graph_capture_on_another_thread(monkeypatch):
    """A serving thread reads its earlier forwards' device work at a forward's end, in thread-local capture mode:
    in the default (global) mode its event queries would invalidate the graph another thread is capturing."""
    from torchtrace._pipeline.worker import WORKER

    # the forward during the capture comes back to back with the one before, however long the hand-over takes
    monkeypatch.setattr("torchtrace._pipeline.dispatcher.BACK_TO_BACK_NS", 10**12)

    model = nn.Sequential(nn.Linear(16, 16)).cuda()
    other = nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda")
    stream = torch.cuda.Stream()
    ready, capturing, served = threading.Event(), threading.Event(), threading.Event()
    buffered = []

    def serve() -> None:
        with torch.cuda.stream(stream):
            for _ in range(3):  # on this stream: its memory cached, kinds learnt, before the capture starts
                model(x)
            stream.synchronize()
            ready.set()
            capturing.wait()
            model(x)  # at its end: the forwards before it read, their events queried during the capture
            buffered.append(len(handle.buffer))
        served.set()

    with torchtrace.instrument(model, exporter="none") as handle, WORKER._condition:  # the worker holds still
        other(x)
        torch.cuda.synchronize()
        server = threading.Thread(target=serve)
        server.start()
        assert ready.wait(60)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = other(x)
            capturing.set()
            assert served.wait(60)
        server.join()
        graph.replay()
        torch.cuda.synchronize()
        assert buffered == [1]  # only the forward that had just ended waits
        assert torch.allclose(static_output, other(x))
    assert len(handle.records) == 8


ONE_RANK_NCCL_JOB = """
import json, os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtrace

torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 8)).cuda())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with torchtrace.instrument(model, exporter="none", backward=True, optimizer=optimizer) as handle:
    for _ in range(3):
        model(torch.randn(64, 256, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    handle.flush()
    spans = [(call.name, call.end_ns - call.start_ns) for call in handle.records]
print(json.dumps(spans), flush=True)
os._exit(0)  # no process-group teardown: not what this checks
"""


def test_nccl_all_reduce_spans_are_timed_on_the_device(tmp_path):
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    result = subprocess.run(
        [sys.executable, "-c", ONE_RANK_NCCL_JOB, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MASTER_ADDR": "127.0.0.1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    spans = json.loads(result.stdout.strip().splitlines()[-1])
    all_reduces = [duration for name, duration in spans if name.startswith("allreduce bucket")]
    assert len(all_reduces) >= 3 and all(duration > 0 for duration in all_reduces)
    assert sum(name == "train_step" for name, _ in spans) == 3
