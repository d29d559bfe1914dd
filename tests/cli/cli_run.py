"""Run the ``tensoropt`` command in this process or in a child process."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from tensoropt.cli import main


@dataclass(frozen=True, slots=True)
class Outcome:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return self.err.strip().splitlines()


def cli(capsys: pytest.CaptureFixture, *argv: object) -> Outcome:
    """``tensoropt ARGV`` in this process (stdout/stderr from capsys)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def cli_process(*argv: object, timeout: float = 120) -> Outcome:
    """``python -m tensoropt ARGV`` in a child process (real exit code, no capsys)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tensoropt", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


def assert_bad_input(outcome: Outcome, command: str, *fragments: str) -> str:
    """Exit code 2, exactly one line on stderr naming the fragments, no traceback."""
    assert outcome.code == 2, outcome
    assert len(outcome.err_lines) == 1, outcome.err
    line = outcome.err_lines[0]
    assert line.startswith(f"tensoropt {command}: error: "), line
    assert "Traceback" not in outcome.err + outcome.out
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line
