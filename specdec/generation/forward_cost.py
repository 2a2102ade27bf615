"""What a target forward costs by the number of tokens it verifies (the adaptive policy's cost model)."""

from __future__ import annotations

import math
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
    # features f = (1, n, [n > 1]): the weight, the token and time sums are entries of it. Plain
    # Python floats, not numpy: every session observes every step it takes, and on a loaded target
    # numpy's per-call overhead on 3 x 3 arrays (about 45 us a fit) stretched each step's gap on the
    # event loop by the sessions times that (docs/BENCHMARKS.md, round 37).
    _sums: list = field(default_factory=lambda: [[0.0] * 4 for _ in range(3)])
    _fitted: tuple[float, float, float] | None = None  # _fit() since the last observe

    @property
    def seen(self) -> bool:
        return self._sums[0][0] > 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if self._sums[0][0] >= self.trusted_weight:
            seconds = min(seconds, self.outlier_ratio * self.cost(num_tokens))
        features = (1.0, float(num_tokens), 1.0 if num_tokens > 1 else 0.0, float(seconds))
        decay = self.decay
        self._sums = [[decay * s + fi * fj for s, fj in zip(row, features)]
                      for row, fi in zip(self._sums, features)]
        self._fitted = None

    def moments(self) -> np.ndarray | None:
        """The sums per unit of weight (what another session's fit can start from), None if unseen."""
        return np.array(self._sums) / self._sums[0][0] if self.seen else None

    def start_from(self, moments, weight: float) -> None:
        """Start from moments() of other sessions, as if `weight` forwards had been seen."""
        self._sums = [[float(m) * weight for m in row] for row in np.asarray(moments, dtype=float)]
        self._fitted = None

    def cost(self, num_tokens: int) -> float:
        if not self.seen:
            return 0.0
        sums = self._sums
        w, n, nn, t = sums[0][0], sums[0][1], sums[1][1], sums[0][3]
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
        sums = self._sums
        for used in ((0, 1, 2), (0, 1), (0, 2), (0,)):
            a = [[sums[i][j] for j in used] for i in used]
            if _condition(a) > 1e8:
                continue
            solution = _solve(a, [sums[i][3] for i in used])
            if all(x >= 0 for x in solution[1:]):
                theta = dict(zip(used, solution))
                return theta.get(0, 0.0), theta.get(1, 0.0), theta.get(2, 0.0)
        return sums[0][3] / sums[0][0], 0.0, 0.0


def _condition(a: list) -> float:
    """The 2-norm condition number of a symmetric positive semi-definite matrix of size 1 to 3
    (the fit's normal equations): its largest eigenvalue over its smallest, inf if that is not
    positive. Closed forms (the trigonometric one for 3 x 3), so a step pays no LAPACK call."""
    if len(a) == 1:
        return 1.0 if a[0][0] > 0 else math.inf
    if len(a) == 2:
        mean, half = (a[0][0] + a[1][1]) / 2, (a[0][0] - a[1][1]) / 2
        radius = math.hypot(half, a[0][1])
        low, high = mean - radius, mean + radius
    else:
        off = a[0][1] ** 2 + a[0][2] ** 2 + a[1][2] ** 2
        q = (a[0][0] + a[1][1] + a[2][2]) / 3
        p = math.sqrt(((a[0][0] - q) ** 2 + (a[1][1] - q) ** 2 + (a[2][2] - q) ** 2 + 2 * off) / 6)
        if p == 0:  # a multiple of the identity
            low = high = q
        else:
            b = [[(a[i][j] - (q if i == j else 0.0)) / p for j in range(3)] for i in range(3)]
            half_det = _det3(b) / 2
            phi = math.acos(max(-1.0, min(1.0, half_det))) / 3
            high = q + 2 * p * math.cos(phi)
            low = q + 2 * p * math.cos(phi + 2 * math.pi / 3)
    return high / low if low > 0 else math.inf


def _det3(m: list) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def _solve(a: list, b: list) -> list:
    """x with a x = b, by Gaussian elimination with partial pivoting (a is well conditioned here)."""
    size = len(b)
    rows = [list(row) + [value] for row, value in zip(a, b)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col])]
    x = [0.0] * size
    for r in reversed(range(size)):
        x[r] = (rows[r][size] - sum(rows[r][c] * x[c] for c in range(r + 1, size))) / rows[r][r]
    return x
