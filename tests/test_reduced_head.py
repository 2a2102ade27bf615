"""A draft with a reduced output head (its most frequent tokens only) stays lossless."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.models.loader import load_model
from specdec.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    target = make_tiny_model(root / "target", vocab_size=256, seed=0)
    draft = make_tiny_model(root / "draft", vocab_size=256, seed=0)  # identical weights: easy to check
    order = torch.randperm(256, generator=torch.Generator().manual_seed(3)).tolist()
    (draft / "head_vocab.json").write_text(json.dumps({"token_ids": order}))
    return {"target": target, "draft": draft, "order": order}


def test_reduced_head_scores_exactly_the_listed_rows(dirs):
    full = load_model(dirs["draft"], num_slots=1)
    reduced = load_model(dirs["draft"], num_slots=1, head_vocab=64)
    tokens = [[1, 2, 3, 4]]
    slot_a, slot_b = full.allocate(), reduced.allocate()
    logits_full = full.forward([slot_a], tokens)[0]  # [4, 256]
    logits_reduced = reduced.forward([slot_b], tokens)[0]  # [4, 64]
    head = torch.tensor(dirs["order"][:64])
    torch.testing.assert_close(logits_reduced, logits_full[:, head], rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgument):
        load_model(dirs["target"], head_vocab=8)  # no head_vocab.json


@pytest.mark.parametrize("head_vocab", [16, 200])
def test_speculation_with_a_reduced_head_equals_plain_decoding(dirs, head_vocab):
    from test_engine_loop import run, target_engine

    from specdec.engine.draft import DraftEngine
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.sampling.params import SamplingMode, SamplingParams

    target = target_engine(dirs["target"])
    draft = DraftEngine(DraftModelProposer(load_model(dirs["draft"], num_slots=2, max_context=256,
                                                      head_vocab=head_vocab)))
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=4, mode=SamplingMode.GUMBEL)):
        plain = run(target, None, [1, 5, 9, 12], params, max_new_tokens=30)
        spec = run(target, draft, [1, 5, 9, 12], params, max_new_tokens=30)
        assert spec.token_ids == plain.token_ids


def test_extra_head_ids_score_exactly_those_rows_beside_the_reduced_head(dirs):
    full = load_model(dirs["draft"], num_slots=1)
    reduced = load_model(dirs["draft"], num_slots=1, head_vocab=32)
    tokens = [[7, 8, 9]]
    slot_a, slot_b = full.allocate(), reduced.allocate()
    logits_full = full.forward([slot_a], tokens, [2])[0]  # [2, 256]
    extra = torch.tensor(dirs["order"][200:205])
    logits = reduced.forward([slot_b], tokens, [2], extra_head_ids=[extra])[0]  # [2, 32 + 5]
    columns = torch.cat((torch.tensor(dirs["order"][:32]), extra))
    torch.testing.assert_close(logits, logits_full[:, columns], rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgument):
        full.forward([slot_a], [[1]], [1], extra_head_ids=[extra])  # a full head has no extra rows


def test_forward_packed_gives_the_rows_logits_in_one_tensor_and_the_hidden_states_behind_them(dirs):
    """What the draft proposer's batched steps read: forward()'s rows concatenated, and final hidden
    states that score a row's extra ids as forward(extra_head_ids=...) does."""
    models = [load_model(dirs["draft"], num_slots=2, head_vocab=32) for _ in range(2)]
    tokens, num_logits = [[7, 8, 9], [3, 4]], [2, 1]
    extra = torch.tensor(dirs["order"][200:205])
    for model in models:
        model.allocate(), model.allocate()
    logits, hidden = models[0].forward_packed([1, 0], tokens, num_logits)
    rows = models[1].forward([1, 0], tokens, num_logits, extra_head_ids=[None, extra])
    assert logits.shape == (3, 32) and hidden.shape[0] == 3
    torch.testing.assert_close(logits, torch.cat([row[:, :32] for row in rows]))
    torch.testing.assert_close(hidden[2:] @ models[0].head_rows(extra).T, rows[1][:, 32:], rtol=1e-5, atol=1e-5)


def test_the_draft_scores_its_head_and_the_sessions_context_tokens_only(dirs):
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.sampling.params import SamplingParams

    order = dirs["order"]
    proposer = DraftModelProposer(load_model(dirs["draft"], num_slots=2, max_context=64, head_vocab=8), top_m=0)
    outside = [t for t in order[100:104]]  # context tokens outside the 8-row head
    prompt = [order[0], outside[0], outside[1], order[1], outside[0], outside[2]]
    state = proposer.open("s")
    block = proposer.propose(state, prompt, 3, SamplingParams(temperature=1.0, seed=1))
    support = set(order[:8]) | set(outside[:3])
    for step in range(3):
        ids = block.draft_prob_ids[step][block.draft_probs[step] > 0].tolist()
        assert set(ids) <= support and set(ids) - set(order[:8])  # context tokens do get mass
        assert block.token_ids[step].item() in support
    assert state.context_ids == outside[:3]  # in order of first appearance, once each
    # A sequence that is not an extension of the one scanned (a rollback into it) is rescanned.
    proposer.propose(state, [order[2], outside[3]], 1, SamplingParams())
    assert state.context_ids == [outside[3]]


def test_head_vocab_auto_takes_the_checkpoints_recommendation_on_cpu_only(dirs, tmp_path):
    import argparse
    import shutil

    from specdec.models.reduced_head import parse_head_vocab

    assert load_model(dirs["draft"], num_slots=1, head_vocab="auto").head_token_ids is None  # none recommended
    draft = shutil.copytree(dirs["draft"], tmp_path / "draft")
    listing = json.loads((draft / "head_vocab.json").read_text())
    (draft / "head_vocab.json").write_text(json.dumps({**listing, "recommended": 24}))
    assert len(load_model(draft, num_slots=1, head_vocab="auto").head_token_ids) == 24
    assert load_model(draft, num_slots=1, head_vocab=None).head_token_ids is None
    assert load_model(dirs["target"], num_slots=1, head_vocab="auto").head_token_ids is None  # no listing
    assert [parse_head_vocab(t) for t in ("auto", "full", "0", "64")] == ["auto", None, None, 64]
    for bad in ("-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_head_vocab(bad)


def test_greedy_drafts_pick_the_full_vectors_argmax_while_the_context_grows_and_rolls_back(dirs, monkeypatch):
    """A greedy row picks its token from the scored columns, for all rows of a step at once, and
    the rows of its context kept between proposals; the tokens and confidences must be those of the
    vocabulary-sized vector's argmax (ties to the lowest id) with the rows gathered afresh, through
    growth and rollbacks."""
    from specdec.proposers import draft_model
    from specdec.proposers.context_columns import ContextColumns
    from specdec.proposers.draft_model import DraftModelProposer, _Drafting, _DraftSlot
    from specdec.sampling.params import SamplingParams

    class RowAtATime(ContextColumns):
        def greedy(self, scores, rows):
            return [None] * len(rows)  # every row through the general path: the full vector's argmax

    order = dirs["order"]

    def proposer(fast: bool) -> DraftModelProposer:
        p = DraftModelProposer(load_model(dirs["draft"], num_slots=2, max_context=128, head_vocab=24), top_m=0)
        if not fast:
            monkeypatch.setattr(p, "_reduced_greedy", lambda d, scores: None)
            monkeypatch.setattr(p, "_context_rows", lambda d: (lambda ids: None if ids is None else
                                                                p.model.head_rows(ids))(p._context_ids(d)))
        return p

    fast, reference = proposer(True), proposer(False)
    states = fast.open("s"), reference.open("s")
    generator = torch.Generator().manual_seed(11)
    sequence = torch.randint(0, 256, (20,), generator=generator).tolist()
    grew = 0
    for cycle in range(12):
        blocks = [fast.propose(states[0], sequence, 4, SamplingParams())]
        with monkeypatch.context() as patch:
            patch.setattr(draft_model, "ContextColumns", RowAtATime)
            blocks.append(reference.propose(states[1], sequence, 4, SamplingParams()))
        assert blocks[0].token_ids.tolist() == blocks[1].token_ids.tolist()
        assert blocks[0].confidences == pytest.approx(blocks[1].confidences, rel=1e-6)
        if cycle % 4 == 3:  # a rollback into the committed text: the context is rebuilt
            sequence = sequence[:len(sequence) - 6]
        else:  # two drafted tokens accepted and a token from outside the head, as a correction
            before = len(states[0].context_ids)
            sequence = sequence + blocks[0].token_ids[:2].tolist() + [order[100 + cycle]]
            fast._context_ids(_Drafting(0, states[0], sequence, 1, SamplingParams()))
            grew += len(states[0].context_ids) > before
    assert grew and states[0].context_rows is not None

    # A tie between a head column and a context column goes to the lower token id.
    state = _DraftSlot("t")
    low = order[100]
    state.scored_ids = torch.cat((fast._head, torch.tensor([low])))
    scores = torch.zeros(len(state.scored_ids))
    scores[-1] = scores[0] = 5.0
    want = min(low, int(fast._head[0]))
    assert fast._reduced_greedy(_Drafting(0, state, [1], 1, SamplingParams()), scores) == want
    assert want == int(torch.argmax(fast._full_vocab(scores, torch.tensor([low]))))
