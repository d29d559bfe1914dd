"""``tensoropt model``: write a zoo model as an ONNX file."""

from __future__ import annotations

import argparse
import sys

from tensoropt.cli.json_output import add_json_flag, document, emit
from tensoropt.errors import TensorOptError
from tensoropt.models import MODEL_NAMES, PRESET_NAMES

_DESCRIPTION = """\
Write one model of the zoo as a static-shape ONNX file (opset 20) that outputs
logits; 'tensoropt search' and 'compile' add the loss and the training step.

models: {models}
presets: tiny (seconds to train on a CPU), small (bigger, still CPU-trainable),
         paper (the published sizes; weights are zeros in a sparse FILE.onnx.data,
         because they exist for planning, not training)
"""

_EPILOG = """\
examples:
  tensoropt model gpt -o gpt.onnx                      # tiny GPT: 2 layers, hidden 32
  tensoropt model gpt --preset small --layers 6 -o gpt6.onnx
  tensoropt model resnet50 --image-size 64 --classes 10 -o rn50.onnx
  tensoropt model wide_resnet --widen 4 -o wrn.onnx
  tensoropt model bert --preset paper -o bert-large.onnx   # + bert-large.onnx.data

knobs override the preset; a knob that does not apply to the model is an error.
the numbers of every preset are in docs/design/zoo.md.
"""

_KNOB_HELP = {
    "layers": "transformer blocks / LSTM layers / MLP hidden layers",
    "hidden": "hidden width; for CNNs the base channel width (64 = published)",
    "heads": "attention heads (gpt, bert); must divide --hidden",
    "batch": "batch size",
    "seq": "sequence length (gpt, bert, rnnlm)",
    "vocab": "vocabulary size (gpt, bert, rnnlm)",
    "image_size": "image height = width in pixels (CNNs)",
    "classes": "number of classes (mlp, CNNs)",
    "widen": "inner-width factor of the bottlenecks (wide_resnet)",
    "seed": "seed of the random weights",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``model`` subcommand."""
    parser = subparsers.add_parser(
        "model",
        help="write a zoo model (gpt, bert, resnet50, ...) as ONNX",
        description=_DESCRIPTION.format(models=", ".join(MODEL_NAMES)),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Name and preset are checked by the zoo (not argparse choices) so a typo gives one
    # line on stderr and exit code 2, like every other bad input.
    parser.add_argument("name", metavar="NAME", help="one of: " + ", ".join(MODEL_NAMES))
    parser.add_argument("-o", "--output", required=True, metavar="FILE.onnx", help="output file")
    parser.add_argument(
        "--preset",
        default="tiny",
        metavar="|".join(PRESET_NAMES),
        help="size preset (default: tiny)",
    )
    knobs = parser.add_argument_group("knobs (override the preset)")
    for knob, text in _KNOB_HELP.items():
        flag = "--" + knob.replace("_", "-")
        knobs.add_argument(flag, dest=knob, type=int, default=None, metavar="N", help=text)
    add_json_flag(parser, "tensoropt.model/1")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Build, save, and print one line: the file, parameter count and weight bytes."""
    from tensoropt.cli.common import check_output_file
    from tensoropt.models import WeightStorage, build_model, save_model, sidecar_path, zoo_info
    from tensoropt.streams import own_descriptor

    check_output_file(args.output, "-o")
    to_stdout = own_descriptor(args.output) == 1  # the model's bytes are stdout
    if to_stdout and args.json:
        raise TensorOptError(
            f"-o {args.output} and --json both write stdout; write the model to a file"
        )
    knobs = {k: getattr(args, k) for k in _KNOB_HELP}
    model = build_model(args.name, args.preset, **knobs)
    save_model(model, args.output)
    info = zoo_info(model)
    assert info is not None
    line = (
        f"wrote {args.output}: {info.name} ({info.preset}), {info.params:,} parameters, "
        f"{_human_bytes(info.weight_bytes)} of weights"
    )
    sidecar = sidecar_path(args.output) if info.weights is WeightStorage.EXTERNAL_ZEROS else None
    if sidecar:
        line += f" (zeros for planning, sparse file {sidecar})"
    if args.json:
        body = {
            "path": args.output,
            "data_path": sidecar,
            "model": info.name,
            "preset": info.preset,
            "parameters": info.params,
            "weight_bytes": info.weight_bytes,
        }
        emit(args, document("tensoropt.model/1", body))
    else:
        print(line, file=sys.stderr if to_stdout else sys.stdout)
    return 0


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
