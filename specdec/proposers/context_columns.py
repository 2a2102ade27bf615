"""A reduced-head draft's scores for a whole batched step at once, and its greedy rows' picks.

A reduced head scores its own token ids; each session adds the tokens of its own text outside the
head as extra columns (specdec.proposers.draft_model). Scored one row at a time, a step of 16 rows
spent about 0.2 ms a row in small tensor operations (a product with the row's context rows, a
concatenation, an argmax, a tie check, a softmax for the confidence): nearly half of the draft step
on the project's CPU (BENCHMARKS.md, rounds 33 and 34). Here a proposal pass packs its rows' context
rows once into one tensor, and each step scores them, and picks for all its greedy rows, in two
compiled loops (specdec.models.cpu_scores; PyTorch's operators off the CPU or without numba).

What a greedy row picks is what the row-at-a-time path picks: the highest score, ties to the lowest
token id; rows with a tie or no finite score are left to that path, which decides them the same way.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specdec.models import cpu_scores


class ContextColumns:
    """The extra columns of one proposal pass's rows (their context fixed for the pass): in a step's
    scores, column j < len(head) scores head[j], column len(head) + c row i's context id c, and the
    columns past a row's own count are -inf."""

    def __init__(self, head_ids: Sequence[int], context_rows: Sequence[torch.Tensor | None],
                 context_ids: Sequence[Sequence[int]]):
        """head_ids: the head's token ids (a list: picks map to ids in Python, cheaper than a gather);
        context_rows[i]: row i's context ids' rows of the full head, context_ids[i] those ids."""
        counts = [0 if rows is None else len(rows) for rows in context_rows]
        self.head_ids, self.context_ids = head_ids, context_ids
        self.head_width = len(head_ids)
        self.widths = np.array([self.head_width + count for count in counts], dtype=np.int64)  # real columns
        self.padded = max(counts, default=0)
        self.offsets = np.cumsum([0, *counts])  # row i's context rows: rows[offsets[i]:offsets[i + 1]]
        kept = [rows for count, rows in zip(counts, context_rows) if count]
        self.rows = (kept[0] if len(kept) == 1 else torch.cat(kept)) if kept else None  # [sum of counts, hidden]

    def scores(self, head_logits: torch.Tensor, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The step's scores [len(rows), head + padded] (float32): head_logits [n, head] and the final
        hidden states [n, hidden] of the pass's rows `rows`, in that order."""
        scores = torch.empty((len(rows), self.head_width + self.padded), device=head_logits.device)
        scores[:, :self.head_width] = head_logits
        if self.rows is None:
            return scores
        scores[:, self.head_width:] = float("-inf")
        if cpu_scores.usable(hidden, self.rows):
            cpu_scores.context_scores(hidden, self.rows, self.offsets, np.asarray(rows, dtype=np.int64), scores,
                                      self.head_width)
            return scores
        for a, row in enumerate(rows):
            first, end = int(self.offsets[row]), int(self.offsets[row + 1])
            if end > first:
                scores[a, self.head_width:self.head_width + end - first] = (
                    torch.nn.functional.linear(hidden[a], self.rows[first:end]).float())
        return scores

    def greedy(self, scores: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, float] | None]:
        """Per row of scores (the pass's rows `rows`): (token, confidence) of its greedy pick, the
        confidence being the softmax of its scores at the pick (specdec.sampling.draft's
        draft_confidence); None where a tie or a non-finite maximum leaves it to the row's own path."""
        picks = []
        for row, pick in zip(rows, greedy_columns(scores, self.widths[list(rows)])):
            if pick is not None:
                column, confidence = pick
                token = (self.head_ids[column] if column < self.head_width
                         else self.context_ids[row][column - self.head_width])
                pick = (token, confidence)
            picks.append(pick)
        return picks


def greedy_columns(scores: torch.Tensor, widths: np.ndarray | None = None) -> list[tuple[int, float] | None]:
    """Per row of scores [n, columns] (over its first widths[i] columns; the rest are -inf or absent):
    (the column of its maximum, the softmax there), or None for a tie or no finite score. A full
    head's columns are token ids, so this is a whole step's greedy picks: on a GPU one transfer for
    the step, where a row at a time cost two synchronisations and seven kernels a row (an argmax, a
    softmax's sum), at 8 rows on one H200 about as long as the 1B draft's forward itself
    (docs/BENCHMARKS.md, round 39)."""
    if cpu_scores.usable(scores):
        if widths is None:
            widths = np.full(scores.shape[0], scores.shape[1], dtype=np.int64)
        columns, ties, best, totals = cpu_scores.greedy(scores, widths)
    else:
        top, where = scores.max(dim=1)
        ties = (scores == top.unsqueeze(1)).sum(dim=1)
        totals = torch.exp(scores - top.unsqueeze(1)).sum(dim=1)
        # One transfer: float64 holds every column index and float32 value exactly.
        columns, ties, best, totals = torch.stack((where.double(), ties.double(), top.double(),
                                                   totals.double())).tolist()
    return [None if tied != 1 or not np.isfinite(top) else (int(column), 1.0 / total)
            for column, tied, top, total in zip(columns, ties, best, totals)]
