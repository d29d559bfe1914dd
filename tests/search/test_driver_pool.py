"""The search driver's worker pool (tensoropt.search.driver.explore)."""

from __future__ import annotations


def _sigterm_is_default() -> bool:
    import signal

    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_search_workers_die_on_sigterm_whatever_the_parent_installed():
    """The search pool stops its workers with SIGTERM; a worker that inherited a raising
    handler could be interrupted holding the task queue's lock and hang the pool."""
    import multiprocessing
    import signal

    from tensoropt.search.driver import _pool_worker_init

    def raising(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raising)
    try:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:
            assert not pool.apply(_sigterm_is_default)  # inherited without the initializer
        with ctx.Pool(1, initializer=_pool_worker_init, initargs=(None, None, None)) as pool:
            assert pool.apply(_sigterm_is_default)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_search_workers_leave_ctrl_c_to_the_parent():
    """Ctrl-C reaches the whole process group; the parent stops the workers, so none
    prints a traceback of its own."""
    import multiprocessing
    import signal

    from tensoropt.search.driver import _pool_worker_init

    # a test run started in the background of a shell without job control inherits
    # SIGINT ignored: the parent's handler is set here, so the check holds either way
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1, initializer=_pool_worker_init, initargs=(None, None, None)) as pool:
            assert pool.apply(_ignores_sigint)
        # the parent's own handler is left alone
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def _ignores_sigint() -> bool:
    import signal

    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _mlp_graph(tmp_path):
    from tensoropt.models import build_model, save_model
    from tests.helpers.program import graph_of

    path = tmp_path / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(path))
    return graph_of(path)


def _explore_within(sg, seconds: float, **kwargs):
    """explore's result or exception, run in a thread: a search that hangs fails the
    test after ``seconds`` instead of hanging it."""
    import threading

    from tensoropt.cost.cluster import builtin
    from tensoropt.search.driver import explore

    out: dict = {}

    def body():
        try:
            out["result"] = explore(sg, [2, 4, 8], "auto", builtin("h100"), jobs=2, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the search did not return within {seconds} s"
    return out


def _workers_left(before: set[int]) -> list:
    import multiprocessing
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [p for p in multiprocessing.active_children() if p.pid not in before]
        if not left:
            return []
        time.sleep(0.05)
    return left


def test_a_search_worker_that_dies_stops_the_search_in_one_line(tmp_path, monkeypatch):
    """A worker killed mid-job (as by the kernel's out-of-memory killer) breaks the pool:
    the search raises a WorkerFault naming the device counts unsolved, where a
    ``multiprocessing.Pool`` replaced the worker and waited for the lost job for good."""
    import multiprocessing
    import os
    import signal

    from tensoropt.errors import ExitCode, WorkerFault
    from tensoropt.search import driver

    parent = os.getpid()
    solve = driver._solve_meshes

    def dies_on_the_8_device_mesh(sg, job, *args):
        if os.getpid() != parent and any(m.size == 8 for m in job[0]):
            os.kill(os.getpid(), signal.SIGKILL)
        return solve(sg, job, *args)

    monkeypatch.setattr(driver, "_solve_meshes", dies_on_the_8_device_mesh)
    before = {p.pid for p in multiprocessing.active_children()}
    out = _explore_within(_mlp_graph(tmp_path), 120)
    error = out.get("error")
    assert isinstance(error, WorkerFault), out
    assert error.exit_code == ExitCode.INTERNAL
    message = str(error)
    assert "search worker process died" in message and "--jobs 1" in message
    assert "8" in message.split("the problems of ", 1)[1].split(" devices", 1)[0].split(", ")
    assert _workers_left(before) == []


def test_a_search_stopped_by_its_caller_stops_its_workers_at_once(tmp_path, monkeypatch):
    """An exception in the parent (Ctrl-C, a failing callback) terminates the workers:
    the pool's own shutdown would wait for the jobs they are solving."""
    import multiprocessing
    import os
    import time

    from tensoropt.search import driver

    parent = os.getpid()
    solve = driver._solve_meshes

    def slow_on_the_4_device_mesh(sg, job, *args):
        if os.getpid() != parent and any(m.size == 4 for m in job[0]):
            time.sleep(600)
        return solve(sg, job, *args)

    def stop(mesh):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "_solve_meshes", slow_on_the_4_device_mesh)
    before = {p.pid for p in multiprocessing.active_children()}
    out = _explore_within(_mlp_graph(tmp_path), 120, on_problem=stop)
    assert isinstance(out.get("error"), KeyboardInterrupt), out
    assert _workers_left(before) == []
