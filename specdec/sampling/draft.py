"""Draft-side sampling: propose one token and report exactly the distribution it came from.

Rejection sampling is lossless for *any* draft distribution, provided the target is told the one the
token was really sampled from (Leviathan et al. 2023, Appendix A.1; Chen et al. 2023, Theorem 1).
So the draft may truncate to its top_m tokens to keep the message small, as long as it samples
from that truncated, renormalised distribution and sends it unchanged; the target never re-warps
it.
"""

from __future__ import annotations

import torch

from specdec.sampling import rng
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.rng import Stream
from specdec.sampling.warp import greedy_token, warp_logits


def sample_draft_token(
    draft_logits: torch.Tensor,  # [vocab]
    params: SamplingParams,
    position: int,
    top_m: int = 0,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Draft the token at absolute `position`.

    Returns (token, ids [m] int64, draft_probs [m] float32); (ids, draft_probs) is the sparse
    distribution the token was drawn from, to be sent with it unchanged.

    The request's own warp (temperature, top-k, top-p) is applied, so with an accurate draft the
    acceptance rate is high. top_m > 0 keeps only the top_m most probable tokens (renormalised).
    REJECTION mode samples with the DRAFT stream; GUMBEL mode proposes argmax(log draft_probs + g)
    with the noise the target will use at this position; greedy proposes the argmax as a point mass.
    """
    if params.greedy:
        token = greedy_token(draft_logits)
        return token, torch.tensor([token]), torch.tensor([1.0])
    ids, draft_probs = _sparse_support(warp_logits(draft_logits, params), top_m)
    if params.mode is SamplingMode.GUMBEL:
        vocab_size = draft_logits.shape[-1]
        dense = torch.zeros(vocab_size, dtype=torch.float32).scatter_(0, ids, draft_probs)
        token = rng.gumbel_argmax(dense, params.seed, position)
    else:
        token = int(ids[rng.sample_from_probs(draft_probs, params.seed, position, Stream.DRAFT)])
    return token, ids, draft_probs


def draft_confidence(draft_logits: torch.Tensor, token: int, ids: torch.Tensor, probs: torch.Tensor,
                     greedy: bool) -> float:
    """The draft's probability of the token it drafted (sample_draft_token's returns): for a greedy
    draft, sent as a point mass, the softmax of its logits at the argmax, 1 / sum(exp(logits - max));
    otherwise the token's entry in the distribution it was sampled from."""
    if greedy:
        logits = draft_logits.float()
        return float(1.0 / torch.exp(logits - logits.max()).sum())
    return float(probs[ids == token].sum())


def _sparse_support(
    probs: torch.Tensor, top_m: int  # probs: [vocab] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens with positive mass, optionally only the top_m most probable, renormalised if cut.

    Returns (ids [m] int64, probs [m] float32) on the CPU, since they are sent over the network.
    """
    probs = probs.detach().to("cpu", torch.float32)
    if 0 < top_m < probs.numel():
        values, ids = torch.topk(probs, top_m)
        keep = values > 0
        ids, values = ids[keep], values[keep]
        if int(keep.sum()) < int((probs > 0).sum()):  # positive mass was cut
            values = values / values.sum()
        return ids, values
    ids = torch.nonzero(probs > 0)[:, 0]
    return ids, probs[ids]


def pack_sparse(
    rows: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-token sparse distributions into DraftBlock's padded form.

    rows: k pairs (ids [m_i], probs [m_i]). Returns (ids [k, m] int64 padded with -1,
    probs [k, m] float32 padded with 0), m = max m_i (0 when k == 0).
    """
    if not rows:
        return torch.empty(0, 0, dtype=torch.long), torch.empty(0, 0, dtype=torch.float32)
    pad = torch.nn.utils.rnn.pad_sequence
    packed_ids = pad([ids.long() for ids, _ in rows], batch_first=True, padding_value=-1)
    packed_probs = pad([probs.float() for _, probs in rows], batch_first=True, padding_value=0.0)
    return packed_ids, packed_probs
