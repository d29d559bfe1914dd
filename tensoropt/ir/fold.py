"""What unoptimized exports compute from constants, folded before the graph is read.

``torch.onnx.export(..., optimize=False)`` keeps every parameter under its torch name and
every computation on it. The optimizer, by default, folds whatever constants compute,
parameters included: a relative position bias gathered at constant buckets (T5, Swin)
or a class token expanded to the batch (ViT) becomes a tensor of its own, which
training then updates per copy, unlike torch (``passes/trainable.py`` warns). An
unoptimized export avoids that, but keeps two things ONNX shape inference cannot always
see through; :func:`fold_shapes` rewrites both, before the model becomes IR:

- **Shape arithmetic** (``Shape``, ``Gather``, ``Concat``, ``Range``, ``Cast``... on
  shapes, then ``Reshape``/``Expand`` reading them): a node whose inputs are all known
  constants that are no parameter (integer or boolean tensors, scalars, ``Constant``
  nodes, what earlier folds made), or a ``Shape``/``Size`` of a value whose shape is
  static, or a ``CastLike`` of a constant to a value of known type, is evaluated
  (``onnx.reference``) and its outputs become initializers marked
  ``MADE_KEY`` (never trained). Float initializers of rank >= 1, and scalars the exporter
  records as parameters, are never read by a fold: they may be trained, so their
  computations stay in the graph.
- **Constant nodes** become initializers too (``Resize`` scales, ``Reshape`` targets),
  read like every other constant.
- **Sequences**: a ``SplitToSequence`` whose every reader is a ``SequenceAt`` at a
  constant position becomes a ``Split`` (``Squeeze`` for ``keepdims=0`` pieces).

Shape inference runs again after each round, until a round changes nothing.

Pre: a model at the target opset. Post: the same computation; no node left that folds
under the rules above; no ``SplitToSequence`` read only by constant ``SequenceAt``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from tensoropt.ir.vocab import MADE_KEY

# Ops never folded: their outputs are random, or they carry graphs or sequences.
_KEEP = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Dropout",
        "If",
        "Loop",
        "Scan",
        "SplitToSequence",
        "SequenceAt",
        "SequenceConstruct",
        "SequenceEmpty",
        "SequenceInsert",
        "SequenceErase",
        "SequenceLength",
        "ConcatFromSequence",
    }
)
_MAX_FOLDED = 1 << 20  # elements: shape operands are small; a larger result stays a node
_ROUNDS = 16


def fold_shapes(
    model: onnx.ModelProto, infer: Callable[[onnx.ModelProto], onnx.ModelProto]
) -> tuple[onnx.ModelProto, int]:
    """``model`` with its constant shape arithmetic and sequences folded (see the module
    doc), and how many nodes were folded or rewritten. ``infer`` writes shape inference
    into a model and returns it."""
    done = 0
    for _ in range(_ROUNDS):
        sequences = _split_sequences(model)
        computed, lifted = _fold_round(model)
        done += sequences + computed + lifted
        if sequences or computed:  # shapes may now be inferred that were not
            _drop_dead(model.graph)
            model = infer(model)
        else:
            break
    return model, done


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Static shapes of the graph's values that shape inference found."""
    found: dict[str, tuple[int, ...]] = {}
    graph = model.graph
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            found[info.name] = tuple(int(d.dim_value) for d in dims)
    for init in graph.initializer:
        found[init.name] = tuple(init.dims)
    return found


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of the graph's values that shape inference found."""
    graph = model.graph
    found = {init.name: init.data_type for init in graph.initializer}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        elem = info.type.tensor_type.elem_type
        if elem:
            found[info.name] = elem
    return found


_KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Values a fold may read: Constant nodes, and initializers that are no parameter
    (integer or boolean, or a float scalar the exporter does not call a parameter) and
    whose data is in the file."""
    params = {
        info.name
        for info in graph.value_info
        if any(p.key == _KIND_KEY and p.value == "PARAMETER" for p in info.metadata_props)
    }
    found: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL or init.name in params:
            continue
        is_float = init.data_type in (
            onnx.TensorProto.FLOAT,
            onnx.TensorProto.DOUBLE,
            onnx.TensorProto.FLOAT16,
            onnx.TensorProto.BFLOAT16,
        )
        if is_float and len(init.dims) >= 1:  # may be trained (rank >= 1, or --trainable)
            continue
        found[init.name] = numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            value = _constant_value(node)
            if value is not None:
                found[node.output[0]] = value
    return found


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a Constant node (tensor, float(s) or int(s)); None for strings and
    sparse tensors, which stay nodes."""
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name in ("value_float", "value_floats"):
            return np.asarray(helper.get_attribute_value(attr), dtype=np.float32)
        if attr.name in ("value_int", "value_ints"):
            return np.asarray(helper.get_attribute_value(attr), dtype=np.int64)
    return None


def _fold_round(model: onnx.ModelProto) -> tuple[int, int]:
    """(nodes computed, Constant nodes made initializers) in one pass over the graph."""
    graph = model.graph
    shapes = _shapes(model)
    types = _types(model)
    consts = _constants(graph)
    kept: list[onnx.NodeProto] = []
    made: list[onnx.TensorProto] = []
    computed = lifted = 0
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        # a graph output stays the output of a node
        values = None if outputs & set(node.output) else _evaluate(node, consts, shapes, types)
        if values is None:
            kept.append(node)
            continue
        for name, value in zip(node.output, values, strict=True):
            consts[name] = value
            tensor = numpy_helper.from_array(value, name)
            tensor.metadata_props.add(key=MADE_KEY, value="import")
            made.append(tensor)
        if node.op_type == "Constant":
            lifted += 1
        else:
            computed += 1
    if made:
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(made)
        made_names = {t.name for t in made}
        keep_info = [v for v in graph.value_info if v.name not in made_names]
        del graph.value_info[:]
        graph.value_info.extend(keep_info)
    return computed, lifted


def _evaluate(
    node: onnx.NodeProto,
    consts: dict[str, np.ndarray],
    shapes: dict[str, tuple[int, ...]],
    types: dict[str, int],
) -> list[np.ndarray] | None:
    """The outputs of ``node`` when it folds, else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _KEEP:
        return None
    if node.op_type == "Constant":  # an initializer, as every constant of the importer
        value = consts.get(node.output[0])
        return None if value is None else [value]
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    ):
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
        shape = shapes[node.input[0]]
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(shape))
        return [np.array(shape[start:end], dtype=np.int64)]
    if node.op_type == "CastLike" and node.input[0] in consts and node.input[1] in types:
        to = helper.tensor_dtype_to_np_dtype(types[node.input[1]])
        return [np.asarray(consts[node.input[0]]).astype(to)]
    inputs = [name for name in node.input if name]
    if not inputs or any(name not in consts for name in inputs):
        return None
    feeds = {name: consts[name] for name in inputs}
    try:
        values = ReferenceEvaluator(node).run(None, feeds)
    except Exception:  # noqa: BLE001 - what the reference cannot run stays a node
        return None
    values = [np.asarray(v) for v in values]
    if any(v.dtype == object or v.size > _MAX_FOLDED for v in values):
        return None
    return values


def _split_sequences(model: onnx.ModelProto) -> int:
    """SplitToSequence read only by SequenceAt at constant positions becomes a Split."""
    graph = model.graph
    if not any(n.op_type == "SplitToSequence" for n in graph.node):
        return 0
    shapes = _shapes(model)
    consts = _constants(graph)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    rewritten: dict[int, list[onnx.NodeProto]] = {}  # id of a node -> what replaces it
    done = 0
    for node in graph.node:
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx"):
            continue
        seq = node.output[0]
        users = readers.get(seq, [])
        if seq in outputs or not users or any(u.op_type != "SequenceAt" for u in users):
            continue
        if any(u.input[1] not in consts for u in users) or node.input[0] not in shapes:
            continue
        pieces = _pieces(node, shapes[node.input[0]], consts)
        if pieces is None:
            continue
        sizes, axis, squeeze = pieces
        names = [f"{seq}__piece{i}" for i in range(len(sizes))]
        taken: set[int] = set()
        for user in users:  # a kept piece is named as the first SequenceAt that reads it
            position = int(consts[user.input[1]]) % len(sizes)
            if not squeeze and position not in taken:
                names[position] = user.output[0]
                taken.add(position)
                rewritten[id(user)] = []
        split_sizes = f"{seq}__sizes"
        graph.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), split_sizes))
        new = [
            helper.make_node(
                "Split", [node.input[0], split_sizes], names, name=f"{node.name}__split", axis=axis
            )
        ]
        for user in users:
            if id(user) in rewritten:
                continue
            piece = names[int(consts[user.input[1]]) % len(sizes)]
            if squeeze:
                axes = f"{user.output[0]}__axes"
                graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
                op = helper.make_node("Squeeze", [piece, axes], list(user.output), name=user.name)
            else:
                op = helper.make_node("Identity", [piece], list(user.output), name=user.name)
            rewritten[id(user)] = [op]
        rewritten[id(node)] = new
        done += 1
    if done:
        nodes = [n for old in graph.node for n in rewritten.get(id(old), [old])]
        del graph.node[:]
        graph.node.extend(nodes)
    return done


def _pieces(
    node: onnx.NodeProto, shape: tuple[int, ...], consts: dict[str, np.ndarray]
) -> tuple[list[int], int, bool] | None:
    """(sizes, axis, squeezed) of a SplitToSequence, or None when not constant."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axis = int(attrs.get("axis", 0)) % len(shape)
    dim = shape[axis]
    if len(node.input) < 2 or not node.input[1]:
        return [1] * dim, axis, not int(attrs.get("keepdims", 1))
    if node.input[1] not in consts:
        return None
    split = np.asarray(consts[node.input[1]]).astype(np.int64)
    if split.ndim == 0:
        size = int(split)
        return [min(size, dim - start) for start in range(0, dim, size)], axis, False
    return [int(s) for s in split], axis, False


def _drop_dead(graph: onnx.GraphProto) -> None:
    """Remove nodes nothing reads (folds leave their Constant inputs behind) and
    initializers nothing reads that a fold made."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        alive = [n for n in graph.node if any(o in read for o in n.output)]
        if len(alive) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(alive)
    read = {name for node in graph.node for name in node.input} | outputs
    made = [
        t
        for t in graph.initializer
        if t.name not in read and any(p.key == MADE_KEY for p in t.metadata_props)
    ]
    for tensor in made:
        graph.initializer.remove(tensor)
