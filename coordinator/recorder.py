"""A turn's writes to its session's Redis record: pipelined with the loop, fenced by version.

The recorder is the only writer of a session while its turn runs. Writes are chained: each one
starts when the previous one has finished and names the version that one produced. So

- the loop never waits for Redis: a cycle's append runs while the next cycle drafts and verifies,
  and the stream sends a block only once its append is done (record before stream);
- any write by someone else (Cancel or EndSession, maybe on another coordinator; a coordinator
  taking over a turn it believed abandoned) makes our next write fail with VersionConflict or
  SessionNotFound instead of interleaving with it. That is how a turn learns, between cycles and
  at no extra cost, that it must stop.

While the loop is slow (long cycles) a heartbeat keeps the record fresh, so other coordinators
can tell a live turn from one whose coordinator died (state.owner_is_live).

Every write names the turn's owner as its writer, so a write that Redis applied but whose reply
was lost with the connection, and that the Redis client then sent again, is answered as applied
instead of failing the version fence on the version it produced (SessionStore._head).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Awaitable, Callable, Sequence

from specdec.store import SessionStats, SessionStore


def _retrieve(task: asyncio.Task) -> None:
    # A failed write is reported where its task is awaited; this only keeps asyncio from warning
    # about the later writes of the chain, which fail with it and are never awaited.
    if not task.cancelled():
        task.exception()


class Recorder:
    def __init__(self, store: SessionStore, session_id: str, version: int, length: int, heartbeat_s: float,
                 writer: str = ""):
        self.store = store
        self.session_id = session_id
        self.writer = writer  # the turn's owner
        self.version = version  # after the last completed write
        self.length = length  # committed tokens once every chained append is done
        self.heartbeat_s = heartbeat_s
        self._last: asyncio.Future | None = None
        self._last_write = time.monotonic()
        self._fields: dict[str, Any] = {}  # set by set_fields(), written with the next append
        self._heartbeat: asyncio.Task | None = None

    def set_fields(self, **fields: Any) -> None:
        """Record fields (e.g. a new target_replica) atomically with the next append."""
        self._fields.update(fields)

    def append(self, token_ids: Sequence[int], stats_delta: SessionStats | None = None) -> asyncio.Future:
        """Chain an append of token_ids; the returned task completes once they are recorded."""
        expected, tokens = self.length, list(token_ids)
        self.length += len(tokens)
        fields, self._fields = self._fields, {}
        return self._chain(
            lambda: self.store.append(
                self.session_id, expected, tokens, expected_version=self.version, fields=fields,
                stats_delta=stats_delta, writer=self.writer,
            )
        )

    async def update(self, fields: dict[str, Any]) -> None:
        """Write fields after every pending write (the turn's final state), and wait for it."""
        merged = {**self._fields, **fields}
        self._fields = {}
        await self._chain(lambda: self._update(merged))

    async def settled(self) -> None:
        """Until every chained write is done; raises the first refusal."""
        if self._last is not None:
            await self._last

    def start_heartbeat(self) -> None:
        if self._heartbeat is None:
            self._heartbeat = asyncio.ensure_future(self._beat())

    async def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None

    def _update(self, fields: dict[str, Any]) -> Awaitable[int]:
        return self.store.update(self.session_id, fields, expected_version=self.version, writer=self.writer)

    def _chain(self, write: Callable[[], Awaitable[int]]) -> asyncio.Future:
        previous = self._last

        async def run() -> int:
            if previous is not None:
                await previous  # a refused write refuses everything after it
            self.version = await write()  # reads self.version only now, after the previous write
            self._last_write = time.monotonic()
            return self.version

        self._last = asyncio.ensure_future(run())
        self._last.add_done_callback(_retrieve)
        return self._last

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s / 2)
            if time.monotonic() - self._last_write >= self.heartbeat_s:
                try:
                    await self._chain(lambda: self._update({}))
                except Exception:  # the turn's own next write reports it
                    return
