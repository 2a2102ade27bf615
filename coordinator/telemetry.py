"""The coordinator's traces and metrics: a request span, a span per cycle, Prometheus series.

Trace shape of one Generate (the gRPC server span comes from the interceptor):
    "<operation> <model>" request span (GenAI attributes, specdec.pool, session id, usage)
      specdec.cycle (sampled: the first cycles, then every Nth)  position, drafted, accepted, kind,
                    cycle_ms, draft_model_ms, target_model_ms, overhead_ms (time outside the models)
        specdec.propose -> DraftService/Propose client and server spans (traceparent over gRPC)
        specdec.verify  -> TargetService/Verify
        specdec.commit  (the Redis append of the cycle's tokens; ends when it is recorded)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from specdec.errors import CacheFull, ServiceUnavailable, SessionNotFound
from specdec.engine.cycle_cost import CycleCost
from specdec.generation.session import LoopObserver
from specdec.observability import spans
from specdec.observability.metrics import CoordinatorMetrics
from specdec.store import SessionStats
from specdec.types import VerifyOutcome


@dataclass
class Telemetry:
    """Built once in main and shared by every request."""

    tracer: trace.Tracer
    metrics: CoordinatorMetrics
    cycle_sampler: spans.CycleSpanSampler
    model: str  # gen_ai.request.model
    # Called with (RequestClock, pool) when a Generate stream ends (the canary's samples).
    request_observers: list[Callable[["RequestClock", str], None]] = field(default_factory=list)

    def request_finished(self, clock: "RequestClock", pool: str) -> None:
        clock.observe(self.metrics, pool)
        for observer in self.request_observers:
            try:
                observer(clock, pool)
            except Exception:  # noqa: BLE001 - an observer never fails the request it observes
                logging.getLogger(__name__).exception("request observer %r failed", observer)

    def request_span(self, operation: str, attributes: dict) -> trace.Span:
        """Started, not current: the caller makes it current where the work runs and ends it."""
        return self.tracer.start_span(
            f"{operation} {self.model}", kind=SpanKind.INTERNAL,
            attributes={**spans.request_attributes(model=self.model, operation=operation), **attributes},
        )


def fallback_reason(error: Exception) -> str:
    if isinstance(error, ServiceUnavailable):
        return "unavailable"
    if isinstance(error, SessionNotFound):
        return "session_lost"
    if isinstance(error, CacheFull):
        return "draft_full"  # every draft KV slot held by sessions in mid-turn: load, not a fault
    return "error"


@dataclass
class RequestClock:
    """Latency and outcome of one Generate stream, observed into the metrics when it ends."""

    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    proposer: str = "none"
    outcome: str = "OK"  # status code name
    session_id: str = ""
    position: int = 0  # committed length after the last message
    final: object | None = None  # the last message's FinalInfo

    def streamed(self, message) -> None:
        if message.token_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        self.tokens += len(message.token_ids)
        self.session_id, self.position = message.session_id, message.position
        if message.final is not None:
            self.final = message.final
            self.proposer = message.final.proposer or self.proposer

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def tpot(self) -> float | None:
        """Per request: the decode phase over the tokens after the first."""
        if self.first_token is None or self.ended is None or self.tokens < 2:
            return None
        return (self.ended - self.first_token) / (self.tokens - 1)

    def observe(self, metrics: CoordinatorMetrics, pool: str) -> None:
        self.ended = ended = time.perf_counter()
        labels = (pool, self.proposer)
        metrics.requests.labels(*labels, self.outcome).inc()
        metrics.e2e_latency.labels(*labels).observe(ended - self.started)
        if self.ttft is not None:
            metrics.time_to_first_token.labels(*labels).observe(self.ttft)
        if self.tpot is not None:
            metrics.time_per_output_token.labels(*labels).observe(self.tpot)
        metrics.output_tokens.labels(*labels).inc(self.tokens)


class TurnObserver(LoopObserver):
    """Spans and metrics of one turn's loop, and the speculation counters its next append records."""

    def __init__(self, telemetry: Telemetry, pool: str, proposer: str = "none"):
        self.telemetry = telemetry
        self.pool = pool
        self.proposer = proposer
        self._pending = SessionStats()

    def cycle(self, index: int, position: int):
        attributes = {spans.SPECDEC_POSITION: position, spans.SPECDEC_POOL: self.pool}
        return spans.cycle_span(self.telemetry.tracer, self.telemetry.cycle_sampler, index, attributes)

    def step(self, name: str):
        return self.telemetry.tracer.start_as_current_span(f"specdec.{name}")

    def verified(self, outcome: VerifyOutcome, proposer: str) -> None:
        self.proposer = proposer or self.proposer
        kind = "bonus" if outcome.is_bonus else "recovered"
        trace.get_current_span().set_attributes(spans.cycle_attributes(
            position=outcome.position, num_draft_tokens=outcome.num_drafted,
            num_accepted=outcome.num_accepted, next_token_kind=kind, pool=self.pool,
        ))
        self.telemetry.metrics.observe_cycle(self.pool, self.proposer, outcome.num_drafted, outcome.num_accepted)
        self._pending += SessionStats.for_cycle(outcome.num_drafted, outcome.num_accepted)

    def pipelined(self, hit: bool, branch: str | None = None) -> None:
        span = trace.get_current_span()
        span.set_attribute(spans.SPECDEC_PIPELINE_HIT, hit)
        counter = self.telemetry.metrics.pipeline_hits if hit else self.telemetry.metrics.pipeline_misses
        counter.labels(self.pool, self.proposer).inc()
        if hit and branch is not None:
            span.set_attribute(spans.SPECDEC_PIPELINE_BRANCH, branch)
            self.telemetry.metrics.pipeline_branch_hits.labels(self.pool, self.proposer, branch).inc()

    def fed_draft(self) -> None:
        self.telemetry.metrics.draft_feeds.labels(self.pool, self.proposer).inc()

    def fell_back(self, error: Exception) -> None:
        self.telemetry.metrics.fallbacks.labels(self.pool, self.proposer, fallback_reason(error)).inc()
        self._pending += SessionStats(fallbacks=1)

    def cycle_cost(self, cost: CycleCost) -> None:
        trace.get_current_span().set_attributes(spans.cycle_cost_attributes(
            wall_s=cost.wall_s, draft_model_s=cost.draft_model_s, target_model_s=cost.target_model_s,
            overhead_s=cost.overhead_s,
        ))
        metrics = self.telemetry.metrics
        metrics.cycle_overhead.labels(self.pool, self.proposer).observe(cost.overhead_s)
        metrics.cycle_overhead_fraction.labels(self.pool, self.proposer).observe(cost.overhead_fraction)

    def take_stats(self) -> SessionStats:
        """Counters since the last call (what the next append adds to the record)."""
        pending, self._pending = self._pending, SessionStats()
        return pending

    def start_commit_span(self, num_tokens: int) -> trace.Span:
        """A specdec.commit span under the current cycle; the caller ends it once recorded."""
        return self.telemetry.tracer.start_span("specdec.commit", attributes={"specdec.num_tokens": num_tokens})
