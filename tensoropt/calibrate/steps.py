"""Training-step cost of one op: forward + backward + SGD-momentum update, measured.

The cost model charges a unit ``op_time`` (forward + backward) plus ``update_time``
per owned parameter. A forward kernel alone says little about the rest: a step
graph holds ~15 nodes per forward op (the gradient rules' Transposes, Where,
ReduceSum, the optimizer's Mul/Add/Sub), many of them small. So each calibration
case is also built as a training step by the project's own passes
(``build_training_step``: MSE loss, SGD with momentum 0.9) and timed as the slope
between R copies and one copy, which leaves one copy's forward, backward and
update. ``profile.py`` turns ``(step - forward - modelled update) / forward`` into
the backward-to-forward ratio curve that :func:`tensoropt.cost.compute.op_time` uses.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from tensoropt.calibrate.kernels import (
    KernelCase,
    KernelOptions,
    KernelResult,
    build_model,
    measure_case,
    session,
)
from tensoropt.calibrate.stats import Sample, steady_sample
from tensoropt.runtime.program import SessionConfig


def _trainable_forward(case: KernelCase, copies: int) -> onnx.ModelProto:
    """The benchmark model, made trainable and single-output.

    Ops without parameters get a scalar-like weight ``w`` [1] multiplied into the
    input (one extra Mul, in every copy count, so the slope cancels it); copies side
    by side are summed into one output so the loss reaches every copy.
    """
    model = build_model(case, copies)
    graph = model.graph
    if not any(i.dims and i.data_type == onnx.TensorProto.FLOAT for i in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(np.ones(1, np.float32), "w"))
        graph.node.insert(0, helper.make_node("Mul", ["x", "w"], ["xw"], name="scale"))
        for node in graph.node[1:]:
            node.input[:] = ["xw" if n == "x" else n for n in node.input]
    if not case.chain:
        outs = [o.name for o in graph.output]
        graph.node.append(helper.make_node("Sum", outs, ["total"], name="sum"))
        del graph.output[:]
        graph.output.append(helper.make_tensor_value_info("total", 1, list(case.out_shape)))
    return model


def build_train_model(case: KernelCase, copies: int) -> onnx.ModelProto:
    """The training step (one SGD-momentum step under an MSE loss) of ``copies`` copies."""
    from tensoropt.passes.loss import LossKind
    from tensoropt.passes.optimizer import OptimizerOptions
    from tensoropt.passes.training_step import TrainingOptions, build_training_step

    proto = onnx.shape_inference.infer_shapes(_trainable_forward(case, copies), strict_mode=True)
    forward = ir.serde.deserialize_model(proto)
    opts = TrainingOptions(loss=LossKind.MSE, optimizer=OptimizerOptions(momentum=0.9))
    step = build_training_step(forward, opts)
    return ir.serde.serialize_model(step.model)


def _feeds(sess, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for arg in sess.get_inputs():
        shape = [int(d) for d in arg.shape]
        feeds[arg.name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return feeds


def step_runner(case: KernelCase, copies: int, threads: int, rng: np.random.Generator):
    """A warmed-up call of the training step of ``copies`` copies of ``case``."""
    sess = session(build_train_model(case, copies), SessionConfig(intra_op_threads=threads))
    names = [o.name for o in sess.get_outputs()]
    feeds = _feeds(sess, rng)

    def run() -> None:
        sess.run(names, feeds)

    for _ in range(2):
        run()
    return run


def measure_step(case: KernelCase, copies: int, opts: KernelOptions) -> Sample:
    """Seconds of one copy's forward + backward + update inside a training step."""
    rng = np.random.default_rng(2)
    one, many = (step_runner(case, count, opts.threads, rng) for count in (1, copies))
    return steady_sample(lambda: opts.slope(one, many, copies)[0], opts.repeats, opts.max_repeats)


# Copies in the step measured against one copy: small cases (at most SMALL_CASE_BYTES of
# operands and output) take up to 32 copies, larger ones up to 8 (the step's build and
# its memory grow with the copies). A small step (~10-20 us) measured with 8 copies is a
# 100 us difference between two ~50 us-dominated calls; with 32, three processes agreed
# within 6-16% where 8 copies gave 7-27%.
SMALL_CASE_BYTES = 1 << 20
STEP_COPIES = (32, 8)


def step_copies(case: KernelCase, kernel_copies: int) -> int:
    """R of the step slope: the kernel measurement's R, capped by the case's size."""
    return min(kernel_copies, STEP_COPIES[case.traffic > SMALL_CASE_BYTES])


def measure_training_case(
    case: KernelCase, opts: KernelOptions, kernel_copies: int | None = None
) -> tuple[KernelResult, Sample]:
    """One calibration case: its kernel alone (slope over copies) and as a training step.

    ``kernel_copies``: the R the step's slope is taken at, from the first pass (every
    pass's step at the same R); None: the R of this kernel measurement. Also returns the
    per-``session.run`` overhead of the kernel measurement.
    """
    result, overhead = measure_case(case, opts.forward())
    copies = result.copies if kernel_copies is None else kernel_copies
    step = measure_step(case, step_copies(case, copies), opts)
    return dataclasses.replace(result, step=step), overhead
