"""Batched verification: many sessions, different k and parameters, one warp for all rows.

Same rule and same random numbers as the reference (`specdec.sampling.verify`), rearranged so that
the work is tensor-wide: one softmax over every target row of every session, every acceptance test
at once (counter-based randomness lets all uniforms be drawn up front, whether or not the reference
would have reached them), one inverse-CDF sample per session. Python loops run over sessions only
to gather their tensors, except in GUMBEL mode, whose vocabulary-sized noise is drawn per position
and only up to the first mismatch. tests/test_sampling_batched.py checks outcome-for-outcome
equality with the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.sampling import rng
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.rng import Stream
from specdec.sampling.warp import warp_rows
from specdec.types import DraftBlock, VerifyOutcome


@dataclass(frozen=True)
class _Batch:
    """All sessions' drafted tokens flattened; D = sum k_i drafted tokens, R = D + n target rows."""

    num_drafted: torch.Tensor  # [n] k_i
    first_row: torch.Tensor  # [n] index of session i's row 0 among the R target rows
    first_draft: torch.Tensor  # [n] index of session i's first drafted token among the D
    draft_session: torch.Tensor  # [D] session of each drafted token
    draft_index: torch.Tensor  # [D] its j within the block
    draft_row: torch.Tensor  # [D] the target row that verifies it
    tokens: torch.Tensor  # [D] int64 drafted token ids
    sparse_ids: torch.Tensor  # [D, M] int64 draft distribution ids, -1 = padding
    sparse_probs: torch.Tensor  # [D, M] float64 draft distribution values


def verify_batch(
    target_logits: Sequence[torch.Tensor] | torch.Tensor,  # n x [k_i + 1, vocab] or padded
    #                                                       [n, K + 1, vocab], K = max k_i
    drafts: Sequence[DraftBlock],
    params: Sequence[SamplingParams],
    positions: Sequence[int],
) -> list[VerifyOutcome]:
    """`verify_block` for n sessions; positions[i] is session i's first drafted position."""
    n = len(drafts)
    if not len(target_logits) == len(params) == len(positions) == n:
        raise ValueError("target_logits, drafts, params and positions need one entry per session")
    if n == 0:
        return []
    batch = _gather(drafts)
    num_drafted = batch.num_drafted.tolist()
    session_rows = [target_logits[i][: num_drafted[i] + 1] for i in range(n)]
    if [rows.shape[0] for rows in session_rows] != [k + 1 for k in num_drafted]:
        raise ValueError("each session needs k + 1 rows of target logits")
    flat_logits = torch.cat(session_rows)  # [R, vocab]
    _validate(batch, int(flat_logits.shape[-1]))
    greedy = [request.greedy for request in params]
    # Greedy sessions are verified on the logits' argmax alone; the warp, a softmax over every row's
    # vocabulary, serves the sampling modes. Made for greedy rows too, it cost 16 greedy rows on
    # 2 vCPUs 7 ms a step on top of a 110 ms forward (SmolLM2's 49,152 tokens), where a decode
    # step takes the argmax only: the hosted draft's plain rows are verifies of nothing (round 53).
    target_probs = None
    if not all(greedy):
        row_params = [request for request, k in zip(params, num_drafted) for _ in range(k + 1)]
        target_probs = warp_rows(flat_logits, row_params)  # [R, vocab] float32

    num_accepted = torch.zeros(n, dtype=torch.long)
    next_token = torch.zeros(n, dtype=torch.long)
    rejection = [not request.greedy and request.mode is SamplingMode.REJECTION
                 for request in params]
    if any(greedy):
        accepted_g, next_g = _verify_greedy(flat_logits, batch)
        _fill(num_accepted, greedy, accepted_g)
        _fill(next_token, greedy, next_g)
    if any(rejection):
        accepted_r, next_r = _verify_rejection(target_probs, batch, params, positions, rejection)
        _fill(num_accepted, rejection, accepted_r)
        _fill(next_token, rejection, next_r)
    for i in [i for i in range(n) if not greedy[i] and not rejection[i]]:
        first = int(batch.first_row[i])
        rows = target_probs[first: first + num_drafted[i] + 1]
        num_accepted[i], next_token[i] = _verify_gumbel(rows, drafts[i], params[i].seed,
                                                        positions[i])
    return [VerifyOutcome(int(position), k, accepted, token) for position, k, accepted, token
            in zip(positions, num_drafted, num_accepted.tolist(), next_token.tolist())]


def _verify_greedy(
    flat_logits: torch.Tensor,  # [R, vocab]
    batch: _Batch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the drafted token is the target's argmax; emit the argmax after that."""
    target_argmax = flat_logits.argmax(dim=-1).cpu()  # [R]
    num_accepted = _accepted_prefix(batch.tokens == target_argmax[batch.draft_row], batch)
    return num_accepted, target_argmax[batch.first_row + num_accepted]


def _verify_rejection(
    target_probs: torch.Tensor,  # [R, vocab] float32
    batch: _Batch,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    selected: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. 2023 Algorithm 1 for every session at once; returns num_accepted [n] and
    next_token [n], meaningful for the `selected` sessions."""
    seeds = np.array([request.seed for request in params], dtype=np.uint64)  # [n]
    start = np.asarray(positions, dtype=np.int64)  # [n]
    session = batch.draft_session.numpy()
    # Acceptance test of every drafted token: uniform < min(1, target_prob / draft_prob).
    device = target_probs.device
    target_prob = target_probs[batch.draft_row.to(device), batch.tokens.to(device)].cpu()
    draft_prob = _drafted_token_probs(batch)  # [D] float64
    accept_prob = torch.clamp(target_prob.double() / draft_prob, max=1.0)
    u = rng.uniforms(seeds[session], start[session] + batch.draft_index.numpy(), Stream.ACCEPT)
    num_accepted = _accepted_prefix(torch.from_numpy(u) < accept_prob, batch)

    # One sample per selected session: from the residual at the first rejection, else the bonus.
    chosen = torch.nonzero(torch.tensor(selected))[:, 0]  # [s]
    rows = (batch.first_row + num_accepted)[chosen]
    # Vocabulary-sized rows stay on the logits' device; only ids, uniforms and tokens travel.
    weights = target_probs[rows.to(device)].double()  # [s, vocab]
    rejected = (num_accepted < batch.num_drafted)[chosen]  # [s]
    if bool(rejected.any()):
        draft_rows = (batch.first_draft + num_accepted)[chosen[rejected]]
        ids = batch.sparse_ids[draft_rows]  # [r, M]
        values = torch.where(ids >= 0, batch.sparse_probs[draft_rows], 0.0)  # [r, M]
        dense = torch.zeros(len(draft_rows), weights.shape[-1], dtype=torch.float64, device=device)
        dense.scatter_add_(1, ids.clamp_min(0).to(device), values.to(device))
        on_device = rejected.to(device)
        residual = (weights[on_device] - dense).clamp_min(0.0)
        # Same guard as verify.residual_probs: an all-zero residual means target == draft.
        empty = ~(residual > 0).any(dim=-1, keepdim=True)
        weights[on_device] = torch.where(empty, weights[on_device], residual)
    sample_positions = start[chosen.numpy()] + num_accepted[chosen].numpy()
    next_token = torch.zeros(len(params), dtype=torch.long)
    next_token[chosen] = rng.sample_rows(weights, seeds[chosen.numpy()], sample_positions,
                                         Stream.RESAMPLE)
    return num_accepted, next_token


def _verify_gumbel(
    target_probs: torch.Tensor,  # [k + 1, vocab]
    draft: DraftBlock,
    seed: int,
    position: int,
) -> tuple[int, int]:
    # Per position by necessity: the noise is vocabulary-sized and keyed on the position, and rows
    # after the first mismatch are skipped (most of the cost at a large vocabulary).
    draft_tokens = draft.token_ids.tolist()
    for j in range(len(draft_tokens) + 1):
        target_token = rng.gumbel_argmax(target_probs[j], seed, position + j)
        if j == len(draft_tokens) or draft_tokens[j] != target_token:
            return j, target_token
    raise AssertionError("unreachable: the loop returns at j == k")


def _gather(drafts: Sequence[DraftBlock]) -> _Batch:
    """Flatten every session's drafted tokens and sparse rows (point masses made explicit)."""
    num_drafted = torch.tensor([d.token_ids.numel() for d in drafts], dtype=torch.long)
    first_row = torch.cumsum(num_drafted + 1, 0) - (num_drafted + 1)
    first_draft = torch.cumsum(num_drafted, 0) - num_drafted
    draft_session = torch.repeat_interleave(torch.arange(len(drafts)), num_drafted)
    draft_index = torch.arange(int(num_drafted.sum())) - first_draft[draft_session]
    tokens = torch.cat([d.token_ids.to("cpu", torch.long) for d in drafts])  # [D]
    sparse = [(d.token_ids.to("cpu", torch.long)[:, None], torch.ones(d.num_tokens, 1))
              if d.draft_probs is None else (d.draft_prob_ids.cpu(), d.draft_probs.cpu())
              for d in drafts]
    width = max(ids.shape[1] for ids, _ in sparse)
    sparse = [(ids, probs) if ids.shape[1] == width else
              (_pad_columns(ids, width, -1), _pad_columns(probs, width, 0.0))
              for ids, probs in sparse]
    sparse_ids = torch.cat([ids.long() for ids, _ in sparse])  # [D, M]
    sparse_probs = torch.cat([probs for _, probs in sparse]).double()  # [D, M], cat promotes
    return _Batch(num_drafted, first_row, first_draft, draft_session, draft_index,
                  first_row[draft_session] + draft_index, tokens, sparse_ids, sparse_probs)


def _pad_columns(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, width - values.shape[1]), value=fill)


def _drafted_token_probs(batch: _Batch) -> torch.Tensor:
    """Draft probability of each drafted token, float64 [D] (as verify.drafted_token_probs)."""
    match = batch.sparse_ids == batch.tokens[:, None]  # [D, M]
    return torch.where(match, batch.sparse_probs, 0.0).sum(dim=-1)


def _validate(batch: _Batch, vocab_size: int) -> None:
    """The checks of verify.check_block, for all sessions at once; names the offending session."""
    bad_token = (batch.tokens < 0) | (batch.tokens >= vocab_size)
    bad_ids = ((batch.sparse_ids < -1) | (batch.sparse_ids >= vocab_size)).any(dim=-1)
    no_mass = ~(_drafted_token_probs(batch) > 0)
    for bad, what in ((bad_token, f"draft token ids must be in [0, {vocab_size})"),
                      (bad_ids, f"draft_prob_ids must be in [0, {vocab_size}) or -1 (padding)"),
                      (no_mass, "every drafted token needs positive probability in the draft "
                                "distribution sent with it (the one it was sampled from)")):
        if bool(bad.any()):
            session = int(batch.draft_session[torch.nonzero(bad)[0, 0]])
            raise InvalidArgument(f"session {session} of the batch: {what}")


def _accepted_prefix(accepted: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """Per session, how many drafted tokens are accepted before the first rejection.

    accepted: [D] bool. Returns [n] int64. Scattered into a [n, K] grid padded with False so a
    cumulative product stops at the first rejection or at the end of a shorter block.
    """
    width = max(int(batch.num_drafted.max()), 1)
    grid = torch.zeros(batch.num_drafted.numel(), width, dtype=torch.long)
    grid[batch.draft_session, batch.draft_index] = accepted.long()
    return grid.cumprod(dim=1).sum(dim=1)


def _fill(out: torch.Tensor, selected: list[bool], values: torch.Tensor) -> None:
    mask = torch.tensor(selected)
    out[mask] = values.to(out.dtype)[mask]
