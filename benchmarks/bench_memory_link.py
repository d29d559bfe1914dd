"""Memory-bound rates timed alone and beside a busy neighbour, against the host's memory link.

The evidence behind docs/design.md, "Compute is timed alone". Rounds alternate,
within one run: a probe of the memory link (``tensoropt.calibrate.memlink``: per-process
bandwidth of two processes streaming at once against one alone), then a few calibration
cases measured alone in a fresh process (as ``calibrate`` does), then the same beside
one neighbour running the case's training step (``calibrate --neighbours 1``). The
baseline of each round is the alone measurement; the ratio neighbour / alone is
printed for each case, with the probe taken before it.

Usage: python benchmarks/bench_memory_link.py [--rounds R] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics

from results import write_section

from tensoropt.calibrate import kernels, memlink
from tensoropt.calibrate.neighbours import busy_neighbours
from tensoropt.calibrate.passes import measure_pass
from tensoropt.calibrate.profile import CalibrateOptions, _kernel_options

SECTION = "## Estimates against measurements"
SUBSECTION = "### Two ranks on one memory link: alone against beside a neighbour"
CASES = (  # two memory-bound cases, a norm and a convolution
    "Relu 1024x1024",
    "Add 4096x1024 x 4096x1024",
    "BatchNormalization 8x32x32x32 x 32 x 32 x 32 x 32",
    "Conv 8x32x16x16 x 32x32x3x3",
)


def _short(label: str) -> str:
    op, shape = label.split()[:2]
    return f"{op} {shape}"


def measure(cases, neighbours: int) -> dict[str, float]:
    """Kernel rate of each case (B/s or FLOP/s), measured in a fresh process."""
    kopts = _kernel_options(CalibrateOptions())
    with busy_neighbours(neighbours, kopts, cases) as pacer:
        results = measure_pass(kopts, cases, pacer, lambda _label: None)
    return {_short(r.case.label()): r.rate for r, _ in results}


def spread(values: list[float]) -> str:
    return f"{min(values):.3g}-{max(values):.3g} ({max(values) / min(values) - 1:+.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench_memory_link: needs two cores (a neighbour and a probe)")
    cases = [c for c in kernels.cases(False) if c.label() in CASES]
    names = [_short(c.label()) for c in cases]
    rows, alone, beside, shared_beside = [], {n: [] for n in names}, {n: [] for n in names}, []
    start = datetime.datetime.now()
    with memlink.Prober(2) as prober:
        for r in range(args.rounds):
            probe = prober.probe()
            solo = measure(cases, 0)
            busy = measure(cases, 1)
            after = prober.probe()
            for n in names:
                alone[n].append(solo[n])
                beside[n].append(busy[n])
            shared_beside.append(probe.shared or after.shared)
            ratios = " | ".join(f"{busy[n] / solo[n]:.2f}" for n in names)
            rows.append(
                f"| {r + 1} | {probe.ratio:.2f}, {after.ratio:.2f} | "
                + " | ".join(f"{solo[n]:.3g}" for n in names)
                + f" | {ratios} |"
            )
            print(rows[-1], flush=True)
    head = (
        f"`python benchmarks/bench_memory_link.py --rounds {args.rounds}` -- "
        f"{start:%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}. Each round: a memory-link probe (two processes "
        "streaming 64 MiB at once, per-process bandwidth over one alone's: ~1 own links, "
        "~0.5 one shared link), the cases alone in a fresh process (the baseline), the "
        "same beside one neighbour running the case's training step, a second probe. "
        "Kernel rates in B/s (Relu, Add, BatchNorm) or FLOP/s (Conv)."
    )
    table = [
        "| round | link probes (before, after) | "
        + " | ".join(f"{n} alone" for n in names)
        + " | "
        + " | ".join(f"{n} beside / alone" for n in names)
        + " |",
        "|---:|---|" + "---:|" * (2 * len(names)),
        *rows,
    ]
    summary = ["| case | alone: range over rounds | beside a neighbour: range | beside / alone, "
               "median: own link / shared link |", "|---|---|---|---|"]  # fmt: skip
    for n in names:
        own = [b / a for a, b, s in zip(alone[n], beside[n], shared_beside, strict=True) if not s]
        shared = [b / a for a, b, s in zip(alone[n], beside[n], shared_beside, strict=True) if s]
        med = lambda v: f"{statistics.median(v):.2f} ({len(v)})" if v else "- (0)"  # noqa: E731
        summary.append(
            f"| {n} | {spread(alone[n])} | {spread(beside[n])} | {med(own)} / {med(shared)} |"
        )
    text = "\n".join([head, "", *summary, "", *table, ""])
    print(text)
    if args.write:
        write_section(SECTION, f"{SUBSECTION}\n\n{text}", SUBSECTION)


if __name__ == "__main__":
    main()
