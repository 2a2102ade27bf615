"""The target service over real gRPC: the server as a subprocess (`python -m target_service`) on a
tiny random model, plus one in-process server where the test must reach into the engine.

Three subprocesses start together, once for the module: `main` (plaintext, 4 slots), `secure`
(mutual TLS, a bearer token, a plaintext health port, 2 slots for cache pressure) and `doomed`
(short session TTL; the SIGTERM test ends it, so its tests come last).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import subprocess
import sys
import uuid

import grpc
import grpc.aio
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service_procs import REPO, launch, stop_all, tiny_model_dir, wait_all
from specdec import errors
from specdec.engine.target import TargetEngine
from specdec.models.loader import load_model
from specdec.models.tokenizer import load_tokenizer, vocab_fingerprint
from specdec.rpc import ACTUAL_POSITION_KEY, common_pb2, target_pb2, target_pb2_grpc
from specdec.sampling.params import SamplingParams
from specdec.server.settings import ClientSettings
from specdec.testing.certs import make_test_certificates
from specdec.testing.tiny_models import TINY_EOS_ID
from specdec.types import DraftBlock
from target_service.client import TargetClient, connect

Code = grpc.StatusCode
GREEDY = SamplingParams()
PROMPT = [1, 5, 9, 12, 5, 9]
TOKEN = "s3cret-token"
CONTEXT = 256
PLAIN = ClientSettings(plaintext=True, timeout_s=30.0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def services(target_dir, certs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("target-logs")
    tokens = logs / "tokens.txt"
    tokens.write_text(f"# accepted tokens\n{TOKEN}\n")
    model = ["--model", str(target_dir), "--max-context", str(CONTEXT)]
    procs = {
        "main": launch("target_service", [*model, "--plaintext", "--num-slots", "4", "--max-draft-tokens", "8",
                                          "--max-message-bytes", "65536"], log_dir=logs),
        # --evict-after 0: the eviction test below calls round robin faster than any protection window
        "secure": launch("target_service", [*model, "--num-slots", "2", "--evict-after", "0", "--tls-cert", str(certs.server_cert),
                                            "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca_cert),
                                            "--auth-tokens-file", str(tokens), "--health-port", "0"], log_dir=logs),
        "doomed": launch("target_service", ["--model", str(target_dir), "--max-context", "512", "--plaintext",
                                            "--session-ttl", "1", "--grace-period", "20"], log_dir=logs),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


@pytest.fixture(scope="module")
def reference(target_dir):
    """Plain greedy decoding on an in-process engine: what every answer must equal."""
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=8, max_context=CONTEXT))

    @functools.lru_cache(maxsize=None)
    def cached(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
        session_id = uuid.uuid4().hex
        engine.start_session(session_id, prompt, GREEDY)
        tokens = engine.committed_tokens(session_id)[len(prompt):] + engine.decode(session_id, len(prompt) + 1, n - 1)
        engine.end_session(session_id)
        return tuple(tokens)

    return lambda prompt, n: list(cached(tuple(prompt), n))


def client(proc, settings: ClientSettings = PLAIN, **kwargs) -> TargetClient:
    return connect(proc.address, settings, **kwargs)


def secure_settings(certs, token: str | None = TOKEN, client_cert: str = "client") -> ClientSettings:
    """Mutual TLS (client_cert "client", "foreign": signed by another CA, or None) and a bearer token."""
    cert = {"client": (certs.client_cert, certs.client_key), None: (None, None),
            "foreign": (certs.foreign_client_cert, certs.foreign_client_key)}[client_cert]
    return ClientSettings(tls_ca=certs.ca_cert, tls_cert=cert[0], tls_key=cert[1], auth_token=token, timeout_s=10.0)


async def new_session(target: TargetClient, prompt=PROMPT) -> tuple[str, int]:
    session_id = uuid.uuid4().hex
    position, _ = await target.start_session(session_id, prompt, GREEDY)
    return session_id, position


# ---- the service answers ---------------------------------------------------------------------


async def test_health_reflection_and_info(services, target_dir):
    main = services["main"]
    assert main.serving()
    async with grpc.aio.insecure_channel(main.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {"specdec.v1.TargetService", "grpc.health.v1.Health"} <= names
    async with client(main) as target:
        info = await target.describe()
    assert (info.model.architecture, info.model.dtype, info.model.device, info.model.backend) == \
        ("llama", "float32", "cpu", "native")
    assert (info.model.vocab_size, info.model.max_context, info.num_slots) == (256, CONTEXT, 4)
    assert info.model.name == str(target_dir)
    assert info.vocab_fingerprint == vocab_fingerprint(load_tokenizer(target_dir))
    assert info.eos_token_ids == (TINY_EOS_ID,)
    assert 0 <= info.free_slots <= 4 and info.server_version


@pytest.mark.parametrize("cycle_calls", ["unary", "stream"])
async def test_decode_and_verify_equal_plain_decoding(services, reference, cycle_calls):
    """Verify as a call each, and as messages of the session's stream (VerifyStream)."""
    expected = reference(PROMPT, 16)
    async with client(services["main"], ClientSettings(plaintext=True, timeout_s=30.0, cycle_calls=cycle_calls)) as target:
        session_id, position = await new_session(target)
        assert await target.decode(session_id, position, 5) == expected[1:6]
        # A block of the right tokens is accepted whole and the bonus token is the next one.
        block = DraftBlock(token_ids=torch.tensor(expected[6:10]))
        outcome = await target.verify(session_id, position + 5, block, epoch=7)
        assert (outcome.num_drafted, outcome.num_accepted, outcome.next_token) == (4, 4, expected[10])
        assert outcome.position == position + 5 and outcome.is_bonus
        # A wrong first token is rejected; the recovered token is the target's own.
        wrong = DraftBlock(token_ids=torch.tensor([(expected[11] + 1) % 256, 3]))
        outcome = await target.verify(session_id, position + 10, wrong)
        assert (outcome.num_accepted, outcome.next_token) == (0, expected[11])
        if cycle_calls == "stream":  # both on one stream, which ending the session closes
            assert target._cycle_streams.answered == 2 and len(target._cycle_streams) == 1
        assert await target.end_session(session_id) is True
        assert target._cycle_streams is None or len(target._cycle_streams) == 0


async def test_decode_stops_after_a_stop_token(services, reference):
    expected = reference(PROMPT, 20)
    stop_token = expected[6]
    cut = expected[1:].index(stop_token) + 1  # generated tokens up to and including the stop token
    async with client(services["main"]) as target:
        session_id, position = await new_session(target)
        tokens = await target.decode(session_id, position, 15, stop_token_ids=[stop_token, 9999])
        assert tokens == expected[1:1 + cut]
        assert await target.decode(session_id, position + cut, 2) == expected[1 + cut:3 + cut]  # committed
        await target.end_session(session_id)


async def test_position_mismatch_reports_the_actual_position(services, reference):
    expected = reference(PROMPT, 8)
    async with client(services["main"]) as target:
        session_id, position = await new_session(target)
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        calls = [
            stub.Verify(target_pb2.TargetServiceVerifyRequest(session_id=session_id, position=position - 1,
                                                              draft_token_ids=[1, 2])),
            stub.Decode(target_pb2.TargetServiceDecodeRequest(session_id=session_id, position=position + 3,
                                                              num_tokens=1)),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == Code.FAILED_PRECONDITION
            assert (ACTUAL_POSITION_KEY, str(position)) in tuple(err.value.trailing_metadata())
            assert f"at position {position}" in err.value.details()
        with pytest.raises(errors.PositionMismatch) as mismatch:
            await target.decode(session_id, position + 1, 1)
        assert mismatch.value.actual == position
        # Nothing moved: the session continues as plain decoding does.
        assert await target.decode(session_id, position, 3) == expected[1:4]
        # Truncate is idempotent and never grows the sequence.
        assert await target.truncate(session_id, position + 2) == position + 2
        assert await target.truncate(session_id, position + 2) == position + 2
        assert await target.truncate(session_id, 999) == position + 2
        assert await target.decode(session_id, position + 2, 2) == expected[3:5]
        await target.end_session(session_id)


async def test_unknown_session_is_not_found(services):
    async with client(services["main"]) as target:
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        for call in (stub.Decode(target_pb2.TargetServiceDecodeRequest(session_id="nope", position=1, num_tokens=1)),
                     stub.Verify(target_pb2.TargetServiceVerifyRequest(session_id="nope", position=1)),
                     stub.Truncate(target_pb2.TargetServiceTruncateRequest(session_id="nope", position=1))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == Code.NOT_FOUND and "'nope' is unknown" in err.value.details()
        with pytest.raises(errors.SessionNotFound):
            await target.decode("nope", 1, 1)
        assert await target.end_session("nope") is False  # idempotent, not an error
        session_id, _ = await new_session(target)
        with pytest.raises(errors.SessionExists):
            await target.start_session(session_id, PROMPT, GREEDY)
        assert await target.end_session(session_id) is True
        assert await target.end_session(session_id) is False


# ---- bad input: refused with what is allowed, nothing else affected ------------------------------


def _start(tokens=PROMPT, session_id="bad", **sampling):
    return "StartSession", target_pb2.TargetServiceStartSessionRequest(
        session_id=session_id, token_ids=tokens, sampling=common_pb2.SamplingParams(**sampling),
        sample_first_token=True)


BAD_INPUT = {
    "empty-prompt": (_start(tokens=[]), Code.INVALID_ARGUMENT, "must not be empty"),
    "token-out-of-vocab": (_start(tokens=[1, 256]), Code.INVALID_ARGUMENT, "in [0, 256)"),
    "prompt-past-context": (_start(tokens=[7] * CONTEXT), Code.INVALID_ARGUMENT, "context length 256"),
    "top-p-zero": (_start(top_p=0.0), Code.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    "negative-top-k": (_start(top_k=-1), Code.INVALID_ARGUMENT, "top_k must be >= 0"),
    "negative-temperature": (_start(temperature=-0.5), Code.INVALID_ARGUMENT, "temperature must be >= 0"),
    "no-session-id": (_start(session_id=""), Code.INVALID_ARGUMENT, "session_id must be a non-empty string"),
    "oversized-message": (_start(tokens=[200] * 40_000), Code.RESOURCE_EXHAUSTED, "larger than max"),
    "too-many-draft-tokens": (("Verify", {"draft_token_ids": [1] * 9}), Code.INVALID_ARGUMENT, "at most 8 draft tokens"),
    "draft-token-out-of-vocab": (("Verify", {"draft_token_ids": [1, 999]}), Code.INVALID_ARGUMENT, "in [0, 256)"),
    "rows-mismatch": (("Verify", {"draft_token_ids": [1, 2], "draft_distributions": common_pb2.SparseDistributions(
        token_ids=[1], probs=[1.0], row_lengths=[1])}), Code.INVALID_ARGUMENT, "one row per draft token"),
    "append-out-of-vocab": (("Decode", {"append_token_ids": [-1], "num_tokens": 1}), Code.INVALID_ARGUMENT, "in [0, 256)"),
    "decode-past-context": (("Decode", {"num_tokens": 10_000}), Code.INVALID_ARGUMENT, "context length 256"),
    "truncate-to-zero": (("Truncate", {"position": 0}), Code.INVALID_ARGUMENT, "must be >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
async def test_bad_input_is_refused_and_other_sessions_are_unaffected(services, reference, case):
    (method, request), code, message = BAD_INPUT[case]
    expected = reference(PROMPT, 4)
    async with client(services["main"]) as target:
        bystander, position = await new_session(target)
        victim, victim_position = await new_session(target)
        if isinstance(request, dict):  # a call on an existing session
            cls = getattr(target_pb2, f"TargetService{method}Request")
            fields = {"position": victim_position, **request}
            request = cls(session_id=victim, **fields)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(target_pb2_grpc.TargetServiceStub(target.channel), method)(request, timeout=10)
        assert err.value.code() == code, err.value.details()
        assert message in err.value.details()
        assert await target.decode(bystander, position, 3) == expected[1:4]
        assert await target.decode(victim, victim_position, 3) == expected[1:4]  # intact too
        for session_id in (bystander, victim):
            await target.end_session(session_id)


async def test_client_refuses_negative_num_tokens(services):
    async with client(services["main"]) as target:
        with pytest.raises(errors.InvalidArgument, match="num_tokens must be >= 0"):
            await target.decode("any", 1, -1)


async def test_deadline_exceeded_is_service_unavailable(services):
    async with client(services["main"]) as target:
        session_id, position = await new_session(target)
        impatient = TargetClient(target.channel, timeout_s=0.001)
        with pytest.raises(errors.ServiceUnavailable, match="DEADLINE_EXCEEDED"):
            await impatient.decode(session_id, position, 100)
        await target.end_session(session_id)


async def test_metrics_are_scraped(services):
    async with client(services["main"]) as target:
        session_id, position = await new_session(target)
        await target.verify(session_id, position, DraftBlock(token_ids=torch.tensor([1, 2])))
        text = services["main"].metrics()
        await target.end_session(session_id)
    for name in ('specdec_target_step_seconds_bucket{le="0.001",step="verify"}',
                 'specdec_target_step_seconds_count{step="prefill"}', 'specdec_target_tokens_total{step="verify"}',
                 "specdec_target_kv_cache_slots_total 4.0", "specdec_target_kv_cache_slots_used",
                 "specdec_target_sessions", "specdec_target_sessions_in_turn", "specdec_target_evictions_total"):
        assert name in text, name


# ---- in process: the engine reachable from the test ---------------------------------------------


async def test_resource_exhausted_only_when_every_session_is_active_and_spans(target_dir, reference):
    """One slot, its session marked in use (as while a call on it runs): a new session gets
    RESOURCE_EXHAUSTED; once it is idle, it is evicted instead and later re-fed. Server spans carry
    the session attributes and continue the client's trace."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from specdec.observability.metrics import TargetMetrics, new_registry
    from specdec.observability.tracing import setup_tracing
    from specdec.server.bootstrap import ModelExecutor, ServiceHost
    from specdec.server.settings import ServerSettings
    from target_service.servicer import TargetServicer

    exporter = InMemorySpanExporter()
    provider = setup_tracing("test-target", exporter=exporter)
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=1, max_context=CONTEXT))
    executor = ModelExecutor("test-target")
    servicer = TargetServicer(engine, executor, TargetMetrics(new_registry(process=False)), max_draft_tokens=8)
    servicer.message_streams.tracer = provider.get_tracer("test-target")  # as serve_model_service does

    def register(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["specdec.v1.TargetService"]

    host = ServiceHost(ServerSettings(port=0, plaintext=True, grace_period_s=0.0), register, tracer_provider=provider)
    await host.start()
    expected = reference(PROMPT, 6)
    try:
        async with connect(f"127.0.0.1:{host.port}", PLAIN, tracer_provider=provider) as target:
            first, position = await new_session(target)
            engine.sessions.get(first).in_use += 1
            with pytest.raises(errors.CacheFull, match="in use"):
                await target.start_session("second", PROMPT, GREEDY)
            engine.sessions.get(first).in_use -= 1
            await target.start_session("second", PROMPT, GREEDY)  # evicts the idle first session
            assert engine.evictions == 1
            assert await target.decode(first, position, 3) == expected[1:4]  # re-fed, then decoded
            block = DraftBlock(token_ids=torch.tensor(expected[4:6]))
            outcome = await target.verify(first, position + 3, block, epoch=3)
            assert outcome.num_accepted == 2
    finally:
        await host.shutdown()
        executor.shutdown()
    spans = exporter.get_finished_spans()
    verify = [s for s in spans if s.kind == SpanKind.SERVER and s.name.endswith("TargetService/Verify")]
    assert len(verify) == 1
    attributes = verify[0].attributes
    assert attributes["specdec.session_id"] == first and attributes["specdec.position"] == position + 3
    assert (attributes["specdec.num_draft_tokens"], attributes["specdec.num_accepted"]) == (2, 2)
    assert attributes["specdec.draft_epoch"] == 3
    caller = [s for s in spans if s.kind == SpanKind.CLIENT and s.name.endswith("TargetService/Verify")]
    assert verify[0].parent.span_id == caller[0].context.span_id  # one trace across the hop


# ---- mutual TLS, tokens, cache pressure (the secure server) ---------------------------------------------


async def test_mutual_tls_and_bearer_token(services, certs):
    secure = services["secure"]
    assert secure.health_port and secure.serving()  # plaintext health port: no certificate, no token
    async with client(secure, secure_settings(certs)) as target:
        assert (await target.info()).architecture == "llama"
    for token, code in ((None, Code.UNAUTHENTICATED), ("wrong", Code.PERMISSION_DENIED)):
        async with client(secure, secure_settings(certs, token=token)) as target:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await target.info()
            assert err.value.code() == code
    refused = [secure_settings(certs, client_cert=None), secure_settings(certs, client_cert="foreign"),
               ClientSettings(plaintext=True, timeout_s=5.0)]
    for settings in refused:  # no handshake without a certificate from the right CA, nor in plaintext
        async with client(secure, settings) as target:
            with pytest.raises(errors.ServiceUnavailable):
                await target.info()


async def test_more_sessions_than_slots_are_evicted_and_refed(services, certs, reference):
    prompts = [[3 + i, 40 + i, 7, 9 + 2 * i] for i in range(5)]  # 5 sessions on 2 slots
    expected = [reference(prompt, 7) for prompt in prompts]
    async with client(services["secure"], secure_settings(certs)) as target:
        sessions = [await new_session(target, prompt) for prompt in prompts]
        generated = [[] for _ in prompts]
        for _ in range(3):  # round robin: every call finds its slot taken by another session
            for i, (session_id, position) in enumerate(sessions):
                generated[i] += await target.decode(session_id, position + len(generated[i]), 2)
        for i, (session_id, _) in enumerate(sessions):
            assert generated[i] == expected[i][1:7]
            await target.end_session(session_id)
    evictions = [line for line in services["secure"].metrics().splitlines()
                 if line.startswith("specdec_target_evictions_total")]
    assert evictions and float(evictions[0].split()[-1]) >= 10


# ---- expiry and SIGTERM (the doomed server; last) ------------------------------------------------


async def test_idle_sessions_expire(services):
    async with client(services["doomed"]) as target:
        session_id, position = await new_session(target)
        kept, kept_position = await new_session(target)
        for _ in range(8):  # keep one busy while the other idles past the 1 s TTL
            await asyncio.sleep(0.25)
            kept_position += len(await target.decode(kept, kept_position, 1))
        with pytest.raises(errors.SessionNotFound):
            await target.decode(session_id, position, 1)
        await target.end_session(kept)


async def test_sigterm_lets_in_flight_calls_finish(services):
    doomed = services["doomed"]
    async with client(doomed) as target:
        sessions = [await new_session(target) for _ in range(4)]
        # Four long decodes queue on the one model thread: whatever SIGTERM interrupts, it must finish.
        # The signal follows them closely: 4 x 480 steps of the tiny model took under 0.2 s on a fast host.
        in_flight = [asyncio.ensure_future(target.decode(s, p, 480)) for s, p in sessions]
        await asyncio.sleep(0.02)
        assert not all(call.done() for call in in_flight)
        doomed.signal(signal.SIGTERM)
        assert [len(tokens) for tokens in await asyncio.gather(*in_flight)] == [480] * 4
        with pytest.raises(errors.ServiceUnavailable):
            await target.decode(*sessions[0], 1)
    assert await asyncio.to_thread(doomed.proc.wait, 30) == 0


def test_a_model_without_tokenizer_reports_an_empty_fingerprint(tmp_path, target_dir):
    from specdec.testing.tiny_models import make_tiny_model
    from target_service.main import tokenizer_facts

    bare = make_tiny_model(tmp_path / "bare", vocab_size=64, tokenizer=False)
    assert tokenizer_facts(bare).vocab_fingerprint == "" and tokenizer_facts(bare).eos_token_ids == ()
    assert tokenizer_facts(target_dir).eos_token_ids == (TINY_EOS_ID,)


# ---- command line --------------------------------------------------------------------------------


def test_help_lists_the_flags(capsys):
    result = subprocess.run([sys.executable, "-m", "target_service", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # `specdec serve target` builds the same flags (its parser, in process: `specdec --help` imports
    # every subcommand).
    import argparse

    from specdec.commands import serve

    parser = argparse.ArgumentParser(prog="specdec")
    serve.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "target", "--help"])
    for text in (result.stdout, capsys.readouterr().out):
        for flag in ("--model", "--backend", "--num-slots", "--max-context", "--session-ttl", "--tls-client-ca",
                     "--auth-tokens-file", "--plaintext", "--grace-period", "--health-port", "--metrics-port"):
            assert flag in text
    args = parser.parse_args(["serve", "target", "--model", "m", "--plaintext", "--session-ttl", "5"])
    assert (args.service, args.model, args.session_ttl, args.plaintext) == ("target", "m", 5.0, True)
    assert callable(args.func)


async def test_verify_and_decode_report_their_model_time(services, reference):
    """ServerTiming: each response says how long its work ran in the model; the client hands it to
    the cycle being measured, so the coordinator can tell model time from overhead."""
    from specdec.engine.cycle_cost import measure_cycle

    expected = reference(PROMPT, 8)
    async with client(services["main"]) as target:
        session_id, position = await new_session(target)
        with measure_cycle() as decode_cost:
            await target.decode(session_id, position, 3)
        with measure_cycle() as verify_cost:
            await target.verify(session_id, position + 3, DraftBlock(token_ids=torch.tensor(expected[4:6])))
        raw = await target._stub.Decode(target_pb2.TargetServiceDecodeRequest(
            session_id=session_id, position=position + 6, num_tokens=1))
        await target.end_session(session_id)
    for cost in (decode_cost, verify_cost):
        assert 0 < cost.target_model_s < cost.wall_s and cost.draft_model_s == 0
        assert cost.queued_s >= 0 and cost.overhead_s > 0
    assert raw.HasField("timing") and raw.timing.model_ns > 0
