"""Headline timings of this tree against a baseline commit, measured in the same run.

A refactor must not make the product slower. This runs the same work on this tree and on
a baseline commit (checked out into a temporary git worktree), each in a fresh process
with ``PYTHONPATH`` set to its tree, alternating the two trees ``--repeats`` times so that
the machine's state falls on both alike, and prints the median ratio (this / baseline):

  search target  zoo ``gpt --preset paper --layers 24 --hidden 1024 --heads 16``
                 (GPT-2-medium size), search graph + every mesh of devices 1..64, h100
  import+step    zoo ``gpt`` at GPT-2-small size (12 layers, hidden 768): import without
                 weights and build the training step (SGD with momentum)

Usage: python benchmarks/bench_against.py --baseline COMMIT [--repeats N] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results import write_section  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## This tree against a baseline commit"

_SEARCH = """
import argparse, time
from tensoropt.cli.common import search_graph
from tensoropt.cost.cluster import builtin
from tensoropt.search.driver import explore
args = argparse.Namespace(model={path!r}, input_shape=None, trainable=None, freeze=None,
                          optimizer="sgd", momentum=0.9, lr=0.01, loss="auto")
t = time.perf_counter()
sg = search_graph(args)
exp = explore(sg, [1, 2, 4, 8, 16, 32, 64], "auto", builtin("h100"))
print(time.perf_counter() - t, len(exp.merged))
"""

_STEP = """
import time
from tensoropt.ir.importer import ImportOptions, import_model
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tensoropt.rules.grad import GRAD_RULES
t = time.perf_counter()
model = import_model({path!r}, ImportOptions(load_weights=False,
                     supported_ops=GRAD_RULES.supported()))
build_training_step(model, TrainingOptions())
print(time.perf_counter() - t, 0)
"""


def _model(tree: Path, path: Path, *knobs: str) -> None:
    cmd = [sys.executable, "-m", "tensoropt", "model", "gpt", "--preset", "paper", *knobs]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([*cmd, "-o", str(path)], env=env, check=True, capture_output=True)


def _time(tree: Path, code: str) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(  # cwd: ``-c`` puts the working directory first on sys.path
        [sys.executable, "-c", code], env=env, cwd=tree, check=True, capture_output=True,
        text=True,
    ).stdout.split()  # fmt: skip
    return float(out[0]), int(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    base_sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    head_sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            lines = _measure(Path(tmp), base, args.repeats, base_sha, head_sha)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                check=False, capture_output=True,
            )  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)


def _measure(tmp: Path, base: Path, repeats: int, base_sha: str, head_sha: str) -> list[str]:
    medium, small = tmp / "gpt_med.onnx", tmp / "gpt_small.onnx"
    _model(ROOT, medium, "--layers", "24", "--hidden", "1024", "--heads", "16")
    _model(ROOT, small, "--layers", "12", "--hidden", "768", "--heads", "12")
    cases = {"search target": _SEARCH.format(path=str(medium)),
             "import+step": _STEP.format(path=str(small))}  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {}
    points: dict[tuple[str, str], int] = {}
    for _ in range(repeats):
        for name, code in cases.items():
            for label, tree in (("baseline", base), ("this", ROOT)):
                seconds, count = _time(tree, code)
                times.setdefault((name, label), []).append(seconds)
                points[(name, label)] = count
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        SECTION,
        "",
        f"`python benchmarks/bench_against.py --baseline {base_sha} --repeats {repeats}` -- "
        f"{stamp}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; this tree is {head_sha}. Each run is a fresh process; "
        "the two trees take turns.",
        "",
        "| work | baseline s (runs) | this s (runs) | ratio (medians) |",
        "|---|---|---|---:|",
    ]
    for name in cases:
        b, t = times[(name, "baseline")], times[(name, "this")]
        ratio = statistics.median(t) / statistics.median(b)
        lines.append(
            f"| {name} | {statistics.median(b):.2f} ({', '.join(f'{x:.1f}' for x in b)}) "
            f"| {statistics.median(t):.2f} ({', '.join(f'{x:.1f}' for x in t)}) "
            f"| **{ratio:.2f}** |"
        )
    b, t = points[("search target", "baseline")], points[("search target", "this")]
    lines += ["", f"Merged frontier points of the search target: baseline {b}, this tree {t}."]
    return lines


if __name__ == "__main__":
    main()
