"""The neighbour processes that keep the host's other cores busy during compute calibration."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensoropt.calibrate import neighbours
from tensoropt.calibrate.kernels import KernelOptions, cases
from tensoropt.calibrate.profile import CalibrateOptions, CommBackend
from tensoropt.errors import TensorOptError
from tensoropt.runtime.malloc import HUGETLB_TUNABLE, MALLOC_ENV, TUNABLES, child_env

OPTS = KernelOptions(threads=1, repeats=3, block_seconds=0.002, cold_calls=2)
SCHEDULE = cases(quick=True)[:3] * 2


def _alive() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name == "neighbour"]


def _cpu_seconds(proc: multiprocessing.Process) -> float:
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.slow
def test_neighbours_compute_while_each_case_is_measured_and_stop_after():
    with neighbours.busy_neighbours(1, OPTS, SCHEDULE) as pacer:
        procs = _alive()
        assert len(procs) == 1
        for _ in range(3):  # the neighbour meets us at every case
            with pacer.busy():
                before = _cpu_seconds(procs[0])
                time.sleep(1.0)
                # it runs the case's step (an idle neighbour adds ~0 s; the margin is for
                # a loaded CI machine, where it shares 2 cores with the test workers)
                assert _cpu_seconds(procs[0]) - before > 0.2
            assert procs[0].is_alive()
    assert not procs[0].is_alive() and _alive() == []


def test_a_dead_neighbour_is_one_clear_error(monkeypatch):
    with neighbours.busy_neighbours(1, OPTS, SCHEDULE) as pacer:
        with pacer.busy():  # the default timeout: a spawned neighbour starts slowly when loaded
            proc = _alive()[0]
        monkeypatch.setattr(neighbours, "SYNC_TIMEOUT_S", 2.0)  # the dead one is waited for
        proc.kill()
        proc.join()
        with pytest.raises(TensorOptError, match="neighbour process stopped"), pacer.busy():
            pass
    assert _alive() == []


def test_neighbours_stop_when_the_block_raises():
    with pytest.raises(KeyboardInterrupt), neighbours.busy_neighbours(1, OPTS, SCHEDULE):
        procs = _alive()
        raise KeyboardInterrupt
    assert procs and not procs[0].is_alive()


def test_no_neighbours_is_no_process():
    with neighbours.busy_neighbours(0, OPTS, SCHEDULE) as pacer, pacer.busy():
        assert _alive() == []


@pytest.mark.parametrize("backend", list(CommBackend))
def test_compute_is_timed_alone_unless_neighbours_are_asked_for(backend):
    # beside a busy neighbour, memory-bound rates follow the host's placement of the
    # vCPUs (docs/design/measured.md, "Calibration determinism")
    assert CalibrateOptions(backend=backend, ranks=4).neighbours == 0


_PARENT = """
from tensoropt.calibrate import neighbours
from tensoropt.calibrate.kernels import KernelOptions, cases
import multiprocessing, time
if __name__ == "__main__":
    opts = KernelOptions(threads=1, repeats=3, block_seconds=0.002, cold_calls=2)
    with neighbours.busy_neighbours(1, opts, cases(quick=True)[:2]) as pacer, pacer.busy():
        (proc,) = multiprocessing.active_children()
        print(proc.pid, flush=True)
        time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited (a zombie that init has not reaped yet)


def test_a_neighbour_stops_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
        parent.kill()  # SIGKILL: no finally, no SIGTERM to the neighbour
        parent.wait()
        deadline = time.monotonic() + 30
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(pid)
    finally:
        parent.kill()


def _report_environment(queue) -> None:
    queue.put((os.environ.get(TUNABLES), os.environ.get("MALLOC_MMAP_THRESHOLD_")))


def test_spawned_children_start_with_the_runtimes_malloc_environment(monkeypatch):
    # measuring processes and neighbours run on the memory the MPI ranks get
    # (huge pages for malloc's memory: the tunable is read at process start only)
    monkeypatch.delenv(TUNABLES, raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_report_environment, args=(queue,))
    neighbours.start_child(proc)
    tunables, threshold = queue.get(timeout=60)
    proc.join()
    assert tunables == child_env()[TUNABLES] and HUGETLB_TUNABLE in tunables
    assert threshold == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert TUNABLES not in os.environ  # the parent's own environment is unchanged


_INTERRUPTED_START = """
import multiprocessing, os, signal, time
from multiprocessing.context import SpawnProcess
from tensoropt.calibrate import neighbours

class Interrupted(SpawnProcess):
    def start(self):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the child is being spawned
        super().start()

def child(queue):
    queue.put(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    time.sleep(120)

if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Queue()
    proc = Interrupted(target=child, args=(queue,), daemon=True)
    try:
        neighbours.start_child(proc)
        time.sleep(10)
        print("lost", flush=True)
    except KeyboardInterrupt:
        print("interrupted", proc.pid is not None, flush=True)
    blocked = queue.get(timeout=60)
    os.kill(proc.pid, signal.SIGINT)  # the child's own Ctrl-C: it stays pending there
    time.sleep(1.0)
    print("child", blocked, proc.is_alive(), flush=True)
    proc.terminate()
"""


def _as_from_a_terminal() -> None:
    """SIGINT as a shell's foreground command gets it: default, unblocked. A process that
    ignores SIGINT (as a test process can, and its children inherit) rightly never sees
    the Ctrl-C that start_child raises again: the test would read "lost"."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_a_ctrl_c_during_a_childs_start_reaches_the_parent_and_not_the_child(tmp_path):
    # the parent must not lose a Ctrl-C that arrives while it spawns (calibrate would go
    # on measuring), and the child must not turn it into a traceback of its own
    script = tmp_path / "parent.py"
    script.write_text(_INTERRUPTED_START)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180,
        preexec_fn=_as_from_a_terminal,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["interrupted True", "child True True"]
    assert "Traceback" not in done.stderr


_TERMINATED_START = """
import multiprocessing, os, signal, time
from multiprocessing.context import SpawnProcess
from tensoropt.calibrate import neighbours

class Terminated(Exception):
    pass

def terminated(signum, frame):
    raise Terminated  # as the command's handler does

class Killed(SpawnProcess):
    def start(self):
        os.kill(os.getpid(), signal.SIGTERM)  # a kill while the child is being spawned
        super().start()

def child(queue):
    queue.put(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    time.sleep(120)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, terminated)
    queue = multiprocessing.get_context("spawn").Queue()
    proc = Killed(target=child, args=(queue,), daemon=True)
    try:
        neighbours.start_child(proc)
        time.sleep(10)
        print("lost", flush=True)
    except Terminated:
        print("terminated", proc.pid is not None, flush=True)
    blocked = queue.get(timeout=60)
    print("child", blocked, proc.is_alive(), flush=True)
    print("handler", signal.getsignal(signal.SIGTERM) is terminated, flush=True)
    proc.terminate()
    proc.join(30)
    print("stopped", proc.exitcode == -signal.SIGTERM, flush=True)
"""


def test_a_kill_during_a_childs_start_reaches_the_parent_after_the_start(tmp_path):
    # raised half-way through the spawn, the parent's SIGTERM cut the child's start data
    # short: the child printed an EOFError traceback. It is raised once the child runs,
    # which does not block SIGTERM (the parent stops its children with it).
    script = tmp_path / "parent.py"
    script.write_text(_TERMINATED_START)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == [
        "terminated True", "child False True", "handler True", "stopped True"
    ], done.stdout  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
