"""Calibration progress on a stderr that is not a terminal: periodic one-line records."""

from __future__ import annotations

import io
import re
import time

from tensoropt.calibrate.progress import Progress

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
