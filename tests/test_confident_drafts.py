"""Drafts priced per token by the draft's confidences (specdec.engine.confident_drafts): the trimmer
keeps a draft's sure tokens where its session's average acceptance would cut them all, plans hosted
drafts at the acceptance of the tokens that would pass, and the plans stay the best by brute force.
Trimmed verification stays lossless: test_batching_goodput.py; drafts hosted by the target end to
end: test_target_stream.py."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from specdec.engine.batch import DecodeWork, VerifyWork
from specdec.engine.confident_drafts import ConfidencePricing
from specdec.engine.inner_draft import InnerDraftWork
from specdec.engine.inner_length import DraftLength
from specdec.engine.step_plan import RowSpec, packed_plan
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock, VerifyOutcome
from tests.test_batching_goodput import ALPHA, BETA, teach, trimmer_with_cost

SURE, UNSURE = 0.97, 0.15


def confident(session_id: str, confidences: tuple[float, ...]) -> VerifyWork:
    return VerifyWork(session_id, 10, DraftBlock(torch.arange(len(confidences)), confidences=confidences))


def teach_calibration(trimmer, blocks: int = 60) -> None:
    """Verified drafts where sure tokens are accepted and unsure ones rejected (the step cost kept)."""
    cost = copy.deepcopy(trimmer.cost)
    for n in range(blocks):
        session_id = f"taught{n % 4}"
        for confidences, accepted in (((SURE, SURE, UNSURE), 2), ((UNSURE, SURE), 0)):
            trimmer.observe([confident(session_id, confidences)],
                            [VerifyOutcome(0, len(confidences), accepted, 0)], ALPHA)
    trimmer.cost = cost


def sixteen_session_step(first: VerifyWork | InnerDraftWork) -> list:
    return [first, *(DecodeWork(f"p{i}", 10) for i in range(15))]


def test_survival_is_the_calibrated_chance_of_each_prefix_and_never_rises():
    pricing = ConfidencePricing()
    assert pricing.survival(DraftBlock(torch.arange(3))) == ()  # no confidences: the session's acceptance
    for _ in range(50):
        pricing.observe("s", DraftBlock(torch.arange(2), confidences=(0.95, 0.95)), VerifyOutcome(0, 2, 2, 0))
        pricing.observe("s", DraftBlock(torch.arange(1), confidences=(0.05,)), VerifyOutcome(0, 1, 0, 0))
    survival = pricing.survival(DraftBlock(torch.arange(4), confidences=(0.95, 0.95, 0.3, 0.99)))
    assert survival[0] > 0.8 and survival[1] > 0.7  # products 0.95 and 0.90, all accepted
    assert survival[2] < 0.3  # product 0.27: the prior (few seen there)
    assert list(survival) == sorted(survival, reverse=True) and survival[3] == survival[2]
    assert pricing.is_confident("s") and not pricing.is_confident("other")


def test_a_draft_not_made_yet_is_priced_by_how_many_of_its_tokens_will_be_sure():
    pricing = ConfidencePricing()
    assert pricing.expected_draft(3, 0.5) is None  # nothing seen yet
    for _ in range(40):  # half the first tokens sure and accepted, half unsure and rejected
        pricing.observe("s", DraftBlock(torch.arange(1), confidences=(SURE,)), VerifyOutcome(0, 1, 1, 0))
        pricing.observe("s", DraftBlock(torch.arange(1), confidences=(UNSURE,)), VerifyOutcome(0, 1, 0, 0))
    gains, verified = pricing.expected_draft(3, 0.67)
    assert verified == pytest.approx((0.5, 0.25, 0.125), abs=0.03)  # only the sure half passes the trim
    accepted = gains[0] / verified[0]  # per verified token: the sure tokens' acceptance
    assert accepted > 0.9 and [g / v for g, v in zip(gains, verified)] == pytest.approx([accepted ** j for j in (1, 2, 3)])
    assert pricing.expected_draft(3, 0.999) is None  # none would pass
    gains, verified = pricing.expected_draft(1, 0.0)  # every first token passes: the plain average
    assert verified == pytest.approx((1.0,)) and gains[0] == pytest.approx(0.5, abs=0.1)


def test_sure_tokens_pass_where_the_sessions_average_acceptance_cuts_every_draft():
    """At 16 sessions a drafted token pays only well above the session's 0.5; the sure prefix of a
    draft with confidences is kept, its unsure tail cut; the same tokens without confidences are
    all cut."""
    trimmer = trimmer_with_cost(packed=True)
    teach_calibration(trimmer)
    teach(trimmer, "s", 1, 4)  # acceptance about 0.54 (a token pays above 0.62)
    kept = trimmer.trim(sixteen_session_step(confident("s", (SURE, SURE, UNSURE, SURE))))[0]
    assert kept.draft.num_tokens == 2 and kept.draft.confidences == (SURE, SURE)
    plain = trimmer.trim(sixteen_session_step(VerifyWork("s", 10, DraftBlock(torch.arange(4)))))[0]
    assert plain.draft.num_tokens == 0
    assert trimmer.trim(sixteen_session_step(confident("s", (UNSURE, SURE))))[0].draft.num_tokens == 0


def test_a_hosted_draft_is_planned_by_what_its_sure_tokens_gain_and_cost():
    """Before drafting, a row of the hosted draft model is priced at what its sure tokens will gain
    and cost, so it drafts where its session's average would not. Its session's plain rows are told
    so (draft_limits), a session drafting elsewhere is not; and sixteen such rows sharing the draft's
    passes are each told to draft, where one row alone would pay a whole pass."""
    trimmer = trimmer_with_cost(packed=True)
    teach(trimmer, "s", 1, 4)  # acceptance about 0.54 (a token pays above 0.62)
    hosted = InnerDraftWork("s", 10, 4, SamplingParams())
    assert trimmer.plan(sixteen_session_step(hosted), drafting_here=True)[0] == 0  # nothing calibrated yet
    teach_calibration(trimmer)
    assert trimmer.plan(sixteen_session_step(hosted), drafting_here=True)[0] >= 1
    teach(trimmer, "elsewhere", 1, 4)
    trimmer.trim([DecodeWork("s", 10), DecodeWork("elsewhere", 10), *(DecodeWork(f"p{i}", 10) for i in range(14))])
    assert trimmer.draft_limits["s"] >= 1 and trimmer.draft_limits["elsewhere"] == 0
    trimmer.observe_draft(steps=1, seconds=BETA)  # a draft pass costs as much as a verified token
    trimmer.trim([DecodeWork("s", 10), *(DecodeWork(f"p{i}", 10) for i in range(15))])
    assert trimmer.draft_limits["s"] == 0  # alone among plain rows it would pay the whole pass
    for i in range(15):
        trimmer.confidence.drafts_with_confidences(f"h{i}")
    trimmer.trim([DecodeWork("s", 10), *(DecodeWork(f"h{i}", 10) for i in range(15))])
    assert trimmer.draft_limits["s"] >= 1 and trimmer.draft_limits["h3"] >= 1


@pytest.mark.parametrize("draft_step_s", [0.0, 0.004])
def test_the_packed_plan_with_survivals_is_the_best_by_brute_force(draft_step_s):
    rows = [RowSpec(1, 3, 0.5, (0.95, 0.9, 0.2)), RowSpec(1, 3, 0.5, (0.4, 0.35, 0.35)),
            RowSpec(1, 3, 0.0, (0.45, 0.2, 0.09), (0.5, 0.25, 0.125)), RowSpec(1, 2, 0.8),
            RowSpec(1, 0, 0.5), RowSpec(2, 0, 0.5)]

    def goodput(kept) -> float:
        gain = sum(1 + sum(r.token_gain(j) for j in range(1, d + 1)) for r, d in zip(rows, kept))
        tokens = sum(r.base + sum(r.token_cost(j) for j in range(1, d + 1)) for r, d in zip(rows, kept))
        return gain / (ALPHA + BETA * tokens + max(kept) * draft_step_s)

    plan = packed_plan(rows, ALPHA, BETA, margin=0.0, draft_step_s=draft_step_s)
    best = max(goodput(ks) for ks in itertools.product(*(range(r.draft + 1) for r in rows)))
    assert goodput(plan.kept) == pytest.approx(best) and plan.goodput == pytest.approx(best)
    assert plan.kept[2] > 0  # gains half of a verified token's compute at 0.9 each: it pays
    assert rows[0].gains(4) == pytest.approx([1.0, 1.0, 1.95, 2.85, 3.05])


def test_a_cut_by_confidence_does_not_limit_the_next_draft():
    length = DraftLength(4)
    length.kept(4, 4, 4, VerifyOutcome(0, 1, 0, 0), by_confidence=True)  # unsure tokens cut after drafting
    assert length.next(room=10) == (4, 0.0)
    length.kept(4, 2, 2, VerifyOutcome(0, 1, 0, 0), by_confidence=True)  # the plan allowed 2
    assert length.next(room=10) == (2, 0.0)
    length.kept(4, 4, 4, VerifyOutcome(0, 1, 0, 0))  # a draft priced by its session: the cut holds
    assert length.next(room=10) == (1, 0.0)


def test_a_draft_pass_is_priced_by_the_rows_it_drafts():
    """One core drafts sixteen rows in about ten times a lone row's step: a pass is fitted against
    its rows, and until passes of two sizes were seen it is their average step."""
    trimmer = trimmer_with_cost(packed=True)
    assert trimmer.draft_pass_s(16) == 0.0  # no pass seen
    trimmer.observe_draft(steps=2, seconds=2 * 0.0007, rows=1)
    assert trimmer.draft_pass_s(16) == pytest.approx(0.0007)
    for rows in (1, 4, 16) * 4:
        trimmer.observe_draft(steps=1, seconds=0.0003 + 0.0004 * rows, rows=rows)
    assert trimmer.draft_pass_s(1) == pytest.approx(0.0007, rel=0.05)
    assert trimmer.draft_pass_s(16) == pytest.approx(0.0067, rel=0.05)
