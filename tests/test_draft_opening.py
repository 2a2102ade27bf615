"""The draft's session opened beside the target's prefill (specdec/generation/draft_opening.py): the
pieces the coordinator's tests (test_coordinator.py, test_refused_at_start.py) do not reach."""

from __future__ import annotations

import asyncio

import pytest

from specdec.errors import ServiceUnavailable
from specdec.generation import draft_opening
from specdec.generation.session import SessionCursor
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


async def test_the_first_cycle_after_an_opening_is_no_steady_cycle_and_the_output_is_plain_decodings(
        tmp_path_factory):
    """The first Propose may wait for the opening's prefill: that cycle is left out of the policy's
    costs, like a cycle whose Propose prefilled itself (on two GPUs the warm-up's first cycle, counted
    as steady, priced drafting so high that the next turns switched off at alpha 0.8)."""
    from service_procs import tiny_model_dir
    from specdec.engine.draft import DraftEngine
    from specdec.engine.local import LocalDraft, LocalTarget
    from specdec.engine.target import TargetEngine
    from specdec.generation.adaptive import DraftLengthPolicy
    from specdec.generation.loop import SpeculativeLoop, start_generation
    from specdec.generation.session import LoopSettings
    from specdec.generation.stopping import StopChecker
    from specdec.models.loader import load_model
    from specdec.proposers.draft_model import DraftModelProposer

    base = tmp_path_factory.getbasetemp()
    target_dir = tiny_model_dir(base, "target", seed=0)
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=2, max_context=128))
    target, prompt, outputs, steady = LocalTarget(engine), [1, 5, 9, 12, 5, 9], {}, []
    observe_cycle = DraftLengthPolicy.observe_cycle

    def watched(policy, *args, **kwargs):
        steady.append(kwargs.get("steady", True))
        observe_cycle(policy, *args, **kwargs)

    for name, draft in (("plain", None), ("speculative", LocalDraft(DraftEngine(DraftModelProposer(
            load_model(target_dir, backend="native", num_slots=2, max_context=128)))))):
        cursor, first = await start_generation(target, name, prompt, SamplingParams())
        if draft is not None:
            draft_opening.open_beside_prefill(draft, cursor, prompt)
        loop = SpeculativeLoop(target, draft, LoopSettings(4, adaptive=True))
        if loop.policy is not None:
            loop.policy.observe_cycle = watched.__get__(loop.policy)
        result = await loop.run(cursor, StopChecker(24, ()), _ignore)
        outputs[name] = [first, *result.token_ids]
    assert outputs["speculative"] == outputs["plain"]
    assert len(steady) > 2 and steady[0] is False and all(steady[1:])


async def _ignore(tokens):
    pass
