"""The draft engine: session-keyed draft state around any proposer.

A draft session's sequence is the committed sequence followed by its live proposals (a chain, see
specdec.engine.branches). Propose first applies the previous verify outcome (the accept/rollback
message: keep the first keep_position tokens, append the target's recovered/bonus token) and then
drafts, so a cycle costs one round trip. A speculative Propose (pipelining) instead keeps its whole
parent, guesses the target's next token with the proposer's own next token and drafts after it;
it may also draft alternatives for other verify outcomes (specdec.engine.alternatives).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specdec.engine.alternatives import (REJECTED_LAST, Alternative, PendingBranch, can_branch, check_kinds)
from specdec.engine.api import Proposal
from specdec.engine.branches import DEFAULT_MAX_LIVE_PROPOSALS, LiveProposal, ProposalChain
from specdec.engine.sessions import SessionState, SessionTable
from specdec.errors import CacheFull, InvalidArgument, PositionMismatch
from specdec.models.base import ModelInfo
from specdec.proposers.base import NextTokens, Proposer
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock


@dataclass
class _Pending:
    """A Propose between its accept/rollback step and its drafted block."""

    speculative: bool
    start: int  # first position of the new proposal's span
    guessed_token_id: int | None = None
    branches: list[PendingBranch] = field(default_factory=list)  # alternatives being drafted beside it


@dataclass
class DraftSession(SessionState):
    committed: int = 0  # tokens[:committed] are known committed; the rest belongs to live proposals
    chain: ProposalChain = None  # type: ignore[assignment]  # the live proposals (set by the engine)
    proposer_state: object = None
    pending: _Pending | None = None
    alternatives: dict[int, Alternative] = field(default_factory=dict)  # by epoch; until the next message

    @property
    def epoch(self) -> int:
        """The newest live proposal's epoch, 0 if none."""
        return self.chain.latest_epoch


def check_stop_below(stop_below: float) -> float:
    """A Propose's confidence stop: a probability in [0, 1); 0 drafts the requested length."""
    if not 0.0 <= stop_below < 1.0:  # also refuses NaN
        raise InvalidArgument(f"stop_below must be in [0, 1) (0: no early stop), got {stop_below}")
    return float(stop_below)


class DraftEngine:
    def __init__(
        self,
        proposer: Proposer,
        idle_ttl_s: float = 600.0,
        max_draft_tokens: int = 16,
        clock: Callable[[], float] = time.monotonic,
        max_live_proposals: int = DEFAULT_MAX_LIVE_PROPOSALS,
    ):
        if max_live_proposals < 2:  # one being verified and one speculative child at least (draft.proto)
            raise InvalidArgument(f"max_live_proposals must be >= 2, got {max_live_proposals}")
        self.proposer = proposer
        self.max_draft_tokens = max_draft_tokens
        self.max_live_proposals = max_live_proposals
        self.sessions: SessionTable[DraftSession] = SessionTable(idle_ttl_s, clock)

    @property
    def info(self) -> ModelInfo | None:
        return self.proposer.info()

    def start_session(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> int:
        params.validate()
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise InvalidArgument("token_ids must not be empty")
        chain = ProposalChain(session_id, self.max_live_proposals)
        state = self.sessions.add(DraftSession(session_id, params, tokens, committed=len(tokens), chain=chain))
        state.proposer_state = self.proposer.open(session_id)
        return state.committed

    def propose(
        self,
        session_id: str,
        keep_position: int,
        append_token_ids: Sequence[int],
        num_draft_tokens: int,
        parent_epoch: int = 0,
        speculative: bool = False,
        alternatives: Sequence[str] = (),
        stop_below: float = 0.0,
    ) -> Proposal:
        from specdec.engine.draft_batch import ProposeWork, run_propose_batch  # it builds on this module

        work = ProposeWork(session_id, keep_position, tuple(append_token_ids), num_draft_tokens, parent_epoch,
                           speculative, tuple(alternatives), check_stop_below(stop_below))
        result = run_propose_batch(self, [work])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def begin_propose(
        self,
        session_id: str,
        keep_position: int,
        append_token_ids: Sequence[int],
        num_draft_tokens: int,
        parent_epoch: int = 0,
        speculative: bool = False,
        alternatives: Sequence[str] = (),
    ) -> DraftSession:
        """Check a Propose and apply its accept/rollback message; drafting comes next (alone, or
        batched with other sessions' Proposes by specdec.engine.draft_batch). A refused message
        changes nothing."""
        state = self.sessions.get(session_id)
        if not 0 <= num_draft_tokens <= self.max_draft_tokens:
            raise InvalidArgument(
                f"num_draft_tokens must be in [0, {self.max_draft_tokens}], got {num_draft_tokens}"
            )
        kinds = check_kinds(alternatives, speculative)
        appended = [int(t) for t in append_token_ids]
        adopted = state.alternatives.get(parent_epoch) if parent_epoch else None
        if adopted is not None:
            state.chain.check_keep_on(adopted.live, keep_position, speculative, appended, state.position)
        elif parent_epoch:
            state.chain.check_keep(parent_epoch, keep_position, speculative, appended, state.position)
        elif speculative:
            raise InvalidArgument("a speculative Propose builds on a live proposal: parent_epoch must not be 0")
        # Rolling back into the committed prefix, or keeping tokens never drafted, means a message
        # was lost or duplicated: refuse with the sequence's length so the caller can resync.
        elif not state.committed <= keep_position <= state.position:
            raise PositionMismatch(session_id, expected=keep_position, actual=state.position)
        if adopted is not None:
            self._adopt(state, adopted)
        self.release_alternatives(state)
        if speculative:
            # The parent stays live (its verify outcome may still roll back into it); only what was
            # drafted on top of it goes, guesses included.
            state.chain.drop_after(parent_epoch)
            self._cut(state, keep_position)
        else:
            self._cut(state, keep_position)
            state.tokens.extend(appended)
            state.committed = state.position
            state.chain.clear()
        state.pending = _Pending(speculative, state.position)
        if kinds and can_branch(self.proposer):
            state.pending.branches = self._fork_branches(state, state.chain.live[-1], kinds)
        return state

    def _fork_branches(self, state: DraftSession, parent: LiveProposal, kinds: Sequence[str]) -> list[PendingBranch]:
        branches = []
        for kind in kinds:
            if kind == REJECTED_LAST:
                # Only a drafted token can be rejected: a speculative parent's guess was committed
                # by the target already when the parent is verified.
                first_drafted = parent.start + int(parent.speculative)
                if parent.end - first_drafted < 1:
                    continue
                tokens = state.tokens[:parent.end - 1]
                excluded = state.tokens[parent.end - 1]
            else:
                tokens, excluded = list(state.tokens), None
            try:
                branch_state = self.proposer.fork(state.proposer_state, len(tokens))  # type: ignore[attr-defined]
            except CacheFull:  # no room: this cycle goes without the branch
                continue
            branches.append(PendingBranch(kind, tokens, branch_state, len(tokens), excluded))
        return branches

    def place_guess(self, state: DraftSession, guess: DraftBlock | NextTokens | None,
                    branch_guesses: Sequence[NextTokens | None | Exception] = ()) -> bool:
        """A speculative Propose's first drafted token becomes its guess of the target's next token;
        the block is then drafted after it. Alternatives guess from the ranked tokens (branch i's
        ranking in branch_guesses[i] for a rejected_last branch, the main one's for a second_guess); one
        without a guess is dropped. A rejected_last branch does not need the main guess: its context
        differs (an n-gram may match there and not after the parent). False: nothing to draft."""
        pending = state.pending
        assert pending is not None and pending.speculative
        if isinstance(guess, DraftBlock):
            guess = NextTokens(int(guess.token_ids[0]), (int(guess.token_ids[0]),)) if guess.num_tokens else None
        if guess is not None:
            pending.guessed_token_id = guess.own
            state.tokens.append(guess.own)
        kept = []
        for branch, own_guess in zip(pending.branches, list(branch_guesses) + [None] * len(pending.branches)):
            ranking = own_guess if branch.kind == REJECTED_LAST else guess
            excluded = branch.excluded if branch.kind == REJECTED_LAST else ranking.own if ranking else None
            token = ranking.best_other_than(excluded) if isinstance(ranking, NextTokens) else None
            if token is None:
                self.proposer.close(branch.proposer_state)
                continue
            branch.guessed_token_id = token
            branch.tokens.append(token)
            kept.append(branch)
        pending.branches = kept
        return guess is not None or bool(kept)

    def abort_propose(self, state: DraftSession) -> None:
        """Drafting failed after begin_propose: drop a placed guess and the forked branches, so
        that the parent is as it was."""
        if state.pending is not None:
            for branch in state.pending.branches:
                self.proposer.close(branch.proposer_state)
            if state.pending.speculative:
                self._cut(state, state.pending.start)
        state.pending = None

    def finish_propose(self, state: DraftSession, block: DraftBlock,
                       branch_blocks: Sequence[DraftBlock | Exception] = ()) -> Proposal:
        """Record a drafted block as the session's newest proposal, and the alternatives drafted
        beside it (branch_blocks[i]: pending branch i's block; a failed one is dropped)."""
        pending, state.pending = state.pending, None
        assert pending is not None
        first = state.position  # after the guess, if any
        if pending.speculative and pending.guessed_token_id is None:
            block = DraftBlock.empty()  # nothing can be drafted on a missing guess
        live, settled_to = state.chain.add(pending.start, first + block.num_tokens, pending.speculative,
                                           pending.guessed_token_id)
        if settled_to is not None:
            state.committed = max(state.committed, settled_to)
        state.tokens.extend(block.token_ids.tolist())
        alternatives = []
        for branch, branch_block in zip(pending.branches, branch_blocks):
            if isinstance(branch_block, Exception):
                self.proposer.close(branch.proposer_state)
                continue
            alternatives.append(self._record_alternative(state, live.epoch, branch, branch_block))
        return Proposal(live.epoch, first, block, self.proposer.name, pending.speculative,
                        pending.guessed_token_id, alternatives=tuple(alternatives))

    def _record_alternative(self, state: DraftSession, sibling: int, branch: PendingBranch,
                            block: DraftBlock) -> Proposal:
        parent_epoch = state.chain.live[state.chain.index_of(sibling) - 1].epoch
        first = branch.start + 1
        live = LiveProposal(state.chain.new_epoch(), branch.start, first + block.num_tokens, True,
                            branch.guessed_token_id)
        branch.tokens.extend(block.token_ids.tolist())
        state.alternatives[live.epoch] = Alternative(live, parent_epoch, branch.kind, branch.tokens,
                                                     branch.proposer_state)
        return Proposal(live.epoch, first, block, self.proposer.name, True, branch.guessed_token_id,
                        kind=branch.kind)

    def _adopt(self, state: DraftSession, alternative: Alternative) -> None:
        """The caller builds on an alternative: it replaces the parent's speculative child."""
        del state.alternatives[alternative.live.epoch]
        state.chain.drop_after(alternative.parent_epoch)
        settled_to = state.chain.append(alternative.live)
        if settled_to is not None:
            state.committed = max(state.committed, settled_to)
        state.tokens = alternative.tokens
        self.proposer.adopt(state.proposer_state, alternative.proposer_state)  # type: ignore[attr-defined]

    def release_alternatives(self, state: DraftSession) -> None:
        for alternative in state.alternatives.values():
            self.proposer.close(alternative.proposer_state)
        state.alternatives.clear()

    def truncate(self, session_id: str, position: int) -> int:
        """Cut the sequence (committed part included) to `position`; idempotent."""
        state = self.sessions.get(session_id)
        if position < 1:
            raise InvalidArgument(f"truncate position must be >= 1, got {position}")
        self._cut(state, min(position, state.position))
        state.committed = min(state.committed, state.position)
        state.chain.clear()
        self.release_alternatives(state)
        return state.position

    def end_session(self, session_id: str) -> bool:
        state = self.sessions.pop(session_id)
        if state is None:
            return False
        self.release_alternatives(state)
        self.proposer.close(state.proposer_state)
        return True

    def end_turn(self, session_id: str) -> bool:
        """The session's turn ended: its draft slot may go to another session before the proposer's
        evict_after_s has passed (its next Propose keeps it again). False for an unknown session."""
        state = self.sessions.peek(session_id)  # peek: ending a turn is not a use
        if state is None:
            return False
        state.between_turns = True  # no longer counted in sessions_in_turn
        release = getattr(self.proposer, "end_turn", None)  # optional (proposers/base.py): those holding a KV slot
        if release is not None:
            release(state.proposer_state)
        return True

    def expire_idle(self) -> list[str]:
        expired = [s.session_id for s in self.sessions.expired()]
        for session_id in expired:
            self.end_session(session_id)
        return expired

    def _cut(self, state: DraftSession, length: int) -> None:
        if length < state.position:
            del state.tokens[length:]
            self.proposer.rollback(state.proposer_state, length)
