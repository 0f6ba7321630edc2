"""Distributed training: real torchrun jobs (gloo, CPU) exporting to a real OTLP receiver.

Every rank's spans of step N share one trace and one root span; each rank's all-reduce buckets are spans; the rank
made slow is the one that waits least in all-reduce; each rank serves its own metrics endpoint.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from checkout import checkout_env
from jobs import one_rank_job
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_receiver import OtlpHttpReceiver, attributes_dict
from test_device import Bucket
from torch import nn

import torchtrace
from torchtrace._core.ranks import rank_info

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ddp_train.py"


def free_port(count: int = 1) -> int:
    """A base port with ``count`` consecutive free ports after it (checked, then released), below the kernel's
    ephemeral range: the ranks' own connections (gloo's mesh, the rendezvous store) take ports from that range, and
    one of them could take a rank's metrics port before the rank's server binds it."""
    for _ in range(200):
        base = random.randrange(15000, _ephemeral_ports_from() - count)
        sockets = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", base + offset))
                sockets.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port range")


def _ephemeral_ports_from() -> int:
    """The lowest port the kernel hands out to unbound sockets (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def torchrun(
    ranks: int, receiver: OtlpHttpReceiver, *args: str, metrics_port: int | None = None, **env_updates: str
) -> subprocess.Popen:
    env = checkout_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="ddp-test",
        OMP_NUM_THREADS="1",
        **env_updates,
    )
    if metrics_port is not None:
        env["TORCHTRACE_METRICS_PORT"] = str(metrics_port)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", str(EXAMPLE), *args]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float = 180) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish in {timeout}s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


def spans_by_rank(receiver: OtlpHttpReceiver) -> list[tuple[int, object]]:
    """(rank from the resource, span) of everything received."""
    found = []
    for request in list(receiver.requests):
        for resource_spans in request.resource_spans:
            resource = attributes_dict(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                found.extend((resource["torchtrace.rank"], span) for span in scope_spans.spans)
    return found


class OneHookDDP:
    """What DistributedDataParallel does with comm hooks: one, registered for good."""

    def __init__(self) -> None:
        self.hooks: list = []

    def register_comm_hook(self, state, hook) -> None:  # noqa: ANN001
        if self.hooks:
            raise RuntimeError("register_comm_hook can only be called once")
        self.hooks.append((state, hook))

    def all_reduce(self, size: int = 4) -> None:
        state, hook = self.hooks[0]
        hook(state, Bucket(torch.ones(size))).wait()


class Recording:
    timer = None

    def __init__(self) -> None:
        self.buckets: list = []

    def record_comm(self, *bucket) -> None:  # noqa: ANN002
        self.buckets.append(bucket)


def test_the_comm_hook_records_for_the_current_handle_only():
    from torchtrace._capture.comm import unwatch_ddp, watch_ddp

    done = torch.futures.Future()
    done.set_result(torch.ones(4))
    ddp, first, second = OneHookDDP(), Recording(), Recording()
    assert watch_ddp(ddp, first, inner=lambda state, bucket: done)
    ddp.all_reduce()
    unwatch_ddp(ddp, first)  # first handle removed: DDP keeps the hook, which now records nothing
    ddp.all_reduce()
    assert watch_ddp(ddp, second)  # a later handle of the same model takes the hook over: no second register
    ddp.all_reduce()
    assert (len(first.buckets), len(second.buckets), len(ddp.hooks)) == (1, 1, 1)


def test_ranks_share_the_steps_trace_through_an_sdk_tracer_provider_too(monkeypatch):
    """Rank 0 and rank 1 of one job, simulated one after the other in this process."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHTRACE_RUN_ID", "job-7")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        model = nn.Sequential(nn.Linear(4, 2))
        with torchtrace.instrument(model, tracer_provider=provider, backward=True) as handle:
            model(torch.randn(3, 4)).sum().backward()
            handle.step()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    root, rank_1 = spans["train_step"], spans["rank 1"]
    assert rank_1.context.trace_id == root.context.trace_id
    assert rank_1.parent.span_id == root.context.span_id  # rank 1's span sits under the root rank 0 sent
    assert spans["rank 0"].parent.span_id == root.context.span_id


def test_torchruns_multi_node_default_run_id_none_does_not_join_unrelated_runs(monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHTRACE_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    first = rank_info().run_id
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert (first, rank_info().run_id) == ("node0:29500", "node0:29501")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")  # shared by the ranks of a Slurm job, new for every job
    assert rank_info().run_id == "slurm-4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")  # --rdzv-id job-42
    assert rank_info().run_id == "job-42"


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_rank_of_a_step_shares_one_trace_and_root(ranks):
    steps = 2
    with OtlpHttpReceiver() as receiver:
        finish(torchrun(ranks, receiver, f"--steps={steps}"))
        spans = spans_by_rank(receiver)
    assert {rank for rank, _ in spans} == set(range(ranks))
    roots = [span for _, span in spans if span.name == "train_step"]
    assert len(roots) == steps  # rank 0 sends one root per step
    for root in roots:
        in_trace = [(rank, span) for rank, span in spans if span.trace_id == root.trace_id]
        rank_steps = {rank: span for rank, span in in_trace if span.name.startswith("rank ")}
        assert set(rank_steps) == set(range(ranks))
        assert all(span.parent_span_id == root.span_id for span in rank_steps.values())
        for rank, span in in_trace:  # each rank's forward, backward, optimizer and all-reduce sit under its step
            if span.name in ("Sequential", "backward", "optimizer.step") or span.name.startswith("allreduce"):
                assert span.parent_span_id == rank_steps[rank].span_id, (rank, span.name)
        buckets = defaultdict(set)
        for rank, span in in_trace:
            if span.name.startswith("allreduce bucket"):
                buckets[rank].add(attributes_dict(span.attributes)["torchtrace.comm.bucket"])
        assert set(buckets) == set(range(ranks)) and len({frozenset(b) for b in buckets.values()}) == 1
    resources = {rank for rank, _ in spans}
    assert resources == set(range(ranks))


def test_each_steps_root_spans_every_ranks_step_though_a_rank_ends_it_late():
    """A rank's step ends with its optimizer step: rank 1's, slowed at step 1, ends 150 ms after rank 0's, and its
    step 2 begins that much later. Each rank sends rank 0 its step spans' bounds through the job's store, and rank
    0's root holds every rank's step span and everything under it, under the default policy too."""
    steps = 3
    with OtlpHttpReceiver() as receiver:
        finish(torchrun(2, receiver, f"--steps={steps}", "--delay-rank=1", "--delay-optimizer", "--delay-ms=150",
                        "--delay-step=1", TORCHTRACE_RANK_DETAIL="all"))  # fmt: skip
        spans = spans_by_rank(receiver)
    roots = {span.trace_id: span for _, span in spans if span.name == "train_step"}
    assert len(roots) == steps
    rank_steps = {(rank, attributes_dict(span.attributes)["torchtrace.step"]): span for rank, span in spans
                  if span.name.startswith("rank ")}  # fmt: skip
    late = rank_steps[1, 1].end_time_unix_nano - rank_steps[0, 1].end_time_unix_nano
    assert late > 100e6, "rank 1 ended step 1 well after rank 0"
    for rank, span in spans:
        root = roots[span.trace_id]
        assert root.start_time_unix_nano <= span.start_time_unix_nano, (rank, span.name)
        assert span.end_time_unix_nano <= root.end_time_unix_nano, (rank, span.name)
    assert "torchtrace.rank.detail" not in attributes_dict(rank_steps[1, 1].attributes)  # "all": no decision made


@pytest.fixture
def exchange_every_pass(monkeypatch):
    """The ranks of these tests exchange at every call, not every EXCHANGE_EVERY_S."""
    from torchtrace._pipeline import step_bounds

    monkeypatch.setattr(step_bounds, "EXCHANGE_EVERY_S", 0.0)
    monkeypatch.setattr(step_bounds, "PER_RANK_S", 0.0)


def _ranks(store, world_size: int = 3) -> list:
    from torchtrace._core.ranks import RankInfo
    from torchtrace._pipeline.step_bounds import StepBounds

    return [StepBounds(RankInfo(rank, rank, world_size, "host", "run"), store, "bounds") for rank in range(world_size)]


def _root(start_ns: int, end_ns: int):
    from torchtrace._core.calls import ModuleCall

    return ModuleCall("", "train_step", 0, 0xABC, 0x1, 0, start_ns, end_ns)


def test_rank_0_holds_each_step_root_until_every_rank_sent_its_bounds(exchange_every_pass):
    rank_0, rank_1, rank_2 = _ranks(torch.distributed.TCPStore("127.0.0.1", 0, is_master=True))
    assert not rank_1.step_resolved(0, None, 90, 1_100)  # rank 1 ran ahead: its bounds arrive before rank 0 holds
    assert rank_1.exchange() == []
    root = _root(100, 1_000)
    assert rank_0.step_resolved(0, root, 100, 1_000)  # held: sent later
    assert rank_0.exchange() == [] and rank_0.pending()  # rank 2's bounds are not in yet
    rank_2.step_resolved(0, None, 120, 1_050)
    rank_2.exchange()
    assert rank_0.exchange() == [root] and not rank_0.pending()
    assert (root.start_ns, root.end_ns) == (90, 1_100)  # from the first start to the last end of any rank


def test_in_a_large_job_each_rank_sends_its_bounds_less_often():
    """Rank 0 pops the others' messages one by one: at W ranks each sends every W milliseconds at most (50 ms below
    50 ranks), so rank 0 reads about one a millisecond however large the job."""
    from torchtrace._core.ranks import RankInfo
    from torchtrace._pipeline.step_bounds import StepBounds

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
    rank_1 = StepBounds(RankInfo(1, 1, 500, "host", "run"), store, "bounds")
    for step in range(3):
        rank_1.step_resolved(step, None, step, step + 1)
        rank_1.exchange()
    assert store.queue_len("bounds") == 1  # the first step went out; the next two wait for the next 0.5 s
    assert rank_1.pending()
    rank_1.exchange(final=True)  # flush(), remove(): at once
    assert store.queue_len("bounds") == 2 and not rank_1.pending()


def test_a_root_whose_rank_never_reports_is_sent_after_a_while_with_one_warning(exchange_every_pass, monkeypatch,
                                                                               caplog):  # fmt: skip
    from torchtrace._pipeline import step_bounds

    monkeypatch.setattr(step_bounds, "RELEASE_AFTER_S", 0.05)
    rank_0, rank_1, _ = _ranks(torch.distributed.TCPStore("127.0.0.1", 0, is_master=True))
    root = _root(100, 1_000)
    rank_0.step_resolved(0, root, 100, 1_000)
    rank_1.step_resolved(0, None, 50, 1_000)
    rank_1.exchange()
    assert rank_0.exchange() == []
    time.sleep(0.1)
    assert rank_0.exchange() == [root] and root.start_ns == 50  # the ranks that did report are held
    assert "1 of 2 other ranks sent no step bounds" in caplog.text
    other = _root(2_000, 3_000)
    rank_0.step_resolved(1, other, 2_000, 3_000)
    started = time.monotonic()
    final = rank_0.exchange(final=True)  # flush() / remove(): waits for the ranks heard from, then sends what it holds
    assert final == [other]
    assert 1.0 < time.monotonic() - started < 10  # rank 1 was waited for (FINAL_WAIT_S); rank 2, never heard, not


def test_a_flush_right_after_the_first_steps_waits_for_a_rank_not_heard_from_yet(exchange_every_pass):
    """Rank 1's first report can come after rank 0's first steps were resolved (its worker had not passed yet):
    the flush waits for it as for any rank, and the root spans its step too."""
    rank_0, rank_1 = _ranks(torch.distributed.TCPStore("127.0.0.1", 0, is_master=True), world_size=2)
    root = _root(100, 1_000)
    rank_0.step_resolved(0, root, 100, 1_000)

    def report_later() -> None:
        time.sleep(0.2)
        rank_1.step_resolved(0, None, 40, 1_200)
        rank_1.exchange()

    reporter = threading.Thread(target=report_later)
    reporter.start()
    started = time.monotonic()
    assert rank_0.exchange(final=True) == [root]
    reporter.join()
    assert (root.start_ns, root.end_ns) == (40, 1_200)
    assert time.monotonic() - started < 1.5  # sent once rank 1's bounds came, not at the end of the wait


def test_a_rank_that_never_instruments_costs_one_wait_at_a_flush_not_one_at_every_flush(
    exchange_every_pass, monkeypatch
):
    from torchtrace._pipeline import step_bounds

    monkeypatch.setattr(step_bounds, "FINAL_WAIT_S", 0.3)
    rank_0, _ = _ranks(torch.distributed.TCPStore("127.0.0.1", 0, is_master=True), world_size=2)
    waits = []
    for step in range(3):
        root = _root(100 * step, 100 * step + 50)
        rank_0.step_resolved(step, root, 100 * step, 100 * step + 50)
        started = time.monotonic()
        assert rank_0.exchange(final=True) == [root]  # rank 0's own bounds
        waits.append(time.monotonic() - started)
    assert waits[0] >= 0.3 and max(waits[1:]) < 0.1  # rank 1 waited for once, then known silent


def test_a_store_without_queues_leaves_the_root_to_rank_0s_step(exchange_every_pass, tmp_path, caplog):
    rank_0, *_ = _ranks(torch.distributed.FileStore(str(tmp_path / "store"), 1))
    root = _root(100, 1_000)
    assert rank_0.step_resolved(0, root, 100, 1_000)
    assert rank_0.exchange() == [root] and (root.start_ns, root.end_ns) == (100, 1_000)
    assert "could not be exchanged through the job's store" in caplog.text
    assert not rank_0.step_resolved(1, _root(0, 1), 0, 1)  # not held again: sent with the step


def test_the_slow_rank_waits_least_in_all_reduce_and_each_rank_serves_its_own_metrics():
    base = free_port(2)
    steps = 3
    with OtlpHttpReceiver() as receiver:
        process = torchrun(
            2, receiver, f"--steps={steps}", "--delay-rank=1", "--delay-ms=300", "--linger=20", metrics_port=base
        )
        scraped = scrape_every_rank(process, base, 2, steps, timeout=150)
        process.terminate()  # done scraping: no need to wait out the linger
        process.communicate(timeout=30)
        spans = spans_by_rank(receiver)
    assert set(scraped) == {0, 1}, "both ranks' endpoints (base port + local rank) served their own metrics"
    wait = defaultdict(int)
    for rank, span in spans:
        if span.name.startswith("allreduce bucket"):
            wait[rank] += span.end_time_unix_nano - span.start_time_unix_nano
    assert min(wait, key=wait.get) == 1, f"the delayed rank is the straggler: {dict(wait)}"
    assert wait[0] > 3 * wait[1]

    def comm_seconds(text: str, rank: int) -> float:
        prefix = f'torchtrace_comm_wait_seconds_total{{model="Sequential",rank="{rank}"}} '
        return float(next(line for line in text.splitlines() if line.startswith(prefix)).split()[-1])

    assert comm_seconds(scraped[1], 1) < comm_seconds(scraped[0], 0)  # the straggler panel's signal
    # rank detail "all" (the default below 64 ranks): every rank its per-module series, no rank detail counts
    assert all(module_series(scraped[rank]) for rank in range(2))
    assert "torchtrace_rank_detail_steps" not in scraped[0] + scraped[1]


USER_COMM_HOOK_JOB = """
import json, os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

import torchtrace

calls = []

def my_hook(state, bucket):  # the user's hook: fp16 compression, counted
    calls.append(bucket.index())
    return fp16_compress_hook(state, bucket)

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with torchtrace.instrument(model, exporter="none", optimizer=optimizer,
                           training=torchtrace.Training(comm_hook=(my_hook, None))) as handle:
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    handle.flush()
    names = [call.name for call in handle.records]
    try:  # registered after instrument(), as the docs say not to
        model.register_comm_hook(None, my_hook)
        refused = None
    except RuntimeError as error:
        refused = str(error)
print(json.dumps({"calls": calls, "names": names, "refused": refused}), flush=True)
# Tearing down a gloo group whose threads still release Python future callbacks can deadlock inside torch
# (the Reducer's destructor joins them holding the GIL): the job ends without running destructors.
os._exit(0)
"""


def run_one_rank(tmp_path, job: str) -> dict:
    """Runs ``job`` (a script that initialises a one-rank gloo group on the file store it is given) in a process of
    its own; returns the JSON object it prints last."""
    env = checkout_env()
    result = subprocess.run(
        [sys.executable, "-c", job, str(tmp_path / "store")], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_users_own_comm_hook_is_timed_instead_of_replaced(tmp_path):
    report = run_one_rank(tmp_path, USER_COMM_HOOK_JOB)
    assert report["calls"], "the user's hook still runs"
    names = report["names"]
    assert names.count("allreduce bucket 0") == 2  # and each bucket's communication is a span, per step
    assert names.count("rank 0") == 2 and names.count("train_step") == 2
    # DDP takes one comm hook: one registered after instrument() is refused with what to do instead
    assert "instrument(ddp, training=torchtrace.Training(comm_hook=(hook, state)))" in report["refused"]


DDP_EQUALITY_JOB = r"""
import json, os, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtrace

dist.init_process_group("gloo")
rank = dist.get_rank()


def train(traced):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    model = DistributedDataParallel(model, bucket_cap_mb=1)  # 1 MiB buckets: several all-reduces a step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = torchtrace.instrument(model, exporter="none", backward=True, optimizer=optimizer) if traced else None
    data = torch.Generator().manual_seed(rank)  # each rank its own batches: the average is what DDP agrees on
    for _ in range(3):
        model(torch.randn(8, 512, generator=data)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    names = []
    if handle is not None:
        handle.flush()
        names = [call.name for call in handle.records]
        handle.remove()
    return [parameter.detach().clone() for parameter in model.parameters()], names


plain, _ = train(False)
traced, names = train(True)
equal = all(torch.equal(a, b) for a, b in zip(plain, traced))
buckets = sorted({name for name in names if name.startswith("allreduce bucket")})
print("RESULT " + json.dumps({"rank": rank, "equal": equal, "buckets": buckets}), flush=True)
os._exit(0)  # see USER_COMM_HOOK_JOB: no gloo teardown with Python future callbacks pending
"""


DROPPED_STEPS_JOB = r"""
import json, os, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtrace

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
# rank 1 holds too few calls for a step: each of its step records is dropped at the step's end, rank 0's are not
limits = torchtrace.Limits(max_pending_calls=2 if rank == 1 else 10_000)
handle = torchtrace.instrument(model, exporter="none", backward=True, optimizer=optimizer, limits=limits)
for _ in range(3):
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
# rank 0 flushes after rank 1's flush has sent its last bounds: a flush waits for the ranks heard from so far only,
# and three short steps can end before rank 1's worker first reports
if rank == 1:
    handle.flush()
dist.barrier()
if rank == 0:
    handle.flush()
spans = [(call.name, call.start_ns, call.end_ns) for call in handle.records if call.kind == "step"]
print("RESULT " + json.dumps({"rank": rank, "spans": spans, "dropped": handle.dropped_calls}), flush=True)
handle.remove()
os._exit(0)  # see USER_COMM_HOOK_JOB
"""


def test_a_step_dropped_on_one_rank_still_sends_its_step_span_and_bounds(tmp_path):
    """A rank whose buffer drops a step's calls still sends the step's own span, and its bounds to rank 0, whose
    root spans it (instead of waiting for bounds that never come, then leaving the rank's step outside it)."""
    rank_0, rank_1 = run_on_two_ranks(tmp_path, DROPPED_STEPS_JOB)
    assert rank_1["dropped"] > 0 and rank_0["dropped"] == 0
    assert [name for name, *_ in rank_1["spans"]] == ["rank 1"] * 3  # its step spans survive the drop
    roots = [(start, end) for name, start, end in rank_0["spans"] if name == "train_step"]
    assert len(roots) == 3
    for (start, end), (_, step_start, step_end) in zip(roots, rank_1["spans"]):
        assert start <= step_start and step_end <= end  # rank 1's bounds reached rank 0's root


def run_on_two_ranks(tmp_path, job: str) -> list[dict]:
    """Runs ``job`` on two ranks under torchrun; what each printed after "RESULT " (a JSON object), by rank."""
    script = tmp_path / "job.py"
    script.write_text(job)
    env = checkout_env(OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
               str(script)]  # fmt: skip
    output = finish(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    # the ranks print at once: their lines may interleave, so each object is read from where its marker ends
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(output, marker.end())[0] for marker in re.finditer("RESULT ", output)]
    results.sort(key=lambda result: result["rank"])
    assert [result["rank"] for result in results] == [0, 1], output[-3000:]
    return results


def test_tracing_a_ddp_job_leaves_its_training_bit_for_bit_unchanged(tmp_path):
    """torchtrace's comm hook does the all-reduce and the average itself: the parameters after three steps on
    two ranks (each with its own data) are exactly those of the same job untraced."""
    for result in run_on_two_ranks(tmp_path, DDP_EQUALITY_JOB):
        assert result["equal"], result
        assert len(result["buckets"]) >= 2, result  # the all-reduces did run through the timed hook


TENSOR_PARALLEL_JOB = r"""
import json, os, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import torchtrace

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(8, 8192))  # a small output's row, a large one's pass
parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=False)})
parallelize_module(model, mesh, {"2": ColwiseParallel(use_local_output=False)})
handle = torchtrace.instrument(model, exporter="none", max_depth=1)
if rank == 1:
    handle.disable()  # this rank traces nothing (sampled out): the other's statistics must not wait for it
x = torch.randn(4, 8)
hidden = model[1](model[0](x))
output = model[2](hidden.to_local())
handle.flush()
got = {call.path: {key.rsplit(".", 1)[-1]: value for key, value in call.attributes.items()} for call in handle.records}
local = {"0": model[0](x).to_local(), "2": output.to_local()}
expected = {path: {"shape": list(tensor.shape), "mean": tensor.double().mean().item(),
                   "norm": torch.linalg.vector_norm(tensor.double()).item()} for path, tensor in local.items()}
handle.remove()

# training, every rank traced: gradients and FSDP2 / TP parameters are DTensors too
from torch.distributed.tensor.parallel import RowwiseParallel

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with torchtrace.instrument(model, exporter="none", backward=True, optimizer=optimizer,
                           training=torchtrace.Training(param_stats=True)) as handle:
    model(x).sum().backward()
    optimizer.step()
    handle.flush()
    training = {call.name: call.attributes for call in handle.records if call.name.endswith("backward")}
print("RESULT " + json.dumps({"rank": rank, "types": [type(output).__name__], "got": got, "expected": expected,
                              "training": training}, default=list), flush=True)
dist.barrier()
os._exit(0)  # see USER_COMM_HOOK_JOB
"""


def test_a_dtensors_statistics_are_of_the_local_shard_and_run_no_collective(tmp_path):
    """Tensor parallelism: a module's DTensor output is summarised by this rank's shard (the DTensor's own reductions
    would be collectives, run inside a hook: a rank that does not trace the call never joins them, and both hang)."""
    results = run_on_two_ranks(tmp_path, TENSOR_PARALLEL_JOB)
    traced = results[0]
    assert traced["types"] == ["DTensor"]
    assert results[1]["got"] == {}
    for path, expected in traced["expected"].items():
        got = traced["got"][path]
        assert "stats_error" not in got, got
        assert list(got["shape"]) == expected["shape"] == [4, 8 if path == "0" else 4096]
        assert got["mean"] == pytest.approx(expected["mean"], rel=1e-5, abs=1e-7)
        assert got["norm"] == pytest.approx(expected["norm"], rel=1e-5)
    for result in results:  # backward statistics and parameter norms, of each rank's shards
        training = result["training"]
        assert {"0 backward", "2 backward"} <= set(training), training
        assert not [key for attributes in training.values() for key in attributes if key.endswith("stats_error")]
        assert training["0 backward"]["torchtrace.param_grad.norm"] > 0
        assert training["2 backward"]["torchtrace.grad_input.0.norm"] > 0


FSDP2_NAMES_JOB = r"""
import json, os, sys, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import torchtrace

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))


model = nn.Sequential(Block(), Block())
for block in model:
    fully_shard(block)
fully_shard(model)
with torchtrace.instrument(model, exporter="none", metrics=True) as handle:
    model(torch.randn(2, 8)).sum().backward()
    handle.flush()
    names = sorted({(r.path, r.type_name) for r in handle.records})
print(json.dumps({"names": names, "classes": [type(model).__name__, type(model[0]).__name__],
                  "model": handle.model_name}), flush=True)
os._exit(0)
"""


def test_fsdp2_modules_are_named_by_the_classes_they_were_made_from(tmp_path):
    """fully_shard swaps each module's class for a generated FSDP<class>: spans, records and summaries name the
    class the user wrote."""
    report = run_one_rank(tmp_path, FSDP2_NAMES_JOB)
    assert report["classes"] == ["FSDPSequential", "FSDPBlock"]  # what fully_shard made of them
    assert [tuple(name) for name in report["names"]] == [
        ("", "Sequential"),
        ("0", "Block"),
        ("0.linear", "Linear"),
        ("1", "Block"),
        ("1.linear", "Linear"),
    ]
    assert report["model"] == "Sequential"


# -- rank detail at scale: step spans from every rank, module spans from the ranks that explain the step -------------


def _facts(wait: float, step: float = 1.0, nonfinite: bool = False, raised: bool = False) -> list[float]:
    return [wait, step, float(nonfinite), float(raised)]


def test_the_straggler_is_the_rank_the_others_waited_for_past_the_noise():
    from torchtrace._pipeline.rank_detail import reasons

    balanced = [_facts(0.100), _facts(0.102), _facts(0.099), _facts(0.101)]  # a 3 ms spread of a 1 s step: noise
    assert [reasons(balanced, rank, frozenset({0}), False) for rank in range(4)] == [("rank",), (), (), ()]
    late = [_facts(0.600), _facts(0.020), _facts(0.590), _facts(0.610)]  # the others waited ~0.6 s for rank 1
    assert [reasons(late, rank, frozenset({0}), False) for rank in range(4)] == [("rank",), ("straggler",), (), ()]
    no_comm = [_facts(-1.0), _facts(0.5)]  # a rank that recorded no all-reduce: no straggler can be named
    assert reasons(no_comm, 1, frozenset(), False) == ()


def test_a_nan_is_detailed_where_it_started_not_where_the_all_reduce_carried_it():
    from torchtrace._pipeline.rank_detail import reasons

    started = [_facts(0.1), _facts(0.1, nonfinite=True), _facts(0.1)]
    assert reasons(started, 1, frozenset(), nonfinite_before=False) == ("nonfinite",)
    everywhere = [_facts(0.1, nonfinite=True)] * 3  # the step after: every rank's parameters hold it
    assert [reasons(everywhere, rank, frozenset(), nonfinite_before=True) for rank in range(3)] == [(), (), ()]
    assert reasons([_facts(0.1), _facts(0.1, raised=True)], 1, frozenset(), False) == ("raised",)


def test_rotating_detail_sees_every_rank_in_turn_with_no_communication():
    """Training(rotating_detail=k): each traced step, k more ranks in turn send their module spans (reason
    "rotation"), chosen by the count of traced steps, the same on every rank: every rank once every W / k steps."""
    from torchtrace._core.ranks import RankInfo
    from torchtrace._pipeline.rank_detail import RankDetail

    def decided(world_size: int, rotating: int, steps: int) -> list[list[tuple[str, ...]]]:
        ranks = [RankDetail(RankInfo(rank, rank, world_size, "host", "run"), (0,), rotating)
                 for rank in range(world_size)]  # fmt: skip
        return [[rank.alone()() for rank in ranks] for _ in range(steps)]  # no process group: each on its own

    one = decided(4, 1, 5)
    assert [[("rotation" in why) for why in step] for step in one] == [
        [True, False, False, False], [False, True, False, False], [False, False, True, False],
        [False, False, False, True], [True, False, False, False],
    ]  # fmt: skip
    assert one[1][0] == ("rank",) and one[0][0] == ("rank", "rotation")
    two = decided(5, 2, 3)  # two ranks a step, wrapping around
    assert [{rank for rank, why in enumerate(step) if "rotation" in why} for step in two] == [{0, 1}, {2, 3}, {4, 0}]
    assert decided(3, 0, 2) == [[("rank",), (), ()]] * 2  # off by default


def _step():
    """What a rank's facts of a step are read from: no all-reduce, one second long, no forward."""
    from types import SimpleNamespace

    return SimpleNamespace(comm=[], forwards=[], start_ns=0, end_ns=1_000_000_000)


def test_one_all_gather_carries_a_run_of_steps_twice_as_long_as_the_last_up_to_16(monkeypatch):
    """Any collective costs a step about half a millisecond on a busy host, so the ranks' facts travel in runs of
    traced steps: 1, 2, 4, 8, then 16 at a time. A step's decision is ready once its run's gather is in; the last
    run, open at remove(), is gathered then."""
    from torchtrace._core.ranks import RankInfo
    from torchtrace._pipeline import rank_detail

    gathered_steps = []
    all_gather = torch.distributed.all_gather

    def counted(tensors, tensor, **kwargs):  # noqa: ANN001, ANN003
        gathered_steps.append(len(tensor))
        # until the gather is started, its steps read as not sent: the worker must not read them without their facts
        assert not policy._run.sent
        return all_gather(tensors, tensor, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_gather", counted)
    with one_rank_job():
        policy = rank_detail.RankDetail(RankInfo(0, 0, 1, "host", "run"), detail_ranks=())
        nonfinite = {5, 6, 40}  # a NaN starts at step 5 (in the run of steps 3-6) and at 40 (in the open run)
        decisions = [policy.start(_step(), step in nonfinite) for step in range(42)]
        assert gathered_steps == [1, 2, 4, 8, 16]  # steps 0, 1-2, 3-6, 7-14, 15-30; 31-41 wait for the 16th
        assert [decision.sent() for decision in decisions] == [True] * 31 + [False] * 11
        assert not any(decision.ready() for decision in decisions[31:])
        policy.close()  # remove(): the open run, padded to 16 steps
        assert gathered_steps[-1] == 16 and all(decision.sent() for decision in decisions)
        decided = [decision() for decision in decisions]  # the worker reads them in order
        assert all(decision.ready() for decision in decisions)
    assert [step for step, why in enumerate(decided) if why] == [5, 40]  # where it started, not the step after
    assert decided[5] == decided[40] == ("nonfinite",)


LAST_RUN_ALONE = """
import sys, time
from types import SimpleNamespace
import torch.distributed as dist
from torchtrace._core.ranks import RankInfo
from torchtrace._pipeline.rank_detail import RankDetail

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
policy = RankDetail(RankInfo(rank, rank, 2, "host", "run"), detail_ranks=(0,))
step = SimpleNamespace(comm=[], forwards=[], start_ns=0, end_ns=10**9)
# rank 0: runs [0], [1, 2] sent, [3] open at remove(); rank 1 stops after step 0 and never joins the runs after it
decisions = [policy.start(step, nonfinite=index == 1) for index in range(4 if rank == 0 else 1)]
if rank == 0:
    started = time.monotonic()
    policy.close()  # remove()
    print([decision() for decision in decisions], round(time.monotonic() - started, 1), flush=True)
else:
    time.sleep(12)  # goes on with something else: it never gathers those runs
"""


def test_remove_waits_a_few_seconds_at_most_for_ranks_that_never_gather_the_last_runs():
    """remove() on one rank after another stopped a run short: the gathers of the runs sent since and of the open
    one are waited for CLOSE_WAIT (5 s) at most in all, not the group's 60 s timeout each; then the rank decides
    those steps on its own (a NaN of its own, no straggler), with a warning."""
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", LAST_RUN_ALONE, str(rank), port], env=checkout_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]  # fmt: skip
    output = [rank.communicate(timeout=60)[0] for rank in ranks]
    assert ranks[0].returncode == 0, output
    decided, waited = output[0].splitlines()[-1].rsplit(" ", 1)
    assert decided == "[('rank',), ('rank', 'nonfinite'), ('rank',), ('rank',)]", output
    assert 4.5 <= float(waited) < 8, output
    assert "each rank decides on its own from now on" in output[0]


def test_under_auto_a_step_waits_on_the_worker_for_its_runs_gather_and_remove_gathers_the_last_run():
    """The worker leaves a step whose run was not gathered yet where it is (counted against max_pending_calls) and
    delivers it once the run's gather is in; a flush leaves it waiting too; remove() gathers the open run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    received = []

    def train_step(x: torch.Tensor | None = None) -> None:
        model(torch.randn(3, 4) if x is None else x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def delivered_steps(until: list[int]) -> list[int]:
        deadline = time.monotonic() + 10
        while True:
            handle._dispatcher.drain(wait=False)  # the worker's pass: it never waits for the other ranks
            steps = [call.attributes["torchtrace.step"] for call in received if call.name == "rank 0"]
            if steps == until or time.monotonic() > deadline:
                return steps
            time.sleep(0.01)

    auto = torchtrace.Training(rank_detail="auto", detail_ranks=())  # rank 0 too sends module spans where they explain
    with one_rank_job(), torchtrace.instrument(model, exporter="none", backward=True, optimizer=optimizer,
                                               sinks=[received.extend], training=auto) as handle:  # fmt: skip
        train_step()  # step 0: a run of one, sent at its end
        assert delivered_steps(until=[0]) == [0]
        assert handle.buffer.held_elsewhere == 0
        train_step()  # step 1: the first of a run of two
        assert delivered_steps(until=[0, 1]) == [0]
        assert handle.buffer.held_elsewhere == 4 + 3  # its forward's 4 calls and 3 backward spans, held
        train_step()  # step 2 ends the run
        assert delivered_steps(until=[0, 1, 2]) == [0, 1, 2]
        train_step(torch.full((3, 4), float("nan")))  # step 3, a NaN starting: the first of a run of four
        assert handle.flush()  # nothing lost; the step waits for its run (a flush starts no collective)
        assert delivered_steps(until=[0, 1, 2, 3]) == [0, 1, 2]
        assert handle.buffer.held_elsewhere == 4 + 3
    # remove(): the open run gathered at once
    details = [call.attributes["torchtrace.rank.detail"] for call in received if call.name == "rank 0"]
    assert details == ["none", "none", "none", "nonfinite"]
    step_of_trace = {call.trace_id: call.attributes["torchtrace.step"] for call in received if call.name == "rank 0"}
    assert {step_of_trace[call.trace_id] for call in received if call.path not in ("", "Sequential")} == {3}


def scrape_every_rank(process: subprocess.Popen, base: int, ranks: int, steps: int, timeout: float) -> dict[int, str]:
    """Each rank's /metrics (port ``base`` + its local rank) once it holds all ``steps`` (examples/ddp_train.py
    ``--linger`` keeps serving after training), by rank. Each rank is polled on a thread of its own: with 8 ranks on
    two cores an endpoint can take seconds to answer, and polled in turn the last ranks could go unasked until their
    linger was over."""

    def scrape(rank: int) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{base + rank}/metrics", timeout=5) as response:
                    text = response.read().decode()
            except (OSError, http.client.HTTPException):
                # not listening yet; where the client's own ephemeral port is that port, it connects to itself and
                # reads its request back as the reply (a BadStatusLine)
                text = ""
            if f'torchtrace_step_duration_seconds_count{{model="Sequential",rank="{rank}"}} {steps}.0' in text:
                return text
            time.sleep(0.3)
        return None

    with ThreadPoolExecutor(ranks) as pool:
        texts = dict(zip(range(ranks), pool.map(scrape, range(ranks))))
    return {rank: text for rank, text in texts.items() if text is not None}


def module_series(text: str) -> set[str]:
    """The per-module samples of a scrape (labelled with a module) other than the model root's own."""
    return {line.split(" ")[0] for line in text.splitlines()
            if not line.startswith("#") and "module=" in line and 'module="Sequential"' not in line}  # fmt: skip


def test_rank_detail_auto_sends_module_spans_only_from_the_ranks_that_explain_each_step():
    """8 gloo ranks, a straggler at step 1 (rank 3) and a NaN starting on rank 5 at step 2: every rank sends its step
    spans every step, one trace a step; module spans come from rank 0, rank 3 at step 1, rank 5 at step 2, and no
    other (at step 3 every rank holds the NaN, through the all-reduce: none is where it started), but for the rank
    that arrives last at step 0, which may be singled out too (the ranks' start-up is in that step).

    Metrics, scraped from every rank's endpoint: per-module series from rank 0 (the detail rank) only; ranks 3 and
    5 sent module spans in a step but keep their model-level series (the model root's row, step and comm wait) and
    count the step they explained by reason, so their series stay as few as any other rank's.

    The ranks' facts of steps 1 and 2 travel in one all-gather (a run of two); step 3, the first of the next run,
    with the open run that remove() gathers."""
    ranks, steps = 8, 4
    base = free_port(ranks)
    with OtlpHttpReceiver() as receiver:
        process = torchrun(ranks, receiver, f"--steps={steps}", "--step-ms=300", "--delay-rank=3", "--delay-step=1",
                           "--delay-ms=1500", "--nan-rank=5", "--nan-step=2", "--linger=20", metrics_port=base,
                           TORCHTRACE_RANK_DETAIL="auto")  # fmt: skip
        scraped = scrape_every_rank(process, base, ranks, steps, timeout=280)
        output = finish(process, timeout=300)
        spans = spans_by_rank(receiver)
    step_of_trace = {}
    detail = {}
    for rank, span in spans:
        attributes = attributes_dict(span.attributes)
        if span.name == f"rank {rank}":
            step_of_trace[span.trace_id] = attributes["torchtrace.step"]
            detail[rank, attributes["torchtrace.step"]] = attributes["torchtrace.rank.detail"]
    assert len(step_of_trace) == steps  # one trace a step, across the ranks
    assert set(detail) == {(rank, step) for rank in range(ranks) for step in range(steps)}  # every rank, every step
    with_modules = {
        (rank, step_of_trace[span.trace_id])
        for rank, span in spans
        if attributes_dict(span.attributes).get("torchtrace.module.path", "") != ""
    }
    # step 0's all-reduce also carries the ranks' start-up (eight processes on this host's two cores): the rank that
    # arrives last there may be singled out as a straggler, as at any step, and then sends its module spans of it
    start_up = {rank for rank in range(ranks) if "straggler" in detail[rank, 0].split(",")}
    assert len(start_up) <= 1, sorted(detail.items())
    expected = {(0, step) for step in range(steps)} | {(3, 1), (5, 2)} | {(rank, 0) for rank in start_up}
    assert with_modules == expected, sorted(detail.items())
    assert detail[3, 1] == "straggler" and detail[5, 2] == "nonfinite"
    assert detail[0, 0] == ("rank,straggler" if 0 in start_up else "rank")
    assert all(detail[rank, step] == "none" for rank in range(1, ranks) for step in range(steps)
               if (rank, step) not in expected)  # fmt: skip
    # the shared root holds every rank's step span (a rank that ends a step first also begins the next one first)
    roots = {span.span_id: span for _, span in spans if span.name == "train_step"}
    for rank, span in spans:
        if span.name == f"rank {rank}":
            root = roots[span.parent_span_id]
            assert root.start_time_unix_nano <= span.start_time_unix_nano, (rank, detail)
            assert span.end_time_unix_nano <= root.end_time_unix_nano, (rank, detail)

    assert set(scraped) == set(range(ranks)), f"every rank's endpoint served its steps:\n{output[-3000:]}"
    assert 'module="0"' in scraped[0] and len(module_series(scraped[0])) > 20  # rank 0: every module, every family
    for rank in (3, 5, 1, 2, 4, 6, 7):  # the straggler and the NaN's rank first
        assert module_series(scraped[rank]) == set(), (rank, sorted(module_series(scraped[rank]))[:5])
        assert not re.search(r"torchtrace_module_call_duration_seconds_bucket\{", scraped[rank]), rank
    samples = [line for line in scraped[3].splitlines() if line.startswith("torchtrace_")]
    assert len(samples) == len([line for line in scraped[1].splitlines() if line.startswith("torchtrace_")])

    def value(rank: int, name: str, **labels: str) -> float:
        wanted = {"model": "Sequential", "rank": str(rank), **labels}
        for line in scraped[rank].splitlines():
            found = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
            if found and found[1] == name and dict(re.findall(r'(\w+)="([^"]*)"', found[2])) == wanted:
                return float(found[3])
        raise AssertionError(f"no {name}{wanted} in rank {rank}'s scrape")

    def reason(rank: int, why: str) -> float:
        return value(rank, "torchtrace_rank_detail_steps_total", reason=why)

    assert reason(3, "straggler") == 1 + (3 in start_up) and reason(5, "nonfinite") == 1 and reason(0, "rank") == steps
    assert reason(1, "straggler") == (1 in start_up) and reason(1, "nonfinite") == reason(3, "nonfinite") == 0
    root = {"module": "Sequential", "module_type": "Sequential"}  # the model root's own row: its forward, every step
    for rank in range(ranks):
        assert value(rank, "torchtrace_module_calls_total", **root) == steps, rank
        assert value(rank, "torchtrace_comm_wait_seconds_total") > 0, rank
    assert value(5, "torchtrace_output_nan_values_total", **root) > 0  # the NaN's rank: its output counted
    assert value(4, "torchtrace_output_nan_values_total", **root) > 0  # at step 3, through the all-reduce


def test_rank_detail_auto_decides_steps_gathered_sixteen_at_a_time_and_the_last_run_at_remove():
    """33 steps on 4 ranks: runs of 1, 2, 4, 8 and 16 steps (0-30), then steps 31-32 open at remove(). The straggler
    at step 20 (in the run of 16) and the NaN starting at step 31 (in the open run) are detailed on their ranks
    alone, and the step after the NaN, which every rank holds through the all-reduce, on none. Steps of 300 ms, as
    in the test above: this shared host's own noise stays below the straggler threshold (a quarter of the step),
    except at step 0, whose all-reduce also carries the ranks' start-up (four processes on this host's two cores,
    each one's first forward and backward): the rank that arrives last there may be singled out, as at any step."""
    ranks, steps = 4, 33
    with OtlpHttpReceiver() as receiver:
        finish(torchrun(ranks, receiver, f"--steps={steps}", "--step-ms=300", "--delay-rank=2", "--delay-step=20",
                        "--delay-ms=1500", "--nan-rank=3", "--nan-step=31", TORCHTRACE_RANK_DETAIL="auto"))  # fmt: skip
        spans = spans_by_rank(receiver)
    detail = {}
    for rank, span in spans:
        if span.name == f"rank {rank}":
            attributes = attributes_dict(span.attributes)
            detail[rank, attributes["torchtrace.step"]] = attributes["torchtrace.rank.detail"]
    assert set(detail) == {(rank, step) for rank in range(ranks) for step in range(steps)}
    singled_out = {key: why for key, why in detail.items() if why not in ("none", "rank")}
    start_up = {key: singled_out.pop(key) for key in list(singled_out) if key[1] == 0}
    assert set(start_up.values()) <= {"straggler"} and len(start_up) <= 1, start_up
    assert singled_out == {(2, 20): "straggler", (3, 31): "nonfinite"}, singled_out
    assert all(detail[0, step] == "rank" for step in range(steps))


def test_rank_detail_is_auto_from_64_ranks_unless_asked_and_validated_at_instrument(monkeypatch):
    from torchtrace._core.ranks import RankInfo
    from torchtrace._pipeline.rank_detail import policy_for

    def rank(world: int) -> RankInfo:
        return RankInfo(0, 0, world, "node", "run")

    assert [policy_for(None, rank(world)) for world in (2, 63, 64, 1000)] == ["all", "all", "auto", "auto"]
    assert policy_for("all", rank(1000)) == "all" and policy_for("auto", rank(2)) == "auto"
    assert policy_for("auto", None) == "all"  # one process: there are no ranks to choose from
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Training.rank_detail must be one of all, auto"):
        torchtrace.instrument(model, exporter="none", training=torchtrace.Training(rank_detail="some"))
    monkeypatch.setenv("TORCHTRACE_DETAIL_RANKS", "0,x")
    with pytest.raises(ValueError, match="TORCHTRACE_DETAIL_RANKS"):
        torchtrace.instrument(model, exporter="none")
    monkeypatch.setenv("TORCHTRACE_DETAIL_RANKS", "3, 1,3")
    with torchtrace.instrument(model, exporter="none") as handle:
        assert handle.options.training.detail_ranks == (1, 3)
