"""The canary's equality check: replay a finished speculative turn on the baseline pool by plain
decoding and compare the two outputs token for token (ARCHITECTURE.md, "What identical means").

Only turns whose output is determined by the prompt and the parameters qualify: greedy, and
Gumbel-coupled sampling (the same seed gives the same tokens with or without a draft). The replay
prefills the committed sequence before the turn on a baseline target, in a session of its own, and
decodes as many tokens as the turn produced (no stop conditions: the lengths then match, and an
early EOS on either side shows up as a divergence).

The rule is specdec.generation.equality.compare_outputs. With fp32 targets on both sides it is exact:
any divergence is a failure; so it is with batch-invariant targets (--batch-invariant) in any dtype. In bf16/fp16 a near-tie may flip between a multi-token verify and a
one-token decode; telling it from a bug takes the target's logits at the divergence: the baseline
target scores both tokens after the shared prefix (ScoreTokens), and a gap within the tie threshold
(tie_threshold, at least 0.05, or a few units in the last place of the logits in the target's
dtype) is a TIE, anything else FAILED. A target too old to score (or failing to) leaves the divergence UNSCORED:
counted, and a rollback only when too many are (policy).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass

from opentelemetry import trace

from specdec.errors import ServiceUnavailable, SessionNotFound
from specdec.generation.equality import (DEFAULT_TIE_THRESHOLD, EXACT_DTYPES, TIE_ULPS, EqualityReport,
                                         compare_outputs, rescored, tie_threshold)
from specdec.sampling.params import SamplingMode
from specdec.store import SessionStore

from coordinator.canary_policy import EqualityResult
from coordinator.failover import SessionTarget
from coordinator.requests import Pool
from coordinator.routing import TARGET, Router

log = logging.getLogger(__name__)

SCORE_SLOT_WAIT_S = 30.0  # how long a re-scoring waits for a KV slot on a full baseline target
REPLAY_TIMEOUT_S = 30.0  # how long a replay waits for a slot, or for a baseline target to answer


@dataclass(frozen=True)
class Replay:
    """A finished speculative turn to check."""

    session_id: str
    turn_start: int  # committed length before the turn's first generated token
    end: int  # committed length after its last
    time: float  # when the request ended: the check counts in that request's window


class EqualityChecker:
    def __init__(self, sessions: SessionStore, router: Router, tracer: trace.Tracer, *,
                 tie_threshold: float = DEFAULT_TIE_THRESHOLD, tie_units: float = TIE_ULPS):
        self.sessions, self.router, self.tracer = sessions, router, tracer
        self.tie_threshold, self.tie_units = tie_threshold, tie_units

    async def check(self, replay: Replay) -> dict | None:
        """The check's record (see docs/CANARY.md), or None when the turn does not qualify."""
        record = await self.sessions.get(replay.session_id)
        if record is None or not (record.sampling.greedy or record.sampling.mode is SamplingMode.GUMBEL):
            return None
        tokens = await self.sessions.tokens(replay.session_id, 0, replay.end - 1)
        prompt, candidate = tokens[:replay.turn_start], tokens[replay.turn_start:replay.end]
        if not candidate or len(tokens) < replay.end:
            return None
        out = {"t": round(replay.time, 3), "session_id": replay.session_id, "tokens": len(candidate),
               "speculative_target": record.target_replica}
        attributes = {"gen_ai.conversation.id": replay.session_id, "specdec.num_tokens": len(candidate)}
        with self.tracer.start_as_current_span("specdec.canary.equality_check", attributes=attributes) as span:
            out |= await self._compare(prompt, candidate, record, replay.session_id)
            span.set_attribute("specdec.canary.equality", out["result"])
        return out

    async def _compare(self, prompt: list[int], candidate: list[int], record, session_id: str) -> dict:
        endpoint = await self.router.choose_target(Pool.BASELINE)
        if endpoint is None:
            return {"result": EqualityResult.ERROR.value, "detail": "no baseline target is available"}
        where = [endpoint]  # the replay's target: it moves off one whose KV slots are all in use
        try:
            reference = await self._plain(where, prompt, len(candidate), record.sampling)
            endpoint = where[0]
            exact = await self._is_exact(endpoint) and await self._is_exact(record.target_replica)
        except (ServiceUnavailable, SessionNotFound) as exc:
            self.router.failed(where[0])
            return {"result": EqualityResult.ERROR.value, "baseline_target": where[0], "detail": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a replay that fails says nothing about equality
            return {"result": EqualityResult.ERROR.value, "baseline_target": endpoint, "detail": repr(exc)}
        report = compare_outputs(prompt, candidate, reference)
        scored = exact
        if not (exact or report.equal) and report.divergence < min(len(candidate), len(reference)):
            report, scored = await self._rescore(endpoint, prompt, candidate, reference, report)
        if report.equal:
            result = EqualityResult.EQUAL
        elif report.tie:
            result = EqualityResult.TIE
        elif scored:
            result = EqualityResult.FAILED
        else:
            result = EqualityResult.UNSCORED
        out = {"result": result.value, "baseline_target": endpoint, "divergence": report.divergence,
               "logit_gap": report.logit_gap}
        if report.divergence is not None and report.divergence < len(candidate):
            i = report.divergence
            out["detail"] = (f"session {session_id} token {i}: speculative {candidate[i]}, "
                             f"plain decoding {reference[i] if i < len(reference) else None}")
        return out

    async def _rescore(self, endpoint: str, prompt: list[int], candidate: list[int], reference: list[int],
                       report: EqualityReport) -> tuple[EqualityReport, bool]:
        """The divergence judged by the baseline target's logits of both tokens after the shared
        prefix (ScoreTokens); (the report unchanged, False) where it cannot be (an older target)."""
        i = report.divergence
        try:
            # In line for a KV slot if the target is full: an unscored divergence counts towards a rollback.
            (candidate_logit, reference_logit), _ = await self.router.target(endpoint).score_tokens(
                prompt + reference[:i], [candidate[i], reference[i]], slot_wait_s=SCORE_SLOT_WAIT_S)
            dtype = (await self.router.describe(TARGET, endpoint)).model.dtype
        except Exception as exc:  # noqa: BLE001 - unscored, not failed: the policy counts those apart
            log.warning("canary equality check: could not re-score a divergence on %s: %r", endpoint, exc)
            return report, False
        threshold = tie_threshold(dtype, candidate_logit, reference_logit, floor=self.tie_threshold,
                                  units=self.tie_units)
        return rescored(report, candidate_logit, reference_logit, threshold), True

    async def _plain(self, where: list[str], prompt: list[int], n: int, params) -> list[int]:
        """n tokens of plain decoding after `prompt` on a baseline target, in a throwaway session:
        where[0] to begin with, and where[0] becomes the one that made them. The replay goes where a
        session would (coordinator/failover.py): off a full target to one with room, else in line
        for a slot (a check must not evict a session), and off a target that stops answering."""
        replay_id = f"canary-replay-{uuid.uuid4().hex}"
        tokens = list(prompt)

        async def unguarded() -> None:  # a replay has no record whose owner could change
            return None

        target = SessionTarget(self.router, Pool.BASELINE, replay_id, params, where[0], committed=lambda: tokens,
                               guard=unguarded, on_moved=lambda endpoint: where.__setitem__(0, endpoint),
                               failover_timeout_s=REPLAY_TIMEOUT_S)
        try:
            tokens.append(await target.prepare(prompt, need_first=True, new_session=True))
            if n > 1:
                tokens += await target.decode(replay_id, len(tokens), n - 1)
            return tokens[len(prompt):]
        finally:
            with contextlib.suppress(Exception):
                await target.end_session(replay_id)

    async def _is_exact(self, endpoint: str) -> bool:
        """Whether the target computes in fp32, or batch-invariantly (--batch-invariant: a verify
        computes every position as a one-token decode does, so no near-tie can flip and any
        divergence is a failure; like fp32, this holds between replicas on the same hardware and
        software). Unknown endpoints count as exact: the baseline's settings decide then."""
        if not endpoint:
            return True
        try:
            description = await self.router.describe(TARGET, endpoint)
        except Exception:  # noqa: BLE001 - gone since the turn: the baseline's dtype decides
            return True
        return description.model.dtype in EXACT_DTYPES or description.model.batch_invariant
