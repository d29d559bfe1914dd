"""The shared synthetic data generator and --data files."""

from __future__ import annotations

import numpy as np
import pytest

from tensoropt.errors import DataError
from tensoropt.runtime.data import InputSpec, load_npz, make_batch, specs_from_model
from tests.helpers.handbuilt import mlp_case

SPECS = [
    InputSpec("ids", (4, 5), "int64", high=7),
    InputSpec("x", (4, 3), "float32"),
    InputSpec("labels", (4,), "int64"),
    InputSpec("mask", (4, 5), "bool"),
]


def test_make_batch_types_ranges_and_shapes():
    batch = make_batch(SPECS, 0, 0)
    assert batch["ids"].dtype == np.int64 and batch["ids"].shape == (4, 5)
    assert batch["ids"].min() >= 0 and batch["ids"].max() < 7
    assert set(np.unique(batch["labels"])) <= {0, 1}  # default high = 2
    assert batch["x"].dtype == np.float32
    assert batch["mask"].dtype == np.bool_


def test_make_batch_is_keyed_by_seed_step_and_name_not_order():
    a = make_batch(SPECS, 3, 11)
    b = make_batch(list(reversed(SPECS)), 3, 11)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["x"], make_batch(SPECS, 4, 11)["x"])
    assert not np.array_equal(a["x"], make_batch(SPECS, 3, 12)["x"])


def test_make_batch_definition_is_stable():
    # The documented rule, spelled out: one default_rng([seed, step, crc32(name)]) per input.
    import zlib

    rng = np.random.default_rng([11, 3, zlib.crc32(b"x")])
    want = rng.standard_normal(size=(4, 3), dtype=np.float32)
    np.testing.assert_array_equal(make_batch(SPECS, 3, 11)["x"], want)


def test_specs_from_model_match_the_manifest_view():
    case = mlp_case(dp=1, tp=1)
    specs = specs_from_model(case.annotated, case.step)
    assert specs == [InputSpec("x", (8, 6), "float32"), InputSpec("labels", (8, 6), "float32")]


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((4, 3), np.float32)}, r"no array 'ids'"),
        (
            {"ids": np.zeros((4, 6), np.int64), "x": np.zeros((4, 3))},
            r"array 'ids' has shape \[4, 6\], expected \[4, 5\] or \[steps, 4, 5\]",
        ),
        ({"ids": np.zeros((4, 5), np.float32)}, r"array 'ids' has dtype float32, expected int64"),
        ({"ids": np.zeros((2, 4, 5), np.int64)}, r"holds 2 steps, expected at least 3"),
    ],
)
def test_bad_data_files_name_the_array(tmp_path, arrays, message):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=message):
        load_npz(path, SPECS[:2], steps=3)


def test_missing_data_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_npz(tmp_path / "nope.npz", SPECS, 1)
