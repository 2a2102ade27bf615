"""Pricing each drafted token by the draft's confidence in it, not only by its session's acceptance.

The goodput trimmer (goodput.py) keeps a drafted token when its expected gain beats what its compute
buys at the step's goodput. With one acceptance rate per session, every token of a draft is priced
alike: at 16 sessions on 2 CPU cores a drafted token pays only above an acceptance of about 0.67, the
default pair accepts 0.53-0.57, and every step decoded plainly (docs/BENCHMARKS.md, rounds 28-29).
Yet the draft knows which of its tokens are sure. Teacher-forced over the target's greedy answers to
26 Spec-Bench dev prompts, the default draft's token agreed with the target's 0.86 of the time where
its confidence was at least 0.5 (45% of the tokens), 0.97 at 0.9 or more (15%), and 0.29 below 0.5.

So a draft that comes with its confidences (the draft model the target hosts, inner_draft.py; drafts
from a draft service carry none) is priced per token: token j's chance that it and every drafted
token before it are accepted is the calibrated survival of their confidence product
(generation/confidence.ConfidenceCalibration, learned here from every verified draft with
confidences, across sessions: a draft's calibration is mostly the draft's own). The trim after
drafting then keeps the sure tokens and cuts the rest. Cutting a draft to a prefix is verifying a
shorter draft: the output is unchanged.

Before a hosted draft is made, the plan cannot see its confidences. It prices each token at what it
is expected to gain and to cost once the sure tokens are picked (expected_draft): from the first
drafted tokens seen so far, how many would pass the step's break-even, and how often those were
accepted. A step then drafts when its sure tokens would pay for the draft's passes.
"""

from __future__ import annotations

from collections import OrderedDict

from specdec.generation.confidence import ConfidenceCalibration
from specdec.types import DraftBlock, VerifyOutcome

MIN_PASSING_SHARE = 0.05  # of first drafted tokens: fewer passing than this, and no draft is planned for them


class ConfidencePricing:
    """Calibration of the drafts' confidences against verification, and which sessions draft with
    them (thread-confined like the trimmer)."""

    def __init__(self, max_sessions: int = 4096):
        self.calibration = ConfidenceCalibration()  # every verified drafted token
        self.first_tokens = ConfidenceCalibration()  # first drafted tokens only: how often each bin occurs
        self.max_sessions = max_sessions
        self._confident: OrderedDict[str, None] = OrderedDict()  # sessions whose drafts carry confidences

    def observe(self, session_id: str, draft: DraftBlock, outcome: VerifyOutcome) -> None:
        """A verified draft (as the step verified it, trimmed): learn from its confidences, if any."""
        confidences = draft.confidences[:outcome.num_drafted]
        if not confidences:
            return
        self.calibration.observe(confidences, outcome.num_accepted)
        self.first_tokens.observe(confidences[:1], outcome.num_accepted)
        self.drafts_with_confidences(session_id)

    def drafts_with_confidences(self, session_id: str) -> None:
        """The session's drafts come with confidences (it drafts with the draft model hosted here)."""
        self._confident[session_id] = None
        self._confident.move_to_end(session_id)
        while len(self._confident) > self.max_sessions:
            self._confident.popitem(last=False)

    def is_confident(self, session_id: str) -> bool:
        return session_id in self._confident

    def survival(self, draft: DraftBlock) -> tuple[float, ...]:
        """Per drafted token, the calibrated chance that it and every one before it are accepted
        (non-increasing, as the plans need); () for a draft without confidences."""
        if not draft.confidences or len(draft.confidences) != draft.num_tokens:
            return ()
        out, product, lowest = [], 1.0, 1.0
        for confidence in draft.confidences:
            product *= max(0.0, min(1.0, confidence))
            lowest = min(lowest, self.calibration.survival(product))
            out.append(lowest)
        return tuple(out)

    def expected_draft(self, length: int, break_even: float) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """For a draft of `length` tokens not made yet, priced before drafting: per token, its
        expected gain and its chance to be verified at all (the trim after drafting keeps only the
        tokens whose survival beats `break_even`). From the first drafted tokens seen so far: a share
        s of them passed, accepted at a mean survival a; token j is taken to pass with s ** j and to
        gain (s * a) ** j, so each verified one gains a ** j. None before any first token was seen,
        or when fewer than MIN_PASSING_SHARE of them would pass."""
        weights, _ = self.first_tokens.shares()
        if not weights:
            return None
        bins = len(weights)
        passing = [(w, self.first_tokens.survival((b + 0.5) / bins)) for b, w in enumerate(weights)]
        passing = [(w, s) for w, s in passing if s > break_even]
        share = sum(w for w, _ in passing)
        if share < MIN_PASSING_SHARE:
            return None
        acceptance = sum(w * s for w, s in passing) / share
        return (tuple((share * acceptance) ** j for j in range(1, length + 1)),
                tuple(share ** j for j in range(1, length + 1)))
