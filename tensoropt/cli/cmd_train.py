"""``tensoropt train``: single-device training of an ONNX model in onnxruntime."""

from __future__ import annotations

import argparse
import sys

from tensoropt.cli.common import (
    TRAINING_HELP,
    add_training_options,
    build_step,
    check_output_file,
    progress,
    save_npz_atomic,
    write_atomic,
)
from tensoropt.cli.json_output import add_json_flag, document, emit, finite_or_null
from tensoropt.errors import TensorOptError

EPILOG = (
    TRAINING_HELP
    + """
data (--data FILE.npz): arrays keyed by the model's input names, plus 'labels' for the
loss; each either the global batch shape (reused every step) or [steps, ...shape].
Integer ids and labels must lie in [0, N) of the table or classes they index (a loss's
ignore_index is allowed): checked before step 0. --trainable/--freeze REGEX must match
some initializer.
Without --data the batches are synthetic and seeded (the same ones `tensoropt run`
uses, so sharded runs can be compared file to file).

examples:
  tensoropt model gpt --preset tiny -o gpt.onnx
  tensoropt train gpt.onnx --steps 10 --optimizer adam --lr 1e-3
  tensoropt train gpt.onnx --steps 3 --save-params p.npz --export-step step.onnx --json
"""
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model on one device (onnxruntime) and print the loss per step",
        description="Build the training step of MODEL (loss, backward, optimizer update) "
        "and run it for --steps steps on one device.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--steps", type=int, default=10, help="number of steps (default 10)")
    add_training_options(p)
    p.add_argument("--data", metavar="FILE.npz", help="training data (default: synthetic)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--save-params", metavar="OUT.npz", help="save the trained parameters")
    p.add_argument("--export-step", metavar="STEP.onnx", help="write the training-step graph")
    p.add_argument("--threads", type=int, help="onnxruntime intra-op threads")
    add_json_flag(p, "tensoropt.train/1")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tensoropt.ir.importer import export_model
    from tensoropt.runtime.data import (
        batch_source,
        check_indices,
        index_exceptions,
        input_specs,
        load_npz,
    )
    from tensoropt.runtime.single import StepSession

    if args.steps < 1:
        raise TensorOptError(f"--steps must be at least 1, got {args.steps}")
    if args.threads is not None and args.threads < 1:
        raise TensorOptError(f"--threads {args.threads}: give at least 1")
    check_output_file(args.save_params, "--save-params")
    check_output_file(args.export_step, "--export-step")
    step = build_step(args)
    summary = step.selection.summary(step.model.graph)
    proto = export_model(step.model)
    # A bad --data file is refused before anything is printed or trained.
    specs = input_specs(proto, step.signature)
    if args.data is None:
        source = batch_source(specs, None, args.seed, args.steps)
    else:  # shapes, dtypes, and ids and labels within the tables they index
        npz = load_npz(args.data, specs, args.steps)
        exceptions = index_exceptions([proto], [s.name for s in specs])
        check_indices(npz, specs, args.steps, exceptions, step.signature.labels)
        source = npz.batch
    print(summary, file=sys.stderr)
    if args.export_step:
        write_atomic(args.export_step, proto.SerializeToString())
    session = StepSession(proto, threads=args.threads)
    state = session.initial_state()
    losses = []
    if not args.json:
        print(f"{'step':>6}  {'loss':>12}")
    steps = progress(range(args.steps), total=args.steps, desc="train", label=lambda k: f"step {k}")
    for k in steps:
        loss, state = session.step(state, source(k))
        losses.append(loss)
        if not args.json:
            print(f"{k:>6}  {loss:>12.6f}", flush=True)
    _warn_if_not_finite(losses, args, specs)
    params = {name: state[name] for name in step.signature.params}
    if args.save_params:
        save_npz_atomic(args.save_params, params)
    if args.json:
        emit(
            args,
            document(
                "tensoropt.train/1",
                {
                    "losses": finite_or_null(losses),  # null where not finite
                    "steps": args.steps,
                    "optimizer": step.signature.optimizer,
                    "trained_parameters": len(step.signature.params),
                    "trained_elements": int(sum(v.size for v in params.values())),
                    "saved_params": args.save_params,
                    "exported_step": args.export_step,
                },
            ),
        )
    return 0


def _warn_if_not_finite(losses, args: argparse.Namespace, specs) -> None:
    """One line on stderr when a loss is NaN or infinite (``runtime.data``)."""
    from tensoropt.runtime.data import not_finite_warning

    line = not_finite_warning("train", losses, specs, synthetic=args.data is None)
    if line is not None:
        print(line, file=sys.stderr)
