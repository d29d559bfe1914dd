"""The ``tensoropt`` command line.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and
``run(args) -> int``. Errors derived from :class:`TensorOptError` become one line
on stderr with their exit code, and so do argparse's usage errors and failures to
read or write a named file (an ``OSError`` with a file name: a path the user gave).
Nothing else is caught here, so internal bugs still show a traceback (exit 1).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import signal
import sys
import threading

from tensoropt import __version__
from tensoropt.errors import ExitCode, TensorOptError, exit_codes_help

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

_EPILOG = (
    """\
the main job, start to finish:
  tensoropt model gpt --preset tiny -o gpt.onnx
  tensoropt search gpt.onnx --devices 1,2,4,8 --plot frontier.png
  tensoropt compile gpt.onnx --devices 2 --pick fastest -o out/
  tensoropt run out/ --steps 3 --backend mpi --verify
or simply: tensoropt demo

device counts (--devices): a list 1,2,4,8; A-B every count from A to B (1-8);
A..B the powers of two from A to B, which must be powers of two (1..64).

"""
    + exit_codes_help()
    + "\n"
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every option's help names its default
    (options whose default is None or False have none to name)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.option_strings and _names_default(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit 2), like
    every other bad input, pointing at ``--help`` instead of printing the usage."""

    def error(self, message: str):
        msg = " ".join(message.split())
        self.exit(ExitCode.BAD_INPUT, f"{self.prog}: error: {msg} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tensoropt",
        description="Plan, partition and run distributed DNN training over ONNX: "
        "search the Pareto frontier of (step time, memory per device, devices), "
        "compile the chosen plan to one ONNX graph per device, and run it.",
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--version", action="version", version=f"tensoropt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"tensoropt.cli.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tensoropt.cli.cmd_{name}":
                raise
            continue
        module.add_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter  # defaults in every command's --help
        for action in command._actions:
            if not action.help and action.option_strings and _names_default(action):
                action.help = "default: %(default)s"  # argparse skips an action without help
    return parser


def _names_default(action: argparse.Action) -> bool:
    """Whether ``--help`` should name the option's default: it is not None or False."""
    default = action.default
    return not (default is None or default is False or default == argparse.SUPPRESS)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread while a command runs (:func:`main`): it unwinds
    like Ctrl-C (cleanup runs, no output is left half-written) and ends in one line,
    ``tensoropt CMD: terminated``, and exit 130 like Ctrl-C, as ``--help`` says. A
    KeyboardInterrupt, so that every cleanup written for Ctrl-C runs for it too."""


def _raise_terminated(signum, frame):
    # a second SIGTERM kills at once, should the first be lost in code that swallows
    # exceptions (a callback whose errors are only printed)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated


def _interrupted(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM that ``exc`` wraps: an interrupt raised inside a numba
    kernel's callback comes out as a SystemError caused by it."""
    seen = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    """Run ``tensoropt ARGV``; its exit code. SIGTERM is :class:`Terminated` meanwhile
    (the main thread's handler is put back on return, for callers in the same process;
    search workers set their own, ``search.driver._pool_worker_init``)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(argv)
    except Terminated:  # before a command ran (while parsing): no command to name
        print("tensoropt: terminated", file=sys.stderr)
        return ExitCode.INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # --help, --version, or a usage error (one line, above)
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return ExitCode.BAD_INPUT
    prefix = f"tensoropt {args.command}: "
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except TensorOptError as exc:
        msg = " ".join(str(exc).split())
        print(f"{prefix}error: {msg}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        _drop_stdout()
        return ExitCode.BROKEN_PIPE
    except OSError as exc:
        if exc.filename is None or exc.errno == errno.EPIPE:
            raise
        print(f"{prefix}error: {_os_error_line(exc)}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except (KeyboardInterrupt, SystemError) as exc:
        interrupt = _interrupted(exc)
        if interrupt is None:
            raise
        what = "terminated" if isinstance(interrupt, Terminated) else "interrupted"
        print(f"{prefix}{what}", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except Exception as exc:
        if type(exc).__module__ != _ORT_ERRORS:
            raise
        # onnxruntime refused or failed a graph: its message names the node and the
        # kernel; the Python frames below it say nothing more
        msg = " ".join(str(exc).split())
        print(
            f"{prefix}error: onnxruntime could not run the step: {msg} (a kernel this "
            "onnxruntime build lacks for the node's types, or a graph tensoropt made "
            "wrongly: please report it with the model)",
            file=sys.stderr,
        )
        return ExitCode.INTERNAL


_ORT_ERRORS = "onnxruntime.capi.onnxruntime_pybind11_state"


QUICK_EXIT = frozenset({"search"})
"""Commands that hold nothing to finalise once :func:`main` returns (no MPI, their worker
processes joined, every output file closed): the ``tensoropt`` command leaves them with
``os._exit`` instead of freeing every object first (the GPT-3 175B shape's search: about
2.5 s of teardown)."""


def console() -> None:
    """The ``tensoropt`` command: :func:`main` on ``sys.argv``, then exit with its code
    (at once after a command in :data:`QUICK_EXIT`, its output flushed)."""
    code = main()
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if command in QUICK_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a closed pipe: main has said so already
            pass
        os._exit(code)
    sys.exit(code)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an unknown argument is reported by the subcommand it was given to."""
    argv = _negative_values(parser, sys.argv[1:] if argv is None else list(argv))
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = getattr(args, "command", None)
        owner = _subcommands(parser).get(command, parser) if command else parser
        owner.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--memory-budget -5GiB`` as ``--memory-budget=-5GiB``: argparse takes a value
    that starts with a dash and is not a plain number for an option, and says "expected
    one argument" instead of what is wrong with the value (the option's own check)."""
    takes_value = {
        option
        for p in (parser, *_subcommands(parser).values())
        for action in p._actions
        if action.nargs is None and action.option_strings
        for option in action.option_strings
        if option.startswith("--")
    }
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if token in takes_value and len(nxt) > 1 and nxt[0] == "-" and nxt[1].isdigit():
            out.append(f"{token}={nxt}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _os_error_line(exc: OSError) -> str:
    """``PATH: reason; what to do`` for a file the command could not read or write."""
    reason = exc.strerror or type(exc).__name__
    advice = {
        errno.EACCES: "choose a path you may write (or read), or fix its permissions",
        errno.EPERM: "choose a path you may write (or read), or fix its permissions",
        errno.EROFS: "choose a path on a writable file system",
        errno.ENOSPC: "free some disk space or choose another file system",
        errno.ENOENT: "check the path",
        errno.ENOTDIR: "check the path: a part of it is a file",
        errno.EISDIR: "give a file name, not a directory",
    }.get(exc.errno or 0, "check the path")
    return f"{exc.filename}: {reason.lower()}; {advice}"


def _drop_stdout() -> None:
    """The reader of stdout went away (``| head``): send whatever Python still holds
    for stdout to /dev/null so that its flush at exit stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is no file (captured in a test): nothing to flush at exit
