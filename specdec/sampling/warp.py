"""Logits -> the distribution plain decoding samples from: temperature, then top-k, then top-p.

The order is Hugging Face's (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper), so a
request means the same thing here as in `transformers.generate`. Speculative decoding is lossless
only with respect to *this* distribution: the target side of verification calls exactly these
functions (Leviathan et al. 2023, sec. 2.2: temperature, top-k and nucleus sampling are all
"sample from an adjusted distribution", and that adjusted distribution is the target's).

One implementation serves one row and many rows with different parameters (`warp_rows`), so the
batched verifier and the readable reference see bit-identical probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.sampling.params import SamplingParams


def greedy_token(logits: torch.Tensor) -> int:  # logits: [vocab]
    """The greedy choice; torch.argmax breaks ties towards the lowest token id."""
    return int(torch.argmax(logits))


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities plain decoding with `params` samples from.

    logits: [..., vocab], any float dtype. Returns float32 [..., vocab]. Greedy (temperature 0) is
    a one-hot at the argmax, which makes "sample from the warped distribution" and "take the argmax"
    the same thing.
    """
    vocab_size = logits.shape[-1]
    rows = logits.reshape(-1, vocab_size)
    probs = warp_rows(rows, [params] * rows.shape[0])
    return probs.reshape(logits.shape)


def warp_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Warp each row with its own parameters in one pass (one softmax for the whole batch).

    logits: [n, vocab], any float dtype; params: n entries. Returns float32 [n, vocab].
    Every step is row-wise, so a row's result does not depend on what else is in the batch.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"expected [n, vocab] logits and n params, got {tuple(logits.shape)}"
                         f" and {len(params)}")
    device = logits.device
    scores = logits.float()
    greedy = torch.tensor([request.greedy for request in params], device=device)
    # Greedy rows divide by 1 (their scores are replaced by a one-hot below).
    temperature = torch.tensor(
        [1.0 if request.greedy else request.temperature for request in params],
        dtype=torch.float32, device=device)
    scores = scores / temperature[:, None]
    vocab_size = scores.shape[-1]
    top_k = [0 if request.greedy else request.top_k for request in params]
    rows = [row for row, k in enumerate(top_k) if 0 < k < vocab_size]
    if rows:  # only the rows that truncate pay for the sort
        scores[rows] = _mask_top_k(scores[rows], [top_k[row] for row in rows])
    top_p = [1.0 if request.greedy else request.top_p for request in params]
    rows = [row for row, mass in enumerate(top_p) if mass < 1.0]
    if rows:
        scores[rows] = _mask_top_p(scores[rows], [top_p[row] for row in rows])
    probs = torch.softmax(scores, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _mask_top_k(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep, per row, the scores >= the k-th largest (each k in [1, vocab)).

    scores: [n, vocab] float32. Like HF, tokens tied with the k-th largest score are all kept: which
    of several equal tokens to drop has no principled answer, and keeping them is order-independent.
    """
    sorted_desc = torch.sort(scores, dim=-1, descending=True).values  # [n, vocab]
    kth_index = torch.tensor([k - 1 for k in top_k], device=scores.device)
    kth_score = sorted_desc.gather(-1, kth_index[:, None])  # [n, 1]
    return scores.masked_fill(scores < kth_score, float("-inf"))


def _mask_top_p(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep, per row, the smallest set of most probable tokens whose mass is >= top_p.

    scores: [n, vocab] float32. Sorting ascending and dropping the prefix whose cumulative mass is
    <= 1 - top_p (as HF does) leaves mass >= top_p; the most probable token is never dropped, so at
    least one token survives. A stable sort makes ties at the boundary deterministic.
    """
    sorted_scores, order = torch.sort(scores, dim=-1, stable=True)  # ascending, [n, vocab]
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    # Compared in float32 against 1 - top_p rounded once to float32, as HF compares its float32
    # cumulative sum with a Python float; the same tensor op for one row or many.
    threshold = torch.tensor([1.0 - mass for mass in top_p], dtype=torch.float32,
                             device=scores.device)
    drop_sorted = cumulative <= threshold[:, None]
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
