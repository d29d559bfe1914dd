"""The probe of the host's memory link (does each rank have one of its own right now?)."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from tensoropt.calibrate import memlink, neighbours
from tensoropt.calibrate.kernels import KernelOptions, cases
from tensoropt.errors import TensorOptError

two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")


def test_a_link_is_shared_when_processes_together_get_much_less_than_one_alone():
    own = memlink.LinkProbe(alone=4.0e10, together=3.9e10, processes=2)
    shared = memlink.LinkProbe(alone=4.0e10, together=2.1e10, processes=2)
    assert not own.shared and shared.shared
    assert shared.to_json() == {
        "alone_Bps": 40_000_000_000,
        "together_Bps": 21_000_000_000,
        "processes": 2,
        "ratio": 0.525,
        "shared": True,
    }


def test_the_streaming_floor_takes_the_probes_median_else_the_largest_add():
    from types import SimpleNamespace

    from tensoropt.calibrate.profile import streaming_bandwidth

    def result(op_type: str, work: float, rate: float):
        return SimpleNamespace(case=SimpleNamespace(op_type=op_type, work=work), rate=rate)

    results = [result("Add", 1e6, 9e9), result("Add", 5e7, 2.5e10), result("Relu", 9e7, 5e10)]
    probes = [memlink.LinkProbe(alone=a, together=a / 2, processes=2) for a in (4e10, 3e10, 5e10)]
    assert streaming_bandwidth(probes, results) == (4e10, "memory-link probes (median of 3)")
    assert streaming_bandwidth(probes[:2], results)[0] == 3.5e10
    assert streaming_bandwidth([], results) == (2.5e10, "largest Add case")


def test_one_rank_or_one_core_is_not_probed(monkeypatch):
    with memlink.prober(1) as prober:
        assert prober is None
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert memlink.probe_processes(4) == 0


@two_cores
def test_a_probe_streams_in_real_processes_and_leaves_none_behind():
    before = set(multiprocessing.active_children())
    with memlink.Prober(2) as prober:
        first, second = prober.probe(0.05), prober.probe(0.05)
    for p in (first, second):
        # a 64 MiB stream, alone and two at once: any machine moves more than 100 MB/s,
        # and two processes never get more than twice what one alone gets
        assert p.alone > 1e8 and p.together > 1e8 and p.processes == 2
        assert 0 < p.ratio < 2
    assert set(multiprocessing.active_children()) <= before


@two_cores
def test_a_streaming_process_that_dies_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(memlink, "REPLY_TIMEOUT_S", 5.0)
    with memlink.Prober(2) as prober:
        prober._procs[1].kill()
        prober._procs[1].join()
        with pytest.raises(TensorOptError, match="memory-link probe: a streaming process"):
            prober.probe(0.05)


@two_cores
def test_a_prober_outlives_other_process_sets():
    # calibrate probes before each pass, and each pass starts and stops its own
    # processes (a neighbour's barrier included); the probe kept working across them
    opts = KernelOptions(threads=1, repeats=3, block_seconds=0.002, cold_calls=2)
    with memlink.Prober(2) as prober:
        prober.probe(0.05)
        with neighbours.busy_neighbours(1, opts, cases(quick=True)[:1]) as pacer, pacer.busy():
            pass
        assert prober.probe(0.05).together > 1e8
