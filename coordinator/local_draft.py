"""Prompt lookup inside the coordinator (`--draft local:ngram`): a proposer without a model needs no
service of its own.

An n-gram draft looks the session's last tokens up in its own earlier tokens (specdec.proposers.ngram),
which the coordinator holds anyway. Served by a draft service, each speculative cycle makes two round
trips, Propose then Verify, and the first one carries a lookup that takes tens of microseconds: on
the CPU benchmark a round trip costs ~2 ms of a ~45 ms cycle (docs/BENCHMARKS.md, "Per-cycle
overhead"). Here the lookup runs on the coordinator's event loop and a cycle makes one round trip.

It is a draft replica like any other to the router and the session (same methods as DraftClient),
named by the endpoint `local:ngram`; it holds its sessions' tokens in this process (expired after the
session TTL, like a draft service's), so a session that moves to another coordinator reopens its
draft there, as after a draft replica failover. Lookup works on token ids alone, so it pairs with
any target vocabulary.
"""

from __future__ import annotations

import time

from draft_service.client import DraftDescription
from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft
from specdec.proposers.ngram import NgramProposer

SWEEP_EVERY_S = 30.0  # how often idle sessions are looked for (at a session's start)


class LocalNgramDraft(LocalDraft):
    """DraftClient's methods over an in-process DraftEngine with the n-gram proposer."""

    def __init__(self, session_ttl_s: float = 600.0, max_draft_tokens: int = 64):
        super().__init__(DraftEngine(NgramProposer(), idle_ttl_s=session_ttl_s, max_draft_tokens=max_draft_tokens))
        self._swept_at = time.monotonic()

    async def start_session(self, session_id, token_ids, params) -> None:
        now = time.monotonic()
        if now - self._swept_at >= SWEEP_EVERY_S:  # a draft service has a task for this; here it is cheap
            self._swept_at = now
            self.engine.expire_idle()
        await super().start_session(session_id, token_ids, params)

    async def describe(self) -> DraftDescription:
        return DraftDescription(
            vocab_fingerprint="", eos_token_ids=(), num_slots=0, free_slots=0, server_version="in-process",
            model=None, proposer=self.engine.proposer.name, max_draft_tokens=self.engine.max_draft_tokens,
            any_vocabulary=True,
        )

    async def close(self) -> None:
        """Nothing to let go of: the sessions are token lists of this process."""
