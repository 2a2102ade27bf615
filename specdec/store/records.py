"""What a session's Redis hash holds, as typed values, and the one place that (de)serialises it.

Hash fields (schema 1): prompt_length, sampling (JSON), pool, draft_replica, target_replica,
num_draft_tokens, turns, status, extra (JSON), one integer field per statistic (`stats:<name>`,
`stats:accepted_at:<i>`) so a cycle adds to them with HINCRBY instead of rewriting them, and the
store-maintained schema, version, created_at and updated_at (milliseconds, Redis server clock),
and written_by (`<writer>@<version it expected>` of the last marked write, lua/common.lua; not read
back into the record). Adding it kept schema 1: older records simply lack it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from specdec.sampling.params import SamplingMode, SamplingParams

SCHEMA = 1  # bump when the layout changes; scripts refuse state written under another schema

STATS_PREFIX = "stats:"
ACCEPTED_AT_PREFIX = "stats:accepted_at:"


class SessionStatus(str, enum.Enum):
    """ACTIVE: a turn is being generated; FINISHED / CANCELLED: the last turn ended that way and the
    session can take another; ENDED: EndSession was called, no more writes are accepted."""

    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    ENDED = "ended"


@dataclass(frozen=True)
class SessionStats:
    """Speculation counters of a session, in the vocabulary of specdec.types (accepted, recovered,
    bonus). accepted_by_position[i] counts the cycles whose i-th drafted token was accepted."""

    drafted: int = 0
    accepted: int = 0
    cycles: int = 0
    recovered: int = 0
    bonus: int = 0
    fallbacks: int = 0
    accepted_by_position: tuple[int, ...] = ()

    @staticmethod
    def for_cycle(num_drafted: int, num_accepted: int) -> "SessionStats":
        """The delta one verified block adds: a recovered token after a rejection, else a bonus one."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted}/{num_drafted}")
        all_accepted = num_accepted == num_drafted
        return SessionStats(
            drafted=num_drafted,
            accepted=num_accepted,
            cycles=1,
            recovered=0 if all_accepted else 1,
            bonus=1 if all_accepted else 0,
            accepted_by_position=(1,) * num_accepted,
        )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def __add__(self, other: "SessionStats") -> "SessionStats":
        width = max(len(self.accepted_by_position), len(other.accepted_by_position))
        mine = self.accepted_by_position + (0,) * (width - len(self.accepted_by_position))
        theirs = other.accepted_by_position + (0,) * (width - len(other.accepted_by_position))
        counters = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in _COUNTERS}
        return SessionStats(**counters, accepted_by_position=tuple(a + b for a, b in zip(mine, theirs)))

    def to_fields(self, *, skip_zero: bool) -> dict[str, int]:
        """Hash fields; skip_zero for a delta (nothing to HINCRBY), not for the initial values."""
        out = {STATS_PREFIX + f.name: getattr(self, f.name) for f in _COUNTERS}
        out.update({f"{ACCEPTED_AT_PREFIX}{i}": n for i, n in enumerate(self.accepted_by_position)})
        return {k: v for k, v in out.items() if v or not skip_zero}

    @staticmethod
    def from_fields(hash_fields: Mapping[str, str]) -> "SessionStats":
        counters = {f.name: int(hash_fields.get(STATS_PREFIX + f.name, 0)) for f in _COUNTERS}
        by_position = {
            int(k[len(ACCEPTED_AT_PREFIX):]): int(v)
            for k, v in hash_fields.items()
            if k.startswith(ACCEPTED_AT_PREFIX)
        }
        width = max(by_position, default=-1) + 1
        by_position_list = tuple(by_position.get(i, 0) for i in range(width))
        return SessionStats(**counters, accepted_by_position=by_position_list)


_COUNTERS = tuple(f for f in fields(SessionStats) if f.name != "accepted_by_position")


@dataclass(frozen=True)
class SessionRecord:
    """The hash of one session. The committed tokens are loaded on demand (SessionStore.tokens);
    `length` is how many there are. version, length, created_at and updated_at are maintained by
    the store and ignored when creating."""

    prompt_length: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    pool: str = "speculative"
    draft_replica: str = ""
    target_replica: str = ""
    num_draft_tokens: int = 0
    turns: int = 1
    status: SessionStatus = SessionStatus.ACTIVE
    stats: SessionStats = field(default_factory=SessionStats)
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = 0
    length: int = 0
    created_at: float = 0.0  # seconds since the epoch, Redis server clock
    updated_at: float = 0.0


# Fields a caller may set through create / append(fields=...) / update; the rest are the store's.
WRITABLE_FIELDS = frozenset(
    {"prompt_length", "sampling", "pool", "draft_replica", "target_replica", "num_draft_tokens",
     "turns", "status", "extra"}
)
_INT_FIELDS = ("prompt_length", "num_draft_tokens", "turns")
_STR_FIELDS = ("pool", "draft_replica", "target_replica")


def encode_fields(values: Mapping[str, Any]) -> dict[str, str | int]:
    """Writable record fields -> hash fields. Unknown names are a programming error."""
    unknown = set(values) - WRITABLE_FIELDS
    if unknown:
        raise ValueError(f"cannot write {sorted(unknown)}; writable fields: {sorted(WRITABLE_FIELDS)}")
    out: dict[str, str | int] = {}
    for name, value in values.items():
        if name == "sampling":
            out[name] = _encode_sampling(value)
        elif name == "extra":
            out[name] = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif name == "status":
            out[name] = SessionStatus(value).value
        elif name in _INT_FIELDS:
            out[name] = int(value)
        else:
            out[name] = str(value)
    return out


def encode_record(record: SessionRecord) -> dict[str, str | int]:
    out = encode_fields({name: getattr(record, name) for name in WRITABLE_FIELDS})
    out.update(record.stats.to_fields(skip_zero=False))
    return out


def decode_record(hash_fields: Mapping[str, str], length: int) -> SessionRecord:
    return SessionRecord(
        **{name: int(hash_fields.get(name, 0)) for name in _INT_FIELDS},
        **{name: hash_fields.get(name, "") for name in _STR_FIELDS},
        sampling=_decode_sampling(hash_fields.get("sampling", "{}")),
        status=SessionStatus(hash_fields.get("status", SessionStatus.ACTIVE.value)),
        stats=SessionStats.from_fields(hash_fields),
        extra=json.loads(hash_fields.get("extra", "{}")),
        version=int(hash_fields.get("version", 0)),
        length=length,
        created_at=int(hash_fields.get("created_at", 0)) / 1000,
        updated_at=int(hash_fields.get("updated_at", 0)) / 1000,
    )


def _encode_sampling(params: SamplingParams) -> str:
    return json.dumps(
        {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
         "seed": params.seed, "mode": params.mode.value},
        sort_keys=True,
    )


def _decode_sampling(text: str) -> SamplingParams:
    data = json.loads(text)
    if "mode" in data:
        data["mode"] = SamplingMode(data["mode"])
    return SamplingParams(**data)
