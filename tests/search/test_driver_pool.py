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
