"""The draft engine: session-keyed draft state around any proposer.

A draft session's sequence is the committed sequence followed by its live proposals (a chain, see
specdec.engine.branches). Propose first applies the previous verify outcome (the accept/rollback
message: keep the first keep_position tokens, append the target's recovered/bonus token) and then
drafts, so a cycle costs one round trip. A speculative Propose (pipelining) instead keeps its whole
parent, guesses the target's next token with the proposer's own next token and drafts after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from specdec.engine.api import Proposal
from specdec.engine.branches import DEFAULT_MAX_LIVE_PROPOSALS, ProposalChain
from specdec.engine.sessions import SessionState, SessionTable
from specdec.errors import InvalidArgument, PositionMismatch
from specdec.models.base import ModelInfo
from specdec.proposers.base import Proposer
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock


@dataclass
class _Pending:
    """A Propose between its accept/rollback step and its drafted block."""

    speculative: bool
    start: int  # first position of the new proposal's span
    guessed_token_id: int | None = None


@dataclass
class DraftSession(SessionState):
    committed: int = 0  # tokens[:committed] are known committed; the rest belongs to live proposals
    chain: ProposalChain = None  # type: ignore[assignment]  # the live proposals (set by the engine)
    proposer_state: object = None
    pending: _Pending | None = None

    @property
    def epoch(self) -> int:
        """The newest live proposal's epoch, 0 if none."""
        return self.chain.latest_epoch


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
    ) -> Proposal:
        state = self.begin_propose(session_id, keep_position, append_token_ids, num_draft_tokens, parent_epoch,
                                   speculative)
        try:
            if speculative and not self.place_guess(state, self.proposer.propose(
                    state.proposer_state, state.tokens, 1, state.params)):
                return self.finish_propose(state, DraftBlock.empty())
            block = self.proposer.propose(state.proposer_state, state.tokens, num_draft_tokens, state.params)
        except Exception:
            self.abort_propose(state)
            raise
        return self.finish_propose(state, block)

    def begin_propose(
        self,
        session_id: str,
        keep_position: int,
        append_token_ids: Sequence[int],
        num_draft_tokens: int,
        parent_epoch: int = 0,
        speculative: bool = False,
    ) -> DraftSession:
        """Check a Propose and apply its accept/rollback message; drafting comes next (alone, or
        batched with other sessions' Proposes by specdec.engine.draft_batch). A refused message
        changes nothing."""
        state = self.sessions.get(session_id)
        if not 0 <= num_draft_tokens <= self.max_draft_tokens:
            raise InvalidArgument(
                f"num_draft_tokens must be in [0, {self.max_draft_tokens}], got {num_draft_tokens}"
            )
        appended = [int(t) for t in append_token_ids]
        if parent_epoch:
            state.chain.check_keep(parent_epoch, keep_position, speculative, appended, state.position)
        elif speculative:
            raise InvalidArgument("a speculative Propose builds on a live proposal: parent_epoch must not be 0")
        # Rolling back into the committed prefix, or keeping tokens never drafted, means a message
        # was lost or duplicated: refuse with the sequence's length so the caller can resync.
        elif not state.committed <= keep_position <= state.position:
            raise PositionMismatch(session_id, expected=keep_position, actual=state.position)
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
        return state

    def place_guess(self, state: DraftSession, guess: DraftBlock) -> bool:
        """A speculative Propose's first drafted token becomes its guess of the target's next token;
        the block is then drafted after it. False: the proposer had no guess (nothing to draft)."""
        assert state.pending is not None and state.pending.speculative
        if guess.num_tokens == 0:
            return False
        state.pending.guessed_token_id = int(guess.token_ids[0])
        state.tokens.append(state.pending.guessed_token_id)
        return True

    def abort_propose(self, state: DraftSession) -> None:
        """Drafting failed after begin_propose: drop a placed guess, so that the parent is as it was."""
        if state.pending is not None and state.pending.speculative:
            self._cut(state, state.pending.start)
        state.pending = None

    def finish_propose(self, state: DraftSession, block: DraftBlock) -> Proposal:
        """Record a drafted block as the session's newest proposal."""
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
        return Proposal(live.epoch, first, block, self.proposer.name, pending.speculative,
                        pending.guessed_token_id)

    def truncate(self, session_id: str, position: int) -> int:
        """Cut the sequence (committed part included) to `position`; idempotent."""
        state = self.sessions.get(session_id)
        if position < 1:
            raise InvalidArgument(f"truncate position must be >= 1, got {position}")
        self._cut(state, min(position, state.position))
        state.committed = min(state.committed, state.position)
        state.chain.clear()
        return state.position

    def end_session(self, session_id: str) -> bool:
        state = self.sessions.pop(session_id)
        if state is None:
            return False
        self.proposer.close(state.proposer_state)
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
