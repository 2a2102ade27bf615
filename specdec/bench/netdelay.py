"""A network delay between the coordinator and the draft and target services.

Loopback hides what a real network costs a draft/verify cycle. Two ways to add one:

- NetnsNetwork: coordinator, target and drafts each in a network namespace of their own, joined
  by veth pairs (10.213.1.0/30 coordinator-target, 10.213.2.0/30 coordinator-draft; addresses exist
  only inside these namespaces), with `tc qdisc ... netem delay D` on both ends of both links. Redis
  and the benchmark reach the coordinator's namespace through unix sockets (a relay), so nothing is
  added to the host's own network. Needs root and the sch_netem qdisc.
- ProxyNetwork: where netem is missing, a relay process (delay_proxy.py) between the coordinator and
  each service that holds every byte for D in each direction. Labelled as such in the report.

Either way a round trip gains 2 x D. `probe_netem()` says which works here and, if not, exactly
what failed. Namespaces are deleted on close, also when the run fails.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdec.processes import ServiceProcess, launch

ADDRESSES = {"target": "10.213.1", "draft": "10.213.2"}  # /30 per link; .1 coordinator side


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def probe_netem() -> str | None:
    """None if namespaces, veth pairs and the netem qdisc all work here; else what failed."""
    name = f"sdbprobe{os.getpid()}"
    steps = [["netns", "add", name],
             ["-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]]
    try:
        for step in steps:
            done = subprocess.run(["ip", *step], capture_output=True, text=True)
            if done.returncode:
                return f"`ip {' '.join(step)}` failed: {done.stderr.strip()}"
        cmd = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            return f"`tc qdisc add dev p0 root netem delay 1ms` (in a fresh namespace) failed: {done.stderr.strip()}"
        return None
    except FileNotFoundError as exc:
        return f"{exc.filename} is not installed"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def wait_ready_file(proc: ServiceProcess, host: str, timeout_s: float) -> ServiceProcess:
    """Ready when the service wrote its ports (it does so once serving); health checks cannot reach
    into another namespace."""
    deadline = time.monotonic() + timeout_s
    while not proc.ready_file.is_file():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            proc._fail("did not come up")  # raises with the log tail
        time.sleep(0.1)
    proc.ports = json.loads(proc.ready_file.read_text())
    proc.host = host
    return proc


class LoopbackNetwork:
    mode = "loopback"

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.helpers: list[ServiceProcess] = []

    def host(self, role: str) -> str:
        return "127.0.0.1"

    def redis_unix_socket(self) -> bool:
        return False

    def spawn(self, role: str, module: str, args: list[str], env: dict) -> ServiceProcess:
        return launch(module, args, log_dir=self.log_dir, env=env)

    def wait(self, role: str, proc: ServiceProcess, timeout_s: float) -> ServiceProcess:
        return proc.wait_ready(timeout_s)

    def route(self, role: str, address: str) -> str:
        """The address the coordinator dials for a service at `address`."""
        return address

    def client_address(self, coordinator: ServiceProcess) -> str:
        return coordinator.address

    def set_delay(self, delay_ms: float) -> None:
        if delay_ms:
            raise RuntimeError("the loopback network has no delay")

    def describe(self) -> dict:
        return {"mode": self.mode}

    def close(self) -> None:
        for proc in self.helpers:
            proc.kill()


def _relay(log_dir: Path, routes: list[str], control: Path, prefix: list[str] | None = None):
    ready = Path(tempfile.mkdtemp(prefix="relay-", dir=log_dir)) / "ready.json"
    cmd = [*(prefix or []), sys.executable, "-m", "specdec.bench.delay_proxy", "--control", str(control),
           "--ready-file", str(ready)]
    for route in routes:
        cmd += ["--route", route]
    log = open(log_dir / f"relay-{time.monotonic_ns()}.log", "wb")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + 30
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"delay relay did not start: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["listen"]


class ProxyNetwork(LoopbackNetwork):
    """Services on loopback; the coordinator dials them through delay relays."""

    mode = "tcp-delay-proxy"

    def __init__(self, log_dir: Path, why: str):
        super().__init__(log_dir)
        self.why = why
        self.control = log_dir / "delay_ms"
        self.control.write_text("0")
        self.relays: list[subprocess.Popen] = []
        self.delay_ms = 0.0

    def route(self, role: str, address: str) -> str:
        proc, listen = _relay(self.log_dir, [f"127.0.0.1:0={address}"], self.control)
        self.relays.append(proc)
        return listen[0]

    def set_delay(self, delay_ms: float) -> None:
        self.control.write_text(str(delay_ms))
        self.delay_ms = delay_ms
        time.sleep(0.3)  # the relays re-read it every 100 ms

    def describe(self) -> dict:
        return {"mode": self.mode, "why_not_netem": self.why,
                "how": "a relay process between the coordinator and each service holds every byte for "
                       "the delay in each direction (a round trip gains 2 x delay)"}

    def close(self) -> None:
        for proc in self.relays:
            proc.kill()
            proc.wait()
        super().close()


class NetnsNetwork(LoopbackNetwork):
    mode = "netns-netem"

    def __init__(self, log_dir: Path):
        super().__init__(log_dir)
        tag = f"sdb{os.getpid()}"
        self.ns = {"coordinator": f"{tag}c", "target": f"{tag}t", "draft": f"{tag}d"}
        self.relays: list[subprocess.Popen] = []
        self.devices: list[tuple[str, str]] = []  # (namespace, device) of every link end
        self.delay_ms = 0.0
        atexit.register(self.close)
        try:
            for ns in self.ns.values():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            coord = self.ns["coordinator"]
            for role, prefix in ADDRESSES.items():
                near, far = f"c{role[0]}", f"{role[0]}c"
                _ip("-n", coord, "link", "add", near, "type", "veth", "peer", "name", far, "netns", self.ns[role])
                _ip("-n", coord, "addr", "add", f"{prefix}.1/30", "dev", near)
                _ip("-n", self.ns[role], "addr", "add", f"{prefix}.2/30", "dev", far)
                _ip("-n", coord, "link", "set", near, "up")
                _ip("-n", self.ns[role], "link", "set", far, "up")
                self.devices += [(coord, near), (self.ns[role], far)]
        except BaseException:
            self.close()
            raise

    def host(self, role: str) -> str:
        return f"{ADDRESSES[role]}.2" if role in ADDRESSES else "127.0.0.1"

    def redis_unix_socket(self) -> bool:
        return True  # the coordinator's namespace cannot reach the host's loopback

    def spawn(self, role: str, module: str, args: list[str], env: dict) -> ServiceProcess:
        ns = self.ns[role if role in self.ns else "draft"]
        return launch("specdec.bench.netns_exec", [ns, module, *args], log_dir=self.log_dir, env=env)

    def wait(self, role: str, proc: ServiceProcess, timeout_s: float) -> ServiceProcess:
        return wait_ready_file(proc, self.host(role), timeout_s)

    def client_address(self, coordinator: ServiceProcess) -> str:
        sock = Path(tempfile.mkdtemp(prefix="coord-", dir=self.log_dir)) / "coordinator.sock"
        prefix = ["ip", "netns", "exec", self.ns["coordinator"]]
        zero = self.log_dir / "zero_delay_ms"
        zero.write_text("0")
        proc, _ = _relay(self.log_dir, [f"unix:{sock}=127.0.0.1:{coordinator.port}"], zero, prefix)
        self.relays.append(proc)
        return f"unix:{sock}"

    def set_delay(self, delay_ms: float) -> None:
        for ns, dev in self.devices:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            if delay_ms:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                                "delay", f"{delay_ms}ms"], capture_output=True, text=True, check=True)
        self.delay_ms = delay_ms

    def describe(self) -> dict:
        return {"mode": self.mode, "namespaces": dict(self.ns),
                "how": "tc netem delay on both ends of the veth links coordinator-target and "
                       "coordinator-draft (a round trip gains 2 x delay)"}

    def close(self) -> None:
        for proc in self.relays:
            proc.kill()
            proc.wait()
        self.relays = []
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        super().close()


def measure_round_trip(addresses: dict[str, str], repeats: int = 100) -> dict[str, float]:
    """Median seconds of a gRPC health check per address, the addresses taken in turn (A B A B),
    so that direct and delayed paths see the same load."""
    import statistics

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = {label: grpc.insecure_channel(address) for label, address in addresses.items()}
    stubs = {label: health_pb2_grpc.HealthStub(channel) for label, channel in channels.items()}
    times: dict[str, list[float]] = {label: [] for label in addresses}
    try:
        for i in range(repeats + 5):
            for label, stub in stubs.items():
                started = time.perf_counter()
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                if i >= 5:  # the first calls open the connections
                    times[label].append(time.perf_counter() - started)
    finally:
        for channel in channels.values():
            channel.close()
    return {label: statistics.median(values) for label, values in times.items()}
