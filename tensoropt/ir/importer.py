"""Import an ONNX file into the IR with every shape static and known.

Pre: a path to an ONNX model (weights inline or as external data; external-data
locations must stay inside the model's directory, see ``ir/external.py``).
Post: an ``onnx_ir.Model`` at ai.onnx opset >= 20 whose every value has a static
shape and dtype, whose nodes all have unique names and carry
``tensoropt.role=forward`` / ``tensoropt.unit=<own name>`` metadata, and which holds
what ``ir/canonical.py`` rewrites in its one spelling (no fused attention or
normalisation of newer opsets, no Resize of constant scales, no flattened Gemm
projection, no Reshape-Transpose-Reshape through merged dimensions).

``load_weights=False`` leaves external-data weights on disk (planning needs only
shapes), so paper-size models are searched without their weights in memory.
"""

from __future__ import annotations

import ast
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from tensoropt.errors import DynamicShapeError, ModelLoadError, UnsupportedOpError
from tensoropt.ir.canonical import canonicalize, constant_along
from tensoropt.ir.external import check_extents, check_locations
from tensoropt.ir.fold import fold_shapes
from tensoropt.ir.vocab import MADE_KEY, ROLE_KEY, UNIT_KEY, Role

log = logging.getLogger(__name__)

MIN_OPSET = 13
TARGET_OPSET = 20
MAX_OPSET = 28  # the newest ai.onnx opset onnxruntime 1.32 accepts (FIELD-NOTES)
_GRAPH_ATTRS = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)  # control flow


@dataclass(frozen=True, slots=True)
class ImportOptions:
    """How to import. ``input_shapes`` pins dynamic input dims: name -> shape."""

    load_weights: bool = True
    input_shapes: Mapping[str, tuple[int, ...]] | None = None
    supported_ops: frozenset[str] | None = None


# the torch module path the exporter records on each node, and the op that exports as a
# Loop over data-dependent bags
_TORCH_SCOPE = "pkg.torch.onnx.class_hierarchy"
_EMBEDDING_BAG = "embedding_bag"


def parse_input_shapes(specs: Sequence[str] | None) -> dict[str, tuple[int, ...]]:
    """Parse ``NAME=8x128`` strings (the ``--input-shape`` option)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs or ():
        name, sep, dims = spec.rpartition("=")
        if not sep or not name or not re.fullmatch(r"\d+(x\d+)*", dims):
            raise DynamicShapeError(
                f"--input-shape {spec!r} is not NAME=D0xD1x...; e.g. input_ids=8x128"
            )
        shape = tuple(int(d) for d in dims.split("x"))
        if 0 in shape:
            raise DynamicShapeError(f"--input-shape {spec!r}: every dimension must be at least 1")
        shapes[name] = shape
    return shapes


def _read_proto(path: str, load_weights: bool) -> onnx.ModelProto:
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file; give the path of an .onnx model")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, not an .onnx file")
    try:
        # Binary ONNX whatever the name ends with: onnx.load would read a ``.json`` or
        # ``.txt`` file as a text serialisation and fail in the JSON or text parser.
        model = onnx.load(path, format="protobuf", load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"{path}: not a readable ONNX model ({first}); the file may be truncated "
            "or not ONNX: re-export or re-download it"
        ) from None
    if not model.HasField("graph") or len(model.graph.node) == 0:
        raise ModelLoadError(
            f"{path}: holds no ONNX graph (not an ONNX model, or truncated); re-export it"
        )
    base_dir = os.path.dirname(os.path.abspath(path))
    try:
        check_locations(model, base_dir)
        if load_weights:
            check_extents(model, base_dir)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if load_weights:
        try:
            onnx.load_external_data_for_model(model, base_dir)
        except (RuntimeError, ValueError, OSError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ModelLoadError(
                f"{path}: cannot read its external data ({first}); keep the data files "
                "next to the model"
            ) from None
    return model


def _opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 0


def _upgrade_opset(model: onnx.ModelProto, path: str) -> onnx.ModelProto:
    version = _opset(model)
    if version < MIN_OPSET or version > MAX_OPSET:
        raise ModelLoadError(
            f"{path}: ai.onnx opset {version} is outside the supported range "
            f"{MIN_OPSET}..{MAX_OPSET}; re-export with opset {TARGET_OPSET}"
        )
    if version >= TARGET_OPSET:
        return model
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, TARGET_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeErrors
        raise ModelLoadError(
            f"{path}: cannot convert opset {version} to {TARGET_OPSET} ({exc}); "
            f"re-export the model with opset {TARGET_OPSET} or newer"
        ) from None


def _pin_inputs(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]], path: str) -> None:
    names = {i.name for i in model.graph.input}
    for name in shapes:
        if name not in names:
            raise DynamicShapeError(
                f"{path}: --input-shape names {name!r}, which is not a model input "
                f"(inputs: {', '.join(sorted(names))})"
            )
    for inp in model.graph.input:
        if inp.name not in shapes:
            continue
        tshape = inp.type.tensor_type.shape
        dims = shapes[inp.name]
        if len(tshape.dim) != len(dims):
            raise DynamicShapeError(
                f"{path}: input {inp.name!r} has rank {len(tshape.dim)}, but --input-shape "
                f"gives {len(dims)} dims"
            )
        for i, (d, size) in enumerate(zip(tshape.dim, dims, strict=True)):
            if d.dim_value > 0 and d.dim_value != size:
                # a static dimension is the model's own: the weights are sized to it
                shown = "x".join(str(x.dim_value) if x.dim_value > 0 else "?" for x in tshape.dim)
                kept = "x".join(
                    str(x.dim_value) if x.dim_value > 0 else str(n)
                    for x, n in zip(tshape.dim, dims, strict=True)
                )
                raise DynamicShapeError(
                    f"{path}: input {inp.name!r} dimension {i} is {d.dim_value} in the "
                    f"model ({shown}), but --input-shape gives {size}; only dynamic "
                    f"dimensions ('?') can be pinned: give {inp.name}={kept}, or re-export "
                    "the model with that dimension dynamic"
                )
        for d, size in zip(tshape.dim, dims, strict=True):
            d.ClearField("dim_param")
            d.dim_value = size
    # Stale intermediate annotations would fight the pinned shapes.
    del model.graph.value_info[:]
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")


def _check_inputs_static(model: onnx.ModelProto, path: str) -> None:
    inits = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        if not tt.HasField("shape"):
            raise DynamicShapeError(
                f"{path}: input {inp.name!r} has no shape; pin it with "
                f"--input-shape {inp.name}=D0xD1..."
            )
        for k, dim in enumerate(tt.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                continue
            label = dim.dim_param or "?"
            raise DynamicShapeError(
                f"{path}: input {inp.name!r} dimension {k} is dynamic ({label!r}); pin it with "
                f"--input-shape {inp.name}="
                + "x".join(str(d.dim_value) if d.dim_value > 0 else "N" for d in tt.shape.dim)
                + " (N = the size you train with), or re-export with static shapes"
            )


# Float initializers above this size enter shape inference as shape-only references.
SHAPE_ONLY_BYTES = 1 << 16
_FLOAT_ITEMSIZE = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.DOUBLE: 8,
}


def _shape_only(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A stand-in with ``tensor``'s name, type and dims, and no data."""
    stub = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type)
    stub.dims.extend(tensor.dims)
    stub.data_location = onnx.TensorProto.EXTERNAL
    stub.external_data.add(key="location", value="__tensoropt_shape_only__")
    return stub


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every set field of proto message ``src`` except ``skip`` into ``dst``."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # repeated
            getattr(dst, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):  # message
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def without_large_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose large float initializers hold no data.

    ONNX shape inference serializes the whole model and parses it back; with the
    weights inside, a GPT-2-size model costs several copies of its weights in time
    and memory. Large float tensors are never shape or index operands, so inference
    needs only their type and dims.
    """
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    for tensor in model.graph.initializer:
        itemsize = _FLOAT_ITEMSIZE.get(tensor.data_type, 0)  # ByteSize() walks the data
        big = itemsize * math.prod(tensor.dims) > SHAPE_ONLY_BYTES
        light.graph.initializer.append(_shape_only(tensor) if big else tensor)
    return light


def _infer(model: onnx.ModelProto, path: str) -> onnx.ModelProto:
    """Shape inference (with data propagation) whose results are written into ``model``."""
    try:
        inferred = onnx.shape_inference.infer_shapes(
            without_large_weights(model), strict_mode=False, data_prop=True
        )
    except Exception as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path}: ONNX shape inference failed: {msg}") from None
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    for out, found in zip(model.graph.output, inferred.graph.output, strict=True):
        out.type.CopyFrom(found.type)
    return model


def _check_references(proto: onnx.ModelProto, path: str) -> None:
    """Every input a node of the main graph reads is made by a node or is a graph input
    or initializer (a damaged or hand-edited file can name one that nothing makes;
    nothing downstream could give it a shape)."""
    graph = proto.graph
    made = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    made |= {t.values.name for t in graph.sparse_initializer}
    made |= {out for node in graph.node for out in node.output}
    for node in graph.node:
        for name in node.input:
            if name and name not in made:
                raise ModelLoadError(
                    f"{path}: node {node.name or '?'!r} ({node.op_type}) reads {name!r}, which "
                    "no node, graph input or initializer makes; the file is damaged or "
                    "incomplete: export it again"
                )


def _check_all_static(graph: ir.Graph, path: str) -> None:
    for node in graph:
        for value in node.outputs:
            shape = value.shape
            static = shape is not None and all(isinstance(d, int) and d >= 0 for d in shape)
            if static and value.dtype is not None:
                continue
            raise DynamicShapeError(
                f"{path}: output {value.name!r} of node {node.name!r} ({node.op_type}) has no "
                f"static shape after inference (found {shape}); pin the model inputs with "
                "--input-shape NAME=D0xD1... or re-export with static shapes"
            )


def _check_supported(graph: ir.Graph, supported: frozenset[str], path: str) -> None:
    bad: dict[str, list[str]] = {}
    for node in graph:
        if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
            key = (
                node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
            )
            bad.setdefault(key, []).append(node.name or "?")
    if bad:
        parts = []
        for op, names in sorted(bad.items()):
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{op} (nodes {shown})")
        raise UnsupportedOpError(
            f"{path}: unsupported ops: {'; '.join(parts)}; re-export without them "
            "(e.g. torch.onnx.export(..., dynamo=True)) or file an issue for the op"
        )


def _name_and_tag(graph: ir.Graph) -> None:
    seen: set[str] = set()
    for k, node in enumerate(graph):
        name = node.name
        if not name or name in seen:
            name = f"{node.op_type}_{k}"
            while name in seen:
                name += "_"
            node.name = name
        seen.add(name)
        node.metadata_props.setdefault(ROLE_KEY, Role.FORWARD.value)
        node.metadata_props.setdefault(UNIT_KEY, name)


def import_model(path: str | os.PathLike, options: ImportOptions | None = None) -> ir.Model:
    """Read, upgrade, shape-infer and check an ONNX model; return the IR."""
    options = options or ImportOptions()
    path = os.fspath(path)
    proto = _read_proto(path, options.load_weights)
    _check_references(proto, path)
    if options.input_shapes:
        _pin_inputs(proto, options.input_shapes, path)
    _check_inputs_static(proto, path)
    proto = _upgrade_opset(proto, path)
    proto = _infer(proto, path)
    proto, folded = fold_shapes(proto, lambda m: _infer(m, path))
    if folded:
        log.info(
            "%s: %d constant shape computations or sequences folded (ir/fold.py)", path, folded
        )
    model = ir.serde.deserialize_model(proto)
    for value in model.graph.initializers.values():  # the folds' mark is the tensor's
        tensor = value.const_value
        if tensor is not None and MADE_KEY in tensor.metadata_props:
            value.metadata_props[MADE_KEY] = tensor.metadata_props[MADE_KEY]
    if not options.load_weights:
        _fix_external_base_dir(model, os.path.dirname(os.path.abspath(path)))
    graph = model.graph
    flow = [n for n in graph if any(a.type in _GRAPH_ATTRS for a in n.attributes.values())]
    if flow:
        names = ", ".join(f"{n.op_type} ({n.name})" for n in flow)
        fix = "export with loops unrolled"
        if any(_EMBEDDING_BAG in n.metadata_props.get(_TORCH_SCOPE, "") for n in flow):
            fix = (
                "nn.EmbeddingBag exports as a Loop over its bags: for bags of one size, use "
                "nn.Embedding on the [batch, bag] indices and .sum(1), .mean(1) or .amax(1) "
                "(per_sample_weights: multiply before the sum)"
            )
        raise UnsupportedOpError(f"{path}: control flow is not supported: {names}; {fix}")
    _retie_transposed_copies(graph)
    _merge_equal_copies(graph)
    _collapse_broadcast_copies(graph)
    _regather_copies(graph)
    _add_dropout_masks(graph)
    for what, count in canonicalize(graph, path).items():
        if count:
            log.info("%s: %d %s rewritten (ir/canonical.py)", path, count, what)
    _hoist_shared_views(graph)
    _name_and_tag(graph)
    if options.supported_ops is not None:
        _check_supported(graph, options.supported_ops, path)
    _check_all_static(graph, path)
    log.info("imported %s: %d nodes, opset %d", path, len(graph), _opset(proto))
    return model


FOLDED_FROM_KEY = "pkg.onnxscript.optimizer.folded_from"


def _folded_from(value: ir.Value) -> list[str]:
    """Source value names the onnxscript optimizer recorded for a folded initializer."""
    raw = value.metadata_props.get(FOLDED_FROM_KEY)
    if not raw:
        return []
    try:
        names = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return []
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else []


def _retie_transposed_copies(graph: ir.Graph) -> None:
    """Restore ties that ``torch.onnx.export(dynamo=True)`` broke by folding Transposes.

    The exporter's optimizer stores ``Linear`` weights pre-transposed under new names
    and records the source in ``pkg.onnxscript.optimizer.folded_from``. When the source
    weight is still an initializer (it has another use, e.g. a GPT-2 ``lm_head`` tied to
    the token embedding), the file holds two copies of one torch parameter, which
    would be trained apart. A copy whose recorded source is a single initializer that
    it equals transposed becomes a ``Transpose`` node of that source again.
    """
    for name, value in list(graph.initializers.items()):
        sources = _folded_from(value)
        if len(sources) != 1 or sources[0] not in graph.initializers:
            continue
        source = graph.initializers[sources[0]]
        copy, orig = value.const_value, source.const_value
        if copy is None or orig is None or len(copy.shape) != 2 or len(orig.shape) != 2:
            continue
        if copy.dtype != orig.dtype or not np.array_equal(copy.numpy(), orig.numpy().T):
            continue
        graph.initializers.pop(name)
        value.const_value = None
        value.metadata_props.pop(FOLDED_FROM_KEY, None)
        node = ir.Node(
            "",
            "Transpose",
            [source],
            [ir.AttrInt64s("perm", [1, 0])],
            outputs=[value],
            name=f"retie_{name}",
        )
        graph.insert_before(graph.node(0), node)
        log.info(
            "initializer %s is %s transposed: tied again through a Transpose", name, source.name
        )


# ops that only lay a tensor out anew: a view of a parameter made by one of them reads
# nothing the step computes
_VIEW_OPS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity"})


def _hoist_shared_views(graph: ir.Graph) -> None:
    """Move each view of a parameter that other nodes also read (a ``Transpose`` of a
    tied embedding for the output layer, in an export without the optimizer's folding)
    to the start of the graph, where :func:`_retie_transposed_copies` puts the same
    view of an optimized export. It then runs with the parameter's first reader, in the
    first block: a pipeline stage cut between the two readers sends the view forward per
    micro-batch and its gradient back, where the view left beside the later reader
    would make that stage read the parameter too, which compile refuses. It reads only
    initializers, so the move keeps the graph's order valid and every value as it was."""
    first = None
    for node in list(graph):
        if node.op_type not in _VIEW_OPS or node.domain not in ("", "ai.onnx"):
            continue
        if not node.inputs or any(v is None or not v.is_initializer() for v in node.inputs):
            continue
        param = node.inputs[0]
        if param.dtype is None or not param.dtype.is_floating_point():
            continue
        readers = {id(use.node) for use in param.uses()}
        if len(readers) < 2:
            continue
        graph.remove(node)
        if first is None:
            graph.insert_before(graph.node(0), node)
        else:
            graph.insert_after(first, node)
        first = node
        log.info("view %s of the shared parameter %s moved to the start", node.name, param.name)


def _merge_equal_copies(graph: ir.Graph) -> None:
    """One initializer for the equal copies the optimizer folded from one parameter.

    A parameter read in several places (ALBERT's one layer, run once per layer) may be
    folded once per place (the transposed weight of each use), under different names;
    trained apart, the copies drift from torch's one parameter after a step. Float
    initializers whose only recorded source is the same name, with the same type, shape
    and values, are one: every reader of the others reads the first, and the gradient
    sums their uses, as torch's does. A constant tensor is left alone (two different
    views of a constant parameter can be equal). Values are read only where two such
    candidates exist (from the external data file in a search, so a search and compile
    build the same step)."""
    groups: dict[tuple, list[ir.Value]] = {}
    for value in graph.initializers.values():
        sources = _folded_from(value)
        if len(sources) != 1 or value.is_graph_output() or value.shape is None:
            continue
        key = (sources[0], value.dtype, tuple(value.shape.numpy()))
        groups.setdefault(key, []).append(value)
    for (source, _, _), copies in groups.items():
        if len(copies) < 2:
            continue
        try:
            arrays = [_copy_values(v) for v in copies]
        except (OSError, ValueError):
            continue
        first, kept = copies[0], arrays[0]
        if kept is None or kept.size < 2 or np.all(kept == kept.flat[0]):
            continue
        for value, array in zip(copies[1:], arrays[1:], strict=True):
            if array is None or not np.array_equal(array, kept):
                continue
            for use in list(value.uses()):
                use.node.replace_input_with(use.idx, first)
            graph.initializers.pop(value.name)
            log.info("initializer %s equals %s (both folded from %s): one", value.name,
                     first.name, source)  # fmt: skip


def _copy_values(value: ir.Value) -> np.ndarray | None:
    tensor = value.const_value
    if tensor is None or tensor.size > _COPIES_READ:
        return None
    array = tensor.numpy()
    return array if np.issubdtype(array.dtype, np.floating) else None


# the exporter names a value after the torch op that made it: these repeat their input
REPLICATING = re.compile(r"(expand|embedding|index|index_select|repeat|tile|gather)(_\d+)?")


_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Where"})
_COPIES_READ = 1 << 26  # elements (256 MiB of float32): larger folded copies stay


def _repeating_copies(graph: ir.Graph):
    """(name, value, recorded sources, float values) of each initializer the exporter
    folded through an op that repeats its input (``REPLICATING``, in its name or its
    sources), of 2 to ``_COPIES_READ`` elements, whose values can be read (from the
    external data file where the weights are not loaded; an unreadable one is left to
    compile, which reports the file)."""
    for name, value in list(graph.initializers.items()):
        sources = _folded_from(value)
        if not sources or value.is_graph_output():
            continue
        if not any(REPLICATING.fullmatch(n) for n in (name, *sources)):
            continue
        tensor = value.const_value
        if tensor is None or not 2 <= tensor.size <= _COPIES_READ:
            continue
        try:
            array = tensor.numpy()
        except (OSError, ValueError):
            continue
        if np.issubdtype(array.dtype, np.floating):
            yield name, value, sources, array


def _collapse_broadcast_copies(graph: ir.Graph) -> None:
    """Give back the parameter of a folded copy that broadcasts it.

    The exporter's optimizer folds what constants compute, parameters included: BART's
    learned positions looked up at ``arange`` and expanded to the batch (``[B, S, D]``),
    BERT's token-type row 0 looked up at the all-zero ``token_type_ids`` buffer
    (``[B, S, D]``, one row everywhere), ViT's class token expanded to the batch
    (``[B, 1, D]``). Trained as they are, each copy learns on its own
    (torch sums their gradients into one parameter), and a batch-sized parameter cannot
    be split into micro-batches. A float initializer folded through an op that repeats
    its input (``REPLICATING``, in its name or its recorded sources) and identical along
    some axes becomes its first slice along them: a broadcasting elementwise op that
    makes the same shape from the slice reads it as it is, and its gradient sums the
    copies, as torch's does. A tensor identical along every axis (a
    zero or constant parameter's copy) is left as it is: which axes repeat cannot be
    told from its values. Another reader (ViT's class token, expanded to the batch and
    concatenated) reads ``Expand(slice, shape)``, which a data-parallel completion lays
    out like the batch (``annotate._Completion._batch_like``). Where the parameter is
    also read directly, it is still an initializer among the copy's recorded sources and
    equals the slice: the slice is that initializer (:func:`_source_equal_to`).

    The candidates' values are read even where the weights are not loaded (a search
    reads them from the external data file), so a search and compile build the same
    step; a candidate above ``_COPIES_READ`` elements is left as it is in both.
    """
    for name, value, sources, array in _repeating_copies(graph):
        axes = [a for a in range(array.ndim) if array.shape[a] > 1 and constant_along(array, a)]
        if not axes or all(array.shape[a] == 1 or a in axes for a in range(array.ndim)):
            continue
        first = array[tuple(slice(0, 1) if a in axes else slice(None) for a in range(array.ndim))]
        uses = list(value.uses())
        if not uses:
            continue
        graph.initializers.pop(name)
        value.name = f"{name}__copies"
        param = _source_equal_to(graph, sources, first, value.dtype)
        if param is None:
            param = _initializer(graph, name, first, value.dtype, value.metadata_props)
        expanded = None  # for the readers that do not broadcast: Expand(slice, shape)
        for use in uses:
            if _broadcasts(use, first.shape):
                use.node.replace_input_with(use.idx, param)
                continue
            if expanded is None:
                expanded = _expand_node(graph, param, list(array.shape), value)
            use.node.replace_input_with(use.idx, expanded)
        log.info(
            "initializer %s %s repeats its first slice along axes %s: trained as that "
            "slice, which its readers broadcast",
            name,
            list(array.shape),
            axes,
        )


def _regather_copies(graph: ir.Graph) -> None:
    """Give back the table of a folded copy that gathers its rows at constant positions.

    T5's and Swin's relative position bias is a table ``[buckets, heads]`` gathered at
    constant buckets and permuted, which the exporter's optimizer folds into one
    ``[1, heads, T, T]`` tensor: trained as it is, each copy of a row learns on its own,
    where torch sums their gradients into the row. A float initializer folded through a
    repeating op (``REPLICATING``), not a broadcast copy (:func:`_collapse_broadcast_copies`
    gave those back), becomes ``Transpose(Gather(table, positions))``: along an axis of
    two or more, its vectors repeat, and ``table`` holds each distinct vector once (in
    the order of first use), ``positions`` (int64, made here) which one each place reads.
    The gradient then sums the copies of each row, as torch's does.

    The table is the parameter only where its values say so: every one of its scalars
    differs from every other (each is one element of the torch parameter; a table whose
    values repeat within or across rows is left as it is, and warned of by the trainable
    selection), and of the axes where that holds the one with the fewest distinct
    vectors is taken. Two rows of the torch table that are equal in every element are
    trained as one (fresh zero-initialised rows; a trained or random table has none).
    Values are read even where the weights are not loaded, so a search and compile
    build the same step."""
    for name, value, _, array in _repeating_copies(graph):
        if not value.uses() or np.unique(array).size == array.size:
            continue  # no value repeats: nothing is a copy
        found = _gathered_table(array)
        if found is None:
            continue
        table, positions, axis = found
        graph.initializers.pop(name)
        value.name = f"{name}__copies"
        param = _initializer(graph, name, table, value.dtype, value.metadata_props)
        at = _initializer(
            graph, f"{name}__positions", positions, ir.DataType.INT64, {MADE_KEY: "import"}
        )
        value.const_value = None
        first = graph.node(0)
        perm = [*range(axis), array.ndim - 1, *range(axis, array.ndim - 1)]
        if perm == list(range(array.ndim)):
            nodes = [ir.Node("", "Gather", [param, at], outputs=[value], name=f"gather_{name}")]
        else:
            gathered = ir.Value(
                name=f"{name}__gathered",
                shape=ir.Shape([*positions.shape, table.shape[1]]),
                type=ir.TensorType(value.dtype),
            )
            nodes = [
                ir.Node("", "Gather", [param, at], outputs=[gathered], name=f"gather_{name}"),
                ir.Node("", "Transpose", [gathered], attributes=[ir.AttrInt64s("perm", perm)],
                        outputs=[value], name=f"transpose_{name}"),
            ]  # fmt: skip
        for node in nodes:
            graph.insert_before(first, node)
        log.info(
            "initializer %s %s gathers %d rows of %d values at constant positions: "
            "trained as that table",
            name,
            list(array.shape),
            table.shape[0],
            table.shape[1],
        )


def _gathered_table(array: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(table, positions, axis) with ``array == moveaxis(table[positions], -1, axis)``,
    where ``table``'s rows are ``array``'s distinct vectors along ``axis`` in the order of
    first use, they repeat, and no scalar of ``table`` equals another; of the axes that
    qualify, the one with the fewest rows. None when none does."""
    best = None
    for axis in range(array.ndim):
        width = array.shape[axis]
        if width < 2:
            continue
        vectors = np.ascontiguousarray(np.moveaxis(array, axis, -1)).reshape(-1, width)
        rows = vectors.view(np.dtype((np.void, width * vectors.itemsize))).ravel()
        _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
        if len(first) == len(rows) or (best is not None and len(first) >= len(best[0])):
            continue
        order = np.argsort(first)  # the distinct vectors in the order of first use
        table = vectors[first[order]]
        if np.unique(table).size != table.size:
            continue
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        shape = np.moveaxis(array, axis, -1).shape[:-1]
        best = (np.ascontiguousarray(table), rank[inverse].reshape(shape).astype(np.int64), axis)
    return best


def _source_equal_to(
    graph: ir.Graph, sources: list[str], first: np.ndarray, dtype
) -> ir.Value | None:
    """The one recorded source of a folded copy that is still an initializer and equals
    its slice ``first`` (the parameter read directly elsewhere, as well as broadcast),
    else None. The slice is then that parameter: one initializer, trained once."""
    found = []
    for source in dict.fromkeys(sources):
        value = graph.initializers.get(source)
        if value is None or value.dtype != dtype or value.is_graph_output():
            continue
        if value.shape is None or tuple(value.shape.numpy()) != first.shape:
            continue
        try:
            array = _copy_values(value)
        except (OSError, ValueError):
            continue
        if array is not None and np.array_equal(array, first):
            found.append(value)
    return found[0] if len(found) == 1 else None


def _initializer(graph: ir.Graph, name: str, array: np.ndarray, dtype, metadata) -> ir.Value:
    """A new initializer ``name`` of ``dtype`` holding ``array``, with ``metadata``."""
    array = np.ascontiguousarray(array)
    value = ir.Value(
        name=name,
        shape=ir.Shape(list(array.shape)),
        type=ir.TensorType(dtype),
        const_value=ir.tensor(array, name=name),
    )
    value.metadata_props.update(metadata)
    graph.register_initializer(value)
    return value


def _expand_node(graph: ir.Graph, param: ir.Value, shape: list[int], like: ir.Value) -> ir.Value:
    """``Expand(param, shape)`` before the graph's first node; its output is ``like``."""
    dims = _initializer(
        graph, f"{param.name}__shape", np.asarray(shape, np.int64), ir.DataType.INT64,
        {MADE_KEY: "import"},
    )  # fmt: skip
    like.const_value = None
    node = ir.Node("", "Expand", [param, dims], outputs=[like], name=f"expand_{param.name}")
    graph.insert_before(graph.node(0), node)
    return like


def _broadcasts(use, shape: tuple[int, ...]) -> bool:
    """Whether ``use``'s node makes the same output from a value of ``shape`` in place
    of the one it reads (a broadcasting elementwise op whose other inputs cover it)."""
    node = use.node
    if node.op_type not in _BROADCASTING or node.domain not in ("", "ai.onnx"):
        return False
    out = node.outputs[0].shape
    if out is None or not out.is_static():
        return False
    shapes = []
    for i, v in enumerate(node.inputs):
        if v is None or v.shape is None or not v.shape.is_static():
            return False
        shapes.append(shape if i == use.idx else tuple(v.shape.numpy()))
    try:
        made = np.broadcast_shapes(*shapes)
    except ValueError:
        return False
    return tuple(made) == tuple(out.numpy())


def _add_dropout_masks(graph: ir.Graph) -> None:
    """Give every Dropout without a mask output one (train-mode torch exports).

    ``torch.onnx.export`` of a model in ``train()`` mode emits
    ``Dropout(x, ratio, training_mode=True)`` with the output only; the backward
    needs the mask the forward drew. A second output makes the node return it;
    inference-mode Dropouts are unaffected (their mask is all true and unused).
    """
    for node in list(graph):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.outputs) >= 2:
            continue
        out = node.outputs[0]
        replacement = ir.Node(
            "",
            "Dropout",
            list(node.inputs),
            list(node.attributes.values()),
            num_outputs=2,
            name=node.name,
            metadata_props=dict(node.metadata_props),
        )
        new_out, mask = replacement.outputs
        graph.insert_after(node, replacement)
        ir.convenience.replace_all_uses_with(out, new_out, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        new_out.name, new_out.shape, new_out.type = out.name, out.shape, out.type
        mask.name, mask.shape = f"{out.name}__mask", out.shape
        mask.type = ir.TensorType(ir.DataType.BOOL)


def _fix_external_base_dir(model: ir.Model, base_dir: str) -> None:
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and not tensor.base_dir:
            tensor.base_dir = base_dir


def export_model(model: ir.Model) -> onnx.ModelProto:
    """The IR as an ONNX ModelProto."""
    return ir.serde.serialize_model(model)
