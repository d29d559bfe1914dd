"""Built-in plans refuse a mesh on which they cannot split what they promise (exit 2),
instead of writing replicas that each compute the whole step."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from tests.cli import models
from tests.cli.cli_run import assert_bad_input, cli


@pytest.fixture
def block(tmp_path) -> Path:
    path = tmp_path / "block.onnx"
    onnx.save(models.mlp_block(), str(path))  # x [8, 8], W1 [8, 16], W2 [16, 8]
    return path


def test_data_parallel_over_a_count_that_does_not_divide_the_batch(block, tmp_path, capsys):
    out = tmp_path / "out"
    outcome = cli(capsys, "compile", block, "--devices", 7, "--plan", "data-parallel", "-o", out)
    line = assert_bad_input(outcome, "compile", "data-parallel over 7 devices")
    assert line.endswith(
        "input 'x' dim 0 has size 8, which 7 does not divide; use a device count that divides 8"
    )
    assert not out.exists()


def test_data_parallel_on_a_two_axis_mesh_counts_every_axis(block, tmp_path, capsys):
    outcome = cli(
        capsys, "compile", block, "--devices", 6, "--mesh", "2x3", "--plan", "data-parallel",
        "-o", tmp_path / "out",
    )  # fmt: skip
    assert_bad_input(outcome, "compile", "over 6 devices", "'x' dim 0 has size 8", "6 does not")


def test_megatron_whose_tp_axis_cannot_split_a_block_weight(block, tmp_path, capsys):
    outcome = cli(
        capsys, "compile", block, "--devices", 3, "--plan", "megatron", "-o", tmp_path / "out"
    )
    assert_bad_input(
        outcome,
        "compile",
        "megatron over 3 devices on mesh axis 0 (tp)",
        "weight 'W1' of MatMul 'mm1' (column-parallel) dim 1 has size 16",
        "3 does not divide; use a tp size that divides 16",
    )


def test_megatron_whose_dp_axis_cannot_split_the_batch(tmp_path, capsys):
    path = tmp_path / "block6.onnx"
    onnx.save(models.mlp_block(batch=6), str(path))
    outcome = cli(
        capsys, "compile", path, "--devices", 8, "--mesh", "4x2", "--plan", "megatron",
        "-o", tmp_path / "out",
    )  # fmt: skip
    assert_bad_input(
        outcome,
        "compile",
        "megatron over mesh axes dp=4 (4 devices)",
        "input 'x' dim 0 has size 6, which 4 does not divide",
    )


def test_plans_that_divide_still_compile(block, tmp_path, capsys):
    split = {"data-parallel": ("x", ["S(0)"]), "megatron": ("W1", ["S(1)"])}
    for plan, devices in (("data-parallel", 4), ("megatron", 2)):
        out = tmp_path / plan
        outcome = cli(capsys, "compile", block, "--devices", devices, "--plan", plan, "-o", out)
        assert outcome.code == 0, outcome
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["world_size"] == devices
        name, placements = split[plan]
        assert manifest["inputs"][name]["placements"] == placements
