"""Megatron block detection on the patterns real exports have.

* an attention mask computed from an int64 ``attention_mask`` input (BERT, Llama)
  does not hide the attention block;
* a gated MLP ``down(silu(gate(x)) * up(x))`` (Llama) is one block: gate and up
  column-parallel, down row-parallel;
* a fused QKV projection followed by a Split (GPT-2, ViT) is left to data
  parallelism with a note (a column split would mix Q, K and V).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tensoropt.passes.loss import LossKind
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tensoropt.runtime.run import run_steps
from tests.helpers.compile import compile_model, make_mesh
from tests.helpers.steps import import_proto

B, T, C, H, F = 2, 4, 8, 2, 12
MSE = TrainingOptions(
    loss=LossKind.MSE, optimizer=OptimizerOptions(OptimizerKind.SGD, lr=0.01, momentum=0.9)
)


def _model(fused: bool):
    rng = np.random.default_rng(0)
    inits: dict[str, np.ndarray] = {}

    def w(name, *shape):
        inits[name] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        return name

    def i64(name, values):
        inits[name] = np.array(values, np.int64)
        return name

    n = helper.make_node
    heads = i64("heads_shape", [B, T, H, C // H])
    merged = i64("merged_shape", [B, T, C])
    if fused:
        proj = [
            n("MatMul", ["x", w("Wqkv", C, 3 * C)], ["qkv"]),
            n("Split", ["qkv", i64("split", [C, C, C])], ["q0", "k0", "v0"], axis=2),
        ]
    else:
        proj = [n("MatMul", ["x", w(f"W{z}", C, C)], [f"{z}0"]) for z in "qkv"]
    mask = [  # BERT: (1 - mask) * min, from an int64 input
        n("Unsqueeze", ["attention_mask", i64("axes", [1, 2])], ["m1"]),
        n("Cast", ["m1"], ["m2"], to=TensorProto.FLOAT),
        n("Sub", ["one", "m2"], ["m3"]),
        n("Mul", ["m3", "neg"], ["ext"]),
    ]
    inits["one"] = np.array(1.0, np.float32)
    inits["neg"] = np.array(-1e9, np.float32)
    attn = [
        *[n("Reshape", [f"{z}0", heads], [f"{z}1"]) for z in "qkv"],
        n("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        n("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        n("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        n("MatMul", ["q", "kt"], ["s"]),
        n("Add", ["s", "ext"], ["s2"]),
        n("Softmax", ["s2"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["c"]),
        n("Transpose", ["c"], ["c1"], perm=[0, 2, 1, 3]),
        n("Reshape", ["c1", merged], ["c2"]),
        n("MatMul", ["c2", w("Wo", C, C)], ["o"]),
        n("Add", ["x", "o"], ["a"]),
    ]
    mlp = [  # Llama: down(silu(gate(a)) * up(a))
        n("MatMul", ["a", w("Wg", C, F)], ["g"]),
        n("Sigmoid", ["g"], ["sg"]),
        n("Mul", ["g", "sg"], ["silu"]),
        n("MatMul", ["a", w("Wu", C, F)], ["u"]),
        n("Mul", ["silu", "u"], ["gu"]),
        n("MatMul", ["gu", w("Wd", F, C)], ["d"]),
        n("Add", ["a", "d"], ["y"]),
    ]
    graph = helper.make_graph(
        proj + mask + attn + mlp,
        "block",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, C]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [B, T]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, T, C])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _notes(fused: bool) -> tuple[str, ...]:
    from tensoropt.passes.plans import builtin_plan

    step = build_training_step(import_proto(_model(fused)), MSE)
    return builtin_plan(
        "megatron", step.model.graph, step.signature, make_mesh("2", "megatron")
    ).notes


def test_masked_attention_and_gated_mlp_are_blocks():
    notes = _notes(fused=False)
    assert notes[0].startswith("megatron: 1 MLP and 1 attention blocks"), notes


def test_fused_qkv_is_left_to_data_parallelism_with_a_note():
    notes = _notes(fused=True)
    assert notes[0].startswith("megatron: 1 MLP and 0 attention blocks"), notes
    assert any("fused QKV" in note for note in notes), notes


def test_masked_attention_and_gated_mlp_verify_on_two_ranks(tmp_path):
    _, built = compile_model(_model(fused=False), "megatron", "2", tmp_path / "out", MSE)
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and report.ok, report.to_json()
