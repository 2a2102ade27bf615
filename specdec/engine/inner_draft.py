"""Drafts made inside the target's decode stream: no draft service, no round trip per cycle.

DecodeStream (target.proto) may ask the target to draft each step itself, then verify the draft in
the same batched step that decodes the other sessions (specdec.engine.target_stream):

- lookup_draft_tokens: prompt lookup in the session's committed tokens (LookupDrafter, an n-gram
  index kept per stream, specdec.engine.target_lookup);
- model_draft_tokens: the draft model the target service hosts (--inner-draft; ModelDrafter): a
  DraftEngine on the target's model thread, its session kept in step with the target's committed
  tokens by the same accept/rollback rule as the coordinator's (keep the common prefix, append the
  rest). Drafting is part of the target's batched step (run_inner_step): the step plans how many
  tokens each row may draft (the goodput trimmer, before drafting), drafts every row in one batched
  draft pass, then verifies every row in one forward. One step, one hop to the model thread: the
  sessions of a batch stay in step (drafting through a batcher of its own split them into groups
  that waited on each other's draft and verify steps: 0.56-0.75x of plain at 4 CPU sessions).

Each step's draft length is the stream's request, fixed (specdec.engine.inner_length) or adaptive
(specdec.generation.inner_adaptive: the coordinator's per-session policy, run per stream on what its
steps measured). Under load a
drafter drafts no more than the target's goodput trimming would verify for its session, and
a draft model's row is planned by the trimmer before it is drafted: a token the trimmer would cut
costs nothing, which matters for a draft model, whose forwards share the target's model thread. A drafter that fails never fails the stream: it logs, stops drafting, and
the stream decodes plainly (the output is the same either way). Drafts never reach past the step's room (the stream's budget)
and never hold a stop token, so a stream still ends right after its stop token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence

from specdec.engine.batch import VerifyWork, Work, run_target_batch
from specdec.engine.batcher import StepTiming
from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.engine.goodput import DraftTrimmer, prefix, run_trimmed_batch
from specdec.engine.target import TargetEngine
from specdec.engine.inner_length import DraftLength
from specdec.engine.target_lookup import LookupIndex
from specdec.engine.target_stream import StreamStep
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock, VerifyOutcome

log = logging.getLogger(__name__)

PROPOSERS = {"ngram": "ngram-target", "model": "draft-model-target"}  # InnerDraft.kind -> name in stats, metrics


class Drafter(Protocol):
    def work(self, session_id: str, position: int, room: int) -> Work | None:
        """The next step's work with a draft of up to `room` tokens (and the stream's own limit)
        continuing the committed tokens, or None: a plain step."""

    def verified(self, work: Work, result) -> tuple[VerifyOutcome, DraftBlock, StepTiming | None]:
        """The step's outcome, the draft it verified, and what drafting cost on the model thread."""

    def stepped(self, step: StreamStep) -> None:
        """The step as the stream yields it (a plain step: no outcome): what the length rule learns from."""

    @property
    def plain_reason(self) -> str | None:
        """Why the last work() gave no work (inner_length.PLAIN_REASONS); None: it gave one, or the
        session had ended."""


class _Drafting:
    """A drafter's length rule (inner_length.DraftLength) and what it learns from each step."""

    def __init__(self, max_tokens: int, limit: Callable[[], int | None], length: DraftLength | None):
        # The fixed rule unless the caller gives another (the adaptive one: generation.inner_adaptive).
        self.length = length if length is not None else DraftLength(max_tokens, limit)
        self._verified: tuple[DraftBlock, bool] | None = None  # (block, steady) of the step just run
        self._plain_reason: str | None = None

    @property
    def plain_reason(self) -> str | None:
        return self._plain_reason

    def _remember(self, asked: int, planned: int, block: DraftBlock, outcome: VerifyOutcome, steady: bool) -> None:
        self.length.kept(asked, planned, block.num_tokens, outcome)
        self._verified = (block, steady)

    def stepped(self, step: StreamStep) -> None:
        verified, self._verified = self._verified, None
        if step.outcome is None or verified is None:
            self.length.plain(step.cost.model_ns * 1e-9)
            return
        block, steady = verified
        draft_s = step.draft_cost.model_ns * 1e-9 if step.draft_cost is not None else 0.0
        self.length.verified(block, step.outcome, draft_s, step.cost.model_ns * 1e-9, steady)


class LookupDrafter(_Drafting):
    def __init__(self, committed: Callable[[], Sequence[int] | None], max_tokens: int,
                 stop_token_ids: Collection[int] = (), limit: Callable[[], int | None] = lambda: None,
                 length: DraftLength | None = None):
        super().__init__(max_tokens, limit, length)
        self.committed, self.stops = committed, frozenset(stop_token_ids)
        self.index = LookupIndex()

    def work(self, session_id: str, position: int, room: int) -> VerifyWork | None:
        tokens = self.committed()
        self._plain_reason = None
        if tokens is None:  # ended meanwhile (the step says so)
            return None
        allowed, _ = self.length.next(room)
        if not allowed:  # nothing would pay
            self._plain_reason = self.length.plain_reason
            return None
        self.index.sync(tokens)
        draft = self.index.draft(allowed, self.stops)
        if not draft.num_tokens:
            self._plain_reason = "no_draft"
            return None
        return VerifyWork(session_id, position, draft)

    def verified(self, work: VerifyWork, outcome: VerifyOutcome) -> tuple[VerifyOutcome, DraftBlock, None]:
        drafted = work.draft.num_tokens  # what lookup found: its length is not a choice to learn from
        self._remember(drafted, drafted, work.draft, outcome, steady=True)
        return outcome, work.draft, None


@dataclass(frozen=True)
class InnerDraftWork:
    """A stream step that drafts with the hosted draft model, then verifies, within one batched step
    (run_inner_step). The draft session keeps its first `keep` tokens and appends `append` (accept /
    rollback); with open_with (a stream's first step) it is first opened, or cut back, to match
    those committed tokens, and keep / append follow from them."""

    session_id: str
    position: int
    num_draft_tokens: int
    params: SamplingParams
    keep: int = 0
    append: tuple[int, ...] = ()
    open_with: tuple[int, ...] | None = None
    stop_token_ids: frozenset = frozenset()
    stop_below: float = 0.0  # the draft's confidence stop (ProposeWork.stop_below); 0: draft them all


@dataclass
class InnerDraftResult:
    outcome: VerifyOutcome
    block: DraftBlock  # what was verified (before the target's trimming, which the outcome tells)
    draft_ns: int  # the step's draft pass on the model thread (every row that drafted reports it whole)
    draft_tokens: list[int] | None  # the draft session's tokens after this step's Propose; None: none ran
    planned: int  # the length the trimmer let it draft (before the draft's confidence stop)
    failed: Exception | None = None  # the draft failed: this step verified nothing


class ModelDrafter(_Drafting):
    """One stream's drafts from the hosted draft model. The draft session (same id as the target's)
    outlives the stream, so the next turn's stream finds the draft's cache and only appends."""

    def __init__(self, params: SamplingParams, committed: Callable[[], Sequence[int] | None], max_tokens: int,
                 stop_token_ids: Collection[int] = (), limit: Callable[[], int | None] = lambda: None,
                 length: DraftLength | None = None):
        super().__init__(max_tokens, limit, length)
        self.params, self.committed, self.stops = params, committed, frozenset(stop_token_ids)
        self.draft_tokens: list[int] | None = None  # the draft session's tokens after our last Propose
        self.known = 0  # of them, a prefix of the committed tokens (which only grow during a stream)
        self.failed = False

    def work(self, session_id: str, position: int, room: int) -> InnerDraftWork | None:
        tokens = self.committed()
        self._plain_reason = "failed" if self.failed else None
        if self.failed or tokens is None:
            return None
        allowed, stop_below = self.length.next(room, confidences=True)
        if not allowed:
            self._plain_reason = self.length.plain_reason
            return None
        if self.draft_tokens is None:  # first step: the draft session is aligned inside the step
            return InnerDraftWork(session_id, position, allowed, self.params, open_with=tuple(tokens),
                                  stop_token_ids=self.stops, stop_below=stop_below)
        keep = _common_prefix(self.draft_tokens, tokens, self.known)
        return InnerDraftWork(session_id, position, allowed, self.params, keep, tuple(tokens[keep:]),
                              stop_token_ids=self.stops, stop_below=stop_below)

    def verified(self, work: InnerDraftWork, result: InnerDraftResult) -> tuple[VerifyOutcome, DraftBlock, StepTiming]:
        if result.failed is not None:  # a failing draft decodes plainly, never fails the stream
            log.warning("inner draft failed for session %s, decoding plainly: %r", work.session_id, result.failed)
            self.failed, self._plain_reason = True, "failed"
        else:
            if result.draft_tokens is not None:  # it drafted (else its session waits as it was)
                self.draft_tokens, self.known = result.draft_tokens, work.position
            # A draft that first caught up on more than the last step's next token (the stream's
            # first step, a step after a plain one) paid a prefill, not a steady draft's cost.
            steady = _steady(work)
            self._remember(work.num_draft_tokens, result.planned, result.block, result.outcome, steady)
            if result.planned and not result.block.num_tokens:  # let through, stopped before a token
                self._plain_reason = "draft_stopped"
        return result.outcome, result.block, StepTiming(model_ns=result.draft_ns)


def run_inner_step(target: TargetEngine, trimmer: DraftTrimmer | None, drafts: DraftEngine,
                   works: Sequence[Work | InnerDraftWork]) -> list:
    """The target's batched step when it hosts a draft model: plan the inner drafts' lengths (the
    trimmer, each as a verify of its longest length), draft them in one batched pass, then
    verify every row in one forward (run_trimmed_batch); an inner row's result is an InnerDraftResult."""
    inner = {i for i, w in enumerate(works) if isinstance(w, InnerDraftWork)}
    if not inner:
        return run_trimmed_batch(target, trimmer, works) if trimmer else run_target_batch(target, works)
    started = time.perf_counter_ns()
    planned = trimmer.plan(works, drafting_here=True) if trimmer else [
        w.num_draft_tokens if i in inner else 0 for i, w in enumerate(works)]
    blocks: dict[int, DraftBlock] = {i: DraftBlock.empty() for i in inner}
    failed: dict[int, Exception] = {}
    proposes: list[tuple[int, ProposeWork]] = []
    for i in sorted(inner):
        work = works[i]
        if planned[i] == 0:  # a plain step: the draft catches up on these tokens when it next drafts
            continue
        try:
            keep, append = (work.keep, work.append) if work.open_with is None else _align(drafts, work)
            proposes.append((i, ProposeWork(work.session_id, keep, append, planned[i],
                                             stop_below=work.stop_below)))
        except Exception as exc:  # noqa: BLE001 - this row's draft only
            failed[i] = exc
    drafting_started = time.perf_counter_ns()
    proposed = run_propose_batch(drafts, [p for _, p in proposes])
    if trimmer is not None and all(_steady(works[i]) for i, _ in proposes):
        # What a draft step costs here, for the next steps' plans: from passes that drafted only. A
        # pass that first caught a row up (its first step, a step after plain ones) paid a prefill;
        # priced as draft steps, those made 8 ms of a 2.5 ms step on one H200 and kept every row
        # from drafting again, so the price never came down (docs/BENCHMARKS.md, round 38).
        trimmer.observe_draft(max((p.num_draft_tokens for _, p in proposes), default=0),
                              (time.perf_counter_ns() - drafting_started) * 1e-9, rows=len(proposes))
    for (i, _), result in zip(proposes, proposed):
        if isinstance(result, Exception):
            failed[i] = result
            continue
        drafted = result.block.token_ids.tolist()
        cut = next((j for j, t in enumerate(drafted) if t in works[i].stop_token_ids), len(drafted))
        blocks[i] = result.block if cut == len(drafted) else prefix(result.block, cut)
    draft_ns = time.perf_counter_ns() - started
    verifies = [VerifyWork(w.session_id, w.position, blocks[i]) if i in inner else w for i, w in enumerate(works)]
    results = run_trimmed_batch(target, trimmer, verifies) if trimmer else run_target_batch(target, verifies)
    drafted_rows = {i for i, _ in proposes}
    for i in inner:
        if isinstance(results[i], Exception):
            continue
        state = drafts.sessions.peek(works[i].session_id) if i in drafted_rows else None
        tokens = list(state.tokens) if state is not None else None
        results[i] = InnerDraftResult(results[i], blocks[i], draft_ns if i in drafted_rows else 0, tokens,
                                      planned[i], failed.get(i))
    return results


def _steady(work: InnerDraftWork) -> bool:
    """The row's draft only drafts: it holds the committed tokens but the last step's next one."""
    return work.open_with is None and len(work.append) <= 1


def _align(drafts: DraftEngine, work: InnerDraftWork) -> tuple[int, tuple[int, ...]]:
    """A stream's first step: open the draft session, or cut it back to what it shares with the
    committed tokens; the Propose's keep and append from there."""
    tokens = list(work.open_with)
    state = drafts.sessions.peek(work.session_id)
    if state is not None:
        keep = _common_prefix(state.tokens, tokens)
        if keep == 0:
            drafts.end_session(work.session_id)
        else:
            if keep < state.committed:
                drafts.truncate(work.session_id, keep)
            return keep, tuple(tokens[keep:])
    drafts.start_session(work.session_id, tokens, work.params)
    return len(tokens), ()


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, given that their first `start` tokens agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
