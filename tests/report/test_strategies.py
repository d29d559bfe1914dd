"""Kinds, groups and sentences of the strategy section, on hand-made tracks."""

from __future__ import annotations

import pytest

from tensoropt.report.analysis import Point
from tensoropt.report.render import change_sentences
from tensoropt.report.strategies import (
    Track,
    UnitRow,
    group_changes,
    layer_ranges,
    normal_kind,
    role_of,
)


@pytest.mark.parametrize(
    ("kind", "devices", "expected"),
    [
        ("dp=8", 8, "dp=8"),
        ("dp=2 x dp=4", 8, "dp=8"),
        ("dp=2 x tp=4", 8, "tp=4 x dp=2"),
        ("tp=8", 16, "tp=8, 2x redundant"),
        ("dp=2", 8, "dp=2, 4x redundant"),
        ("replicated", 8, "replicated"),
    ],
)
def test_normal_kind(kind, devices, expected):
    assert normal_kind(kind, devices) == expected


def test_role_and_layer_ranges():
    assert role_of("h12/mlp/fc_in/MatMul", "MatMul") == "h#/mlp/fc_in"
    assert role_of("h12/mlp/fc_in/Add", "Add") == "h#/mlp/fc_in"
    assert role_of("lm_head/MatMul", "MatMul") == "lm_head"
    names = [f"h{i}/mlp/fc_in/MatMul" for i in (0, 1, 2, 5, 7, 8)]
    assert layer_ranges(names) == "h0..h2, h5, h7..h8"
    assert layer_ranges(["lm_head/MatMul"]) == "lm_head"
    assert layer_ranges(["layer4/0/a/conv/Conv", "fc/Gemm", "layer4/1/a/conv/Conv"]) == (
        "layer4, fc"
    )


def _track(kinds_by_unit: dict[str, list[str]]) -> Track:
    n = len(next(iter(kinds_by_unit.values())))
    points = tuple(
        Point(8, (8,), i, time_s=1e-3 * (1 + i), memory_bytes=2**30 * (n - i), summary="")
        for i in range(n)
    )
    units = tuple(
        UnitRow(name, name.rsplit("/", 1)[1], role_of(name, name.rsplit("/", 1)[1]))
        for name in kinds_by_unit
    )
    return Track(8, points, units, tuple(tuple(k) for k in kinds_by_unit.values()))


def test_groups_are_ordered_by_where_they_settle():
    tr = _track(
        {
            "h0/attn/q_proj/MatMul": ["dp=8", "dp=8", "tp=8", "tp=8"],
            "h1/attn/q_proj/MatMul": ["dp=8", "dp=8", "dp=8", "tp=8"],
            "h0/mlp/fc_in/MatMul": ["dp=8", "tp=8", "tp=8", "tp=8"],
            "h0/mlp/fc_in/Add": ["dp=8", "tp=8", "tp=8", "tp=8"],
            "h1/mlp/fc_in/MatMul": ["dp=8", "tp=8", "dp=8", "tp=8"],
            "h0/ln/LayerNormalization": ["dp=8", "dp=8", "tp=8", "dp=8"],
            "lm_head/MatMul": ["tp=8", "tp=8", "tp=8", "tp=8"],
        }
    )
    groups = group_changes(tr)
    assert [g.role for g in groups] == ["h#/mlp/fc_in", "h#/attn/q_proj", "h#/ln", "lm_head"]
    mlp, attn, ln, head = groups
    assert mlp.ops == "MatMul+Add" and len(mlp.changed) == 3
    assert (mlp.fast_state, mlp.lean_state) == ("dp=8", "tp=8")
    assert (mlp.first_point, mlp.settle_point) == (1, 1)  # median of settles 1, 1, 3
    assert (attn.first_point, attn.settle_point) == (2, 3)  # median of settles 2, 3
    assert ln.changed == () and ln.detours == 1 and ln.first_point == 2
    assert head.first_point == -1 and head.changed == ()

    text = "\n".join(change_sentences(tr, groups))
    assert (
        "in this order: `h#/mlp/fc_in` (dp=8 → tp=8), then `h#/attn/q_proj` (dp=8 → tp=8)." in text
    )
    assert (
        "`h#/mlp/fc_in` (MatMul+Add; all 3 units change): dp=8 → tp=8; first moves at point 1"
        in text
    )
    assert "`h#/ln` (LayerNormalization, 1 unit): dp=8 at both ends; 1 units take other" in text
    assert "unchanged along the whole frontier: `lm_head` (MatMul: tp=8)" in text


def test_partial_groups_name_their_layers_and_mixed_states_count_kinds():
    tr = _track(
        {
            "h0/mlp/fc_out/MatMul": ["dp=8", "dp=8"],
            "h1/mlp/fc_out/MatMul": ["dp=8", "dp=8"],
            "h2/mlp/fc_out/MatMul": ["dp=8", "tp=8"],
            "h3/mlp/fc_out/MatMul": ["dp=8", "tp=8"],
            "h4/mlp/fc_out/MatMul": ["dp=8", "tp=8"],
        }
    )
    (group,) = group_changes(tr)
    assert group.changed == tuple(f"h{i}/mlp/fc_out/MatMul" for i in (2, 3, 4))
    assert group.lean_state == "tp=8 (3), dp=8 (2)"
    assert "3 of 5 units change: h2..h4" in "\n".join(change_sentences(tr, [group]))


def test_a_frontier_without_changes_says_so():
    tr = _track({"fc0/MatMul": ["tp=8", "tp=8"], "fc1/MatMul": ["tp=8", "tp=8"]})
    text = "\n".join(change_sentences(tr, group_changes(tr)))
    assert "No weight unit changes strategy along this frontier (tp=8)" in text
