"""verify_batch gives outcome-for-outcome what the reference verify_block gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.sampling import rng
from specdec.sampling.batched import verify_batch
from specdec.sampling.draft import pack_sparse, sample_draft_token
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.verify import verify_block
from specdec.types import DraftBlock
from sampling_helpers import single_torch_thread  # noqa: F401 (autouse fixture)

VOCAB = 40
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.5, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.6),
    SamplingParams(temperature=1.0, mode=SamplingMode.GUMBEL),
    SamplingParams(temperature=0.7, top_p=0.9, mode=SamplingMode.GUMBEL),
]


def _random_session(generator: torch.Generator, index: int):
    """One session: target logits [k + 1, vocab], a draft of k tokens, params, position."""
    k = int(torch.randint(0, 6, (1,), generator=generator))
    base = PARAMS[index % len(PARAMS)]
    params = SamplingParams(base.temperature, base.top_k, base.top_p, seed=index * 7919,
                            mode=base.mode)
    position = int(torch.randint(0, 10_000, (1,), generator=generator))
    target_logits = torch.randn(k + 1, VOCAB, generator=generator) * 2
    draft_logits = target_logits[:k] + torch.randn(k, VOCAB, generator=generator)
    kind = index % 3  # full distribution, top-m, point mass
    drafted = [sample_draft_token(draft_logits[j], params, position + j, top_m=[0, 6, 0][kind])
               for j in range(k)]
    token_ids = torch.tensor([token for token, _, _ in drafted], dtype=torch.long)
    if kind == 2:
        return target_logits, DraftBlock(token_ids), params, position
    ids, probs = pack_sparse([(ids, probs) for _, ids, probs in drafted])
    return target_logits, DraftBlock(token_ids, ids, probs), params, position


def _sessions(count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [_random_session(generator, index) for index in range(count)]


def test_batched_equals_reference_on_many_mixed_sessions():
    sessions = _sessions(600, seed=0)
    reference = [verify_block(*session) for session in sessions]
    batched = verify_batch(*[list(column) for column in zip(*sessions)])
    assert batched == reference
    # The cases cover every branch: rejections, bonuses, empty drafts, and all three modes.
    assert any(o.num_accepted < o.num_drafted for o in reference)
    assert sum(o.is_bonus and o.num_drafted > 0 for o in reference) > 20
    assert any(o.num_drafted == 0 for o in reference)


def test_padded_logits_tensor_equals_list_input():
    sessions = _sessions(50, seed=1)
    longest = max(logits.shape[0] for logits, *_ in sessions)
    padded = torch.full((len(sessions), longest, VOCAB), float("nan"))  # padding is never read
    for i, (logits, *_) in enumerate(sessions):
        padded[i, : logits.shape[0]] = logits
    _, drafts, params, positions = (list(column) for column in zip(*sessions))
    assert verify_batch(padded, drafts, params, positions) == [verify_block(*s) for s in sessions]


def test_a_greedy_batch_is_verified_without_the_warp(monkeypatch):
    """Greedy verification reads the logits' argmax only: a batch of greedy sessions makes no
    vocabulary-wide softmax (7 ms a step at 16 rows of SmolLM2 on 2 vCPUs), and its outcomes are
    the reference's."""
    sessions = [s for s in _sessions(210, seed=2) if s[2].greedy]
    assert len(sessions) >= 20
    reference = [verify_block(*session) for session in sessions]

    def no_warp(*args, **kwargs):
        raise AssertionError("the warp was called")

    monkeypatch.setattr("specdec.sampling.batched.warp_rows", no_warp)
    assert verify_batch(*[list(column) for column in zip(*sessions)]) == reference
    mixed = _sessions(14, seed=3)
    with pytest.raises(AssertionError, match="the warp was called"):  # a sampled session needs it
        verify_batch(*[list(column) for column in zip(*mixed)])


def test_zero_residual_guard_agrees_with_the_reference(monkeypatch):
    # Draft probabilities a hair above the target's everywhere: every acceptance probability is
    # just below 1, so uniforms pinned near 1 reject, and every residual is all zero.
    near_one = 1.0 - 2.0**-53
    monkeypatch.setattr(rng, "uniform", lambda seed, position, stream: near_one)
    monkeypatch.setattr(rng, "uniforms",
                        lambda seed, positions, stream: np.full(len(positions), near_one))
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(9))
    target_probs = torch.softmax(logits, dim=-1)
    ids = torch.arange(VOCAB).repeat(2, 1)
    draft = DraftBlock(target_probs[:2].argmax(-1), ids, target_probs[:2] * (1 + 1e-6))
    reference = verify_block(logits, draft, params, 0)
    assert reference.num_accepted == 0
    assert verify_batch([logits], [draft], [params], [0]) == [reference]


def test_a_bad_session_is_named():
    sessions = _sessions(5, seed=2)
    _, _, params, position = sessions[3]
    sessions[3] = (torch.zeros(2, VOCAB), DraftBlock(torch.tensor([VOCAB])), params, position)
    with pytest.raises(InvalidArgument, match="session 3"):
        verify_batch(*[list(column) for column in zip(*sessions)])


def test_empty_batch():
    assert verify_batch([], [], [], []) == []
