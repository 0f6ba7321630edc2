"""What the dispatch thread costs the model's thread on one GIL: a traced forward on the simulated CUDA path
(benchmarks/simulated_cuda.py), timed with the dispatch worker live and held off, beside the untraced model.

On a GPU host the model's thread is the bottleneck of a host-bound forward, and every torch op lets the GIL go: a
second Python thread that takes it then (the worker reading device work) holds it until it is done, and the model's
thread waits. CPU torch ops let the GIL go the same way while they compute, so the cost shows here too. torchtrace
reads a CUDA forward's device work on the model's thread at a later forward's end while forwards come back to back,
and leaves the worker the rest once the model is idle: with that, the live worker costs the model nothing more than the
worker held off (``x_held`` near 1.0); a worker reading beside the forwards showed as ``x_held`` above 1.2 here.

Variants, timed round-robin in one process (the starting one rotating every round), each repetition N forwards:
  untraced             a copy of the model made before instrumenting
  traced               torchtrace.instrument(model, exporter="none") (every statistic), the worker live
  traced_worker_held   the same model and handle, the worker held off while the N forwards run
  traced_events_in_line  the same, each forward's timing events read where it is resolved (at a later forward's
                       end, on the model's thread) instead of by the device-times reader's thread
After each repetition (outside the timed window) the worker is let to read everything left, so every repetition
starts empty.

Model: LAYERS x (Linear(WIDTH, WIDTH) + ReLU) at BATCH rows, under torch.no_grad(), one torch thread: default
64 x Linear(32) at batch 4 (129 calls a forward, each op a few microseconds, as a host-bound GPU forward's launches).

Reported per variant: us a forward (median over repetitions), x untraced, and for the traced ones the us a call
added and ``x_held`` (us a forward against traced_worker_held's).

``--elapsed-us US``: each elapsed-time read spins US microseconds in the stub, as the driver's read takes on a GPU
host (~3 us on an H200's); the stub returns at once otherwise.

Run: python benchmarks/worker_contention.py [--repeats R] [--forwards N] [--layers L] [--width W] [--batch B]
     [--elapsed-us US]
Needs a C compiler and Triton (simulated_cuda.py; exits 2 without them). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import simulated_cuda  # noqa: E402

VARIANTS = ("untraced", "traced", "traced_worker_held", "traced_events_in_line")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--forwards", type=int, default=20)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--elapsed-us", type=float, default=0.0, help="each elapsed-time read takes this long (the driver's ~3 us)"
    )
    args = parser.parse_args()
    missing = simulated_cuda.available()
    if missing:
        print(f"worker_contention: {missing}", file=sys.stderr)
        return 2
    os.environ.setdefault("TORCHTRACE_PRINT_SUMMARY", "false")
    import torchtrace
    from torchtrace._pipeline import device_times
    from torchtrace._pipeline.worker import WORKER

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())])
    untraced = copy.deepcopy(model)
    x = torch.randn(args.batch, args.width)
    stubs = simulated_cuda.install(setattr)
    if args.elapsed_us:
        from torchtrace._capture import device as device_module

        (timer,) = device_module._timers.values()
        timer._free[0]._driver.elapsed_address = stubs.address("elapsed_spin")  # every pooled event's driver
        stubs.set("spin_ns", int(args.elapsed_us * 1000))
    handle = torchtrace.instrument(model, exporter="none")
    calls = len(list(model.modules()))

    def settle() -> None:  # outside the window: the worker reads what is left (the model idle), then all is exported
        deadline = time.monotonic() + 30
        while handle._dispatcher.has_unresolved() and time.monotonic() < deadline:
            time.sleep(0.002)
        handle.flush()

    @contextlib.contextmanager
    def events_in_line():  # no device-times reader: each forward's events read where it is resolved
        applies, device_times.applies = device_times.applies, lambda forward: False
        try:
            yield
        finally:
            device_times.applies = applies

    runs = {
        "untraced": (untraced, contextlib.nullcontext),
        "traced": (model, contextlib.nullcontext),
        "traced_worker_held": (model, lambda: WORKER._condition),  # the worker takes this lock before any work
        "traced_events_in_line": (model, events_in_line),
    }
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with torch.no_grad():
        for _ in range(10):  # warm-up: first calls, kinds of tensors learnt, pools filled
            model(x)
            untraced(x)
        settle()
        for repetition in range(args.repeats):
            order = VARIANTS[repetition % len(VARIANTS) :] + VARIANTS[: repetition % len(VARIANTS)]
            for name in order:
                forward, hold = runs[name]
                with hold():
                    start = time.perf_counter()
                    for _ in range(args.forwards):
                        forward(x)
                    elapsed = time.perf_counter() - start
                settle()
                times[name].append(elapsed / args.forwards * 1e6)
    handle.remove()
    medians = {name: statistics.median(values) for name, values in times.items()}
    report: dict = {
        "machine": platform.node(),
        "torch": torch.__version__,
        "torchtrace": os.path.dirname(os.path.dirname(os.path.abspath(torchtrace.__file__))),
        "model": f"{args.layers} x (Linear({args.width}) + ReLU), batch {args.batch}, no_grad, {calls} calls",
        "forwards": args.forwards,
        "repeats": args.repeats,
        "variants": {},
    }
    print(f"{'variant':22s} {'us/forward':>11s} {'x untraced':>11s} {'us/call added':>14s} {'x held':>7s}")
    for name in VARIANTS:
        row = {"us_per_forward": round(medians[name], 1), "x_untraced": round(medians[name] / medians["untraced"], 3)}
        if name != "untraced":
            row["us_per_call_added"] = round((medians[name] - medians["untraced"]) / calls, 3)
            row["x_held"] = round(medians[name] / medians["traced_worker_held"], 3)
        report["variants"][name] = row
        print(
            f"{name:22s} {row['us_per_forward']:11.1f} {row['x_untraced']:11.3f} "
            f"{row.get('us_per_call_added', 0.0):14.3f} {row.get('x_held', 1.0):7.3f}"
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
