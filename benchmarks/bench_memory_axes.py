"""The memory axes (ZeRO, recomputation, micro-batches) on the cost model: the issue's
targets on the GPT-3 2.7B shape, and the search time with every axis against the split
alone, measured in the same run.

Run: python benchmarks/bench_memory_axes.py [--write] [--skip-time | --skip-targets]
[--devices LIST] [--repeats N]

1. Targets: zoo `gpt --preset paper --layers 32 --hidden 2560 --heads 32 --seq 2048
   --batch 8`, Adam, a100, devices 1, 2, 4, 8, budget 40 GiB: the fewest devices that fit,
   the least memory at 8 devices, and at 8 devices the fastest plan under 40 GiB against
   the unconstrained fastest; each with every axis and with the split alone.
2. Search time: GPT-2-medium (24 layers, hidden 1024, 16 heads, seq 1024), devices
   1..64, every mesh, every axis against `--axes split`, process CPU time of the search
   in this process (import excluded), alternating, median of --repeats.
Results go to benchmarks/RESULTS.md ("## Memory axes") with --write.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

from results import write_section  # benchmarks/ is on sys.path when run as a script

from tensoropt.cli import build_parser
from tensoropt.cli.cmd_search import search_space
from tensoropt.cli.common import search_graph
from tensoropt.cost.cluster import builtin
from tensoropt.models import build_model, save_model
from tensoropt.search.driver import device_frontier, explore

SECTION = "## Memory axes"
TARGETS = "### Targets: GPT-3 2.7B shape, Adam, a100, budget 40 GiB"
TIME = "### Search time: GPT-2-medium, all axes against split"
GIB = 2**30
ALL = "split,zero,recompute,micro"


def _args(path: str, optimizer: str, axes: str) -> argparse.Namespace:
    """`tensoropt search PATH --optimizer O --axes A` as the command parses it."""
    return build_parser().parse_args(["search", path, "--optimizer", optimizer, "--axes", axes])


def _search(path: str, optimizer: str, axes: str, devices, cluster: str, jobs: int | None):
    args = _args(path, optimizer, axes)
    sg = search_graph(args)
    start = time.process_time()  # the space's own graphs (the recomputed step) count
    space = search_space(args, sg)
    exp = explore(sg, devices, "auto", builtin(cluster), jobs=jobs, space=space)
    return exp, time.process_time() - start


def targets(tmp: str) -> list[str]:
    path = os.path.join(tmp, "gpt27.onnx")
    save_model(
        build_model("gpt", "paper", layers=32, hidden=2560, heads=32, seq=2048, batch=8), path
    )
    lines = [
        TARGETS,
        "",
        "| axes | fewest devices that fit 40 GiB | least memory at 8 devices | "
        "fastest at 8 | fastest under 40 GiB at 8 | ratio | its plan |",
        "|---|---|---|---|---|---|---|",
    ]
    for axes in ("split", ALL):
        exp, _ = _search(path, "adam", axes, [1, 2, 4, 8], "a100", 1)
        fits = None
        for d in (1, 2, 4, 8):
            rows = device_frontier(exp, d)
            if rows and rows[-1][1].memory_bytes <= 40 * GIB:
                fits = d
                break
        rows = device_frontier(exp, 8)
        fastest, least = rows[0][1], rows[-1][1]
        under = [(s, p) for s, p in rows if p.memory_bytes <= 40 * GIB]
        if under:
            s, p = under[0]
            cell = f"{p.time_s:.3f} s, {p.memory_bytes / GIB:.1f} GiB"
            ratio = f"{p.time_s / fastest.time_s:.2f}x"
            plan = s.summaries[s.result.points.index(p)]
        else:
            cell, ratio, plan = "none", "-", "-"
        lines.append(
            f"| {axes} | {fits if fits else 'more than 8'} | "
            f"{least.memory_bytes / GIB:.2f} GiB | {fastest.time_s:.3f} s, "
            f"{fastest.memory_bytes / GIB:.1f} GiB | {cell} | {ratio} | {plan} |"
        )
        print(lines[-1], flush=True)
    return lines


def search_time(tmp: str, repeats: int, devices: list[int]) -> list[str]:
    path = os.path.join(tmp, "gpt2m.onnx")
    save_model(build_model("gpt", "paper", layers=24, hidden=1024, heads=16, seq=1024), path)
    runs: dict[str, list[float]] = {"split": [], ALL: []}
    counts = {}
    for _ in range(repeats):
        for axes in runs:
            exp, cpu = _search(path, "sgd", axes, devices, "h100", 1)
            runs[axes].append(cpu)
            counts[axes] = (len(exp.searches), len(exp.merged))
            print(f"{axes}: {cpu:.1f} s CPU, {counts[axes]}", flush=True)
    base = statistics.median(runs["split"])
    every = statistics.median(runs[ALL])
    # each pair's own ratio: the two searches of a pair run minutes apart at most, so a
    # host whose speed moves between pairs moves both
    pairs = [a / b for a, b in zip(runs[ALL], runs["split"], strict=True)]
    return [
        TIME,
        "",
        f"Devices {','.join(map(str, devices))}, every mesh.",
        "",
        f"| axes | problems | merged points | search CPU (median of {repeats}) | ratio |",
        "|---|---|---|---|---|",
        f"| split | {counts['split'][0]} | {counts['split'][1]} | {base:.1f} s | 1.00 |",
        f"| {ALL} | {counts[ALL][0]} | {counts[ALL][1]} | {every:.1f} s | {every / base:.2f} |",
        "",
        f"Each pair's ratio (split, then every axis): "
        f"{', '.join(f'{r:.2f}' for r in pairs)}; median {statistics.median(pairs):.2f}.",
        "",
        "One process (`jobs=1`), process CPU time, so the ratio holds under load; the "
        "target is 1.5.",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--devices", default="1,2,4,8,16,32,64", help="of the search-time part")
    ap.add_argument("--skip-targets", action="store_true")
    args = ap.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    where = (
        f"{stamp} — {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load {os.getloadavg()[0]:.1f} at the start."
    )
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_targets:
            lines = targets(tmp)
            parts.append((TARGETS, [lines[0], "", where, *lines[1:]]))
        if not args.skip_time:
            devices = [int(d) for d in args.devices.split(",")]
            lines = search_time(tmp, args.repeats, devices)
            parts.append((TIME, [lines[0], "", where, *lines[1:]]))
    for heading, lines in parts:
        text = "\n".join(lines) + "\n"
        print(text)
        if args.write:  # each part replaces its own subsection
            write_section(SECTION, text, heading)
    return 0


if __name__ == "__main__":
    sys.exit(main())
