"""A real Prometheus for tests: Debian's ``prometheus`` binary on 127.0.0.1, temp config and storage.

    with PrometheusServer(["127.0.0.1:9464"], tmp_dir) as prometheus:
        prometheus.wait_for("up", lambda result: result, timeout=20)
        prometheus.query("torchtrace_spans_recorded_total")

Scrapes every second with exemplar storage on. The first sample shows up ~6 s after start (targets are refreshed
every 5 s): poll with ``wait_for``, never sleep a fixed time. The process is always terminated on exit.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus (scripts/dev test does it when run as root)"


def require_binary(name: str) -> str:
    """Path of ``prometheus`` / ``promtool``. Missing: the test fails on CI (CI=true), is skipped elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PrometheusServer:
    def __init__(self, targets: Sequence[str], directory: Path, *, binary: str | None = None) -> None:
        self.binary = binary or require_binary("prometheus")
        self.directory = Path(directory)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "torchtrace", "static_configs": [{"targets": list(targets)}]}],
        }
        self.config_file = self.directory / "prometheus.yml"
        self.config_file.write_text(json.dumps(config))  # JSON is YAML
        self.log_file = self.directory / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 15) -> PrometheusServer:
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config_file}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--enable-feature=exemplar-storage",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait(lambda: self._get("/-/ready", raw=True) is not None, timeout, "ready")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- HTTP API ---------------------------------------------------------------------------------------------------

    def _get(self, path: str, params: dict[str, Any] | None = None, *, raw: bool = False) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = response.read()
        except (OSError, http.client.HTTPException):  # not listening yet (or connected to itself), or a 4xx/5xx
            if raw:
                return None
            raise
        return body if raw else json.loads(body)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query: the ``result`` list (vector / scalar results as Prometheus gives them)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        answer = self._get("/api/v1/query", params)
        assert answer["status"] == "success", answer
        result = answer["data"]["result"]
        return result if answer["data"]["resultType"] in ("vector", "matrix") else [result]

    def query_exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        answer = self._get("/api/v1/query_exemplars", {"query": expr, "start": start, "end": end})
        assert answer["status"] == "success", answer
        return answer["data"]

    def wait_for(self, expr: str, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 30) -> list:
        """Polls ``expr`` until ``predicate(result)`` holds; returns that result."""
        found: list = []

        def check() -> bool:
            nonlocal found
            found = self.query(expr)
            return predicate(found)

        self._wait(check, timeout, f"{expr!r} to satisfy the condition")
        return found

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                log = self.log_file.read_text()[-2000:]
                raise RuntimeError(f"prometheus exited ({self.process.returncode}): {log}")
            if condition():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for prometheus: {what}")
            time.sleep(0.1)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``promtool args...``; the result's stdout/stderr are text."""
    return subprocess.run(
        [require_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
