"""DecodeStream over real gRPC (the target service as a subprocess on a tiny random model): the
streamed tokens are plain decoding's, token by token; a caller that stops reading and truncates
finds the session exactly where it stopped, whatever step the stream had started meanwhile; any
other call of the session ends its stream; bad input gets the same statuses as Decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid

import grpc
import grpc.aio
import pytest

from inprocess_target import hosted
from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec import errors
from specdec.engine.api import InnerDraft
from specdec.engine.cycle_cost import measure_cycle
from specdec.engine.inner_length import PLAIN_REASONS
from specdec.engine.target import TargetEngine
from specdec.models.loader import load_model
from specdec.rpc import ACTUAL_POSITION_KEY, target_pb2, target_pb2_grpc
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.server.settings import ClientSettings
from target_service.client import connect

Code = grpc.StatusCode
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
PROMPT = [1, 5, 9, 12, 5, 9]
CONTEXT = 256


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)


def _serve(target_dir, logs, *extra: str):
    proc = launch("target_service", ["--model", str(target_dir), "--max-context", str(CONTEXT), "--plaintext",
                                     *extra], log_dir=logs)
    wait_all(proc)
    return proc


@pytest.fixture(scope="module")
def service(target_dir, tmp_path_factory):
    proc = _serve(target_dir, tmp_path_factory.mktemp("stream-logs"), "--num-slots", "8")
    yield proc
    stop_all(proc)


@pytest.fixture(scope="module")
def drafting_service(target_dir, tmp_path_factory):
    """A target hosting a draft model: itself, so that every drafted token is right (the coordinator
    tests host a random draft, whose tokens are rejected)."""
    proc = _serve(target_dir, tmp_path_factory.mktemp("drafting-stream-logs"), "--inner-draft", str(target_dir))
    yield proc
    stop_all(proc)


@pytest.fixture(scope="module")
def slow_service(target_dir, tmp_path_factory):
    """Steps of 30 ms or more, so that a Truncate lands while the stream is still early on."""
    proc = _serve(target_dir, tmp_path_factory.mktemp("slow-stream-logs"), "--test-delay-ms", "30")
    yield proc
    stop_all(proc)


@pytest.fixture(scope="module")
def reference(target_dir):
    """Plain decoding on an in-process engine, one token per call: what every stream must equal."""
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=8, max_context=CONTEXT))

    @functools.lru_cache(maxsize=None)
    def cached(params: SamplingParams, n: int) -> tuple[int, ...]:
        session_id = uuid.uuid4().hex
        position, first = engine.start_session(session_id, PROMPT, params)
        tokens = [first] + [engine.decode(session_id, position + i, 1)[0] for i in range(n - 1)]
        engine.end_session(session_id)
        return tuple(tokens)

    return lambda n, params=GREEDY: list(cached(params, n))


@contextlib.asynccontextmanager
async def session(service, params: SamplingParams = GREEDY):
    async with connect(service.address, ClientSettings(plaintext=True, timeout_s=30.0)) as target:
        session_id = uuid.uuid4().hex
        position, _ = await target.start_session(session_id, PROMPT, params)
        yield target, session_id, position
        await target.end_session(session_id)


async def read(stream, count: int) -> list[int]:
    tokens = []
    async for step in stream:
        assert len(step) == 1  # one message per step
        tokens += step
        if len(tokens) == count:
            break
    return tokens


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_a_stream_is_plain_decoding_token_by_token(service, reference, params):
    expected = reference(40, params)
    async with session(service, params) as (target, session_id, position):
        tokens = [t async for step in target.decode_stream(session_id, position, 20) for t in step]
        assert tokens == expected[1:21]
        # Everything streamed is committed: plain decoding continues from there.
        assert await target.decode(session_id, position + 20, 5) == expected[21:26]


async def test_every_message_reports_its_step_as_model_time(service, reference):
    async with session(service) as (target, session_id, position):
        with measure_cycle() as cost:
            assert await read(target.decode_stream(session_id, position, 1), 1) == reference(2)[1:]
    assert 0 < cost.target_model_s <= cost.handler_s <= cost.calls_s


async def test_the_stream_ends_right_after_a_stop_token(service, reference):
    expected = reference(30)
    stop_token = expected[6]
    cut = expected[1:].index(stop_token) + 1
    async with session(service) as (target, session_id, position):
        tokens = [t async for step in target.decode_stream(session_id, position, 25, stop_token_ids=[stop_token])
                  for t in step]
        assert tokens == expected[1:1 + cut]
        assert await target.decode(session_id, position + cut, 2) == expected[1 + cut:3 + cut]


@pytest.mark.parametrize("read_count", [1, 3, 7])
async def test_a_caller_that_stops_reading_truncates_and_continues_exactly(service, reference, read_count):
    """The service runs a step ahead of its reader; the reader's Truncate undoes whatever it ran."""
    expected = reference(30)
    async with session(service) as (target, session_id, position):
        stream = target.decode_stream(session_id, position, 25)
        assert await read(stream, read_count) == expected[1:1 + read_count]
        await stream.aclose()  # cancels the call
        stopped = position + read_count
        assert await target.truncate(session_id, stopped) == stopped
        assert await target.decode(session_id, stopped, 4) == expected[1 + read_count:5 + read_count]


async def test_any_other_call_of_the_session_ends_its_stream_and_no_step_commits_after(slow_service, reference):
    """The service runs ahead of its reader (as fast as its steps go, whatever was read), so only
    slow steps show where a stream ended: within a step or two of the other call."""
    expected = reference(60)
    async with session(slow_service) as (target, session_id, position):
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        call = stub.DecodeStream(target_pb2.TargetServiceDecodeStreamRequest(
            session_id=session_id, position=position, num_tokens=50))
        first = [m async for m in _take(call, 2)]
        assert [m.token_ids[0] for m in first] == expected[1:3] and first[-1].position == position + 2
        # The caller never cancels: its Truncate alone must end the stream.
        assert await target.truncate(session_id, position + 2) == position + 2
        rest = [m async for m in call]  # ends at once (what was sent before the Truncate came), with OK
        assert len(rest) <= 3 and await call.code() == Code.OK
        assert await target.decode(session_id, position + 2, 3) == expected[3:6]
        # A second stream of the same session ends the first one too.
        older = target.decode_stream(session_id, position + 5, 40)
        assert await read(older, 1) == expected[6:7]
        await target.truncate(session_id, position + 6)
        newer = [t async for step in target.decode_stream(session_id, position + 6, 3) for t in step]
        assert newer == expected[7:10]
        assert len(await read(older, 40)) <= 3  # ended: at most what it had sent before the Truncate
        await older.aclose()


async def test_bad_input_gets_decodes_statuses_and_other_sessions_are_unaffected(service, reference):
    expected = reference(12)
    async with session(service) as (target, session_id, position):
        with pytest.raises(errors.PositionMismatch) as mismatch:
            await read(target.decode_stream(session_id, position + 3, 2), 2)
        assert mismatch.value.actual == position
        with pytest.raises(errors.SessionNotFound):
            await read(target.decode_stream("no-such-session", 1, 2), 2)
        with pytest.raises(errors.InvalidArgument):
            await read(target.decode_stream(session_id, position, -1), 1)
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        call = stub.DecodeStream(target_pb2.TargetServiceDecodeStreamRequest(
            session_id=session_id, position=position + 1, num_tokens=1))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == Code.FAILED_PRECONDITION
        assert (ACTUAL_POSITION_KEY, str(position)) in tuple(err.value.trailing_metadata())
        with pytest.raises(errors.InvalidArgument, match="context"):  # past the context: refused up front
            await read(target.decode_stream(session_id, position, CONTEXT), 1)
        # Nothing moved.
        assert await read(target.decode_stream(session_id, position, 4), 4) == expected[1:5]


async def test_a_lookup_stream_drafts_inside_the_target_and_is_plain_decoding(service, reference):
    """lookup_draft_tokens: steps of several tokens, each message saying what it drafted and
    accepted, the tokens those of plain decoding; too long a draft is refused, nothing moved."""
    expected = reference(40)
    async with session(service) as (target, session_id, position):
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        messages = [m async for m in stub.DecodeStream(target_pb2.TargetServiceDecodeStreamRequest(
            session_id=session_id, position=position, num_tokens=39, lookup_draft_tokens=4))]
        assert [t for m in messages for t in m.token_ids] == expected[1:]
        assert messages[-1].position == position + 39
        for m in messages:
            assert len(m.token_ids) == (m.num_accepted + 1 if m.num_drafted else 1) and m.num_drafted <= 4
        assert len(messages) < 39 and sum(m.num_accepted for m in messages) > 0
        with pytest.raises(errors.InvalidArgument, match="model_draft_tokens are at most 64"):
            await read(target.decode_stream(session_id, position + 39, 2, inner_draft=InnerDraft("ngram", 65)), 1)
        outcomes = []  # the client reports each drafted step's outcome into the cycle it is read in
        stream = target.decode_stream(session_id, position + 39, 11, inner_draft=InnerDraft("ngram", 4))
        tokens = []
        while True:
            with measure_cycle() as cost:
                step = await anext(stream, None)
            if step is None:
                break
            tokens += step
            outcomes.append(cost.inner_draft)
        assert tokens == reference(51)[40:] and outcomes[0] is None  # the first step decodes: no draft
        assert any(o is not None and o.num_drafted for o in outcomes)


async def test_the_target_counts_why_its_streams_steps_verified_no_draft(target_dir, reference):
    """specdec_target_stream_plain_steps: lookup streams batched together under a step cost where no
    drafted token pays (compute-bound) decode plainly, each such step counted under the trimmer's
    name; their tokens are plain decoding's."""
    from specdec.server.service import BatchSettings
    from target_service.servicer import TargetServicer

    expected = reference(24)
    async with hosted(target_dir, TargetServicer, num_slots=4, max_context=CONTEXT, batching=BatchSettings(batch_wait_s=0.005),
                      trim_drafts=True) as (target, servicer):
        servicer.trimmer.cost.fit = lambda rows=1: (0.01, 0.05)  # as if measured: every drafted token costs a row

        async def one() -> list[int]:
            session_id = uuid.uuid4().hex
            position, _ = await target.start_session(session_id, PROMPT, GREEDY)
            return [t async for step in target.decode_stream(session_id, position, 23, inner_draft=InnerDraft("ngram", 4))
                    for t in step]

        got = await asyncio.gather(one(), one(), one())
        counted = {why: servicer.metrics.stream_plain_steps.labels(why)._value.get() for why in PLAIN_REASONS}
    assert got == [expected[1:]] * 3
    assert counted["trimmer"] > 0 and counted["failed"] == 0


GUMBEL = SamplingParams(temperature=1.0, top_p=0.9, seed=5, mode=SamplingMode.GUMBEL)


@pytest.mark.parametrize("params", [GREEDY, GUMBEL], ids=["greedy", "gumbel"])
async def test_a_stream_drafted_by_the_hosted_draft_model_is_plain_decoding(drafting_service, reference, params):
    """model_draft_tokens: the target's own draft model drafts each step (distributions included:
    Gumbel-coupled sampling is token for token plain sampling); two turns in a row reuse its
    session, the second with the adaptive length; both fields at once are refused, and so is an
    adaptive length with neither; a target hosting no draft decodes plainly."""
    expected = reference(50, params)
    async with session(drafting_service, params) as (target, session_id, position):
        stub = target_pb2_grpc.TargetServiceStub(target.channel)

        async def stream(at: int, n: int, **fields):
            return [m async for m in stub.DecodeStream(target_pb2.TargetServiceDecodeStreamRequest(
                session_id=session_id, position=at, num_tokens=n, **fields))]

        first = await stream(position, 20, model_draft_tokens=3)
        second = await stream(position + 20, 29, model_draft_tokens=6, adaptive_draft_length=True)
        assert [t for m in first + second for t in m.token_ids] == expected[1:]
        drafted = sum(m.num_drafted for m in first + second)
        assert sum(m.num_accepted for m in first + second) == drafted > 20  # the same model: all accepted
        for m in first + second:
            assert len(m.token_ids) == (m.num_accepted + 1 if m.num_drafted else 1)
            assert (m.timing.draft_model_ns > 0) == (m.num_drafted > 0)  # drafting is model time, reported apart
        assert max(m.num_drafted for m in first) <= 3 and max(m.num_drafted for m in second) <= 6
        with pytest.raises(grpc.aio.AioRpcError) as both:
            await stream(position + 49, 2, model_draft_tokens=2, lookup_draft_tokens=2)
        assert both.value.code() == Code.INVALID_ARGUMENT and "not both" in both.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as neither:
            await stream(position + 49, 2, adaptive_draft_length=True)
        assert neither.value.code() == Code.INVALID_ARGUMENT and "needs lookup_draft_tokens" in neither.value.details()


async def test_a_target_hosting_no_draft_model_decodes_plainly(service, reference):
    async with session(service) as (target, session_id, position):
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        messages = [m async for m in stub.DecodeStream(target_pb2.TargetServiceDecodeStreamRequest(
            session_id=session_id, position=position, num_tokens=10, model_draft_tokens=3))]
        assert [t for m in messages for t in m.token_ids] == reference(11)[1:]
        assert all(m.num_drafted == 0 and len(m.token_ids) == 1 for m in messages)


async def _take(call, count: int):
    got = 0
    while got < count:
        message = await call.read()
        if message is grpc.aio.EOF:
            return
        got += 1
        yield message


def test_concurrent_streams_of_many_sessions_are_each_plain_decoding(service, reference):
    """Sessions streaming at once share batched steps; each still gets its own tokens."""
    expected = reference(24)

    async def one() -> list[int]:
        async with session(service) as (target, session_id, position):
            return [t async for step in target.decode_stream(session_id, position, 23) for t in step]

    async def main():
        return await asyncio.gather(*(one() for _ in range(6)))

    assert asyncio.run(main()) == [expected[1:]] * 6



async def test_a_target_older_than_decode_stream_gets_one_decode_call_per_step(target_dir, reference):
    """An older target answers DecodeStream with UNIMPLEMENTED: the client says so once and decodes
    with Decode calls, with the same tokens, the stop token honoured."""
    from target_service.servicer import TargetServicer

    class OlderTarget(TargetServicer):
        async def DecodeStream(self, request, context):
            await context.abort(Code.UNIMPLEMENTED, "Method not found!")
            yield  # a streamed handler is an async generator

    expected = reference(20)
    stop_token = expected[9]
    cut = expected[1:].index(stop_token) + 1
    async with hosted(target_dir, OlderTarget, max_context=CONTEXT) as (target, _):
        session_id = uuid.uuid4().hex
        position, _ = await target.start_session(session_id, PROMPT, GREEDY)
        tokens = [t async for step in target.decode_stream(session_id, position, 15, stop_token_ids=[stop_token])
                  for t in step]
        assert tokens == expected[1:1 + cut] and target._decode_stream_unimplemented
        more = [t async for step in target.decode_stream(session_id, position + cut, 3) for t in step]
        assert more == expected[1 + cut:4 + cut]


@pytest.mark.parametrize("beta, limits", [(0.05, {0}), (0.0, {8})], ids=["compute-bound", "flat"])
async def test_each_message_says_what_a_draft_of_the_session_would_have_kept(target_dir, reference, beta, limits):
    """With goodput trimming on, a message whose step batched the session with others carries the
    trimmer's draft_limit for it (0 where drafted tokens would not pay, 8 where they cost nothing),
    the client reports it into the cycle, and a step the session had alone carries none."""
    from specdec.server.service import BatchSettings
    from target_service.servicer import TargetServicer

    expected = reference(13)
    async with hosted(target_dir, TargetServicer, num_slots=4, max_context=CONTEXT, batching=BatchSettings(batch_wait_s=0.005),
                      trim_drafts=True, trim_margin=0.2) as (target, servicer):
        servicer.trimmer.cost.fit = lambda rows=1: (0.01, beta)  # the step cost, as if measured: not the tiny model's

        async def one() -> tuple[list[int], list[int | None]]:
            session_id = uuid.uuid4().hex
            position, _ = await target.start_session(session_id, PROMPT, GREEDY)
            tokens, told = [], []
            stream = target.decode_stream(session_id, position, 12)
            for _ in range(12):
                with measure_cycle() as cost:
                    tokens += await anext(stream)
                told.append(cost.target_draft_limit)
            await stream.aclose()
            return tokens, told

        together = await asyncio.gather(one(), one(), one())
        alone_tokens, alone_told = await one()
    assert [tokens for tokens, _ in together] == [expected[1:]] * 3 and alone_tokens == expected[1:]
    told = [limit for _, each in together for limit in each]
    assert set(told) - {None} == limits and told.count(None) < len(told) / 2
    assert set(alone_told) == {None}
