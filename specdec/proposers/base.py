"""The proposer interface: anything that drafts tokens for the target to verify.

The verifier never learns which proposer produced a draft; it only sees token ids and the exact
distributions they were sampled from (none for deterministic proposers: a point mass).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from specdec.models.base import ModelInfo
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock


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
