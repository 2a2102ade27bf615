"""Multi-outcome pipelining: alternatives drafted beside a speculative proposal (a second bonus
guess, all but the last token accepted) in one batched pass; adoption; lossless loops that hit on
them. Engine and loop over local engines on tiny random models (tests/test_pipeline.py's helpers)."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.engine.alternatives import alternatives_for
from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.errors import EpochMismatch, InvalidArgument, PositionMismatch
from specdec.proposers.base import NextTokens
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.types import DraftBlock
from test_pipeline import GREEDY, PROMPTS, VOCAB, ScriptedProposer, draft_engine, run, tiny_dirs  # noqa: F401

BOTH = ("second_guess", "rejected_last")
SAMPLED = SamplingParams(temperature=1.0, seed=3)


def _outcome(parent, kind: str) -> tuple[int, list[int]]:
    """(keep_position, appended) of the verify outcome a branch assumes, for a sequential Propose."""
    end = parent.position + parent.block.num_tokens
    return (end, []) if kind == "second_guess" else (end - 1, [])


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_branch_is_the_sequential_block_after_its_outcome(tiny_dirs, params):
    pipelined = draft_engine("random", tiny_dirs)
    prompt = PROMPTS[0]
    pipelined.start_session("s", prompt, params)
    parent = pipelined.propose("s", len(prompt), [], 3)
    child = pipelined.propose("s", len(prompt) + 3, [], 4, parent_epoch=parent.epoch, speculative=True,
                              alternatives=BOTH)
    assert [b.kind for b in child.alternatives] == list(BOTH)
    second, rejected_last = child.alternatives
    assert second.guessed_token_id != child.guessed_token_id and second.position == child.position
    last_drafted = parent.block.token_ids[-1].item()
    assert rejected_last.guessed_token_id != last_drafted and rejected_last.position == child.position - 1
    assert sorted([child.epoch, second.epoch, rejected_last.epoch]) == [2, 3, 4]
    for branch in (child, second, rejected_last):
        sequential = draft_engine("random", tiny_dirs)
        sequential.start_session("s", prompt, params)
        first = sequential.propose("s", len(prompt), [], 3)
        assert first.block.token_ids.tolist() == parent.block.token_ids.tolist()
        keep, _ = _outcome(parent, "rejected_last" if branch.kind == "rejected_last" else "second_guess")
        after = sequential.propose("s", keep, [branch.guessed_token_id], 4, parent_epoch=first.epoch)
        assert after.position == branch.position
        assert after.block.token_ids.tolist() == branch.block.token_ids.tolist()
        if not params.greedy:
            assert after.block.draft_probs.allclose(branch.block.draft_probs, atol=1e-6)
    if params.greedy:  # the greedy second guess is the draft's second most likely token
        ranked = pipelined.proposer.rank_batch([(pipelined.sessions.get("s").proposer_state,
                                                  pipelined.sessions.get("s").tokens[:child.position - 1], params)], 2)[0]
        assert ranked.ranked == (child.guessed_token_id, second.guessed_token_id)


def test_adopting_a_branch_frees_the_others_and_continues_on_it(tiny_dirs):
    engine = draft_engine("random", tiny_dirs)
    model = engine.proposer.model
    prompt = PROMPTS[1]
    engine.start_session("s", prompt, GREEDY)
    parent = engine.propose("s", len(prompt), [], 3)
    free_before = model.num_free_slots
    child = engine.propose("s", len(prompt) + 3, [], 3, parent_epoch=parent.epoch, speculative=True,
                           alternatives=BOTH)
    assert model.num_free_slots == free_before - 2  # a forked slot per alternative
    rejected_last = child.alternatives[1]
    # The target accepted 2 of 3 and recovered the guessed token: the next message names the branch.
    grandchild = engine.propose("s", rejected_last.position + 3, [], 2, parent_epoch=rejected_last.epoch,
                                speculative=True)
    state = engine.sessions.get("s")
    assert model.num_free_slots == free_before and not state.alternatives
    expected = list(prompt) + parent.block.token_ids[:2].tolist() + [rejected_last.guessed_token_id] \
        + rejected_last.block.token_ids.tolist() + [grandchild.guessed_token_id] + grandchild.block.token_ids.tolist()
    assert state.tokens == expected
    assert [p.epoch for p in state.chain.live] == [parent.epoch, rejected_last.epoch, grandchild.epoch]
    # The same continuation as a fresh engine that never branched.
    fresh = draft_engine("random", tiny_dirs)
    fresh.start_session("s", expected[:rejected_last.position + 3], GREEDY)
    again = fresh.propose("s", rejected_last.position + 3, [], 3)  # greedy: its first token is the guess
    assert again.block.token_ids.tolist() == [grandchild.guessed_token_id] + grandchild.block.token_ids.tolist()
    # The discarded siblings are gone: naming them is refused.
    with pytest.raises(EpochMismatch):
        engine.propose("s", child.position, [], 2, parent_epoch=child.epoch)
    engine.end_session("s")
    assert model.num_free_slots == model.num_slots


def test_a_miss_discards_every_branch_and_a_refusal_keeps_them(tiny_dirs):
    engine = draft_engine("random", tiny_dirs)
    model = engine.proposer.model
    prompt = PROMPTS[0]
    engine.start_session("s", prompt, GREEDY)
    parent = engine.propose("s", len(prompt), [], 3)
    child = engine.propose("s", len(prompt) + 3, [], 3, parent_epoch=parent.epoch, speculative=True,
                           alternatives=BOTH)
    state = engine.sessions.get("s")
    with pytest.raises(PositionMismatch, match="span"):  # keep outside the branch's span: nothing changes
        engine.propose("s", child.alternatives[0].position + 9, [], 3, parent_epoch=child.alternatives[0].epoch)
    assert set(state.alternatives) == {b.epoch for b in child.alternatives}
    engine.propose("s", len(prompt) + 1, [7], 3, parent_epoch=parent.epoch)  # a miss: 1 accepted
    assert not state.alternatives and model.num_free_slots == model.num_slots - 1
    for branch in child.alternatives:
        with pytest.raises(EpochMismatch):
            engine.propose("s", branch.position, [], 3, parent_epoch=branch.epoch)


def test_clear_errors():
    engine = DraftEngine(ScriptedProposer(list(range(40)), set()))
    engine.start_session("s", list(range(10)), GREEDY)
    with pytest.raises(InvalidArgument, match="need a speculative Propose"):
        engine.propose("s", 10, [], 3, alternatives=("second_guess",))
    parent = engine.propose("s", 10, [], 3)
    for bad in (("third_guess",), ("second_guess", "second_guess"), ("main",)):
        with pytest.raises(InvalidArgument, match="distinct kinds among"):
            engine.propose("s", 13, [], 3, parent_epoch=parent.epoch, speculative=True, alternatives=bad)
    with pytest.raises(InvalidArgument, match=r"\[1, 3\]"):
        alternatives_for(4)
    assert alternatives_for(1) == () and alternatives_for(3) == BOTH


def test_batched_branches_equal_one_at_a_time(tiny_dirs):
    """Several sessions' speculative items with alternatives in one batch: the same proposals as
    each alone."""
    def start(engine):
        parents = []
        for i, prompt in enumerate(PROMPTS):
            engine.start_session(f"s{i}", prompt, SAMPLED)
            parents.append(engine.propose(f"s{i}", len(prompt), [], 2 + i))
        return parents
    batched, alone = draft_engine("random", tiny_dirs), draft_engine("random", tiny_dirs)
    parents = start(batched)
    start(alone)
    works = [ProposeWork(f"s{i}", p.position + p.block.num_tokens, (), 3, p.epoch, True, BOTH)
             for i, p in enumerate(parents)]
    together = run_propose_batch(batched, works)
    for work, result in zip(works, together):
        single = alone.propose(work.session_id, work.keep_position, [], 3, work.parent_epoch, True, BOTH)
        for a, b in zip((result, *result.alternatives), (single, *single.alternatives), strict=True):
            assert (a.epoch, a.position, a.kind, a.guessed_token_id) == (b.epoch, b.position, b.kind, b.guessed_token_id)
            assert a.block.token_ids.tolist() == b.block.token_ids.tolist()


# ---- the loop ---------------------------------------------------------------------------------------


def test_matching_branch_needs_the_guess_at_its_own_position():
    """Every outcome of a 3-token parent at position 10: a branch is valid only where the target
    committed its guess at its guess position (the same token elsewhere is no hit)."""
    from specdec.engine.api import Proposal
    from specdec.generation.pipeline import matching_branch
    from specdec.types import VerifyOutcome

    block = lambda n: DraftBlock(token_ids=torch.arange(n))  # noqa: E731
    parent = Proposal(1, 10, block(3), "draft-model")
    second = Proposal(3, 14, block(2), "draft-model", True, 51, kind="second_guess")
    rejected_last = Proposal(4, 13, block(2), "draft-model", True, 50, kind="rejected_last")
    child = Proposal(2, 14, block(2), "draft-model", True, 50, alternatives=(second, rejected_last))
    for drafted in (3, 2):
        for accepted in range(drafted + 1):
            for token in (50, 51, 52):
                found = matching_branch(parent, VerifyOutcome(10, drafted, accepted, token), child)
                expected = {(3, 50): child, (3, 51): second, (2, 50): rejected_last}.get((accepted, token))
                assert found is expected, (drafted, accepted, token)
    assert matching_branch(parent, VerifyOutcome(10, 3, 3, 50), None) is None


class RankedScript(ScriptedProposer):
    """ScriptedProposer whose runner-up at every position is the target's own token: a second
    guess or a recovered-token guess is always right, so every wrong_guess and rejected_last miss
    of a single-branch run becomes a hit with three branches."""

    def rank_batch(self, requests, num_ranked):
        out = []
        for _, token_ids, params in requests:
            block = self.propose(None, token_ids, 1, params)
            if not block.num_tokens:
                out.append(None)
                continue
            own, true = block.token_ids[0].item(), self.reference[len(token_ids)]
            out.append(NextTokens(own, (own, true if true != own else (own + 1) % VOCAB)))
        return out

    def fork(self, state, length):
        return None

    def adopt(self, state, branch):
        pass


def test_branches_turn_scripted_misses_into_hits(tiny_dirs):
    prompt = PROMPTS[0]
    plain, _ = run(tiny_dirs["target"], None, prompt, GREEDY, pipelining=False, max_new_tokens=60)
    reference = list(prompt) + plain
    wrong = set(random.Random(0).sample(range(len(prompt), len(reference)), len(plain) // 5))
    stats = {}
    for branches in (1, 2, 3):
        tokens, stats[branches] = run(tiny_dirs["target"], DraftEngine(RankedScript(reference, wrong)), prompt,
                                      GREEDY, pipelining=True, max_new_tokens=60, k=3, branches=branches)
        assert tokens == plain
    one, two, three = stats[1], stats[2], stats[3]
    assert one.pipeline_wrong_guesses > 0 and one.pipeline_rejected_last > 0
    assert one.pipeline_hits_second_guess == one.pipeline_hits_rejected_last == 0
    # The cycles are the same in every run (acceptance is scripted); only which of them hit changes.
    assert one.cycles == two.cycles == three.cycles
    assert two.pipeline_hits_second_guess == one.pipeline_wrong_guesses and two.pipeline_wrong_guesses == 0
    assert two.pipeline_hits == one.pipeline_hits + one.pipeline_wrong_guesses
    assert three.pipeline_hits_rejected_last == one.pipeline_rejected_last and three.pipeline_rejected_last == 0
    assert three.pipeline_hits == two.pipeline_hits + one.pipeline_rejected_last


@pytest.mark.parametrize("kind", ["same", "random", "ngram"])
@pytest.mark.parametrize("branches", [2, 3])
def test_multi_branch_greedy_equals_plain_decoding(tiny_dirs, kind, branches):
    for prompt in PROMPTS:
        plain, _ = run(tiny_dirs["target"], None, prompt, GREEDY, pipelining=False)
        pipelined, stats = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), prompt, GREEDY, True,
                               branches=branches)
        assert pipelined == plain
        assert stats.pipeline_hits + stats.pipeline_misses > 0


@pytest.mark.parametrize("kind", ["same", "random"])
def test_multi_branch_sampling_is_lossless(tiny_dirs, kind):
    """Gumbel-coupled: plain sampling token for token. Rejection sampling: the sequential run with
    the same seed (a hit branch is the block sequential drafting would have drafted there)."""
    gumbel = SamplingParams(temperature=1.0, top_p=0.9, seed=7, mode=SamplingMode.GUMBEL)
    plain, _ = run(tiny_dirs["target"], None, PROMPTS[0], gumbel, pipelining=False)
    coupled, _ = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), PROMPTS[0], gumbel, True, branches=3)
    assert coupled == plain
    sampled = SamplingParams(temperature=1.0, seed=11)
    for prompt in PROMPTS[:2]:
        sequential, _ = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), prompt, sampled, False)
        pipelined, stats = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), prompt, sampled, True, branches=3)
        assert pipelined == sequential


def test_alternatives_never_evict_another_session(tiny_dirs):
    """A branch takes a free KV slot or is not drafted: with one slot free, one alternative."""
    engine = draft_engine("random", tiny_dirs)
    model = engine.proposer.model  # 4 slots
    parents = {}
    for i, prompt in enumerate(PROMPTS):
        engine.start_session(f"s{i}", prompt, GREEDY)
        parents[f"s{i}"] = engine.propose(f"s{i}", len(prompt), [], 2)
    slots = {sid: engine.sessions.get(sid).proposer_state.slot for sid in parents}
    assert model.num_free_slots == 1
    parent = parents["s0"]
    child = engine.propose("s0", parent.position + 2, [], 2, parent.epoch, speculative=True, alternatives=BOTH)
    assert [b.kind for b in child.alternatives] == ["second_guess"] and model.num_free_slots == 0
    assert {sid: engine.sessions.get(sid).proposer_state.slot for sid in parents} == slots


def test_ngram_ranks_the_continuations_of_every_match():
    """Own token = propose(..., 1)'s; then the other continuations, longest n-gram and most recent
    match first, each once; None where the lookup finds nothing."""
    from specdec.proposers.ngram import NgramProposer

    proposer = NgramProposer(max_ngram=3)
    tokens = [1, 2, 3, 1, 2, 4, 9, 2, 7, 1, 2]  # [1, 2] was followed by 3 then 4; [2] also by 7
    ranked = proposer.rank_batch([(None, tokens, GREEDY)], 3)[0]
    assert ranked.own == proposer.propose(None, tokens, 1, GREEDY).token_ids[0].item() == 4
    assert ranked.ranked == (4, 3, 7) and ranked.best_other_than(4) == 3
    assert proposer.rank_batch([(None, [5, 6], GREEDY)], 2) == [None]
