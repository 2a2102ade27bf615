"""Conversions between the core's value types and `specdec.v1` messages: the protobuf boundary.

Servers and clients convert here, once, on the way in and out; nothing below them sees protobuf.
Draft distributions travel packed (see SparseDistributions in common.proto): the [k, m] padded
tensors of a DraftBlock become three flat repeated fields, and back, exactly (float32 in, float32
out; padding is dropped on the wire and restored to the widest row).
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

import specdec
from specdec.errors import InvalidArgument
from specdec.models.base import ModelInfo
from specdec.rpc import ACTUAL_POSITION_KEY, LATEST_EPOCH_KEY, LIVE_EPOCHS_KEY, common_pb2, target_pb2
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.types import DraftBlock, VerifyOutcome

_MODE_TO_PB = {
    SamplingMode.REJECTION: common_pb2.SAMPLING_MODE_REJECTION,
    SamplingMode.GUMBEL: common_pb2.SAMPLING_MODE_GUMBEL,
}
_MODE_FROM_PB = {pb: mode for mode, pb in _MODE_TO_PB.items()}
_MODE_FROM_PB[common_pb2.SAMPLING_MODE_UNSPECIFIED] = SamplingMode.REJECTION


# ---- sampling parameters ---------------------------------------------------------------------


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set explicitly (top_p and seed included): what internal hops send."""
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        mode=_MODE_TO_PB[params.mode],
    )


def sampling_params_from_proto(msg: common_pb2.SamplingParams, default_seed: int = 0) -> SamplingParams:
    """Unset top_p means 1 (off); unset seed means default_seed (the coordinator passes a fresh
    random one for a new session). Ranges are not checked here: call .validate() at the edge."""
    mode = _MODE_FROM_PB.get(msg.mode)
    if mode is None:
        raise InvalidArgument(
            f"sampling mode must be REJECTION or GUMBEL (or unset), got enum value {msg.mode}"
        )
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else default_seed,
        mode=mode,
    )


# ---- sparse draft distributions --------------------------------------------------------------


def pack_distributions(block: DraftBlock) -> common_pb2.SparseDistributions:
    """The block's [k, m] padded rows as concatenated rows. An empty message for a block without
    distributions (point masses): leave the request field unset in that case."""
    msg = common_pb2.SparseDistributions()
    if block.draft_probs is None:
        return msg
    prob_ids = block.draft_prob_ids.detach().cpu()  # [k, m] int64, -1 = padding
    draft_probs = block.draft_probs.detach().cpu().to(torch.float32)  # [k, m]
    real = prob_ids >= 0  # [k, m]
    # Boolean indexing walks row-major, so the kept entries come out row after row.
    msg.token_ids.extend(prob_ids[real].tolist())
    msg.probs.extend(draft_probs[real].tolist())
    msg.row_lengths.extend(real.sum(dim=1).tolist())
    return msg


def unpack_distributions(
    msg: common_pb2.SparseDistributions | None, token_ids: Sequence[int]
) -> DraftBlock:
    """A DraftBlock for draft tokens token_ids with the distributions of msg.

    msg None or without rows (an unset field reads as an empty message) means point masses. Rows
    come back padded to the widest one with id -1 and probability 0. Malformed input raises
    InvalidArgument saying what is expected.
    """
    draft_token_ids = torch.tensor(list(token_ids), dtype=torch.long)  # [k]
    if msg is None or (not msg.row_lengths and not msg.token_ids and not msg.probs):
        return DraftBlock(token_ids=draft_token_ids)
    k = draft_token_ids.numel()
    row_lengths = torch.tensor(list(msg.row_lengths), dtype=torch.long)  # [k]
    ids = torch.tensor(list(msg.token_ids), dtype=torch.long)  # [n]
    probs = torch.tensor(list(msg.probs), dtype=torch.float32)  # [n]
    _check_packed(k, row_lengths, ids, probs)
    m = int(row_lengths.max()) if k else 0
    rows = torch.repeat_interleave(torch.arange(k), row_lengths)  # [n]: row of each entry
    starts = torch.cumsum(row_lengths, dim=0) - row_lengths  # [k]
    cols = torch.arange(ids.numel()) - starts[rows]  # [n]: column of each entry within its row
    prob_ids = torch.full((k, m), -1, dtype=torch.long)  # [k, m]
    draft_probs = torch.zeros((k, m), dtype=torch.float32)  # [k, m]
    prob_ids[rows, cols] = ids
    draft_probs[rows, cols] = probs
    return DraftBlock(token_ids=draft_token_ids, draft_prob_ids=prob_ids, draft_probs=draft_probs)


def _check_packed(k: int, row_lengths: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> None:
    if row_lengths.numel() != k:
        raise InvalidArgument(
            f"draft_distributions must have one row per draft token: {k} tokens, {row_lengths.numel()} rows"
        )
    if probs.numel() != ids.numel():
        raise InvalidArgument(
            "draft_distributions needs one probability per token id: "
            f"{ids.numel()} ids, {probs.numel()} probs"
        )
    if int(row_lengths.sum()) != ids.numel():
        raise InvalidArgument(
            f"draft_distributions row_lengths must sum to the number of entries ({ids.numel()}), "
            f"got {int(row_lengths.sum())}"
        )
    if k and int(row_lengths.min()) == 0:
        raise InvalidArgument("every draft_distributions row needs at least one entry (the drafted token)")
    if ids.numel() and int(ids.min()) < 0:
        raise InvalidArgument(f"draft_distributions token ids must be >= 0, got {int(ids.min())}")
    if not bool(torch.isfinite(probs).all()) or (probs.numel() and float(probs.min()) < 0.0):
        raise InvalidArgument("draft_distributions probabilities must be finite and >= 0")


# ---- verification, model info, error metadata --------------------------------------------------


def verify_outcome_to_proto(
    outcome: VerifyOutcome, draft_epoch: int = 0
) -> target_pb2.TargetServiceVerifyResponse:
    return target_pb2.TargetServiceVerifyResponse(
        num_drafted=outcome.num_drafted,
        num_accepted=outcome.num_accepted,
        next_token_id=outcome.next_token,
        is_bonus=outcome.is_bonus,
        position=outcome.position + outcome.num_committed,
        draft_epoch=draft_epoch,
    )


def verify_outcome_from_proto(msg: target_pb2.TargetServiceVerifyResponse) -> VerifyOutcome:
    """The outcome's position is where the block started: the response's position minus the
    tokens it committed."""
    return VerifyOutcome(
        position=msg.position - msg.num_accepted - 1,
        num_drafted=msg.num_drafted,
        num_accepted=msg.num_accepted,
        next_token=msg.next_token_id,
    )


def server_timing_to_proto(model_ns: int, queued_ns: int, handler_started_ns: int) -> common_pb2.ServerTiming:
    """What a call cost in the service: model_ns on the model thread, queued_ns before its step,
    and the handler's whole time since handler_started_ns (time.perf_counter_ns())."""
    return common_pb2.ServerTiming(model_ns=model_ns, queued_ns=queued_ns,
                                   handler_ns=time.perf_counter_ns() - handler_started_ns)


def server_timing_seconds(response) -> tuple[float, float, float] | None:
    """(model, queued, handler) seconds of a Verify, Decode or Propose response; None from a service
    that predates ServerTiming."""
    if not response.HasField("timing"):
        return None
    timing = response.timing
    return timing.model_ns * 1e-9, timing.queued_ns * 1e-9, timing.handler_ns * 1e-9


def model_info_to_proto(
    info: ModelInfo,
    *,
    vocab_fingerprint: str = "",
    eos_token_ids: Iterable[int] = (),
    num_slots: int = 0,
    free_slots: int = 0,
) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        name=info.name,
        architecture=info.architecture,
        dtype=info.dtype,
        device=info.device,
        backend=info.backend,
        context_length=info.max_context,
        vocab_size=info.vocab_size,
        vocab_fingerprint=vocab_fingerprint,
        eos_token_ids=list(eos_token_ids),
        num_slots=num_slots,
        free_slots=free_slots,
        server_version=specdec.__version__,
        batch_invariant=info.batch_invariant,
    )


def model_info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(name=msg.name, architecture=msg.architecture, vocab_size=msg.vocab_size,
                     max_context=msg.context_length, dtype=msg.dtype, device=msg.device, backend=msg.backend,
                     batch_invariant=msg.batch_invariant)


def actual_position(error: object) -> int | None:
    """The session's actual position from a FAILED_PRECONDITION mismatch (grpc.RpcError or
    grpc.aio.AioRpcError), or None when the error does not carry one."""
    return _trailing_int(error, ACTUAL_POSITION_KEY)


def latest_epoch(error: object) -> int | None:
    """The draft session's newest live proposal from a Propose mismatch, or None."""
    return _trailing_int(error, LATEST_EPOCH_KEY)


def live_epochs(error: object) -> list[int] | None:
    """The draft session's live proposals from a Propose mismatch, or None (an older server)."""
    trailing = getattr(error, "trailing_metadata", None)
    for item_key, value in (trailing() if callable(trailing) else None) or ():
        if item_key == LIVE_EPOCHS_KEY:
            try:
                return [int(v) for v in value.split(",") if v]
            except (TypeError, ValueError, AttributeError):
                return None
    return None


def _trailing_int(error: object, key: str) -> int | None:
    trailing = getattr(error, "trailing_metadata", None)
    for item_key, value in (trailing() if callable(trailing) else None) or ():
        if item_key == key:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None
