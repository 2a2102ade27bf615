"""In-process implementations of TargetAPI / DraftAPI: the engines called directly, no network.

The gRPC clients implement the same protocols, so the speculative loop cannot tell them apart.
Every call is model time for the loop's per-cycle cost accounting (there is no RPC to pay).
"""

from __future__ import annotations

from typing import AsyncIterator, Sequence

from specdec.engine.api import InnerDraft, Proposal, decode_by_steps
from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.engine.cycle_cost import DRAFT, TARGET, model_time
from specdec.models.base import ModelInfo
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock, VerifyOutcome


class LocalTarget:
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    async def start_session(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, sample_first_token: bool = True,
        drafts_elsewhere: bool = False, draft_source: str = "",  # in process: no round trips to price
        slot_wait_s: float = 0.0,  # one caller in process: nobody to wait for
    ) -> tuple[int, int | None]:
        return self.engine.start_session(session_id, token_ids, params, sample_first_token)

    async def verify(self, session_id: str, position: int, draft: DraftBlock, epoch: int = 0) -> VerifyOutcome:
        with model_time(TARGET):
            return self.engine.verify(session_id, position, draft)

    async def decode(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = ()
    ) -> list[int]:
        with model_time(TARGET):
            return self.engine.decode(session_id, position, num_tokens, append_token_ids)

    def decode_stream(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (), inner_draft: InnerDraft | None = None,
    ) -> AsyncIterator[list[int]]:
        """decode() one token at a time (an in-process engine has no step to overlap, and no round
        trip for an inner draft to save: an in-process draft does the same)."""
        return decode_by_steps(self.decode, session_id, position, num_tokens, append_token_ids, stop_token_ids)

    async def truncate(self, session_id: str, position: int) -> int:
        return self.engine.truncate(session_id, position)

    async def end_session(self, session_id: str) -> bool:
        return self.engine.end_session(session_id)

    async def info(self) -> ModelInfo:
        return self.engine.info


class LocalDraft:
    def __init__(self, engine: DraftEngine):
        self.engine = engine

    async def start_session(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> None:
        self.engine.start_session(session_id, token_ids, params)

    async def propose(
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
        with model_time(DRAFT):
            return self.engine.propose(session_id, keep_position, append_token_ids, num_draft_tokens, parent_epoch,
                                       speculative, alternatives, stop_below)

    async def truncate(self, session_id: str, position: int) -> int:
        return self.engine.truncate(session_id, position)

    async def end_session(self, session_id: str) -> bool:
        return self.engine.end_session(session_id)

    async def end_turn(self, session_id: str) -> bool:
        return self.engine.end_turn(session_id)

    async def info(self) -> ModelInfo | None:
        return self.engine.info
