"""More sessions in mid-turn than a target has KV slots: the ones without a slot wait for one (the
target refuses with CacheFull, the coordinator retries) instead of evicting sessions that return
next cycle. Before, LRU evicted exactly the session needed next, and every cycle re-prefilled one:
throughput fell several-fold past --num-slots concurrent sessions (a launched default pair: 56 tok/s
at 8 sessions, 9 at 20). With another replica that has room, the session goes there instead of waiting."""

from __future__ import annotations

import asyncio

import pytest

from coordinator_harness import Reference, read_some, request, running_coordinator, tokens_of
from service_procs import launch, stop_all, wait_all
from specdec.engine.target import TargetEngine
from specdec.errors import CacheFull
from specdec.models.loader import load_model
from specdec.sampling.params import SamplingParams

CONTEXT = 256
SLOTS = 2
SESSIONS = 5
TOKENS = 40


@pytest.fixture(scope="module")
def target_dir(models):
    return models[0]


def test_a_session_used_lately_keeps_its_slot(target_dir):
    now = [0.0]
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=SLOTS, max_context=CONTEXT),
                          clock=lambda: now[0], evict_after_s=1.0)
    for name in ("a", "b"):
        engine.start_session(name, [3, 4, 5], SamplingParams())
    now[0] = 0.5
    with pytest.raises(CacheFull, match="used in the last 1 s"):
        engine.start_session("c", [3, 4, 5], SamplingParams())
    engine.decode("a", 4, 1)  # a is used again: b is now the least recently used
    now[0] = 1.2  # b unused for 1.2 s, a for 0.7 s
    engine.start_session("c", [3, 4, 5], SamplingParams())
    assert engine.evictions == 1 and engine.sessions.peek("b").slot is None
    assert engine.sessions.peek("a").slot is not None


def test_a_session_between_turns_gives_its_slot_up_at_once(target_dir):
    """EndTurn: a session whose turn ended is evicted for a new one without waiting out
    --evict-after; its next call keeps its slot again, and after an eviction it re-feeds its tokens
    and continues exactly as if it had never lost its cache."""
    now = [0.0]
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=SLOTS, max_context=CONTEXT),
                          clock=lambda: now[0], evict_after_s=60.0)
    reference = TargetEngine(load_model(target_dir, backend="native", num_slots=4, max_context=CONTEXT))
    for e in (engine, reference):
        for name in ("a", "b"):
            e.start_session(name, [3, 4, 5], SamplingParams())  # prompt + first token: position 4
    assert not engine.end_turn("a", 3) and not engine.end_turn("unknown", 4)  # wrong position: kept
    assert engine.end_turn("a", 4)
    now[0] = 0.5
    assert engine.sessions.in_turn(1.0) == 1  # b; a's turn is over (the load the registry gets)
    now[0] = 2.0
    assert engine.sessions.in_turn(1.0) == 0  # b unused for 2 s: between turns too
    engine.decode("a", 4, 1)  # a's next turn: its slot is kept again
    reference.decode("a", 4, 1)
    with pytest.raises(CacheFull):
        engine.start_session("c", [3, 4, 5], SamplingParams())
    assert engine.end_turn("a", 5)
    engine.start_session("c", [3, 4, 5], SamplingParams())  # 0 s later, evict_after 60 s
    assert engine.evictions == 1 and engine.sessions.peek("a").slot is None
    assert engine.end_turn("b", 4)
    assert engine.decode("a", 5, 3) == reference.decode("a", 5, 3)  # re-fed into b's slot
    assert engine.evictions == 2 and engine.sessions.peek("c").slot is not None


@pytest.fixture(scope="module")
def services(target_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("admission-logs")
    # 10 ms a forward, so that a turn lasts while the others wait; the draft is the target itself
    target = ["--model", str(target_dir), "--max-context", str(CONTEXT), "--num-slots", str(SLOTS),
              "--evict-after", "1", "--test-delay-ms", "10", "--plaintext"]
    procs = {
        "target": launch("target_service", target, log_dir=logs),
        "spare": launch("target_service", target, log_dir=logs),  # only the spill test uses it
        # One slot kept a minute after each call: only EndTurn frees it for the next session in time.
        "one_slot": launch("target_service", ["--model", str(target_dir), "--max-context", str(CONTEXT),
                                              "--num-slots", "1", "--evict-after", "60", "--test-delay-ms", "5",
                                              "--plaintext"], log_dir=logs),
        "draft": launch("draft_service", ["--model", str(target_dir), "--plaintext"], log_dir=logs),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


async def test_sessions_past_the_slots_wait_instead_of_thrashing(redis_url, target_dir, services):
    reference = Reference(target_dir, CONTEXT)
    prompts = [f"Story number {i}." for i in range(SESSIONS)]
    async with running_coordinator(redis_url, target_dir, [services["target"].address],
                                   [services["draft"].address]) as c:
        answers = await asyncio.gather(*[c.generate(prompt=p, max_new_tokens=TOKENS, ignore_eos=True)
                                         for p in prompts])
    for prompt, answer in zip(prompts, answers):
        expected = reference.continuation(reference.prompt_ids(prompt), TOKENS)
        assert tokens_of(answer) == expected
    evictions = next(float(line.split()[-1]) for line in services["target"].metrics().splitlines()
                     if line.startswith("specdec_target_evictions_total"))
    # Each session is evicted at most once, after its turn; thrashing evicts one every cycle (dozens).
    assert evictions <= SESSIONS, f"{evictions} evictions for {SESSIONS} sessions on {SLOTS} slots"


async def test_a_session_without_a_slot_moves_to_a_replica_with_room(redis_url, target_dir, services):
    """Another coordinator's turns hold every slot of the first target (as coordinators that all saw
    it least loaded would); a new session there is refused a slot and starts on the spare at once."""
    reference = Reference(target_dir, CONTEXT)
    full, spare = services["target"].address, services["spare"].address
    async with running_coordinator(redis_url, target_dir, [full]) as holder, \
            running_coordinator(redis_url, target_dir, [full, spare]) as c:  # lists the full one first
        holding = [holder.stub.Generate(request(prompt=f"Hold slot {i}.", max_new_tokens=200, ignore_eos=True))
                   for i in range(SLOTS)]
        held = [await read_some(call, 1) for call in holding]  # both turns run: every slot is kept
        answer = await c.generate(prompt="A new story.", max_new_tokens=TOKENS, ignore_eos=True)
        moved_to = (await c.session(answer[0].session_id)).target_replica
        still_running = [not call.done() for call in holding]
        for call, first in zip(holding, held):
            first += [m async for m in call]
    assert tokens_of(answer) == reference.continuation(reference.prompt_ids("A new story."), TOKENS)
    assert moved_to == spare
    assert all(still_running), "the new session should not have waited for the holders' turns to end"
    for i, got in enumerate(held):
        prompt = f"Hold slot {i}."
        assert tokens_of(got) == reference.continuation(reference.prompt_ids(prompt), 200)


async def test_a_finished_turn_frees_its_slot_for_the_next_session(redis_url, target_dir, services):
    """One-turn sessions one after another on a target with one KV slot kept 60 s after its last
    call: each turn's end tells the target (EndTurn), so each next session gets the slot at once.
    Without it the second waited for the slot until the failover timeout and failed."""
    reference = Reference(target_dir, CONTEXT)
    one_slot = services["one_slot"]
    prompts = [f"Short answer {i}." for i in range(3)]
    async with running_coordinator(redis_url, target_dir, [one_slot.address], failover_timeout_s=5.0) as c:
        answers = [await c.generate(prompt=p, max_new_tokens=8, ignore_eos=True) for p in prompts]
        session = answers[0][0].session_id
        again = await c.generate(session_id=session, prompt=" And then?", max_new_tokens=8, ignore_eos=True)
        record = await c.tokens(session)
    for prompt, answer in zip(prompts, answers):
        assert tokens_of(answer) == reference.continuation(reference.prompt_ids(prompt), 8)
    # The first session's next turn, its cache re-fed after the eviction, equals plain decoding.
    assert tokens_of(again) == record[-8:] == reference.continuation(record[:-8], 8)
    evictions = next(float(line.split()[-1]) for line in one_slot.metrics().splitlines()
                     if line.startswith("specdec_target_evictions_total"))
    assert evictions == 3  # each new session, then the first one's second turn


async def test_sessions_waiting_for_a_slot_get_it_in_arrival_order(redis_url, target_dir, services):
    """Five new sessions arrive 0.2 s apart while another's long turn holds the only KV slot. With no
    replica that has room, the coordinator has each wait in the target's queue (StartSession's
    slot_wait_ms), so they start in arrival order and none fails, each equal to plain decoding.
    (Before, each retried with backoff and a freed slot went to whoever tried first: under steady
    load some waited past the failover timeout and failed with RESOURCE_EXHAUSTED.) Arrivals 0.1 s
    apart were too close once on a loaded 2-core CI machine (started [0, 1, 3, 4, 2, 5]): before a
    session joins the target's queue it passes Redis, a first StartSession refused at once and the spill
    check, and those hops can vary by more than 0.1 s there; 0.2 s apart leaves them twice the room."""
    reference = Reference(target_dir, CONTEXT)
    started: list[int] = []
    async with running_coordinator(redis_url, target_dir, [services["one_slot"].address]) as c:
        holder = c.stub.Generate(request(prompt="Hold the slot.", max_new_tokens=220, ignore_eos=True))
        held = await read_some(holder, 1)

        async def arrive(i: int):
            await asyncio.sleep(0.2 * i)
            call = c.stub.Generate(request(prompt=f"In line {i}.", max_new_tokens=6, ignore_eos=True))
            first = await read_some(call, 1)
            started.append(i)
            return first + [m async for m in call]

        arrivals = asyncio.gather(*[arrive(i) for i in range(5)])
        await asyncio.sleep(0.55)  # three have arrived and wait; the holder's 220 steps take over a second
        metrics = await asyncio.to_thread(services["one_slot"].metrics)
        answers = await arrivals
        held += [m async for m in holder]
    waiting = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("specdec_target_sessions_waiting_for_slot "))
    assert waiting >= 1, "the waiting sessions should be visible to operators"
    assert started == list(range(5))
    assert tokens_of(held) == reference.continuation(reference.prompt_ids("Hold the slot."), 220)
    for i, answer in enumerate(answers):
        assert tokens_of(answer) == reference.continuation(reference.prompt_ids(f"In line {i}."), 6)
