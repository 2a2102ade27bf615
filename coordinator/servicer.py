"""CoordinatorService over gRPC: protobuf in, the session manager, protobuf out. Nothing else.

Domain errors map to status codes once, in the server's ErrorMappingInterceptor (specdec.errors'
defaults plus ERROR_CODES below); messages reach the client verbatim.
"""

from __future__ import annotations

import grpc

from specdec.errors import InvalidArgument, ServiceUnavailable
from specdec.rpc import coordinator_pb2 as pb
from specdec.rpc import coordinator_pb2_grpc
from specdec.server.interceptors import STATUS_BY_ERROR, grpc_status
from specdec.store import SchemaMismatch, StoreUnavailable, VersionConflict
from specdec.store.canary import CanaryWriteRefused

from coordinator.canary import CanaryController
from coordinator.canary_state import CanaryDisabled
from coordinator.canary_convert import state_to_proto, status_to_proto
from coordinator.canary_policy import Action
from coordinator.claims import TurnInProgress
from coordinator.convert import message_to_proto, request_from_proto, session_to_proto
from coordinator.failover import NoReplica
from coordinator.sessions import SessionManager
from coordinator.stream import StreamInterrupted
from coordinator.turn import SessionRecordLost, TurnStopped

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CoordinatorService"].full_name

ERROR_CODES = {
    TurnInProgress: grpc.StatusCode.FAILED_PRECONDITION,
    TurnStopped: grpc.StatusCode.ABORTED,
    SessionRecordLost: grpc.StatusCode.DATA_LOSS,
    VersionConflict: grpc.StatusCode.ABORTED,
    SchemaMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    NoReplica: grpc.StatusCode.UNAVAILABLE,
    ServiceUnavailable: grpc.StatusCode.UNAVAILABLE,
    StreamInterrupted: grpc.StatusCode.UNAVAILABLE,
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    CanaryDisabled: grpc.StatusCode.FAILED_PRECONDITION,
    CanaryWriteRefused: grpc.StatusCode.ABORTED,
}


def status_name(exc: BaseException) -> str:
    """The status code name a client sees for an error (the requests metric's label)."""
    if isinstance(exc, grpc.aio.AbortError):
        return "ABORTED_BY_HANDLER"
    mapped = grpc_status(exc, {**STATUS_BY_ERROR, **ERROR_CODES})
    return mapped[0].name if mapped else grpc.StatusCode.INTERNAL.name


def _session_id(value: str) -> str:
    if not value:
        raise InvalidArgument("session_id is required")
    return value


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, sessions: SessionManager, canary: CanaryController | None = None):
        self.sessions = sessions
        self.canary = canary

    async def Generate(self, request, context):
        async for message in self.sessions.generate(request_from_proto(request)):
            yield message_to_proto(message)

    async def Cancel(self, request, context):
        was_generating = await self.sessions.cancel(_session_id(request.session_id))
        return pb.CoordinatorServiceCancelResponse(was_generating=was_generating)

    async def GetSession(self, request, context):
        session_id = _session_id(request.session_id)
        view = await self.sessions.get(session_id)
        return pb.CoordinatorServiceGetSessionResponse(session=session_to_proto(session_id, view))

    async def EndSession(self, request, context):
        existed = await self.sessions.end(_session_id(request.session_id))
        return pb.CoordinatorServiceEndSessionResponse(existed=existed)

    async def GetCanary(self, request, context):
        return status_to_proto(await self._canary().status(request.max_decisions or 20))

    async def PromoteCanary(self, request, context):
        state = await self._act(Action.PROMOTE, request.reason, full=request.to_last_step)
        return pb.CoordinatorServicePromoteCanaryResponse(state=state)

    async def AbortCanary(self, request, context):
        return pb.CoordinatorServiceAbortCanaryResponse(state=await self._act(Action.ABORT, request.reason))

    async def PauseCanary(self, request, context):
        return pb.CoordinatorServicePauseCanaryResponse(state=await self._act(Action.PAUSE, request.reason))

    async def ResumeCanary(self, request, context):
        return pb.CoordinatorServiceResumeCanaryResponse(state=await self._act(Action.RESUME, request.reason))

    async def _act(self, action: Action, reason: str, full: bool = False) -> pb.CanaryState:
        canary = self._canary()
        state = await canary.act(action, reason, full)
        return state_to_proto(state, await canary.store.holder(), canary.policy.steps)

    def _canary(self) -> CanaryController:
        if self.canary is None:
            raise CanaryDisabled("this coordinator runs no canary controller; start it with --canary")
        return self.canary
