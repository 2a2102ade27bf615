"""Lossless verification of a drafted block: the readable reference.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2): the
draft proposes x_j ~ draft_probs_j; the target accepts it with probability
min(1, target_probs_j[x_j] / draft_probs_j[x_j]); at the first rejection it emits a *recovered*
token from norm(max(0, target_probs_j - draft_probs_j)); if all k are accepted it emits a *bonus*
token from target_probs_k. Each emitted token is then distributed exactly as target_probs given its
prefix, whatever the draft proposed (Leviathan et al., Appendix A.1; Chen et al., Theorem 1).

GUMBEL mode couples draft and target through shared Gumbel noise instead: the target's token at a
position is argmax(log target_probs + g), a draft token is accepted iff it equals that token, so the
output is token for token what `sample_next` emits with the same seed.

Position convention: `position` is the absolute position of the first drafted token; target_logits
row i holds the target's logits for position `position + i` (given the prompt, the committed tokens
and drafted tokens 0..i-1). Every random number is keyed on the position of the token it decides.

`specdec.sampling.batched.verify_batch` is the fast form; it must agree with this module exactly.
"""

from __future__ import annotations

import torch

from specdec.errors import InvalidArgument
from specdec.sampling import rng
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.rng import Stream
from specdec.sampling.warp import greedy_token, warp_logits
from specdec.types import DraftBlock, VerifyOutcome


def sample_next(target_logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Plain decoding of the token at absolute `position` (Decode RPC, baseline pool, fallback).

    target_logits: [vocab]. Uses the same stream and position as a bonus or recovered token, so a
    bonus token equals what plain decoding draws there.
    """
    if params.greedy:
        return greedy_token(target_logits)
    target_probs = warp_logits(target_logits, params)  # [vocab]
    if params.mode is SamplingMode.GUMBEL:
        return rng.gumbel_argmax(target_probs, params.seed, position)
    return rng.sample_from_probs(target_probs, params.seed, position, Stream.RESAMPLE)


def verify_block(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    draft: DraftBlock,
    params: SamplingParams,
    position: int,
) -> VerifyOutcome:
    """Accept a prefix of the drafted tokens and emit one recovered or bonus token."""
    vocab_size = check_block(target_logits, draft)
    draft_tokens = draft.token_ids.tolist()
    if params.greedy:
        target_tokens = target_logits.argmax(dim=-1).tolist()  # [k + 1]
        num_accepted = _count_equal_prefix(draft_tokens, target_tokens)
        return VerifyOutcome(position, len(draft_tokens), num_accepted, target_tokens[num_accepted])
    target_probs = warp_logits(target_logits, params)  # [k + 1, vocab]
    if params.mode is SamplingMode.GUMBEL:
        return _verify_gumbel(target_probs, draft_tokens, params.seed, position)
    draft_probs = dense_draft_probs(draft, vocab_size)  # [k, vocab]
    return _verify_rejection(target_probs, draft_probs, draft_tokens, params.seed, position)


def _verify_rejection(
    target_probs: torch.Tensor,  # [k + 1, vocab] float32
    draft_probs: torch.Tensor,  # [k, vocab] float64, exactly what the draft sampled from
    draft_tokens: list[int],
    seed: int,
    position: int,
) -> VerifyOutcome:
    num_drafted = len(draft_tokens)
    for j, token in enumerate(draft_tokens):
        target_prob, draft_prob = float(target_probs[j, token]), float(draft_probs[j, token])
        accept_prob = acceptance_probability(target_prob, draft_prob)
        if not rng.bernoulli(accept_prob, seed, position + j, Stream.ACCEPT):
            residual = residual_probs(target_probs[j], draft_probs[j])
            recovered = rng.sample_from_probs(residual, seed, position + j, Stream.RESAMPLE)
            return VerifyOutcome(position, num_drafted, j, recovered)
    # All accepted: the bonus is drawn exactly as plain decoding at that position would draw it.
    bonus = rng.sample_from_probs(
        target_probs[num_drafted], seed, position + num_drafted, Stream.RESAMPLE
    )
    return VerifyOutcome(position, num_drafted, num_drafted, bonus)


def _verify_gumbel(
    target_probs: torch.Tensor,  # [k + 1, vocab]
    draft_tokens: list[int],
    seed: int,
    position: int,
) -> VerifyOutcome:
    # The target's own Gumbel-max sample at each position decides; the draft only guesses it.
    # Rows after the first mismatch are never needed, so their noise is never drawn.
    num_drafted = len(draft_tokens)
    for j in range(num_drafted + 1):
        target_token = rng.gumbel_argmax(target_probs[j], seed, position + j)
        if j == num_drafted or draft_tokens[j] != target_token:
            return VerifyOutcome(position, num_drafted, j, target_token)
    raise AssertionError("unreachable: the loop returns at j == num_drafted")


def acceptance_probability(target_prob: float, draft_prob: float) -> float:
    """min(1, target_prob / draft_prob) in float64 (Leviathan et al. 2023, sec. 2.3).

    draft_prob > 0 is guaranteed by `check_block`: the draft sampled the token from it.
    """
    return min(1.0, target_prob / draft_prob)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, target_probs - draft_probs) as float64 [vocab], unnormalised (the sampler scales u
    by the total, so norm() is implicit).

    target_probs, draft_probs: [vocab]. The residual is all zero only when target_probs <=
    draft_probs everywhere, i.e. the two agree up to rounding; a rejection then has probability ~0
    but is still possible, and sampling from target_probs is the correct limit.
    """
    target_probs = target_probs.double()
    residual = (target_probs - draft_probs.to(target_probs.device, torch.float64)).clamp_min(0.0)
    if not bool((residual > 0).any()):
        return target_probs
    return residual


def dense_draft_probs(draft: DraftBlock, vocab_size: int) -> torch.Tensor:
    """Scatter the draft's sparse rows into float64 [k, vocab]; no sparse rows = point masses.

    The values are used as sent, never re-warped: they are the distribution the draft sampled from,
    and warping them again (top-p is not idempotent) would bias the output.
    """
    token_ids = draft.token_ids.to("cpu", torch.long)  # [k]
    k = token_ids.numel()
    dense = torch.zeros(k, vocab_size, dtype=torch.float64)
    if draft.draft_probs is None:
        return dense.scatter_(1, token_ids[:, None], 1.0)
    ids = draft.draft_prob_ids.to("cpu", torch.long)  # [k, m], -1 = padding
    probs = draft.draft_probs.to("cpu", torch.float64)  # [k, m]
    valid = ids >= 0
    return dense.scatter_add_(1, ids.clamp_min(0), torch.where(valid, probs, 0.0))


def drafted_token_probs(draft: DraftBlock) -> torch.Tensor:
    """Draft probability of each drafted token, float64 [k] (1.0 for point-mass drafts)."""
    token_ids = draft.token_ids.to("cpu", torch.long)  # [k]
    if draft.draft_probs is None:
        return torch.ones(token_ids.numel(), dtype=torch.float64)
    match = draft.draft_prob_ids.to("cpu", torch.long) == token_ids[:, None]  # [k, m]
    return torch.where(match, draft.draft_probs.to("cpu", torch.float64), 0.0).sum(dim=-1)


def check_block(target_logits: torch.Tensor, draft: DraftBlock) -> int:
    """Validate a block before verifying it; returns the vocabulary size.

    target_logits: [k + 1, vocab]. Engines may call it when a request arrives, so that one bad
    request is refused alone instead of failing the batch it would have joined.
    """
    k = draft.num_tokens
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k + 1, vocab] = [{k + 1}, vocab], "
                         f"got {tuple(target_logits.shape)}")
    vocab_size = int(target_logits.shape[1])
    if k and not bool(((draft.token_ids >= 0) & (draft.token_ids < vocab_size)).all()):
        raise InvalidArgument(f"draft token ids must be in [0, {vocab_size}), "
                              f"got {draft.token_ids.tolist()}")
    ids = draft.draft_prob_ids
    if ids is not None and ids.numel() and not bool(((ids >= -1) & (ids < vocab_size)).all()):
        raise InvalidArgument(f"draft_prob_ids must be in [0, {vocab_size}) or -1 (padding)")
    if k and not bool((drafted_token_probs(draft) > 0).all()):
        raise InvalidArgument(
            "every drafted token needs positive probability in the draft distribution sent with "
            f"it (the one it was sampled from); got {drafted_token_probs(draft).tolist()}"
        )
    return vocab_size


def _count_equal_prefix(draft_tokens: list[int], target_tokens: list[int]) -> int:
    num_accepted = 0
    for draft_token, target_token in zip(draft_tokens, target_tokens):
        if draft_token != target_token:
            break
        num_accepted += 1
    return num_accepted
