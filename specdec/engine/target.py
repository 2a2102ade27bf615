"""The target engine: session-keyed KV caches on the target model, verification next to its logits.

Every mutating call names the committed length (`position`) it expects, so a retried or duplicated
call fails cleanly with the actual position instead of corrupting the cache. Thread-confined: the
service runs every call on one model executor thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from typing import Callable, Iterator, Sequence

import torch

from specdec.engine.sessions import SessionState, SessionTable
from specdec.errors import CacheFull, ContextOverflow, InvalidArgument, PositionMismatch
from specdec.models.base import CausalLM, ModelInfo
from specdec.sampling.params import SamplingParams
from specdec.sampling.verify import sample_next, verify_block
from specdec.sampling.warp import greedy_token
from specdec.types import DraftBlock, VerifyOutcome

# Test-only faults (TargetEngine(fault_injection=...)): deliberate verification bugs, so that tests
# can show the canary's equality check catching one. Never set in production.
FAULTS = ("wrong-bonus",)  # wrong-bonus: every bonus token is replaced by the next token id
MAX_SCORED_TOKENS = 64  # candidates one score() call may ask for


class TargetEngine:
    def __init__(
        self,
        model: CausalLM,
        idle_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        fault_injection: str | None = None,  # TEST ONLY, see FAULTS; None in every real deployment
        evict_after_s: float = 0.0,
    ):
        """evict_after_s: a session used within this many seconds keeps its KV slot; a session that
        needs one while every slot is kept gets CacheFull (its caller waits and retries) instead of
        evicting it. Sessions in the middle of a turn return every cycle, so evicting one only to
        re-prefill it a moment later (LRU picks exactly those once more sessions are active than
        slots fit) would cut throughput several-fold; idle ones (between turns) are evicted as before.
        0: any session not in a call may be evicted."""
        if fault_injection is not None and fault_injection not in FAULTS:
            raise InvalidArgument(f"fault_injection must be one of {FAULTS} or None, got {fault_injection!r}")
        self.fault_injection = fault_injection
        self.model = model
        self.sessions: SessionTable[SessionState] = SessionTable(idle_ttl_s, clock)
        self.evict_after_s = evict_after_s
        self.evictions = 0

    @property
    def info(self) -> ModelInfo:
        return self.model.info

    # ---- RPC-shaped operations -------------------------------------------------------------

    def start_session(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        sample_first_token: bool = True,
    ) -> tuple[int, int | None]:
        """Prefill token_ids; with sample_first_token, also sample and commit the next token."""
        params.validate()
        tokens = self._check_tokens(token_ids, room=1 if sample_first_token else 0)
        state = self.sessions.add(SessionState(session_id, params, tokens))
        try:
            with self._in_use(state):
                if not sample_first_token:
                    # Restoring: fill the cache now so the next cycle costs what a cycle costs.
                    if len(tokens) > 1:
                        self._forward(state, [], num_logits=1, feed_last=False)
                    return state.position, None
                first = self._sample_after(state)
                return state.position, first
        except BaseException:
            self._drop(session_id)
            raise

    def verify(self, session_id: str, position: int, draft: DraftBlock) -> VerifyOutcome:
        state = self._at(session_id, position)
        k = draft.num_tokens
        self._check_room(state, k + 1)
        self._check_ids(draft.token_ids.tolist())
        with self._in_use(state):
            # Row i of target_logits is the target's distribution for position `position + i`.
            target_logits = self._forward(state, draft.token_ids.tolist(), num_logits=k + 1)  # [k + 1, vocab]
            outcome = verify_block(target_logits, draft, state.params, position)
            outcome = self.inject_fault(outcome)
            accepted = draft.token_ids[: outcome.num_accepted].tolist()
            state.tokens.extend(accepted + [outcome.next_token])
            # The cache now holds every drafted token; keep only the accepted ones. O(1).
            self.model.truncate(state.slot, position + outcome.num_accepted)
            return outcome

    def decode(
        self, session_id: str, position: int, num_tokens: int, append_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """Plain autoregressive decoding: the baseline pool, the fallback, and a new chat turn."""
        state = self._at(session_id, position)
        if num_tokens < 0:
            raise InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
        appended = self._check_tokens(append_token_ids, room=0, allow_empty=True)
        self._check_room(state, len(appended) + num_tokens)
        with self._in_use(state):
            state.tokens.extend(appended)
            return [self._sample_after(state) for _ in range(num_tokens)]

    def truncate(self, session_id: str, position: int) -> int:
        """Roll the committed sequence back to min(position, current) and return the new position.

        Idempotent and never grows the sequence, so a repeated or late truncate is harmless."""
        state = self.sessions.get(session_id)
        if position < 1:
            raise InvalidArgument(f"truncate position must be >= 1, got {position}")
        del state.tokens[position:]
        if state.slot is not None and self.model.length(state.slot) > state.position:
            self.model.truncate(state.slot, state.position)
        return state.position

    def end_session(self, session_id: str) -> bool:
        return self._drop(session_id)

    def end_turn(self, session_id: str, position: int) -> bool:
        """The session's turn ended at position: its slot may go to another session before
        evict_after_s has passed (its next call keeps it again). False, changing nothing, for an
        unknown session, one in a call, or one no longer at position (its next turn has begun)."""
        state = self.sessions.peek(session_id)  # peek: ending a turn is not a use
        if state is None or state.in_use or state.position != position:
            return False
        state.between_turns = True
        return True

    def score(self, token_ids: Sequence[int], candidate_token_ids: Sequence[int]) -> tuple[list[float], int]:
        """The logits of the candidates at the position after token_ids, and the greedy token there:
        a prefill of token_ids in a throwaway session (it may evict an idle session's cache, as a
        new session would; the evicted session re-feeds its tokens when next used)."""
        tokens = self._check_tokens(token_ids, room=1)
        candidates = [int(t) for t in candidate_token_ids]
        if not 1 <= len(candidates) <= MAX_SCORED_TOKENS:
            raise InvalidArgument(f"score 1 to {MAX_SCORED_TOKENS} candidate tokens, got {len(candidates)}")
        self._check_ids(candidates)
        state = self.sessions.add(SessionState(f"score-{uuid.uuid4().hex}", SamplingParams(), tokens))
        try:
            with self._in_use(state):
                logits = self._forward(state, [], num_logits=1)[-1].float()
        finally:
            self._drop(state.session_id)
        return logits[candidates].tolist(), greedy_token(logits)

    def inject_fault(self, outcome: VerifyOutcome) -> VerifyOutcome:
        """TEST ONLY: the outcome as the configured fault corrupts it (unchanged without a fault).
        Every path that commits a verify outcome calls this before committing it."""
        if self.fault_injection == "wrong-bonus" and outcome.is_bonus:
            wrong = (outcome.next_token + 1) % self.model.info.vocab_size
            return dataclasses.replace(outcome, next_token=wrong)
        return outcome

    def expire_idle(self) -> list[str]:
        expired = [s.session_id for s in self.sessions.expired()]
        for session_id in expired:
            self._drop(session_id)
        return expired

    def committed_tokens(self, session_id: str) -> list[int]:
        return list(self.sessions.get(session_id).tokens)

    # ---- internals ------------------------------------------------------------------------

    def _sample_after(self, state: SessionState) -> int:
        logits = self._forward(state, [], num_logits=1)  # [1, vocab]
        token = sample_next(logits[-1], state.params, state.position)
        state.tokens.append(token)
        return token

    def _forward(
        self, state: SessionState, new_tokens: list[int], num_logits: int, feed_last: bool = True
    ) -> torch.Tensor:
        """Feed the committed tokens the cache lacks, then new_tokens; return the last logits."""
        slot, feed = self._feed(state, new_tokens, num_logits, feed_last)
        return self.model.forward([slot], [feed], [num_logits])[0]

    def _feed(
        self, state: SessionState, new_tokens: list[int], num_logits: int, feed_last: bool = True
    ) -> tuple[int, list[int]]:
        """The session's slot and the row to feed it (one row of a batched forward, batch.py)."""
        slot = self._ensure_slot(state)
        cached = self.model.length(slot)
        end = state.position if feed_last else state.position - 1
        # Logits come only from tokens fed now, so at least num_logits tokens must be fed; a cache
        # longer than that holds drafted tokens of an aborted call or a tail cut by truncate.
        limit = min(end, end + len(new_tokens) - num_logits)
        if cached > limit:
            self.model.truncate(slot, limit)
            cached = limit
        return slot, state.tokens[cached:end] + new_tokens

    def _ensure_slot(self, state: SessionState) -> int:
        if state.slot is not None:
            return state.slot
        while True:
            try:
                state.slot = self.model.allocate()
                return state.slot
            except CacheFull:
                victim = next((s for s in self.sessions.lru_evictable(self.evict_after_s) if s is not state), None)
                if victim is None:
                    active = f" or used in the last {self.evict_after_s:g} s" if self.evict_after_s > 0 else ""
                    raise CacheFull(
                        f"all {self.model.num_slots} KV cache slots are held by sessions in use{active}; "
                        "retry later or route to another replica (--num-slots sets how many fit)"
                    ) from None
                self.model.free(victim.slot)
                victim.slot = None
                self.evictions += 1

    def _at(self, session_id: str, position: int) -> SessionState:
        state = self.sessions.get(session_id)
        if position != state.position:
            raise PositionMismatch(session_id, expected=position, actual=state.position)
        return state

    def _check_room(self, state: SessionState, extra: int) -> None:
        limit = self.model.info.max_context
        if state.position + extra > limit:
            raise ContextOverflow(
                f"session {state.session_id!r} is at position {state.position}; {extra} more tokens "
                f"would pass the context length {limit} (at most {max(0, limit - state.position)} fit)"
            )

    def _check_tokens(self, token_ids: Sequence[int], room: int, allow_empty: bool = False) -> list[int]:
        tokens = [int(t) for t in token_ids]
        if not tokens and not allow_empty:
            raise InvalidArgument("token_ids must not be empty")
        limit = self.model.info.max_context
        if len(tokens) + room > limit:
            raise ContextOverflow(
                f"{len(tokens)} tokens leave no room in the context length {limit} "
                f"(at most {limit - room} prompt tokens)"
            )
        self._check_ids(tokens)
        return tokens

    def _check_ids(self, tokens: Sequence[int]) -> None:
        vocab = self.model.info.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"token ids must be in [0, {vocab}), got {bad[:5]}")

    @contextlib.contextmanager
    def _in_use(self, state: SessionState) -> Iterator[None]:
        state.in_use += 1
        try:
            yield
        finally:
            state.in_use -= 1

    def _drop(self, session_id: str) -> bool:
        state = self.sessions.pop(session_id)
        if state is None:
            return False
        if state.slot is not None:
            self.model.free(state.slot)
        return True
