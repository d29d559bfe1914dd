"""Megatron-LM blocks found by graph structure, and the forward rewrite that stacks their
column-parallel projections.

Recognition (used on the forward model and on the training step):

- an MLP block is a weight MatMul (A), a region of element-wise ops (bias Add,
  activation, dropout, ...) and of Split/Squeeze that leave the last dim alone, and a
  second weight MatMul (B) that is the region's only exit. A is column-parallel, B
  row-parallel. Weight MatMuls on A's own input whose outputs join the region are gate
  siblings (a gated MLP ``down(act(gate(x)) * up(x))``), column-parallel like A.
- an attention block is a weight MatMul (O) whose activation input comes, through
  attention ops only (Reshape, Transpose, activation MatMuls, Softmax, scale, mask,
  rotary products, ...), from weight MatMuls (Q, K, V, or one fused QKV). The
  projections are column-parallel, O is row-parallel, so heads split across tp.

A *weight MatMul* multiplies an activation by a trained 2-D weight, by its transpose
(``Transpose(W, [1, 0])``, from a ``Gemm`` with ``transB``), or by a *stacked* weight
``[k, C, D]`` that :func:`stack_projections` builds from trained weights.

The rewrite (:func:`stack_projections`, on the forward model before the training step
is built) makes each block's column-parallel side one MatMul, as Megatron-LM's fused
``ColumnParallelLinear`` is:

- Q, K and V (or gate and up) reading the same input become
  ``MatMul(Unsqueeze(x), Concat(Unsqueeze(Wq), Unsqueeze(Wk), Unsqueeze(Wv)))`` of shape
  ``[.., 3, T, D]``, split back into q, k and v. Their weights stay separate parameters.
  The block input is then read by one MatMul, so its gradient is one partial sum and
  the backward needs one all-reduce, not one per projection. Projections of different
  shapes (grouped-query attention's smaller K and V) stack by shape: Q alone, K and V
  together, two partial sums.
- a fused QKV weight ``W [C, 3D]`` whose output is split into three (``Split``) or
  reshaped to ``[.., 3, heads, head_dim]`` is trained as its ``[C, 3, D]`` view (the
  same bytes, row-major; its bias ``[3D]`` as ``[3, 1, D]``), multiplied as
  ``Transpose(W, [1, 0, 2])``. A column split of dim 2 of that view gives each rank
  the columns of the same heads of q, k and v: the per-device ``[q | k | v]`` blocks.
- weights an unoptimized export reads as torch stores them, ``Transpose(W [D, C])``,
  stack and view the same way through ``[k, D, C]`` and one ``Transpose(., [0, 2, 1])``.
- a packed in-projection ``W [3D, C]`` that a cross-attention takes apart into a q and a
  kv piece (``Split`` on dim 0, each piece transposed into its MatMul) is trained as its
  ``[3, D, C]`` view, each piece read as ``Transpose(Slice(view), [0, 2, 1])``: a
  stacked weight of one part (q) and of two (k, v).
An HF ``Conv1D`` projection (``Reshape -> Gemm -> Reshape``) and
``nn.MultiheadAttention``'s out projection (a ``Gemm`` with ``transB``) arrive as
MatMuls already: the importer unflattens them (``ir/canonical.unflatten_gemms``).

Every rewrite computes the same function with the same parameters (values and names),
so the step trains exactly as before; only a fused or packed QKV weight's shape changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.ir.builder import static_shape
from tensoropt.ir.vocab import ROLE_KEY, UNIT_KEY, Role, role_of

ELEMENTWISE = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Sqrt",
        "Neg",
        "Gelu",
        "Relu",
        "Tanh",
        "Sigmoid",
        "Erf",
        "Cast",
        "Dropout",
        "Identity",
        "LeakyRelu",
        "Exp",
    }
)
NONLINEAR = frozenset(
    {
        "Gelu",
        "Relu",
        "Tanh",
        "Sigmoid",
        "Erf",
        "LeakyRelu",
        "Exp",
        "Pow",
        "Sqrt",
        "Softplus",
        "Elu",
        "HardSigmoid",
        "HardSwish",
        "Mul",
        "Div",
    }
)
ATTENTION = ELEMENTWISE | frozenset(
    {
        "Reshape",
        "Transpose",
        "MatMul",
        "Softmax",
        "Where",
        "Split",
        "Slice",
        "Squeeze",
        "Unsqueeze",
        "Concat",
        "Expand",
        "Constant",
        "Einsum",
        # torch's scaled_dot_product_attention export zeroes the rows a mask leaves
        # empty: Where(IsNaN(softmax), 0, softmax)
        "IsNaN",
    }
)
# Ops that move a stacked projection's pieces apart without touching the feature dim.
_UNSTACK = frozenset({"Split", "Squeeze"})


def is_forward(node: ir.Node) -> bool:
    return role_of(node) is Role.FORWARD


def stacked_sources(b: ir.Value, params: set[str]) -> list[ir.Value] | None:
    """The trained weights a stacked ``[k, C, D]`` MatMul operand is built from, if it is one.

    Two forms (see the module doc): ``Transpose(W[C, k, D], perm=[1, 0, 2])`` and
    ``Concat(Unsqueeze(W_i, [0]), ..., axis=0)``; and the same of weights stored as torch
    keeps them, ``[D, C]`` (unoptimized exports): ``Transpose(W[k, D, C], perm=[0, 2,
    1])`` and ``Transpose(Concat(Unsqueeze(W_i [D, C], [0]), ...), perm=[0, 2, 1])``.
    """
    node = b.producer()
    if node is None or not is_forward(node) or len(static_shape(b)) != 3:
        return None
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        w = node.inputs[0]
        order = list(perm.value) if perm is not None else None
        if w is None or order not in ([1, 0, 2], [0, 2, 1]):
            return None
        if w.name in params:
            return [w]
        if order != [0, 2, 1]:
            return None
        sliced = _sliced_param(w, params)
        return [sliced] if sliced is not None else _concat_sources(w, params)
    return _concat_sources(b, params)


def _sliced_param(b: ir.Value, params: set[str]) -> ir.Value | None:
    """W when ``b`` is ``Slice(W [n, D, C], axis 0)``: a packed weight's piece, as
    :func:`stack_projections` views nn.MultiheadAttention's cross-attention."""
    node = b.producer()
    if node is None or node.op_type != "Slice" or not is_forward(node) or len(node.inputs) < 4:
        return None
    w, axes = node.inputs[0], node.inputs[3]
    if w is None or w.name not in params or len(static_shape(w)) != 3:
        return None
    if axes is None or axes.const_value is None or axes.const_value.numpy().tolist() != [0]:
        return None
    return w


def packed_piece(b: ir.Value, params: set[str]) -> tuple[ir.Value, ir.Node, int] | None:
    """(W, its Split, the piece's index) when a MatMul operand is ``Transpose(piece,
    [1, 0])`` of a piece of ``Split(W [N, C], axis 0)`` read by that MatMul alone in the
    forward: nn.MultiheadAttention's cross-attention takes its packed in-projection
    ``[3D, C]`` apart into a q ``[D, C]`` and a kv ``[2D, C]`` weight, read by the
    decoder and by the encoder's output."""
    node = b.producer()
    if node is None or node.op_type != "Transpose" or not is_forward(node):
        return None
    perm = node.attributes.get("perm")
    if perm is not None and list(perm.value) != [1, 0]:
        return None
    piece = node.inputs[0]
    split = piece.producer() if piece is not None else None
    if split is None or split.op_type != "Split" or not is_forward(split):
        return None
    w = split.inputs[0]
    if w is None or w.name not in params or len(static_shape(w)) != 2:
        return None
    if split.attributes.get_int("axis", 0) % 2 != 0 or len(piece.uses()) != 1:
        return None
    if sum(is_forward(u.node) for u in b.uses()) != 1:  # the backward reads it too
        return None
    return w, split, list(split.outputs).index(piece)


def _concat_sources(b: ir.Value, params: set[str]) -> list[ir.Value] | None:
    """The 2-D trained weights of ``Concat(Unsqueeze(W_i, [0]), ..., axis=0)``."""
    node = b.producer()
    if node is None or not is_forward(node) or node.op_type != "Concat":
        return None
    if node.attributes.get_int("axis", 0) != 0:
        return None
    out = []
    for v in node.inputs:
        u = v.producer() if v is not None else None
        if u is None or u.op_type != "Unsqueeze" or not is_forward(u):
            return None
        w = u.inputs[0]
        if w is None or w.name not in params or len(static_shape(w)) != 2:
            return None
        out.append(w)
    return out


def stored_transposed(b: ir.Value) -> bool:
    """Whether a stacked operand is built from weights stored ``[D, C]`` (the
    ``perm=[0, 2, 1]`` forms of :func:`stacked_sources`)."""
    node = b.producer()
    if node is None or node.op_type != "Transpose":
        return False
    perm = node.attributes.get("perm")
    return perm is not None and list(perm.value) == [0, 2, 1]


def transposed_source(b: ir.Value, params: set[str]) -> ir.Value | None:
    """The trained 2-D weight W when a MatMul operand is ``Transpose(W, [1, 0])`` read by
    that MatMul alone in the forward (a ``Gemm`` with ``transB``, as
    ``nn.MultiheadAttention`` exports its out projection, made MatMul at import)."""
    node = b.producer()
    if node is None or node.op_type != "Transpose" or not is_forward(node):
        return None
    w = node.inputs[0]
    perm = node.attributes.get("perm")
    if w is None or w.name not in params or len(static_shape(w)) != 2:
        return None
    if sum(is_forward(u.node) for u in b.uses()) != 1:  # the backward reads it too
        return None
    return w if perm is None or list(perm.value) == [1, 0] else None


def weight_matmuls(graph: ir.Graph, params: set[str]) -> list[ir.Node]:
    """Forward MatMuls by a trained 2-D weight (or its transpose) or a stacked weight, in
    graph order."""
    out = []
    for node in graph:
        if not is_forward(node) or node.op_type != "MatMul":
            continue
        w = node.inputs[1]
        if w is None:
            continue
        if (
            (w.name in params and len(static_shape(w)) == 2)
            or stacked_sources(w, params)
            or transposed_source(w, params)
            or packed_piece(w, params)
        ):
            out.append(node)
    return out


def batch_dims(graph: ir.Graph, inputs: Sequence[str]) -> dict[ir.Value, int]:
    """The batch dimension of each forward value that one can be followed to from the
    data ``inputs`` (their dimension 0): through Transpose and Reshape (the batch keeps
    its size and what precedes it), Gather, Squeeze/Unsqueeze, MatMul, and ops that keep
    or right-align their input's dimensions. Seq-first blocks (``nn.MultiheadAttention``
    transposes [B, T, C] to [T, B, C]) hold the batch in dimension 1, and a data-parallel
    split of dimension 0 there would split the sequence. Values not followed are left
    out (callers take dimension 0)."""
    dims: dict[ir.Value, int] = {
        v: 0 for v in graph.inputs if v.name in set(inputs) and v.shape is not None and len(v.shape)
    }
    for node in graph:
        if role_of(node) is not Role.FORWARD:
            continue
        found = next(
            ((i, dims[v]) for i, v in enumerate(node.inputs) if v is not None and v in dims), None
        )
        if found is None:
            continue
        for out in node.outputs:
            d = _batch_dim_after(node, *found, out)
            if d is not None:
                dims[out] = d
    return dims


def _batch_dim_after(node: ir.Node, i: int, d: int, out: ir.Value) -> int | None:
    src = static_shape(node.inputs[i])
    dst = static_shape(out)
    size = src[d]
    op = node.op_type
    found: int | None
    if op == "Transpose":
        perm = node.attributes.get("perm")
        order = list(perm.value) if perm is not None else list(range(len(src)))[::-1]
        found = order.index(d)
    elif op == "Reshape":
        before = math.prod(src[:d])
        found = next(
            (j for j in range(len(dst)) if math.prod(dst[:j]) == before and dst[j] == size), None
        )
    elif op == "Gather" and i == 1:  # the indices carry the batch
        found = d + node.attributes.get_int("axis", 0) % max(len(static_shape(node.inputs[0])), 1)
    elif op == "MatMul" and d == len(src) - (2 if i == 1 else 1):
        found = None  # contracted
    elif len(dst) == len(src):
        found = d
    else:  # broadcast, squeezed or unsqueezed leading dims: right-aligned
        found = len(dst) - (len(src) - d)
    if found is None or not 0 <= found < len(dst) or dst[found] != size:
        return None
    return found


def is_stacked(node: ir.Node) -> bool:
    """A weight MatMul whose weight is a stacked ``[k, C, D]`` (rank 3)."""
    w = node.inputs[1]
    return w is not None and len(static_shape(w)) == 3


def is_const(value: ir.Value, params: set[str]) -> bool:
    if value.const_value is not None or value.name in params:
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


def _keeps_last_dim(node: ir.Node) -> bool:
    """A Split or Squeeze that leaves its input's last dim whole (a stacked piece)."""
    rank = len(static_shape(node.inputs[0]))
    if node.op_type == "Split":
        axis = node.attributes.get_int("axis", 0)
        return axis % rank != rank - 1
    axes = node.inputs[1] if len(node.inputs) > 1 else None
    if axes is None or axes.const_value is None:
        return False
    return all(int(a) % rank != rank - 1 for a in axes.const_value.numpy().reshape(-1))


def mlp_partner(
    a: ir.Node, weights: set[ir.Node], params: set[str]
) -> tuple[ir.Node, list[ir.Node]] | None:
    """The row-parallel MatMul that closes an MLP block opened by ``a``, and the gate
    siblings (module doc), if any."""
    region: set[ir.Node] = set()
    frontier = [a.outputs[0]]
    exit_node = None
    while frontier:
        value = frontier.pop()
        for use in value.uses():
            node = use.node
            if not is_forward(node):
                continue
            if node in weights and use.idx == 0 and not is_stacked(node):
                if exit_node not in (None, node):
                    return None
                exit_node = node
                continue
            if node.op_type in _UNSTACK and use.idx == 0 and _keeps_last_dim(node):
                pass
            elif node.op_type not in ELEMENTWISE:
                return None
            if node not in region:
                region.add(node)
                frontier.extend(node.outputs)
    if exit_node is None or not any(n.op_type in NONLINEAR for n in region):
        # Two weight MatMuls joined by nothing (or only a bias) are not an MLP block:
        # pairing them would take a MatMul away from the block that follows.
        return None
    siblings: list[ir.Node] = []
    for node in region:
        for v in node.inputs:
            if v is None or v is a.outputs[0] or v.producer() in region:
                continue
            sibling = v.producer()
            if sibling in weights and sibling.inputs[0] is a.inputs[0] and sibling is not a:
                if sibling not in siblings:
                    siblings.append(sibling)
                continue
            if not is_const(v, params):
                return None
    return exit_node, siblings


def param_dependent(graph: ir.Graph, params: set[str]) -> set[ir.Value]:
    """Values computed from some parameter; the others come from data inputs and
    constants only (attention masks built from an ``attention_mask`` input)."""
    dependent = {v for v in graph.initializers.values() if v.name in params}
    dependent |= {v for v in graph.inputs if v.name in params}
    for node in graph:  # topological order
        if any(v is not None and v in dependent for v in node.inputs):
            dependent.update(node.outputs)
    return dependent


def data_dependent(graph: ir.Graph, params: set[str]) -> set[ir.Value]:
    """Values computed from some data input (a graph input that is no parameter)."""
    dependent = {v for v in graph.inputs if v.name not in params}
    for node in graph:  # topological order
        if any(v is not None and v in dependent for v in node.inputs):
            dependent.update(node.outputs)
    return dependent


def attention_sources(
    o: ir.Node,
    weights: set[ir.Node],
    params: set[str],
    dependent: set[ir.Value],
    data: set[ir.Value] | None = None,
) -> list[ir.Node] | None:
    """The projection MatMuls feeding ``o`` through attention ops only, if that holds.
    Values of parameters alone (``data``: the values that depend on a data input) are
    read like constants: a relative position bias gathered from its table at constant
    buckets, which an optimized export folds into one."""
    sources: list[ir.Node] = []
    seen: set[ir.Node] = set()
    stack = [o.inputs[0]]
    saw_softmax = False
    while stack:
        value = stack.pop()
        if value is None or is_const(value, params) or value not in dependent:
            continue
        if data is not None and value not in data:
            continue
        node = value.producer()
        if node is None or not is_forward(node):
            return None
        if node in weights:
            if node not in sources:
                sources.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        if node.op_type not in ATTENTION:
            return None
        saw_softmax |= node.op_type == "Softmax"
        stack.extend(node.inputs)
    return sources if saw_softmax and sources else None


@dataclass(frozen=True, slots=True)
class Blocks:
    """Column- and row-parallel MatMuls of the blocks found, and the fused QKV left over."""

    mlp: tuple[tuple[tuple[ir.Node, ...], ir.Node], ...]  # (column side, row)
    attention: tuple[tuple[tuple[ir.Node, ...], ir.Node], ...]
    fused: tuple[tuple[ir.Node, ir.Node], ...]  # (unstacked fused QKV, output projection)


def find_blocks(graph: ir.Graph, params: set[str]) -> Blocks:
    """Every MLP and attention block (module doc); a MatMul joins at most one block."""
    weights = weight_matmuls(graph, params)
    weight_set = set(weights)
    taken: set[ir.Node] = set()
    mlp = []
    for a in weights:
        found = mlp_partner(a, weight_set, params)
        if found is None:
            continue
        b, siblings = found
        if not any(n in taken for n in (a, b, *siblings)):
            taken.update((a, b, *siblings))
            mlp.append(((a, *siblings), b))
    attention = []
    fused = []
    dependent = param_dependent(graph, params)
    data = data_dependent(graph, params)
    for o in weights:
        if o in taken or is_stacked(o):
            continue
        sources = attention_sources(o, weight_set, params, dependent, data)
        if not sources or any(s in taken for s in sources):
            continue
        if len(sources) == 1 and not is_stacked(sources[0]):
            # One 2-D projection makes Q, K and V: a column split would give each rank a
            # slice of [Q | K | V], not whole heads (stack_projections views it instead).
            fused.append((sources[0], o))
            continue
        packed = [s for s in sources if packed_piece(s.inputs[1], params) is not None]
        if packed:  # pieces of one packed weight (q; k and v), likewise until viewed
            fused.append((packed[0], o))
            continue
        taken.update((*sources, o))
        attention.append((tuple(sources), o))
    return Blocks(tuple(mlp), tuple(attention), tuple(fused))


# -- the forward rewrite ----------------------------------------------------------------


class _Emitter:
    """Inserts named, forward-tagged nodes before an anchor node."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.names = {n.name for n in graph} | {v.name for v in graph.initializers.values()}
        self.count = 0

    def fresh(self, stem: str) -> str:
        while True:
            self.count += 1
            name = f"megatron_{stem}_{self.count}"
            if name not in self.names:
                self.names.add(name)
                return name

    def node(
        self,
        anchor: ir.Node,
        op: str,
        inputs: list[ir.Value | None],
        shapes: list[tuple[int, ...]],
        dtype: ir.DataType,
        attrs: dict | None = None,
    ) -> list[ir.Value]:
        name = self.fresh(op)
        attributes = [ir.convenience.convert_attribute(k, v) for k, v in (attrs or {}).items()]
        outputs = [ir.Value(name=f"{name}_o{i}") for i in range(len(shapes))]
        node = ir.Node(
            "",
            op,
            inputs,
            attributes,
            outputs=outputs,
            name=name,
            metadata_props={ROLE_KEY: Role.FORWARD.value, UNIT_KEY: name},
        )
        for value, shape in zip(outputs, shapes, strict=True):
            value.shape = ir.Shape(list(shape))
            value.dtype = dtype
        self.graph.insert_before(anchor, node)
        return outputs

    def ints(self, values: Iterable[int]) -> ir.Value:
        """An int64 initializer (shapes, axes, split sizes)."""
        name = self.fresh("ints")
        array = np.asarray(list(values), dtype=np.int64)
        value = ir.Value(
            name=name,
            shape=ir.Shape(list(array.shape)),
            type=ir.TensorType(ir.DataType.INT64),
            const_value=ir.tensor(array, name=name),
        )
        self.graph.register_initializer(value)
        return value


def _replace_uses(old: ir.Value, new: ir.Value) -> None:
    """Every reader of ``old`` reads ``new`` (callers check that ``old`` is no graph output)."""
    assert not old.is_graph_output(), old.name
    for use in list(old.uses()):
        use.node.replace_input_with(use.idx, new)


def _removable(values: Iterable[ir.Value]) -> bool:
    return not any(v.is_graph_output() for v in values)


def _reshaped(value: ir.Value, shape: tuple[int, ...]) -> None:
    """Give initializer ``value`` the row-major view ``shape`` of the same bytes."""
    tensor = value.const_value
    assert tensor is not None
    if isinstance(tensor, ir.ExternalTensor):
        new = ir.ExternalTensor(
            tensor.location,
            tensor.offset,
            tensor.length,
            tensor.dtype,
            shape=ir.Shape(list(shape)),
            name=tensor.name,
            base_dir=tensor.base_dir,
            metadata_props=dict(tensor.metadata_props),
        )
    else:
        new = ir.tensor(tensor.numpy().reshape(shape), name=tensor.name)
        new.metadata_props.update(tensor.metadata_props)
    value.const_value = new
    value.shape = ir.Shape(list(shape))


def _stack(graph: ir.Graph, em: _Emitter, group: list[ir.Node], params: set[str]) -> None:
    """Q, K, V (or gate, up) reading one input and of equal weight shapes: one MatMul.
    Weights stored ``[D, C]`` and read through their Transpose stack as ``[k, D, C]``,
    transposed to ``[k, C, D]`` once."""
    order = {n: i for i, n in enumerate(graph)}
    anchor = min(group, key=order.__getitem__)
    x = group[0].inputs[0]
    assert x is not None
    xs = static_shape(x)
    cin, d = static_shape(group[0].inputs[1])
    k = len(group)
    r = len(xs)
    dtype = group[0].outputs[0].dtype
    stored = [transposed_source(m.inputs[1], params) for m in group]
    flipped = all(w is not None for w in stored)
    [xu] = em.node(anchor, "Unsqueeze", [x, em.ints([r - 2])], [(*xs[:-2], 1, *xs[-2:])], dtype)
    if flipped:
        pieces = [
            em.node(anchor, "Unsqueeze", [w, em.ints([0])], [(1, d, cin)], dtype)[0] for w in stored
        ]
        [wk] = em.node(anchor, "Concat", pieces, [(k, d, cin)], dtype, {"axis": 0})
        [ws] = em.node(anchor, "Transpose", [wk], [(k, cin, d)], dtype, {"perm": [0, 2, 1]})
    else:
        pieces = [
            em.node(anchor, "Unsqueeze", [m.inputs[1], em.ints([0])], [(1, cin, d)], dtype)[0]
            for m in group
        ]
        [ws] = em.node(anchor, "Concat", pieces, [(k, cin, d)], dtype, {"axis": 0})
    _unstack(em, anchor, xu, ws, [m.outputs[0] for m in group], xs, d, dtype)
    transposes = [m.inputs[1].producer() for m in group] if flipped else []
    for m in group:
        graph.remove(m, safe=True)
    for t in transposes:
        graph.remove(t, safe=True)


def _unstack(em: _Emitter, anchor: ir.Node, xu, ws, outs, xs, d, dtype, bias=None) -> ir.Value:
    """``P = MatMul(xu, ws) (+ bias)`` of shape ``[.., k, T, D]``; each ``outs[i]`` (if
    any are given) is replaced by piece ``i``. Returns P."""
    k = static_shape(ws)[0]
    r = len(xs)
    pshape = (*xs[:-2], k, xs[-2], d)
    [p] = em.node(anchor, "MatMul", [xu, ws], [pshape], dtype)
    if bias is not None:
        [p] = em.node(anchor, "Add", [p, bias], [pshape], dtype)
    if not outs:
        return p
    one = (*xs[:-2], 1, xs[-2], d)
    parts = em.node(anchor, "Split", [p, em.ints([1] * k)], [one] * k, dtype, {"axis": r - 2})
    for part, old in zip(parts, outs, strict=True):
        [q] = em.node(anchor, "Squeeze", [part, em.ints([r - 2])], [(*xs[:-1], d)], dtype)
        _replace_uses(old, q)
    return p


def _fused_consumer(y: ir.Value, k_parts: int) -> tuple[str, ir.Node] | None:
    """How a fused QKV output is taken apart: ``("split", Split)`` into equal pieces of
    the last dim, or ``("reshape", Reshape)`` to ``[.., k, heads, head_dim]``."""
    uses = y.uses()
    if len(uses) != 1 or uses[0].idx != 0:
        return None
    node = uses[0].node
    shape = static_shape(y)
    last = shape[-1]
    if node.op_type == "Split" and len(node.outputs) == k_parts:
        rank = len(shape)
        if node.attributes.get_int("axis", 0) % rank != rank - 1:
            return None
        sizes = [static_shape(o)[-1] for o in node.outputs]
        if sizes == [last // k_parts] * k_parts and _removable(node.outputs):
            return "split", node
        return None
    if node.op_type == "Reshape":
        out = static_shape(node.outputs[0])
        keeps = out[: len(shape) - 1] == shape[:-1] and len(out) == len(shape) + 2
        if keeps and out[len(shape) - 1] == k_parts and _removable(node.outputs):
            return "reshape", node
    return None


def _taken_apart(em: _Emitter, found, xu, wt, xs, d, dtype, bias) -> None:
    """The stacked product ``MatMul(xu, wt) (+ bias)`` ``[.., k, T, D]`` replaces what a
    fused projection's consumer (:func:`_fused_consumer`) made of its output: the
    Split's pieces, or the Reshape to ``[.., k, heads, head_dim]``."""
    kind, consumer = found
    if kind == "split":
        _unstack(em, consumer, xu, wt, list(consumer.outputs), xs, d, dtype, bias)
        return
    k, r = static_shape(wt)[0], len(xs)
    p = _unstack(em, consumer, xu, wt, [], xs, d, dtype, bias)
    perm = [*range(r - 2), r - 1, r - 2, r]
    [pt] = em.node(consumer, "Transpose", [p], [(*xs[:-1], k, d)], dtype, {"perm": perm})
    out = static_shape(consumer.outputs[0])
    [v] = em.node(consumer, "Reshape", [pt, em.ints(out)], [out], dtype)
    _replace_uses(consumer.outputs[0], v)


def _fused_parts(y: ir.Value) -> int | None:
    """The number of equal parts a fused projection's output is taken apart into."""
    for use in y.uses():
        node = use.node
        if node.op_type == "Split":
            return len(node.outputs)
        if node.op_type == "Reshape":
            out = static_shape(node.outputs[0])
            if len(out) == len(static_shape(y)) + 2:
                return out[len(static_shape(y)) - 1]
    return None


def _view_fused(graph: ir.Graph, em: _Emitter, m: ir.Node, params: set[str]) -> bool:
    """Fused ``W [C, kD]`` (+ bias) taken apart into k pieces: use its ``[C, k, D]`` view."""
    x, w = m.inputs[0], m.inputs[1]
    if x is None or w is None or len(w.uses()) != 1:
        return False
    stored = transposed_source(w, params)  # W [kD, C] as torch keeps it, read transposed
    if (stored if stored is not None else w).const_value is None:
        return False
    y = m.outputs[0]
    bias = None
    bias_add = None
    uses = y.uses()
    if len(uses) == 1 and uses[0].node.op_type == "Add":
        add = uses[0].node
        other = add.inputs[1 - uses[0].idx]
        is_bias = other is not None and other.name in params and other.const_value is not None
        if is_bias and len(other.uses()) == 1 and static_shape(other) == (static_shape(y)[-1],):
            bias, bias_add, y = other, add, add.outputs[0]
    k = _fused_parts(y)
    if not k or k < 2:
        return False
    found = _fused_consumer(y, k)
    if found is None:
        return False
    consumer = found[1]
    cin, total = static_shape(w)
    if total % k:
        return False
    d = total // k
    xs = static_shape(x)
    if len(xs) < 2:
        return False
    dtype = y.dtype
    if stored is not None:
        _reshaped(stored, (k, d, cin))
        [wt] = em.node(m, "Transpose", [stored], [(k, cin, d)], dtype, {"perm": [0, 2, 1]})
    else:
        _reshaped(w, (cin, k, d))
        [wt] = em.node(m, "Transpose", [w], [(k, cin, d)], dtype, {"perm": [1, 0, 2]})
    [xu] = em.node(m, "Unsqueeze", [x, em.ints([len(xs) - 2])], [(*xs[:-2], 1, *xs[-2:])], dtype)
    if bias is not None:
        _reshaped(bias, (k, 1, d))
    _taken_apart(em, found, xu, wt, xs, d, dtype, bias)
    for node in (consumer, bias_add, m, w.producer() if stored is not None else None):
        if node is not None:
            graph.remove(node, safe=True)
    return True


def _bias_piece(m: ir.Node, index: int, sizes: list[int], params: set[str]):
    """(Add, bias Split) when ``m``'s only reader adds piece ``index`` of a ``Split`` of a
    trained bias ``[N]`` into the pieces ``sizes`` (the packed in-projection's bias);
    (None, None) when no Add alone reads it (no bias); None when that Add adds anything
    else."""
    uses = m.outputs[0].uses()
    if len(uses) != 1 or uses[0].node.op_type != "Add":
        return None, None
    add = uses[0].node
    other = add.inputs[1 - uses[0].idx]
    split = other.producer() if other is not None else None
    if split is None or split.op_type != "Split" or not is_forward(split):
        return None
    b = split.inputs[0]
    if b is None or b.name not in params or b.const_value is None or len(b.uses()) != 1:
        return None  # a bias also read elsewhere (merged by the exporter) keeps its shape
    if [static_shape(o)[0] for o in split.outputs] != sizes or len(other.uses()) != 1:
        return None
    return (add, split) if list(split.outputs).index(other) == index else None


def _view_pieces(
    graph: ir.Graph, em: _Emitter, split: ir.Node, readers: list[ir.Node], params: set[str]
) -> bool:
    """A packed weight ``W [N, C]`` taken apart by ``split`` into pieces each read by one
    of ``readers`` (:func:`packed_piece`), each piece ``k_i`` equal parts of ``D`` (q: 1,
    kv: 2, taken apart by a Split or a Reshape as :func:`_view_fused` takes a fused QKV):
    train W as its ``[N/D, D, C]`` view (its bias ``[N]`` as ``[N/D, 1, D]``) and read
    each piece as ``Transpose(Slice(view), [0, 2, 1])``, a stacked weight that splits
    head-wise like the view of a fused QKV."""
    w = split.inputs[0]
    assert w is not None
    pieces = list(split.outputs)
    by_piece: dict[int, ir.Node] = {}
    for m in readers:
        found = packed_piece(m.inputs[1], params)
        if found is not None and found[1] is split:
            by_piece[found[2]] = m
    if sorted(by_piece) != list(range(len(pieces))) or w.const_value is None:
        return False
    if len(w.uses()) != 1:  # read elsewhere too: its view would change that reader
        return False
    sizes = [static_shape(o)[0] for o in pieces]
    plans = []  # (reader, its bias Add and Split, its parts, its output taken apart)
    for i, size in enumerate(sizes):
        m = by_piece[i]
        bias = _bias_piece(m, i, sizes, params)
        if bias is None or m.inputs[0] is None or len(static_shape(m.inputs[0])) < 2:
            return False
        y = bias[0].outputs[0] if bias[0] is not None else m.outputs[0]
        k = _fused_parts(y) or 1
        consumer = _fused_consumer(y, k) if k > 1 else None
        if (k > 1 and consumer is None) or size % k or not _removable([y]):
            return False
        plans.append((m, bias, k, size // k, consumer, y))
    d = plans[0][3]
    if any(p[3] != d for p in plans):
        return False
    biases = {p[1][1] for p in plans}
    if len(biases) != 1:  # every piece has its bias, of one packed bias, or none has
        return False
    [bias_split] = biases
    n, cin = sum(sizes) // d, static_shape(w)[1]
    dtype = plans[0][0].outputs[0].dtype
    _reshaped(w, (n, d, cin))
    if bias_split is not None:
        _reshaped(bias_split.inputs[0], (n, 1, d))
    start = 0
    for m, (add, _), k, _, consumer, y in plans:
        x = m.inputs[0]
        xs = static_shape(x)
        r = len(xs)
        at = [em.ints([start]), em.ints([start + k]), em.ints([0])]
        [wi] = em.node(m, "Slice", [w, *at], [(k, d, cin)], dtype)
        [wt] = em.node(m, "Transpose", [wi], [(k, cin, d)], dtype, {"perm": [0, 2, 1]})
        [xu] = em.node(m, "Unsqueeze", [x, em.ints([r - 2])], [(*xs[:-2], 1, *xs[-2:])], dtype)
        bias = None
        if bias_split is not None:
            [bias] = em.node(m, "Slice", [bias_split.inputs[0], *at], [(k, 1, d)], dtype)
        if consumer is None:  # one part (q): the product, squeezed, replaces y
            p = _unstack(em, m, xu, wt, [], xs, d, dtype, bias)
            [q] = em.node(m, "Squeeze", [p, em.ints([r - 2])], [(*xs[:-1], d)], dtype)
            _replace_uses(y, q)
        else:
            _taken_apart(em, consumer, xu, wt, xs, d, dtype, bias)
        transpose = m.inputs[1].producer()
        for node in (consumer[1] if consumer else None, add, m, transpose):
            if node is not None:
                graph.remove(node, safe=True)
        start += k
    graph.remove(split, safe=True)
    if bias_split is not None:
        graph.remove(bias_split, safe=True)
    return True


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What :func:`stack_projections` changed."""

    stacked: int  # groups of projections on one input made one MatMul
    fused: tuple[str, ...]  # fused QKV weights now trained as their [C, k, D] view


def stack_projections(model: ir.Model) -> Rewrite:
    """The forward rewrite of the module doc (mutates ``model``)."""
    graph = model.graph
    em = _Emitter(graph)
    params = {
        v.name
        for v in graph.initializers.values()
        if v.const_value is not None and v.dtype is not None and v.dtype.is_floating_point()
    }
    blocks = find_blocks(graph, params)
    order = {node: i for i, node in enumerate(graph)}
    groups: list[list[ir.Node]] = []
    for column, _row in (*blocks.attention, *blocks.mlp):
        by_input: dict[ir.Value, list[ir.Node]] = {}
        for m in column:
            x, w = m.inputs[0], m.inputs[1]
            plain = w is not None and w.name in params  # not stacked
            flipped = w is not None and transposed_source(w, params) is not None
            if (plain or flipped) and x is not None and len(static_shape(x)) >= 2:
                by_input.setdefault(x, []).append(m)
        for group in by_input.values():
            # projections of one shape stack; grouped-query attention's smaller K and V
            # stack apart from Q (one partial sum fewer, not one)
            by_shape: dict[tuple, list[ir.Node]] = {}
            for m in group:  # weights stored [D, C] stack apart from those stored [C, D]
                flipped = transposed_source(m.inputs[1], params) is not None
                by_shape.setdefault((static_shape(m.inputs[1]), flipped), []).append(m)
            for same in by_shape.values():
                if len(same) > 1:
                    groups.append(sorted(same, key=order.__getitem__))
    stacked = 0
    for group in groups:
        if _removable(m.outputs[0] for m in group):
            _stack(graph, em, group, params)
            stacked += 1
    fused = []
    for m, _o in blocks.fused:
        w = m.inputs[1]
        found = packed_piece(w, params) if w is not None else None
        if found is not None:  # a packed weight's piece: view the whole weight
            split = found[1]
            if _view_pieces(graph, em, split, _piece_readers(split), params):
                fused.append(found[0].name)
        elif w is not None and _removable(m.outputs) and _view_fused(graph, em, m, params):
            fused.append(w.name)
    return Rewrite(stacked, tuple(fused))


def _piece_readers(split: ir.Node) -> list[ir.Node]:
    """The MatMuls that read the pieces of a packed weight's Split through their
    Transposes (:func:`packed_piece`)."""
    readers = []
    for piece in split.outputs:
        for use in piece.uses():
            for read in use.node.outputs[0].uses() if use.node.op_type == "Transpose" else ():
                if read.node.op_type == "MatMul" and read.idx == 1 and is_forward(read.node):
                    readers.append(read.node)
    return readers
