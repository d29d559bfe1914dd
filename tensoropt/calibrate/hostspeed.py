"""How fast this host computes now, against when the profile was calibrated.

A VM's vCPUs run at the speed the host gives them at the moment: an estimate is made at
the calibration's speed, a measurement is taken at the speed of its minute
(docs/design/measured.md, "Host speed").

:class:`Reference` times a fixed onnxruntime graph on one thread (a MatMul of
``ROWS x SIDE`` by ``SIDE x SIDE``, a Tanh and a Mul: compute-bound and element-wise
work). ``calibrate`` times it before every compute pass and after the last, and keeps
the median in the profile (``calibration.host_reference_s``); ``validate`` times it
before and after every plan. Their ratio (:func:`host_ratio`: > 1, the host ran slower
than at calibration) scales the estimate in validate's host-corrected error, reported
beside the raw error: the raw one is the estimate's error, the corrected one what is
left of it once the host's drift is taken out.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

ROWS, SIDE = 256, 1024
REFERENCE_SECONDS = 0.3  # timing per measurement: ~100 runs of ~3 ms


def reference_model():
    """Y = Tanh(X @ W) * X, X: ROWS x SIDE, W: SIDE x SIDE (float32, W a constant)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((SIDE, SIDE)).astype(np.float32) / SIDE**0.5
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("Mul", ["t", "x"], ["y"]),
        ],
        "host_reference",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, SIDE])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


class Reference:
    """The reference graph in one onnxruntime session on one thread (built once)."""

    def __init__(self) -> None:
        import onnxruntime as ort

        from tensoropt.runtime.program import SessionConfig

        opts = SessionConfig(intra_op_threads=1, inter_op_threads=1).options()
        self._session = ort.InferenceSession(
            reference_model().SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        x = np.random.default_rng(1).standard_normal((ROWS, SIDE)).astype(np.float32)
        self._feeds = {"x": x}
        self._session.run(None, self._feeds)  # warm: the first run allocates

    def measure(self, seconds: float = REFERENCE_SECONDS) -> float:
        """Median wall seconds of one run, over runs for ``seconds``."""
        times: list[float] = []
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            self._session.run(None, self._feeds)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            if t1 - start >= seconds and len(times) >= 3:
                return float(statistics.median(times))


def calibrated_reference(profile: dict) -> float | None:
    """The profile's ``calibration.host_reference_s``; None for a profile without one
    (built-in, or calibrated before the reference existed)."""
    value = (profile.get("calibration") or {}).get("host_reference_s")
    return float(value) if value else None


def host_ratio(now: list[float], calibrated: float | None) -> float | None:
    """Mean reference time now over the calibrated one (> 1: the host runs slower now)."""
    if not now or not calibrated:
        return None
    return float(np.mean(now)) / calibrated


def drift(references: list[float]) -> float | None:
    """How far the host's speed moved over a calibration: the slowest reference timing
    over the fastest, less one (0.2: the slowest run took 20% longer); None with fewer
    than two timings."""
    if len(references) < 2 or min(references) <= 0:
        return None
    return max(references) / min(references) - 1.0
