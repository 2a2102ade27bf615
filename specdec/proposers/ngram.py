"""Prompt lookup / n-gram proposer (Saxena 2023; "PLD" on Spec-Bench): no weights.

Find the most recent earlier occurrence of the sequence's last n tokens (longest n first) and
propose what followed it. A deterministic proposal is a point mass, so verification stays lossless
under sampling too: the target accepts it with probability target_probs[token].
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.models.base import ModelInfo
from specdec.proposers.base import NextTokens
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock


class NgramProposer:
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_lookback: int = 4096):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgument(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_lookback = max_lookback  # bounds the per-cycle search cost on long sessions

    def info(self) -> ModelInfo | None:
        return None

    def open(self, session_id: str) -> object:
        return None

    def close(self, state: object) -> None:
        pass

    def rollback(self, state: object, length: int) -> None:
        pass

    def propose(
        self, state: object, token_ids: Sequence[int], num_tokens: int, params: SamplingParams
    ) -> DraftBlock:
        if num_tokens <= 0 or len(token_ids) < 2:
            return DraftBlock.empty()
        window = np.asarray(token_ids[-self.max_lookback :], dtype=np.int64)
        for n in range(min(self.max_ngram, len(window) - 1), self.min_ngram - 1, -1):
            start = self._last_match(window, n)
            if start is not None:
                continuation = window[start + n : start + n + num_tokens]
                return DraftBlock(token_ids=torch.from_numpy(continuation.copy()))
        return DraftBlock.empty()

    def rank_batch(self, requests: Sequence, num_ranked: int) -> list[NextTokens | None]:
        """Own next token: propose(..., 1)'s (so a subclass that drafts otherwise stays consistent);
        then what followed every earlier occurrence of the suffix, longest n-gram first, most
        recent first, each token once."""
        out: list[NextTokens | None] = []
        for state, token_ids, params in requests:
            block = self.propose(state, token_ids, 1, params)
            if block.num_tokens == 0:
                out.append(None)
                continue
            own = int(block.token_ids[0])
            others = [t for t in self._continuations(token_ids, num_ranked + 1) if t != own]
            out.append(NextTokens(own, (own, *others)[:num_ranked]))
        return out

    def _continuations(self, token_ids: Sequence[int], limit: int) -> list[int]:
        window = np.asarray(token_ids[-self.max_lookback :], dtype=np.int64)
        found: list[int] = []
        for n in range(min(self.max_ngram, len(window) - 1), self.min_ngram - 1, -1):
            candidates = np.lib.stride_tricks.sliding_window_view(window[:-1], n)  # [len - n, n]
            for start in np.flatnonzero((candidates == window[-n:]).all(axis=1))[::-1]:
                token = int(window[start + n])
                if token not in found:
                    found.append(token)
                if len(found) >= limit:
                    return found
        return found

    @staticmethod
    def _last_match(window: np.ndarray, n: int) -> int | None:
        """Start of the latest earlier occurrence of window[-n:] that has a continuation."""
        suffix = window[-n:]
        # Candidates end before the suffix itself starts, so something follows each of them.
        candidates = np.lib.stride_tricks.sliding_window_view(window[:-1], n)  # [len - n, n]
        hits = np.flatnonzero((candidates == suffix).all(axis=1))
        return int(hits[-1]) if hits.size else None
