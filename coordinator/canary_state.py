"""What the canary shows: its shared state as read from Redis, a status report, its metrics."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from specdec.errors import SpecDecError
from specdec.observability.metrics import NAMESPACE

from coordinator.canary_policy import CanaryPhase, EqualityTally, Verdict
from coordinator.canary_stats import Window
from coordinator.requests import Pool

POOLS = (Pool.SPECULATIVE, Pool.BASELINE)


class CanaryDisabled(SpecDecError):
    """A canary RPC on a coordinator without --canary (maps to FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class CanaryState:
    phase: CanaryPhase
    weight: float  # percent of new sessions that go to the speculative pool
    paused: bool
    cause: str
    reason: str
    since: float  # seconds since the epoch of the last change of weight: windows start here
    version: int

    @staticmethod
    def parse(fields: dict[str, str]) -> "CanaryState | None":
        if "phase" not in fields:
            return None
        return CanaryState(CanaryPhase(fields["phase"]), float(fields.get("weight", 0)), fields.get("paused") == "1",
                           fields.get("cause", ""), fields.get("reason", ""), float(fields.get("since", 0)),
                           int(fields.get("version", 0)))


@dataclass(frozen=True)
class CanaryStatus:
    state: CanaryState | None
    decider: str  # the replica holding the lease; '' if none
    windows: dict[Pool, Window]
    equality: EqualityTally
    decisions: list[dict]
    steps: tuple[float, ...]
    last_verdict: Verdict | None  # this replica's last evaluation (deciders only)


class CanaryMetrics:
    def __init__(self, registry: CollectorRegistry):
        common = {"namespace": NAMESPACE, "subsystem": "coordinator", "registry": registry}
        self.weight = Gauge("canary_weight_percent", "Share of new sessions routed to each pool.", ("pool",),
                            **common)
        self.decisions = Counter("canary_decisions", "Canary state changes this replica made, by action and cause.",
                                 ("action", "cause"), **common)
        self.equality_checks = Counter("canary_equality_checks", "Replays of speculative turns on the baseline "
                                       "pool, by result.", ("result",), **common)
        self.leader = Gauge("canary_leader", "1 while this replica holds the canary decider lease.", **common)

    def show(self, weight: float) -> None:
        self.weight.labels(Pool.SPECULATIVE.value).set(weight)
        self.weight.labels(Pool.BASELINE.value).set(100.0 - weight)
