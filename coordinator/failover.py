"""A session's target and draft as the loop sees them: TargetAPI / DraftAPI that outlive replicas.

SessionTarget forwards to the session's target replica. When that replica is gone
(ServiceUnavailable) or has lost the session (SessionNotFound: restarted, evicted), it rebuilds the
session's cache on another replica, or on the same one restarted, by prefilling the committed
tokens (StartSession with sample_first_token=False), then repeats the call. Every call names an
absolute position and the randomness is keyed on positions, so the repeated call commits exactly
what the first attempt would have: the output is unchanged and the request does not fail.

SessionDraft forwards to the session's draft replica; a draft that fails is never fatal (the loop
decodes plainly and reopens the draft session later), and that reopening is when a draft that did
not answer is replaced by another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, Sequence

from specdec.errors import (
    CacheFull, PositionMismatch, ServiceUnavailable, SessionExists, SessionNotFound, SpecDecError,
)
from specdec.sampling.params import SamplingParams

from coordinator.requests import Pool
from coordinator.routing import DRAFT, TARGET, Router

log = logging.getLogger(__name__)

# CacheFull: every KV slot of the replica is held by sessions in mid-turn (the target's --evict-after);
# the call waits for one, as a queue would, for up to failover_timeout_s.
RECOVERABLE = (ServiceUnavailable, SessionNotFound, PositionMismatch, CacheFull)


async def backoff(delay: float) -> float:
    """Wait `delay` seconds before a retry; the next retry's delay (doubling, at most 1 s)."""
    await asyncio.sleep(delay)
    return min(2 * delay, 1.0)


def _log_recovery(session_id: str, endpoint: str, exc: Exception) -> None:
    # Waiting for a KV slot is load, not a fault: a queue of sessions would otherwise log every retry.
    level = logging.DEBUG if isinstance(exc, CacheFull) else logging.WARNING
    log.log(level, "session %s on target %s: %s; recovering", session_id, endpoint, exc)


class NoReplica(SpecDecError):
    """No replica of the needed kind is registered or configured (maps to UNAVAILABLE)."""


class SessionTarget:
    def __init__(
        self,
        router: Router,
        pool: Pool,
        session_id: str,
        params: SamplingParams,
        endpoint: str,
        *,
        committed: Callable[[], Sequence[int]],
        guard: Callable[[], Awaitable[None]],
        on_moved: Callable[[str], None],
        failover_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        draft_source: str | None = None,
    ):
        self.router, self.pool, self.session_id, self.params = router, pool, session_id, params
        self.endpoint = endpoint
        self.draft_source = draft_source  # where its drafts come from (StartSession says); None: no draft
        self.committed = committed  # the committed sequence as the loop knows it (cursor.tokens)
        self.guard = guard  # raises when the turn must stop instead of rebuilding anything
        self.on_moved = on_moved
        self.failover_timeout_s = failover_timeout_s
        self.clock = clock
        self.rebuilds = 0
        self.slot_wait_s = 0.0  # how long a StartSession waits for a KV slot in the target's queue
        self.give_up_at = 0.0  # when the call being retried fails for good (failover_timeout_s)

    @property
    def client(self):
        return self.router.target(self.endpoint)

    async def prepare(self, tokens: Sequence[int], need_first: bool, new_session: bool) -> int | None:
        """Make the replica hold exactly `tokens` and, with need_first, commit and return the next
        token: StartSession for a new session or one the replica lost; else Truncate (dropping
        what a stopped stream left beyond the record) and Decode what the replica lacks."""
        start = new_session

        async def attempt(client) -> int | None:
            if start:
                return await self._start(client, tokens, need_first)
            held = await client.truncate(self.session_id, len(tokens))
            new = await client.decode(self.session_id, held, int(need_first), list(tokens[held:]))
            return new[0] if need_first else None

        async def restart(error: Exception) -> None:
            nonlocal start
            start = True

        return await self._retrying(attempt, restart)

    async def verify(self, session_id: str, position: int, draft, epoch: int = 0):
        return await self._retrying(
            lambda c: c.verify(session_id, position, draft, epoch), lambda e: self._realign(e, position)
        )

    async def decode(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = ()
    ) -> list[int]:
        return await self._retrying(
            lambda c: c.decode(session_id, position, num_tokens, append_token_ids),
            lambda e: self._realign(e, position),
        )

    async def decode_stream(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (), inner_draft=None,
    ) -> AsyncIterator[list[int]]:
        """The replica's DecodeStream; after a recoverable error it recovers as every call does and
        resumes after the last token read (the loop has committed it by then), for up to
        failover_timeout_s since the last token."""
        appended, left, stops = list(append_token_ids), num_tokens, frozenset(stop_token_ids)
        deadline, delay, error = self.clock() + self.failover_timeout_s, 0.05, None
        self.give_up_at = deadline
        ended = False  # the run is complete: an error after its last token needs no resuming
        while not ended:
            try:
                if error is not None:
                    delay = await self._recover(error, lambda e: self._realign(e, position), delay)
                stream = self.client.decode_stream(session_id, position, left, appended, stop_token_ids,
                                                   inner_draft)
                async with contextlib.aclosing(stream):  # closing this closes the replica's stream now
                    async for tokens in stream:
                        position += len(appended) + len(tokens)
                        appended, left, error = [], left - len(tokens), None
                        ended = left <= 0 or bool(tokens) and tokens[-1] in stops
                        deadline = self.give_up_at = self.clock() + self.failover_timeout_s
                        yield tokens
                return
            except RECOVERABLE as exc:
                if self.clock() >= deadline:
                    raise self._gave_up(exc) from exc
                _log_recovery(self.session_id, self.endpoint, exc)
                error = exc

    async def truncate(self, session_id: str, position: int) -> int:
        return await self._retrying(
            lambda c: c.truncate(session_id, position), lambda e: self._realign(e, position)
        )

    async def start_session(self, session_id, token_ids, params, sample_first_token: bool = True,
                            drafts_elsewhere: bool = False, draft_source: str = ""):  # (its own apply)
        first = await self.prepare(token_ids, sample_first_token, new_session=True)
        return len(token_ids) + int(sample_first_token), first

    async def end_session(self, session_id: str) -> bool:
        try:
            return await self.client.end_session(session_id)
        except ServiceUnavailable:  # gone with its caches; its idle TTL frees them otherwise
            return False

    async def end_turn(self, position: int) -> bool:
        """The turn ended at position: the replica may give the session's KV slot to a new session at
        once instead of keeping it for its --evict-after. Best effort: no retry, no failover."""
        try:
            return await self.client.end_turn(self.session_id, position)
        except Exception as exc:  # noqa: BLE001 - only slot reuse is lost; --evict-after frees it anyway
            log.info("session %s: EndTurn on %s failed: %r", self.session_id, self.endpoint, exc)
            return False

    async def info(self):
        return (await self.router.describe(TARGET, self.endpoint)).model

    async def _retrying(self, call, recover):
        """call(client) until it succeeds; after a recoverable error, recover and try again, for
        up to failover_timeout_s."""
        deadline = self.give_up_at = self.clock() + self.failover_timeout_s
        delay, error = 0.05, None
        while True:
            try:
                if error is not None:
                    delay = await self._recover(error, recover, delay)
                return await call(self.client)
            except RECOVERABLE as exc:
                if self.clock() >= deadline:
                    raise self._gave_up(exc) from exc
                _log_recovery(self.session_id, self.endpoint, exc)
                error = exc

    def _gave_up(self, exc: Exception) -> Exception:
        """The error a client sees once failover_timeout_s has passed: what happened, in its terms."""
        if not isinstance(exc, ServiceUnavailable):
            return exc  # CacheFull's and the others' own messages say what to do
        return ServiceUnavailable(
            f"no target replica answered for session {self.session_id!r} within {self.failover_timeout_s:g} s "
            f"(--failover-timeout; last tried {self.endpoint}: {exc}); every token streamed is recorded: "
            "resume the stream (ResumeStream) or retry once a target replica is back"
        )

    async def _recover(self, error: Exception, recover, delay: float) -> float:
        """Before a retry: stop if the turn must, leave a replica that did not answer (after
        `delay`), rebuild the session; the delay before the next such retry."""
        await self.guard()
        if isinstance(error, CacheFull):
            # The session holds no slot there (new, or evicted), so a replica with a free one costs
            # no more than this one would: the same prefill, now instead of after the wait.
            if not await self._spill():
                # Every replica known is full: wait in this one's queue for a slot, first come first
                # served (a session that backed off between tries lost every freed slot to newcomers
                # and failed after the timeout, the replica busy all along). The recovery restarts the
                # session with StartSession, which carries the wait; a wait that ran out, or a target
                # older than the queue, backs off instead.
                if self.slot_wait_s:
                    delay = await backoff(delay)
                self.slot_wait_s = max(self.give_up_at - self.clock(), 0.05)  # what is left of the timeout
            await recover(error)
            return delay
        if isinstance(error, ServiceUnavailable):
            await self._move()
            delay = await backoff(delay)
        await recover(error)
        return delay

    async def _move(self) -> None:
        """Leave an endpoint that did not answer: another live one if any, else the same again."""
        self.router.failed(self.endpoint)
        endpoint = await self.router.choose_target(self.pool)
        if endpoint is None:
            raise NoReplica("no target replica is available; retry later")
        if endpoint != self.endpoint:
            log.warning("session %s moves from target %s to %s", self.session_id, self.endpoint, endpoint)
            self._switch(endpoint)

    async def _spill(self) -> bool:
        """Leave a replica that has no free KV slot for one that is not known to be full, if any;
        False when there is none (the session then waits for a slot where it is)."""
        # Not choose_target: each refused retry would count as a new session placed on the full one.
        endpoint = await self.router.room_elsewhere(self.pool, self.endpoint)
        if endpoint is None:
            return False
        log.info("session %s: target %s has no free KV slot; moves to %s", self.session_id, self.endpoint, endpoint)
        full = self.client
        self._switch(endpoint)
        with contextlib.suppress(SpecDecError):  # it keeps the tokens without a slot until its idle TTL
            await full.end_session(self.session_id)
        return True

    def _switch(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.slot_wait_s = 0.0  # a new replica is asked at once first: it may refuse, and another have room
        self.on_moved(endpoint)

    async def _realign(self, error: Exception, position: int) -> None:
        tokens = list(self.committed())[:position]
        if len(tokens) != position:
            raise RuntimeError(f"cannot rebuild session {self.session_id} at {position}: {len(tokens)} known")
        if isinstance(error, PositionMismatch) and error.actual > position:
            # An earlier attempt was applied but its answer was lost: undo it and repeat.
            held = await self.client.truncate(self.session_id, position)
            await self.client.decode(self.session_id, held, 0, tokens[held:])
            return
        await self._start(self.client, tokens, need_first=False)

    async def _start(self, client, tokens: Sequence[int], need_first: bool) -> int | None:
        def start():
            return client.start_session(self.session_id, tokens, self.params, need_first,
                                        drafts_elsewhere=self.draft_source is not None,
                                        draft_source=self.draft_source or "", slot_wait_s=self.slot_wait_s)
        try:
            _, first = await start()
        except SessionExists:  # the replica still holds a copy whose state is unknown: replace it
            await client.end_session(self.session_id)
            _, first = await start()
        self.rebuilds += 1
        self.slot_wait_s = 0.0
        return first


class SessionDraft:
    def __init__(
        self,
        router: Router,
        pool: Pool,
        fingerprint: str,
        endpoint: str,
        on_moved: Callable[[str], None],
    ):
        self.router, self.pool, self.fingerprint = router, pool, fingerprint
        self.endpoint = endpoint
        self.on_moved = on_moved
        self._broken = False  # the endpoint did not answer: choose again at the next start_session

    async def start_session(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> None:
        if self._broken:
            endpoint = await self.router.choose_draft(self.pool, self.fingerprint)
            if endpoint is None:
                raise ServiceUnavailable("no draft replica with the target's vocabulary is available")
            self._broken = False
            if endpoint != self.endpoint:
                self.endpoint = endpoint
                self.on_moved(endpoint)
        await self._call(lambda c: c.start_session(session_id, token_ids, params))

    async def propose(self, session_id, keep_position, append_token_ids, num_draft_tokens, parent_epoch=0,
                      speculative=False, alternatives=(), stop_below=0.0):
        return await self._call(
            lambda c: c.propose(session_id, keep_position, append_token_ids, num_draft_tokens, parent_epoch,
                                speculative, alternatives, stop_below)
        )

    async def truncate(self, session_id: str, position: int) -> int:
        return await self._call(lambda c: c.truncate(session_id, position))

    async def end_session(self, session_id: str) -> bool:
        if self._broken:  # about to move; its idle TTL frees whatever it still holds
            return False
        return await self._call(lambda c: c.end_session(session_id))

    async def end_turn(self, session_id: str) -> bool:
        """The turn ended: the draft replica may give the session's slot to another session at once
        instead of keeping it for its --evict-after. Best effort: no retry, no failover."""
        if self._broken:
            return False
        try:
            return await self.router.draft(self.endpoint).end_turn(session_id)
        except Exception as exc:  # noqa: BLE001 - only slot reuse is lost; --evict-after frees it anyway
            log.info("session %s: EndTurn on draft %s failed: %r", session_id, self.endpoint, exc)
            return False

    async def info(self):
        return (await self.router.describe(DRAFT, self.endpoint)).model

    async def _call(self, call):
        try:
            return await call(self.router.draft(self.endpoint))
        except ServiceUnavailable:
            self._broken = True
            self.router.failed(self.endpoint)
            raise
