"""A reduced-head draft's batched scoring (specdec/proposers/context_columns.py): the picks and the
scores of a whole step at once are those of its rows one at a time."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.models import cpu_scores
from specdec.models.loader import load_model
from specdec.proposers.context_columns import ContextColumns, greedy_columns
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.draft import draft_confidence
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.testing.tiny_models import make_tiny_model

HEAD = [7, 3, 9, 1]


def columns(context_ids: list[list[int]], hidden: int = 2) -> ContextColumns:
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(len(row), hidden, generator=generator) if row else None for row in context_ids]
    return ContextColumns(HEAD, rows, context_ids)


@pytest.fixture(params=["compiled", "pytorch"])
def path(request, monkeypatch):
    """Each test through the compiled loops (CPU, float32) and through PyTorch (any other device or dtype)."""
    if request.param == "compiled" and not cpu_scores.usable(torch.zeros(1)):
        pytest.skip("no compiled loop here (numba missing or failed)")
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_scores, "usable", lambda *tensors: False)
    return request.param


def test_scores_are_the_head_then_each_rows_own_context_columns(path):
    batch = columns([[20, 21], [], [30]])
    head_logits = torch.arange(12.0).reshape(3, 4)
    hidden = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 2.0]])
    scores = batch.scores(head_logits[[0, 2]], hidden[[0, 2]], [0, 2])  # a step where row 1 stopped
    assert scores.shape == (2, 4 + 2)
    assert batch.widths.tolist() == [6, 4, 5]
    torch.testing.assert_close(scores[:, :4], head_logits[[0, 2]])
    torch.testing.assert_close(scores[0, 4:], batch.rows[0:2] @ hidden[0])
    torch.testing.assert_close(scores[1, 4], batch.rows[2] @ hidden[2])
    assert scores[1, 5] == float("-inf")  # row 2 has one context column: the other is padding


def test_greedy_picks_the_top_score_and_leaves_ties_and_non_finite_rows(path):
    batch = columns([[20, 21], [], [30], [40]])
    inf = float("-inf")
    scores = torch.tensor([
        [0.0, 1.0, 0.5, 0.2, 3.0, -1.0],  # a context column wins: token 20
        [2.0, 1.0, 0.5, 0.2, inf, inf],  # the head wins, no context: token 7
        [1.0, 4.0, 0.0, 0.0, 4.0, inf],  # a tie between head id 3 and context id 30: the row's own path
        [inf, inf, inf, inf, inf, inf],  # nothing finite: the row's own path
    ])
    picks = batch.greedy(scores, [0, 1, 2, 3])
    assert [p if p is None else p[0] for p in picks] == [20, 7, None, None]
    assert batch.greedy(scores[[1]], [1]) == picks[1:2]  # a step where only row 1 drafts
    for pick, row, width in zip(picks[:2], scores, batch.widths):
        token = pick[0]
        assert pick[1] == pytest.approx(draft_confidence(row[:width], token, None, None, True), rel=1e-6)


def test_a_full_heads_step_is_picked_at_once_as_row_by_row(path):
    """greedy_columns over a full head's logits (columns are token ids): the row's argmax and its
    softmax there, as draft_confidence gives; a tie or nothing finite is left to the row's own path."""
    inf = float("-inf")
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 3.0, 0.0, 1.0], [inf, inf, inf, inf], [0.0, 0.0, 0.1, 0.0]])
    picks = greedy_columns(logits)
    assert [p if p is None else p[0] for p in picks] == [1, None, None, 2]
    for pick, row in zip((picks[0], picks[3]), (logits[0], logits[3])):
        assert pick[1] == pytest.approx(draft_confidence(row, pick[0], None, None, True), rel=1e-6)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("columns") / "draft", vocab_size=256, seed=5)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(1)).tolist()
    (path / "head_vocab.json").write_text(json.dumps({"token_ids": order}))
    return path


@pytest.mark.parametrize("head_vocab", [32, None])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_mixed_batch_proposes_what_each_row_proposes_alone(draft_dir, device, head_vocab):
    """Greedy, sampled and Gumbel rows with contexts of different lengths (one inside the head only),
    drafting different lengths, in one batch: each gets the tokens it gets alone, and the same
    distributions to rounding (a row's numbers in a batched forward differ in the last bits). On a
    GPU the scores and picks go through PyTorch's operators instead of the compiled loops. With the
    full head (None: a GPU's) the greedy rows are picked together too (greedy_columns)."""
    def proposer() -> DraftModelProposer:
        return DraftModelProposer(load_model(draft_dir, device=device, num_slots=8, max_context=128,
                                             head_vocab=head_vocab), top_m=16)

    head = proposer()._head.tolist() if head_vocab else list(range(32))
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (30, 12, 45)]
    prompts.append(head[:5] * 3)  # every token inside the head: no context columns
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=1.0, seed=4, mode=SamplingMode.GUMBEL), SamplingParams()]
    lengths = [4, 2, 3, 5]
    together = proposer()
    blocks = together.propose_batch([(together.open(f"s{i}"), prompt, n, p)
                                     for i, (prompt, n, p) in enumerate(zip(prompts, lengths, params))])
    for i, (prompt, n, p) in enumerate(zip(prompts, lengths, params)):
        alone = proposer()
        want = alone.propose(alone.open("s"), prompt, n, p)
        got = blocks[i]
        assert got.token_ids.tolist() == want.token_ids.tolist(), i
        assert got.confidences == pytest.approx(want.confidences, rel=1e-4), i
        if not p.greedy:
            assert torch.equal(got.draft_prob_ids, want.draft_prob_ids), i
            torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_tie_and_a_sampled_row_use_the_ids_kept_on_the_cpu(draft_dir):
    """The head's and the context's ids stay on the CPU while the scores are on the model's device:
    a tie between a head and a context column goes to the lower id, and a sampled row's vector over
    the whole vocabulary is built where its scores are."""
    from specdec.proposers.draft_model import _Drafting, _DraftSlot

    proposer = DraftModelProposer(load_model(draft_dir, device="cuda", num_slots=2, max_context=64, head_vocab=32))
    low = min(set(range(256)) - set(proposer._head_ids))
    state = _DraftSlot("t")
    state.scored_ids = torch.cat((proposer._head, torch.tensor([low])))
    scores = torch.zeros(len(state.scored_ids), device="cuda")
    scores[-1] = scores[0] = 5.0
    assert proposer._reduced_greedy(_Drafting(0, state, [1], 1, SamplingParams()), scores) == min(
        low, proposer._head_ids[0])
    full = proposer._full_vocab(scores, torch.tensor([low]))
    assert full.device.type == "cuda" and int(torch.argmax(full)) == min(low, proposer._head_ids[0])
