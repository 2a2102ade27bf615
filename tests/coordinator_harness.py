"""What the coordinator tests share: an in-process coordinator over real gRPC (draft and target are
real subprocesses, see service_procs), plain decoding on an in-process engine as the reference,
and stream collection."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from dataclasses import dataclass

import grpc
import grpc.aio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator.main import Coordinator, build
from coordinator.servicer import ERROR_CODES, SERVICE_NAME
from coordinator.settings import CoordinatorSettings
from specdec.engine.target import TargetEngine
from specdec.models.loader import load_model
from specdec.models.tokenizer import encode_prompt, load_tokenizer
from specdec.observability.metrics import new_registry
from specdec.observability.tracing import setup_tracing
from specdec.rpc import coordinator_pb2 as pb
from specdec.rpc import coordinator_pb2_grpc
from specdec.sampling.params import SamplingParams
from specdec.server.bootstrap import ServiceHost
from specdec.server.settings import ClientSettings, ServerSettings
from specdec.store import SessionStore
from specdec.testing.tiny_models import TINY_EOS_ID

Code = grpc.StatusCode


class Reference:
    """Plain greedy decoding of the target model in this process: what every answer must equal."""

    def __init__(self, target_dir, max_context: int):
        self.engine = TargetEngine(load_model(target_dir, backend="native", num_slots=2, max_context=max_context))
        self.tokenizer = load_tokenizer(target_dir)

    def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt=prompt, messages=messages)

    def continuation(self, tokens: list[int], n: int) -> list[int]:
        session_id = uuid.uuid4().hex
        _, first = self.engine.start_session(session_id, tokens, SamplingParams())
        out = [first] + self.engine.decode(session_id, len(tokens) + 1, n - 1) if n > 1 else [first]
        self.engine.end_session(session_id)
        return out


def expected(reference: Reference, tokens: list[int], n: int) -> list[int]:
    """Plain greedy decoding of n tokens after `tokens`, cut after an EOS as generation stops there."""
    out = reference.continuation(tokens, n)
    return out[: out.index(TINY_EOS_ID) + 1] if TINY_EOS_ID in out else out


@dataclass
class Running:
    coordinator: Coordinator
    host: ServiceHost
    channel: grpc.aio.Channel
    stub: coordinator_pb2_grpc.CoordinatorServiceStub
    store: SessionStore
    exporter: InMemorySpanExporter
    settings: CoordinatorSettings

    async def generate(self, **fields) -> list[pb.CoordinatorServiceGenerateResponse]:
        """The whole stream of one Generate call."""
        return [m async for m in self.stub.Generate(request(**fields))]

    async def session(self, session_id: str) -> pb.SessionInfo:
        reply = await self.stub.GetSession(pb.CoordinatorServiceGetSessionRequest(session_id=session_id))
        return reply.session

    async def tokens(self, session_id: str) -> list[int]:
        return await self.store.tokens(session_id)


def request(**fields) -> pb.CoordinatorServiceGenerateRequest:
    """A Generate request; resume=N and messages=[(role, content), ...] are spelled out."""
    if "resume" in fields:
        fields["resume"] = pb.ResumeStream(from_position=fields["resume"])
    if "messages" in fields:
        fields["messages"] = pb.ChatMessages(
            messages=[pb.ChatMessage(role=r, content=c) for r, c in fields["messages"]]
        )
    if "speculation" in fields and isinstance(fields["speculation"], dict):
        fields["speculation"] = pb.SpeculationOptions(**fields["speculation"])
    return pb.CoordinatorServiceGenerateRequest(**fields)


def tokens_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def read_some(call, count: int) -> list:
    """The first `count` messages of a streaming call, leaving the rest unread."""
    got = []
    async for message in call:
        got.append(message)
        if len(got) == count:
            break
    return got


@contextlib.asynccontextmanager
async def running_coordinator(redis_url: str, tokenizer_dir, targets=(), drafts=(), *, prefix: str | None = None,
                              server: dict | None = None, target_client: ClientSettings | None = None,
                              **overrides):
    """A coordinator on a free port (plaintext), its own Redis key prefix, an in-memory span exporter
    and a metrics port; yields a Running. Target calls are plaintext unless target_client says."""
    exporter = InMemorySpanExporter()
    provider = setup_tracing("coordinator-test", exporter=exporter)
    registry = new_registry(process=False)
    settings = CoordinatorSettings(
        server=ServerSettings(**{"port": 0, "plaintext": True, "metrics_port": 0, "grace_period_s": 5.0,
                                 **(server or {})}),
        target_client=target_client or ClientSettings(plaintext=True, timeout_s=10.0),
        draft_client=ClientSettings(plaintext=True, timeout_s=2.0),
        tokenizer=str(tokenizer_dir), redis_url=redis_url, targets=tuple(targets), drafts=tuple(drafts),
        redis_prefix=prefix or f"t{uuid.uuid4().hex[:12]}", **overrides,
    )
    coordinator = build(settings, tracer_provider=provider, registry=registry)

    def register(srv):
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(coordinator.servicer, srv)
        return [SERVICE_NAME]

    host = ServiceHost(settings.server, register, tracer_provider=provider, registry=registry,
                       error_codes=ERROR_CODES, on_shutdown=[coordinator.aclose])
    await host.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{host.port}")
    running = Running(coordinator, host, channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel),
                      coordinator.sessions.store, exporter, settings)
    try:
        yield running
    finally:
        await channel.close()
        await host.shutdown()  # or wait for the one a test began
        provider.shutdown()


def replace_settings(settings: CoordinatorSettings, **changes) -> CoordinatorSettings:
    return dataclasses.replace(settings, **changes)
