"""The canary's protobuf boundary: CanaryStatus / CanaryState -> CoordinatorService messages."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from specdec.rpc import coordinator_pb2 as pb

from coordinator.canary_state import CanaryState, CanaryStatus
from coordinator.canary_policy import Action, CanaryPhase, EqualityResult
from coordinator.canary_stats import Window, quantile
from coordinator.requests import Pool

_PHASE_TO_PB = {
    CanaryPhase.PROGRESSING: pb.CANARY_PHASE_PROGRESSING,
    CanaryPhase.PROMOTED: pb.CANARY_PHASE_PROMOTED,
    CanaryPhase.ROLLED_BACK: pb.CANARY_PHASE_ROLLED_BACK,
    CanaryPhase.ABORTED: pb.CANARY_PHASE_ABORTED,
}
_ACTION_TO_PB = {action: getattr(pb, f"CANARY_ACTION_{action.name}") for action in Action}
_POOL_TO_PB = {Pool.SPECULATIVE: pb.POOL_SPECULATIVE, Pool.BASELINE: pb.POOL_BASELINE}


def state_to_proto(state: CanaryState | None, decider: str, steps: tuple[float, ...]) -> pb.CanaryState:
    msg = pb.CanaryState(decider=decider, steps=list(steps))
    if state is None:
        msg.phase = pb.CANARY_PHASE_NOT_STARTED
        msg.baseline_weight = 100.0
        return msg
    msg.phase = _PHASE_TO_PB[state.phase]
    msg.speculative_weight, msg.baseline_weight = state.weight, 100.0 - state.weight
    msg.paused, msg.reason, msg.cause, msg.version = state.paused, state.reason, state.cause, state.version
    msg.since_time.CopyFrom(_timestamp(state.since))
    return msg


def status_to_proto(status: CanaryStatus) -> pb.CoordinatorServiceGetCanaryResponse:
    tally = status.equality
    return pb.CoordinatorServiceGetCanaryResponse(
        state=state_to_proto(status.state, status.decider, status.steps),
        windows=[window_to_proto(pool, window) for pool, window in status.windows.items()],
        equality=pb.CanaryEqualityCounts(
            equal=tally[EqualityResult.EQUAL], ties=tally[EqualityResult.TIE], failed=tally[EqualityResult.FAILED],
            unscored=tally[EqualityResult.UNSCORED], errors=tally[EqualityResult.ERROR],
        ),
        decisions=[decision_to_proto(d) for d in status.decisions],
        last_evaluation=status.last_verdict.reason if status.last_verdict else "",
    )


def window_to_proto(pool: Pool, window: Window) -> pb.CanaryWindow:
    def q(values, p):
        value = quantile(values, p)
        return 0.0 if value is None else value
    return pb.CanaryWindow(
        pool=_POOL_TO_PB[pool], requests=window.requests, errors=window.errors, error_rate=window.error_rate,
        timed_requests=len(window.tpot), tpot_p50_seconds=q(window.tpot, 0.5), tpot_p99_seconds=q(window.tpot, 0.99),
        ttft_p50_seconds=q(window.ttft, 0.5), ttft_p99_seconds=q(window.ttft, 0.99),
        acceptance_rate=window.acceptance,
    )


def decision_to_proto(decision: dict) -> pb.CanaryDecision:
    try:
        action = _ACTION_TO_PB[Action(decision.get("action"))]
    except ValueError:  # written by a newer version
        action = pb.CANARY_ACTION_UNSPECIFIED
    return pb.CanaryDecision(
        time=_timestamp(float(decision.get("t", 0))), action=action, cause=decision.get("cause", ""),
        reason=decision.get("reason", ""), from_weight=float(decision.get("from", 0)),
        to_weight=float(decision.get("to", 0)), decided_by=decision.get("by", ""),
        manual=bool(decision.get("manual")),
    )


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
