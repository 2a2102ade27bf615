"""What earlier turns learned, for the next turn's adaptive draft length.

Every turn used to start its DraftLengthPolicy from nothing: three cycles at the initial length, a
plain step to price plain decoding, then a few noisy cycles of adapting. A Spec-Bench answer of 128
tokens is about 50 cycles, so the opening cost the adaptive length 3% against the best fixed k in a
simulation with two GPUs' costs (tests/test_shared_estimates.py; 1.4% warm), and 4-6% on two GPUs
(docs/BENCHMARKS.md, rounds 22 and 23; a tie warm). Yet most of what a policy learns belongs to
the deployment, not to the turn: the draft's seconds per token, the target's cost per verified
token, the overhead of a cycle and of a plain step, and how the draft's confidence predicts
acceptance. Only the acceptance itself depends much on the text.

So the coordinator keeps one SharedEstimates per route (target, draft, sequential or pipelined):
each adaptive turn adds what its policy measured (every `absorb_every` cycles and at its end), and
a new turn's policy starts from the running average: the costs with the weight of a few
measurements (its own replace them within a few cycles), the acceptance per position with the
weight of a few cycles, and the length the average says is best (at least one token: the turn's
text may differ), adapting from its first cycle.
Lengths only: verification, and so the output, does not depend on any of it.

Pure bookkeeping, like adaptive.py: no I/O, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from specdec.generation.pipeline_price import PipelinePrice


@dataclass(frozen=True)
class PolicyEstimates:
    """A policy's measurements, each normalised to one unit of weight (per forward, per cycle,
    per confidence observation), so that turns of any length average alike."""

    draft_s: float | None = None  # model seconds per drafted token
    forward_moments: np.ndarray | None = None  # ForwardCost's sums divided by their weight
    speculative_overhead_s: float | None = None
    ahead_overhead_s: float | None = None
    plain_overhead_s: float | None = None  # a plain step inside a streamed run
    opening_overhead_s: float | None = None  # a plain step that opened a run
    probe_s: float | None = None  # a probe cycle after plain steps
    pipelined: bool = False
    acceptance: float | None = None  # accepted / acceptance tests
    tested: tuple[float, ...] = ()  # per draft position, relative to position 0's tests
    passed: tuple[float, ...] = ()
    calibration_weight: tuple[float, ...] = ()  # the confidence bins' shares of the observations
    calibration_survived: tuple[float, ...] = ()
    # The turn's own acceptance evidence as counts (a warm start's pseudo-counts left out): what the
    # route pools, by evidence rather than by turn (SharedEstimates.absorb).
    trials: float = 0.0  # acceptance tests
    accepted: float = 0.0
    tested_counts: tuple[float, ...] = ()  # [j]: cycles whose draft token j was tested
    passed_counts: tuple[float, ...] = ()  # ... and accepted


def _blend(old, new, keep: float):
    """old * keep + new * (1 - keep), where either may be missing (None, or an empty sequence).
    Sequences of different lengths (draft positions) count the missing entries as 0."""
    if new is None or (isinstance(new, tuple) and not new):
        return old
    if old is None or (isinstance(old, tuple) and not old):
        return new
    if isinstance(new, tuple):
        size = max(len(old), len(new))
        padded_old, padded_new = (np.pad(np.asarray(x, dtype=float), (0, size - len(x))) for x in (old, new))
        return tuple((keep * padded_old + (1.0 - keep) * padded_new).tolist())
    return keep * old + (1.0 - keep) * new


def merge(old: PolicyEstimates | None, new: PolicyEstimates, keep: float) -> PolicyEstimates:
    """The running average of turns' estimates: `keep` is the weight of everything before `new`."""
    if old is None:
        return new
    return PolicyEstimates(
        draft_s=_blend(old.draft_s, new.draft_s, keep),
        forward_moments=_blend(old.forward_moments, new.forward_moments, keep),
        speculative_overhead_s=_blend(old.speculative_overhead_s, new.speculative_overhead_s, keep),
        ahead_overhead_s=_blend(old.ahead_overhead_s, new.ahead_overhead_s, keep),
        plain_overhead_s=_blend(old.plain_overhead_s, new.plain_overhead_s, keep),
        opening_overhead_s=_blend(old.opening_overhead_s, new.opening_overhead_s, keep),
        probe_s=_blend(old.probe_s, new.probe_s, keep),
        pipelined=new.pipelined,
        acceptance=_blend(old.acceptance, new.acceptance, keep),
        tested=_blend(old.tested, new.tested, keep),
        passed=_blend(old.passed, new.passed, keep),
        calibration_weight=_blend(old.calibration_weight, new.calibration_weight, keep),
        calibration_survived=_blend(old.calibration_survived, new.calibration_survived, keep),
    )


@dataclass
class SharedEstimates:
    """One route's running average of what its adaptive turns measured.

    Costs are averaged per snapshot. Acceptance is pooled by evidence instead (every turn's accepted
    and tested tokens, the older fading by `keep` per snapshot): averaged per turn, a turn that
    switched off after two one-token cycles weighed as much as one that drafted all its answer, and
    since a turn's estimate held the warm start it began from, a route that met a few unpredictable
    turns stayed pessimistic: later turns opened at one token, switched off within two cycles with
    next to no evidence of their own, and handed the pessimism on (two GPUs, a mix of prompts
    at alpha 0.5-1.0: 64% of the tokens plain, 10% behind k = 2; BENCHMARKS.md, round 27)."""

    keep: float = 0.8  # per absorbed snapshot: the last ten or so turns matter
    absorb_every: int = 32  # cycles between a long turn's snapshots
    estimates: PolicyEstimates | None = None
    absorbed: int = 0
    _trials: float = 0.0  # pooled acceptance evidence
    _accepted: float = 0.0
    _tested: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _passed: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def absorb(self, estimates: PolicyEstimates, since: PolicyEstimates | None = None) -> None:
        """A turn's snapshot; since: its previous snapshot, whose evidence the route already holds."""
        self._pool(estimates, since or PolicyEstimates())
        merged = merge(self.estimates, estimates, self.keep)
        cycles = self._tested[0] if self._tested.size else 0.0
        self.estimates = replace(
            merged, acceptance=self._accepted / self._trials if self._trials > 0 else None,
            tested=tuple((self._tested / cycles).tolist()) if cycles > 0 else (),
            passed=tuple((self._passed / cycles).tolist()) if cycles > 0 else (),
            trials=0.0, accepted=0.0, tested_counts=(), passed_counts=())
        self.absorbed += 1

    def _pool(self, new: PolicyEstimates, old: PolicyEstimates) -> None:
        def grown(pooled: np.ndarray, size: int) -> np.ndarray:
            return np.pad(pooled, (0, max(0, size - pooled.size)))

        def delta(now: tuple[float, ...], before: tuple[float, ...]) -> np.ndarray:
            return np.asarray(now, dtype=float) - grown(np.asarray(before, dtype=float), len(now))[: len(now)]

        self._trials = self.keep * self._trials + new.trials - old.trials
        self._accepted = self.keep * self._accepted + new.accepted - old.accepted
        size = max(self._tested.size, len(new.tested_counts))
        self._tested = self.keep * grown(self._tested, size)
        self._passed = self.keep * grown(self._passed, size)
        self._tested[: len(new.tested_counts)] += delta(new.tested_counts, old.tested_counts)
        self._passed[: len(new.passed_counts)] += delta(new.passed_counts, old.passed_counts)


class SharingPolicy:
    """One policy's link to its route's estimates: warm-started when made, and its estimates added
    every `absorb_every` cycles it observes and once more when its turn (or stream) ends."""

    def __init__(self, shared: SharedEstimates, policy) -> None:
        self.shared, self.policy = shared, policy
        if shared.estimates is not None:
            policy.warm_start(shared.estimates)
        self._shared_at = policy.cycles  # the policy's cycle count when it last added its estimates
        self._shared: PolicyEstimates | None = None  # what it added then

    def share(self, ended: bool = False) -> None:
        if self.policy.cycles - self._shared_at >= (1 if ended else self.shared.absorb_every):
            self._shared_at = self.policy.cycles
            estimates = self.policy.estimates()
            self.shared.absorb(estimates, since=self._shared)
            self._shared = estimates


@dataclass
class SharedEstimatesByRoute:
    """The coordinator's estimates, one SharedEstimates per (target, draft, pipelined) route:
    replicas on other hardware, or another mode, cost differently."""

    routes: dict[tuple[str, str, bool], SharedEstimates] = field(default_factory=dict)
    max_routes: int = 256  # a bound for coordinators whose replicas come and go
    # --pipelining auto's price per (target, draft): whether a draft slows the verify beside it is
    # the deployment's (one GPU for both, or two), so every turn on the route adds to one price and
    # a new turn starts decided instead of learning it over its first dozen cycles.
    prices: dict[tuple[str, str], PipelinePrice] = field(default_factory=dict)

    def price(self, target: str, draft: str) -> PipelinePrice:
        key = (target, draft)
        if key not in self.prices:
            if len(self.prices) >= self.max_routes:
                self.prices.pop(next(iter(self.prices)))
            self.prices[key] = PipelinePrice()
        return self.prices[key]

    def route(self, target: str, draft: str, pipelined: bool) -> SharedEstimates:
        key = (target, draft, pipelined)
        if key not in self.routes:
            if len(self.routes) >= self.max_routes:
                self.routes.pop(next(iter(self.routes)))  # the oldest route
            self.routes[key] = SharedEstimates()
        return self.routes[key]
