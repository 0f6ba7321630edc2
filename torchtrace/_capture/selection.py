"""Which modules get hooks: globs over module paths, module types, and a maximum depth."""

from __future__ import annotations

import sys
from fnmatch import fnmatchcase

import torch

from torchtrace._capture.recorder import ModuleInfo, warn_compiled_modules, warn_region_level
from torchtrace._capture.traced_forward import compiled_call
from torchtrace._core.options import Options


def is_compiled_module(model: torch.nn.Module) -> bool:
    """torch.compile(model) returns an OptimizedModule wrapping the original as ``_orig_mod``."""
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


def compiled_alone(module: torch.nn.Module) -> bool:
    """A module compiled on its own inside a model: ``module.compile()`` (the per-block recipe), or
    ``torch.compile(module)`` put in its place (an OptimizedModule). It is traced as a whole, the modules inside it
    not at all: a traced forward of theirs, one object per module, would be guarded by dynamo in each block's
    compiled code, a graph per block (see docs/training.md)."""
    return compiled_call(module) is not None or is_compiled_module(module)


def type_name(module: torch.nn.Module) -> str:
    """The module's class name as its user wrote it: FSDP2's ``fully_shard`` swaps the class of a module for a
    generated subclass named ``FSDP<its class>``; spans, metrics and summaries name the class it was made from."""
    if is_compiled_module(module):
        return type_name(module._orig_mod)
    cls = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")  # only where FSDP2 can be in use: never imported for it
    generated = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if generated is not None and issubclass(cls, generated) and cls is not generated:
        for base in cls.__bases__:
            if base is not generated:
                return base.__name__
    return cls.__name__


def select_modules(model: torch.nn.Module, options: Options) -> list[tuple[torch.nn.Module, ModuleInfo]]:
    """The modules to trace, in registration order. A module shared by two parents is listed once, under the
    first path that reaches it; its spans are still parented by whichever module called it."""
    if is_compiled_module(model):  # compiled before instrumenting
        name = type(model._orig_mod).__name__
        warn_region_level(name)
        return [(model, ModuleInfo(path="", type_name=name, depth=0))]
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module  # paths as in the user's model, without DDP's "module." prefix
    selected = []
    compiled: list[str] = []  # paths of the modules compiled on their own: nothing under them is traced
    for path, module in model.named_modules():
        if compiled and path.startswith(compiled[-1] + "."):
            continue
        if path and compiled_alone(module):  # the model itself compiled (model.compile()): region level, as above
            compiled.append(path)
        depth = path.count(".") + 1 if path else 0
        if options.max_depth is not None and depth > options.max_depth:
            continue
        if options.types and not isinstance(module, options.types):
            continue
        if not any(fnmatchcase(path, pattern) for pattern in options.include):
            continue
        if any(fnmatchcase(path, pattern) for pattern in options.exclude):
            continue
        selected.append((module, ModuleInfo(path=path, type_name=type_name(module), depth=depth)))
    if compiled:
        warn_compiled_modules(compiled)
    if not selected:
        raise ValueError(
            f"no module of {type(model).__name__} matches include={list(options.include)}, "
            f"exclude={list(options.exclude)}, types={[t.__name__ for t in options.types]}, "
            f"max_depth={options.max_depth}; module paths look like {[p for p, _ in model.named_modules()][:5]}"
        )
    return selected
