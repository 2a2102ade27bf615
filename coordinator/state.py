"""What the coordinator keeps in a session's Redis record beyond the store's own fields.

The store's hash has the fields every component understands (prompt length, sampling, pool,
replicas, status, counters); the coordinator's bookkeeping of the latest turn lives in its JSON
`extra` field as a TurnRecord. It is rewritten only when a turn starts or ends, never per cycle.

Who generates. `owner` names the stream generating the latest turn (a random token per stream),
empty when none does. A live owner writes at least every lease / 3 seconds (appends or heartbeats),
so a session whose record says ACTIVE with an owner but has not changed for a lease was left by a
coordinator that died: its turn is INTERRUPTED, and any coordinator may take it over.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specdec.store import SessionRecord, SessionStatus


class Phase(enum.Enum):
    GENERATING = "generating"  # a live stream is generating the latest turn
    IDLE = "idle"  # between turns
    INTERRUPTED = "interrupted"  # the latest turn stopped unfinished: resume it or start the next


@dataclass(frozen=True)
class TurnRecord:
    """The latest turn of a session, as the record's `extra` holds it."""

    turn_start: int  # position of the turn's first generated token (= the prompt tokens before it)
    max_new_tokens: int  # the turn's budget
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    owner: str = ""  # the stream generating it; "" when none does
    finish_reason: str = ""  # FinishReason value once finished; "" while generating or interrupted
    # The chat so far, through the latest input message; None for a session started raw.
    messages: list[dict] | None = None
    speculate: bool = True  # the session uses a draft (its SpeculationOptions.enabled)
    num_draft_tokens: int = 0  # the session's fixed draft length; 0: the server default
    pipelined: bool | None = None  # the session's SpeculationOptions.pipelined; None: the server default
    # The draft replica's committed length after a cleanly ended turn (it holds exactly the first
    # draft_position committed tokens); None when unknown, and the draft session is reopened.
    draft_position: int | None = None
    proposer: str = ""
    turn_stats: dict[str, Any] = field(default_factory=dict)  # the finished turn's SpeculationStats

    def to_extra(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop_sequences"] = list(self.stop_sequences)
        return out

    @staticmethod
    def from_extra(extra: dict[str, Any]) -> "TurnRecord":
        known = {k: v for k, v in extra.items() if k in TurnRecord.__dataclass_fields__}
        known["stop_sequences"] = tuple(known.get("stop_sequences", ()))
        return TurnRecord(**known)

    def with_owner(self, owner: str) -> "TurnRecord":
        return replace(self, owner=owner)


def turn_of(record: SessionRecord) -> TurnRecord:
    return TurnRecord.from_extra(record.extra) if record.extra else TurnRecord(record.length, 1)


def owner_is_live(record: SessionRecord, lease_s: float, now: float | None = None) -> bool:
    """Whether a stream is generating the session's turn right now, as far as Redis can tell."""
    turn = turn_of(record)
    if record.status is not SessionStatus.ACTIVE or not turn.owner:
        return False
    now = time.time() if now is None else now
    # updated_at is Redis' clock, `now` ours: a lease of seconds tolerates ordinary skew.
    return now - record.updated_at < lease_s


def phase(record: SessionRecord, lease_s: float, now: float | None = None) -> Phase:
    if record.status is not SessionStatus.ACTIVE:
        return Phase.IDLE
    return Phase.GENERATING if owner_is_live(record, lease_s, now) else Phase.INTERRUPTED
