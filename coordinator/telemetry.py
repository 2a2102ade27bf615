"""The coordinator's traces and metrics: a request span, a span per cycle, Prometheus series.

Trace shape of one Generate (the gRPC server span comes from the interceptor):
    "<operation> <model>" request span (GenAI attributes, specdec.pool, session id, usage)
      specdec.cycle (sampled: the first cycles, then every Nth)  position, drafted, accepted, kind
        specdec.propose -> DraftService/Propose client and server spans (traceparent over gRPC)
        specdec.verify  -> TargetService/Verify
        specdec.commit  (the Redis append of the cycle's tokens; ends when it is recorded)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from specdec.errors import ServiceUnavailable, SessionNotFound
from specdec.generation.loop import LoopObserver
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
    return "error"


@dataclass
class RequestClock:
    """Latency and outcome of one Generate stream, observed into the metrics when it ends."""

    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    tokens: int = 0
    proposer: str = "none"
    outcome: str = "OK"  # status code name

    def streamed(self, message) -> None:
        if message.token_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        self.tokens += len(message.token_ids)
        if message.final is not None and message.final.proposer:
            self.proposer = message.final.proposer

    def observe(self, metrics: CoordinatorMetrics, pool: str) -> None:
        ended, labels = time.perf_counter(), (pool, self.proposer)
        metrics.requests.labels(*labels, self.outcome).inc()
        metrics.e2e_latency.labels(*labels).observe(ended - self.started)
        if self.first_token is not None:
            metrics.time_to_first_token.labels(*labels).observe(self.first_token - self.started)
            if self.tokens > 1:  # per request: the decode phase over the tokens after the first
                tpot = (ended - self.first_token) / (self.tokens - 1)
                metrics.time_per_output_token.labels(*labels).observe(tpot)
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

    def fell_back(self, error: Exception) -> None:
        self.telemetry.metrics.fallbacks.labels(self.pool, self.proposer, fallback_reason(error)).inc()
        self._pending += SessionStats(fallbacks=1)

    def take_stats(self) -> SessionStats:
        """Counters since the last call (what the next append adds to the record)."""
        pending, self._pending = self._pending, SessionStats()
        return pending

    def start_commit_span(self, num_tokens: int) -> trace.Span:
        """A specdec.commit span under the current cycle; the caller ends it once recorded."""
        return self.telemetry.tracer.start_span("specdec.commit", attributes={"specdec.num_tokens": num_tokens})
