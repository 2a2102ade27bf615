"""The canary controller: the speculative pool's share of new sessions, stepped up while speculation
is better than plain decoding and rolled back to 0 when it is worse or wrong (docs/CANARY.md).

Every coordinator replica runs one. Each routes new sessions by the share in Redis (a session keeps
its pool: it is in the session's record), records every finished request of either pool as a
sample in Redis, and replays a sample of speculative turns on the baseline pool (canary_equality.py).
One replica at a time, the holder of the decider lease, evaluates the windows every interval and
applies the verdict of canary_policy.decide; operators' promote / abort / pause / resume go through
any replica. State changes are versioned and logged atomically (specdec.store.canary), so a restart
or another replica continues from exactly what Redis says.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from typing import Callable

from specdec.generation.stopping import FinishReason
from specdec.store.canary import CanaryStore, CanaryWriteRefused

from coordinator.canary_equality import EqualityChecker, Replay
from coordinator.canary_policy import Action, CanaryPhase, EqualityResult, EqualityTally, Verdict, decide
from coordinator.canary_settings import CanarySettings
from coordinator.canary_state import POOLS, CanaryMetrics, CanaryState, CanaryStatus
from coordinator.canary_stats import SERVER_ERRORS, Sample, Window
from coordinator.requests import Pool
from coordinator.routing import TARGET, Router

log = logging.getLogger(__name__)


class CanaryController:
    def __init__(self, store: CanaryStore, settings: CanarySettings, checker: EqualityChecker,
                 metrics: CanaryMetrics, router: Router, *, replica_id: str | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None):
        self.store, self.settings, self.checker, self.metrics, self.router = store, settings, checker, metrics, router
        self.policy = settings.policy
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.clock = clock
        self.rng = rng or random.Random()
        self.last_verdict: Verdict | None = None
        self.is_leader = False  # held the decider lease at the last tick
        self._checks = asyncio.Semaphore(settings.max_concurrent_checks)
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        self._closing = False

    # ---- routing and observation (every replica) ---------------------------------------------

    async def state(self) -> CanaryState | None:
        return CanaryState.parse(await self.store.state())

    async def choose_pool(self) -> Pool:
        """The pool of a new session: speculative with probability weight / 100 (0 before the
        canary has started)."""
        state = await self.state()
        weight = state.weight if state is not None else 0.0
        return Pool.SPECULATIVE if self.rng.random() * 100.0 < weight else Pool.BASELINE

    def observe(self, clock, pool: str) -> None:
        """A Generate stream ended (telemetry's request observer): record it, maybe replay it."""
        if clock.outcome != "OK" and clock.outcome not in SERVER_ERRORS:
            return  # the client's doing (bad input, cancelled): says nothing about the pool
        final = clock.final
        if pool == Pool.SPECULATIVE.value and final is not None and not final.num_draft_tokens:
            return  # the request turned speculation off: plain decoding in the speculative pool
        sample = Sample(self.clock(), clock.outcome == "OK", clock.ttft, clock.tpot,
                        final.stats.drafted if final else 0, final.stats.accepted if final else 0)
        replay = None
        if (pool == Pool.SPECULATIVE.value and sample.ok and final is not None and final.completion_tokens
                and final.finish_reason is not FinishReason.CANCELLED
                and self.rng.random() < self.settings.equality_sample):
            replay = Replay(clock.session_id, final.prompt_tokens, clock.position, sample.time)
        self._spawn(self._record(pool, sample, replay))

    async def _record(self, pool: str, sample: Sample, replay: Replay | None) -> None:
        await self.store.add_sample(pool, sample.to_dict())
        if replay is None or self._checks.locked():
            return  # replays are a sample: skip one rather than queue behind others
        async with self._checks:
            check = await self.checker.check(replay)
        if check is not None:
            self.metrics.equality_checks.labels(check["result"]).inc()
            await self.store.add_check(check)
            if check["result"] == EqualityResult.FAILED.value:
                log.error("canary equality check failed: %s", check.get("detail", check))

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("canary: recording a request failed: %r", task.exception())

    # ---- deciding (the lease holder) ---------------------------------------------------------

    def start(self) -> asyncio.Task:
        self._loop = asyncio.ensure_future(self.run())
        return self._loop

    async def run(self) -> None:
        while not self._closing:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away for a moment: try again next interval
                log.warning("canary: evaluation failed: %r", exc)
            await asyncio.sleep(self.settings.interval_s)

    async def tick(self) -> Verdict | None:
        """Renew the lease; if held, evaluate the windows and apply the verdict. -> the verdict"""
        self.is_leader = leader = await self.store.acquire(self.replica_id, self.settings.lease_s)
        self.metrics.leader.set(int(leader))
        state = await self.state()
        if state is None and leader:
            state = await self._start()
        if state is not None:
            self.metrics.show(state.weight)
        if not leader or state is None or state.paused:
            return None
        now = self.clock()
        windows, tally = await self._windows(state.since, now)
        verdict = decide(self.policy, state.phase, state.weight, now - state.since,
                         windows[Pool.SPECULATIVE], windows[Pool.BASELINE], tally)
        if verdict.action is Action.STEP_UP and (unhealthy := await self._unhealthy_pool()):
            verdict = Verdict(None, "health", f"better, but the {unhealthy} pool has no live target")
        self.last_verdict = verdict
        if verdict.action is not None:
            evidence = {p.value: w.summary() for p, w in windows.items()} | {"equality": tally.counts}
            try:
                await self._transition(state, verdict.action, verdict.cause, verdict.reason, evidence=evidence)
            except CanaryWriteRefused as exc:  # an operator acted meanwhile, or the lease lapsed
                log.info("canary: %s not applied: %s", verdict.action.value, exc)
                return Verdict(None, "race", str(exc))
        return verdict

    async def _start(self) -> CanaryState | None:
        first = self.policy.steps[0]
        fields = {"phase": CanaryPhase.PROGRESSING.value, "weight": first, "paused": 0, "cause": "start",
                  "reason": f"canary started at {first:g}%", "since": self.clock()}
        try:
            await self.store.write_state(fields, expected_version=None,
                                         decision=self._decision(Action.START, "start", fields["reason"], 0.0, first))
            self.metrics.decisions.labels(Action.START.value, "start").inc()
        except CanaryWriteRefused:
            pass  # another replica started it
        return await self.state()

    async def _unhealthy_pool(self) -> str | None:
        """Probe every target of both pools (GetInfo); the first pool left without a live one."""
        for pool in POOLS:
            live = 0
            for candidate in await self.router.candidates(TARGET, pool):
                try:
                    await self.router.target(candidate.endpoint).describe()
                    live += 1
                except Exception:  # noqa: BLE001 - down: routing avoids it for a while
                    self.router.failed(candidate.endpoint)
            if not live:
                return pool.value
        return None

    async def _windows(self, since: float, now: float) -> tuple[dict[Pool, Window], EqualityTally]:
        start = max(since, now - self.policy.window_s)
        windows = {}
        for pool in POOLS:
            samples = [Sample.from_dict(s) for s in await self.store.samples(pool.value)]
            windows[pool] = Window.of(s for s in samples if s.time >= start)
        checks = [c for c in await self.store.checks() if float(c.get("t", 0)) >= start]
        counts: dict[str, int] = {}
        for check in checks:
            counts[check["result"]] = counts.get(check["result"], 0) + 1
        failure = next((c.get("detail", "") for c in checks if c["result"] == EqualityResult.FAILED.value), "")
        return windows, EqualityTally(counts, failure)

    # ---- state changes -----------------------------------------------------------------------

    async def _transition(self, state: CanaryState, action: Action, cause: str, reason: str, *,
                          manual: bool = False, full: bool = False, evidence: dict | None = None) -> bool:
        fields = self._fields(state, action, full)
        if fields is None:
            return False
        fields |= {"cause": cause, "reason": reason}
        weight = float(fields.get("weight", state.weight))
        decision = self._decision(action, cause, reason, state.weight, weight, manual, evidence)
        await self.store.write_state(fields, expected_version=state.version, decision=decision,
                                     holder="" if manual else self.replica_id)
        self.metrics.decisions.labels(action.value, cause).inc()
        self.metrics.show(weight)
        log.info("canary: %s %g%% -> %g%%: %s", action.value, state.weight, weight, reason)
        return True

    def _fields(self, state: CanaryState, action: Action, full: bool) -> dict | None:
        """The state fields an action sets; None when it changes nothing."""
        now, steps = self.clock(), self.policy.steps
        if action in (Action.STEP_UP, Action.PROMOTE):
            weight = steps[-1] if full else self.policy.next_step(state.weight)
            if weight is None or weight <= state.weight:
                return None
            phase = CanaryPhase.PROMOTED if weight == steps[-1] else CanaryPhase.PROGRESSING
            return {"phase": phase.value, "weight": weight, "since": now}
        if action in (Action.ROLLBACK, Action.ABORT):
            phase = CanaryPhase.ROLLED_BACK if action is Action.ROLLBACK else CanaryPhase.ABORTED
            return {"phase": phase.value, "weight": 0.0, "since": now}
        if action is Action.PAUSE:
            return None if state.paused else {"paused": 1}
        if action is Action.RESUME:
            if state.phase in (CanaryPhase.ROLLED_BACK, CanaryPhase.ABORTED):  # a new attempt
                return {"paused": 0, "phase": CanaryPhase.PROGRESSING.value, "weight": steps[0], "since": now}
            return {"paused": 0} if state.paused else None
        raise ValueError(f"not a state change: {action}")

    def _decision(self, action: Action, cause: str, reason: str, from_weight: float, to_weight: float,
                  manual: bool = False, evidence: dict | None = None) -> dict:
        return {"t": round(self.clock(), 3), "action": action.value, "cause": cause, "reason": reason,
                "from": from_weight, "to": to_weight, "by": self.replica_id, "manual": manual,
                "evidence": evidence or {}}

    async def act(self, action: Action, reason: str = "", full: bool = False) -> CanaryState:
        """An operator's promote / abort / pause / resume (any replica; retried on a race)."""
        text = f"manual {action.value}" + (f": {reason}" if reason else "")
        for _ in range(5):
            state = await self.state() or await self._start()
            if state is None:
                continue
            try:
                await self._transition(state, action, "manual", text, manual=True, full=full)
            except CanaryWriteRefused:
                continue  # the decider or another operator got there first: re-read, decide again
            return await self.state()
        raise CanaryWriteRefused("version", -1)

    async def status(self, max_decisions: int = 20) -> CanaryStatus:
        state = await self.state()
        now = self.clock()
        windows, tally = await self._windows(state.since if state else 0.0, now)
        return CanaryStatus(state, await self.store.holder(), windows, tally,
                            await self.store.decisions(max_decisions), self.policy.steps, self.last_verdict)

    async def aclose(self) -> None:
        """Stop deciding, let recordings finish briefly, and hand the lease on at once."""
        # One cancel once left the loop running for ever (a CI run hung here, its shutdown awaiting the
        # loop): a cancellation that a client library turns into an ordinary error inside a tick is, to
        # run(), a failed tick, and it goes on. So the loop also checks a flag, and is cancelled again
        # until it has ended (tests/test_canary_store.py reproduces it with a probe that does that).
        self._closing = True
        while self._loop is not None and not self._loop.done():
            self._loop.cancel()
            await asyncio.wait([self._loop], timeout=0.5)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        try:
            await self.store.release(self.replica_id)
        except Exception as exc:  # noqa: BLE001 - it expires anyway
            log.info("canary: releasing the lease failed: %r", exc)


def build_canary(settings: CanarySettings, redis_client, prefix: str, sessions, router: Router, telemetry,
                 registry) -> CanaryController:
    """The controller, wired in: it chooses the pool of new sessions and observes every request."""
    store = CanaryStore(redis_client, prefix, max_samples=settings.max_samples)
    checker = EqualityChecker(sessions.store, router, telemetry.tracer, tie_units=settings.tie_units)
    controller = CanaryController(store, settings, checker, CanaryMetrics(registry), router)
    sessions.claims.choose_pool = controller.choose_pool
    telemetry.request_observers.append(controller.observe)
    return controller
