"""DraftService over gRPC: a thin translator between specdec.v1 messages and the DraftEngine.

Engine calls run on the ModelExecutor (one thread: the engine and a draft model are thread-confined;
the event loop stays free for health checks). Domain errors go to the error-mapping interceptor of
specdec.server. A Propose whose parent epoch or keep position does not fit the session is answered
here, as FAILED_PRECONDITION with trailing metadata "specdec-actual-position" (the length of the
draft's whole sequence, drafted tokens included) and "specdec-latest-epoch" (its newest proposal),
as draft.proto specifies; the session is left as it was.

Continuous batching: Propose calls of concurrent sessions go through a Batcher, which runs everything
queued as one batched step (specdec.engine.draft_batch: each accept/rollback applied on its own, then
step t of every proposal drafted in one forward); a call that arrives during a step joins the next.

Pipelining: `speculative=true` drafts the next block while the parent is being verified (the
engine's live proposal chain, specdec.engine.branches): the response carries guessed_token_id, the
draft's guess of the target's next token, unless the proposer had none (then the block is empty).
Speculative work joins the same batched step as sequential work. Multi-outcome pipelining: the
request's `alternatives` become branches drafted in the same step (specdec.engine.alternatives),
answered as repeated DraftBranch messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import grpc

from specdec.engine.api import Proposal
from specdec.engine.batcher import Batcher
from specdec.engine.draft import DraftEngine, check_stop_below
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.errors import (
    ContextOverflow,
    EpochMismatch,
    InvalidArgument,
    PositionMismatch,
    SessionExists,
    SessionNotFound,
)
from specdec.models.base import ModelInfo
from specdec.observability.metrics import DraftMetrics
from specdec.observability.spans import SPECDEC_NUM_DRAFT_TOKENS, SPECDEC_POSITION
from specdec.rpc import (ACTUAL_POSITION_KEY, LATEST_EPOCH_KEY, LIVE_EPOCHS_KEY, PROPOSE_METHOD, draft_pb2,
                         draft_pb2_grpc)
from specdec.rpc_convert import (model_info_to_proto, pack_distributions, sampling_params_from_proto,
                                 server_timing_to_proto)
from specdec.server.bootstrap import ModelExecutor
from specdec.server.service import BatchSettings
from specdec.server.message_streams import MessageStreams
from specdec.server.model_servicer import SPECDEC_SESSION_ID, EngineServicer, annotate, check_session_id

DRAFT_SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
BRANCH_KINDS = {"main": draft_pb2.BRANCH_KIND_MAIN, "second_guess": draft_pb2.BRANCH_KIND_SECOND_GUESS,
                "rejected_last": draft_pb2.BRANCH_KIND_REJECTED_LAST}


def _branch_kind_from_proto(kind: int) -> str:
    for name, value in BRANCH_KINDS.items():
        if value == kind and name != "main":
            return name
    raise InvalidArgument(f"alternatives must be BRANCH_KIND_SECOND_GUESS or BRANCH_KIND_REJECTED_LAST "
                          f"(the main branch is always drafted), got {draft_pb2.BranchKind.Name(kind) if kind in draft_pb2.BranchKind.values() else kind}")


@dataclass(frozen=True)
class DraftServiceConfig:
    """What the servicer reports and enforces, fixed when the service starts."""

    model: ModelInfo  # the draft model, or the tokenizer's facts for a proposer without weights
    vocab_fingerprint: str = ""
    eos_token_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 4  # draft length when neither the request nor the session names one
    top_m: int | None = None  # the proposer's top-m (None: it sends no distributions at all)
    max_context: int = 0  # tokens a session may hold; 0: unlimited (a proposer without weights)


@dataclass(frozen=True)
class _Mismatch:
    """A refused Propose and the session's state to report with it."""

    error: Exception
    length: int
    latest_epoch: int
    live_epochs: tuple[int, ...] = ()


def _start(engine: DraftEngine, session_id: str, tokens: list[int], params) -> int:
    # Checked first: DraftEngine.start_session opens proposer state before it finds the id taken.
    try:
        engine.sessions.get(session_id)
    except SessionNotFound:
        pass
    else:
        raise SessionExists(session_id)
    return engine.start_session(session_id, tokens, params)


def _propose_batch(engine: DraftEngine, works: list[ProposeWork]) -> list[Proposal | _Mismatch | Exception]:
    """The batched step; a refused parent epoch or keep position comes back with the session's
    state, read on the model thread right after the step."""
    results: list[Proposal | _Mismatch | Exception] = list(run_propose_batch(engine, works))
    for index, (work, result) in enumerate(zip(works, results)):
        if isinstance(result, (PositionMismatch, EpochMismatch)):
            state = engine.sessions.get(work.session_id)
            results[index] = _Mismatch(result, state.position, state.epoch,
                                       tuple(p.epoch for p in state.chain.live))
    return results


class DraftServicer(EngineServicer, draft_pb2_grpc.DraftServiceServicer):
    TRUNCATE_RESPONSE = draft_pb2.DraftServiceTruncateResponse
    END_SESSION_RESPONSE = draft_pb2.DraftServiceEndSessionResponse

    def __init__(self, engine: DraftEngine, executor: ModelExecutor, metrics: DraftMetrics, config: DraftServiceConfig,
                 batching: BatchSettings = BatchSettings()):
        self.engine = engine
        self.executor = executor
        self.metrics = metrics
        self.config = config
        self.proposer = engine.proposer.name
        self.batcher = Batcher(executor, lambda works: _propose_batch(engine, works),
                               max_batch_size=batching.max_batch_size, batch_wait_s=batching.batch_wait_s,
                               gather=batching.gather, on_step=self._observe_batch)
        self._session_num_draft_tokens: dict[str, int] = {}  # ProposerOptions.num_draft_tokens, if set
        self.message_streams = MessageStreams()  # the open ProposeStreams, ended when the service stops
        metrics.sessions_in_turn.set_function(lambda: engine.sessions.in_turn(1.0))  # a Propose a cycle
        self._evictions_seen = 0
        self.update_gauges()

    # ---- RPCs ------------------------------------------------------------------------------

    async def StartSession(self, request, context):
        check_session_id(request.session_id)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, "specdec.num_prompt_tokens": len(request.token_ids)})
        num_draft_tokens = self._check_options(request.options)
        tokens = list(request.token_ids)
        self._check_tokens(tokens, 0, "token_ids")
        params = sampling_params_from_proto(request.sampling)
        started = time.perf_counter()
        position = await self._run(_start, self.engine, request.session_id, tokens, params)
        self.metrics.step_latency.labels(self.proposer, "prefill").observe(time.perf_counter() - started)
        if num_draft_tokens:
            self._session_num_draft_tokens[request.session_id] = num_draft_tokens
        return draft_pb2.DraftServiceStartSessionResponse(position=position, proposer=self.proposer)

    async def Propose(self, request, context):
        received_ns = time.perf_counter_ns()
        check_session_id(request.session_id)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, "specdec.parent_epoch": request.parent_epoch,
                    "specdec.keep_position": request.keep_position,
                    "specdec.speculative": request.speculative})
        k = request.num_draft_tokens
        if k < 0 or k > self.engine.max_draft_tokens:
            raise InvalidArgument(
                f"num_draft_tokens must be in [0, {self.engine.max_draft_tokens}] (0: the session's "
                f"default), got {k}"
            )
        k = k or self._session_num_draft_tokens.get(request.session_id, self.config.num_draft_tokens)
        appended = list(request.append_token_ids)
        self._check_tokens(appended, request.keep_position, "append_token_ids")
        alternatives = tuple(_branch_kind_from_proto(kind) for kind in request.alternatives)
        stop_below = check_stop_below(request.stop_below)
        started = time.perf_counter()
        result, timing = await self.batcher.submit_timed(
            ProposeWork(request.session_id, request.keep_position, tuple(appended), k, request.parent_epoch,
                        request.speculative, alternatives, stop_below)
        )
        if isinstance(result, _Mismatch):
            trailing = ((ACTUAL_POSITION_KEY, str(result.length)), (LATEST_EPOCH_KEY, str(result.latest_epoch)),
                        (LIVE_EPOCHS_KEY, ",".join(map(str, result.live_epochs))))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(result.error), trailing)
        num_drafted = result.block.num_tokens
        step = "propose_speculative" if request.speculative else "propose"
        self.metrics.step_latency.labels(self.proposer, step).observe(time.perf_counter() - started)
        self.metrics.proposed_tokens.labels(self.proposer).inc(num_drafted)
        annotate(**{SPECDEC_POSITION: result.position, SPECDEC_NUM_DRAFT_TOKENS: num_drafted,
                    "specdec.epoch": result.epoch})
        response = draft_pb2.DraftServiceProposeResponse(
            epoch=result.epoch, parent_epoch=request.parent_epoch, position=result.position,
            draft_token_ids=result.block.token_ids.tolist(), proposer=result.proposer,
            speculative=result.speculative, draft_confidences=result.block.confidences,
        )
        if result.guessed_token_id is not None:
            response.guessed_token_id = result.guessed_token_id
        if result.block.draft_probs is not None:
            response.draft_distributions.CopyFrom(pack_distributions(result.block))
        response.timing.CopyFrom(server_timing_to_proto(timing.model_ns, timing.queued_ns, received_ns))
        for branch in result.alternatives:
            msg = response.alternatives.add(
                epoch=branch.epoch, kind=BRANCH_KINDS[branch.kind], position=branch.position,
                guessed_token_id=branch.guessed_token_id, draft_token_ids=branch.block.token_ids.tolist())
            if branch.block.draft_probs is not None:
                msg.draft_distributions.CopyFrom(pack_distributions(branch.block))
        return response

    async def EndTurn(self, request, context):
        check_session_id(request.session_id)
        annotate(**{SPECDEC_SESSION_ID: request.session_id})
        released = await self._run(self.engine.end_turn, request.session_id)
        return draft_pb2.DraftServiceEndTurnResponse(released=released)

    async def ProposeStream(self, requests, context):
        # Each message is a Propose call; a refusal ends the stream with that call's status.
        async for message in self.message_streams.requests(requests):
            with self.message_streams.span(PROPOSE_METHOD, message.trace_context):
                response = await self.Propose(message.propose, context)
            yield draft_pb2.DraftServiceProposeStreamResponse(propose=response)

    async def GetInfo(self, request, context):
        model = self._model()
        info = model_info_to_proto(
            self.config.model, vocab_fingerprint=self.config.vocab_fingerprint,
            eos_token_ids=self.config.eos_token_ids,
            num_slots=model.num_slots if model is not None else 0,
            free_slots=model.num_free_slots if model is not None else 0,
        )
        return draft_pb2.DraftServiceGetInfoResponse(
            model=info, proposer=self.proposer, max_draft_tokens=self.engine.max_draft_tokens
        )

    # ---- housekeeping ------------------------------------------------------------------------

    def forget_sessions(self, session_ids: Iterable[str]) -> None:
        for session_id in session_ids:
            self._session_num_draft_tokens.pop(session_id, None)
            self.batcher.forget(session_id)

    def update_gauges(self) -> None:
        self.metrics.sessions.set(len(self.engine.sessions))
        model = self._model()
        if model is not None:
            self.metrics.kv_cache_slots_total.set(model.num_slots)
            self.metrics.kv_cache_slots_used.set(model.num_slots - model.num_free_slots)
        evictions = getattr(self.engine.proposer, "evictions", 0)  # the draft model's; n-gram holds no cache
        if evictions > self._evictions_seen:
            self.metrics.evictions.inc(evictions - self._evictions_seen)
            self._evictions_seen = evictions

    async def aclose(self) -> None:
        await self.batcher.aclose()

    def _observe_batch(self, works: list, results: list, seconds: float) -> None:
        self.metrics.batch_size.labels(self.proposer).observe(len(works))
        self.update_gauges()

    # ---- internals ---------------------------------------------------------------------------

    def _model(self):
        """The draft model behind the proposer, None for a proposer without weights."""
        return getattr(self.engine.proposer, "model", None)

    def _check_options(self, options) -> int:
        limit = self.engine.max_draft_tokens
        if not 0 <= options.num_draft_tokens <= limit:
            raise InvalidArgument(
                f"options.num_draft_tokens must be in [0, {limit}] (0: the server default "
                f"{self.config.num_draft_tokens}), got {options.num_draft_tokens}"
            )
        top_m = self.config.top_m
        if options.top_m < 0 or (top_m is not None and options.top_m not in (0, top_m)):
            allowed = "0 or any positive value (this proposer sends no distributions)" if top_m is None \
                else f"0 (the server default) or {top_m}: every session of this server drafts with top_m={top_m}"
            raise InvalidArgument(f"options.top_m must be {allowed}, got {options.top_m}")
        return options.num_draft_tokens

    def _check_tokens(self, tokens: Sequence[int], before: int, field: str) -> None:
        """Ids in the vocabulary, and room in the context after `before` tokens. A `before` past the
        context is left to the engine, which reports it as the position mismatch it is."""
        vocab = self.config.model.vocab_size
        bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
        if bad:
            allowed = f"[0, {vocab})" if vocab else ">= 0"
            raise InvalidArgument(f"{field} must be token ids in {allowed}, got {bad[:5]}")
        limit = self.config.max_context
        if limit and before <= limit < before + len(tokens):
            raise ContextOverflow(
                f"{field}: {before + len(tokens)} tokens would pass the draft's context length {limit} "
                f"(at most {limit - before} fit)"
            )
