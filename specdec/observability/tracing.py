"""OpenTelemetry tracing: provider setup from the standard OTEL_* variables, and gRPC propagation.

Exporters (first match wins):
- an `exporter` passed in (tests: InMemorySpanExporter), exported synchronously;
- OTEL_TRACES_EXPORTER=none: nothing; =console: ConsoleSpanExporter;
- OTEL_TRACES_EXPORTER=otlp, OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set:
  the OTLP gRPC exporter, which reads its endpoint, headers, TLS and timeout from those variables;
- otherwise no exporter: spans still carry trace context across services, nothing is sent.
Sampling: OTEL_TRACES_SAMPLER(/_ARG) when set, else ParentBased(TraceIdRatioBased(sampling_ratio)),
so a trace is sampled or not as a whole, decided where it starts.
"""

from __future__ import annotations

import contextlib
import logging
import os

import grpc.aio
from opentelemetry.propagate import inject
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

logger = logging.getLogger(__name__)

# Health probes every few seconds and reflection would drown real traces.
_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")


def _env_exporters() -> list[SpanExporter]:
    names = {n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()}
    if "none" in names:
        return []
    exporters: list[SpanExporter] = []
    if "console" in names:
        exporters.append(ConsoleSpanExporter())
    endpoint_set = any(
        os.environ.get(v) for v in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    if "otlp" in names or endpoint_set:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
        )
        if protocol != "grpc":
            logger.warning("OTLP protocol %r is not installed; exporting over grpc", protocol)
        exporters.append(OTLPSpanExporter())
    return exporters


def setup_tracing(
    service_name: str,
    sampling_ratio: float = 1.0,
    exporter: SpanExporter | None = None,
    *,
    set_global: bool = False,
) -> TracerProvider:
    """A TracerProvider for one service. Pass it explicitly (serve(), create_channel(), the
    engines' tracers); set_global=True also installs it for libraries that use the global one.
    The owner calls provider.shutdown() at exit to flush batched spans."""
    sampler = (
        None if os.environ.get("OTEL_TRACES_SAMPLER") else ParentBased(TraceIdRatioBased(sampling_ratio))
    )
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES; OTEL_SERVICE_NAME, when set, wins.
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(sampler=sampler, resource=Resource.create({SERVICE_NAME: name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        for env_exporter in _env_exporters():
            provider.add_span_processor(BatchSpanProcessor(env_exporter))
    if set_global:
        from opentelemetry import trace

        trace.set_tracer_provider(provider)
    return provider


def exports_spans(provider) -> bool:
    """Whether spans recorded on `provider` go anywhere (an exporter's span processor is attached).
    A provider of unknown kind, or None (the global one), counts as exporting."""
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)
    return provider is None or processors is None or len(processors) > 0


# A session's per-cycle message streams (server/cycle_streams.py) outlive their cycles, so a span per
# stream would straddle many traces: they are traced per message (sent_/received_message_span).
_PER_MESSAGE = ("/specdec.v1.TargetService/VerifyStream", "/specdec.v1.DraftService/ProposeStream")


def _traced_filter():
    from opentelemetry.instrumentation.grpc.filters import any_of, full_method_name, negate, service_name

    return negate(any_of(*(service_name(s) for s in _UNTRACED_SERVICES),
                         *(full_method_name(m) for m in _PER_MESSAGE)))


def _rpc_attributes(method: str) -> dict:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


@contextlib.contextmanager
def sent_message_span(tracer, method: str, carrier):
    """Around one message of a per-cycle stream, sent: a CLIENT span under the current one, named
    and described as the unary call `method` ("/specdec.v1.TargetService/Verify") would be, whose
    context goes into `carrier` (the message's trace_context). No tracer (spans go nowhere): no span,
    only the current context injected, so a service that exports still joins the caller's trace."""
    if tracer is None:
        inject(carrier)
        yield
        return
    from opentelemetry import trace

    with tracer.start_as_current_span(method, kind=trace.SpanKind.CLIENT,
                                      attributes=_rpc_attributes(method)):
        inject(carrier)
        yield


def received_message_span(tracer, method: str, carrier):
    """Around handling one received message of a per-cycle stream: a SERVER span continuing the
    trace in the message's trace_context (`carrier`), as the unary call `method` would have one.
    No tracer: none."""
    if tracer is None:
        return contextlib.nullcontext()
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    return tracer.start_as_current_span(method, context=extract(dict(carrier)), kind=trace.SpanKind.SERVER,
                                        attributes=_rpc_attributes(method))


class StreamDetachNoise(logging.Filter):
    """The aio server instrumentation keeps a stream's span current across its handler's yields; when
    the client cancels the stream (a backend that stops reading, a shutdown), the generator is closed
    in another Context, and putting the context back fails with a ValueError that OpenTelemetry
    catches and logs as an ERROR with a traceback (open-telemetry/opentelemetry-python-contrib#2357,
    open). Nothing is lost (the span still ends), but every cancelled Generate stream wrote an ERROR
    traceback to the coordinator's log. Such records are demoted to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.getMessage() == "Failed to detach context" and isinstance(error, ValueError) \
                and "different Context" in str(error):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def server_interceptor(tracer_provider=None):
    """grpc.aio server interceptor: continues the caller's trace (W3C traceparent in metadata) and
    records a SERVER span per call. Streaming handlers must be async generators (yield), which
    the instrumentation iterates; health and reflection are not traced."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    context_logger = logging.getLogger("opentelemetry.context")
    if not any(isinstance(f, StreamDetachNoise) for f in context_logger.filters):
        context_logger.addFilter(StreamDetachNoise())
    return aio_server_interceptor(tracer_provider=tracer_provider, filter_=_traced_filter())


def client_interceptors(tracer_provider=None) -> list:
    """grpc.aio client interceptors: a CLIENT span per call and the current context injected as
    W3C traceparent metadata, so the server span becomes its child. When `tracer_provider` exports
    nothing, only the injection: a client span that goes nowhere costs about 0.2 ms a call (two
    calls a speculative cycle), while the caller's context must still reach services that export."""
    if not exports_spans(tracer_provider):
        return [PropagateContextInterceptor(), PropagateStreamContextInterceptor()]
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(tracer_provider=tracer_provider, filter_=_traced_filter())


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """`details` with the current trace context added to its metadata as W3C traceparent."""
    carrier: dict[str, str] = {}
    inject(carrier)
    if not carrier:  # no current span: nothing to continue
        return details
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), *carrier.items())
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


# Two classes: a grpc.aio channel files an interceptor under the first call kind it subclasses only.
class PropagateContextInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Injects the current trace context as W3C traceparent metadata, recording no span."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class PropagateStreamContextInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    """PropagateContextInterceptor for calls with streamed responses."""

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)
