"""What the search JSON costs: file size, peak RSS and time of ``search --json-out``.

Target: the search of ``bench_search_models.py`` (zoo ``gpt --preset paper --layers 24
--hidden 1024 --heads 16``, GPT-2-medium size; devices 1..64, every mesh shape, h100),
run three ways, each in a fresh process (``os.wait4``'s rusage: peak RSS of the largest
process of the search, wall time of the whole command):

- ``no JSON``: ``tensoropt search MODEL --devices 1..64``;
- ``compact``: the same with ``--json-out FILE`` (schema ``tensoropt.search/2``: per mesh
  a table of the strategies points use, each point a vector of indices into it);
- ``one plan per point``: the same search, then every point written with its whole plan
  (the ``tensoropt.search/1`` layout this replaced: ``plan_from_choice(...).to_json()``
  per point, ``indent=1``), by this script in a child process (``--child-expanded``).

The whole-run walls include the search (minutes on a loaded machine), so a fourth child
(``--child-write-times``) runs the search once and times only the writing: building
each document and writing it, compact then one plan per point, on the same search.

Then, in this process, every point of the compact file is expanded into its plan as
``compile --search FILE --pick INDEX`` does (``search_json.plan_of``), and the expanded
plans are checked equal to the ones the old layout carried (units and layouts).

Ratios are against ``no JSON`` (medians over ``--repeats`` runs, taking turns). On a
shared machine the whole-run walls vary more than the JSON costs; the writing-alone
times are the measure of that cost.

Usage: python benchmarks/bench_search_json.py [--repeats 2] [--dir DIR] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results import write_section  # noqa: E402  (benchmarks/ is on sys.path)

SECTION = "## Search JSON size"
MEDIUM = ("--layers", "24", "--hidden", "1024", "--heads", "16")
DEVICES = "1..64"
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    peak_rss: int
    file_bytes: int


def _child(argv: list[str], out: Path | None) -> Run:
    """``python ARGV`` in a fresh process: wall time, peak RSS, size of ``out``."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status):
            err.seek(0)
            sys.exit(f"python {' '.join(argv)} failed:\n{err.read()}")
    size = out.stat().st_size if out is not None else 0
    return Run(wall, usage.ru_maxrss * 1024, size)


def expanded_document(sg, profile, exp, model_path: str) -> dict:
    """The search JSON with one whole plan per point (what every point carried before)."""
    from tensoropt.search.driver import device_frontier, plan_from_choice

    per_device = {}
    for d in sorted({s.mesh.size for s in exp.searches}):
        per_device[str(d)] = [
            {
                "index": i,
                "mesh": list(s.mesh.shape),
                "time_s": p.time_s,
                "memory_bytes": p.memory_bytes,
                "samples_per_s": sg.batch / p.time_s,
                "summary": s.summaries[s.result.points.index(p)],
                "plan": plan_from_choice(s, p.choice, f"search point {d}:{i}").to_json(),
            }
            for i, (s, p) in enumerate(device_frontier(exp, d))
        ]
    return {
        "schema": "tensoropt.search/1",
        "model": model_path,
        "cluster": profile.to_json(),
        "per_device": per_device,
        "frontier": [
            {
                "devices": p.devices,
                "mesh": list(p.mesh),
                "time_s": p.time_s,
                "memory_bytes": p.memory_bytes,
                "point": p.index,
            }
            for p in exp.merged
        ],  # fmt: skip
    }


def child_expanded(model: str, out: str) -> None:
    """The CLI's search (same parser, same explore), then the one-plan-per-point file."""
    from tensoropt.cli.cmd_search import explore_from_args
    from tensoropt.cli.common import parse_devices, write_atomic

    args = build_args(model)
    sg, profile, exp = explore_from_args(args, parse_devices(args.devices))
    doc = expanded_document(sg, profile, exp, model)
    write_atomic(out, json.dumps(doc, indent=1).encode())


def child_write_times(model: str, work: str) -> None:
    """One search, then the seconds to build and write each document (JSON on stdout)."""
    from tensoropt.cli.cmd_search import explore_from_args
    from tensoropt.cli.common import parse_devices, write_atomic
    from tensoropt.cli.json_output import document, dumps
    from tensoropt.cli.search_json import SCHEMA, search_document, step_options

    args = build_args(model)
    sg, profile, exp = explore_from_args(args, parse_devices(args.devices))
    start = time.perf_counter()
    body = search_document(sg, profile, exp, model, step_options(args))
    write_atomic(
        os.path.join(work, "t-compact.json"), dumps(document(SCHEMA, body), compact=True).encode()
    )
    compact = time.perf_counter() - start
    start = time.perf_counter()
    doc = expanded_document(sg, profile, exp, model)
    write_atomic(os.path.join(work, "t-expanded.json"), json.dumps(doc, indent=1).encode())
    expanded = time.perf_counter() - start
    print(json.dumps({"compact": compact, "expanded": expanded}))


def build_args(model: str) -> argparse.Namespace:
    from tensoropt.cli import build_parser

    return build_parser().parse_args(["search", model, "--devices", DEVICES])


def check_expansion(compact: Path, expanded: Path) -> tuple[int, float]:
    """Expand every point of the compact file; each plan must equal the old file's.
    Returns (points, seconds to load the file and expand them all)."""
    from tensoropt.cli.search_json import PickedRow, load_search, plan_of

    old = json.loads(expanded.read_text())["per_device"]
    start = time.perf_counter()
    sf = load_search(str(compact))
    plans = {
        (d, i): plan_of(sf, PickedRow(int(d), i, row), "")
        for d, rows in sf.doc["per_device"].items()
        for i, row in enumerate(rows)
    }
    seconds = time.perf_counter() - start
    for (d, i), plan in plans.items():
        ours, theirs = plan.to_json(), old[d][i]["plan"]
        assert ours["units"] == theirs["units"] and ours["mesh"] == theirs["mesh"], (d, i)
    assert len(plans) == sum(len(rows) for rows in old.values())
    return len(plans), seconds


def _median(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def report(runs: dict[str, list[Run]], points: int, expand_s: float, writes: dict, args) -> str:
    base = runs["no JSON"]
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0]
    lines = [
        SECTION,
        "",
        f"`python benchmarks/bench_search_json.py --repeats {args.repeats}` -- {now}, "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load:.1f} at the end. Search: zoo `gpt --preset paper "
        f"{' '.join(MEDIUM)}` (GPT-2-medium size), `--devices {DEVICES}`, every mesh, h100; "
        f"{points} points over the per-device-count frontiers. Each run is a fresh process "
        "(peak RSS of the largest process of the search); medians, ratios against the "
        "search without JSON.",
        "",
        "| run | file | peak RSS | wall | RSS ratio | time ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rs in runs.items():
        size = _median(rs, "file_bytes")
        lines.append(
            f"| {name} | {size / MIB:.1f} MiB | {_median(rs, 'peak_rss') / MIB:.0f} MiB | "
            f"{_median(rs, 'wall_s'):.1f} s | "
            f"{_median(rs, 'peak_rss') / _median(base, 'peak_rss'):.2f} | "
            f"**{_median(rs, 'wall_s') / _median(base, 'wall_s'):.2f}** |"
            if name != "no JSON"
            else f"| {name} | - | {_median(rs, 'peak_rss') / MIB:.0f} MiB | "
            f"{_median(rs, 'wall_s'):.1f} s | 1.00 | 1.00 |"
        )
    compact, expanded = runs["compact"], runs["one plan per point"]
    shrink = _median(expanded, "file_bytes") / _median(compact, "file_bytes")
    walls = [r.wall_s for rs in runs.values() for r in rs]
    lines += [
        "",
        "The walls are the search's (minutes here: the machine was shared with other jobs, "
        f"load average {args.load_start:.1f} at the start), and the runs "
        f"ranged {min(walls):.0f}-{max(walls):.0f} s over all variants, so the whole-run "
        "time ratios are noise; the cost of the JSON is the writing, timed alone: on one "
        f"search in one process, compact {writes['compact']:.2f} s, one plan per point "
        f"{writes['expanded']:.2f} s ({writes['expanded'] / writes['compact']:.0f}x). The "
        "compact file leaves the peak RSS where the search puts it; one plan per point "
        "raises it.",
        "",
        f"The compact file is {shrink:.0f}x smaller than one plan per point. Expanding all "
        f"{points} points from it (load + `plan_of`, what `compile --search` does for one) "
        f"took {expand_s:.2f} s in one process, and every expanded plan equals the plan the "
        "old layout carried.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument(
        "--child-expanded", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS
    )
    parser.add_argument("--child-write-times", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_expanded:
        child_expanded(*args.child_expanded)
        return
    if args.child_write_times:
        child_write_times(*args.child_write_times)
        return
    args.load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        model = work / "gpt_med.onnx"
        subprocess.run(
            [sys.executable, "-m", "tensoropt", "model", "gpt", "--preset", "paper", *MEDIUM,
             "-o", str(model)],
            check=True, capture_output=True,
        )  # fmt: skip
        compact, expanded = work / "compact.json", work / "expanded.json"
        search = ["-m", "tensoropt", "search", str(model), "--devices", DEVICES]
        variants = {
            "no JSON": (search, None),
            "compact": ([*search, "--json-out", str(compact)], compact),
            "one plan per point": (
                [__file__, "--child-expanded", str(model), str(expanded)],
                expanded,
            ),
        }
        runs: dict[str, list[Run]] = {name: [] for name in variants}
        for k in range(args.repeats):
            for name, (argv, out) in variants.items():
                runs[name].append(_child(argv, out))
                print(f"repeat {k}: {name}: {runs[name][-1]}", file=sys.stderr)
        timing = subprocess.run(
            [sys.executable, __file__, "--child-write-times", str(model), str(work)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        writes = json.loads(timing.stdout.strip().splitlines()[-1])
        points, expand_s = check_expansion(compact, expanded)
    text = report(runs, points, expand_s, writes, args)
    print(text)
    if args.write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
