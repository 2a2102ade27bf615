"""The adaptive draft length of drafts made inside the target (DecodeStream's adaptive_draft_length,
specdec.generation.inner_adaptive; the fixed rule: specdec.engine.inner_length): the stream's own
policy lengthens the drafts of a draft that is always right, switches a draft that is never right off
(re-probing now and then), and the output stays plain decoding's token for token (greedy and
Gumbel-coupled sampling), alone and concurrently, with the trimmer in the step."""

from __future__ import annotations

import asyncio
import functools

import pytest

from specdec.engine.batcher import Batcher
from specdec.engine.draft import DraftEngine
from specdec.engine.goodput import DraftTrimmer, run_trimmed_batch
from specdec.engine.inner_draft import LookupDrafter, ModelDrafter, run_inner_step
from specdec.engine.inner_length import DraftLength
from specdec.generation.inner_adaptive import AdaptiveDraftLength
from specdec.engine.target_stream import decode_step_stream
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.server.executor import ModelExecutor
from specdec.types import DraftBlock, VerifyOutcome

import batching_helpers
from batching_helpers import CONTEXT, one_thread, tiny_dir  # noqa: F401 (module fixtures)

GREEDY = SamplingParams()
GUMBEL = SamplingParams(temperature=1.0, top_p=0.9, seed=11, mode=SamplingMode.GUMBEL)
PROMPTS = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [3, 4, 3, 4, 3, 4, 3], [50, 60, 70, 50, 60, 70, 50], [1, 2, 3, 4, 5, 6]]
TOKENS = 60


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A draft with other random weights: it almost never drafts the target's token."""
    from specdec.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("other") / "draft", vocab_size=256, seed=5)


def plain(path, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    engine = batching_helpers.target_engine(path, 2)
    _, first = engine.start_session("s", prompt, params)
    return [first] + engine.decode("s", len(prompt) + 1, n - 1)


def run_streams(target_dir, draft_dir, params: SamplingParams, prompts, max_tokens: int = 8, adaptive: bool = True):
    """Streams of TOKENS tokens drafted by the hosted draft model, concurrently; (tokens, steps) each."""
    engine = batching_helpers.target_engine(target_dir, 8)
    drafts = DraftEngine(DraftModelProposer(load_model(draft_dir, backend="native", num_slots=8, max_context=CONTEXT)))
    executor = ModelExecutor("test-inner-length")
    batcher = Batcher(executor, functools.partial(run_inner_step, engine, DraftTrimmer(), drafts))

    async def stream(session_id: str, prompt: list[int]):
        _, first = engine.start_session(session_id, prompt, params)
        drafter = ModelDrafter(params, lambda: engine.sessions.peek(session_id).tokens, max_tokens,
                               length=AdaptiveDraftLength(max_tokens) if adaptive else None)
        steps = [s async for s in decode_step_stream(batcher, session_id, len(prompt) + 1, TOKENS - 1,
                                                     drafter=drafter)]
        return [first] + [t for s in steps for t in s.tokens], steps

    async def main():
        try:
            return await asyncio.gather(*(stream(f"a{i}", p) for i, p in enumerate(prompts)))
        finally:
            await batcher.aclose()

    try:
        return asyncio.run(main())
    finally:
        executor.shutdown(wait=False)


@pytest.mark.parametrize("params", [GREEDY, GUMBEL], ids=["greedy", "gumbel"])
def test_adaptive_streams_drafted_by_the_hosted_model_are_plain_decoding(tiny_dir, params):
    """The target as its own draft (every drafted token accepted, but a draft token costs a target
    step, so the policy soon finds plain decoding as good): whatever lengths it picks, concurrently,
    the output is plain decoding's."""
    for prompt, (tokens, steps) in zip(PROMPTS, run_streams(tiny_dir, tiny_dir, params, PROMPTS)):
        assert tokens == plain(tiny_dir, prompt, params, TOKENS)
        assert sum(s.outcome.num_accepted for s in steps if s.outcome) > 0


def simulate(confidence: float, accepted: bool, steps: int = 60) -> list[int]:
    """The policy's side, with costs given: a draft token costs 5% of a 40 ms target step, a verify
    grows 3% a token; each drafted token has `confidence` and all or none are accepted. The drafted
    length of each step (0: plain), the draft's confidence stop applied as the draft model does."""
    length = AdaptiveDraftLength(8)
    lengths = []
    for _ in range(steps):
        k, stop_below = length.next(100, confidences=True)
        if k == 0:
            lengths.append(0)
            length.plain(0.040)
            continue
        drafted, survival = 0, 1.0
        while drafted < k and not survival < stop_below:
            drafted, survival = drafted + 1, survival * confidence
        lengths.append(drafted)
        outcome = VerifyOutcome(0, drafted, drafted if accepted else 0, 1)
        length.kept(k, k, drafted, outcome)
        length.verified(_block(drafted, (confidence,) * drafted), outcome, 0.002 * drafted, 0.040 * (1 + 0.03 * drafted))
    return lengths


def test_a_cheap_draft_that_is_always_right_drafts_longer_than_it_started():
    """After the warm-up at 4 (and one plain step that measures plain decoding) the length grows to
    the most allowed and stays there."""
    lengths = simulate(0.99, accepted=True)
    assert lengths[:4] == [4, 4, 4, 0] and set(lengths[4:]) == {8}


def test_a_draft_that_is_never_right_drafts_little_and_is_switched_off():
    """Its confidence stop cuts blocks to one token, the policy switches it off, and re-probes."""
    lengths = simulate(0.3, accepted=False, steps=120)
    assert lengths[-90:].count(0) >= 60 and sum(lengths[-90:]) <= 30  # a fixed k = 8: 720 tokens
    assert any(lengths[-90:])  # re-probed


@pytest.mark.parametrize("params", [GREEDY, GUMBEL], ids=["greedy", "gumbel"])
def test_a_never_right_draft_is_switched_off_and_the_output_is_plain_decoding(tiny_dir, other_dir, params):
    """Another random model as the draft: its tokens are rejected, so after the warm-up most steps
    are plain (drafting only to re-probe); the output is plain decoding's."""
    fixed = run_streams(tiny_dir, other_dir, params, PROMPTS[:2], adaptive=False)
    adaptive = run_streams(tiny_dir, other_dir, params, PROMPTS[:2])
    for prompt, (tokens, steps), (fixed_tokens, fixed_steps) in zip(PROMPTS, adaptive, fixed):
        assert tokens == fixed_tokens == plain(tiny_dir, prompt, params, TOKENS)
        drafted = sum(s.outcome.num_drafted for s in steps if s.outcome)
        accepted = sum(s.outcome.num_accepted for s in steps if s.outcome)
        assert drafted - accepted < 0.5 * sum(s.outcome.num_drafted - s.outcome.num_accepted for s in fixed_steps if s.outcome)
        plain_steps = [s for s in steps[1:] if not s.outcome or not s.outcome.num_drafted]
        assert len(plain_steps) > len(steps) // 2
        # Each says why: here mostly the stream's own policy, which switched the draft off.
        assert all(s.plain_reason for s in plain_steps)
        assert sum(s.plain_reason in ("length_rule", "both") for s in plain_steps) > len(plain_steps) // 2


def test_a_fixed_length_is_cut_by_the_trimming_then_restored():
    """Fixed: what the trimmer kept of the last draft, then its draft_limits; never past the room."""
    limit = {"now": None}
    length = DraftLength(4, lambda: limit["now"])
    assert length.next(10) == (4, 0.0)
    length.kept(4, 4, 4, VerifyOutcome(7, 2, 1, 0))  # the trimmer kept 2 of 4
    assert length.next(10) == (2, 0.0)
    length.kept(4, 2, 2, VerifyOutcome(7, 2, 2, 0))  # planned 2 of 4: still cut
    assert length.next(10) == (2, 0.0)
    length.kept(4, 4, 4, VerifyOutcome(7, 4, 4, 0))  # all of it kept
    limit["now"] = 0
    assert length.next(10) == (0, 0.0) and length.plain_reason == "trimmer"
    limit["now"] = None
    assert length.next(3) == (3, 0.0) and length.plain_reason is None
    assert length.next(0) == (0, 0.0) and length.plain_reason == "budget"


def test_why_a_step_is_plain():
    """The trimmer's limit, the stream's own rule, both, or no room (the metric's why label)."""
    from specdec.engine.inner_length import why_plain

    assert why_plain(room=10, allowed=3, wanted=2) is None
    assert why_plain(room=10, allowed=0, wanted=2) == "trimmer"
    assert why_plain(room=10, allowed=3, wanted=0) == "length_rule"
    assert why_plain(room=10, allowed=0, wanted=0) == "both"
    assert why_plain(room=0, allowed=0, wanted=4) == "budget"


def test_a_confidence_stop_is_not_taken_for_trimming():
    """A draft model's block that stopped by its confidence is shorter than asked, but nothing was
    trimmed: the next draft may be as long as the policy wants."""
    length = AdaptiveDraftLength(6)
    length.kept(6, 6, 3, VerifyOutcome(7, 3, 3, 0))
    assert length._kept is None
    length.kept(6, 6, 3, VerifyOutcome(7, 2, 1, 0))  # 3 drafted, 2 kept: trimmed
    assert length.next(10)[0] <= 2


def test_an_adaptive_lookup_stream_is_plain_decoding(tiny_dir):
    """Lookup drafts with the adaptive length, the trimmer in the step: plain decoding's tokens."""
    engine = batching_helpers.target_engine(tiny_dir, 8)
    executor = ModelExecutor("test-inner-length-lookup")
    batcher = Batcher(executor, functools.partial(run_trimmed_batch, engine, DraftTrimmer()))

    async def stream(session_id: str, prompt: list[int]):
        _, first = engine.start_session(session_id, prompt, GREEDY)
        drafter = LookupDrafter(lambda: engine.sessions.peek(session_id).tokens, 8, length=AdaptiveDraftLength(8))
        steps = [s async for s in decode_step_stream(batcher, session_id, len(prompt) + 1, TOKENS - 1,
                                                     drafter=drafter)]
        return [first] + [t for s in steps for t in s.tokens]

    async def main():
        try:
            return await asyncio.gather(*(stream(f"l{i}", p) for i, p in enumerate(PROMPTS)))
        finally:
            await batcher.aclose()

    got = asyncio.run(main())
    executor.shutdown(wait=False)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == plain(tiny_dir, prompt, GREEDY, TOKENS)


def _block(n: int, confidences: tuple[float, ...] = ()) -> DraftBlock:
    import torch

    return DraftBlock(torch.arange(n, dtype=torch.int64), confidences=confidences)


def test_an_adaptive_stream_starts_from_what_earlier_streams_of_its_drafter_measured():
    """The target's adaptive streams share estimates as the coordinator's turns do: a stream adds its
    policy's estimates every absorb_every drafted steps; the next one starts at the length they make
    best (short here: half the drafted tokens are wrong), not at 4 for a warm-up."""
    from specdec.generation.shared_estimates import SharedEstimates

    shared = SharedEstimates(absorb_every=8)
    first = AdaptiveDraftLength(8, shared=shared)
    first.plain(0.040)
    for _ in range(16):
        k, _ = first.next(100)
        k = k or 4  # the exploring plain steps aside, every step drafts
        outcome = VerifyOutcome(0, k, min(1, k), 1)  # the first token accepted, the second not
        first.kept(k, k, k, outcome)
        first.verified(_block(k, ()), outcome, 0.004 * k, 0.040 * (1 + 0.03 * k))
    assert shared.absorbed == 2
    second = AdaptiveDraftLength(8, shared=shared)
    assert second.policy.cycles == second.policy.warmup_cycles
    assert 0 < second.next(100)[0] < 4
    assert AdaptiveDraftLength(8).next(100)[0] == 4  # cold: the warm-up length
