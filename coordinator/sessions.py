"""Session lifecycle: Generate (new session, next turn, resume), Cancel, EndSession, GetSession.

The coordinator keeps no session state of its own beyond the turns running in this process;
everything else is read from Redis on each call, so any coordinator replica serves any session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from specdec.errors import InvalidArgument, SessionNotFound
from specdec.generation.draft_opening import StartVerdicts
from specdec.generation.shared_estimates import SharedEstimatesByRoute
from specdec.generation.stopping import FinishReason
from specdec.observability import spans
from specdec.store import SessionRecord, SessionStatus, SessionStore

from coordinator.claims import Claim, Claims, TurnInProgress
from coordinator.prompts import PromptEncoder
from coordinator.requests import GenerateRequest, Limits, Pool, validate
from coordinator.routing import Router
from coordinator.state import Phase, owner_is_live, phase, turn_of
from coordinator.stream import StreamMessage, TextStream, TurnStream, stats_from_dict
from coordinator.telemetry import RequestClock, Telemetry
from coordinator.turn import StopRequest, Turn, TurnSettings

# How long an ended session's record stays as a tombstone: longer than any turn elsewhere takes to
# notice (its next write is refused at once; a turn waiting for a replica checks before each retry).
ENDED_KEEP_S = 120.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionConfig:
    default_pool: Pool = Pool.SPECULATIVE
    owner_lease_s: float = 10.0  # a turn whose record is older than this has no live coordinator
    turn: TurnSettings = TurnSettings()
    stop_wait_s: float = 10.0  # how long Cancel / resume wait for a local turn to stop


@dataclass(frozen=True)
class Opened:
    """A Generate call once its turn is claimed: what to replay, then the turn to follow."""

    stream: TurnStream
    turn: Turn | None  # None: a finished turn, replayed only
    replay: list[StreamMessage]
    added: int  # input tokens this call added to the session (prefilled)


@dataclass(frozen=True)
class SessionView:
    record: SessionRecord
    phase: Phase
    expires_at: float  # seconds since the epoch


class SessionManager:
    def __init__(self, store: SessionStore, router: Router, prompts: PromptEncoder, telemetry: Telemetry,
                 limits: Limits, config: SessionConfig,
                 status_name: Callable[[BaseException], str] = lambda exc: type(exc).__name__):
        self.store, self.router, self.prompts, self.telemetry = store, router, prompts, telemetry
        self.limits, self.config = limits, config
        self.status_name = status_name  # an error -> the status code name the client sees (metrics)
        self.claims = Claims(store, router, prompts, config.default_pool)
        self._turns: dict[str, Turn] = {}  # turns running in this process, by session id
        self.estimates = SharedEstimatesByRoute()  # what adaptive turns measured, per route
        self.start_verdicts = StartVerdicts()  # whether targets refused new sessions' drafts, per route

    # ---- Generate --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamMessage]:
        clock = RequestClock()
        pool = (request.pool or self.config.default_pool).value
        span = self.telemetry.request_span(request.operation, {spans.SPECDEC_POOL: pool})
        opened = None
        try:
            with trace.use_span(span, end_on_exit=False):  # the turn's task inherits the span
                opened = await self._open(request, span)
            for message in opened.replay:
                clock.streamed(message)
                yield message
            if opened.turn is not None:
                async for message in opened.stream.follow(opened.turn):
                    clock.streamed(message)
                    yield message
        except BaseException as exc:
            cancelled = isinstance(exc, (asyncio.CancelledError, GeneratorExit))
            clock.outcome = "CANCELLED" if cancelled else self.status_name(exc)
            span.set_status(Status(StatusCode.ERROR, clock.outcome))
            raise
        finally:
            self._close(opened, span, clock, pool)

    def _close(self, opened: Opened | None, span: trace.Span, clock: RequestClock, pool: str) -> None:
        metrics = self.telemetry.metrics
        if opened is not None:
            if opened.turn is not None and not opened.turn.done.is_set():
                opened.turn.request_stop(StopRequest.INTERRUPT)  # the client went away: keep it resumable
            stream, pool = opened.stream, opened.stream.pool.value
            span.set_attributes(spans.usage_attributes(
                input_tokens=stream.turn_start, output_tokens=stream.position - stream.turn_start))
            metrics.active_requests.labels(pool, "any").dec()
            metrics.prompt_tokens.labels(pool, clock.proposer).inc(opened.added)
        span.end()
        self.telemetry.request_finished(clock, pool)

    async def _open(self, request: GenerateRequest, span: trace.Span) -> Opened:
        max_new_tokens = validate(request, self.limits)
        if request.session_id is None:
            opened = self._opened(await self.claims.new_session(request, max_new_tokens))
        elif request.resume_from is None:
            record = await self._record(request.session_id)
            self._refuse_if_generating(record, request.session_id)
            opened = self._opened(await self.claims.next_turn(request, record, request.session_id, max_new_tokens))
        else:
            opened = await self._resume(await self._record(request.session_id), request.session_id,
                                        request.resume_from)
        span.set_attributes(self._request_attributes(request, opened.stream, max_new_tokens))
        self.telemetry.metrics.active_requests.labels(opened.stream.pool.value, "any").inc()
        if opened.turn is not None:
            self._start(opened.turn)
        return opened

    def _opened(self, claim: Claim) -> Opened:
        plan, turn_record = claim.plan, claim.plan.turn
        text = TextStream(self.prompts.stream_decoder(), turn_record.stop_sequences)
        stream = TurnStream(plan.session_id, text, turn_record.turn_start, len(plan.tokens), plan.pool,
                            self._draft_length(turn_record))
        return Opened(stream, Turn(*self._turn_args(claim)), [], claim.added)

    async def _resume(self, record: SessionRecord, session_id: str, from_position: int) -> Opened:
        record = await self._wait_unowned(record, session_id)
        turn_record = turn_of(record)
        if not turn_record.turn_start <= from_position <= record.length:
            raise InvalidArgument(
                f"resume.from_position must lie within the latest turn, [{turn_record.turn_start}, "
                f"{record.length}], got {from_position}"
            )
        tokens = await self.store.tokens(session_id)
        turn = None
        if record.status is SessionStatus.ACTIVE:
            turn = Turn(*self._turn_args(await self.claims.resume(record, session_id, tokens)))
        stream = TurnStream(session_id, self._text(turn_record, tokens, from_position), turn_record.turn_start,
                            from_position, Pool(record.pool), self._draft_length(turn_record))
        replay = [m for m in [stream.replay(tokens[from_position:])] if m is not None]
        if turn is None:  # finished: replay, then the end it had
            reason = FinishReason(turn_record.finish_reason or FinishReason.CANCELLED.value)
            replay.append(stream.final(reason, stats_from_dict(turn_record.turn_stats), turn_record.proposer))
        return Opened(stream, turn, replay, 0)

    def _turn_args(self, claim):
        return (claim.plan, claim.stop, self.store, self.router, self.telemetry, self.config.turn, self.estimates,
                self.start_verdicts)

    def _draft_length(self, turn_record) -> int:
        if not turn_record.speculate:
            return 0
        return turn_record.num_draft_tokens or self.config.turn.num_draft_tokens

    def _text(self, turn_record, tokens: list[int], from_position: int) -> TextStream:
        text = TextStream(self.prompts.stream_decoder(), turn_record.stop_sequences)
        text.prime(tokens[turn_record.turn_start:from_position])
        return text

    def _start(self, turn: Turn) -> None:
        session_id = turn.plan.session_id
        self._turns[session_id] = turn
        turn.start().add_done_callback(
            lambda _: self._turns.pop(session_id) if self._turns.get(session_id) is turn else None
        )

    def _request_attributes(self, request: GenerateRequest, stream: TurnStream, max_new_tokens: int) -> dict:
        params = request.sampling
        return spans.request_attributes(
            model=self.telemetry.model, operation=request.operation, temperature=params.temperature,
            top_p=params.top_p, top_k=params.top_k, max_tokens=max_new_tokens, seed=params.seed,
            conversation_id=stream.session_id,
        ) | {spans.SPECDEC_POOL: stream.pool.value}

    # ---- Cancel, EndSession, GetSession ------------------------------------------------------

    async def cancel(self, session_id: str) -> bool:
        record = await self._record(session_id)
        local = self._turns.get(session_id)
        generating = local is not None or phase(record, self.config.owner_lease_s) is Phase.GENERATING
        if local is not None and await self._stop_local(local, StopRequest.CANCEL):
            record = await self._record(session_id)
            if record.status is SessionStatus.CANCELLED:
                return True  # its final write marked it cancelled and freed both caches
        fields = {"target_replica": "", "draft_replica": ""}
        if record.status is SessionStatus.ACTIVE:
            # Unfenced on purpose: this write makes a turn running elsewhere fail its next write.
            turn = replace(turn_of(record), owner="", finish_reason=FinishReason.CANCELLED.value,
                           draft_position=None)
            fields |= {"status": SessionStatus.CANCELLED, "extra": turn.to_extra()}
        await self.store.update(session_id, fields)
        await self._free_caches(record, session_id)
        return generating

    async def end(self, session_id: str) -> bool:
        record = await self.store.get(session_id)
        if record is None or record.status is SessionStatus.ENDED:
            return False
        await self.store.end(session_id)  # fences any running turn first
        local = self._turns.get(session_id)
        if local is not None:
            await self._stop_local(local, StopRequest.CANCEL)
        await self._free_caches(record, session_id)
        await self.store.retire(session_id, ENDED_KEEP_S)
        return True

    async def get(self, session_id: str) -> SessionView:
        record = await self._record(session_id)
        # Every write slides the TTL (reads do not), so it runs from the last update.
        return SessionView(record, phase(record, self.config.owner_lease_s),
                           record.updated_at + self.store.ttl_seconds)

    async def drain(self, timeout_s: float) -> None:
        """Shutdown: let running turns finish for half the time, then stop the rest resumably."""
        turns = list(self._turns.values())
        if not turns:
            return
        log.info("draining %d running turns", len(turns))
        await _all_done(turns, timeout_s / 2)
        for turn in turns:
            turn.request_stop(StopRequest.INTERRUPT)
        await _all_done(turns, timeout_s / 2)

    # ---- helpers -----------------------------------------------------------------------------

    async def _record(self, session_id: str) -> SessionRecord:
        record = await self.store.get(session_id)
        if record is None or record.status is SessionStatus.ENDED:
            raise SessionNotFound(session_id)
        return record

    def _refuse_if_generating(self, record: SessionRecord, session_id: str) -> None:
        local = self._turns.get(session_id)
        if (local is not None and not local.done.is_set()) or owner_is_live(record, self.config.owner_lease_s):
            raise TurnInProgress(
                f"a turn of session {session_id!r} is being generated; wait for its last message, "
                "Cancel it, or resume its stream"
            )

    async def _wait_unowned(self, record: SessionRecord, session_id: str) -> SessionRecord:
        """Resume takes over a turn only when no live stream generates it: stop ours (a broken
        stream this process has not noticed yet), wait for another coordinator's to stop or
        expire."""
        local = self._turns.get(session_id)
        if local is not None:
            await self._stop_local(local, StopRequest.INTERRUPT)
            record = await self._record(session_id)
        deadline = time.monotonic() + self.config.owner_lease_s + 1.0
        while owner_is_live(record, self.config.owner_lease_s) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            record = await self._record(session_id)
        if owner_is_live(record, self.config.owner_lease_s):
            raise TurnInProgress(f"another stream is generating session {session_id!r}; retry the resume")
        return record

    async def _stop_local(self, turn: Turn, how: StopRequest) -> bool:
        turn.request_stop(how)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(turn.done.wait(), self.config.stop_wait_s)
        return turn.done.is_set()

    async def _free_caches(self, record: SessionRecord, session_id: str) -> None:
        for client_of, endpoint in ((self.router.target, record.target_replica),
                                    (self.router.draft, record.draft_replica)):
            if endpoint:
                try:
                    await client_of(endpoint).end_session(session_id)
                except Exception as exc:  # noqa: BLE001 - best effort: replicas expire idle sessions
                    log.info("session %s: EndSession on %s failed: %r", session_id, endpoint, exc)


async def _all_done(turns: list[Turn], timeout_s: float) -> None:
    waiters = [asyncio.ensure_future(t.done.wait()) for t in turns]
    await asyncio.wait(waiters, timeout=timeout_s)
    for waiter in waiters:
        waiter.cancel()
