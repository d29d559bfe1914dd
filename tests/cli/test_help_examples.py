"""Every example the help shows works as shown.

The examples are read from the parsers' epilogs (``tensoropt --help``'s main job, then
each command's ``examples:`` section, in the order ``tensoropt --help`` lists the
commands) and run in that order in one directory, as a user following the help would:
a file an example reads must come from an earlier example. Each must exit 0 and write
the files it names (``-o``, ``--json-out``, ``--plot``, ...; a file named in its
comment too). Examples that measure this machine or take long are skipped by an
explicit list, but still parsed."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from tensoropt.cli import build_parser
from tests.cli.cli_run import cli

pytest.importorskip("matplotlib")

MAIN_JOB = "the main job, start to finish:"
EXAMPLES = "examples:"

# Options whose value is a file or directory the command writes.
WRITES = ("-o", "--output", "--json-out", "--plot", "--dump-costs", "--save-params")
WRITES += ("--export-step", "--checkpoint")

# A file name in an example's comment ("# + bert-large.onnx.data"): it must exist too.
_FILE_IN_COMMENT = re.compile(r"[\w.-]+\.(?:onnx|data|json|png|npz|md)\b")

# Examples not run (each still parsed), by their command line without the comment.
SKIP = {
    "tensoropt calibrate -o here.json": "measures this machine for minutes",
    "tensoropt calibrate -o here.json --quick": "measures this machine (30-40 s)",
    "tensoropt calibrate -o here.json --resume": "needs an interrupted calibration",
    "tensoropt calibrate -o today.json --against here.json": "measures for minutes",
    "tensoropt search gpt.onnx --devices 1,2 --cluster here.json": "needs a calibration",
    "tensoropt validate gpt.onnx --devices 1,2 --cluster here.json": (
        "needs a calibration; compiles and measures plans (minutes)"
    ),
    "tensoropt validate mlp.onnx --devices 1,2 --cluster here.json --plot v.png": (
        "needs a calibration; compiles and measures plans (about a minute)"
    ),
    "tensoropt validate gpt.onnx --devices 1,2 --cluster here.json --points 6 "
    "--json-out v.json": "needs a calibration; compiles and measures plans (minutes)",
    "tensoropt validate gpt.onnx --devices 1,2 --cluster here.json --record": (
        "needs a calibration; compiles and measures plans (minutes)"
    ),
    "tensoropt report bert-large.onnx --devices 1..64 --cluster h100 --epsilon 0.02 "
    "-o bert-h100/": "searches the paper-size BERT at 7 device counts (about 20 s)",
}


@dataclass(frozen=True, slots=True)
class Example:
    section: str  # "main job" or the command whose --help shows it
    line: str  # the command line as shown, without its comment
    comment: str

    @property
    def words(self) -> list[str]:
        return shlex.split(self.line)

    @property
    def argv(self) -> list[str]:
        """The arguments after ``tensoropt``, up to a pipe."""
        words = self.words
        assert words[0] == "tensoropt", self.line
        return words[1 : words.index("|")] if "|" in words else words[1:]

    @property
    def pipe(self) -> list[str]:
        words = self.words
        return words[words.index("|") + 1 :] if "|" in words else []

    def written(self) -> list[str]:
        """The files and directories this example says it writes."""
        argv = self.argv
        named = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word in WRITES]
        return named + _FILE_IN_COMMENT.findall(self.comment)


def _lines_under(text: str, heading: str) -> list[str]:
    """The indented ``tensoropt ...`` lines right under ``heading``, up to a blank line."""
    lines = text.splitlines()
    if heading not in (line.strip() for line in lines):
        return []
    start = [line.strip() for line in lines].index(heading) + 1
    found = []
    for line in lines[start:]:
        if not line.startswith("  ") or not line.strip():
            break
        if line.strip().startswith("tensoropt "):
            found.append(line.strip())
    return found


def _example(section: str, text: str) -> Example:
    line, *comment = re.split(r"\s+#\s", text, maxsplit=1)
    return Example(section, " ".join(line.split()), " ".join(comment).strip())


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def help_examples() -> list[Example]:
    """The main job, then every command's examples, in ``tensoropt --help``'s order."""
    parser = build_parser()
    found = [_example("main job", line) for line in _lines_under(parser.epilog, MAIN_JOB)]
    for name, command in _commands(parser).items():
        found += [_example(name, line) for line in _lines_under(command.epilog or "", EXAMPLES)]
    return found


def test_every_command_shows_examples_and_the_skip_list_names_real_ones():
    examples = help_examples()
    sections = {example.section for example in examples}
    commands = set(_commands(build_parser()))
    assert sections == {"main job"} | commands - {"demo"}, sections
    lines = {example.line for example in examples}
    assert set(SKIP) <= lines, set(SKIP) - lines


@pytest.mark.parametrize("example", help_examples(), ids=lambda example: example.line)
def test_every_example_parses(example):
    """Every example, the skipped ones too, names only options its command has."""
    try:
        build_parser().parse_args(example.argv)
    except SystemExit as exc:
        pytest.fail(f"{example.line!r} does not parse (exit {exc.code})")


@pytest.mark.slow
def test_the_examples_run_in_order_and_write_what_they_say(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ran = 0
    for example in help_examples():
        if example.line in SKIP:
            continue
        outcome = cli(capsys, *example.argv)
        assert outcome.code == 0, (example.section, example.line, outcome.err[-2000:])
        for path in example.written():
            assert (tmp_path / path).exists(), (example.line, f"{path} was not written")
        if example.pipe:
            document = json.loads(outcome.out)  # the pipe reads one JSON document
            if example.pipe[0] == "jq" and shutil.which("jq"):
                piped = subprocess.run(
                    example.pipe, input=json.dumps(document), capture_output=True, text=True
                )
                assert piped.returncode == 0, (example.line, piped.stderr)
                assert piped.stdout.strip() not in ("", "null"), (example.line, piped.stdout)
        ran += 1
    assert ran >= 25, ran
