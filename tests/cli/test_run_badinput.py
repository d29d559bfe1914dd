"""Bad input to ``run``, ``train`` and ``inspect``: one line, exit 2, nothing written or
deleted; and checkpoints that stay a step every rank completed when ranks run apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from tensoropt.cli import main
from tensoropt.runtime.checkpoint import latest_common_step
from tests.cli.cli_run import assert_bad_input, cli


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def outs(zoo_file, tmp_path_factory) -> dict[str, Path]:
    """gpt tiny compiled for 2 devices: ``whole`` (both hold the whole model, no
    collectives) and ``dp`` (data parallel), plus ``ck``: 4 steps of ``whole`` saved."""
    root = tmp_path_factory.mktemp("runbad")
    gpt = zoo_file("gpt")
    whole, dp, ck = root / "whole", root / "dp", root / "ck"
    assert main(["compile", str(gpt), "--devices", "2", "--pick", "fastest", "-o", str(whole)]) == 0
    assert main(["compile", str(gpt), "--devices", "2", "-o", str(dp)]) == 0
    assert main(["run", str(whole), "--steps", "4", "--checkpoint", str(ck)]) == 0
    return {"gpt": gpt, "whole": whole, "dp": dp, "ck": ck}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------- checkpoints


@pytest.mark.mpi
def test_mpi_checkpoints_are_steps_every_rank_completed(outs, tmp_path, capsys, monkeypatch):
    # Rank 1 dies before step 5 (after saving step 5); with no collectives rank 0 would
    # run on and drop its older shards. A checkpoint is a coordinated point, so rank 0
    # waits there, and the directory still holds a step both ranks saved. (A death, not
    # a hang: a stall timeout short enough for a test also fires on a loaded machine.)
    ck = tmp_path / "ck"
    monkeypatch.setenv("TENSOROPT_FAULT_INJECT", "1:5")
    args = ["--backend", "mpi", "--checkpoint", ck]
    outcome = cli(capsys, "run", outs["whole"], "--steps", 40, *args)
    assert outcome.code == 1, outcome
    assert latest_common_step(ck, 2) == 5, sorted(p.name for p in ck.iterdir())
    monkeypatch.delenv("TENSOROPT_FAULT_INJECT")
    full = cli(capsys, "run", outs["whole"], "--steps", 7, "--json")
    resumed = cli(
        capsys, "run", outs["whole"], "--steps", 7, "--json", "--checkpoint", ck, "--resume"
    )
    assert resumed.code == 0, resumed
    assert json.loads(resumed.out)["start_step"] == 5
    assert json.loads(resumed.out)["losses"] == json.loads(full.out)["losses"]


def test_resume_from_a_missing_or_empty_directory_starts_at_step_0(outs, tmp_path, capsys, caplog):
    """Nothing there to lose: a job that always passes --resume (requeued or not) starts
    at step 0 and says so."""
    for name in ("missing", "empty"):
        ck = tmp_path / name
        if name == "empty":
            ck.mkdir()
        outcome = cli(capsys, "run", outs["whole"], "--steps", 1, "--resume", "--checkpoint", ck)
        assert outcome.code == 0, outcome.err
        assert f"{ck}: no checkpoint yet; starting from step 0" in caplog.text
        assert sorted(p.name for p in ck.iterdir()) == [
            "rank_0.step_1.tensors",
            "rank_1.step_1.tensors",
        ]


def test_resume_without_a_complete_checkpoint_deletes_nothing(outs, tmp_path, capsys):
    ck = _copy(outs["ck"], tmp_path / "ck")
    for shard in ck.glob("rank_1.*"):
        shard.unlink()  # only rank 0's shards: no step every rank saved
    before = _tree(ck)
    outcome = cli(capsys, "run", outs["whole"], "--steps", 9, "--resume", "--checkpoint", ck)
    assert_bad_input(outcome, "run", str(ck), "rank 0: steps 3, 4", "nothing to resume from")
    assert outcome.out == ""
    assert _tree(ck) == before


@pytest.mark.parametrize("resume", [False, True])
def test_checkpoints_of_another_output_are_refused(outs, tmp_path, capsys, resume):
    ck = _copy(outs["ck"], tmp_path / "ck")
    before = _tree(ck)
    flags = ["--resume"] if resume else []
    outcome = cli(capsys, "run", outs["dp"], "--steps", 6, "--checkpoint", ck, *flags)
    assert_bad_input(outcome, "run", str(ck), "another compiled output")
    assert _tree(ck) == before


def test_own_checkpoints_without_resume_are_refused(outs, tmp_path, capsys):
    ck = _copy(outs["ck"], tmp_path / "ck")
    before = _tree(ck)
    outcome = cli(capsys, "run", outs["whole"], "--steps", 1, "--checkpoint", ck)
    assert_bad_input(outcome, "run", str(ck), "up to step 4", "add --resume")
    assert _tree(ck) == before


def test_checkpoint_every_without_checkpoint_is_refused(outs, capsys):
    outcome = cli(capsys, "run", outs["whole"], "--steps", 2, "--checkpoint-every", 5)
    assert_bad_input(outcome, "run", "--checkpoint-every 5", "--checkpoint DIR")
    assert outcome.out == ""


# ----------------------------------------------------------------- manifests


def _edited(outs, tmp_path, edit) -> Path:
    out = _copy(outs["whole"], tmp_path / "edited")
    path = out / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    return out


def _no_step(raw):
    del raw["step"]


def _no_params(raw):
    del raw["step"]["params"]


def _no_inputs(raw):
    raw["inputs"] = {}


def _mesh_of_4(raw):
    raw["mesh"]["shape"] = [4]


MANIFESTS = {
    "no step": (_no_step, "no 'step' key"),
    "no params": (_no_params, "no 'params' key in \"step\""),
    "no inputs": (_no_inputs, "\"inputs\" does not describe 'wte.weight'"),
    "mesh of 4": (_mesh_of_4, "mesh shape [4] holds 4 devices, but the manifest lists 2"),
}


@pytest.mark.parametrize("command", ["run", "inspect"])
@pytest.mark.parametrize("case", MANIFESTS.values(), ids=MANIFESTS.keys())
def test_manifest_lacking_what_the_runtime_reads_is_refused(outs, tmp_path, capsys, case, command):
    edit, fragment = case
    out = _edited(outs, tmp_path, edit)
    before = _tree(tmp_path)
    outcome = cli(capsys, command, out, *(["--steps", 1] if command == "run" else []))
    assert_bad_input(outcome, command, "manifest.json", fragment, "recompile")
    assert _tree(tmp_path) == before


# ----------------------------------------------------------------- data


def _npz(path: Path, ids, labels) -> Path:
    np.savez(path, input_ids=np.full((8, 8), ids, np.int64), labels=np.full((8, 8), labels))
    return path


DATA = {
    "ids too large": (10**6, 3, "'input_ids'", "[1000000, 1000000], outside [0, 64)"),
    "negative ids": (-1, 3, "'input_ids'", "[-1, -1], outside [0, 64)"),
    "negative labels": (1, -5, "'labels'", "[-5, -5], outside [0, 64) (class labels"),
}


@pytest.mark.parametrize("case", DATA.values(), ids=DATA.keys())
@pytest.mark.parametrize("command", ["train", "run", "run-mpi"])
def test_ids_and_labels_out_of_range_are_refused(outs, tmp_path, capsys, case, command):
    ids, labels, name, fragment = case
    data = _npz(tmp_path / "d.npz", ids, labels)
    if command == "train":
        argv = ["train", outs["gpt"], "--save-params", tmp_path / "p.npz"]
    else:
        argv = ["run", outs["whole"], "--save-params", tmp_path / "p.npz"]
        argv += ["--backend", "mpi"] if command == "run-mpi" else []
    before = _tree(tmp_path)
    outcome = cli(capsys, *argv, "--steps", 1, "--data", data)
    assert_bad_input(outcome, argv[0], str(data), name, fragment)
    assert _tree(tmp_path) == before


def test_ids_and_labels_in_range_are_accepted(outs, tmp_path, capsys):
    data = _npz(tmp_path / "d.npz", 63, 0)
    assert cli(capsys, "train", outs["gpt"], "--steps", 1, "--data", data).code == 0
    assert cli(capsys, "run", outs["whole"], "--steps", 1, "--data", data).code == 0


@pytest.fixture(scope="module")
def own_loss(tmp_path_factory) -> Path:
    """A model returning its own cross entropy with ignore_index -100 over 5 classes."""
    w = onnx.numpy_helper.from_array(np.ones((4, 5), np.float32), "w")
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["y"]),
        h.make_node("SoftmaxCrossEntropyLoss", ["y", "t"], ["out"], ignore_index=-100),
    ]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [6, 4])]
    inputs.append(h.make_tensor_value_info("t", T.INT64, [6]))
    outputs = [h.make_tensor_value_info("out", T.FLOAT, [])]
    graph = h.make_graph(nodes, "own_loss", inputs, outputs, [w])
    path = tmp_path_factory.mktemp("own_loss") / "sce.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)]), path)
    return path


def test_ignore_index_is_allowed_and_other_labels_are_not(own_loss, tmp_path, capsys):
    x = np.zeros((6, 4), np.float32)
    ok = tmp_path / "ok.npz"
    np.savez(ok, x=x, t=np.array([0, 1, -100, 4, 3, -100]))
    outcome = cli(capsys, "train", own_loss, "--steps", 1, "--data", ok)
    assert outcome.code == 0, outcome
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=x, t=np.array([0, 1, -100, 5, 3, -7]))
    outcome = cli(capsys, "train", own_loss, "--steps", 1, "--data", bad)
    assert_bad_input(outcome, "train", str(bad), "'t'", "[-7, 5], outside [0, 5) or -100")


def test_data_directory_is_named_a_directory(outs, tmp_path, capsys):
    data = tmp_path / "adir.onnx"
    data.mkdir()
    outcome = cli(capsys, "run", outs["whole"], "--steps", 1, "--data", data)
    assert_bad_input(outcome, "run", str(data), "is a directory")


# ----------------------------------------------------------------- options


@pytest.mark.parametrize("tolerance", ["nan", "inf", "-1"])
def test_non_finite_or_negative_tolerance_is_refused(outs, capsys, tolerance):
    outcome = cli(capsys, "run", outs["whole"], "--steps", 1, "--verify", "--tolerance", tolerance)
    assert_bad_input(outcome, "run", "--tolerance", "positive finite")
    assert outcome.out == ""


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_unreadable_hostfile_is_refused_before_launching(outs, tmp_path, capsys, kind):
    hostfile = tmp_path / "hosts"
    if kind == "directory":
        hostfile.mkdir()
    outcome = cli(
        capsys, "run", outs["whole"], "--steps", 1, "--backend", "mpi", "--hostfile", hostfile
    )
    assert_bad_input(outcome, "run", f"--hostfile {hostfile}")
    assert outcome.out == ""


@pytest.mark.parametrize("command", ["train", "compile", "search"])
@pytest.mark.parametrize("flag", ["--trainable", "--freeze"])
def test_a_pattern_matching_no_initializer_is_refused(outs, tmp_path, capsys, flag, command):
    """A typo in --trainable/--freeze would leave the default policy in force, silently."""
    before = _tree(tmp_path)
    argv = {
        "train": ["--steps", 1, "--save-params", tmp_path / "p"],
        "compile": ["--devices", 2, "-o", tmp_path / "o"],
        "search": ["--devices", 2, "--json-out", tmp_path / "s.json"],
    }[command]
    outcome = cli(capsys, command, outs["gpt"], *argv, flag, "zzz")
    assert_bad_input(outcome, command, f"{flag} 'zzz' matches no initializer")
    assert _tree(tmp_path) == before
