"""The draft model copying from the session's text where it is unsure (specdec.proposers.copy_guess):
the n-gram index, and what DraftModelProposer sends when it copies. Lossless by exact enumeration:
tests/test_sampling_exact.py; token for token through the loop: tests/test_engine_loop.py."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.models.loader import load_model
from specdec.proposers.copy_guess import CopyIndex, CopyRule
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingParams
from specdec.testing.tiny_models import make_tiny_model

CYCLE = [11, 12, 13, 14]
PROMPT = CYCLE * 2 + CYCLE[:2]  # ... 11 12: an earlier (11, 12) was followed by 13


def test_the_index_guesses_what_followed_the_latest_earlier_occurrence():
    index = CopyIndex(2)
    index.sync([5, 6, 7, 5, 6, 8, 5, 6])
    assert index.guess([5, 6]) == 8  # the latest occurrence with a continuation, not the first
    assert index.guess([6, 8]) == 5
    assert index.guess([9, 9]) is None and index.guess([6]) is None
    index.sync([5, 6, 7, 5, 6, 8, 5, 6, 9])  # an extension: indexed incrementally
    assert index.guess([5, 6]) == 9
    index.sync([1, 2, 3])  # not an extension (a rollback into committed text, a new state): rebuilt
    assert index.tokens == [1, 2, 3] and index.guess([1, 2]) == 3 and index.guess([5, 6]) is None


@pytest.mark.parametrize("below, ngram", [(-0.1, 3), (1.5, 3), (float("nan"), 3), (0.5, 0)])
def test_a_copy_rule_out_of_range_is_refused(below, ngram):
    with pytest.raises(InvalidArgument):
        CopyRule(below=below, ngram=ngram)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("copy") / "draft", variant="llama", vocab_size=64, seed=3)
    return load_model(path, backend="native", num_slots=4, max_context=128)


def test_an_unsure_draft_copies_the_repeated_span_as_point_masses(random_draft):
    rule = CopyRule(below=1.0, ngram=2)  # a random draft is always unsure: copy wherever possible
    proposer = DraftModelProposer(random_draft, top_m=0, copy=rule)
    sampled = SamplingParams(temperature=1.0, seed=1)
    for params in (SamplingParams(), sampled):
        state = proposer.open("s")
        block = proposer.propose(state, PROMPT, 5, params)
        assert block.token_ids.tolist() == [13, 14, 11, 12, 13]  # drafted tokens extend the matched n-gram
        assert block.confidences == (rule.confidence,) * 5
        if not params.greedy:  # each copied token is sent as the point mass it was drawn from
            assert block.draft_prob_ids[:, 0].tolist() == [13, 14, 11, 12, 13]
            assert torch.all(block.draft_probs[:, 0] == 1.0) and torch.all(block.draft_probs[:, 1:] == 0)
        proposer.close(state)
    never = DraftModelProposer(random_draft, top_m=0, copy=CopyRule(below=0.0))
    assert never.copy is None
    state = never.open("s")
    assert never.propose(state, PROMPT, 5, SamplingParams()).token_ids.tolist() != [13, 14, 11, 12, 13]
    never.close(state)


def test_a_sure_draft_keeps_its_own_tokens_and_batches_draft_as_one(random_draft):
    """Below a threshold no random draft reaches, nothing is copied; a batch of sessions drafts what
    each drafts alone, copying or not."""
    plain = DraftModelProposer(random_draft, top_m=0)
    unsure_only = DraftModelProposer(random_draft, top_m=0, copy=CopyRule(below=1e-6, ngram=2))
    copying = DraftModelProposer(random_draft, top_m=0, copy=CopyRule(below=1.0, ngram=2))
    other = [3, 9, 27, 17, 3, 9]
    greedy = SamplingParams()
    drafted = {}
    for name, proposer in (("plain", plain), ("unsure_only", unsure_only), ("copying", copying)):
        alone = []
        for prompt in (PROMPT, other):
            state = proposer.open("alone")
            alone.append(proposer.propose(state, prompt, 4, greedy).token_ids.tolist())
            proposer.close(state)
        states = [proposer.open("a"), proposer.open("b")]
        together = proposer.propose_batch([(states[0], PROMPT, 4, greedy), (states[1], other, 4, greedy)])
        assert [b.token_ids.tolist() for b in together] == alone, name
        for state in states:
            proposer.close(state)
        drafted[name] = alone
    assert drafted["unsure_only"] == drafted["plain"]
    assert drafted["copying"][1][:1] == [27] != drafted["plain"][1][:1]  # (3, 9) was followed by 27


def test_the_evaluation_scores_the_copy_rule_as_the_proposer_applies_it():
    """specdec distill evaluate --copy-below: teacher-forced, each answer position where the draft is
    unsure takes the token that followed the preceding n-gram's latest earlier occurrence."""
    import numpy as np

    from specdec.distill.data import Record
    from specdec.distill.evaluate import _with_copy

    tokens = np.array(PROMPT + [13, 14, 7, 8])  # the answer repeats the cycle, then leaves it
    record = Record(tokens, len(PROMPT), "qa", "eval")
    pred = torch.full((4,), 99)
    unsure, sure = torch.full((4,), 0.2), torch.tensor([0.2, 0.9, 0.2, 0.2])
    rule = CopyRule(below=0.5, ngram=2)
    assert _with_copy(pred, unsure, rule, record).tolist() == [13, 14, 11, 99]  # (14, 7) never occurred before
    assert _with_copy(pred, sure, rule, record).tolist() == [13, 99, 11, 99]
