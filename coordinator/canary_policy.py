"""The canary's decision rules: from the two pools' windows and the equality checks to one verdict
(step up, roll back, or hold). Pure: canary.py feeds it what Redis holds and applies the verdict.

In order, each rule needing what the one before did not decide:
 1. an equality failure (a replay on the baseline that differs, and is no numerical tie) rolls back
    at once: one is proof, not noise. Divergences that could not be re-scored (no logits for a
    bf16/fp16 target) roll back once they are more than `max_unscored_share` of at least
    `min_equality_checks` checks: numerical ties are rare, a verification bug diverges every time;
 2. below `min_samples` requests in either pool since the last transition, nothing else is decided;
 3. a higher server-error rate rolls back: one-sided two-proportion test at `alpha` and a difference
    above `error_margin`;
 4. a slower pool rolls back: Mann-Whitney U at `alpha` that speculative TPOT is larger, with the
    median ratio above 1 + `regress_margin`; the same for time to first token with `ttft_margin`
    (speculation adds a draft prefill, so TTFT gets a looser margin);
 5. a faster pool steps up, once `step_pause_s` have passed at the current step: Mann-Whitney U at
    `alpha` that speculative TPOT is smaller, and the median ratio at most 1 - `improve_margin`.
Both a significance level and a margin must hold: significance alone would act on differences too
small to matter once windows are large, a margin alone on the noise of small ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.canary_stats import Window, mann_whitney, quantile, two_proportions


class CanaryPhase(str, enum.Enum):
    PROGRESSING = "progressing"  # stepping the share up while speculation is better
    PROMOTED = "promoted"  # at the last step; equality checks go on
    ROLLED_BACK = "rolled_back"  # the controller set the share to 0 (reason recorded)
    ABORTED = "aborted"  # an operator set the share to 0


class Action(str, enum.Enum):
    START = "start"
    STEP_UP = "step_up"
    ROLLBACK = "rollback"
    PROMOTE = "promote"
    ABORT = "abort"
    PAUSE = "pause"
    RESUME = "resume"


class EqualityResult(str, enum.Enum):
    EQUAL = "equal"  # token for token
    TIE = "tie"  # diverged at a numerical near-tie (re-scored): counted, not a failure
    FAILED = "failed"  # diverged, and no tie
    UNSCORED = "unscored"  # diverged on a bf16/fp16 target and no logits to re-score it
    ERROR = "error"  # the replay itself failed (no baseline target, ...): says nothing


@dataclass(frozen=True)
class CanaryPolicy:
    steps: tuple[float, ...] = (5.0, 25.0, 50.0, 100.0)  # speculative share of new sessions, percent
    step_pause_s: float = 300.0  # least time at a step before the next step up
    window_s: float = 600.0  # samples older than this are ignored (and older than the last transition)
    min_samples: int = 50  # requests per pool since the last transition before latency/errors decide
    alpha: float = 0.01  # significance level of each one-sided test
    improve_margin: float = 0.05  # step up only if speculative median TPOT <= (1 - this) x baseline's
    regress_margin: float = 0.10  # roll back if speculative median TPOT >= (1 + this) x baseline's
    ttft_margin: float = 0.50  # roll back if speculative median TTFT >= (1 + this) x baseline's
    error_margin: float = 0.01  # roll back if the speculative error rate exceeds baseline's by this
    min_equality_checks: int = 5
    max_unscored_share: float = 0.2

    def __post_init__(self) -> None:
        steps = list(self.steps)
        if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
            raise ValueError(f"canary steps must be increasing percentages in (0, 100], got {self.steps}")
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"alpha must be in (0, 0.5), got {self.alpha}")
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {self.min_samples}")

    def next_step(self, weight: float) -> float | None:
        return next((s for s in self.steps if s > weight), None)


@dataclass(frozen=True)
class EqualityTally:
    counts: dict  # EqualityResult value -> checks
    first_failure: str = ""  # a failed check, described, for the rollback reason

    def __getitem__(self, result: EqualityResult) -> int:
        return self.counts.get(result.value, 0)

    @property
    def scored(self) -> int:
        """Checks that compared outputs (replay errors say nothing)."""
        return sum(v for k, v in self.counts.items() if k != EqualityResult.ERROR.value)


@dataclass(frozen=True)
class Verdict:
    action: Action | None  # None: hold
    cause: str  # bounded: "equality", "error_rate", "latency", "ttft", "better", "samples", "hold", ...
    reason: str  # for people: what was measured


def _hold(cause: str, reason: str) -> Verdict:
    return Verdict(None, cause, reason)


def decide(policy: CanaryPolicy, phase: CanaryPhase, weight: float, at_step_s: float,
           speculative: Window, baseline: Window, equality: EqualityTally) -> Verdict:
    """The verdict for the current windows; `at_step_s` is the time since the last transition."""
    if phase not in (CanaryPhase.PROGRESSING, CanaryPhase.PROMOTED):
        return _hold("phase", f"the canary is {phase.value}; an operator resumes or promotes it")
    if equality[EqualityResult.FAILED]:
        return Verdict(Action.ROLLBACK, "equality", (
            f"equality: {equality[EqualityResult.FAILED]} of {equality.scored} replays on the baseline "
            f"differ from the speculative output ({equality.first_failure})"))
    unscored = equality[EqualityResult.UNSCORED]
    if equality.scored >= policy.min_equality_checks and unscored > policy.max_unscored_share * equality.scored:
        return Verdict(Action.ROLLBACK, "equality", (
            f"equality: {unscored} of {equality.scored} replays diverge and could not be re-scored; more "
            f"than {policy.max_unscored_share:.0%} is no longer plausible as numerical ties"))
    need = policy.min_samples
    if speculative.requests < need or baseline.requests < need:
        return _hold("samples", f"waiting for {need} requests per pool (speculative {speculative.requests}, "
                                f"baseline {baseline.requests})")
    p_errors = two_proportions(speculative.errors, speculative.requests, baseline.errors, baseline.requests)
    if p_errors < policy.alpha and speculative.error_rate - baseline.error_rate > policy.error_margin:
        return Verdict(Action.ROLLBACK, "error_rate", (
            f"error rate: speculative {speculative.error_rate:.2%} vs baseline {baseline.error_rate:.2%} "
            f"(two-proportion z-test p={p_errors:.2g}, n={speculative.requests}/{baseline.requests})"))
    if len(speculative.tpot) < need or len(baseline.tpot) < need:
        return _hold("samples", f"waiting for {need} timed requests per pool (speculative "
                                f"{len(speculative.tpot)}, baseline {len(baseline.tpot)})")
    tpot = _compare("TPOT", speculative.tpot, baseline.tpot)
    if tpot.p_greater < policy.alpha and tpot.ratio >= 1 + policy.regress_margin:
        return Verdict(Action.ROLLBACK, "latency", f"latency: {tpot.text('p_greater')}")
    ttft = _compare("TTFT", speculative.ttft, baseline.ttft)
    if len(ttft.x) >= need and len(ttft.y) >= need and ttft.p_greater < policy.alpha \
            and ttft.ratio >= 1 + policy.ttft_margin:
        return Verdict(Action.ROLLBACK, "ttft", f"time to first token: {ttft.text('p_greater')}")
    better = tpot.p_less < policy.alpha and tpot.ratio <= 1 - policy.improve_margin
    step = policy.next_step(weight)
    if phase is CanaryPhase.PROGRESSING and better and step is not None:
        if at_step_s < policy.step_pause_s:
            return _hold("pause", f"better, stepping up after {policy.step_pause_s:g} s at {weight:g}% "
                                  f"({at_step_s:.0f} s so far)")
        return Verdict(Action.STEP_UP, "better", f"better: {tpot.text('p_less')}")
    return _hold("hold", f"no significant difference by the margins: {tpot.text('p_less')}")


@dataclass(frozen=True)
class _Comparison:
    name: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    ratio: float
    p_less: float
    p_greater: float

    def text(self, side: str) -> str:
        return (f"speculative {self.name} p50 {quantile(self.x, 0.5):.4g} s vs baseline "
                f"{quantile(self.y, 0.5):.4g} s (ratio {self.ratio:.3g}, Mann-Whitney U one-sided "
                f"p={getattr(self, side):.2g}, n={len(self.x)}/{len(self.y)})")


def _compare(name: str, x: tuple[float, ...], y: tuple[float, ...]) -> _Comparison:
    if not x or not y:
        return _Comparison(name, x, y, 1.0, 1.0, 1.0)
    base = quantile(y, 0.5)
    ratio = quantile(x, 0.5) / base if base > 0 else 1.0
    test = mann_whitney(x, y)
    return _Comparison(name, x, y, ratio, test.p_less, test.p_greater)
