"""Which drafted tokens a batched step verifies: the goodput plans of goodput.py, as pure functions.

A step commits sum_i E_i(d_i) tokens in expectation, E_i(d) = 1 + a_i + ... + a_i^d (Leviathan et
al. 2023, sec. 3.1), and costs T = alpha + beta * n seconds (goodput.StepCost's fit). What n is
depends on how the backend runs a batch of ragged rows:

- padded (the CUDA graphs' static shapes): every row is as wide as the widest, n = rows x width.
  Widening the step is what costs; a row's drafted tokens up to the width ride along for free. The
  plan is a width (padded_width).
- packed (the native backend's eager path: projections and MLP on each row's own tokens only;
  transformers, which runs rows one at a time): n is the tokens fed, so each drafted token costs
  beta whichever row it is in. The plan keeps, over all rows, the drafted tokens whose expected gain
  beats what beta buys at the step's goodput (packed_plan). Priced as padded there, one row's draft
  of 4 among 15 plain rows counted 80 tokens against the 20 it costs, and drafts that paid were cut
  (docs/BENCHMARKS.md, round 29).

Either plan verifies a prefix of each draft, a shorter draft: the output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RowSpec:
    """A row of a step as planned: its width without drafted tokens, the most it may draft, and its
    session's acceptance rate."""

    base: int
    draft: int
    acceptance: float

    def gains(self, widest: int) -> list[float]:
        """Expected tokens the row commits in a padded step of each width 0..widest: 1 + a + ... + a^d,
        with d the drafted tokens that fit."""
        out, gain, term = [], 1.0, 1.0
        for width in range(widest + 1):
            if self.base < width <= self.base + self.draft:  # one more drafted token fits
                term *= self.acceptance
                gain += term
            out.append(gain)
        return out


def padded_width(num_rows: int, plain_width: int, gains: Sequence[float], alpha: float, beta: float,
                 margin: float, drafting: Sequence[float] | None = None) -> int:
    """The padded step's width with the best goodput, given the rows' summed expected tokens by width
    (gains[width]); plain_width (no drafted tokens) unless a wider step beats plain decoding by the
    margin. drafting[width]: what drafting that wide costs on the same thread first (the hosted draft
    model's passes), if anything."""
    plain = num_rows / (alpha + beta * num_rows * plain_width)
    best_width, best = plain_width, plain
    for width in range(plain_width + 1, len(gains)):
        extra = drafting[width] if drafting else 0.0
        goodput = gains[width] / (alpha + beta * num_rows * width + extra)
        if goodput > best:
            best_width, best = width, goodput
    if best < (1.0 + margin) * plain:
        return plain_width  # not worth what the step cost does not show: decode plainly
    return best_width


@dataclass(frozen=True)
class PackedPlan:
    """What packed_plan keeps of each row, and the step's expected tokens and cost with it (and
    without any drafted token: plain)."""

    kept: list[int]
    gain: float
    cost: float
    plain_gain: float
    plain_cost: float

    @property
    def goodput(self) -> float:
        return self.gain / self.cost

    def limit(self, acceptance: float, most: int, beta: float, margin: float, draft_step_s: float = 0.0) -> int:
        """Drafted tokens a plain row of this acceptance would keep as a verify of up to `most`: the
        count that makes this step's goodput highest with them in it (each costs beta, and a pass of
        the hosted draft, draft_step_s, past the plan's longest draft); where the plan kept none,
        only if they raise plain decoding's goodput by the margin."""
        longest = max(self.kept, default=0)
        best_count, best, gain, term = 0, self.goodput, self.gain, 1.0
        for count in range(1, most + 1):
            term *= acceptance
            gain += term
            goodput = gain / (self.cost + count * beta + max(0, count - longest) * draft_step_s)
            if goodput > best:
                best_count, best = count, goodput
        if best_count and not longest and best < (1.0 + margin) * self.plain_gain / self.plain_cost:
            return 0
        return best_count


def packed_plan(rows: Sequence[RowSpec], alpha: float, beta: float, margin: float,
                draft_step_s: float = 0.0) -> PackedPlan:
    """The drafted tokens to keep of each row in a packed step (plain decoding's, none, unless the
    best plan beats it by the margin).

    For a given longest kept draft (the hosted draft model's passes cost draft_step_s each, on the
    same thread first), the best set is greedy: a row's j-th drafted token gains a^j, less than its
    (j-1)-th, so taking tokens by falling gain keeps every row's tokens a prefix, and a token raises
    gain / cost exactly when its gain exceeds beta times the goodput so far (which only rises as
    tokens are taken): the first one that does not ends the plan."""
    plain_gain, plain_cost = float(len(rows)), alpha + beta * sum(r.base for r in rows)
    plain = PackedPlan([0] * len(rows), plain_gain, plain_cost, plain_gain, plain_cost)
    candidates = sorted(((r.acceptance ** j, j, i) for i, r in enumerate(rows) for j in range(1, r.draft + 1)),
                        key=lambda c: (-c[0], c[1]))
    longest = max((r.draft for r in rows), default=0)
    best = plain
    for cap in range(1, longest + 1) if draft_step_s > 0 else [longest]:
        keep, gain, cost = [0] * len(rows), plain_gain, plain_cost + cap * draft_step_s
        for token_gain, j, i in candidates:
            if j > cap:
                continue
            if token_gain * cost <= beta * gain:
                break
            keep[i], gain, cost = j, gain + token_gain, cost + beta
        if gain / cost > best.goodput:
            best = PackedPlan(keep, gain, cost, plain_gain, plain_cost)
    if best.goodput < (1.0 + margin) * plain.goodput:
        return plain
    return best
