"""The speculative loop, written once against TargetAPI / DraftAPI (in-process or over gRPC).

One cycle (Leviathan et al. 2023; Chen et al. 2023):
  1. propose: the draft applies the last outcome (accept/rollback) and drafts k tokens
  2. verify:  the target scores all k in one forward pass and commits accepted + recovered/bonus
  3. stop:    EOS, a stop sequence or the budget inside the block cuts it; both caches roll back
  4. emit:    the committed tokens go to the caller (the coordinator records them first)
Without a draft, or while the draft is failing, the same loop decodes plainly on the target: the
output is the same either way, only slower. A LoopObserver sees each cycle and its steps (the
coordinator's spans and metrics) without the loop knowing about either.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from specdec.engine.api import DraftAPI, TargetAPI
from specdec.engine.cycle_cost import CycleCost, measure_cycle
from specdec.engine.inner_draft import PROPOSERS as INNER_PROPOSERS
from specdec.errors import CacheFull, ServiceUnavailable, SessionNotFound
from specdec.generation.adaptive import DraftLengthPolicy
from specdec.generation import draft_opening
from specdec.generation.draft_feed import DraftFeed
from specdec.generation.pipeline import PipelinedDrafting
from specdec.generation.plain_runs import PlainRuns
from specdec.generation.session import GenerationResult, LoopObserver, LoopSettings, SessionCursor, TokenSink
from specdec.generation.shared_estimates import SharingPolicy
from specdec.generation.stats import SpeculationStats
from specdec.generation.stopping import StopChecker
from specdec.sampling.params import SamplingParams
from specdec.types import VerifyOutcome

log = logging.getLogger(__name__)


@dataclass
class _CycleCalls:
    """What one cycle's calls did, for the draft-length policy once the cycle's cost is known."""

    outcome: VerifyOutcome | None  # None: a plain step
    draft_s: float  # the Propose call before the verify, as the loop timed it (0 if none)
    target_s: float  # the Verify or Decode call
    num_proposed: int = 0  # tokens the draft proposed (a loaded target may verify fewer)
    confidences: tuple[float, ...] = ()
    draft_steps: int = 0  # draft forwards the cycle paid for (pipelined: its successor's too)
    drafted_ahead: bool = False  # pipelined: the block was drafted during the previous verify
    beside: bool = False  # pipelined: the next block was drafted during this verify
    opened_run: bool = False  # a plain step that opened a streamed run of plain steps


class SpeculativeLoop:
    def __init__(
        self,
        target: TargetAPI,
        draft: DraftAPI | None,
        settings: LoopSettings | None = None,
        observer: LoopObserver | None = None,
    ):
        self.target = target
        self.draft = draft
        self.settings = settings or LoopSettings()
        self.observer = observer or LoopObserver()
        self.policy: DraftLengthPolicy | None = None
        # What the calls of the cycle running now did, for the policy once the cycle's cost is known.
        self._cycle_calls: _CycleCalls | None = None
        # The cycle's draft first caught up on a whole prompt or on tokens decoded plainly (a prefill
        # in its Propose, or a StartSession): its draft time and overhead say nothing of a steady cycle.
        self._draft_catching_up = False
        # With DEBUG logging: each cycle as drafted:accepted ("." a plain step), logged at the turn's end
        # with the policy's estimates, to see why an adaptive length switched off where it did.
        self._trace: list[str] | None = [] if log.isEnabledFor(logging.DEBUG) else None
        k = self.settings.num_draft_tokens
        if draft is not None and self.settings.adaptive:
            self.policy = DraftLengthPolicy(k, self.settings.max_draft_tokens)
        elif draft is not None and k > 0:  # a fixed length too yields to the loaded target's trimming
            self.policy = DraftLengthPolicy(k, k, adapt=False)
        self.pipeline = PipelinedDrafting(self) if self.settings.pipelining and draft is not None else None
        # Plain steps, streamed in runs (plain_runs.py); with target lookup, steps that may speculate.
        self.plain_runs = PlainRuns(target, self.settings.inner_draft if self.settings.stream_plain else None)
        self._policy_plain = False  # the policy chose this cycle's plain step (not the budget)
        self.feed = DraftFeed(self, self.settings.feed_draft_every if draft is not None else 0)
        # An adaptive length starts from the route's shared estimates and adds its own to them.
        shared = self.settings.shared_estimates
        self.sharing = SharingPolicy(shared, self.policy) if shared is not None and self.policy is not None \
            and self.policy.adapt else None

    async def run(self, cursor: SessionCursor, stop: StopChecker, emit: TokenSink) -> GenerationResult:
        """Generate after the cursor's committed sequence until `stop` says so; emit every token
        the moment it is committed (and kept)."""
        stats = SpeculationStats()
        plain_cycles_left = 0 if self.draft is not None else -1  # -1: never speculate
        if self.policy is not None and cursor.target_draft_limit == 0:
            self.policy.start_refused()
        try:
            return await self._run(cursor, stop, emit, stats, plain_cycles_left)
        finally:  # an error or a cancelled turn: the next turn truncates the target to its record
            if self._trace is not None:
                self._log_trace(cursor.session_id)
            if self.sharing is not None:
                self.sharing.share(ended=True)
            await self.feed.cancel()
            await self.plain_runs.close()
            draft_opening.discard(cursor)

    async def _run(self, cursor: SessionCursor, stop: StopChecker, emit: TokenSink, stats: SpeculationStats,
                   plain_cycles_left: int) -> GenerationResult:
        generated: list[int] = []
        index = 0
        while True:
            with self.observer.cycle(index, cursor.position), measure_cycle(lambda c: self._measured(c, stats)):
                k = self._draft_length(cursor, stop)
                new_tokens: list[int] | None = None
                if plain_cycles_left == 0 and k > 0:
                    await self._end_plain_run(cursor)
                    new_tokens = await (self.pipeline.speculate(cursor, k, stats, stop) if self.pipeline
                                        else self._speculate(cursor, k, stats))
                    if new_tokens is None:  # the draft failed: plain decoding, retry later
                        stats.fallbacks += 1
                        plain_cycles_left = self.settings.retry_draft_after
                elif plain_cycles_left > 0:
                    plain_cycles_left -= 1
                if new_tokens is None:
                    new_tokens = await self._decode(cursor, stats, stop, self._plain_run(cursor, stop, plain_cycles_left, k))
                keep, reason = stop.check(new_tokens)
                if keep < len(new_tokens):
                    await self._end_plain_run(cursor, truncate=False)  # the truncate below undoes its steps
                    del cursor.tokens[len(cursor.tokens) - len(new_tokens) + keep:]
                    with self.observer.step("truncate"):
                        await self.target.truncate(cursor.session_id, cursor.position)
                    new_tokens = new_tokens[:keep]
                generated.extend(new_tokens)
                await emit(new_tokens)
            index += 1
            if reason is not None:
                await self._end_plain_run(cursor)
                await self._settle_draft(cursor)
                return GenerationResult(generated, reason, stats)

    def _measured(self, cost: CycleCost, stats: SpeculationStats) -> None:
        """At a cycle's end: account its cost; the policy learns from model times and the overhead
        apart (services that report no model time: from the calls' wall times)."""
        stats.record_cost(cost)
        if cost.inner_draft is not None:  # a streamed step that verified the target's own draft
            stats.decode_steps -= 1  # counted as a plain step by _decode; it was a speculative cycle
            stats.record(cost.inner_draft)
            self.observer.verified(cost.inner_draft, INNER_PROPOSERS[self.settings.inner_draft.kind])
        self.observer.cycle_cost(cost)
        calls, self._cycle_calls = self._cycle_calls, None
        if self.policy is None or calls is None:
            return
        outcome, draft_steps = calls.outcome, calls.draft_steps
        catching_up, self._draft_catching_up = self._draft_catching_up, False
        if cost.target_model_s > 0:
            draft_s, target_s = cost.draft_model_s, cost.target_model_s
            overhead_s = cost.overhead_s  # on the critical path: a pipelined Propose beside the verify is off it
        else:  # services that report no model time: the calls' walls (a pipelined Propose's is not timed)
            draft_s, target_s = calls.draft_s, calls.target_s
            overhead_s = max(0.0, cost.wall_s - draft_s - target_s)
            draft_steps = 0 if calls.drafted_ahead else calls.num_proposed
        if self._trace is not None:
            self._trace.append("." if outcome is None else f"{outcome.num_drafted}:{outcome.num_accepted}")
        if outcome is None:
            self.policy.observe_plain(target_s, overhead_s, cost.target_draft_limit, opened_run=calls.opened_run,
                                      queued_s=cost.queued_s)
        else:
            self.policy.observe_cycle(outcome.num_drafted, outcome.num_accepted, draft_s, target_s, overhead_s,
                                      calls.confidences, steady=not catching_up, draft_steps=draft_steps,
                                      drafted_ahead=calls.drafted_ahead, beside=calls.beside)
            if outcome.num_drafted < calls.num_proposed:  # the loaded target trimmed the draft
                self.policy.limit(outcome.num_drafted)
            if self.sharing is not None:
                self.sharing.share()

    def _log_trace(self, session_id: str) -> None:
        estimates = f"; {self.policy.summary()}" if self.policy is not None and self.policy.adapt else ""
        log.debug("session %s: cycles (drafted:accepted, . plain) %s%s", session_id, " ".join(self._trace), estimates)

    def _draft_length(self, cursor: SessionCursor, stop: StopChecker, ahead: int = 0) -> int:
        """For a block that starts `ahead` tokens past the committed sequence (pipelining)."""
        # Never draft past the budget or the context: a cycle commits up to k + 1 tokens.
        room = cursor.max_context - cursor.position - ahead - 1
        wanted = self.policy.next_k() if self.policy else self.settings.num_draft_tokens
        if not ahead:
            self._policy_plain = wanted == 0
        return max(0, min(wanted, stop.remaining - ahead - 1, room))

    async def _speculate(self, cursor: SessionCursor, k: int, stats: SpeculationStats) -> list[int] | None:
        started = time.perf_counter()
        proposal = await self._propose_or_fall_back(cursor, k)
        if proposal is None:
            return None
        drafted_at = time.perf_counter()
        stats.draft_seconds += drafted_at - started
        with self.observer.step("verify"):
            outcome = await self.target.verify(cursor.session_id, cursor.position, proposal.block, proposal.epoch)
        verified_at = time.perf_counter()
        stats.verify_seconds += verified_at - drafted_at
        return self._apply_outcome(cursor, proposal, outcome, stats, drafted_at - started, verified_at - drafted_at)

    def _apply_outcome(self, cursor: SessionCursor, proposal, outcome: VerifyOutcome, stats: SpeculationStats,
                       draft_s: float, verify_s: float, draft_steps: int | None = None,
                       pipelined: tuple[bool, bool] = (False, False)) -> list[int]:
        """Record a verify outcome and commit its tokens to the cursor; return them. draft_steps: the
        draft forwards the cycle paid for (default: the proposal's); pipelined: (the block was drafted
        ahead, its successor was drafted beside the verify)."""
        stats.record(outcome)
        num_proposed = proposal.block.num_tokens
        self._cycle_calls = _CycleCalls(outcome, draft_s, verify_s, num_proposed, proposal.block.confidences,
                                        num_proposed if draft_steps is None else draft_steps, *pipelined)
        self.observer.verified(outcome, proposal.proposer)
        new_tokens = proposal.block.token_ids[: outcome.num_accepted].tolist() + [outcome.next_token]
        cursor.tokens.extend(new_tokens)
        return new_tokens

    async def _propose_or_fall_back(self, cursor: SessionCursor, k: int):
        """A proposal of k tokens, or None when the draft failed (the caller decodes plainly)."""
        await self.feed.settle()  # the draft's messages in order; the cursor says what it holds
        self._draft_catching_up = False  # a feed's catch-up was off this cycle's path; its own may not be
        try:
            with self.observer.step("propose"):
                return await self._propose(cursor, k)
        except Exception as exc:  # a failing draft never fails a request
            # A draft with every slot in use is load, not a fault (the fallbacks metric counts it by
            # reason): logged per session every few cycles, it would flood the log of a busy coordinator.
            level = logging.DEBUG if isinstance(exc, CacheFull) else logging.WARNING
            log.log(level, "draft failed for session %s, decoding plainly: %s", cursor.session_id, exc)
            cursor.draft_ready = False
            self.observer.fell_back(exc)
            return None

    async def _propose(self, cursor: SessionCursor, k: int):
        was_open = cursor.draft_ready
        try:
            return await self._propose_once(cursor, k)
        except SessionNotFound:
            if not was_open:
                raise
            # The draft no longer holds the session (it expired or was evicted there, or the draft
            # lives inside another coordinator): reopen it now rather than decode plainly until a retry.
            log.info("draft lost session %s; reopening it", cursor.session_id)
            cursor.draft_ready = False
            return await self._propose_once(cursor, k)

    async def _propose_once(self, cursor: SessionCursor, k: int):
        if cursor.draft_opening is not None:
            # The draft's prefill, opened beside the target's, may still run: the wait is this cycle's,
            # which is no steady one (a first cycle counted as one priced drafting off on two GPUs).
            self._draft_catching_up = True
            await draft_opening.wait(cursor)
        if not cursor.draft_ready:
            # (Re)open the draft's session from the committed sequence: first use, or after a
            # failure when its state is unknown.
            self._draft_catching_up = True
            await self._forget_draft(cursor)
            await self.draft.start_session(cursor.session_id, cursor.tokens, cursor.params)
            cursor.draft_tokens = list(cursor.tokens)
            cursor.draft_committed = cursor.position
            cursor.draft_epoch = 0
            cursor.draft_ready = True
        keep = self._common_prefix(cursor)
        if cursor.position - keep > 2:  # more than a cycle's recovered/bonus token to feed the draft
            self._draft_catching_up = True
        stop_below = self.policy.stop_below() if self.policy else 0.0
        proposal = await self.draft.propose(
            cursor.session_id, keep, cursor.tokens[keep:], k, cursor.draft_epoch,
            **({"stop_below": stop_below} if stop_below else {}),  # proposers without confidences: none
        )
        cursor.draft_tokens = cursor.tokens + proposal.block.token_ids.tolist()
        cursor.draft_committed = cursor.position
        cursor.draft_epoch = proposal.epoch
        return proposal

    @staticmethod
    def _common_prefix(cursor: SessionCursor) -> int:
        """Accept/rollback point: the draft keeps its tokens up to where they match the committed
        sequence (accepted drafts), and gets the rest appended (recovered/bonus, new turns)."""
        keep = cursor.draft_committed
        limit = min(len(cursor.draft_tokens), cursor.position)
        while keep < limit and cursor.draft_tokens[keep] == cursor.tokens[keep]:
            keep += 1
        return keep

    def _plain_run(self, cursor: SessionCursor, stop: StopChecker, plain_cycles_left: int, k: int) -> int:
        """How many plain steps in a row the loop will take from here, as far as it knows now."""
        if plain_cycles_left != 0:  # no draft (-1: all of them), or the draft failed lately
            run = stop.remaining if plain_cycles_left < 0 else plain_cycles_left + 1
        elif self._policy_plain and self.policy is not None:
            run = self.policy.plain_run()
        else:  # no room for a draft: the budget or the context ends within a step
            run = stop.remaining
        return max(1, min(run, stop.remaining, cursor.max_context - cursor.position))

    async def _decode(self, cursor: SessionCursor, stats: SpeculationStats, stop: StopChecker, run: int) -> list[int]:
        """One plain step: the next token of the open plain run, or of a new one of `run` steps."""
        started = time.perf_counter()
        with self.observer.step("decode"):
            if not self.settings.stream_plain:
                new_tokens = await self.target.decode(cursor.session_id, cursor.position, 1)
            else:
                new_tokens = await self._next_plain(cursor, stop, run)
        elapsed = time.perf_counter() - started
        stats.decode_seconds += elapsed
        stats.decode_steps += 1
        # Without streaming, plain_runs is never used and says False: each step is a call of its own.
        self._cycle_calls = _CycleCalls(None, 0.0, elapsed, opened_run=self.plain_runs.opened_run)
        cursor.tokens.extend(new_tokens)
        if self._policy_plain and self.policy is not None and self.policy.switched_off:
            await self.feed.after_plain_step(cursor, self.plain_runs.left)
        return new_tokens

    async def _next_plain(self, cursor: SessionCursor, stop: StopChecker, run: int) -> list[int]:
        for _ in range(2):
            tokens = await self.plain_runs.next(cursor.session_id, cursor.position, run, stop.eos_token_ids)
            if tokens is not None:
                return tokens
            await self._end_plain_run(cursor)  # ended early by another call of the session: start again
        raise ServiceUnavailable(f"the target ended two plain runs of session {cursor.session_id} before a token")

    async def _end_plain_run(self, cursor: SessionCursor, truncate: bool = True) -> None:
        """Close the plain run; if it stopped early, the target may be a step past the cursor."""
        if await self.plain_runs.close() and truncate:
            with self.observer.step("truncate"):
                await self.target.truncate(cursor.session_id, cursor.position)

    async def _settle_draft(self, cursor: SessionCursor) -> None:
        """Leave the draft holding only committed tokens (a prefix of the committed sequence), so
        the next turn, or another coordinator, starts from a known state."""
        await self.feed.settle()
        if not cursor.draft_ready:
            return
        keep = self._common_prefix(cursor)
        try:
            await self.draft.truncate(cursor.session_id, keep)
            cursor.draft_tokens = cursor.tokens[:keep]
            cursor.draft_epoch = 0  # Truncate discards every live proposal
        except Exception as exc:
            log.warning("draft truncate failed for session %s: %s", cursor.session_id, exc)
            cursor.draft_ready = False

    async def _forget_draft(self, cursor: SessionCursor) -> None:
        try:
            await self.draft.end_session(cursor.session_id)
        except Exception:  # already gone, or the draft is down: start_session will tell
            pass


async def generate(
    target: TargetAPI,
    draft: DraftAPI | None,
    session_id: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stop: StopChecker,
    emit: TokenSink,
    settings: LoopSettings | None = None,
) -> GenerationResult:
    """One whole generation for a new session: prefill, first token, then the loop."""
    # A draft client says where it is served (its address), which the target keys its verdicts by.
    cursor, first = await start_generation(target, session_id, prompt_ids, params, drafts_elsewhere=draft is not None,
                                           draft_source=getattr(draft, "address", ""))
    keep, reason = stop.check([first])
    await emit([first])
    if reason is not None:
        return GenerationResult([first], reason, SpeculationStats())
    result = await SpeculativeLoop(target, draft, settings).run(cursor, stop, emit)
    result.token_ids.insert(0, first)
    return result


async def start_generation(
    target: TargetAPI, session_id: str, prompt_ids: Sequence[int], params: SamplingParams,
    drafts_elsewhere: bool = False, draft_source: str = "",
) -> tuple[SessionCursor, int]:
    """Open the target session (prefill) and return a cursor and the first token."""
    with measure_cycle() as opening:  # the target may say: start plain (target_draft_limit)
        position, first = await target.start_session(session_id, prompt_ids, params, sample_first_token=True,
                                                     drafts_elsewhere=drafts_elsewhere, draft_source=draft_source)
    info = await target.info()
    cursor = SessionCursor(session_id, params, list(prompt_ids) + [first], info.max_context,
                           target_draft_limit=opening.target_draft_limit)
    assert cursor.position == position
    return cursor, first
