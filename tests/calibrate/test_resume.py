"""``calibrate --resume``: a real calibration interrupted by a signal continues from its
last finished pass; a resume that cannot be right is refused in one line."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensoropt.calibrate.kernels import cases
from tensoropt.calibrate.partial import partial_path
from tensoropt.cli import main

# a short calibration of two passes: the local backend (no MPI launches), quick cases
ARGS = ["--quick", "--passes", "2", "--repeats", "3", "--backend", "local"]


def _calibrate(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tensoropt", "calibrate", "-o", str(out), *ARGS, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # xdist workers may ignore SIGINT; the child gets the default dispositions
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        start_new_session=True,
    )  # fmt: skip


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def _progress(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("calibrate: ")]


@pytest.mark.slow
def test_interrupted_calibration_resumes_from_its_finished_pass(tmp_path):
    out = tmp_path / "here.json"
    partial = Path(partial_path(str(out)))
    proc = _calibrate(out)
    try:
        _wait_for(partial, proc, timeout_s=600)  # generous: CI machines may be loaded
        proc.send_signal(signal.SIGTERM)  # inside the second pass
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert lines[-1] == "tensoropt calibrate: terminated"
    assert f"kept in {partial}; run the same command with --resume" in lines[-2]
    assert not out.exists() and partial.exists()
    kept = json.loads(partial.read_text())
    assert len(kept["passes"]) == 1 and kept["fingerprint"]["passes"] == 2
    saved = {row["case"]: row["seconds"][0] for row in kept["passes"][0]}
    assert list(saved) == [c.label() for c in cases(True)]
    spare = tmp_path / "spare.partial"  # for the refusals below
    shutil.copy(partial, spare)

    resumed = _calibrate(out, "--resume")
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    assert f"wrote {out}" in stdout
    # the resumed run counted the finished pass as done from its first record on
    first = _progress(stderr)[0]
    assert first.startswith(f"calibrate: {len(saved)}/"), first
    assert out.exists() and not partial.exists()  # the partial file goes with completion
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here.json", "spare.partial"]
    data = json.loads(out.read_text())
    cal = data["calibration"]
    assert cal["resumed"] is True and cal["compute_passes"] == 2
    assert set(cal["passes_apart"]) == {"median", "max", "max_case"}
    # the host-speed reference: timed before each pass and after the last, the kept
    # timings first
    assert len(cal["host_references_s"]) == 3 and kept["references"]
    assert cal["host_references_s"][: len(kept["references"])] == pytest.approx(
        kept["references"], abs=1e-6
    )
    # every pass times the forward kernels and each case keeps the faster of its two:
    # the kept pass's timings are one of the two, so no case ends slower than them
    final = {}
    for curve in data["op_curves"].values():
        for label, (work, rate, _) in zip(curve["cases"], curve["points"], strict=True):
            final[label] = work / rate
    assert set(final) == set(saved)
    assert all(final[c] <= saved[c] * (1 + 1e-12) for c in saved)

    # refusals, one line each, exit 2, nothing written
    other = tmp_path / "other.json"
    shutil.copy(spare, partial_path(str(other)))
    refused = _run_main(["calibrate", "-o", str(other), *ARGS[:2], "3", *ARGS[3:], "--resume"])
    assert refused[0] == 2 and "passes differ" in refused[1], refused
    moved = json.loads(spare.read_text())
    moved["fingerprint"]["host"] = "elsewhere"
    Path(partial_path(str(other))).write_text(json.dumps(moved))
    refused = _run_main(["calibrate", "-o", str(other), *ARGS, "--resume"])
    assert refused[0] == 2 and "host differ" in refused[1], refused
    # a file whose later passes timed the steps alone (no forward kernels) is not mixed in
    older = json.loads(spare.read_text())
    del older["fingerprint"]["passes_time"]
    Path(partial_path(str(other))).write_text(json.dumps(older))
    refused = _run_main(["calibrate", "-o", str(other), *ARGS, "--resume"])
    assert refused[0] == 2 and "passes_time differ" in refused[1], refused
    assert not other.exists()


def _run_main(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    return code, lines[0]


def test_resume_with_nothing_to_resume_is_refused(tmp_path, capsys):
    out = tmp_path / "here.json"
    code = main(["calibrate", "-o", str(out), *ARGS, "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "nothing to resume" in err[0] and partial_path(str(out)) in err[0]
    assert list(tmp_path.iterdir()) == []


def test_resume_of_a_damaged_partial_file_is_refused(tmp_path, capsys):
    out = tmp_path / "here.json"
    Path(partial_path(str(out))).write_text('{"format": "tensoropt.calibrate.partial/1", "fi')
    code = main(["calibrate", "-o", str(out), *ARGS, "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "not a readable partial calibration" in err[0] and not out.exists()
