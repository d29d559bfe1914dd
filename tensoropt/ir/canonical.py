"""Import-time rewrites into the one vocabulary every pass understands.

Two spellings of the same computation should plan alike. :func:`canonicalize` rewrites:

- **Pixel shuffles** (:func:`decompose_fused`): ``DepthToSpace`` (``F.pixel_shuffle``)
  and ``SpaceToDepth`` as the Reshape, Transpose and Reshape of their definitions.
- **Activations** (:func:`decompose_fused`): ``PRelu`` (``nn.PReLU``) as a Where of
  ``x`` and ``x * slope``, ``Mish`` as ``x * tanh(softplus(x))``.
- **Class losses** (:func:`decompose_fused`): ``SoftmaxCrossEntropyLoss`` and
  ``NegativeLogLikelihoodLoss`` (a model that returns ``F.cross_entropy`` or
  ``F.nll_loss``) as LogSoftmax, GatherElements at the labels, the class weights and
  ``ignore_index`` as weights, and the reduction.
- **Recurrences** (:func:`decompose_fused`): ``LSTM``, ``GRU`` and ``RNN`` (how
  ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` export) unrolled over their static sequence
  (``ir/recurrent.py``).
- **Fused ops** (:func:`decompose_fused`). ``InstanceNormalization`` (how
  ``nn.GroupNorm`` exports: Reshape to the groups, InstanceNormalization, Reshape, then
  the affine Mul and Add) becomes ReduceMean, Sub, Mul, Sqrt and Div.
  ``torch.onnx.export(..., opset_version=23)`` (and later) emits ``Attention`` for
  ``scaled_dot_product_attention`` and ``RMSNormalization`` for ``nn.RMSNorm``; opset 20
  exports spell both out as MatMul, Softmax, ReduceMean and friends. They become those
  primitives, so that the gradient table, the sharding rules and the cost model see one
  vocabulary, and a plan splits an attention's heads or batch as it splits the opset-20
  export of the same model.
- **Transposes through merged dimensions** (:func:`fold_merged_transposes`). Opset-20
  exports transpose a 4-D key as ``Reshape`` to [B*H, S, d], ``Transpose`` of the last
  two, ``Reshape`` back to [B, H, d, S]; ``nn.MultiheadAttention`` splits heads as
  [T, B, H*d] -> [T, B*H, d] -> [B*H, T, d] -> [B, H, T, d]. Merging B and H hides the
  head dimension: a plan that splits heads cannot split the merged one in blocks and
  pays an all-to-all each way. The chain becomes a Reshape to the finest shape both
  reshapes group ([B, H, S, d], [T, B, H, d]) and the Transpose of that it computes.
  Pairs of Transposes are composed first (:func:`compose_transposes`).
- **Flattened projections** (:func:`unflatten_gemms`): a ``Gemm`` between a flattening
  and an unflattening Reshape becomes a MatMul on the unflattened activation.
- **Resizes** (:func:`resize_as_gathers`): ``F.interpolate`` exports as ``Resize``,
  which becomes weighted Gathers along each resized dimension.
- **Unbinds by Gathers** (:func:`split_unbinds`): ``nn.MultiheadAttention`` takes its
  packed projection apart with layout ops and one Gather per piece; the pieces become
  the outputs of one Split, as a fused QKV split reads everywhere else.
- **Slices that partition a dimension** (:func:`slices_as_splits`): ``unbind`` and
  ``chunk`` export as Slices when not optimized; they become the pieces of one Split,
  as the optimized export spells them.
- **Gathers that only view** (:func:`gathers_as_views`): a ``GatherND`` of constant
  indices that read their data in order and broadcast it (transformers 5's padding
  masks) becomes a Reshape and an Expand, which a batch split keeps.
- **Gathers of one position per sample** (:func:`sample_gathers`): ``data[arange(B),
  i]`` (HuggingFace's sequence classifiers pooling the last non-padding position)
  becomes a GatherElements along dim 1, which a batch split keeps.
- **Tiles of ones** (:func:`tiles_as_expands`): ``Tile`` whose every repeated
  dimension is 1 (a class token ``.repeat``-ed to the batch) becomes ``Expand``, and an
  ``Expand`` that keeps its input's shape (``optimize=False``'s ``expand`` of the token
  to its own shape) is dropped: the token is then expanded where it is read, which the
  data-parallel completion lays out like the batch.
- **CastLike** (:func:`cast_likes`), which ``torch.onnx.export(..., optimize=False)``
  emits for scalars, becomes a ``Cast`` to the static dtype of its second input.

Pre: a graph whose values have static shapes and dtypes (after shape inference).
Post: no node of :data:`FUSED` (fused ops, activations, pixel shuffles, recurrences, class
losses); no Reshape -> Transpose -> Reshape chain of single readers whose reshapes have a
common refinement that the output groups, no Transpose read only by a Transpose, no Gathers
that unbind a last dimension, no Slices that partition a dimension, no Resize but
tf_crop_and_resize or of variable scales, no CastLike, no Tile whose every repeated
dimension is 1, no Expand to its input's shape but a graph output; every value made here has its
static shape and dtype; the constants made here carry ``MADE_KEY`` and are never
trained (``passes/trainable.py``): scalars, shapes, additive masks (values at the
dtype's lowest), gather indices and resize weights. A fused node whose form has no
primitive spelling here (a key/value cache, extra outputs, a sequence-shortened mask)
raises :class:`UnsupportedOpError` naming the node and what to change.

Numerics: the primitives compute what the ONNX definition computes, in its order
(``Q*sqrt(scale)``, ``K*sqrt(scale)``, MatMul, softcap, mask, Softmax, MatMul;
``X / Sqrt(ReduceMean(X*X) + epsilon) * scale``), checked against onnxruntime's fused
kernels in ``tests/ir/test_canonical.py``. A masked position gets the dtype's lowest
finite value, as opset-20 exports do, not ``-inf``: a query row whose every key is
masked then attends uniformly instead of giving zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from tensoropt.errors import DynamicShapeError, UnsupportedOpError
from tensoropt.ir.recurrent import RECURRENT, unroll
from tensoropt.ir.torch_calls import aten_call, float_arg
from tensoropt.ir.vocab import MADE_KEY

LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
ACTIVATIONS = frozenset({"PRelu", "Mish"})
FUSED = (
    frozenset({"Attention", "RMSNormalization", "InstanceNormalization"})
    | ACTIVATIONS
    | frozenset({"DepthToSpace", "SpaceToDepth"})
    | RECURRENT
    | LOSSES
)


def canonicalize(graph: ir.Graph, path: str) -> dict[str, int]:
    """Every rewrite of this module on ``graph``, in place; how many of each were made."""
    return {
        "fused ops": decompose_fused(graph, path),
        "gathered unbinds": split_unbinds(graph),
        "transpose pairs": compose_transposes(graph),
        "merged transposes": fold_merged_transposes(graph),
        "resizes": resize_as_gathers(graph),
        "gathers as views": gathers_as_views(graph),
        "per-sample gathers": sample_gathers(graph),
        "flattened Gemms": unflatten_gemms(graph),
        "CastLikes": cast_likes(graph),
        "Tiles of ones": tiles_as_expands(graph),
        "partitioning Slices": slices_as_splits(graph),
    }


def slices_as_splits(graph: ir.Graph) -> int:
    """Slices of one value along one axis (constant bounds, step 1) whose pieces
    partition that axis, in any order, become the outputs of one ``Split``. Returns the
    Splits made."""
    done = 0
    b = _Builder(graph)
    order = {node: i for i, node in enumerate(graph)}
    for x in _sliced_values(graph):
        by_axis: dict[int, list[tuple[int, int, ir.Node]]] = {}
        shape = _shape(x)
        for user, _ in x.uses():
            piece = _slice_piece(user, x, shape)
            if piece is not None:
                axis, start, end = piece
                by_axis.setdefault(axis, []).append((start, end, user))
        for axis, pieces in by_axis.items():
            pieces.sort(key=lambda p: (p[0], p[1]))
            bounds = [p[0] for p in pieces] + [pieces[-1][1]]
            whole = bounds[0] == 0 and bounds[-1] == shape[axis]
            if len(pieces) < 2 or not whole:
                continue
            if any(p[1] != q[0] for p, q in zip(pieces, pieces[1:], strict=False)):
                continue
            _split_pieces(graph, b, x, axis, pieces, order)
            done += 1
    return done


def _sliced_values(graph: ir.Graph) -> list[ir.Value]:
    found: dict[ir.Value, None] = {}
    for node in graph:
        if node.op_type == "Slice" and node.inputs and node.inputs[0] is not None:
            found[node.inputs[0]] = None
    return list(found)


def _slice_piece(node: ir.Node, x: ir.Value, shape: list[int]) -> tuple[int, int, int] | None:
    """(axis, start, end) of a Slice of ``x`` along one axis with step 1, else None."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or node.inputs[0] is not x:
        return None
    ins = list(node.inputs) + [None] * (5 - len(node.inputs))
    values = [None if v is None else _const_ints(v) for v in ins[1:5]]
    starts, ends, axes, steps = values
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if (ins[3] is not None and axes is None) or (ins[4] is not None and steps is None):
        return None
    if steps is not None and list(steps) != [1]:
        return None
    rank = len(shape)
    axis = int(axes[0]) % rank if axes is not None else 0
    dim = shape[axis]
    start, end = int(starts[0]), int(ends[0])
    start = min(max(start + dim if start < 0 else start, 0), dim)
    end = min(max(end + dim if end < 0 else end, 0), dim)
    return (axis, start, end) if start < end else None


def _const_ints(value: ir.Value) -> list[int] | None:
    tensor = value.const_value
    if tensor is None:
        return None
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def _split_pieces(
    graph: ir.Graph,
    b: _Builder,
    x: ir.Value,
    axis: int,
    pieces: list[tuple[int, int, ir.Node]],
    order: dict[ir.Node, int],
) -> None:
    first = min((n for _, _, n in pieces), key=order.__getitem__)
    b.at(first)
    sizes = b.const(np.array([end - start for start, end, _ in pieces], np.int64), "sizes")
    split = ir.Node(
        "",
        "Split",
        [x, sizes],
        [ir.AttrInt64("axis", axis)],
        num_outputs=len(pieces),
        name=b._name("split"),
    )
    graph.insert_before(first, split)
    for (_, _, node), out in zip(pieces, split.outputs, strict=True):
        old = node.outputs[0]
        out.shape, out.type = ir.Shape(_shape(old)), old.type
        _replace(graph, old, out)
        graph.remove(node, safe=True)


def cast_likes(graph: ir.Graph) -> int:
    """``CastLike(x, like)`` becomes ``Cast(x, to=like's dtype)`` (its ``saturate`` kept).
    Returns how many were rewritten."""
    b = _Builder(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "CastLike" or node.domain not in ("", "ai.onnx"):
            continue
        x, like, out = node.inputs[0], node.inputs[1], node.outputs[0]
        if x is None or like is None or like.dtype is None or out.shape is None:
            continue
        attrs = {"to": like.dtype.value}
        if "saturate" in node.attributes:
            attrs["saturate"] = node.attributes["saturate"].value
        b.at(node)
        _replace(graph, out, b.op("Cast", [x], _shape(out), like.dtype, "cast", **attrs))
        graph.remove(node, safe=True)
        done += 1
    return done


def tiles_as_expands(graph: ir.Graph) -> int:
    """``Tile(x, r)`` whose every repeated dimension of ``x`` is 1 becomes
    ``Expand(x, shape)``, and an ``Expand`` whose output has its input's shape (not a
    graph output) is dropped, its readers reading its input. A class token repeated to
    the batch (``cls.repeat(B, 1, 1)``, exported unoptimized as a no-op Expand and a
    Tile) is then one Expand of the parameter, which the data-parallel completion lays
    out like the batch (``annotate._Completion._batch_like``); read through the Tile, its
    gradient was gathered from every sample. Returns how many nodes were rewritten."""
    b = _Builder(graph)
    done = 0
    for node in list(graph):
        if node.op_type not in ("Tile", "Expand") or node.domain not in ("", "ai.onnx"):
            continue
        x, out = node.inputs[0], node.outputs[0]
        if x is None or x.shape is None or out.shape is None or len(node.inputs) < 2:
            continue
        shape, result = _shape(x), _shape(out)
        if node.op_type == "Expand":
            if shape != result or out.is_graph_output():
                continue
            ir.convenience.replace_all_uses_with(out, x)
            graph.remove(node, safe=True)
            done += 1
            continue
        repeats = _const_ints(node.inputs[1]) if node.inputs[1] is not None else None
        if repeats is None or len(repeats) != len(shape) or all(r == 1 for r in repeats):
            continue
        if any(r != 1 and d != 1 for r, d in zip(repeats, shape, strict=True)):
            continue
        b.at(node)
        dims = b.const(np.asarray(result, dtype=np.int64), "shape")
        _replace(graph, out, b.op("Expand", [x, dims], result, out.dtype, "expand"))
        graph.remove(node, safe=True)
        done += 1
    return done


def unflatten_gemms(graph: ir.Graph) -> int:
    """``Reshape(x -> [N, C]) -> Gemm(., W [C, D], b [D]) -> Reshape([.., D])`` becomes
    ``MatMul(x', W) + b`` on ``x'``, x as [.., C] (HF ``Conv1D``: ``view -> addmm ->
    view``; ``nn.MultiheadAttention``'s out projection). With ``transB`` (W stored
    [D, C]) the MatMul reads ``Transpose(W)``, a node of its own, so the trained weight
    keeps its shape and name. Flattening to [N, C] merges the batch with the other
    leading dimensions: a seq-first block's [T, B] becomes [T*B], which no split of the
    batch can reach, and neither a micro-batch. Returns the projections rewritten."""
    b = _Builder(graph)
    done = 0
    for gemm in list(graph):
        if gemm.op_type != "Gemm" or gemm.domain not in ("", "ai.onnx") or len(gemm.inputs) < 2:
            continue
        attrs = {k: a.value for k, a in gemm.attributes.items()}
        if (
            attrs.get("transA", 0)
            or attrs.get("alpha", 1.0) != 1.0
            or attrs.get("beta", 1.0) != 1.0
        ):
            continue
        flat, w = gemm.inputs[0], gemm.inputs[1]
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        before = flat.producer() if flat is not None else None
        after = _only_user(gemm.outputs[0], "Reshape")
        if before is None or before.op_type != "Reshape" or after is None:
            continue
        x = before.inputs[0]
        if x is None or w is None or w.const_value is None:
            continue
        ws, ys = _shape(w), _shape(after.outputs[0])
        if len(ws) != 2 or len(ys) < 2:
            continue
        if attrs.get("transB", 0):
            ws = [ws[1], ws[0]]
        fs = _shape(flat)
        if ys[-1] != ws[1] or math.prod(ys[:-1]) != fs[0] or fs[1] != ws[0]:
            continue
        if bias is not None and _shape(bias) not in ([ws[1]], [1, ws[1]]):
            continue
        b.at(gemm)
        dtype = after.outputs[0].dtype
        xs = [*ys[:-1], ws[0]]
        if _shape(x) != xs:  # e.g. attention heads merged by the flattening Reshape
            x = b.op("Reshape", [x, b.const(np.array(xs, dtype=np.int64), "shape")], xs, dtype, "x")
        if attrs.get("transB", 0):
            w = b.op("Transpose", [w], ws, dtype, "weight_transposed", perm=[1, 0])
        y = b.op("MatMul", [x, w], ys, dtype, "matmul")
        if bias is not None:
            y = b.op("Add", [y, bias], ys, dtype, "bias")
        _replace(graph, after.outputs[0], y)
        _drop_dead(graph, [after, gemm, before])
        done += 1
    return done


_MAX_TAPS = 8  # input elements one output element of a resize may read


def gathers_as_views(graph: ir.Graph) -> int:
    """A ``GatherND`` of constant indices that read ``data`` in order, each element once,
    and broadcast it along some output dimensions, becomes ``Reshape`` (and ``Expand``):
    HuggingFace transformers 5 build an attention mask by indexing the padding mask
    ``[B, S]`` at ``(b, s)`` for every output position (``padding[batch_idx, kv_idx]``),
    a ``[B, 1, 1, S]`` (or ``[B, 1, T, S]``) GatherND whose constant indices name every
    sample, so a batch split could not keep it (data parallelism gathered the mask,
    micro-batching refused the step). Returns the gathers replaced."""
    b = _Builder(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "GatherND" or node.domain not in ("", "ai.onnx"):
            continue
        if _int(node, "batch_dims", 0) != 0 or node.inputs[1] is None:
            continue
        data, out = node.inputs[0], node.outputs[0]
        tensor = node.inputs[1].const_value
        if data is None or tensor is None or data.shape is None or out.shape is None:
            continue
        dims = _shape(data)
        index = np.asarray(tensor.numpy()).astype(np.int64)
        if index.ndim < 1 or index.shape[-1] != len(dims) or not dims:
            continue  # only full coordinates: one element per output position
        flat = np.ravel_multi_index(tuple(np.moveaxis(index % dims, -1, 0)), dims)  # (J...)
        kept = [1 if flat.shape[j] > 1 and constant_along(flat, j) else flat.shape[j]
                for j in range(flat.ndim)]  # fmt: skip
        if math.prod(kept) != math.prod(dims):
            continue
        if not np.array_equal(flat[tuple(slice(0, k) for k in kept)].reshape(-1),
                              np.arange(math.prod(dims))):  # fmt: skip
            continue
        b.at(node)
        to = b.const(np.array(kept, dtype=np.int64), "view_shape")
        new = b.op("Reshape", [data, to], kept, data.dtype, "viewed")
        if kept != list(flat.shape):
            full = b.const(np.array(flat.shape, dtype=np.int64), "broadcast_shape")
            new = b.op("Expand", [new, full], list(flat.shape), data.dtype, "broadcast")
        _replace(graph, out, new)
        graph.remove(node, safe=True)
        done += 1
    return done


def sample_gathers(graph: ir.Graph) -> int:
    """A ``GatherND`` that reads one position per sample, ``data[arange(B), i]`` with
    ``data`` ``[B, S, ...]`` (its indices the Concat of the constant sample numbers and
    one index per sample), becomes ``GatherElements`` along dim 1 of ``i`` expanded over
    the trailing dims, then a Reshape that drops dim 1. HuggingFace's sequence
    classifiers pool the last non-padding position so; the GatherND's indices name
    every sample, so a batch split gathered the logits of the whole batch and
    micro-batching refused the step, where GatherElements keeps the batch split (and its
    gradient is a scatter-add per sample). Returns the gathers replaced."""
    b = _Builder(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "GatherND" or node.domain not in ("", "ai.onnx"):
            continue
        data, index, out = node.inputs[0], node.inputs[1], node.outputs[0]
        if _int(node, "batch_dims", 0) != 0 or data is None or index is None:
            continue
        concat = index.producer()
        if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
            continue
        samples, position = concat.inputs
        dims, shape = _shape(data), _shape(index)
        if len(dims) < 2 or shape != [dims[0], 2] or samples is None or position is None:
            continue
        if samples.const_value is None or _shape(position) != [dims[0], 1]:
            continue
        numbers = np.asarray(samples.const_value.numpy()).reshape(-1)
        if not np.array_equal(numbers, np.arange(dims[0])):
            continue
        b.at(node)
        rest = dims[2:]
        ones = b.const(np.array([dims[0], 1] + [1] * len(rest), dtype=np.int64), "per_sample")
        at = b.op("Reshape", [position, ones], [dims[0], 1] + [1] * len(rest), position.dtype,
                  "position")  # fmt: skip
        if rest:
            wide = b.const(np.array([dims[0], 1, *rest], dtype=np.int64), "over_rest")
            at = b.op("Expand", [at, wide], [dims[0], 1, *rest], position.dtype, "positions")
        picked = b.op("GatherElements", [data, at], [dims[0], 1, *rest], data.dtype, "picked",
                      axis=1)  # fmt: skip
        to = b.const(np.array([dims[0], *rest], dtype=np.int64), "per_sample_shape")
        new = b.op("Reshape", [picked, to], [dims[0], *rest], data.dtype, "pooled")
        _replace(graph, out, new)
        graph.remove(node, safe=True)
        if not concat.outputs[0].uses() and not concat.outputs[0].is_graph_output():
            graph.remove(concat, safe=True)
        done += 1
    return done


def constant_along(array: np.ndarray, axis: int) -> bool:
    """Whether ``array`` repeats its first slice along ``axis``."""
    first = np.take(array, [0], axis=axis)
    return bool(np.all(array == first))


def resize_as_gathers(graph: ir.Graph) -> int:
    """Each ``Resize`` (``F.interpolate``, ``nn.Upsample``) of constant scales or sizes
    becomes, per resized dimension, a weighted sum of Gathers along it: nearest is one
    Gather, linear two, cubic four. The weights of a dimension are its interpolation
    matrix, which is measured by resizing the identity with onnxruntime under the
    node's own attributes: a resize that is not tf_crop_and_resize is linear in its input
    and separable over its dimensions, so this is what the op computes, in every
    coordinate, nearest and antialias mode. ``tf_crop_and_resize`` (an extrapolation
    value), variable scales and non-stretching aspect policies are kept (and refused at
    import as unsupported). Returns the resizes rewritten."""
    b = _Builder(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "Resize" or node.domain not in ("", "ai.onnx"):
            continue
        taps = _resize_taps(node)
        if taps is None:
            continue
        b.at(node)
        x, out = node.inputs[0], node.outputs[0]
        shape = _shape(x)
        value = x
        if not taps:  # a resize to the same size: the input itself
            value = b.op("Identity", [x], shape, x.dtype, "resize_identity")
        for axis, (index, weight) in taps.items():
            shape = [*shape[:axis], index.shape[1], *shape[axis + 1 :]]
            tail = [1] * (len(shape) - axis - 1)
            total = None
            for t in range(index.shape[0]):
                at = b.const(index[t], "resize_index")
                picked = b.op("Gather", [value, at], shape, x.dtype, "resize_gather", axis=axis)
                if not np.all(weight[t] == 1.0):
                    w = b.const(weight[t].reshape([-1, *tail]).astype(_np_dtype(x.dtype)), "w")
                    picked = b.op("Mul", [picked, w], shape, x.dtype, "resize_weighted")
                if total is not None:
                    picked = b.op("Add", [total, picked], shape, x.dtype, "resize_sum")
                total = picked
            value = total
        _replace(graph, out, value)
        graph.remove(node, safe=True)
        done += 1
    return done


def _resize_taps(node: ir.Node) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:
    """{axis: (index [taps, out], weight [taps, out])} of every resized dimension, or
    None when the rewrite does not apply."""
    attrs = {k: a.value for k, a in node.attributes.items()}
    mode = attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode == "tf_crop_and_resize" or attrs.get("keep_aspect_ratio_policy", "stretch") != (
        "stretch"
    ):
        return None
    inputs = list(node.inputs) + [None] * (4 - len(node.inputs))
    x, scales, sizes = inputs[0], inputs[2], inputs[3]
    xs, os_ = _shape(x), _shape(node.outputs[0])
    given = None
    for v in (scales, sizes):
        if v is not None and v.const_value is not None and v.const_value.size:
            given = (v is scales, np.asarray(v.const_value.numpy()).reshape(-1))
    if given is None or "axes" in attrs:
        return None
    by_scale, values = given
    if len(values) != len(xs):
        return None
    taps = {}
    for axis, (n_in, n_out) in enumerate(zip(xs, os_, strict=True)):
        if by_scale and float(values[axis]) == 1.0 and n_in == n_out:
            continue
        if not by_scale and n_in == n_out:
            continue
        matrix = _interpolation(attrs, n_in, n_out, float(values[axis]), by_scale)
        if matrix is None:
            return None
        found = _as_taps(matrix)
        if found is None:
            return None
        taps[axis] = found
    return taps


def _interpolation(attrs: dict, n_in: int, n_out: int, value: float, by_scale: bool):
    """[n_out, n_in]: the resize of the identity along one dimension (onnxruntime)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    keep = {
        k: v
        for k, v in attrs.items()
        if k in ("antialias", "coordinate_transformation_mode", "cubic_coeff_a")
        or k in ("exclude_outside", "mode", "nearest_mode")
    }
    inputs = ["x", "", "scales" if by_scale else "", "" if by_scale else "sizes"]
    made = helper.make_node("Resize", inputs, ["y"], **keep)
    init = (
        helper.make_tensor("scales", TensorProto.FLOAT, [2], [1.0, value])
        if by_scale
        else helper.make_tensor("sizes", TensorProto.INT64, [2], [n_in, n_out])
    )
    graph = helper.make_graph(
        [made],
        "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n_in, n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        (y,) = session.run(None, {"x": np.eye(n_in, dtype=np.float32)})
    except Exception:  # onnxruntime refuses these attributes: the node stays, refused later
        return None
    if y.shape != (n_in, n_out):
        return None
    return y.T


def _as_taps(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The nonzero entries of each row of ``matrix`` as (index, weight), each [taps,
    rows]; rows with fewer taps read index 0 with weight 0."""
    rows = [np.flatnonzero(r) for r in matrix]
    taps = max((len(r) for r in rows), default=0)
    if taps == 0 or taps > _MAX_TAPS:
        return None
    index = np.zeros((taps, len(rows)), dtype=np.int64)
    weight = np.zeros((taps, len(rows)), dtype=np.float64)
    for i, r in enumerate(rows):
        index[: len(r), i] = r
        weight[: len(r), i] = matrix[i, r]
    return index, weight


def _only_user(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one node reading ``value``, when it is an ``op_type`` and the value is no
    graph output."""
    users = [u for u, _ in value.uses()]
    if len(users) != 1 or users[0].op_type != op_type or value.is_graph_output():
        return None
    return users[0]


def _drop_dead(graph: ir.Graph, nodes: Sequence[ir.Node]) -> None:
    """Remove ``nodes`` (in order) once nothing reads their outputs."""
    for node in nodes:
        if node.graph is None:
            continue
        if not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def _replace(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    name = old.name
    old.name = None
    new.name = name


def compose_transposes(graph: ir.Graph) -> int:
    """Transpose(Transpose(x, p), q) becomes Transpose(x, p[q]) where the inner one has
    no other reader. Returns how many pairs were composed."""
    b = _Builder(graph)
    done = 0
    for inner in list(graph):
        if inner.op_type != "Transpose" or inner.graph is None:
            continue
        outer = _only_user(inner.outputs[0], "Transpose")
        if outer is None:
            continue
        x, out = inner.inputs[0], outer.outputs[0]
        rank = len(x.shape)
        p, q = _perm(inner, rank), _perm(outer, rank)
        b.at(outer)
        new = b.op("Transpose", [x], _shape(out), out.dtype, "composed", perm=[p[i] for i in q])
        _replace(graph, out, new)
        _drop_dead(graph, [outer, inner])
        done += 1
    return done


def fold_merged_transposes(graph: ir.Graph) -> int:
    """Replace each Reshape -> Transpose -> Reshape chain by Reshape to the finest shape
    both reshapes are groupings of, the Transpose of that shape it computes, and a
    Reshape to the output where that is not already it. [T, B, H*d] -> [T, B*H, d] ->
    [B*H, T, d] -> [B, H, T, d] becomes [T, B, H, d] -> [B, H, T, d]: no dimension merges
    batch and heads any more. A chain whose shapes have no common refinement, or whose
    output does not group the transposed refinement, is kept, and so is one whose first
    Reshape merges nothing (a view into heads, then its transpose): rewriting it would
    replace the Reshape that begins the merging chain after it (an exported
    ``scaled_dot_product_attention`` transposing a key made by ``view`` and
    ``transpose``). Returns the chains replaced."""
    b = _Builder(graph)
    done = 0
    for first in list(graph):
        if first.op_type != "Reshape" or first.graph is None:
            continue
        x, merged = first.inputs[0], first.outputs[0]
        transpose = _only_user(merged, "Transpose")
        if transpose is None:
            continue
        second = _only_user(transpose.outputs[0], "Reshape")
        if second is None:
            continue
        out = second.outputs[0]
        xs, ms, os_ = _shape(x), _shape(merged), _shape(out)
        fine = _refinement(xs, ms)
        if fine is None or fine == ms:  # nothing merged (a view into heads): nothing to undo
            continue
        groups = _groups(fine, ms)
        perm = _perm(transpose, len(ms))
        order = [i for g in perm for i in groups[g]]
        turned = [fine[i] for i in order]
        if _groups(turned, os_) is None:
            continue
        b.at(second)
        new = x
        if xs != fine:
            to = b.const(np.array(fine, dtype=np.int64), "fine_shape")
            new = b.op("Reshape", [new, to], fine, out.dtype, "refined")
        new = b.op("Transpose", [new], turned, out.dtype, "unmerged", perm=order)
        if turned != os_:
            to = b.const(np.array(os_, dtype=np.int64), "shape")
            new = b.op("Reshape", [new, to], os_, out.dtype, "regrouped")
        _replace(graph, out, new)
        _drop_dead(graph, [second, transpose, first])
        done += 1
    return done


def _refinement(a: list[int], b: list[int]) -> list[int] | None:
    """The coarsest shape that both ``a`` and ``b`` group runs of (their prefix
    products' union as boundaries), without size-1 dimensions; None when a boundary of
    one does not divide the next of the other (no common refinement)."""
    if math.prod(a) != math.prod(b):
        return None
    bounds = sorted({p for dims in (a, b) for p in _prefixes(dims)} | {1})
    fine = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if hi % lo:
            return None
        fine.append(hi // lo)
    return fine


def _prefixes(dims: list[int]) -> list[int]:
    out, acc = [], 1
    for d in dims:
        acc *= d
        out.append(acc)
    return out


def _groups(fine: list[int], coarse: list[int]) -> list[list[int]] | None:
    """For each dimension of ``coarse``, the positions of the run of ``fine`` it is the
    product of (a size-1 dimension takes none); None when ``coarse`` does not group
    runs of ``fine``."""
    out: list[list[int]] = []
    k = 0
    for want in coarse:
        run, got = [], 1
        while k < len(fine) and got < want:
            got *= fine[k]
            run.append(k)
            k += 1
        if got != want:
            return None
        out.append(run)
    return out if k == len(fine) else None


_UNBIND_CHAIN = frozenset({"Unsqueeze", "Squeeze", "Transpose", "Identity"})


def split_unbinds(graph: ir.Graph) -> int:
    """A fused projection taken apart by layout ops and Gathers becomes a Split of its
    last dimension. ``nn.MultiheadAttention`` exports ``y [T, B, 3E]`` as Reshape
    [T, B, 3, E], Unsqueeze 0, Transpose [3, 1, 2, 0, 4], Squeeze -2, then Gather 0, 1
    and 2 on axis 0: each is ``y[..., iE:(i+1)E]``, a piece of ``Split(y, 3, axis=-1)``.
    The chain is followed with a label per dimension (Reshape only where it splits the
    last dimension into [k, E]); the Gathers are replaced when what remains is y's
    leading dimensions and E, in order. Returns the chains replaced."""
    b = _Builder(graph)
    done = 0
    for first in list(graph):
        if first.op_type != "Reshape" or first.graph is None:
            continue
        y = first.inputs[0]
        ys, vs = _shape(y), _shape(first.outputs[0])
        if len(vs) != len(ys) + 1 or vs[:-2] != ys[:-1] or vs[-2] * vs[-1] != ys[-1]:
            continue
        k, e = vs[-2], vs[-1]
        labels: list = [*range(len(ys) - 1), "k", "e"]
        chain, value = [first], first.outputs[0]
        while True:
            users = [u for u, _ in value.uses()]
            if value.is_graph_output() or not users:
                break
            node = users[0]
            if len(users) > 1 or node.op_type not in _UNBIND_CHAIN:
                break
            labels = _relabel(node, labels)
            if labels is None:
                break
            chain.append(node)
            value = node.outputs[0]
        if labels is None or "k" not in labels:
            continue
        axis = labels.index("k")
        gathers = [u for u, _ in value.uses()]
        picks = [_picked(g, axis, k) for g in gathers]
        if value.is_graph_output() or not gathers or any(p is None for p in picks):
            continue
        rest = [lab for i, lab in enumerate(labels) if i != axis and lab is not None]
        if rest != [*range(len(ys) - 1), "e"]:
            continue
        b.at(gathers[0])
        split = ir.Node(
            "",
            "Split",
            [y],
            [ir.AttrInt64("axis", len(ys) - 1), ir.AttrInt64("num_outputs", k)],
            num_outputs=k,
            name=b._name("unbind_split"),
        )
        graph.insert_before(gathers[0], split)
        for piece in split.outputs:
            piece.name = b._name("piece")
            piece.shape, piece.type = ir.Shape([*ys[:-1], e]), y.type
        for g, i in zip(gathers, picks, strict=True):
            old = g.outputs[0]
            piece = split.outputs[i]
            if _shape(old) != _shape(piece):
                to = b.const(np.array(_shape(old), dtype=np.int64), "unbind_shape")
                b.at(g)
                piece = b.op("Reshape", [piece, to], _shape(old), old.dtype, "unbind_piece")
            _replace(graph, old, piece)
        _drop_dead(graph, [*gathers, *reversed(chain)])
        done += 1
    return done


def _relabel(node: ir.Node, labels: list) -> list | None:
    """The dimension labels after ``node`` (Unsqueeze: new unlabelled 1s; Squeeze: only
    size-1 dimensions go; Transpose: permuted), or None when it cannot be followed."""
    rank = len(labels)
    if node.op_type == "Identity":  # a clone, in unoptimized exports
        return list(labels)
    if node.op_type == "Transpose":
        return [labels[i] for i in _perm(node, rank)]
    axes_value = node.inputs[1] if len(node.inputs) > 1 else None
    if axes_value is None or axes_value.const_value is None:
        return None
    axes = [int(a) for a in np.asarray(axes_value.const_value.numpy()).reshape(-1)]
    if node.op_type == "Unsqueeze":
        out_rank = rank + len(axes)
        spots = {a % out_rank for a in axes}
        it = iter(labels)
        return [None if i in spots else next(it) for i in range(out_rank)]
    shape = _shape(node.inputs[0])
    spots = {a % rank for a in axes}
    if any(shape[i] != 1 for i in spots):
        return None
    return [lab for i, lab in enumerate(labels) if i not in spots]


def _picked(node: ir.Node, axis: int, k: int) -> int | None:
    """The piece a ``Gather(axis, scalar index)`` takes, else None."""
    if node.op_type != "Gather" or node.attributes.get_int("axis", 0) != axis:
        return None
    index = node.inputs[1]
    if index is None or index.const_value is None:
        return None
    i = np.asarray(index.const_value.numpy())
    if i.shape != ():
        return None
    return int(i) % k


def _perm(node: ir.Node, rank: int) -> list[int]:
    a = node.attributes.get("perm")
    return list(range(rank))[::-1] if a is None else [int(p) for p in a.value]


def decompose_fused(graph: ir.Graph, path: str) -> int:
    """Rewrite every node of :data:`FUSED` in ``graph`` in place; return how many were
    rewritten."""
    todo = [n for n in graph if n.domain in ("", "ai.onnx") and n.op_type in FUSED]
    if not todo:
        return 0
    b = _Builder(graph)
    for node in todo:
        b.at(node)
        if node.op_type in RECURRENT:
            _unrolled(graph, b, node, path)
            continue
        if node.op_type in ("DepthToSpace", "SpaceToDepth"):
            out = _depth_space(b, node)
        elif node.op_type == "RMSNormalization":
            out = _rms_norm(b, node, path)
        elif node.op_type == "InstanceNormalization":
            out = _instance_norm(b, node)
        elif node.op_type in LOSSES:
            out = _class_loss(graph, b, node, path)
        elif node.op_type in ACTIVATIONS:
            out = _activation(b, node)
        else:
            out = _attention(b, node, path)
        _replace(graph, node.outputs[0], out)  # the graph keeps its value names
        graph.remove(node, safe=True)
    return len(todo)


def _unrolled(graph: ir.Graph, b: _Builder, node: ir.Node, path: str) -> None:
    """Replace a recurrent node by its unrolled steps (``ir/recurrent.py``); the steps
    that make only an output nothing reads are left out."""
    dtype = node.inputs[0].dtype

    def op(op_type: str, inputs, shape, hint: str, **attrs) -> ir.Value:
        return b.op(op_type, inputs, shape, dtype, hint, **attrs)

    outs = unroll(node, op, b.const, path)
    dead = []
    for old, new in zip(node.outputs, outs, strict=True):
        if new is None:
            continue
        if old.uses() or old.is_graph_output():
            _replace(graph, old, new)
        else:
            dead.append(new)
    graph.remove(node, safe=True)
    while dead:  # what only the unread outputs needed
        value = dead.pop()
        maker = value.producer()
        if maker is None or maker.graph is None or value.uses() or value.is_graph_output():
            continue
        if any(o.uses() or o.is_graph_output() for o in maker.outputs):
            continue
        inputs = [v for v in maker.inputs if v is not None]
        graph.remove(maker, safe=True)
        dead.extend(inputs)


class _Builder:
    """Makes nodes before one node of the graph, with named, shaped outputs."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.names = {v.name for n in graph for v in (*n.inputs, *n.outputs) if v is not None}
        self.names |= set(graph.initializers) | {v.name for v in graph.inputs}
        self.anchor: ir.Node | None = None
        self.prefix = ""
        self.count = 0
        self._consts: dict[tuple, ir.Value] = {}

    def at(self, node: ir.Node) -> None:
        self.anchor, self.prefix, self.count = node, node.name or node.op_type, 0

    def _name(self, hint: str) -> str:
        name = f"{self.prefix}__{hint}"
        while name in self.names:
            self.count += 1
            name = f"{self.prefix}__{hint}_{self.count}"
        self.names.add(name)
        return name

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value],
        shape: Sequence[int],
        dtype: ir.DataType,
        hint: str,
        **attrs,
    ) -> ir.Value:
        out = ir.Value(name=self._name(hint), shape=ir.Shape(list(shape)))
        out.type = ir.TensorType(dtype)
        node = ir.Node(
            "",
            op_type,
            list(inputs),
            [_attr(k, v) for k, v in attrs.items()],
            outputs=[out],
            name=self._name(f"{hint}_node"),
        )
        assert self.anchor is not None
        self.graph.insert_before(self.anchor, node)
        return out

    def const(self, array: np.ndarray, hint: str) -> ir.Value:
        """An initializer holding ``array``, shared by equal constants."""
        key = (array.dtype.str, array.shape, array.tobytes())
        found = self._consts.get(key)
        if found is None:
            name = self._name(hint)
            found = ir.Value(name=name, shape=ir.Shape(list(array.shape)))
            found.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
            found.const_value = ir.tensor(array, name=name)
            found.metadata_props[MADE_KEY] = "import"
            self.graph.register_initializer(found)
            self._consts[key] = found
        return found


def _attr(name: str, value) -> ir.Attr:
    if isinstance(value, (list, tuple)):
        return ir.AttrInt64s(name, [int(v) for v in value])
    if isinstance(value, float):
        return ir.AttrFloat32(name, value)
    return ir.AttrInt64(name, int(value))


def _shape(v: ir.Value) -> list[int]:
    """``v``'s static shape; a value shape inference left unknown (inputs pinned to a
    shape that the model's fixed Reshapes contradict, say) is refused here, before a
    rewrite reads it."""
    shape = v.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise DynamicShapeError(
            f"value {v.name!r} has no static shape after shape inference (found {shape}); "
            "pin the model inputs with --input-shape NAME=D0xD1... at sizes the model's "
            "fixed shapes agree with, or re-export with static shapes"
        )
    return [int(d) for d in shape]


def _np_dtype(dtype: ir.DataType) -> np.dtype:
    return np.dtype(dtype.numpy())


def _int(node: ir.Node, name: str, default: int) -> int:
    a = node.attributes.get(name)
    return default if a is None else int(a.value)


def _float(node: ir.Node, name: str, default: float | None) -> float | None:
    a = node.attributes.get(name)
    return default if a is None else float(a.value)


_REEXPORT = "re-export with opset 20, where the exporter spells it out in primitive ops"


def _refuse(node: ir.Node, path: str, why: str, fix: str = _REEXPORT) -> UnsupportedOpError:
    return UnsupportedOpError(f"{path}: {node.op_type} node {node.name!r}: {why}; {fix}")


def _rms_norm(b: _Builder, node: ir.Node, path: str) -> ir.Value:
    x, scale = node.inputs[0], node.inputs[1]
    shape, dtype = _shape(x), x.dtype
    rank = len(shape)
    axis = _int(node, "axis", -1)
    axis = axis + rank if axis < 0 else axis
    epsilon = _float(node, "epsilon", 1e-5)
    stash = _int(node, "stash_type", 1)
    if not 0 <= axis < rank:
        raise _refuse(node, path, f"axis {_int(node, 'axis', -1)} is outside rank {rank}")
    work = ir.DataType(stash)
    if work != dtype:  # stage one runs in the stash type, then casts back
        x = b.op("Cast", [x], shape, work, "x_stash", to=int(work))
    kept = [d if i < axis else 1 for i, d in enumerate(shape)]
    square = b.op("Mul", [x, x], shape, work, "square")
    axes = b.const(np.arange(axis, rank, dtype=np.int64), "axes")
    mean = b.op("ReduceMean", [square, axes], kept, work, "mean_square", keepdims=1)
    eps = b.const(np.array(epsilon, dtype=_np_dtype(work)), "epsilon")
    rms = b.op("Sqrt", [b.op("Add", [mean, eps], kept, work, "plus_epsilon")], kept, work, "rms")
    normal = b.op("Div", [x, rms], shape, work, "normalized")
    if work != dtype:
        normal = b.op("Cast", [normal], shape, dtype, "normalized_cast", to=int(dtype))
    out_type = scale.dtype if scale.dtype is not None else dtype
    return b.op("Mul", [normal, scale], shape, out_type, "scaled")


def _depth_space(b: _Builder, node: ir.Node) -> ir.Value:
    """``DepthToSpace`` (``F.pixel_shuffle``: mode CRD; DCR) and ``SpaceToDepth`` as the
    Reshape, Transpose and Reshape their definitions are written in."""
    x, out = node.inputs[0], node.outputs[0]
    n, c, h, w = _shape(x)
    k = _int(node, "blocksize", 1)
    if node.op_type == "SpaceToDepth":
        split, perm = [n, c, h // k, k, w // k, k], [0, 3, 5, 1, 2, 4]
    elif node.attributes.get_string("mode", "DCR") == "CRD":
        split, perm = [n, c // (k * k), k, k, h, w], [0, 1, 4, 2, 5, 3]
    else:
        split, perm = [n, k, k, c // (k * k), h, w], [0, 3, 4, 1, 5, 2]
    shape = b.const(np.array(split, dtype=np.int64), "blocks")
    blocks = b.op("Reshape", [x, shape], split, x.dtype, "blocks")
    moved = b.op("Transpose", [blocks], [split[i] for i in perm], x.dtype, "moved", perm=perm)
    to = b.const(np.array(_shape(out), dtype=np.int64), "shape")
    return b.op("Reshape", [moved, to], _shape(out), x.dtype, "rearranged")


def _instance_norm(b: _Builder, node: ir.Node) -> ir.Value:
    """``scale * (x - mean) / sqrt(var + epsilon) + B`` over the spatial dimensions of
    each (sample, channel); scale and B ([C]) reshaped to [C, 1, ..]: ``nn.GroupNorm``
    exports as Reshape, InstanceNormalization (of the groups), Reshape, Mul, Add."""
    x, scale, bias = node.inputs[0], node.inputs[1], node.inputs[2]
    shape, dtype = _shape(x), x.dtype
    rank = len(shape)
    kept = shape[:2] + [1] * (rank - 2)
    axes = b.const(np.arange(2, rank, dtype=np.int64), "spatial_axes")
    mean = b.op("ReduceMean", [x, axes], kept, dtype, "mean", keepdims=1)
    centred = b.op("Sub", [x, mean], shape, dtype, "centred")
    square = b.op("Mul", [centred, centred], shape, dtype, "square")
    var = b.op("ReduceMean", [square, axes], kept, dtype, "variance", keepdims=1)
    eps = b.const(np.array(_float(node, "epsilon", 1e-5), dtype=_np_dtype(dtype)), "epsilon")
    std = b.op("Sqrt", [b.op("Add", [var, eps], kept, dtype, "plus_epsilon")], kept, dtype, "std")
    normal = b.op("Div", [centred, std], shape, dtype, "normalized")
    per_channel = [shape[1]] + [1] * (rank - 2)
    to = b.const(np.array(per_channel, dtype=np.int64), "channel_shape")
    s = b.op("Reshape", [scale, to], per_channel, scale.dtype, "scale_per_channel")
    c = b.op("Reshape", [bias, to], per_channel, bias.dtype, "bias_per_channel")
    scaled = b.op("Mul", [normal, s], shape, dtype, "scaled")
    return b.op("Add", [scaled, c], shape, dtype, "shifted")


def _activation(b: _Builder, node: ir.Node) -> ir.Value:
    """``PRelu`` (``nn.PReLU``: a learned slope, broadcast) as ``Where(x > 0, x, x *
    slope)``, torch's branch at 0 included (the slope's); ``Mish`` as ``x *
    tanh(softplus(x))``, its definition."""
    x = node.inputs[0]
    shape, dtype = _shape(x), x.dtype
    if node.op_type == "PRelu":
        zero = b.const(np.array(0, dtype=_np_dtype(dtype)), "zero")
        positive = b.op("Greater", [x, zero], shape, ir.DataType.BOOL, "positive")
        sloped = b.op("Mul", [x, node.inputs[1]], shape, dtype, "sloped")
        return b.op("Where", [positive, x, sloped], shape, dtype, "prelu")
    soft = b.op("Softplus", [x], shape, dtype, "softplus")
    return b.op("Mul", [x, b.op("Tanh", [soft], shape, dtype, "tanh")], shape, dtype, "mish")


def _class_loss(graph: ir.Graph, b: _Builder, node: ir.Node, path: str) -> ir.Value:
    """``SoftmaxCrossEntropyLoss`` (``F.cross_entropy`` inside a model that returns its
    own loss) and ``NegativeLogLikelihoodLoss`` (``F.nll_loss``) as their definitions:
    scores ``[N, C, D1..]`` (log-probabilities for the second), integer labels
    ``[N, D1..]``, optional class weights ``[C]``. Each element's loss is
    ``-logp[n, label, d] * weight[label]``, 0 where the label is ``ignore_index``; "mean"
    divides the sum by the summed weights of the elements not ignored (their count
    without weights), so a batch whose every label is ignored gives NaN, as torch does.
    The optional ``log_prob`` output is the LogSoftmax made here. A torch export drops
    ``F.cross_entropy``'s ``label_smoothing``; it is read back from the node's recorded
    call (``ir/torch_calls``) and added as torch computes it (:func:`_smoothed`)."""
    scores, labels = node.inputs[0], node.inputs[1]
    weight = node.inputs[2] if len(node.inputs) > 2 else None
    shape, dtype = _shape(scores), scores.dtype
    if len(shape) < 2 or labels is None or _shape(labels) != [shape[0], *shape[2:]]:
        raise _refuse(
            node, path, f"scores {shape} and labels {_shape(labels) if labels else None} "
            "are not [N, C, D1..] and [N, D1..]", "file an issue with the export",
        )  # fmt: skip
    reduction_attr = node.attributes.get("reduction")
    reduction = "mean" if reduction_attr is None else reduction_attr.as_string()
    if reduction not in ("mean", "sum", "none"):
        raise _refuse(node, path, f"reduction {reduction!r}", "file an issue with the export")
    ignore_attr = node.attributes.get("ignore_index")
    each = [shape[0], *shape[2:]]
    picked_shape = [shape[0], 1, *shape[2:]]
    npd = _np_dtype(dtype)
    if node.op_type == "SoftmaxCrossEntropyLoss":
        logp = b.op("LogSoftmax", [scores], shape, dtype, "log_prob", axis=1)
        if len(node.outputs) > 1 and node.outputs[1] is not None:
            _replace(graph, node.outputs[1], logp)
    else:
        logp = scores
    index, counted = labels, None  # counted: 1 where the label counts, 0 where ignored
    if ignore_attr is not None:
        ignored = b.const(np.array(int(ignore_attr.value), dtype=_np_dtype(labels.dtype)), "ignore")
        skipped = b.op("Equal", [labels, ignored], each, ir.DataType.BOOL, "ignored")
        zero_label = b.const(np.array(0, dtype=_np_dtype(labels.dtype)), "label_zero")
        index = b.op("Where", [skipped, zero_label, labels], each, labels.dtype, "label_safe")
        zero, one = b.const(np.array(0, dtype=npd), "zero"), b.const(np.array(1, dtype=npd), "one")
        counted = b.op("Where", [skipped, zero, one], each, dtype, "counted")
    axis1 = b.const(np.array([1], dtype=np.int64), "class_axis")
    at = b.op("Unsqueeze", [index, axis1], picked_shape, index.dtype, "label_index")
    picked = b.op("GatherElements", [logp, at], picked_shape, dtype, "picked", axis=1)
    loss = b.op("Neg", [b.op("Squeeze", [picked, axis1], each, dtype, "picked_each")],
                each, dtype, "nll")  # fmt: skip
    kept = counted  # each element's weight in the loss: its class's, 0 where ignored
    if weight is not None:
        w = b.op("Gather", [weight, index], each, dtype, "class_weight", axis=0)
        kept = w if kept is None else b.op("Mul", [w, kept], each, dtype, "weight_counted")
    if kept is not None:
        loss = b.op("Mul", [loss, kept], each, dtype, "weighted")
    smoothing = float_arg(aten_call(node), "cross_entropy_loss.default", 5)
    smooth = None  # torch's label smoothing term, which the exporter leaves out
    if node.op_type == "SoftmaxCrossEntropyLoss" and smoothing:
        smooth = _smoothing_term(b, logp, weight, counted, shape, dtype)
    if reduction == "none":
        return loss if smooth is None else _smoothed(b, loss, smooth, smoothing, shape, each)
    total = b.op("ReduceSum", [loss], [], dtype, "total", keepdims=0)
    if smooth is not None:
        smooth = b.op("ReduceSum", [smooth], [], dtype, "smooth_total", keepdims=0)
        total = _smoothed(b, total, smooth, smoothing, shape, [])
    if reduction == "sum":
        return total
    if kept is None:
        count = b.const(np.array(math.prod(each), dtype=npd), "count")
    else:
        count = b.op("ReduceSum", [kept], [], dtype, "counted_total", keepdims=0)
    return b.op("Div", [total, count], [], dtype, "mean")


def _smoothing_term(b: _Builder, logp, weight, counted, shape, dtype) -> ir.Value:
    """Each element's ``-sum_c weight[c] * logp[n, c, d]``, 0 where ignored."""
    each = [shape[0], *shape[2:]]
    if weight is not None:
        per_class = [1, shape[1]] + [1] * (len(shape) - 2)
        to = b.const(np.array(per_class, dtype=np.int64), "class_shape")
        w = b.op("Reshape", [weight, to], per_class, dtype, "class_weights")
        logp = b.op("Mul", [logp, w], shape, dtype, "weighted_log_prob")
    axis1 = b.const(np.array([1], dtype=np.int64), "class_axis")
    summed = b.op("ReduceSum", [logp, axis1], each, dtype, "class_sum", keepdims=0)
    term = b.op("Neg", [summed], each, dtype, "smooth")
    if counted is not None:
        term = b.op("Mul", [term, counted], each, dtype, "smooth_counted")
    return term


def _smoothed(b: _Builder, nll, smooth, smoothing: float, shape, out_shape) -> ir.Value:
    """``(1 - eps) * nll + eps / C * smooth``: torch's cross entropy with label smoothing
    ``eps`` over ``C`` classes (the smoothing term reduced as the loss is)."""
    npd = _np_dtype(nll.dtype)
    keep = b.const(np.array(1.0 - smoothing, dtype=npd), "unsmoothed")
    spread = b.const(np.array(smoothing / shape[1], dtype=npd), "smoothing")
    a = b.op("Mul", [nll, keep], out_shape, nll.dtype, "nll_share")
    c = b.op("Mul", [smooth, spread], out_shape, nll.dtype, "smooth_share")
    return b.op("Add", [a, c], out_shape, nll.dtype, "smoothed")


def _attention(b: _Builder, node: ir.Node, path: str) -> ir.Value:
    inputs = list(node.inputs) + [None] * (7 - len(node.inputs))
    q, k, v, mask, past_key, past_value, nonpad = inputs[:7]
    if past_key is not None or past_value is not None or nonpad is not None:
        raise _refuse(
            node,
            path,
            "a key/value cache (past_key, past_value or nonpad_kv_seqlen) is inference state",
            "export the model for training without a cache",
        )
    used = [i for i, o in enumerate(node.outputs) if i and (o.uses() or o.is_graph_output())]
    if used:
        raise _refuse(
            node,
            path,
            "its outputs present_key, present_value or qk_matmul_output are used",
            "export the model without them",
        )
    dtype = q.dtype
    three_d = len(q.shape) == 3
    if three_d:
        hq, hkv = _int(node, "q_num_heads", 0), _int(node, "kv_num_heads", 0)
        if hq <= 0 or hkv <= 0:
            raise _refuse(node, path, "3-D inputs need q_num_heads and kv_num_heads")
        q4 = _heads(b, q, hq, "q")
        k4 = _heads(b, k, hkv, "k")
        v4 = _heads(b, v, hkv, "v")
    else:
        q4, k4, v4 = q, k, v
    bsz, hq, sq, d = _shape(q4)
    _, hkv, skv, _ = _shape(k4)
    dv = _shape(v4)[3]
    if hq % hkv:
        raise _refuse(node, path, f"{hq} query heads are not a multiple of {hkv} key heads")
    if hq != hkv:  # grouped-query: each key/value head serves hq/hkv query heads in turn
        k4 = _repeat_heads(b, k4, hq // hkv, "k")
        v4 = _repeat_heads(b, v4, hq // hkv, "v")
    scale = _float(node, "scale", None)
    root = math.sqrt(1.0 / math.sqrt(d) if scale is None else scale)
    npd = _np_dtype(dtype)
    s = b.const(np.array(root, dtype=npd), "sqrt_scale")
    kt = b.op("Transpose", [k4], [bsz, hq, d, skv], dtype, "k_transposed", perm=[0, 1, 3, 2])
    scores_shape = [bsz, hq, sq, skv]
    scores = b.op(
        "MatMul",
        [
            b.op("Mul", [q4, s], [bsz, hq, sq, d], dtype, "q_scaled"),
            b.op("Mul", [kt, s], [bsz, hq, d, skv], dtype, "k_scaled"),
        ],
        scores_shape,
        dtype,
        "scores",
    )
    softcap = _float(node, "softcap", 0.0) or 0.0
    if softcap:
        c = b.const(np.array(softcap, dtype=npd), "softcap")
        ratio = b.op("Div", [scores, c], scores_shape, dtype, "capped_ratio")
        scores = b.op(
            "Mul",
            [b.op("Tanh", [ratio], scores_shape, dtype, "capped_tanh"), c],
            scores_shape,
            dtype,
            "capped",
        )
    lowest = np.finfo(npd).min
    bias = _window_bias(node, sq, skv, npd, lowest)
    if bias is not None:
        scores = b.op("Add", [scores, b.const(bias, "causal_bias")], scores_shape, dtype, "biased")
    if mask is not None:
        scores = _apply_mask(b, node, path, scores, mask, scores_shape, skv, lowest)
    precision = _int(node, "softmax_precision", 0)
    if precision and ir.DataType(precision) != dtype:
        work = ir.DataType(precision)
        wide = b.op("Cast", [scores], scores_shape, work, "scores_cast", to=precision)
        probs = b.op("Softmax", [wide], scores_shape, work, "probs_wide", axis=-1)
        probs = b.op("Cast", [probs], scores_shape, dtype, "probs", to=int(dtype))
    else:
        probs = b.op("Softmax", [scores], scores_shape, dtype, "probs", axis=-1)
    y = b.op("MatMul", [probs, v4], [bsz, hq, sq, dv], dtype, "attended")
    if three_d:
        t = b.op("Transpose", [y], [bsz, sq, hq, dv], dtype, "y_heads", perm=[0, 2, 1, 3])
        to = b.const(np.array([bsz, sq, hq * dv], dtype=np.int64), "y_shape")
        y = b.op("Reshape", [t, to], [bsz, sq, hq * dv], dtype, "y")
    return y


def _heads(b: _Builder, x: ir.Value, heads: int, hint: str) -> ir.Value:
    """[B, S, H*d] -> [B, H, S, d]."""
    bsz, seq, hidden = _shape(x)
    d = hidden // heads
    to = b.const(np.array([bsz, seq, heads, d], dtype=np.int64), f"{hint}_heads_shape")
    split = b.op("Reshape", [x, to], [bsz, seq, heads, d], x.dtype, f"{hint}_split")
    to_heads = [bsz, heads, seq, d]
    return b.op("Transpose", [split], to_heads, x.dtype, f"{hint}_heads", perm=[0, 2, 1, 3])


def _repeat_heads(b: _Builder, x: ir.Value, group: int, hint: str) -> ir.Value:
    """[B, Hkv, S, d] -> [B, Hkv*group, S, d], each head repeated ``group`` times in turn."""
    bsz, h, seq, d = _shape(x)
    one = b.const(np.array([2], dtype=np.int64), "axis_2")
    wide = b.op("Unsqueeze", [x, one], [bsz, h, 1, seq, d], x.dtype, f"{hint}_unsqueezed")
    full = b.const(np.array([bsz, h, group, seq, d], dtype=np.int64), f"{hint}_group_shape")
    grouped = b.op("Expand", [wide, full], [bsz, h, group, seq, d], x.dtype, f"{hint}_grouped")
    to = b.const(np.array([bsz, h * group, seq, d], dtype=np.int64), f"{hint}_repeat_shape")
    return b.op("Reshape", [grouped, to], [bsz, h * group, seq, d], x.dtype, f"{hint}_repeated")


def _window_bias(node: ir.Node, sq: int, skv: int, npd, lowest) -> np.ndarray | None:
    """The additive [Sq, Skv] bias of ``is_causal`` and the sliding windows (no cache:
    offset 0, query i attends key j iff j <= i), or None when neither is set."""
    causal = bool(_int(node, "is_causal", 0))
    left, right = _int(node, "left_window_size", -1), _int(node, "right_window_size", -1)
    if not causal and left < 0 and right < 0:
        return None
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    allowed = np.ones((sq, skv), dtype=bool)
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return np.where(allowed, 0.0, lowest).astype(npd)


def _apply_mask(
    b: _Builder,
    node: ir.Node,
    path: str,
    scores: ir.Value,
    mask: ir.Value,
    shape: list[int],
    skv: int,
    lowest,
) -> ir.Value:
    dims = _shape(mask)
    if not dims or dims[-1] != skv:
        raise _refuse(
            node,
            path,
            f"attn_mask {mask.name!r} of shape {dims} does not cover the {skv} keys",
            "give the mask the keys' full length",
        )
    dtype = scores.dtype
    if mask.dtype == ir.DataType.BOOL:
        low = b.const(np.array(lowest, dtype=_np_dtype(dtype)), "masked")
        return b.op("Where", [mask, scores, low], shape, dtype, "masked_scores")
    if mask.dtype != dtype:
        raise _refuse(
            node,
            path,
            f"attn_mask {mask.name!r} is {mask.dtype.name}, neither bool nor the scores' "
            f"{dtype.name}",
            "export a boolean or an additive float mask",
        )
    return b.op("Add", [scores, mask], shape, dtype, "masked_scores")
