"""TargetService over gRPC: a thin translator between specdec.v1 messages and the TargetEngine.

Every engine call runs on the ModelExecutor: one thread, because the engine is thread-confined, and
off the event loop, so health checks and other calls stay responsive during a forward pass. Domain
errors (specdec.errors) are left to the error-mapping interceptor of specdec.server, which turns them
into status codes; a PositionMismatch travels as FAILED_PRECONDITION with the session's actual
position in the trailing metadata. The per-RPC server span comes from the OpenTelemetry interceptor;
handlers only add attributes to it. Verification itself lives in the engine and specdec.sampling.

Continuous batching: Verify and Decode work of concurrent sessions goes through a Batcher, which runs
everything queued as one batched engine step (specdec.engine.batch: one forward over rows at
different positions and lengths); a call that arrives during a step joins the next. A multi-token
Decode is a sequence of one-token steps, each joining a batch. StartSession (prefill), Truncate,
EndTurn and EndSession run on the same model thread directly.

DecodeStream streams a multi-token Decode token by token, and submits each next step before it
writes the token just made, so the model never waits for the caller's round trip; the streams woken
by one step all submit their next before any builds its response, so the model does not wait for
the responses either. A caller that
stops reading early (a stop sequence) cancels the stream and truncates; since it cannot know how far
the stream got, every other call of the session first ends the session's stream (end_stream): its
step still queued is dropped, and a step already on the model thread finishes before the new call's
work, which runs on the same thread after it, so the caller's Truncate undoes it. With
lookup_draft_tokens or model_draft_tokens, each step after the first drafts inside the target (n-gram
lookup in the session's own tokens, or the draft model the service hosts, --inner-draft) and
verifies the draft in the same batched forward (specdec.engine.inner_draft): speculation with no
draft service and no round trip per cycle.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Callable, Iterable

from specdec.engine.batch import DecodeWork, VerifyWork, run_target_batch
from specdec.engine.batcher import Batcher, StepTiming
from specdec.engine.draft import DraftEngine
from specdec.engine.goodput import DraftTrimmer, run_trimmed_batch
from specdec.engine.inner_draft import Drafter, InnerDraftResult, LookupDrafter, ModelDrafter, run_inner_step
from specdec.engine.target import TargetEngine
from specdec.engine.target_stream import DecodeStepper, decode_steps
from specdec.errors import InvalidArgument
from specdec.generation.inner_adaptive import AdaptiveDraftLength
from specdec.generation.shared_estimates import SharedEstimatesByRoute
from specdec.observability.metrics import TargetMetrics
from specdec.observability.spans import SPECDEC_NUM_ACCEPTED, SPECDEC_NUM_DRAFT_TOKENS, SPECDEC_POSITION
from specdec.rpc import VERIFY_METHOD, target_pb2, target_pb2_grpc
from specdec.rpc_convert import (
    model_info_to_proto,
    sampling_params_from_proto,
    server_timing_to_proto,
    unpack_distributions,
    verify_outcome_to_proto,
)
from specdec.server.bootstrap import ModelExecutor
from specdec.server.service import BatchSettings
from specdec.server.message_streams import MessageStreams
from specdec.server.model_servicer import SPECDEC_SESSION_ID, EngineServicer, annotate, check_session_id
from specdec.server.tokenizer_info import TokenizerFacts

from target_service.slot_queue import SlotQueue

log = logging.getLogger(__name__)

TARGET_SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
SPECDEC_DRAFT_EPOCH = "specdec.draft_epoch"


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
        batching: BatchSettings = BatchSettings(),
        trim_drafts: bool = False,
        trim_margin: float = 0.0,
        inner_draft: DraftEngine | None = None,
        trim_cycles: bool = True,
        step_pricing: str = "auto",
    ):
        self.engine = engine
        self.executor = executor
        self._warned_no_inner_draft = False
        self._ending: set[asyncio.Task] = set()  # hosted draft sessions being ended (forget_sessions)
        self.shared_estimates = SharedEstimatesByRoute(max_routes=2)  # adaptive streams' (inner_adaptive.py)
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.max_draft_tokens = max_draft_tokens
        # With trim_drafts, each step verifies only the drafted tokens that raise the batch's
        # expected tokens per second (specdec.engine.goodput), so load never makes speculation
        # slower than plain decoding; without, every drafted token is verified.
        packed = step_pricing == "packed" or (step_pricing == "auto" and engine.model.packs_ragged_rows)
        self.trimmer = DraftTrimmer(margin=trim_margin, price_cycles=trim_cycles, packed=packed) if trim_drafts else None
        # StartSessions waiting for their prefill: changed on the event loop only, read by the cycle
        # pricing on the model thread as load about to arrive (cycle_wall.py).
        self._starting = 0
        self.slot_queue = SlotQueue()  # new sessions waiting for a KV slot, in arrival order
        metrics.sessions_waiting_for_slot.set_function(lambda: len(self.slot_queue))
        # Mid-turn is what --evict-after protects: a session used that recently (or 1 s without it).
        metrics.sessions_in_turn.set_function(lambda: engine.sessions.in_turn(engine.evict_after_s or 1.0))
        if self.trimmer is not None and self.trimmer.cycle_wall is not None:
            self.trimmer.cycle_wall.starting = lambda: self._starting
        step = functools.partial(run_trimmed_batch, engine, self.trimmer) if trim_drafts \
            else functools.partial(run_target_batch, engine)
        # The draft model this service hosts (--inner-draft) for DecodeStream's model_draft_tokens: its
        # drafts are made inside the batched step, before the verify forward (run_inner_step).
        self.inner_draft = inner_draft
        if inner_draft is not None:
            step = functools.partial(run_inner_step, engine, self.trimmer, inner_draft)
        self.batcher = Batcher(executor, step,
                               max_batch_size=batching.max_batch_size, batch_wait_s=batching.batch_wait_s,
                               gather=batching.gather, on_step=self._observe_batch)
        self._streams: dict[str, _Stream] = {}  # session -> its DecodeStream in progress
        self.message_streams = MessageStreams()  # the open VerifyStreams, ended when the service stops
        self._evictions_seen = engine.evictions
        self._counted: dict = {}  # metric counter -> the trimmer's running total it last counted up to
        self.update_gauges()

    # ---- RPCs ------------------------------------------------------------------------------

    async def StartSession(self, request, context):
        check_session_id(request.session_id)
        self.end_stream(request.session_id)
        params = sampling_params_from_proto(request.sampling)
        tokens = list(request.token_ids)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, "specdec.num_prompt_tokens": len(tokens)})

        async def start():
            self._starting += 1  # only while it is queued for the model thread, not waiting for a slot
            try:
                return await self._step(
                    "prefill", len(tokens), self._start_session,
                    request.session_id, tokens, params, request.sample_first_token, request.drafts_elsewhere,
                    request.draft_source,
                )
            finally:
                self._starting -= 1

        position, first, draft_limit = await self.slot_queue.admit(start, request.slot_wait_ms / 1000)
        response = target_pb2.TargetServiceStartSessionResponse(position=position)
        if first is not None:
            response.first_token_id = first
        if draft_limit is not None:
            response.draft_limit = draft_limit
        return response

    def _start_session(self, session_id: str, tokens: list[int], params, sample_first_token: bool,
                       drafts_elsewhere: bool, draft_source: str) -> tuple[int, int | None, int | None]:
        """On the model thread (the trimmer is confined to it): the prefill, then for a session that
        will draft on a draft service, whether the cycle pricing refuses it from the start; and for
        every session, that it is load the next steps will carry."""
        position, first = self.engine.start_session(session_id, tokens, params, sample_first_token)
        draft_limit = None
        if self.trimmer is not None:
            now = time.perf_counter()
            if drafts_elsewhere:
                draft_limit = self.trimmer.admit_drafting_elsewhere(session_id, now, draft_source)
            self.trimmer.session_started(session_id, now)  # after: it was still counted as starting
        return position, first, draft_limit

    async def Verify(self, request, context):
        received_ns = time.perf_counter_ns()
        check_session_id(request.session_id)
        self.end_stream(request.session_id)
        k = len(request.draft_token_ids)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, SPECDEC_POSITION: request.position,
                    SPECDEC_NUM_DRAFT_TOKENS: k, SPECDEC_DRAFT_EPOCH: request.draft_epoch})
        if k > self.max_draft_tokens:
            raise InvalidArgument(
                f"a Verify carries at most {self.max_draft_tokens} draft tokens (--max-draft-tokens), got {k}"
            )
        rows = request.draft_distributions if request.HasField("draft_distributions") else None
        block = unpack_distributions(rows, request.draft_token_ids)
        work = VerifyWork(request.session_id, request.position, block, drafted_elsewhere=True)
        outcome, timing = await self.batcher.submit_timed(work)
        annotate(**{SPECDEC_NUM_ACCEPTED: outcome.num_accepted,
                    "specdec.next_token_kind": "bonus" if outcome.is_bonus else "recovered"})
        response = verify_outcome_to_proto(outcome, request.draft_epoch)
        response.timing.CopyFrom(server_timing_to_proto(timing.model_ns, timing.queued_ns, received_ns))
        return response

    async def VerifyStream(self, requests, context):
        # Each message is a Verify call; an error ends the stream with that call's status.
        async for message in self.message_streams.requests(requests):
            with self.message_streams.span(VERIFY_METHOD, message.trace_context):
                response = await self.Verify(message.verify, context)
            yield target_pb2.TargetServiceVerifyStreamResponse(verify=response)

    async def Decode(self, request, context):
        received_ns = time.perf_counter_ns()
        check_session_id(request.session_id)
        self.end_stream(request.session_id)
        appended = list(request.append_token_ids)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, SPECDEC_POSITION: request.position,
                    "specdec.num_appended_tokens": len(appended), "specdec.num_tokens": request.num_tokens})
        timing = StepTiming()
        tokens = await decode_steps(self.batcher, request.session_id, request.position, request.num_tokens,
                                    appended, request.stop_token_ids, timing)
        annotate(**{"specdec.num_generated_tokens": len(tokens)})
        return target_pb2.TargetServiceDecodeResponse(
            token_ids=tokens, position=request.position + len(appended) + len(tokens),
            timing=server_timing_to_proto(timing.model_ns, timing.queued_ns, received_ns),
        )

    async def DecodeStream(self, request, context):
        started_ns = time.perf_counter_ns()
        session_id = request.session_id
        check_session_id(session_id)
        self.end_stream(session_id)
        appended = list(request.append_token_ids)
        annotate(**{SPECDEC_SESSION_ID: session_id, SPECDEC_POSITION: request.position,
                    "specdec.num_appended_tokens": len(appended), "specdec.num_tokens": request.num_tokens,
                    "specdec.lookup_draft_tokens": request.lookup_draft_tokens})
        drafter = self._drafter(session_id, request)
        stepper = DecodeStepper(self.batcher, session_id, request.position, request.num_tokens, appended,
                                request.stop_token_ids, drafter)
        stream = self._streams[session_id] = _Stream(stepper)
        position, generated = request.position + len(appended), 0
        try:
            stream.next_step()
            while stream.pending:
                try:
                    step = await stepper.result()
                except asyncio.CancelledError:
                    if stream.ended:  # another call of the session ended it (see the module's doc)
                        break
                    raise
                if stream.ended:  # ended after this step ran: its caller's Truncate undoes it
                    break
                if step.plain_reason is not None:
                    self.metrics.stream_plain_steps.labels(step.plain_reason).inc()
                position += len(step.tokens)
                generated += len(step.tokens)
                stream.next_step()  # the next step runs while this one's tokens are written
                # Let the other streams woken by the same step queue their next steps before this
                # one builds and writes its response: the batcher starts that step once they are all
                # queued, and the responses are written while it runs.
                await asyncio.sleep(0)
                response = target_pb2.TargetServiceDecodeStreamResponse(
                    token_ids=step.tokens, position=position, draft_limit=self._draft_limit(session_id),
                    timing=server_timing_to_proto(step.cost.model_ns, step.cost.queued_ns, started_ns),
                )
                if step.outcome is not None:
                    response.num_drafted, response.num_accepted = step.outcome.num_drafted, step.outcome.num_accepted
                if step.draft_cost is not None:
                    response.timing.draft_model_ns = step.draft_cost.model_ns
                    response.timing.queued_ns += step.draft_cost.queued_ns
                yield response
                started_ns = time.perf_counter_ns()
        finally:
            stream.end()
            if self._streams.get(session_id) is stream:
                del self._streams[session_id]
            annotate(**{"specdec.num_generated_tokens": generated})

    def _drafter(self, session_id: str, request) -> Drafter | None:
        """DecodeStream's drafts made here (specdec.engine.inner_draft), or None for plain decoding.
        Drafters read the session's committed tokens on the event loop between its steps, when none
        of them is queued or running, so what they read is settled; peek touches nothing the model
        thread may be changing."""
        lookup, model = request.lookup_draft_tokens, request.model_draft_tokens
        if lookup and model:
            raise InvalidArgument("a DecodeStream drafts by lookup_draft_tokens or model_draft_tokens, not both")
        if max(lookup, model) > self.max_draft_tokens:
            raise InvalidArgument(f"lookup_draft_tokens and model_draft_tokens are at most {self.max_draft_tokens} "
                                  f"(--max-draft-tokens), got {max(lookup, model)}")
        if request.adaptive_draft_length and not (lookup or model):
            raise InvalidArgument("adaptive_draft_length needs lookup_draft_tokens or model_draft_tokens: "
                                  "the most tokens a step may draft")
        state = self.engine.sessions.peek(session_id)
        if not (lookup or model) or state is None:  # no session: the first step says so
            return None

        def committed():
            current = self.engine.sessions.peek(session_id)
            return None if current is None else current.tokens

        def limit():  # what the goodput trimming would verify for it now (None: no limit known)
            return self._draft_limit(session_id)

        # The adaptive length (generation.inner_adaptive), or None: the drafter's fixed rule.
        length = None
        if request.adaptive_draft_length:  # starting from what earlier streams of this drafter measured
            shared = self.shared_estimates.route("", "lookup" if lookup else "model", False)
            length = AdaptiveDraftLength(lookup or model, limit, shared)
        if lookup:
            return LookupDrafter(committed, lookup, request.stop_token_ids, limit, length)
        if self.inner_draft is None:  # a misconfiguration costs speed, never the request
            if not self._warned_no_inner_draft:
                self._warned_no_inner_draft = True
                log.warning("DecodeStream asked for model_draft_tokens but this target hosts no draft model "
                            "(--inner-draft): decoding plainly")
            return None
        return ModelDrafter(state.params, committed, model, request.stop_token_ids, limit, length)

    def _draft_limit(self, session_id: str) -> int | None:
        """What a draft of this session would have kept in its latest step (goodput.py), if known.
        (That step, or the next one, which may already run: either is the current load.)"""
        return None if self.trimmer is None else self.trimmer.draft_limits.get(session_id)

    def end_stream(self, session_id: str) -> None:
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            stream.end()

    async def EndTurn(self, request, context):
        check_session_id(request.session_id)
        annotate(**{SPECDEC_SESSION_ID: request.session_id, SPECDEC_POSITION: request.position})
        self.end_stream(request.session_id)
        released = await self._run(self.engine.end_turn, request.session_id, request.position)
        return target_pb2.TargetServiceEndTurnResponse(released=released)

    async def ScoreTokens(self, request, context):
        tokens, candidates = list(request.token_ids), list(request.candidate_token_ids)
        annotate(**{"specdec.num_prompt_tokens": len(tokens), "specdec.num_candidates": len(candidates)})
        score = functools.partial(self._step, "score", len(tokens), self.engine.score, tokens, candidates)
        logits, greedy = await self.slot_queue.admit(score, request.slot_wait_ms / 1000)
        return target_pb2.TargetServiceScoreTokensResponse(logits=logits, greedy_token_id=greedy)

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

    def forget_sessions(self, session_ids: Iterable[str]) -> None:
        ended = list(session_ids)
        for session_id in ended:
            self.end_stream(session_id)
            self.batcher.forget(session_id)
        if self.inner_draft is not None and ended:  # the hosted draft's sessions end with the target's
            task = asyncio.ensure_future(self.executor.run(_end_all, self.inner_draft, ended))
            self._ending.add(task)  # referenced until done: the loop keeps only weak references
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self._ending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("ending hosted draft sessions failed: %r", task.exception())

    async def aclose(self) -> None:
        await self.batcher.aclose()

    # ---- internals ---------------------------------------------------------------------------

    async def _step(self, step: str, num_tokens: int, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        result = await self._run(fn, *args)
        self._observe(step, started, num_tokens)
        return result

    def _observe(self, step: str, started: float, num_tokens: int) -> None:
        self.metrics.step_latency.labels(step).observe(time.perf_counter() - started)
        self.metrics.batch_size.labels(step).observe(1)  # a prefill runs alone
        self.metrics.tokens.labels(step).inc(num_tokens)

    def _observe_batch(self, works: list, results: list, seconds: float) -> None:
        """After each batched step: its duration, rows and tokens, labelled verify, decode or mixed;
        the rows of the latest step as the current load (the coordinator's adaptive draft length
        sees the same load as longer verify times)."""
        verify_tokens = sum(w.draft.num_tokens + 1 for w in works if isinstance(w, VerifyWork)) + sum(
            r.outcome.num_drafted + 1 for r in results if isinstance(r, InnerDraftResult))  # drafted in the step
        decode_tokens = sum(len(w.append_token_ids) + w.num_tokens for w in works if isinstance(w, DecodeWork))
        step = "mixed" if verify_tokens and decode_tokens else "verify" if verify_tokens else "decode"
        self.metrics.step_latency.labels(step).observe(seconds)
        self.metrics.batch_size.labels(step).observe(len(works))
        self.metrics.tokens.labels(step).inc(verify_tokens + decode_tokens)
        self.metrics.batch_rows.set(len(works))
        if self.trimmer is not None:
            self._count_up(self.metrics.trimmed_draft_tokens, self.trimmer.trimmed_tokens)
            self._count_up(self.metrics.draft_refusals,
                           self.trimmer.cycle_wall.refusals if self.trimmer.cycle_wall else 0)
            self._count_up(self.metrics.joint_explorations, self.trimmer.exploration.explorations)
        self.update_gauges()

    def _count_up(self, counter, total: int) -> None:
        """Add to `counter` what a running total of the trimmer's gained since the last step."""
        seen = self._counted.get(counter, 0)
        if total > seen:
            counter.inc(total - seen)
            self._counted[counter] = total


def _end_all(engine: DraftEngine, session_ids: list[str]) -> None:
    for session_id in session_ids:
        engine.end_session(session_id)


class _Stream:
    """A DecodeStream in progress: its stepper, and whether another call of the session ended it."""

    def __init__(self, stepper: DecodeStepper) -> None:
        self.stepper = stepper
        self.pending = False  # a step is queued or running
        self.ended = False

    def next_step(self) -> None:
        self.pending = not self.ended and self.stepper.submit()

    def end(self) -> None:
        """No further step: one still queued in the batcher is dropped (cancelling its future, which
        the batcher then skips; a handler awaiting it sees CancelledError with `ended` set)."""
        self.ended = True
        self.pending = False
        self.stepper.cancel()
