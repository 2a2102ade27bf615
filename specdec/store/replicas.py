"""Replica discovery: draft and target replicas register their endpoints in Redis under a lease.

Keys (all under one hash tag, so a script may touch several in Redis Cluster):
    <prefix>:{replicas}:replica:<replica_id>    hash  endpoint, model, capacity, load, draining;
                                                      its TTL *is* the lease
    <prefix>:{replicas}:index:<kind>:<pool>     set   replica ids, pruned when their hash is gone

A replica runs `keep_alive()` as a task: it registers, then renews the lease (and reports its load)
every lease/3. When it stops renewing, its hash expires and it drops out of every listing; an
entry pruned by a racing listing is re-added by the next renewal. Draining (`deregister`) keeps a
replica listed and routable for the sessions it holds while `choose` stops giving it new ones.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import redis.asyncio as redis
from redis.exceptions import RedisError

from specdec.store import lua

log = logging.getLogger(__name__)

KINDS = ("draft", "target")


@dataclass(frozen=True)
class Replica:
    replica_id: str
    kind: str  # "draft" | "target"
    pool: str  # "baseline" | "speculative" | ...
    endpoint: str  # host:port of its gRPC server
    model: str = ""
    capacity: int = 0  # session slots it can hold; 0 = unknown
    active_sessions: int = 0
    free_slots: int = 0
    draining: bool = False

    @property
    def load(self) -> float:
        """Share of capacity in use; plain active sessions when the capacity is unknown."""
        return self.active_sessions / self.capacity if self.capacity > 0 else float(self.active_sessions)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _to_hash(replica: Replica) -> dict[str, str | int]:
    return {
        "replica_id": replica.replica_id,
        "kind": replica.kind,
        "pool": replica.pool,
        "endpoint": replica.endpoint,
        "model": replica.model,
        "capacity": replica.capacity,
        "active_sessions": replica.active_sessions,
        "free_slots": replica.free_slots,
        "draining": int(replica.draining),
    }


def _from_hash(raw: dict) -> Replica:
    h = {_text(k): _text(v) for k, v in raw.items()}
    return Replica(
        replica_id=h["replica_id"],
        kind=h["kind"],
        pool=h["pool"],
        endpoint=h["endpoint"],
        model=h.get("model", ""),
        capacity=int(h.get("capacity", 0)),
        active_sessions=int(h.get("active_sessions", 0)),
        free_slots=int(h.get("free_slots", 0)),
        draining=h.get("draining") == "1",
    )


class ReplicaRegistry:
    def __init__(self, client: redis.Redis, prefix: str = "specdec", lease_seconds: float = 10.0):
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.client = client
        self.prefix = prefix
        self.lease_seconds = lease_seconds
        self._draining: set[str] = set()  # drained here: a re-registration must not undo it
        self._heartbeat = client.register_script(lua.load("registry_heartbeat.lua"))
        self._set_if_live = client.register_script(lua.load("registry_set.lua"))

    def replica_key(self, replica_id: str) -> str:
        return f"{self.prefix}:{{replicas}}:replica:{replica_id}"

    def index_key(self, kind: str, pool: str) -> str:
        return f"{self.prefix}:{{replicas}}:index:{kind}:{pool}"

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.lease_seconds * 1000))

    async def register(self, replica: Replica) -> None:
        """Publish the replica (replacing an earlier registration of the same id) under a new lease."""
        if replica.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {replica.kind!r}")
        if not replica.pool or not replica.endpoint:
            raise ValueError("a replica needs a pool and an endpoint (host:port)")
        if replica.replica_id in self._draining:
            replica = replace(replica, draining=True)
        key = self.replica_key(replica.replica_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key).hset(key, mapping=_to_hash(replica)).pexpire(key, self._lease_ms)
            await pipe.sadd(self.index_key(replica.kind, replica.pool), replica.replica_id).execute()

    async def heartbeat(
        self, replica: Replica, active_sessions: int | None = None, free_slots: int | None = None
    ) -> bool:
        """Renew the lease, reporting load if given; False if it had lapsed (register again)."""
        load = {}
        if active_sessions is not None:
            load["active_sessions"] = int(active_sessions)
        if free_slots is not None:
            load["free_slots"] = int(free_slots)
        renewed = await self._heartbeat(
            keys=[self.replica_key(replica.replica_id), self.index_key(replica.kind, replica.pool)],
            args=[self._lease_ms, replica.replica_id, *[x for kv in load.items() for x in kv]],
        )
        return bool(renewed)

    async def keep_alive(
        self,
        replica: Replica,
        interval_seconds: float | None = None,
        load: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        """Register and keep the lease alive until cancelled. `load` returns (active_sessions,
        free_slots) for each renewal. Redis being unreachable is logged and retried, never raised."""
        interval = interval_seconds if interval_seconds is not None else self.lease_seconds / 3
        registered = False
        while True:
            try:
                active, free = load() if load else (None, None)
                if registered:
                    registered = await self.heartbeat(replica, active, free)
                if not registered:
                    current = replica if load is None else replace(
                        replica, active_sessions=active, free_slots=free
                    )
                    await self.register(current)
                    registered = True
            except RedisError as exc:
                log.warning("replica %s: lease renewal failed (%s); retrying", replica.replica_id, exc)
                registered = False
            await asyncio.sleep(interval)

    async def report_load(self, replica_id: str, active_sessions: int, free_slots: int) -> bool:
        """Record the replica's load; False if its lease has lapsed."""
        return bool(
            await self._set_if_live(
                keys=[self.replica_key(replica_id)],
                args=["active_sessions", int(active_sessions), "free_slots", int(free_slots)],
            )
        )

    async def deregister(self, replica_id: str) -> bool:
        """Drain: no new sessions from now on, still routable for those it holds. False if unknown."""
        self._draining.add(replica_id)
        return bool(await self._set_if_live(keys=[self.replica_key(replica_id)], args=["draining", 1]))

    async def remove(self, replica_id: str) -> bool:
        """Drop the registration now (a clean shutdown, once drained). False if it was not live."""
        self._draining.discard(replica_id)
        return bool(await self.client.delete(self.replica_key(replica_id)))

    async def get(self, replica_id: str) -> Replica | None:
        """The live registration of one replica, draining or not (routing an existing session)."""
        raw = await self.client.hgetall(self.replica_key(replica_id))
        return _from_hash(raw) if raw else None

    async def list(self, kind: str, pool: str) -> list[Replica]:
        """Live replicas of a kind in a pool, draining ones included, ordered by id."""
        index = self.index_key(kind, pool)
        ids = sorted(_text(member) for member in await self.client.smembers(index))
        if not ids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for replica_id in ids:
                pipe.hgetall(self.replica_key(replica_id))
            hashes = await pipe.execute()
        live, stale = [], []
        for replica_id, raw in zip(ids, hashes):
            replica = _from_hash(raw) if raw else None
            if replica is None or (replica.kind, replica.pool) != (kind, pool):
                stale.append(replica_id)  # lease lapsed, or re-registered elsewhere
            else:
                live.append(replica)
        if stale:
            await self.client.srem(index, *stale)
        return live

    async def choose(self, kind: str, pool: str, exclude: Iterable[str] = ()) -> Replica | None:
        """The least loaded live, non-draining replica not in `exclude`; ties go to the lowest id."""
        excluded = set(exclude)
        candidates = [
            r for r in await self.list(kind, pool) if not r.draining and r.replica_id not in excluded
        ]
        return min(candidates, key=lambda r: (r.load, r.active_sessions, r.replica_id), default=None)
