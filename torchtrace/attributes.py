"""The names of the attributes torchtrace writes on spans and resources, for code that reads them.

OpenTelemetry's semantic conventions have nothing for layers or tensor statistics, so these are torchtrace's own,
under the ``torchtrace.`` namespace (docs/spans.md describes each). A tensor's statistics are ``<prefix>.<stat>``
for a bare tensor and ``<prefix>.<name>.<stat>`` for one inside a container::

    from torchtrace import attributes

    mean = span.attributes[f"{attributes.OUTPUT_PREFIX}.mean"]
    layer = span.attributes[attributes.MODULE_PATH]

torchtrace's own writers and readers import them from here; no name is spelled anywhere else in the package.
"""

from __future__ import annotations

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
COMM_SECONDS = "torchtrace.comm.seconds"  # a rank's all-reduce time in the step
COMM_BUCKET = "torchtrace.comm.bucket"  # an all-reduce span's bucket index
COMM_BYTES = "torchtrace.comm.bytes"
COMM_LAST = "torchtrace.comm.last"
OPTIMIZER_CLOSURE_FORWARDS = "torchtrace.optimizer.closure_forwards"  # forwards a closure optimizer's step ran
OPTIMIZER_CALL_SECONDS = "torchtrace.optimizer.call_seconds"  # its whole step() call
