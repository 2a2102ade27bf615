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

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import grpc.aio

from specdec.engine.api import Proposal
from specdec.engine.cycle_cost import DRAFT
from specdec.errors import InvalidArgument
from specdec.models.base import ModelInfo
from specdec.rpc import PROPOSE_METHOD, draft_pb2, draft_pb2_grpc
from specdec.rpc_convert import model_info_from_proto, sampling_params_to_proto, unpack_distributions
from specdec.sampling.params import SamplingParams
from specdec.server.client_base import Metadata, ServiceClient, ServiceDescription


_BRANCH_KINDS = {"second_guess": draft_pb2.BRANCH_KIND_SECOND_GUESS,
                 "rejected_last": draft_pb2.BRANCH_KIND_REJECTED_LAST}
_KIND_NAMES = {value: name for name, value in _BRANCH_KINDS.items()}


def _branch_kind(name: str) -> int:
    if name not in _BRANCH_KINDS:
        raise InvalidArgument(f"alternatives must be among {list(_BRANCH_KINDS)}, got {name!r}")
    return _BRANCH_KINDS[name]


@dataclass(frozen=True)
class DraftDescription(ServiceDescription):
    """GetInfo in full. model is None for a proposer without weights (as LocalDraft.info())."""

    model: ModelInfo | None
    proposer: str
    max_draft_tokens: int
    any_vocabulary: bool = False  # pairs with every target (coordinator.local_draft: lookup on ids)


class DraftClient(ServiceClient):
    """DraftAPI on a grpc.aio channel (see connect() for one with TLS, deadlines and tracing).

    num_draft_tokens and top_m are the ProposerOptions sent with every StartSession (0: the
    server's defaults)."""

    SERVICE = "draft service"
    ROLE = DRAFT
    STUB = draft_pb2_grpc.DraftServiceStub
    TRUNCATE_REQUEST = draft_pb2.DraftServiceTruncateRequest
    END_SESSION_REQUEST = draft_pb2.DraftServiceEndSessionRequest
    CYCLE_STREAM = ("ProposeStream", PROPOSE_METHOD,
                    lambda request: draft_pb2.DraftServiceProposeStreamRequest(propose=request),
                    lambda message: message.propose)

    def __init__(
        self,
        channel: grpc.aio.Channel,
        timeout_s: float = 30.0,
        metadata: Metadata = (),
        stream_cycle_calls: bool = True,
        tracer=None,
        *,
        num_draft_tokens: int = 0,
        top_m: int = 0,
    ):
        super().__init__(channel, timeout_s, metadata, stream_cycle_calls, tracer)
        self.options = draft_pb2.ProposerOptions(num_draft_tokens=num_draft_tokens, top_m=top_m)

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
        speculative: bool = False,
        alternatives: Sequence[str] = (),
        stop_below: float = 0.0,
    ) -> Proposal:
        request = draft_pb2.DraftServiceProposeRequest(
            session_id=session_id, parent_epoch=parent_epoch, keep_position=keep_position,
            append_token_ids=list(append_token_ids), num_draft_tokens=num_draft_tokens, speculative=speculative,
            alternatives=[_branch_kind(kind) for kind in alternatives], stop_below=stop_below,
        )
        response = await self._cycle_call(self._stub.Propose, request, session_id, keep_position, parent_epoch)
        rows = response.draft_distributions if response.HasField("draft_distributions") else None
        block = unpack_distributions(rows, response.draft_token_ids)
        if len(response.draft_confidences) == block.num_tokens > 0:  # anything else: no confidences
            block = dataclasses.replace(block, confidences=tuple(response.draft_confidences))
        guess = response.guessed_token_id if response.HasField("guessed_token_id") else None
        branches = tuple(
            Proposal(b.epoch, b.position,
                     unpack_distributions(b.draft_distributions if b.HasField("draft_distributions") else None,
                                          b.draft_token_ids),
                     response.proposer, True, b.guessed_token_id, kind=_KIND_NAMES[b.kind])
            for b in response.alternatives)
        return Proposal(response.epoch, response.position, block, response.proposer, response.speculative, guess,
                        alternatives=branches)

    async def end_turn(self, session_id: str) -> bool:
        """The session's turn ended: its draft slot may go to another session at once (EndTurn;
        ServiceClient._end_turn)."""
        return await self._end_turn(draft_pb2.DraftServiceEndTurnRequest(session_id=session_id), session_id)

    async def describe(self) -> DraftDescription:
        response = await self._call(self._stub.GetInfo, draft_pb2.DraftServiceGetInfoRequest())
        msg = response.model
        # A proposer without weights describes only its tokenizer.
        model = model_info_from_proto(msg) if msg.architecture else None
        return DraftDescription(model=model, proposer=response.proposer, max_draft_tokens=response.max_draft_tokens,
                                **ServiceDescription.fields_from_proto(msg))


# A DraftClient on a new channel with TLS, deadlines and tracing: see ServiceClient.connect. Its keyword
# options num_draft_tokens and top_m are the ProposerOptions of every StartSession.
connect = DraftClient.connect
