"""The file exporter's file: bounded by rotation, whole lines only (disk full included), private, never through a
planted symlink, and its failures named, counted and recovered from. Disk-full and read-only cases run on a real
tiny tmpfs (mounting needs root; skipped with the reason otherwise)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

import torchtrace
from torchtrace._otlp.exporters import EncodedSpans, JsonFileSender, check_endpoint, default_resource
from torchtrace._otlp.file_writer import TraceFile, rotated_paths
from torchtrace._otlp.json_lines import encode_otlp_json

SPANS_PER_FORWARD = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)).eval()


def lines_of(path: Path) -> list[dict]:
    """Every line parsed: a torn line fails the test."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def span_names(path: Path) -> list[str]:
    return [
        span["name"]
        for line in lines_of(path)
        for resource in line["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]


def spans_in_set(path: Path, backups: int) -> int:
    return sum(len(span_names(Path(name))) for name in rotated_paths(path, backups))


def line(number: int) -> EncodedSpans:
    """A one-span request whose span is named by ``number`` (to read the order back)."""
    model = make_model()
    with torchtrace.instrument(model, exporter="none", include="") as handle:
        model(torch.ones(1, 16))
        call = handle.records[0]
    call.path = f"n{number}"  # the span name
    return EncodedSpans(encode_otlp_json([call], default_resource(), "torchtrace", ""), 1)


# --- rotation -----------------------------------------------------------------------------------------------------


def test_rotation_keeps_the_newest_lines_in_numbered_files(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    first = line(0)
    size = len(first.payload) + 1
    sender = JsonFileSender(path, max_bytes=3 * size + 10, backups=2)  # three lines a file
    for number in range(20):
        assert sender.send(line(number))
    sender.shutdown()
    names = [span_names(Path(name)) for name in rotated_paths(path, 2)]  # current, .1, .2
    assert names == [["n18", "n19"], ["n15", "n16", "n17"], ["n12", "n13", "n14"]]
    assert not Path(f"{path}.3").exists()
    assert all(os.path.getsize(name) <= 3 * size + 10 for name in rotated_paths(path, 2))
    assert sender.file.rotations == 6


def test_zero_backups_keep_only_the_current_file_and_zero_mb_never_rotates(tmp_path: Path) -> None:
    payload = line(1)
    bounded = JsonFileSender(tmp_path / "a.jsonl", max_bytes=len(payload.payload) + 1, backups=0)
    unbounded = JsonFileSender(tmp_path / "b.jsonl", max_bytes=0)
    for _ in range(5):
        bounded.send(payload)
        unbounded.send(payload)
    assert len(lines_of(tmp_path / "a.jsonl")) == 1 and sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl"]
    assert len(lines_of(tmp_path / "b.jsonl")) == 5
    bounded.shutdown()
    unbounded.shutdown()


def test_instrument_rotates_as_the_variables_say_and_every_span_is_accounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHTRACE_TRACE_FILE_MAX_MB", "0.01")  # ~10 KiB
    monkeypatch.setenv("TORCHTRACE_TRACE_FILE_BACKUPS", "3")
    path = tmp_path / "traces.jsonl"
    model = make_model()
    with torchtrace.instrument(model, exporter="file", trace_file=str(path)) as handle:
        for _ in range(200):
            model(torch.randn(2, 16))
            handle.flush()
        exported = handle.exported_spans
    assert exported == 200 * SPANS_PER_FORWARD and handle.failed_spans == 0
    files = sorted(os.listdir(tmp_path))
    assert files == ["traces.jsonl", "traces.jsonl.1", "traces.jsonl.2", "traces.jsonl.3"]
    kept = spans_in_set(path, 3)
    assert 0 < kept < exported  # the oldest were rotated out, the set is whole lines
    assert all(os.path.getsize(tmp_path / name) <= 10_486 for name in files)


def test_rotation_options_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    for field, value in (("max_mb", -1), ("max_mb", float("inf")), ("backups", -1), ("backups", True),
                         ("max_mb", False)):  # fmt: skip
        with pytest.raises(ValueError, match=f"TraceFile.{field}"):
            torchtrace.instrument(model, exporter="none", trace_file=torchtrace.TraceFile(**{field: value}))
    monkeypatch.setenv("TORCHTRACE_TRACE_FILE_BACKUPS", "two")
    with pytest.raises(ValueError, match="TORCHTRACE_TRACE_FILE_BACKUPS"):
        torchtrace.instrument(model, exporter="none")


# --- private, no symlinks at the default path ----------------------------------------------------------------------


def test_the_directory_and_file_are_private(tmp_path: Path) -> None:
    path = tmp_path / "new" / "traces.jsonl"
    sender = JsonFileSender(path)
    sender.send(line(1))
    sender.shutdown()
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("written", ["relative", "absolute", "dotted"])
def test_a_symlink_planted_at_the_default_path_is_refused_however_the_path_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (tmp_path / "torchtrace-traces").mkdir(mode=0o700)
    (tmp_path / "torchtrace-traces" / "traces.jsonl").symlink_to(target)
    path = {
        "relative": None,  # the default itself
        "absolute": str(tmp_path / "torchtrace-traces" / "traces.jsonl"),
        "dotted": "./torchtrace-traces/../torchtrace-traces/traces.jsonl",
    }[written]
    with pytest.raises(ValueError, match="symlink; not written through"):
        torchtrace.instrument(make_model(), exporter="file", **({"trace_file": path} if path else {}))
    assert target.read_text() == "precious\n"


def test_a_symlink_planted_at_the_default_path_later_is_not_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    model = make_model()
    with (
        caplog.at_level(logging.WARNING, logger="torchtrace"),
        torchtrace.instrument(model, exporter="file") as handle,
    ):
        (tmp_path / "torchtrace-traces" / "traces.jsonl").symlink_to(target)  # after instrument()'s checks
        model(torch.randn(2, 16))
        handle.flush()
    assert target.read_text() == "precious\n"
    assert (handle.exported_spans, handle.failed_spans) == (0, SPANS_PER_FORWARD)
    assert any("file export failed" in record.getMessage() for record in caplog.records)


def test_a_default_directory_others_can_write_or_own_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's pre-made ``torchtrace-traces/`` in a shared working directory (0777, or theirs) is refused at
    instrument(): nothing is written into it."""
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "torchtrace-traces"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(ValueError, match="writable by others"):
        torchtrace.instrument(make_model(), exporter="file")
    if os.geteuid() != 0:
        return  # making a directory another user's needs root
    directory.chmod(0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to another user"):
        torchtrace.instrument(make_model(), exporter="file")
    assert list(directory.iterdir()) == []


def test_a_file_at_the_default_path_must_be_ours_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace file found at the default path: this user's and readable by others is made private; another
    user's, a hard link or not a regular file is refused at instrument()."""
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "torchtrace-traces"
    directory.mkdir(mode=0o700)
    path = directory / "traces.jsonl"
    path.write_text("")
    path.chmod(0o666)
    model = make_model()
    with torchtrace.instrument(model, exporter="file") as handle:
        model(torch.randn(2, 16))
        handle.flush()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and handle.exported_spans == SPANS_PER_FORWARD
    os.link(path, tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="not a regular file of one link"):
        torchtrace.instrument(make_model(), exporter="file")
    (tmp_path / "elsewhere").unlink()
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to another user"):
            torchtrace.instrument(make_model(), exporter="file")


@pytest.mark.parametrize("path", ["a\0b.jsonl", "."], ids=["nul-byte", "a-directory"])
def test_an_unusable_trace_file_is_refused_at_instrument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="NUL byte|is a directory"):
        torchtrace.instrument(make_model(), exporter="file", trace_file=path)


def test_a_symlinked_default_directory_is_refused_at_instrument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "torchtrace-traces").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="TORCHTRACE_TRACE_FILE.*symlink"):
        torchtrace.instrument(make_model(), exporter="file")


# --- configuration errors at instrument() ---------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["htp://x", ":::", "http://", "http://host:99999", "localhost:4318"])
def test_an_unusable_http_endpoint_is_refused_at_instrument(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        torchtrace.instrument(make_model(), exporter="otlp")


@pytest.mark.parametrize("endpoint", ["htp://x", ":::", "localhost", "host:port"])
def test_an_unusable_grpc_endpoint_is_refused_at_instrument(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        torchtrace.instrument(make_model(), exporter="otlp")


@pytest.mark.parametrize(
    "protocol, endpoint",
    [("grpc", "localhost:4317"), ("grpc", "http://127.0.0.1:4317"), ("grpc", "[::1]:4317"),
     ("http/protobuf", "https://collector.example:4318/v1/traces"), ("http/protobuf", "http://[::1]:4318")],
)  # fmt: skip
def test_usable_endpoints_pass(monkeypatch: pytest.MonkeyPatch, protocol: str, endpoint: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    check_endpoint(protocol)


def test_a_trace_directory_that_cannot_be_created_is_refused_at_instrument(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"trace_file \(TORCHTRACE_TRACE_FILE\).*cannot write traces there"):
        torchtrace.instrument(make_model(), exporter="file", trace_file=str(tmp_path / "a-file" / "t.jsonl"))


# --- a real tiny filesystem: full, read-only, vanished ----------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 128 KiB tmpfs mounted at tmp_path/fs (unmounted after)."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> Path:
    """Fills the filesystem: a file as large as it can get."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_disk_full_leaves_whole_lines_and_writing_resumes(tiny_fs: Path) -> None:
    path = tiny_fs / "traces" / "traces.jsonl"
    sender = JsonFileSender(path)
    big = line(1)
    assert sender.send(big)
    filler = fill(tiny_fs)
    failures = 0
    for _ in range(5):
        try:
            sender.send(big)
        except OSError as error:
            assert error.errno == 28  # ENOSPC
            failures += 1
    assert failures >= 1
    assert path.read_text().endswith("\n") and span_names(path)  # the failed writes were cut back
    filler.unlink()
    assert sender.send(line(2))
    sender.shutdown()
    names = span_names(path)
    assert names[-1] == "n2" and len(lines_of(path)) == len(names)


def test_a_full_disk_is_counted_warned_once_and_recovered_from(tiny_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_fs / "traces.jsonl"
    model = make_model()
    x = torch.randn(2, 16)
    expected = model(x)
    with (
        caplog.at_level(logging.WARNING, logger="torchtrace"),
        torchtrace.instrument(model, exporter="file", trace_file=str(path)) as handle,
    ):
        filler = fill(tiny_fs)
        for _ in range(20):
            assert torch.equal(model(x), expected)  # the model does not notice
            handle.flush()
        assert handle.failed_spans > 0
        filler.unlink()
        time.sleep(1.1)  # the sink probes again after its retry interval
        for _ in range(5):
            model(x)
            handle.flush()
        exported, failed = handle.exported_spans, handle.failed_spans
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("torchtrace")]
    failed_lines = [m for m in messages if "file export failed" in m]
    assert len(failed_lines) == 1 and "No space left on device" in failed_lines[0]
    assert sum("file export recovered" in m for m in messages) == 1
    assert not any("OTLP" in m for m in messages)
    assert exported + failed == 25 * SPANS_PER_FORWARD and exported >= 5 * SPANS_PER_FORWARD
    assert len(span_names(path)) == exported  # every exported span is in the file, every line whole


def test_a_read_only_then_vanished_directory(tiny_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tiny_fs / "traces"
    path = directory / "traces.jsonl"
    model = make_model()
    with (
        caplog.at_level(logging.WARNING, logger="torchtrace"),
        torchtrace.instrument(model, exporter="file", trace_file=str(path)) as handle,
    ):
        # nothing is open for writing yet, so the filesystem can be made read-only under the handle
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
        try:
            model(torch.randn(2, 16))
            handle.flush()
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(tiny_fs)], check=True)
        assert (handle.exported_spans, handle.failed_spans) == (0, SPANS_PER_FORWARD)
        time.sleep(1.1)  # the sink probes again after its retry interval
        model(torch.randn(2, 16))
        handle.flush()
        shutil.rmtree(directory)  # vanished: made again at the next write
        model(torch.randn(2, 16))
        handle.flush()
        assert (handle.exported_spans, handle.failed_spans) == (2 * SPANS_PER_FORWARD, SPANS_PER_FORWARD)
    assert len(span_names(path)) == SPANS_PER_FORWARD  # the batch after the directory came back, in a new file
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("torchtrace")]
    assert any("file export failed" in m and "Read-only file system" in m for m in messages)


def test_a_read_only_trace_directory_is_refused_at_instrument(tiny_fs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    with pytest.raises(ValueError, match="TORCHTRACE_TRACE_FILE.*(Read-only|not writable)"):
        torchtrace.instrument(make_model(), exporter="file", trace_file=str(tiny_fs / "traces.jsonl"))


def test_the_sdk_file_exporter_warns_once_per_burst(tiny_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    from torchtrace._otlp.exporters import SdkJsonFileExporter

    exporter = SdkJsonFileExporter(tiny_fs / "app.jsonl")
    tracer = TracerProvider().get_tracer("app")
    spans = []
    for index in range(4):
        with tracer.start_as_current_span(f"request {index}" + "x" * 2000) as span:
            spans.append(span)
    filler = fill(tiny_fs)
    with caplog.at_level(logging.WARNING, logger="torchtrace"):
        results = [exporter.export(spans) for _ in range(3)]
        filler.unlink()
        results.append(exporter.export(spans[:1]))
    exporter.shutdown()
    assert results == [SpanExportResult.FAILURE] * 3 + [SpanExportResult.SUCCESS]
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("torchtrace")]
    assert len(messages) == 2 and "file export failed" in messages[0] and "recovered" in messages[1]
    assert span_names(tiny_fs / "app.jsonl") == [spans[0].name]


def test_a_file_left_ending_mid_line_gets_the_next_line_on_a_line_of_its_own(tmp_path: Path) -> None:
    """What a process killed inside a write leaves (the kernel stops a write of more than a page at a fatal signal):
    the next writer keeps the fragment a line apart, never gluing a good line to it."""
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b'{"resourceSpans": []}\n{"resourceSp')
    TraceFile(path).append(b'{"resourceSpans": [1]}\n')
    assert path.read_bytes().split(b"\n") == [b'{"resourceSpans": []}', b'{"resourceSp', b'{"resourceSpans": [1]}', b""]
