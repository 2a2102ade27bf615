"""A reduced-head draft's per-row scoring for a batched step, as two compiled loops (numba).

The draft proposer scores each row's own context tokens beside the head (a product of the row's
final hidden state with a few hundred rows of the full head, different for every row) and, for a
greedy row, picks the best column and its softmax probability. In PyTorch that was a dozen small
operator calls a row, about 0.1 ms a row on the project's CPU; here it is two calls a step whatever
the rows (specdec.proposers.context_columns; BENCHMARKS.md, round 34). float32, sums reassociated
for vectorisation: a draft's numbers only decide what it proposes, since it sends the distribution
it sampled from.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from specdec.models import cpu_attention


def _context_scores_loop(hidden, rows, offsets, pass_rows, scores, first_column):  # pragma: no cover - compiled
    # scores[a, first_column + j] = hidden[a] . rows[offsets[r] + j] for row r = pass_rows[a]'s columns j;
    # rows [sum of columns, hidden]: every row's context rows one after another (offsets [rows + 1]).
    for a in range(hidden.shape[0]):
        first, end = offsets[pass_rows[a]], offsets[pass_rows[a] + 1]
        for j in range(end - first):
            acc = np.float32(0.0)
            for i in range(hidden.shape[1]):
                acc += hidden[a, i] * rows[first + j, i]
            scores[a, first_column + j] = acc


def _greedy_loop(scores, widths, column, ties, best, total):  # pragma: no cover - compiled
    # Per row a, over its first widths[a] scores: the first column holding the maximum, how many hold
    # it, the maximum, and sum(exp(score - maximum)) (the softmax's denominator at the maximum).
    for a in range(scores.shape[0]):
        top = scores[a, 0]
        where, count = 0, 1
        for j in range(1, widths[a]):
            value = scores[a, j]
            if value > top:
                top, where, count = value, j, 1
            elif value == top:
                count += 1
        column[a], ties[a], best[a] = where, count, top
        acc = np.float32(0.0)
        if np.isfinite(top):
            for j in range(widths[a]):
                acc += np.exp(scores[a, j] - top)
        total[a] = acc


@functools.cache
def _kernels():
    """(context scores, greedy) compiled or loaded from numba's disk cache, or None without numba."""
    if cpu_attention._kernel() is None:  # numba missing or broken; also sets its cache directory
        return None
    import numba

    jit = functools.partial(numba.njit, nogil=True, cache=True, fastmath=cpu_attention.FASTMATH, boundscheck=False)
    return jit(_context_scores_loop), jit(_greedy_loop)


def warm_up() -> None:
    """Compile now (or load from numba's disk cache), at model load rather than in a first Propose."""
    if _kernels() is not None:
        context_scores(torch.ones(1, 2), torch.ones(1, 2), np.array([0, 1]), np.zeros(1, np.int64),
                       torch.empty(1, 3), 2)
        greedy(torch.zeros(1, 3), np.array([3]))


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the loops can take these tensors: float32 on the CPU, with numba present."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and _kernels() is not None


def context_scores(hidden: torch.Tensor, rows: torch.Tensor, offsets: np.ndarray, pass_rows: np.ndarray,
                   scores: torch.Tensor, first_column: int) -> None:
    """Fill scores[a, first_column + j] with hidden[a] . rows[offsets[r] + j] for r = pass_rows[a]
    and j below its count (offsets[r + 1] - offsets[r]). All float32 on the CPU (usable())."""
    _kernels()[0](hidden.contiguous().numpy(), rows.numpy(), offsets, pass_rows, scores.numpy(), first_column)


def greedy(scores: torch.Tensor, widths: np.ndarray) -> tuple[list[int], list[int], list[float], list[float]]:
    """Per row of scores [n, columns], over its first widths[i] columns: (first column of the maximum,
    how many columns hold it, the maximum, sum of exp(score - maximum)), each a list."""
    n = scores.shape[0]
    column, ties = np.empty(n, np.int64), np.empty(n, np.int64)
    best, total = np.empty(n, np.float32), np.empty(n, np.float32)
    _kernels()[1](scores.numpy(), widths, column, ties, best, total)
    return column.tolist(), ties.tolist(), best.tolist(), total.tolist()
