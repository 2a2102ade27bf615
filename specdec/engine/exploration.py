"""Trying a joint draft after a plain stretch (the goodput trimmer's padded plans, goodput.py).

The trimmer learns what drafting costs only from steps that drafted: a step's width from steps of
other widths (step_cost.StepCost), the hosted draft's passes from passes (DraftStepPrice). A price
that is too low lets drafts through, and their steps correct it; a price that is too high lets none
through, and nothing ever corrects it. On one H200 (8B target, 1B draft hosted, 16 sessions) the
trimmer's price of a token of width sat at 0.1-0.2 ms after plain stretches, against 0.0125 ms
measured, right at the joint probe's break-even: batches that started plain stayed plain for whole
waves of sessions (0.94 of plain decoding), where drafting together gave 1.11 (docs/BENCHMARKS.md,
round 40).

So after `interval` plans in a row in which plain rows that could draft together (the joint probe's
rows) stayed plain, those rows are told to draft one token each (a draft_limit of at least 1), and
the plans that then hold their drafts keep one token each whatever the prices say, until a step
that verified drafted tokens is observed: what it cost tells the fits. An exploration the prices do
not take up doubles the interval (up to max_interval); a plan whose prices draft resets it. The
cost where drafting does not pay is one step's drafts (and the draft's catch-up) per interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_INTERVAL = 64  # plain plans before the first exploration (a second of steps on a GPU)


@dataclass
class JointExploration:
    first_interval: int = FIRST_INTERVAL
    max_interval: int = 1024
    hold_plans: int = 8  # plans an exploration waits for the rows' drafts before it lapses
    interval: int = field(init=False)  # plain plans before the next exploration: first_interval, doubling
    plain_plans: int = 0  # plans in a row that stayed plain while rows could have drafted together
    holding: int = 0  # > 0: an exploration is on, for at most this many more plans without drafts
    explorations: int = 0  # how many were started (a metric)

    def __post_init__(self) -> None:
        self.interval = self.first_interval

    def planned(self, prices_draft: bool, joint_rows: int) -> bool:
        """After a plan: `prices_draft`, whether its own prices drafted (the step, or a plain row's
        probe); `joint_rows`, the plain rows that may probe together. True: tell those rows to draft."""
        if prices_draft:
            self.plain_plans, self.interval = 0, self.first_interval
            return False
        if joint_rows < 2 or self.holding:
            return False
        self.plain_plans += 1
        if self.plain_plans < self.interval:
            return False
        self.plain_plans, self.interval = 0, min(2 * self.interval, self.max_interval)
        self.holding, self.explorations = self.hold_plans, self.explorations + 1
        return True

    def width(self, width: int, drafting_bases: list[int]) -> int:
        """The step's width while an exploration holds: at least one drafted token for the narrowest
        row that drafted (`drafting_bases`, the bases of the rows with drafts). A plan with no drafts
        counts towards the exploration's lapse."""
        if not self.holding:
            return width
        if not drafting_bases:
            self.holding -= 1
            return width
        return max(width, min(drafting_bases) + 1)

    def observed(self, verified_drafts: bool) -> None:
        """A step ran; `verified_drafts`: it verified drafted tokens, so the fits have been told."""
        if verified_drafts:
            self.holding = 0
