"""Value types that cross layer boundaries: a drafted block and the outcome of verifying it.

Vocabulary (as in vLLM's rejection sampler): of k drafted tokens, the first `num_accepted` are
*accepted*; at the first rejection the target emits a *recovered* token sampled from the residual
norm(max(0, target_probs - draft_probs)); when all k are accepted it emits a *bonus* token sampled
from target_probs at the position after the block. Either way every cycle commits num_accepted + 1
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftBlock:
    """k drafted tokens and the exact (sparse) distributions they were sampled from.

    draft_probs is None when the proposer has no distribution (n-gram lookup, greedy draft): each
    token then counts as a point mass, which is what a deterministic proposer "samples" from.
    Sparse rows are padded with id -1 and probability 0; m is the widest row's support.
    """

    token_ids: torch.Tensor  # [k] int64
    draft_prob_ids: torch.Tensor | None = None  # [k, m] int64, -1 = padding
    draft_probs: torch.Tensor | None = None  # [k, m] float32, rows sum to 1 over the non-padded ids
    # The draft's probability of each drafted token under the distribution it was drafted from (its
    # confidence: what the coordinator's draft-length policy calibrates against acceptance). Empty:
    # the proposer has none (n-gram lookup).
    confidences: tuple[float, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def __post_init__(self) -> None:
        if (self.draft_prob_ids is None) != (self.draft_probs is None):
            raise ValueError("draft_prob_ids and draft_probs come together or not at all")
        if self.draft_probs is not None and self.draft_probs.shape != self.draft_prob_ids.shape:
            raise ValueError("draft_probs and draft_prob_ids must have the same [k, m] shape")
        if self.draft_probs is not None and self.draft_probs.shape[0] != self.token_ids.numel():
            raise ValueError("one sparse distribution per drafted token is required")
        if self.confidences and len(self.confidences) != self.token_ids.numel():
            raise ValueError("one confidence per drafted token is required (or none)")

    @staticmethod
    def empty() -> "DraftBlock":
        return DraftBlock(token_ids=torch.empty(0, dtype=torch.long))


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of verifying one DraftBlock at absolute position `position`.

    The tokens committed are draft tokens [0, num_accepted) followed by next_token, which is a
    recovered token when num_accepted < num_drafted and a bonus token otherwise.
    """

    position: int  # absolute position of the first drafted token
    num_drafted: int
    num_accepted: int
    next_token: int

    @property
    def is_bonus(self) -> bool:
        return self.num_accepted == self.num_drafted

    @property
    def num_committed(self) -> int:
        return self.num_accepted + 1
