"""SlotQueue (target_service/slot_queue.py): new sessions get freed KV slots in arrival order; a
newcomer does not pass those waiting; a waiter leaves the queue at its deadline or when cancelled."""

from __future__ import annotations

import asyncio

import pytest

from specdec.errors import CacheFull
from target_service.slot_queue import SlotQueue


class Slots:
    """A replica's free slots: start(name) takes one or raises CacheFull, as the engine does."""

    def __init__(self, free: int):
        self.free = free
        self.given: list[str] = []

    def starter(self, name: str):
        async def start():
            if self.free == 0:
                raise CacheFull("every slot is in use")
            self.free -= 1
            self.given.append(name)
            return name
        return start


async def _settle(queue: SlotQueue) -> None:
    await asyncio.sleep(queue.poll_s * 3)


async def test_no_one_waiting_starts_at_once_or_refuses_at_once():
    queue, slots = SlotQueue(poll_s=0.005), Slots(free=1)
    assert await queue.admit(slots.starter("a"), wait_s=0) == "a"
    with pytest.raises(CacheFull):
        await queue.admit(slots.starter("b"), wait_s=0)
    assert len(queue) == 0


async def test_freed_slots_go_to_the_waiting_sessions_in_arrival_order():
    queue, slots = SlotQueue(poll_s=0.005), Slots(free=0)
    first = asyncio.ensure_future(queue.admit(slots.starter("first"), wait_s=5))
    await _settle(queue)
    second = asyncio.ensure_future(queue.admit(slots.starter("second"), wait_s=5))
    await _settle(queue)
    with pytest.raises(CacheFull, match="2 sessions are waiting"):  # a newcomer asking not to wait
        await queue.admit(slots.starter("newcomer"), wait_s=0)
    third = asyncio.ensure_future(queue.admit(slots.starter("third"), wait_s=5))
    await _settle(queue)
    assert len(queue) == 3 and slots.given == []
    for expected in ("first", "second", "third"):
        slots.free += 1  # a turn ends somewhere
        await _settle(queue)
        assert slots.given[-1] == expected and slots.free == 0
    assert [await t for t in (first, second, third)] == ["first", "second", "third"]
    assert len(queue) == 0


async def test_a_waiter_leaves_at_its_deadline_or_when_cancelled():
    queue, slots = SlotQueue(poll_s=0.005), Slots(free=0)
    head = asyncio.ensure_future(queue.admit(slots.starter("head"), wait_s=5))
    await _settle(queue)
    with pytest.raises(CacheFull, match="behind 1 other"):
        await queue.admit(slots.starter("impatient"), wait_s=0.05)
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    assert len(queue) == 0
    with pytest.raises(CacheFull, match="every slot is in use"):  # the head's own last refusal
        await queue.admit(slots.starter("alone"), wait_s=0.03)
    slots.free = 1
    assert await queue.admit(slots.starter("later"), wait_s=0) == "later"
