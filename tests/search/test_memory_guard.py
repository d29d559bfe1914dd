"""A search that outgrows its share of the machine's memory stops with one line (exit 2)
instead of being killed by the kernel (search.memory)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from search_strategies import problems

from tensoropt.cli import main
from tensoropt.models import build_model, save_model
from tensoropt.search import memory


def test_check_raises_over_the_limit_and_only_inside_it(monkeypatch):
    held = memory.resident_bytes()
    assert held is not None and held > 0  # Linux: /proc/self/statm
    memory.check()  # no limit: nothing is checked
    with memory.limited(held * 100):
        memory.check()
    monkeypatch.setattr(memory, "_where", ["the search"])  # restored after the test
    memory.solving("the search of 8 devices, mesh 2x4")
    with memory.limited(1.0), pytest.raises(memory.SearchMemoryError) as err:
        memory.check()
    assert "the search of 8 devices, mesh 2x4 needs more memory" in str(err.value)
    assert "--epsilon" in str(err.value) and "--devices" in str(err.value)
    memory.check()  # the limit is gone with its block


def test_each_solving_process_gets_an_even_share(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 8.0 * memory.GIB)
    monkeypatch.setattr(memory, "resident_bytes", lambda: 1.0 * memory.GIB)
    assert memory.share(1) == memory.GIB + memory.SHARE * 8.0 * memory.GIB
    assert memory.share(4) == memory.GIB + memory.SHARE * 2.0 * memory.GIB
    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    assert memory.share(2) is None


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_search_beyond_its_share_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, jobs):
    model = tmp_path / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(model))
    out = tmp_path / "search.json"
    # a share below what the process already holds: the first product is over it
    held = memory.resident_bytes()
    assert held is not None
    monkeypatch.setattr(memory, "share", lambda processes: held / 2)
    code = main(["search", str(model), "--devices", "2,4", "--jobs", jobs, "--json-out", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "needs more memory than this machine leaves it" in lines[0]
    assert "devices, mesh" in lines[0] and "Traceback" not in captured.err
    assert not out.exists()  # nothing half-written
    monkeypatch.undo()
    assert (
        main(["search", str(model), "--devices", "2", "--jobs", jobs, "--json-out", str(out)]) == 0
    )
    assert json.loads(out.read_text())["schema"].startswith("tensoropt.search")


@given(problem=problems())
@settings(max_examples=40, deadline=None)
def test_frontier_points_are_evaluated_bit_for_bit(problem):
    """Every plan's (time, memory) from the compiled evaluation, which gathers the terms
    of one row at a time, equals the scalar evaluation exactly."""
    import itertools

    import numpy as np

    from tensoropt.search import solver

    sizes = [len(u.strategies) for u in problem.units]
    choices = np.array(list(itertools.product(*map(range, sizes))), dtype=np.int64)
    expected = [problem.evaluate(tuple(row)) for row in choices.tolist()]
    times, memories = solver.evaluate_choices(problem, choices)
    assert list(zip(times.tolist(), memories.tolist(), strict=True)) == expected


def test_a_search_runs_with_fewer_collections_and_restores_the_thresholds(tmp_path):
    """The collector's thresholds are the search's while it solves (full collections
    traverse every object the process holds) and the caller's afterwards, also when the
    search stops with an error."""
    import gc

    from tensoropt.cost.cluster import builtin
    from tensoropt.search.driver import explore
    from tests.helpers.program import graph_of

    path = tmp_path / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(path))
    sg = graph_of(path)
    before = gc.get_threshold()
    assert before != memory.SEARCH_GC_THRESHOLDS
    seen = []
    explore(
        sg,
        [2],
        "auto",
        builtin("a100"),
        jobs=1,
        on_problem=lambda m: seen.append(gc.get_threshold()),
    )
    assert seen and set(seen) == {memory.SEARCH_GC_THRESHOLDS}
    assert gc.get_threshold() == before

    def stop(mesh):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        explore(sg, [2], "auto", builtin("a100"), jobs=1, on_problem=stop)
    assert gc.get_threshold() == before


def test_check_counts_what_is_about_to_be_made():
    held = memory.resident_bytes()
    assert held is not None
    with memory.limited(held * 2):
        memory.check(held / 2)  # within the share once made
        with pytest.raises(memory.SearchMemoryError) as err:
            memory.check(held * 2)
    assert "GiB about to be made" in str(err.value)


def test_announced_bytes_are_checked_once_they_add_up(monkeypatch):
    """The bounds announce every step's arrays; the resident size is read (and the
    share checked with the bytes about to be made) once READ_EVERY bytes have been
    announced since the last reading, so small steps cost no /proc read each."""
    reads = []
    monkeypatch.setattr(memory, "resident_bytes", lambda: reads.append(1) or 1.0)
    monkeypatch.setattr(memory, "_unread", [0.0])
    memory.about_to_make(memory.READ_EVERY)  # no share: nothing is read
    assert reads == []
    with memory.limited(memory.READ_EVERY * 10):
        memory.about_to_make(memory.READ_EVERY / 2)
        assert reads == []
        memory.about_to_make(memory.READ_EVERY / 2)  # adds up: read
        assert len(reads) == 1
        memory.about_to_make(memory.READ_EVERY / 2)  # counted afresh after a reading
        assert len(reads) == 1
        with pytest.raises(memory.SearchMemoryError, match="GiB about to be made"):
            memory.about_to_make(memory.READ_EVERY * 20)  # large: read at once, over


def test_made_bytes_are_checked_once_they_add_up(monkeypatch):
    """What the factor products made is counted; the share is checked (no bytes about
    to be made: they are held already) once READ_EVERY bytes have been counted, and
    the count shares its total with the bounds' announcements."""
    reads = []
    monkeypatch.setattr(memory, "resident_bytes", lambda: reads.append(1) or 1.0)
    monkeypatch.setattr(memory, "_unread", [0.0])
    monkeypatch.setattr(memory, "_where", ["the search"])
    memory.made(memory.READ_EVERY)  # no share: nothing is read
    assert reads == []
    with memory.limited(memory.READ_EVERY * 10):
        memory.made(memory.READ_EVERY / 2)
        assert reads == []
        memory.about_to_make(memory.READ_EVERY / 2)  # one count for both: read
        assert len(reads) == 1
        memory.made(memory.READ_EVERY / 2)
        assert len(reads) == 1
        memory.made(memory.READ_EVERY * 20)  # large: read at once, within the share
        assert len(reads) == 2
        monkeypatch.setattr(memory, "resident_bytes", lambda: memory.READ_EVERY * 11.0)
        with pytest.raises(memory.SearchMemoryError) as err:
            memory.made(memory.READ_EVERY)
        assert "about to be made" not in str(err.value)
        with pytest.raises(memory.SearchMemoryError, match="^the next problem needs"):
            memory.solving("the next problem")  # each problem starts from a reading


def test_every_factor_product_counts_the_points_it_keeps(tmp_path, monkeypatch):
    from tensoropt.cost.cluster import builtin
    from tensoropt.search import factor
    from tensoropt.search.driver import explore
    from tests.helpers.program import graph_of

    path = tmp_path / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(path))
    kept, counted = [], []
    real = factor.sum_entries

    def sum_entries(*args, **kw):
        table = real(*args, **kw)
        kept.append(len(table.t))
        return table

    monkeypatch.setattr(factor, "sum_entries", sum_entries)
    monkeypatch.setattr(memory, "made", counted.append)
    explore(graph_of(path), [2, 4], "auto", builtin("a100"), jobs=1)
    assert kept and sum(kept) > len(kept)  # products that keep points
    assert counted == [factor.POINT_BYTES * n for n in kept]


def test_the_bounds_check_each_steps_arrays_before_making_them(tmp_path, monkeypatch):
    """The bounds' passes (the inside and outside min-sums, the incumbents' inside pass
    and their outside pass) make arrays over each elimination step's joint scope: on
    ALBERT (one layer's parameters read by every layer) 0.4 to 3.3 GiB each, and a
    worker reached 23 GB before the kernel killed it. Each pass asks for each step's
    bytes first."""
    import sys

    from tensoropt.cli import build_parser
    from tensoropt.cli.common import search_graph
    from tensoropt.cost.cluster import builtin
    from tensoropt.search.driver import explore

    model = tmp_path / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(model))
    asked: dict[str, list[float]] = {}
    real = memory.about_to_make

    def about_to_make(nbytes):
        caller = sys._getframe(1).f_code.co_name
        if caller == "_ask":  # the pass that asked
            caller = sys._getframe(2).f_code.co_name
        asked.setdefault(caller, []).append(nbytes)
        real(nbytes)

    monkeypatch.setattr(memory, "about_to_make", about_to_make)
    sg = search_graph(build_parser().parse_args(["search", str(model)]))
    explore(sg, [4], "auto", builtin("h100"), jobs=1)
    passes = {"_inside", "_outside", "_plans_inside", "_incumbents"}
    assert passes <= set(asked), sorted(asked)
    assert all(extra > 0 for name in passes for extra in asked[name])
