"""DraftClient: specdec.engine.api.DraftAPI over gRPC, interchangeable with
specdec.engine.local.LocalDraft (same methods, same return types).

Every call carries a deadline (timeout_s). gRPC errors come back as domain errors: a refused Propose
(FAILED_PRECONDITION) -> EpochMismatch when the session's latest epoch ("specdec-latest-epoch") is not
the parent named, else PositionMismatch with the draft's sequence length ("specdec-actual-position");
NOT_FOUND -> SessionNotFound; ALREADY_EXISTS -> SessionExists; INVALID_ARGUMENT -> InvalidArgument;
RESOURCE_EXHAUSTED -> CacheFull; UNAVAILABLE / DEADLINE_EXCEEDED -> ServiceUnavailable (the
coordinator then decodes without the draft). Other codes stay grpc.aio.AioRpcError.

One difference from LocalDraft: on the wire num_draft_tokens=0 means "the session's default"
(ProposerOptions), so propose(..., num_draft_tokens=0) drafts that many, not none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc
import grpc.aio

from specdec import errors
from specdec.engine.api import Proposal
from specdec.models.base import ModelInfo
from specdec.rpc import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.rpc_convert import actual_position, latest_epoch, sampling_params_to_proto, unpack_distributions
from specdec.sampling.params import SamplingParams
from specdec.server.credentials import create_channel
from specdec.server.settings import ClientSettings

Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class DraftDescription:
    """GetInfo in full. model is None for a proposer without weights (as LocalDraft.info())."""

    model: ModelInfo | None
    proposer: str
    max_draft_tokens: int
    vocab_fingerprint: str
    eos_token_ids: tuple[int, ...]
    num_slots: int
    free_slots: int
    server_version: str


def model_info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo | None:
    if not msg.architecture:  # a proposer without weights describes only its tokenizer
        return None
    return ModelInfo(name=msg.name, architecture=msg.architecture, vocab_size=msg.vocab_size,
                     max_context=msg.context_length, dtype=msg.dtype, device=msg.device, backend=msg.backend)


def domain_error(
    err: grpc.aio.AioRpcError, session_id: str = "", position: int | None = None, parent_epoch: int = 0
) -> Exception:
    """The domain error a gRPC status stands for (what LocalDraft would have raised)."""
    code, details = err.code(), err.details() or err.code().name
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        latest, actual = latest_epoch(err), actual_position(err)
        if latest is not None and parent_epoch and latest != parent_epoch:
            return errors.EpochMismatch(session_id, expected=parent_epoch, actual=latest)
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
        return errors.ServiceUnavailable(f"draft service {code.name}: {details}")
    return err


class DraftClient:
    """DraftAPI on a grpc.aio channel (see connect() for one with TLS, deadlines and tracing).

    num_draft_tokens and top_m are the ProposerOptions sent with every StartSession (0: the
    server's defaults)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        timeout_s: float = 30.0,
        metadata: Metadata = (),
        *,
        num_draft_tokens: int = 0,
        top_m: int = 0,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.channel = channel
        self.timeout_s = timeout_s
        self.metadata = tuple(metadata)
        self.options = draft_pb2.ProposerOptions(num_draft_tokens=num_draft_tokens, top_m=top_m)
        self._stub = draft_pb2_grpc.DraftServiceStub(channel)

    async def start_session(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> None:
        request = draft_pb2.DraftServiceStartSessionRequest(
            session_id=session_id, token_ids=list(token_ids), sampling=sampling_params_to_proto(params),
            options=self.options,
        )
        await self._call(self._stub.StartSession, request, session_id)

    async def propose(
        self,
        session_id: str,
        keep_position: int,
        append_token_ids: Sequence[int],
        num_draft_tokens: int,
        parent_epoch: int = 0,
    ) -> Proposal:
        request = draft_pb2.DraftServiceProposeRequest(
            session_id=session_id, parent_epoch=parent_epoch, keep_position=keep_position,
            append_token_ids=list(append_token_ids), num_draft_tokens=num_draft_tokens,
        )
        response = await self._call(self._stub.Propose, request, session_id, keep_position, parent_epoch)
        rows = response.draft_distributions if response.HasField("draft_distributions") else None
        block = unpack_distributions(rows, response.draft_token_ids)
        return Proposal(response.epoch, response.position, block, response.proposer)

    async def truncate(self, session_id: str, position: int) -> int:
        if position < 0:
            raise errors.InvalidArgument(f"truncate position must be >= 1, got {position}")
        request = draft_pb2.DraftServiceTruncateRequest(session_id=session_id, position=position)
        return (await self._call(self._stub.Truncate, request, session_id)).position

    async def end_session(self, session_id: str) -> bool:
        request = draft_pb2.DraftServiceEndSessionRequest(session_id=session_id)
        return (await self._call(self._stub.EndSession, request, session_id)).existed

    async def info(self) -> ModelInfo | None:
        return (await self.describe()).model

    async def describe(self) -> DraftDescription:
        response = await self._call(self._stub.GetInfo, draft_pb2.DraftServiceGetInfoRequest())
        msg = response.model
        return DraftDescription(
            model_info_from_proto(msg), response.proposer, response.max_draft_tokens, msg.vocab_fingerprint,
            tuple(msg.eos_token_ids), msg.num_slots, msg.free_slots, msg.server_version,
        )

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "DraftClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _call(self, method, request, session_id: str = "", position: int | None = None, parent_epoch: int = 0):
        try:
            return await method(request, timeout=self.timeout_s, metadata=self.metadata or None)
        except grpc.aio.AioRpcError as err:
            raise domain_error(err, session_id, position, parent_epoch) from err


def connect(
    address: str,
    settings: ClientSettings,
    *,
    metadata: Metadata = (),
    tracer_provider=None,
    trace: bool = True,
    num_draft_tokens: int = 0,
    top_m: int = 0,
) -> DraftClient:
    """A DraftClient on a new channel: TLS or mutual TLS per `settings` (plaintext only when it says
    so), its bearer token as call credentials, keepalive, message size limit, settings.timeout_s as
    every call's deadline, and OpenTelemetry client spans with W3C trace-context propagation."""
    channel = create_channel(address, settings, tracer_provider=tracer_provider, trace=trace)
    return DraftClient(channel, timeout_s=settings.timeout_s, metadata=metadata,
                       num_draft_tokens=num_draft_tokens, top_m=top_m)
