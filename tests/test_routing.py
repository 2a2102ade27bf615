"""The coordinator's choice of replicas for new sessions: a burst is spread over the replicas, not
sent to whichever was least loaded at the registry's last report (found by hand: 8 concurrent new
sessions all went to one of two registered targets)."""

from __future__ import annotations

import collections
import uuid

import redis.asyncio as aioredis

from coordinator.requests import Pool
from coordinator.routing import Router
from specdec.store import Replica, ReplicaRegistry


def _router(now: list[float], **kwargs) -> Router:
    return Router(lambda e: None, lambda e: None, clock=lambda: now[0], **kwargs)


async def test_a_burst_of_new_sessions_spreads_over_flag_given_targets():
    now = [0.0]
    router = _router(now, targets=["a:1", "b:1"])
    # No turn has started yet (acquire() comes later): the choices alone must spread.
    chosen = [await router.choose_target(Pool.SPECULATIVE) for _ in range(6)]
    assert collections.Counter(chosen) == {"a:1": 3, "b:1": 3}
    router.acquire("a:1")  # a turn runs on a; the placements are forgotten after a while
    now[0] = 6.0
    assert await router.choose_target(Pool.SPECULATIVE) == "b:1"


async def test_a_burst_of_new_sessions_spreads_over_registered_targets(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    try:
        registry = ReplicaRegistry(client, prefix=f"t{uuid.uuid4().hex[:8]}", lease_seconds=30)
        for name, active in (("t0", 0), ("t1", 2)):  # as last reported: t1 holds 2 of its 8 slots
            await registry.register(Replica(name, "target", "speculative", f"{name}:50051", capacity=8,
                                            active_sessions=active, free_slots=8 - active))
        router = _router([0.0], registry=registry)
        chosen = [await router.choose_target(Pool.SPECULATIVE) for _ in range(9)]
        # t0 takes the first two (to 2 of 8, level with t1), then they alternate, ties to t0.
        assert collections.Counter(chosen) == {"t0:50051": 6, "t1:50051": 3}
        assert chosen[:2] == ["t0:50051", "t0:50051"]
        # A session's own target stays its target, and is not counted as a new placement: t1 (6 of 8)
        # is still below t0 (7 of 8) for the next new session.
        assert await router.choose_target(Pool.SPECULATIVE, sticky="t1:50051") == "t1:50051"
        assert await router.choose_target(Pool.SPECULATIVE) == "t1:50051"
    finally:
        await client.aclose()
