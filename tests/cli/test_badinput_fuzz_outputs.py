"""Bad input found by a fuzz tour of the CLI: output paths that are links or streams,
--mesh, zoo knobs, --lr, SIGTERM, demo --dir, device counts, --axes, --memory-budget and
--micro-batches. Each refusal is one line on stderr, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from tests.cli.cli_run import assert_bad_input, cli, cli_process
from tests.helpers.procs import catches, wait_for


@pytest.fixture
def gpt(zoo_file):
    return zoo_file("gpt")


def _files(path) -> list[str]:
    return sorted(os.listdir(path))


# -- 1. output paths that are symlinks, FIFOs or devices ---------------------------------


def test_json_out_through_a_symlink_replaces_its_target_and_keeps_the_link(capsys, gpt, tmp_path):
    target = tmp_path / "sub" / "target.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    out = cli(capsys, "search", gpt, "--devices", "2", "--jobs", "1", "--json-out", link)
    assert out.code == 0, out.err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["schema"].startswith("tensoropt.search/")
    assert _files(target.parent) == ["target.json"]  # no temp file left beside it


def test_json_out_to_a_fifo_writes_through_to_its_reader(capsys, gpt, tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    out = cli(capsys, "search", gpt, "--devices", "2", "--jobs", "1", "--json-out", fifo)
    reader.join(timeout=30)
    assert out.code == 0, out.err
    assert fifo.is_fifo()
    assert json.loads(got[0])["schema"].startswith("tensoropt.search/")


def _redirected(argv: list[object], stdout_path) -> subprocess.CompletedProcess:
    """``python -m tensoropt ARGV`` with its stdout redirected to a regular file."""
    with open(stdout_path, "wb") as f:
        return subprocess.run(
            [sys.executable, "-m", "tensoropt", *map(str, argv)],
            stdout=f, stderr=subprocess.PIPE, text=True, timeout=120, check=False,
        )  # fmt: skip


@pytest.mark.parametrize("alias", ["/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"])
def test_json_out_to_stdout_redirected_to_a_file_follows_the_tables(gpt, tmp_path, alias):
    # The alias resolves to the regular file; replacing that file would drop the tables
    # printed before the JSON.
    printed = tmp_path / "printed.txt"
    argv = ["search", gpt, "--devices", "2", "--jobs", "1", "--json-out", alias]
    proc = _redirected(argv, printed)
    assert proc.returncode == 0, proc.stderr
    text = printed.read_text()
    start = text.index('{"schema"')
    assert "devices" in text[:start], text[:start]  # the tables, then the document
    assert json.loads(text[start:])["schema"].startswith("tensoropt.search/")
    assert _files(tmp_path) == ["printed.txt"]


def test_a_model_written_to_stdout_redirected_to_a_file_loads(tmp_path):
    import onnx

    written = tmp_path / "model.onnx"
    proc = _redirected(["model", "mlp", "-o", "/dev/stdout"], written)
    assert proc.returncode == 0, proc.stderr
    assert onnx.load(str(written)).graph.node  # the model's bytes alone
    assert "wrote /dev/stdout: mlp" in proc.stderr
    assert _files(tmp_path) == ["model.onnx"]
    proc = _redirected(["model", "mlp", "-o", "/dev/stdout", "--json"], written)
    assert proc.returncode == 2 and "both write stdout" in proc.stderr, proc.stderr


@pytest.fixture
def null_device(tmp_path):
    """A character device like /dev/null, made in ``tmp_path`` (the real one is shared:
    a writer that replaced it would break the machine); needs root for mknod."""
    path = tmp_path / "null"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root")
    return path


def test_outputs_to_a_null_device_leave_it_a_device(capsys, gpt, null_device):
    out = cli(capsys, "search", gpt, "--devices", "2", "--jobs", "1", "--json-out", null_device)
    assert out.code == 0, out.err
    assert stat.S_ISCHR(null_device.stat().st_mode)
    out = cli(capsys, "model", "gpt", "-o", null_device)
    assert out.code == 0, out.err
    assert stat.S_ISCHR(null_device.stat().st_mode)
    assert _files(null_device.parent) == ["null"]


def test_model_through_a_symlink_replaces_its_target(capsys, tmp_path):
    target = tmp_path / "real.onnx"
    target.write_bytes(b"old")
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    out = cli(capsys, "model", "gpt", "-o", link)
    assert out.code == 0, out.err
    assert link.is_symlink() and target.stat().st_size > 1000
    assert _files(tmp_path) == ["link.onnx", "real.onnx"]


# -- 2. --mesh ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["search", "report"])
@pytest.mark.parametrize(
    ("mesh", "fragment"), [("axb", "is not like 8 or 2x4"), ("", "is not like 8 or 2x4")]
)
def test_malformed_mesh_is_refused_like_compile(capsys, gpt, tmp_path, command, mesh, fragment):
    extra = ["-o", tmp_path / "rep"] if command == "report" else []
    out = cli(capsys, command, gpt, "--devices", "2", "--jobs", "1", "--mesh", mesh, *extra)
    assert_bad_input(out, command, f"--mesh {mesh!r}", fragment)
    assert _files(tmp_path) == []


def test_mesh_with_a_zero_size_is_refused(capsys, gpt):
    out = cli(capsys, "search", gpt, "--devices", "2", "--jobs", "1", "--mesh", "0x2")
    assert_bad_input(out, "search", "--mesh '0x2'", "positive sizes")


# -- 3. zoo knobs ------------------------------------------------------------------------


def test_huge_model_knob_is_refused(capsys, tmp_path):
    out = cli(capsys, "model", "gpt", "--batch", "99999999999999999999", "-o", tmp_path / "x.onnx")
    assert_bad_input(out, "model", "--batch 99999999999999999999", "at most 2147483647")
    assert _files(tmp_path) == []


# -- 4. --lr -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lr", "fragment"),
    [
        ("nan", "positive finite"),
        ("inf", "positive finite"),
        ("1e308", "overflows float32"),
        ("1e-50", "rounds to 0 in float32"),
    ],
)
@pytest.mark.parametrize("command", ["train", "compile"])
def test_unusable_learning_rate_is_refused(capsys, gpt, tmp_path, command, lr, fragment):
    extra = ["--devices", "2", "-o", tmp_path / "out"] if command == "compile" else []
    out = cli(capsys, command, gpt, f"--lr={lr}", *extra)
    assert_bad_input(out, command, "--lr", fragment)
    assert _files(tmp_path) == []


def test_nan_learning_rate_is_refused_by_validate(capsys, gpt, tmp_path):
    out = cli(
        capsys, "validate", gpt, "--devices", "1", "--lr=nan", "--cluster", "h100",
        "--jobs", "1", "--json-out", tmp_path / "v.json",
    )  # fmt: skip
    assert_bad_input(out, "validate", "--lr", "positive finite")
    assert _files(tmp_path) == []


# -- 5. SIGTERM --------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_sigterm_is_one_line_and_the_documented_code(gpt, tmp_path):
    """SIGTERM once the command runs (its handler installed, seen in /proc rather than
    guessed from a sleep, which a loaded machine outlasts): one line, exit 130."""
    from tensoropt.errors import ExitCode

    out = tmp_path / "s.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensoropt", "search", str(gpt), "--devices", "1..64",
         "--axes", "all", "--jobs", "1", "--json-out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: catches(proc.pid, signal.SIGTERM), lambda: proc.poll() is None, 120)
        time.sleep(1.0)  # past parsing: the search under way
        assert proc.poll() is None, "the search ended before the signal"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert err.strip().splitlines() == ["tensoropt search: terminated"]
    assert _files(tmp_path) == []


# -- 6. demo --dir -----------------------------------------------------------------------


def test_demo_refuses_a_missing_parent(capsys, tmp_path):
    out = cli(capsys, "demo", "--dir", tmp_path / "no" / "d", "--backend", "local")
    assert_bad_input(out, "demo", "--dir", "does not exist")
    assert _files(tmp_path) == []


def test_demo_refuses_a_directory_that_is_not_its_own(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    out = cli(capsys, "demo", "--dir", tmp_path, "--backend", "local")
    assert_bad_input(out, "demo", "--dir", "not a tensoropt demo directory", "notes.txt")
    assert _files(tmp_path) == ["notes.txt"]


def test_demo_checks_the_cluster_before_writing(capsys, tmp_path):
    out = cli(capsys, "demo", "--dir", tmp_path / "dm", "--cluster", "nope", "--backend", "local")
    assert_bad_input(out, "demo", "'nope'")
    assert _files(tmp_path) == []


def test_failed_demo_step_leaves_no_directory_it_made(capsys, tmp_path, monkeypatch):
    from tensoropt.cli import cmd_demo

    steps = []
    real = cmd_demo._step

    def second_fails(title, argv, quiet, out):
        steps.append(argv[0])
        if len(steps) == 2:  # the search, after the model was written
            assert os.path.exists(os.path.join(tmp_path, "dm", "gpt.onnx"))
            raise cmd_demo._StepFailed(2)
        return real(title, argv, quiet, out)

    monkeypatch.setattr(cmd_demo, "_step", second_fails)
    out = cli(capsys, "demo", "--dir", tmp_path / "dm", "--backend", "local")
    assert out.code == 2 and steps == ["model", "search"]
    assert _files(tmp_path) == []


# -- 7. device counts --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "fragment"),
    [
        ("99999999999999999999999", "up to 1048576"),
        ("1..1099511627776", "up to 1048576"),
        ("1-100000", "at most 1024"),
        ("0..4", "at least 1"),
    ],
)
def test_absurd_device_counts_are_refused_at_once(gpt, tmp_path, devices, fragment):
    # a child process with a timeout: unchecked, these counts ran for minutes
    out = cli_process(
        "search",
        gpt,
        "--devices",
        devices,
        "--jobs",
        "1",
        "--json-out",
        tmp_path / "s.json",
        timeout=60,
    )
    line = assert_bad_input(out, "search", f"--devices {devices!r}", fragment)
    assert "use 0-4" not in line
    assert _files(tmp_path) == []


# -- 8. --axes, --memory-budget, --micro-batches -----------------------------------------


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (["--axes", "split,,zero"], ["--axes 'split,,zero'", "empty item"]),
        (["--memory-budget", "0"], ["--memory-budget '0'", "positive size"]),
        (["--memory-budget", "0GiB"], ["--memory-budget '0GiB'", "positive size"]),
        (["--micro-batches", "2", "--axes", "split"], ["--micro-batches 2", "add micro"]),
        (["--micro-batches", "1,,2", "--axes", "split,micro"], ["--micro-batches '1,,2'"]),
    ],
)
def test_search_option_refused(capsys, gpt, tmp_path, options, fragments):
    out = cli(
        capsys, "search", gpt, "--devices", "2", "--jobs", "1", *options,
        "--json-out", tmp_path / "s.json",
    )  # fmt: skip
    line = assert_bad_input(out, "search", *fragments)
    assert "0GiB" not in line.split("'0GiB'")[-1]  # never suggests what it refuses
    assert _files(tmp_path) == []


@pytest.mark.parametrize("shape", ["trailing-separator", "symlink-loop"])
def test_output_files_that_reach_no_file_are_refused_before_work(capsys, gpt, tmp_path, shape):
    # a trailing separator failed only when the file was written; a loop was replaced
    if shape == "trailing-separator":
        path, fragment = f"{tmp_path}/s.json/", "ends in /"
    else:
        path, fragment = tmp_path / "loop.json", "symlink loop"
        path.symlink_to("loop.json")
    before = _files(tmp_path)
    for argv in (["search", gpt, "--devices", "2", "--jobs", "1", "--json-out", path],
                 ["model", "gpt", "-o", path]):  # fmt: skip
        assert_bad_input(cli(capsys, *argv), argv[0], fragment)
    assert _files(tmp_path) == before
