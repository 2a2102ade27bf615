"""A new session's draft prefills the prompt beside the target, not inside the first cycle.

The loop opened the draft's session (StartSession: a prefill of the whole prompt) at its first
Propose, after the target's prefill and first token, so that prefill sat on every speculative
turn's critical path, before the turn's first cycle could tell whether drafting pays; on the CPU
pair the Propose time per cycle fell by 0.3-1.0 ms (some 20-50 ms of a 128-token answer) once it
moved out (docs/BENCHMARKS.md, round 26). The coordinator (coordinator/turn.py) now sends the
draft's StartSession together with the target's; the loop waits for it where the draft is first
needed (wait()), so the first token never waits for the draft, and a failed opening is that
Propose's failure: the turn decodes plainly as after any draft failure. That first cycle stays out
of the adaptive length's costs (it may include the wait). A turn that never proposes stops waiting
for the opening (discard()).

Under load a target may refuse a new session's drafts at its start (the session decodes plainly
until the target lets a probe through), and such a session should not take a draft slot and a
prefill for nothing: the coordinator remembers, per route, whether the last new session was refused
(StartVerdicts) and opens the draft beside the prefill only where it was not.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from specdec.engine.cycle_cost import unmeasured

if TYPE_CHECKING:
    from specdec.engine.api import DraftAPI
    from specdec.generation.session import SessionCursor


def open_beside_prefill(draft: "DraftAPI", cursor: "SessionCursor", prompt: Sequence[int]) -> None:
    """Start the draft's session on `prompt` now, in the background (cursor.draft_opening)."""
    prompt = list(prompt)

    async def open_draft() -> None:
        with unmeasured():  # beside the target's prefill: no cycle's cost
            await draft.start_session(cursor.session_id, prompt, cursor.params)
        cursor.draft_tokens, cursor.draft_committed, cursor.draft_epoch = list(prompt), len(prompt), 0
        cursor.draft_ready = True

    cursor.draft_opening = asyncio.ensure_future(open_draft())


async def wait(cursor: "SessionCursor") -> None:
    """Before the session's first draft call: the opening's end (its error, if it failed)."""
    opening, cursor.draft_opening = cursor.draft_opening, None
    if opening is not None:
        await opening


def discard(cursor: "SessionCursor") -> None:
    """At the turn's end: an opening the turn never waited for is cancelled if still in flight (the
    draft may then hold a session, which the next opening ends first), its failure, if any, read."""
    opening, cursor.draft_opening = cursor.draft_opening, None
    if opening is None:
        return
    if not opening.done():
        opening.cancel()  # not awaited: this may run because the turn itself is being cancelled
        cursor.draft_ready = False
    elif opening.cancelled() or opening.exception() is not None:
        cursor.draft_ready = False


@dataclass
class StartVerdicts:
    """Per (target, draft) route: did the target refuse the drafts of the last new session at its start?"""

    refused: dict[tuple[str, str], bool] = field(default_factory=dict)
    max_routes: int = 256  # a bound for coordinators whose replicas come and go

    def expects_drafting(self, target: str, draft: str) -> bool:
        return not self.refused.get((target, draft), False)

    def record(self, target: str, draft: str, refused: bool) -> None:
        self.refused.pop((target, draft), None)
        if len(self.refused) >= self.max_routes:
            self.refused.pop(next(iter(self.refused)))  # the oldest route
        self.refused[(target, draft)] = refused
