"""Frontier Tracking on real models: speed target, scaling, HiGHS, plan quality.

Run: python benchmarks/bench_search_models.py [--quick] [--write]

1. Target: the full frontier of `gpt` at GPT-2-medium size (24 layers, hidden 1024,
   16 heads, seq 1024) over devices 1..64 with every mesh shape, timed end to end
   (import + cost problems + search + merge), against the 10 s target.
2. Scaling: search time against depth (6..96 layers) at 8 devices, and against
   device count at 24 layers.
3. HiGHS: an Alpa-style integer program on the same cost tables (min time under 5
   memory budgets); ratio of its total time to one frontier, optima compared.
4. Quality: for every zoo paper model at 8, 16 and 64 devices on each built-in
   profile, the fastest and lowest-memory frontier points against the data-parallel
   and Megatron plans on the same cost model.
Every ratio is measured in this run. Results go to benchmarks/RESULTS.md with --write.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

from results import write_section  # benchmarks/ is on sys.path when run as a script

from tensoropt.cli.common import search_graph
from tensoropt.cost.cluster import BUILTIN_NAMES, builtin
from tensoropt.cost.model import build_problem
from tensoropt.models import MODEL_NAMES, build_model, save_model
from tensoropt.search.driver import explore, mesh_shapes
from tensoropt.search.ilp import ilp_min_time
from tensoropt.search.solver import solve

SECTION = "## Frontier Tracking on real models"
TARGET = "### Target: GPT-2-medium size (24 layers, hidden 1024), devices 1..64, every mesh shape"


def _args(path: str) -> argparse.Namespace:
    return argparse.Namespace(
        model=path,
        input_shape=None,
        trainable=None,
        freeze=None,
        optimizer="sgd",
        momentum=0.9,
        loss="auto",
    )


def _model(tmp: str, name: str, preset: str, **knobs) -> str:
    path = os.path.join(tmp, f"{name}_{preset}_{'_'.join(map(str, knobs.values()))}.onnx")
    if not os.path.exists(path):
        save_model(build_model(name, preset, **knobs), path)
    return path


def target(tmp: str, repeats: int = 3) -> list[str]:
    path = _model(tmp, "gpt", "paper", layers=24, hidden=1024, heads=16)
    load = os.getloadavg()[0]
    walls, cpus = [], []
    for _ in range(repeats):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        sg = search_graph(_args(path))
        exp = explore(sg, [1, 2, 4, 8, 16, 32, 64], "auto", builtin("h100"))
        walls.append(time.perf_counter() - start)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        pairs = ((r0, r1), (c0, c1))
        fields = ("ru_utime", "ru_stime")
        cpus.append(sum(getattr(b, f) - getattr(a, f) for a, b in pairs for f in fields))
    usage = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    rss = max(resource.getrusage(w).ru_maxrss for w in usage) / 1024
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    ok = "meets" if wall <= 10 else "misses"
    return [
        TARGET,
        "",
        "`tensoropt search gpt_med.onnx --devices 1..64` end to end (import, cost problems, "
        "search, merge), zoo `gpt --preset paper --layers 24 --hidden 1024 --heads 16` "
        f"(seq 1024), profile h100: {len(exp.searches)} (devices, mesh) problems after "
        "skipping 2-D meshes whose data axis cannot split the batch, "
        f"{len(exp.merged)} points on the merged frontier; {os.cpu_count()} cores, one search "
        f"process per core, load average {load:.1f} at the start.",
        "",
        "| runs | median wall | runs' walls | median CPU (all processes) | peak RSS | target |",
        "|---:|---:|---|---:|---:|---|",
        f"| {repeats} | **{wall:.1f} s** | {', '.join(f'{w:.1f}' for w in walls)} s | "
        f"{cpu:.1f} s | {rss:.0f} MiB | {ok} 10 s |",
        "",
    ]


def scaling(tmp: str, quick: bool) -> list[str]:
    lines = [
        "### Scaling",
        "",
        "| layers | devices | units | solve s | frontier points |",
        "|---:|---:|---:|---:|---:|",
    ]
    depths = [6, 12, 24] if quick else [6, 12, 24, 48, 96]
    profile = builtin("h100")
    for layers in depths:
        sg = search_graph(_args(_model(tmp, "gpt", "paper", layers=layers, hidden=1024, heads=16)))
        for mesh in mesh_shapes(8, "auto")[:2]:
            mp = build_problem(sg, mesh, profile)
            t = time.perf_counter()
            r = solve(mp.problem)
            lines.append(
                f"| {layers} | {'x'.join(map(str, mesh.shape))} | "
                f"{len(mp.problem.units)} | {time.perf_counter() - t:.2f} | "
                f"{len(r.points)} |"
            )
    sg = search_graph(_args(_model(tmp, "gpt", "paper", layers=24, hidden=1024, heads=16)))
    for d in [2, 4, 8, 16, 32, 64]:
        meshes = mesh_shapes(d, "auto")
        t = time.perf_counter()
        for mesh in meshes:
            solve(build_problem(sg, mesh, profile).problem)
        lines.append(
            f"| 24 | {d} ({len(meshes)} meshes) | - | "
            f"{time.perf_counter() - t:.2f} (incl. costing) | - |"
        )
    return [*lines, ""]


def highs(tmp: str) -> list[str]:
    lines = [
        "### Against an Alpa-style integer program (HiGHS), same cost tables",
        "",
        "| model | mesh | frontier s | 5 ILP solves s | ratio | optima identical |",
        "|---|---|---:|---:|---:|---|",
    ]
    profile = builtin("h100")
    for name, knobs, mesh_spec in (("gpt", {"layers": 6}, 8), ("bert", {"layers": 6}, 8)):
        sg = search_graph(_args(_model(tmp, name, "paper", **knobs)))
        for mesh in mesh_shapes(mesh_spec, "auto")[:2]:
            mp = build_problem(sg, mesh, profile)
            t = time.perf_counter()
            points = solve(mp.problem).points
            t_ft = time.perf_counter() - t
            lo, hi = points[-1].memory_bytes, points[0].memory_bytes
            budgets = [lo + (hi - lo) * k / 4 for k in range(5)]
            t = time.perf_counter()
            same = True
            for b in budgets:
                _, ilp_t = ilp_min_time(mp.problem, b)
                best = min(p.time_s for p in points if p.memory_bytes <= b)
                same &= abs(ilp_t - best) <= 1e-9 * best
            t_ilp = time.perf_counter() - t
            lines.append(
                f"| {name} {knobs['layers']}L | {'x'.join(map(str, mesh.shape))} | "
                f"{t_ft:.2f} | {t_ilp:.2f} | {t_ilp / max(t_ft, 1e-9):.1f}x | "
                f"{'yes' if same else 'NO'} |"
            )
    return [*lines, ""]


def quality(
    tmp: str,
    quick: bool,
    only_models: list[str] | None = None,
    only_profiles: list[str] | None = None,
    only_devices: list[int] | None = None,
) -> list[str]:
    lines = [
        "### Plan quality against data parallelism and Megatron (same cost model)",
        "",
        "| model | profile | devices | fastest ms | its memory GiB | lowest memory GiB |"
        " DP ms / GiB | Megatron ms / GiB | time saved vs DP | memory saved vs DP |"
        " dominates DP & Megatron |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    models = only_models or (["gpt", "mlp"] if quick else list(MODEL_NAMES))
    profiles = only_profiles or (["h100"] if quick else list(BUILTIN_NAMES))
    device_counts = only_devices or ([8] if quick else [8, 16, 64])
    for name in models:
        sg = search_graph(_args(_model(tmp, name, "paper")))
        for profile in profiles:
            for d in device_counts:
                t0 = time.perf_counter()
                exp = explore(sg, [d], "auto", builtin(profile))
                pts = [p for s in exp.searches for p in s.result.points]
                fastest = min(pts, key=lambda p: p.time_s)
                lowest = min(pts, key=lambda p: p.memory_bytes)
                best_ref = {}
                for s in exp.searches:
                    for n, (t, m, _) in s.references.items():
                        if n not in best_ref or t < best_ref[n][0]:
                            best_ref[n] = (t, m)
                dominated = all(
                    any(p.time_s <= t and p.memory_bytes <= m for p in pts)
                    for s in exp.searches
                    for (t, m, _) in s.references.values()
                )
                dp = best_ref.get("data-parallel")
                mg = best_ref.get("megatron")
                t_save = f"{(1 - fastest.time_s / dp[0]) * 100:.0f}%" if dp else "-"
                m_save = f"{(1 - lowest.memory_bytes / dp[1]) * 100:.0f}%" if dp else "-"
                lines.append(
                    f"| {name} | {profile} | {d} | {fastest.time_s * 1e3:.1f} | "
                    f"{fastest.memory_bytes / 2**30:.2f} | {lowest.memory_bytes / 2**30:.2f} | "
                    f"{fmt(dp)} | {fmt(mg)} | {t_save} | {m_save} | "
                    f"{'yes' if dominated else 'NO'} ({time.perf_counter() - t0:.0f} s) |"
                )
                print(lines[-1], flush=True)
    return [*lines, ""]


def fmt(r: tuple[float, float] | None) -> str:
    return f"{r[0] * 1e3:.1f} / {r[1] / 2**30:.2f}" if r else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument("--only", choices=["target", "scaling", "highs", "quality"])
    parser.add_argument("--models", help="quality: these zoo models only (comma-separated)")
    parser.add_argument("--profiles", help="quality: these built-in profiles only")
    parser.add_argument("--devices", help="quality: these device counts only (e.g. 16,64)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    only = args.models.split(",") if args.models else None
    profiles = args.profiles.split(",") if args.profiles else None
    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    parts = {
        "target": lambda: target(tmp),
        "scaling": lambda: scaling(tmp, args.quick),
        "highs": lambda: highs(tmp),
        "quality": lambda: quality(tmp, args.quick, only, profiles, devices),
    }
    lines = [
        SECTION,
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}",
        "",
    ]
    for key, fn in parts.items():
        if args.only and key != args.only:
            continue
        part = fn()
        print("\n".join(part), flush=True)
        lines += part
    if args.write and args.only:  # one subsection; the section's others stay
        write_section(SECTION, "\n".join(lines[4:]), subsection=lines[4])
    elif args.write:
        write_section(SECTION, "\n".join(lines))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
