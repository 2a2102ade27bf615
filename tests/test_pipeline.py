"""Pipelined drafting: the draft engine's live proposal chain (epochs, speculative children,
rollback, refusals) and the pipelined loop over local engines (lossless, and it does hit)."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.errors import EpochMismatch, InvalidArgument, PositionMismatch
from specdec.generation.session import LoopObserver, LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.testing.tiny_models import make_tiny_model

VOCAB = 256
GREEDY = SamplingParams()
PROMPTS = [[1, 5, 9, 12, 5, 9], [3, 3, 3, 7, 200, 31, 44, 3, 3], [17, 4, 17, 4, 17]]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"target": make_tiny_model(root / "target", variant="llama", vocab_size=VOCAB, seed=0),
            "random": make_tiny_model(root / "draft", variant="llama", vocab_size=VOCAB, seed=1)}


def model(path):
    return load_model(path, backend="native", num_slots=4, max_context=256)


def draft_engine(kind: str, dirs) -> DraftEngine:
    if kind == "ngram":
        return DraftEngine(NgramProposer())
    return DraftEngine(DraftModelProposer(model(dirs["target"] if kind == "same" else dirs["random"])))


# ---- the engine's live proposal chain --------------------------------------------------------------


def test_speculative_child_equals_the_sequential_block_after_the_guess(tiny_dirs):
    """A hit block is exactly what a sequential Propose drafts after committing the guess."""
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=3)):
        pipelined, sequential = draft_engine("random", tiny_dirs), draft_engine("random", tiny_dirs)
        prompt = PROMPTS[0]
        for e in (pipelined, sequential):
            e.start_session("s", prompt, params)
        parent = pipelined.propose("s", len(prompt), [], 3)
        child = pipelined.propose("s", len(prompt) + 3, [], 4, parent_epoch=parent.epoch, speculative=True)
        assert child.speculative and child.guessed_token_id is not None
        assert (child.epoch, child.position) == (parent.epoch + 1, len(prompt) + 4)
        first = sequential.propose("s", len(prompt), [], 3)
        assert first.block.token_ids.tolist() == parent.block.token_ids.tolist()
        after = sequential.propose("s", len(prompt) + 3, [child.guessed_token_id], 4, parent_epoch=first.epoch)
        assert after.position == child.position
        assert after.block.token_ids.tolist() == child.block.token_ids.tolist()
        if not params.greedy:
            assert after.block.draft_probs.allclose(child.block.draft_probs, atol=1e-6)


def test_miss_rolls_back_to_the_parent_and_drafts_as_if_never_speculated(tiny_dirs):
    pipelined, sequential = draft_engine("random", tiny_dirs), draft_engine("random", tiny_dirs)
    prompt = PROMPTS[1]
    for e in (pipelined, sequential):
        e.start_session("s", prompt, GREEDY)
    parent = pipelined.propose("s", len(prompt), [], 4)
    child = pipelined.propose("s", len(prompt) + 4, [], 4, parent_epoch=parent.epoch, speculative=True)
    assert pipelined.sessions.get("s").position == len(prompt) + 9  # parent, guess, child
    # Verify outcome of the parent: 2 accepted, then a recovered token.
    recovered = (parent.block.token_ids[2].item() + 1) % VOCAB
    redraft = pipelined.propose("s", len(prompt) + 2, [recovered], 4, parent_epoch=parent.epoch)
    sequential.propose("s", len(prompt), [], 4)
    expected = sequential.propose("s", len(prompt) + 2, [recovered], 4, parent_epoch=1)
    assert redraft.block.token_ids.tolist() == expected.block.token_ids.tolist()
    assert redraft.epoch == child.epoch + 1
    state = pipelined.sessions.get("s")
    assert state.tokens == sequential.sessions.get("s").tokens
    assert [p.epoch for p in state.chain.live] == [redraft.epoch]
    with pytest.raises(EpochMismatch):  # the discarded child can no longer be built on
        pipelined.propose("s", child.position, [], 2, parent_epoch=child.epoch)


def test_hit_chain_builds_on_the_child_and_settles_old_proposals(tiny_dirs):
    engine = DraftEngine(NgramProposer(), max_live_proposals=2)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    engine.start_session("s", prompt, GREEDY)
    parent = engine.propose("s", len(prompt), [], 2)  # 3 1
    assert parent.block.token_ids.tolist() == [3, 1]
    child = engine.propose("s", parent.position + 2, [], 2, parent_epoch=parent.epoch, speculative=True)
    assert (child.guessed_token_id, child.block.token_ids.tolist()) == (2, [3, 1])
    # A hit: the child is verified next while its own child is drafted; with max_live=2 the first
    # parent is settled (its tokens count as committed).
    grandchild = engine.propose("s", child.position + 2, [], 2, parent_epoch=child.epoch, speculative=True)
    state = engine.sessions.get("s")
    assert [p.epoch for p in state.chain.live] == [child.epoch, grandchild.epoch]
    assert state.committed == child.position - 1
    with pytest.raises(EpochMismatch):
        engine.propose("s", parent.position + 1, [9], 2, parent_epoch=parent.epoch)
    # The outcome of the child: everything accepted but a different bonus; the grandchild goes.
    after = engine.propose("s", child.position + 2, [7], 2, parent_epoch=child.epoch)
    assert after.position == child.position + 3
    assert engine.sessions.get("s").tokens[:child.position + 3] == prompt + [3, 1, 2, 3, 1, 7]


def test_refusals_say_what_is_allowed_and_leave_the_session_intact(tiny_dirs):
    engine = draft_engine("random", tiny_dirs)
    prompt = PROMPTS[0]
    engine.start_session("s", prompt, GREEDY)
    parent = engine.propose("s", len(prompt), [], 3)
    end = len(prompt) + 3
    before = list(engine.sessions.get("s").tokens)
    with pytest.raises(InvalidArgument, match="keep_position must be"):
        engine.propose("s", end - 1, [], 3, parent_epoch=parent.epoch, speculative=True)
    with pytest.raises(InvalidArgument, match="appends no tokens"):
        engine.propose("s", end, [5], 3, parent_epoch=parent.epoch, speculative=True)
    with pytest.raises(InvalidArgument, match="parent_epoch must not be 0"):
        engine.propose("s", end, [], 3, speculative=True)
    with pytest.raises(EpochMismatch, match="not live"):
        engine.propose("s", end, [], 3, parent_epoch=parent.epoch + 5, speculative=True)
    with pytest.raises(PositionMismatch, match=r"span \[6, 9\]"):
        engine.propose("s", len(prompt) - 1, [5], 3, parent_epoch=parent.epoch)
    assert engine.sessions.get("s").tokens == before
    child = engine.propose("s", end, [], 3, parent_epoch=parent.epoch, speculative=True)
    assert child.position == end + 1


def test_batched_speculative_work_equals_one_at_a_time(tiny_dirs):
    """Speculative and sequential items of several sessions in one batched pass give the blocks
    each would get alone (the draft batching runs rows at different positions)."""
    batched, single = draft_engine("random", tiny_dirs), draft_engine("random", tiny_dirs)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=5), GREEDY]
    parents = {}
    for e in (batched, single):
        for i, prompt in enumerate(PROMPTS):
            e.start_session(f"s{i}", prompt, params[i])
            parents[f"s{i}"] = e.propose(f"s{i}", len(prompt), [], 3)
    works = [ProposeWork("s0", len(PROMPTS[0]) + 3, (), 4, parents["s0"].epoch, True),
             ProposeWork("s1", len(PROMPTS[1]) + 1, (42,), 4, parents["s1"].epoch),
             ProposeWork("s2", len(PROMPTS[2]) + 3, (), 2, parents["s2"].epoch, True)]
    got = run_propose_batch(batched, works)
    for w, result in zip(works, got):
        expected = single.propose(w.session_id, w.keep_position, w.append_token_ids, w.num_draft_tokens,
                                  w.parent_epoch, w.speculative)
        assert (result.epoch, result.position, result.guessed_token_id, result.block.token_ids.tolist()) == \
            (expected.epoch, expected.position, expected.guessed_token_id, expected.block.token_ids.tolist())


# ---- the pipelined loop -------------------------------------------------------------------------------


class CountingObserver(LoopObserver):
    def __init__(self):
        self.hits = self.misses = 0
        self.branches: list[str] = []

    def pipelined(self, hit: bool, branch: str | None = None) -> None:
        if hit:
            self.hits += 1
            self.branches.append(branch)
        else:
            self.misses += 1


def run(target_path, draft: DraftEngine | None, prompt, params, pipelining: bool, max_new_tokens=40, k=4, eos=(),
        branches=1):
    from specdec.generation.loop import SpeculativeLoop, start_generation

    target = TargetEngine(model(target_path))
    emitted: list[int] = []
    observer = CountingObserver()

    async def emit(tokens):
        emitted.extend(tokens)

    async def main():
        session_id = uuid.uuid4().hex
        cursor, first = await start_generation(LocalTarget(target), session_id, prompt, params)
        stop = StopChecker(max_new_tokens, eos)
        stop.check([first])
        loop = SpeculativeLoop(LocalTarget(target), LocalDraft(draft) if draft else None,
                               LoopSettings(num_draft_tokens=k, pipelining=pipelining, pipeline_branches=branches),
                               observer)
        result = await loop.run(cursor, stop, emit)
        assert target.committed_tokens(session_id) == list(prompt) + [first] + result.token_ids
        if draft is not None:  # the draft was left holding committed tokens only
            assert draft.sessions.get(session_id).tokens == cursor.tokens[:len(draft.sessions.get(session_id).tokens)]
        return [first] + result.token_ids, result.stats

    tokens, stats = asyncio.run(main())
    assert (stats.pipeline_hits, stats.pipeline_misses) == (observer.hits, observer.misses)
    assert (stats.pipeline_hits_second_guess, stats.pipeline_hits_rejected_last) == (
        observer.branches.count("second_guess"), observer.branches.count("rejected_last"))
    if draft is not None:  # the loop's final truncate leaves no alternative branch live
        assert all(not s.alternatives for s in draft.sessions)
    return tokens, stats


@pytest.mark.parametrize("kind", ["same", "random", "ngram"])
def test_pipelined_greedy_equals_plain_decoding(tiny_dirs, kind):
    for prompt in PROMPTS:
        plain, _ = run(tiny_dirs["target"], None, prompt, GREEDY, pipelining=False)
        sequential, seq_stats = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), prompt, GREEDY, False)
        pipelined, stats = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), prompt, GREEDY, True)
        assert pipelined == sequential == plain
        assert seq_stats.pipeline_hits == seq_stats.pipeline_misses == 0
        assert stats.pipeline_hits + stats.pipeline_misses > 0
        if kind == "same":  # a draft identical to the target guesses every bonus token
            assert stats.pipeline_misses <= 1 and stats.cycles < seq_stats.cycles + 2


def test_a_stop_inside_a_hit_block_leaves_the_draft_on_committed_tokens(tiny_dirs):
    """An EOS inside the block verified right after a hit: the committed sequence is cut back
    below where the draft's speculative block started, and the draft must be cut back with it."""
    prompt = PROMPTS[2]
    plain, _ = run(tiny_dirs["target"], None, prompt, GREEDY, pipelining=False, max_new_tokens=40)
    for stop_at in range(6, 20):
        eos = plain[stop_at]
        if eos in plain[:stop_at]:
            continue
        pipelined, stats = run(tiny_dirs["target"], draft_engine("same", tiny_dirs), prompt, GREEDY, True,
                               eos=(eos,))  # run() checks what the draft holds
        assert pipelined == plain[:stop_at + 1]


@pytest.mark.parametrize("kind", ["same", "random"])
def test_pipelined_sampling_is_sequential_sampling(tiny_dirs, kind):
    """Gumbel-coupled: token for token plain sampling. Rejection sampling: token for token the
    sequential run with the same seed (the hit blocks are the sequential blocks)."""
    gumbel = SamplingParams(temperature=1.0, top_p=0.9, seed=7, mode=SamplingMode.GUMBEL)
    plain, _ = run(tiny_dirs["target"], None, PROMPTS[0], gumbel, pipelining=False)
    coupled, _ = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), PROMPTS[0], gumbel, True)
    assert coupled == plain
    sampled = SamplingParams(temperature=1.0, seed=11)
    sequential, _ = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), PROMPTS[1], sampled, False)
    pipelined, stats = run(tiny_dirs["target"], draft_engine(kind, tiny_dirs), PROMPTS[1], sampled, True)
    assert pipelined == sequential
    if kind == "same":
        assert stats.pipeline_hits > 0


def test_the_policy_sees_a_pipelined_cycle_s_draft_forwards_and_critical_path(tiny_dirs, monkeypatch):
    """What the draft-length policy is told of a pipelined cycle: every draft forward the cycle paid
    for (its own block's unless drafted ahead, the successor's guess and tokens), whether the block
    was drafted ahead, and an overhead that leaves the Propose beside the verify out."""
    from specdec.generation.adaptive import DraftLengthPolicy

    seen = []
    original = DraftLengthPolicy.observe_cycle

    def spy(self, k, num_accepted, draft_s, verify_s, overhead_s=0.0, confidences=(), steady=True, **pipelined):
        seen.append((k, num_accepted, draft_s, overhead_s, steady, pipelined))
        return original(self, k, num_accepted, draft_s, verify_s, overhead_s, confidences, steady, **pipelined)

    monkeypatch.setattr(DraftLengthPolicy, "observe_cycle", spy)
    tokens, stats = run(tiny_dirs["target"], draft_engine("same", tiny_dirs), PROMPTS[0], GREEDY, True,
                        max_new_tokens=40, k=3)
    assert stats.pipeline_hits >= stats.cycles - 3 and len(seen) == stats.cycles
    first, *rest = seen
    assert first[5] == {"draft_steps": 3 + 1 + 3, "drafted_ahead": False, "beside": True}
    hits = [c for c in rest if c[5]["drafted_ahead"]]
    assert len(hits) == stats.pipeline_hits
    # A hit's block came ahead: its cycle drafted only its successor (the guess and 3 tokens), until
    # the budget leaves no room for one.
    assert all(c[5] == {"draft_steps": 4, "drafted_ahead": True, "beside": True} for c in hits[:-3])
    assert all((c[2] > 0) == (c[5]["draft_steps"] > 0) and c[3] >= 0 for c in seen)


class ScriptedProposer(NgramProposer):
    """Drafts the target's own greedy continuation, except a wrong token at the `wrong` positions,
    and nothing once the sequence has left that continuation: so some blocks are fully accepted
    with a right guess (hits), some with a wrong one (misses), and some are rejected (misses)."""

    name = "scripted"

    def __init__(self, reference: list[int], wrong: set[int]):
        super().__init__()
        self.reference = reference
        self.wrong = wrong

    def propose(self, state, token_ids, num_tokens, params):
        import torch

        from specdec.types import DraftBlock

        start = len(token_ids)
        if list(token_ids) != self.reference[:start]:
            return DraftBlock.empty()
        tokens = [(t + 1) % VOCAB if p in self.wrong else t
                  for p, t in enumerate(self.reference[start:start + num_tokens], start)]
        return DraftBlock(token_ids=torch.tensor(tokens, dtype=torch.long))


def test_a_wrong_guess_is_a_miss_and_never_verified(tiny_dirs):
    prompt = PROMPTS[0]
    plain, _ = run(tiny_dirs["target"], None, prompt, GREEDY, pipelining=False, max_new_tokens=60)
    reference = list(prompt) + plain
    wrong = set(random.Random(0).sample(range(len(prompt), len(reference)), len(plain) // 5))
    proposer = ScriptedProposer(reference, wrong)
    pipelined, stats = run(tiny_dirs["target"], DraftEngine(proposer), prompt, GREEDY, pipelining=True,
                           max_new_tokens=60, k=3)
    assert pipelined == plain
    # Replay the cycles: a block starts after each commit, a hit when it has no wrong token and the
    # position after it (the guess) is right, a miss otherwise; every block the target saw was
    # drafted on the committed sequence, so it got exactly its scripted acceptance.
    position, hits, misses, wrong_guesses, rejected_last = len(prompt) + 1, 0, 0, 0, 0
    while position < len(reference):
        remaining = len(reference) - position
        k = min(3, remaining - 1)
        speculated = remaining - (k + 1) - 1 > 0  # room for a child after a full acceptance
        rejected = next((p for p in range(position, position + k) if p in wrong), None)
        if speculated:
            hits += rejected is None and position + k not in wrong
            misses += rejected is not None or position + k in wrong
            wrong_guesses += rejected is None and position + k in wrong
            rejected_last += rejected == position + k - 1
        position = rejected + 1 if rejected is not None else position + k + 1
    assert (stats.pipeline_hits, stats.pipeline_misses) == (hits, misses)
    assert (stats.pipeline_wrong_guesses, stats.pipeline_rejected_last) == (wrong_guesses, rejected_last)
    assert wrong_guesses > 0 and rejected_last > 0
    assert hits > 0 and misses > 0


class FailingDraft(LocalDraft):
    """A draft whose speculative calls fail from the `speculative_from`-th on, and whose ordinary
    calls fail in the `ordinary_failures` range (0-based call counts)."""

    def __init__(self, engine, speculative_from: int, ordinary_failures: range):
        super().__init__(engine)
        self.speculative_from, self.ordinary_failures = speculative_from, ordinary_failures
        self.calls = {True: 0, False: 0}

    async def propose(self, *args, speculative=False, **kwargs):
        index = self.calls[speculative]
        self.calls[speculative] += 1
        if (index >= self.speculative_from) if speculative else (index in self.ordinary_failures):
            raise RuntimeError("draft down")
        return await super().propose(*args, speculative=speculative, **kwargs)


def test_a_failing_draft_never_fails_a_pipelined_request(tiny_dirs):
    """Failed speculative calls cost only pipelining; failed ordinary ones fall back to plain
    decoding (and speculation resumes later); the output is plain decoding's either way."""
    from specdec.generation.loop import SpeculativeLoop, start_generation

    prompt = PROMPTS[0]
    plain, _ = run(tiny_dirs["target"], None, prompt, GREEDY, pipelining=False, max_new_tokens=60)
    target = TargetEngine(model(tiny_dirs["target"]))
    draft = FailingDraft(draft_engine("same", tiny_dirs), speculative_from=3, ordinary_failures=range(2, 4))

    async def main():
        cursor, first = await start_generation(LocalTarget(target), "s", prompt, GREEDY)
        stop = StopChecker(60, ())
        stop.check([first])
        loop = SpeculativeLoop(LocalTarget(target), draft, LoopSettings(num_draft_tokens=3, pipelining=True,
                                                                        retry_draft_after=2))

        async def emit(tokens):
            pass

        result = await loop.run(cursor, stop, emit)
        return [first] + result.token_ids, result.stats

    tokens, stats = asyncio.run(main())
    assert tokens == plain
    assert draft.calls[True] > 3 and draft.calls[False] > 4  # failures happened, speculation went on
    assert stats.fallbacks == 2 and 0 < stats.pipeline_hits <= 3  # only the first 3 speculative calls worked


def test_the_full_acceptance_gate_stops_and_keeps_pipelining(tiny_dirs):
    """pipeline_min_full_accept: a draft that never has a block accepted whole (random weights)
    stops speculating after a few cycles; an identical one keeps pipelining. Output unchanged."""
    from specdec.generation.loop import SpeculativeLoop, start_generation

    def pipelined_cycles(kind: str, gate: float):
        target = TargetEngine(model(tiny_dirs["target"]))

        async def main():
            cursor, first = await start_generation(LocalTarget(target), "s", PROMPTS[0], GREEDY)
            stop = StopChecker(60, ())
            stop.check([first])
            settings = LoopSettings(num_draft_tokens=3, pipelining=True, pipeline_min_full_accept=gate)
            loop = SpeculativeLoop(LocalTarget(target), LocalDraft(draft_engine(kind, tiny_dirs)), settings)

            async def emit(tokens):
                pass

            result = await loop.run(cursor, stop, emit)
            return [first] + result.token_ids, result.stats

        return asyncio.run(main())

    plain, _ = run(tiny_dirs["target"], None, PROMPTS[0], GREEDY, pipelining=False, max_new_tokens=60)
    for kind, gate in (("random", 0.0), ("random", 0.5), ("same", 0.5)):
        tokens, stats = pipelined_cycles(kind, gate)
        assert tokens == plain
        attempts = stats.pipeline_hits + stats.pipeline_misses
        if kind == "same":
            assert stats.pipeline_misses == 0 and attempts >= stats.cycles - 2
        elif gate:  # 1.0 decays by 10% per cycle: below 0.5 from the 7th wholly rejected block on
            assert attempts == 7
        else:  # every cycle but the last few, where the budget leaves no room for a child
            assert attempts >= stats.cycles - 5


@pytest.mark.parametrize("flag, pipelining, gate, priced",
                         [("off", False, 0.0, False), ("on", True, 0.0, False), ("auto", True, 0.2, True)])
def test_coordinator_pipelining_flag(flag, pipelining, gate, priced):
    import argparse

    from coordinator.settings import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser, environ={})
    args = parser.parse_args(["--plaintext", "--tokenizer", "t", "--redis-url", "redis://x", "--target-plaintext",
                              "--draft-plaintext", "--pipelining", flag])
    settings = settings_from_args(args)
    assert (settings.pipelining, settings.pipelining_min_full_accept) == (pipelining, gate)
    assert settings.pipelining_priced is priced  # only auto prices speculative drafts (pipeline_price.py)
