"""What torchtrace leaves on a model: the tests that check nothing is left behind ask here."""

from __future__ import annotations

from torch import nn

from torchtrace._traced_forward import TracedForward
from torchtrace._untraced_state import UntracedState


def traced_modules(model: nn.Module) -> list[str]:
    """Paths of the modules that carry a forward hook (any: torch's own call path then changes), a traced forward or
    torchtrace's ``__getstate__``."""
    return [
        path
        for path, module in model.named_modules()
        if module._forward_hooks
        or module._forward_pre_hooks
        or module._forward_hooks_with_kwargs
        or module._forward_hooks_always_called
        or module._forward_pre_hooks_with_kwargs
        or isinstance(module.__dict__.get("forward"), TracedForward)
        or isinstance(module.__dict__.get("__getstate__"), UntracedState)
    ]
