"""Draft-side sampling: the token comes from exactly the (sparse) distribution that is sent."""

from __future__ import annotations

import torch

from specdec.sampling import rng
from specdec.sampling.draft import pack_sparse, sample_draft_token
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.rng import Stream
from specdec.sampling.verify import sample_next
from specdec.sampling.warp import warp_logits
from specdec.types import DraftBlock
from sampling_helpers import single_torch_thread  # noqa: F401 (autouse fixture)

LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, 1.9, -3.0, 0.2])


def test_greedy_draft_is_a_point_mass_on_the_argmax():
    token, ids, probs = sample_draft_token(LOGITS, SamplingParams(), position=3)
    assert token == 1 and ids.tolist() == [1] and probs.tolist() == [1.0]


def test_rejection_draft_samples_its_sparse_rows_with_the_draft_stream():
    params = SamplingParams(temperature=0.9, top_k=5, seed=4)
    for position in range(50):
        token, ids, probs = sample_draft_token(LOGITS, params, position)
        assert token == int(ids[rng.sample_from_probs(probs, 4, position, Stream.DRAFT)])
        dense = torch.zeros(8).scatter_(0, ids, probs)
        assert torch.equal(dense, warp_logits(LOGITS, params))  # the full warp, unchanged
        assert sample_draft_token(LOGITS, params, position)[0] == token  # reproducible


def test_top_m_keeps_the_most_probable_and_renormalises():
    params = SamplingParams(temperature=1.0, seed=2)
    full = warp_logits(LOGITS, params)
    for position in range(30):
        token, ids, probs = sample_draft_token(LOGITS, params, position, top_m=3)
        assert sorted(ids.tolist()) == [1, 3, 5] and token in (1, 3, 5)
        torch.testing.assert_close(probs, full[ids] / full[ids].sum())
        assert abs(float(probs.sum()) - 1.0) < 1e-6


def test_top_m_wider_than_the_support_changes_nothing():
    params = SamplingParams(temperature=1.0, top_k=2, seed=2)
    token, ids, probs = sample_draft_token(LOGITS, params, 0, top_m=5)
    assert sorted(ids.tolist()) == [1, 5]  # zero-mass tokens are never sent
    assert torch.equal(probs, warp_logits(LOGITS, params)[ids])


def test_gumbel_draft_uses_the_targets_noise():
    # An exact draft in GUMBEL mode guesses the target's own token every time.
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=8, mode=SamplingMode.GUMBEL)
    for position in range(50):
        logits = torch.randn(8, generator=torch.Generator().manual_seed(position))
        assert sample_draft_token(logits, params, position)[0] == sample_next(logits, params,
                                                                             position)
    token, ids, probs = sample_draft_token(LOGITS, params, 5, top_m=2)
    assert token in ids.tolist()


def test_pack_sparse_pads_with_minus_one_and_zero():
    ids, probs = pack_sparse([(torch.tensor([4, 1]), torch.tensor([0.75, 0.25])),
                              (torch.tensor([2]), torch.tensor([1.0]))])
    assert ids.tolist() == [[4, 1], [2, -1]] and probs.tolist() == [[0.75, 0.25], [1.0, 0.0]]
    assert ids.dtype == torch.long and probs.dtype == torch.float32
    DraftBlock(torch.tensor([4, 2]), ids, probs)  # the shape DraftBlock expects
    empty_ids, empty_probs = pack_sparse([])
    assert empty_ids.shape == (0, 0) and empty_probs.shape == (0, 0)
    DraftBlock(torch.empty(0, dtype=torch.long), empty_ids, empty_probs)
