"""What the clients of the model services (TargetClient, DraftClient) share.

A ServiceClient holds a channel, sends every call with its deadline and metadata, and raises the
domain errors an in-process engine would have raised (domain_error), so the speculative loop cannot
tell a remote engine from a local one. GetInfo's facts beyond ModelInfo come back as a
ServiceDescription.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
import grpc.aio

from specdec import errors
from specdec.rpc import common_pb2
from specdec.engine.cycle_cost import report_model_time
from specdec.observability.tracing import exports_spans
from specdec.rpc_convert import actual_position, latest_epoch, live_epochs, server_timing_seconds
from specdec.server.credentials import create_channel
from specdec.server.cycle_streams import SessionStreams
from specdec.server.settings import ClientSettings

Metadata = Sequence[tuple[str, str]]
C = TypeVar("C", bound="ServiceClient")


def domain_error(
    err: grpc.aio.AioRpcError,
    service: str,
    session_id: str = "",
    position: int | None = None,
    parent_epoch: int = 0,
) -> Exception:
    """The domain error a gRPC status from `service` (e.g. "target service") stands for.

    FAILED_PRECONDITION -> EpochMismatch when the parent_epoch named (a draft's Propose) is not live
    ("specdec-live-epochs"; from an older server: not its latest epoch, "specdec-latest-epoch"), else PositionMismatch with the actual position
    ("specdec-actual-position") when the call named a position, else IncompatibleModels; NOT_FOUND
    -> SessionNotFound; ALREADY_EXISTS -> SessionExists; INVALID_ARGUMENT -> InvalidArgument;
    RESOURCE_EXHAUSTED -> CacheFull; UNAVAILABLE / DEADLINE_EXCEEDED -> ServiceUnavailable. Other
    codes (UNAUTHENTICATED, INTERNAL, ...) are configuration or server bugs: `err` itself.
    """
    code, details = err.code(), err.details() or err.code().name
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        latest, actual, live = latest_epoch(err), actual_position(err), live_epochs(err)
        not_live = parent_epoch not in live if live is not None else latest != parent_epoch
        if latest is not None and parent_epoch and not_live:
            return errors.EpochMismatch(session_id, expected=parent_epoch, actual=latest, live=live)
        if actual is not None and position is not None:
            return errors.PositionMismatch(session_id, expected=position, actual=actual)
        return errors.IncompatibleModels(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.SessionNotFound(session_id)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return errors.SessionExists(session_id)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.CacheFull(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return errors.ServiceUnavailable(f"{service} {code.name}: {details}{_tls_hint(details)}")
    return err


def _tls_hint(details: str) -> str:
    """What a TLS handshake failure most likely means, in the flags' terms (gRPC's own text names
    only OpenSSL's error)."""
    if "WRONG_VERSION_NUMBER" in details:
        return (" (TLS was tried against a server that speaks plaintext: give the service TLS, or "
                "dial it with --target-plaintext / --draft-plaintext)")
    if "Tls handshake failed" in details or "CERTIFICATE_VERIFY_FAILED" in details:
        return (" (the TLS handshake failed: check the CA (--target-tls-ca / --draft-tls-ca), the "
                "server name (--target-tls-server-name) and the client certificate)")
    return ""


@dataclass(frozen=True)
class ServiceDescription:
    """What GetInfo says about a model service beyond ModelInfo (the core's type)."""

    vocab_fingerprint: str
    eos_token_ids: tuple[int, ...]
    num_slots: int
    free_slots: int
    server_version: str

    @staticmethod
    def fields_from_proto(msg: common_pb2.ModelInfo) -> dict[str, Any]:
        """This class's fields from a ModelInfo message, as keyword arguments for a subclass."""
        return {"vocab_fingerprint": msg.vocab_fingerprint, "eos_token_ids": tuple(msg.eos_token_ids),
                "num_slots": msg.num_slots, "free_slots": msg.free_slots, "server_version": msg.server_version}


class ServiceClient:
    """A model service's API on a grpc.aio channel; see connect() for one with TLS, deadlines and
    tracing. Subclasses name their service (SERVICE, for error messages), their STUB class and the
    request messages of Truncate and EndSession, which both services spell alike."""

    SERVICE: ClassVar[str]
    ROLE: ClassVar[str]  # "target" or "draft": whose model time the responses' ServerTiming reports
    STUB: ClassVar[type]
    TRUNCATE_REQUEST: ClassVar[type]
    END_SESSION_REQUEST: ClassVar[type]
    # The per-cycle call (Verify, Propose) as a stream RPC: the stream's method name on STUB, the unary
    # call's full name (its spans' name), and how a unary request goes into and a unary response comes
    # out of the stream's messages (cycle_streams.py).
    CYCLE_STREAM: ClassVar[tuple[str, str, Callable[[Any], Any], Callable[[Any], Any]] | None] = None

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 30.0, metadata: Metadata = (),
                 stream_cycle_calls: bool = True, tracer=None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.channel = channel
        self.address = ""  # where the channel dials, when connect() made it (a name for the service)
        self.timeout_s = timeout_s
        self.metadata = tuple(metadata)
        self._stub = self.STUB(channel)
        self._cycle_streams: SessionStreams | None = None
        if stream_cycle_calls and self.CYCLE_STREAM is not None:
            name, unary, wrap, unwrap = self.CYCLE_STREAM
            self._cycle_streams = SessionStreams(getattr(self._stub, name), wrap, unwrap, service=self.SERVICE,
                                                 timeout_s=timeout_s, metadata=self.metadata, tracer=tracer,
                                                 span_name=unary)

    @classmethod
    def connect(cls: type[C], address: str, settings: ClientSettings, *, metadata: Metadata = (),
                tracer_provider=None, trace: bool = True, **options: Any) -> C:
        """A client on a new channel: TLS or mutual TLS per `settings` (plaintext only when it says
        so), its bearer token as call credentials, keepalive, message size limit, settings.timeout_s
        as every call's deadline, and W3C trace-context propagation with OpenTelemetry client spans
        (spans only when `tracer_provider` exports them). `options` go to the subclass's constructor.
        The per-cycle calls go as messages of a stream per session unless settings.cycle_calls is
        "unary"; each message gets its own client span then (cycle_streams.py)."""
        from opentelemetry import trace as otel_trace

        channel = create_channel(address, settings, tracer_provider=tracer_provider, trace=trace)
        options.setdefault("stream_cycle_calls", settings.cycle_calls == "stream")
        if trace and exports_spans(tracer_provider):
            options.setdefault("tracer", otel_trace.get_tracer("specdec.client", tracer_provider=tracer_provider))
        client = cls(channel, timeout_s=settings.timeout_s, metadata=metadata, **options)
        client.address = address
        return client

    async def truncate(self, session_id: str, position: int) -> int:
        if position < 0:
            raise errors.InvalidArgument(f"truncate position must be >= 1, got {position}")
        request = self.TRUNCATE_REQUEST(session_id=session_id, position=position)
        return (await self._call(self._stub.Truncate, request, session_id)).position

    async def end_session(self, session_id: str) -> bool:
        if self._cycle_streams is not None:
            self._cycle_streams.close(session_id)
        request = self.END_SESSION_REQUEST(session_id=session_id)
        return (await self._call(self._stub.EndSession, request, session_id)).existed

    _end_turn_unimplemented = False  # set once the replica answered EndTurn with UNIMPLEMENTED

    async def _end_turn(self, request, session_id: str) -> bool:
        """EndTurn, which both services define: the session's slot may go to another session at once.
        Also closes the session's cycle stream, which the next turn reopens. False when the replica did
        not release it, or is older than EndTurn (asked once: it then keeps slots for --evict-after)."""
        if self._cycle_streams is not None:
            self._cycle_streams.close(session_id)
        if self._end_turn_unimplemented:
            return False
        try:
            return (await self._call(self._stub.EndTurn, request, session_id)).released
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._end_turn_unimplemented = True
            return False

    async def info(self):
        return (await self.describe()).model

    async def describe(self):
        raise NotImplementedError

    async def close(self) -> None:
        if self._cycle_streams is not None:
            self._cycle_streams.close_all()
        await self.channel.close()

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _timed_call(self, method, request, session_id: str, position: int, parent_epoch: int = 0):
        """_call, and hand the response's ServerTiming with the call's round trip to the cycle being
        measured (engine/cycle_cost.py)."""
        started = time.perf_counter()
        response = await self._call(method, request, session_id, position, parent_epoch)
        self._report_timing(response, started)
        return response

    async def _cycle_call(self, method, request, session_id: str, position: int, parent_epoch: int = 0):
        """_timed_call of the per-cycle call: on the session's stream where there is one (see
        cycle_streams.py), else the unary `method`."""
        response = None
        started = time.perf_counter()
        if self._cycle_streams is not None:
            response = await self._cycle_streams.call(
                session_id, request, lambda err: domain_error(err, self.SERVICE, session_id, position, parent_epoch))
        if response is None:
            response = await self._call(method, request, session_id, position, parent_epoch)
        self._report_timing(response, started)
        return response

    def _report_timing(self, response, started: float) -> None:
        timing = server_timing_seconds(response)
        if timing is not None:
            model_s, queued_s, handler_s = timing
            report_model_time(self.ROLE, model_s, queued_s, handler_s, time.perf_counter() - started)

    async def _call(self, method, request, session_id: str = "", position: int | None = None, parent_epoch: int = 0,
                    extra_time_s: float = 0.0):
        """One unary call with the client's deadline (plus extra_time_s the service may wait by request)."""
        try:
            return await method(request, timeout=self.timeout_s + extra_time_s, metadata=self.metadata or None)
        except grpc.aio.AioRpcError as err:
            raise domain_error(err, self.SERVICE, session_id, position, parent_epoch) from err
