"""Activation recomputation: blocks of the forward, found by structure, and their clones.

A *block* is a region of the forward between two *cuts*. A cut is a forward value that
every path from the primary data input to the loss passes through: after the node that
makes it, it is the only live value of the stream (values that depend on the primary data
input; side values such as a processed attention mask or position embeddings may stay
live across a cut). Cuts are coarsened to layer boundaries: a cut is kept when it is made
by a join of two forward values (a residual Add, a Concat), when it feeds a contraction
with a weight (a MatMul, Gemm or Conv reading an initializer: an MLP layer boundary), or
when the loss reads it (the last cut); a block of one node (a Relu or a norm right after a
residual join) is merged into the next. A GPT layer gives two blocks (attention half and
MLP half around the residual stream), a residual network one block per residual block, a
plain MLP one block per weight layer. Blocks are named ``block_<i>`` in forward order.

Recomputing a block (:func:`apply_recompute`, the ``recompute`` pass): only the block's
input is kept for the backward. The block's forward nodes whose outputs the backward
reads, and the block nodes they need, are cloned; the backward reads the clones. The
clones are nodes of the same units as their originals (``tensoropt.unit``), role
``backward``, and take their originals' strategies (``units``), so the partitioner
shards them alike and their conversions are the forward's again.

The clones read the block input through ``Where(IsNaN(ReduceSum(g)), x, x)``, where
``g`` is the gradient that reaches the block's output, summed per sample when ``x`` and
``g`` share the batch dim: the same values as ``x`` (both branches are ``x``), but a data
dependency on the backward. Without it onnxruntime runs a
clone as soon as its inputs exist (in the forward, which saves nothing) and its common
subexpression elimination merges the clone with its original.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.errors import PlanError
from tensoropt.ir.builder import ROLE_KEY, UNIT_KEY, static_shape
from tensoropt.ir.vocab import Role
from tensoropt.passes.autodiff import grad_of

RECOMPUTE_KEY = "tensoropt.recompute"  # node metadata: the block this recompute node serves
# clone node metadata: the forward node it reruns; clone value metadata: the forward value
RECOMPUTE_OF_KEY = "tensoropt.recompute_of"
APPLIED_KEY = "tensoropt.recomputed_blocks"  # model metadata: JSON list of the blocks

_CONTRACTIONS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
# Ops that draw random numbers: a rerun draws different ones.
_RANDOM = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli"}
)


@dataclass(frozen=True, slots=True)
class Block:
    """One recomputable region of the forward.

    ``input``: the value kept for the backward (a cut, or the primary data input);
    ``output``: the cut that ends the block (the next block's input); ``nodes``: the
    forward nodes the block covers, in graph order."""

    name: str
    input: str
    output: str
    nodes: tuple[str, ...]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "input": self.input,
            "output": self.output,
            "nodes": list(self.nodes),
        }


def _role(node: ir.Node) -> str:
    return node.metadata_props.get(ROLE_KEY, Role.FORWARD.value)


def _forward_order(graph: ir.Graph) -> list[ir.Node]:
    """Forward and loss nodes in graph order, forward Constants left out."""
    roles = (Role.FORWARD.value, Role.LOSS.value)
    return [n for n in graph if _role(n) in roles and n.op_type != "Constant"]


def _made(value: ir.Value) -> bool:
    """True for a value made by a node other than a Constant."""
    producer = value.producer()
    return producer is not None and producer.op_type != "Constant"


def find_blocks(graph: ir.Graph, data_inputs: Sequence[str]) -> tuple[Block, ...]:
    """The blocks of a training step's forward (see the module doc), in forward order.

    ``data_inputs``: the step's data inputs; the first is the primary one."""
    order = _forward_order(graph)
    primary = next((v for v in graph.inputs if data_inputs and v.name == data_inputs[0]), None)
    if primary is None or not order:
        return ()
    position = {node: i for i, node in enumerate(order)}
    stream: set[ir.Value] = {primary}
    for node in order:
        if any(v in stream for v in node.inputs if v is not None):
            stream.update(node.outputs)
    last_use: dict[ir.Value, int] = {}
    for value in stream:
        uses = [position[u.node] for u in value.uses() if u.node in position]
        last_use[value] = max(uses, default=-2)
    cuts = _cuts(order, stream, primary, last_use)
    kept = [c for c in cuts if _keep(c, position, order)]
    blocks = []
    start, start_pos = primary, -1
    for i, cut in enumerate(kept):
        end_pos = position[cut.producer()]  # type: ignore[index]
        nodes = tuple(
            n.name
            for n in order[start_pos + 1 : end_pos + 1]
            if _role(n) == Role.FORWARD.value and any(v in stream for v in n.outputs)
        )
        if len(nodes) < 2 and i < len(kept) - 1:
            continue  # one node (a Relu or norm after a residual join) joins the next block
        if nodes:
            name = f"block_{len(blocks)}"
            blocks.append(Block(name, start.name, cut.name, nodes))  # type: ignore[arg-type]
        start, start_pos = cut, end_pos
    return tuple(blocks)


def _cuts(order, stream, primary, last_use) -> list[ir.Value]:
    """Stream values that are the only live stream value right after their producer."""
    live: set[ir.Value] = {primary} if last_use[primary] >= 0 else set()
    ending: dict[int, list[ir.Value]] = {}
    if live:
        ending.setdefault(last_use[primary], []).append(primary)
    cuts = []
    for i, node in enumerate(order):
        if _role(node) != Role.FORWARD.value:
            break  # the loss: no cut inside it
        for value in ending.pop(i, ()):
            live.discard(value)
        for value in node.outputs:
            if value in stream and last_use[value] > i:
                live.add(value)
                ending.setdefault(last_use[value], []).append(value)
        if len(live) == 1:
            (only,) = live
            if only.producer() is node:
                cuts.append(only)
    return cuts


def _keep(cut: ir.Value, position: dict, order: list[ir.Node]) -> bool:
    """A cut at a layer boundary: a join, the input of a weight contraction, or the
    value the loss reads."""
    producer = cut.producer()
    assert producer is not None
    if len({id(v) for v in producer.inputs if v is not None and _made(v)}) >= 2:
        return True
    for use in cut.uses():
        node = use.node
        if node not in position:
            continue
        if _role(node) == Role.LOSS.value:
            return True
        if node.op_type in _CONTRACTIONS and any(
            v is not None and v is not cut and v.producer() is None for v in node.inputs
        ):
            return True
    return False


def select_blocks(blocks: Sequence[Block], spec: str) -> tuple[str, ...]:
    """``--recompute all|none|REGEX``: the names of the chosen blocks.

    A REGEX must match (``re.fullmatch``) a block's name or the name of a node it covers;
    matching none is an error that names the blocks there are."""
    if spec == "none":
        return ()
    if spec == "all":
        chosen = list(blocks)
    else:
        try:
            pattern = re.compile(spec)
        except re.error as exc:
            raise PlanError(f"--recompute {spec!r}: not a regular expression ({exc})") from None
        chosen = [
            b
            for b in blocks
            if pattern.fullmatch(b.name) or any(pattern.fullmatch(n) for n in b.nodes)
        ]
    if not chosen:
        raise PlanError(
            f"--recompute {spec!r}: matches no block of the model ({_available(blocks)}); "
            "give all, none, or a regular expression of block or node names (`tensoropt "
            "inspect OUTDIR --json` of a --recompute all compile lists each block's nodes)"
        )
    return tuple(b.name for b in chosen)


def _available(blocks: Sequence[Block]) -> str:
    if not blocks:
        return "it has none"
    return f"blocks block_0..block_{len(blocks) - 1}"


def apply_recompute(model: ir.Model, data_inputs: Sequence[str], names: Iterable[str]) -> int:
    """Recompute the named blocks of the training step ``model`` (mutated in place).

    Applying the same names again changes nothing (compile prices the step before it
    partitions it); returns the number of nodes added."""
    names = tuple(names)
    applied = model.metadata_props.get(APPLIED_KEY)
    if applied is not None:
        if tuple(json.loads(applied)) != names:
            raise AssertionError(f"the step already recomputes {applied}, not {list(names)}")
        return 0
    if not names:
        return 0
    graph = model.graph
    blocks = {b.name: b for b in find_blocks(graph, data_inputs)}
    unknown = [n for n in names if n not in blocks]
    if unknown:
        raise PlanError(
            f"plan recompute: no block {unknown[0]!r} in this model "
            f"({_available(list(blocks.values()))}); list blocks that `tensoropt inspect` shows"
        )
    step = _StepIndex(graph)
    added = sum(_recompute(graph, blocks[name], step) for name in names)
    model.metadata_props[APPLIED_KEY] = json.dumps(list(names))
    return added


class _StepIndex:
    """The step's nodes by name, their order, its values by name and each value's total
    gradient (the last backward value made as its gradient), found in one walk before any
    block is recomputed. What recomputing a block adds (clones, tagged recompute, and
    their dependency) is none of these for another block: its nodes are not the block's,
    it makes no gradient, and inserting it keeps the other nodes' relative order."""

    def __init__(self, graph: ir.Graph) -> None:
        self.nodes: dict[str, ir.Node] = {}
        self.order: dict[ir.Node, int] = {}
        self.values: dict[str, ir.Value] = {}
        self.gradient: dict[str, ir.Value] = {}
        for v in graph.inputs:
            self.values.setdefault(v.name, v)
        backward = Role.BACKWARD.value
        for i, node in enumerate(graph):
            self.nodes.setdefault(node.name, node)
            self.order[node] = i
            is_backward = _role(node) == backward
            for v in node.outputs:
                self.values.setdefault(v.name, v)
                if is_backward:
                    for name in grad_of(v):
                        self.gradient[name] = v  # the last one made wins

    def value(self, name: str) -> ir.Value:
        found = self.values.get(name)
        if found is None:
            raise AssertionError(f"no value {name!r} in the step")
        return found

    def gradient_at(self, block: Block) -> ir.Value:
        """The total gradient of the block's output."""
        found = self.gradient.get(block.output)
        if found is None:
            raise PlanError(
                f"{block.name}: no gradient reaches its output {block.output!r}, so there is "
                "nothing to recompute it for; leave it out of --recompute"
            )
        return found


def _recompute(graph: ir.Graph, block: Block, step: _StepIndex) -> int:
    members = [step.nodes[name] for name in block.nodes]
    member_set = set(members)
    backward = Role.BACKWARD.value
    # values of the block the backward reads (the block's output stays: the next block's
    # input, kept anyway)
    read = [
        v
        for n in members
        for v in n.outputs
        if v.name != block.output and any(_role(u.node) == backward for u in v.uses())
    ]
    if not read:
        return 0
    needed = _ancestors(read, member_set)
    clones_of = [n for n in members if n in needed]
    _refuse_random(block, clones_of)
    source = step.value(block.input)
    grad = step.gradient_at(block)
    readers = [
        u.node for v in read for u in v.uses() if _role(u.node) == backward and u.node not in needed
    ]
    order = step.order
    if any(r not in order for r in readers):  # a node another block's recomputation made
        order = {n: i for i, n in enumerate(graph)}
    first = min(readers, key=order.__getitem__)
    if order[grad.producer()] >= order[first]:  # type: ignore[index]
        raise PlanError(
            f"{block.name}: its backward starts before the gradient at its output "
            f"{block.output!r} is complete; recompute another block"
        )
    made: list[ir.Node] = []
    # the dependency sits in the unit that makes the gradient: it reads it as held there
    unit = grad.producer().metadata_props.get(UNIT_KEY, "")  # type: ignore[union-attr]
    dep = _dependency(source, grad, block, unit, made)
    clone: dict[ir.Value, ir.Value] = {source: dep}
    for node in clones_of:
        copy = _clone(node, clone, block.name)
        made.append(copy)
        for old, new in zip(node.outputs, copy.outputs, strict=True):
            clone[old] = new
    graph.insert_before(first, made)
    for v in read:
        for use in list(v.uses()):
            if _role(use.node) == backward and RECOMPUTE_KEY not in use.node.metadata_props:
                use.node.replace_input_with(use.idx, clone[v])
    return len(made)


def _ancestors(values: Iterable[ir.Value], members: set[ir.Node]) -> set[ir.Node]:
    needed: set[ir.Node] = set()
    stack = [v.producer() for v in values]
    while stack:
        node = stack.pop()
        if node is None or node in needed or node not in members:
            continue
        needed.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None)
    return needed


def _refuse_random(block: Block, nodes: Iterable[ir.Node]) -> None:
    for node in nodes:
        random = node.op_type in _RANDOM or (node.op_type == "Dropout" and _active(node))
        if random:
            raise PlanError(
                f"{block.name}: node {node.name!r} ({node.op_type}) draws random numbers, "
                "which a recompute would draw again differently; leave this block out of "
                "--recompute or give the model dropout 0"
            )


def _active(node: ir.Node) -> bool:
    """True for a Dropout that drops: training mode (input 2, default off) that is not a
    constant false, and a ratio (input 1, default 0.5) that is not a constant 0."""
    mode_in = node.inputs[2] if len(node.inputs) > 2 else None
    ratio_in = node.inputs[1] if len(node.inputs) > 1 else None
    if mode_in is None:
        return False
    mode = _constant(mode_in)
    ratio = _constant(ratio_in)
    training = mode is None or bool(mode.any())
    dropping = ratio_in is None or ratio is None or bool(ratio.any())
    return training and dropping


def _constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def _tags(block: str, unit: str) -> dict[str, str]:
    return {ROLE_KEY: Role.BACKWARD.value, UNIT_KEY: unit, RECOMPUTE_KEY: block}


def _dependency(
    source: ir.Value, grad: ir.Value, block: Block, unit: str, made: list[ir.Node]
) -> ir.Value:
    """``Where(IsNaN(sum(grad)), source, source)``: ``source``, after ``grad``.

    When the two share dim 0 (the batch) the sum keeps it and the condition broadcasts
    per sample, so a batch-split gradient needs no collective. A gradient whose dim 0 is
    a multiple of the batch (a loss over the samples' positions flattened together,
    ``logits.reshape(-1, V)``) is viewed as ``[batch, rest, ...]`` first, so the same
    holds. A source whose dim 0 is a multiple of the gradient's (OPT's layers hold their
    hidden states as ``[B * T, C]`` while the gradient at the block output is
    ``[B, T, C]``) takes the condition of each gradient row repeated over its rows.
    Otherwise the sum is a scalar (a partial sum under a batch split: a collective, and
    one over the micro-batches that micro-batching cannot run)."""
    stem = f"{block.name}__after"
    gshape, sshape = static_shape(grad), static_shape(source)
    batch = sshape[0] if sshape else 0
    lead = gshape[0] if gshape else 0
    grouped = lead > 0 and batch > 0 and lead != batch and lead % batch == 0
    spread = lead > 0 and batch > 0 and lead != batch and batch % lead == 0
    per_sample = bool(sshape) and (lead == batch or grouped or spread) and lead > 0
    value = grad
    if grouped:
        gshape = (batch, gshape[0] // batch, *gshape[1:])
        shape_node = _ints(f"{stem}_groups", list(gshape), block.name)
        view = _node(
            "Reshape",
            [grad, shape_node.outputs[0]],
            f"{stem}_per_sample_view",
            grad.dtype,
            list(gshape),
            block,
            unit,
        )
        made.extend((shape_node, view))
        value = view.outputs[0]
    axes = list(range(1 if per_sample else 0, len(gshape)))
    kept = [gshape[0]] if per_sample else []
    if axes:
        axes_node = _ints(f"{stem}_axes", axes, block.name)
        total = _node(
            "ReduceSum", [value, axes_node.outputs[0]], f"{stem}_sum", grad.dtype, kept, block, unit
        )
        total.attributes["keepdims"] = ir.AttrInt64("keepdims", 0)
        made.extend((axes_node, total))
        value = total.outputs[0]
    cond = _node("IsNaN", [value], f"{stem}_nan", ir.DataType.BOOL, kept, block, unit)
    made.append(cond)
    if spread:  # [lead] -> [lead, batch / lead] -> [batch]: each row's flag over its rows
        repeat = [lead, batch // lead]
        one = _ints(f"{stem}_one", [1], block.name)
        column = _node(
            "Unsqueeze", [cond.outputs[0], one.outputs[0]], f"{stem}_column",
            ir.DataType.BOOL, [lead, 1], block, unit,
        )  # fmt: skip
        wide = _ints(f"{stem}_repeat", repeat, block.name)
        spread_out = _node(
            "Expand", [column.outputs[0], wide.outputs[0]], f"{stem}_repeated",
            ir.DataType.BOOL, repeat, block, unit,
        )  # fmt: skip
        flat = _ints(f"{stem}_rows", [batch], block.name)
        cond = _node(
            "Reshape", [spread_out.outputs[0], flat.outputs[0]], f"{stem}_per_row",
            ir.DataType.BOOL, [batch], block, unit,
        )  # fmt: skip
        made.extend((one, column, wide, spread_out, flat, cond))
    if per_sample and len(sshape) > 1:
        rest = list(range(1, len(sshape)))
        rest_node = _ints(f"{stem}_rest", rest, block.name)
        cond = _node(
            "Unsqueeze",
            [cond.outputs[0], rest_node.outputs[0]],
            f"{stem}_per_sample",
            ir.DataType.BOOL,
            [sshape[0]] + [1] * len(rest),
            block,
            unit,
        )
        made.extend((rest_node, cond))
    where = _node(
        "Where",
        [cond.outputs[0], source, source],
        f"{stem}_where",
        source.dtype,
        list(sshape),
        block,
        unit,
    )
    if source.name:
        where.outputs[0].metadata_props[RECOMPUTE_OF_KEY] = source.name
    made.append(where)
    return where.outputs[0]


def _ints(name: str, values: list[int], block: str) -> ir.Node:
    """A Constant node of int64 ``values`` (nodes of no unit are replicated)."""
    out = ir.Value(name=name)
    out.dtype = ir.DataType.INT64
    out.shape = ir.Shape([len(values)])
    tensor = ir.tensor(np.asarray(values, dtype=np.int64), name=name)
    return ir.Node(
        "",
        "Constant",
        [],
        [ir.AttrTensor("value", tensor)],
        outputs=[out],
        name=name,
        metadata_props={ROLE_KEY: Role.BACKWARD.value, RECOMPUTE_KEY: block},
    )


def _node(op, inputs, name, dtype, shape, block: Block, unit: str) -> ir.Node:
    out = ir.Value(name=f"{name}_o0")
    out.dtype = dtype
    if shape is not None:
        out.shape = ir.Shape(shape)
    return ir.Node("", op, inputs, outputs=[out], name=name, metadata_props=_tags(block.name, unit))


def _clone(node: ir.Node, clone: dict[ir.Value, ir.Value], block: str) -> ir.Node:
    """A copy of forward ``node`` reading the clones of its inputs where there are any."""
    inputs = [None if v is None else clone.get(v, v) for v in node.inputs]
    outputs = []
    for v in node.outputs:
        out = ir.Value(name=f"{v.name}__rc" if v.name else None)
        out.dtype = v.dtype
        out.shape = v.shape.copy() if v.shape is not None else None
        if v.name:
            out.metadata_props[RECOMPUTE_OF_KEY] = v.name
        outputs.append(out)
    tags = _tags(block, node.name or "")  # a forward node names its own unit (units.by_name)
    tags[RECOMPUTE_OF_KEY] = node.name or ""
    return ir.Node(
        node.domain,
        node.op_type,
        inputs,
        list(node.attributes.values()),
        outputs=outputs,
        name=f"{node.name}__rc",
        overload=node.overload,
        version=node.version,
        metadata_props=tags,
    )
