"""Engine contracts: positions, idempotent truncate, accept/rollback on the draft, bad input."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.errors import (
    CacheFull,
    ContextOverflow,
    EpochMismatch,
    InvalidArgument,
    PositionMismatch,
    SessionExists,
    SessionNotFound,
)
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from specdec.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("t") / "target", vocab_size=256, seed=0)


def engine(path, slots=4, ctx=64):
    return TargetEngine(load_model(path, backend="native", num_slots=slots, max_context=ctx))


def test_positions_are_checked_and_retries_are_harmless(tiny_target):
    target = engine(tiny_target)
    position, first = target.start_session("a", [1, 2, 3], GREEDY)
    assert position == 4 and first is not None
    with pytest.raises(PositionMismatch) as err:
        target.decode("a", 3, 1)
    assert err.value.actual == 4
    draft = DraftBlock(token_ids=torch.tensor([5, 6]))
    outcome = target.verify("a", 4, draft)
    with pytest.raises(PositionMismatch):  # the same verify again is detected, not applied twice
        target.verify("a", 4, draft)
    assert len(target.committed_tokens("a")) == 4 + outcome.num_accepted + 1


def test_truncate_is_idempotent_and_rolls_back_the_cache(tiny_target):
    target = engine(tiny_target)
    target.start_session("a", [1, 2, 3], GREEDY)
    tokens = target.decode("a", 4, 6)
    assert target.truncate("a", 6) == 6
    assert target.truncate("a", 6) == 6
    assert target.decode("a", 6, 4) == tokens[2:6]  # greedy: the same continuation again
    assert target.truncate("a", 99) == 10  # never grows
    # A verify right after a truncate re-feeds the last committed token to score the first draft.
    assert target.truncate("a", 8) == 8
    assert target.verify("a", 8, DraftBlock(token_ids=torch.tensor(tokens[4:6]))).num_accepted == 2
    with pytest.raises(InvalidArgument):
        target.truncate("a", 0)


def test_bad_input_leaves_sessions_intact(tiny_target):
    target = engine(tiny_target, ctx=16)
    target.start_session("a", [1, 2, 3], GREEDY)
    before = target.committed_tokens("a")
    with pytest.raises(SessionExists):
        target.start_session("a", [1], GREEDY)
    with pytest.raises(SessionNotFound):
        target.decode("missing", 1, 1)
    with pytest.raises(InvalidArgument):
        target.start_session("b", [], GREEDY)
    with pytest.raises(InvalidArgument):
        target.start_session("b", [1, 9999], GREEDY)
    with pytest.raises(ContextOverflow):
        target.start_session("b", list(range(16)), GREEDY)
    with pytest.raises(ContextOverflow):
        target.decode("a", 4, 100)
    with pytest.raises(InvalidArgument):
        target.start_session("b", [1], SamplingParams(top_p=0.0))
    assert target.committed_tokens("a") == before
    assert "b" not in [s.session_id for s in target.sessions]
    assert len(target.decode("a", 4, 2)) == 2


def test_cache_full_only_when_every_session_is_in_use(tiny_target):
    target = engine(tiny_target, slots=1)
    target.start_session("a", [1, 2], GREEDY)
    target.start_session("b", [3, 4], GREEDY)  # evicts a's slot: a is idle
    assert target.evictions == 1
    state = target.sessions.get("b")
    state.in_use += 1  # b is mid-call: nothing can be evicted for c
    with pytest.raises(CacheFull):
        target.start_session("c", [5], GREEDY)
    state.in_use -= 1
    assert "c" not in [s.session_id for s in target.sessions]


def test_draft_accept_and_rollback(tiny_target):
    model = load_model(tiny_target, backend="native", num_slots=2, max_context=64)
    draft = DraftEngine(DraftModelProposer(model))
    draft.start_session("a", [1, 2, 3], GREEDY)
    p1 = draft.propose("a", 3, [], 4)
    assert p1.position == 3 and p1.block.num_tokens == 4 and p1.epoch == 1
    tokens = p1.block.token_ids.tolist()
    # Target accepted 2 and recovered token 7: keep 3 + 2, append 7.
    p2 = draft.propose("a", 5, [7], 3, parent_epoch=1)
    assert p2.position == 6
    # A greedy draft is deterministic: the same prefix gives the same proposal as a fresh session.
    draft.start_session("b", [1, 2, 3] + tokens[:2] + [7], GREEDY)
    assert draft.propose("b", 6, [], 3).block.token_ids.tolist() == p2.block.token_ids.tolist()
    with pytest.raises(EpochMismatch):
        draft.propose("a", 6, [], 2, parent_epoch=1)
    with pytest.raises(PositionMismatch):  # keeping a token never drafted means a lost message
        draft.propose("a", 99, [], 2)
    with pytest.raises(InvalidArgument):
        draft.propose("a", 6, [], 999)


def test_ngram_proposer_looks_up_the_latest_match():
    proposer = NgramProposer(max_ngram=2)
    block = proposer.propose(None, [4, 5, 6, 7, 9, 4, 5, 6, 8, 1, 5, 6], 3, GREEDY)
    assert block.token_ids.tolist() == [8, 1, 5]  # latest "5 6" is followed by 8 1 5
    assert proposer.propose(None, [1, 2, 3], 3, GREEDY).num_tokens == 0
