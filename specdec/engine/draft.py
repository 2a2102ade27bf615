"""The draft engine: session-keyed draft state around any proposer.

A draft session's sequence is the committed sequence followed by its latest drafted tail. Propose
first applies the previous verify outcome (the accept/rollback message: keep the first keep_position
tokens, append the target's recovered/bonus token) and then drafts, so a cycle costs one round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from specdec.engine.api import Proposal
from specdec.engine.sessions import SessionState, SessionTable
from specdec.errors import EpochMismatch, InvalidArgument, PositionMismatch
from specdec.models.base import ModelInfo
from specdec.proposers.base import Proposer
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock


@dataclass
class DraftSession(SessionState):
    committed: int = 0  # tokens[:committed] are known committed; the rest is the drafted tail
    epoch: int = 0  # id of the latest proposal
    proposer_state: object = None


class DraftEngine:
    def __init__(
        self,
        proposer: Proposer,
        idle_ttl_s: float = 600.0,
        max_draft_tokens: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.proposer = proposer
        self.max_draft_tokens = max_draft_tokens
        self.sessions: SessionTable[DraftSession] = SessionTable(idle_ttl_s, clock)

    @property
    def info(self) -> ModelInfo | None:
        return self.proposer.info()

    def start_session(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> int:
        params.validate()
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise InvalidArgument("token_ids must not be empty")
        state = self.sessions.add(DraftSession(session_id, params, tokens, committed=len(tokens)))
        state.proposer_state = self.proposer.open(session_id)
        return state.committed

    def propose(
        self,
        session_id: str,
        keep_position: int,
        append_token_ids: Sequence[int],
        num_draft_tokens: int,
        parent_epoch: int = 0,
    ) -> Proposal:
        state = self.begin_propose(session_id, keep_position, append_token_ids, num_draft_tokens, parent_epoch)
        block = self.proposer.propose(state.proposer_state, state.tokens, num_draft_tokens, state.params)
        return self.finish_propose(state, block)

    def begin_propose(
        self,
        session_id: str,
        keep_position: int,
        append_token_ids: Sequence[int],
        num_draft_tokens: int,
        parent_epoch: int = 0,
    ) -> DraftSession:
        """Check a Propose and apply its accept/rollback message; drafting comes next (alone, or
        batched with other sessions' Proposes by specdec.engine.draft_batch)."""
        state = self.sessions.get(session_id)
        if not 0 <= num_draft_tokens <= self.max_draft_tokens:
            raise InvalidArgument(
                f"num_draft_tokens must be in [0, {self.max_draft_tokens}], got {num_draft_tokens}"
            )
        if parent_epoch and parent_epoch != state.epoch:
            raise EpochMismatch(session_id, expected=parent_epoch, actual=state.epoch)
        # Rolling back into the committed prefix, or keeping tokens never drafted, means a message
        # was lost or duplicated: refuse with the sequence's length so the caller can resync.
        if not state.committed <= keep_position <= state.position:
            raise PositionMismatch(session_id, expected=keep_position, actual=state.position)
        self._cut(state, keep_position)
        state.tokens.extend(int(t) for t in append_token_ids)
        state.committed = state.position
        return state

    def finish_propose(self, state: DraftSession, block: DraftBlock) -> Proposal:
        """Record a drafted block as the session's newest proposal."""
        state.epoch += 1
        proposal = Proposal(state.epoch, state.position, block, self.proposer.name)
        state.tokens.extend(block.token_ids.tolist())
        return proposal

    def truncate(self, session_id: str, position: int) -> int:
        """Cut the sequence (committed part included) to `position`; idempotent."""
        state = self.sessions.get(session_id)
        if position < 1:
            raise InvalidArgument(f"truncate position must be >= 1, got {position}")
        self._cut(state, min(position, state.position))
        state.committed = min(state.committed, state.position)
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
