"""Transparent huge pages for the ranks' malloc (``glibc.malloc.hugetlb=1``), measured.

The MPI ranks start with the tunable (tensoropt.runtime.malloc.child_env). Baseline in
the same run: the same compiled plans with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=0``
(a user's own setting wins over the project's). The two settings take turns, plan by
plan and round by round, so a drift of the machine hits both alike; each number is the
median over rounds of the slowest rank's median step (``run --profile``).

Usage: python benchmarks/bench_hugepages.py [--rounds R] [--steps N] [--cluster C] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from results import write_section

from tensoropt.cli import main
from tensoropt.runtime.malloc import HUGETLB, TUNABLES

SECTION = "## Runtime"
SUBSECTION = "### Huge pages for the ranks' malloc"
# (zoo model, preset, devices, pick): 2-rank plans at both ends of the frontier, and
# one rank alone
PLANS = [
    ("gpt", "small", 2, "fastest"),
    ("gpt", "small", 2, "min-memory"),
    ("vgg16", "tiny", 2, "fastest"),
    ("vgg16", "tiny", 2, "min-memory"),
    ("mlp", "small", 1, "fastest"),
]
SETTINGS = {"4 KiB pages": f"{HUGETLB}=0", "huge pages": f"{HUGETLB}=1"}


def cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"tensoropt {' '.join(argv)} failed ({code})")
    return out.getvalue()


def step_ms(outdir: Path, steps: int, tunables: str) -> tuple[float, float]:
    """(slowest rank's median step, its communication) in ms, under ``tunables``."""
    saved = os.environ.get(TUNABLES)
    os.environ[TUNABLES] = tunables
    try:
        argv = ["run", str(outdir), "--steps", str(steps), "--backend", "mpi"]
        text = cli([*argv, "--profile", "--json"])
    finally:
        if saved is None:
            os.environ.pop(TUNABLES, None)
        else:
            os.environ[TUNABLES] = saved
    ranks = json.loads(text)["profile"]["ranks"]
    slowest = max(ranks, key=lambda r: r["step_s"])
    return slowest["step_s"] * 1e3, slowest["comm_s"] * 1e3


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--cluster", help="profile for --pick (default: the built-in one)")
    ap.add_argument("--write", action="store_true", help="replace the RESULTS.md subsection")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, preset, devices, pick in PLANS:
            onnx_path = Path(tmp) / f"{model}-{preset}.onnx"
            if not onnx_path.exists():
                cli(["model", model, "--preset", preset, "-o", str(onnx_path)])
            outdir = Path(tmp) / f"{model}-{preset}-{devices}-{pick}"
            extra = ["--cluster", args.cluster] if args.cluster else []
            argv = ["compile", str(onnx_path), "--devices", str(devices), "--pick", pick]
            cli([*argv, *extra, "-o", str(outdir)])
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
            for _ in range(args.rounds):
                for name, tunables in SETTINGS.items():
                    times[name].append(step_ms(outdir, args.steps, tunables))
            med = {
                name: (
                    statistics.median(t for t, _ in values),
                    statistics.median(c for _, c in values),
                )
                for name, values in times.items()
            }
            base, huge = med["4 KiB pages"], med["huge pages"]
            rows.append((f"{model}:{preset}", devices, pick, base, huge, huge[0] / base[0]))
            print(f"{rows[-1][0]} {devices} {pick}: {base[0]:.2f} -> {huge[0]:.2f} ms "
                  f"(x{rows[-1][-1]:.3f})", flush=True)  # fmt: skip
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        SUBSECTION,
        "",
        f"`python benchmarks/bench_hugepages.py --rounds {args.rounds} --steps {args.steps}"
        f"{' --cluster ' + args.cluster if args.cluster else ''}` -- {stamp}, "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load:.1f} at the start. MPI backend; the settings take turns; "
        "medians over rounds of the slowest rank's median step.",
        "",
        "| plan | devices | pick | step, 4 KiB pages | step, huge pages | ratio | "
        "comm, 4 KiB | comm, huge |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, devices, pick, base, huge, ratio in rows:
        lines.append(
            f"| {name} | {devices} | {pick} | {base[0]:.2f} ms | {huge[0]:.2f} ms | "
            f"{ratio:.3f} | {base[1]:.2f} ms | {huge[1]:.2f} ms |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text, SUBSECTION)


if __name__ == "__main__":
    main_()
