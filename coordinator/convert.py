"""The coordinator's protobuf boundary: CoordinatorService messages <-> the coordinator's types."""

from __future__ import annotations

import secrets

from google.protobuf.timestamp_pb2 import Timestamp

from specdec.errors import InvalidArgument
from specdec.generation.stats import SpeculationStats
from specdec.generation.stopping import FinishReason
from specdec.rpc import coordinator_pb2 as pb
from specdec.rpc_convert import sampling_params_from_proto, sampling_params_to_proto
from specdec.store import SessionStats

from coordinator.requests import GenerateRequest, Pool, SpeculationOptions
from coordinator.sessions import SessionView
from coordinator.state import Phase, turn_of
from coordinator.stream import FinalInfo, StreamMessage

_POOL_FROM_PB = {pb.POOL_BASELINE: Pool.BASELINE, pb.POOL_SPECULATIVE: Pool.SPECULATIVE}
_POOL_TO_PB = {pool: value for value, pool in _POOL_FROM_PB.items()}
_FINISH_TO_PB = {
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
_PHASE_TO_PB = {
    Phase.GENERATING: pb.SESSION_STATE_GENERATING,
    Phase.IDLE: pb.SESSION_STATE_IDLE,
    Phase.INTERRUPTED: pb.SESSION_STATE_INTERRUPTED,
}


def request_from_proto(msg: pb.CoordinatorServiceGenerateRequest) -> GenerateRequest:
    """The request as the coordinator sees it. An unset seed becomes a fresh random one, which
    the session records (GetSession shows it)."""
    which = msg.WhichOneof("input")
    if msg.pool != pb.POOL_UNSPECIFIED and msg.pool not in _POOL_FROM_PB:
        raise InvalidArgument(f"pool must be BASELINE, SPECULATIVE or unset, got enum value {msg.pool}")
    speculation = msg.speculation
    return GenerateRequest(
        prompt=msg.prompt if which == "prompt" else None,
        messages=tuple({"role": m.role, "content": m.content} for m in msg.messages.messages)
        if which == "messages" else None,
        resume_from=msg.resume.from_position if which == "resume" else None,
        raw=msg.raw,
        sampling=sampling_params_from_proto(msg.sampling, default_seed=secrets.randbits(63)),
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else None,
        stop_sequences=tuple(msg.stop_sequences),
        ignore_eos=msg.ignore_eos,
        session_id=msg.session_id if msg.HasField("session_id") else None,
        pool=_POOL_FROM_PB.get(msg.pool),
        speculation=SpeculationOptions(
            enabled=speculation.enabled if speculation.HasField("enabled") else None,
            num_draft_tokens=speculation.num_draft_tokens,
            pipelined=speculation.pipelined if speculation.HasField("pipelined") else None,
        ),
    )


def message_to_proto(message: StreamMessage) -> pb.CoordinatorServiceGenerateResponse:
    response = pb.CoordinatorServiceGenerateResponse(
        session_id=message.session_id, token_ids=message.token_ids, text=message.text,
        position=message.position,
    )
    if message.final is not None:
        final: FinalInfo = message.final
        response.finish_reason = _FINISH_TO_PB[final.finish_reason]
        response.usage.prompt_tokens = final.prompt_tokens
        response.usage.completion_tokens = final.completion_tokens
        response.stats.CopyFrom(stats_to_proto(final.stats, final.pool, final.proposer, final.num_draft_tokens))
    return response


def stats_to_proto(stats: SpeculationStats, pool: Pool, proposer: str, num_draft_tokens: int) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        cycles=stats.cycles, drafted=stats.drafted, accepted=stats.accepted,
        drafted_by_position=stats.drafted_by_position, accepted_by_position=stats.accepted_by_position,
        recovered=stats.recovered, bonus=stats.bonus, decode_steps=stats.decode_steps,
        fallbacks=stats.fallbacks, pipeline_hits=stats.pipeline_hits, pipeline_misses=stats.pipeline_misses,
        pipeline_wrong_guesses=stats.pipeline_wrong_guesses, pipeline_rejected_last=stats.pipeline_rejected_last,
        pipeline_hits_second_guess=stats.pipeline_hits_second_guess,
        pipeline_hits_rejected_last=stats.pipeline_hits_rejected_last,
        mean_accepted_length=stats.mean_accepted_length, draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        decode_seconds=stats.decode_seconds, pool=_POOL_TO_PB[pool], proposer=proposer,
        num_draft_tokens=num_draft_tokens, cycle_seconds=stats.cycle_seconds,
        draft_model_seconds=stats.draft_model_seconds, target_model_seconds=stats.target_model_seconds,
        hidden_draft_model_seconds=stats.hidden_draft_model_seconds, queued_seconds=stats.queued_seconds, timed_cycles=stats.timed_cycles,
        handler_seconds=stats.handler_seconds, call_seconds=stats.call_seconds,
    )


def session_stats_to_proto(stats: SessionStats, pool: Pool, proposer: str, num_draft_tokens: int) -> pb.SpeculationStats:
    """The session's counters as Redis sums them over its turns (timings are per turn only)."""
    cycles = stats.cycles
    return pb.SpeculationStats(
        cycles=cycles, drafted=stats.drafted, accepted=stats.accepted,
        accepted_by_position=stats.accepted_by_position, recovered=stats.recovered, bonus=stats.bonus,
        fallbacks=stats.fallbacks, mean_accepted_length=(stats.accepted + cycles) / cycles if cycles else 0.0,
        pool=_POOL_TO_PB[pool], proposer=proposer, num_draft_tokens=num_draft_tokens,
    )


def session_to_proto(session_id: str, view: SessionView) -> pb.SessionInfo:
    record, turn = view.record, turn_of(view.record)
    pool = Pool(record.pool)
    return pb.SessionInfo(
        session_id=session_id, state=_PHASE_TO_PB[view.phase], position=record.length,
        prompt_length=record.prompt_length, turn_start_position=turn.turn_start, turn_count=record.turns,
        sampling=sampling_params_to_proto(record.sampling), pool=_POOL_TO_PB[pool],
        target_replica=record.target_replica, draft_replica=record.draft_replica,
        stats=session_stats_to_proto(record.stats, pool, turn.proposer, record.num_draft_tokens),
        create_time=_timestamp(record.created_at), update_time=_timestamp(record.updated_at),
        expire_time=_timestamp(view.expires_at),
    )


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
