"""A target session's decoding as a stream of batched steps: Decode and DecodeStream on the service.

Each step is a work item of the target's Batcher, so it joins whatever batch runs next with the
other sessions' work (continuous batching); the stream submits the next step only when its consumer
asks, which the DecodeStream handler does before writing the last step's tokens, so the model never
waits for the caller's round trip.
"""

from __future__ import annotations

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


async def decode_step_stream(
    batcher: Batcher,
    session_id: str,
    position: int,
    num_tokens: int,
    append_token_ids: Sequence[int] = (),
    stop_token_ids: Collection[int] = (),
    drafter: Drafter | None = None,
) -> AsyncIterator[StreamStep]:
    """Each step as soon as it ends; the next step is submitted when the consumer asks for it. The
    first step commits append_token_ids and checks that the whole budget fits the context (as
    engine.decode does); decoding ends after num_tokens tokens or right after a stop token (which is
    committed, like the others). num_tokens 0: one step that only commits.

    drafter, if given, drafts for each step after the first (inside the target: prompt lookup or
    the hosted draft model, specdec.engine.inner_draft); a step with a draft verifies it and commits
    the accepted tokens and the next one, a step without one decodes one token. Drafts stop one
    token short of the budget, so no step runs past it."""
    stop = frozenset(stop_token_ids)
    first = DecodeWork(session_id, position, tuple(int(t) for t in append_token_ids),
                       num_tokens=min(num_tokens, 1), room=num_tokens)
    tokens, cost = await batcher.submit_timed(first)
    yield StreamStep(tokens, cost)
    generated = len(tokens)
    position += len(first.append_token_ids) + generated
    while generated < num_tokens and tokens[-1] not in stop:
        left = num_tokens - generated
        work = drafter.work(session_id, position, left - 1) if drafter is not None and left > 1 else None
        outcome = draft_cost = None
        if work is not None:
            result, cost = await batcher.submit_timed(work)
            outcome, draft, draft_cost = drafter.verified(work, result)
            if draft_cost is not None:  # drafting ran inside the step: its time is the draft's, not the target's
                cost = StepTiming(max(0, cost.model_ns - draft_cost.model_ns), cost.queued_ns)
            tokens = draft.token_ids[: outcome.num_accepted].tolist() + [outcome.next_token]
        else:
            tokens, cost = await batcher.submit_timed(DecodeWork(session_id, position, num_tokens=1, room=left))
        step = StreamStep(tokens, cost, outcome, draft_cost)
        if drafter is not None:
            drafter.stepped(step)  # what its length rule learns from (inner_length)
        yield step
        generated += len(tokens)
        position += len(tokens)
