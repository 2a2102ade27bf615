"""What the speculative loop needs from a target and a draft, whatever carries the calls.

Local engines (specdec.engine.local) implement these in-process; gRPC clients implement them over the
network. The loop in specdec.generation.loop is written once, against these protocols only.

Positions are absolute token indices in the session's committed sequence. `position` always means
"the committed length the caller expects the session to have"; a mismatch raises PositionMismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from specdec.models.base import ModelInfo
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock, VerifyOutcome


@dataclass(frozen=True)
class Proposal:
    """A drafted block and where it sits: its tokens occupy [position, position + k).

    A speculative proposal (pipelining) assumes its parent fully accepted and the target's next
    token equal to guessed_token_id, placed at position - 1; it is valid only if that comes true.
    A speculative proposal without a guess (the proposer had none) is empty and never valid."""

    epoch: int  # id of this proposal within the session, increasing; confirmed by the next Propose
    position: int
    block: DraftBlock
    proposer: str
    speculative: bool = False
    guessed_token_id: int | None = None


class TargetAPI(Protocol):
    async def start_session(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        sample_first_token: bool = True,
    ) -> tuple[int, int | None]:
        """Prefill and commit token_ids; return (position, first token or None when restoring)."""

    async def verify(self, session_id: str, position: int, draft: DraftBlock, epoch: int = 0) -> VerifyOutcome:
        """Verify draft tokens at [position, position + k), commit accepted + recovered/bonus."""

    async def decode(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """Commit append_token_ids, then generate and commit num_tokens tokens by plain decoding."""

    async def truncate(self, session_id: str, position: int) -> int: ...

    async def end_session(self, session_id: str) -> bool: ...

    async def info(self) -> ModelInfo: ...


class DraftAPI(Protocol):
    async def start_session(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams
    ) -> None: ...

    async def propose(
        self,
        session_id: str,
        keep_position: int,
        append_token_ids: Sequence[int],
        num_draft_tokens: int,
        parent_epoch: int = 0,
        speculative: bool = False,
    ) -> Proposal:
        """Accept/rollback (keep the first keep_position tokens, append the target's tokens), then
        draft num_draft_tokens tokens with the exact distributions they were sampled from.
        speculative: keep the whole parent (keep_position = its end, nothing appended), guess the
        target's next token and draft after the guess (draft.proto, pipelining)."""

    async def truncate(self, session_id: str, position: int) -> int: ...

    async def end_session(self, session_id: str) -> bool: ...

    async def info(self) -> ModelInfo: ...
