"""TargetClient: specdec.engine.api.TargetAPI over gRPC, so the speculative loop cannot tell it from
specdec.engine.local.LocalTarget (same methods, same return types).

Every call carries a deadline (timeout_s). gRPC errors come back as the domain errors LocalTarget
raises: FAILED_PRECONDITION with "specdec-actual-position" -> PositionMismatch(actual), NOT_FOUND ->
SessionNotFound, ALREADY_EXISTS -> SessionExists, INVALID_ARGUMENT -> InvalidArgument,
RESOURCE_EXHAUSTED -> CacheFull; UNAVAILABLE and DEADLINE_EXCEEDED -> ServiceUnavailable, on which
the coordinator fails over or falls back. Other codes (UNAUTHENTICATED, INTERNAL, ...) stay
grpc.aio.AioRpcError: they are configuration or server bugs, not conditions to handle.

    client = connect("target:50052", ClientSettings(tls_ca=ca_path))
    position, first = await client.start_session("s1", prompt_ids, params)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc
import grpc.aio

from specdec import errors
from specdec.models.base import ModelInfo
from specdec.rpc import common_pb2, target_pb2, target_pb2_grpc
from specdec.rpc_convert import (
    actual_position,
    pack_distributions,
    sampling_params_to_proto,
    verify_outcome_from_proto,
)
from specdec.sampling.params import SamplingParams
from specdec.server.credentials import create_channel
from specdec.server.settings import ClientSettings
from specdec.types import DraftBlock, VerifyOutcome

Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class TargetDescription:
    """GetInfo in full: the model plus what ModelInfo (the core's type) does not hold."""

    model: ModelInfo
    vocab_fingerprint: str
    eos_token_ids: tuple[int, ...]
    num_slots: int
    free_slots: int
    server_version: str


def model_info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(name=msg.name, architecture=msg.architecture, vocab_size=msg.vocab_size,
                     max_context=msg.context_length, dtype=msg.dtype, device=msg.device, backend=msg.backend)


def domain_error(err: grpc.aio.AioRpcError, session_id: str = "", position: int | None = None) -> Exception:
    """The domain error a gRPC status stands for (what LocalTarget would have raised)."""
    code, details = err.code(), err.details() or err.code().name
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        actual = actual_position(err)
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
        return errors.ServiceUnavailable(f"target service {code.name}: {details}")
    return err


class TargetClient:
    """TargetAPI on a grpc.aio channel (see connect() for one with TLS, deadlines and tracing)."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 30.0, metadata: Metadata = ()):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.channel = channel
        self.timeout_s = timeout_s
        self.metadata = tuple(metadata)
        self._stub = target_pb2_grpc.TargetServiceStub(channel)

    async def start_session(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, sample_first_token: bool = True
    ) -> tuple[int, int | None]:
        request = target_pb2.TargetServiceStartSessionRequest(
            session_id=session_id, token_ids=list(token_ids), sampling=sampling_params_to_proto(params),
            sample_first_token=sample_first_token,
        )
        response = await self._call(self._stub.StartSession, request, session_id)
        first = response.first_token_id if response.HasField("first_token_id") else None
        return response.position, first

    async def verify(self, session_id: str, position: int, draft: DraftBlock, epoch: int = 0) -> VerifyOutcome:
        request = target_pb2.TargetServiceVerifyRequest(
            session_id=session_id, position=position, draft_token_ids=draft.token_ids.tolist(), draft_epoch=epoch,
        )
        if draft.draft_probs is not None:
            request.draft_distributions.CopyFrom(pack_distributions(draft))
        response = await self._call(self._stub.Verify, request, session_id, position)
        return verify_outcome_from_proto(response)

    async def decode(
        self,
        session_id: str,
        position: int,
        num_tokens: int,
        append_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> list[int]:
        """As LocalTarget.decode; stop_token_ids (an extension) ends generation right after one of
        them, so a multi-token decode does not run past EOS."""
        if num_tokens < 0:  # uint32 on the wire: refuse here rather than wrap around
            raise errors.InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
        request = target_pb2.TargetServiceDecodeRequest(
            session_id=session_id, position=position, append_token_ids=list(append_token_ids),
            num_tokens=num_tokens, stop_token_ids=list(stop_token_ids),
        )
        response = await self._call(self._stub.Decode, request, session_id, position)
        return list(response.token_ids)

    async def truncate(self, session_id: str, position: int) -> int:
        if position < 0:
            raise errors.InvalidArgument(f"truncate position must be >= 1, got {position}")
        request = target_pb2.TargetServiceTruncateRequest(session_id=session_id, position=position)
        return (await self._call(self._stub.Truncate, request, session_id)).position

    async def end_session(self, session_id: str) -> bool:
        request = target_pb2.TargetServiceEndSessionRequest(session_id=session_id)
        return (await self._call(self._stub.EndSession, request, session_id)).existed

    async def info(self) -> ModelInfo:
        return (await self.describe()).model

    async def describe(self) -> TargetDescription:
        msg = (await self._call(self._stub.GetInfo, target_pb2.TargetServiceGetInfoRequest())).model
        return TargetDescription(model_info_from_proto(msg), msg.vocab_fingerprint, tuple(msg.eos_token_ids),
                                 msg.num_slots, msg.free_slots, msg.server_version)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "TargetClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _call(self, method, request, session_id: str = "", position: int | None = None):
        try:
            return await method(request, timeout=self.timeout_s, metadata=self.metadata or None)
        except grpc.aio.AioRpcError as err:
            raise domain_error(err, session_id, position) from err


def connect(
    address: str,
    settings: ClientSettings,
    *,
    metadata: Metadata = (),
    tracer_provider=None,
    trace: bool = True,
) -> TargetClient:
    """A TargetClient on a new channel: TLS or mutual TLS per `settings` (plaintext only when it says
    so), its bearer token as call credentials, keepalive, message size limit, settings.timeout_s as
    every call's deadline, and OpenTelemetry client spans with W3C trace-context propagation."""
    channel = create_channel(address, settings, tracer_provider=tracer_provider, trace=trace)
    return TargetClient(channel, timeout_s=settings.timeout_s, metadata=metadata)
