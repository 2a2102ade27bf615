"""What the servicers of the model services (target, draft) share.

Request checks every RPC makes (check_session_id), span attributes (annotate), and EngineServicer:
engine calls on the ModelExecutor thread with the gauges updated after each, the reaper of idle
sessions, and the Truncate and EndSession RPCs, which both services define alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from opentelemetry import trace

from specdec.errors import InvalidArgument
from specdec.observability.spans import SPECDEC_POSITION
from specdec.server.executor import ModelExecutor

log = logging.getLogger(__name__)

SPECDEC_SESSION_ID = "specdec.session_id"
MAX_SESSION_ID_LENGTH = 256


def check_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_LENGTH:
        raise InvalidArgument(
            f"session_id must be a non-empty string of at most {MAX_SESSION_ID_LENGTH} characters, "
            f"got {len(session_id)} characters"
        )


def annotate(**attributes: Any) -> None:
    """Add attributes to the current RPC's server span (a no-op when it is not recorded); None values
    are left out."""
    trace.get_current_span().set_attributes({k: v for k, v in attributes.items() if v is not None})


class EngineServicer:
    """Base of a servicer in front of a session-keyed engine (truncate, end_session, and
    expire_idle() -> expired ids); list it before the generated servicer class.

    Subclasses set `engine` and `executor`, name the response messages of Truncate and EndSession,
    and define update_gauges(); one whose own state is keyed by session overrides forget_sessions()."""

    TRUNCATE_RESPONSE: ClassVar[type]
    END_SESSION_RESPONSE: ClassVar[type]
    engine: Any
    executor: ModelExecutor

    async def Truncate(self, request, context):
        check_session_id(request.session_id)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, SPECDEC_POSITION: request.position})
        self.end_stream(request.session_id)
        position = await self._run(self.engine.truncate, request.session_id, request.position)
        return self.TRUNCATE_RESPONSE(position=position)

    async def EndSession(self, request, context):
        annotate(**{SPECDEC_SESSION_ID: request.session_id})
        self.end_stream(request.session_id)
        existed = await self._run(self.engine.end_session, request.session_id)
        self.forget_sessions([request.session_id])
        return self.END_SESSION_RESPONSE(existed=existed)

    def update_gauges(self) -> None:
        raise NotImplementedError

    def forget_sessions(self, session_ids: Iterable[str]) -> None:
        """Drop the servicer's own state of sessions that ended or expired."""

    def end_stream(self, session_id: str) -> None:
        """Before any other call of a session runs: end the session's streamed call, if the servicer
        has one (the target's DecodeStream), so that no step of it commits after this call."""

    async def aclose(self) -> None:
        """At shutdown, before the model thread closes: stop what the servicer runs (a batcher)."""

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the model thread; the gauges are updated however it ends."""
        try:
            return await self.executor.run(fn, *args)
        finally:
            self.update_gauges()

    async def expire_idle_sessions(self, interval_s: float) -> None:
        """Forever: end sessions idle past the engine's TTL (the coordinator re-opens them from its
        session store if they come back)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                expired = await self._run(self.engine.expire_idle)
            except Exception:  # noqa: BLE001 - keep expiring later; a dead reaper would leak slots
                log.exception("expiring idle sessions failed")
                continue
            self.forget_sessions(expired)
            if expired:
                log.info("expired %d idle sessions", len(expired))
