"""Dynamic draft length from the draft's own confidence: where to stop drafting, per block.

A fixed k drafts as far into an uncertain continuation as into a copied one. The draft knows which is
which: its probability of each token it drafts (its confidence). The product of those probabilities
up to token j ranks how likely tokens 0..j are all accepted, so a draft that stops once the product
falls below a threshold spends its tokens where they pay (as in HF's assistant_confidence_threshold
and SpecDec++, Huang et al. 2024, which stop on a learned acceptance estimate). The stop depends only
on the draft's outputs, so verification stays exact: the target verifies a shorter draft.

The coordinator chooses the threshold. A draft's probabilities are not acceptance probabilities
(a small draft is often overconfident), so this module calibrates them against what verification
showed: for every drafted token j it records the product P_j of confidences up to j and whether
tokens 0..j were all accepted, in bins of P_j, shrunk toward "calibrated" (survival = P_j). Drafting
token j + 1 costs one draft step and one more verified token, and adds survival(P_j) * a expected
tokens (a: the per-token acceptance); it pays while that beats the best rate the session can get,
so the threshold is the smallest P whose calibrated survival reaches rate * cost / a. Pure
bookkeeping, like adaptive.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ConfidenceCalibration:
    bins: int = 10  # equal bins of the confidence product in [0, 1]
    decay: float = 0.98  # per verified block: the text changes, old blocks matter less
    prior_weight: float = 4.0  # pseudo-observations at survival = the bin's mid-point
    _weight: list[float] = field(default_factory=list)
    _survived: list[float] = field(default_factory=list)
    blocks: int = 0  # verified blocks with confidences seen

    def __post_init__(self) -> None:
        self._weight = [0.0] * self.bins
        self._survived = [0.0] * self.bins

    def observe(self, confidences: tuple[float, ...] | list[float], num_accepted: int) -> None:
        """A verified block: its drafted tokens' confidences (those verified) and how many were accepted."""
        if not confidences:
            return
        self._weight = [w * self.decay for w in self._weight]
        self._survived = [s * self.decay for s in self._survived]
        product = 1.0
        for j, confidence in enumerate(confidences):
            product *= max(0.0, min(1.0, confidence))
            b = self._bin(product)
            self._weight[b] += 1.0
            self._survived[b] += 1.0 if num_accepted > j else 0.0
        self.blocks += 1

    def shares(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per bin, the share of all observations it holds and of those that survived ((), () if none)."""
        total = sum(self._weight)
        if total <= 0:
            return (), ()
        return tuple(w / total for w in self._weight), tuple(s / total for s in self._survived)

    def start_from(self, weight: tuple[float, ...], survived: tuple[float, ...], observations: float,
                   blocks: int) -> None:
        """Start from shares() of other sessions, as if `observations` drafted tokens in `blocks`
        blocks had been seen (a draft's calibration is mostly the draft's, not the text's)."""
        if len(weight) != self.bins or len(survived) != self.bins:
            return
        self._weight = [w * observations for w in weight]
        self._survived = [s * observations for s in survived]
        self.blocks = blocks

    def survival(self, product: float) -> float:
        """Estimated P(all drafted tokens so far accepted) given their confidence product."""
        b = self._bin(product)
        midpoint = (b + 0.5) / self.bins
        return (self._survived[b] + self.prior_weight * midpoint) / (self._weight[b] + self.prior_weight)

    def threshold(self, survival: float) -> float:
        """The smallest confidence product (a bin's lower edge) from which every bin above it has a
        calibrated survival of at least `survival`: drafting stops below it. 0 when every bin
        qualifies; just under 1 when none does (stop after the first token)."""
        lowest = None
        for b in reversed(range(self.bins)):
            if self.survival((b + 0.5) / self.bins) < survival:
                break
            lowest = b
        if lowest is None:
            return 0.999
        return lowest / self.bins

    def _bin(self, product: float) -> int:
        return min(int(product * self.bins), self.bins - 1)
