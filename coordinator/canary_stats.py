"""The canary's statistics: per-request samples of a pool, their window summary, and the two tests
its decisions rest on. Pure (no Redis, no gRPC, no clock): the decision rules in canary_policy.py
and their unit tests run on synthetic windows.

- Latency: Mann-Whitney U on per-request time per output token (and time to first token), speculative
  against baseline. It compares whole distributions by rank, so a few slow outliers do not decide,
  and it assumes nothing about their shape (TPOT is skewed, often bimodal). Normal approximation with
  the tie correction and a continuity correction (Mann & Whitney 1947; Lehmann, "Nonparametrics",
  1975, ch. 1): adequate from about 5 samples per side, which is below any sensible minimum.
- Errors: the pooled two-proportion z-test on server-error counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

# gRPC status names that count as a failed request (the server's fault, not the client's): the same
# set the chart's AnalysisTemplate counts, so mesh-owned and coordinator-owned canaries agree.
SERVER_ERRORS = frozenset({"INTERNAL", "UNAVAILABLE", "UNKNOWN", "DEADLINE_EXCEEDED", "DATA_LOSS"})


@dataclass(frozen=True)
class Sample:
    """One finished Generate request of a pool, as the canary records it in Redis."""

    time: float  # seconds since the epoch when the request ended
    ok: bool  # False: it ended with a server error
    ttft: float | None = None  # seconds to the first token; None if none came
    tpot: float | None = None  # mean seconds per output token after the first; None below 2 tokens
    drafted: int = 0  # draft tokens verified in the turn
    accepted: int = 0  # of which accepted

    def to_dict(self) -> dict:
        return {"t": round(self.time, 3), "ok": int(self.ok), "ttft": self.ttft, "tpot": self.tpot,
                "d": self.drafted, "a": self.accepted}

    @staticmethod
    def from_dict(raw: dict) -> "Sample":
        return Sample(float(raw["t"]), bool(raw["ok"]), raw.get("ttft"), raw.get("tpot"),
                      int(raw.get("d", 0)), int(raw.get("a", 0)))


@dataclass(frozen=True)
class Window:
    """The samples of one pool that a decision looks at."""

    requests: int
    errors: int
    tpot: tuple[float, ...]
    ttft: tuple[float, ...]
    drafted: int = 0
    accepted: int = 0

    @staticmethod
    def of(samples: Iterable[Sample]) -> "Window":
        samples = list(samples)
        return Window(
            requests=len(samples), errors=sum(not s.ok for s in samples),
            tpot=tuple(s.tpot for s in samples if s.ok and s.tpot is not None),
            ttft=tuple(s.ttft for s in samples if s.ok and s.ttft is not None),
            drafted=sum(s.drafted for s in samples), accepted=sum(s.accepted for s in samples),
        )

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def acceptance(self) -> float:
        """Accepted / drafted draft tokens; 0 without drafts (the baseline pool)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> dict:
        """Rounded figures for a decision's evidence and the status API."""
        def r(x):
            return None if x is None else round(x, 6)
        return {"requests": self.requests, "errors": self.errors, "error_rate": round(self.error_rate, 4),
                "tpot_samples": len(self.tpot), "tpot_p50": r(quantile(self.tpot, 0.5)),
                "tpot_p99": r(quantile(self.tpot, 0.99)), "ttft_p50": r(quantile(self.ttft, 0.5)),
                "ttft_p99": r(quantile(self.ttft, 0.99)), "acceptance": round(self.acceptance, 4)}


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between order statistics; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(frozen=True)
class MannWhitney:
    u: float  # U of the first sample: pairs (x, y) with x > y, ties counted one half
    p_less: float  # one-sided p-value for "x tends to be smaller than y"
    p_greater: float  # one-sided p-value for "x tends to be larger than y"


def mann_whitney(x: Sequence[float], y: Sequence[float]) -> MannWhitney:
    """Mann-Whitney U test of x against y (normal approximation, tie and continuity corrected)."""
    n1, n2 = len(x), len(y)
    if not n1 or not n2:
        return MannWhitney(0.0, 1.0, 1.0)
    ranks, tie_term = _ranks([*x, *y])
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    n = n1 + n2
    mean = n1 * n2 / 2
    variance = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0:  # every value equal: no evidence either way
        return MannWhitney(u, 1.0, 1.0)
    sd = math.sqrt(variance)
    return MannWhitney(u, p_less=normal_sf((mean - u - 0.5) / sd), p_greater=normal_sf((u - mean - 0.5) / sd))


def _ranks(values: Sequence[float]) -> tuple[list[float], float]:
    """1-based ranks, ties given their average rank, and sum(t^3 - t) over groups of t ties."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    tie_term = 0.0
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        t = j - i + 1
        tie_term += t ** 3 - t
        i = j + 1
    return ranks, tie_term


def two_proportions(k1: int, n1: int, k2: int, n2: int) -> float:
    """One-sided p-value of the pooled two-proportion z-test for "rate 1 is higher than rate 2"."""
    if not n1 or not n2:
        return 1.0
    pooled = (k1 + k2) / (n1 + n2)
    variance = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    if variance <= 0:  # no errors anywhere (or only errors): equal
        return 1.0
    return normal_sf((k1 / n1 - k2 / n2) / math.sqrt(variance))
