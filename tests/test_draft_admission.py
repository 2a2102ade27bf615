"""More sessions drafting at once than the draft has KV slots: the ones without a slot decode without
the draft for a few cycles (the draft refuses with CacheFull, the coordinator falls back and retries)
instead of evicting a session in mid-turn. Before, the least recently used session lost its slot
whatever its age: with more active sessions than slots, every cycle of every session re-fed its
whole sequence to the draft (the target's own admission: test_target_admission.py)."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import grpc.aio
import pytest

from coordinator_harness import Reference, running_coordinator, tokens_of
from draft_service.client import DraftClient
from service_procs import launch, stop_all, wait_all
from specdec.engine.draft import DraftEngine
from specdec.errors import CacheFull, InvalidArgument
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.rpc import draft_pb2_grpc
from specdec.sampling.params import SamplingParams

CONTEXT = 256
PROMPT = [3, 4, 5, 6]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model_dirs(models):
    return {"target": models[0], "draft": models[1]}


def _engine(draft_dir, slots: int, evict_after_s: float = 0.0, clock=None) -> DraftEngine:
    model = load_model(draft_dir, backend="native", num_slots=slots, max_context=CONTEXT)
    kwargs = {"clock": clock} if clock else {}
    return DraftEngine(DraftModelProposer(model, evict_after_s=evict_after_s, **kwargs))


def _slot(engine: DraftEngine, session_id: str):
    return engine.sessions.peek(session_id).proposer_state.slot


def test_a_session_that_drafted_lately_keeps_its_slot(model_dirs):
    now = [0.0]
    engine = _engine(model_dirs["draft"], slots=2, evict_after_s=1.0, clock=lambda: now[0])
    roomy = _engine(model_dirs["draft"], slots=4)
    for e in (engine, roomy):
        for name in ("a", "b", "c"):
            e.start_session(name, PROMPT, GREEDY)
    engine.propose("a", len(PROMPT), [], 3)
    engine.propose("b", len(PROMPT), [], 3)
    now[0] = 0.5
    with pytest.raises(CacheFull, match="drafted in the last 1 s"):
        engine.propose("c", len(PROMPT), [], 3)
    assert _slot(engine, "a") is not None and _slot(engine, "b") is not None
    engine.propose("a", len(PROMPT), [], 3)  # a drafts again: b is the idle one now
    now[0] = 1.2  # b idle 1.2 s, a 0.7 s
    got = engine.propose("c", len(PROMPT), [], 3).block.token_ids.tolist()
    assert got == roomy.propose("c", len(PROMPT), [], 3).block.token_ids.tolist()
    assert engine.proposer.evictions == 1 and _slot(engine, "b") is None and _slot(engine, "a") is not None
    # b, evicted, drafts again once a slot is idle, from its re-fed sequence, as if never evicted.
    now[0] = 2.5
    got = engine.propose("b", len(PROMPT), [], 3).block.token_ids.tolist()
    assert got == roomy.propose("b", len(PROMPT), [], 3).block.token_ids.tolist()
    assert engine.proposer.evictions == 2


def test_a_session_between_turns_gives_its_draft_slot_up_at_once(model_dirs):
    """EndTurn: the slot of a session whose turn ended goes to a new session without waiting out
    --evict-after; drafting again keeps it again, and once evicted the session drafts from its
    re-fed sequence as if it had never lost its cache."""
    now = [0.0]
    engine = _engine(model_dirs["draft"], slots=1, evict_after_s=60.0, clock=lambda: now[0])
    roomy = _engine(model_dirs["draft"], slots=4)
    for e in (engine, roomy):
        for name in ("a", "b"):
            e.start_session(name, PROMPT, GREEDY)
    engine.propose("a", len(PROMPT), [], 3)
    assert not engine.end_turn("unknown")
    assert engine.end_turn("a") and engine.sessions.in_turn(1.0) == 1  # b, just started; a is between turns
    engine.propose("a", len(PROMPT), [], 3)  # a's next turn: the slot is kept again
    with pytest.raises(CacheFull):
        engine.propose("b", len(PROMPT), [], 3)
    assert engine.end_turn("a")
    got = engine.propose("b", len(PROMPT), [], 3).block.token_ids.tolist()  # 0 s later, evict_after 60 s
    assert got == roomy.propose("b", len(PROMPT), [], 3).block.token_ids.tolist()
    assert engine.proposer.evictions == 1 and _slot(engine, "a") is None
    assert engine.end_turn("b")
    got = engine.propose("a", len(PROMPT), [5], 3).block.token_ids.tolist()  # re-fed into b's slot
    assert got == roomy.propose("a", len(PROMPT), [5], 3).block.token_ids.tolist()


def test_without_evict_after_the_least_recently_used_session_is_evicted(model_dirs):
    """0 (a target's hosted draft, whose slots mirror the target's sessions): the old rule."""
    engine = _engine(model_dirs["draft"], slots=1)
    for name in ("a", "b"):
        engine.start_session(name, PROMPT, GREEDY)
        engine.propose(name, len(PROMPT), [], 2)
    assert engine.proposer.evictions == 1 and _slot(engine, "a") is None
    with pytest.raises(InvalidArgument, match="evict_after_s"):
        DraftModelProposer(engine.proposer.model, evict_after_s=-1.0)


@pytest.fixture(scope="module")
def services(model_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("draft-admission-logs")
    procs = {
        # No cycle pricing: a fresh target's would let one session of the three probe and the others
        # decode plainly, and these tests are of the draft's slots, which need them all drafting.
        "target": launch("target_service", ["--model", str(model_dirs["target"]), "--max-context", str(CONTEXT),
                                            "--num-slots", "8", "--test-delay-ms", "5", "--plaintext",
                                            "--draft-trimming", "step"], log_dir=logs),
        # One slot, kept a minute after each Propose: a second session in mid-turn can never take it.
        "draft": launch("draft_service", ["--model", str(model_dirs["draft"]), "--max-context", str(CONTEXT),
                                          "--num-slots", "1", "--evict-after", "60", "--plaintext"], log_dir=logs),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


async def test_sessions_past_the_draft_slots_decode_plainly_instead_of_thrashing(redis_url, model_dirs, services):
    reference = Reference(model_dirs["target"], CONTEXT)
    prompts = [f"Story number {i}." for i in range(3)]
    async with running_coordinator(redis_url, model_dirs["target"], [services["target"].address],
                                   [services["draft"].address], retry_draft_after=2) as c:
        answers = await asyncio.gather(*[c.generate(prompt=p, max_new_tokens=40, ignore_eos=True)
                                         for p in prompts])
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{c.host.metrics_port}/metrics", timeout=5).read().decode()
    for prompt, answer in zip(prompts, answers):
        assert tokens_of(answer) == reference.continuation(reference.prompt_ids(prompt), 40)
    stats = [answer[-1].stats for answer in answers]
    assert sum(s.cycles for s in stats) > 0, "one session at least drafted"
    assert sum(s.fallbacks for s in stats) > 0, "the others were refused the draft's one slot"
    assert 'reason="draft_full"' in metrics
    draft_metrics = services["draft"].metrics()
    evictions = next(float(line.split()[-1]) for line in draft_metrics.splitlines()
                     if line.startswith("specdec_draft_evictions_total"))
    # A session loses its slot only after its turn (EndTurn); thrashing evicts one every cycle.
    assert evictions < len(prompts), f"{evictions} draft evictions for {len(prompts)} sessions on one slot"


async def test_a_finished_turn_frees_its_draft_slot_for_the_next_session(redis_url, model_dirs, services):
    """The draft's one slot is kept 60 s after each Propose: only the coordinator's EndTurn at the end
    of a turn lets the next session draft (without it, every later session decodes plainly)."""
    reference = Reference(model_dirs["target"], CONTEXT)
    async with running_coordinator(redis_url, model_dirs["target"], [services["target"].address],
                                   [services["draft"].address], retry_draft_after=2) as c:
        answers = []
        for i in range(3):
            answers.append(await c.generate(prompt=f"Tale {i}.", max_new_tokens=30, ignore_eos=True))
    for i, answer in enumerate(answers):
        assert tokens_of(answer) == reference.continuation(reference.prompt_ids(f"Tale {i}."), 30)
        assert answer[-1].stats.cycles > 0, f"session {i} never drafted: the draft kept the last one's slot"


class _OlderDraft(draft_pb2_grpc.DraftServiceServicer):
    end_turn_calls = 0

    async def EndTurn(self, request, context):
        self.end_turn_calls += 1
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


async def test_a_draft_older_than_end_turn_is_asked_once():
    """EndTurn is best effort: a draft without it answers UNIMPLEMENTED, the client says not
    released, and does not ask that replica again (its slots are then kept for --evict-after)."""
    server, servicer = grpc.aio.server(), _OlderDraft()
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = DraftClient(channel, timeout_s=5.0)
            assert await client.end_turn("s") is False
            assert await client.end_turn("s") is False
        assert servicer.end_turn_calls == 1
    finally:
        await server.stop(None)
