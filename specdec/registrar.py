"""Publish a model service's endpoint in the replica registry for as long as the service serves.

The draft and target services do not register themselves in Redis (they take no --redis-url), so
something beside each replica does it: a sidecar container in its Kubernetes pod, or a thread in its
Ray actor. The registrar watches the service's plaintext grpc.health.v1 port and mirrors it in the
registry (specdec.store.ReplicaRegistry):

    SERVING                        registered under a lease, renewed every lease/3 with the load read
                                   from the service's /metrics (sessions held, free slots)
    NOT_SERVING (draining, or      kept listed but draining: the coordinator routes the sessions this
    an unhealthy engine)           replica holds and sends new ones elsewhere; back to SERVING
                                   registers it afresh
    unreachable `gone_after` times removed at once (its sessions are rebuilt on another replica)
    registrar stopped (SIGTERM)    draining, and kept so while the service still answers, at most
                                   `drain_timeout_s`; then removed

    python -m specdec.registrar --kind target --pool speculative --replica-id "$POD_NAME" \\
        --advertise-address "$POD_IP" --port 50052 --health-port 50062 --metrics-port 9102 \\
        --capacity 32 --redis-url "$SPECDEC_REDIS_URL"
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import urllib.request
from dataclasses import dataclass, replace

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc import RECONNECT_BACKOFF
from specdec.store import Replica, ReplicaRegistry

log = logging.getLogger("specdec.registrar")

SERVING = health_pb2.HealthCheckResponse.SERVING


def host_port(host: str, port: int) -> str:
    """host:port, with an IPv6 address in brackets (Kubernetes' POD_IP may be one)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass(frozen=True)
class RegistrarSettings:
    redis_url: str
    kind: str  # "target" | "draft"
    pool: str  # "speculative" | "baseline"
    replica_id: str
    endpoint: str  # what the coordinator dials: advertised address and the service's main port
    health_address: str  # the service's plaintext health port, normally on 127.0.0.1
    metrics_url: str | None = None  # the service's /metrics, for the load it reports; None: no load
    model: str = ""
    capacity: int = 0  # session slots (--num-slots); 0 = unknown
    redis_prefix: str = "specdec"
    lease_s: float = 10.0
    drain_timeout_s: float = 60.0
    gone_after: int = 3  # consecutive unanswered health checks before the replica counts as gone
    check_every_s: float | None = None  # health checks and lease renewals; None: a third of the lease

    def __post_init__(self) -> None:
        if self.kind not in ("target", "draft"):
            raise ValueError(f"kind must be 'target' or 'draft', got {self.kind!r}")
        if not self.redis_url:
            raise ValueError("a Redis URL is required (--redis-url or SPECDEC_REDIS_URL)")
        if self.lease_s <= 0 or self.drain_timeout_s < 0 or self.gone_after < 1:
            raise ValueError("lease must be > 0 s, drain timeout >= 0 s and gone-after >= 1")

    @property
    def interval_s(self) -> float:
        return self.check_every_s or self.lease_s / 3


def read_load(metrics_url: str, kind: str, capacity: int, timeout_s: float = 1.0) -> tuple[int, int] | None:
    """(sessions in a turn, free slots) from the service's Prometheus text, or None if unavailable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError:
        return None
    # Sessions in a turn; a service older than that gauge reports only all sessions it holds, idle
    # ones (kept caches) included.
    found = {family.name: family.samples[0].value for family in text_string_to_metric_families(text)
             if family.samples and family.name in (f"specdec_{kind}_sessions_in_turn", f"specdec_{kind}_sessions")}
    active = found.get(f"specdec_{kind}_sessions_in_turn", found.get(f"specdec_{kind}_sessions"))
    if active is None:
        return None
    return int(active), max(capacity - int(active), 0)


class Registrar:
    """One replica's registration; `run()` until `stop` is set, then drain and remove."""

    def __init__(self, settings: RegistrarSettings, registry: ReplicaRegistry):
        self.settings = settings
        self.registry = registry
        self.replica = Replica(
            replica_id=settings.replica_id, kind=settings.kind, pool=settings.pool,
            endpoint=settings.endpoint, model=settings.model, capacity=settings.capacity,
        )
        self.registered = False
        self.draining = False
        self._channel = grpc.aio.insecure_channel(settings.health_address, options=RECONNECT_BACKOFF)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def status(self) -> int | None:
        """The service's overall health status, or None if it does not answer."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            return reply.status
        except grpc.aio.AioRpcError:
            return None

    def _load(self) -> tuple[int | None, int | None]:
        if self.settings.metrics_url is None:
            return None, None
        load = read_load(self.settings.metrics_url, self.settings.kind, self.settings.capacity)
        return load if load is not None else (None, None)

    async def step(self, status: int | None, unanswered: int) -> None:
        """Bring the registration in line with one health observation."""
        if status == SERVING:
            if self.draining:  # healthy again: a fresh registration (remove() forgets the drain)
                await self.registry.remove(self.replica.replica_id)
                self.registered = self.draining = False
            active, free = await asyncio.to_thread(self._load)
            if self.registered:
                self.registered = await self.registry.heartbeat(self.replica, active, free)
            if not self.registered:
                current = self.replica if active is None else replace(
                    self.replica, active_sessions=active, free_slots=free)
                await self.registry.register(current)
                self.registered = True
                log.info("registered %s %s/%s at %s", self.replica.replica_id, self.replica.kind,
                         self.replica.pool, self.replica.endpoint)
        elif status is not None and self.registered:
            await self.drain()
            self.registered = await self.registry.heartbeat(self.replica)
        elif status is None and self.registered and unanswered >= self.settings.gone_after:
            await self.remove()

    async def drain(self) -> None:
        if self.registered and not self.draining:
            await self.registry.deregister(self.replica.replica_id)
            log.info("draining %s: no new sessions", self.replica.replica_id)
        self.draining = True

    async def remove(self) -> None:
        if self.registered:
            await self.registry.remove(self.replica.replica_id)
            log.info("removed %s", self.replica.replica_id)
        self.registered = self.draining = False

    async def run(self, stop: asyncio.Event) -> None:
        unanswered = 0
        try:
            while not stop.is_set():
                status = await self.status()
                unanswered = unanswered + 1 if status is None else 0
                try:
                    await self.step(status, unanswered)
                except Exception as exc:  # Redis away for a moment: retry at the next tick
                    log.warning("registry update for %s failed (%s); retrying", self.replica.replica_id, exc)
                    self.registered = False
                await _wait(stop, self.settings.interval_s)
            await self._drain_until_gone()
        finally:
            await self._channel.close()

    async def _drain_until_gone(self) -> None:
        """Stopped: keep the replica routable for its sessions while the service still answers."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout_s
        try:
            await self.drain()
            while self.registered and loop.time() < deadline and await self.status() is not None:
                self.registered = await self.registry.heartbeat(self.replica)
                await asyncio.sleep(min(self.settings.interval_s, max(deadline - loop.time(), 0)))
            await self.remove()
        except Exception as exc:
            log.warning("final deregistration of %s failed (%s); its lease will lapse", self.replica.replica_id, exc)


async def _wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        pass


async def run_registrar(settings: RegistrarSettings, stop: asyncio.Event) -> None:
    """Register, renew and finally remove one replica; returns after `stop` is set and the drain."""
    import redis.asyncio as redis

    client = redis.Redis.from_url(settings.redis_url)
    try:
        registry = ReplicaRegistry(client, settings.redis_prefix, lease_seconds=settings.lease_s)
        await Registrar(settings, registry).run(stop)
    finally:
        await client.aclose()


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m specdec.registrar", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["target", "draft"], required=True)
    parser.add_argument("--pool", choices=["speculative", "baseline"], default="speculative")
    parser.add_argument("--replica-id", default=env("POD_NAME") or socket.gethostname(),
                        help="unique per replica (default: $POD_NAME, else the host name)")
    parser.add_argument("--advertise-address", default=env("POD_IP"),
                        help="address the coordinator dials (default: $POD_IP)")
    parser.add_argument("--port", type=int, required=True, help="the service's gRPC port")
    parser.add_argument("--health-port", type=int, help="its plaintext health port (default: --port)")
    parser.add_argument("--metrics-port", type=int, help="its /metrics port, for load reports")
    parser.add_argument("--model", default="", help="model name recorded with the replica")
    parser.add_argument("--capacity", type=int, default=0, help="session slots (the service's --num-slots)")
    parser.add_argument("--redis-url", default=env("SPECDEC_REDIS_URL", ""))
    parser.add_argument("--redis-prefix", default=env("SPECDEC_REDIS_PREFIX", "specdec"))
    parser.add_argument("--lease", type=float, default=10.0, help="seconds a registration lives unrenewed")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds to keep a stopped replica routable while it still answers")
    return parser


def settings_from_args(args: argparse.Namespace) -> RegistrarSettings:
    if not args.advertise_address:
        raise ValueError("--advertise-address (or $POD_IP) is required")
    return RegistrarSettings(
        redis_url=args.redis_url, kind=args.kind, pool=args.pool, replica_id=args.replica_id,
        endpoint=host_port(args.advertise_address, args.port),
        health_address=host_port("127.0.0.1", args.health_port or args.port),
        metrics_url=f"http://127.0.0.1:{args.metrics_port}/metrics" if args.metrics_port else None,
        model=args.model, capacity=args.capacity, redis_prefix=args.redis_prefix, lease_s=args.lease,
        drain_timeout_s=args.drain_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(build_parser().parse_args(argv))
    except ValueError as exc:
        print(f"registrar: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_registrar(settings, stop)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
