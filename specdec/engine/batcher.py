"""Continuous batching: concurrent requests join the next batched engine step.

A request enqueues its work item and awaits a future. One worker task takes everything queued (up to
max_batch_size items), runs the batched step (specdec.engine.batch / draft_batch) on the model
thread, resolves the futures and repeats, so a request that arrives while a step runs joins the
next one. Nothing waits for a batch to fill: a lone request starts at once as a batch of one, so
latency at low load stays that of an unbatched call. What is held back, briefly, is a step that
would leave out sessions just served and about to return (_gather: without it, concurrent sessions
split into alternating half-size batches); batch_wait_s > 0 optionally holds a non-full batch that
long to gather more (a trade of latency for throughput, off by default).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generic, Protocol, TypeVar

from specdec.errors import ServiceUnavailable

log = logging.getLogger(__name__)

W = TypeVar("W")
R = TypeVar("R")
Step = Callable[[list], list]  # works -> one result or exception per work, on the model thread
StepObserver = Callable[[list, list, float], None]  # (works, results, seconds) after each step


@dataclass
class StepTiming:
    """What a submitted work item cost where (nanoseconds): the step it ran in, on the model
    thread, and its wait before that step started. The ServerTiming its RPC reports."""

    model_ns: int = 0
    queued_ns: int = 0

    def add(self, other: "StepTiming") -> None:
        self.model_ns += other.model_ns
        self.queued_ns += other.queued_ns


class ModelThread(Protocol):
    """Where steps run: specdec.server's ModelExecutor (the engine layer never imports servers)."""

    async def run(self, fn: Callable[..., Any], /, *args: Any) -> Any: ...


class Batcher(Generic[W, R]):
    def __init__(
        self,
        executor: ModelThread,
        step: Step,
        *,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.0,
        gather: float = 0.25,
        on_step: StepObserver | None = None,
        key: Callable[[W], object] = lambda work: getattr(work, "session_id", None),
    ):
        if max_batch_size < 1 or not batch_wait_s >= 0 or not gather >= 0:
            raise ValueError(f"need max_batch_size >= 1, batch_wait_s >= 0 and gather >= 0, got "
                             f"{max_batch_size}, {batch_wait_s}, {gather}")
        self.executor = executor
        self.step = step
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.gather = gather  # see _gather
        self.on_step = on_step
        self.key = key  # the session a work item belongs to
        self._queue: deque[tuple[W, asyncio.Future, int]] = deque()  # (work, future, enqueued at, ns)
        self._recent: set = set()  # sessions of the last step, still open
        self._served_at: dict = {}  # session -> perf_counter() when its last result was delivered
        self._return_gap: dict = {}  # session -> running average of result-to-next-submit seconds
        self._last_end: float | None = None  # perf_counter() when the last step ended
        self._last_seconds = 0.0
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        """Work items waiting for a step (the load a new request would queue behind)."""
        return len(self._queue)

    async def submit(self, work: W) -> R:
        """Run `work` in the next step; its result, or its own exception raised here."""
        return (await self.submit_timed(work))[0]

    async def submit_timed(self, work: W) -> tuple[R, StepTiming]:
        """As submit, with what the work cost: its step's time on the model thread, its wait."""
        return await self.enqueue(work)

    def enqueue(self, work: W) -> "asyncio.Future[tuple[R, StepTiming]]":
        """Queue `work` for the next step now, without a hop through the event loop: the future of
        submit_timed's answer. Cancelling it before its step starts drops the work."""
        if self._closed:
            raise ServiceUnavailable("the service is shutting down")
        future = asyncio.get_running_loop().create_future()
        self._note_return(self.key(work))
        self._queue.append((work, future, time.perf_counter_ns()))
        self._start_worker()
        self._wakeup.set()
        return future

    def forget(self, key: object) -> None:
        """The session ended: no step waits for its next work."""
        self._recent.discard(key)
        self._served_at.pop(key, None)
        self._return_gap.pop(key, None)

    def _note_return(self, key: object) -> None:
        served = self._served_at.pop(key, None)
        if served is not None:
            gap = time.perf_counter() - served
            old = self._return_gap.get(key)
            self._return_gap[key] = gap if old is None else 0.7 * old + 0.3 * gap

    async def aclose(self) -> None:
        """Stop the worker; queued work fails with ServiceUnavailable (a running step finishes on
        the model thread, its callers are told the same)."""
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        while self._queue:
            _, future, _ = self._queue.popleft()
            if not future.done():
                future.set_exception(ServiceUnavailable("the service is shutting down"))

    def _start_worker(self) -> None:
        if self._worker is None:
            self._wakeup = asyncio.Event()
            # A fresh context: steps must not run inside the first caller's trace span.
            self._worker = asyncio.get_running_loop().create_task(self._work(), context=contextvars.Context())

    async def _work(self) -> None:
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._gather()
            if self.batch_wait_s > 0:
                await self._wait_until(lambda: len(self._queue) >= self.max_batch_size,
                                       time.perf_counter() + self.batch_wait_s)
            batch = self._take()
            if batch:
                await self._run(batch)

    async def _gather(self) -> None:
        """Hold a non-full batch until the sessions of the last step are queued again, for at most
        `gather` times the last step's duration.

        A plain decoding session sends its next work one round trip after its result. Started
        without them, a step keeps them out, they form the next step, and the sessions settle into
        alternating half-size steps: twice the forwards for the same tokens. Nothing is held for a
        lone session (its own return is what the worker waits for anyway), for an ended one, for
        one that usually comes back later than the window (a speculative session verifies on the
        target between two Proposes and drafts between two Verifies: waiting for it idles the
        model), nor once the time is up."""
        if not self.gather or self._last_end is None:
            return
        window = self.gather * self._last_seconds
        expected = {key for key in self._recent if self._return_gap.get(key, 0.0) <= window}

        def ready() -> bool:
            queued = {self.key(work) for work, _, _ in self._queue}
            return len(self._queue) >= self.max_batch_size or expected <= queued

        await self._wait_until(ready, self._last_end + window)

    async def _wait_until(self, ready: Callable[[], bool], deadline: float) -> None:
        while not ready():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.clear()  # no await since ready(): no submit can slip in between
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[tuple[W, asyncio.Future, int]]:
        """Up to max_batch_size queued items, oldest first; callers that gave up are skipped."""
        batch = []
        while self._queue and len(batch) < self.max_batch_size:
            item = self._queue.popleft()
            if not item[1].done():  # cancelled while queued: the work never starts
                batch.append(item)
        return batch

    def _timed_step(self, works: list) -> tuple[list, int, int]:
        """The step, on the model thread, timed there: its start and end (perf_counter_ns)."""
        started = time.perf_counter_ns()
        results = self.step(works)
        return results, started, time.perf_counter_ns()

    async def _run(self, batch: list[tuple[W, asyncio.Future, int]]) -> None:
        works = [work for work, _, _ in batch]
        started = time.perf_counter()
        step_start = step_end = time.perf_counter_ns()
        try:
            results, step_start, step_end = await self.executor.run(self._timed_step, works)
            if len(results) != len(works):
                raise RuntimeError(f"a batched step returned {len(results)} results for {len(works)} works")
        except asyncio.CancelledError:
            for _, future, _ in batch:
                if not future.done():
                    future.set_exception(ServiceUnavailable("the service is shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - the step itself failed: every item of it did
            log.exception("batched step of %d items failed", len(works))
            results = [exc] * len(works)
        self._last_end = time.perf_counter()
        # The step's own duration, not its wait for the model thread behind other work there (a
        # prefill runs outside the batcher): as a metric it is "one batched forward pass", and as
        # the gather window's unit a step that queued behind prefills stretched the next window.
        elapsed = self._last_seconds = (step_end - step_start) * 1e-9 if step_end > step_start \
            else self._last_end - started
        self._recent = {self.key(work) for work in works}
        for key in self._recent:
            self._served_at[key] = self._last_end
        for (_, future, enqueued), result in zip(batch, results):
            if future.done():  # the caller gave up while the step ran
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result((result, StepTiming(step_end - step_start, max(0, step_start - enqueued))))
        if self.on_step is not None:
            # After the callers: their handlers were scheduled when their futures resolved and run
            # first, so metrics never sit between a step's end and its responses.
            asyncio.get_running_loop().call_soon(self._observe, works, results, elapsed)

    def _observe(self, works: list, results: list, elapsed: float) -> None:
        try:
            self.on_step(works, results, elapsed)
        except Exception:  # noqa: BLE001 - metrics must never stop the worker
            log.exception("batch step observer failed")
