"""``tensoropt calibrate``: measure this machine's compute and collective rates."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from tensoropt.cli.common import Given, check_output_file, given
from tensoropt.errors import TensorOptError

EPILOG = """\
what it measures (medians of --repeats runs, with the spread IQR/median of each):
  compute   per op family through onnxruntime (CPU EP, the runtime's session options,
            intra-op threads pinned to what one rank gets: cores // ranks): MatMul from
            32^3 to 1024^3, ResNet-like Convs, element-wise, reductions, Softmax,
            LayerNorm, MaxPool; each op's time inside a graph (the slope between a model
            holding it once and one holding it R times), so one session.run's fixed cost
            is not charged to every op; MatMul, Conv and BatchNorm also as training
            steps on a grid of shapes. Every timed call starts on evicted caches (a
            step reads weights and saved tensors from memory). Each case is timed
            alone: the rates are a rank's on a memory link of its own, as each
            accelerator has its own memory. On a VM whose host sometimes puts two
            vCPUs on one memory link, ranks streaming memory at once then run
            memory-bound ops up to 2x slower than that, and a calibration beside busy
            processes (--neighbours) gets whichever the host gave it that minute.
            Against disturbances by other work on the host: every case's training
            step is measured in --passes passes over all cases (minutes apart, each
            in a fresh process), keeping its median; the file records how far apart
            they were. The forward kernels alone are timed in every pass too
            (shorter blocks), each keeping its median pass: the cost model prices an
            op's step as forward x (1 + backward ratio), the ratio measured against
            that forward.
            Measuring processes start with the MPI ranks' malloc settings (see `run
            --help`: heap thresholds, transparent huge pages). Also: a Softmax on
            causally masked scores against plain ones (softmax_masked_s: onnxruntime's
            CPU Softmax slows down where exp underflows on some hosts; 0 where the two
            timings differ by no more than their own spread). The cost model floors a
            non-contraction op at the time to stream its bytes and its backward's at
            memory_bandwidth: in a step those come from memory, not the cache a chain
            of one op keeps them in. memory_bandwidth is the median one-process rate of
            the memory-link probes (0.25 s streams over twice the L3, before each pass
            and after the last; the largest Add case's rate with one rank or one core).
            Before each pass and after the last, a fixed 1-thread graph (MatMul, Tanh,
            Mul) is timed too: calibration.host_reference_s, the host's speed then,
            which `validate` times again around every plan (a VM's speed drifts)
  comm      AllReduce, AllGather, ReduceScatter, AllToAll through the runtime's
            communicator (mpi: mpiexec with --ranks ranks; local: in-process), message
            sizes from 64 B to 32 MiB, sampled in rounds of every (collective, size),
            each round in its own order (a call right after a 32 MiB one runs slower,
            and a fixed order put that on the 64 B points); alpha and bandwidth fitted
            by least squares on the DESIGN section 4 volume model, per collective and
            jointly (the profile's link); with mpi, every point is the mean of the
            medians of --launches fresh process sets, run before, between and after the
            compute passes (one set's rates can sit 30-50% from another's, and the host
            changed state over minutes), its spread the larger of the in-launch
            IQR/median and the across-launch range/mean

output: a cluster JSON file for `tensoropt search --cluster FILE.json` (and compile,
validate): rates, rate-vs-size curves per op family, every point with its spread,
the machine, library versions and the date. Written atomically: an interrupted
calibration leaves no CLUSTER.json.

progress: a bar on a terminal; otherwise (a log, a pipe) one line on stderr every
10 s: "calibrate: done/total (share), seconds elapsed, phase: what was measured last".

interrupt and resume: after every finished compute pass, what was measured so far is
written (atomically) to CLUSTER.json.partial, next to the output. After Ctrl-C,
SIGTERM or a kill, the same command with --resume measures only the passes that were
not finished. --resume is refused (exit 2) when there is no partial file, or it was
made with other options, another tensoropt timing setup, on another machine or with
other library versions. A calibration that completes removes the partial file.
One calibration at a time writes an output: a second one into the same file is
refused (exit 2) while the first runs.

time and accuracy (2 cores, idle; benchmarks/RESULTS.md, "Calibration: time and
accuracy per mode"): the default takes about 3.5 minutes (209 s), --quick about
30-40 s. `validate` right after, idle, 20 plans of gpt, resnet50 and mlp small and a
torch.onnx GPT-2 export on 1 and 2 ranks (3 rounds): default, median step-time error
6.6% (worst 12.8%), memory 5.6%, every model's signed median within 10%; in a run
before, 4.6% (worst 18.0%) with mlp small on 2 ranks at -15.5% (its optimizer update
streams the whole state, and the two ranks shared one memory link); --quick 5.4%
(worst 12.7%), memory 7.1%, gpt small on 1 rank +12.4% and mlp small on 2 -10.9%.
With every memory axis (36 plans, default): 9.9%, memory 8.5%; pipelined plans (13):
8.6%, memory 13.2%. Two calibrations in a row: every rate within 15% on an Intel
host whose speed held; on one whose speed moved 71% within the first (its reference
graph 3.4-5.9 ms), 6 of 81 rates 20-83% apart (the MatMul training-step grid); on an
AMD host every compute rate within 15%, the collectives' up to 19% apart when the
memory link changed state. A model's signed error moves by that much between them.
The summary gives the reference graph's range, and calibrate warns when it spans more
than 15%: rates measured minutes later can then differ by as much. A loaded machine
(other work on the cores) costs both time (the default took 8 minutes at load 5-7) and
accuracy (2-rank plans 31-41% slower than estimated).

examples:
  tensoropt calibrate -o here.json                         # about 4 minutes on 2 cores
  tensoropt calibrate -o here.json --quick                 # under a minute, fewer sizes
  tensoropt calibrate -o here.json --resume                # after an interrupt
  tensoropt calibrate -o today.json --against here.json    # what moved since then
  tensoropt search gpt.onnx --devices 1,2 --cluster here.json
  tensoropt validate gpt.onnx --devices 1,2 --cluster here.json
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure compute and collective rates here and write a cluster profile",
        description="Measure per-op-family compute throughput and collective alpha-beta "
        "rates on this machine and write them as a cluster profile (JSON).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-o", "--output", required=True, metavar="CLUSTER.json")
    p.add_argument("--backend", choices=["mpi", "local"], default="mpi")
    p.add_argument(
        "--ranks", type=int, default=2, help="ranks for the collectives, 2 to the cores (default 2)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="repeats per compute timing, their median kept (default 3 in each of the 3 "
        "passes; --quick: 5 in its one pass; 3 to 100); the collectives take at least 15 "
        "samples",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="intra-op threads per rank, 1 to the cores (default cores//ranks)",
    )
    p.add_argument(
        "--launches",
        type=int,
        action=Given,
        default=3,  # calibrate.collectives.DEFAULT_LAUNCHES (not imported: --help stays fast)
        help="fresh MPI process sets the collectives are timed in, spread over the "
        "calibration; each point is the mean of their medians (default 3; rates vary "
        "more between processes and over minutes than within one set; 1 to 100; mpi "
        "backend only)",
    )
    p.add_argument(
        "--passes",
        type=int,
        help="passes over every compute case, minutes apart, each in a fresh process; each "
        "case keeps its median pass, so one pass disturbed by other work on the host (or "
        "an odd process) does not decide the rate (default 3; --quick: 1; 1 to 100)",
    )
    p.add_argument(
        "--neighbours",
        type=int,
        default=0,
        metavar="N",
        help="processes that run the measured case's training step on other cores while "
        "it is timed (default 0: each case is timed alone). With N > 0 the memory-bound "
        "rates depend on whether the host puts the processes on cores that share a "
        "memory link, which can change from one minute to the next",
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing blocks")
    p.add_argument(
        "--against",
        metavar="OLD.json",
        help="a previous profile of this machine: after measuring, list the rates that "
        "moved more than 20%% since it (the host changed under you, or a library did)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted calibration from its last finished compute pass, kept "
        "in CLUSTER.json.partial next to the output (give the same options; refused when "
        "there is none, or it was made with other options or on another machine)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the profile (the file's content) on stdout instead of the summary",
    )
    p.set_defaults(func=run)


def _summary(profile: dict) -> str:
    cal = profile["calibration"]
    lines = [
        f"calibrated {profile['machine']['cpu']} ({profile['machine']['cores']} cores), "
        f"{cal['ranks']} ranks x {cal['threads_per_rank']} thread(s), {cal['backend']} backend, "
        f"{cal['seconds']:.1f} s",
        f"  {'family':<12} {'GFLOP/s':>9} {'spread':>7}",
    ]
    spreads = profile["spread"]["op_throughput"]
    for fam, rate in profile["op_throughput"].items():
        lines.append(f"  {fam:<12} {rate / 1e9:>9.2f} {spreads[fam]:>7.2f}")
    lines.append(
        f"  peak {profile['peak_flops'] / 1e9:.1f} GFLOP/s, memory "
        f"{profile['memory_bandwidth'] / 1e9:.1f} GB/s, op floor "
        f"{profile['op_floor_s'] * 1e6:.2f} us, session.run "
        f"{cal['run_overhead_s'] * 1e6:.1f} us, masked Softmax score "
        f"+{profile.get('softmax_masked_s', 0.0) * 1e9:.2f} ns"
    )
    lines.append(f"  {'collective':<14} {'alpha us':>9} {'GB/s':>8} {'fit err':>8} {'spread':>7}")
    per_kind = profile["collectives"]["per_kind"]
    for kind, fit in per_kind.items():
        lines.append(
            f"  {kind:<14} {fit['alpha_s'] * 1e6:>9.2f} {fit['bandwidth'] / 1e9:>8.3f} "
            f"{fit['rel_residual']:>8.2f} {profile['spread']['collectives'][kind]:>7.2f}"
        )
    probes = cal.get("memory_link") or []
    if probes:
        ratios = ", ".join(f"{p['ratio']:.2f}" for p in probes)
        shared = sum(p["shared"] for p in probes)
        busy = cal.get("compute_neighbours", 0)
        timed = f"beside {busy} busy process(es)" if busy else "alone"
        lines.append(
            f"  memory link: {probes[0]['processes']} processes streaming at once got "
            f"{ratios} of one alone's bandwidth each (shared in {shared} of {len(probes)} "
            f"probes; compute was timed {timed})"
        )
    references = cal.get("host_references_s") or []
    if references:
        lines.append(
            f"  host speed: reference graph {min(references) * 1e3:.2f}-"
            f"{max(references) * 1e3:.2f} ms over {len(references)} timings "
            f"(median {cal['host_reference_s'] * 1e3:.2f} ms)"
        )
    link = profile["intra"]
    lines.append(
        f"  link (joint fit): alpha {link['alpha_s'] * 1e6:.2f} us, "
        f"{link['bandwidth'] / 1e9:.3f} GB/s; inter = intra (single host)"
    )
    return "\n".join(lines)


def busy_warning(load: float, cores: int) -> str | None:
    """A warning when other work shares the machine: rates measured then are those of a
    shared machine (measured: a quick calibration at load 5 on 2 cores put the collective
    latency at 1.3 ms, against 80 us idle, and over-estimated ZeRO-3 plans 2-3x)."""
    if load <= BUSY_LOAD * cores:
        return None
    return (
        f"tensoropt calibrate: warning: load average {load:.1f} on {cores} cores: other work "
        "shares this machine, and the rates measured now are those of a shared machine; "
        "calibrate when it is idle (`tensoropt calibrate --against` says which rates moved)"
    )


BUSY_LOAD = 0.5  # load average per core above which calibrate warns


def drift_warning(references: list[float]) -> str | None:
    """A warning when the host's speed moved during the calibration by more than
    DRIFT_WARN (the reference graph, ``calibrate.hostspeed``, timed before each pass and
    after the last). On a 2-core VM idle throughout, it took 3.4 to 5.9 ms within one
    calibration, and the next calibration's rates moved up to 83% (the MatMul training
    step grid; benchmarks/RESULTS.md, "Calibration determinism")."""
    from tensoropt.calibrate.hostspeed import drift

    moved = drift(references)
    if moved is None or moved <= DRIFT_WARN:
        return None
    return (
        f"tensoropt calibrate: warning: the host's speed moved {moved:.0%} during this "
        f"calibration (its reference graph took {min(references) * 1e3:.2f}-"
        f"{max(references) * 1e3:.2f} ms): another calibration can differ by as much; "
        "compare two with --against, and read `validate`'s host-corrected error"
    )


# the host's speed moves (slowest reference over fastest, less one) above which calibrate
# warns: the bound two calibrations in a row are held to
DRIFT_WARN = 0.15


def run(args: argparse.Namespace) -> int:
    """SIGTERM behaves like Ctrl-C here as in every command (``cli.main``): cleanup runs,
    no file is written, one line, exit 130; a finished pass stays for --resume."""
    return _calibrate(args)


def _calibrate(args: argparse.Namespace) -> int:
    from tensoropt.calibrate.compare import load_baseline
    from tensoropt.calibrate.partial import exclusive
    from tensoropt.calibrate.profile import CalibrateOptions, CommBackend

    opts = CalibrateOptions(
        backend=CommBackend(args.backend),
        ranks=args.ranks,
        repeats=args.repeats,
        quick=args.quick,
        threads=args.threads,
        launches=args.launches,
        passes=args.passes,
        neighbours=args.neighbours,
    )
    opts.check()
    if opts.backend is CommBackend.LOCAL and given(args, "launches"):
        raise TensorOptError(
            f"--launches {args.launches}: the local backend times the collectives in this "
            "process, with no MPI launch; leave --launches out or use --backend mpi"
        )
    check_output_file(args.output, "-o")
    _check_output(args)
    if args.against is not None and not args.against.strip():
        raise TensorOptError(f"--against {args.against!r}: give the file of a previous profile")
    baseline = load_baseline(args.against) if args.against else None
    if opts.backend is CommBackend.MPI:
        from tensoropt.runtime.launcher import mpiexec_path

        mpiexec_path()  # refused now, not after the first measurements
    with exclusive(args.output):
        return _measure(args, opts, baseline)


# the longest a name gets in the files a calibration writes beside its output: the
# partial file's suffix, and a temporary file's dot, random part and suffix around it
# (``runtime.checkpoint.write_atomic``: ".NAME.partial.XXXXXXXX.tmp")
_NAME_GROWS_BY = len(".partial") + len("..xxxxxxxx.tmp")


def _check_output(args: argparse.Namespace) -> None:
    """What ``check_output_file`` leaves to the end of a calibration, refused before it
    starts: a name too long for the files written beside it, a partial file's place
    that cannot take one, and a stream (which keeps no partial file) with --resume or,
    for stdout, with --json."""
    from tensoropt.calibrate.partial import partial_path
    from tensoropt.streams import is_stream, own_descriptor

    path = args.output
    if is_stream(path):
        if args.resume:
            raise TensorOptError(
                f"-o {path} is a stream, which keeps no partial calibration next to it, so "
                "there is nothing to resume; run calibrate without --resume"
            )
        if args.json and own_descriptor(path) == 1:
            raise TensorOptError(
                f"-o {path} and --json both write the profile on stdout; give -o a file"
            )
        return
    directory = os.path.dirname(os.path.abspath(path)) or os.sep
    name = os.path.basename(path)
    with contextlib.suppress(OSError, ValueError):
        longest = os.pathconf(directory, "PC_NAME_MAX") - _NAME_GROWS_BY
        if len(os.fsencode(name)) > longest:
            raise TensorOptError(
                f"-o {path}: the file name is too long for the files written beside it "
                f"(at most {longest} bytes here); give a shorter name"
            )
    partial = partial_path(path)
    if os.path.isdir(partial):
        raise TensorOptError(
            f"-o {path}: {partial}, where the finished passes are kept, is a directory; "
            "remove it or give another -o"
        )
    check_output_file(partial, "-o")  # the directory of a symlink, not of its target


def _measure(args: argparse.Namespace, opts, baseline) -> int:
    """Calibrate with ``opts`` into ``args.output`` (the partial file kept per pass)."""
    from tensoropt.calibrate import kernels
    from tensoropt.calibrate.compare import moved_report
    from tensoropt.calibrate.partial import load as load_partial
    from tensoropt.calibrate.partial import partial_path
    from tensoropt.calibrate.profile import (
        calibrate,
        collective_rounds,
        fingerprint,
        work_items,
        write_profile,
    )
    from tensoropt.cli.json_output import emit, integral_bytes
    from tensoropt.cli.progress import Progress
    from tensoropt.cost.cluster import from_json
    from tensoropt.streams import is_stream, own_descriptor

    # a stream keeps no partial file: "/dev/stdout.partial" is no place for one
    stream = is_stream(args.output)
    partial = partial_path(args.output)
    resume = None
    if args.resume:
        resume = load_partial(partial, fingerprint(opts), kernels.cases(opts.quick))
    elif not stream and os.path.exists(partial):
        print(
            f"calibrate: starting over; {partial} (an interrupted calibration) is replaced "
            "after the first pass (--resume continues it instead)",
            file=sys.stderr,
        )
    busy = busy_warning(os.getloadavg()[0], os.cpu_count() or 1)
    if busy:
        print(busy, file=sys.stderr)
    cases = len(kernels.cases(opts.quick))
    done = cases * len(resume.passes) if resume is not None else 0
    if resume is not None:
        done += collective_rounds(opts, resume.runs)
    bar = Progress(work_items(opts), done=done)

    def save(state) -> None:
        if not stream:
            state.write(partial)

    try:
        profile = calibrate(opts, bar.tick, resume=resume, save=save)
    except KeyboardInterrupt:
        bar.close()  # its records stop here: none comes between this message and the exit
        if not stream and os.path.exists(partial):
            print(
                f"calibrate: the finished passes are kept in {partial}; "
                f"run the same command with --resume to continue",
                file=sys.stderr,
            )
        raise
    finally:
        bar.close()
    from_json(profile, args.output)  # what search will read: refuse to write a bad file
    write_profile(args.output, profile)
    if not stream:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    drifted = drift_warning(profile["calibration"].get("host_references_s") or [])
    if drifted:
        print(drifted, file=sys.stderr)
    # with -o naming stdout, stdout is the profile alone: the summary goes to stderr
    lines = sys.stderr if own_descriptor(args.output) == 1 else sys.stdout
    if args.json:
        emit(args, integral_bytes(profile))
    else:
        print(_summary(profile), file=lines)
        print(f"wrote {args.output}", file=lines)
    if baseline is not None:  # with --json, stdout is the profile alone
        report = moved_report(baseline, profile, args.against)
        print(report, file=sys.stderr if args.json else lines)
    return 0
