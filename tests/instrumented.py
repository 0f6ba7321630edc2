"""What torchtrace leaves on a model: the tests that check nothing is left behind ask here."""

from __future__ import annotations

from torch import nn

from torchtrace._capture.copies import _EntryOfModule
from torchtrace._capture.traced_forward import TracedForward


def traced_modules(model: nn.Module) -> list[str]:
    """Paths of the modules that carry a forward hook (any: torch's own call path then changes), a traced forward or
    another entry of torchtrace's in its instance dict (``_copies``)."""
    return [
        path
        for path, module in model.named_modules()
        if module._forward_hooks
        or module._forward_pre_hooks
        or module._forward_hooks_with_kwargs
        or module._forward_hooks_always_called
        or module._forward_pre_hooks_with_kwargs
        or isinstance(module.__dict__.get("forward"), TracedForward)
        or any(isinstance(entry, _EntryOfModule) for entry in module.__dict__.values())
    ]
