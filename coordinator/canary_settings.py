"""The canary controller's flags and its frozen settings (part of CoordinatorSettings).

    --canary                        turn the controller on (off: --default-pool and overrides decide)
    --canary-steps 5,25,50,100      speculative share of new sessions at each step, percent
    --canary-step-pause 300         least seconds at a step before the next step up
    --canary-window 600             seconds of samples a decision looks at
    --canary-min-samples 50         requests per pool, since the last transition, before deciding
    --canary-alpha 0.01             significance level of each one-sided test
    --canary-improve-margin 0.05    step up if speculative median TPOT <= (1 - m) x baseline's
    --canary-regress-margin 0.10    roll back if speculative median TPOT >= (1 + m) x baseline's
    --canary-ttft-margin 0.5        the same for time to first token
    --canary-error-margin 0.01      roll back if the speculative error rate is higher by this
    --canary-equality-sample 0.05   share of greedy / Gumbel speculative requests replayed on baseline
    --canary-tie-units 4            bf16 / fp16: a divergence within this many units in the last place is a tie
    --canary-interval 10            seconds between two decisions of the lease holder
    --canary-lease 30               seconds the decider lease lasts without renewal
See docs/CANARY.md for the rules these feed.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from specdec.generation.equality import TIE_ULPS
from specdec.server.settings import ConfigError

from coordinator.canary_policy import CanaryPolicy


@dataclass(frozen=True)
class CanarySettings:
    policy: CanaryPolicy = field(default_factory=CanaryPolicy)
    equality_sample: float = 0.05  # share of eligible speculative requests replayed on the baseline
    interval_s: float = 10.0  # between two decisions (and lease renewals) of the decider
    lease_s: float = 30.0
    max_samples: int = 2000  # per pool, kept in Redis
    max_concurrent_checks: int = 2  # replays in flight per coordinator; more are skipped
    tie_units: float = TIE_ULPS  # bf16 / fp16: the equality check's tie rule (specdec.generation.equality)

    def __post_init__(self) -> None:
        if not 0.0 <= self.equality_sample <= 1.0:
            raise ConfigError(f"--canary-equality-sample must be in [0, 1], got {self.equality_sample}")
        if not self.tie_units >= 0:  # also refuses NaN
            raise ConfigError(f"--canary-tie-units must be >= 0 (0: only the 0.05 floor), got {self.tie_units}")
        if not self.interval_s > 0:
            raise ConfigError(f"--canary-interval must be > 0 seconds, got {self.interval_s}")
        if not self.lease_s >= 2 * self.interval_s:
            raise ConfigError(f"--canary-lease must be at least twice --canary-interval (renewed every "
                              f"interval), got lease {self.lease_s} s, interval {self.interval_s} s")


def add_canary_arguments(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    g = parser.add_argument_group("canary (speculative pool against the baseline pool; docs/CANARY.md)")
    g.add_argument("--canary", action="store_true", default=environ.get("SPECDEC_CANARY") == "1",
                   help="run the canary controller: it sets the speculative share of new sessions and steps "
                        "it up or rolls it back (state in Redis, shared by every coordinator replica)")
    g.add_argument("--canary-steps", default="5,25,50,100",
                   help="speculative share of new sessions at each step, percent, increasing (default: %(default)s)")
    g.add_argument("--canary-step-pause", type=float, default=300.0,
                   help="least seconds at a step before stepping up")
    g.add_argument("--canary-window", type=float, default=600.0, help="seconds of samples a decision uses")
    g.add_argument("--canary-min-samples", type=int, default=50,
                   help="requests per pool since the last change before latency or errors decide")
    g.add_argument("--canary-alpha", type=float, default=0.01, help="significance level of each test")
    g.add_argument("--canary-improve-margin", type=float, default=0.05,
                   help="step up only if speculative median TPOT is at most (1 - this) x baseline's")
    g.add_argument("--canary-regress-margin", type=float, default=0.10,
                   help="roll back if speculative median TPOT is at least (1 + this) x baseline's")
    g.add_argument("--canary-ttft-margin", type=float, default=0.5,
                   help="roll back if speculative median time to first token is at least (1 + this) x baseline's")
    g.add_argument("--canary-error-margin", type=float, default=0.01,
                   help="roll back if the speculative error rate exceeds baseline's by more than this")
    g.add_argument("--canary-equality-sample", type=float, default=0.05,
                   help="share of greedy / Gumbel-sampled speculative requests replayed on the baseline")
    g.add_argument("--canary-tie-units", type=float, default=TIE_ULPS,
                   help="bf16 / fp16 targets: a divergence whose logit gap on the baseline target is within "
                        "this many units in the last place of the logits (at least 0.05) is a numerical tie, "
                        "a wider one a failure (default: %(default)s; docs/CANARY.md)")
    g.add_argument("--canary-interval", type=float, default=10.0, help="seconds between decisions")
    g.add_argument("--canary-lease", type=float, default=30.0,
                   help="seconds the decider lease lasts unless renewed (one coordinator decides at a time)")


def canary_settings_from_args(args: argparse.Namespace) -> CanarySettings | None:
    if not args.canary:
        return None
    try:
        steps = tuple(float(s) for s in args.canary_steps.split(",") if s.strip())
        policy = CanaryPolicy(
            steps=steps, step_pause_s=args.canary_step_pause, window_s=args.canary_window,
            min_samples=args.canary_min_samples, alpha=args.canary_alpha,
            improve_margin=args.canary_improve_margin, regress_margin=args.canary_regress_margin,
            ttft_margin=args.canary_ttft_margin, error_margin=args.canary_error_margin,
        )
    except ValueError as exc:
        raise ConfigError(f"--canary-*: {exc}") from None
    return CanarySettings(policy, equality_sample=args.canary_equality_sample, interval_s=args.canary_interval,
                          lease_s=args.canary_lease, tie_units=args.canary_tie_units)
