"""Per-rank step profiles for ``tensoropt run --profile`` (and ``tensoropt validate``).

Per step and rank: the wall time of the engine's step (segments, collectives and
the glue between them; batch generation is outside), compute = the sum of the
segments' ``session.run`` times (also as this thread's CPU time, which other
processes on a busy machine do not inflate when onnxruntime runs one thread),
communication = the sum of the collectives' times (including waiting for the other
members), and memory.

Memory is the process's *anonymous* resident memory (``/proc/self/statm``:
resident minus file-backed pages, so library code pages touched on the first run
do not count), sampled before the step and after every segment and collective,
minus the same quantity when the step loop starts (sessions built, no training
state yet). glibc's ``malloc_trim`` runs once, when the loop starts (not per step:
a real run never trims, and per-step trims made the step fault its buffers in again),
so the heap's high-water mark over the steps counts, as a device pool's would; the
shared onnxruntime arena
(:mod:`tensoropt.runtime.arena`) is trimmed once, when the loop starts, so regions
left by session construction or an earlier run in the process do not hide the
step's growth. It therefore counts what training adds to the process: parameter and
optimizer-state arrays (inputs and their ``__new`` outputs), activations and
gradients in the rank's one onnxruntime arena (which keeps its high-water mark:
the pool a device would need), data shards and collective buffers. Not counted:
the interpreter, libraries, the loaded device graphs and constants inside the
sessions. Samples at stage boundaries can miss a buffer that lives only inside one
collective call. With the ``local`` backend every rank lives in one process and
shares one arena: each rank reports the process's figure (all ranks together).

Summaries are medians over the steps after ``warmup``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tensoropt.runtime.arena import trim_shared_arena

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_trim() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``), where available.

    Called when the profiled step loop starts, so that memory freed by earlier work
    (session construction, an earlier run in this process) does not hide the steps'
    growth.
    """
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


_STATM: tuple[int, int] | None = None  # (pid, fd of /proc/<pid>/statm), kept open


def anon_rss_bytes() -> int:
    """Resident anonymous memory of this process (resident - shared pages), in bytes.

    Sampled after every segment and collective, so it must be cheap: the file stays
    open and is re-read with ``pread`` (~1 us; open + read + close took ~11 us, which
    added ~3 ms to a profiled resnet50-tiny step of ~180 stages). /proc/self resolves
    when opened, so a forked child opens its own."""
    global _STATM
    try:
        pid = os.getpid()
        if _STATM is None or _STATM[0] != pid:
            _STATM = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        parts = os.pread(_STATM[1], 256, 0).split()
        return (int(parts[1]) - int(parts[2])) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(slots=True)
class StepClock:
    """Accumulates one rank's compute and communication seconds and peak memory."""

    baseline: int = 0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    comm_s: float = 0.0
    peak: int = 0

    def start_loop(self) -> None:
        trim_shared_arena()  # free regions left by session construction or earlier runs
        _libc_trim()
        self.baseline = anon_rss_bytes()

    def start_step(self) -> None:
        # No trim here: a real run never trims, and trimming each step handed the heap
        # back to the OS only for the step to fault it in again (measured: +0.4 ms of
        # collective time per step on mlp-small, 2 ranks). The heap's high-water mark
        # persists across steps, as a device's pool does.
        self.compute_s = 0.0
        self.compute_cpu_s = 0.0
        self.comm_s = 0.0
        self.peak = anon_rss_bytes()

    def add_compute(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.compute_s += seconds
        self.compute_cpu_s += cpu_seconds
        self.sample()

    def add_comm(self, seconds: float) -> None:
        self.comm_s += seconds
        self.sample()

    def sample(self) -> None:
        self.peak = max(self.peak, anon_rss_bytes())

    def record(self, step: int, seconds: float) -> StepRecord:
        self.sample()
        # growth over the baseline; pages the process freed since the baseline (trimmed
        # heap left by earlier work) would make a step with no growth look negative
        growth = max(0, self.peak - self.baseline)
        return StepRecord(
            step, seconds, self.compute_s, self.comm_s, growth, self.compute_cpu_s
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    seconds: float
    compute_s: float
    comm_s: float
    memory_bytes: int
    compute_cpu_s: float = 0.0  # this thread's CPU time in the segments


@dataclass(frozen=True, slots=True)
class RankProfile:
    """Medians over the measured steps of one rank."""

    rank: int
    steps: int  # measured (after warm-up)
    step_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    step_spread: float  # IQR / median of the step time
    compute_cpu_s: float = 0.0
    records: tuple[StepRecord, ...] = field(default=())

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "compute_cpu_s": self.compute_cpu_s,
            "other_s": max(self.step_s - self.compute_s - self.comm_s, 0.0),
            "memory_bytes": self.memory_bytes,
            "step_spread": self.step_spread,
        }


def summarize(rank: int, records: Sequence[StepRecord], warmup: int) -> RankProfile:
    measured = [r for r in records if r.step >= records[0].step + warmup] or list(records)
    steps = np.array([r.seconds for r in measured])
    q1, q3 = np.percentile(steps, [25, 75])
    med = float(np.median(steps))
    return RankProfile(
        rank=rank,
        steps=len(measured),
        step_s=med,
        compute_s=float(np.median([r.compute_s for r in measured])),
        comm_s=float(np.median([r.comm_s for r in measured])),
        memory_bytes=float(np.median([r.memory_bytes for r in measured])),
        step_spread=float((q3 - q1) / med) if med > 0 else 0.0,
        compute_cpu_s=float(np.median([r.compute_cpu_s for r in measured])),
        records=tuple(records),
    )


@dataclass(frozen=True, slots=True)
class ProfileReport:
    """Every rank's profile; what ``run --profile`` prints and ``--json`` holds."""

    warmup: int
    ranks: tuple[RankProfile, ...]
    memory_definition: str = "anonymous RSS growth over the step loop's start (see docs)"

    def to_json(self) -> dict:
        return {
            "warmup": self.warmup,
            "memory_definition": self.memory_definition,
            "ranks": [r.to_json() for r in self.ranks],
        }

    @staticmethod
    def from_records(by_rank: Mapping[int, Sequence[StepRecord]], warmup: int) -> ProfileReport:
        ranks = tuple(summarize(r, recs, warmup) for r, recs in sorted(by_rank.items()))
        return ProfileReport(warmup, ranks)

    @staticmethod
    def from_json(d: Mapping) -> ProfileReport:
        ranks = tuple(
            RankProfile(
                int(r["rank"]),
                int(r["steps"]),
                float(r["step_s"]),
                float(r["compute_s"]),
                float(r["comm_s"]),
                float(r["memory_bytes"]),
                float(r["step_spread"]),
                float(r.get("compute_cpu_s", 0.0)),
            )
            for r in d["ranks"]
        )
        return ProfileReport(int(d["warmup"]), ranks)


def now() -> float:
    return time.perf_counter()


def cpu_now() -> float:
    """This thread's CPU seconds: with one intra-op thread, a segment's own work."""
    return time.thread_time()
