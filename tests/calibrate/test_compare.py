"""``calibrate --against OLD.json``: what moved since the last calibration of this machine."""

from __future__ import annotations

import copy
import json

import pytest

from tensoropt.calibrate.compare import MOVED, compare, load_baseline, moved_report, profile_rates
from tensoropt.cli import main
from tensoropt.cost.cluster import builtin
from tensoropt.errors import TensorOptError
from tests.helpers.modes import umask, unreadable

from .conftest import load

pytestmark = pytest.mark.mpi


@pytest.mark.slow
def test_every_rate_kind_is_compared(quick_profile):
    data = load(quick_profile)
    rates = profile_rates(data)
    assert {f"compute {fam}" for fam in data["op_throughput"]} <= set(rates)
    assert {f"{kind} alpha" for kind in data["collectives"]["per_kind"]} <= set(rates)
    assert {"link alpha", "link bandwidth", "memory bandwidth"} <= set(rates)
    assert any(" grid " in name for name in rates)  # the training-step grids
    assert all(r.change == 0 for r in compare(data, data))


@pytest.mark.slow
def test_the_report_lists_what_moved_beyond_the_bound(quick_profile):
    old = load(quick_profile)
    new = copy.deepcopy(old)
    new["op_throughput"]["Relu"] *= 1.5  # moved
    new["intra"]["alpha_s"] *= 1 + MOVED / 2  # within the bound
    lines = moved_report(old, new, "old.json").splitlines()
    total = len(profile_rates(old))
    assert lines[0].startswith("against old.json (calibrated ")
    assert lines[0].endswith(f"1 of {total} rates moved more than {MOVED:.0%}")
    assert lines[1].split()[:2] == ["compute", "Relu"] and lines[1].endswith("+50.0%")
    assert len(lines) == 2
    assert moved_report(old, old, "old.json").endswith(f"all {total} rates within 20%")
    other = copy.deepcopy(old)
    other["machine"]["cores"] = old["machine"]["cores"] + 6
    assert "a different machine" in moved_report(other, old, "old.json")


def _write(tmp_path, obj) -> str:
    path = tmp_path / "old.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda tmp, data: str(tmp / "nowhere.json"), "no such file"),
        (lambda tmp, data: _write(tmp, "{not json"), "not a JSON profile"),
        (lambda tmp, data: _write(tmp, builtin("v100").to_json()), "not a calibrated"),
        (
            lambda tmp, data: _write(tmp, {**data, "intra": {**data["intra"], "bandwidth": -1}}),
            "intra.bandwidth",
        ),
    ],
)
def test_a_bad_baseline_is_one_line_before_anything_is_measured(
    quick_profile, tmp_path, capsys, make, fragment
):
    path = make(tmp_path, load(quick_profile))
    with pytest.raises(TensorOptError, match=fragment):
        load_baseline(path)
    out = tmp_path / "new.json"
    code = main(["calibrate", "-o", str(out), "--quick", "--against", path])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--against {path}" in err[0] and fragment in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_calibrate_against_the_last_profile_prints_what_moved(
    quick_profile, tmp_path, capsys, monkeypatch
):
    """The new profile is the last one with one rate doubled (the measuring itself is the
    quick profile's, and test_resume.py's on the local backend). Also: under umask 022
    the profile is readable by others (tests/cli/test_umask.py checks the other
    commands)."""
    from tensoropt.calibrate import profile

    moved = load(quick_profile)
    moved["op_throughput"]["matmul"] *= 2
    monkeypatch.setattr(profile, "calibrate", lambda opts, tick, **_: moved)
    root = tmp_path / "outputs"
    root.mkdir()
    out = root / "new.json"
    argv = ["calibrate", "-o", str(out), "--quick", "--repeats", "3", "--backend", "local"]
    with umask(0o022):
        code = main([*argv, "--against", str(quick_profile)])
    stdout = capsys.readouterr().out
    assert code == 0 and load(out) == moved
    assert unreadable(root) == []
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith(f"against {quick_profile}")]
    assert "rates moved more than 20%" in line and "compute matmul" in stdout


@pytest.mark.slow
def test_with_json_stdout_is_the_profile_alone(quick_profile, tmp_path, capsys, monkeypatch):
    from tensoropt.calibrate import profile

    moved = load(quick_profile)
    moved["op_throughput"]["matmul"] *= 2
    monkeypatch.setattr(profile, "calibrate", lambda opts, tick, **_: moved)  # no measuring
    out = tmp_path / "new.json"
    argv = ["calibrate", "-o", str(out), "--quick", "--json", "--against", str(quick_profile)]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0 and json.loads(captured.out) == moved
    assert f"against {quick_profile}" in captured.err and "compute matmul" in captured.err


def test_the_against_help_states_the_bound():
    """cmd_calibrate writes it by hand (importing calibrate would slow --help)."""
    from tensoropt.cli import build_parser

    calibrate = build_parser()._subparsers._group_actions[0].choices["calibrate"]
    (against,) = [a for a in calibrate._actions if a.dest == "against"]
    assert f"more than {MOVED:.0%}%" in against.help  # argparse's %% is one % when shown
