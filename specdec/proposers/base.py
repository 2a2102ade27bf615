"""The proposer interface: anything that drafts tokens for the target to verify.

The verifier never learns which proposer produced a draft; it only sees token ids and the exact
distributions they were sampled from (none for deterministic proposers: a point mass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from specdec.models.base import ModelInfo
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock


@dataclass(frozen=True)
class NextTokens:
    """A proposer's view of the next position: the token it would draft there (its own, sampled
    with its position-keyed randomness, as propose(..., 1) returns it) and its most likely tokens,
    best first. Multi-outcome pipelining guesses the target's token with the ranked ones."""

    own: int
    ranked: tuple[int, ...]

    def best_other_than(self, *excluded: int) -> int | None:
        return next((t for t in self.ranked if t not in excluded), None)


class Proposer(Protocol):
    name: str  # "draft-model" | "ngram" | ...

    def info(self) -> ModelInfo | None:
        """The draft model's info, or None for a proposer without weights."""

    def open(self, session_id: str) -> object:
        """Per-session proposer state (a KV slot for a model; nothing for n-gram lookup)."""

    def close(self, state: object) -> None: ...

    def rollback(self, state: object, length: int) -> None:
        """The session's sequence was cut to `length` tokens: forget anything cached beyond it."""

    def propose(
        self, state: object, token_ids: Sequence[int], num_tokens: int, params: SamplingParams
    ) -> DraftBlock:
        """Draft up to num_tokens tokens continuing token_ids (the whole sequence so far).

        The i-th drafted token sits at absolute position len(token_ids) + i; counter-based
        randomness is keyed on that position. May return fewer tokens (even none)."""

    # Optional, for multi-outcome pipelining (specdec.engine.alternatives); a proposer without them
    # drafts only the main branch.
    #   rank_batch(requests: [(state, token_ids, params)], num_ranked) -> [NextTokens | None | Exception]
    #     (NextTokens.own must be the token propose(..., 1) drafts: it becomes the main guess)
    #   fork(state, length) -> a new state holding what `state` caches of the first `length` tokens
    #   adopt(state, branch): `state` takes over the branch's cache (the branch state is used up)
    # Optional, for proposers that hold a KV slot (DraftEngine.end_turn calls it when present):
    #   end_turn(state): the session's turn ended; its slot may go to another session before it drafts again
