"""Section 1 of the report, rendered from hand-made frontiers."""

from __future__ import annotations

from tensoropt.cost.summary import ALL_REPLICATED
from tensoropt.report.analysis import Point
from tensoropt.report.render import frontier_section


def _point(devices: int, mesh: tuple[int, ...], time_s: float, memory: float, plan: str):
    return Point(devices, mesh, 0, time_s, memory, plan)


def test_rows_that_fewer_devices_match_say_so():
    """A row matched by a plan on fewer devices (at most as slow, no more memory) names
    the fewest such count; a plan that replicates all work keeps its own note."""
    rows = {
        1: [_point(1, (1,), 1.0, 100.0, "replicated")],
        2: [
            _point(2, (2,), 1.0, 100.0, ALL_REPLICATED),
            _point(2, (2,), 1.5, 60.0, "tp=2 on MatMul"),
        ],
        4: [
            # what a replicated point uses follows its summary: still its own note
            _point(4, (2, 2), 1.0, 100.0, f"{ALL_REPLICATED}, zero-1"),
            _point(4, (2, 2), 1.6, 60.0, "tp=2 on MatMul"),  # 2 devices do as well
            _point(4, (4,), 2.0, 40.0, "tp=4 on MatMul"),
        ],
    }
    text = "\n".join(frontier_section(rows, 8, "f.png", per_count=5))
    lines = text.splitlines()
    assert sum("no better than" in line for line in lines) == 1
    (row,) = [line for line in lines if "1.6 s" in line]
    assert row.endswith("| tp=2 on MatMul (no better than 2 devices) |"), row
    assert "No better than N devices: a plan on fewer devices" in text
    replicated = [line for line in lines if "| 1 s |" in line and "replicated (" in line]
    assert [line.rstrip(" |").rsplit("| ", 1)[1] for line in replicated] == [
        ALL_REPLICATED, f"{ALL_REPLICATED}, zero-1"
    ]  # fmt: skip
    # a replicated plan keeps its own note whichever smaller count matches it (here 2
    # devices: 1 was not searched)
    alone = {
        2: [_point(2, (2,), 1.0, 100.0, ALL_REPLICATED)],
        4: [_point(4, (4,), 1.0, 100.0, ALL_REPLICATED)],
    }
    assert "no better than" not in "\n".join(frontier_section(alone, 8, "f.png", per_count=5))
    # without such a row, no footnote
    del rows[4]
    assert "No better than" not in "\n".join(frontier_section(rows, 8, "f.png"))


def test_the_strategy_section_says_where_each_memory_axis_comes_in():
    """Section 4 names, per axis, the first frontier point (fastest first) that uses it
    and how many do; a frontier of the split alone says nothing of the axes."""
    from tensoropt.report.render import change_sentences
    from tensoropt.report.strategies import Track
    from tensoropt.search.driver import PLAIN, Variant

    def at(t, m, v=PLAIN):
        return Point(2, (2,), 0, t, m, "plan", v)

    points = (
        at(1.0, 100.0),
        at(1.1, 80.0, Variant(zero=1)),
        at(1.3, 60.0, Variant(zero=3, recompute=True)),
        at(2.0, 40.0, Variant(micro_batches=4, recompute=True)),
    )
    lines = change_sentences(Track(2, points, (), ()), [])
    (axes,) = [line for line in lines if line.startswith("The memory axes along it")]
    assert axes == (
        "The memory axes along it (points fastest first): ZeRO from point 1 (80 B, 1.1 s) "
        "on, in 2; recomputation from point 2 (60 B, 1.3 s) on, in 2; micro-batches from "
        "point 3 (40 B, 2 s) on, in 1."
    )
    plain = change_sentences(Track(2, points[:1], (), ()), [])
    assert not any("memory axes" in line for line in plain)


def test_section_5_names_the_references_no_mesh_holds():
    """The references the search could not express are listed with the plan's own
    refusal under the table, and alone when no reference is expressible at all."""
    from tensoropt.report.render import baseline_section

    why = "data-parallel over 3 devices: input 'x' dim 0 has size 8, which 3 does not divide"
    gaps = {3: {"data-parallel": why, "fsdp": why}}
    lines = baseline_section([], 8, gaps)
    assert "No reference plan is expressible on the searched meshes." in lines
    assert f"- 3 devices, data parallel: {why}." in lines
    assert f"- 3 devices, FSDP (ZeRO-3 + recompute): {why}." in lines
    assert not any("not expressible" in line.lower() for line in baseline_section([], 8))
