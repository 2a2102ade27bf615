"""New sessions wait for a KV slot first come, first served (StartSession's slot_wait_ms).

While every slot is held by sessions in use (the engine's CacheFull), a caller used to retry with
backoff; a slot that freed then went to whichever StartSession arrived first, usually a new one
that had not waited at all, while a session backed off to a second between tries lost every race
and failed after its caller's timeout with the replica busy all along. Here a StartSession that asks
to wait joins a queue; only the head of the queue tries for a slot (every poll_s, as slots free
when turns end, sessions end or idle ones age past --evict-after; the others sleep until they are
the head), and a newcomer while others
wait is refused at once (slot_wait_ms 0, so its caller may try another replica) or queues behind
them. A waiter that gives up (its deadline, a cancelled call) leaves the queue.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from specdec.errors import CacheFull

T = TypeVar("T")


class SlotQueue:
    def __init__(self, poll_s: float = 0.02, clock: Callable[[], float] = time.monotonic):
        self.poll_s = poll_s
        self.clock = clock
        self._waiting: collections.deque[asyncio.Event] = collections.deque()

    def __len__(self) -> int:
        return len(self._waiting)

    async def admit(self, start: Callable[[], Awaitable[T]], wait_s: float) -> T:
        """start() (which raises CacheFull while no slot is free) in turn: at once when nobody
        waits; else, or while it is refused, from the queue for up to wait_s."""
        if not self._waiting:
            try:
                return await start()
            except CacheFull:
                if wait_s <= 0:
                    raise
        elif wait_s <= 0:
            raise CacheFull(f"every KV cache slot is in use and {len(self._waiting)} sessions are waiting for "
                            "one; retry later, or with slot_wait_ms to wait in turn")
        deadline = self.clock() + wait_s
        ticket = asyncio.Event()  # set when it reaches the head of the queue
        self._waiting.append(ticket)
        try:
            while True:
                if self._waiting[0] is ticket:  # only the head polls: one wake-up per poll_s, however long the line
                    try:
                        return await start()
                    except CacheFull:
                        if self.clock() >= deadline:
                            raise
                    await asyncio.sleep(self.poll_s)
                    continue
                try:
                    await asyncio.wait_for(ticket.wait(), max(deadline - self.clock(), 0.0))
                except asyncio.TimeoutError:
                    raise CacheFull(f"waited {wait_s:g} s for a KV cache slot behind {self._waiting.index(ticket)} "
                                    "other sessions; retry later or route to another replica") from None
        finally:
            was_head = self._waiting[0] is ticket
            self._waiting.remove(ticket)
            if was_head and self._waiting:
                self._waiting[0].set()
