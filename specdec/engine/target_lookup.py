"""Prompt lookup inside the target: drafts for DecodeStream's lookup_draft_tokens.

A speculative cycle whose proposer runs elsewhere pays a round trip to the target per cycle (two
with a draft service), which is most of its overhead on a CPU and most of its loss under load on a
GPU, where streamed plain decoding pays none (docs/BENCHMARKS.md). An n-gram proposer needs only the
session's committed tokens, which the target holds: here it drafts inside the target's decode
stream, and each step verifies the draft in the same batched forward that decodes the other
sessions. No draft service, no round trip per cycle; the goodput trimmer cuts the drafts that would
slow the batch down, as it does any verify's.

The lookup runs on the service's event loop between a session's steps, for every streaming session,
so it must cost microseconds: LookupIndex keeps, for each n-gram, where it last occurred, updated as
tokens are committed, and answers what NgramProposer.propose answers (same n-grams, same most recent
occurrence, same lookback) with three dictionary lookups instead of a scan of the sequence.

Lossless as any verify: a lookup draft is deterministic, a point mass, so the target accepts a
drafted token with its own probability of it (specdec.proposers.ngram). A draft never holds a stop
token: one can only end a step as its recovered or bonus token, so a stream still ends right after
its stop token, with nothing committed past it.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from specdec.proposers.ngram import NgramProposer
from specdec.types import DraftBlock

class LookupIndex:
    """The n-grams (min_ngram..max_ngram tokens) of one growing sequence, each mapped to the start
    of its latest occurrence that has a continuation (a token after it)."""

    def __init__(self, proposer: NgramProposer | None = None):
        proposer = proposer or NgramProposer()
        self.min_ngram, self.max_ngram, self.max_lookback = proposer.min_ngram, proposer.max_ngram, proposer.max_lookback
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], int] = {}  # n-grams of every n share one dict: lengths differ

    def sync(self, tokens: Sequence[int]) -> None:
        """Catch up with the session's committed sequence, which only grows while a stream owns it
        (any other call of the session ends the stream first); a shorter one is indexed afresh."""
        if len(tokens) < len(self.tokens) or tokens[len(self.tokens) - 1: len(self.tokens)] != self.tokens[-1:]:
            self.tokens, self._starts = [], {}
        old = len(self.tokens)
        if len(tokens) == old:
            return
        self.tokens.extend(int(t) for t in tokens[old:])
        # An n-gram gains a continuation when the token after it arrives: those starting at
        # [old - n, len - 1 - n). Only starts inside the lookback window can ever be drafted from.
        first = max(0, len(self.tokens) - self.max_lookback)
        seq = self.tokens
        for n in range(self.min_ngram, self.max_ngram + 1):
            begin = max(old - n, first, 0)
            # In order, so that a later occurrence overwrites an earlier one: the latest wins.
            self._starts.update({tuple(seq[i: i + n]): i for i in range(begin, len(seq) - n)})

    def draft(self, max_tokens: int, stop_token_ids: Collection[int] = ()) -> DraftBlock:
        """NgramProposer.propose(tokens, max_tokens), cut before the first stop token."""
        length = len(self.tokens)
        if max_tokens <= 0 or length < 2:
            return DraftBlock.empty()
        window = min(length, self.max_lookback)
        for n in range(min(self.max_ngram, window - 1), self.min_ngram - 1, -1):
            start = self._starts.get(tuple(self.tokens[length - n:]))
            if start is None or start < length - window:  # outside the lookback window: none inside it
                continue
            drafted = []
            for token in self.tokens[start + n: start + n + max_tokens]:
                if token in stop_token_ids:
                    break
                drafted.append(token)
            return DraftBlock(torch.tensor(drafted, dtype=torch.long))
        return DraftBlock.empty()
