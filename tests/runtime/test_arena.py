"""One onnxruntime CPU arena per process for every segment session (runtime/arena.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import ModelProto, TensorProto, helper

from tensoropt.errors import TensorOptError
from tensoropt.runtime.arena import (
    ArenaMode,
    ensure_shared_arena,
    registered_arena,
    trim_shared_arena,
)
from tensoropt.runtime.comm import LocalWorld
from tensoropt.runtime.driver import RunOptions
from tensoropt.runtime.profiling import StepClock, _libc_trim, anon_rss_bytes
from tensoropt.runtime.program import RankProgram, SessionConfig
from tensoropt.runtime.run import run_steps
from tensoropt.runtime.split import split_graph

N = 1 << 22  # elements of each intermediate: 16 MiB of float32
MIB = 1 << 20


def two_segment_model(n: int) -> ModelProto:
    """x -> (Exp, Sin, Mul, ReduceSum) -> AllReduce -> (Add, Exp, Sin, Mul, ReduceSum).

    Each of the two compute segments holds three n-element intermediates at its peak.
    """
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    nodes = [
        helper.make_node("Exp", ["x"], ["e0"]),
        helper.make_node("Sin", ["e0"], ["s0"]),
        helper.make_node("Mul", ["e0", "s0"], ["m0"]),
        helper.make_node("ReduceSum", ["m0"], ["r0"], keepdims=1),
        helper.make_node("AllReduce", ["r0"], ["a"], domain="ai.tensoropt", group=[0]),
        helper.make_node("Add", ["x", "a"], ["x1"]),
        helper.make_node("Exp", ["x1"], ["e1"]),
        helper.make_node("Sin", ["e1"], ["s1"]),
        helper.make_node("Mul", ["e1", "s1"], ["m1"]),
        helper.make_node("ReduceSum", ["m1"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(nodes, "two_segments", [x], [loss])
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("ai.tensoropt", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.fixture(scope="module")
def plan():
    p = split_graph(two_segment_model(N), 0, 1, {"x"})
    assert p.num_segments == 2
    return p


def program(plan, mode: ArenaMode) -> RankProgram:
    return RankProgram(plan, SessionConfig(intra_op_threads=1, arena=mode).for_sessions(2))


def step_growth(prog: RankProgram, steps: int = 3) -> int:
    """Profiled memory of ``prog``'s step, as ``run --profile`` measures it."""
    comm = LocalWorld(1).communicator(0)
    x = np.full(N, 0.1, np.float32)
    prog.clock = clock = StepClock()
    clock.start_loop()
    for _ in range(steps):
        clock.start_step()
        prog.run({"x": x}, comm)
    return clock.record(steps - 1, 0.0).memory_bytes


def test_segment_sessions_use_the_env_allocator(plan):
    shared = program(plan, ArenaMode.SHARED)
    assert len(shared.sessions) == 2
    for sess in shared.sessions:
        opts = sess.get_session_options()
        assert opts.get_session_config_entry("session.use_env_allocators") == "1"
        assert not opts.enable_mem_pattern
    assert registered_arena() is not None
    for sess in program(plan, ArenaMode.PER_SESSION).sessions:
        with pytest.raises(RuntimeError, match="use_env_allocators"):
            sess.get_session_options().get_session_config_entry("session.use_env_allocators")
    for sess in program(plan, ArenaMode.NONE).sessions:
        assert not sess.get_session_options().enable_cpu_mem_arena


def test_shared_arena_holds_the_step_peak_not_the_sum_of_segments(plan):
    """Per-session arenas keep both segments' peaks; the shared arena one of them."""
    per_session = step_growth(program(plan, ArenaMode.PER_SESSION))
    shared = step_growth(program(plan, ArenaMode.SHARED))
    tensor = 4 * N
    # one segment's peak is at least two live intermediates
    assert shared >= 2 * tensor
    # the per-session arenas hold the second segment's intermediates on top
    assert per_session - shared >= 2 * tensor
    assert shared < 0.6 * per_session


def test_trim_returns_the_free_regions(plan):
    prog = program(plan, ArenaMode.SHARED)
    step_growth(prog, steps=1)
    _libc_trim()
    before = anon_rss_bytes()
    assert trim_shared_arena()
    _libc_trim()
    # the step's intermediates (at least two 16 MiB tensors) were free arena regions
    assert before - anon_rss_bytes() >= 2 * 4 * N


def test_an_earlier_run_does_not_hide_the_growth(plan):
    """The profile trims the arena at the loop's start: a rerun measures the same."""
    first = step_growth(program(plan, ArenaMode.SHARED))
    again = step_growth(program(plan, ArenaMode.SHARED))
    assert again >= 0.9 * first
    assert abs(again - first) <= 4 * MIB


def test_first_registration_wins(caplog):
    first = ensure_shared_arena(registered_arena() or ArenaMode.SHARED)
    other = ArenaMode.SHARED_POW2 if first is ArenaMode.SHARED else ArenaMode.SHARED
    with caplog.at_level(logging.WARNING, logger="tensoropt.runtime.arena"):
        assert ensure_shared_arena(other) is first
        assert ensure_shared_arena(first) is first
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and other.value in warnings[0].getMessage()
    with pytest.raises(ValueError, match="not a shared"):
        ensure_shared_arena(ArenaMode.NONE)


@pytest.mark.parametrize("case", ["dp2_tp2", "a2a2"])
def test_every_arena_mode_gives_identical_results(outdirs, case):
    """Where tensors live must not change a single bit of the numbers."""
    outdir = outdirs(case)
    ref = run_steps(outdir, 3, seed=3, arena=ArenaMode.PER_SESSION)
    for mode in (ArenaMode.SHARED, ArenaMode.NONE):
        got = run_steps(outdir, 3, seed=3, arena=mode.value)
        assert got.losses == ref.losses
        for name, value in ref.params.items():
            np.testing.assert_array_equal(got.params[name], value)
        for name, value in ref.states.items():
            np.testing.assert_array_equal(got.states[name], value)


def test_arena_mode_travels_to_the_workers():
    opts = RunOptions(steps=2, arena=ArenaMode.NONE)
    assert opts.to_json()["arena"] == "none"
    assert RunOptions.from_json(opts.to_json()) == opts
    legacy = {k: v for k, v in opts.to_json().items() if k != "arena"}
    assert RunOptions.from_json(legacy).arena is ArenaMode.SHARED


def test_unknown_arena_mode_is_bad_input(outdirs):
    with pytest.raises(TensorOptError, match="unknown arena mode 'pooled'.*shared"):
        run_steps(outdirs("dp2"), 1, arena="pooled")


@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_ranks_give_identical_results_in_every_mode(outdirs):
    outdir = outdirs("dp2_tp2")
    ref = run_steps(outdir, 3, backend="mpi", seed=2, threads=1, arena="per-session")
    got = run_steps(outdir, 3, backend="mpi", seed=2, threads=1)
    local = run_steps(outdir, 3, seed=2)
    assert got.losses == ref.losses == local.losses
    for name, value in ref.params.items():
        np.testing.assert_array_equal(got.params[name], value)
