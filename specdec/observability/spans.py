"""Span names and attributes: OpenTelemetry GenAI semantic conventions for the request span and the
project's specdec.* attributes for the per-cycle span, plus cycle-span sampling.

Only opentelemetry-api is imported, so engines can use this without pulling in gRPC.

Cycle-span sampling. A generation of 1,000 tokens at ~3 tokens per cycle is ~330 cycles, each with
propose / verify / commit children and a server span in two other services: thousands of spans per
trace. `CycleSpanSampler(every=N, first=F)` records the first F cycles (time to first token lives
there) and then every Nth; a skipped cycle runs under a non-recording, *unsampled* span context, so
its child spans and the draft/target server spans it causes (the unsampled flag travels in
traceparent) are dropped too, instead of being re-parented onto the request span. Parent-based
samplers (the default) honour this; OTEL_TRACES_SAMPLER=always_on would record those children.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "text_completion" (prompt) or "chat" (messages)
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"

# The project's cycle span: one propose -> verify -> commit round.
CYCLE_SPAN = "specdec.cycle"
SPECDEC_CYCLE_INDEX = "specdec.cycle_index"
SPECDEC_POSITION = "specdec.position"  # absolute position of the first draft token
SPECDEC_NUM_DRAFT_TOKENS = "specdec.num_draft_tokens"
SPECDEC_NUM_ACCEPTED = "specdec.num_accepted"
SPECDEC_NEXT_TOKEN_KIND = "specdec.next_token_kind"  # "recovered" (after a rejection) or "bonus"
SPECDEC_PIPELINE_HIT = "specdec.pipeline_hit"
SPECDEC_PIPELINE_BRANCH = "specdec.pipeline_branch"  # on a hit: main | second_guess | rejected_last
SPECDEC_POOL = "specdec.pool"  # "speculative" or "baseline"
# Per-cycle cost (specdec.engine.cycle_cost), milliseconds: wall, inside each model, the rest.
SPECDEC_CYCLE_MS = "specdec.cycle_ms"
SPECDEC_DRAFT_MODEL_MS = "specdec.draft_model_ms"
SPECDEC_TARGET_MODEL_MS = "specdec.target_model_ms"
SPECDEC_OVERHEAD_MS = "specdec.overhead_ms"

NextTokenKind = Literal["recovered", "bonus"]


def _drop_none(attributes: dict) -> dict:
    return {k: v for k, v in attributes.items() if v is not None}


def request_attributes(
    *,
    model: str,
    operation: str = "text_completion",
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    conversation_id: str | None = None,
) -> dict:
    """Attributes for the request span, set when it starts."""
    return _drop_none(
        {
            GEN_AI_OPERATION_NAME: operation,
            GEN_AI_REQUEST_MODEL: model,
            GEN_AI_REQUEST_TEMPERATURE: temperature,
            GEN_AI_REQUEST_TOP_P: top_p,
            GEN_AI_REQUEST_TOP_K: top_k,
            GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
            GEN_AI_REQUEST_SEED: seed,
            GEN_AI_CONVERSATION_ID: conversation_id,
        }
    )


def usage_attributes(*, input_tokens: int, output_tokens: int, finish_reason: str | None = None) -> dict:
    """Attributes for the request span, set when it ends."""
    attributes = {GEN_AI_USAGE_INPUT_TOKENS: input_tokens, GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens}
    if finish_reason is not None:
        attributes[GEN_AI_RESPONSE_FINISH_REASONS] = (finish_reason,)
    return attributes


def cycle_attributes(
    *,
    position: int,
    num_draft_tokens: int,
    num_accepted: int,
    next_token_kind: NextTokenKind,
    pipeline_hit: bool | None = None,
    pool: str | None = None,
) -> dict:
    """Outcome of one cycle; set on the span `cycle_span` yields once verification returns."""
    if next_token_kind not in ("recovered", "bonus"):
        raise ValueError(f"next_token_kind must be 'recovered' or 'bonus', got {next_token_kind!r}")
    return _drop_none(
        {
            SPECDEC_POSITION: position,
            SPECDEC_NUM_DRAFT_TOKENS: num_draft_tokens,
            SPECDEC_NUM_ACCEPTED: num_accepted,
            SPECDEC_NEXT_TOKEN_KIND: next_token_kind,
            SPECDEC_PIPELINE_HIT: pipeline_hit,
            SPECDEC_POOL: pool,
        }
    )


def cycle_cost_attributes(*, wall_s: float, draft_model_s: float, target_model_s: float, overhead_s: float) -> dict:
    """Where the cycle's time went; set on the cycle span when the cycle ends."""
    return {SPECDEC_CYCLE_MS: wall_s * 1e3, SPECDEC_DRAFT_MODEL_MS: draft_model_s * 1e3,
            SPECDEC_TARGET_MODEL_MS: target_model_s * 1e3, SPECDEC_OVERHEAD_MS: overhead_s * 1e3}


@dataclass(frozen=True)
class CycleSpanSampler:
    """Which cycles get a span: the first `first`, then every `every`th (cycle indices from 0)."""

    every: int = 1
    first: int = 1

    def __post_init__(self) -> None:
        if self.every < 1 or self.first < 0:
            raise ValueError(f"need every >= 1 and first >= 0, got every={self.every}, first={self.first}")

    def records(self, cycle_index: int) -> bool:
        return cycle_index < self.first or cycle_index % self.every == 0


def _unsampled_context() -> SpanContext:
    parent = trace.get_current_span().get_span_context()
    if parent.is_valid:
        trace_id, span_id, state = parent.trace_id, parent.span_id, parent.trace_state
    else:  # no request span: invent ids so children still see an unsampled parent, not a root
        trace_id, span_id, state = random.getrandbits(128) or 1, random.getrandbits(64) or 1, None
    return SpanContext(
        trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT), trace_state=state
    )


@contextmanager
def cycle_span(
    tracer: trace.Tracer,
    sampler: CycleSpanSampler,
    cycle_index: int,
    attributes: Mapping[str, object] | None = None,
) -> Iterator[trace.Span]:
    """`with cycle_span(tracer, sampler, i) as span:` around one cycle (propose / verify / commit
    spans and gRPC calls inside become its children); `span.set_attributes(cycle_attributes(...))`
    once the outcome is known. Skipped cycles yield a non-recording span: setting attributes on it
    costs nothing."""
    if sampler.records(cycle_index):
        start_attributes = {**(attributes or {}), SPECDEC_CYCLE_INDEX: cycle_index}
        with tracer.start_as_current_span(CYCLE_SPAN, attributes=start_attributes) as span:
            yield span
    else:
        with trace.use_span(NonRecordingSpan(_unsampled_context()), end_on_exit=False) as span:
            yield span
