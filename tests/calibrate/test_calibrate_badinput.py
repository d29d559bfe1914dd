"""``tensoropt calibrate`` given odd input: refused in one line (exit 2) before anything is
measured, with no file left behind; and outputs that are links or streams kept as such.

No test here measures: where a refusal could come late, ``profile.calibrate`` is replaced
by a stub that fails the test if it is reached."""

from __future__ import annotations

import copy
import glob
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tensoropt.calibrate import kernels, partial, profile
from tensoropt.calibrate.collectives import total_points
from tensoropt.calibrate.kernels import KernelResult, cases
from tensoropt.calibrate.memlink import LinkProbe
from tensoropt.calibrate.partial import PartialState, partial_path
from tensoropt.calibrate.profile import CalibrateOptions, CommBackend, fingerprint
from tensoropt.calibrate.stats import Sample
from tensoropt.cost.cluster import builtin
from tests.cli.cli_run import assert_bad_input, cli

CORES = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def no_measuring(monkeypatch):
    """A refusal comes before the measuring: reaching it fails the test."""

    def measured(*_args, **_kwargs):
        raise AssertionError("calibrate started measuring")

    monkeypatch.setattr(profile, "calibrate", measured)


def synthetic_profile() -> dict:
    """A calibrated profile's shape (what --against and the summary read), no measuring."""
    data = builtin("v100").to_json()
    data.update(
        calibration={"date": "2026-01-01", "ranks": 2, "threads_per_rank": 1,
                     "backend": "local", "seconds": 1.0, "run_overhead_s": 1e-5},
        machine={"cpu": "test cpu", "cores": 2},
        op_throughput={"matmul": 1e10},
        op_floor_s=1e-6,
        spread={"op_throughput": {"matmul": 0.01}, "collectives": {"AllReduce": 0.01}},
        collectives={"per_kind": {"AllReduce": {
            "alpha_s": 1e-5, "bandwidth": 1e9, "rel_residual": 0.01,
            "points": [[64, 1e-5, 0.01]]}}},
    )  # fmt: skip
    return data


def _refused(capsys, tmp_path, *argv, fragment: str) -> None:
    before = sorted(tmp_path.iterdir())
    out = cli(capsys, "calibrate", *argv)
    assert_bad_input(out, "calibrate", fragment)
    assert sorted(tmp_path.iterdir()) == before  # nothing written, nothing left


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--ranks", 2**40),
        ("--ranks", 99999999999999999999),
        ("--ranks", max(2, CORES) + 1),  # more ranks than cores
        ("--repeats", 2**40),
        ("--repeats", 99999999999999999999),
        ("--threads", CORES + 1),
        ("--threads", 2**40),
        ("--launches", 2**40),
        ("--passes", 99999999999999999999),
    ],
)
def test_absurd_counts_are_refused(capsys, tmp_path, flag, value):
    _refused(capsys, tmp_path, "-o", tmp_path / "c.json", flag, value, fragment=f"{flag} {value}")


def test_launches_with_the_local_backend_are_refused(capsys, tmp_path):
    # the local backend makes no MPI launch: the count would be ignored without a word
    argv = ["-o", tmp_path / "c.json", "--backend", "local", "--launches", "3"]
    _refused(capsys, tmp_path, *argv, fragment="local backend")


def test_output_ending_in_a_separator_is_refused(capsys, tmp_path):
    # it wrote the profile to c.json, then failed on the partial file with exit 2
    _refused(capsys, tmp_path, "-o", f"{tmp_path}/c.json/", fragment="ends in /")


def test_output_in_a_symlink_loop_is_refused(capsys, tmp_path):
    (tmp_path / "loop.json").symlink_to("loop.json")
    _refused(capsys, tmp_path, "-o", tmp_path / "loop.json", fragment="symlink loop")


def test_output_name_too_long_for_the_files_beside_it_is_refused(capsys, tmp_path):
    # 240 bytes fit a name (255), not the temporary ".NAME.partial.XXXXXXXX.tmp"
    _refused(capsys, tmp_path, "-o", tmp_path / ("a" * 235 + ".json"), fragment="too long")


def test_partial_path_that_is_a_directory_is_refused(capsys, tmp_path):
    Path(partial_path(str(tmp_path / "c.json"))).mkdir()
    _refused(capsys, tmp_path, "-o", tmp_path / "c.json", fragment="is a directory")


def test_stdout_output_with_json_is_refused(capsys, tmp_path):
    _refused(capsys, tmp_path, "-o", "/dev/stdout", "--json", fragment="both write")


def test_resume_into_a_stream_is_refused(capsys, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _refused(capsys, tmp_path, "-o", fifo, "--resume", fragment="is a stream")


def test_empty_against_is_refused(capsys, tmp_path):
    _refused(capsys, tmp_path, "-o", tmp_path / "c.json", "--against", "", fragment="--against ''")


def test_against_a_profile_with_a_zero_rate_is_refused(capsys, tmp_path):
    # new / old: a zero link alpha divided by zero after the whole calibration
    old = synthetic_profile()
    old["intra"]["alpha_s"] = 0
    (tmp_path / "old.json").write_text(json.dumps(old))
    argv = ["-o", tmp_path / "c.json", "--backend", "local", "--against", tmp_path / "old.json"]
    _refused(capsys, tmp_path, *argv, fragment="link alpha is 0")


def test_mpi_backend_without_mpiexec_is_refused_before_measuring(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))  # no mpiexec there
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    _refused(capsys, tmp_path, "-o", tmp_path / "c.json", "--quick", fragment="no mpiexec")


# --resume: a partial file written by hand, for a quick local calibration of one pass

OPTS = CalibrateOptions(backend=CommBackend.LOCAL, quick=True, repeats=3)
ARGS = ["--quick", "--repeats", "3", "--backend", "local", "--resume"]


def _partial() -> dict:
    """What a quick local calibration saves after its one pass."""
    step = Sample(3e-4, 0.01, 3)
    rows = [(KernelResult(c, Sample(1e-4, 0.01, 3), 2, step), 1e-5) for c in cases(True)]
    state = PartialState(fingerprint(OPTS), [rows], [], [LinkProbe(1e10, 8e9, 2)], 12.0, [7e-3])
    if not profile.memlink.probe_processes(OPTS.ranks):  # one core: no probe is taken
        state.probes = []
    return state.to_json()


def test_a_partial_file_as_saved_is_read(tmp_path):
    path = tmp_path / "c.json.partial"
    path.write_text(json.dumps(_partial()))
    state = partial.load(str(path), fingerprint(OPTS), cases(True))
    assert len(state.passes) == 1 and state.references == [7e-3]


def _set(keys, value):
    def edit(data):
        *path, last = keys
        for key in path:
            data = data[key]
        data[last] = value

    return edit


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (_set(["passes", 0, 0, "seconds"], [0, 0.01, 3]), "a median must be a number > 0"),
        (_set(["passes", 0, 0, "seconds"], [float("nan"), 0.01, 3]), "a median"),
        (_set(["passes", 0, 0, "step"], [0, 0.01, 3]), "a median must be a number > 0"),
        (_set(["passes", 0, 0, "seconds"], [1e-4, 0.01, True]), "repeats must be an integer"),
        (_set(["passes", 0, 0, "seconds"], [1e-4, 0.01, 3, 9]), "a timing is"),
        (_set(["passes", 0, 0, "copies"], 0), "copies"),
        (_set(["passes", 0, 0, "overhead_s"], -1), "overhead_s"),
        (_set(["seconds"], "12"), "seconds must be a number"),
        (_set(["runs"], ["junk"]), "a launch's points"),
        (_set(["references"], [-1]), "host-speed timing"),
        (_set(["references"], [7e-3] * 9), "9 host-speed timings"),
        (_set(["fingerprint"], [1]), "fingerprint is not an object"),
        (lambda d: d["passes"].append(copy.deepcopy(d["passes"][0])), "holds 2 finished passes"),
    ],
)
def test_a_damaged_partial_file_is_refused(capsys, tmp_path, edit, fragment):
    data = _partial()
    edit(data)
    Path(partial_path(str(tmp_path / "c.json"))).write_text(json.dumps(data))
    _refused(capsys, tmp_path, "-o", tmp_path / "c.json", *ARGS, fragment=fragment)


@pytest.mark.skipif(CORES < 2, reason="one core: no memory-link probe is taken")
def test_a_partial_file_with_a_zero_probe_is_refused(capsys, tmp_path):
    data = _partial()
    data["probes"][0]["alone_Bps"] = 0  # the probe's ratio divided by it
    Path(partial_path(str(tmp_path / "c.json"))).write_text(json.dumps(data))
    _refused(capsys, tmp_path, "-o", tmp_path / "c.json", *ARGS, fragment="alone_Bps")


# outputs that are links or streams, and the progress bar's length


def test_the_profile_replaces_a_symlinks_target_and_keeps_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "here.json"
    link.symlink_to("real/here.json")
    profile.write_profile(str(link), {"a": 1})
    assert link.is_symlink() and json.loads((tmp_path / "real" / "here.json").read_text()) == {
        "a": 1
    }


def test_the_profile_is_written_through_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    profile.write_profile(str(fifo), {"a": 1})
    reader.join(5)
    assert got and json.loads(got[0]) == {"a": 1}
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


_TO_STDOUT = """
import json, sys
from tensoropt.calibrate import profile
from tensoropt.cli import main
data = json.loads(sys.argv[1])
def calibrate(opts, tick, resume=None, save=None):
    if save is not None:
        save(profile.PartialState(profile.fingerprint(opts)))  # after a pass
    return data
profile.calibrate = calibrate
sys.exit(main(["calibrate", "-o", "/dev/stdout", "--quick", "--backend", "local"]))
"""


def test_output_to_stdout_is_the_profile_alone(tmp_path):
    # the summary goes to stderr, and no partial file is made beside /dev/stdout
    data = synthetic_profile()
    proc = subprocess.run(
        [sys.executable, "-c", _TO_STDOUT, json.dumps(data)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == data
    assert "wrote /dev/stdout" in proc.stderr
    assert not glob.glob("/dev/stdout.partial*")


def test_the_progress_bar_counts_every_tick(monkeypatch):
    # it counted one item fewer than measure_kernels ticks: the bar ended at 101%
    from tensoropt.calibrate import passes

    opts = CalibrateOptions(backend=CommBackend.LOCAL, quick=True, repeats=3)
    sample = Sample(1e-4, 0.01, 3)

    def measure_pass(kopts, schedule, pacer, tick, copies):
        for case in schedule:
            tick(case.label())
        return [(KernelResult(c, sample, 2, sample), 1e-5) for c in schedule]

    monkeypatch.setattr(passes, "measure_pass", measure_pass)
    monkeypatch.setattr(kernels, "measure_case", lambda case, kopts: (
        KernelResult(case, sample), sample))  # fmt: skip
    monkeypatch.setattr(kernels, "measure_masked_softmax", lambda kopts: sample)
    ticks: list[str] = []
    profile.measure_kernels(opts, ticks.append)
    collective = total_points(profile._comm_spec(opts), 1)
    assert len(ticks) + collective == profile.work_items(opts)
