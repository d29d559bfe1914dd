"""``compile --recompute``, plan files with ``recompute``, ``inspect``, and resume.

Bad input is exit 2 with one line naming the thing; plan.json records the blocks; the
flag overrides a plan file's blocks; inspect shows per device which forward nodes each
recomputed block reruns; a checkpointed, resumed recomputed run gives the losses of an
uninterrupted one.
"""

from __future__ import annotations

import json

import pytest

from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.runtime.run import run_steps
from tests.cli.cli_run import cli


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("rc_cli") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def _compile(capsys, gpt, out, *extra):
    return cli(capsys, "compile", gpt, "--devices", 2, "-o", out, "--json", *extra)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nothing", "--recompute 'nothing': matches no block of the model (blocks block_0.."),
        ("(", "--recompute '(': not a regular expression"),
    ],
)
def test_a_recompute_that_names_nothing_is_exit_2_one_line(capsys, gpt, tmp_path, spec, message):
    result = _compile(capsys, gpt, tmp_path / "out", "--recompute", spec)
    assert result.code == 2
    assert len(result.err_lines) == 1 and message in result.err, result.err
    assert not (tmp_path / "out").exists()


def test_plan_json_records_the_blocks_and_the_flag_overrides_a_plan_file(capsys, gpt, tmp_path):
    first = _compile(capsys, gpt, tmp_path / "a", "--recompute", ".*/mlp/.*")
    assert first.code == 0, first.err
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["recompute"] == ["block_1", "block_3"]
    again = _compile(capsys, gpt, tmp_path / "b", "--plan", tmp_path / "a" / "plan.json")
    assert again.code == 0, again.err
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["recompute"] == [
        "block_1",
        "block_3",
    ]
    assert json.loads(again.out)["estimate"] == json.loads(first.out)["estimate"]
    plain = _compile(
        capsys, gpt, tmp_path / "c", "--plan", tmp_path / "a" / "plan.json", "--recompute", "none"
    )
    assert plain.code == 0, plain.err
    assert "recompute" not in json.loads((tmp_path / "c" / "plan.json").read_text())
    # the flag says what it chose, on a --plan and on a --pick alike (text and JSON)
    note = "--recompute none: 0 of 5 blocks recomputed"
    assert note in plain.err and note in json.loads(plain.out)["notes"]
    picked = _compile(capsys, gpt, tmp_path / "d", "--pick", "fastest", "--recompute", "all")
    assert picked.code == 0, picked.err
    note = "--recompute all: 5 of 5 blocks recomputed"
    assert note in picked.err and note in json.loads(picked.out)["notes"]
    # recomputing drops saved activations: less memory, more time than the same plan without
    before, after = json.loads(plain.out)["estimate"], json.loads(first.out)["estimate"]
    assert after["memory_bytes"] < before["memory_bytes"]
    assert after["time_s"] > before["time_s"]


def test_a_plan_file_naming_an_unknown_block_is_exit_2_one_line(capsys, gpt, tmp_path):
    assert _compile(capsys, gpt, tmp_path / "a").code == 0
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    plan["recompute"] = ["block_99"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))
    result = _compile(capsys, gpt, tmp_path / "b", "--plan", path)
    assert result.code == 2
    assert len(result.err_lines) == 1, result.err
    assert "plan recompute: no block 'block_99'" in result.err
    assert not (tmp_path / "b").exists()


def test_inspect_shows_the_recomputed_blocks(capsys, gpt, tmp_path):
    assert _compile(capsys, gpt, tmp_path / "o", "--recompute", "block_[14]").code == 0
    shown = cli(capsys, "inspect", tmp_path / "o")
    assert shown.code == 0, shown.err
    lines = [line for line in shown.out.splitlines() if "recompute block_1" in line]
    assert len(lines) == 1  # the same on every device: said once
    assert "h0/mlp/fc_in/MatMul" in lines[0] and "h0/mlp/act/Gelu" in lines[0]
    assert "reruns 4 nodes: " in lines[0]
    # the last block is the final LayerNormalization alone: one node, said so
    last = [line for line in shown.out.splitlines() if "recompute block_4" in line]
    assert len(last) == 1 and "reruns 1 node: ln_f/" in last[0]
    as_json = json.loads(cli(capsys, "inspect", tmp_path / "o", "--json").out)
    for device in as_json["devices"]:
        assert set(device["recompute"]) == {"block_1", "block_4"}
        assert "h0/mlp/act/Gelu" in device["recompute"]["block_1"]


def test_resumed_recomputed_run_equals_uninterrupted(capsys, gpt, tmp_path):
    out = tmp_path / "o"
    result = _compile(capsys, gpt, out, "--plan", "megatron", "--recompute", "all")
    assert result.code == 0, result.err
    full = run_steps(out, 5, threads=1)
    run_steps(out, 3, checkpoint=tmp_path / "ck", threads=1)
    resumed = run_steps(out, 5, checkpoint=tmp_path / "ck", resume=True, threads=1)
    assert resumed.start_step == 3
    assert resumed.losses == full.losses
