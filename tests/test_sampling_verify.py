"""verify_block and sample_next on hand-built logits, determinism, guards and validation."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.sampling import rng, verify
from specdec.sampling.draft import pack_sparse
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.verify import residual_probs, sample_next, verify_block
from specdec.types import DraftBlock
from sampling_helpers import single_torch_thread  # noqa: F401 (autouse fixture)

VOCAB = 6
EOS = 5
SAMPLED = SamplingParams(temperature=1.0, seed=17)
MODES = [
    SamplingParams(temperature=1.0, seed=17),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=17),
    SamplingParams(temperature=1.0, seed=17, mode=SamplingMode.GUMBEL),
]


def certain(*tokens: int) -> torch.Tensor:
    """Target rows that put all mass on one token each (+10 there, -inf elsewhere): [len, vocab]."""
    logits = torch.full((len(tokens), VOCAB), float("-inf"))
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def uncertain(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def sparse_draft(tokens: list[int], rows: list[dict[int, float]] | None = None) -> DraftBlock:
    """A DraftBlock; rows gives each token's draft distribution, point masses when omitted."""
    token_ids = torch.tensor(tokens, dtype=torch.long)
    if rows is None:
        return DraftBlock(token_ids)
    ids, probs = pack_sparse([(torch.tensor(list(row)), torch.tensor(list(row.values())))
                              for row in rows])
    return DraftBlock(token_ids, ids, probs)


@pytest.mark.parametrize("params", MODES, ids=["rejection", "top-k-top-p", "gumbel"])
def test_accept_all_then_bonus(params):
    draft = sparse_draft([3, 1], [{3: 0.6, 2: 0.4}, {1: 1.0}])
    outcome = verify_block(certain(3, 1, 4), draft, params, position=10)
    assert (outcome.num_drafted, outcome.num_accepted, outcome.next_token) == (2, 2, 4)
    assert outcome.is_bonus and outcome.num_committed == 3 and outcome.position == 10


@pytest.mark.parametrize("params", MODES, ids=["rejection", "top-k-top-p", "gumbel"])
def test_early_mismatch_emits_the_recovered_token(params):
    outcome = verify_block(certain(3, 1, 4), sparse_draft([3, 2]), params, position=10)
    assert (outcome.num_accepted, outcome.next_token, outcome.is_bonus) == (1, 1, False)
    outcome = verify_block(certain(3, 1, 4), sparse_draft([0, 1]), params, position=10)
    assert (outcome.num_accepted, outcome.next_token) == (0, 3)


@pytest.mark.parametrize("params", MODES + [SamplingParams()], ids=["rejection", "top-k-top-p",
                                                                      "gumbel", "greedy"])
def test_empty_draft_is_plain_decoding(params):
    for position in range(30):
        logits = uncertain(position)
        outcome = verify_block(logits, DraftBlock.empty(), params, position)
        assert (outcome.num_drafted, outcome.num_accepted) == (0, 0)
        assert outcome.next_token == sample_next(logits[0], params, position)


def test_eos_inside_the_draft_is_just_a_token():
    # Stopping at EOS is the generation loop's job; verification accepts past it like any token.
    outcome = verify_block(certain(EOS, 2, 0), sparse_draft([EOS, 2]), SAMPLED, position=4)
    assert (outcome.num_accepted, outcome.next_token) == (2, 0)
    outcome = verify_block(certain(2, EOS, 1), sparse_draft([2, 3]), SAMPLED, position=4)
    assert (outcome.num_accepted, outcome.next_token) == (1, EOS)


def test_greedy_accepts_while_equal_to_the_argmax():
    logits = uncertain(5, rows=4) + torch.eye(VOCAB)[[2, 0, 4, 1]] * 20  # argmaxes 2, 0, 4, 1
    greedy = SamplingParams(temperature=0.0, seed=3)
    assert verify_block(logits, sparse_draft([2, 0, 4]), greedy, 0).num_accepted == 3
    assert verify_block(logits, sparse_draft([2, 0, 4]), greedy, 0).next_token == 1
    outcome = verify_block(logits, sparse_draft([2, 0, 3]), greedy, 0)
    assert (outcome.num_accepted, outcome.next_token) == (2, 4)
    tie = torch.tensor([[1.0, 5.0, 5.0, 0.0, 0.0, 0.0]] * 2)  # ties go to the lowest id
    assert verify_block(tie, sparse_draft([2]), greedy, 0).num_accepted == 0
    assert verify_block(tie, sparse_draft([2]), greedy, 0).next_token == 1


@pytest.mark.parametrize("params", MODES, ids=["rejection", "top-k-top-p", "gumbel"])
def test_bonus_and_recovered_tokens_equal_plain_decoding_at_their_position(params):
    for seed in range(40):
        params_seed = SamplingParams(params.temperature, params.top_k, params.top_p, seed,
                                     params.mode)
        last = uncertain(seed)
        bonus = verify_block(torch.cat([certain(1, 2), last]), sparse_draft([1, 2]), params_seed,
                             position=50)
        assert bonus.next_token == sample_next(last[0], params_seed, 52)
        # Drafting a token the target gives no mass is rejected for sure; the residual is then
        # the target distribution itself, so the recovered token is plain decoding at 51.
        middle = uncertain(seed + 1000)
        middle[0, 4] = float("-inf")
        recovered = verify_block(torch.cat([certain(1), middle, certain(0)]),
                                 sparse_draft([1, 4]), params_seed, position=50)
        assert (recovered.num_accepted, recovered.next_token) == (1, sample_next(middle[0],
                                                                                params_seed, 51))


def _random_block(seed: int, k: int = 3):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, VOCAB, generator=generator)
    tokens = torch.randint(0, VOCAB, (k,), generator=generator).tolist()
    rows = [{t: 0.5, (t + 1) % VOCAB: 0.5} for t in tokens]
    return logits, sparse_draft(tokens, rows)


@pytest.mark.parametrize("params", MODES, ids=["rejection", "top-k-top-p", "gumbel"])
def test_same_seed_and_position_give_the_same_outcome(params):
    logits, draft = _random_block(0)
    first = verify_block(logits, draft, params, 100)
    retry = verify_block(logits.clone(), sparse_draft(draft.token_ids.tolist(),
                         [{t: 0.5, (t + 1) % VOCAB: 0.5} for t in draft.token_ids.tolist()]),
                         params, 100)
    assert retry == first
    by_seed = set()
    for seed in range(40):
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, seed, params.mode)
        outcome = verify_block(logits, draft, seeded, 100)
        by_seed.add((outcome.num_accepted, outcome.next_token))
    assert len(by_seed) > 2  # different seeds draw different numbers
    by_position = {verify_block(logits, draft, params, position).next_token
                   for position in range(100, 140)}
    assert len(by_position) > 1  # so do different positions


def test_all_zero_residual_falls_back_to_target_probs(monkeypatch):
    target_probs = torch.tensor([0.5, 0.5, 0.0])
    assert torch.equal(residual_probs(target_probs, target_probs + 1e-7), target_probs.double())
    # Force the (numerically possible, practically never seen) rejection of an identical draft.
    monkeypatch.setattr(rng, "bernoulli", lambda prob, seed, position, stream: False)
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]))
    draft = sparse_draft([0], [{0: 0.5, 1: 0.5}])
    outcome = verify_block(logits, draft, SAMPLED, 0)
    assert outcome.num_accepted == 0 and outcome.next_token in (0, 1)


def test_draft_probs_are_used_as_sent_never_rewarped(monkeypatch):
    seen = []
    monkeypatch.setattr(rng, "bernoulli", lambda prob, *args: seen.append(prob) or True)
    params = SamplingParams(temperature=0.5, top_p=0.5, seed=1)
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.1, 0.4], [0.25] * 4]))
    draft = sparse_draft([2], [{0: 0.4, 1: 0.35, 2: 0.25}])
    verify_block(logits, draft, params, 0)
    target_probs = verify.warp_logits(logits[0], params)
    assert seen == [min(1.0, float(target_probs[2]) / 0.25)]  # 0.25 as sent: top-p would drop it


def test_low_precision_logits_verify_like_float32():
    logits, draft = _random_block(3)
    for params in MODES:
        assert verify_block(logits.bfloat16(), draft, params, 7) == verify_block(
            logits.bfloat16().float(), draft, params, 7)


def test_invalid_blocks_are_refused_with_what_is_allowed():
    logits = certain(1, 2)
    with pytest.raises(InvalidArgument, match=r"in \[0, 6\)"):
        verify_block(logits, sparse_draft([VOCAB]), SAMPLED, 0)
    with pytest.raises(InvalidArgument, match="positive probability"):
        verify_block(logits, sparse_draft([1], [{0: 1.0}]), SAMPLED, 0)
    with pytest.raises(InvalidArgument, match="draft_prob_ids"):
        ids = torch.tensor([[1, VOCAB]])
        verify_block(logits, DraftBlock(torch.tensor([1]), ids, torch.tensor([[0.5, 0.5]])),
                     SAMPLED, 0)
    with pytest.raises(ValueError, match=r"\[k \+ 1, vocab\]"):
        verify_block(certain(1), sparse_draft([1]), SAMPLED, 0)
