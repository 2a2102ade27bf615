"""The internal channels' default deadline: unary calls without one get ClientSettings.timeout_s;
the streamed call (the public Generate) keeps whatever deadline its caller set, none included."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.server.credentials import create_channel
from specdec.server.settings import ClientSettings

pytestmark = pytest.mark.asyncio


async def _slow_unary(request: bytes, context) -> bytes:
    await asyncio.sleep(1.0)
    return request


async def _slow_stream(request: bytes, context):
    for _ in range(4):
        await asyncio.sleep(0.25)
        yield request


@pytest.fixture
async def address():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Slow", {
        "Unary": grpc.unary_unary_rpc_method_handler(_slow_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(_slow_stream),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_unary_calls_get_the_default_deadline_and_streams_do_not(address):
    channel = create_channel(address, ClientSettings(plaintext=True, timeout_s=0.3), trace=False)
    async with channel:
        unary = channel.unary_unary("/t.Slow/Unary")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await unary(b"x")
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await unary(b"y", timeout=5.0) == b"y"  # a deadline the caller sets is kept
        # 1 s of streaming: past the 0.3 s default, which a long generation must not inherit.
        chunks = [c async for c in channel.unary_stream("/t.Slow/Stream")(b"z")]
        assert chunks == [b"z"] * 4
