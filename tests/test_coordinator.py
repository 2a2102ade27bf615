"""The coordinator over real gRPC, with a real Redis and the target and drafts as real subprocesses
on tiny random models: outputs equal plain decoding, sessions continue and resume, every token is
recorded before it is streamed, Cancel / EndSession / GetSession, bad input, spans and metrics.

Failures of replicas and of the coordinator itself are in test_coordinator_failover.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import grpc
import pytest

from coordinator_harness import Code, Reference, expected, read_some, request, running_coordinator, tokens_of
from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec.models.tokenizer import encode_continuation
from specdec.rpc import common_pb2
from specdec.rpc import coordinator_pb2 as pb
from specdec.server.settings import ClientSettings, TracingSettings
from specdec.store import SessionStatus
from specdec.testing.certs import make_test_certificates
from specdec.testing.tiny_models import TINY_EOS_ID
from target_service.client import connect as target_connect

CONTEXT = 256
PROMPTS = ["Name three colours.", "Count: 1, 2, 3"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return {"target": tiny_model_dir(base, "target", seed=0), "random": tiny_model_dir(base, "draft", seed=1)}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def services(dirs, certs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("coordinator-logs")
    plain = ["--plaintext"]
    # The target requires mutual TLS (the coordinator presents a client certificate) and prints its
    # spans, so the test can follow a trace into it.
    mtls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
            "--tls-client-ca", str(certs.ca_cert), "--health-port", "0"]
    trace_env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    procs = {
        # It also hosts a draft model, for --draft target:model.
        "target": launch("target_service", ["--model", str(dirs["target"]), "--max-context", str(CONTEXT),
                                            "--inner-draft", str(dirs["random"]), *mtls], log_dir=logs, env=trace_env),
        "random": launch("draft_service", ["--model", str(dirs["random"]), *plain], log_dir=logs),
        "same": launch("draft_service", ["--model", str(dirs["target"]), *plain], log_dir=logs),
        "ngram": launch("draft_service", ["--proposer", "ngram", "--tokenizer", str(dirs["target"]), *plain],
                        log_dir=logs),
    }
    wait_all(*procs.values())
    yield {**procs, "certs": certs}
    stop_all(*procs.values())


@pytest.fixture(scope="module")
def reference(dirs):
    return Reference(dirs["target"], CONTEXT)


def coordinator(redis_url, dirs, services, draft: str | None = "same", **kwargs):
    inner = {"local": "local:ngram", "target": "target:ngram", "target-model": "target:model"}
    drafts = [] if not draft else [inner.get(draft) or services[draft].address]
    certs = services["certs"]
    client = ClientSettings(tls_ca=certs.ca_cert, tls_cert=certs.client_cert, tls_key=certs.client_key, timeout_s=10.0)
    return running_coordinator(redis_url, dirs["target"], [services["target"].address], drafts,
                               target_client=client, **kwargs)


def raw_ids(reference: Reference, text: str) -> list[int]:
    return reference.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("draft", ["random", "same", "ngram", "local", "target", "target-model", "baseline", "disabled"])
async def test_greedy_output_equals_plain_decoding_and_is_recorded_before_it_is_streamed(
    redis_url, dirs, services, reference, draft
):
    n = 24
    options = {"baseline": dict(pool=pb.POOL_BASELINE), "disabled": dict(speculation={"enabled": False})}
    async with coordinator(redis_url, dirs, services, None if draft == "baseline" else
                           ("same" if draft == "disabled" else draft)) as c:
        for prompt in PROMPTS:
            prompt_ids = reference.prompt_ids(prompt)
            want = expected(reference, prompt_ids, n)
            messages, position = [], len(prompt_ids)
            async for m in c.stub.Generate(request(prompt=prompt, max_new_tokens=n, **options.get(draft, {}))):
                assert len(await c.tokens(m.session_id)) >= m.position  # recorded before streamed
                position += len(m.token_ids)
                assert m.position == position
                messages.append(m)
            final = messages[-1]
            assert tokens_of(messages) == want, draft
            assert final.finish_reason == (pb.FINISH_REASON_EOS if want[-1] == TINY_EOS_ID else pb.FINISH_REASON_LENGTH)
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt_ids), len(want))
            assert await c.tokens(final.session_id) == prompt_ids + want
            assert "".join(m.text for m in messages) == reference.tokenizer.decode(want, skip_special_tokens=True)
            stats = final.stats
            if draft in ("baseline", "disabled"):
                assert stats.cycles == 0 and stats.decode_steps == len(want) - 1 and stats.proposer == ""
                assert stats.pool == (pb.POOL_BASELINE if draft == "baseline" else pb.POOL_SPECULATIVE)
            else:
                assert stats.pool == pb.POOL_SPECULATIVE and stats.cycles > 0 and stats.fallbacks == 0
                assert stats.num_draft_tokens == 4 and stats.proposer
            if draft == "same":
                assert stats.accepted == stats.drafted > 0  # an identical draft is always accepted
            if draft.startswith("target"):  # drafted inside the target's stream: no Propose call
                assert stats.proposer == {"target": "ngram-target", "target-model": "draft-model-target"}[draft]
                assert stats.drafted > 0
                if draft == "target":  # (the random draft model is rarely right: its steps may hold one token)
                    assert stats.decode_steps + stats.cycles < len(want) - 1  # steps of several tokens


async def test_sampled_output_follows_the_seed_with_or_without_a_draft(redis_url, dirs, services):
    """Gumbel-coupled sampling is token for token plain sampling with the same seed; an unset seed
    is drawn per session and recorded."""
    gumbel = common_pb2.SamplingParams(temperature=1.0, top_p=0.9, seed=7, mode=common_pb2.SAMPLING_MODE_GUMBEL)
    async with coordinator(redis_url, dirs, services, "same") as c:
        spec = await c.generate(prompt=PROMPTS[0], max_new_tokens=16, sampling=gumbel)
        plain = await c.generate(prompt=PROMPTS[0], max_new_tokens=16, sampling=gumbel, pool=pb.POOL_BASELINE)
        unseeded = [await c.generate(prompt=PROMPTS[0], max_new_tokens=2,
                                     sampling=common_pb2.SamplingParams(temperature=1.0)) for _ in range(2)]
        seeds = [(await c.session(m[-1].session_id)).sampling.seed for m in (spec, *unseeded)]
    assert tokens_of(spec) == tokens_of(plain) and spec[-1].stats.cycles > 0
    assert seeds[0] == 7 and seeds[1] != seeds[2]


async def test_next_turn_appends_to_the_session_and_equals_plain_decoding_of_the_conversation(
    redis_url, dirs, services, reference
):
    first = {"role": "user", "content": "What is two plus two?"}
    second = {"role": "user", "content": "And three plus three?"}
    async with coordinator(redis_url, dirs, services, "same") as c:
        turn1 = await c.generate(messages=[("user", first["content"])], max_new_tokens=12)
        session_id = turn1[-1].session_id
        info1 = await c.session(session_id)
        turn2 = await c.generate(session_id=session_id, messages=[("user", second["content"])], max_new_tokens=12,
                                 sampling=common_pb2.SamplingParams(temperature=2.0))  # ignored: kept greedy
        info2 = await c.session(session_id)
    prompt = reference.prompt_ids(messages=[first])
    generated = tokens_of(turn1)
    assistant = {"role": "assistant", "content": reference.tokenizer.decode(generated, skip_special_tokens=True)}
    appended = encode_continuation(reference.tokenizer, [first, assistant], [second],
                                   ended_with_eos=generated[-1] == TINY_EOS_ID)
    conversation = prompt + generated + appended
    assert tokens_of(turn2) == expected(reference, conversation, 12)
    assert turn2[-1].usage.prompt_tokens == len(conversation)
    # The draft caught up through accept/rollback (its session was kept, never reopened).
    assert turn2[-1].stats.fallbacks == 0 and turn2[-1].stats.accepted == turn2[-1].stats.drafted > 0
    assert info2.turn_count == 2 and info2.turn_start_position == len(conversation)
    assert info2.prompt_length == len(prompt) and info2.position == len(conversation) + len(tokens_of(turn2))
    assert info2.state == pb.SESSION_STATE_IDLE and info2.pool == pb.POOL_SPECULATIVE
    assert info1.sampling.seed == info2.sampling.seed and info2.sampling.temperature == 0.0  # drawn once, kept
    assert info2.stats.cycles == turn1[-1].stats.cycles + turn2[-1].stats.cycles


async def test_prompt_lookup_inside_the_coordinator_continues_sessions_here_and_on_another_coordinator(
    redis_url, dirs, services, reference
):
    """--draft local:ngram: a session's next turn finds its lookup draft in the same coordinator; on
    another coordinator (a failover, a new replica) the draft is opened there. Both equal plain decoding."""
    text = "red green blue red green blue"
    prefix = f"local{time.monotonic_ns()}"  # one session store for both coordinators
    async with coordinator(redis_url, dirs, services, "local", prefix=prefix) as first:
        turn1 = await first.generate(prompt=text, max_new_tokens=12)
        session_id = turn1[-1].session_id
        turn2 = await first.generate(session_id=session_id, messages=[("user", text)], max_new_tokens=12)
    async with coordinator(redis_url, dirs, services, "local", prefix=prefix) as second:
        turn3 = await second.generate(session_id=session_id, messages=[("user", text)], max_new_tokens=12)
        tokens = await second.tokens(session_id)
    for turn in (turn1, turn2, turn3):
        start = turn[-1].position - len(tokens_of(turn))
        assert tokens_of(turn) == expected(reference, tokens[:start], 12)
        stats = turn[-1].stats
        assert stats.proposer == "ngram" and stats.cycles > 0 and stats.fallbacks == 0


@pytest.mark.parametrize("pool", [pb.POOL_SPECULATIVE, pb.POOL_BASELINE], ids=["speculative", "baseline"])
async def test_stop_sequence_inside_an_accepted_block_ends_the_output_there(redis_url, dirs, services, reference, pool):
    """Speculative: the stop falls inside an accepted block. Baseline: inside a streamed plain run,
    which the target has decoded past by then (it does not wait for the reader)."""
    prompt_ids = reference.prompt_ids(PROMPTS[0])
    plain = expected(reference, prompt_ids, 60)
    printable = [32 <= t < 127 for t in plain]
    end = next(i for i in range(4, len(plain)) if printable[i - 1] and printable[i]
               and bytes(plain[i - 1:i + 1]).decode() not in reference.tokenizer.decode(plain[:i]))
    stop = bytes(plain[end - 1:end + 1]).decode()
    async with coordinator(redis_url, dirs, services, "same") as c:
        messages = await c.generate(prompt=PROMPTS[0], max_new_tokens=60, stop_sequences=[stop, "\x00never"],
                                    pool=pool)
        session_id = messages[-1].session_id
        assert messages[-1].stats.pool == pool
        assert messages[-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert tokens_of(messages) == plain[: end + 1]
        assert "".join(m.text for m in messages).endswith(stop)
        committed = await c.tokens(session_id)
        assert committed == prompt_ids + plain[: end + 1]
        # Both caches were rolled back to the stop: the next turn continues from exactly there.
        nxt = await c.generate(session_id=session_id, prompt=" go on", raw=True, max_new_tokens=10, pool=pool)
        assert tokens_of(nxt) == expected(reference, committed + raw_ids(reference, " go on"), 10)
        assert nxt[-1].stats.fallbacks == 0


async def test_broken_stream_resumes_from_its_last_position(redis_url, dirs, services, reference):
    n = 60
    want = expected(reference, reference.prompt_ids(PROMPTS[1]), n)
    async with coordinator(redis_url, dirs, services, "random") as c:
        call = c.stub.Generate(request(prompt=PROMPTS[1], max_new_tokens=n))
        got = await read_some(call, 5)
        call.cancel()  # the client goes away mid-stream
        session_id, last = got[-1].session_id, got[-1].position
        info = await _wait_for_state(c, session_id, pb.SESSION_STATE_INTERRUPTED)
        # As if a coordinator had died between a cycle and its record: the target holds more.
        certs = services["certs"]
        async with target_connect(services["target"].address, ClientSettings(
                tls_ca=certs.ca_cert, tls_cert=certs.client_cert, tls_key=certs.client_key)) as target:
            await target.decode(session_id, info.position, 3)
        rest = await c.generate(session_id=session_id, resume=last)
        assert tokens_of(got) + tokens_of(rest) == want
        assert rest[0].position == last + len(rest[0].token_ids)
        assert rest[-1].usage.completion_tokens == len(want)
        # A finished turn replays from any position in it, and ends as it ended.
        info = await c.session(session_id)
        again = await c.generate(session_id=session_id, resume=info.turn_start_position + 3)
        assert tokens_of(again) == want[3:] and again[-1].finish_reason == rest[-1].finish_reason
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.generate(session_id=session_id, resume=info.turn_start_position - 1)
        assert refused.value.code() == Code.INVALID_ARGUMENT and "within the latest turn" in refused.value.details()


async def test_another_coordinator_resumes_a_stream_cut_by_graceful_shutdown(redis_url, dirs, services, reference):
    prefix = f"restart{time.monotonic_ns()}"
    async with coordinator(redis_url, dirs, services, "random", prefix=prefix,
                           server={"grace_period_s": 5.0}) as a:
        turn1 = await a.generate(prompt=PROMPTS[0], max_new_tokens=8)
        session_id = turn1[-1].session_id
        call = a.stub.Generate(request(session_id=session_id, prompt=" more", raw=True, max_new_tokens=160))
        got = await read_some(call, 3)
        # What SIGTERM does (main.serve_coordinator), with a short drain: running turns get 10 ms. (With
        # 0.1 s and 80 tokens, which took 110 ms after the third message, the turn sometimes finished.)
        drain = asyncio.ensure_future(a.coordinator.sessions.drain(0.02))
        a.host.begin_shutdown()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for m in call:
                got.append(m)
        await drain
        assert ended.value.code() == Code.UNAVAILABLE and "resume session" in ended.value.details()
    conversation = reference.prompt_ids(PROMPTS[0]) + tokens_of(turn1) + raw_ids(reference, " more")
    async with coordinator(redis_url, dirs, services, "random", prefix=prefix) as b:
        assert (await b.session(session_id)).state == pb.SESSION_STATE_INTERRUPTED
        rest = await b.generate(session_id=session_id, resume=got[-1].position)
        assert tokens_of(got) + tokens_of(rest) == expected(reference, conversation, 160)


async def test_cancel_stops_the_turn_frees_caches_and_the_session_continues(redis_url, dirs, services, reference):
    prefix = f"cancel{time.monotonic_ns()}"
    async with coordinator(redis_url, dirs, services, "random", prefix=prefix) as a, \
            coordinator(redis_url, dirs, services, "random", prefix=prefix) as b:
        for canceller in (a, b):  # here, and from another coordinator (through Redis)
            call = a.stub.Generate(request(prompt=PROMPTS[0], max_new_tokens=200))
            got = await read_some(call, 3)
            reply = await canceller.stub.Cancel(pb.CoordinatorServiceCancelRequest(session_id=got[0].session_id))
            got += [m async for m in call]
            assert reply.was_generating and got[-1].finish_reason == pb.FINISH_REASON_CANCELLED
            session_id = got[0].session_id
            info = await a.session(session_id)
            assert info.state == pb.SESSION_STATE_IDLE and not info.target_replica and not info.draft_replica
            committed = await a.tokens(session_id)
            prompt_ids = reference.prompt_ids(PROMPTS[0])
            assert committed == prompt_ids + tokens_of(got)
            assert tokens_of(got) == expected(reference, prompt_ids, len(tokens_of(got)))
        # The session goes on: its caches are rebuilt from Redis.
        nxt = await b.generate(session_id=session_id, prompt="!", raw=True, max_new_tokens=8)
        assert tokens_of(nxt) == expected(reference, committed + raw_ids(reference, "!"), 8)


async def test_end_session_forgets_it(redis_url, dirs, services):
    async with coordinator(redis_url, dirs, services, "same") as c:
        session_id = (await c.generate(prompt=PROMPTS[0], max_new_tokens=4))[-1].session_id
        end = pb.CoordinatorServiceEndSessionRequest(session_id=session_id)
        assert (await c.stub.EndSession(end)).existed
        assert not (await c.stub.EndSession(end)).existed
        for call in (c.session(session_id), c.generate(session_id=session_id, prompt="hi"),
                     c.stub.Cancel(pb.CoordinatorServiceCancelRequest(session_id=session_id))):
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await call
            assert missing.value.code() == Code.NOT_FOUND and "unknown or has ended" in missing.value.details()



async def test_a_stream_ended_elsewhere_is_cancelled_and_one_whose_record_vanished_is_data_loss(
        redis_url, dirs, services):
    prefix = f"tombstone{time.monotonic_ns()}"
    async with coordinator(redis_url, dirs, services, "random", prefix=prefix) as a, \
            coordinator(redis_url, dirs, services, "random", prefix=prefix) as b:
        # EndSession through another coordinator: the record stays as an "ended" tombstone, so the
        # stream on the first one ends as cancelled.
        call = a.stub.Generate(request(prompt=PROMPTS[0], max_new_tokens=200))
        got = await read_some(call, 3)
        assert (await b.stub.EndSession(pb.CoordinatorServiceEndSessionRequest(session_id=got[0].session_id))).existed
        got += [m async for m in call]
        assert got[-1].finish_reason == pb.FINISH_REASON_CANCELLED
        tombstone = await a.store.get(got[0].session_id)
        assert tombstone.status is SessionStatus.ENDED and tombstone.length == 0
        # The record vanishing (Redis restarted empty, an evicted key) is not an EndSession: the client
        # learns that the session is lost.
        call = a.stub.Generate(request(prompt=PROMPTS[1], max_new_tokens=200))
        got = await read_some(call, 3)
        assert await a.store.delete(got[0].session_id)
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            async for _ in call:
                pass
        assert lost.value.code() == Code.DATA_LOSS and "disappeared from Redis" in lost.value.details()


BAD_INPUT = [
    (dict(prompt=""), Code.INVALID_ARGUMENT, "prompt must not be empty"),
    (dict(max_new_tokens=3), Code.INVALID_ARGUMENT, "exactly one of prompt, messages or resume"),
    (dict(prompt="x" * 300, raw=True), Code.INVALID_ARGUMENT, "a prompt may have at most 255"),
    (dict(prompt="hi", max_new_tokens=0), Code.INVALID_ARGUMENT, "max_new_tokens must be in [1, 64]"),
    (dict(prompt="hi", max_new_tokens=-3), Code.INVALID_ARGUMENT, "max_new_tokens must be in [1, 64]"),
    (dict(prompt="hi", max_new_tokens=65), Code.INVALID_ARGUMENT, "max_new_tokens must be in [1, 64]"),
    (dict(prompt="hi", sampling=common_pb2.SamplingParams(temperature=-0.5)), Code.INVALID_ARGUMENT,
     "temperature must be >= 0"),
    (dict(prompt="hi", sampling=common_pb2.SamplingParams(temperature=float("inf"))), Code.INVALID_ARGUMENT,
     "temperature must be >= 0 and finite"),
    (dict(prompt="hi", sampling=common_pb2.SamplingParams(temperature=1e-300)), Code.INVALID_ARGUMENT,
     "0 (greedy) or in [0.0001, 10000]"),
    (dict(prompt="hi", sampling=common_pb2.SamplingParams(temperature=1e300)), Code.INVALID_ARGUMENT,
     "0 (greedy) or in [0.0001, 10000]"),
    (dict(prompt="hi", sampling=common_pb2.SamplingParams(top_p=0.0)), Code.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    (dict(prompt="hi", sampling=common_pb2.SamplingParams(top_p=1.5)), Code.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    (dict(prompt="hi", sampling=common_pb2.SamplingParams(top_k=-1)), Code.INVALID_ARGUMENT, "top_k must be >= 0"),
    (dict(prompt="hi", session_id="no-such-session"), Code.NOT_FOUND, "unknown or has ended"),
    (dict(resume=4), Code.INVALID_ARGUMENT, "resume needs the session_id"),
    (dict(messages=[("user", "hi")], raw=True), Code.INVALID_ARGUMENT, "raw applies to a prompt only"),
    (dict(prompt="hi", speculation={"num_draft_tokens": 99}), Code.INVALID_ARGUMENT, "num_draft_tokens must be in"),
    (dict(prompt="hi", stop_sequences=[""]), Code.INVALID_ARGUMENT, "each stop sequence must have"),
    (dict(prompt="x" * 70_000), Code.RESOURCE_EXHAUSTED, ""),
]


async def test_bad_input_is_refused_with_what_is_allowed(redis_url, dirs, services):
    async with coordinator(redis_url, dirs, services, "random", limits=_limits(64),
                           server={"max_message_bytes": 65_536}) as c:
        session_id = (await c.generate(prompt=PROMPTS[0], max_new_tokens=4))[-1].session_id
        for fields, code, message in BAD_INPUT:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await c.generate(**fields)
            assert refused.value.code() == code, fields
            assert message in (refused.value.details() or ""), (fields, refused.value.details())
        # A second turn while one is generating.
        call = c.stub.Generate(request(session_id=session_id, prompt="a", raw=True, max_new_tokens=64))
        await read_some(call, 1)
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await c.generate(session_id=session_id, prompt="b", raw=True)
        assert busy.value.code() == Code.FAILED_PRECONDITION and "is being generated" in busy.value.details()
        await c.stub.Cancel(pb.CoordinatorServiceCancelRequest(session_id=session_id))
        call.cancel()
        # The service and the session are unaffected.
        assert (await c.generate(session_id=session_id, prompt="c", raw=True, max_new_tokens=2))[-1].finish_reason
        assert (await c.generate(prompt=PROMPTS[1], max_new_tokens=2))[-1].usage.completion_tokens == 2


def _limits(limit: int):
    from coordinator.requests import Limits

    return Limits(default_max_new_tokens=16, max_new_tokens_limit=limit, max_draft_tokens=8)


async def test_spans_link_request_cycles_and_the_target_across_processes(redis_url, dirs, services):
    """Verify goes as messages of the session's stream (server/cycle_streams.py), each with its own
    client span and the target's server span under it, named as the unary call's."""
    async with coordinator(redis_url, dirs, services, "same") as c:
        messages = await c.generate(prompt=PROMPTS[0], max_new_tokens=12)
        spans = c.exporter.get_finished_spans()
        assert c.coordinator.router.target(services["target"].address)._cycle_streams.answered > 0
    by_id = {s.context.span_id: s for s in spans}
    request_span = next(s for s in spans if s.name.startswith("chat "))
    attributes = request_span.attributes
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["specdec.pool"] == "speculative"
    assert attributes["gen_ai.usage.output_tokens"] == 12
    assert attributes["gen_ai.usage.input_tokens"] == messages[-1].usage.prompt_tokens
    assert attributes["gen_ai.conversation.id"] == messages[-1].session_id
    assert attributes["gen_ai.request.max_tokens"] == 12 and attributes["gen_ai.request.temperature"] == 0.0
    assert by_id[request_span.parent.span_id].name.endswith("CoordinatorService/Generate")  # the server span
    cycles = [s for s in spans if s.name == "specdec.cycle"]
    assert cycles and all(s.parent.span_id == request_span.context.span_id for s in cycles)
    verified = [s for s in cycles if "specdec.num_accepted" in s.attributes]
    assert verified and all(s.attributes["specdec.next_token_kind"] == "bonus" for s in verified)
    for name in ("specdec.propose", "specdec.verify", "specdec.commit"):
        children = [s for s in spans if s.name == name]
        assert children and all(by_id[s.parent.span_id].name == "specdec.cycle" for s in children
                                if s.start_time > cycles[0].start_time), name
    first_commit = min((s for s in spans if s.name == "specdec.commit"), key=lambda s: s.start_time)
    assert first_commit.parent.span_id == request_span.context.span_id  # the first token: before any cycle
    verify_calls = [s for s in spans if s.name.endswith("TargetService/Verify")]
    assert verify_calls and all(by_id[s.parent.span_id].name == "specdec.verify" for s in verify_calls)
    assert {s.context.trace_id for s in spans} == {request_span.context.trace_id}
    # The target service continued the trace: its Verify span is the child of our client span.
    trace_id = f"0x{request_span.context.trace_id:032x}"
    client_ids = {f"0x{s.context.span_id:016x}" for s in verify_calls}
    target_spans = await _spans_logged(services["target"], trace_id)
    assert any(s["name"].endswith("TargetService/Verify") and s["parent_id"] in client_ids for s in target_spans)


async def test_a_new_sessions_draft_prefills_beside_the_target(redis_url, dirs, services, reference):
    """The draft's StartSession goes out with the target's, not inside the first cycle after the first
    token (specdec/generation/draft_opening.py): the two calls overlap, the draft opens once, and the
    answer is plain decoding's. A draft that fails to open fails no request (the greedy test's
    "random" draft and tests/test_coordinator_failover.py)."""
    async with coordinator(redis_url, dirs, services, "same") as c:
        messages = await c.generate(prompt=PROMPTS[1], max_new_tokens=12)
        spans = c.exporter.get_finished_spans()
    assert tokens_of(messages) == expected(reference, reference.prompt_ids(PROMPTS[1]), 12)
    target_start = [s for s in spans if s.name.endswith("TargetService/StartSession")]
    draft_start = [s for s in spans if s.name.endswith("DraftService/StartSession")]
    assert len(target_start) == 1 and len(draft_start) == 1 and messages[-1].stats.cycles > 0
    assert draft_start[0].start_time < target_start[0].end_time  # sent before the first token came back
    first_cycle = min((s for s in spans if s.name == "specdec.cycle"), key=lambda s: s.start_time)
    assert draft_start[0].start_time < first_cycle.start_time


async def test_cycle_spans_are_sampled(redis_url, dirs, services):
    tracing = TracingSettings(cycle_span_every=1000)
    async with coordinator(redis_url, dirs, services, "random", server={"tracing": tracing}) as c:
        messages = await c.generate(prompt=PROMPTS[0], max_new_tokens=12)
        spans = c.exporter.get_finished_spans()
    assert messages[-1].stats.cycles > 2
    assert len([s for s in spans if s.name == "specdec.cycle"]) == 1  # only the first of many
    assert len([s for s in spans if s.name == "specdec.verify"]) == 1


async def test_metrics_are_scraped(redis_url, dirs, services):
    async with coordinator(redis_url, dirs, services, "same") as c:
        await c.generate(prompt=PROMPTS[0], max_new_tokens=12)
        text = urllib.request.urlopen(f"http://127.0.0.1:{c.host.metrics_port}/metrics", timeout=5).read().decode()
    labels = 'pool="speculative",proposer="draft-model"'
    for series in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                   "e2e_request_latency_seconds_count"):
        assert f"specdec_coordinator_{series}{{{labels}}} 1.0" in text, series
    assert f'specdec_coordinator_requests_total{{{labels},status="OK"}} 1.0' in text
    assert f"specdec_coordinator_output_tokens_total{{{labels}}} 12.0" in text
    drafted = float(re.search(rf"specdec_coordinator_draft_tokens_total{{{labels}}} (\S+)", text).group(1))
    accepted = float(re.search(rf"specdec_coordinator_accepted_tokens_total{{{labels}}} (\S+)", text).group(1))
    assert drafted == accepted > 0
    assert 'specdec_coordinator_accepted_tokens_by_position_total{pool="speculative",position="0",' in text
    assert f"specdec_coordinator_cycles_total{{{labels}}}" in text


async def _wait_for_state(c, session_id: str, state, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (info := await c.session(session_id)).state != state and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert info.state == state
    return info


async def _spans_logged(service, trace_id: str, timeout_s: float = 10.0) -> list[dict]:
    """Spans of one trace from a service's console exporter output (JSON objects in its log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [s for s in _json_objects(service.log_path.read_text(errors="replace"))
                 if s.get("context", {}).get("trace_id") == trace_id]
        if found or time.monotonic() > deadline:
            return [{"name": s["name"], "parent_id": s.get("parent_id")} for s in found]
        await asyncio.sleep(0.1)


def _json_objects(text: str) -> list[dict]:
    decoder, objects, i = json.JSONDecoder(), [], 0
    while (i := text.find("{\n", i)) != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        objects.append(obj)
        i = end
    return [o for o in objects if isinstance(o, dict) and "context" in o]
