"""A small inference server with no torchtrace code in it: tracing comes from outside.

    torchtrace run examples/inference_server.py --port 8000
    opentelemetry-instrument python examples/inference_server.py --port 8000     # with opentelemetry-distro

    curl -s localhost:8000/predict -d '{"features": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]]}' \\
         -H 'traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'

Each request gets an OTel SERVER span, parented by the W3C ``traceparent`` header when the client sends one
(``opentelemetry.propagate.extract``); the model runs inside it, so torchtrace's module spans are its children.
Without any tracing set up, the OTel API is a no-op and the server works the same.

``--port 0`` picks a free port; the first line printed is ``listening on http://HOST:PORT``. ``--requests N``
stops after N requests (for tests and demos); by default it serves until interrupted.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from torch import nn

FEATURES = 8
CLASSES = 3

tracer = trace.get_tracer("examples.inference_server")


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(features)).softmax(dim=-1)


def make_handler(model: nn.Module, on_request: threading.Semaphore | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            parent = propagate.extract({key.lower(): value for key, value in self.headers.items()})
            with tracer.start_as_current_span(
                f"POST {self.path}", context=parent, kind=SpanKind.SERVER, record_exception=False
            ) as span:
                span.set_attribute("http.request.method", "POST")
                span.set_attribute("url.path", self.path)
                status, reply = self._predict()
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            body = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            if on_request is not None:
                on_request.release()

        def _predict(self) -> tuple[int, dict]:
            if self.path != "/predict":
                return 404, {"error": "not found"}
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                features = torch.tensor(request["features"], dtype=torch.float32).reshape(-1, FEATURES)
            except (ValueError, KeyError, TypeError, RuntimeError) as error:
                return 400, {"error": f"bad request: {error}"}
            with torch.inference_mode():
                probabilities = model(features)
            return 200, {"probabilities": probabilities.tolist()}

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--requests", type=int, default=0, help="stop after this many requests (0: never)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Classifier().eval()
    served = threading.Semaphore(0) if args.requests else None
    server = ThreadingHTTPServer((args.host, args.port), make_handler(model, served))
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        if served is None:
            thread.join()
        else:
            for _ in range(args.requests):
                served.acquire()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    print(f"served {args.requests or 'all'} requests", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
