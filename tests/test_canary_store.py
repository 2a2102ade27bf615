"""Canary state in a real Redis: the decider lease (one holder, renewal, fencing of a lapsed holder),
versioned state changes logged atomically, bounded sample lists; and the controller on top of it:
two controllers never both decide, a restarted one continues from Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as redis

from coordinator.canary import CanaryController
from coordinator.canary_policy import Action, CanaryPhase, CanaryPolicy
from coordinator.canary_settings import CanarySettings
from coordinator.canary_state import CanaryMetrics
from coordinator.canary_stats import Sample
from coordinator.requests import Pool
from specdec.observability.metrics import new_registry
from specdec.store.canary import CanaryStore, CanaryWriteRefused


@pytest.fixture
async def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


@pytest.fixture
def prefix():
    return f"canary{uuid.uuid4().hex[:10]}"


async def test_one_holder_at_a_time_renewal_and_release(client, prefix):
    a, b = CanaryStore(client, prefix), CanaryStore(client, prefix)
    assert await a.acquire("A", 0.3)
    assert not await b.acquire("B", 0.3)
    assert await a.acquire("A", 0.3)  # renewal
    assert await a.holder() == "A"
    await asyncio.sleep(0.4)  # A stops renewing: the lease lapses
    assert await b.acquire("B", 5)
    assert not await a.acquire("A", 5) and not await a.release("A")  # A cannot take it back or drop it
    assert await b.release("B") and await a.holder() == ""
    assert await a.acquire("A", 5)


async def test_state_changes_are_versioned_fenced_and_logged(client, prefix):
    store = CanaryStore(client, prefix, max_decisions=3)
    assert await store.state() == {}
    version = await store.write_state({"weight": 5}, expected_version=None, decision={"action": "start"})
    with pytest.raises(CanaryWriteRefused) as exists:
        await store.write_state({"weight": 9}, expected_version=None)
    assert exists.value.refusal == "exists"
    with pytest.raises(CanaryWriteRefused) as stale:
        await store.write_state({"weight": 9}, expected_version=version - 1)
    assert stale.value.refusal == "version" and stale.value.version == version
    # A decider must hold the lease in the same atomic step (a lapsed decider cannot write).
    with pytest.raises(CanaryWriteRefused) as fenced:
        await store.write_state({"weight": 25}, expected_version=version, holder="A", decision={"action": "x"})
    assert fenced.value.refusal == "not_leader"
    assert await store.acquire("A", 5)
    version = await store.write_state({"weight": 25}, expected_version=version, holder="A",
                                      decision={"action": "step_up"})
    for i in range(3):  # an operator: no lease needed
        version = await store.write_state({"weight": i}, expected_version=version, decision={"action": f"m{i}"})
    assert (await store.state())["version"] == str(version) == "5"
    assert [d["action"] for d in await store.decisions(10)] == ["m2", "m1", "m0"]  # newest first, trimmed


async def test_sample_lists_are_bounded_newest_first(client, prefix):
    store = CanaryStore(client, prefix, max_samples=4)
    for i in range(6):
        await store.add_sample("speculative", Sample(float(i), True, 0.1, 0.01).to_dict())
    await client.lpush(store.key("samples:speculative"), "not json")
    samples = await store.samples("speculative")
    assert [s["t"] for s in samples] == [5.0, 4.0, 3.0, 2.0]  # the last 4 kept; a foreign entry skipped
    assert await store.samples("baseline") == []


def controller(client, prefix, name, **policy) -> CanaryController:
    settings = CanarySettings(CanaryPolicy(**{"steps": (10, 50, 100), "min_samples": 5, "step_pause_s": 0,
                                              **policy}), interval_s=0.1, lease_s=1.0)
    return CanaryController(CanaryStore(client, prefix), settings, checker=None,
                            metrics=CanaryMetrics(new_registry(process=False)), router=_HealthyRouter(),
                            replica_id=name)


class _HealthyRouter:
    """Every pool has one live target (the controller probes before stepping up)."""

    async def candidates(self, kind, pool):
        return [type("C", (), {"endpoint": f"{pool.value}:1"})()]

    def target(self, endpoint):
        class Client:
            async def describe(self):
                return None
        return Client()

    def failed(self, endpoint):
        pass


async def add(store: CanaryStore, pool: Pool, tpot: float, n: int) -> None:
    import time
    for i in range(n):
        await store.add_sample(pool.value, Sample(time.time(), True, 0.05, tpot * (1 + i / 100)).to_dict())


async def test_two_controllers_never_both_decide_and_a_restart_continues(client, prefix):
    a, b = controller(client, prefix, "A"), controller(client, prefix, "B")
    await asyncio.gather(a.tick(), b.tick())
    leaders = [c.replica_id for c in (a, b) if c.is_leader]
    assert len(leaders) == 1
    state = await a.state()
    assert (state.phase, state.weight) == (CanaryPhase.PROGRESSING, 10)  # started once
    await add(a.store, Pool.SPECULATIVE, 0.01, 8)
    await add(a.store, Pool.BASELINE, 0.03, 8)
    verdicts = await asyncio.gather(*(c.tick() for c in (a, b) for _ in range(3)))
    assert sum(v is not None and v.action is Action.STEP_UP for v in verdicts) == 1  # the since-reset
    decisions = await a.store.decisions()
    assert [d["action"] for d in decisions] == ["step_up", "start"]
    assert decisions[0]["by"] == leaders[0] and decisions[0]["evidence"]["speculative"]["requests"] == 8
    assert (await b.state()).weight == 50
    # The leader goes away (a restart): the other one takes over once the lease lapses, and a
    # controller started afresh reads the same state.
    leader = a if leaders[0] == "A" else b
    other = b if leader is a else a
    await leader.aclose()
    await other.tick()
    assert other.is_leader
    fresh = controller(client, prefix, "C")
    assert (await fresh.state()).weight == 50 and (await fresh.status()).decider == other.replica_id


async def test_operators_act_through_any_replica(client, prefix):
    a = controller(client, prefix, "A")
    state = await a.act(Action.PROMOTE, "looks good")  # starts the canary first if needed
    assert (state.weight, state.phase) == (50, CanaryPhase.PROGRESSING)
    assert (await a.act(Action.PROMOTE, full=True)).phase is CanaryPhase.PROMOTED
    paused = await a.act(Action.PAUSE)
    assert paused.paused and await a.tick() is None  # no automatic decision while paused
    aborted = await a.act(Action.ABORT, "incident 42")
    assert (aborted.weight, aborted.phase, aborted.paused) == (0, CanaryPhase.ABORTED, True)
    resumed = await a.act(Action.RESUME)
    assert (resumed.weight, resumed.phase, resumed.paused) == (10, CanaryPhase.PROGRESSING, False)
    log = await a.store.decisions()
    assert [d["action"] for d in log] == ["resume", "abort", "pause", "promote", "promote", "start"]
    assert log[1]["reason"] == "manual abort: incident 42" and log[1]["manual"] and log[1]["to"] == 0
    assert (await a.act(Action.RESUME)).version == resumed.version  # nothing to resume: no change


class _SwallowingRouter(_HealthyRouter):
    """A target probe that turns its cancellation into an ordinary error, as a client library may."""

    probing = False
    swallow = True

    def target(self, endpoint):
        router = self

        class Client:
            async def describe(self):
                router.probing = True
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if not router.swallow:
                        raise
                    raise RuntimeError("call cancelled") from None
        return Client()


async def test_closing_ends_the_deciding_loop_even_when_a_cancellation_is_swallowed(client, prefix):
    """A CI run once hung in shutdown awaiting the canary's loop: its one cancellation had become an
    ordinary error inside a tick, which the loop survives by design (Redis away for a moment)."""
    c = controller(client, prefix, "A")
    c.router = router = _SwallowingRouter()
    c.start()
    await asyncio.sleep(0.3)  # started: samples count from now
    await add(c.store, Pool.SPECULATIVE, 0.01, 8)
    await add(c.store, Pool.BASELINE, 0.03, 8)
    for _ in range(50):  # a step-up, held at probing the targets before it
        if router.probing:
            break
        await asyncio.sleep(0.1)
    assert router.probing
    closing = asyncio.ensure_future(c.aclose())
    done, _ = await asyncio.wait([closing], timeout=10)
    router.swallow = False  # from here a cancellation is one again: nothing is left hanging either way
    if not done:
        c._loop.cancel()
        await asyncio.wait([closing], timeout=5)
    assert done and c._loop.done(), "closing did not end the loop"
