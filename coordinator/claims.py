"""Claiming a turn: the checks and the one Redis write that make a stream the owner of a session's
new, next or resumed turn, and the plan the turn then runs.

- new session: StoreSession.create with the prompt tokens and the turn record (owner set);
- next turn: one fenced append of the chat template's tokens for the new messages, with the new
  turn record, status ACTIVE and turns + 1 (the target gets them by Decode: no re-prefill);
- resume: one fenced update that sets the owner of the unfinished turn (nothing is added).
A claim names the record version it read, so two streams never both own a turn.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

from opentelemetry import trace

from specdec.errors import IncompatibleModels, InvalidArgument, PositionMismatch, ServiceUnavailable, SpecDecError
from specdec.observability import spans
from specdec.store import SessionRecord, SessionStatus, SessionStore, VersionConflict

from coordinator.failover import NoReplica
from coordinator.prompts import PromptEncoder
from coordinator.requests import GenerateRequest, Pool
from coordinator.routing import TARGET, Router
from coordinator.state import TurnRecord, turn_of
from coordinator.turn import TurnPlan, TurnStop


class TurnInProgress(SpecDecError):
    """A turn of the session is being generated (maps to FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class Claim:
    plan: TurnPlan
    stop: TurnStop
    added: int = 0  # input tokens the claim appended (the prompt, a turn's template tokens)


class Claims:
    def __init__(self, store: SessionStore, router: Router, prompts: PromptEncoder, default_pool: Pool,
                 choose_pool: Callable[[], Awaitable[Pool]] | None = None):
        self.store, self.router, self.prompts, self.default_pool = store, router, prompts, default_pool
        self.choose_pool = choose_pool  # the canary controller's draw, when it runs

    async def new_session(self, request: GenerateRequest, max_new_tokens: int) -> Claim:
        tokens, messages = self.prompts.first_turn(request)
        pool = await self.pool_for(request)
        speculate = pool is Pool.SPECULATIVE and request.speculation.enabled is not False
        target, description = await self._target(pool)
        self._check_room(0, len(tokens), description.model.max_context)
        draft = await self.router.choose_draft(pool, description.vocab_fingerprint) if speculate else None
        session_id, owner = uuid.uuid4().hex, uuid.uuid4().hex
        turn = TurnRecord(
            turn_start=len(tokens), max_new_tokens=max_new_tokens, stop_sequences=request.stop_sequences,
            ignore_eos=request.ignore_eos, owner=owner, messages=messages, speculate=speculate,
            num_draft_tokens=request.speculation.num_draft_tokens, pipelined=request.speculation.pipelined,
        )
        record = SessionRecord(
            prompt_length=len(tokens), sampling=request.sampling, pool=pool.value, draft_replica=draft or "",
            target_replica=target, num_draft_tokens=request.speculation.num_draft_tokens, turns=1,
            status=SessionStatus.ACTIVE, extra=turn.to_extra(),
        )
        version = await self.store.create(session_id, record, tokens)
        plan = self._plan(session_id, record, turn, version, tokens, target, draft, description, new_session=True)
        return Claim(plan, self._stop(turn, plan), len(tokens))

    async def next_turn(self, request: GenerateRequest, record: SessionRecord, session_id: str,
                        max_new_tokens: int) -> Claim:
        previous = turn_of(record)
        tokens = await self.store.tokens(session_id)
        pool = Pool(record.pool)
        target, description = await self._target(pool, record.target_replica)
        eos = self.prompts.eos_token_ids | set(description.eos_token_ids)
        generated = tokens[previous.turn_start:]
        appended, messages = self.prompts.next_turn(
            request, previous.messages, generated, ended_with_eos=bool(generated) and generated[-1] in eos
        )
        self._check_room(len(tokens), len(appended), description.model.max_context)
        draft = None
        if previous.speculate:
            draft = await self.router.choose_draft(pool, description.vocab_fingerprint, record.draft_replica)
        turn = TurnRecord(
            turn_start=len(tokens) + len(appended), max_new_tokens=max_new_tokens,
            stop_sequences=request.stop_sequences, ignore_eos=request.ignore_eos, owner=uuid.uuid4().hex,
            messages=messages, speculate=previous.speculate, num_draft_tokens=previous.num_draft_tokens,
            pipelined=previous.pipelined,
            draft_position=previous.draft_position if draft == record.draft_replica else None,
        )
        fields = {"status": SessionStatus.ACTIVE, "turns": record.turns + 1, "extra": turn.to_extra(),
                  "target_replica": target, "draft_replica": draft or ""}
        try:
            version = await self.store.append(session_id, len(tokens), appended, record.version, fields,
                                              writer=turn.owner)
        except (VersionConflict, PositionMismatch):
            raise TurnInProgress(_CHANGED.format(session_id)) from None
        plan = self._plan(session_id, record, turn, version, tokens + appended, target, draft, description)
        return Claim(plan, self._stop(turn, plan), len(appended))

    async def resume(self, record: SessionRecord, session_id: str, tokens: list[int]) -> Claim:
        """Take over the unfinished latest turn (the caller checked that nobody generates it)."""
        turn = turn_of(record).with_owner(uuid.uuid4().hex)
        try:
            version = await self.store.update(session_id, {"extra": turn.to_extra()}, record.version,
                                              writer=turn.owner)
        except VersionConflict:
            raise TurnInProgress(_CHANGED.format(session_id)) from None
        pool = Pool(record.pool)
        target, description = await self._target(pool, record.target_replica)
        draft = None
        if turn.speculate:
            draft = await self.router.choose_draft(pool, description.vocab_fingerprint, record.draft_replica)
        if draft != record.draft_replica:
            turn = replace(turn, draft_position=None)
        plan = self._plan(session_id, record, turn, version, tokens, target, draft, description)
        stop = self._stop(turn, plan)
        _, reason = stop.check(tokens[turn.turn_start:]) if len(tokens) > turn.turn_start else (0, None)
        if reason is not None:  # its coordinator died after the last token, before the final write
            plan = replace(plan, finished=reason)
        return Claim(plan, stop)

    async def pool_for(self, request: GenerateRequest) -> Pool:
        """The pool of a new session: the request's override, else the canary's draw (the share of
        new sessions it gives the speculative pool), else the default. A session keeps its pool for
        all its turns (it is in the session's record)."""
        chosen_by = "request" if request.pool else ("canary" if self.choose_pool else "default")
        pool = request.pool or (await self.choose_pool() if self.choose_pool else self.default_pool)
        trace.get_current_span().set_attributes({spans.SPECDEC_POOL: pool.value, "specdec.pool_chosen_by": chosen_by})
        return pool

    async def _target(self, pool: Pool, sticky: str = ""):
        """The session's target (or the least loaded one) and its GetInfo; skips one that does not
        answer. Refuses a target whose tokenizer differs from the coordinator's."""
        last_error = "none is configured or registered"
        for _ in range(3):
            endpoint = await self.router.choose_target(pool, sticky)
            if endpoint is None:
                break
            try:
                description = await self.router.describe(TARGET, endpoint)
            except ServiceUnavailable as exc:
                self.router.failed(endpoint)
                sticky, last_error = "", f"{endpoint}: {exc}"
                continue
            if description.vocab_fingerprint and description.vocab_fingerprint != self.prompts.vocab_fingerprint:
                raise IncompatibleModels(
                    f"target {endpoint} uses another tokenizer than the coordinator's --tokenizer "
                    "(vocab fingerprints differ); point --tokenizer at the target model"
                )
            return endpoint, description
        raise NoReplica(f"no {pool.value} target replica is available ({last_error}); retry later")

    @staticmethod
    def _check_room(held: int, added: int, max_context: int) -> None:
        """The conversation and this turn's input must leave room for at least one new token."""
        if held + added + 1 <= max_context:
            return
        if not held:
            raise InvalidArgument(
                f"the prompt has {added} tokens; the target's context is {max_context} tokens, so a "
                f"prompt may have at most {max_context - 1}"
            )
        raise InvalidArgument(
            f"the session holds {held} tokens and this turn adds {added}; the target's context is "
            f"{max_context} tokens, so this turn's input may have at most {max(0, max_context - held - 1)}"
        )

    def _plan(self, session_id, record, turn, version, tokens, target, draft, description,
              new_session: bool = False) -> TurnPlan:
        eos = frozenset() if turn.ignore_eos else frozenset(self.prompts.eos_token_ids | set(description.eos_token_ids))
        return TurnPlan(
            session_id=session_id, owner=turn.owner, params=record.sampling, pool=Pool(record.pool),
            tokens=list(tokens), turn=turn, version=version, new_session=new_session, target_endpoint=target,
            draft_endpoint=draft, fingerprint=description.vocab_fingerprint,
            max_context=description.model.max_context, eos_token_ids=eos,
        )

    def _stop(self, turn: TurnRecord, plan: TurnPlan) -> TurnStop:
        budget = min(turn.max_new_tokens, plan.max_context - turn.turn_start)  # the context caps the turn
        return TurnStop(budget, plan.eos_token_ids, turn.stop_sequences, self.prompts.detokenize)


_CHANGED = "session {!r} changed while this turn was being claimed (another turn or a Cancel); retry"
