"""Canary state in Redis: what every coordinator replica shares about the speculative rollout.

Keys (all under one hash tag, so one script may touch several in Redis Cluster):
    <prefix>:{canary}:state              hash   weight, phase, paused, reason, since, version, ...
    <prefix>:{canary}:samples:<pool>     list   finished requests of a pool, newest first (JSON)
    <prefix>:{canary}:checks             list   equality checks, newest first (JSON)
    <prefix>:{canary}:decisions          list   the decision log, newest first (JSON)
    <prefix>:{canary}:lease              string the replica that decides now; its TTL is the lease

Every replica appends samples and checks (LPUSH + LTRIM: bounded, no read-modify-write) and reads
the state when it routes a new session. Only the lease holder decides: it takes the lease with
SET NX PX and renews it by compare-and-PEXPIRE. A state change is one script that checks the
state's version (a decision made on stale state is refused), for the decider also that it still
holds the lease (fencing: a replica that paused past its lease cannot write), and logs the decision
in the same step. Operators' actions skip the lease check, not the version check.

The store knows the layout, not the rules: the coordinator's canary modules own field meanings.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import redis.asyncio as redis

from specdec.errors import SpecDecError
from specdec.store import lua
from specdec.store.client import translated


class CanaryWriteRefused(SpecDecError):
    """A canary state write was refused: the state changed since it was read ('version'), it
    already exists ('exists'), or the writer no longer holds the decider lease ('not_leader')."""

    def __init__(self, refusal: str, version: int):
        super().__init__(f"canary state write refused ({refusal}; the state is at version {version}); "
                         "re-read the canary state and retry")
        self.refusal = refusal
        self.version = version


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class CanaryStore:
    def __init__(self, client: redis.Redis, prefix: str = "specdec", *, max_samples: int = 2000,
                 max_checks: int = 500, max_decisions: int = 200):
        if min(max_samples, max_checks, max_decisions) < 1:
            raise ValueError("the canary's lists must keep at least one entry each")
        self.client = client
        self.prefix = prefix
        self.max_samples, self.max_checks, self.max_decisions = max_samples, max_checks, max_decisions
        self._transition = client.register_script(lua.load("canary_transition.lua"))
        self._lease = client.register_script(lua.load("canary_lease.lua"))

    def key(self, name: str) -> str:
        return f"{self.prefix}:{{canary}}:{name}"

    # ---- state and decisions ------------------------------------------------------------------

    @translated
    async def state(self) -> dict[str, str]:
        """The state hash ({} before the first write)."""
        raw = await self.client.hgetall(self.key("state"))
        return {_text(k): _text(v) for k, v in raw.items()}

    @translated
    async def write_state(self, fields: Mapping[str, Any], *, expected_version: int | None,
                          holder: str = "", decision: Mapping[str, Any] | None = None) -> int:
        """Set state fields and log `decision`, atomically. expected_version None: create the state,
        only if there is none. holder: the decider's lease id ('' for an operator). -> new version"""
        pairs = [str(x) for kv in fields.items() for x in kv]
        reply = await self._transition(
            keys=[self.key("state"), self.key("decisions"), self.key("lease")],
            args=["absent" if expected_version is None else int(expected_version), holder,
                  json.dumps(dict(decision), separators=(",", ":")) if decision else "", self.max_decisions,
                  *pairs],
        )
        status, version = _text(reply[0]), int(reply[1])
        if status != "ok":
            raise CanaryWriteRefused(status, version)
        return version

    @translated
    async def decisions(self, count: int = 50) -> list[dict]:
        """The latest decisions, newest first."""
        return self._decode(await self.client.lrange(self.key("decisions"), 0, max(count, 1) - 1))

    # ---- samples and equality checks ----------------------------------------------------------

    @translated
    async def add_sample(self, pool: str, sample: Mapping[str, Any]) -> None:
        await self._push(self.key(f"samples:{pool}"), sample, self.max_samples)

    @translated
    async def samples(self, pool: str) -> list[dict]:
        """The kept samples of a pool, newest first."""
        return self._decode(await self.client.lrange(self.key(f"samples:{pool}"), 0, -1))

    @translated
    async def add_check(self, check: Mapping[str, Any]) -> None:
        await self._push(self.key("checks"), check, self.max_checks)

    @translated
    async def checks(self) -> list[dict]:
        return self._decode(await self.client.lrange(self.key("checks"), 0, -1))

    async def _push(self, key: str, value: Mapping[str, Any], keep: int) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.lpush(key, json.dumps(dict(value), separators=(",", ":")))
            await pipe.ltrim(key, 0, keep - 1).execute()

    @staticmethod
    def _decode(values: list) -> list[dict]:
        out = []
        for value in values:
            try:
                out.append(json.loads(_text(value)))
            except ValueError:
                continue  # a foreign or truncated entry: skip it, never fail the reader
        return out

    # ---- the decider lease --------------------------------------------------------------------

    @translated
    async def acquire(self, holder: str, lease_s: float) -> bool:
        """Take the lease if free, renew it if `holder` has it; False if another replica holds it."""
        lease_ms = max(1, int(lease_s * 1000))
        if await self.client.set(self.key("lease"), holder, nx=True, px=lease_ms):
            return True
        return bool(await self._lease(keys=[self.key("lease")], args=[holder, lease_ms]))

    @translated
    async def release(self, holder: str) -> bool:
        """Give the lease up (shutdown) if `holder` still has it, so another replica decides at once."""
        return bool(await self._lease(keys=[self.key("lease")], args=[holder, "0"]))

    @translated
    async def holder(self) -> str:
        """The replica holding the lease; '' if none does."""
        value = await self.client.get(self.key("lease"))
        return _text(value) if value is not None else ""
