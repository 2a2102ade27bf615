"""Session state in Redis: one hash and one append-only token list per session.

Keys (schema 1, see records.py for the hash fields):
    <prefix>:{<session_id>}          hash   record, stats counters, schema, version, timestamps
    <prefix>:{<session_id>}:tokens   list   committed token ids (prompt first), only ever RPUSHed
The braces are a Redis Cluster hash tag: both keys hash to one slot, so one script may touch both.

Every write is one Lua script (specdec/store/lua/): it checks the schema, the expected version and,
for append, the expected length; then writes, bumps `version` and slides the TTL of both keys.
A cycle therefore sends only its new tokens, whatever the session's length.

Writes off the critical path. Each method is a coroutine, so a caller overlaps the Redis round trip
with the next cycle's model work, and still streams a token only after it is recorded:

    recorded = asyncio.create_task(store.append(sid, expected_length=n, token_ids=block,
                                                stats_delta=SessionStats.for_cycle(k, a)))
    next_block = asyncio.create_task(run_cycle(...))   # propose / verify while Redis writes
    await recorded                                      # raises if the write was refused ...
    await stream(block)                                 # ... so the client never sees unrecorded tokens

Await one append of a session before issuing its next: two in flight may reach Redis in either
order, and the second would then fail its length check (loudly, never corrupting the list).

A Redis that does not answer (after the client's retries, specdec.store.client) raises
StoreUnavailable from every method.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import redis.asyncio as redis

from specdec.errors import PositionMismatch, SessionExists, SessionNotFound, SpecDecError
from specdec.store import lua
from specdec.store.client import translated
from specdec.store.records import (
    SCHEMA,
    SessionRecord,
    SessionStats,
    SessionStatus,
    decode_record,
    encode_fields,
    encode_record,
)


class VersionConflict(SpecDecError):
    """The session changed since the caller read it (maps to ABORTED: re-read and retry)."""

    def __init__(self, session_id: str, expected: int, actual: int):
        super().__init__(
            f"session {session_id!r} is at version {actual}, the write expected version {expected}; "
            "re-read the session and retry"
        )
        self.session_id = session_id
        self.expected = expected
        self.actual = actual


class SchemaMismatch(SpecDecError):
    """The stored session was written under another schema (maps to FAILED_PRECONDITION)."""

    def __init__(self, session_id: str, actual: str):
        super().__init__(
            f"session {session_id!r} is stored under schema {actual}, this store speaks schema "
            f"{SCHEMA}; migrate it or run a matching version"
        )
        self.session_id = session_id
        self.actual = actual


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class SessionStore:
    """Sessions in Redis with a sliding TTL; works with decode_responses on or off."""

    def __init__(self, client: redis.Redis, ttl_seconds: float, prefix: str = "specdec"):
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        self.client = client
        self.ttl_seconds = ttl_seconds
        self.prefix = prefix
        # register_script only hashes the source; redis-py loads it on first use and again on NOSCRIPT.
        self._create = client.register_script(lua.load("common.lua", "create.lua"))
        self._append = client.register_script(lua.load("common.lua", "append.lua"))
        self._truncate = client.register_script(lua.load("common.lua", "truncate.lua"))
        self._update = client.register_script(lua.load("common.lua", "update.lua"))

    def keys(self, session_id: str) -> tuple[str, str]:
        """(hash key, token list key) of a session."""
        base = f"{self.prefix}:{{{session_id}}}"
        return base, f"{base}:tokens"

    @translated
    async def create(self, session_id: str, record: SessionRecord, token_ids: Sequence[int]) -> int:
        """Record a new session with its prompt tokens; SessionExists if the id is taken. -> version"""
        items = self._pairs(encode_record(record))
        reply = await self._create(
            keys=self.keys(session_id),
            args=[*self._head(None), len(items), *items, *map(int, token_ids)],
        )
        return self._result(session_id, reply, expected_version=None, expected_length=0)[0]

    @translated
    async def get(self, session_id: str) -> SessionRecord | None:
        hash_key, list_key = self.keys(session_id)
        async with self.client.pipeline(transaction=True) as pipe:
            raw, length = await pipe.hgetall(hash_key).llen(list_key).execute()
        if not raw:
            return None
        hash_fields = {_text(k): _text(v) for k, v in raw.items()}
        if hash_fields.get("schema") != str(SCHEMA):
            raise SchemaMismatch(session_id, hash_fields.get("schema", "(none)"))
        return decode_record(hash_fields, length)

    @translated
    async def tokens(self, session_id: str, start: int = 0, end: int = -1) -> list[int]:
        """Committed token ids [start, end], end inclusive as in LRANGE (-1 = the last one)."""
        hash_key, list_key = self.keys(session_id)
        async with self.client.pipeline(transaction=True) as pipe:
            exists, values = await pipe.exists(hash_key).lrange(list_key, start, end).execute()
        if not exists:
            raise SessionNotFound(session_id)
        return [int(v) for v in values]

    @translated
    async def append(
        self,
        session_id: str,
        expected_length: int,
        token_ids: Sequence[int],
        expected_version: int | None = None,
        fields: Mapping[str, Any] | None = None,
        stats_delta: SessionStats | None = None,
        writer: str = "",
    ) -> int:
        """Commit token_ids at position expected_length (the list's length before them) and, in the
        same atomic step, set `fields` and add `stats_delta`. PositionMismatch carries the actual
        length; nothing is written on any refusal. With a writer (and expected_version), a repeat
        of a write that was applied is answered as the first time (see _head). -> the new version"""
        field_items = self._pairs(encode_fields(fields or {}))
        counter_items = self._pairs((stats_delta or SessionStats()).to_fields(skip_zero=True))
        reply = await self._append(
            keys=self.keys(session_id),
            args=[
                *self._head(expected_version, writer),
                int(expected_length),
                len(field_items),
                len(counter_items),
                *field_items,
                *counter_items,
                *map(int, token_ids),
            ],
        )
        return self._result(session_id, reply, expected_version, expected_length)[0]

    @translated
    async def truncate(self, session_id: str, length: int, expected_version: int | None = None,
                       writer: str = "") -> int:
        """Keep the first `length` tokens (a stop sequence found inside a recorded block). A length
        beyond the list is a PositionMismatch. -> the new version"""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        reply = await self._truncate(
            keys=self.keys(session_id), args=[*self._head(expected_version, writer), int(length)]
        )
        return self._result(session_id, reply, expected_version, length)[0]

    @translated
    async def update(
        self, session_id: str, fields: Mapping[str, Any], expected_version: int | None = None, writer: str = ""
    ) -> int:
        """Set writable record fields atomically; VersionConflict if expected_version is stale."""
        return await self._set(session_id, fields, expected_version, allow_ended=False, writer=writer)

    @translated
    async def end(self, session_id: str) -> int:
        """Mark the session ended: readable until its TTL runs out, no longer writable. Idempotent."""
        return await self._set(session_id, {"status": SessionStatus.ENDED}, None, allow_ended=True)

    @translated
    async def touch(self, session_id: str) -> bool:
        """Slide the TTL without writing; False if the session does not exist."""
        hash_key, list_key = self.keys(session_id)
        ttl_ms = int(self.ttl_seconds * 1000)
        async with self.client.pipeline(transaction=True) as pipe:
            found, _ = await pipe.pexpire(hash_key, ttl_ms).pexpire(list_key, ttl_ms).execute()
        return bool(found)

    @translated
    async def retire(self, session_id: str, keep_s: float) -> bool:
        """After end(): drop the tokens, keep the ended record as a tombstone for keep_s seconds, so
        that a turn still running elsewhere reads "ended" rather than finding nothing (which only
        data loss causes). False if there was no record."""
        hash_key, list_key = self.keys(session_id)
        async with self.client.pipeline(transaction=True) as pipe:
            _, kept = await pipe.delete(list_key).pexpire(hash_key, max(1, int(keep_s * 1000))).execute()
        return bool(kept)

    @translated
    async def delete(self, session_id: str) -> bool:
        """Remove both keys now; False if there was nothing to remove."""
        hash_key, list_key = self.keys(session_id)
        async with self.client.pipeline(transaction=True) as pipe:
            removed, _ = await pipe.delete(hash_key).delete(list_key).execute()
        return bool(removed)

    async def _set(
        self, session_id: str, fields: Mapping[str, Any], expected_version: int | None, allow_ended: bool,
        writer: str = "",
    ) -> int:
        items = self._pairs(encode_fields(fields))
        reply = await self._update(
            keys=self.keys(session_id),
            args=[*self._head(expected_version, writer), "1" if allow_ended else "0", len(items), *items],
        )
        return self._result(session_id, reply, expected_version, None)[0]

    def _head(self, expected_version: int | None, writer: str = "") -> list[Any]:
        """ARGV[1..3], common to every script: schema, TTL in ms, expected version ('' = any).

        A writer's name travels with the expected version ('12|name'): the write marks the record
        with both, so that the client library's retry of a write whose reply was lost with the
        connection (redis-py resends it) is recognised as applied instead of failing the version
        check on the version it produced itself (lua/common.lua)."""
        if "|" in writer:
            raise ValueError(f"a writer's name must not contain '|', got {writer!r}")
        version = "" if expected_version is None else str(int(expected_version))
        if writer and version:
            version += "|" + writer
        return [SCHEMA, int(self.ttl_seconds * 1000), version]

    @staticmethod
    def _pairs(mapping: Mapping[str, Any]) -> list[Any]:
        return [item for pair in mapping.items() for item in pair]

    @staticmethod
    def _result(
        session_id: str, reply: list, expected_version: int | None, expected_length: int | None
    ) -> tuple[int, int]:
        """Script reply -> (version, length), or the domain error it stands for."""
        status, detail = _text(reply[0]), reply[1]
        if status == "ok":
            return int(detail), int(reply[2])
        if status in ("missing", "ended"):
            raise SessionNotFound(session_id)
        if status == "exists":
            raise SessionExists(session_id)
        if status == "position":
            raise PositionMismatch(session_id, expected=int(expected_length), actual=int(detail))
        if status == "version":
            raise VersionConflict(session_id, expected=int(expected_version), actual=int(detail))
        if status == "schema":
            raise SchemaMismatch(session_id, _text(detail))
        raise RuntimeError(f"unexpected reply from a session script: {reply!r}")
