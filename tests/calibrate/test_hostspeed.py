"""The host-speed reference: how fast the host computes now against its calibration."""

from __future__ import annotations

import pytest

from tensoropt.calibrate import hostspeed


def test_the_reference_times_a_fixed_graph_on_one_thread():
    ref = hostspeed.Reference()
    assert ref.measure(0.05) > 0
    opts = ref._session.get_session_options()
    assert opts.intra_op_num_threads == 1 and opts.inter_op_num_threads == 1
    model = hostspeed.reference_model()
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Tanh", "Mul"]


def test_the_ratio_is_the_mean_time_now_over_the_calibrated_time():
    assert hostspeed.host_ratio([0.004, 0.006], 0.004) == pytest.approx(1.25)
    assert hostspeed.host_ratio([], 0.004) is None
    assert hostspeed.host_ratio([0.004], None) is None


def test_a_profile_without_a_reference_has_none():
    assert hostspeed.calibrated_reference({"calibration": {"host_reference_s": 0.003}}) == 0.003
    assert hostspeed.calibrated_reference({"calibration": {}}) is None
    assert hostspeed.calibrated_reference({"name": "h100"}) is None
