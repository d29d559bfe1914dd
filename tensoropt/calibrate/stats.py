"""Robust summaries of repeated timings and the alpha-beta least-squares fit.

Every calibrated number is the median of K repeats, and carries its spread
(interquartile range over median), so a reader of the profile can tell a steady
rate from a noisy one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# The last-level cache of this project's machines (lscpu: 32 MiB L3, shared by the cores):
# after writing this many bytes, nothing an earlier call touched is still cached.
EVICT_BYTES = 32 << 20


@functools.cache
def _evict_buffer() -> np.ndarray:
    return np.ones(EVICT_BYTES // 4, dtype=np.float32)


def evict_caches() -> None:
    """Write :data:`EVICT_BYTES` of scratch memory, evicting every cache level.

    Inside a training step, an op's weights were last touched a whole step earlier and
    the tensors the backward reads many ops earlier, with the rest of the model's
    working set in between: they come from memory. Timings taken after this call see
    the same.
    """
    buf = _evict_buffer()
    np.add(buf, 1.0, out=buf)


@dataclass(frozen=True, slots=True)
class Sample:
    """The median of repeated measurements and their relative spread (IQR / median)."""

    median: float
    spread: float
    repeats: int

    @staticmethod
    def of(values: Sequence[float]) -> Sample:
        arr = np.asarray(values, dtype=np.float64)
        if arr.size == 0:
            raise ValueError("no measurements to summarise")
        med = float(np.median(arr))
        q1, q3 = np.percentile(arr, [25, 75])
        spread = float((q3 - q1) / med) if med > 0 else 0.0
        return Sample(med, spread, int(arr.size))


# A measurement whose repeats spread more than this (IQR / median) was disturbed
# part-way (on this project's VM: bursts of a second or so, measured);
# it gets more repeats, so the disturbed ones fall outside the median.
STEADY_SPREAD = 0.05


def steady_sample(
    measure: Callable[[], float], repeats: int, max_repeats: int, *, spread=STEADY_SPREAD
) -> Sample:
    """The median of ``repeats`` calls of ``measure``, more (up to ``max_repeats``) while
    their spread is above ``spread``."""
    values = [measure() for _ in range(repeats)]
    while len(values) < max_repeats and Sample.of(values).spread > spread:
        values.append(measure())
    return Sample.of(values)


def time_call(
    fn: Callable[[], object],
    *,
    min_seconds: float,
    max_calls: int = 10_000,
    clock: Callable[[], float] = time.perf_counter,
    before: Callable[[], object] | None = None,
) -> float:
    """Seconds per call of ``fn``: calls in a loop until ``min_seconds`` have passed.

    One timed block of many calls (not one call) keeps the clock's resolution and
    Python's per-call jitter out of short kernels. ``clock`` is wall time by default;
    ``time.thread_time`` measures only this thread's CPU, which other processes on a
    busy machine cannot inflate (right for single-threaded kernels).

    With ``before`` (e.g. :func:`evict_caches`), it runs untimed before every call and
    each call is timed alone; ``min_seconds`` then counts the timed calls only.
    """
    if before is not None:
        calls, elapsed = 0, 0.0
        while calls < max_calls and (elapsed < min_seconds or calls == 0):
            before()
            start = clock()
            fn()
            elapsed += clock() - start
            calls += 1
        return elapsed / calls
    calls = 0
    start = clock()
    elapsed = 0.0
    while calls < max_calls and (elapsed < min_seconds or calls == 0):
        fn()
        calls += 1
        elapsed = clock() - start
    return elapsed / calls


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """``time = latency_terms * alpha + volume / bandwidth``, fitted by least squares."""

    alpha_s: float
    bandwidth: float
    rel_residual: float  # median |measured - fitted| / measured over the points


def fit_alpha_beta(
    latency_terms: Sequence[float], volumes: Sequence[float], seconds: Sequence[float]
) -> AlphaBeta:
    """Least squares of ``seconds ~ terms * alpha + volume / bandwidth`` (alpha >= 0).

    One row per measured point, each with its own latency-term count (a joint fit
    over several collectives shares one alpha and one bandwidth). Relative errors
    are minimised (each row weighted by 1 / measured time): small messages then
    count as much as large ones, which is what a latency fit needs.
    """
    lat = np.asarray(latency_terms, dtype=np.float64)
    v = np.asarray(volumes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if v.size < 2 or np.ptp(v) == 0:
        raise ValueError("an alpha-beta fit needs at least two different message sizes")
    w = 1.0 / t
    design = np.stack([lat, v], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if alpha < 0 or beta <= 0:  # refit one parameter alone (non-negative rates only)
        alpha = max(float(alpha), 0.0)
        rest = t - lat * alpha
        beta = float(np.sum(w * w * v * rest) / np.sum(w * w * v * v))
        if beta <= 0:
            beta = float(t[np.argmax(v)] / v.max())
    fitted = lat * alpha + beta * v
    residual = float(np.median(np.abs(fitted - t) / t))
    return AlphaBeta(float(alpha), float(1.0 / beta), residual)
