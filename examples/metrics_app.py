"""A long-running traced model with a Prometheus endpoint: the example app of deploy/docker-compose.yml.

    TORCHTRACE_METRICS_PORT=9464 python examples/metrics_app.py   # then curl localhost:9464/metrics

Spans go where torchtrace's exporter settings say (OTEL_EXPORTER_OTLP_ENDPOINT in the compose file); metrics are
aggregated by a MetricsSink and served by metrics_from_env(). Every 50th batch carries a NaN so the NaN panels
and alert have something to show.
"""

from __future__ import annotations

import argparse
import time

import torch

import torchtrace
from torchtrace._demo import BATCH, SEED, SEQUENCE, VOCAB, DemoTransformer
from torchtrace._sinks.metrics import MetricsSink
from torchtrace._sinks.metrics_server import metrics_from_env, serve_metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=0, help="stop after this many batches (default: never)")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between batches (default: 0.2)")
    parser.add_argument("--nan-every", type=int, default=50, help="poison every Nth batch with a NaN (0: never)")
    args = parser.parse_args()

    server = metrics_from_env() or serve_metrics(9464)
    print(f"metrics on {server.url}", flush=True)
    torch.manual_seed(SEED)
    model = DemoTransformer().eval()
    metrics = MetricsSink()
    with torchtrace.instrument(model, exporter="otlp" if _otlp() else "file", sinks=[metrics]) as handle:
        metrics.watch(handle)
        batch = 0
        while not args.batches or batch < args.batches:
            tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
            with torch.no_grad():
                poisoned = args.nan_every and batch % args.nan_every == args.nan_every - 1
                row = model.embedding.weight[int(tokens[0, 0])]  # a view: fill_ and copy_ write the weight
                saved = row.clone()
                if poisoned:
                    row.fill_(float("nan"))  # one token's embedding, restored right after the forward
                model(tokens)
                row.copy_(saved)
            batch += 1
            time.sleep(args.interval)
    server.shutdown()
    return 0


def _otlp() -> bool:
    from torchtrace._otlp.exporters import otlp_endpoint_configured

    return otlp_endpoint_configured()


if __name__ == "__main__":
    raise SystemExit(main())
