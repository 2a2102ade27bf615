"""A joint draft tried after a plain stretch (specdec.engine.exploration), alone and in the goodput
trimmer's padded plans: a price too high to let any draft through gets a step that tells it."""

from __future__ import annotations

import itertools

from specdec.engine.batch import DecodeWork
from specdec.engine.exploration import FIRST_INTERVAL, JointExploration
from specdec.engine.goodput import DraftTrimmer
from specdec.engine.inner_draft import InnerDraftWork
from specdec.sampling.params import SamplingParams


def test_rows_that_could_draft_together_try_after_a_plain_stretch_then_less_often():
    explore = JointExploration()
    assert not any(explore.planned(False, 16) for _ in range(FIRST_INTERVAL - 1))
    assert explore.planned(False, 16) and explore.holding
    assert not explore.planned(False, 16)  # one at a time
    assert explore.width(1, [1, 1, 2]) == 2 and explore.width(3, [1]) == 3  # one drafted token at least
    explore.observed(verified_drafts=True)  # the step that tells the fits ran
    assert explore.width(1, [1]) == 1
    # The prices did not take it up: the next try comes after twice the stretch.
    assert not any(explore.planned(False, 16) for _ in range(2 * FIRST_INTERVAL - 1))
    assert explore.planned(False, 16)
    explore.observed(verified_drafts=True)
    explore.planned(True, 16)  # the prices draft: back to the first interval
    assert explore.interval == FIRST_INTERVAL


def test_an_exploration_lapses_when_no_draft_comes_and_a_lone_row_never_explores():
    explore = JointExploration(hold_plans=3)
    assert not any(explore.planned(False, 1) for _ in range(10 * FIRST_INTERVAL))
    for _ in range(FIRST_INTERVAL):
        explore.planned(False, 4)
    assert explore.holding == 3
    for _ in range(3):
        assert explore.width(1, []) == 1  # plans without drafts: the rows did not take the offer
    assert explore.holding == 0 and explore.width(1, [1]) == 1


def dear_width_trimmer() -> DraftTrimmer:
    """One H200 after a draft-service pool's slow verify steps (round 40's trace): a token of width
    priced at 1 ms (0.0125 measured when the hosted batch drafts), the hosted draft at 3.8 ms a step."""
    trimmer = DraftTrimmer()
    for rows, width in itertools.product(range(1, 17), (1, 1, 1, 2)):
        trimmer.cost.observe(rows * width, 0.0064 + 0.00031 * rows + 0.001 * rows * (width - 1), rows)
    trimmer.observe_draft(steps=2, seconds=2 * 0.0038, rows=8)
    return trimmer


def test_a_hosted_batch_held_plain_by_a_dear_price_tries_one_step_together():
    trimmer = dear_width_trimmer()
    hosted = [f"h{i}" for i in range(14)]
    elsewhere = ["s0", "s1"]  # sessions of a draft service: their round trips are priced apart
    for session_id in elsewhere:
        trimmer.admit_drafting_elsewhere(session_id, 0.0, "draft:50051")
    plain = [DecodeWork(s, 100) for s in hosted + elsewhere]
    for _ in range(FIRST_INTERVAL - 1):
        trimmer.plan(plain)
        assert not any(trimmer.draft_limits.values())
    trimmer.plan(plain)
    assert all(trimmer.draft_limits[s] == 1 for s in hosted)
    assert all(trimmer.draft_limits[s] == 0 for s in elsewhere)
    # The rows draft: the dear price would cut every token, the exploration keeps one each.
    drafting = [InnerDraftWork(s, 100, 1, SamplingParams()) for s in hosted] + plain[len(hosted):]
    assert trimmer.plan(drafting, drafting_here=True) == [1] * len(hosted) + [0, 0]
    fresh = dear_width_trimmer()
    assert fresh.plan(drafting, drafting_here=True) == [0] * len(drafting)
