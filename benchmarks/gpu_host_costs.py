"""Where the host's microseconds go when torchtrace traces a call on a CUDA device: each operation of a traced call
timed alone, in a loop, with the dispatch worker's thread idle and with a Python thread busy beside it.

A GPU forward that tracing slows is host-bound: the model's thread launches kernels, and every microsecond a hook
adds is a microsecond the device may wait. The operations: a timing event through the driver (as the hooks record
it, and the driver call alone), torch's own event, a small torch op (the unit of a model's own launches), the
statistics kernel launched from C (``_native.launch_kernel``) and through Triton's launcher, and a multi-tensor
reduction (``torch._foreach_norm`` over 16 tensors, per tensor). "busy" runs a Python thread that keeps asking for
the GIL, as the worker does while it exports: an operation that lets the GIL go pays for it there. Also timed: the
torch calls the compiled hot path makes each call on a CUDA build, which the simulated device
(``simulated_cuda.py``) stands in for or runs on CPU tensors: the current device and its current stream, a tensor's
address, device and version (a lambda around those that take an argument adds its own call).

Run: python benchmarks/gpu_host_costs.py [--loops N]. The last line printed is one JSON object (on a machine
without CUDA: {"gpu_host_costs": {"skipped": "..."}}, exit 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torchtrace._capture import cuda_driver as _cuda_driver
from torchtrace._capture import device as _device  # noqa: E402

SHAPE = (1, 128, 768)  # one output of the B1 S128 encoder in gpu.py


def per_operation_us(operation: Callable[[], Any], loops: int, repeats: int = 5) -> float:
    """Median over repeats of the host time per call, in microseconds; the device is drained between repeats so
    a full launch queue never blocks a launch."""
    for _ in range(min(loops, 200)):
        operation()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(loops):
            operation()
        samples.append((time.perf_counter_ns() - start) / loops / 1e3)
        torch.cuda.synchronize()
    return round(statistics.median(samples), 3)


class BusyThread:
    """A thread that runs Python (and so wants the GIL) until stopped."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        table: dict[int, int] = {}
        while not self._stop.is_set():
            for i in range(1000):
                table[i] = i * i

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def operations() -> dict[str, Callable[[], Any]]:
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(SHAPE, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    block = _device._Block(device)
    values, counts = block.views(0)
    timer = _device.event_timer(device)
    ops: dict[str, Callable[[], Any]] = {}

    def mark() -> None:  # a mark as the hooks take it, the event back to the pool as the worker does
        event = timer.mark()
        timer._free.append(event)

    ops["event_mark"] = mark
    # what the compiled hot path asks torch on a CUDA build a call (simulated_cuda.py stands in C int methods for
    # the first two): the current device, its current stream, and a tensor's address, device and version
    index = device.index
    ops["torch_current_device"] = torch._C._cuda_getDevice
    ops["torch_current_raw_stream"] = lambda: torch._C._cuda_getCurrentRawStream(index)
    ops["tensor_data_ptr"] = x.data_ptr
    ops["tensor_get_device"] = x.get_device
    ops["tensor_version"] = lambda: x._version
    cuda = _cuda_driver.driver()
    if cuda is not None:
        event = timer.mark()
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        from torchtrace._native import driver_call

        ops["event_record_driver_only"] = lambda: driver_call(cuda.record_address, event.handle, stream)
    torch_event = torch.cuda.Event(enable_timing=True)
    ops["torch_event_record"] = torch_event.record
    ops["torch_op_add"] = lambda: torch.add(x, 1, out=out)

    def statistics_row() -> None:
        _device.reduce(x, values, counts, True)

    ops["statistics_launch"] = statistics_row
    statistics_row()  # compiles the kernel and decides how it is launched
    from torchtrace._capture import triton_stats as _triton_stats

    ops["statistics_launch_triton"] = _without_direct_launch(statistics_row, _triton_stats)
    tensors = [torch.randn(SHAPE, device=device, dtype=torch.bfloat16) for _ in range(16)]
    ops["foreach_norm_per_tensor"] = lambda: torch._foreach_norm(tensors)
    return ops


def _without_direct_launch(operation: Callable[[], Any], module: Any) -> Callable[[], Any]:
    def run() -> None:
        saved = dict(module._direct)
        module._direct.clear()
        try:
            operation()
        finally:
            module._direct.update(saved)

    return run


def launch_matches_triton() -> dict[str, Any]:
    """The C launch and Triton's launcher write the same row (a check of the C launch's parameters)."""
    from torchtrace._capture import triton_stats as _triton_stats

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    x = torch.randn(3, 1000, 77, device=device, dtype=torch.bfloat16) * 3 + 1
    x[0, 0, :5] = 0
    rows = []
    for direct in (True, False):
        block = _device._Block(device)
        block.reset()
        values, counts = block.views(0)
        saved = dict(_triton_stats._direct)
        if not direct:
            _triton_stats._direct.clear()
        try:
            _device.reduce(x, values, counts, True)
        finally:
            _triton_stats._direct.update(saved)
        torch.cuda.synchronize()
        rows.append((values.tolist(), counts.tolist()))
    (c_values, c_counts), (triton_values, triton_counts) = rows
    # counts, min and max exactly; the sums within float32 rounding (the programs' atomic adds come in any order)
    same = c_counts == triton_counts and c_values[2:4] == triton_values[2:4] and c_values[5] == triton_values[5]
    same = same and all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-3) for a, b in zip(c_values, triton_values))
    return {"same_row": same, "direct_launch": any(v is not None for v in _triton_stats._direct.values())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=2000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"gpu_host_costs": {"skipped": "no CUDA device"}}))
        return 0
    ops = operations()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "check": launch_matches_triton(),
        "idle_us": {},
        "busy_us": {},
    }
    for name, operation in ops.items():
        report["idle_us"][name] = per_operation_us(operation, args.loops)
    for name, operation in ops.items():
        with BusyThread():
            report["busy_us"][name] = per_operation_us(operation, max(args.loops // 20, 50))
    report["idle_us"]["foreach_norm_per_tensor"] = round(report["idle_us"]["foreach_norm_per_tensor"] / 16, 3)
    report["busy_us"]["foreach_norm_per_tensor"] = round(report["busy_us"]["foreach_norm_per_tensor"] / 16, 3)
    print(json.dumps({"gpu_host_costs": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
