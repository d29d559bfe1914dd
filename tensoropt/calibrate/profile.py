"""``calibrate``: measure this machine and turn the numbers into a cluster profile.

The profile is a cluster JSON object (:func:`tensoropt.cost.cluster.from_json`
reads it) whose rates are medians of repeated measurements (compute: the median of
``--passes`` passes' medians, each pass in a fresh process; collectives: the mean of
the medians of launches spread over the calibration):

* ``op_curves``: per op family, rate against size (FLOP/s against FLOPs for
  matmul and conv, bytes/s against bytes for the memory-bound families), with the
  spread of every point; :func:`tensoropt.cost.compute.op_time` interpolates them;
* ``op_train_grids``: MatMul, Conv and BatchNormalization, forward + backward (and
  the SGD-momentum update of their weight) FLOP/s measured inside a training step on
  a grid of their shape (MatMul: output rows 16..1024 x operand side sqrt(K N)
  64..1024; Conv: channels 8..128 x output positions 8..8192, per kernel side 1 and
  3; BatchNorm: channels x positions); the cost model takes these ops' time from it
  instead of forward curve x backward ratio (a MatMul's rate follows its rows: 16 rows
  ran at a third of the rate of 256 at equal K and N; convs of equal FLOPs differed 5x
  with their channels);
* ``op_backward``: per family, (training-step time - forward - modelled update) /
  forward against size (:mod:`tensoropt.calibrate.steps`): what the backward
  really costs, instead of the roofline's fixed 2x;
* ``op_throughput``: per family one FLOP/s number (median over the family's
  sizes), for readers and for code that does not use the curves;
* ``peak_flops`` (best MatMul), ``memory_bandwidth`` (:func:`streaming_bandwidth`),
  ``op_floor_s`` (one tiny kernel inside a graph), ``efficiency`` = 1 (the rates
  are already achieved ones);
* ``intra`` = ``inter``: the joint alpha-beta fit of the collectives (one host);
  ``collectives``: every point and the per-collective fits.

A "device" is one rank with the intra-op thread count this file records: the
runtime gives each MPI rank ``cores // ranks`` threads, and so does calibration.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensoropt.calibrate import collectives as coll
from tensoropt.calibrate import hostspeed, kernels, memlink
from tensoropt.calibrate.machine import (
    machine_info,
    memory_bytes,
    now,
    package_versions,
    versions,
)
from tensoropt.calibrate.partial import PartialState
from tensoropt.calibrate.stats import Sample
from tensoropt.errors import TensorOptError

log = logging.getLogger(__name__)

SCHEMA = "tensoropt.cluster/1"
# Every compute case is measured this many times, each pass over all cases in a fresh
# process (minutes apart), and the median kept (middle_pass): on this project's VM,
# seconds-long disturbances (another tenant, the kernel's background work, a process's
# first seconds) and a process's own history moved whole cases by 10-50%
# (docs/design/measured.md, "Calibration determinism").
DEFAULT_PASSES = 3
# Repeats of each timing (the median of them), full and --quick: a full calibration's
# three passes each take the median of three, and their median is kept; a quick one has
# one pass (docs/design/measured.md, "Where the time goes")
DEFAULT_REPEATS = {False: 3, True: 5}
# The most repeats, MPI launches and compute passes a calibration takes: far beyond what
# the rates need (the defaults are 3 to 5), and few enough that a mistyped count is refused
# instead of starting a calibration of days (each pass takes about a minute on 2 cores)
MAX_REPEATS = 100
MAX_LAUNCHES = 100
MAX_PASSES = 100


class CommBackend(enum.Enum):
    MPI = "mpi"
    LOCAL = "local"


@dataclass(frozen=True, slots=True)
class CalibrateOptions:
    backend: CommBackend = CommBackend.MPI
    ranks: int = 2
    repeats: int | None = None  # repeats per timing; None: DEFAULT_REPEATS by mode
    quick: bool = False
    threads: int | None = None  # intra-op threads per rank; None = cores // ranks
    launches: int = coll.DEFAULT_LAUNCHES  # fresh MPI process sets for the collectives
    passes: int | None = None  # compute passes over every case; None: 1 quick, else 3
    # processes computing beside the measured one (neighbours.py); none by default:
    # docs/design.md, "Compute is timed alone"
    neighbours: int = 0

    @property
    def compute_repeats(self) -> int:
        return self.repeats or DEFAULT_REPEATS[self.quick]

    @property
    def compute_passes(self) -> int:
        return self.passes or (1 if self.quick else DEFAULT_PASSES)

    @property
    def threads_per_rank(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.ranks)

    def check(self) -> None:
        """Refuse options that make no calibration (one line), before anything runs."""
        cores = os.cpu_count() or 1
        most_ranks = max(2, cores)
        if not 2 <= self.ranks <= most_ranks:
            raise TensorOptError(
                f"--ranks {self.ranks}: give 2 to {most_ranks}: collectives need at least 2 "
                f"ranks, and each rank is a device with a core of its own (this machine has "
                f"{cores}; more ranks would wait for cores, and the rates would time that)"
            )
        if self.repeats is not None and not 3 <= self.repeats <= MAX_REPEATS:
            raise TensorOptError(
                f"--repeats {self.repeats}: give 3 (medians, IQR) to {MAX_REPEATS}"
            )
        if not 1 <= self.launches <= MAX_LAUNCHES:
            raise TensorOptError(f"--launches {self.launches}: give 1 to {MAX_LAUNCHES}")
        if self.passes is not None and not 1 <= self.passes <= MAX_PASSES:
            raise TensorOptError(f"--passes {self.passes}: give 1 to {MAX_PASSES}")
        if self.threads is not None and not 1 <= self.threads <= cores:
            raise TensorOptError(
                f"--threads {self.threads}: give 1 to {cores} (this machine's cores): more "
                "threads than cores would time the threads waiting for each other"
            )
        if not 0 <= self.neighbours < cores:
            raise TensorOptError(
                f"--neighbours {self.neighbours}: give 0 to {cores - 1} (this machine has "
                f"{cores} cores, one of them for the measured process)"
            )


def _comm_spec(opts: CalibrateOptions) -> coll.CommSpec:
    return coll.CommSpec(coll.sizes(opts.quick), opts.compute_repeats)


def work_items(opts: CalibrateOptions) -> int:
    """Progress-bar length: kernel cases + the floor + the masked Softmax + collective
    points (one tick each, :func:`measure_kernels` and the collectives)."""
    launches = opts.launches if opts.backend is CommBackend.MPI else 1
    cases = len(kernels.cases(opts.quick)) * opts.compute_passes
    return cases + 2 + coll.total_points(_comm_spec(opts), launches)


def collective_rounds(opts: CalibrateOptions, runs: list) -> int:
    """Progress items of ``runs`` finished MPI launches."""
    return coll.total_points(_comm_spec(opts), len(runs))


def _kernel_options(opts: CalibrateOptions) -> kernels.KernelOptions:
    if opts.quick:
        return kernels.KernelOptions(
            opts.threads_per_rank, opts.compute_repeats, 0.01, cold_calls=8, extra_repeats=0
        )
    # steps (the grid entries, the backward ratios) in 40 ms blocks of at most 48 cold
    # calls; forward kernels in 20 ms blocks of at most 24 calls; no extra repeats: the
    # median of the passes drops a disturbed one (docs/design/measured.md, "Where the
    # time goes")
    return kernels.KernelOptions(
        opts.threads_per_rank, opts.compute_repeats, 0.04, cold_calls=48, extra_repeats=0,
        forward_block_seconds=0.02, forward_cold_calls=24,
    )  # fmt: skip


def _middle(values: list, key) -> object:
    """The median of ``values`` by ``key``; of an even count, the faster middle one."""
    ordered = sorted(values, key=key)
    return ordered[(len(ordered) - 1) // 2]


def middle_pass(passes: list[kernels.KernelResult]) -> kernels.KernelResult:
    """One case's result from its passes: the median kernel time and, on its own, the
    median step (of two passes, the faster).

    Why the median, not the fastest: a step is a slope between two timed blocks
    (``KernelOptions.slope``), so a disturbance can make it look faster as well as
    slower, and one process can simply run a case fast. Measured: the two passes of one
    calibration put the BatchNorm 8 x 128 step 40% apart, the faster at 33% above what
    five other calibrations measured, and keeping the fastest pass kept it
    (`docs/design/measured.md`, "Calibration determinism"). The median of three passes
    drops one odd pass in either direction."""
    kernel = _middle(passes, key=lambda r: r.seconds.median)
    steps = [r.step for r in passes if r.step is not None]
    step = _middle(steps, key=lambda v: v.median) if steps else None
    return dataclasses.replace(kernel, step=step)


def pass_difference(by_case: dict) -> dict:
    """How far apart the passes of each case were (slowest / fastest - 1, of the step
    time or, without a step, the kernel time): how steady the machine was."""
    diffs = {}
    for case, passes in by_case.items():
        times = [(r.step or r.seconds).median for r in passes]
        diffs[case.label()] = max(times) / min(times) - 1
    if not diffs:
        return {}
    worst = max(diffs, key=diffs.__getitem__)
    return {
        "median": round(float(np.median(list(diffs.values()))), 4),
        "max": round(diffs[worst], 4),
        "max_case": worst,
    }


def fingerprint(opts: CalibrateOptions) -> dict:
    """What a calibration's measurements depend on besides the moment: its options, the
    machine and the measuring libraries (a partial calibration resumes only under the
    same ones, :mod:`tensoropt.calibrate.partial`)."""
    machine = machine_info()
    return {
        "backend": opts.backend.value,
        "ranks": opts.ranks,
        "repeats": opts.compute_repeats,
        "quick": opts.quick,
        "threads_per_rank": opts.threads_per_rank,
        "launches": opts.launches,
        "passes": opts.compute_passes,
        "neighbours": opts.neighbours,
        # how each case is timed, and which cases: a file of another tensoropt version
        # measured differently
        "timing": dataclasses.asdict(_kernel_options(opts)),
        # what each pass times: the forward kernels and the steps (a file whose later
        # passes timed the steps alone cannot be resumed into one that needs both)
        "passes_time": "forward and step",
        "cases": len(kernels.cases(opts.quick)),
        **{k: machine[k] for k in ("host", "cpu", "arch", "cores", "memory_bytes", "python")},
        **package_versions(),
    }


def measure_kernels(
    opts: CalibrateOptions,
    tick: Callable[[str], None],
    before_pass: Callable[[int], None] = lambda _index: None,
    state: PartialState | None = None,
    save: Callable[[PartialState], None] = lambda _state: None,
):
    """(results per case, floor result, session-run overhead sample, pass difference).

    Each pass over the cases runs in its own fresh process
    (:mod:`tensoropt.calibrate.passes`) beside its own busy neighbours; ``before_pass(i)``
    runs before pass ``i``, with no neighbour alive (the collectives' launches). The
    passes already in ``state`` (a resumed calibration) are not measured again; every
    finished pass is appended to it and ``save(state)`` called."""
    from tensoropt.calibrate.neighbours import busy_neighbours
    from tensoropt.calibrate.passes import measure_pass

    kopts = _kernel_options(opts)
    cases = kernels.cases(opts.quick)
    state = state if state is not None else PartialState({})
    total = opts.compute_passes
    for index in range(len(state.passes), total):
        before_pass(index)

        def pass_tick(label: str, index: int = index) -> None:
            tick(f"pass {index + 1}/{total}: {label}")

        # every pass times the forward kernels and the steps, the steps at the first pass's R
        copies = {r.case.label(): r.copies for r, _ in state.passes[0]} if index else None
        with busy_neighbours(opts.neighbours, kopts, cases) as pacer:
            state.passes.append(measure_pass(kopts, cases, pacer, pass_tick, copies))
        save(state)
    by_case: dict[kernels.KernelCase, list[kernels.KernelResult]] = {}
    overheads = []
    for done in state.passes:
        for result, overhead in done:
            by_case.setdefault(result.case, []).append(result)
            overheads.append(overhead)
    tick("floor")
    floor, overhead = kernels.measure_case(kernels.floor_case(), kopts)
    overheads.append(overhead.median)
    tick("masked softmax")
    masked = kernels.measure_masked_softmax(kopts)
    results = [middle_pass(passes) for passes in by_case.values()]
    spread = pass_difference(by_case) if opts.compute_passes > 1 else {}
    return results, (floor, masked), Sample.of(overheads), spread


def _curves(results) -> dict:
    by_key: dict[str, list] = {}
    for r in results:
        by_key.setdefault(r.case.curve_key, []).append(r)
    curves = {}
    for key, rows in sorted(by_key.items()):
        rows.sort(key=lambda r: r.case.work)
        curves[key] = {
            "work": "flops" if key in kernels.CONTRACTIONS else "bytes",
            "points": [[r.case.work, r.rate, round(r.seconds.spread, 4)] for r in rows],
            "cases": [r.case.label() for r in rows],
        }
    return curves


def _train_grids(results) -> dict:
    """MatMul, Conv and BatchNorm: FLOPs / step slope on their shape grids
    (``kernels.GRID_*``, ``kernels.CONV_GRID``), per kernel side. The slope is one
    copy's forward + backward + SGD-momentum update of its own weight, and stays so:
    the cost model charges those weights' update through the grid
    (:func:`tensoropt.cost.compute.grid_update_slots`). Subtracting an update was
    tried and dropped: for small ops the update is most of the step, and a measured
    one (in a graph of updates alone, ~2.5x slower per op) or a modelled one left
    noise or nothing (two calibrations disagreed by 76% on the smallest BatchNorm).
    One-off cases off the grid are left out."""
    from tensoropt.cost.compute import TRAIN_FAMILIES, train_key

    cells: dict[tuple[str, int], dict[tuple[float, float], float]] = {}
    for r in results:
        case = r.case
        key = train_key(case.op_type, dict(case.attrs), case.shapes, (case.out_shape,), case.flops)
        if key is None or r.step is None:
            continue
        train = r.step.median
        side, first, second = key
        cell = cells.setdefault((TRAIN_FAMILIES[case.op_type], side), {})
        cell[round(first, 6), round(second, 6)] = case.flops / train
    out: dict[str, dict] = {}
    for (fam, side), rate in sorted(cells.items()):
        # the grid: second keys measured at two or more first keys, then the first
        # keys measured at every such second key
        seconds = sorted(j for j in {j for _, j in rate} if sum(1 for _, k in rate if k == j) > 1)
        firsts = sorted(i for i in {i for i, _ in rate} if all((i, j) in rate for j in seconds))
        if len(firsts) < 2 or len(seconds) < 2:
            continue
        out.setdefault(fam, {})[f"kernel_{side}"] = {
            "rows": firsts,
            "sides": seconds,
            "rates": [[rate[i, j] for j in seconds] for i in firsts],
        }
    return out


def _probe(curves: dict):
    """A profile holding only the measured curves (to price a case's own update)."""
    from tensoropt.cost.cluster import from_json

    return from_json(
        {"base": "h100", "op_curves": {f: {k: c[k] for k in ("work", "points")}
                                       for f, c in curves.items()}},
        "calibration",
    )  # fmt: skip


def _backward(results, curves: dict) -> dict:
    """Per family (or op type, ``KernelCase.curve_key``): (step - forward - modelled
    update) / forward against size.

    With this ratio, ``op_time`` (forward x (1 + ratio)) plus the cost model's own
    ``update_time`` of the op's parameters equals the measured step slope at every
    calibrated size. Ratios are floored at 0.05 (a step is never cheaper than its
    forward; below that is timing noise).
    """
    from tensoropt.cost.compute import update_time

    probe = _probe(curves)
    by_family: dict[str, list] = {}
    for r in results:
        if r.step is None:
            continue
        params = sum(math.prod(s) for s in r.case.shapes[1:])
        update = update_time(params, 1, 4, probe) if params else 0.0
        ratio = max((r.step.median - r.seconds.median - update) / r.seconds.median, 0.05)
        by_family.setdefault(r.case.curve_key, []).append(
            [r.case.work, ratio, round(r.step.spread, 4)]
        )
    return {
        fam: {"work": curves[fam]["work"], "points": sorted(rows)}
        for fam, rows in sorted(by_family.items())
    }


def streaming_bandwidth(probes, results) -> tuple[float, str]:
    """(bytes/s, where it comes from) of the profile's ``memory_bandwidth``: the rate at
    which a step streams what its forward saved (the cost model's streaming floor).

    The median of the memory-link probes' one-process rates (``memlink``: ``dst = src +
    1`` over twice the last-level cache, 0.25 s each, before every compute pass and after
    the last) where there are any; else the largest element-wise Add case's rate. The
    probes are the steadier: 0.25 s of streaming each, against one timed case whose
    operands exceed a 32 MiB L3 by little (two calibrations two hours apart: 38.5 and
    38.5 GB/s from the probes, 27.8 and 40.2 from the Add; docs/design/measured.md)."""
    alone = sorted(p.alone for p in probes)
    if alone:
        return float(statistics.median(alone)), f"memory-link probes (median of {len(alone)})"
    streams = [r for r in results if r.case.op_type == "Add"]
    return max(streams, key=lambda r: r.case.work).rate, "largest Add case"


def _throughput(results) -> tuple[dict[str, float], dict[str, float]]:
    """Per family: median FLOP/s over its cases, and the median spread."""
    rates: dict[str, list[float]] = {}
    spreads: dict[str, list[float]] = {}
    for r in results:
        fam = r.case.curve_key
        rates.setdefault(fam, []).append(r.case.flops / r.seconds.median)
        spreads.setdefault(fam, []).append(r.seconds.spread)
    med = {f: float(np.median(v)) for f, v in sorted(rates.items())}
    return med, {f: round(float(np.median(v)), 4) for f, v in sorted(spreads.items())}


def _repeated_more(results, repeats: int) -> list[str]:
    """Cases whose kernel or step timings were disturbed, so got more repeats."""
    return [
        r.case.label()
        for r in results
        if r.seconds.repeats > repeats or (r.step is not None and r.step.repeats > repeats)
    ]


def _collectives_json(fits: coll.CommFits) -> dict:
    return {
        "backend": fits.backend,
        "ranks": fits.ranks,
        "volume_model": "DESIGN §4 (tensoropt.ir.redistribute.comm_bytes)",
        "joint_fit_of": [k.value for k in coll.JOINT_KINDS],
        "per_kind": {
            k: {
                "alpha_s": f.alpha_s,
                "bandwidth": f.bandwidth,
                "rel_residual": round(f.rel_residual, 4),
                "points": fits.points[k],  # [buffer bytes B, median seconds, spread]
            }
            for k, f in fits.per_kind.items()
        },
    }


def calibrate(
    opts: CalibrateOptions,
    tick: Callable[[str], None] | None = None,
    *,
    resume: PartialState | None = None,
    save: Callable[[PartialState], None] | None = None,
) -> dict:
    """Measure this machine; the cluster JSON object of a calibrated profile.

    ``resume``: the finished passes of an interrupted calibration with these options
    (:func:`tensoropt.calibrate.partial.load`), not measured again. ``save(state)`` is
    called after every finished compute pass with everything measured so far."""
    from tensoropt.runtime.malloc import tune_process

    opts.check()
    tune_process()  # the floor case below runs here, under the runtime's malloc settings
    tick = tick or (lambda _label: None)
    t0 = time.perf_counter()
    state = resume if resume is not None else PartialState(fingerprint(opts))
    earlier_s = state.seconds  # measuring time of the interrupted run(s)

    def checkpoint(state: PartialState) -> None:
        state.seconds = earlier_s + time.perf_counter() - t0
        if save is not None:
            save(state)

    spec = _comm_spec(opts)

    def on_point() -> None:
        tick("collectives")

    # the collectives' MPI launches, the host's memory-link state and its speed, taken
    # before each pass and after the last (kept in ``state`` with the pass that follows)
    slots = coll.launch_slots(opts.launches, opts.compute_passes)
    reference = hostspeed.Reference()  # the host's speed, timed with each probe

    def launch(index: int) -> None:
        if prober is not None:
            state.probes.append(prober.probe())
        state.references.append(reference.measure())
        if opts.backend is CommBackend.MPI:
            for _ in range(slots.count(index)):
                state.runs.append(
                    coll.launch_mpi(opts.ranks, spec, opts.threads_per_rank, on_point)
                )

    with memlink.prober(opts.ranks) as prober:
        results, (floor, masked), overhead, passes_apart = measure_kernels(
            opts, tick, launch, state, checkpoint
        )
        launch(opts.compute_passes)
    link_probes = state.probes
    if opts.backend is CommBackend.MPI:
        fits = coll.fit(coll.merge_launches(state.runs), opts.ranks, "mpi")
    else:
        fits = coll.run_local(opts.ranks, spec, on_point)
    link = {"alpha_s": fits.joint.alpha_s, "bandwidth": fits.joint.bandwidth}
    throughput, fam_spread = _throughput(results)
    curves = _curves(results)
    matmul = [r.rate for r in results if r.case.family == "matmul"]
    bandwidth, bandwidth_from = streaming_bandwidth(link_probes, results)
    machine = machine_info()
    return {
        "schema": SCHEMA,
        "name": f"calibrated-{machine['host']}",
        "description": (
            f"measured by tensoropt calibrate on {machine['cpu']} ({machine['cores']} cores): "
            f"one device = one rank with {opts.threads_per_rank} onnxruntime thread(s); "
            f"{opts.ranks} ranks over {fits.backend}; single host, so inter = intra"
        ),
        "peak_flops": max(matmul),
        "memory_bandwidth": bandwidth,
        "memory_bytes": float(memory_bytes()),
        "devices_per_node": opts.ranks,
        "intra": link,
        "inter": dict(link),
        "efficiency": 1.0,
        "op_floor_s": floor.seconds.median,
        "softmax_masked_s": masked.median,
        "op_throughput": throughput,
        "op_curves": curves,
        "op_train_grids": _train_grids(results),
        "op_backward": _backward(results, curves),
        "collectives": _collectives_json(fits),
        "spread": {
            "op_throughput": fam_spread,
            "op_floor_s": round(floor.seconds.spread, 4),
            "softmax_masked_s": round(masked.spread, 4),
            "collectives": {
                k: round(float(np.median([p[2] for p in fits.points[k]])), 4) for k in fits.points
            },
            "intra_fit_rel_residual": round(fits.joint.rel_residual, 4),
        },
        "machine": machine,
        "versions": versions(),
        "calibration": {
            "date": now(),
            "backend": fits.backend,
            "ranks": opts.ranks,
            "threads_per_rank": opts.threads_per_rank,
            "compute_clock": _kernel_options(opts).clock_name,
            "compute_caches": "cold" if _kernel_options(opts).cold else "warm",
            "compute_neighbours": opts.neighbours,
            "memory_link": [p.to_json() for p in link_probes],
            "memory_bandwidth_from": bandwidth_from,
            # hostspeed.Reference: median seconds, timed before each pass and after the last
            "host_reference_s": statistics.median(state.references),
            "host_references_s": [round(x, 7) for x in state.references],
            "repeats": opts.compute_repeats,
            "max_repeats": _kernel_options(opts).max_repeats,
            "compute_passes": opts.compute_passes,
            "passes_apart": passes_apart,
            "repeated_more": _repeated_more(results, opts.compute_repeats),
            "launches": opts.launches if fits.backend == "mpi" else 1,
            "quick": opts.quick,
            "run_overhead_s": overhead.median,
            "inter": "single host: inter is a copy of intra (no inter-node link was measured)",
            "resumed": resume is not None,
            "seconds": round(earlier_s + time.perf_counter() - t0, 2),
        },
    }


def write_profile(path: str, profile: dict) -> None:
    """Write the profile atomically (temp file + rename): all of it or nothing. A symlink
    is followed and a stream written through (``runtime.checkpoint.write_atomic``)."""
    from tensoropt.runtime.checkpoint import write_atomic

    write_atomic(path, (json.dumps(profile, indent=1) + "\n").encode())
