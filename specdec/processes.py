"""Services as real subprocesses: the local launcher, end-to-end tests and benchmarks use these.

    proc = start_service("target_service", ["--model", str(model_dir), "--plaintext"])
    ... grpc calls to proc.address ...
    proc.stop()      # SIGTERM (graceful), SIGKILL after a timeout; returns the exit code
    proc.kill()      # kill -9

A service is started with `python -m <module>` on free ports it picks itself (--port 0
--metrics-port 0, --health-port 0 where the caller asks for a separate health port) and reports them
through --ready-file; start_service returns once grpc.health.v1 says SERVING. Start several at once
with launch() + wait_ready() so their startups (imports, model loading) overlap. Output goes to a log
file whose tail is shown when a service fails to come up.

A launched service exits with its launcher: it is told the launcher's pid (EXIT_WITH_PARENT) and
shuts down gracefully once it is no longer its parent's child. A launcher killed with SIGKILL (a CI
timeout, an interrupted pytest) used to leave its services running, holding ports and cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The launcher's pid, in a launched service's environment: the service exits once it is orphaned.
EXIT_WITH_PARENT = "SPECDEC_EXIT_WITH_PARENT"
# The folder holding the specdec package: children import the same code as their parent.
SOURCE_ROOT = Path(__file__).resolve().parents[1]
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class ServiceProcess:
    module: str
    proc: subprocess.Popen
    log_path: Path
    ready_file: Path
    tls_ca: Path | None = None  # to check health over TLS when there is no plaintext health port
    host: str = "127.0.0.1"
    ports: dict = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.ports["port"]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def health_port(self) -> int | None:
        return self.ports.get("health_port")

    @property
    def metrics_port(self) -> int | None:
        return self.ports.get("metrics_port")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 90.0) -> "ServiceProcess":
        """Until the ready file names the ports and health reports SERVING; raises with the log
        tail if the process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not self.ports:
            self._check_alive()
            if self.ready_file.is_file():
                self.ports = json.loads(self.ready_file.read_text())
            elif time.monotonic() > deadline:
                self._fail(f"no ready file after {timeout_s:.0f}s")
            else:
                time.sleep(0.05)
        while not self.serving():
            self._check_alive()
            if time.monotonic() > deadline:
                self._fail(f"health not SERVING after {timeout_s:.0f}s")
            time.sleep(0.05)
        return self

    def serving(self, timeout_s: float = 1.0) -> bool:
        if self.health_port:
            channel = grpc.insecure_channel(f"{self.host}:{self.health_port}")
        elif self.tls_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=self.tls_ca.read_bytes())
            channel = grpc.secure_channel(self.address, creds)
        else:
            channel = grpc.insecure_channel(self.address)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status == SERVING
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def metrics(self, timeout_s: float = 5.0) -> str:
        """The Prometheus text exposition from /metrics."""
        url = f"http://{self.host}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode()

    def signal(self, signum: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (graceful shutdown), then SIGKILL if it has not exited in timeout_s."""
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        """kill -9: no shutdown at all, as when a node dies."""
        self.signal(signal.SIGKILL)
        return self.proc.wait()

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            self._fail(f"exited with code {self.proc.returncode}")

    def _fail(self, why: str) -> None:
        if self.proc.poll() is None:
            self.kill()
        raise RuntimeError(f"{self.module} {why}; log {self.log_path}:\n{self.log()}")


def launch(
    module: str,
    args: list[str],
    *,
    log_dir: Path | None = None,
    tls_ca: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> ServiceProcess:
    """Start `python -m module *args` without waiting for it; call wait_ready() on the result.

    --port and --metrics-port default to 0 (free ports) unless args set them."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="specdec-svc-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{module}-{time.monotonic_ns()}"
    ready_file = log_dir / f"{stem}.ready.json"
    log_path = log_dir / f"{stem}.log"
    extra = ["--ready-file", str(ready_file)]
    for flag in ("--port", "--metrics-port"):
        if flag not in args:
            extra += [flag, "0"]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", EXIT_WITH_PARENT: str(os.getpid()), **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), child_env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", module, *args, *extra], cwd=cwd, env=child_env,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return ServiceProcess(module, proc, log_path, ready_file, tls_ca=tls_ca)


def start_service(module: str, args: list[str], *, timeout_s: float = 90.0, **kwargs) -> ServiceProcess:
    """launch() and wait until it is SERVING; returns the running service (see .address)."""
    return launch(module, args, **kwargs).wait_ready(timeout_s)


def wait_all(*procs: ServiceProcess, timeout_s: float = 120.0) -> None:
    """wait_ready() for services launched together; on a failure, stop the others too."""
    try:
        for proc in procs:
            proc.wait_ready(timeout_s)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise


def stop_all(*procs: ServiceProcess, timeout_s: float = 20.0) -> list[str]:
    """SIGTERM every service at once; SIGKILL those still running timeout_s later. One deadline for
    all: waited one after the other, each with its own timeout, three services that hang on their
    way out held a launcher's Ctrl-C for a minute. Returns a line for each service that was killed."""
    for proc in procs:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    killed = []
    for proc in procs:
        try:
            proc.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            killed.append(f"{proc.module} (pid {proc.proc.pid}) was still running {timeout_s:.0f} s after "
                          f"SIGTERM: killed; its log: {proc.log_path}")
    for line in killed:
        print(line, file=sys.stderr, flush=True)
    return killed


def exit_with_parent(poll_s: float = 0.5) -> None:
    """In a service: if launched with EXIT_WITH_PARENT, SIGTERM ourselves (the graceful shutdown)
    once that process is no longer our parent. A daemon thread polls getppid(): portable, and unlike
    PR_SET_PDEATHSIG it does not fire when merely the launching thread ends."""
    import threading

    parent = os.environ.pop(EXIT_WITH_PARENT, "")  # popped: the service's own children are not ours
    if not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_s)
        print(f"launcher (pid {parent}) is gone: shutting down", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
