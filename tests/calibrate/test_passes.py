"""A compute pass measured in a fresh process: results, progress, and clean failure."""

from __future__ import annotations

import multiprocessing

import pytest

from tensoropt.calibrate.kernels import KernelOptions, cases
from tensoropt.calibrate.neighbours import Pacer
from tensoropt.calibrate.passes import measure_pass
from tensoropt.errors import TensorOptError

OPTS = KernelOptions(threads=1, repeats=3, block_seconds=0.002, cold_calls=2)
CASES = cases(quick=True)[:2]


def _measuring() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name == "measure"]


def test_a_pass_returns_every_case_in_order_with_progress():
    ticks = []
    out = measure_pass(OPTS, CASES, Pacer(), ticks.append)
    assert [r.case for r, _ in out] == list(CASES)
    assert ticks == [c.label() for c in CASES]
    assert all(r.seconds.median > 0 and r.step.median > 0 and o >= 0 for r, o in out)
    assert _measuring() == []


def test_a_measuring_process_that_dies_is_one_clear_error():
    def kill(_label):
        for proc in _measuring():
            proc.kill()

    with pytest.raises(TensorOptError, match=r"measuring process stopped .* of 2 cases"):
        measure_pass(OPTS, CASES, Pacer(), kill)
    assert _measuring() == []


def test_an_interrupt_stops_the_measuring_process():
    def interrupt(_label):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_pass(OPTS, CASES, Pacer(), interrupt)
    assert _measuring() == []
