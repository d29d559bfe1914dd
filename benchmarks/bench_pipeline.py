"""Pipeline stages on the cost model at scale: what pipelined points buy, the Megatron-LM
configuration against the frontier, and the search time with stages against without,
measured in the same run.

Run: python benchmarks/bench_pipeline.py [--write] [--layers 96 --hidden 12288 --heads 96
--seq 2048 --batch 1536] [--devices 64] [--micro-batches 1,32] [--stages 2,4,8,16]
[--epsilon E] [--jobs N]

Zoo `gpt --preset paper` of the given shape (default: the GPT-3 175B shape), Adam, h100
(8 devices per node). Two searches of the same devices, exact or both with --epsilon,
in this process (`jobs=1`, process CPU time; --jobs N > 1: N worker processes and
wall-clock time): `--axes split,micro` (no stages) and `--axes split,stages` (the same
micro-batch counts, plus pipelines over them). Per device count: the fastest point and the
least memory of each, and whether the frontier with stages holds a point that equals or
dominates the best non-pipelined one; the `megatron+pp` reference (Megatron within each
stage, its fastest cut) against the frontier, and Megatron-LM's own layout (tensor
parallelism over one node's 8 devices in every stage, 16 stages, data parallelism over
the rest: tp=8 x pp=16 at 128 devices, dp=8 x tp=8 x pp=16 at 1024) when the stage
counts include 16. Results go to benchmarks/RESULTS.md
("## Pipeline stages", a subsection per shape, and one more for runs with --epsilon)
with --write.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

from results import write_section  # benchmarks/ is on sys.path when run as a script

from tensoropt.cli import build_parser
from tensoropt.cli.cmd_search import search_space
from tensoropt.cli.common import search_graph
from tensoropt.cost.cluster import builtin
from tensoropt.models import build_model, save_model
from tensoropt.search.driver import device_frontier, explore, mesh_label

SECTION = "## Pipeline stages"
NODE = 8  # h100 devices per node
LM_STAGES = 16  # Megatron-LM's pipeline stages for GPT-3 175B
GIB = 2**30


def _search(path: str, axes: str, devices, micro: str, stages: str, epsilon=None, jobs=1):
    """The exploration and its time: process CPU with one job, else wall-clock (the
    workers' CPU is not this process's)."""
    args = build_parser().parse_args(
        ["search", path, "--optimizer", "adam", "--axes", axes, "--micro-batches", micro,
         "--stages", stages]
    )  # fmt: skip
    sg = search_graph(args)
    clock = time.process_time if jobs == 1 else time.perf_counter
    start = clock()
    exp = explore(
        sg,
        devices,
        "auto",
        builtin("h100"),
        jobs=jobs,
        epsilon=epsilon,
        space=search_space(args, sg),
    )
    return exp, clock() - start


def _fmt(s, p) -> str:
    mesh = mesh_label(s.mesh.shape, s.variant.stages)
    return f"{p.time_s:.3g} s, {p.memory_bytes / GIB:.1f} GiB ({mesh})"


def _reference_cells(searches, frontier) -> tuple[str, str]:
    """The fastest ``megatron+pp`` reference of ``searches`` and whether a point of
    ``frontier`` equals or dominates it ("-" and "-" when there is none)."""
    refs = [s.references["megatron+pp"] for s in searches if "megatron+pp" in s.references]
    ref = min(refs, default=None)
    if ref is None:
        return "-", "-"
    matched = any(p.time_s <= ref[0] and p.memory_bytes <= ref[1] for _, p in frontier)
    return f"{ref[0]:.3g} s, {ref[1] / GIB:.1f} GiB", str(matched)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1536)
    ap.add_argument("--devices", default="64")
    ap.add_argument("--micro-batches", default="1,32")
    ap.add_argument("--stages", default="2,4,8,16")
    ap.add_argument(
        "--epsilon", type=float, default=None, help="both searches within (1+E) in time"
    )
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (> 1: wall-clock times)")
    args = ap.parse_args()
    devices = [int(d) for d in args.devices.split(",")]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    where = (
        f"{stamp} — {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load {os.getloadavg()[0]:.1f} at the start."
    )
    shape = (
        f"gpt --preset paper --layers {args.layers} --hidden {args.hidden} --heads "
        f"{args.heads} --seq {args.seq} --batch {args.batch}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gpt.onnx")
        save_model(
            build_model(
                "gpt", "paper", layers=args.layers, hidden=args.hidden, heads=args.heads,
                seq=args.seq, batch=args.batch,
            ),
            path,
        )  # fmt: skip
        plain, t_plain = _search(
            path, "split,micro", devices, args.micro_batches, args.stages, args.epsilon, args.jobs
        )
        print(f"without stages: {t_plain:.1f} s", flush=True)
        staged, t_staged = _search(
            path, "split,stages", devices, args.micro_batches, args.stages, args.epsilon, args.jobs
        )
        print(f"with stages: {t_staged:.1f} s", flush=True)
    # an epsilon run keeps its own subsection: it must not replace the exact run's
    lines = [
        f"### {shape}, Adam, h100" + ("" if args.epsilon is None else f", epsilon {args.epsilon}"),
        "",
        where,
        "",
        f"Devices {args.devices}; micro-batch counts {args.micro_batches}; stage counts "
        f"{args.stages}; "
        + ("exact" if args.epsilon is None else f"epsilon {args.epsilon}")
        + (
            ". Search CPU time (one process): "
            if args.jobs == 1
            else f". Search wall time ({args.jobs} worker processes): "
        )
        + f"{t_plain:.1f} s without stages, "
        f"{t_staged:.1f} s with ({t_staged / t_plain:.2f}x).",
        "",
        "| devices | fastest without | fastest with stages | least memory without | "
        "least memory with stages | best non-pipelined matched | megatron+pp | "
        "megatron+pp matched | Megatron-LM layout (dp x tp=8 per stage, pp=16) | "
        "matched |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in devices:
        without, with_ = device_frontier(plain, d), device_frontier(staged, d)
        if not without or not with_:
            lines.append(f"| {d} | none | none | | | | | | | |")
            continue
        fastest = without[0][1]
        matched = any(
            p.time_s <= fastest.time_s and p.memory_bytes <= fastest.memory_bytes for _, p in with_
        )
        ref_cell, ref_matched = _reference_cells(
            [s for s in staged.searches if s.devices == d], with_
        )
        # Megatron-LM's layout: tensor parallelism over one node's 8 devices in every
        # stage, 16 stages, data parallelism over the replicas (its GPT-3 175B run:
        # tp=8 x pp=16, dp=8 at 1024 devices)
        lm_mesh = (NODE,) if d == NODE * LM_STAGES else (d // (NODE * LM_STAGES), NODE)
        lm_cell, lm_matched = _reference_cells(
            [
                s for s in staged.searches
                if s.devices == d and s.mesh.shape == lm_mesh and s.variant.stages == LM_STAGES
            ],
            with_,
        )  # fmt: skip
        lines.append(
            f"| {d} | {_fmt(*without[0])} | {_fmt(*with_[0])} | {_fmt(*without[-1])} | "
            f"{_fmt(*with_[-1])} | {matched} | {ref_cell} | {ref_matched} | {lm_cell} | "
            f"{lm_matched} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text, lines[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
