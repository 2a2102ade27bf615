"""The draft's session opened beside the target's prefill (specdec/generation/draft_opening.py): the
pieces the coordinator's tests (test_coordinator.py, test_refused_at_start.py) do not reach."""

from __future__ import annotations

import asyncio

import pytest

from specdec.errors import ServiceUnavailable
from specdec.generation import draft_opening
from specdec.generation.loop import SessionCursor
from specdec.sampling.params import SamplingParams


class Draft:
    def __init__(self, fail: bool = False):
        self.fail, self.release, self.opened = fail, asyncio.Event(), []

    async def start_session(self, session_id, token_ids, params):
        await self.release.wait()
        if self.fail:
            raise ServiceUnavailable("draft down")
        self.opened.append((session_id, list(token_ids)))


def cursor() -> SessionCursor:
    return SessionCursor("s", SamplingParams(), [1, 2, 3], 64)


async def test_an_opening_holds_the_prompt_once_waited_for():
    draft, c = Draft(), cursor()
    draft_opening.open_beside_prefill(draft, c, [1, 2, 3])
    c.tokens.append(9)  # the target's first token, meanwhile
    assert not c.draft_ready
    draft.release.set()
    await draft_opening.wait(c)
    assert draft.opened == [("s", [1, 2, 3])] and c.draft_ready and c.draft_opening is None
    assert c.draft_tokens == [1, 2, 3] and c.draft_committed == 3 and c.draft_epoch == 0
    await draft_opening.wait(c)  # nothing pending: returns at once


async def test_a_failed_opening_is_the_first_proposes_failure_and_a_discarded_one_is_cancelled():
    failing, c = Draft(fail=True), cursor()
    draft_opening.open_beside_prefill(failing, c, [1, 2, 3])
    failing.release.set()
    with pytest.raises(ServiceUnavailable):
        await draft_opening.wait(c)
    assert not c.draft_ready
    slow, c = Draft(), cursor()
    draft_opening.open_beside_prefill(slow, c, [1, 2, 3])
    opening = c.draft_opening
    draft_opening.discard(c)  # the turn ended (a stop at the first token) before its loop proposed
    await asyncio.sleep(0)
    assert opening.cancelled() and not c.draft_ready and c.draft_opening is None and not slow.opened
    done, c = Draft(fail=True), cursor()
    draft_opening.open_beside_prefill(done, c, [1, 2, 3])
    done.release.set()
    await asyncio.sleep(0.01)
    draft_opening.discard(c)  # its failure read: no "exception was never retrieved"
    assert not c.draft_ready


def test_start_verdicts_remember_each_routes_last_new_session():
    verdicts = draft_opening.StartVerdicts(max_routes=2)
    assert verdicts.expects_drafting("t1", "d1")
    verdicts.record("t1", "d1", refused=True)
    verdicts.record("t2", "d1", refused=False)
    assert not verdicts.expects_drafting("t1", "d1") and verdicts.expects_drafting("t2", "d1")
    verdicts.record("t3", "d1", refused=True)  # the oldest route goes
    assert verdicts.expects_drafting("t1", "d1") and not verdicts.expects_drafting("t3", "d1")
    verdicts.record("t3", "d1", refused=False)
    assert verdicts.expects_drafting("t3", "d1")
