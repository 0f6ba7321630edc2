"""The names of the attributes torchtrace writes on spans and resources, for code that reads them.

OpenTelemetry's semantic conventions have nothing for layers or tensor statistics, so these are torchtrace's own,
under the ``torchtrace.`` namespace (docs/spans.md describes each). A tensor's statistics are ``<prefix>.<stat>``
for a bare tensor and ``<prefix>.<name>.<stat>`` for one inside a container::

    from torchtrace import attributes

    mean = span.attributes[f"{attributes.OUTPUT_PREFIX}.mean"]
    layer = span.attributes[attributes.MODULE_PATH]

torchtrace's own writers and readers import them from here; no name is spelled anywhere else in the package.
``SPAN_ATTRIBUTES`` documents each (docs/spans.md's table is generated from it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MODULE_PATH = "torchtrace.module.path"  # the module's path in its model ("" for the model: its class name)
MODULE_TYPE = "torchtrace.module.type"  # the module's class name

OUTPUT_PREFIX = "torchtrace.output"  # statistics of a call's output tensors
INPUT_PREFIX = "torchtrace.input"  # of its input tensors (Stats(inputs=True))
GRAD_OUTPUT_PREFIX = "torchtrace.grad_output"  # of the gradients reaching a module's output (backward spans)
GRAD_INPUT_PREFIX = "torchtrace.grad_input"  # of the gradients it passes on
MODULE_ATTRIBUTE_PREFIX = "torchtrace.module_attribute"  # Records(module_attributes=)

PARAM_NORM = "torchtrace.param.norm"  # Training(param_stats=True): the module's parameters' joint norm
PARAM_GRAD_NORM = "torchtrace.param_grad.norm"  # and their gradients'

STEP = "torchtrace.step"  # a training step's number
RANK = "torchtrace.rank"  # on a rank's step span, and as a resource attribute
LOCAL_RANK = "torchtrace.local_rank"  # resource
WORLD_SIZE = "torchtrace.world_size"  # on the all-ranks root span, and as a resource attribute
RANK_DETAIL = "torchtrace.rank.detail"  # on a rank's step span under rank_detail="auto": why it has module spans
COMM_SECONDS = "torchtrace.comm.seconds"  # a rank's all-reduce time in the step
COMM_BUCKET = "torchtrace.comm.bucket"  # an all-reduce span's bucket index
COMM_BYTES = "torchtrace.comm.bytes"
COMM_LAST = "torchtrace.comm.last"
OPTIMIZER_CLOSURE_FORWARDS = "torchtrace.optimizer.closure_forwards"  # forwards a closure optimizer's step ran
OPTIMIZER_CALL_SECONDS = "torchtrace.optimizer.call_seconds"  # its whole step() call
DRIFT_SCORE = "torchtrace.drift.score"  # a call whose layer drifted from the baseline: its highest score (1 = alert)
DRIFT_STATISTIC = "torchtrace.drift.statistic"  # the statistic that score is of
DRIFT_FIRST = "torchtrace.drift.first"  # true on the forward's first drifted call (the earliest to finish)

# (key, value type, meaning): the span attribute table of docs/spans.md, generated from here at build time.
_OUT = f"{OUTPUT_PREFIX}[.<name>]"
SPAN_ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    (MODULE_PATH, "string", 'path from `named_modules()` (`""` for the model itself)'),
    (MODULE_TYPE, "string", "class name, e.g. `Linear`"),
    (f"{OUTPUT_PREFIX}.<stat>", "see below", "statistic of a module output that is a tensor"),
    (f"{OUTPUT_PREFIX}.<name>.<stat>", "", "statistic of a tensor inside the output (see naming)"),
    (
        f"{OUTPUT_PREFIX}.truncated",
        "bool",
        "more than `Stats(max_tensors=)` tensors in the output; the first ones are summarised",
    ),
    (
        f"{_OUT}.stats_error",
        "string",
        "a statistic failed (with a name; a `Stats(extra=)` function's error starts with its key, `p99: RuntimeError: "
        "...`), or one of your functions / a capture failed on this call (without); everything else on the span is "
        "intact",
    ),
    (
        f"{_OUT}.sampled",
        "int",
        "with `Stats(sample=N)`, on a tensor larger than N: the statistics are of this many evenly spaced elements",
    ),
    (
        f"{INPUT_PREFIX}.<name>.<stat>",
        "",
        "with `Stats(inputs=True)`: positional inputs by index (`0`), keyword inputs by name",
    ),
    (
        f"{MODULE_ATTRIBUTE_PREFIX}.<attr>",
        "",
        "with `Records(module_attributes=)`: the attribute's value after the call",
    ),
    (f"{_OUT}.<extra>", "number", 'a user statistic from `Stats(extra={"<extra>": fn})`'),
    (
        f"{GRAD_OUTPUT_PREFIX}.<name>.<stat>",
        "",
        "backward spans: gradient reaching the output named as in the forward (`0` for a bare tensor; `mean`, "
        "`abs_max`, `norm`, `nan_count`, `inf_count`); absent for an output that got none",
    ),
    (
        f"{GRAD_INPUT_PREFIX}.<i>.<stat>",
        "",
        "backward spans: gradient leaving for input `i` (or parameter `i` for a first layer)",
    ),
    (
        PARAM_NORM,
        "double",
        "backward spans with `Training(param_stats=True)`: joint L2 norm of the module's own parameters",
    ),
    (PARAM_GRAD_NORM, "double", "the same spans: joint L2 norm of their gradients"),
    (STEP, "int", "`train_step` (and `rank N`) spans: the step number, from 0"),
    (RANK, "int", "DDP: on `rank N` spans (and a resource attribute)"),
    (WORLD_SIZE, "int", "DDP: on the shared `train_step` root (and a resource attribute)"),
    (LOCAL_RANK, "int", "resource attribute: the rank on its node"),
    (
        RANK_DETAIL,
        "string",
        'DDP with `Training(rank_detail="auto")`, on `rank N`: why this rank sent its module spans of the step '
        "(`rank`, `straggler`, `nonfinite`, `raised`, comma-separated), or `none`: its step and phase spans only",
    ),
    (COMM_SECONDS, "double", "DDP: the rank's all-reduce wait in the step (on `rank N`)"),
    (COMM_BUCKET, "int", "DDP: on `allreduce bucket <i>` spans, the bucket's index"),
    (COMM_BYTES, "int", "DDP: on `allreduce bucket <i>` spans, its size"),
    (COMM_LAST, "bool", "DDP: on `allreduce bucket <i>` spans, whether it is the step's last bucket"),
    (OPTIMIZER_CLOSURE_FORWARDS, "int", "on an optimizer step span: the forwards its closure ran (LBFGS)"),
    (OPTIMIZER_CALL_SECONDS, "double", "on an optimizer step span: the whole `step()` call"),
    (
        DRIFT_SCORE,
        "double",
        "with a baseline, on a call whose layer is over the drift threshold: its highest drift score (1.0 is the "
        "alert threshold; see Drift)",
    ),
    (DRIFT_STATISTIC, "string", "the statistic of that score (`mean`, `std`, `abs_max`, `zero_fraction`)"),
    (
        DRIFT_FIRST,
        "bool",
        "`true` on the forward's first drifted call: of those over the threshold, the earliest to finish",
    ),
)

_NON_STAT_KEYS = ("truncated", "stats_error")


def main_output_prefix(attributes: Mapping[str, Any]) -> str:
    """Attribute prefix of a call's main output: the output itself when it is a tensor, else its first tensor.

    Follows the span attribute naming: ``torchtrace.output.<stat>`` for a bare tensor, ``torchtrace.output.
    <name>.<stat>`` inside containers, in the order the tensors were found.
    """
    if f"{OUTPUT_PREFIX}.dtype" in attributes:
        return OUTPUT_PREFIX
    start = len(OUTPUT_PREFIX) + 1
    for key in attributes:
        if key.startswith(OUTPUT_PREFIX + ".") and key.endswith(".dtype"):
            return key[: -len(".dtype")]
    for key in attributes:  # statistics chosen without dtype: the first tensor-named statistic
        rest = key[start:] if key.startswith(OUTPUT_PREFIX + ".") else ""
        if "." in rest and rest.rsplit(".", 1)[1] not in _NON_STAT_KEYS:
            return key.rsplit(".", 1)[0]
    return OUTPUT_PREFIX
