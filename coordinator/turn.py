"""One turn of a session, run as a task: prepare the target, the first token, the loop, the end.

The turn produces Blocks (committed tokens and the Redis write that records them) into a queue
that the stream (stream.py) consumes: the loop never waits for the client or for Redis, and the
client never sees a token before it is recorded. The turn ends in one of three ways:
- finished (EOS, length, stop sequence) or cancelled here: the final state is written;
- stopped elsewhere (Cancel or EndSession on another coordinator, or a takeover): our fenced
  write was refused, or the target session vanished and the record says why;
- failed: the record is left resumable (no owner), so a later resume rebuilds what is needed.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, replace

from specdec.engine.api import InnerDraft
from specdec.engine.cycle_cost import measure_cycle
from specdec.errors import SessionNotFound, SpecDecError
from specdec.generation import draft_opening
from specdec.generation.loop import SpeculativeLoop
from specdec.generation.session import GenerationResult, LoopSettings, SessionCursor
from specdec.generation.pipeline_price import PipelinePrice
from specdec.generation.shared_estimates import SharedEstimates, SharedEstimatesByRoute
from specdec.generation.stats import SpeculationStats
from specdec.generation.stopping import FinishReason, StopChecker
from specdec.sampling.params import SamplingParams
from specdec.store import SessionStatus, SessionStore, VersionConflict

from coordinator.failover import SessionDraft, SessionTarget
from coordinator.recorder import Recorder
from coordinator.requests import Pool
from coordinator.routing import Router
from coordinator.state import TurnRecord, turn_of
from coordinator.telemetry import Telemetry, TurnObserver

log = logging.getLogger(__name__)


_background: set[asyncio.Task] = set()  # referenced until done: the loop keeps only weak references


def _in_background(call) -> None:
    """Run a best-effort call (it handles its own errors) without keeping the stream waiting."""
    task = asyncio.ensure_future(call)
    _background.add(task)
    task.add_done_callback(_background.discard)


class StopRequest(enum.Enum):
    CANCEL = "cancel"  # Cancel / EndSession: ends as cancelled, caches freed
    INTERRUPT = "interrupt"  # the stream broke, or shutdown: stays resumable, caches kept


class TurnStopped(SpecDecError):
    """Someone else stopped the turn (maps to ABORTED when it reaches a client)."""

    def __init__(self, message: str, taken_over: bool = False):
        super().__init__(message)
        self.taken_over = taken_over


class SessionRecordLost(SpecDecError):
    """The session's record vanished from Redis mid-turn (maps to DATA_LOSS). An ended session
    leaves a tombstone, so this is data loss: Redis restarted without persistence, or evicted or
    expired the key."""

    def __init__(self, session_id: str):
        super().__init__(
            f"the record of session {session_id!r} disappeared from Redis during the turn (Redis lost its "
            "data, or evicted or expired the key); the tokens already streamed are all that was generated: "
            "start a new session (and give Redis persistence and no eviction policy; DEPLOYMENT.md)"
        )


class TurnStop(StopChecker):
    """A StopChecker that also ends the turn on request, at the next cycle boundary (the loop then
    leaves both caches holding exactly the committed sequence)."""

    requested: StopRequest | None = None

    def check(self, new_tokens):
        keep, reason = super().check(new_tokens)
        if reason is None and self.requested is not None:
            return keep, FinishReason.CANCELLED
        return keep, reason


@dataclass(frozen=True)
class TurnSettings:
    num_draft_tokens: int = 4
    retry_draft_after: int = 8
    heartbeat_s: float = 3.0
    failover_timeout_s: float = 30.0
    adaptive: bool = True  # a request naming no draft length gets an adaptive one
    max_adaptive_tokens: int = 8
    pipelining: bool = False  # a request not naming speculation.pipelined gets this (--pipelining)
    pipelining_min_full_accept: float = 0.0  # --pipelining auto's gate; a request asking for pipelining gets 0
    pipelining_priced: bool = False  # --pipelining auto's price (pipeline_price.py); not for a request asking
    pipeline_branches: int = 1  # --pipeline-branches
    plain_streaming: bool = True  # --plain-decoding
    inner_draft: str = ""  # --draft target:ngram / target:model: speculative turns draft inside the target
    adaptive_warm_start: bool = True  # --adaptive-warm-start
    feed_draft_every: int = 0  # --feed-draft-every


@dataclass(frozen=True)
class TurnPlan:
    """Everything a turn needs, decided by sessions.py when it claimed the turn."""

    session_id: str
    owner: str
    params: SamplingParams
    pool: Pool
    tokens: list[int]  # the committed sequence when the turn (re)starts
    turn: TurnRecord  # the turn's record as claimed
    version: int  # the record's version after the claim
    new_session: bool
    target_endpoint: str
    draft_endpoint: str | None  # None: plain decoding
    fingerprint: str  # the target's vocab fingerprint (a draft must match it)
    max_context: int
    eos_token_ids: frozenset[int]
    finished: FinishReason | None = None  # a resumed turn whose tokens already end it


@dataclass
class Block:
    token_ids: list[int]
    position: int  # committed length after them
    recorded: asyncio.Future  # done once Redis has them


@dataclass
class Finished:
    reason: FinishReason
    stats: SpeculationStats
    proposer: str
    interrupted: bool = False  # stopped for shutdown: the client should resume


@dataclass
class Failed:
    error: BaseException


class Turn:
    def __init__(self, plan: TurnPlan, stop: TurnStop, store: SessionStore, router: Router,
                 telemetry: Telemetry, settings: TurnSettings, estimates: SharedEstimatesByRoute | None = None,
                 start_verdicts: draft_opening.StartVerdicts | None = None):
        self.plan, self.stop, self.store, self.router, self.settings = plan, stop, store, router, settings
        self.estimates = estimates  # the coordinator's, for an adaptive length's warm start
        self.start_verdicts = start_verdicts or draft_opening.StartVerdicts()  # the coordinator's
        self.queue: asyncio.Queue = asyncio.Queue()  # bounded by the turn's token budget
        self.done = asyncio.Event()
        self.recorder = Recorder(store, plan.session_id, plan.version, len(plan.tokens), settings.heartbeat_s,
                                 writer=plan.owner)
        self.observer = TurnObserver(telemetry, plan.pool.value)
        # A draft that ended the previous turn cleanly holds the first draft_position committed
        # tokens; the loop's first Propose appends the rest (accept/rollback), no re-prefill.
        held = plan.turn.draft_position if plan.draft_endpoint is not None else None
        self.cursor = SessionCursor(
            plan.session_id, plan.params, list(plan.tokens), plan.max_context,
            draft_tokens=list(plan.tokens[:held]) if held else [], draft_committed=held or 0,
            draft_ready=bool(held),
        )
        self.target = SessionTarget(
            router, plan.pool, plan.session_id, plan.params, plan.target_endpoint,
            committed=lambda: self.cursor.tokens, guard=self.check_owner,
            on_moved=lambda endpoint: self.recorder.set_fields(target_replica=endpoint),
            failover_timeout_s=settings.failover_timeout_s, draft_source=plan.draft_endpoint,
        )
        self.draft = None
        if plan.draft_endpoint is not None:
            self.draft = SessionDraft(
                router, plan.pool, plan.fingerprint, plan.draft_endpoint,
                on_moved=lambda endpoint: self.recorder.set_fields(draft_replica=endpoint),
            )
        self._previous: asyncio.Future | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self._task = asyncio.ensure_future(self._run())
        return self._task

    def request_stop(self, how: StopRequest) -> None:
        if self.stop.requested is None or how is StopRequest.CANCEL:
            self.stop.requested = how

    async def check_owner(self) -> None:
        """Raise TurnStopped unless the record still says this stream generates the turn."""
        record = await self.store.get(self.plan.session_id)
        if record is None:
            raise SessionRecordLost(self.plan.session_id)
        if record.status is SessionStatus.ENDED:
            raise TurnStopped(f"session {self.plan.session_id!r} was ended")
        if record.status is SessionStatus.CANCELLED:
            raise TurnStopped(f"session {self.plan.session_id!r} was cancelled")
        if turn_of(record).owner != self.plan.owner:
            raise TurnStopped(f"the turn of session {self.plan.session_id!r} was taken over", taken_over=True)

    async def _run(self) -> None:
        self.router.acquire(self.plan.target_endpoint, self.plan.draft_endpoint or "")
        item: Finished | Failed = Failed(asyncio.CancelledError())
        try:
            self.recorder.start_heartbeat()
            result = await self._generate()
            item = await self._finish(result)
        except Exception as exc:  # noqa: BLE001 - sorted out and handed to the stream
            item = await self._after_error(exc)
        finally:
            draft_opening.discard(self.cursor)  # a turn that ended before its loop did
            await self.recorder.stop_heartbeat()
            self.router.release(self.plan.target_endpoint, self.plan.draft_endpoint or "")
            self.queue.put_nowait(item)
            self.done.set()

    async def _generate(self) -> GenerationResult:
        plan = self.plan
        if plan.finished is not None:  # a resumed turn whose committed tokens already end it
            return GenerationResult([], plan.finished, SpeculationStats())
        route = (plan.target_endpoint, plan.draft_endpoint or "")
        opens_early = self.draft is not None and plan.new_session and plan.turn.speculate
        if opens_early and not self.cursor.draft_ready and self.start_verdicts.expects_drafting(*route):
            # The draft prefills the prompt while the target does (specdec/generation/draft_opening.py).
            draft_opening.open_beside_prefill(self.draft, self.cursor, plan.tokens)
        with measure_cycle() as opening:  # a new session's StartSession may say: start plain
            first = await self.target.prepare(plan.tokens, self.plan.turn.turn_start == len(plan.tokens),
                                              plan.new_session)
        self.cursor.target_draft_limit = opening.target_draft_limit
        if opens_early:
            self.start_verdicts.record(*route, refused=opening.target_draft_limit == 0)
        if first is not None:
            self.cursor.tokens.append(first)
            _, reason = self.stop.check([first])
            await self._emit([first])
            if reason is not None:
                return GenerationResult([first], reason, SpeculationStats())
        fixed = plan.turn.num_draft_tokens
        adaptive = not fixed and self.settings.adaptive
        pipelining = self.settings.pipelining if plan.turn.pipelined is None else plan.turn.pipelined
        gate = self.settings.pipelining_min_full_accept if plan.turn.pipelined is None else 0.0
        priced = self.settings.pipelining_priced and plan.turn.pipelined is None
        loop_settings = LoopSettings(fixed or self.settings.num_draft_tokens, self.settings.retry_draft_after,
                                     adaptive=adaptive, max_draft_tokens=self.settings.max_adaptive_tokens,
                                     pipelining=pipelining, pipeline_min_full_accept=gate,
                                     pipeline_price=self._pipeline_price() if priced and pipelining else None,
                                     pipeline_branches=self.settings.pipeline_branches,
                                     stream_plain=self.settings.plain_streaming,
                                     feed_draft_every=self.settings.feed_draft_every,
                                     inner_draft=self._inner_draft(),
                                     shared_estimates=self._shared_estimates(adaptive, pipelining))
        loop = SpeculativeLoop(self.target, self.draft, loop_settings, self.observer)
        return await loop.run(self.cursor, self.stop, self._emit)

    def _shared_estimates(self, adaptive: bool, pipelined: bool) -> SharedEstimates | None:
        """Earlier turns' estimates on this turn's route, for an adaptive length through a draft."""
        if not (adaptive and self.settings.adaptive_warm_start and self.estimates is not None
                and self.plan.draft_endpoint is not None):
            return None
        return self.estimates.route(self.plan.target_endpoint, self.plan.draft_endpoint, pipelined)

    def _pipeline_price(self) -> PipelinePrice:
        """--pipelining auto's price: the route's, which every turn on it adds to, when there is a
        draft service (else this turn's own)."""
        if self.estimates is None or self.plan.draft_endpoint is None:
            return PipelinePrice()
        return self.estimates.price(self.plan.target_endpoint, self.plan.draft_endpoint)

    def _inner_draft(self) -> InnerDraft | None:
        """A speculative turn's drafts inside the target under --draft target:ngram / target:model:
        the request's num_draft_tokens, else an adaptive length up to --max-adaptive-draft-tokens
        (the policy runs in the target's stream), or the default under --draft-length fixed. The
        target's trimming shortens any of them under load."""
        if not (self.settings.inner_draft and self.plan.turn.speculate and self.draft is None):
            return None
        fixed = self.plan.turn.num_draft_tokens
        if not fixed and self.settings.adaptive:
            return InnerDraft(self.settings.inner_draft, self.settings.max_adaptive_tokens, adaptive=True)
        return InnerDraft(self.settings.inner_draft, fixed or self.settings.num_draft_tokens)

    async def _emit(self, token_ids: list[int]) -> None:
        """The loop's sink: record the block (pipelined) and queue it for the stream."""
        if self._previous is not None:
            await self._previous  # at most one block unrecorded; a refused write stops the loop here
        span = self.observer.start_commit_span(len(token_ids))
        recorded = self.recorder.append(token_ids, self.observer.take_stats())
        recorded.add_done_callback(lambda _: span.end())
        self._previous = recorded
        self.queue.put_nowait(Block(list(token_ids), self.recorder.length, recorded))

    async def _finish(self, result: GenerationResult) -> Finished:
        how = self.stop.requested if result.finish_reason is FinishReason.CANCELLED else None
        turn = replace(
            self.plan.turn, owner="", proposer=self.observer.proposer,
            finish_reason="" if how is StopRequest.INTERRUPT else result.finish_reason.value,
            draft_position=len(self.cursor.draft_tokens) if self.cursor.draft_ready else None,
            turn_stats=result.stats.to_dict(),
        )
        fields = {"target_replica": self.target.endpoint, "draft_replica": self.draft.endpoint if self.draft else ""}
        if how is StopRequest.CANCEL:
            await self.free_caches()
            fields = {"target_replica": "", "draft_replica": ""}
            turn = replace(turn, draft_position=None)
        if how is not StopRequest.INTERRUPT:
            fields["status"] = SessionStatus.CANCELLED if how else SessionStatus.FINISHED
        await self.recorder.update({**fields, "extra": turn.to_extra()})
        if how is not StopRequest.CANCEL:  # the caches stay for the next turn, the slots are free
            _in_background(self.target.end_turn(len(self.cursor.tokens)))
            if self.draft is not None and self.cursor.draft_ready:
                _in_background(self.draft.end_turn(self.plan.session_id))
        return Finished(result.finish_reason, result.stats, self.observer.proposer,
                        interrupted=how is StopRequest.INTERRUPT)

    async def _after_error(self, exc: Exception) -> Finished | Failed:
        if isinstance(exc, (VersionConflict, SessionNotFound)):  # a write was refused: ask the record why
            exc = await self._why_refused(exc)
        if isinstance(exc, TurnStopped):
            log.info("session %s: %s", self.plan.session_id, exc)
            if exc.taken_over:
                return Failed(exc)
            await self.free_caches()  # the canceller freed them too; a rebuild may have raced it
            return Finished(FinishReason.CANCELLED, SpeculationStats(), self.observer.proposer)
        if isinstance(exc, SessionRecordLost):  # nothing is left to resume: free the caches too
            log.error("session %s: %s", self.plan.session_id, exc)
            await self.free_caches()
            return Failed(exc)
        log.warning("session %s: turn failed: %r", self.plan.session_id, exc)
        await self._abandon()
        return Failed(exc)

    async def _why_refused(self, exc: Exception) -> Exception:
        """The reason behind a refused write: the turn was stopped or taken over, the record was
        lost, or (none of these, or Redis unreachable) the refusal itself."""
        try:
            await self.check_owner()
        except (TurnStopped, SessionRecordLost) as why:
            return why
        except Exception:  # noqa: BLE001 - Redis unreachable: report the original error
            return exc
        return exc

    async def _abandon(self) -> None:
        """Leave the session resumable: no owner (INTERRUPTED), caches where they are. A new
        session that never produced a token is removed: its client never learned its id."""
        try:
            await self.recorder.settled()
            if self.plan.new_session and self.recorder.length == len(self.plan.tokens):
                await self.store.delete(self.plan.session_id)
                await self.free_caches()
            else:
                # Where the draft stands is unknown after a failure: it is reopened next time.
                turn = replace(self.plan.turn, owner="", draft_position=None)
                await self.recorder.update({"extra": turn.to_extra()})
        except Exception as exc:  # noqa: BLE001 - a stale owner expires with its lease anyway
            log.warning("session %s: could not release the turn: %r", self.plan.session_id, exc)

    async def free_caches(self) -> None:
        for part in (self.target, self.draft):
            if part is None:
                continue
            try:
                await part.end_session(self.plan.session_id)
            except Exception as exc:  # noqa: BLE001 - idempotent and best effort: replicas expire idle sessions
                log.info("session %s: freeing a cache failed: %r", self.plan.session_id, exc)
