"""A target session's decoding as a stream of batched steps: Decode and DecodeStream on the service.

Each step is a work item of the target's Batcher, so it joins whatever batch runs next with the
other sessions' work (continuous batching); the stream submits the next step only when its consumer
asks, which the DecodeStream handler does before writing the last step's tokens, so the model never
waits for the caller's round trip.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Collection, Sequence

from specdec.engine.batch import DecodeWork
from specdec.engine.batcher import Batcher, StepTiming
from specdec.types import VerifyOutcome

if TYPE_CHECKING:
    from specdec.engine.inner_draft import Drafter


async def decode_steps(
    batcher: Batcher,
    session_id: str,
    position: int,
    num_tokens: int,
    append_token_ids: Sequence[int] = (),
    stop_token_ids: Collection[int] = (),
    timing: StepTiming | None = None,
) -> list[int]:
    """A multi-token Decode as a sequence of one-token steps, each joining whatever batch runs next
    (decode_step_stream's steps, collected). `timing`, if given, sums what the steps cost."""
    timing = timing if timing is not None else StepTiming()
    generated: list[int] = []
    async for step in decode_step_stream(batcher, session_id, position, num_tokens, append_token_ids,
                                         stop_token_ids):
        timing.add(step.cost)
        generated += step.tokens
    return generated


@dataclass
class StreamStep:
    """One step of decode_step_stream: the tokens it committed, what it cost, and its verify outcome
    when it verified a draft (None for a plain step), with what drafting cost on the model thread."""

    tokens: list[int]
    cost: StepTiming
    outcome: VerifyOutcome | None = None
    draft_cost: StepTiming | None = None
    # A stream with a drafter: why this step verified no drafted token (inner_length.PLAIN_REASONS).
    plain_reason: str | None = None


async def decode_step_stream(
    batcher: Batcher,
    session_id: str,
    position: int,
    num_tokens: int,
    append_token_ids: Sequence[int] = (),
    stop_token_ids: Collection[int] = (),
    drafter: Drafter | None = None,
) -> AsyncIterator[StreamStep]:
    """DecodeStepper's steps, each as soon as it ends; the next step is submitted when the consumer
    asks for it, and one left queued when the consumer stops is dropped."""
    stepper = DecodeStepper(batcher, session_id, position, num_tokens, append_token_ids, stop_token_ids, drafter)
    try:
        while stepper.submit():
            yield await stepper.result()
    finally:
        stepper.cancel()


class DecodeStepper:
    """A session's decoding as batched steps, one at a time: submit() queues the next step's work at
    once (no task to schedule first: under load every session's next work is queued in the first
    pass of the event loop after a step, so the batcher starts the next step sooner), result()
    awaits it. The first step commits append_token_ids and checks that the whole budget fits the
    context (as engine.decode does); decoding ends after num_tokens tokens or right after a stop
    token (which is committed, like the others). num_tokens 0: one step that only commits.

    drafter, if given, drafts for each step after the first (inside the target: prompt lookup or
    the hosted draft model, specdec.engine.inner_draft); a step with a draft verifies it and commits
    the accepted tokens and the next one, a step without one decodes one token. Drafts stop one
    token short of the budget, so no step runs past it."""

    def __init__(self, batcher: Batcher, session_id: str, position: int, num_tokens: int,
                 append_token_ids: Sequence[int] = (), stop_token_ids: Collection[int] = (),
                 drafter: Drafter | None = None):
        self.batcher, self.session_id, self.num_tokens, self.drafter = batcher, session_id, num_tokens, drafter
        self.stops = frozenset(stop_token_ids)
        self.append_token_ids = tuple(int(t) for t in append_token_ids)
        self.position = position + len(self.append_token_ids)  # where the next step's tokens go
        self.generated = 0
        self.last_token: int | None = None
        self._work = None  # the pending step's work, None when no step is pending
        self._plain_reason: str | None = None  # why the pending step has no draft (a drafter's reason)
        self._pending: asyncio.Future | None = None

    @property
    def done(self) -> bool:
        """No step is left to run: the budget is spent or the last step ended with a stop token."""
        started = self.last_token is not None
        return started and (self.generated >= self.num_tokens or self.last_token in self.stops)

    def submit(self) -> bool:
        """Queue the next step (if none is pending and the stream is not done); whether one is pending."""
        if self._pending is not None:
            return True
        if self.done:
            return False
        if self.last_token is None:  # the first step: commits the appended tokens
            work = DecodeWork(self.session_id, self.position - len(self.append_token_ids), self.append_token_ids,
                              num_tokens=min(self.num_tokens, 1), room=self.num_tokens)
        else:
            left = self.num_tokens - self.generated
            work = self.drafter.work(self.session_id, self.position, left - 1) \
                if self.drafter is not None and left > 1 else None
            if work is None:
                work = DecodeWork(self.session_id, self.position, num_tokens=1, room=left)
                if self.drafter is not None:
                    self._plain_reason = self.drafter.plain_reason if left > 1 else "budget"
        self._work, self._pending = work, self.batcher.enqueue(work)
        return True

    async def result(self) -> StreamStep:
        """The pending step, once it ran (submit() first)."""
        work, pending, plain_reason = self._work, self._pending, self._plain_reason
        try:
            result, cost = await pending
        finally:
            self._work = self._pending = self._plain_reason = None
        first = self.last_token is None
        outcome = draft_cost = None
        if isinstance(work, DecodeWork):
            tokens = result
        else:
            outcome, draft, draft_cost = self.drafter.verified(work, result)
            if draft_cost is not None:  # drafting ran inside the step: its time is the draft's, not the target's
                cost = StepTiming(max(0, cost.model_ns - draft_cost.model_ns), cost.queued_ns)
            tokens = draft.token_ids[: outcome.num_accepted].tolist() + [outcome.next_token]
            if not outcome.num_drafted:  # the step's plan (or the draft's failure) left nothing to verify
                plain_reason = self.drafter.plain_reason or "trimmer"
        step = StreamStep(tokens, cost, outcome, draft_cost, plain_reason)
        if self.drafter is not None and not first:
            self.drafter.stepped(step)  # what its length rule learns from (inner_length)
        self.generated += len(tokens)
        self.position += len(tokens)
        # A step that only commits (num_tokens 0) ends the stream with no token: mark it started.
        self.last_token = tokens[-1] if tokens else -1
        return step

    def cancel(self) -> None:
        """Drop the pending step if it has not started (one already running finishes: its caller's
        Truncate undoes it)."""
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
