"""TargetService over gRPC: a thin translator between specdec.v1 messages and the TargetEngine.

Every engine call runs on the ModelExecutor: one thread, because the engine is thread-confined, and
off the event loop, so health checks and other calls stay responsive during a forward pass. Domain
errors (specdec.errors) are left to the error-mapping interceptor of specdec.server, which turns them
into status codes; a PositionMismatch travels as FAILED_PRECONDITION with the session's actual
position in the trailing metadata. The per-RPC server span comes from the OpenTelemetry interceptor;
handlers only add attributes to it. Verification itself lives in the engine and specdec.sampling.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Sequence

from specdec.engine.target import TargetEngine
from specdec.errors import ContextOverflow, InvalidArgument
from specdec.observability.metrics import TargetMetrics
from specdec.observability.spans import SPECDEC_NUM_ACCEPTED, SPECDEC_NUM_DRAFT_TOKENS, SPECDEC_POSITION
from specdec.rpc import target_pb2, target_pb2_grpc
from specdec.rpc_convert import (
    model_info_to_proto,
    sampling_params_from_proto,
    unpack_distributions,
    verify_outcome_to_proto,
)
from specdec.server.bootstrap import ModelExecutor
from specdec.server.model_servicer import SPECDEC_SESSION_ID, EngineServicer, annotate, check_session_id
from specdec.server.tokenizer_info import TokenizerFacts

TARGET_SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
SPECDEC_DRAFT_EPOCH = "specdec.draft_epoch"


def decode_until_stop(
    engine: TargetEngine,
    session_id: str,
    position: int,
    num_tokens: int,
    append_token_ids: Sequence[int],
    stop_token_ids: Collection[int],
) -> list[int]:
    """engine.decode that ends right after a stop token (which is committed, like the others).

    Runs on the model thread in one go, so no other session's call interleaves with its steps. The
    whole budget is checked against the context before anything is committed, as engine.decode does.
    """
    stop = frozenset(stop_token_ids)
    if not stop or num_tokens <= 1:
        return engine.decode(session_id, position, num_tokens, append_token_ids)
    state = engine.sessions.get(session_id)
    extra = len(append_token_ids) + num_tokens
    limit = engine.info.max_context
    if state.position == position and position + extra > limit:  # a mismatch is decode's to report
        raise ContextOverflow(
            f"session {session_id!r} is at position {position}; {extra} more tokens would pass the "
            f"context length {limit} (at most {max(0, limit - position)} fit)"
        )
    generated = engine.decode(session_id, position, 1, append_token_ids)
    while generated[-1] not in stop and len(generated) < num_tokens:
        generated += engine.decode(session_id, position + len(append_token_ids) + len(generated), 1)
    return generated


class TargetServicer(EngineServicer, target_pb2_grpc.TargetServiceServicer):
    TRUNCATE_RESPONSE = target_pb2.TargetServiceTruncateResponse
    END_SESSION_RESPONSE = target_pb2.TargetServiceEndSessionResponse

    def __init__(
        self,
        engine: TargetEngine,
        executor: ModelExecutor,
        metrics: TargetMetrics,
        tokenizer: TokenizerFacts = TokenizerFacts(),
        max_draft_tokens: int = 64,
    ):
        self.engine = engine
        self.executor = executor
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.max_draft_tokens = max_draft_tokens
        self._evictions_seen = engine.evictions
        self.update_gauges()

    # ---- RPCs ------------------------------------------------------------------------------

    async def StartSession(self, request, context):
        check_session_id(request.session_id)
        params = sampling_params_from_proto(request.sampling)
        tokens = list(request.token_ids)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, "specdec.num_prompt_tokens": len(tokens)})
        position, first = await self._step(
            "prefill", len(tokens), self.engine.start_session,
            request.session_id, tokens, params, request.sample_first_token,
        )
        response = target_pb2.TargetServiceStartSessionResponse(position=position)
        if first is not None:
            response.first_token_id = first
        return response

    async def Verify(self, request, context):
        check_session_id(request.session_id)
        k = len(request.draft_token_ids)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, SPECDEC_POSITION: request.position,
                    SPECDEC_NUM_DRAFT_TOKENS: k, SPECDEC_DRAFT_EPOCH: request.draft_epoch})
        if k > self.max_draft_tokens:
            raise InvalidArgument(
                f"a Verify carries at most {self.max_draft_tokens} draft tokens (--max-draft-tokens), got {k}"
            )
        rows = request.draft_distributions if request.HasField("draft_distributions") else None
        block = unpack_distributions(rows, request.draft_token_ids)
        outcome = await self._step("verify", k + 1, self.engine.verify, request.session_id, request.position, block)
        annotate(**{SPECDEC_NUM_ACCEPTED: outcome.num_accepted,
                    "specdec.next_token_kind": "bonus" if outcome.is_bonus else "recovered"})
        return verify_outcome_to_proto(outcome, request.draft_epoch)

    async def Decode(self, request, context):
        check_session_id(request.session_id)
        appended = list(request.append_token_ids)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, SPECDEC_POSITION: request.position,
                    "specdec.num_appended_tokens": len(appended), "specdec.num_tokens": request.num_tokens})
        started = time.perf_counter()
        tokens = await self._run(
            decode_until_stop, self.engine, request.session_id, request.position, request.num_tokens,
            appended, request.stop_token_ids,
        )
        self._observe("decode", started, len(appended) + len(tokens))
        annotate(**{"specdec.num_generated_tokens": len(tokens)})
        return target_pb2.TargetServiceDecodeResponse(
            token_ids=tokens, position=request.position + len(appended) + len(tokens)
        )

    async def GetInfo(self, request, context):
        model = self.engine.model
        info = model_info_to_proto(
            self.engine.info,
            vocab_fingerprint=self.tokenizer.vocab_fingerprint,
            eos_token_ids=self.tokenizer.eos_token_ids,
            num_slots=model.num_slots,
            free_slots=model.num_free_slots,
        )
        return target_pb2.TargetServiceGetInfoResponse(model=info)

    # ---- housekeeping ------------------------------------------------------------------------

    def update_gauges(self) -> None:
        model = self.engine.model
        self.metrics.sessions.set(len(self.engine.sessions))
        self.metrics.kv_cache_slots_total.set(model.num_slots)
        self.metrics.kv_cache_slots_used.set(model.num_slots - model.num_free_slots)
        evictions = self.engine.evictions
        if evictions > self._evictions_seen:
            self.metrics.evictions.inc(evictions - self._evictions_seen)
            self._evictions_seen = evictions

    # ---- internals ---------------------------------------------------------------------------

    async def _step(self, step: str, num_tokens: int, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        result = await self._run(fn, *args)
        self._observe(step, started, num_tokens)
        return result

    def _observe(self, step: str, started: float, num_tokens: int) -> None:
        self.metrics.step_latency.labels(step).observe(time.perf_counter() - started)
        self.metrics.batch_size.labels(step).observe(1)  # one session per forward pass until batching
        self.metrics.tokens.labels(step).inc(num_tokens)
