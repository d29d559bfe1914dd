"""Validator: every strategy of every registered sharding rule, run per shard in onnxruntime.

1-D meshes of 2 and 3 devices, and 2-D meshes (2x2, 2x3, 3x2) where the per-axis
strategies are composed by ``strategies_nd`` / ``localize_nd``.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from sharding_cases import CASES
from sharding_harness import validate

from tensoropt.rules.sharding import SHARDING_RULES


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("op_type", sorted(CASES))
@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)], ids=["n2", "n3", "2x2"])
def test_every_strategy_matches_full_op(op_type: str, mesh_shape: tuple[int, ...]) -> None:
    cases = CASES[op_type](_rng(op_type))
    checked = [validate(case, mesh_shape, seed=k) for k, case in enumerate(cases)]
    assert all(count >= 1 for count in checked)


@pytest.mark.slow
@pytest.mark.parametrize("op_type", sorted(CASES))
@pytest.mark.parametrize("mesh_shape", [(2, 3), (3, 2), (2, 2, 2)], ids=["2x3", "3x2", "2x2x2"])
def test_every_strategy_on_larger_meshes(op_type: str, mesh_shape: tuple[int, ...]) -> None:
    cases = CASES[op_type](_rng(op_type))
    for k, case in enumerate(cases):
        validate(case, mesh_shape, seed=k)


@pytest.mark.parametrize("op_type", ["MatMul", "Reshape", "Softmax", "LayerNormalization"])
def test_2d_composition_shards_on_both_axes(op_type: str) -> None:
    """On 2x2 the composed list holds strategies that shard on both mesh axes at once."""
    from sharding_harness import op_view, run

    from tensoropt.ir.layout import Shard
    from tensoropt.rules.sharding import strategies_2d

    found = 0
    for case in CASES[op_type](_rng(op_type)):
        view = op_view(case, run(case, case.inputs, case.attrs))
        found += sum(
            all(isinstance(p, Shard) for p in m.outputs[0].placements)
            for m in strategies_2d(view, 2, 2)
        )
    assert found >= 2, f"{op_type}: too few strategies shard output 0 on both mesh axes"


def test_cases_cover_every_registered_rule() -> None:
    assert set(CASES) == set(SHARDING_RULES.op_types)
