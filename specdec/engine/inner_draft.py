"""Drafts made inside the target's decode stream: no draft service, no round trip per cycle.

DecodeStream (target.proto) may ask the target to draft each step itself, then verify the draft in
the same batched step that decodes the other sessions (specdec.engine.target_stream):

- lookup_draft_tokens: prompt lookup in the session's committed tokens (LookupDrafter, an n-gram
  index kept per stream, specdec.engine.target_lookup);
- model_draft_tokens: the draft model the target service hosts (--inner-draft; ModelDrafter): a
  DraftEngine on the target's model thread, its Propose work batched across sessions like the draft
  service's, its session kept in step with the target's committed tokens by the same accept/rollback
  rule as the coordinator's (keep the common prefix, append the rest).

Under load a drafter drafts no more than the target's goodput trimming would verify for its session
(what it kept of the session's last draft, or, after a plain step, the trimmer's draft_limits): a
draft the trimmer would cut costs nothing then, which matters for a draft model, whose forwards share
the target's model thread. A drafter that fails never fails the stream: it logs, stops drafting, and
the stream decodes plainly (the output is the same either way). Drafts never reach past the step's room (the stream's budget)
and never hold a stop token, so a stream still ends right after its stop token.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Collection, Protocol, Sequence

from specdec.engine.batcher import Batcher, ModelThread, StepTiming
from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork
from specdec.engine.goodput import prefix
from specdec.engine.target_lookup import LookupIndex
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock, VerifyOutcome

log = logging.getLogger(__name__)

LOOKUP = "ngram"
MODEL = "model"
PROPOSERS = {LOOKUP: "ngram-target", MODEL: "draft-model-target"}  # names in stats, metrics, benchmarks


class Drafter(Protocol):
    async def draft(self, room: int) -> tuple[DraftBlock, StepTiming]:
        """Up to `room` tokens (and the stream's own limit) continuing the committed tokens, and
        what drafting them cost on the model thread (nothing for a lookup on the event loop)."""

    def verified(self, drafted: int, outcome: VerifyOutcome) -> None:
        """The step verified `drafted` of them (fewer when the target trimmed the draft)."""


class _TrimAware:
    """How many tokens the next draft may have: the stream's limit, the room, and what the target's
    trimming let through last time (limit(): its draft_limits for the session, None: no limit)."""

    def __init__(self, max_tokens: int, limit: Callable[[], int | None] = lambda: None):
        self.max_tokens, self.limit = max_tokens, limit
        self._kept: int | None = None  # the last draft's trimmed length, when trimmed

    def allowed(self, room: int) -> int:
        kept, self._kept = self._kept, None
        limit = kept if kept is not None else self.limit()
        return min(self.max_tokens, room, self.max_tokens if limit is None else limit)

    def verified(self, drafted: int, outcome: VerifyOutcome) -> None:
        self._kept = outcome.num_drafted if outcome.num_drafted < drafted else None


class LookupDrafter(_TrimAware):
    def __init__(self, committed: Callable[[], Sequence[int] | None], max_tokens: int,
                 stop_token_ids: Collection[int] = (), limit: Callable[[], int | None] = lambda: None):
        super().__init__(max_tokens, limit)
        self.committed, self.stops = committed, frozenset(stop_token_ids)
        self.index = LookupIndex()

    async def draft(self, room: int) -> tuple[DraftBlock, StepTiming]:
        tokens, allowed = self.committed(), self.allowed(room)
        if tokens is None or not allowed:  # ended meanwhile (the step says so), or nothing would pay
            return DraftBlock.empty(), StepTiming()
        self.index.sync(tokens)
        return self.index.draft(allowed, self.stops), StepTiming()


class ModelDrafter(_TrimAware):
    """One stream's drafts from the hosted draft model. The draft session (same id as the target's)
    outlives the stream, so the next turn's stream finds the draft's cache and only appends."""

    def __init__(self, engine: DraftEngine, batcher: Batcher, model_thread: ModelThread, session_id: str,
                 params: SamplingParams, committed: Callable[[], Sequence[int] | None], max_tokens: int,
                 stop_token_ids: Collection[int] = (), limit: Callable[[], int | None] = lambda: None):
        super().__init__(max_tokens, limit)
        self.engine, self.batcher, self.model_thread = engine, batcher, model_thread
        self.session_id, self.params, self.committed = session_id, params, committed
        self.stops = frozenset(stop_token_ids)
        self.draft_tokens: list[int] | None = None  # the draft session's tokens after our last Propose
        self.known = 0  # of them, a prefix of the committed tokens (which only grow during a stream)
        self.failed = False

    async def draft(self, room: int) -> tuple[DraftBlock, StepTiming]:
        tokens, allowed = self.committed(), self.allowed(room)
        cost = StepTiming()
        if self.failed or tokens is None or not allowed:
            return DraftBlock.empty(), cost
        tokens = list(tokens)
        try:
            if self.draft_tokens is None:  # first step: align the draft session on the model thread
                started = time.perf_counter_ns()
                self.draft_tokens = await self.model_thread.run(self._align, tokens)
                cost.model_ns += time.perf_counter_ns() - started  # a prefill, mostly: model time
            keep = _common_prefix(self.draft_tokens, tokens, self.known)
            proposal, step = await self.batcher.submit_timed(ProposeWork(
                self.session_id, keep, tuple(tokens[keep:]), allowed))
            cost.add(step)
        except Exception as exc:  # noqa: BLE001 - a failing draft decodes plainly, never fails the stream
            log.warning("inner draft failed for session %s, decoding plainly: %r", self.session_id, exc)
            self.failed = True
            return DraftBlock.empty(), cost
        block = proposal.block
        drafted = block.token_ids.tolist()
        self.draft_tokens, self.known = tokens + drafted, len(tokens)
        cut = next((i for i, t in enumerate(drafted) if t in self.stops), len(drafted))
        return (block if cut == len(drafted) else prefix(block, cut)), cost

    def _align(self, tokens: list[int]) -> list[int]:
        """On the model thread: open the draft session, or cut it back to what it shares with the
        target's committed tokens; its tokens, which the next Propose keeps a prefix of."""
        state = self.engine.sessions.peek(self.session_id)
        if state is not None:
            keep = _common_prefix(state.tokens, tokens)
            if keep == 0:
                self.engine.end_session(self.session_id)
            else:
                if keep < state.committed:
                    self.engine.truncate(self.session_id, keep)
                return list(self.engine.sessions.peek(self.session_id).tokens)
        self.engine.start_session(self.session_id, tokens, self.params)
        return list(tokens)


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, given that their first `start` tokens agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
