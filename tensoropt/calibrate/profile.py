"""``calibrate``: measure this machine and turn the numbers into a cluster profile.

The profile is a cluster JSON object (:func:`tensoropt.cost.cluster.from_json`
reads it) whose rates are medians of repeated measurements:

* ``op_curves``: per op family, rate against size (FLOP/s against FLOPs for
  matmul and conv, bytes/s against bytes for the memory-bound families), with the
  spread of every point; :func:`tensoropt.cost.compute.op_time` interpolates them;
* ``op_grids``: for MatMul, FLOP/s on a grid of output rows (16..1024) x operand side
  sqrt(K N) (64..1024); the cost model prefers it to the curve (a MatMul's rate
  follows its shape: 16 rows ran at a third of the rate of 256 at equal K and N);
* ``op_backward``: per family, (training-step time - forward - modelled update) /
  forward against size (:mod:`tensoropt.calibrate.steps`): what the backward
  really costs, instead of the roofline's fixed 2x;
* ``op_throughput``: per family one FLOP/s number (median over the family's
  sizes), for readers and for code that does not use the curves;
* ``peak_flops`` (best MatMul), ``memory_bandwidth`` (largest element-wise Add),
  ``op_floor_s`` (one tiny kernel inside a graph), ``efficiency`` = 1 (the rates
  are already achieved ones);
* ``intra`` = ``inter``: the joint alpha-beta fit of the collectives (one host);
  ``collectives``: every point and the per-collective fits.

A "device" is one rank with the intra-op thread count this file records: the
runtime gives each MPI rank ``cores // ranks`` threads, and so does calibration.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensoropt.calibrate import collectives as coll
from tensoropt.calibrate import kernels
from tensoropt.calibrate.machine import machine_info, memory_bytes, now, versions
from tensoropt.calibrate.stats import Sample
from tensoropt.errors import TensorOptError

log = logging.getLogger(__name__)

SCHEMA = "tensoropt.cluster/1"


class CommBackend(enum.Enum):
    MPI = "mpi"
    LOCAL = "local"


@dataclass(frozen=True, slots=True)
class CalibrateOptions:
    backend: CommBackend = CommBackend.MPI
    ranks: int = 2
    repeats: int = 5
    quick: bool = False
    threads: int | None = None  # intra-op threads per rank; None = cores // ranks
    launches: int = coll.DEFAULT_LAUNCHES  # fresh MPI process sets for the collectives

    @property
    def threads_per_rank(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.ranks)

    def check(self) -> None:
        if self.ranks < 2:
            raise TensorOptError(f"--ranks {self.ranks}: collectives need at least 2 ranks")
        if self.repeats < 3:
            raise TensorOptError(f"--repeats {self.repeats}: give at least 3 (medians, IQR)")
        if self.launches < 1:
            raise TensorOptError(f"--launches {self.launches}: give at least 1")
        if self.threads is not None and self.threads < 1:
            raise TensorOptError(f"--threads {self.threads}: give at least 1")


def _comm_spec(opts: CalibrateOptions) -> coll.CommSpec:
    return coll.CommSpec(coll.sizes(opts.quick), opts.repeats)


def work_items(opts: CalibrateOptions) -> int:
    """Progress-bar length: kernel cases + the floor + collective points."""
    launches = opts.launches if opts.backend is CommBackend.MPI else 1
    return len(kernels.cases(opts.quick)) + 1 + coll.total_points(_comm_spec(opts), launches)


def _kernel_options(opts: CalibrateOptions) -> kernels.KernelOptions:
    block = 0.01 if opts.quick else 0.04
    return kernels.KernelOptions(opts.threads_per_rank, opts.repeats, block)


def measure_kernels(opts: CalibrateOptions, tick: Callable[[str], None]):
    """(results per case, floor result, session-run overhead sample)."""
    import dataclasses

    from tensoropt.calibrate.steps import measure_step

    kopts = _kernel_options(opts)
    results = []
    overheads = []
    for case in kernels.cases(opts.quick):
        tick(case.label())
        result, overhead = kernels.measure_case(case, kopts)
        step = measure_step(case, min(result.copies, 8), kopts)
        results.append(dataclasses.replace(result, step=step))
        overheads.append(overhead.median)
    tick("floor")
    floor, overhead = kernels.measure_case(kernels.floor_case(), kopts)
    overheads.append(overhead.median)
    return results, floor, Sample.of(overheads)


def _curves(results) -> dict:
    by_family: dict[str, list] = {}
    for r in results:
        by_family.setdefault(r.case.family, []).append(r)
    curves = {}
    for fam, rows in sorted(by_family.items()):
        rows.sort(key=lambda r: r.case.work)
        curves[fam] = {
            "work": "flops" if fam in kernels.CONTRACTIONS else "bytes",
            "points": [[r.case.work, r.rate, round(r.seconds.spread, 4)] for r in rows],
            "cases": [r.case.label() for r in rows],
        }
    return curves


def _grids(results) -> dict:
    """Per family in ``kernels.GRIDDED``: FLOP/s on the grid of rows x operand side
    (:class:`~tensoropt.cost.cluster.RateGrid`), from the cases that sit on it."""
    out = {}
    for fam in kernels.GRIDDED:
        rate = {}
        for r in results:
            if r.case.family == fam:
                side = round(math.sqrt(r.case.flops / (2.0 * r.case.rows)))
                rate[int(r.case.rows), side] = r.rate
        # the grid: sides measured at two or more row counts (the squares in between
        # are one-off points), then the row counts measured at every such side
        sides = sorted(k for k in {k for _, k in rate} if sum(1 for _, j in rate if j == k) > 1)
        rows = sorted(m for m in {m for m, _ in rate} if all((m, k) in rate for k in sides))
        if len(rows) < 2 or len(sides) < 2:
            continue
        out[fam] = {
            "rows": rows,
            "sides": sides,
            "rates": [[rate[m, k] for k in sides] for m in rows],
        }
    return out


def _backward(results, curves: dict) -> dict:
    """Per family: (step - forward - modelled update) / forward against size.

    With this ratio, ``op_time`` (forward x (1 + ratio)) plus the cost model's own
    ``update_time`` of the op's parameters equals the measured step slope at every
    calibrated size. Ratios are floored at 0.05 (a step is never cheaper than its
    forward; below that is timing noise).
    """
    import math

    from tensoropt.cost.cluster import from_json
    from tensoropt.cost.compute import update_time

    probe = from_json(
        {"base": "h100", "op_curves": {f: {k: c[k] for k in ("work", "points")}
                                       for f, c in curves.items()}},
        "calibration",
    )  # fmt: skip
    by_family: dict[str, list] = {}
    for r in results:
        if r.step is None:
            continue
        params = sum(math.prod(s) for s in r.case.shapes[1:])
        update = update_time(params, 1, 4, probe) if params else 0.0
        ratio = max((r.step.median - r.seconds.median - update) / r.seconds.median, 0.05)
        by_family.setdefault(r.case.family, []).append(
            [r.case.work, ratio, round(r.step.spread, 4)]
        )
    return {
        fam: {"work": curves[fam]["work"], "points": sorted(rows)}
        for fam, rows in sorted(by_family.items())
    }


def _throughput(results) -> tuple[dict[str, float], dict[str, float]]:
    """Per family: median FLOP/s over its cases, and the median spread."""
    rates: dict[str, list[float]] = {}
    spreads: dict[str, list[float]] = {}
    for r in results:
        fam = r.case.family
        rates.setdefault(fam, []).append(r.case.flops / r.seconds.median)
        spreads.setdefault(fam, []).append(r.seconds.spread)
    med = {f: float(np.median(v)) for f, v in sorted(rates.items())}
    return med, {f: round(float(np.median(v)), 4) for f, v in sorted(spreads.items())}


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


def calibrate(opts: CalibrateOptions, tick: Callable[[str], None] | None = None) -> dict:
    """Measure this machine; the cluster JSON object of a calibrated profile."""
    from tensoropt.runtime.malloc import tune_process

    opts.check()
    tune_process()  # measure kernels with the malloc settings the runtime runs under
    tick = tick or (lambda _label: None)
    t0 = time.perf_counter()
    results, floor, overhead = measure_kernels(opts, tick)
    spec = _comm_spec(opts)

    def on_point() -> None:
        tick("collectives")

    if opts.backend is CommBackend.MPI:
        fits = coll.run_mpi(opts.ranks, spec, opts.threads_per_rank, on_point, opts.launches)
    else:
        fits = coll.run_local(opts.ranks, spec, on_point)
    link = {"alpha_s": fits.joint.alpha_s, "bandwidth": fits.joint.bandwidth}
    throughput, fam_spread = _throughput(results)
    curves = _curves(results)
    matmul = [r.rate for r in results if r.case.family == "matmul"]
    streams = [r for r in results if r.case.op_type == "Add"]
    bandwidth = max(streams, key=lambda r: r.case.work).rate
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
        "op_throughput": throughput,
        "op_curves": curves,
        "op_grids": _grids(results),
        "op_backward": _backward(results, curves),
        "collectives": _collectives_json(fits),
        "spread": {
            "op_throughput": fam_spread,
            "op_floor_s": round(floor.seconds.spread, 4),
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
            "repeats": opts.repeats,
            "launches": opts.launches if fits.backend == "mpi" else 1,
            "quick": opts.quick,
            "run_overhead_s": overhead.median,
            "inter": "single host: inter is a copy of intra (no inter-node link was measured)",
            "seconds": round(time.perf_counter() - t0, 2),
        },
    }


def write_profile(path: str, profile: dict) -> None:
    """Write the profile atomically (temp file + rename): all of it or nothing."""
    from tensoropt.runtime.checkpoint import write_atomic

    write_atomic(path, (json.dumps(profile, indent=1) + "\n").encode())
