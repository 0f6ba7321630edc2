"""After ``os.fork()`` (multiprocessing's "fork" start method, DataLoader workers): a child traces on its own.

A forked child inherits each live handle's buffer, dispatcher and sender, but not the dispatch worker thread, and
possibly a lock held by that worker at the moment of the fork (a drain in progress holds the dispatcher's lock for
a whole export; a stalled endpoint makes that seconds). Left as is, the child's records / flush / remove / exit
would wait on that lock forever, and its spans would never be exported.

So, in the child, for every live handle: fresh locks, an empty buffer and a fresh training step (what was pending
belongs to the parent, which exports it), the child's own worker thread (one for all its handles), and new senders
(a new HTTP session / gRPC channel / file handle; never the parent's sockets) with a fresh resource (the SDK gives
the child a new ``service.instance.id``; a rank of a distributed job keeps its rank's). The child then
exports its own spans like any process. A child ending with ``os._exit()`` (multiprocessing does) skips atexit:
spans it recorded in its last ``export_interval_ms`` are lost unless it calls ``handle.flush()``.

GNU OpenMP's thread pool does not survive fork: in a child, any torch reduction that goes parallel hangs forever
when the parent had used the pool (plain torch, traced or not). torchtrace's statistics are such reductions, so a
child with live handles gets ``torch.set_num_threads(1)``, as PyTorch's DataLoader workers do.

Registered once, on import: ``import torchtrace`` imports this module (it sits above ``_handle`` and ``worker``,
whose live handles and worker it re-arms).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from torchtrace._handle import _live_handles
from torchtrace._pipeline.worker import WORKER

_logger = logging.getLogger(__name__)
_registered = False


def _renew_sender(sink: Any) -> None:
    """A fresh sender of the same kind for an ``OtlpSink`` (and fresh sink state)."""
    from torchtrace._otlp import (
        exporters as _exporters,  # only an OtlpSink has a sender: the handle that made it imported this already
    )

    sender = sink.sender
    if isinstance(sender, _exporters.GrpcSender):
        new: Any = _exporters.create_otlp_sender("grpc")
    elif isinstance(sender, _exporters.HttpSender):
        new = _exporters.create_otlp_sender("http/protobuf")
    elif isinstance(sender, _exporters.JsonFileSender):
        new = _exporters.JsonFileSender(sender.path)
    else:
        return  # a user's sender: theirs to handle
    sink.sender = new
    sink._lock = threading.Lock()
    sink.resource = _exporters.process_resource()  # a new service.instance.id, unless the rank's says otherwise


def after_fork_in_child() -> None:
    """Make every live handle usable in this (forked) process. Never raises."""
    WORKER.after_fork()  # the parent's worker thread is not here; live handles below start the child's own
    handles = list(_live_handles)
    if handles:
        try:
            import torch

            torch.set_num_threads(1)  # libgomp's pool is unusable after fork: the statistics would hang
        except Exception:
            pass
    for handle in handles:
        try:
            buffer = handle.buffer
            buffer._lock = threading.Lock()
            buffer._forwards.clear()
            buffer.pending_calls = 0
            dispatcher = handle._dispatcher
            dispatcher.after_fork()
            if handle._steps is not None:
                handle._steps.forget_after_fork()
            for sink in dispatcher.sinks:
                if hasattr(sink, "sender") and hasattr(sink, "exported"):
                    _renew_sender(sink)
            if not handle._removed:
                dispatcher.start()
        except Exception:  # tracing must not break the child
            _logger.debug("torchtrace: could not re-arm a handle after fork", exc_info=True)


def register() -> None:
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=after_fork_in_child)
        _registered = True


register()
