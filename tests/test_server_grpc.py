"""The server toolkit over real gRPC on localhost: TLS / mTLS / plaintext, bearer tokens, error
mapping, health (main and plaintext port), reflection, graceful shutdown, deadlines, executor.

The test surface is a raw-bytes service built from grpc's generic handlers, so these tests do not
depend on the project's protos.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import signal
import time

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec import errors
from specdec.server.bootstrap import ModelExecutor, ServiceHost, serve
from specdec.server.credentials import call_timeout, create_channel
from specdec.server.interceptors import ACTUAL_POSITION_KEY
from specdec.server.settings import ClientSettings, ServerSettings
from specdec.testing.certs import make_test_certificates

SERVICE = "specdec.test.Echo"
Code = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

DOMAIN_ERRORS = {
    "invalid": (errors.InvalidArgument("temperature must be >= 0, got -1.0"), Code.INVALID_ARGUMENT),
    "overflow": (
        errors.ContextOverflow("prompt of 9000 tokens exceeds the context of 8192"),
        Code.INVALID_ARGUMENT,
    ),
    "not_found": (errors.SessionNotFound("s-1"), Code.NOT_FOUND),
    "exists": (errors.SessionExists("s-1"), Code.ALREADY_EXISTS),
    "position": (errors.PositionMismatch("s-1", expected=5, actual=7), Code.FAILED_PRECONDITION),
    "full": (errors.CacheFull("all 8 cached sessions are active; retry later"), Code.RESOURCE_EXHAUSTED),
    "incompatible": (
        errors.IncompatibleModels("draft vocab 32000 != target vocab 49152"),
        Code.FAILED_PRECONDITION,
    ),
}


class EpochMismatch(Exception):
    """A service's own error type, mapped through ServiceHost(error_codes=...)."""

    def trailing_metadata(self):
        return [("specdec-latest-epoch", "3")]


PLAIN = ServerSettings(port=0, plaintext=True, grace_period_s=0.0)
PLAIN_CLIENT = ClientSettings(plaintext=True, timeout_s=5.0)


def echo_service(register_log: list | None = None):
    async def echo(request, context):
        return request

    async def fail(request, context):
        if request == b"crash":
            raise RuntimeError("secret internals: /home/model/weights.bin")
        if request == b"epoch":
            raise EpochMismatch("proposal epoch 2 is stale; the latest is 3")
        raise DOMAIN_ERRORS[request.decode()][0]

    async def fail_stream(request, context):
        yield b"first"
        raise DOMAIN_ERRORS[request.decode()][0]

    async def sleep(request, context):
        await asyncio.sleep(float(request))
        return b"slept"

    async def count(request, context):
        for i in range(int(request)):
            yield str(i).encode()

    async def abort(request, context):
        await context.abort(Code.DATA_LOSS, "the handler aborted on purpose")

    generic = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Fail": grpc.unary_unary_rpc_method_handler(fail),
            "FailStream": grpc.unary_stream_rpc_method_handler(fail_stream),
            "Sleep": grpc.unary_unary_rpc_method_handler(sleep),
            "Count": grpc.unary_stream_rpc_method_handler(count),
            "Abort": grpc.unary_unary_rpc_method_handler(abort),
        },
    )

    def register(server):
        server.add_generic_rpc_handlers((generic,))
        return [SERVICE]

    return register


@contextlib.asynccontextmanager
async def running(settings: ServerSettings, **kwargs):
    host = ServiceHost(settings, echo_service(), **kwargs)
    await host.start()
    try:
        yield host
    finally:
        await host.shutdown()


def connect(port: int, client: ClientSettings = PLAIN_CLIENT) -> grpc.aio.Channel:
    return create_channel(f"127.0.0.1:{port}", client)  # the production stack: deadline + tracing


async def unary(channel, method: str, request: bytes = b"hi", **kwargs) -> bytes:
    return await channel.unary_unary(f"/{SERVICE}/{method}")(request, **kwargs)


async def check(channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


def tls_settings(certs, **kwargs) -> ServerSettings:
    return ServerSettings(
        port=0, tls_cert=certs.server_cert, tls_key=certs.server_key, grace_period_s=0.0, **kwargs
    )


# --- transport security -------------------------------------------------------------------------


async def test_plaintext_only_when_configured():
    async with running(PLAIN) as host, connect(host.port) as channel:
        assert await unary(channel, "Echo", b"ping") == b"ping"


async def test_tls_serves_clients_that_trust_the_ca(certs):
    async with running(tls_settings(certs)) as host:
        async with connect(host.port, ClientSettings(tls_ca=certs.ca_cert)) as channel:
            assert await unary(channel, "Echo", b"ping") == b"ping"
        for client in (PLAIN_CLIENT, ClientSettings(timeout_s=5.0)):  # plaintext; system roots
            async with connect(host.port, client) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await unary(channel, "Echo")
                assert info.value.code() == Code.UNAVAILABLE


async def test_mutual_tls_rejects_clients_without_a_trusted_cert(certs):
    settings = tls_settings(certs, tls_client_ca=certs.ca_cert)
    no_cert = ClientSettings(tls_ca=certs.ca_cert)
    foreign = ClientSettings(
        tls_ca=certs.ca_cert, tls_cert=certs.foreign_client_cert, tls_key=certs.foreign_client_key
    )
    good = ClientSettings(tls_ca=certs.ca_cert, tls_cert=certs.client_cert, tls_key=certs.client_key)
    async with running(settings) as host:
        for client in (no_cert, foreign):
            async with connect(host.port, client) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await unary(channel, "Echo")
                assert info.value.code() == Code.UNAVAILABLE
        async with connect(host.port, good) as channel:
            assert await unary(channel, "Echo", b"ok") == b"ok"


async def test_mutual_tls_serves_health_on_a_separate_plaintext_port(certs):
    settings = tls_settings(certs, tls_client_ca=certs.ca_cert, health_port=0, drain_period_s=0.5)
    host = ServiceHost(settings, echo_service())
    await host.start()
    async with connect(host.health_port) as probe:
        assert await check(probe) == SERVING
        assert await check(probe, SERVICE) == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:  # only health lives on that port
            await unary(probe, "Echo")
        assert info.value.code() == Code.UNIMPLEMENTED
        shutdown = host.begin_shutdown()
        await asyncio.sleep(0.1)  # inside the drain period
        assert await check(probe) == NOT_SERVING
        assert await check(probe, SERVICE) == NOT_SERVING
        await shutdown


async def test_oversized_messages_are_refused():
    settings = dataclasses.replace(PLAIN, max_message_bytes=1024)
    async with running(settings) as host, connect(host.port) as channel:
        assert await unary(channel, "Echo", b"x" * 512) == b"x" * 512
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(channel, "Echo", b"x" * 4096)
        assert info.value.code() == Code.RESOURCE_EXHAUSTED


# --- bearer tokens ------------------------------------------------------------------------------


async def test_bearer_tokens(certs):
    settings = tls_settings(certs, auth_tokens=frozenset({"alpha-token", "beta-token"}))
    client = ClientSettings(tls_ca=certs.ca_cert, timeout_s=5.0)
    async with running(settings) as host:
        async with connect(host.port, client) as channel:
            for call in (unary(channel, "Echo"), channel.unary_unary("/no.Such/Method")(b"")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == Code.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unary(channel, "Echo", metadata=(("authorization", "Basic YWxwaGE="),))
            assert info.value.code() == Code.UNAUTHENTICATED
            assert await check(channel) == SERVING  # health is exempt
            assert SERVICE in await list_services(channel)  # and so is reflection
        wrong = dataclasses.replace(client, auth_token="gamma-token")
        async with connect(host.port, wrong) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unary(channel, "Echo")
            assert info.value.code() == Code.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [m async for m in channel.unary_stream(f"/{SERVICE}/Count")(b"3")]
            assert info.value.code() == Code.PERMISSION_DENIED
        for token in ("alpha-token", "beta-token"):
            async with connect(host.port, dataclasses.replace(client, auth_token=token)) as channel:
                assert await unary(channel, "Echo", b"in") == b"in"
                assert [m async for m in channel.unary_stream(f"/{SERVICE}/Count")(b"2")] == [b"0", b"1"]


# --- error mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DOMAIN_ERRORS))
async def test_domain_errors_map_to_status_codes(name):
    error, code = DOMAIN_ERRORS[name]
    async with running(PLAIN) as host, connect(host.port) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(channel, "Fail", name.encode())
        assert (info.value.code(), info.value.details()) == (code, str(error))
        trailing = dict(info.value.trailing_metadata() or ())
        assert trailing.get(ACTUAL_POSITION_KEY) == ("7" if name == "position" else None)

        call = channel.unary_stream(f"/{SERVICE}/FailStream")(name.encode())
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for message in call:
                received.append(message)
        assert received == [b"first"]
        assert (info.value.code(), info.value.details()) == (code, str(error))


async def test_services_can_map_their_own_errors_with_trailing_metadata():
    async with running(PLAIN, error_codes={EpochMismatch: Code.FAILED_PRECONDITION}) as host:
        async with connect(host.port) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unary(channel, "Fail", b"epoch")
    assert info.value.code() == Code.FAILED_PRECONDITION
    assert info.value.details() == "proposal epoch 2 is stale; the latest is 3"
    assert dict(info.value.trailing_metadata())["specdec-latest-epoch"] == "3"


async def test_unexpected_errors_are_internal_and_logged_not_leaked(caplog):
    caplog.set_level(logging.ERROR, logger="specdec.server.interceptors")
    async with running(PLAIN) as host, connect(host.port) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(channel, "Fail", b"crash")
        assert info.value.code() == Code.INTERNAL
        assert "secret" not in info.value.details() and "Fail" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:  # a deliberate abort passes through
            await unary(channel, "Abort")
        assert (info.value.code(), info.value.details()) == (Code.DATA_LOSS, "the handler aborted on purpose")
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)


# --- health, reflection, shutdown ---------------------------------------------------------------


async def list_services(channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    response = await call.read()
    call.cancel()
    return {s.name for s in response.list_services_response.service}


async def test_reflection_lists_services():
    async with running(PLAIN) as host, connect(host.port) as channel:
        assert await list_services(channel) == {
            SERVICE,
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }


async def test_health_serving_then_not_serving_during_graceful_shutdown():
    host = ServiceHost(dataclasses.replace(PLAIN, grace_period_s=1.0), echo_service())
    await host.start()
    async with connect(host.port) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert (await watch.read()).status == SERVING
        in_flight = asyncio.ensure_future(unary(channel, "Sleep", b"0.4"))
        await asyncio.sleep(0.1)
        shutdown = host.begin_shutdown()
        assert (await asyncio.wait_for(watch.read(), 2)).status == NOT_SERVING
        assert await in_flight == b"slept"  # in-flight work finishes within the grace period
        await shutdown
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(channel, "Echo")
        assert info.value.code() == Code.UNAVAILABLE


async def test_health_check_callable_drives_the_status():
    healthy = True
    async with running(PLAIN, health_check=lambda: healthy, health_check_interval_s=0.05) as host:
        async with connect(host.port) as channel:
            assert await check(channel, SERVICE) == SERVING
            healthy = False
            await asyncio.sleep(0.3)
            assert await check(channel) == NOT_SERVING
            assert await check(channel, SERVICE) == NOT_SERVING


async def test_model_executor_keeps_the_loop_responsive():
    executor = ModelExecutor("test-model")
    marker = contextvars.ContextVar("marker", default=None)
    marker.set("from-caller")
    async with running(PLAIN, on_shutdown=executor.aclose) as host, connect(host.port) as channel:
        forward = asyncio.ensure_future(executor.run(lambda: (time.sleep(0.6), marker.get())[1]))
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        assert await check(channel) == SERVING
        assert time.perf_counter() - started < 0.3  # answered while the "forward pass" runs
        assert await forward == "from-caller"  # the caller's context travels into the thread


async def test_default_deadline_applies_to_calls_without_one():
    async with running(PLAIN) as host:
        async with connect(host.port, ClientSettings(plaintext=True, timeout_s=0.2)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unary(channel, "Sleep", b"2")
            assert info.value.code() == Code.DEADLINE_EXCEEDED
            assert await unary(channel, "Sleep", b"0.3", timeout=3) == b"slept"  # explicit wins
    assert call_timeout(5.0) == 5.0


async def test_serve_stops_gracefully_on_sigterm():
    events: list[str] = []
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            PLAIN,
            echo_service(),
            on_shutdown=[lambda: events.append("hook")],
            on_started=started.set_result,
        )
    )
    host = await asyncio.wait_for(started, 5)
    async with connect(host.port) as channel:
        assert await unary(channel, "Echo", b"up") == b"up"
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 5)
    assert events == ["hook"] and host.stopping


async def test_a_second_signal_cancels_in_flight_calls():
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    settings = dataclasses.replace(PLAIN, grace_period_s=30.0)
    task = asyncio.ensure_future(serve(settings, echo_service(), on_started=started.set_result))
    host = await asyncio.wait_for(started, 5)
    async with connect(host.port) as channel:
        in_flight = asyncio.ensure_future(unary(channel, "Sleep", b"20"))
        await asyncio.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.2)
        assert not task.done()  # waiting for the in-flight call, up to the 30 s grace
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(task, 5)
        with pytest.raises(grpc.aio.AioRpcError):
            await in_flight
