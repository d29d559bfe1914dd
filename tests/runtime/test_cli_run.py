"""``tensoropt run`` on the command line: table, JSON, verdict and exit codes."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tensoropt.cli import main
from tests.helpers.handbuilt import mlp_case, write_outdir


def _run(capsys, *args):
    code = main(["run", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_and_verdict(outdirs, capsys):
    code, out, err = _run(capsys, outdirs("dp2_tp2"), "--steps", 3, "--verify")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["step", "loss", "rel.err", "loss", "rel.err", "params"]
    assert [line.split()[0] for line in lines[1:4]] == ["0", "1", "2"]
    assert lines[-1].startswith("verify: ok: max relative error loss")


def test_json_output(outdirs, capsys):
    code, out, _ = _run(capsys, outdirs("a2a2"), "--steps", 2, "--verify", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "tensoropt.run/1"
    assert len(data["losses"]) == 2
    assert set(data["verify"]) == {
        "max_rel_error_loss", "max_rel_error_params", "per_step", "ok", "tolerance",
        "within_rounding_sensitivity",
    }  # fmt: skip
    assert data["verify"]["ok"] is True and data["verify"]["tolerance"] == 1e-4
    assert data["verify"]["within_rounding_sensitivity"] == {}  # every tensor within 1e-4
    assert len(data["verify"]["per_step"]) == 2
    assert all(s["allowed_params"] == {} for s in data["verify"]["per_step"])


def test_tampered_file_exits_2_with_one_line(tmp_path, capsys):
    outdir = write_outdir(mlp_case(dp=2, tp=1), tmp_path / "out")
    with (outdir / "device_0.onnx").open("ab") as f:
        f.write(b"\0")
    code, out, err = _run(capsys, outdir, "--steps", 1)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "device_0.onnx" in err and "recompile" in err


def test_bad_data_exits_2_naming_array_and_shapes(outdirs, tmp_path, capsys):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((8, 6), np.float32), labels=np.zeros((8, 5), np.float32))
    code, _, err = _run(capsys, outdirs("dp2"), "--data", path)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "'labels' has shape [8, 5], expected [8, 6]" in err


def test_bad_steps_exit_2(outdirs, capsys):
    code, _, err = _run(capsys, outdirs("dp2"), "--steps", 0)
    assert code == 2 and "--steps must be at least 1" in err


def test_failed_verification_exits_3(tmp_path, capsys):
    case = mlp_case(dp=2, tp=1)
    wrong = dataclasses.replace(case, annotated=mlp_case(dp=1, tp=1, lr=0.2).annotated)
    code, out, err = _run(capsys, write_outdir(wrong, tmp_path / "o"), "--steps", 2, "--verify")
    assert code == 3  # its own code: 1 is an internal error
    assert "verify: FAILED" in out
    assert "differs from the unpartitioned step" in err


@pytest.mark.mpi
def test_mpi_backend_from_the_cli(outdirs, capsys):
    code, out, _ = _run(capsys, outdirs("dp2"), "--steps", 2, "--backend", "mpi", "--json")
    assert code == 0
    local = json.loads(_run(capsys, outdirs("dp2"), "--steps", 2, "--json")[1])
    assert json.loads(out)["losses"] == local["losses"]


@pytest.mark.parametrize("arena", ["per-session", "none"])
def test_arena_choice_keeps_the_numbers(outdirs, capsys, arena):
    code, out, err = _run(capsys, outdirs("dp2_tp2"), "--steps", 2, "--json")
    assert code == 0, err
    default = json.loads(out)["losses"]
    code, out, err = _run(capsys, outdirs("dp2_tp2"), "--steps", 2, "--json", "--arena", arena)
    assert code == 0, err
    assert json.loads(out)["losses"] == default


def test_arena_choices_are_the_runtimes_modes():
    """cmd_run lists the modes by hand (importing the runtime would slow --help)."""
    from tensoropt.cli import build_parser
    from tensoropt.runtime.arena import ArenaMode

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    (arena,) = [a for a in run._actions if a.dest == "arena"]
    assert arena.choices == [m.value for m in ArenaMode]
    assert arena.default == ArenaMode.SHARED.value


def test_run_help_names_the_ranks_malloc_settings():
    """cmd_run writes them by hand (importing the runtime would slow --help)."""
    from tensoropt.cli.cmd_run import EPILOG
    from tensoropt.runtime.malloc import HUGETLB, HUGETLB_TUNABLE, MALLOC_ENV, TUNABLES

    text = " ".join(EPILOG.split())
    assert f"{TUNABLES}={HUGETLB_TUNABLE}" in text and f"{TUNABLES}={HUGETLB}=0" in text
    assert all(name in text for name in MALLOC_ENV)


def test_unknown_arena_exits_2(outdirs, capsys):
    code, out, err = _run(capsys, outdirs("dp2_tp2"), "--arena", "huge")
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and "--arena" in err
