"""Traced modules replaced after ``instrument()``: found as torch registers the replacement, never per call.

PEFT's ``get_peft_model`` and ``merge_and_unload``, a quantizer or a wrapper put another module where a traced one
was (``setattr(parent, name, new)``; in-place converters such as ``quantize_dynamic(..., inplace=True)`` write
``parent._modules`` directly: ``sweep`` finds those). The traced module may still run, inside its replacement (a
LoRA layer calls its ``base_layer``), and its spans would then carry a path that is no longer its own: the frozen
base layer's output shown as the adapted layer's. torch calls its global module registration hook as the
replacement is registered; there the replaced module and every traced module under it stop being traced, and the
handle warns once, naming them. Tracing what the model is now takes ``remove()`` and ``instrument()`` again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

# parent module -> {attribute name: (the traced module there, what to call when something else is put there)}
_placements: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[weakref.ref, Callable[[Any], None]]]]
_placements = weakref.WeakKeyDictionary()
_hook_handle: Any = None


def watch(model: torch.nn.Module, paths: Iterable[str], on_replaced: Callable[[str, Any], None]) -> None:
    """Calls ``on_replaced(path, new_module)`` once another module is registered at one of ``paths`` of ``model``
    (module paths as ``named_modules()`` gives them; "" is the model itself, which has no parent to watch)."""
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = torch.nn.modules.module.register_module_module_registration_hook(_on_registered)
    for path in paths:
        if not path:
            continue
        parent_path, _, name = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
            module = parent._modules[name]
        except (AttributeError, KeyError):
            continue
        if module is None:
            continue
        _placements.setdefault(parent, {})[name] = (weakref.ref(module), lambda new, path=path: on_replaced(path, new))


def unwatch(model: torch.nn.Module, paths: Iterable[str]) -> None:
    """``watch`` undone for ``paths`` (at ``remove()``, or once they were replaced)."""
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
        except AttributeError:
            continue
        placed = _placements.get(parent)
        if placed is not None:
            placed.pop(name, None)


def sweep() -> None:
    """Replacements torch registered without calling its hook: ``parent._modules[name] = new``, as
    ``quantize_dynamic(..., inplace=True)`` and other in-place converters write. Each watched place is checked
    (a dict lookup each); called by every drain of the dispatcher, off the model's thread and never per call."""
    try:
        places = [
            (parent, name, entry) for parent, placed in list(_placements.items()) for name, entry in placed.items()
        ]
    except RuntimeError:  # a model being instrumented or removed on another thread meanwhile: the next drain
        return
    for parent, name, (traced_ref, on_replaced) in places:
        current = parent._modules.get(name)
        if current is not traced_ref() and _placements.get(parent, {}).pop(name, None) is not None:
            on_replaced(current)


def _on_registered(parent: torch.nn.Module, name: str, module: Any) -> None:
    placed = _placements.get(parent)
    if not placed or name not in placed:
        return
    traced_ref, on_replaced = placed[name]
    if module is traced_ref():  # the same module registered again
        return
    del placed[name]
    on_replaced(module)
