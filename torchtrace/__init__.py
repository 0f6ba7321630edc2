"""torchtrace: OpenTelemetry spans and tensor statistics for every PyTorch module call."""

from torchtrace import _fork  # noqa: F401 - a forked child (DataLoader worker) traces with its own worker and senders
from torchtrace._capture.recorder import CompressedTensor
from torchtrace._core.baseline import Baseline, BaselineError
from torchtrace._core.calls import ModuleCall, NonFiniteError, Sink
from torchtrace._core.options import STAT_NAMES, Drift, Limits, Records, Stats, TraceFile, Training
from torchtrace._core.schedule import StepSchedule, every, schedule
from torchtrace._core.settings import Settings, configure
from torchtrace._handle import TraceHandle, handle_of, instrument
from torchtrace._sinks.drift import DriftStatus, LayerDrift
from torchtrace._sinks.metrics import MetricsSink
from torchtrace._sinks.metrics_server import MetricsServer, metrics_from_env, serve_metrics
from torchtrace.version import __version__

__all__ = [
    "STAT_NAMES",
    "Baseline",
    "BaselineError",
    "CompressedTensor",
    "Drift",
    "DriftStatus",
    "LayerDrift",
    "Limits",
    "MetricsServer",
    "MetricsSink",
    "ModuleCall",
    "NonFiniteError",
    "Records",
    "Settings",
    "Sink",
    "Stats",
    "StepSchedule",
    "TraceFile",
    "TraceHandle",
    "Training",
    "__version__",
    "configure",
    "every",
    "handle_of",
    "instrument",
    "metrics_from_env",
    "schedule",
    "serve_metrics",
]
