"""The project's shared vocabulary: every name that more than one module spells.

Graph metadata, collective op types and optimizer-state names are written into ONNX
files and read back by other passes, the runtime and other tools. Each is defined here
once, as an Enum (or a constant) whose ``.value`` is the exact string on disk, so files
written before and after stay compatible and a typo is an ``AttributeError``, not a
silently unmatched string.
"""

from __future__ import annotations

import enum

import onnx_ir as ir

ROLE_KEY = "tensoropt.role"  # node metadata: which part of the training step made the node
UNIT_KEY = "tensoropt.unit"  # node metadata: the forward node (plan unit) it belongs to
PARAM_KEY = "tensoropt.param"  # optimizer node metadata: the parameter it updates
# conversion node metadata: the phase ("forward", "backward") of the reads a ZeRO-3
# parameter's all-gather serves; the runtime runs it just before them
ZERO_GATHER_KEY = "tensoropt.zero_gather"
# initializer metadata: a constant the importer made (ir/canonical.py), not one of the
# file's; what the user is told about the file's initializers leaves it out
MADE_KEY = "tensoropt.made"

COLLECTIVE_DOMAIN = "ai.tensoropt"  # the ONNX domain of collectives and conversions


class Role(enum.Enum):
    """The part of a training step that made a node (metadata ``tensoropt.role``)."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    REDISTRIBUTION = "redistribution"
    PIPELINE = "pipeline"  # Send/Recv between pipeline stages


def role_of(node: ir.Node) -> Role | None:
    """The node's role, or None when it carries no (or an unknown) role tag."""
    value = node.metadata_props.get(ROLE_KEY)
    try:
        return Role(value)
    except ValueError:
        return None


class CollectiveKind(enum.Enum):
    """What one redistribution step does along one mesh axis.

    The value is the op type of the node in the ``ai.tensoropt`` domain: the four
    communicating kinds stay in device graphs (the runtime executes them); the two
    local kinds exist in the rank-independent template only and are lowered per rank
    (``ShardSlice`` to a ``Slice``, ``ZeroUnlessFirst`` to an ``Identity`` or a zero).
    """

    ALL_REDUCE = "AllReduce"
    ALL_GATHER = "AllGather"
    REDUCE_SCATTER = "ReduceScatter"
    ALL_TO_ALL = "AllToAll"
    LOCAL_SLICE = "ShardSlice"
    LOCAL_ZERO = "ZeroUnlessFirst"

    @property
    def communicates(self) -> bool:
        return self not in (CollectiveKind.LOCAL_SLICE, CollectiveKind.LOCAL_ZERO)


COMMUNICATING_KINDS = tuple(k for k in CollectiveKind if k.communicates)


class OptimizerState(enum.Enum):
    """Suffix of an optimizer-state tensor's name after its parameter's name."""

    MOMENTUM = "__mom"  # SGD with momentum: the velocity
    ADAM_M = "__m"  # Adam: first moment
    ADAM_V = "__v"  # Adam: second moment

    def of(self, param: str) -> str:
        """The state tensor's name for parameter ``param``."""
        return f"{param}{self.value}"


class MegatronSplit(enum.Enum):
    """How a Megatron-LM block splits one weight MatMul over the tensor-parallel axis."""

    COLUMN = "column"  # the weight's output dim: each rank computes some output features
    ROW = "row"  # the weight's input dim: each rank holds a partial sum of the output
