"""ReplicaRegistry against a real Redis: leases, least-loaded choice, draining."""

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from specdec.store import Replica, ReplicaRegistry

LEASE_S = 0.3


@pytest.fixture
async def client(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def registry(client):
    return ReplicaRegistry(client, prefix=f"t{uuid.uuid4().hex[:8]}", lease_seconds=30)


def _target(replica_id: str, active: int = 0, capacity: int = 8, pool: str = "speculative") -> Replica:
    return Replica(replica_id, "target", pool, f"10.0.0.{len(replica_id)}:50051", model="smollm2-135m",
                   capacity=capacity, active_sessions=active, free_slots=capacity - active)


async def test_register_list_get(registry):
    await registry.register(_target("t1", active=2))
    await registry.register(_target("t0"))
    await registry.register(Replica("d0", "draft", "speculative", "10.0.1.1:50052"))
    await registry.register(_target("b0", pool="baseline"))
    assert [r.replica_id for r in await registry.list("target", "speculative")] == ["t0", "t1"]
    assert [r.replica_id for r in await registry.list("draft", "speculative")] == ["d0"]
    assert [r.replica_id for r in await registry.list("target", "baseline")] == ["b0"]
    assert await registry.get("t1") == _target("t1", active=2)
    assert await registry.get("missing") is None
    with pytest.raises(ValueError, match="kind"):
        await registry.register(Replica("x", "assistant", "speculative", "h:1"))


async def test_lease_expiry_removes_the_replica(client):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    short = ReplicaRegistry(client, prefix=prefix, lease_seconds=LEASE_S)
    long = ReplicaRegistry(client, prefix=prefix, lease_seconds=30)
    await short.register(_target("t0"))
    await long.register(_target("t1"))
    assert len(await short.list("target", "speculative")) == 2
    await asyncio.sleep(LEASE_S + 0.2)
    assert [r.replica_id for r in await short.list("target", "speculative")] == ["t1"]
    assert await client.smembers(short.index_key("target", "speculative")) == {b"t1"}  # pruned
    assert await short.get("t0") is None
    assert not await short.heartbeat(_target("t0"))  # lapsed: it must register again
    assert not await short.report_load("t0", 1, 7)
    assert await client.exists(short.replica_key("t0")) == 0  # no late write resurrected it

    assert await short.heartbeat(_target("t1"), active_sessions=3, free_slots=5)  # now a short lease
    assert (await short.get("t1")).active_sessions == 3
    await asyncio.sleep(LEASE_S + 0.2)
    assert await short.list("target", "speculative") == []
    assert await short.choose("target", "speculative") is None


async def test_keep_alive_holds_the_lease_and_reports_load(client):
    registry = ReplicaRegistry(client, prefix=f"t{uuid.uuid4().hex[:8]}", lease_seconds=LEASE_S)
    load = [1, 7]
    task = asyncio.create_task(registry.keep_alive(_target("t0"), load=lambda: tuple(load)))
    try:
        await asyncio.sleep(LEASE_S * 3)
        assert [r.replica_id for r in await registry.list("target", "speculative")] == ["t0"]
        load[:] = [5, 3]
        await client.delete(registry.replica_key("t0"))  # e.g. Redis restarted empty
        await asyncio.sleep(LEASE_S)
        replica = await registry.get("t0")
        assert (replica.active_sessions, replica.free_slots) == (5, 3)  # re-registered with its load
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.sleep(LEASE_S * 2)
    assert await registry.list("target", "speculative") == []


async def test_choose_least_loaded_ties_by_id(registry):
    await registry.register(_target("t2", active=1))
    await registry.register(_target("t1", active=1))
    await registry.register(_target("t3", active=3))
    await registry.register(_target("big", active=2, capacity=32))  # 2/32 is the lightest share
    assert (await registry.choose("target", "speculative")).replica_id == "big"
    assert (await registry.choose("target", "speculative", exclude={"big"})).replica_id == "t1"
    assert await registry.report_load("t3", active_sessions=0, free_slots=8)
    assert (await registry.choose("target", "speculative", exclude=["big"])).replica_id == "t3"
    assert await registry.choose("draft", "speculative") is None


async def test_draining_gets_no_new_sessions_but_stays_routable(registry):
    await registry.register(_target("t0"))
    await registry.register(_target("t1", active=4))
    assert await registry.deregister("t0")
    assert (await registry.choose("target", "speculative")).replica_id == "t1"
    drained = await registry.get("t0")
    assert drained is not None and drained.draining  # existing sessions still find it
    assert [r.replica_id for r in await registry.list("target", "speculative")] == ["t0", "t1"]
    await registry.register(_target("t0"))  # a re-registration by the same process keeps draining
    assert (await registry.get("t0")).draining
    assert await registry.deregister("t1")
    assert await registry.choose("target", "speculative") is None
    assert not await registry.deregister("unknown")
    assert await registry.remove("t0")
    assert await registry.get("t0") is None


async def test_moving_to_another_pool_leaves_the_old_listing(registry):
    await registry.register(_target("t0", pool="baseline"))
    await registry.register(_target("t0", pool="speculative"))
    assert await registry.list("target", "baseline") == []
    assert [r.replica_id for r in await registry.list("target", "speculative")] == ["t0"]
