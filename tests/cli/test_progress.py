"""Calibration progress on a stderr that is not a terminal: periodic one-line records."""

from __future__ import annotations

import io
import re
import time

import pytest

from tensoropt.cli.progress import Progress

RECORD = re.compile(r"^calibrate: (\d+)/(\d+) \((\d+)%\), \d+ s elapsed, (.+)$")


def test_records_come_periodically_with_phase_done_total_and_elapsed():
    out = io.StringIO()  # not a terminal: records, no bar
    bar = Progress(8, done=2, stream=out, every_s=0.05)
    bar.tick("pass 1/3: MatMul 16x64 x 64x64")
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # a long case: records keep coming without ticks
    bar.tick("collectives")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3
    parsed = [RECORD.match(line) for line in lines]
    assert all(parsed), lines
    assert parsed[0].groups()[:2] == ("2", "8") and parsed[0].group(4) == "starting"
    assert parsed[-1].group(1) in ("3", "4") and "pass 1/3: MatMul" in lines[1]
    count = len(lines)
    time.sleep(0.2)
    assert len(out.getvalue().splitlines()) == count  # closed: no more records


def test_calibrate_warns_when_other_work_shares_the_machine():
    from tensoropt.cli.cmd_calibrate import busy_warning

    assert busy_warning(0.4, 2) is None and busy_warning(1.0, 2) is None
    line = busy_warning(4.9, 2)
    assert line is not None and "\n" not in line
    assert "load average 4.9 on 2 cores" in line and "calibrate when it is idle" in line


def test_calibrate_warns_when_the_hosts_speed_moved_during_it():
    from tensoropt.calibrate.hostspeed import drift
    from tensoropt.cli.cmd_calibrate import DRIFT_WARN, drift_warning

    # the references of one calibration on an idle 2-core VM (benchmarks/RESULTS.md)
    moved = [0.0059012, 0.0034487, 0.0051807, 0.0034796]
    assert drift(moved) == pytest.approx(0.0059012 / 0.0034487 - 1)
    line = drift_warning(moved)
    assert line is not None and "\n" not in line
    assert "moved 71%" in line and "3.45-5.90 ms" in line and "--against" in line
    steady = [0.0034, 0.0034 * (1 + DRIFT_WARN) * 0.999, 0.0035]
    assert drift_warning(steady) is None
    assert drift_warning([0.0034]) is None and drift([]) is None and drift([0.0, 1.0]) is None


def _wait_for_lines(out: io.StringIO, count: int) -> None:
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_steps_count_finished_items_and_name_the_one_under_way():
    from tensoropt.cli.progress import Steps

    out = io.StringIO()
    bar = Progress(3, desc="train", stream=out, every_s=0.05, announce=False)
    seen = []
    for k in Steps(range(3), lambda: bar, label=lambda k: f"step {k}"):
        seen.append(bar.line())
        if k == 1:  # a long item: records keep coming while it runs
            _wait_for_lines(out, 2)
    assert [line.split(", ")[0] for line in seen] == [
        "train: 0/3 (0%)",
        "train: 1/3 (33%)",
        "train: 2/3 (67%)",
    ]
    assert [line.rsplit(", ", 1)[1] for line in seen] == ["step 0", "step 1", "step 2"]
    assert bar.line().startswith("train: 3/3 (100%)")
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all(re.match(r"^train: \d/3 ", line) for line in lines)
    assert any("step 1" in line for line in lines)
    count = len(lines)
    time.sleep(0.2)
    assert len(out.getvalue().splitlines()) == count  # the loop ended: no more records


def test_short_work_leaves_a_non_terminal_stderr_alone():
    from tensoropt.cli.progress import Steps

    out = io.StringIO()
    steps = Steps(range(4), lambda: Progress(4, desc="validate", stream=out, announce=False))
    for _ in steps:
        pass
    assert out.getvalue() == ""


def test_an_interrupted_loop_stops_its_records():
    from tensoropt.cli.progress import Steps

    out = io.StringIO()
    bar = Progress(5, desc="validate", stream=out, every_s=0.05, announce=False)
    try:
        for k in Steps(range(5), lambda: bar):
            if k == 2:
                raise RuntimeError("a plan failed")
    except RuntimeError:
        pass
    count = len(out.getvalue().splitlines())
    time.sleep(0.2)
    assert len(out.getvalue().splitlines()) == count


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal], ids=["records", "bar"])
def test_a_count_kept_elsewhere_is_what_the_progress_shows(stream):
    """Work counted in other processes (a search's workers): the records read the count,
    and the bar follows it and ends at it."""
    out = stream()
    seen = [0]
    bar = Progress(10, desc="search", stream=out, every_s=0.05, count=lambda: seen[0])
    seen[0] = 7
    deadline = time.monotonic() + 30
    while "7/10" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    seen[0] = 10
    bar.close()
    assert "search: 7/10" in out.getvalue() or " 7/10 " in out.getvalue(), out.getvalue()
    if stream is _Terminal:  # the bar (cleared from the line when closed) ends at the count
        assert bar._bar is not None and bar._bar.n == 10


def test_the_search_counts_every_problem_in_its_workers_too(tmp_path):
    """``explore``'s counter reaches ``problem_count`` whether the problems are solved in
    forked workers or here, while most of them are left out, not solved."""
    import multiprocessing

    from tensoropt.cli import build_parser
    from tensoropt.cli.cmd_search import search_space
    from tensoropt.cli.common import search_graph
    from tensoropt.cost.cluster import builtin
    from tensoropt.models import build_model, save_model
    from tensoropt.search.driver import explore, problem_count, search_meshes

    path = tmp_path / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    args = build_parser().parse_args(["search", str(path), "--axes", "split,zero,recompute,micro"])
    sg = search_graph(args)
    space = search_space(args, sg)
    devices = [1, 2, 4]
    total = problem_count(sg, devices, "auto", space)
    assert total == sum(len(space.variants(sg, m)) for m in search_meshes(sg, devices, "auto"))
    for jobs in (2, 1):
        counter = multiprocessing.Value("q", 0)
        exp = explore(sg, devices, "auto", builtin("h100"), jobs=jobs, space=space,
                      counter=counter)  # fmt: skip
        assert counter.value == total, jobs
        assert len(exp.searches) < total  # the count is of problems, not of searches


def test_compile_counts_every_model_file_it_writes(monkeypatch, capsys, tmp_path):
    """compile's progress: one item per model file (the annotated step, each device),
    named in its records; records as any long work gives them (here every 10 ms)."""
    from tensoropt.cli import progress
    from tensoropt.models import build_model, save_model
    from tests.cli.cli_run import cli

    made: list[Progress] = []
    ticks: list[str] = []

    class Often(Progress):
        def __init__(self, total, **kwargs):
            super().__init__(total, **{**kwargs, "every_s": 0.01})
            made.append(self)

        def tick(self, label):
            ticks.append(label)
            time.sleep(0.03)  # a file that takes a while: records come between ticks
            super().tick(label)

    monkeypatch.setattr(progress, "Progress", Often)
    path = tmp_path / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    out = cli(capsys, "compile", path, "--devices", 4, "--mesh", "2x2", "-o", tmp_path / "c")
    assert out.code == 0, out.err
    assert len(made) == 1 and made[0]._total == 5
    assert ticks == ["annotated.onnx written", *(f"device_{r}.onnx written" for r in range(4))]
    records = [ln for ln in out.err.splitlines() if ln.startswith("compile: ")]
    assert records and all(re.match(r"compile: [0-5]/5 \(\d+%\), \d+ s elapsed, ", r)
                           for r in records), records  # fmt: skip
    assert any("device_" in r for r in records), records
