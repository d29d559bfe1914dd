"""Alpha-beta fits, medians and spreads, and the cost model's use of measured curves."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensoropt.calibrate import kernels
from tensoropt.calibrate.collectives import (
    KINDS,
    fit,
    latency_terms,
    launch_slots,
    merge_launches,
    volume,
)
from tensoropt.calibrate.kernels import KernelOptions, KernelResult, build_model, cases
from tensoropt.calibrate.stats import (
    STEADY_SPREAD,
    Sample,
    fit_alpha_beta,
    steady_sample,
    time_call,
)
from tensoropt.cost.cluster import OpCurve, RateGrid, builtin, from_json
from tensoropt.cost.compute import (
    contraction_rows,
    curve_rate,
    forward_flops,
    op_time,
    update_time,
)
from tensoropt.errors import ClusterError


@given(
    alpha=st.floats(1e-7, 1e-3),
    bandwidth=st.floats(1e7, 1e11),
    terms=st.sampled_from([1, 2]),
)
def test_fit_recovers_exact_alpha_beta(alpha, bandwidth, terms):
    volumes = [64.0 * 4**k for k in range(9)]
    seconds = [terms * alpha + v / bandwidth for v in volumes]
    got = fit_alpha_beta([terms] * len(volumes), volumes, seconds)
    assert got.alpha_s == pytest.approx(alpha, rel=1e-4, abs=1e-12)
    assert got.bandwidth == pytest.approx(bandwidth, rel=1e-4)
    assert got.rel_residual < 1e-6


def test_fit_never_returns_negative_rates():
    # noisy latency-bound points whose unconstrained fit has a negative intercept
    got = fit_alpha_beta([1, 1, 1], [10.0, 1e6, 2e6], [1e-9, 1e-3, 2.2e-3])
    assert got.alpha_s >= 0 and got.bandwidth > 0


def test_each_collective_keeps_its_own_fit():
    rows = {}
    for kind in KINDS:
        scale = 3.0 if kind.value == "AllToAll" else 1.0  # a slower collective
        rows[kind.value] = [
            [b, latency_terms(kind) * 1e-5 + scale * volume(kind, b, 2) / 1e9, 0.0]
            for b in (64.0, 4096.0, 1 << 20, 1 << 24)
        ]
    fits = fit(rows, 2, "synthetic")
    assert fits.per_kind["AllToAll"].bandwidth == pytest.approx(1e9 / 3, rel=1e-6)
    for kind in ("AllReduce", "AllGather", "ReduceScatter"):
        assert fits.per_kind[kind].bandwidth == pytest.approx(1e9, rel=1e-6)
        assert fits.per_kind[kind].alpha_s == pytest.approx(1e-5, rel=1e-4)


def test_alltoall_volume_is_what_comm_bytes_charges():
    from tensoropt.ir.layout import Shard
    from tensoropt.ir.redistribute import Step, comm_bytes
    from tensoropt.ir.vocab import CollectiveKind

    step = Step(CollectiveKind.ALL_TO_ALL, 0, Shard(0), Shard(1))
    for n in (2, 4):
        local = (8, 16)  # the rank's buffer: 512 bytes of float32
        assert volume(CollectiveKind.ALL_TO_ALL, 512.0, n) == comm_bytes(step, local, np.float32, n)


@pytest.fixture(scope="module")
def mlp_tiny_sg(tmp_path_factory):
    """The search graph of the zoo's tiny mlp (SGD with momentum)."""
    import argparse

    from tensoropt.cli.common import search_graph
    from tensoropt.models import build_model, save_model

    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(path))
    args = argparse.Namespace(model=str(path), input_shape=None, trainable=None, freeze=None,
                              optimizer="sgd", momentum=0.9, loss="auto")  # fmt: skip
    return search_graph(args)


def _profile_with(per_kind: dict) -> object:
    from tensoropt.cost.cluster import from_json

    return from_json({"base": "h100", "collectives": {"per_kind": per_kind}}, "c.json")


def test_profile_uses_measured_collective_rates_inside_a_node():
    from tensoropt.cost.cluster import Link

    profile = _profile_with({"AllReduce": {"alpha_s": 1e-5, "bandwidth": 1e9, "points": []}})
    assert profile.link_for("AllReduce", profile.intra) == Link(1e-5, 1e9)
    assert profile.link_for("AllGather", profile.intra) == profile.intra
    assert profile.link_for("AllReduce", profile.inter) == profile.inter  # not measured


@pytest.mark.parametrize(
    "fit, field",
    [
        ({"alpha_s": 1e-5, "bandwidth": -1.0}, "per_kind.AllReduce.bandwidth"),
        ({"alpha_s": -1e-5, "bandwidth": 1e9}, "per_kind.AllReduce.alpha_s"),
        ({"alpha_s": 1e-5}, "per_kind.AllReduce"),
    ],
)
def test_bad_collective_rates_name_the_field(fit, field):
    from tensoropt.errors import ClusterError

    with pytest.raises(ClusterError, match=field.replace(".", r"\.")):
        _profile_with({"AllReduce": fit})


def test_cost_model_charges_the_gradient_allreduce_at_its_measured_rate(mlp_tiny_sg):
    from tensoropt.cost.model import build_problem
    from tensoropt.ir.mesh import Mesh
    from tensoropt.search.driver import reference_choices

    sg = mlp_tiny_sg
    mesh = Mesh((2,), ("x",))
    base = builtin("h100")
    slow = _profile_with({"AllReduce": {"alpha_s": 1e-4, "bandwidth": 1e8}})
    times = []
    for profile in (base, slow):
        mp = build_problem(sg, mesh, profile)
        times.append(mp.problem.evaluate(reference_choices(sg, mp)["data-parallel"])[0])
    # one all-reduce per parameter gradient, and one of the float32 scalar loss (the mean
    # over a batch split two ways is partial until it is reduced for the graph output)
    param_bytes = sum(4 * math.prod(sg.graph.initializers[p].shape) for p in sg.params)
    alphas = 2 * (len(sg.params) + 1) * (1e-4 - base.intra.alpha_s)
    betas = (param_bytes + 4) * (1 / 1e8 - 1 / base.intra.bandwidth)  # 2 (n-1)/n = 1 at n = 2
    assert times[1] - times[0] == pytest.approx(alphas + betas, rel=1e-9)


def test_launches_merge_to_the_mean_of_their_medians_with_the_wider_spread():
    runs = [
        {"AllReduce": [[64.0, 1.0, 0.05], [1024.0, 2.0, 0.30]]},
        {"AllReduce": [[64.0, 4.0, 0.01], [1024.0, 2.2, 0.20]]},
        {"AllReduce": [[64.0, 1.0, 0.02], [1024.0, 2.1, 0.10]]},
    ]
    merged = merge_launches(runs)["AllReduce"]
    # mean over launches (the median would be 1.0); spread = max(median own, range / mean)
    assert merged[0] == [64.0, 2.0, (4.0 - 1.0) / 2.0]
    assert merged[1][:2] == [1024.0, pytest.approx(2.1)] and merged[1][2] == 0.20
    assert merge_launches(runs[:1]) is runs[0]


def test_launches_are_spread_over_the_compute_passes():
    assert launch_slots(3, 2) == [0, 1, 2]  # before, between and after the two passes
    assert launch_slots(3, 1) == [0, 0, 1]
    assert launch_slots(5, 2) == [0, 0, 1, 2, 2]
    assert launch_slots(1, 2) == [2]  # one launch: after the compute


def test_sample_median_and_spread():
    s = Sample.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s.median == 3.0 and s.repeats == 5
    assert s.spread == pytest.approx((4.0 - 2.0) / 3.0)


def test_a_disturbed_measurement_gets_more_repeats_and_its_burst_falls_outside_the_median():
    burst = iter([1.0, 1.6, 1.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    s = steady_sample(lambda: next(burst), 5, 15)
    assert s.repeats == 9 and s.median == 1.0 and s.spread <= STEADY_SPREAD
    steady = iter([1.0, 1.01, 0.99, 1.0, 1.02])
    assert steady_sample(lambda: next(steady), 5, 15).repeats == 5  # no more than needed
    noisy = iter([1.0, 2.0] * 10)
    assert steady_sample(lambda: next(noisy), 5, 15).repeats == 15  # never past the cap
    assert steady_sample(lambda: next(noisy), 3, 3).repeats == 3  # quick: none extra


def test_full_calibration_times_forward_kernels_in_shorter_blocks():
    from tensoropt.calibrate.profile import CalibrateOptions, _kernel_options

    full = _kernel_options(CalibrateOptions())
    assert full.repeats == 3 and full.max_repeats == 3  # no extra: the median of 3 passes
    assert _kernel_options(CalibrateOptions(quick=True)).repeats == 5
    # the forward kernel alone: shorter blocks (its error cancels in the backward ratio
    # at calibrated sizes); the step keeps the long blocks
    assert full.forward().block_seconds < full.block_seconds
    assert full.forward().cold_calls < full.cold_calls
    assert _kernel_options(CalibrateOptions(repeats=5, quick=True)).max_repeats == 5


def test_each_case_keeps_its_median_pass_and_the_profile_says_how_far_apart_they_were():
    from tensoropt.calibrate.profile import middle_pass, pass_difference

    case, other = cases(quick=True)[:2]
    first = KernelResult(case, Sample(2e-6, 0.01, 5), 8, step=Sample(10e-6, 0.02, 5))
    second = KernelResult(case, Sample(3e-6, 0.01, 5), 4, step=Sample(8e-6, 0.03, 15))
    odd = KernelResult(case, Sample(9e-6, 0.01, 5), 6, step=Sample(4e-6, 0.03, 5))
    # three passes: the median kernel and, on its own, the median step; an odd pass is
    # dropped whether it is slow (the kernel 9 us) or fast (the step 4 us)
    mid = middle_pass([first, odd, second])
    assert mid.seconds == second.seconds and mid.copies == 4
    assert mid.step == second.step
    # two passes: the faster of the two
    best = middle_pass([first, second])
    assert best.seconds == first.seconds and best.copies == 8 and best.step == second.step
    no_step = dataclasses.replace(first, step=None)
    assert middle_pass([no_step]).step is None
    steady = KernelResult(other, Sample(1e-6, 0.01, 5), 4, step=Sample(5e-6, 0.01, 5))
    apart = pass_difference({case: [first, second], other: [steady, steady]})
    assert apart == {"median": 0.125, "max": 0.25, "max_case": case.label()}
    assert pass_difference({}) == {}


def test_small_steps_are_measured_over_more_copies():
    from tensoropt.calibrate.steps import SMALL_CASE_BYTES, step_copies

    small = kernels._matmul(16, 64)
    big = kernels._matmul(1024, 1024)
    assert small.traffic <= SMALL_CASE_BYTES < big.traffic
    assert step_copies(small, 64) == 32 and step_copies(small, 12) == 12
    assert step_copies(big, 64) == 8 and step_copies(big, 4) == 4


class _FakeClock:
    """A clock that only the timed function and the eviction advance."""

    def __init__(self):
        self.now = 0.0
        self.evictions = 0

    def __call__(self):
        return self.now

    def call(self):
        self.now += 1.0

    def evict(self):
        self.evictions += 1
        self.now += 100.0


def test_cold_timing_evicts_before_every_call_and_times_the_calls_alone():
    clock = _FakeClock()
    per_call = time_call(clock.call, min_seconds=5.0, max_calls=8, clock=clock, before=clock.evict)
    assert per_call == 1.0  # the eviction's 100 s per call are not counted
    assert clock.evictions == 5  # min_seconds counts timed calls: 5 of them
    clock = _FakeClock()
    time_call(clock.call, min_seconds=50.0, max_calls=8, clock=clock, before=clock.evict)
    assert clock.evictions == 8  # capped


def test_kernel_calibration_times_cold_by_default(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(kernels, "evict_caches", clock.evict)
    opts = KernelOptions(threads=1)
    monkeypatch.setattr(KernelOptions, "clock", property(lambda self: clock))
    assert opts.time(clock.call, 3.0) == 1.0 and clock.evictions == 3
    warm = dataclasses.replace(opts, cold=False)
    assert warm.time(clock.call, 3.0) == 1.0 and clock.evictions == 3


def _calibrated(**curves):
    return dataclasses.replace(builtin("h100"), op_curves=curves, op_floor_s=1e-9)


def test_curve_interpolates_log_log_and_clamps():
    curve = OpCurve("flops", ((1e3, 1e9), (1e9, 1e11)))
    assert curve_rate(curve, 1e3) == 1e9 and curve_rate(curve, 1e12) == 1e11
    assert curve_rate(curve, 10.0) == 1e9
    assert curve_rate(curve, 1e6) == pytest.approx(1e10)  # halfway in log space


def test_op_time_follows_the_matmul_curve():
    profile = _calibrated(matmul=OpCurve("flops", ((1e6, 1e10), (1e9, 2e11))))
    shapes, out = [(512, 512), (512, 512)], [(512, 512)]
    flops = forward_flops("MatMul", {}, shapes, out)
    expected = 3 * flops / curve_rate(profile.op_curves["matmul"], flops)
    assert op_time("MatMul", {}, shapes, out, 4, profile) == pytest.approx(expected)
    small = [(8, 8), (8, 8)]
    # small kernels run at the small end of the curve: slower per FLOP than big ones
    per_flop_small = op_time("MatMul", {}, small, [(8, 8)], 4, profile) / (2 * 8**3)
    assert per_flop_small > op_time("MatMul", {}, shapes, out, 4, profile) / flops


def test_memory_bound_families_use_bytes():
    profile = _calibrated(elementwise=OpCurve("bytes", ((1e3, 1e9), (1e8, 4e10))))
    shape = (1024, 1024)
    traffic = 4 * 3 * math.prod(shape)
    rate = curve_rate(profile.op_curves["elementwise"], traffic)
    assert op_time("Add", {}, [shape, shape], [shape], 4, profile) == pytest.approx(
        3 * traffic / rate
    )
    update = update_time(1e6, 1, 4, profile)  # momentum: 4 ops, 10 accesses per element
    per_op = 4 * 1e6 * 10 / 4
    rate = curve_rate(profile.op_curves["elementwise"], per_op)
    assert update == pytest.approx(4 * 1e6 * 10 / rate)


@pytest.mark.parametrize("optimizer, momentum", [("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0)])
def test_update_cost_counts_the_ops_the_optimizer_emits(optimizer, momentum):
    """update_time charges the element-wise ops of passes/optimizer.py one by one:
    their number and the tensor accesses of a parameter's shape they make."""
    from tensoropt.cost.compute import _UPDATE_OPS
    from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
    from tensoropt.passes.training_step import TrainingOptions
    from tests.helpers.steps import zoo_step

    opts = OptimizerOptions(OptimizerKind(optimizer), momentum=momentum)
    proto, _ = zoo_step("mlp", TrainingOptions(optimizer=opts))
    param = next(i.name for i in proto.graph.input if i.name.endswith("weight"))
    nodes = [
        n for n in proto.graph.node
        if n.op_type != "Constant"
        and {p.key: p.value for p in n.metadata_props}.get("tensoropt.param") == param
    ]  # fmt: skip
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    values = (*inferred.input, *inferred.value_info, *inferred.output)
    shape = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}
    full = shape[param]
    accesses = sum(sum(shape.get(name) == full for name in (*n.input, *n.output)) for n in nodes)
    states = {"sgd": 1 if momentum else 0, "adam": 2}[optimizer]
    assert _UPDATE_OPS[states] == (len(nodes), accesses)


def test_contraction_rows_follow_the_gemm_the_op_runs():
    assert contraction_rows("MatMul", {}, [(8, 128, 64), (64, 32)]) == 8 * 128  # shared weight
    assert contraction_rows("MatMul", {}, [(8, 128, 64), (8, 64, 32)]) == 128  # batched
    assert contraction_rows("MatMul", {}, [(64,), (64, 32)]) == 1
    assert contraction_rows("Gemm", {}, [(16, 64), (64, 32)]) == 16
    assert contraction_rows("Gemm", {"transA": 1}, [(64, 16), (64, 32)]) == 16


def test_rate_grid_interpolates_log_bilinear_and_clamps():
    grid = RateGrid((16.0, 256.0), (64.0, 1024.0), ((1e10, 4e10), (1e11, 1e11)))
    assert grid.rate(16, 64) == pytest.approx(1e10)
    assert grid.rate(256, 1024) == pytest.approx(1e11)
    assert grid.rate(16, 1) == pytest.approx(1e10) and grid.rate(1e6, 1e6) == pytest.approx(1e11)
    # below the smallest rows the rate falls along the first cell's log-log slope
    # (10x over 16x rows): a 16x smaller GEMM runs 10x slower per FLOP
    assert grid.rate(1, 1) == pytest.approx(1e9)
    # ... at most in proportion to the rows: the call's time never grows as rows shrink
    steep = RateGrid((16.0, 32.0), (64.0,), ((1e9,), (1e10,)))
    assert 2 / steep.rate(2, 64) == pytest.approx(16 / steep.rate(16, 64))  # rows / rate
    assert grid.rate(16, 256) == pytest.approx(2e10)  # halfway in log side
    assert grid.rate(64, 64) == pytest.approx(math.sqrt(1e10 * 1e11))  # halfway in log rows
    middle = grid.rate(64, 256)  # the geometric mean of the four corners
    assert middle == pytest.approx((1e10 * 4e10 * 1e11 * 1e11) ** 0.25)


def test_accumulation_is_a_copy_then_one_in_place_add_per_further_micro_batch():
    from tensoropt.cost.compute import accumulate_time

    profile = dataclasses.replace(builtin("h100"), op_floor_s=0.0, op_curves={})
    n, isz = 1e6, 4
    bw = profile.memory_bandwidth
    assert accumulate_time(n, 1, isz, profile) == 0.0
    for k in (2, 4, 8):  # the runtime: np.array(copy) of the first, np.add(out=) after
        want = (2 + 3 * (k - 1)) * n * isz / bw
        assert accumulate_time(n, k, isz, profile) == pytest.approx(want)


def test_calibration_grids_take_the_grid_cases_only():
    from tensoropt.calibrate.kernels import CONV_GRID, GRID_ROWS, GRID_SIDES, KernelResult
    from tensoropt.calibrate.profile import _train_grids
    from tensoropt.cost.compute import train_key

    # step slope = flops / (first key x second key): every grid entry is recognisable,
    # and the squares in between drop out
    results = []
    for c in cases(quick=False):
        key = train_key(c.op_type, dict(c.attrs), c.shapes, (c.out_shape,), c.flops)
        rate = key[1] * key[2] if key else 1e11
        step = Sample(c.flops / rate, 0.0, 3)
        results.append(KernelResult(c, Sample(c.flops / 1e15, 0.0, 3), 4, step))
    grids = _train_grids(results)
    matmul = grids["matmul"]["kernel_1"]
    assert matmul["rows"] == list(GRID_ROWS) and matmul["sides"] == list(GRID_SIDES)
    channels, sides, kernels = CONV_GRID
    assert sorted(grids["conv"]) == [f"kernel_{k}" for k in kernels]
    conv = grids["conv"]["kernel_3"]
    assert conv["rows"] == list(channels)
    assert conv["sides"] == [8 * s * s for s in sides]  # batch 8 x output side^2
    norm = grids["batchnorm"]["kernel_1"]
    assert norm["rows"] == list(channels) and norm["sides"] == conv["sides"]
    for grid in (matmul, conv, norm):
        expected = [[pytest.approx(m * k) for k in grid["sides"]] for m in grid["rows"]]
        assert grid["rates"] == expected


def test_grid_ops_weights_are_not_updated_twice(mlp_tiny_sg, monkeypatch):
    """A grid entry holds the op's forward, backward and the momentum-SGD update of its
    weight, so the cost model charges that weight's update only beyond it (here: 0)."""
    import tensoropt.cost.model as model
    from tensoropt.ir.mesh import Mesh

    grid = RateGrid((1.0, 1e4), (1.0, 1e4), ((1e10, 1e10), (1e10, 1e10)))
    profile = _grid_profile(matmul=((1, grid),))
    sg, mesh = mlp_tiny_sg, Mesh((1,), ("x",))
    choice = None
    totals = []
    for slots in (model.grid_update_slots, lambda op, prof: ()):
        monkeypatch.setattr(model, "grid_update_slots", slots)
        mp = model.build_problem(sg, mesh, profile)
        choice = choice or [0] * len(mp.problem.units)
        totals.append(mp.problem.evaluate(choice)[0])
    weights = [
        n.inputs[1] for n in sg.graph if n.op_type in ("MatMul", "Gemm")
        and n.inputs[1] is not None and n.inputs[1].name in sg.params
    ]  # fmt: skip
    assert weights and sg.optimizer_states == 1
    held = sum(update_time(math.prod(w.shape), 1, 4, profile) for w in weights)
    assert totals[1] - totals[0] == pytest.approx(held, rel=1e-9)


def test_grid_update_deduction_never_exceeds_what_the_grid_charged(mlp_tiny_sg):
    """A grid that finds the trained GEMM faster than the element-wise update priced
    alone (here: a very high rate, no floor): the weight's update is taken out of the
    unit only up to what the grid entry charged, so no unit costs less than nothing."""
    import tensoropt.cost.model as model
    from tensoropt.ir.mesh import Mesh

    grid = RateGrid((1.0, 1e4), (1.0, 1e4), ((1e18, 1e18), (1e18, 1e18)))
    profile = dataclasses.replace(_grid_profile(matmul=((1, grid),)), op_floor_s=0.0)
    # micro-batches: the entry is charged once per slot, the update taken out once per step
    mp = model.build_problem(mlp_tiny_sg, Mesh((1,), ("x",)), profile, micro_batches=4)
    times = [s.time_s for u in mp.problem.units for s in u.strategies]  # validated >= 0
    assert min(times) >= 0.0 and max(times) > 0.0


def _grid_profile(**grids):
    curve = OpCurve("flops", ((1e6, 1e10), (1e9, 2e11)))
    return dataclasses.replace(_calibrated(matmul=curve, conv=curve), op_train_grids=grids)


def test_op_time_takes_matmul_time_from_the_training_grid():
    grid = RateGrid((16.0, 256.0), (256.0, 1024.0), ((2e10, 1e10), (2e11, 2e11)))
    profile = _grid_profile(matmul=((1, grid),))
    skinny, wide = [(16, 1024), (1024, 1024)], [(256, 1024), (1024, 1024)]
    flops = 2 * 16 * 1024 * 1024
    t_skinny = op_time("MatMul", {}, skinny, [(16, 1024)], 4, profile)
    assert t_skinny == pytest.approx(flops / 1e10)  # forward + backward, no ratio on top
    t_wide = op_time("MatMul", {}, wide, [(256, 1024)], 4, profile)
    assert t_wide == pytest.approx(16 * flops / 2e11)
    # batch dimensions of A fold into the rows when B is a shared weight
    batched = [(4, 4, 1024), (1024, 1024)]
    assert op_time("MatMul", {}, batched, [(4, 4, 1024)], 4, profile) == pytest.approx(t_skinny)
    gemm = op_time("Gemm", {"transA": 1}, [(1024, 16), (1024, 1024)], [(16, 1024)], 4, profile)
    assert gemm == pytest.approx(t_skinny)


def test_op_time_takes_conv_time_from_the_slice_of_its_kernel():
    one = RateGrid((8.0, 64.0), (32.0, 2048.0), ((1e9, 2e9), (4e9, 8e9)))
    three = RateGrid((8.0, 64.0), (32.0, 2048.0), ((3e9, 6e9), (12e9, 24e9)))
    profile = _grid_profile(conv=((1, one), (3, three)))
    for kernel, grid in ((1, one), (3, three), (7, three)):
        pad = kernel // 2
        attrs = {"kernel_shape": [kernel, kernel], "pads": [pad] * 4}
        shapes = [(8, 64, 16, 16), (64, 64, kernel, kernel)]
        out = [(8, 64, 16, 16)]
        flops = forward_flops("Conv", attrs, shapes, out)
        assert op_time("Conv", attrs, shapes, out, 4, profile) == pytest.approx(
            flops / grid.rate(64, 8 * 16 * 16)
        )


@pytest.mark.parametrize(
    "grid, field",
    [
        ({"rows": [16, 8], "sides": [64], "rates": [[1e9], [1e9]]}, r"kernel_1\.rows"),
        ({"rows": [16], "sides": [64], "rates": [[-1.0]]}, r"rates\[0\]\[0\]"),
        ({"rows": [16, 64], "sides": [64], "rates": [[1e9]]}, r"kernel_1\.rates"),
        ({"rows": [16], "sides": [64, 128], "rates": [[1e9]]}, r"rates\[0\]"),
        ({"rows": [16], "sides": [64]}, r"op_train_grids\.matmul"),
    ],
)
def test_bad_rate_grids_name_the_field(grid, field):
    with pytest.raises(ClusterError, match=field):
        from_json({"base": "h100", "op_train_grids": {"matmul": {"kernel_1": grid}}}, "f.json")


def test_bad_grid_slice_names_the_key():
    grid = {"rows": [16], "sides": [64], "rates": [[1e9]]}
    with pytest.raises(ClusterError, match="matmul.any: expected a key kernel_K"):
        from_json({"base": "h100", "op_train_grids": {"matmul": {"any": grid}}}, "f.json")


def test_an_op_type_with_its_own_curves_uses_them():
    family = OpCurve("bytes", ((1e3, 1e10), (1e8, 1e10)))
    gelu = OpCurve("bytes", ((1e3, 2e9), (1e8, 2e9)))
    profile = dataclasses.replace(
        _calibrated(elementwise=family, Gelu=gelu),
        op_backward={
            "elementwise": OpCurve("bytes", ((1.0, 1.0),)),
            "Gelu": OpCurve("bytes", ((1.0, 9.0),)),
        },
    )
    shape = (256, 1024)
    traffic = 4 * 2 * math.prod(shape)
    assert op_time("Gelu", {}, [shape], [shape], 4, profile) == pytest.approx(
        traffic / 2e9 * (1 + 9.0)
    )
    assert op_time("Tanh", {}, [shape], [shape], 4, profile) == pytest.approx(
        traffic / 1e10 * (1 + 1.0)
    )


def test_profiles_without_curves_keep_the_roofline():
    profile = builtin("v100")
    shapes, out = [(256, 256), (256, 256)], [(256, 256)]
    flops = 2 * 256**3
    traffic = 4 * 3 * 256 * 256
    roofline = max(flops / (profile.peak_flops * profile.efficiency),
                   traffic / profile.memory_bandwidth, profile.op_floor_s)  # fmt: skip
    assert op_time("MatMul", {}, shapes, out, 4, profile) == pytest.approx(3 * roofline)


@pytest.mark.parametrize("case", cases(quick=True), ids=lambda c: c.label())
def test_benchmark_models_compute_their_op(case):
    """Every benchmark model is valid ONNX, has R copies, and outputs the declared shape."""
    import onnx
    import onnxruntime as ort

    model = build_model(case, 3)
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == [case.op_type] * 3
    # distinct parameters per copy (no copy reads another's weights from cache)
    params = [i for n in model.graph.node for i in n.input[1:] if i != "axes"]
    assert len(params) == len(set(params))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.ones(case.shapes[0], np.float32)
    outs = sess.run(None, {"x": x})
    assert all(o.shape == case.out_shape for o in outs)


def test_activation_memory_counts_only_values_the_backward_reads(mlp_tiny_sg):
    """1 device: memory = parameters x (3 + 2 states) + the saved forward values."""
    from tensoropt.cost.model import build_problem
    from tensoropt.ir.mesh import Mesh

    sg = mlp_tiny_sg
    assert sg.saved and len(sg.saved) < sum(len(n.outputs) for n in sg.graph)
    views = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")  # no memory of their own
    values = {v.name: v for n in sg.graph if n.op_type not in views for v in n.outputs}
    saved_bytes = sum(
        values[name].dtype.itemsize * math.prod(values[name].shape)
        for name in sg.saved
        if name in values
    )
    param_bytes = sum(4 * math.prod(sg.graph.initializers[p].shape) for p in sg.params)
    mp = build_problem(sg, Mesh((1,), ("x",)), builtin("h100"))
    memory = mp.problem.evaluate([0] * len(mp.problem.units))[1]
    assert memory == param_bytes * (3 + 2 * sg.optimizer_states) + saved_bytes


def test_conversion_buffers_count_only_when_the_backward_reads_the_value(mlp_tiny_sg):
    """A forward conversion's result is memory of the step only when the value is saved
    for the backward (as a node's output is); otherwise it lives from the conversion to
    its reader and is not resident (measured: docs/design/measured.md)."""
    from tensoropt.cost.model import ProblemFamily, graph_facts
    from tensoropt.ir.mesh import Mesh

    sg = mlp_tiny_sg
    family = ProblemFamily(sg, Mesh((2,), ("x",)), builtin("h100"))
    mp = family.problem()
    facts = graph_facts(sg).crossings  # per crossing: (shape, item size, held)
    kept = passing = 0
    for c, f in zip(mp.crossings, facts, strict=True):
        if c.source == c.target or not c.forward:
            continue
        times, mems = family.builder._crossing_tables(c, mp.programs, *f)
        if c.value.name in sg.saved:
            kept += bool(mems.any())
        else:
            assert not mems.any(), c.value.name
            passing += bool(times.any())  # converted (it costs time), yet holds nothing
    assert kept and passing


@pytest.mark.parametrize("k", [1, 2, 4])
def test_micro_batched_steps_hold_parameters_and_states_once(mlp_tiny_sg, k, monkeypatch):
    """With micro-batches the step phase updates in place (runtime.inplace): the
    parameter and each optimizer state are priced once, not twice; without them the
    update shares its segment with the backward and keeps both copies."""
    from tensoropt.cost import model as cm
    from tensoropt.cost.model import build_problem
    from tensoropt.ir.mesh import Mesh

    sg = mlp_tiny_sg
    param_bytes = sum(4 * math.prod(sg.graph.initializers[p].shape) for p in sg.params)

    def memory() -> float:
        mp = build_problem(sg, Mesh((1,), ("x",)), builtin("h100"), micro_batches=k)
        return mp.problem.evaluate([0] * len(mp.problem.units))[1]

    priced = memory()
    apart = cm.param_bytes
    monkeypatch.setattr(cm, "param_bytes", lambda *a: apart(*a[:5], False))
    both = memory()
    once = param_bytes * (1 + sg.optimizer_states) if k > 1 else 0
    assert both - priced == once


def test_column_parallel_consumer_pays_the_backward_allreduce(mlp_tiny_sg):
    """Forward R -> R needs nothing, but the gradient of a column-parallel MatMul's input
    is partial over the tp axis: the edge charges its AllReduce (Megatron's backward)."""
    from tensoropt.cost.model import build_problem
    from tensoropt.ir.mesh import Mesh

    sg = mlp_tiny_sg
    profile = _profile_with({"AllReduce": {"alpha_s": 1e-5, "bandwidth": 1e9}})
    mp = build_problem(sg, Mesh((2,), ("x",)), profile)
    names = [u.name for u in mp.problem.units]
    dst = names.index("fc1/MatMul")
    col = next(j for j, s in enumerate(mp.problem.units[dst].strategies)
               if s.label.startswith("(R, S(1))"))  # fmt: skip
    edge = next(e for e in mp.problem.edges if e.dst == dst)
    src = mp.problem.units[edge.src]
    rep = next(j for j, s in enumerate(src.strategies) if s.label.endswith("-> (R)"))
    value = mp.units[dst].node.inputs[0]
    nbytes = 4 * math.prod(value.shape)
    assert edge.time_s[rep][col] == pytest.approx(2 * 1e-5 + nbytes / 1e9, rel=1e-12)


def test_masked_softmax_excess_within_the_timings_spread_is_no_slow_path():
    from tensoropt.calibrate.kernels import masked_excess
    from tensoropt.calibrate.stats import Sample

    fast = Sample(median=1.0e-3, spread=0.04, repeats=3)
    # a difference inside either timing's IQR (4% of 1 ms) is not a slow path
    assert masked_excess(Sample(1.03e-3, 0.02, 3), fast) == 0.0
    assert masked_excess(Sample(0.98e-3, 0.02, 3), fast) == 0.0
    assert masked_excess(Sample(1.05e-3, 0.06, 3), fast) == 0.0  # the slow one's own spread
    # two tight timings still differ by up to the steady-sample criterion (5%)
    steady = Sample(median=1.0e-3, spread=0.001, repeats=3)
    assert masked_excess(Sample(1.04e-3, 0.001, 3), steady) == 0.0
    # a real slow path (the development VM's: several times the plain kernel) is kept
    assert masked_excess(Sample(4.0e-3, 0.05, 3), fast) == pytest.approx(3.0e-3)
