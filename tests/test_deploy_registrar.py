"""The registrar (Kubernetes sidecar, Ray actor thread) mirrors a service's health in the replica
registry: SERVING registers, NOT_SERVING drains, gone removes, stopping drains then removes."""

from __future__ import annotations

import asyncio
import socket
import uuid

import grpc.aio
import pytest
import redis.asyncio as redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.registrar import RegistrarSettings, build_parser, host_port, run_registrar, settings_from_args
from specdec.store import ReplicaRegistry

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def eventually(predicate, timeout_s: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_registration_follows_health(redis_url):
    servicer = health.aio.HealthServicer()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", NOT_SERVING)  # still loading its model
    prefix = f"reg{uuid.uuid4().hex[:8]}"
    settings = RegistrarSettings(
        redis_url=redis_url, redis_prefix=prefix, kind="target", pool="baseline", replica_id="target-0",
        endpoint="10.1.2.3:50052", health_address=f"127.0.0.1:{port}", lease_s=0.6, drain_timeout_s=2.0,
    )
    client = redis.Redis.from_url(redis_url)
    registry = ReplicaRegistry(client, prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(run_registrar(settings, stop))
    try:
        await asyncio.sleep(0.5)
        assert await registry.list("target", "baseline") == []  # not before it serves

        await servicer.set("", SERVING)
        await eventually(lambda: _is(registry, endpoint="10.1.2.3:50052", draining=False))
        await asyncio.sleep(1.0)  # longer than the lease: renewals keep it listed
        assert await _is(registry, draining=False)

        await servicer.set("", NOT_SERVING)  # the service drains (SIGTERM, --drain-period)
        await eventually(lambda: _is(registry, draining=True))
        await servicer.set("", SERVING)  # healthy again: a fresh registration
        await eventually(lambda: _is(registry, draining=False))

        stop.set()  # the pod is deleted: drain while the service still answers, then remove
        await eventually(lambda: _is(registry, draining=True), timeout_s=2.0)
        await server.stop(0)
        await asyncio.wait_for(task, 5.0)
        assert await registry.get("target-0") is None
    finally:
        stop.set()
        await server.stop(0)
        await client.aclose()


@pytest.mark.slow  # waits 17 s for gRPC's default backoff to grow
async def test_a_service_that_starts_late_is_registered_within_seconds_of_serving(redis_url):
    """A pod's registrar starts with it, long before a big model has loaded. gRPC's default
    reconnect backoff (1 s, x1.6, up to 120 s) then kept the channel waiting: a service up after
    2 minutes was registered 66 s later. Reconnects now back off to at most 2 s."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    prefix = f"reg{uuid.uuid4().hex[:8]}"
    settings = RegistrarSettings(
        redis_url=redis_url, redis_prefix=prefix, kind="target", pool="speculative", replica_id="late-0",
        endpoint=f"127.0.0.1:{port}", health_address=f"127.0.0.1:{port}", lease_s=1.5,
    )
    client = redis.Redis.from_url(redis_url)
    registry = ReplicaRegistry(client, prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(run_registrar(settings, stop))
    server = grpc.aio.server()
    try:
        # Nothing listens for 17 s: the default backoff tries at about 1, 2.6, 5.2, 9.3, 15.8 and 26.3 s
        # (each +-20%), so it would find the service 7-12 s after it serves.
        await asyncio.sleep(17.0)
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await eventually(lambda: _is(registry, pool="speculative", replica_id="late-0", draining=False), timeout_s=4.0)
    finally:
        stop.set()
        await server.stop(0)
        await asyncio.wait_for(task, 5.0)
        await client.aclose()


async def test_a_vanished_service_is_removed(redis_url):
    servicer = health.aio.HealthServicer()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    prefix = f"reg{uuid.uuid4().hex[:8]}"
    settings = RegistrarSettings(
        redis_url=redis_url, redis_prefix=prefix, kind="draft", pool="speculative", replica_id="draft-0",
        endpoint="10.1.2.4:50053", health_address=f"127.0.0.1:{port}", lease_s=60.0, check_every_s=0.1, gone_after=2,
    )
    client = redis.Redis.from_url(redis_url)
    registry = ReplicaRegistry(client, prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(run_registrar(settings, stop))
    try:
        await eventually(lambda: _is(registry, kind="draft", pool="speculative", replica_id="draft-0"))
        await server.stop(0)  # killed outright (OOM, node lost): removed, not left listed for its lease
        await eventually(lambda: _gone(registry, "draft-0"))
    finally:
        stop.set()
        await asyncio.wait_for(task, 5.0)
        await client.aclose()


async def _gone(registry: ReplicaRegistry, replica_id: str) -> bool:
    return await registry.get(replica_id) is None


async def _is(registry: ReplicaRegistry, kind: str = "target", pool: str = "baseline", replica_id: str | None = None,
              **expected) -> bool:
    replicas = await registry.list(kind, pool)
    if len(replicas) != 1 or (replica_id and replicas[0].replica_id != replica_id):
        return False
    return all(getattr(replicas[0], name) == value for name, value in expected.items())


def test_flags_build_the_pod_endpoint(monkeypatch):
    monkeypatch.setenv("POD_IP", "fd00::17")
    monkeypatch.setenv("POD_NAME", "specdec-target-speculative-7c9f-abcde")
    monkeypatch.setenv("SPECDEC_REDIS_URL", "redis://:pw@redis:6379/0")
    args = build_parser().parse_args(["--kind", "target", "--port", "50052", "--health-port", "50062",
                                      "--metrics-port", "9102", "--capacity", "32"])
    settings = settings_from_args(args)
    assert settings.endpoint == "[fd00::17]:50052"  # IPv6 pod IPs in brackets
    assert settings.replica_id == "specdec-target-speculative-7c9f-abcde"
    assert settings.health_address == "127.0.0.1:50062"
    assert settings.metrics_url == "http://127.0.0.1:9102/metrics"
    assert host_port("10.0.0.7", 1) == "10.0.0.7:1"
    with pytest.raises(ValueError):
        RegistrarSettings(redis_url="", kind="target", pool="speculative", replica_id="x", endpoint="a:1",
                          health_address="b:2")


@pytest.mark.parametrize("gauges, expected", [
    ({"specdec_target_sessions": 40, "specdec_target_sessions_in_turn": 3}, (3, 29)),
    ({"specdec_target_sessions": 40}, (40, 0)),  # a service older than the in-turn gauge
    ({}, None),
], ids=["in-turn", "older-service", "no-gauge"])
def test_the_load_reported_is_the_sessions_in_a_turn(gauges, expected):
    """Kept caches of sessions between turns are not load: the registry gets the sessions in a
    turn (capacity 32: 29 slots free for new sessions), where a service has that gauge."""
    import http.server
    import threading

    from specdec.registrar import read_load

    text = "".join(f"# TYPE {name} gauge\n{name} {value}\n" for name, value in gauges.items()).encode()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert read_load(f"http://127.0.0.1:{server.server_port}/metrics", "target", 32) == expected
    finally:
        server.shutdown()
