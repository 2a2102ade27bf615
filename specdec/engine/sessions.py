"""A session table shared by the target and draft engines: lookup, idle expiry, LRU order.

A session's committed tokens are the truth; its KV cache slot is only a cache of a prefix of them.
That is what makes eviction cheap: an evicted session keeps its tokens and re-feeds them into a new
slot on its next call, so memory pressure costs a re-prefill, never the session.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from specdec.errors import SessionExists, SessionNotFound
from specdec.sampling.params import SamplingParams


@dataclass
class SessionState:
    session_id: str
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # committed (target) or committed + drafted (draft)
    slot: int | None = None  # KV cache slot, None while evicted or for weightless proposers
    in_use: int = 0  # calls in flight; a session in use is never evicted
    last_used: float = 0.0
    between_turns: bool = False  # its caller said its turn ended (EndTurn): evictable at once

    @property
    def position(self) -> int:
        return len(self.tokens)


S = TypeVar("S", bound=SessionState)


class SessionTable(Generic[S]):
    def __init__(self, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._sessions: OrderedDict[str, S] = OrderedDict()  # least recently used first
        self._idle_ttl_s = idle_ttl_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._sessions.values()))

    def add(self, state: S) -> S:
        if state.session_id in self._sessions:
            raise SessionExists(state.session_id)
        state.last_used = self._clock()
        self._sessions[state.session_id] = state
        return state

    def get(self, session_id: str) -> S:
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(session_id)
        state.last_used = self._clock()
        state.between_turns = False  # a call: the session is in a turn again
        self._sessions.move_to_end(session_id)
        return state

    def peek(self, session_id: str) -> S | None:
        """The session or None, touching nothing: safe to call off the model thread (no LRU move)."""
        return self._sessions.get(session_id)

    def pop(self, session_id: str) -> S | None:
        return self._sessions.pop(session_id, None)

    def lru_evictable(self, idle_s: float = 0.0) -> Iterator[S]:
        """Sessions holding a slot, not in use, and unused for at least idle_s seconds or between
        turns, least recently used first."""
        used_before = self._clock() - idle_s
        for state in list(self._sessions.values()):
            if state.slot is not None and state.in_use == 0 and (state.between_turns or state.last_used <= used_before):
                yield state

    def in_turn(self, window_s: float) -> int:
        """Sessions in the middle of a turn: a call in flight, or one in the last window_s seconds
        and no EndTurn since. The load a replica carries (its other sessions only keep a cache). Safe
        to read off the model thread (a metrics scrape): the copy of the table is one C call."""
        used_after = self._clock() - window_s
        return sum(1 for s in list(self._sessions.values())
                   if s.in_use or (not s.between_turns and s.last_used >= used_after))

    def expired(self) -> list[S]:
        """Idle sessions past their TTL (the coordinator rebuilds them from Redis if it returns)."""
        deadline = self._clock() - self._idle_ttl_s
        return [s for s in self._sessions.values() if s.in_use == 0 and s.last_used < deadline]
