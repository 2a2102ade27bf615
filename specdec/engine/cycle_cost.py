"""Where one cycle's time goes: inside the models, or outside them (the per-cycle overhead).

The loop measures each cycle's wall time; the services say how long each call ran in their model
(ServerTiming on the wire; the in-process engines are all model). The rest is what the distributed
system costs on top of the engines: RPC, batching windows, protobuf conversion, the coordinator's
own work, Redis hand-offs. Issue 6 asks for it per cycle and under 5% of a cycle.

The clients report into the cycle being measured through a context variable rather than through
the TargetAPI / DraftAPI return types: a coordinator shares one client between many sessions, and
each session's loop runs in its own asyncio task (its own context), so each cycle sees only its own
calls, and a task the loop spawns (a pipelined draft) reports into the cycle that spawned it.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

from specdec.types import VerifyOutcome

DRAFT = "draft"
TARGET = "target"


@dataclass
class CycleCost:
    """One cycle (or, summed, many): wall time, time in each model, time queued in the services."""

    wall_s: float = 0.0
    draft_model_s: float = 0.0  # every draft call's, a pipelined one's beside the verify included
    target_model_s: float = 0.0
    # Of draft_model_s: a pipelined cycle's speculative Propose, which ran beside the verify, not
    # before it (specdec.generation.pipeline); only what outlasts the target's time lengthens the cycle.
    overlapped_draft_model_s: float = 0.0
    # Where the overhead went, as far as the services tell (0 when they don't):
    queued_s: float = 0.0  # waiting in the services' batchers before a step
    handler_s: float = 0.0  # the services' handlers, request in to response built (model included)
    calls_s: float = 0.0  # the calls' round trips as the caller measured them (handlers included)
    # A plain step's: drafted tokens the target would have verified for this session in that step
    # (its goodput trimming; None: not said). Not a cost, but it travels the same way.
    target_draft_limit: int | None = None
    # A streamed step that verified a draft the target made itself: its outcome
    # (specdec.engine.inner_draft), so the loop counts the step as a speculative cycle.
    inner_draft: VerifyOutcome | None = None

    @property
    def hidden_draft_model_s(self) -> float:
        """Draft model time spent while the target's model ran: not on the cycle's critical path."""
        return min(self.overlapped_draft_model_s, self.target_model_s)

    @property
    def model_s(self) -> float:
        """Model time on the cycle's critical path: the draft's before the verify, then the longer
        of the verify and the draft beside it (the sum of both in a sequential cycle)."""
        return self.draft_model_s + self.target_model_s - self.hidden_draft_model_s

    @property
    def overhead_s(self) -> float:
        """Wall time outside the model forwards (never negative: clocks of two processes)."""
        return max(0.0, self.wall_s - self.model_s)

    @property
    def overhead_fraction(self) -> float:
        return self.overhead_s / self.wall_s if self.wall_s > 0 else 0.0

    def add_model_time(self, role: str, model_s: float, queued_s: float = 0.0, handler_s: float = 0.0,
                       call_s: float = 0.0, overlapped: bool = False) -> None:
        if role == DRAFT:
            self.draft_model_s += model_s
            if overlapped:
                self.overlapped_draft_model_s += model_s
        elif role == TARGET:
            self.target_model_s += model_s
        else:
            raise ValueError(f"role must be {DRAFT!r} or {TARGET!r}, got {role!r}")
        self.queued_s += queued_s
        self.handler_s += handler_s
        self.calls_s += call_s


_current: ContextVar[CycleCost | None] = ContextVar("specdec_cycle_cost", default=None)
_beside_verify: ContextVar[bool] = ContextVar("specdec_beside_verify", default=False)


def report_model_time(role: str, model_s: float, queued_s: float = 0.0, handler_s: float = 0.0,
                      call_s: float = 0.0) -> None:
    """A service call of the cycle being measured spent model_s in its model (no-op outside one);
    see CycleCost for the rest."""
    cost = _current.get()
    if cost is not None:
        cost.add_model_time(role, model_s, queued_s, handler_s, call_s, _beside_verify.get())


@contextlib.contextmanager
def beside_verify() -> Iterator[None]:
    """The enclosed calls run concurrently with the cycle's verify (a pipelined speculative Propose):
    their draft model time is overlapped. Set inside the concurrent task, so it marks only that
    task's calls (a task runs in a copy of its creator's context)."""
    token = _beside_verify.set(True)
    try:
        yield
    finally:
        _beside_verify.reset(token)


@contextlib.contextmanager
def unmeasured() -> Iterator[None]:
    """The enclosed calls belong to no cycle: a background task's (specdec.generation.draft_feed),
    whose context, copied from the cycle that spawned it, would otherwise report into that cycle."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def report_draft_limit(num_tokens: int | None) -> None:
    """The target said how many drafted tokens it would have verified in the cycle's plain step."""
    cost = _current.get()
    if cost is not None:
        cost.target_draft_limit = num_tokens


def report_inner_draft(outcome: VerifyOutcome) -> None:
    """The cycle's streamed step verified a draft the target made itself."""
    cost = _current.get()
    if cost is not None:
        cost.inner_draft = outcome


@contextlib.contextmanager
def measure_cycle(on_end: Callable[[CycleCost], None] | None = None) -> Iterator[CycleCost]:
    """Measure the enclosed cycle: its wall time on exit, model time as the calls report it;
    on_end(cost) once it ends without an exception."""
    cost = CycleCost()
    token = _current.set(cost)
    started = time.perf_counter()
    try:
        yield cost
    finally:
        cost.wall_s = time.perf_counter() - started
        _current.reset(token)
    if on_end is not None:
        on_end(cost)


@contextlib.contextmanager
def model_time(role: str) -> Iterator[None]:
    """Count the enclosed in-process engine call as model time (LocalTarget / LocalDraft)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - started
        report_model_time(role, elapsed, 0.0, elapsed, elapsed)
