"""The equality rule shared by tests, benchmarks and the canary (ARCHITECTURE.md, "What identical
means").

Greedy speculative output must equal plain decoding token for token. In fp32 that is exact. In
bf16/fp16 a multi-token verify and a one-token decode sum in different orders, so a near-tie between
the top two tokens can flip: at the first divergence both tokens are re-scored with the target, and
a logit gap within `tie_threshold` is a numerical tie (counted, reported), anything else a failure.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# Returns the target's logits [vocab] for the next token after the given prefix.
NextLogits = Callable[[Sequence[int]], torch.Tensor]
# Logit gap within which two tokens at a divergence count as a numerical tie (bf16 / fp16), or
# TIE_ULPS units in the last place of the larger logit in the model's dtype where that is wider:
# bf16 keeps 8 significant bits, so at |logit| 32-64 one unit is 0.25 and any two distinct logits
# differ by at least that (a CPU bf16 run parted from plain decoding at gaps of 0.25 and 0.5). On one
# H200 (8B random weights, bf16, |logits| 256-512 where a unit is 2) 48 divergences under load lay at
# 0-4 units, none beyond: the re-scored gap itself comes from another summation order (a prefill).
DEFAULT_TIE_THRESHOLD = 0.05
TIE_ULPS = 4
# Dtypes whose greedy output must equal plain decoding's exactly (no near-tie rule).
EXACT_DTYPES = frozenset({"float32", "torch.float32", "fp32"})


def tie_threshold(dtype: str, *logits: float, floor: float = DEFAULT_TIE_THRESHOLD, units: float = TIE_ULPS) -> float:
    """The gap within which logits computed in `dtype` count as tied: `floor`, or `units` units in
    the last place of the largest of them in that dtype where that is wider (the benchmark's
    --tie-units, the canary's --canary-tie-units)."""
    try:
        info = torch.finfo(getattr(torch, dtype.removeprefix("torch.")))
    except (AttributeError, TypeError):  # not a floating dtype torch knows
        return floor
    magnitude = max((abs(x) for x in logits), default=0.0)
    if magnitude == 0.0 or not math.isfinite(magnitude):
        return floor
    unit = info.eps * 2.0 ** math.floor(math.log2(magnitude))
    return max(floor, units * unit)


@dataclass(frozen=True)
class EqualityReport:
    equal: bool  # identical token for token
    tie: bool  # not identical, but the first divergence is a numerical tie
    divergence: int | None  # index into the generated tokens of the first difference
    logit_gap: float | None  # target logit gap between the two tokens at the divergence

    @property
    def passed(self) -> bool:
        return self.equal or self.tie


def compare_outputs(
    prompt_ids: Sequence[int],
    candidate: Sequence[int],
    reference: Sequence[int],
    next_logits: NextLogits | None = None,
    tie_threshold: float = 0.0,
) -> EqualityReport:
    """Compare generated tokens (prompt excluded) of a candidate run against a reference run."""
    divergence = next((i for i, (a, b) in enumerate(zip(candidate, reference)) if a != b), None)
    if divergence is None:
        if len(candidate) == len(reference):
            return EqualityReport(True, False, None, None)
        # One stopped earlier with the other agreeing up to there: a length difference, not a tie.
        return EqualityReport(False, False, min(len(candidate), len(reference)), None)
    if next_logits is None or tie_threshold <= 0.0:
        return EqualityReport(False, False, divergence, None)
    logits = next_logits(list(prompt_ids) + list(reference[:divergence])).float()
    return rescored(EqualityReport(False, False, divergence, None), float(logits[candidate[divergence]]),
                    float(logits[reference[divergence]]), tie_threshold)


def is_tie(gap: float, threshold: float) -> bool:
    """A divergence at this logit gap is a numerical tie: within the threshold, its bound included."""
    return gap <= threshold


def rescored(report: EqualityReport, candidate_logit: float, reference_logit: float,
             tie_threshold: float = DEFAULT_TIE_THRESHOLD) -> EqualityReport:
    """A divergence judged by the target's logits of the two tokens at it (the reference's prefix
    before it): a gap within tie_threshold is a numerical tie."""
    gap = abs(candidate_logit - reference_logit)
    return dataclasses.replace(report, tie=is_tie(gap, tie_threshold), logit_gap=gap)
