"""Keeping the draft's cache current while a session decodes plainly.

A session whose adaptive length switched speculation off decodes plainly until its next probe
(adaptive.py), and the draft sees none of those tokens: the probe's Propose first prefills every
one of them (up to longest_probe_wait, 64), on the probe's critical path, and a session that was
refused from its start has no draft session at all, so its first probe also prefills the whole
prompt. On two GPUs at alpha 0.6 a probe after a plain run cost about 23 ms against 14 ms for two
plain tokens (docs/BENCHMARKS.md, round 24), which is what makes switching off dear and probes rare.

So every `every` plain tokens the loop hands the draft what it has not seen, in the background:
a Propose of one token (the accept/rollback message appends the committed tokens, and drafting one
token is one forward over them, which is the feed; the token itself is ignored, the next Propose
rolls it back unless the target committed the same). The plain steps never wait for it: the draft
runs on its own device (or core) while the target decodes. Before the session's next draft call the
loop waits for the feed in flight (settle), so the draft's messages stay in order and the cursor
says what the draft holds. A feed that fails leaves the draft to be reopened by the next Propose,
as any draft failure does; it never fails the request.

Off by default (the coordinator's --feed-draft-every): on two H200s at acceptance 0.6 probes that
cost less made the switch-off rule (_paying_wait) switch off twice as often, at the same speed
within 1%, and a CPU sweep came out 3% slower, within its spread (docs/BENCHMARKS.md, round 25).

The feed's model time belongs to no cycle (its context leaves the cycle being measured): it is
off every critical path, and charged to the plain step that spawned it, it would price plain
decoding as dearer than it is.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from specdec.engine.cycle_cost import unmeasured

if TYPE_CHECKING:
    from specdec.generation.loop import SpeculativeLoop
    from specdec.generation.session import SessionCursor

log = logging.getLogger(__name__)

LEAST_STEPS_LEFT = 2


class DraftFeed:
    def __init__(self, loop: "SpeculativeLoop", every: int):
        self.loop = loop
        self.every = every  # plain tokens the draft may lag before a feed; 0: never feed
        self.feeds = 0  # feeds started (tests, logs)
        self._task: asyncio.Task | None = None

    async def after_plain_step(self, cursor: "SessionCursor", steps_left: int) -> None:
        """A plain step committed tokens while speculation is off, and the plain run has steps_left
        steps to go: feed the draft if it lags by `every` tokens or more, no feed is in flight, and
        the run has at least LEAST_STEPS_LEFT steps to overlap the feed with (a feed at the run's end
        would hold up the probe, which waits for it, by a round trip)."""
        if self.every <= 0 or steps_left < LEAST_STEPS_LEFT or (self._task is not None and not self._task.done()):
            return
        seen = cursor.draft_committed if cursor.draft_ready else 0
        if cursor.position - seen >= self.every:
            await self.settle()  # a finished feed: collect it
            self.feeds += 1
            self.loop.observer.fed_draft()
            self._task = asyncio.get_running_loop().create_task(self._feed(cursor))
            # Let it send its message now: an in-process target's plain run may not yield before
            # the run ends (a service's does at every token).
            await asyncio.sleep(0)

    async def _feed(self, cursor: "SessionCursor") -> None:
        with unmeasured():
            try:
                # _propose opens the draft's session first if it has none (a session refused from
                # its start): that prefill leaves the probe's critical path too.
                await self.loop._propose(cursor, 1)
            except Exception as exc:  # the next Propose reopens the draft's session
                log.info("feeding the draft failed for session %s: %s", cursor.session_id, exc)
                cursor.draft_ready = False

    async def settle(self) -> None:
        """Wait for the feed in flight, if any (before any other draft call of the session)."""
        task, self._task = self._task, None
        if task is not None:
            await task

    async def cancel(self) -> None:
        """The turn ends (or was cancelled): stop a feed in flight and wait for it to be gone."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
