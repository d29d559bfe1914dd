"""The model zoo: ONNX training targets built directly with ``onnx.helper``.

Every model is ai.onnx opset 20, IR version 10, static-shaped, outputs logits only
(the training-step pass adds the loss), and carries its input and label convention
in ``model.metadata_props["tensoropt.zoo"]`` (JSON, schema ``tensoropt.zoo/1``).

    >>> from tensoropt.models import build_model, save_model
    >>> model = build_model("gpt", "tiny", layers=3)
    >>> save_model(model, "gpt.onnx")

Small models embed seeded random weights. Models with more than 64 MiB of weights
(the ``paper`` presets) get zero-valued external-data stubs that :func:`save_model`
backs with one sparse ``<file>.data``: they exist for planning, not for training.
See docs/design/zoo.md for the presets.

The names are imported on first use (PEP 562): onnx and the builders take 0.6 s to
import, which the CLI's parsers (``tensoropt --help``: the zoo's model and preset names)
do not need.
"""

from tensoropt.lazy import names_on_first_use

_WHERE = {
    "EXTERNAL_THRESHOLD_BYTES": "_builder",
    "GraphBuilder": "_builder",
    "WeightStorage": "_builder",
    "CLI_KNOBS": "config",
    "MODEL_NAMES": "config",
    "PRESET_NAMES": "config",
    "TASKS": "config",
    "CnnConfig": "config",
    "MlpConfig": "config",
    "ModelConfig": "config",
    "Preset": "config",
    "RnnConfig": "config",
    "Task": "config",
    "TransformerConfig": "config",
    "ZooError": "config",
    "configure": "config",
    "knobs_for": "config",
    "parse_preset": "config",
    "preset_config": "config",
    "build_resnet50": "cnn",
    "build_vgg16": "cnn",
    "build_wide_resnet": "cnn",
    "build_inception_v3": "inception",
    "build_mlp": "mlp",
    "build_rnnlm": "rnn",
    "build_bert": "transformer",
    "build_gpt": "transformer",
    "ZooInfo": "io",
    "save_model": "io",
    "sidecar_path": "io",
    "zoo_info": "io",
    "ZOO_SCHEMA": "zoo",
    "build_model": "zoo",
}

__all__ = [
    "CLI_KNOBS",
    "EXTERNAL_THRESHOLD_BYTES",
    "MODEL_NAMES",
    "PRESET_NAMES",
    "ZOO_SCHEMA",
    "CnnConfig",
    "MlpConfig",
    "ModelConfig",
    "Preset",
    "RnnConfig",
    "Task",
    "TransformerConfig",
    "WeightStorage",
    "ZooError",
    "ZooInfo",
    "build_model",
    "configure",
    "knobs_for",
    "preset_config",
    "save_model",
    "sidecar_path",
    "zoo_info",
]

__getattr__ = names_on_first_use(__name__, _WHERE)
