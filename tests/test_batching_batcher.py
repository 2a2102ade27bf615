"""The continuous batching scheduler: concurrent asyncio clients each get exactly their sequential
result while their work shares forward passes; cancellation, shutdown and failures stay per item."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
import torch

from specdec.engine.batch import VerifyWork, run_target_batch
from specdec.engine.batcher import Batcher
from specdec.engine.target_stream import decode_steps
from specdec.engine.target import TargetEngine
from specdec.errors import PositionMismatch, ServiceUnavailable
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.server.executor import ModelExecutor
from specdec.types import DraftBlock

import batching_helpers
from batching_helpers import CONTEXT, one_thread, tiny_dir  # noqa: F401 (module fixtures)

NUM_CLIENTS = 6
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=21, mode=SamplingMode.GUMBEL),
    SamplingParams(temperature=0.9, top_k=30, seed=22),
]


def target_engine(path, slots: int = 8) -> TargetEngine:
    return batching_helpers.target_engine(path, slots)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(NUM_CLIENTS)]


def plain_continuations(path, n: int) -> list[list[int]]:
    engine = target_engine(path)
    out = []
    for i, prompt in enumerate(prompts()):
        _, first = engine.start_session(f"c{i}", prompt, PARAMS[i % len(PARAMS)])
        out.append([first] + engine.decode(f"c{i}", len(prompt) + 1, n))
    return out


class Script:
    """One client's calls: verify a point-mass draft taken from the plain continuation (k = 1..4),
    or decode 1..3 tokens; the same script runs through the batcher and one call at a time."""

    def __init__(self, index: int, prompt: list[int], plain: list[int]):
        self.index, self.session_id, self.prompt, self.plain = index, f"c{index}", prompt, plain

    def calls(self, rounds: int):
        rng = random.Random(self.index)
        for r in range(rounds):
            yield ("decode", rng.randint(1, 3)) if r % 2 else ("verify", rng.randint(1, 4))

    def draft(self, position: int, k: int) -> DraftBlock:
        start = position - len(self.prompt)
        return DraftBlock(token_ids=torch.tensor(self.plain[start: start + k] or [0]))


async def run_script(script: Script, rounds: int, verify, decode) -> list:
    position, results = len(script.prompt) + 1, []
    for kind, n in script.calls(rounds):
        if kind == "verify":
            outcome = await verify(script.session_id, position, script.draft(position, n))
            results.append(outcome)
            position += outcome.num_committed
        else:
            tokens = await decode(script.session_id, position, n)
            results.append(tokens)
            position += len(tokens)
    return results


async def test_concurrent_clients_get_their_sequential_results_in_shared_steps(tiny_dir):
    plain = plain_continuations(tiny_dir, 60)
    scripts = [Script(i, p, plain[i]) for i, p in enumerate(prompts())]
    sequential, batched = target_engine(tiny_dir), target_engine(tiny_dir, slots=4)  # and evictions
    for engine in (sequential, batched):
        for i, script in enumerate(scripts):
            engine.start_session(script.session_id, script.prompt, PARAMS[i % len(PARAMS)])

    async def verify_now(session_id, position, draft):
        return sequential.verify(session_id, position, draft)

    async def decode_now(session_id, position, n):
        return sequential.decode(session_id, position, n)

    want = [await run_script(s, 8, verify_now, decode_now) for s in scripts]

    sizes: list[int] = []
    executor = ModelExecutor("test-batcher")
    batcher = Batcher(executor, functools.partial(run_target_batch, batched), max_batch_size=8,
                      on_step=lambda works, results, seconds: sizes.append(len(works)))

    async def verify(session_id, position, draft):
        return await batcher.submit(VerifyWork(session_id, position, draft))

    try:
        got = await asyncio.gather(*(run_script(s, 8, verify, functools.partial(decode_steps, batcher))
                                     for s in scripts))
    finally:
        await batcher.aclose()
        executor.shutdown()
    assert got == want
    for i, script in enumerate(scripts):
        committed = batched.committed_tokens(script.session_id)
        assert committed == sequential.committed_tokens(script.session_id)
        if PARAMS[i % len(PARAMS)].mode is SamplingMode.GUMBEL or PARAMS[i % len(PARAMS)].greedy:
            generated = committed[len(script.prompt):]  # lossless: what plain decoding produces
            assert generated == plain[i][: len(generated)]
    num_works = sum(len(r) if isinstance(r, list) else 1 for results in want for r in results)
    assert max(sizes) > 1 and len(sizes) < num_works  # work of different clients shared steps


async def test_decode_steps_stop_after_a_stop_token(tiny_dir):
    engine, reference = target_engine(tiny_dir), target_engine(tiny_dir)
    for e in (engine, reference):
        e.start_session("a", [1, 2, 3], PARAMS[0])
    expected = reference.decode("a", 4, 8)
    stop = expected[2]
    executor = ModelExecutor("test-batcher")
    batcher = Batcher(executor, functools.partial(run_target_batch, engine))
    try:
        got = await decode_steps(batcher, "a", 4, 8, stop_token_ids=[stop])
        assert got == expected[: expected.index(stop) + 1]
        with pytest.raises(PositionMismatch):
            await decode_steps(batcher, "a", 4, 1)
        assert await decode_steps(batcher, "a", 4 + len(got), 0, append_token_ids=[5, 6]) == []
        assert engine.committed_tokens("a")[-2:] == [5, 6]
    finally:
        await batcher.aclose()
        executor.shutdown()


class GatedThread:
    """A model thread that holds each step until released, to queue work behind a running step."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.steps: list[list] = []

    async def run(self, fn, *args):
        self.steps.append(list(args[0]))
        await self.gate.wait()
        return fn(*args)


def echo(works: list) -> list:
    return [ValueError(w) if w == "bad" else w.upper() for w in works]


async def test_requests_arriving_during_a_step_join_the_next_one():
    thread = GatedThread()
    batcher = Batcher(thread, echo, max_batch_size=3)
    first = asyncio.create_task(batcher.submit("a"))
    for _ in range(10):
        await asyncio.sleep(0)
    assert thread.steps == [["a"]]  # a lone request starts at once, no waiting for company
    later = [asyncio.create_task(batcher.submit(w)) for w in ("b", "gone", "bad", "c", "d")]
    await asyncio.sleep(0)
    later[1].cancel()  # its caller gave up while queued: the work never runs
    thread.gate.set()
    assert await first == "A"
    assert [await later[0], await later[3], await later[4]] == ["B", "C", "D"]
    with pytest.raises(ValueError):
        await later[2]  # its own error; the others of its step are unaffected
    assert thread.steps == [["a"], ["b", "bad", "c"], ["d"]]  # at most max_batch_size per step
    await batcher.aclose()


async def test_a_failing_step_fails_its_items_and_the_worker_goes_on():
    calls = []

    def step(works):
        calls.append(works)
        if len(calls) == 1:
            raise RuntimeError("broken forward")
        return works

    executor = ModelExecutor("test-batcher")
    batcher = Batcher(executor, step)
    try:
        with pytest.raises(RuntimeError):
            await batcher.submit(1)
        assert await batcher.submit(2) == 2
    finally:
        await batcher.aclose()
        executor.shutdown()


async def test_shutdown_fails_queued_work():
    thread = GatedThread()
    batcher = Batcher(thread, echo)
    running = asyncio.create_task(batcher.submit("a"))
    for _ in range(10):
        await asyncio.sleep(0)
    queued = asyncio.create_task(batcher.submit("b"))
    await asyncio.sleep(0)
    await batcher.aclose()
    for task in (running, queued):
        with pytest.raises(ServiceUnavailable):
            await task
    with pytest.raises(ServiceUnavailable):
        await batcher.submit("c")


class TimedThread:
    """A model thread whose steps take step_s (on the event loop: timing without a model)."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.steps: list[list] = []

    async def run(self, fn, *args):
        self.steps.append(sorted(w.session_id for w in args[0]))
        await asyncio.sleep(self.step_s)
        results, _, ended = fn(*args)  # Batcher._timed_step: the step as timed on the model thread
        return results, ended - int(self.step_s * 1e9), ended  # which it ran for step_s


class Work:
    def __init__(self, session_id: str):
        self.session_id = session_id


@pytest.mark.parametrize("gather", [0.0, 0.5])
async def test_sessions_just_served_are_gathered_into_one_step(gather):
    """Two sessions, the second arriving during the first's step, each sending its next work 10 ms
    after its result (a round trip). Without gathering they alternate in steps of one; with it the
    second step waits the 10 ms for the first session and from then on both share every step."""
    thread = TimedThread(0.1)
    batcher = Batcher(thread, lambda works: list(works), gather=gather)

    async def client(session_id: str, delay_s: float):
        await asyncio.sleep(delay_s)
        for _ in range(4):
            await batcher.submit(Work(session_id))
            await asyncio.sleep(0.01)

    await asyncio.gather(client("a", 0.0), client("b", 0.03))
    await batcher.aclose()
    if gather:
        assert thread.steps[:2] == [["a"], ["a", "b"]] and len(thread.steps) == 5
    else:
        assert thread.steps[:3] == [["a"], ["b"], ["a"]] and len(thread.steps) == 8


async def test_a_session_that_comes_back_late_is_not_waited_for():
    """A speculative session drafts between two Verifies (and verifies between two Proposes): it is
    back long after the gathering window. Once its return gap is known, steps no longer idle
    waiting for it, while a session that returns in a round trip is still gathered."""
    thread = TimedThread(0.03)
    batcher = Batcher(thread, lambda works: list(works), gather=0.5)  # window: 15 ms
    waits: dict[str, list[float]] = {"fast": [], "slow": []}

    async def client(session_id: str, rounds: int, away_s: float):
        for _ in range(rounds):
            _, timing = await batcher.submit_timed(Work(session_id))
            waits[session_id].append(timing.queued_ns * 1e-9)
            await asyncio.sleep(away_s)

    await asyncio.gather(client("fast", 24, 0.001), client("slow", 5, 0.1))
    await batcher.aclose()
    # Only after the first step shared with "slow" (its gap unknown yet) did "fast" wait out the
    # window; without the gaps it waits after every step "slow" was in.
    assert sum(wait > 0.01 for wait in waits["fast"]) <= 1, waits["fast"]


async def test_a_step_reports_its_own_duration_not_its_wait_for_the_model_thread():
    """Work outside the batcher (a prefill) may hold the model thread when a step is due: the step's
    seconds (the target's step_seconds metric, the gather window's unit) are the step's own."""
    import time

    seen: list[float] = []
    executor = ModelExecutor("test-step-time")

    def step(works):
        time.sleep(0.01)
        return list(works)

    batcher = Batcher(executor, step, max_batch_size=4, on_step=lambda works, results, seconds: seen.append(seconds))
    try:
        blocker = asyncio.ensure_future(executor.run(time.sleep, 0.2))  # a prefill holding the model thread
        await asyncio.sleep(0.01)
        assert await batcher.submit("work") == "work"
        await blocker
        await asyncio.sleep(0.01)  # on_step runs after the callers
    finally:
        await batcher.aclose()
        executor.shutdown()
    assert len(seen) == 1 and 0.009 <= seen[0] < 0.1
