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
