"""Sessions share the loaded target's refusals: one that starts while the target trims every draft
away starts by decoding plainly instead of drafting warm-up blocks the target would refuse."""

from __future__ import annotations

from specdec.generation.loop import LoopSettings, SpeculativeLoop
from specdec.generation.refusals import TargetRefusals


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_holds_for_hold_s_unless_a_draft_is_verified():
    clock = Clock()
    refusals = TargetRefusals(hold_s=5.0, clock=clock)
    assert not refusals.refusing()
    refusals.observe(4, 2)  # trimmed, not refused
    assert not refusals.refusing()
    refusals.observe(4, 0)
    assert refusals.refusing()
    clock.now += 4.9
    assert refusals.refusing()
    clock.now += 0.2
    assert not refusals.refusing()  # old news
    refusals.observe(4, 0)
    refusals.observe(0, 0)  # a plain step says nothing about drafts
    assert refusals.refusing()
    refusals.observe(3, 3)  # the target lets drafts through again
    assert not refusals.refusing()


def test_a_session_starting_while_the_target_refuses_decodes_plainly_and_probes_later():
    refusals = TargetRefusals()
    draft = object()  # the constructor only needs to know there is one
    for adaptive in (True, False):
        fresh = SpeculativeLoop(None, draft, LoopSettings(num_draft_tokens=4, adaptive=adaptive), refusals=refusals)
        assert fresh.policy.next_k() == 4
    refusals.observe(4, 0)
    for adaptive in (True, False):
        loop = SpeculativeLoop(None, draft, LoopSettings(num_draft_tokens=4, adaptive=adaptive), refusals=refusals)
        ks = []
        for _ in range(40):
            k = loop.policy.next_k()
            ks.append(k)
            if k == 0:
                loop.policy.observe_plain(0.040)
        assert ks[0] == 0 and 4 in ks  # plain first, then a probe (after 2 x probe_every plain steps)
        assert ks.index(4) == 2 * loop.policy.probe_every
