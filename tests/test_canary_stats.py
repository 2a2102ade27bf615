"""The canary's statistics and decision rules on synthetic windows: the tests against scipy, no
decision below the minimum sample count, a clear regression rolls back, noise alone does nothing."""

from __future__ import annotations

import random

import pytest
from scipy import stats as scipy_stats

from coordinator.canary_policy import (
    Action,
    CanaryPhase,
    CanaryPolicy,
    EqualityResult,
    EqualityTally,
    decide,
)
from coordinator.canary_stats import Sample, Window, mann_whitney, quantile, two_proportions

POLICY = CanaryPolicy(steps=(5, 25, 50, 100), step_pause_s=60, min_samples=30, alpha=0.01)
NO_CHECKS = EqualityTally({})


def window(tpot, ttft=None, errors=0, drafted=0, accepted=0) -> Window:
    ttft = ttft if ttft is not None else [0.05] * len(tpot)
    samples = [Sample(float(i), True, f, t, drafted, accepted) for i, (t, f) in enumerate(zip(tpot, ttft))]
    samples += [Sample(0.0, False) for _ in range(errors)]
    return Window.of(samples)


def lognormal(rng: random.Random, n: int, median: float, sigma: float = 0.3) -> list[float]:
    return [median * rng.lognormvariate(0.0, sigma) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_mann_whitney_matches_scipy(seed):
    rng = random.Random(seed)
    x = [round(v, 2) for v in lognormal(rng, 17 + seed, 1.0)]  # rounding makes ties
    y = [round(v, 2) for v in lognormal(rng, 23, 1.2)]
    ours = mann_whitney(x, y)
    for side, p in (("less", ours.p_less), ("greater", ours.p_greater)):
        want = scipy_stats.mannwhitneyu(x, y, alternative=side, method="asymptotic", use_continuity=True)
        assert p == pytest.approx(want.pvalue, rel=1e-9, abs=1e-12), side
    assert ours.u == scipy_stats.mannwhitneyu(x, y, method="asymptotic").statistic


def test_degenerate_inputs_give_no_evidence():
    assert mann_whitney([], [1.0]).p_less == 1.0
    assert mann_whitney([2.0, 2.0], [2.0, 2.0]).p_greater == 1.0
    assert two_proportions(0, 100, 0, 100) == 1.0 and two_proportions(1, 0, 1, 10) == 1.0


def test_two_proportions_matches_the_z_test():
    # 12/200 against 3/200: pooled z = (0.06 - 0.015) / sqrt(p(1-p)(2/200)), p = 15/400
    p = 15 / 400
    z = (0.06 - 0.015) / (p * (1 - p) * 2 / 200) ** 0.5
    assert two_proportions(12, 200, 3, 200) == pytest.approx(scipy_stats.norm.sf(z))
    assert two_proportions(3, 200, 12, 200) > 0.99


def test_quantile_interpolates():
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert quantile([1.0], 0.99) == 1.0 and quantile([], 0.5) is None
    assert quantile(list(map(float, range(101))), 0.99) == pytest.approx(99.0)


def test_window_summary_counts_errors_and_acceptance():
    w = window([0.01, 0.02], errors=2, drafted=8, accepted=6)
    assert (w.requests, w.errors, w.error_rate) == (4, 2, 0.5)
    assert w.acceptance == 12 / 16 and w.summary()["tpot_p50"] == 0.015


def test_no_decision_below_the_minimum_sample_count():
    rng = random.Random(1)
    slow, fast = lognormal(rng, 29, 0.1), lognormal(rng, 200, 0.01)  # 10x slower, but only 29 requests
    verdict = decide(POLICY, CanaryPhase.PROGRESSING, 5, 600, window(slow), window(fast), NO_CHECKS)
    assert verdict.action is None and verdict.cause == "samples" and "speculative 29" in verdict.reason


def test_a_clear_latency_regression_rolls_back():
    rng = random.Random(2)
    verdict = decide(POLICY, CanaryPhase.PROGRESSING, 25, 5, window(lognormal(rng, 40, 0.030)),
                     window(lognormal(rng, 40, 0.020)), NO_CHECKS)
    assert verdict.action is Action.ROLLBACK and verdict.cause == "latency"
    assert "Mann-Whitney" in verdict.reason and "n=40/40" in verdict.reason


def test_a_slower_first_token_rolls_back_beyond_its_margin_only():
    rng = random.Random(3)
    tpot = lognormal(rng, 60, 0.02)
    same_tpot = window(tpot, ttft=lognormal(rng, 60, 0.5)), window(tpot, ttft=lognormal(rng, 60, 0.1))
    assert decide(POLICY, CanaryPhase.PROGRESSING, 25, 5, *same_tpot, NO_CHECKS).cause == "ttft"
    slightly = window(tpot, ttft=lognormal(rng, 60, 0.12)), window(tpot, ttft=lognormal(rng, 60, 0.1))
    assert decide(POLICY, CanaryPhase.PROGRESSING, 25, 5, *slightly, NO_CHECKS).action is None


def test_a_higher_error_rate_rolls_back():
    rng = random.Random(4)
    tpot = lognormal(rng, 200, 0.02)
    verdict = decide(POLICY, CanaryPhase.PROGRESSING, 25, 5, window(tpot, errors=20), window(tpot, errors=1),
                     NO_CHECKS)
    assert verdict.action is Action.ROLLBACK and verdict.cause == "error_rate" and "z-test" in verdict.reason
    # One more error among hundreds is noise.
    verdict = decide(POLICY, CanaryPhase.PROGRESSING, 25, 5, window(tpot, errors=2), window(tpot, errors=1),
                     NO_CHECKS)
    assert verdict.action is None


@pytest.mark.parametrize("seed", range(20))
def test_noise_alone_does_not_decide(seed):
    """Both pools from one distribution: neither a rollback nor a step up, whatever the draw."""
    rng = random.Random(100 + seed)
    spec, base = lognormal(rng, 200, 0.02, 0.5), lognormal(rng, 200, 0.02, 0.5)
    verdict = decide(POLICY, CanaryPhase.PROGRESSING, 25, 600, window(spec, errors=rng.randint(0, 3)),
                     window(base, errors=rng.randint(0, 3)), NO_CHECKS)
    assert verdict.action is None, verdict.reason


def test_better_steps_up_after_the_pause_at_the_step():
    rng = random.Random(5)
    spec, base = window(lognormal(rng, 50, 0.010)), window(lognormal(rng, 50, 0.020))
    early = decide(POLICY, CanaryPhase.PROGRESSING, 25, 30, spec, base, NO_CHECKS)
    assert early.action is None and early.cause == "pause"
    verdict = decide(POLICY, CanaryPhase.PROGRESSING, 25, 61, spec, base, NO_CHECKS)
    assert verdict.action is Action.STEP_UP and verdict.cause == "better"
    # Promoted (last step): nothing further to step to.
    assert decide(POLICY, CanaryPhase.PROMOTED, 100, 600, spec, base, NO_CHECKS).action is None
    # Better, but by less than the margin: hold.
    close = window([t * 0.98 for t in base.tpot])
    assert decide(POLICY, CanaryPhase.PROGRESSING, 25, 600, close, base, NO_CHECKS).action is None


def test_an_equality_failure_rolls_back_at_once_and_ties_do_not():
    tiny = window([0.01] * 3)
    failed = EqualityTally({"equal": 9, "failed": 1}, "session s token 3: speculative 7, plain decoding 8")
    verdict = decide(POLICY, CanaryPhase.PROMOTED, 100, 1, tiny, window([]), failed)
    assert verdict.action is Action.ROLLBACK and verdict.cause == "equality" and "token 3" in verdict.reason
    ties = EqualityTally({"equal": 9, "tie": 3, "error": 5})
    assert decide(POLICY, CanaryPhase.PROGRESSING, 5, 1, tiny, tiny, ties).action is None
    assert ties.scored == 12 and ties[EqualityResult.TIE] == 3


def test_unscored_divergences_roll_back_only_when_too_frequent():
    tiny = window([0.01] * 3)
    few = EqualityTally({"equal": 19, "unscored": 1})
    assert decide(POLICY, CanaryPhase.PROGRESSING, 5, 1, tiny, tiny, few).action is None
    many = EqualityTally({"equal": 6, "unscored": 4})
    assert decide(POLICY, CanaryPhase.PROGRESSING, 5, 1, tiny, tiny, many).cause == "equality"


def test_a_stopped_canary_decides_nothing():
    rng = random.Random(6)
    slow, fast = window(lognormal(rng, 50, 0.05)), window(lognormal(rng, 50, 0.01))
    for phase in (CanaryPhase.ROLLED_BACK, CanaryPhase.ABORTED):
        assert decide(POLICY, phase, 0, 600, slow, fast, EqualityTally({"failed": 1})).action is None


def test_policy_refuses_bad_steps():
    for steps in ((), (0, 50), (50, 25), (25, 25, 50), (10, 150)):
        with pytest.raises(ValueError):
            CanaryPolicy(steps=steps)
    assert CanaryPolicy(steps=(10, 50)).next_step(10) == 50 and CanaryPolicy(steps=(10, 50)).next_step(50) is None
