"""Benchmark of the Frontier Tracking search (a script, not a test).

(a) transformer-shaped problems of depth 6..96: solve time with and without block
    recognition (exact), and with blocks at epsilon = 0.05;
(b) an Alpa-style integer program solved by HiGHS on the same tables: minimum time under a
    memory budget at 5 budgets; the optima must be identical to the frontier's;
(c) scaling with the number of strategies (device counts 1..64);
(d) the target case: 24 layers over 7 device counts, including the merge.

Prints tables and ratios measured in the same run, and appends them to
benchmarks/RESULTS.md under "## Frontier Tracking search".

    python benchmarks/bench_search.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import numpy as np

from tensoropt.search import BlockMode, merge_frontiers, solve
from tensoropt.search.ilp import ilp_min_time
from tensoropt.search.synthetic import MESHES, transformer_problem

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADING = "## Frontier Tracking search"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def depth_table(depths: list[int], mesh: tuple[int, ...]) -> list[str]:
    rows = [
        f"(a) depth scaling, mesh {mesh}, exact unless noted",
        "| layers | units | points | blocks s | no-blocks s | speedup | eps=0.05 s | eps points |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layers in depths:
        p = transformer_problem(layers, mesh)
        with_b, tb = timed(lambda p=p: solve(p))
        without, tn = timed(lambda p=p: solve(p, blocks=BlockMode.OFF))
        assert with_b.points == without.points or [
            (q.time_s, q.memory_bytes) for q in with_b.points
        ] == [(q.time_s, q.memory_bytes) for q in without.points]
        approx, te = timed(lambda p=p: solve(p, epsilon=0.05))
        rows.append(
            f"| {layers} | {len(p.units)} | {len(with_b.points)} | {tb:.2f} | {tn:.2f} | "
            f"{tn / tb:.1f}x | {te:.2f} | {len(approx.points)} |"
        )
        print(rows[-1], flush=True)
    return rows


def ilp_table(layers_list: list[int], mesh: tuple[int, ...]) -> list[str]:
    rows = [
        f"(b) FT vs Alpa-style MILP (HiGHS), mesh {mesh}, min time under 5 memory budgets",
        "| layers | FT frontier s | FT 5x budget s | MILP 5 solves s | MILP/FT | optima equal |",
        "|---|---|---|---|---|---|",
    ]
    for layers in layers_list:
        p = transformer_problem(layers, mesh)
        full, t_ft = timed(lambda p=p: solve(p))
        pts = full.points
        picks = np.linspace(0, len(pts) - 1, 5).round().astype(int)
        budgets = [
            pts[k].memory_bytes * 1.0001
            if k == 0
            else (pts[k].memory_bytes + pts[k - 1].memory_bytes) / 2
            for k in picks
        ]
        t_ilp = t_budget = 0.0
        equal = True
        for k, b in zip(picks, budgets, strict=True):
            fb, tb = timed(lambda p=p, b=b: solve(p, memory_budget=b))
            t_budget += tb
            (choice, ilp_time), ti = timed(lambda p=p, b=b: ilp_min_time(p, b))
            t_ilp += ti
            ft_time = pts[k].time_s
            ok = ilp_time == ft_time == fb.points[0].time_s and p.evaluate(choice)[1] <= b
            equal &= ok
            if not ok:
                print(f"  MISMATCH layers={layers} budget={b}: FT {ft_time!r} MILP {ilp_time!r}")
        rows.append(
            f"| {layers} | {t_ft:.2f} | {t_budget:.2f} | {t_ilp:.2f} | {t_ilp / t_ft:.1f}x | "
            f"{'yes' if equal else 'NO'} |"
        )
        print(rows[-1], flush=True)
        assert equal, "MILP optimum differs from the frontier"
    return rows


def strategies_table(layers: int) -> list[str]:
    rows = [
        f"(c) strategies scaling, {layers} layers, exact, with blocks",
        "| devices | mesh | max strategies/unit | mean | points | solve s |",
        "|---|---|---|---|---|---|",
    ]
    for d, mesh in MESHES.items():
        p = transformer_problem(layers, mesh)
        counts = [len(u.strategies) for u in p.units]
        r, t = timed(lambda p=p: solve(p))
        rows.append(
            f"| {d} | {'x'.join(map(str, mesh))} | {max(counts)} | {np.mean(counts):.1f} | "
            f"{len(r.points)} | {t:.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


def target_table(layers: int) -> list[str]:
    problems = {(d, mesh): transformer_problem(layers, mesh) for d, mesh in MESHES.items()}
    results, t_solve = timed(lambda: {k: solve(p) for k, p in problems.items()})
    merged, t_merge = timed(lambda: merge_frontiers(results))
    row = (
        f"(d) {layers} layers x 7 device counts (1..64): solve {t_solve:.2f} s, merge "
        f"{t_merge:.3f} s, {sum(len(r.points) for r in results.values())} points -> "
        f"{len(merged)} merged"
    )
    print(row, flush=True)
    return [row]


def append_results(lines: list[str]) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    headings = [ln for ln in text.splitlines() if ln.startswith("## ")]
    block = "\n".join(lines) + "\n"
    if not headings or headings[-1] != HEADING:
        block = f"\n{HEADING}\n" + block
    RESULTS.write_text(text.rstrip("\n") + "\n" + block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller depths (for a smoke run)")
    ap.add_argument("--no-write", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    depths = [6, 12, 24] if args.quick else [6, 12, 24, 48, 96]
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, numpy {np.__version__}"
    )
    lines = [f"\n### {stamp} — {machine}{' (quick)' if args.quick else ''}\n"]
    lines += depth_table(depths, (2, 4)) + [""]
    lines += ilp_table([6] if args.quick else [6, 12], (2, 4)) + [""]
    lines += strategies_table(12) + [""]
    lines += target_table(24)
    if not args.no_write:
        append_results(lines)


if __name__ == "__main__":
    main()
