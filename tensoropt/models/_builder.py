"""A small graph builder for the zoo: nodes, parameters and constants by name.

Why not ``onnx.helper`` alone: the zoo needs two things helper does not give.
Parameters are recorded as *specs* (name, shape, how to initialise) and only turned
into tensors at the end, so a model whose weights are too large to hold (the
``paper`` presets) can get external-data stubs instead, without a single weight
array ever being allocated. And node and tensor names are made unique and readable
(``h0/attn/q_proj/MatMul``), which keeps graphs easy to read in tests and plans.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import tensoropt

OPSET = 20
IR_VERSION = 10
EXTERNAL_THRESHOLD_BYTES = 64 * 1024 * 1024
"""Above this many bytes of initializers a model gets zero-valued external-data stubs."""
EXTERNAL_ALIGN = 4096
"""Each external tensor starts on a page boundary (as onnx's own writer does), so
runtimes may memory-map it."""
PLACEHOLDER_LOCATION = "weights.data"
"""External-data location until :func:`tensoropt.models.save_model` names the sidecar."""
ZOO_METADATA_KEY = "tensoropt.zoo"


class Init(enum.Enum):
    """How an initializer is filled when weights are generated."""

    NORMAL = "normal"
    """Normal(0, scale**2)."""
    CONSTANT = "constant"
    """Every element equals scale."""
    ZEROS = "zeros"
    ONES = "ones"


class WeightStorage(enum.Enum):
    """Where the initializer bytes of a built model live."""

    EMBEDDED = "embedded"
    """Seeded random values inside the model proto."""
    EXTERNAL_ZEROS = "external-zeros"
    """Stubs that point into a sparse sidecar file of zeros (planning only)."""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One initializer before it exists: its name, shape, fill and role."""

    name: str
    shape: tuple[int, ...]
    init: Init
    scale: float = 0.0
    frozen: bool = False

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


@dataclass(frozen=True, slots=True)
class IOSpec:
    """A graph input or output with its full static shape."""

    name: str
    elem_type: int
    shape: tuple[int, ...]


class GraphBuilder:
    """Collects nodes, parameter specs and I/O for one model; see :meth:`finish`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._nodes: list[onnx.NodeProto] = []
        self._params: list[ParamSpec] = []
        self._param_names: set[str] = set()
        self._node_names: Counter[str] = Counter()
        self._inputs: list[IOSpec] = []
        self._outputs: list[IOSpec] = []
        self._shared_consts: dict[str, str] = {}

    # -- inputs, outputs -------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: Sequence[int]) -> str:
        self._inputs.append(IOSpec(name, elem_type, tuple(shape)))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: Sequence[int]) -> str:
        """Expose ``value`` as graph output ``name``.

        The producing node's output is renamed when nothing else reads it (no Identity
        node); otherwise an Identity is added.
        """
        if value != name and not self._rename_output(value, name):
            self._nodes.append(
                helper.make_node("Identity", [value], [name], name=f"{name}/Identity")
            )
        self._outputs.append(IOSpec(name, elem_type, tuple(shape)))
        return name

    def _rename_output(self, value: str, name: str) -> bool:
        if any(value in node.input for node in self._nodes):
            return False
        for node in reversed(self._nodes):
            for i, out in enumerate(node.output):
                if out == value:
                    node.output[i] = name
                    return True
        return False

    # -- parameters ------------------------------------------------------------------
    def param(
        self,
        name: str,
        shape: Sequence[int],
        init: Init = Init.NORMAL,
        scale: float = 0.02,
        *,
        frozen: bool = False,
    ) -> str:
        """Declare a float32 initializer; ``frozen`` ones (BatchNorm statistics) are not trained.

        `scale` is the standard deviation for :attr:`Init.NORMAL` and the value for
        :attr:`Init.CONSTANT`; other fills ignore it.
        """
        if name in self._param_names:
            raise ValueError(f"duplicate parameter name {name!r} in model {self.name}")
        spec = ParamSpec(name, tuple(int(d) for d in shape), init, float(scale), frozen)
        self._params.append(spec)
        self._param_names.add(name)
        return name

    @property
    def params(self) -> tuple[ParamSpec, ...]:
        return tuple(self._params)

    @property
    def inputs(self) -> tuple[IOSpec, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[IOSpec, ...]:
        return tuple(self._outputs)

    # -- nodes -----------------------------------------------------------------------
    def _node_name(self, scope: str, op_type: str) -> str:
        base = f"{scope}/{op_type}" if scope else op_type
        count = self._node_names[base]
        self._node_names[base] += 1
        return base if count == 0 else f"{base}_{count}"

    def op(self, op_type: str, inputs: Sequence[str], scope: str = "", **attrs: object) -> str:
        """Add a single-output node; returns its output name."""
        return self.op_multi(op_type, inputs, 1, scope, **attrs)[0]

    def op_multi(
        self, op_type: str, inputs: Sequence[str], n_out: int, scope: str = "", **attrs: object
    ) -> list[str]:
        """Add a node with ``n_out`` outputs; returns their names."""
        node_name = self._node_name(scope, op_type)
        outs = [f"{node_name}_out{i}" if n_out > 1 else f"{node_name}_out" for i in range(n_out)]
        self._nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, **attrs))
        return outs

    def const(self, value: np.ndarray, scope: str, *, share_key: str | None = None) -> str:
        """A Constant node (not an initializer, so it is never mistaken for a parameter).

        With ``share_key`` one node serves every caller with the same key (the causal
        mask); otherwise each call site gets its own node, so a pass can rewrite one
        Reshape target without touching another.
        """
        if share_key is not None and share_key in self._shared_consts:
            return self._shared_consts[share_key]
        node_name = self._node_name(scope, "Constant")
        out = f"{node_name}_out"
        tensor = numpy_helper.from_array(np.asarray(value), name=f"{node_name}_value")
        self._nodes.append(helper.make_node("Constant", [], [out], name=node_name, value=tensor))
        if share_key is not None:
            self._shared_consts[share_key] = out
        return out

    def shape_const(self, shape: Sequence[int], scope: str) -> str:
        """An int64 vector Constant: a Reshape target or Squeeze/Unsqueeze axes."""
        return self.const(np.asarray(list(shape), dtype=np.int64), scope)

    def scalar(self, value: float, scope: str) -> str:
        return self.const(np.asarray(value, dtype=np.float32), scope)

    # -- common layers ---------------------------------------------------------------
    def linear(self, x: str, d_in: int, d_out: int, scope: str, *, bias: bool = True) -> str:
        """``x @ W + b`` as MatMul then Add, the form the Megatron matcher looks for."""
        w = self.param(f"{_dotted(scope)}.weight", (d_in, d_out), Init.NORMAL, 0.02)
        y = self.op("MatMul", [x, w], scope)
        if not bias:
            return y
        b = self.param(f"{_dotted(scope)}.bias", (d_out,), Init.ZEROS)
        return self.op("Add", [y, b], scope)

    def layer_norm(self, x: str, dim: int, scope: str, eps: float) -> str:
        g = self.param(f"{_dotted(scope)}.weight", (dim,), Init.ONES)
        b = self.param(f"{_dotted(scope)}.bias", (dim,), Init.ZEROS)
        return self.op("LayerNormalization", [x, g, b], scope, axis=-1, epsilon=eps)

    # -- finishing -------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self._params)

    def finish(self, seed: int, metadata: dict[str, object]) -> onnx.ModelProto:
        """Materialise initializers, infer shapes, check outputs, attach metadata.

        Weights above :data:`EXTERNAL_THRESHOLD_BYTES` become zero-valued external-data
        stubs (never allocated); smaller models get seeded random values.
        """
        total = self.weight_bytes()
        storage = (
            WeightStorage.EXTERNAL_ZEROS
            if total > EXTERNAL_THRESHOLD_BYTES
            else WeightStorage.EMBEDDED
        )
        if storage is WeightStorage.EMBEDDED:
            inits = _random_initializers(self._params, seed)
        else:
            inits = _external_stubs(self._params, PLACEHOLDER_LOCATION)
        graph = helper.make_graph(
            self._nodes,
            self.name,
            [_value_info(s) for s in self._inputs],
            [_value_info(s) for s in self._outputs],
            inits,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            ir_version=IR_VERSION,
            producer_name="tensoropt",
            producer_version=tensoropt.__version__,
        )
        meta = dict(metadata)
        meta.update(
            params=sum(p.numel for p in self._params if not p.frozen),
            weight_bytes=total,
            weights=storage.value,
            frozen=[p.name for p in self._params if p.frozen],
        )
        helper.set_model_props(model, {ZOO_METADATA_KEY: json.dumps(meta, sort_keys=True)})
        # Strict inference fails if any declared output shape disagrees with the graph.
        return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _dotted(scope: str) -> str:
    return scope.replace("/", ".")


def _value_info(spec: IOSpec) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(spec.name, spec.elem_type, list(spec.shape))


def _random_initializers(params: Sequence[ParamSpec], seed: int) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    out = []
    for p in params:
        if p.init is Init.NORMAL:
            arr = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(p.scale)
        elif p.init is Init.CONSTANT:
            arr = np.full(p.shape, p.scale, dtype=np.float32)
        elif p.init is Init.ONES:
            arr = np.ones(p.shape, dtype=np.float32)
        else:
            arr = np.zeros(p.shape, dtype=np.float32)
        out.append(numpy_helper.from_array(arr, name=p.name))
    return out


def _external_stubs(params: Sequence[ParamSpec], location: str) -> list[onnx.TensorProto]:
    """TensorProtos that only point into a sidecar file; no data is created."""
    out = []
    offset = 0
    for p in params:
        t = TensorProto()
        t.name = p.name
        t.dims.extend(p.shape)
        t.data_type = TensorProto.FLOAT
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", p.nbytes)):
            entry = t.external_data.add()
            entry.key = key
            entry.value = str(value)
        offset = _align(offset + p.nbytes)
        out.append(t)
    return out


def _align(n: int) -> int:
    return (n + EXTERNAL_ALIGN - 1) // EXTERNAL_ALIGN * EXTERNAL_ALIGN
