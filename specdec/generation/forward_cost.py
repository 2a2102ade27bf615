"""What a target forward costs by the number of tokens it verifies (the adaptive policy's cost model)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ForwardCost:
    """t(n) = t0 + t1 * n + t2 * [n > 1]: seconds of a target forward over n tokens, by exponentially
    weighted least squares over every forward seen (plain steps are n = 1). The step term t2 is what a
    forward of several tokens costs beyond a one-token step whatever its length: on a CPU at one thread
    the one-row products run on another kernel than the multi-row ones (models/linear_kernels.py; a
    2-token verify measured 50 ms against 40 ms for a plain step and 53 ms for 5 tokens), which a line
    through both cannot show (it made k = 1 look cheap and plain decoding dear). One fit over all sizes
    keeps costs ordered by size when the load shifts (sizes timed apart, at different loads, were
    not). Until sizes differ enough, a forward is assumed to grow by 5% of its mean per extra token:
    cautious on CPUs, nearly flat as on GPUs. t1 and t2 are never negative.

    A forward counts at most outlier_ratio times what the fit expects of its size: a target on a GPU
    captures a CUDA graph the first time a step shape is used past its warm-up context (~0.2 s for the
    8B shape against a 13 ms verify), and the adaptive length, which tries several lengths, paid those
    captures and learned them as the price of drafting: it switched a prompt of 3,300 tokens at alpha
    0.8-0.9 off and ran it 2.1x slower than k = 3 (docs/BENCHMARKS.md, round 26). A real change of
    cost (a growing batch) is still learned: each forward may double the estimate's share it replaces."""

    decay: float = 0.95  # per forward: slower than the acceptance estimates, to average out noise
    default_slope: float = 0.05
    outlier_ratio: float = 2.0
    trusted_weight: float = 2.0  # forwards' worth of weight before outliers are clamped
    # Exponentially weighted sums over forwards of f f^T (columns 0-2) and f t (column 3), with the
    # features f = (1, n, [n > 1]): the weight, the token and time sums are entries of it.
    _sums: "np.ndarray" = field(default_factory=lambda: np.zeros((3, 4)))
    _fitted: tuple[float, float, float] | None = None  # _fit() since the last observe

    @property
    def seen(self) -> bool:
        return self._sums[0, 0] > 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if self._sums[0, 0] >= self.trusted_weight:
            seconds = min(seconds, self.outlier_ratio * self.cost(num_tokens))
        features = np.array([1.0, num_tokens, 1.0 if num_tokens > 1 else 0.0])
        self._sums = self.decay * self._sums + np.outer(features, np.append(features, seconds))
        self._fitted = None

    def moments(self) -> np.ndarray | None:
        """The sums per unit of weight (what another session's fit can start from), None if unseen."""
        return self._sums / self._sums[0, 0] if self.seen else None

    def start_from(self, moments: np.ndarray, weight: float) -> None:
        """Start from moments() of other sessions, as if `weight` forwards had been seen."""
        self._sums, self._fitted = np.array(moments, dtype=float) * weight, None

    def cost(self, num_tokens: int) -> float:
        if not self.seen:
            return 0.0
        w, n, nn, t = self._sums[0, 0], self._sums[0, 1], self._sums[1, 1], self._sums[0, 3]
        mean_n, mean_t = n / w, t / w
        if nn / w - mean_n * mean_n < 0.5:  # (nearly) one size so far: no slope to fit
            return max(mean_t + self.default_slope * mean_t * (num_tokens - mean_n), 1e-9)
        if self._fitted is None:  # a policy asks for many sizes per cycle: solve once per forward seen
            self._fitted = self._fit()
        t0, t1, t2 = self._fitted
        return max(t0 + t1 * num_tokens + (t2 if num_tokens > 1 else 0.0), 1e-9)

    def _fit(self) -> tuple[float, float, float]:
        """(t0, t1, t2) with t1, t2 >= 0: the least-squares fit, refitted without a term that came
        out negative; a term the data cannot tell apart (no plain step seen: [n > 1] is constant)
        is left out the same way."""
        for used in ((0, 1, 2), (0, 1), (0, 2), (0,)):
            a, b = self._sums[np.ix_(used, used)], self._sums[list(used), 3]
            if np.linalg.cond(a) > 1e8:
                continue
            solution = np.linalg.solve(a, b)
            if (solution[1:] >= 0).all():
                theta = dict(zip(used, solution))
                return theta.get(0, 0.0), theta.get(1, 0.0), theta.get(2, 0.0)
        return self._sums[0, 3] / self._sums[0, 0], 0.0, 0.0
