"""Per-cycle cost accounting: model time as the services report it, overhead = the rest."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.engine.batcher import Batcher, StepTiming
from specdec.engine.target_stream import decode_steps
from specdec.engine.cycle_cost import (DRAFT, TARGET, CycleCost, beside_verify, measure_cycle, report_model_time,
                                       unmeasured)
from specdec.generation.loop import SpeculativeLoop
from specdec.generation.session import LoopObserver, LoopSettings
from specdec.generation.stats import SpeculationStats
from specdec.generation.stopping import StopChecker
from specdec.server.executor import ModelExecutor


def test_overhead_is_the_wall_time_outside_both_models():
    cost = CycleCost(wall_s=0.100)
    cost.add_model_time(DRAFT, 0.020, queued_s=0.001)
    cost.add_model_time(TARGET, 0.070)
    assert cost.model_s == pytest.approx(0.090)
    assert cost.overhead_s == pytest.approx(0.010) and cost.overhead_fraction == pytest.approx(0.10)
    assert cost.queued_s == pytest.approx(0.001)
    # Two processes' clocks: reported model time may exceed the caller's wall time by a hair.
    assert CycleCost(wall_s=0.05, target_model_s=0.051).overhead_s == 0.0
    with pytest.raises(ValueError):
        cost.add_model_time("verifier", 1.0)


def test_reports_go_to_the_cycle_being_measured_and_nowhere_else():
    report_model_time(TARGET, 1.0)  # outside any cycle: dropped, no error
    seen = []
    with measure_cycle(seen.append) as outer:
        report_model_time(TARGET, 0.002)
        with measure_cycle() as inner:
            report_model_time(DRAFT, 0.001)
        report_model_time(DRAFT, 0.003)
        time.sleep(0.01)
    assert (inner.draft_model_s, inner.target_model_s) == (0.001, 0.0)
    assert (outer.draft_model_s, outer.target_model_s) == (0.003, 0.002)
    assert seen == [outer] and outer.wall_s >= 0.01 > inner.wall_s


async def test_concurrent_sessions_each_see_only_their_own_calls():
    """A coordinator shares one client among sessions; each loop runs in its own task."""

    async def session(model_s: float) -> CycleCost:
        with measure_cycle() as cost:
            for _ in range(3):
                await asyncio.sleep(0.001)
                report_model_time(TARGET, model_s)
        return cost

    costs = await asyncio.gather(*(session(m) for m in (0.001, 0.002, 0.004)))
    assert [c.target_model_s for c in costs] == pytest.approx([0.003, 0.006, 0.012])


async def test_the_batcher_times_each_step_on_the_model_thread():
    def slow_step(works):
        time.sleep(0.02)
        return [w * 2 for w in works]

    executor = ModelExecutor("test-timing")
    batcher = Batcher(executor, slow_step)
    try:
        first = asyncio.create_task(batcher.submit_timed(1))
        await asyncio.sleep(0.005)  # the first step is running: the second waits for it
        second = asyncio.create_task(batcher.submit_timed(2))
        (one, t1), (two, t2) = await first, await second
        assert (one, two) == (2, 4)
        for timing in (t1, t2):
            assert 0.018 < timing.model_ns * 1e-9 < 0.5
        assert t2.queued_ns * 1e-9 > 0.005 and t2.queued_ns > t1.queued_ns
        assert await batcher.submit(3) == 6  # the untimed form is unchanged
    finally:
        await batcher.aclose()
        executor.shutdown()


async def test_a_multi_step_decode_sums_its_steps():
    def step(works):
        time.sleep(0.005)
        return [[7] for _ in works]

    executor = ModelExecutor("test-decode-timing")
    batcher = Batcher(executor, step, key=lambda work: work.session_id)
    timing = StepTiming()
    try:
        assert await decode_steps(batcher, "s", 10, 3, timing=timing) == [7, 7, 7]
    finally:
        await batcher.aclose()
        executor.shutdown()
    assert timing.model_ns * 1e-9 >= 0.015


class _CountingObserver(LoopObserver):
    def __init__(self):
        self.costs: list[CycleCost] = []

    def cycle_cost(self, cost: CycleCost) -> None:
        self.costs.append(cost)


class _FakeTarget:
    """A target whose every step is 'model time' of a known length, plus a fixed RPC-like delay."""

    def __init__(self, model_s: float, rpc_s: float):
        self.model_s, self.rpc_s = model_s, rpc_s

    async def decode(self, session_id, position, num_tokens, append_token_ids=()):
        await asyncio.sleep(self.rpc_s)
        time.sleep(self.model_s)
        report_model_time(TARGET, self.model_s)
        return [position % 50 + 1]

    async def decode_stream(self, session_id, position, num_tokens, append_token_ids=(), stop_token_ids=()):
        self.streams += 1
        await asyncio.sleep(self.rpc_s)  # one round trip for the whole run
        for i in range(num_tokens):
            time.sleep(self.model_s)
            report_model_time(TARGET, self.model_s)
            yield [(position + i) % 50 + 1]

    async def truncate(self, session_id, position):
        return position

    streams = 0


async def test_the_loop_accounts_every_cycle_and_tells_the_observer():
    from specdec.generation.session import SessionCursor
    from specdec.sampling.params import SamplingParams

    observer = _CountingObserver()
    loop = SpeculativeLoop(_FakeTarget(0.004, 0.003), None, LoopSettings(stream_plain=False), observer)
    cursor = SessionCursor("s", SamplingParams(), [1, 2, 3], max_context=100)

    async def emit(tokens):
        pass

    result = await loop.run(cursor, StopChecker(5, ()), emit)
    stats: SpeculationStats = result.stats
    assert stats.timed_cycles == stats.decode_steps == 5 == len(observer.costs)
    assert stats.target_model_seconds == pytest.approx(5 * 0.004)
    # The fake's "RPC" sleep is outside the model: overhead of at least 3 ms per cycle.
    assert stats.overhead_seconds >= 5 * 0.003
    assert stats.cycle_seconds == pytest.approx(sum(c.wall_s for c in observer.costs))
    assert all(c.overhead_fraction > 0.3 for c in observer.costs)


async def test_a_streamed_plain_run_pays_its_round_trip_once_and_accounts_every_token():
    from specdec.generation.session import SessionCursor
    from specdec.sampling.params import SamplingParams

    observer, target = _CountingObserver(), _FakeTarget(0.004, 0.003)
    loop = SpeculativeLoop(target, None, LoopSettings(), observer)
    cursor = SessionCursor("s", SamplingParams(), [1, 2, 3], max_context=100)

    async def emit(tokens):
        pass

    result = await loop.run(cursor, StopChecker(5, ()), emit)
    stats: SpeculationStats = result.stats
    assert result.token_ids == [4, 5, 6, 7, 8]  # the fake's tokens: position % 50 + 1
    assert target.streams == 1  # no draft: the whole budget is one run
    assert stats.timed_cycles == stats.decode_steps == 5 == len(observer.costs)
    assert stats.target_model_seconds == pytest.approx(5 * 0.004)
    assert observer.costs[0].overhead_s >= 0.003  # the run's one round trip lands in its first token


def test_a_pipelined_propose_beside_the_verify_is_off_the_critical_path():
    """The critical path of a pipelined cycle: the Propose before the verify, then the longer of the
    verify and the speculative Propose beside it."""
    cost = CycleCost(wall_s=0.020)
    cost.add_model_time(DRAFT, 0.004)
    cost.add_model_time(TARGET, 0.008)
    cost.add_model_time(DRAFT, 0.005, overlapped=True)  # shorter than the verify: hidden entirely
    assert (cost.draft_model_s, cost.hidden_draft_model_s) == pytest.approx((0.009, 0.005))
    assert cost.model_s == pytest.approx(0.012) and cost.overhead_s == pytest.approx(0.008)
    cost.add_model_time(DRAFT, 0.006, overlapped=True)  # now 0.011 beside 0.008: 0.003 lengthens the cycle
    assert cost.model_s == pytest.approx(0.004 + 0.011) and cost.overhead_s == pytest.approx(0.005)
    stats = SpeculationStats()
    stats.record_cost(cost)
    assert stats.hidden_draft_model_seconds == pytest.approx(0.008)
    assert stats.overhead_seconds == pytest.approx(cost.overhead_s)


async def test_beside_verify_marks_only_the_concurrent_task_s_calls():
    async def verify():
        await asyncio.sleep(0.002)
        report_model_time(TARGET, 0.008)

    async def speculative_propose():
        with beside_verify():
            await asyncio.sleep(0.001)
            report_model_time(DRAFT, 0.003)

    with measure_cycle() as cost:
        report_model_time(DRAFT, 0.002)  # the Propose before the verify
        await asyncio.gather(verify(), speculative_propose())
        report_model_time(DRAFT, 0.001)  # after: the task's mark did not leak into the loop's context
    assert (cost.draft_model_s, cost.overlapped_draft_model_s) == pytest.approx((0.006, 0.003))


async def test_a_background_feed_reports_into_no_cycle():
    """The draft fed in the background while the session decodes plainly (draft_feed.py): its task
    copies the spawning cycle's context, but its model time must not price that plain step."""
    async def feed():
        with unmeasured():
            await asyncio.sleep(0.001)
            report_model_time(DRAFT, 0.005)

    with measure_cycle() as cost:
        report_model_time(TARGET, 0.004)
        await asyncio.get_running_loop().create_task(feed())
        report_model_time(TARGET, 0.001)  # the cycle's own context is untouched after it
    assert (cost.draft_model_s, cost.target_model_s) == (0.0, pytest.approx(0.005))
