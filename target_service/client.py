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

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
import grpc.aio

from specdec import errors
from specdec.engine.api import InnerDraft, decode_by_steps
from specdec.engine.cycle_cost import DRAFT, TARGET, report_draft_limit, report_inner_draft, report_model_time
from specdec.models.base import ModelInfo
from specdec.rpc import VERIFY_METHOD, target_pb2, target_pb2_grpc
from specdec.rpc_convert import (
    model_info_from_proto,
    pack_distributions,
    sampling_params_to_proto,
    server_timing_seconds,
    verify_outcome_from_proto,
)
from specdec.sampling.params import SamplingParams
from specdec.server.client_base import ServiceClient, ServiceDescription, domain_error
from specdec.types import DraftBlock, VerifyOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetDescription(ServiceDescription):
    """GetInfo in full: the model plus what ModelInfo (the core's type) does not hold."""

    model: ModelInfo


class TargetClient(ServiceClient):
    """TargetAPI on a grpc.aio channel (see connect() for one with TLS, deadlines and tracing)."""

    SERVICE = "target service"
    ROLE = TARGET
    STUB = target_pb2_grpc.TargetServiceStub
    TRUNCATE_REQUEST = target_pb2.TargetServiceTruncateRequest
    END_SESSION_REQUEST = target_pb2.TargetServiceEndSessionRequest
    CYCLE_STREAM = ("VerifyStream", VERIFY_METHOD,
                    lambda request: target_pb2.TargetServiceVerifyStreamRequest(verify=request),
                    lambda message: message.verify)
    _decode_stream_unimplemented = False  # set once the target answered DecodeStream with UNIMPLEMENTED

    async def start_session(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, sample_first_token: bool = True,
        drafts_elsewhere: bool = False, draft_source: str = "", slot_wait_s: float = 0.0,
    ) -> tuple[int, int | None]:
        """slot_wait_s: while every KV slot is in use, wait up to this long for one in the target's
        queue (first come, first served) before CacheFull; 0: CacheFull at once."""
        request = target_pb2.TargetServiceStartSessionRequest(
            session_id=session_id, token_ids=list(token_ids), sampling=sampling_params_to_proto(params),
            sample_first_token=sample_first_token, drafts_elsewhere=drafts_elsewhere, draft_source=draft_source,
            slot_wait_ms=round(slot_wait_s * 1000),
        )
        response = await self._call(self._stub.StartSession, request, session_id, extra_time_s=slot_wait_s)
        if response.HasField("draft_limit"):  # into the cycle being measured, as a plain step's is
            report_draft_limit(response.draft_limit)
        first = response.first_token_id if response.HasField("first_token_id") else None
        return response.position, first

    async def verify(self, session_id: str, position: int, draft: DraftBlock, epoch: int = 0) -> VerifyOutcome:
        request = target_pb2.TargetServiceVerifyRequest(
            session_id=session_id, position=position, draft_token_ids=draft.token_ids.tolist(), draft_epoch=epoch,
        )
        if draft.draft_probs is not None:
            request.draft_distributions.CopyFrom(pack_distributions(draft))
        response = await self._cycle_call(self._stub.Verify, request, session_id, position)
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
        response = await self._timed_call(self._stub.Decode, request, session_id, position)
        return list(response.token_ids)

    async def decode_stream(
        self,
        session_id: str,
        position: int,
        num_tokens: int,
        append_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
        inner_draft: InnerDraft | None = None,
    ) -> AsyncIterator[list[int]]:
        """decode(), streamed (DecodeStream): each step's token(s) as the target commits them, while
        it already computes the next. Every message must come within timeout_s (the stream as a
        whole has no deadline: a long plain run takes longer than any one call). Closing the
        iterator early cancels the stream; the target may have committed a step more than was
        read, so the caller truncates to where it stopped reading before anything else. A target
        older than DecodeStream (UNIMPLEMENTED) gets one Decode call per step, from then on.
        inner_draft: the target drafts each step itself (prompt lookup or its hosted draft model)
        and verifies the draft in the step (specdec.engine.inner_draft); each such step's outcome
        goes to the cycle being measured (report_inner_draft)."""
        if num_tokens < 0:  # uint32 on the wire: refuse here rather than wrap around
            raise errors.InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
        if not self._decode_stream_unimplemented:
            try:
                async for tokens in self._streamed(session_id, position, num_tokens, append_token_ids, stop_token_ids,
                                                   inner_draft):
                    yield tokens
                return
            except _Unimplemented:
                self._decode_stream_unimplemented = True
                log.warning("the target service at %s has no DecodeStream (an older version): plain decoding "
                            "makes one Decode call per token", self.channel)
        async for tokens in decode_by_steps(self.decode, session_id, position, num_tokens, append_token_ids,
                                            stop_token_ids):
            yield tokens

    async def _streamed(self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int],
                        stop_token_ids: Sequence[int], inner_draft: InnerDraft | None = None) -> AsyncIterator[list[int]]:
        request = target_pb2.TargetServiceDecodeStreamRequest(
            session_id=session_id, position=position, append_token_ids=list(append_token_ids),
            num_tokens=num_tokens, stop_token_ids=list(stop_token_ids),
        )
        if inner_draft is not None:
            field = {"ngram": "lookup_draft_tokens", "model": "model_draft_tokens"}.get(inner_draft.kind)
            if field is None:
                raise errors.InvalidArgument(f"an inner draft is 'ngram' or 'model', got {inner_draft.kind!r}")
            setattr(request, field, inner_draft.num_tokens)
            request.adaptive_draft_length = inner_draft.adaptive
        call = self._stub.DecodeStream(request, metadata=self.metadata or None)
        last = time.perf_counter()
        try:
            while True:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        response = await call.read()
                except TimeoutError:
                    raise errors.ServiceUnavailable(
                        f"{self.SERVICE} sent no token for {self.timeout_s} s (DecodeStream)") from None
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                        raise _Unimplemented() from err
                    raise domain_error(err, self.SERVICE, session_id, position) from err
                if response is grpc.aio.EOF:
                    return
                now = time.perf_counter()
                timing = server_timing_seconds(response)
                if timing is not None:
                    report_model_time(self.ROLE, *timing, now - last)
                    if response.timing.draft_model_ns:  # a draft the target's hosted draft model made
                        report_model_time(DRAFT, response.timing.draft_model_ns * 1e-9)
                report_draft_limit(response.draft_limit if response.HasField("draft_limit") else None)
                tokens = list(response.token_ids)
                if response.num_drafted:
                    report_inner_draft(VerifyOutcome(response.position - len(tokens), response.num_drafted,
                                                       response.num_accepted, tokens[-1]))
                last = now
                yield tokens
        finally:
            call.cancel()  # a no-op once the stream ended

    async def end_turn(self, session_id: str, position: int) -> bool:
        """The session's turn ended at position: its KV slot may go to a new session at once (EndTurn;
        ServiceClient._end_turn)."""
        request = target_pb2.TargetServiceEndTurnRequest(session_id=session_id, position=position)
        return await self._end_turn(request, session_id)

    async def score_tokens(self, token_ids: Sequence[int], candidate_token_ids: Sequence[int],
                           slot_wait_s: float = 0.0) -> tuple[list[float], int]:
        """The target's logits for each candidate after token_ids, and its greedy token there
        (ScoreTokens: a prefill in a throwaway session, which waits up to slot_wait_s for a KV slot)."""
        request = target_pb2.TargetServiceScoreTokensRequest(token_ids=list(token_ids),
                                                             candidate_token_ids=list(candidate_token_ids),
                                                             slot_wait_ms=round(slot_wait_s * 1000))
        response = await self._call(self._stub.ScoreTokens, request, extra_time_s=slot_wait_s)
        return list(response.logits), response.greedy_token_id

    async def describe(self) -> TargetDescription:
        msg = (await self._call(self._stub.GetInfo, target_pb2.TargetServiceGetInfoRequest())).model
        return TargetDescription(model=model_info_from_proto(msg), **ServiceDescription.fields_from_proto(msg))


class _Unimplemented(Exception):
    """The target has no DecodeStream (an older version): it said so before sending anything."""


# A TargetClient on a new channel with TLS, deadlines and tracing: see ServiceClient.connect.
connect = TargetClient.connect
