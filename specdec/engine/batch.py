"""Continuous batching on the target: Verify and Decode work of many sessions in one forward pass.

run_target_batch(engine, works) does what engine.verify / engine.decode do one session at a time,
for a whole batch: every row (a session's committed tokens its cache lacks, plus its drafted tokens
for a verify) goes through ONE model.forward, every verify row through one verify_batch. Results
are those of the sequential calls, token for token and outcome for outcome, because each row keeps
its own position, parameters and counter-based random numbers (verify_batch == verify_block).

Each work item is validated on its own: a bad one yields its own exception and never fails the
others. Every session of a round is marked in use before any slot is claimed, so making room for
one row never evicts another row of the same forward; a row that finds no slot while the others
hold theirs waits for the next round of the same batch. A session named twice runs its items in
order, in successive sub-batches. Like the engine itself, this runs on the one model thread.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from specdec.engine.sessions import SessionState
from specdec.engine.target import TargetEngine
from specdec.errors import CacheFull, InvalidArgument
from specdec.sampling.batched import verify_batch
from specdec.sampling.verify import check_block, sample_next
from specdec.types import DraftBlock, VerifyOutcome


@dataclass(frozen=True)
class VerifyWork:
    """engine.verify(session_id, position, draft) as an item of a batch."""

    session_id: str
    position: int
    draft: DraftBlock
    # The draft came over the network (a Verify call): its session is away for a round trip per cycle,
    # which the trimmer prices (cycle_wall.py). False for drafts made inside the target.
    drafted_elsewhere: bool = False


@dataclass(frozen=True)
class DecodeWork:
    """One plain decoding step: commit append_token_ids, then sample num_tokens (0 or 1) tokens.

    A multi-token Decode is a sequence of such steps, each joining whatever batch runs next;
    `room` (default num_tokens) is how many tokens beyond the appended ones must still fit in the
    context, so that its first step refuses the whole budget up front, as engine.decode does.
    """

    session_id: str
    position: int
    append_token_ids: tuple[int, ...] = ()
    num_tokens: int = 1
    room: int | None = None


Work = Union[VerifyWork, DecodeWork]
Result = Union[VerifyOutcome, list, Exception]  # VerifyOutcome | sampled token ids | the item's error


@dataclass
class _Row:
    index: int  # the work item's index in the batch
    work: Work
    state: SessionState
    logits: torch.Tensor | None = None  # [num_logits, vocab] once the forward has run


def split_by_session(session_ids: Sequence[str]) -> list[list[int]]:
    """Indices grouped into sub-batches in which no session appears twice; a session's n-th item
    goes into the n-th sub-batch, so its items run in order and as few forwards as possible run."""
    groups: list[list[int]] = []
    seen: dict[str, int] = defaultdict(int)
    for index, session_id in enumerate(session_ids):
        round_ = seen[session_id]
        seen[session_id] += 1
        if round_ == len(groups):
            groups.append([])
        groups[round_].append(index)
    return groups


def run_target_batch(engine: TargetEngine, works: Sequence[Work]) -> list[Result]:
    """Run every work item; item i's result (or exception) is at index i."""
    results: list[Result | None] = [None] * len(works)
    for group in split_by_session([w.session_id for w in works]):
        rows: list[_Row] = []
        for index in group:
            try:
                row = _validate(engine, index, works[index])
            except Exception as exc:  # noqa: BLE001 - the item's own error, returned to its caller
                results[index] = exc
                continue
            if row is not None:
                rows.append(row)
            else:
                results[index] = []  # a decode of 0 tokens: the appended tokens are committed
        while rows:
            rows = _run_round(engine, rows, results)
    return results  # type: ignore[return-value]


def _validate(engine: TargetEngine, index: int, work: Work) -> _Row | None:
    """The checks engine.verify / engine.decode make before touching anything; None when the item
    needs no forward (a decode that only appends)."""
    state = engine._at(work.session_id, work.position)
    if isinstance(work, VerifyWork):
        k = work.draft.num_tokens
        engine._check_room(state, k + 1)
        engine._check_ids(work.draft.token_ids.tolist())
        # check_block reads only the shape of the logits: an expanded view costs no memory.
        check_block(torch.empty(1, engine.info.vocab_size).expand(k + 1, -1), work.draft)
        return _Row(index, work, state)
    if work.num_tokens not in (0, 1):
        raise InvalidArgument(f"a decode step samples 0 or 1 tokens, got {work.num_tokens}")
    room = work.num_tokens if work.room is None else work.room
    if room < work.num_tokens:
        raise InvalidArgument(f"room must be >= num_tokens, got {room} < {work.num_tokens}")
    appended = engine._check_tokens(work.append_token_ids, room=0, allow_empty=True)
    engine._check_room(state, len(appended) + room)
    state.tokens.extend(appended)  # committed before the step, as engine.decode does
    return _Row(index, work, state) if work.num_tokens else None


def _run_round(engine: TargetEngine, rows: list[_Row], results: list) -> list[_Row]:
    """One forward over the rows that get a KV slot; returns the rows left for the next round."""
    for row in rows:
        row.state.in_use += 1  # before any slot is claimed: no row of this batch is evicted
    try:
        ready, waiting = _claim_slots(engine, rows, results)
        if ready:
            _forward(engine, ready, results)
            _verify(engine, [r for r in ready if isinstance(r.work, VerifyWork) and r.logits is not None], results)
            _sample(ready, results)
        return waiting
    finally:
        for row in rows:
            row.state.in_use -= 1


def _claim_slots(engine: TargetEngine, rows: list[_Row], results: list) -> tuple[list[_Row], list[_Row]]:
    ready, full = [], []
    for row in rows:
        try:
            engine._ensure_slot(row.state)
            ready.append(row)
        except CacheFull as exc:
            full.append((row, exc))
    if ready:  # the ready rows free their slots for eviction once this round is done
        return ready, [row for row, _ in full]
    for row, exc in full:  # every slot is held by sessions in use outside this batch
        results[row.index] = exc
    return [], []


def _forward(engine: TargetEngine, rows: list[_Row], results: list) -> None:
    """ONE model.forward over all rows: verify rows ask for k + 1 logits, decode rows for 1."""
    slots, feeds, num_logits = [], [], []
    for row in rows:
        drafted = row.work.draft.token_ids.tolist() if isinstance(row.work, VerifyWork) else []
        n = len(drafted) + 1
        slot, feed = engine._feed(row.state, drafted, num_logits=n)
        slots.append(slot)
        feeds.append(feed)
        num_logits.append(n)
    try:
        logits = engine.model.forward(slots, feeds, num_logits)  # len(rows) x [num_logits[i], vocab]
    except Exception as exc:  # noqa: BLE001 - the forward failed for every row of it
        for row in rows:
            results[row.index] = exc
        return
    for row, row_logits in zip(rows, logits):
        row.logits = row_logits


def _verify(engine: TargetEngine, rows: list[_Row], results: list) -> None:
    """Verify every verify row at once, then commit each exactly as engine.verify does."""
    if not rows:
        return
    try:
        outcomes = verify_batch(
            [r.logits for r in rows], [r.work.draft for r in rows],
            [r.state.params for r in rows], [r.work.position for r in rows],
        )
    except Exception as exc:  # noqa: BLE001 - validated above, so this is a bug: fail these rows only
        for row in rows:
            results[row.index] = exc
        return
    for row, outcome in zip(rows, outcomes):
        outcome = engine.inject_fault(outcome)  # test-only canary fault; the identity otherwise
        accepted = row.work.draft.token_ids[: outcome.num_accepted].tolist()
        row.state.tokens.extend(accepted + [outcome.next_token])
        # The cache now holds every drafted token; keep only the accepted ones. O(1).
        engine.model.truncate(row.state.slot, row.work.position + outcome.num_accepted)
        results[row.index] = outcome


def _sample(rows: list[_Row], results: list) -> None:
    """Plain decoding for the decode rows: the same sample_next, at the same position."""
    for row in rows:
        if isinstance(row.work, VerifyWork) or row.logits is None:
            continue
        try:
            token = sample_next(row.logits[-1], row.state.params, row.state.position)
        except Exception as exc:  # noqa: BLE001
            results[row.index] = exc
            continue
        row.state.tokens.append(token)
        results[row.index] = [token]
