"""Is calibration deterministic enough? Two ``tensoropt calibrate`` runs in a row, compared.

The bound: the rates of two full calibrations in a row are within 15% of each other
(``compare.DETERMINISM``). Compared rate by rate: every op family's median throughput, every
entry of the training-step rate grids (MatMul, Conv, BatchNorm), every collective's
alpha and bandwidth, and the joint link. The ratio is second / first - 1; the run
passes when every |ratio| <= 15%.

Usage: python benchmarks/bench_calibrate.py [--profiles A.json B.json] [--quick] [--write]
(without --profiles it calibrates twice, 5-10 minutes each on the 2-core machine, with
the machine's load).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import tempfile
from pathlib import Path

from results import write_section

from tensoropt.calibrate.compare import DETERMINISM as BOUND
from tensoropt.calibrate.compare import compare

SECTION = "## Estimates against measurements"
SUBSECTION = "### Calibration determinism (two calibrations in a row)"


def calibrate(path: Path, quick: bool) -> None:
    from tensoropt.cli import main

    argv = ["calibrate", "-o", str(path), *(["--quick"] if quick else [])]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"calibrate failed ({code})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs=2, metavar="FILE.json", help="compare these two")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-calibrate-") as tmp:
        paths = [Path(p) for p in args.profiles] if args.profiles else []
        if not paths:
            paths = [Path(tmp) / "first.json", Path(tmp) / "second.json"]
            for path in paths:
                calibrate(path, args.quick)
        first, second = (json.loads(p.read_text()) for p in paths)
    rows = compare(first, second)
    worst = max(rows, key=lambda r: abs(r.change))
    verdict = "meets" if abs(worst.change) <= BOUND else "misses"
    dates = " and ".join(p["calibration"]["date"] for p in (first, second))
    head = (
        f"`python benchmarks/bench_calibrate.py{' --quick' if args.quick else ''}` -- "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} "
        f"cores ({first['machine']['cpu']}), Python {platform.python_version()}, load average "
        f"{load:.1f} at the start. Calibrations of {dates} "
        f"({first['calibration'].get('launches', 1)} MPI launches and "
        f"{first['calibration'].get('compute_passes', 1)} compute passes each; "
        f"{first['calibration']['seconds']:.0f} s and {second['calibration']['seconds']:.0f} s, "
        f"load average {first['machine']['load_average_1min']:.1f} and "
        f"{second['machine']['load_average_1min']:.1f} at their ends). "
        f"**Worst difference {worst.change:+.1%} ({worst.name}): {verdict} the {BOUND:.0%} bound.**"
    )
    table = ["| rate | first | second | second / first - 1 |", "|---|---:|---:|---:|"]
    table += [f"| {r.name} | {r.first:.4g} | {r.second:.4g} | {r.change:+.1%} |" for r in rows]
    text = "\n".join([SUBSECTION, "", head, "", *table, ""])
    print(text)
    if args.write:
        write_section(SECTION, text, SUBSECTION)


if __name__ == "__main__":
    main()
