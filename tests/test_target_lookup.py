"""Drafts made inside the target (DecodeStream's lookup_draft_tokens and model_draft_tokens), in
process: the streamed steps draft from the session's own tokens (or the hosted draft model, inside
the batched step) and verify in that step; the output is plain decoding's token for token (greedy,
and Gumbel-coupled sampling), its distribution plain sampling's (a chi-square test against the exact
distribution on an 8-token vocabulary), it keeps the budget, ends right after a stop token, and the
goodput trimmer may cut its drafts without changing it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random

import pytest
import torch
from scipy import stats

from specdec.engine.batch import run_target_batch
from specdec.engine.batcher import Batcher
from specdec.engine.goodput import DraftTrimmer, run_trimmed_batch
from specdec.engine.target import TargetEngine
from specdec.engine.draft import DraftEngine
from specdec.engine.inner_draft import InnerDraftWork, LookupDrafter, ModelDrafter, run_inner_step
from specdec.engine.target_lookup import LookupIndex
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.engine.target_stream import decode_step_stream
from specdec.models.loader import load_model
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.warp import warp_logits
from specdec.server.executor import ModelExecutor
from specdec.types import VerifyOutcome

import batching_helpers
from batching_helpers import CONTEXT, one_thread, tiny_dir  # noqa: F401 (module fixtures)

GREEDY = SamplingParams()
GUMBEL = SamplingParams(temperature=1.0, top_p=0.9, seed=11, mode=SamplingMode.GUMBEL)
# Repetitive prompts, so that lookup finds continuations from the first step on.
PROMPTS = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [3, 4, 3, 4, 3, 4, 3], [50, 60, 70, 50, 60, 70, 50], [1, 2, 3, 4, 5, 6]]


def lookup_for(engine: TargetEngine, session_id: str, max_tokens: int, stops=frozenset()):
    """What the target service passes decode_step_stream for lookup_draft_tokens = max_tokens."""
    return LookupDrafter(lambda: engine.sessions.peek(session_id).tokens, max_tokens, stops)


def plain(path, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    engine = batching_helpers.target_engine(path, 2)
    _, first = engine.start_session("s", prompt, params)
    return [first] + engine.decode("s", len(prompt) + 1, n - 1)


async def streamed(engine: TargetEngine, batcher: Batcher, session_id: str, prompt: list[int],
                   params: SamplingParams, n: int, k: int, stops=()) -> tuple[list[int], list]:
    """The first token, then n - 1 tokens streamed with lookup drafts of up to k; and the steps."""
    _, first = engine.start_session(session_id, prompt, params)
    steps = [step async for step in decode_step_stream(
        batcher, session_id, len(prompt) + 1, n - 1, stop_token_ids=stops,
        drafter=lookup_for(engine, session_id, k, frozenset(stops)))]
    return [first] + [t for step in steps for t in step.tokens], steps


@pytest.fixture
def served(tiny_dir):
    """A target engine behind a batcher, with the goodput trimmer (as the service runs it)."""
    engine = batching_helpers.target_engine(tiny_dir, 8)
    executor = ModelExecutor("test-lookup")
    trimmer = DraftTrimmer()
    batcher = Batcher(executor, functools.partial(run_trimmed_batch, engine, trimmer))
    yield engine, batcher, trimmer  # each test closes the batcher on its own loop
    executor.shutdown(wait=False)


def test_the_lookup_index_drafts_what_the_ngram_proposer_drafts():
    """Grown token by token (as a stream commits) and at once, on sequences with many repeats, short
    lookback windows included: every draft equals NgramProposer.propose's."""
    rng = random.Random(3)
    for trial in range(40):
        proposer = NgramProposer(max_ngram=rng.choice([1, 2, 3, 4]), max_lookback=rng.choice([6, 16, 4096]))
        tokens = [rng.randrange(rng.choice([3, 6, 20])) for _ in range(rng.randrange(1, 80))]
        grown, whole = LookupIndex(proposer), LookupIndex(proposer)
        whole.sync(tokens)
        for length in range(1, len(tokens) + 1):
            grown.sync(tokens[:length])
            k = rng.randrange(0, 6)
            expected = proposer.propose(None, tokens[:length], k, GREEDY).token_ids.tolist()
            assert grown.draft(k).token_ids.tolist() == expected, (trial, length)
        assert whole.draft(4).token_ids.tolist() == grown.draft(4).token_ids.tolist()


def test_a_lookup_draft_stops_before_a_stop_token_and_at_its_room():
    index = LookupIndex()
    index.sync([5, 6, 7, 8, 5, 6])
    assert index.draft(4).token_ids.tolist() == [7, 8, 5, 6]
    assert index.draft(2).token_ids.tolist() == [7, 8]
    assert index.draft(4, stop_token_ids={8}).token_ids.tolist() == [7]
    assert index.draft(4, stop_token_ids={7}).num_tokens == 0
    assert index.draft(0).num_tokens == 0
    index.sync([1, 2, 3])  # not a continuation of what it indexed: indexed afresh
    assert index.draft(4).num_tokens == 0  # nothing repeats: no draft


def test_a_drafter_drafts_no_more_than_the_trimming_would_verify():
    """Under load the target's trimmer says what it would verify for a session (draft_limits after a
    plain step, the kept length after a trimmed verify): the drafter drafts no more than that."""
    tokens = [5, 6, 7, 8, 9, 5, 6]
    limit = {"now": None}
    drafter = LookupDrafter(lambda: tokens, 4, limit=lambda: limit["now"])
    work = drafter.work("s", 7, 10)
    assert work.draft.token_ids.tolist() == [7, 8, 9, 5]  # no limit known: all 4
    drafter.verified(work, VerifyOutcome(7, 2, 1, 0))  # the trimmer kept 2 of the 4
    work = drafter.work("s", 7, 10)
    assert work.draft.num_tokens == 2
    drafter.verified(work, VerifyOutcome(7, 2, 2, 0))  # not trimmed: the limit applies again
    limit["now"] = 0  # after a plain step: a draft would be cut entirely
    assert drafter.work("s", 7, 10) is None and drafter.plain_reason == "trimmer"  # a plain step
    limit["now"] = 3
    assert drafter.work("s", 7, 2).draft.num_tokens == 2  # and never past the room
    assert drafter.plain_reason is None
    unrepeated = LookupDrafter(lambda: [1, 2, 3], 4)
    assert unrepeated.work("s", 3, 10) is None and unrepeated.plain_reason == "no_draft"  # nothing repeats


@pytest.mark.parametrize("params", [GREEDY, GUMBEL], ids=["greedy", "gumbel"])
async def test_concurrent_lookup_streams_are_plain_decoding_token_for_token(tiny_dir, served, params):
    engine, batcher, trimmer = served
    n = 40
    got = await asyncio.gather(*(streamed(engine, batcher, f"s{i}", prompt, params, n, k=4)
                                 for i, prompt in enumerate(PROMPTS)))
    await batcher.aclose()
    for prompt, (tokens, steps) in zip(PROMPTS, got):
        assert tokens == plain(tiny_dir, prompt, params, n)
        for step in steps:  # a step's tokens are its accepted draft and the next token
            if step.outcome is not None:
                assert len(step.tokens) == step.outcome.num_accepted + 1 <= 5
            else:
                assert len(step.tokens) == 1
    drafted = sum(s.outcome.num_drafted for _, steps in got for s in steps if s.outcome)
    accepted = sum(s.outcome.num_accepted for _, steps in got for s in steps if s.outcome)
    assert drafted > 0 and accepted > 0  # lookup drafted, and some of it was right
    assert sum(len(steps) for _, steps in got) < len(PROMPTS) * (n - 1)  # fewer steps than tokens


async def test_a_lookup_stream_keeps_its_budget_and_ends_right_after_a_stop_token(tiny_dir, served):
    engine, batcher, _ = served
    prompt = PROMPTS[1]
    reference = plain(tiny_dir, prompt, GREEDY, 30)
    for n in (2, 3, 7, 30):
        tokens, _ = await streamed(engine, batcher, f"n{n}", prompt, GREEDY, n, k=6)
        assert tokens == reference[:n] and engine.committed_tokens(f"n{n}") == prompt + tokens
    stop = reference[12]
    tokens, steps = await streamed(engine, batcher, "stop", prompt, GREEDY, 30, k=6, stops=[stop])
    await batcher.aclose()
    cut = reference.index(stop, 1) + 1
    assert tokens == reference[:cut] and engine.committed_tokens("stop") == prompt + tokens
    assert all(stop not in s.tokens[:-1] for s in steps)  # a stop token only ever ends a step


@pytest.mark.parametrize("params,margin", [(GREEDY, 0.0), (GUMBEL, 0.0), (GREEDY, 10.0)],
                         ids=["greedy", "gumbel", "all-cut"])
def test_concurrent_streams_drafted_by_a_hosted_model_are_plain_decoding(tiny_dir, params, margin):
    """model_draft_tokens in process: every stream's draft is made inside the batched step, the rows
    of a step drafted in one pass (run_inner_step); the target as its own draft, so drafts are
    accepted and steps carry several tokens; the output is plain decoding's token for token."""
    engine = batching_helpers.target_engine(tiny_dir, 8)
    drafts = DraftEngine(DraftModelProposer(load_model(tiny_dir, backend="native", num_slots=8, max_context=CONTEXT)))
    executor = ModelExecutor("test-inner")
    inner_rows = []
    trimmer = DraftTrimmer(margin=margin)
    if margin:  # a step cost fitted already, and a margin no draft can meet: every row is planned plain
        for n in range(1, 21):
            trimmer.cost.observe(n, 0.01 + 0.001 * n)
    batcher = Batcher(executor, functools.partial(run_inner_step, engine, trimmer, drafts),
                      on_step=lambda works, results, s: inner_rows.append(sum(isinstance(w, InnerDraftWork)
                                                                              for w in works)))

    async def stream(session_id: str, prompt: list[int]):
        _, first = engine.start_session(session_id, prompt, params)
        drafter = ModelDrafter(params, lambda: engine.sessions.peek(session_id).tokens, 3)
        steps = [s async for s in decode_step_stream(batcher, session_id, len(prompt) + 1, 29, drafter=drafter)]
        return [first] + [t for s in steps for t in s.tokens], steps

    async def main():
        try:
            return await asyncio.gather(*(stream(f"m{i}", p) for i, p in enumerate(PROMPTS)))
        finally:
            await batcher.aclose()

    got = asyncio.run(main())
    executor.shutdown(wait=False)
    for prompt, (tokens, steps) in zip(PROMPTS, got):
        assert tokens == plain(tiny_dir, prompt, params, 30)
        if margin:  # planned plain before drafting: the draft model never ran, not even to open a session
            assert len(drafts.sessions) == 0 and all(not s.outcome or not s.outcome.num_drafted for s in steps)
            continue
        assert sum(s.outcome.num_accepted for s in steps if s.outcome) > 0 and len(steps) < 29
        assert all(s.draft_cost.model_ns > 0 for s in steps if s.outcome and s.outcome.num_drafted)
    assert max(inner_rows) > 1  # sessions drafted (or were planned) together, in one step


def test_trimmed_lookup_drafts_change_nothing(tiny_dir):
    """Under load the trimmer cuts lookup drafts (here: every drafted token, by a huge margin)."""
    engine = batching_helpers.target_engine(tiny_dir, 8)
    executor = ModelExecutor("test-lookup-trim")
    trimmer = DraftTrimmer(margin=10.0)
    trimmer.cost.observe(1, 0.01), trimmer.cost.observe(8, 0.05)
    for _ in range(10):
        trimmer.cost.observe(2, 0.02), trimmer.cost.observe(6, 0.04)
    batcher = Batcher(executor, functools.partial(run_trimmed_batch, engine, trimmer))

    async def main():
        try:
            return await asyncio.gather(*(streamed(engine, batcher, f"t{i}", p, GREEDY, 24, k=4)
                                          for i, p in enumerate(PROMPTS)))
        finally:
            await batcher.aclose()

    got = asyncio.run(main())
    executor.shutdown(wait=False)
    assert trimmer.trimmed_tokens > 0
    for prompt, (tokens, _) in zip(PROMPTS, got):
        assert tokens == plain(tiny_dir, prompt, GREEDY, 24)


VOCAB = 8
SAMPLES = 3000
SAMPLED = dict(temperature=2.0, top_k=0, top_p=1.0)  # flat enough for drafts to be accepted and rejected
STATS_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 5, 0, 0, 0, 2, 5, 7, 2, 5]  # every token has a continuation


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    from specdec.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lookup-stats") / "target", vocab_size=VOCAB, seed=3,
                           tokenizer=False)


def test_sampled_lookup_streams_follow_the_targets_distribution(small_vocab):
    """Tokens 2-4 of SAMPLES seeded sessions (the 3rd and 4th from steps that verify lookup drafts)
    against the exact distribution of plain sampling enumerated from the model, given the first
    token (plain sampling in both): a chi-square test over the 512 sequences, small cells pooled."""
    params = [SamplingParams(seed=i, **SAMPLED) for i in range(SAMPLES)]
    engine = TargetEngine(load_model(small_vocab, backend="native", num_slots=SAMPLES, max_context=32))
    executor = ModelExecutor("test-lookup-stats")
    batcher = Batcher(executor, functools.partial(run_target_batch, engine), max_batch_size=SAMPLES)

    async def main():
        try:
            return await asyncio.gather(*(streamed(engine, batcher, f"r{i}", STATS_PROMPT, p, 4, k=3)
                                          for i, p in enumerate(params)))
        finally:
            await batcher.aclose()

    got = asyncio.run(main())
    executor.shutdown(wait=False)
    outcomes = [s.outcome for _, steps in got for s in steps if s.outcome]
    accepted, drafted = sum(o.num_accepted for o in outcomes), sum(o.num_drafted for o in outcomes)
    assert SAMPLES // 20 < accepted < drafted  # both paths of verification ran, many times

    reference = TargetEngine(load_model(small_vocab, backend="native", num_slots=1, max_context=32))

    @functools.lru_cache(maxsize=None)
    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        reference.start_session("p", list(prefix), params[0], sample_first_token=False)
        logits = reference._forward(reference.sessions.get("p"), [], num_logits=1)[-1]
        reference.end_session("p")
        return warp_logits(logits, params[0])  # the probabilities plain sampling draws from

    by_first: dict[int, list[tuple[int, ...]]] = {}
    for tokens, _ in got:
        by_first.setdefault(tokens[0], []).append(tuple(tokens[1:]))
    for first, seqs in sorted(by_first.items(), key=lambda kv: -len(kv[1]))[:2]:
        head = tuple(STATS_PROMPT) + (first,)
        exact = {seq: float(probs(head)[seq[0]] * probs(head + seq[:1])[seq[1]] * probs(head + seq[:2])[seq[2]])
                 for seq in itertools.product(range(VOCAB), repeat=3)}
        n = len(seqs)
        big = [seq for seq in exact if exact[seq] * n >= 5]
        small = [seq for seq in exact if exact[seq] * n < 5]
        f_obs = [seqs.count(seq) for seq in big] + [sum(seqs.count(seq) for seq in small)]
        f_exp = [exact[seq] * n for seq in big] + [sum(exact[seq] for seq in small) * n]
        f_exp[-1] += n - sum(f_exp)  # float rounding: both sum to n
        assert stats.chisquare(f_obs, f_exp).pvalue > 1e-3, (first, n)
