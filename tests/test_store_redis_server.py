"""EmbeddedRedis: a real redis-server that starts, answers, and never outlives its owner."""

import os
import signal
import subprocess
import sys
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specdec.store.redis_server import EmbeddedRedis, find_redis_server


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (an orphan's reaper may be slow in a container)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_binary_is_found():
    assert os.access(find_redis_server(), os.X_OK)


def test_context_manager_starts_and_stops_cleanly():
    with EmbeddedRedis() as server:
        pid, directory = server.pid, server._dir
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    assert not server.running
    assert not _alive(pid)  # terminated and reaped, not a zombie
    assert not os.path.exists(directory)
    with pytest.raises(RuntimeError, match="not running"):
        server.url


def test_explicit_start_stop_is_idempotent():
    server = EmbeddedRedis()
    assert server.start() is server
    pid = server.pid
    server.start()  # already running: a no-op
    assert server.pid == pid
    server.stop()
    server.stop()
    assert not _alive(pid)


def test_password_is_required_when_set():
    with EmbeddedRedis(password='s3cr"et pw') as server:
        assert redis.Redis.from_url(server.url).ping()
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with open(os.path.join(server._dir, "redis.conf")) as config:
            assert os.stat(config.fileno()).st_mode & 0o077 == 0
        if os.path.exists(f"/proc/{server.pid}/cmdline"):
            with open(f"/proc/{server.pid}/cmdline", "rb") as cmdline:
                assert b"s3cr" not in cmdline.read()


def test_unix_socket():
    with EmbeddedRedis(unix_socket=True) as server:
        assert server.url.startswith("unix://")
        assert redis.Redis.from_url(server.url).ping()
        socket_path = server.socket_path
    assert not os.path.exists(socket_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_server_dies_with_a_killed_owner():
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from specdec.store.redis_server import EmbeddedRedis\n"
         "server = EmbeddedRedis().start()\n"
         "print(server.pid, flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        redis_pid = int(owner.stdout.readline())
        assert _alive(redis_pid)
        owner.send_signal(signal.SIGKILL)  # no atexit, no finally: only the kernel can clean up
        owner.wait()
        assert _wait_gone(redis_pid)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()
