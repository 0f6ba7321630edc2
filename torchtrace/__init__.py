"""torchtrace: OpenTelemetry spans and tensor statistics for every PyTorch module call."""

from torchtrace._calls import ModuleCall, Sink
from torchtrace._handle import TraceHandle, instrument
from torchtrace._hooks import CompressedTensor
from torchtrace._stats import STAT_NAMES
from torchtrace.version import __version__

__all__ = [
    "STAT_NAMES",
    "CompressedTensor",
    "ModuleCall",
    "Sink",
    "TraceHandle",
    "__version__",
    "instrument",
]
