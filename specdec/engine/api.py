"""What the speculative loop needs from a target and a draft, whatever carries the calls.

Local engines (specdec.engine.local) implement these in-process; gRPC clients implement them over the
network. The loop in specdec.generation.loop is written once, against these protocols only.

Positions are absolute token indices in the session's committed sequence. `position` always means
"the committed length the caller expects the session to have"; a mismatch raises PositionMismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol, Sequence

from specdec.models.base import ModelInfo
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock, VerifyOutcome


@dataclass(frozen=True)
class InnerDraft:
    """Drafts the target makes inside its decode stream (specdec.engine.inner_draft): "ngram" (prompt
    lookup) or "model" (the draft model it hosts), up to num_tokens a step: that many, or, adaptive,
    as many as the stream's own policy finds pays (specdec.generation.inner_adaptive)."""

    kind: str
    num_tokens: int
    adaptive: bool = False


@dataclass(frozen=True)
class Proposal:
    """A drafted block and where it sits: its tokens occupy [position, position + k).

    A speculative proposal (pipelining) assumes its parent fully accepted and the target's next
    token equal to guessed_token_id, placed at position - 1; it is valid only if that comes true.
    A speculative proposal without a guess (the proposer had none) is empty and never valid.
    Its alternatives (multi-outcome pipelining, specdec.engine.alternatives) are speculative
    proposals for other outcomes of the same parent, each valid where the target commits its guess
    at position - 1; at most one is."""

    epoch: int  # id of this proposal within the session, increasing; confirmed by the next Propose
    position: int
    block: DraftBlock
    proposer: str
    speculative: bool = False
    guessed_token_id: int | None = None
    kind: str = "main"  # "main" | "second_guess" | "rejected_last" (specdec.engine.alternatives)
    alternatives: tuple["Proposal", ...] = field(default=())


class TargetAPI(Protocol):
    async def start_session(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        sample_first_token: bool = True,
        drafts_elsewhere: bool = False,
        draft_source: str = "",
        slot_wait_s: float = 0.0,
    ) -> tuple[int, int | None]:
        """Prefill and commit token_ids; return (position, first token or None when restoring).
        slot_wait_s: while every KV slot is in use, wait up to this long for one, first come first
        served, before CacheFull (0: at once, so the caller may go to another replica).
        drafts_elsewhere: the session's drafts will not be made inside the target (they come from
        draft_source, e.g. the draft service's address); a target that prices their cycles may report
        a draft limit of 0 into the measured cycle (cycle_cost.py)."""

    async def verify(self, session_id: str, position: int, draft: DraftBlock, epoch: int = 0) -> VerifyOutcome:
        """Verify draft tokens at [position, position + k), commit accepted + recovered/bonus."""

    async def decode(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """Commit append_token_ids, then generate and commit num_tokens tokens by plain decoding."""

    def decode_stream(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (), inner_draft: InnerDraft | None = None,
    ) -> AsyncIterator[list[int]]:
        """decode(), one step's tokens at a time as they are committed, ending right after a stop
        token. A caller that stops reading early truncates to where it stopped before any other
        call of the session (the target may have committed a step more). inner_draft: a target
        that can drafts each step itself and verifies the draft in the step (several tokens a step,
        the same output); one that cannot decodes plainly."""

    async def truncate(self, session_id: str, position: int) -> int: ...

    async def end_session(self, session_id: str) -> bool: ...

    async def info(self) -> ModelInfo: ...


async def decode_by_steps(
    decode: Callable[..., Awaitable[list[int]]], session_id: str, position: int, num_tokens: int,
    append_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
) -> AsyncIterator[list[int]]:
    """TargetAPI.decode_stream from one decode() call per step (an in-process engine, or a target
    service older than DecodeStream): the first call commits append_token_ids; ends after num_tokens
    tokens or right after a stop token."""
    stop, start = frozenset(stop_token_ids), position + len(append_token_ids)
    tokens = await decode(session_id, position, min(num_tokens, 1), append_token_ids)
    yield tokens
    for position in range(start + len(tokens), start + num_tokens):
        if tokens[-1] in stop:
            return
        tokens = await decode(session_id, position, 1)
        yield tokens


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
        alternatives: Sequence[str] = (),
        stop_below: float = 0.0,
    ) -> Proposal:
        """Accept/rollback (keep the first keep_position tokens, append the target's tokens), then
        draft num_draft_tokens tokens with the exact distributions they were sampled from.
        stop_below > 0: a proposer with confidences stops once their product falls below it (the
        block's confidences say what they were; specdec.generation.adaptive chooses the value).
        speculative: keep the whole parent (keep_position = its end, nothing appended), guess the
        target's next token and draft after the guess (draft.proto, pipelining); alternatives: also
        draft these branches for other outcomes in the same pass (specdec.engine.alternatives)."""

    async def truncate(self, session_id: str, position: int) -> int: ...

    async def end_session(self, session_id: str) -> bool: ...

    async def info(self) -> ModelInfo: ...
