"""Fixtures of the runtime tests: hand-built output directories (no compiler needed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from tests.helpers.handbuilt import Case, a2a_case, mlp_case, write_outdir

CASES: dict[str, Callable[[], Case]] = {
    "megatron_tp2": lambda: mlp_case(dp=1, tp=2),
    "dp2": lambda: mlp_case(dp=2, tp=1),
    "dp4": lambda: mlp_case(dp=4, tp=1),
    "dp2_tp2": lambda: mlp_case(dp=2, tp=2),
    "a2a2": lambda: a2a_case(2),
    "a2a4": lambda: a2a_case(4),
    "single": lambda: mlp_case(dp=1, tp=1),
}


@pytest.fixture(scope="session")
def outdirs(tmp_path_factory) -> Callable[[str], Path]:
    """``outdirs(name)``: the output directory of a hand-built case (written once)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_outdir(CASES[name](), tmp_path_factory.mktemp(name))
        return made[name]

    return get


def reference_run(outdir: Path, batches: list[dict[str, np.ndarray]]):
    """Plain onnxruntime over annotated.onnx (independent of the runtime's code)."""
    import json

    import onnx

    model = onnx.load(str(outdir / "annotated.onnx"))
    step = json.loads((outdir / "manifest.json").read_text())["step"]
    wanted = set(step["params"]) | set(step["states"])
    state = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in wanted}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    losses = []
    for batch in batches:
        out = dict(zip(names, sess.run(names, {**batch, **state}), strict=True))
        losses.append(float(out["loss"]))
        state = {dst: out[src] for src, dst in step["carry"].items()}
    return losses, state
