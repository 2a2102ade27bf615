"""Which replicas serve a session, and one client per replica endpoint.

Endpoints come from flags (--target / --draft for the speculative pool, --baseline-target for the
baseline pool; without --baseline-target, every --target serves both pools) or from the replica
registry in Redis (kind "target" / "draft", pools "speculative" / "baseline"; a baseline session
uses baseline targets, or speculative ones when the baseline pool has none). New sessions go to
the least loaded live replica; a session sticks to the endpoints in its record while those are
live. Load is what the registry last heard (or, for flag-given replicas, the turns this
coordinator runs there) plus the sessions this coordinator placed there in the last few seconds,
which neither counts yet: a burst of new sessions is spread instead of all going to the replica
that was least loaded at the last report. An endpoint that failed is avoided for a while, unless
nothing else is left (it may be the same replica, restarted); one that refused a session for want
of a KV slot (CacheFull) is ranked after the others for a shorter while, so new and spilled
sessions go where there is room. A draft is paired with a target only if their vocab fingerprints
(GetInfo) are equal; an incompatible draft is refused once, with a log line, and never used.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from specdec.store import ReplicaRegistry

from coordinator.requests import Pool

log = logging.getLogger(__name__)

TARGET, DRAFT = "target", "draft"


@dataclass(frozen=True)
class Candidate:
    endpoint: str
    load: float  # share of capacity in use (registry), or sessions this coordinator runs there


class Router:
    def __init__(
        self,
        connect_target: Callable[[str], object],
        connect_draft: Callable[[str], object],
        *,
        targets: Iterable[str] = (),
        drafts: Iterable[str] = (),
        baseline_targets: Iterable[str] = (),
        registry: ReplicaRegistry | None = None,
        avoid_failed_s: float = 5.0,
        full_for_s: float = 1.0,
        placement_memory_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        use_drafts: bool = True,
    ):
        self._connect = {TARGET: connect_target, DRAFT: connect_draft}
        self._static = {TARGET: list(dict.fromkeys(targets)), DRAFT: list(dict.fromkeys(drafts))}
        self._static_baseline = list(dict.fromkeys(baseline_targets))  # baseline targets from flags
        self.use_drafts = use_drafts  # False: sessions draft inside the target (--draft target:...)
        self.registry = registry
        self.avoid_failed_s = avoid_failed_s
        self.full_for_s = full_for_s  # about a target's --evict-after: when a kept slot may free up
        # Longer than a registrar's report interval (a third of its lease, 3.3 s by default) and than
        # the moment between a choice and its turn's acquire().
        self.placement_memory_s = placement_memory_s
        self.clock = clock
        self._clients: dict[tuple[str, str], object] = {}
        self._descriptions: dict[tuple[str, str], object] = {}
        self._failed_at: dict[str, float] = {}
        self._full_at: dict[str, float] = {}
        self._placed: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._sessions: collections.Counter[str] = collections.Counter()  # turns running here
        self._refused: set[tuple[str, str]] = set()  # (draft endpoint, target fingerprint) pairs

    # ---- clients --------------------------------------------------------------------------

    def target(self, endpoint: str):
        return self._client(TARGET, endpoint)

    def draft(self, endpoint: str):
        return self._client(DRAFT, endpoint)

    def _client(self, kind: str, endpoint: str):
        key = (kind, endpoint)
        if key not in self._clients:
            self._clients[key] = self._connect[kind](endpoint)
        return self._clients[key]

    async def describe(self, kind: str, endpoint: str):
        """GetInfo of a replica (TargetDescription / DraftDescription), cached until it fails."""
        key = (kind, endpoint)
        if key not in self._descriptions:
            self._descriptions[key] = await self._client(kind, endpoint).describe()
        return self._descriptions[key]

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    # ---- health and load ------------------------------------------------------------------

    def failed(self, endpoint: str) -> None:
        """The endpoint did not answer: avoid it for a while, and ask it GetInfo again later."""
        self._failed_at[endpoint] = self.clock()
        for key in [k for k in self._descriptions if k[1] == endpoint]:
            del self._descriptions[key]

    def is_avoided(self, endpoint: str) -> bool:
        failed_at = self._failed_at.get(endpoint)
        return failed_at is not None and self.clock() - failed_at < self.avoid_failed_s

    def full(self, endpoint: str) -> None:
        """The target refused a session for want of a KV slot (CacheFull): rank it last for a while."""
        self._full_at[endpoint] = self.clock()

    def is_full(self, endpoint: str) -> bool:
        full_at = self._full_at.get(endpoint)
        return full_at is not None and self.clock() - full_at < self.full_for_s

    def _placed_lately(self, endpoint: str) -> int:
        """New sessions this coordinator sent to `endpoint` within placement_memory_s."""
        times, cutoff = self._placed[endpoint], self.clock() - self.placement_memory_s
        while times and times[0] < cutoff:
            times.popleft()
        return len(times)

    def _place(self, endpoint: str) -> str:
        self._placed[endpoint].append(self.clock())
        return endpoint

    def acquire(self, *endpoints: str) -> None:
        """A turn started on these endpoints (the load of static replicas)."""
        self._sessions.update(e for e in endpoints if e)

    def release(self, *endpoints: str) -> None:
        self._sessions.subtract(e for e in endpoints if e)

    # ---- choice ---------------------------------------------------------------------------

    async def candidates(self, kind: str, pool: Pool) -> list[Candidate]:
        """Live endpoints of a kind for a pool, least loaded first (draining ones excluded)."""
        static = self._static_for(kind, pool)
        if static or self.registry is None:
            found = [Candidate(e, float(self._sessions[e] + self._placed_lately(e))) for e in static]
        else:
            found = await self._registered(kind, pool)
        return sorted(found, key=lambda c: (self.is_avoided(c.endpoint), self.is_full(c.endpoint), c.load))

    async def _registered(self, kind: str, pool: Pool) -> list[Candidate]:
        pools = [pool.value] if kind == DRAFT else [pool.value, Pool.SPECULATIVE.value]
        for name in dict.fromkeys(pools):
            replicas = [r for r in await self.registry.list(kind, name) if not r.draining]
            if replicas:
                return [Candidate(r.endpoint, r.load + self._placed_lately(r.endpoint) / max(r.capacity, 1))
                        for r in replicas]
        return []

    async def is_live(self, kind: str, pool: Pool, endpoint: str) -> bool:
        """Whether a recorded endpoint still serves (listed in the flags or registered; a
        draining replica still serves the sessions it holds)."""
        if not endpoint:
            return False
        static = self._static_for(kind, pool)
        if static or self.registry is None:
            return endpoint in static
        pools = {pool.value, Pool.SPECULATIVE.value} if kind == TARGET else {pool.value}
        for name in pools:
            if any(r.endpoint == endpoint for r in await self.registry.list(kind, name)):
                return True
        return False

    def _static_for(self, kind: str, pool: Pool) -> list[str]:
        """Flag-given endpoints of a kind for a pool: --baseline-target for baseline targets when
        given, else --target / --draft (an empty list: look in the registry)."""
        if kind == TARGET and pool is Pool.BASELINE and self._static_baseline:
            return self._static_baseline
        return self._static[kind]

    async def choose_target(self, pool: Pool, sticky: str = "") -> str | None:
        """The session's recorded target if it is live, else the least loaded one (one that lately
        had no free KV slot only when every other one failed or had none either)."""
        if sticky and not self.is_avoided(sticky) and await self.is_live(TARGET, pool, sticky):
            return sticky
        found = await self.candidates(TARGET, pool)
        return self._place(found[0].endpoint) if found else None

    async def room_elsewhere(self, pool: Pool, full: str) -> str | None:
        """`full` refused a session for want of a KV slot: the least loaded other target that is
        neither known to be full nor failed lately (counted as a placement), else None."""
        self.full(full)
        for c in await self.candidates(TARGET, pool):
            if c.endpoint != full and not self.is_full(c.endpoint) and not self.is_avoided(c.endpoint):
                return self._place(c.endpoint)
        return None

    async def choose_draft(self, pool: Pool, fingerprint: str, sticky: str = "") -> str | None:
        """A live draft whose vocabulary matches `fingerprint` (the target's): the recorded one
        when it qualifies, else the least loaded; None when no draft qualifies."""
        if not self.use_drafts:
            return None
        # A draft that failed lately is skipped, not retried per session: decoding plainly costs
        # less than waiting for it to time out again.
        found = [c.endpoint for c in await self.candidates(DRAFT, pool) if not self.is_avoided(c.endpoint)]
        if sticky in found:
            found.remove(sticky)
            found.insert(0, sticky)
        for endpoint in found:
            if await self.draft_compatible(endpoint, fingerprint):
                return endpoint if endpoint == sticky else self._place(endpoint)
        return None

    async def draft_compatible(self, endpoint: str, fingerprint: str) -> bool:
        try:
            description = await self.describe(DRAFT, endpoint)
        except Exception as exc:  # unreachable now: not a candidate this time
            log.warning("draft %s did not answer GetInfo: %s", endpoint, exc)
            self.failed(endpoint)
            return False
        if description.vocab_fingerprint != fingerprint and not description.any_vocabulary:
            if (endpoint, fingerprint) not in self._refused:  # say it once, not per session
                self._refused.add((endpoint, fingerprint))
                log.error(
                    "refusing draft %s: its vocab fingerprint %.12s... differs from the target's %.12s...; "
                    "sessions decode without it", endpoint, description.vocab_fingerprint, fingerprint,
                )
            return False
        return True
