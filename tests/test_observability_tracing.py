"""Tracing: provider setup from OTEL_* variables, trace context across real gRPC, cycle-span sampling,
GenAI attribute names."""

from __future__ import annotations

import logging

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.trace import SpanKind, get_current_span

from specdec.errors import PositionMismatch
from specdec.observability import spans
from specdec.observability.spans import CycleSpanSampler, cycle_attributes, cycle_span
from specdec.observability.tracing import _env_exporters, setup_tracing
from specdec.server.bootstrap import ModelExecutor, ServiceHost
from specdec.server.credentials import create_channel
from specdec.server.interceptors import ACTUAL_POSITION_KEY
from specdec.server.settings import ClientSettings, ServerSettings

SERVICE = "specdec.test.Traced"


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch):
    for name in (
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)


def traced_service(tracer, executor: ModelExecutor):
    def forward(n: bytes) -> bytes:
        with tracer.start_as_current_span("model.forward"):  # in the executor thread
            return n

    async def step(request, context):
        return await executor.run(forward, request)

    async def fail(request, context):
        raise PositionMismatch("s-1", expected=3, actual=4)

    async def stream(request, context):
        for i in range(2):
            yield bytes([i])


    generic = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Step": grpc.unary_unary_rpc_method_handler(step),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Fail": grpc.unary_unary_rpc_method_handler(fail),
        },
    )

    def register(server):
        server.add_generic_rpc_handlers((generic,))
        return [SERVICE]

    return register


async def traced_host(server_provider) -> ServiceHost:
    """A started server of traced_service, its spans to server_provider."""
    executor = ModelExecutor()
    settings = ServerSettings(port=0, plaintext=True, grace_period_s=0.0)
    register = traced_service(server_provider.get_tracer("target"), executor)
    host = ServiceHost(settings, register, tracer_provider=server_provider, on_shutdown=executor.aclose)
    await host.start()
    return host


async def test_trace_context_propagates_from_client_span_to_server_span():
    client_spans, server_spans = InMemorySpanExporter(), InMemorySpanExporter()
    client_provider = setup_tracing("test-coordinator", 1.0, client_spans)
    server_provider = setup_tracing("test-target", 1.0, server_spans)
    host = await traced_host(server_provider)
    tracer = client_provider.get_tracer("coordinator")
    client = ClientSettings(plaintext=True, timeout_s=5.0)
    async with create_channel(f"127.0.0.1:{host.port}", client, tracer_provider=client_provider) as channel:
        with tracer.start_as_current_span("request") as request_span:
            assert await channel.unary_unary(f"/{SERVICE}/Step")(b"x") == b"x"
            assert [m async for m in channel.unary_stream(f"/{SERVICE}/Stream")(b"")] == [b"\0", b"\1"]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary(f"/{SERVICE}/Fail")(b"")
            assert dict(info.value.trailing_metadata())[ACTUAL_POSITION_KEY] == "4"
            with cycle_span(tracer, CycleSpanSampler(every=2, first=0), 1):  # a skipped cycle
                await channel.unary_unary(f"/{SERVICE}/Step")(b"y")
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    await host.shutdown()

    trace_id = request_span.get_span_context().trace_id
    by_name = {s.name: s for s in client_spans.get_finished_spans()}
    client_step = by_name[f"/{SERVICE}/Step"]
    assert (
        client_step.kind == SpanKind.CLIENT
        and client_step.parent.span_id == request_span.get_span_context().span_id
    )
    server = {s.name: s for s in server_spans.get_finished_spans()}
    # no health check, nothing from the skipped cycle
    assert set(server) == {f"/{SERVICE}/Step", f"/{SERVICE}/Stream", f"/{SERVICE}/Fail", "model.forward"}
    assert (
        server[f"/{SERVICE}/Fail"].attributes["rpc.grpc.status_code"]
        == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    )
    server_step = server[f"/{SERVICE}/Step"]
    assert server_step.kind == SpanKind.SERVER and server_step.context.trace_id == trace_id
    assert server_step.parent.span_id == client_step.context.span_id and server_step.parent.is_remote
    assert server[f"/{SERVICE}/Stream"].context.trace_id == trace_id
    assert server["model.forward"].parent.span_id == server_step.context.span_id
    assert server_step.resource.attributes["service.name"] == "test-target"


def test_the_instrumentations_context_detach_error_is_demoted(caplog):
    """When a client goes away with a traced stream open, the aio server instrumentation can fail to
    restore the context (open-telemetry/opentelemetry-python-contrib#2357) and OpenTelemetry logs an
    ERROR with a traceback (seen in a coordinator's log when a load client died mid-streams).
    server_interceptor() installs StreamDetachNoise, which demotes exactly that record to DEBUG."""
    from specdec.observability.tracing import server_interceptor

    server_interceptor()
    context_logger = logging.getLogger("opentelemetry.context")
    token_error = ValueError("<Token var=<ContextVar name='current_context'> at 0x1> was created in a different Context")
    with caplog.at_level(logging.INFO):
        for error in (token_error, RuntimeError("something else")):
            try:
                raise error
            except Exception:  # as opentelemetry.context.detach logs it
                context_logger.exception("Failed to detach context")
    assert [(r.levelname, type(r.exc_info[1]).__name__) for r in caplog.records] == [("ERROR", "RuntimeError")]


def test_cycle_spans_follow_the_sampler_and_skipped_cycles_drop_their_children():
    exporter = InMemorySpanExporter()
    tracer = setup_tracing("test", 1.0, exporter).get_tracer("test")
    sampler = CycleSpanSampler(every=3, first=2)
    with tracer.start_as_current_span("request"):
        for i in range(7):
            with cycle_span(tracer, sampler, i, {spans.SPECDEC_POOL: "speculative"}) as span:
                with tracer.start_as_current_span("propose"):
                    pass
                span.set_attributes(
                    cycle_attributes(
                        position=10 + i,
                        num_draft_tokens=4,
                        num_accepted=2,
                        next_token_kind="bonus",
                        pipeline_hit=False,
                    )
                )
        assert get_current_span().is_recording()  # the request span is current again
    finished = exporter.get_finished_spans()
    cycles = [s for s in finished if s.name == spans.CYCLE_SPAN]
    assert [s.attributes[spans.SPECDEC_CYCLE_INDEX] for s in cycles] == [0, 1, 3, 6]
    assert cycles[2].attributes[spans.SPECDEC_POSITION] == 13
    assert cycles[2].attributes[spans.SPECDEC_NEXT_TOKEN_KIND] == "bonus"
    assert cycles[2].attributes[spans.SPECDEC_POOL] == "speculative"
    cycle_ids = {s.context.span_id for s in cycles}
    proposes = [s for s in finished if s.name == "propose"]
    assert len(proposes) == 4 and all(s.parent.span_id in cycle_ids for s in proposes)
    with pytest.raises(ValueError):
        cycle_attributes(position=0, num_draft_tokens=1, num_accepted=0, next_token_kind="guess")


def test_sampler_from_env_and_exporters_from_env(monkeypatch):
    assert isinstance(setup_tracing("s", 0.5).sampler, ParentBased)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert setup_tracing("s", 0.5).sampler.get_description() == "AlwaysOffSampler"
    assert _env_exporters() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert [type(e).__name__ for e in _env_exporters()] == ["ConsoleSpanExporter"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert _env_exporters() == []
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    exporters = _env_exporters()
    assert [type(e).__name__ for e in exporters] == ["OTLPSpanExporter"]
    exporters[0].shutdown()


def test_genai_attribute_names_match_the_semantic_conventions():
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as semconv

    for name in (
        "OPERATION_NAME",
        "REQUEST_MODEL",
        "REQUEST_TEMPERATURE",
        "REQUEST_TOP_P",
        "REQUEST_TOP_K",
        "REQUEST_MAX_TOKENS",
        "REQUEST_SEED",
        "USAGE_INPUT_TOKENS",
        "USAGE_OUTPUT_TOKENS",
        "RESPONSE_FINISH_REASONS",
        "CONVERSATION_ID",
    ):
        assert getattr(spans, f"GEN_AI_{name}") == getattr(semconv, f"GEN_AI_{name}")
    attributes = spans.request_attributes(model="SmolLM2-1.7B", operation="chat", temperature=0.0, top_k=None)
    assert attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "SmolLM2-1.7B",
        "gen_ai.request.temperature": 0.0,
    }
    assert spans.usage_attributes(input_tokens=3, output_tokens=5, finish_reason="stop")[
        "gen_ai.response.finish_reasons"
    ] == ("stop",)


def test_a_model_service_traces_its_calls_only_when_its_spans_go_somewhere(monkeypatch):
    """Server spans nobody exports cost every cycle time (per-cycle overhead, issue 6)."""
    from specdec.observability.tracing import exports_spans
    from specdec.server.bootstrap import ServiceHost
    from specdec.server.interceptors import ErrorMappingInterceptor
    from specdec.server.settings import ServerSettings

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not exports_spans(setup_tracing("quiet", 1.0))
    assert exports_spans(setup_tracing("exporting", 1.0, InMemorySpanExporter()))
    assert exports_spans(None)  # the global provider: unknown, so traced
    settings = ServerSettings(port=0, plaintext=True)
    untraced = ServiceHost(settings, lambda server: [], trace_calls=False)._interceptors()
    traced = ServiceHost(settings, lambda server: [])._interceptors()
    assert [type(i) for i in untraced] == [ErrorMappingInterceptor]
    assert len(traced) == 2 and isinstance(traced[-1], ErrorMappingInterceptor)


async def test_a_client_whose_spans_go_nowhere_records_none_but_still_propagates_the_context(monkeypatch):
    """A coordinator without an exporter skips its client spans (per-cycle overhead, issue 6); the
    services it calls, exporting, still continue the trace it serves."""
    from opentelemetry import trace

    from specdec.observability.tracing import (
        PropagateContextInterceptor,
        PropagateStreamContextInterceptor,
        client_interceptors,
    )

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    quiet = setup_tracing("test-coordinator", 1.0)
    assert [type(i) for i in client_interceptors(quiet)] == [PropagateContextInterceptor,
                                                             PropagateStreamContextInterceptor]
    server_spans = InMemorySpanExporter()
    server_provider = setup_tracing("test-target", 1.0, server_spans)
    host = await traced_host(server_provider)
    client = ClientSettings(plaintext=True, timeout_s=5.0)
    async with create_channel(f"127.0.0.1:{host.port}", client, tracer_provider=quiet) as channel:
        await channel.unary_unary(f"/{SERVICE}/Step")(b"x")  # no current span: a trace of its own
        with quiet.get_tracer("coordinator").start_as_current_span("request") as request_span:
            assert await channel.unary_unary(f"/{SERVICE}/Step")(b"y", metadata=(("k", "v"),)) == b"y"
            assert [m async for m in channel.unary_stream(f"/{SERVICE}/Stream")(b"")] == [b"\0", b"\1"]
        assert trace.get_current_span() is trace.INVALID_SPAN
    await host.shutdown()

    steps = [s for s in server_spans.get_finished_spans() if s.name == f"/{SERVICE}/Step"]
    stream = next(s for s in server_spans.get_finished_spans() if s.name == f"/{SERVICE}/Stream")
    context = request_span.get_span_context()
    assert steps[0].parent is None and steps[0].context.trace_id != context.trace_id
    assert steps[1].parent.span_id == context.span_id and steps[1].parent.is_remote  # no client span between
    assert stream.parent.span_id == context.span_id
