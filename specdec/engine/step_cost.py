"""What a batched target step costs, fitted online to the measured steps (the goodput trimming's T).

Packed steps (the native backend's eager path) cost what they feed: T = alpha + beta * tokens.

Padded steps (CUDA graphs' static shapes: every row as wide as the widest) cost by rows as well as
by tokens: each row reads its own context from the KV cache and is sampled on its own, whatever its
width, so T = alpha + beta_row * rows + beta_token * rows * width. Only the token part is what
drafting adds to a step of given rows. Plain steps alone cannot tell the two apart (their width is
1: tokens = rows), and fitted as tokens alone, their growth with rows passed for a cost of width:
on one H200 (8B target) a plain step grows 0.39 ms a row from 1 to 8 rows, while widening 8 rows
from 1 to 5 tokens adds about 0.4 ms in all; the tokens-alone fit priced that width at 22 ms
against a real 9.5. So the padded fit splits a slope it cannot tell apart half and half (UNTOLD_SHARE)
until steps of other widths tell: then the data decide (a ridge of one step's weight). The half is
an optimism the trimming tests: drafts it lets through are steps of other widths, which correct it.
Measurements fade (decay), so after a long plain stretch the split returns to what the widths last
told (`share`, learned from every wider step), or to the half where they told width was dearer: the
trimming then tries a width again, and where width is dear that costs a few slower steps. Only the
cheaper side is remembered, because only an optimistic price is tested (a pessimistic one lets no
draft through, so nothing corrects it). Returning to the half on a GPU, where width costs 4% of a
row's growth, priced a 16-row step one token wider at about +2.8 ms against +0.2 told; after a plain
stretch (another pool's turn, a wave of new sessions) a batch that had drafted together at 1.11x of
plain decoding stayed plain for whole waves (one H200, 8B / 1B hosted; docs/BENCHMARKS.md, round 40).
"""

from __future__ import annotations

from dataclasses import dataclass, field

UNTOLD_SHARE = 0.5  # of a plain step's growth per row, what a padded fit charges to width until told


@dataclass
class StepCost:
    """T by exponentially weighted least squares over measured steps (per_row: the padded model
    above; else tokens alone). Once fitted, a step counts at most outlier_ratio times what the fit
    expects of its size: past the graph warm-up context a GPU step's first use of a shape captures a
    CUDA graph inside it (~0.2 s at the 8B shape, against a 9 ms step), which is no price of its
    tokens (the coordinator's cost fit does the same: generation/forward_cost.py, docs/BENCHMARKS.md
    round 26)."""

    decay: float = 0.98  # weight of the past per step: the fit follows a changing machine load
    min_steps: float = 8.0  # (weighted) steps before the fit is trusted
    outlier_ratio: float = 2.0
    per_row: bool = False
    ridge: float = 1.0  # padded: the weight of the untold split against the widths' evidence
    share: float = UNTOLD_SHARE  # padded: the untold split, as the widths last told it (at most the half)
    # Weighted sums of 1, rows (r), tokens (n), seconds (t) and their products.
    _w: float = 0.0
    _r: float = 0.0
    _n: float = 0.0
    _t: float = 0.0
    _rr: float = 0.0
    _rn: float = 0.0
    _nn: float = 0.0
    _rt: float = 0.0
    _nt: float = 0.0

    def observe(self, tokens: int, seconds: float, rows: int | None = None) -> None:
        """A step of `tokens` (packed: fed; padded: rows x width) over `rows` rows (None: as many as
        tokens, a plain step) took `seconds`."""
        rows = tokens if rows is None else rows
        fitted = self.fit(rows)
        if fitted is not None:
            seconds = min(seconds, self.outlier_ratio * (fitted[0] + fitted[1] * tokens))
        d = self.decay
        self._w, self._r, self._n, self._t = (d * self._w + 1, d * self._r + rows, d * self._n + tokens,
                                              d * self._t + seconds)
        self._rr, self._rn, self._nn = (d * self._rr + rows * rows, d * self._rn + rows * tokens,
                                        d * self._nn + tokens * tokens)
        self._rt, self._nt = d * self._rt + rows * seconds, d * self._nt + tokens * seconds
        if self.per_row and tokens != rows:  # a step wider than one token a row: what width costs, told
            self._learn_share()

    def _learn_share(self) -> None:
        solved = self._solve()
        if solved is not None and solved[1] + solved[2] > 0:
            _, beta_row, beta_token = solved
            self.share = min(UNTOLD_SHARE, beta_token / (beta_row + beta_token))

    def fit(self, rows: int = 1) -> tuple[float, float] | None:
        """(alpha, beta) in seconds for a step of `rows` rows: T = alpha + beta * tokens (padded:
        alpha includes the rows' own cost); None until enough steps of different sizes were seen."""
        solved = self._solve()
        if solved is None:
            return None
        alpha, beta_row, beta_token = solved
        return alpha + beta_row * rows, beta_token

    def _solve(self) -> tuple[float, float, float] | None:
        """(alpha, beta_row, beta_token): beta_row 0 unless per_row."""
        if self._w < self.min_steps:
            return None
        w = self._w
        mean_r, mean_n, mean_t = self._r / w, self._n / w, self._t / w
        var_n = self._nn / w - mean_n * mean_n
        if var_n < 0.25:  # every step had (nearly) the same size: the slope is unknown
            return None
        cov_nt = self._nt / w - mean_n * mean_t
        if not self.per_row:
            beta = max(0.0, cov_nt / var_n)
            return max(mean_t - beta * mean_n, 1e-6), 0.0, beta
        # T = a + u * z1 + v * z2 with z1 = (1 - s) r + s n and z2 = n - r (the tokens beyond one a row):
        # then beta_token = v + s u and beta_row = u - beta_token. The ridge holds v at 0 (the untold
        # split, s) where z2 hardly varies, and gives way to the widths' evidence where it does.
        s = self.share
        var_r, cov_rn = self._rr / w - mean_r * mean_r, self._rn / w - mean_r * mean_n
        cov_rt = self._rt / w - mean_r * mean_t
        var_1 = (1 - s) ** 2 * var_r + 2 * s * (1 - s) * cov_rn + s * s * var_n
        var_2 = var_n - 2 * cov_rn + var_r + self.ridge / w
        cov_12 = (1 - s) * (cov_rn - var_r) + s * (var_n - cov_rn)
        cov_1t, cov_2t = (1 - s) * cov_rt + s * cov_nt, cov_nt - cov_rt
        det = var_1 * var_2 - cov_12 * cov_12
        if det <= 1e-12 * max(var_1 * var_2, 1e-30):
            return None
        u = (var_2 * cov_1t - cov_12 * cov_2t) / det
        v = (var_1 * cov_2t - cov_12 * cov_1t) / det
        beta_token = max(0.0, v + s * u)
        beta_row = max(0.0, u - beta_token)
        alpha = mean_t - beta_row * mean_r - beta_token * mean_n
        return max(alpha, 1e-6), beta_row, beta_token


@dataclass
class DraftStepPrice:
    """What one step of the hosted draft model's batched pass costs, by the rows drafting in it
    (specdec.engine.inner_draft): a + b * rows, fitted over the passes as StepCost fits tokens
    alone; the passes' mean until passes of different rows tell the slope. One price whatever the
    rows made 16 rows drafting together on one H200 look as cheap as one (2.4 ms a step, against
    5-7 ms measured), and the batch drafted at a loss (docs/BENCHMARKS.md, rounds 38 and 39)."""

    decay: float = 0.9  # of the mean; the fit keeps StepCost's
    mean_s: float | None = None  # seconds a step, over the passes seen (None: no pass yet)
    cost: StepCost = field(default_factory=lambda: StepCost(min_steps=4.0))

    def observe(self, rows: int, steps: int, seconds: float) -> None:
        """A pass of `steps` draft steps over `rows` rows took `seconds`."""
        if steps <= 0 or rows <= 0:
            return
        per_step = seconds / steps
        self.mean_s = per_step if self.mean_s is None else self.decay * self.mean_s + (1 - self.decay) * per_step
        self.cost.observe(rows, per_step)

    def at(self, rows: int) -> float:
        """Seconds a draft step of `rows` rows (0 before any pass: nothing known, drafting is free)."""
        if self.mean_s is None:
            return 0.0
        fitted = self.cost.fit(rows)
        return self.mean_s if fitted is None else fitted[0] + fitted[1] * rows
