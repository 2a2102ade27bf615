"""SessionStore against a real Redis: atomic, versioned, append-only, sliding TTL."""

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from specdec.errors import PositionMismatch, SessionExists, SessionNotFound
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.store import (
    SchemaMismatch,
    SessionRecord,
    SessionStats,
    SessionStatus,
    SessionStore,
    VersionConflict,
)

PROMPT = [101, 102, 103]


@pytest.fixture
async def client(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def prefix():
    return f"t{uuid.uuid4().hex[:8]}"  # tests share one server: each gets its own key space


@pytest.fixture
def store(client, prefix):
    return SessionStore(client, ttl_seconds=30, prefix=prefix)


def _record(**overrides) -> SessionRecord:
    values = dict(
        prompt_length=len(PROMPT),
        sampling=SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, mode=SamplingMode.GUMBEL),
        pool="speculative",
        draft_replica="draft-0",
        target_replica="target-1",
        num_draft_tokens=4,
        extra={"chat_template": "smol", "stop": ["\n\n"]},
    )
    values.update(overrides)
    return SessionRecord(**values)


async def test_create_get_append_tokens_round_trip(store):
    assert await store.get("s") is None
    assert await store.create("s", _record(), PROMPT) == 1
    record = await store.get("s")
    expected = _record()
    for name in ("prompt_length", "sampling", "pool", "draft_replica", "target_replica",
                 "num_draft_tokens", "turns", "extra"):
        assert getattr(record, name) == getattr(expected, name), name
    assert (record.status, record.version, record.length) == (SessionStatus.ACTIVE, 1, 3)
    assert record.created_at > 0 and record.updated_at >= record.created_at

    version = await store.append("s", 3, [7, 8, 9], stats_delta=SessionStats.for_cycle(4, 2),
                                 fields={"num_draft_tokens": 5})
    assert version == 2
    assert await store.tokens("s") == PROMPT + [7, 8, 9]
    assert await store.tokens("s", 3) == [7, 8, 9]
    assert await store.tokens("s", 3, 4) == [7, 8]  # end inclusive, as LRANGE
    record = await store.get("s")
    assert (record.length, record.version, record.num_draft_tokens) == (6, 2, 5)
    assert record.stats == SessionStats(drafted=4, accepted=2, cycles=1, recovered=1,
                                        accepted_by_position=(1, 1))


async def test_create_twice_fails_and_keeps_the_first(store):
    await store.create("s", _record(), PROMPT)
    with pytest.raises(SessionExists):
        await store.create("s", _record(pool="baseline"), [1])
    record = await store.get("s")
    assert (record.pool, record.version) == ("speculative", 1)
    assert await store.tokens("s") == PROMPT


async def test_empty_session_and_empty_append(store):
    await store.create("s", _record(prompt_length=0), [])
    assert await store.tokens("s") == []
    assert await store.append("s", 0, [], fields={"turns": 2}) == 2
    assert (await store.get("s")).turns == 2


async def test_wrong_expected_length_changes_nothing(store, client):
    await store.create("s", _record(), PROMPT)
    await store.append("s", 3, [1, 2])
    hash_key, _ = store.keys("s")
    before = await client.hgetall(hash_key)
    for wrong in (3, 4, 6, 0):
        with pytest.raises(PositionMismatch) as caught:
            await store.append("s", wrong, [9, 9], fields={"pool": "baseline"},
                               stats_delta=SessionStats.for_cycle(2, 2))
        assert (caught.value.expected, caught.value.actual) == (wrong, 5)
    assert await store.tokens("s") == PROMPT + [1, 2]
    assert await client.hgetall(hash_key) == before  # no field, counter, version or timestamp moved


async def test_versions_and_conflicts(store):
    assert await store.create("s", _record(), PROMPT) == 1
    assert await store.append("s", 3, [4], expected_version=1) == 2
    with pytest.raises(VersionConflict) as caught:
        await store.append("s", 4, [5], expected_version=1)
    assert (caught.value.expected, caught.value.actual) == (1, 2)
    with pytest.raises(VersionConflict):
        await store.update("s", {"pool": "baseline"}, expected_version=1)
    with pytest.raises(VersionConflict):
        await store.truncate("s", 3, expected_version=7)
    assert await store.update("s", {"pool": "baseline", "status": "finished"}, expected_version=2) == 3
    assert await store.truncate("s", 3, expected_version=3) == 4
    record = await store.get("s")
    assert (record.pool, record.status, record.version, record.length) == (
        "baseline", SessionStatus.FINISHED, 4, 3)
    assert await store.tokens("s") == PROMPT


async def test_a_repeated_write_of_one_writer_is_applied_once(store):
    """What redis-py's retry does when a connection drops after Redis applied a write: it sends the
    same script again. Its writer's mark lets the repeat answer as the first time did."""
    v1 = await store.create("s", _record(), PROMPT)
    stats = SessionStats(cycles=1, drafted=4, accepted=2)
    v2 = await store.append("s", 3, [7, 8], expected_version=v1, writer="owner-a", stats_delta=stats)
    assert await store.append("s", 3, [7, 8], expected_version=v1, writer="owner-a", stats_delta=stats) == v2
    record = await store.get("s")
    assert record.version == v2 and await store.tokens("s") == PROMPT + [7, 8] and record.stats.cycles == 1
    v3 = await store.truncate("s", 4, expected_version=v2, writer="owner-a")
    assert await store.truncate("s", 4, expected_version=v2, writer="owner-a") == v3
    v4 = await store.update("s", {"target_replica": "t2"}, expected_version=v3, writer="owner-a")
    assert await store.update("s", {"target_replica": "t2"}, expected_version=v3, writer="owner-a") == v4
    # The fence still holds: another writer, no writer, or a repeat after someone else wrote.
    for writer in ("owner-b", ""):
        with pytest.raises(VersionConflict):
            await store.append("s", 4, [9], expected_version=v3, writer=writer)
    await store.update("s", {"pool": "baseline"})  # someone else: v5
    with pytest.raises(VersionConflict):
        await store.update("s", {"target_replica": "t2"}, expected_version=v3, writer="owner-a")
    assert await store.tokens("s") == PROMPT + [7]


async def test_truncate(store):
    await store.create("s", _record(), PROMPT)
    await store.append("s", 3, [4, 5, 6])
    with pytest.raises(PositionMismatch) as caught:
        await store.truncate("s", 7)
    assert caught.value.actual == 6
    await store.truncate("s", 5)
    await store.truncate("s", 5)  # idempotent in content
    assert await store.tokens("s") == PROMPT + [4, 5]
    await store.truncate("s", 0)
    assert await store.tokens("s") == []
    await store.append("s", 0, [1])
    assert await store.tokens("s") == [1]


async def test_update_rejects_unknown_fields(store):
    await store.create("s", _record(), PROMPT)
    with pytest.raises(ValueError, match="version"):
        await store.update("s", {"version": 99})
    assert (await store.get("s")).version == 1


async def test_stats_accumulate(store):
    await store.create("s", _record(), PROMPT)
    length = 3
    for num_accepted in (4, 0, 2):
        block = [1] * (num_accepted + 1)
        await store.append("s", length, block, stats_delta=SessionStats.for_cycle(4, num_accepted))
        length += len(block)
    await store.append("s", length, [2], stats_delta=SessionStats(fallbacks=1))
    stats = (await store.get("s")).stats
    assert stats == SessionStats(drafted=12, accepted=6, cycles=3, recovered=2, bonus=1, fallbacks=1,
                                 accepted_by_position=(2, 2, 1, 1))
    assert stats.acceptance_rate == 0.5


async def test_end_and_delete(store):
    await store.create("s", _record(), PROMPT)
    await store.end("s")
    await store.end("s")  # idempotent
    record = await store.get("s")
    assert record.status == SessionStatus.ENDED  # still readable until the TTL runs out
    for write in (store.append("s", 3, [1]), store.update("s", {"turns": 2}), store.truncate("s", 1)):
        with pytest.raises(SessionNotFound):
            await write
    assert await store.delete("s")
    assert not await store.delete("s")
    assert await store.get("s") is None
    with pytest.raises(SessionNotFound):
        await store.tokens("s")


async def test_missing_session(store):
    with pytest.raises(SessionNotFound):
        await store.append("nope", 0, [1])
    with pytest.raises(SessionNotFound):
        await store.update("nope", {"turns": 2})
    with pytest.raises(SessionNotFound):
        await store.end("nope")
    assert not await store.touch("nope")
    assert await store.client.exists(*store.keys("nope")) == 0  # no write resurrected a key


async def test_keys_share_one_cluster_slot(store, client, prefix):
    await store.create("user-42/chat", _record(), PROMPT)
    hash_key, list_key = store.keys("user-42/chat")
    assert (hash_key, list_key) == (f"{prefix}:{{user-42/chat}}", f"{prefix}:{{user-42/chat}}:tokens")
    assert {k.decode() for k in await client.keys(f"{prefix}:*")} == {hash_key, list_key}
    assert await client.type(hash_key) == b"hash" and await client.type(list_key) == b"list"
    assert key_slot(hash_key.encode()) == key_slot(list_key.encode())
    assert (await client.hget(hash_key, "schema")) == b"1"


async def test_ttl_is_set_and_slides(store, client):
    await store.create("s", _record(), PROMPT)
    keys = store.keys("s")
    for key in keys:
        assert 29_000 < await client.pttl(key) <= 30_000
    await asyncio.sleep(0.3)
    for key in keys:
        assert await client.pttl(key) < 29_800
    await store.append("s", 3, [1])
    for key in keys:
        assert await client.pttl(key) > 29_900  # slid back to the full TTL
    await asyncio.sleep(0.2)
    assert await store.touch("s")
    for key in keys:
        assert await client.pttl(key) > 29_900


async def test_session_expires(client, prefix):
    store = SessionStore(client, ttl_seconds=0.2, prefix=prefix)
    await store.create("s", _record(), PROMPT)
    await asyncio.sleep(0.4)
    assert await store.get("s") is None
    assert await client.exists(*store.keys("s")) == 0


async def test_concurrent_appends_never_lose_or_duplicate(redis_url, prefix):
    # A pool of connections, so writers really race each other inside Redis.
    client = aioredis.Redis.from_url(redis_url, max_connections=32)
    store = SessionStore(client, ttl_seconds=30, prefix=prefix)
    await store.create("s", _record(), PROMPT)
    writers, blocks_each, block_size = 16, 10, 3

    async def writer(w: int) -> int:
        conflicts = 0
        length = len(PROMPT)
        for b in range(blocks_each):
            block = [w * 1000 + b * 10 + i for i in range(block_size)]
            while True:
                try:
                    await store.append("s", length, block, stats_delta=SessionStats(cycles=1))
                    length += block_size
                    break
                except PositionMismatch as exc:
                    conflicts += 1
                    length = exc.actual
        return conflicts

    conflicts = await asyncio.gather(*(writer(w) for w in range(writers)))
    tokens = await store.tokens("s")
    record = await store.get("s")
    await client.aclose()
    assert sum(conflicts) > 0  # the race did happen
    assert tokens[:3] == PROMPT
    blocks = [tuple(tokens[i:i + block_size]) for i in range(3, len(tokens), block_size)]
    expected = {tuple(w * 1000 + b * 10 + i for i in range(block_size))
                for w in range(writers) for b in range(blocks_each)}
    assert len(blocks) == len(expected) and set(blocks) == expected  # whole blocks, each exactly once
    assert record.version == 1 + writers * blocks_each
    assert record.stats.cycles == writers * blocks_each


async def _append_cost(client, store, session_id, length, block):
    """(bytes Redis received, commands by name) for one append, measured from the server's side."""
    stats_before = await client.info("stats")
    commands_before = await client.info("commandstats")
    await store.append(session_id, length, block)
    stats_after = await client.info("stats")
    commands_after = await client.info("commandstats")
    received = stats_after["total_net_input_bytes"] - stats_before["total_net_input_bytes"]
    calls = {
        name.removeprefix("cmdstat_"): value["calls"] - commands_before.get(name, {"calls": 0})["calls"]
        for name, value in commands_after.items()
    }
    return received, {name: n for name, n in calls.items() if n}


async def test_append_to_a_long_session_costs_the_same_as_to_a_short_one(redis_url, prefix):
    # A private connection, so the byte counters see only this test's traffic.
    client = aioredis.Redis.from_url(redis_url, max_connections=1)
    store = SessionStore(client, ttl_seconds=30, prefix=prefix)
    long_prompt = list(range(10_000))
    await store.create("short", _record(prompt_length=10), long_prompt[:10])
    await store.create("long", _record(prompt_length=10_000), long_prompt)
    await store.append("short", 10, [1])  # script loaded, connection warm
    await store.append("long", 10_000, [1])
    block = [11, 12, 13, 14, 15]

    short_bytes, short_calls = await _append_cost(client, store, "short", 11, block)
    long_bytes, long_calls = await _append_cost(client, store, "long", 10_001, block)
    length = len(await store.tokens("long"))
    await client.aclose()

    # Only the new tokens travel: same size but for the digits of expected_length (11 vs 10001)
    assert abs(long_bytes - short_bytes) <= 6, (short_bytes, long_bytes)
    assert long_bytes < 1_000
    # ... and only RPUSH touches the list: nothing reads, rewrites or trims it.
    assert long_calls == short_calls
    assert long_calls.get("rpush") == 1
    assert not {"lrange", "ltrim", "lset", "del", "unlink", "rename"} & set(long_calls)
    assert length == 10_006


async def test_decoded_responses_and_script_cache_flush(redis_url, prefix):
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    store = SessionStore(client, ttl_seconds=30, prefix=prefix)
    await store.create("s", _record(), PROMPT)
    await client.script_flush()  # e.g. a Redis restart or failover: redis-py reloads on NOSCRIPT
    assert await store.append("s", 3, [4]) == 2
    record = await store.get("s")
    assert (record.length, record.extra) == (4, _record().extra)
    assert await store.tokens("s") == PROMPT + [4]
    with pytest.raises(PositionMismatch):
        await store.append("s", 3, [4])
    await client.aclose()


async def test_other_schema_is_refused(store, client):
    await store.create("s", _record(), PROMPT)
    await client.hset(store.keys("s")[0], "schema", 2)
    with pytest.raises(SchemaMismatch):
        await store.get("s")
    with pytest.raises(SchemaMismatch):
        await store.append("s", 3, [1])
    assert await store.client.llen(store.keys("s")[1]) == 3


async def test_record_then_stream_overlaps_the_next_cycle(store):
    """The documented pattern: the write runs while the next cycle computes; await it before streaming."""
    await store.create("s", _record(), PROMPT)
    streamed: list[int] = []
    length = 3
    for cycle in range(5):
        block = [cycle, cycle]
        recorded = asyncio.create_task(store.append("s", length, block))
        await asyncio.sleep(0.001)  # stands in for the next propose / verify
        await recorded
        streamed += block
        length += len(block)
    assert await store.tokens("s", 3) == streamed


def test_stats_add_and_cycle_delta():
    total = SessionStats.for_cycle(3, 3) + SessionStats.for_cycle(5, 1) + SessionStats(fallbacks=2)
    assert total == SessionStats(drafted=8, accepted=4, cycles=2, recovered=1, bonus=1, fallbacks=2,
                                 accepted_by_position=(2, 1, 1))
    with pytest.raises(ValueError):
        SessionStats.for_cycle(2, 3)
