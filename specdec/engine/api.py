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
    """A drafted block and where it sits: its tokens occupy [position, position + k)."""

    epoch: int  # id of this proposal within the session, increasing; confirmed by the next Propose
    position: int
    block: DraftBlock
    proposer: str


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
    ) -> Proposal:
        """Accept/rollback (keep the first keep_position tokens, append the target's tokens), then
        draft num_draft_tokens tokens with the exact distributions they were sampled from."""

    async def truncate(self, session_id: str, position: int) -> int: ...

    async def end_session(self, session_id: str) -> bool: ...

    async def info(self) -> ModelInfo: ...
