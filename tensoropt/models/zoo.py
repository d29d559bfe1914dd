"""Building a zoo model by name: the builders' table and the metadata every model carries
(``tensoropt.zoo/1``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx

from tensoropt.models._builder import GraphBuilder
from tensoropt.models.cnn import build_resnet50, build_vgg16, build_wide_resnet
from tensoropt.models.config import (
    TASKS,
    CnnConfig,
    MlpConfig,
    ModelConfig,
    Preset,
    RnnConfig,
    Task,
    TransformerConfig,
    configure,
    parse_preset,
)
from tensoropt.models.inception import build_inception_v3
from tensoropt.models.mlp import build_mlp
from tensoropt.models.rnn import build_rnnlm
from tensoropt.models.transformer import build_bert, build_gpt

ZOO_SCHEMA = "tensoropt.zoo/1"

_BUILDERS: dict[str, Callable[..., GraphBuilder]] = {
    "mlp": build_mlp,
    "gpt": build_gpt,
    "bert": build_bert,
    "vgg16": build_vgg16,
    "resnet50": build_resnet50,
    "wide_resnet": build_wide_resnet,
    "inception_v3": build_inception_v3,
    "rnnlm": build_rnnlm,
}


def build_model(name: str, preset: str = "tiny", **knobs: int | None) -> onnx.ModelProto:
    """Build zoo model `name` at `preset`, with knobs (config fields) overriding the preset.

    Knobs set to None are ignored, so CLI arguments can be passed straight through.
    Raises :class:`ZooError` for an unknown name, preset or knob, or a bad value.
    """
    config = configure(name, preset, **knobs)
    builder = _BUILDERS[name](config)
    return builder.finish(config.seed, _metadata(name, parse_preset(preset), config, builder))


def _metadata(
    name: str, preset: Preset, config: ModelConfig, builder: GraphBuilder
) -> dict[str, object]:
    """The input/label convention recorded in the model (the zoo JSON, before weight facts)."""
    task = TASKS[name]
    graph_inputs = builder.inputs
    batch = graph_inputs[0].shape[0]
    if task is Task.LM:
        assert isinstance(config, TransformerConfig | RnnConfig)
        labels = {"shape": [batch, config.seq], "dtype": "int64", "num_classes": config.vocab}
    else:
        assert isinstance(config, MlpConfig | CnnConfig)
        labels = {"shape": [batch], "dtype": "int64", "num_classes": config.classes}
    return {
        "schema": ZOO_SCHEMA,
        "name": name,
        "preset": preset.value,
        "task": task.value,
        "inputs": [_io_json(s.name, s.elem_type, s.shape) for s in graph_inputs],
        "labels": labels,
        "outputs": [_io_json(s.name, s.elem_type, s.shape) for s in builder.outputs],
        "config": dataclasses.asdict(config),
    }


def _io_json(name: str, elem_type: int, shape: tuple[int, ...]) -> dict[str, object]:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type).name
    return {"name": name, "shape": list(shape), "dtype": dtype}
