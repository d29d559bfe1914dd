"""``tensoropt validate``: estimated vs measured step time and memory of searched plans."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensoropt.cli.cmd_search import add_search_options
from tensoropt.cli.json_output import add_json_flag, add_json_out
from tensoropt.errors import InfeasibleError, TensorOptError

if TYPE_CHECKING:
    from tensoropt.calibrate.memlink import LinkProbe
    from tensoropt.runtime.profiling import ProfileReport

EPILOG = """\
what it does: searches the frontier of MODEL at each device count with the cluster
profile (normally one from `tensoropt calibrate` on this machine), picks --points
points per count (fastest, min-memory and evenly spaced ones), compiles each exactly
as `compile --pick` does, runs it with `run --profile` (--steps steps, medians after
--warmup) --rounds times, in rounds over all plans, and compares its median round
(a disturbance of the host during one run then moves nothing):

  time    estimated step time vs the slowest rank's median measured step
  memory  the search's memory estimate vs the largest rank's measured memory (growth
          of anonymous resident memory over the step loop's start); the static-
          liveness peak of the emitted device graph is shown beside it

  link    with mpi, before each multi-device plan runs: is each rank on a memory link
          of its own? (the per-process bandwidth of processes streaming memory at
          once, against one alone; "shared" under 0.75). Some VM hosts put two vCPUs
          on one link at times, and then memory-bound ops run up to 2x slower than
          the calibration (timed alone) says; the summary gives the step-time error
          of the plans on own links and of those on a shared one apart (the estimate
          assumes a link per rank, as a device has its own memory)
  host    the host's speed: a fixed 1-thread onnxruntime graph (MatMul, Tanh, Mul),
          timed before and after each plan, over its time when the profile was
          calibrated (x1.10: the host ran 10% slower). A VM's speed drifts with its
          neighbours; the summary adds the step-time error with each estimate scaled
          by its plan's ratio, beside the raw error (for profiles from calibrate)

relative error = (estimate - measured) / measured; the summary is the median of
|error| over all plans. Plans that do not fit the profile's memory_bytes are not
searched; a model that fits at no requested device count exits 2.

--record appends each plan's errors to the profile file: the median |error| of its
recorded plans (one device, and several, apart) is the error band that search and
compile then print beside every estimate made with that profile.

examples:
  tensoropt calibrate -o here.json
  tensoropt model mlp -o mlp.onnx
  tensoropt validate mlp.onnx --devices 1,2 --cluster here.json --plot v.png
  tensoropt validate gpt.onnx --devices 1,2 --cluster here.json --points 6 --json-out v.json
  tensoropt validate gpt.onnx --devices 1,2 --cluster here.json --record
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "validate",
        help="compare the cost model's estimates with measured runs of frontier plans",
        description="Compile and run frontier plans of MODEL, and compare estimated with "
        "measured step time and memory per device.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument(
        "--devices", default="1,2", help="device counts: a list, A-B or A..B (default 1,2)"
    )
    p.add_argument("--mesh", default="auto", help="auto (1-D and 2-D) or one shape like 2x4")
    p.add_argument("--points", type=int, default=4, help="plans per device count (default 4)")
    p.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out (default 2)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run every plan this many times, in rounds over all plans, and compare the "
        "median round (default 3; 1: one run each, a third of the time)",
    )
    p.add_argument("--backend", choices=["mpi", "local"], default="mpi")
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default: profile's)")
    p.add_argument("--lr", type=float, default=0.01)
    add_search_options(p)
    add_json_flag(p, "tensoropt.validate/1")
    add_json_out(p, "tensoropt.validate/1")
    p.add_argument("--plot", metavar="FILE.png", help="estimated vs measured scatter (log-log)")
    p.add_argument(
        "--pipelined",
        action="store_true",
        help="with --axes ...,stages: validate points of the pipelined problems' own "
        "frontiers (pipelines rarely win on few devices, so the merged frontier may hold "
        "none)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="append each plan's errors to the --cluster profile file (its accuracy "
        "record): search and compile then show every estimate's error band",
    )
    p.set_defaults(func=run, cluster=None)


def _pipelined_frontier(exp, devices: int):
    """The non-dominated points of the pipelined problems at ``devices`` alone."""
    from tensoropt.search.merge import merge_frontiers

    group = [s for s in exp.searches if s.devices == devices and s.variant.stages > 1]
    if not group:
        raise TensorOptError(
            f"--pipelined: no pipelined problem at {devices} devices; search with --axes "
            "split,stages and a stage count that divides the device count"
        )
    by_key = {s.key: s for s in group}
    merged = merge_frontiers({k: s.result for k, s in by_key.items()})
    return [
        (
            by_key[(p.devices, p.mesh, p.variant)],
            by_key[(p.devices, p.mesh, p.variant)].result.points[p.index],
        )
        for p in merged
    ]


def oversubscribed(ranks: int, threads: int, cores: int | None = None) -> str | None:
    """What is wrong with running ``ranks`` ranks of ``threads`` threads on this
    machine's cores, or None when each thread has a core: a rank stands for a device,
    and ranks that wait for a core measure the host's crowding, not the plan."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if ranks * threads <= cores:
        return None
    fits = max(1, cores // threads)
    return (
        f"{ranks} rank{'s' if ranks != 1 else ''} x {threads} thread(s) need "
        f"{ranks * threads} cores and this machine "
        f"has {cores}: the ranks wait for cores, so their measured step times are not a "
        f"device's; validate at most {fits} device(s) here (or fewer --threads)"
    )


def _threads(args, devices) -> int:
    """The profile's threads per rank (what its rates were measured with), else cores//ranks."""
    if args.threads is not None:
        if args.threads < 1:
            raise TensorOptError(f"--threads {args.threads}: give at least 1")
        return args.threads
    if args.cluster.endswith(".json") and os.path.isfile(args.cluster):
        with open(args.cluster) as f:
            cal = json.load(f).get("calibration") or {}
        if isinstance(cal.get("threads_per_rank"), int) and cal["threads_per_rank"] >= 1:
            return cal["threads_per_rank"]
    return max(1, (os.cpu_count() or 1) // max(devices))


def _explore(args, devices):
    from tensoropt.cli.cmd_search import explore_from_args
    from tensoropt.cost.cluster import load_cluster

    profile = load_cluster(args.cluster)
    if args.memory_budget is None:
        args.memory_budget = f"{int(profile.memory_bytes)}B"
    try:
        return explore_from_args(args, devices)
    except InfeasibleError as exc:
        raise InfeasibleError(
            f"{args.model} does not fit at {', '.join(map(str, devices))} devices with "
            f"{args.cluster}: {exc}"
        ) from None


def _compute_only(args, profile):
    """``f(plan)``: the plan's estimated time with free communication, priced as
    ``compile`` prices it (its ZeRO stages, micro-batches and recomputed blocks too)."""
    import dataclasses

    from tensoropt.cli.cmd_compile import estimate_of
    from tensoropt.cli.common import build_step
    from tensoropt.cost.cluster import Link

    free = Link(0.0, 1e300)
    no_comm = dataclasses.replace(profile, intra=free, inter=free, collective_links={})

    def estimate(plan) -> float:
        return estimate_of(build_step(args, load_weights=False), plan, None, no_comm).time_s

    return estimate


def _check_args(args) -> None:
    if args.cluster is None:
        raise TensorOptError(
            "--cluster is required: a profile of this machine (`tensoropt calibrate -o "
            "here.json`), since measurements are taken here"
        )
    if args.points < 1:
        raise TensorOptError(f"--points {args.points}: give at least 1")
    if args.rounds < 1:
        raise TensorOptError(f"--rounds {args.rounds}: give at least 1")
    if args.record and not (args.cluster.endswith(".json") and os.path.isfile(args.cluster)):
        raise TensorOptError(
            f"--record writes into the --cluster profile file; {args.cluster!r} is not one "
            "(give the FILE.json of `tensoropt calibrate`)"
        )
    if not 0 <= args.warmup < args.steps:
        raise TensorOptError(
            f"--steps {args.steps} --warmup {args.warmup}: need 0 <= warmup < steps"
        )


@dataclass(frozen=True, slots=True)
class _Run:
    """One run of one plan: its profile, the memory-link probe and host speed around it."""

    profile: ProfileReport
    link: LinkProbe | None
    host: float | None


def _step_s(profile: ProfileReport) -> float:
    """The step time validate compares: the slowest rank's median step."""
    return max(r.step_s for r in profile.ranks)


def _median_round(runs: list[_Run]) -> _Run:
    """The run whose step time is the median of the plan's rounds (the lower middle of an
    even count): its compute, communication and memory are reported together."""
    return sorted(runs, key=lambda r: _step_s(r.profile))[(len(runs) - 1) // 2]


def _calibrated_reference(cluster: str | None) -> float | None:
    """The host-speed reference time that ``cluster`` was calibrated with, if any."""
    from tensoropt.calibrate.hostspeed import calibrated_reference

    if not cluster or not os.path.isfile(cluster):
        return None  # a built-in profile
    try:
        with open(cluster, encoding="utf-8") as f:
            return calibrated_reference(json.load(f))
    except (OSError, ValueError, AttributeError):
        return None  # _explore has read the profile already; nothing to report here


def run(args: argparse.Namespace) -> int:
    from tensoropt.calibrate import hostspeed, memlink
    from tensoropt.calibrate.validate import (
        PlanCheck,
        graph_facts,
        plot,
        report_json,
        select_points,
        table,
    )
    from tensoropt.cli.common import (
        build_step,
        check_output_file,
        parse_devices,
        progress,
    )
    from tensoropt.cli.json_output import emit, integral_bytes
    from tensoropt.cost.cluster import load_cluster
    from tensoropt.passes.compile import compile_step
    from tensoropt.runtime.run import run_steps
    from tensoropt.search.driver import device_frontier, plan_of_point

    _check_args(args)
    # the whole profile, its calibration and accuracy sections too, before anything is
    # read from it (threads per rank) or measured: --record writes into it at the end
    load_cluster(args.cluster)
    devices = parse_devices(args.devices)
    check_output_file(args.json_out, "--json-out")
    check_output_file(args.plot, "--plot")
    threads = _threads(args, devices)
    crowded = oversubscribed(max(devices) if args.backend == "mpi" else 1, threads)
    if crowded:
        print(f"validate: warning: {crowded}", file=sys.stderr)
    sg, profile, exp = _explore(args, devices)
    compute_only = _compute_only(args, profile)
    picks = []
    for d in devices:
        rows = _pipelined_frontier(exp, d) if args.pipelined else device_frontier(exp, d)
        for k in select_points(len(rows), args.points):
            picks.append((d, k, len(rows), *rows[k]))
    ranks = max(devices) if args.backend == "mpi" else 1  # local: the ranks take turns
    calibrated = _calibrated_reference(args.cluster)
    reference = hostspeed.Reference() if calibrated else None
    with (
        tempfile.TemporaryDirectory(prefix="tensoropt-validate-") as tmp,
        memlink.prober(ranks) as prober,
    ):
        plans = []
        for n, (d, k, _size, search, point) in enumerate(picks):
            plan = plan_of_point(search, point, f"validate point {k} at {d} devices")
            outdir = os.path.join(tmp, f"plan_{n}")
            compile_step(build_step(args), plan, None, outdir)
            plans.append((plan, outdir))
        # every plan once per round, the rounds one after another: a disturbance of the
        # host that lasts a run slows one plan's round, and the median round drops it
        runs: list[list[_Run]] = [[] for _ in picks]
        tasks = [(r, n) for r in range(args.rounds) for n in range(len(picks))]
        bar = progress(
            tasks,
            total=len(tasks),
            desc="validate",
            label=lambda t: (
                f"round {t[0] + 1}/{args.rounds}: {picks[t[1]][0]} devices, point {picks[t[1]][1]}"
            ),
        )
        for _r, n in bar:
            d, outdir = picks[n][0], plans[n][1]
            link = prober.probe() if prober is not None and d > 1 else None
            around = [reference.measure()] if reference else []
            result = run_steps(
                outdir,
                args.steps,
                backend=args.backend,
                threads=threads,
                profile=True,
                profile_warmup=args.warmup,
            )
            assert result.profile is not None
            if reference:
                around.append(reference.measure())
            runs[n].append(_Run(result.profile, link, hostspeed.host_ratio(around, calibrated)))
        checks = []
        for n, (d, k, size, search, point) in enumerate(picks):
            kept = _median_round(runs[n])
            summary = search.summaries[search.result.points.index(point)]
            facts = graph_facts(plans[n][1], profile.intra)
            checks.append(
                PlanCheck(
                    d, tuple(search.mesh.shape), k, size, summary, point.time_s,
                    point.memory_bytes, facts.liveness_peak, kept.profile,
                    compute_only(plans[n][0]), facts.state_bytes, facts.comm_s,
                    facts.collectives, kept.link, search.variant.to_json(len(search.blocks)),
                    kept.host, tuple(_step_s(r.profile) for r in runs[n]),
                )
            )  # fmt: skip
    if not args.json:  # with --json, stdout is the document alone
        print(table(checks))
    meta = {
        "model": args.model,
        "cluster": args.cluster,
        "devices": devices,
        "backend": args.backend,
        "threads_per_rank": threads,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    if args.record:
        from tensoropt.cost.accuracy import record

        held = record(
            args.cluster,
            os.path.basename(args.model),
            [
                (c.devices, c.time_error, c.memory_error, None if c.link is None else c.link.shared)
                for c in checks
            ],
        )
        print(
            f"recorded {len(checks)} plans in {args.cluster} (its accuracy record holds "
            f"{held}; search and compile show the error band)",
            file=sys.stderr,
        )
    emit(args, integral_bytes(report_json(checks, meta)))
    if args.json_out:
        print(f"wrote json: {args.json_out}", file=sys.stderr)
    if args.plot:
        plot(checks, args.plot)
        print(f"wrote plot: {args.plot}", file=sys.stderr)
    return 0
