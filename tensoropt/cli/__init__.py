"""The ``tensoropt`` command line.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and
``run(args) -> int``. Errors derived from :class:`TensorOptError` become one line
on stderr with their exit code; nothing else is caught here, so internal bugs
still show a traceback (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tensoropt.errors import TensorOptError

# (module, command) in the order --help lists them.
_COMMANDS = (
    "model",
    "train",
    "search",
    "compile",
    "run",
    "inspect",
    "demo",
    "calibrate",
    "validate",
    "report",
)

_EPILOG = """\
the main job, start to finish:
  tensoropt model gpt --preset tiny -o gpt.onnx
  tensoropt search gpt.onnx --devices 1,2,4,8 --plot frontier.png
  tensoropt compile gpt.onnx --devices 2 --pick fastest -o out/
  tensoropt run out/ --steps 3 --backend mpi --verify
or simply: tensoropt demo

exit codes: 0 ok, 2 bad input or infeasible request, 1 internal error.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensoropt",
        description="Plan, partition and run distributed DNN training over ONNX: "
        "search the Pareto frontier of (step time, memory per device, devices), "
        "compile the chosen plan to one ONNX graph per device, and run it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"tensoropt.cli.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tensoropt.cli.cmd_{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TensorOptError as exc:
        msg = " ".join(str(exc).split())
        print(f"tensoropt {args.command}: error: {msg}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"tensoropt {args.command}: interrupted", file=sys.stderr)
        return 130
