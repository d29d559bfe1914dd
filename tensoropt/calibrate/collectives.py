"""Alpha-beta rates of the runtime's collectives on this machine (``tensoropt calibrate``).

Each collective (AllReduce, AllGather, ReduceScatter, AllToAll) runs through the
runtime's own communicator, over the whole world, at message sizes from bytes to
tens of MiB. Per point: the median of single calls made as a training step makes
them (:func:`measure_comm`), each ended when the slowest rank is done (the max over
ranks). Then ``time = latency_terms * alpha + volume / bandwidth`` is fitted
per collective and jointly, with the volume convention of
:func:`tensoropt.ir.redistribute.comm_bytes` (DESIGN §4), so the fitted rates mean
what the cost model multiplies them by.

Backends: ``mpi`` starts ``mpiexec -n N python -m tensoropt.calibrate.comm_worker``
(the :class:`~tensoropt.runtime.mpi_comm.MpiCommunicator`) ``launches`` times, each a
fresh set of processes, and keeps per point the mean of the launches' medians (see
:func:`merge_launches`); ``local`` times
:class:`~tensoropt.runtime.comm.LocalWorld` in this process (the local engine's
path: numpy copies and sums, no transport).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensoropt.calibrate.stats import AlphaBeta, Sample, evict_caches, fit_alpha_beta
from tensoropt.errors import TensorOptError
from tensoropt.ir.vocab import COMMUNICATING_KINDS, CollectiveKind
from tensoropt.runtime.collectives import CollectiveCall
from tensoropt.runtime.comm import Communicator, LocalWorld
from tensoropt.runtime.malloc import child_env

KINDS = COMMUNICATING_KINDS
# Collectives in the joint fit that becomes the profile's link. Every kind's volume is
# the one ``comm_bytes`` charges (AllToAll: (n-1)/n of the rank's buffer, what the
# runtime sends), so all four share the convention; each also keeps its own fit
# (``per_kind``), which the cost model prefers on the link it was measured on.
JOINT_KINDS = KINDS
LATENCY_TERMS = {CollectiveKind.ALL_REDUCE: 2}  # every other collective: 1


def latency_terms(kind: CollectiveKind) -> int:
    return LATENCY_TERMS.get(kind, 1)


def volume(kind: CollectiveKind, buffer_bytes: float, n: int) -> float:
    """Volume of one call as ``comm_bytes`` charges it; ``buffer_bytes`` is B there.

    AllReduce 2(n-1)/n B; AllGather and ReduceScatter (n-1)/n B; AllToAll (n-1)/n of
    the rank's own buffer (what ``_local_input`` holds)."""
    frac = (n - 1) / n
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * frac * buffer_bytes
    return frac * buffer_bytes


def sizes(quick: bool) -> tuple[int, ...]:
    """Buffer sizes B in bytes (multiples of 64 so every split divides)."""
    if quick:
        return (64, 4096, 1 << 18, 1 << 22)
    return (64, 1024, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)


@dataclass(frozen=True, slots=True)
class CommSpec:
    """What the timing loop needs (JSON-able: it travels to the MPI workers)."""

    sizes: tuple[int, ...]
    repeats: int

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes), "repeats": self.repeats}

    @staticmethod
    def from_json(d: dict) -> CommSpec:
        return CommSpec(tuple(d["sizes"]), int(d["repeats"]))


def _local_input(kind: CollectiveKind, buffer_bytes: int, n: int) -> np.ndarray:
    """This rank's input: B bytes, except AllGather whose B is the gathered output."""
    count = buffer_bytes // 4 // (n if kind is CollectiveKind.ALL_GATHER else 1)
    count = max(count - count % n, n)
    return np.ones(count, dtype=np.float32)


def _call_of(comm: Communicator, kind: CollectiveKind, group) -> Callable[[np.ndarray], object]:
    if kind is CollectiveKind.ALL_REDUCE:
        return lambda x: comm.allreduce(x, group)
    if kind is CollectiveKind.ALL_GATHER:
        return lambda x: comm.allgather(x, group, 0)
    if kind is CollectiveKind.REDUCE_SCATTER:
        return lambda x: comm.reduce_scatter(x, group, 0)
    return lambda x: comm.alltoall(x, group, 0, 0)


# Collectives inside a training step run between compute segments: on a buffer the
# compute has just written, with caches full of the compute's data. Measured on this
# project's 2-core machine (gpt-small, 2 ranks, a barrier before every collective):
# 1.4-3.7x the back-to-back rate of the same calls on one hot buffer. So each sample
# is one call on a fresh copy of the input after a 32 MiB sweep that evicts the
# caches (stats.evict_caches, standing for the compute in between), started together
# (barrier), timed alone, slowest rank kept.
IN_STEP_SAMPLES = 15


def samples_per_point(spec: CommSpec) -> int:
    return max(spec.repeats, IN_STEP_SAMPLES)


def measure_comm(
    comm: Communicator,
    spec: CommSpec,
    slowest: Callable[[float], float],
    on_round: Callable[[], None] | None = None,
) -> dict[str, list[list[float]]]:
    """Per collective: ``[buffer_bytes, median_seconds, spread]`` per size (every rank calls).

    Each time is one call as a training step makes it (see ``evict_caches``); the median
    of :func:`samples_per_point` samples. The samples are taken in rounds, each round
    one sample of every (collective, size) point, so that a slow phase of the processes
    (the first seconds after start measured 1.5-1.8x slower small AllReduces than the
    rest) spreads over every point instead of shifting the latency of whichever
    collective would be measured first; each round takes the points in its own order
    (seeded by the round), so no point always follows the same one. ``slowest(t)``
    returns the max of ``t`` over ranks; ``on_round`` is called after each round.
    """
    n = comm.size
    group = tuple(range(n))
    points = [(kind, size) for kind in KINDS for size in spec.sizes]
    calls = {kind: _call_of(comm, kind, group) for kind in KINDS}
    inputs = {(kind, size): _local_input(kind, size, n) for kind, size in points}
    for kind, size in points:
        for _ in range(2):
            calls[kind](inputs[kind, size])  # warm-up (buffers, sub-communicators)
    times: dict[tuple, list[float]] = {point: [] for point in points}
    for r in range(samples_per_point(spec)):
        # each round in its own order, the same on every rank (their calls must match):
        # in a fixed order each collective's smallest size ran right after the previous
        # one's 32 MiB call and measured 1.5-2x its 1 KiB point (docs/design/measured.md)
        for i in np.random.default_rng(r).permutation(len(points)):
            kind, size = points[i]
            evict_caches()  # the compute between collectives
            fresh = inputs[kind, size].copy()  # written just before, as a segment's output is
            comm.barrier()
            t0 = time.perf_counter()
            calls[kind](fresh)
            times[kind, size].append(slowest(time.perf_counter() - t0))
        if on_round is not None:
            on_round()
    out: dict[str, list[list[float]]] = {kind.value: [] for kind in KINDS}
    for kind, size in points:
        sample = Sample.of(times[kind, size])
        x = inputs[kind, size]
        nbytes = x.nbytes * (n if kind is CollectiveKind.ALL_GATHER else 1)
        out[kind.value].append([float(nbytes), sample.median, sample.spread])
    return out


@dataclass(frozen=True, slots=True)
class CommFits:
    """Per-collective points and fits, and the joint fit (over JOINT_KINDS) of the link."""

    ranks: int
    backend: str
    points: dict[str, list[list[float]]]
    per_kind: dict[str, AlphaBeta]
    joint: AlphaBeta


def fit(points: dict[str, list[list[float]]], ranks: int, backend: str) -> CommFits:
    per_kind = {}
    all_terms, all_vol, all_t = [], [], []
    for kind in KINDS:
        rows = points[kind.value]
        terms = [latency_terms(kind)] * len(rows)
        vols = [volume(kind, b, ranks) for b, _, _ in rows]
        secs = [t for _, t, _ in rows]
        per_kind[kind.value] = fit_alpha_beta(terms, vols, secs)
        if kind not in JOINT_KINDS:
            continue
        all_terms += terms
        all_vol += vols
        all_t += secs
    return CommFits(ranks, backend, points, per_kind, fit_alpha_beta(all_terms, all_vol, all_t))


def run_local(ranks: int, spec: CommSpec, on_point=None) -> CommFits:
    """Time :meth:`LocalWorld.run_batched` (the local engine's collective path)."""
    world = LocalWorld(ranks)
    comm = _BatchedComm(world)
    points = measure_comm(comm, spec, lambda t: t, on_point)
    return fit(points, ranks, "local")


class _BatchedComm:
    """Communicator-shaped view of a LocalWorld: one call serves every rank at once."""

    def __init__(self, world: LocalWorld) -> None:
        self._world = world

    rank = 0

    @property
    def size(self) -> int:
        return self._world.size

    def _run(self, kind: CollectiveKind, x: np.ndarray, group, **axes) -> np.ndarray:
        call = CollectiveCall("calibrate", kind, "x", "y", tuple(group), **axes)
        calls = dict.fromkeys(group, call)
        return self._world.run_batched(calls, dict.fromkeys(group, x))[0]

    def allreduce(self, x, group):
        return self._run(CollectiveKind.ALL_REDUCE, x, group)

    def allgather(self, x, group, axis):
        return self._run(CollectiveKind.ALL_GATHER, x, group, axis=axis)

    def reduce_scatter(self, x, group, axis):
        return self._run(CollectiveKind.REDUCE_SCATTER, x, group, axis=axis)

    def alltoall(self, x, group, split_axis, concat_axis):
        kind = CollectiveKind.ALL_TO_ALL
        return self._run(kind, x, group, split_axis=split_axis, concat_axis=concat_axis)

    def barrier(self) -> None:
        return None


# Two calibrations in a row on a quiet 2-core machine differed by up to 2x at single
# points (16 MiB AllToAll) while each run's own IQR was a few percent: the rate
# depends on the processes (where MPI's shared memory and the heap landed) and on the
# moment (:func:`launch_slots`), not only on the repeats. So each point comes from
# several fresh launches spread over the calibration (:func:`merge_launches`).
DEFAULT_LAUNCHES = 3


def merge_launches(runs: Sequence[dict[str, list[list[float]]]]) -> dict[str, list[list[float]]]:
    """Per point: the mean of the launches' medians, and spread = the larger of the
    launches' median own spread (IQR / median) and their range over the mean, so the
    file shows how far one launch can be from another.

    The mean, not the median, across launches: launches spread over the calibration
    (:func:`launch_slots`) sample a host that switches between two states 25-35%
    apart, and their mean is the time-average a later run meets, where a median of
    three flips with the majority."""
    if len(runs) == 1:
        return runs[0]
    merged: dict[str, list[list[float]]] = {}
    for kind, rows in runs[0].items():
        out = []
        for i, (nbytes, _, _) in enumerate(rows):
            medians = np.array([run[kind][i][1] for run in runs])
            own = float(np.median([run[kind][i][2] for run in runs]))
            mid = float(np.mean(medians))
            across = float(np.ptp(medians) / mid) if mid > 0 else 0.0
            out.append([nbytes, mid, max(own, across)])
        merged[kind] = out
    return merged


def launch_slots(launches: int, passes: int) -> list[int]:
    """When each MPI launch runs: before compute pass ``i`` (``i == passes``: after the
    last), spread evenly over the calibration. The host moved between two states minutes
    apart (64 B AllGather 62 or 79 us, 32 MiB 8.0 or 5.9 ms): launches
    spread over the calibration's minutes sample both, where back-to-back ones saw one."""
    if launches <= 1:
        return [passes] * launches
    return [round(k * passes / (launches - 1)) for k in range(launches)]


def launch_mpi(ranks: int, spec: CommSpec, threads: int, on_point) -> dict[str, list[list[float]]]:
    """Start ``ranks`` MPI workers that time the collectives; rank 0 writes the points."""
    from tensoropt.runtime.launcher import mpiexec_path

    with tempfile.TemporaryDirectory(prefix="tensoropt-calibrate-") as tmp:
        out = Path(tmp) / "points.json"
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps({"spec": spec.to_json(), "out": str(out)}))
        cmd = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m"]
        cmd += ["tensoropt.calibrate.comm_worker", str(config)]
        env = {**child_env(), "OMP_NUM_THREADS": str(threads)}  # the runtime's settings
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            _follow(proc, on_point)
        finally:
            _stop(proc)
        if proc.returncode != 0 or not out.exists():
            err = proc.stderr.read() if proc.stderr else ""
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise TensorOptError(
                f"calibrate: the {ranks}-rank MPI collective benchmark failed "
                f"(exit {proc.returncode}: {last}); try --backend local"
            )
        return json.loads(out.read_text())


def _follow(proc: subprocess.Popen, on_point) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("POINT") and on_point is not None:
            on_point()
    proc.wait()


def _stop(proc: subprocess.Popen) -> None:
    """Stop mpiexec (it stops its ranks) if it is still running (an interrupt)."""
    import signal

    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def total_points(spec: CommSpec, launches: int = 1) -> int:
    """Progress ticks of the collective benchmark: one per round of every launch."""
    return samples_per_point(spec) * launches


def check_sizes(values: Sequence[int]) -> None:
    if any(v <= 0 for v in values):
        raise TensorOptError("message sizes must be positive")
