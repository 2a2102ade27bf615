"""Speculation statistics of one generation (and sums over many, for benchmarks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec.engine.cycle_cost import CycleCost
from specdec.types import VerifyOutcome


@dataclass
class SpeculationStats:
    cycles: int = 0  # verify calls
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0
    recovered: int = 0  # cycles that ended in a rejection
    bonus: int = 0  # cycles where every drafted token was accepted
    decode_steps: int = 0  # plain target steps (no draft, fallback, or k = 0)
    fallbacks: int = 0  # cycles where the draft failed and plain decoding took over
    pipeline_hits: int = 0  # pipelined cycles whose speculative block went to verification next
    pipeline_misses: int = 0  # pipelined cycles whose speculative block was discarded
    pipeline_wrong_guesses: int = 0  # ... of them: the block was fully accepted, the bonus guess was wrong
    pipeline_rejected_last: int = 0  # ... of them: only the block's last token was rejected
    # Hits by the branch that hit (multi-outcome pipelining); main hits are the rest of pipeline_hits.
    pipeline_hits_second_guess: int = 0  # all accepted, the bonus was the draft's second guess
    pipeline_hits_rejected_last: int = 0  # all but the last accepted, the recovered token was guessed
    drafted_by_position: list[int] = field(default_factory=list)  # [i]: drafts that had a token i
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: ... whose token i was accepted
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    decode_seconds: float = 0.0
    # Per-cycle cost (cycle_cost.py), summed over every cycle, speculative or plain.
    timed_cycles: int = 0
    cycle_seconds: float = 0.0  # wall time of the cycles
    draft_model_seconds: float = 0.0  # of it, inside the draft model, as the draft service reported
    # Of the draft model time: what a pipelined speculative Propose spent while the target's model ran
    # beside it (CycleCost.hidden_draft_model_s), so not on the critical path.
    hidden_draft_model_seconds: float = 0.0
    target_model_seconds: float = 0.0  # of it, inside the target model
    queued_seconds: float = 0.0  # of it, waiting in the services' batchers before a step
    handler_seconds: float = 0.0  # of it, in the services' handlers (model time included)
    call_seconds: float = 0.0  # of it, in calls to the services (handlers included)

    def record_cost(self, cost: CycleCost) -> None:
        self.timed_cycles += 1
        self.cycle_seconds += cost.wall_s
        self.draft_model_seconds += cost.draft_model_s
        self.hidden_draft_model_seconds += cost.hidden_draft_model_s
        self.target_model_seconds += cost.target_model_s
        self.queued_seconds += cost.queued_s
        self.handler_seconds += cost.handler_s
        self.call_seconds += cost.calls_s

    @property
    def overhead_seconds(self) -> float:
        """Cycle time outside the model forwards on the critical path: RPC, batching, conversions,
        coordination."""
        model = self.draft_model_seconds + self.target_model_seconds - self.hidden_draft_model_seconds
        return max(0.0, self.cycle_seconds - model)

    def record(self, outcome: VerifyOutcome) -> None:
        self.cycles += 1
        self.drafted += outcome.num_drafted
        self.accepted += outcome.num_accepted
        if outcome.num_drafted == 0:
            pass
        elif outcome.is_bonus:
            self.bonus += 1
        else:
            self.recovered += 1
        grow = outcome.num_drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(outcome.num_drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < outcome.num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify cycle (accepted + the recovered/bonus token)."""
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0

    def record_pipeline(self, hit: bool, miss_kind: str | None = None, branch: str | None = None) -> None:
        """One pipelined cycle; a miss's kind as specdec.generation.pipeline.miss_kind says, a
        hit's branch as specdec.engine.alternatives names it."""
        if hit:
            self.pipeline_hits += 1
            self.pipeline_hits_second_guess += branch == "second_guess"
            self.pipeline_hits_rejected_last += branch == "rejected_last"
            return
        self.pipeline_misses += 1
        self.pipeline_wrong_guesses += miss_kind == "wrong_guess"
        self.pipeline_rejected_last += miss_kind == "rejected_last"

    @property
    def pipeline_hit_rate(self) -> float | None:
        """Hits / pipelined cycles; None without pipelined cycles (sequential mode)."""
        attempts = self.pipeline_hits + self.pipeline_misses
        return self.pipeline_hits / attempts if attempts else None

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def merge(self, other: "SpeculationStats") -> None:
        for name in ("cycles", "drafted", "accepted", "recovered", "bonus", "decode_steps", "fallbacks",
                     "pipeline_hits", "pipeline_misses", "pipeline_wrong_guesses", "pipeline_rejected_last",
                     "pipeline_hits_second_guess", "pipeline_hits_rejected_last",
                     "draft_seconds", "verify_seconds", "decode_seconds", "timed_cycles", "cycle_seconds",
                     "draft_model_seconds", "target_model_seconds", "queued_seconds", "handler_seconds", "call_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_by_position, other.drafted_by_position),
                             (self.accepted_by_position, other.accepted_by_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def to_dict(self) -> dict:
        out = asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted_length"] = self.mean_accepted_length
        out["pipeline_hit_rate"] = self.pipeline_hit_rate
        out["acceptance_by_position"] = self.acceptance_by_position()
        out["overhead_seconds"] = self.overhead_seconds
        return out
