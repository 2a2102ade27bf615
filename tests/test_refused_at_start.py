"""A session that starts while the target refuses drafts from elsewhere (cycle pricing,
specdec/engine/cycle_wall.py) is told so by StartSession (draft_limit 0), so its loop starts plain
and opens no draft session at all: the draft's prefill and the first Propose round trip were what
such a session still cost the loaded target (docs/BENCHMARKS.md). Once the refusal's window is over,
its plain steps say so and it probes. The output is plain decoding's either way.

The target is a real TargetService over gRPC in this process (so that the test can set the refusal
it would otherwise take a loaded machine to reach); the draft a real draft engine in process, or a
draft service in its own process behind a real coordinator."""

from __future__ import annotations

import pytest

from inprocess_target import hosted
from service_procs import tiny_model_dir
from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.proposers.draft_model import DraftModelProposer
from specdec.rpc import coordinator_pb2 as pb
from specdec.generation.loop import generate
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.sampling.params import SamplingParams
from target_service.servicer import TargetServicer

CONTEXT = 256
PROMPT = [3, 17, 42, 8, 99, 5]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)


class CountingDraft(LocalDraft):
    """A real draft engine that counts the draft sessions opened on it."""

    def __init__(self, engine: DraftEngine):
        super().__init__(engine)
        self.started: list[str] = []

    async def start_session(self, session_id, token_ids, params) -> None:
        self.started.append(session_id)
        await super().start_session(session_id, token_ids, params)


async def run(target, draft, session_id: str, new_tokens: int, adaptive: bool):
    async def emit(tokens):
        pass

    settings = LoopSettings(num_draft_tokens=4, adaptive=adaptive)
    return await generate(target, draft, session_id, PROMPT, SamplingParams(), StopChecker(new_tokens, ()), emit,
                          settings)


@pytest.mark.parametrize("adaptive", [False, True])
async def test_a_session_refused_at_start_opens_no_draft_and_probes_after_the_window(target_dir, adaptive):
    reference = TargetEngine(load_model(target_dir, backend="native", num_slots=2, max_context=CONTEXT))
    expected = {n: (await run(LocalTarget(reference), None, f"plain-{n}", n, adaptive)).token_ids for n in (24, 96)}
    draft_model = load_model(target_dir, backend="native", num_slots=4, max_context=CONTEXT)
    draft = CountingDraft(DraftEngine(DraftModelProposer(draft_model)))
    # Goodput trimming with cycle pricing, as the service runs by default.
    async with hosted(target_dir, TargetServicer, num_slots=4, max_context=CONTEXT, max_draft_tokens=8,
                      trim_drafts=True) as (target, servicer):
        pricing = servicer.trimmer.cycle_wall
        # As after a refusal on a loaded target: new sessions drafting elsewhere are refused for the
        # next 40 of its steps (the source "": this draft engine in process has no address).
        pricing._verdicts[""] = (pricing._steps, 40, 0)
        short = await run(target, draft, "short", 24, adaptive)
        assert short.token_ids == expected[24]
        assert draft.started == [] and short.stats.cycles == 0  # plain throughout, no draft session
        # A fresh window: refused for its 40 steps; after them its plain steps allow a probe and it
        # drafts: the draft session opens then, and the identical draft pays.
        pricing._verdicts[""] = (pricing._steps, 40, 0)
        long = await run(target, draft, "long", 96, adaptive)
        assert long.token_ids == expected[96]
        assert draft.started == ["long"] and long.stats.cycles > 0
        # A session that starts once the window is over drafts at once.
        assert pricing._inherited_refusal("") == 0
        later = await run(target, draft, "later", 24, adaptive)
        assert later.token_ids == expected[24] and draft.started[-1] == "later"
        assert later.stats.cycles > later.stats.decode_steps
    assert pricing.refusals == 0  # no verdict was reached here: only the one set above


async def test_through_the_coordinator_a_refused_session_never_touches_the_draft_service(
        target_dir, redis_url, tmp_path_factory):
    """The coordinator's turn says at StartSession that its drafts come from the draft service, reads
    the answer and starts plain; the answer is plain decoding's. The draft prefills a new session's
    prompt beside the target (draft_opening.py) unless the route's last new session was refused: the
    first refused session's prefill is the price of learning that, the next one prefills nothing."""
    from coordinator_harness import Reference, expected, running_coordinator, tokens_of
    from service_procs import start_service
    from specdec.server.tokenizer_info import tokenizer_facts

    reference = Reference(target_dir, CONTEXT)
    prompt = "Count with me:"
    want = expected(reference, reference.prompt_ids(prompt), 20)
    draft_service = start_service("draft_service", ["--model", str(target_dir), "--plaintext", "--max-context",
                                                    str(CONTEXT)], log_dir=tmp_path_factory.mktemp("refused-logs"))
    try:
        # The tokenizer's facts, as the service reports them: the coordinator pairs a draft only with a
        # target whose vocabulary it knows to match.
        async with hosted(target_dir, TargetServicer, num_slots=4, max_context=CONTEXT, max_draft_tokens=8,
                          trim_drafts=True, tokenizer=tokenizer_facts(target_dir)) as (_, servicer):
            pricing = servicer.trimmer.cycle_wall
            async with running_coordinator(redis_url, target_dir, [servicer.test_address],
                                           [draft_service.address]) as c:
                # A refusal of another draft source says nothing of this one: the session drafts.
                pricing._verdicts["other-draft:50053"] = (pricing._steps, 1000, 0)
                other = await c.generate(prompt=prompt, max_new_tokens=20)
                # Its own source refused (for longer than the test): plain from the start.
                pricing._verdicts[draft_service.address] = (pricing._steps, 1000, 0)
                first_refused = await c.generate(prompt=prompt, max_new_tokens=20)
                prefills_before = _prefills(draft_service)
                messages = await c.generate(prompt=prompt, max_new_tokens=20)
                prefills_after = _prefills(draft_service)
    finally:
        draft_service.stop()
    assert tokens_of(other) == want and other[-1].stats.cycles > 0 and prefills_before >= 1
    assert tokens_of(first_refused) == want and first_refused[-1].stats.cycles == 0
    assert tokens_of(messages) == want
    stats = messages[-1].stats
    assert stats.pool == pb.POOL_SPECULATIVE and stats.cycles == 0 and stats.decode_steps == len(want) - 1
    assert prefills_after == prefills_before  # no draft session opened


def _prefills(service) -> float:
    """StartSession calls the draft service has served (its prefill steps)."""
    return sum(float(line.split()[-1]) for line in service.metrics().splitlines()
               if line.startswith("specdec_draft_step_seconds_count") and 'step="prefill"' in line)


async def test_start_sessions_waiting_for_their_prefill_are_counted_as_load(target_dir):
    """The cycle pricing hears how many StartSessions wait for their prefill (the rows the next steps
    will carry, which no result shows yet): the count includes each one until its prefill is done, and
    then it counts as prefilled until its first step."""
    import asyncio
    import time

    async with hosted(target_dir, TargetServicer, num_slots=4, max_context=CONTEXT, trim_drafts=True) as (
            target, servicer):
        pricing = servicer.trimmer.cycle_wall
        assert pricing.starting() == 0
        seen: list[int] = []
        prefill = servicer.engine.start_session

        def counting_prefill(*args, **kwargs):  # on the model thread: the first waits for all three
            deadline = time.monotonic() + 10.0
            while not seen and pricing.starting() < 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            seen.append(pricing.starting())
            return prefill(*args, **kwargs)

        servicer.engine.start_session = counting_prefill
        await asyncio.gather(*(target.start_session(f"s{i}", PROMPT, SamplingParams(), drafts_elsewhere=True)
                               for i in range(3)))
        assert seen[0] == 3 and len(seen) == 3 and seen[-1] >= 1
        assert pricing.starting() == 0
        assert pricing.load(time.perf_counter()) == 3  # prefilled, none stepped yet: still load
