"""Single-device execution of a training-step graph in onnxruntime.

Used by ``tensoropt train``, by ``run --verify`` as the reference, and as the
1-device baseline in benchmarks. The graph has no collectives.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from tensoropt.passes.training_step import StepSignature, read_signature


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """Shared ORT options: full graph optimisation, quiet logs, optional thread cap."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return opts


class StepSession:
    """One onnxruntime session over a training-step graph, with its state names."""

    def __init__(self, model: onnx.ModelProto | str | os.PathLike, *, threads: int | None = None):
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))
        self.signature: StepSignature = read_signature(proto)
        self._initial = _initial_values(proto, self.signature)
        self._session = ort.InferenceSession(
            proto.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"]
        )
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
