"""A session's per-cycle calls as messages of one stream (specdec/server/cycle_streams.py).

The answers themselves are tested where the calls are (test_target_service, test_draft_service, and
end to end through the coordinator in test_coordinator_pipelining, whose harness streams). Here: how
the client keeps streams safe, first against the real target service (a subprocess on a tiny model),
then, for what a real service cannot be made to do on cue (be old, be slow, close a stream), against
an in-process gRPC server whose answers are canned.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import grpc
import grpc.aio
import pytest
import torch

from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec import errors
from specdec.rpc import target_pb2, target_pb2_grpc
from specdec.sampling.params import SamplingParams
from specdec.server.client_base import domain_error
from specdec.server.cycle_streams import SessionStreams
from specdec.server.settings import ClientSettings
from specdec.types import DraftBlock
from target_service.client import TargetClient, connect

STREAM = ClientSettings(plaintext=True, timeout_s=30.0, cycle_calls="stream")
PROMPT = [1, 5, 9, 12, 5, 9]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)
    proc = launch("target_service", ["--model", str(model), "--max-context", "256", "--plaintext"],
                  log_dir=tmp_path_factory.mktemp("stream-logs"))
    wait_all(proc)
    yield proc
    stop_all(proc)


def block(*tokens: int) -> DraftBlock:
    return DraftBlock(token_ids=torch.tensor(tokens))


def end(outcome) -> int:
    """The committed length after a Verify (outcome.position is where it verified from)."""
    return outcome.position + outcome.num_accepted + 1


async def test_a_refused_message_ends_the_stream_and_the_next_call_opens_another(target):
    async with connect(target.address, STREAM) as client:
        session, position = uuid.uuid4().hex, 0
        position, _ = await client.start_session(session, PROMPT, SamplingParams())
        bystander, bystander_position = uuid.uuid4().hex, 0
        bystander_position, _ = await client.start_session(bystander, PROMPT, SamplingParams())
        first = await client.verify(session, position, block(3, 4))
        call = client._cycle_streams._open[session].call
        second = await client.verify(session, end(first), block(3))
        assert client._cycle_streams._open[session].call is call  # one stream for the session's cycles
        with pytest.raises(errors.PositionMismatch) as mismatch:
            await client.verify(session, end(first), block(3))  # already past it
        assert mismatch.value.actual == end(second)
        assert session not in client._cycle_streams._open and call.done()
        with pytest.raises(errors.InvalidArgument, match="at most"):
            await client.verify(session, end(second), block(*[1] * 99))
        # Nothing moved: the session and its neighbour go on, on new streams.
        assert end(await client.verify(session, end(second), block(3))) > end(second)
        assert end(await client.verify(bystander, bystander_position, block(3))) > bystander_position
        with pytest.raises(errors.SessionNotFound):
            await client.verify("nope", 1, block(3))
        assert client._cycle_streams.answered == 4 and set(client._cycle_streams._open) == {session, bystander}


async def test_a_late_answer_discards_the_stream_and_a_stream_closed_while_idle_is_replaced(target):
    async with connect(target.address, STREAM) as client:
        session = uuid.uuid4().hex
        position, _ = await client.start_session(session, PROMPT, SamplingParams())
        outcome = await client.verify(session, position, block(3))
        client._cycle_streams._open[session].call.cancel()  # as a restarted service would end it
        outcome = await client.verify(session, end(outcome), block(3))  # on a new stream
        impatient = TargetClient(client.channel, timeout_s=1e-4, stream_cycle_calls=True)
        with pytest.raises(errors.ServiceUnavailable, match="no answer"):
            await impatient.verify(session, end(outcome), block(3, 4, 5, 6))
        assert len(impatient._cycle_streams) == 0
        # Whether the late Verify committed is unknown, as after a call past its deadline: realign.
        await asyncio.sleep(0.5)  # (once the service is done with it)
        held = await client.truncate(session, end(outcome))
        assert end(await client.verify(session, held, block(3))) > held


async def test_a_stopping_service_ends_its_idle_streams_instead_of_waiting_its_grace(tmp_path_factory):
    """Open streams must not hold a restart for its whole grace period (server/message_streams.py):
    SIGTERM with a 30 s grace ends an idle stream at once, with status OK, the service exits, and the
    session's next call is refused like any call to a stopped service."""
    model = tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)
    proc = launch("target_service", ["--model", str(model), "--max-context", "256", "--plaintext",
                                     "--grace-period", "30"], log_dir=tmp_path_factory.mktemp("stopping-logs"))
    wait_all(proc)
    try:
        async with connect(proc.address, STREAM) as client:
            session = uuid.uuid4().hex
            position, _ = await client.start_session(session, PROMPT, SamplingParams())
            outcome = await client.verify(session, position, block(3))
            call = client._cycle_streams._open[session].call
            started = time.monotonic()
            proc.signal(signal.SIGTERM)
            assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
            assert await asyncio.to_thread(proc.proc.wait, 20) == 0
            assert time.monotonic() - started < 15  # not the 30 s grace
            with pytest.raises(errors.ServiceUnavailable):
                await client.verify(session, end(outcome), block(3))
    finally:
        stop_all(proc)


# ---- against an in-process server with canned answers ------------------------------------------


class CannedTarget(target_pb2_grpc.TargetServiceServicer):
    """Answers Verify (and VerifyStream unless `old`) after `delay_s`, counting calls by kind."""

    def __init__(self, old: bool = False, delay_s: float = 0.0, hang_up: bool = False):
        self.old, self.delay_s, self.hang_up = old, delay_s, hang_up
        self.calls = {"unary": 0, "stream": 0, "streams": 0}

    async def answer(self, request) -> target_pb2.TargetServiceVerifyResponse:
        await asyncio.sleep(self.delay_s)
        return target_pb2.TargetServiceVerifyResponse(num_drafted=len(request.draft_token_ids), next_token_id=7,
                                                      position=request.position + 1)  # none accepted

    async def Verify(self, request, context):
        self.calls["unary"] += 1
        return await self.answer(request)

    async def VerifyStream(self, requests, context):
        if self.old:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        self.calls["streams"] += 1
        if self.hang_up:  # ends every stream at once, status OK
            return
        async for message in requests:
            self.calls["stream"] += 1
            if message.verify.position == 99:  # the service shutting down: it ends the stream unanswered
                return
            yield target_pb2.TargetServiceVerifyStreamResponse(verify=await self.answer(message.verify))


async def canned(servicer: CannedTarget, **options) -> tuple[grpc.aio.Server, TargetClient]:
    server = grpc.aio.server()
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, TargetClient(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), stream_cycle_calls=True, **options)


async def test_an_older_service_without_the_stream_is_called_unary_from_then_on():
    servicer = CannedTarget(old=True)
    server, client = await canned(servicer)
    try:
        for position in (10, 11, 12):
            assert end(await client.verify("s", position, block(1))) == position + 1
        assert client._cycle_streams.unimplemented and servicer.calls["unary"] == 3
    finally:
        await client.close()
        await server.stop(None)


async def test_a_second_call_of_a_busy_session_goes_unary_and_idle_streams_are_closed():
    servicer = CannedTarget(delay_s=0.2)
    server, client = await canned(servicer)
    try:
        together = await asyncio.gather(client.verify("s", 10, block(1)), client.verify("s", 20, block(1)))
        assert [end(o) for o in together] == [11, 21]  # each answer paired with its own request
        assert servicer.calls["stream"] == 1 and servicer.calls["unary"] == 1
        with pytest.raises(errors.ServiceUnavailable, match="closed the session's stream"):
            await client.verify("s", 99, block(1))
        streams = client._cycle_streams
        streams.idle_s = 0.0  # every idle stream is past it: opening one closes the others
        await client.verify("a", 1, block(1))
        await client.verify("b", 1, block(1))
        assert list(streams._open) == ["b"]
        streams.idle_s, streams.max_open = 60.0, 2
        for session in ("c", "d", "e"):
            await client.verify(session, 1, block(1))
        assert list(streams._open) == ["d", "e"]  # the least recently used went
    finally:
        await client.close()
        await server.stop(None)


async def test_a_stream_that_ended_before_the_write_is_not_a_lost_request():
    """grpc.aio refuses a write on an ended call with InvalidStateError, not its status: a stream the
    service closed (OK) sends this call unary; one that failed reports the failure as a domain error."""
    servicer = CannedTarget(hang_up=True)
    server, client = await canned(servicer)
    try:
        closed = client._stub.VerifyStream()
        assert await closed.code() == grpc.StatusCode.OK
        streams = SessionStreams(lambda metadata=None: closed, *TargetClient.CYCLE_STREAM[2:],
                                 service="target service", timeout_s=5.0)
        request = target_pb2.TargetServiceVerifyRequest(session_id="s", position=3, draft_token_ids=[1])
        assert await streams.call("s", request, lambda err: domain_error(err, "target service")) is None
        await server.stop(None)
        failed = client._stub.VerifyStream()
        assert await failed.code() == grpc.StatusCode.UNAVAILABLE
        streams = SessionStreams(lambda metadata=None: failed, *TargetClient.CYCLE_STREAM[2:],
                                 service="target service", timeout_s=5.0)
        with pytest.raises(errors.ServiceUnavailable, match="UNAVAILABLE"):
            await streams.call("s", request, lambda err: domain_error(err, "target service"))
        assert len(streams) == 0
    finally:
        await client.close()
        await server.stop(None)
