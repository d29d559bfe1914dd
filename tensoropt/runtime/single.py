"""Single-device execution of a training-step graph in onnxruntime.

Used by ``tensoropt train``, by ``run --verify`` as the reference, and as the
1-device baseline in benchmarks. The graph has no collectives.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from tensoropt.passes.training_step import StepSignature, read_signature
from tensoropt.runtime.arena import ArenaMode, apply_arena
from tensoropt.runtime.external import load_graph, read_initializer


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """Shared ORT options: full graph optimisation, quiet logs, optional thread cap."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 4  # errors come back as exceptions, said once
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return opts


class StepSession:
    """One onnxruntime session over a training-step graph, with its state names.

    From a ModelProto (``tensoropt train``) the graph's initializers are the initial
    state. From a path (``run --verify``'s ``annotated.onnx``) onnxruntime reads the
    file and its external data itself, so the weights never pass through protobuf;
    such a file may leave the trained parameters and optimizer states without values
    (graph inputs only): :meth:`initial_state` is then empty and the caller feeds them.
    """

    def __init__(
        self,
        model: onnx.ModelProto | str | os.PathLike,
        *,
        threads: int | None = None,
        arena: ArenaMode | None = None,
    ):
        opts = session_options(threads)
        if arena is not None:  # e.g. the process's shared arena, next to a rank's segments
            apply_arena(opts, arena)
        if isinstance(model, onnx.ModelProto):
            self.signature: StepSignature = read_signature(model)
            self._initial = _initial_values(model, self.signature)
            source: bytes | str = model.SerializeToString()
        else:
            path = Path(os.fspath(model))
            proto = load_graph(path)  # no weight bytes; external locations checked
            self.signature = read_signature(proto)
            self._initial = _stored_values(proto, self.signature, path.parent)
            source = str(path)
        self._session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        self._carry = dict(self.signature.carry)

    def initial_state(self) -> dict[str, np.ndarray]:
        """Parameters and optimizer state at step 0 (copies)."""
        return {k: v.copy() for k, v in self._initial.items()}

    def step(
        self, state: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> tuple[float, dict[str, np.ndarray]]:
        """Run one training step; return the loss and the next state."""
        feeds = {**batch, **state}
        results = self._session.run(self._outputs, feeds)
        new_state: dict[str, np.ndarray] = {}
        loss = float("nan")
        for name, value in zip(self._outputs, results, strict=True):
            if name == self.signature.loss:
                loss = float(value)
            elif name in self._carry:
                new_state[self._carry[name]] = value
        return loss, new_state


def _initial_values(proto: onnx.ModelProto, sig: StepSignature) -> dict[str, np.ndarray]:
    wanted = set(sig.params) | set(sig.states)
    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if t.name in wanted}
    missing = wanted - values.keys()
    if missing:
        raise ValueError(f"training step lacks initial values for {sorted(missing)}")
    return values


def _stored_values(proto: onnx.ModelProto, sig: StepSignature, base: Path) -> dict:
    """The initial state stored in a step file: all of it, or nothing if any is absent."""
    wanted = set(sig.params) | set(sig.states)
    tensors = {t.name: t for t in proto.graph.initializer if t.name in wanted}
    if tensors.keys() != wanted:
        return {}
    return {name: read_initializer(t, base) for name, t in tensors.items()}
