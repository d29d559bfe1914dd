"""Mesh, placements, layouts: parsing, local shapes, the slicing rule and its inverse."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.layout import (
    Layout,
    Partial,
    Replicate,
    Shard,
    assemble,
    local_shape,
    parse_placements,
    slice_for,
)
from tensoropt.ir.mesh import Mesh


def test_mesh_parse_and_ranks_are_row_major() -> None:
    mesh = Mesh.parse("2x4")
    assert mesh.shape == (2, 4) and mesh.axis_names == ("dp", "tp") and mesh.size == 8
    assert mesh.coords(5) == (1, 1)
    assert [mesh.rank(mesh.coords(r)) for r in range(8)] == list(range(8))
    assert Mesh.parse("8").axis_names == ("dp",)
    assert str(Mesh.parse(" 2 x 2 x 2 ")) == "2x2x2"


def test_mesh_group_shares_all_other_coords() -> None:
    mesh = Mesh.parse("2x4")
    assert mesh.group(5, 1) == (4, 5, 6, 7)
    assert mesh.group(5, "dp") == (1, 5)
    assert mesh.group(0, 0) == (0, 4)


@pytest.mark.parametrize(
    ("text", "match"),
    [("2y4", "expected a shape"), ("", "expected a shape"), ("0x2", ">= 1")],
)
def test_mesh_parse_errors(text: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Mesh.parse(text)


def test_mesh_errors_name_the_problem() -> None:
    with pytest.raises(PlanError, match="2 axes .* 1 names"):
        Mesh((2, 2), ("dp",))
    with pytest.raises(PlanError, match="rank 8 out of range"):
        Mesh.parse("2x4").coords(8)
    with pytest.raises(PlanError, match="no axis named 'pp'"):
        Mesh.parse("2x4").group(0, "pp")
    assert Mesh.from_json({"shape": [2, 4], "axis_names": ["a", "b"]}) == Mesh((2, 4), ("a", "b"))
    with pytest.raises(PlanError, match=r"mesh\.shape: expected a list of integers"):
        Mesh.from_json({"shape": "2x4"})


def test_placements_print_and_parse() -> None:
    layout = Layout((Shard(0), Replicate(), Partial()))
    assert str(layout) == "S(0)RP"
    assert Layout.parse("S(0)RP") == layout
    assert parse_placements("S(12)") == (Shard(12),)


@pytest.mark.parametrize("text", ["S0", "S(-1)R", "X", "", "S(0)Q", "s(0)"])
def test_bad_placement_string_names_position(text: str) -> None:
    with pytest.raises(PlanError, match="units.a.inputs"):
        Layout.parse(text, "units.a.inputs")


PLACEMENT = st.one_of(st.just(Replicate()), st.just(Partial()), st.builds(Shard, st.integers(0, 2)))


@given(st.lists(PLACEMENT, min_size=1, max_size=4))
def test_layout_string_round_trip(placements) -> None:
    layout = Layout(tuple(placements))
    assert Layout.parse(str(layout)) == layout


def test_local_shape_and_uneven_split_error() -> None:
    mesh = Mesh.parse("2x3")
    assert local_shape((4, 6), Layout.parse("S(0)S(1)"), mesh) == (2, 2)
    assert local_shape((12, 6), Layout.parse("S(0)S(0)"), mesh) == (2, 6)
    with pytest.raises(ShardingError, match=r"dim 0 \(size 4, 2 after the outer mesh axes"):
        local_shape((4, 6), Layout.parse("S(0)S(0)"), mesh)
    with pytest.raises(ShardingError, match=r"W: dim 1 \(size 4; .*\) .* 3 pieces on mesh axis 1"):
        local_shape((4, 4), Layout.parse("RS(1)"), mesh, "W")
    with pytest.raises(ShardingError, match="shards dim 2 but the tensor has rank 2"):
        local_shape((4, 4), Layout.parse("S(2)R"), mesh)
    with pytest.raises(ShardingError, match="1 placements but mesh 2x3 has 2 axes"):
        local_shape((4, 4), Layout.parse("R"), mesh)


def test_same_dim_on_two_axes_puts_axis_zero_outermost() -> None:
    mesh = Mesh.parse("2x2")
    x = np.arange(8)
    layout = Layout.parse("S(0)S(0)")
    for i in range(2):
        for j in range(2):
            piece = slice_for(x, layout, mesh, (i, j))
            np.testing.assert_array_equal(piece, x[2 * (2 * i + j) : 2 * (2 * i + j) + 2])


def test_partial_slice_keeps_value_on_coordinate_zero() -> None:
    mesh = Mesh.parse("2")
    x = np.ones((2, 2))
    np.testing.assert_array_equal(slice_for(x, Layout.parse("P"), mesh, (0,)), x)
    np.testing.assert_array_equal(slice_for(x, Layout.parse("P"), mesh, (1,)), 0 * x)


LAYOUTS_2D = [
    Layout((a, b))
    for a in (Replicate(), Partial(), Shard(0), Shard(1))
    for b in (Replicate(), Partial(), Shard(0), Shard(1))
]


@settings(max_examples=40)
@given(
    layout=st.sampled_from(LAYOUTS_2D),
    mesh_shape=st.sampled_from([(2, 2), (2, 3), (3, 2)]),
    scalar=st.integers(-5, 5),
)
def test_slice_then_assemble_is_identity(layout: Layout, mesh_shape, scalar: int) -> None:
    mesh = Mesh.of(*mesh_shape)
    x = np.arange(12 * 12, dtype=np.int64).reshape(12, 12) * scalar
    pieces = {c: slice_for(x, layout, mesh, c) for c in mesh.all_coords()}
    for piece in pieces.values():
        assert piece.shape == local_shape(x.shape, layout, mesh)
    np.testing.assert_array_equal(assemble(pieces, layout, mesh), x)


def test_assemble_checks_replicas_and_missing_pieces() -> None:
    mesh = Mesh.parse("2")
    with pytest.raises(ShardingError, match="x: replicated on mesh axis 0"):
        assemble({(0,): np.zeros(2), (1,): np.ones(2)}, Layout.parse("R"), mesh, "x")
    with pytest.raises(ShardingError, match=r"no piece for mesh coordinates \(1,\)"):
        assemble({(0,): np.zeros(2)}, Layout.parse("R"), mesh)
    summed = assemble({(0,): np.ones(2), (1,): np.ones(2)}, Layout.parse("P"), mesh)
    np.testing.assert_array_equal(summed, [2.0, 2.0])


def test_shard_refuses_negative_dim() -> None:
    with pytest.raises(ShardingError, match="dim must be an integer >= 0"):
        Shard(-1)


def test_placements_are_one_object_each() -> None:
    """Equal placements are the same object, also through pickling (forked search workers
    send layouts back): tuples of them then compare without calling ``__eq__``."""
    import pickle

    assert Shard(1) is Shard(1) and Shard(1) is not Shard(2)
    assert Replicate() is Replicate() and Partial() is Partial()
    layout = Layout.parse("S(0)RP")
    again = pickle.loads(pickle.dumps(layout))
    assert again == layout
    assert all(a is b for a, b in zip(again.placements, layout.placements, strict=True))
    for bad in (-1, True, 1.0):
        with pytest.raises(ShardingError, match="dim must be an integer"):
            Shard(bad)
