"""Draft step, target step and verify times, measured on the engines in this process.

The ideal speedup (Leviathan et al. 2023, with the measured multi-token verify cost, as
../shared/docs/BENCHMARKS.md asks) needs what the model pair and the hardware give, free of RPC,
coordination and Redis: t_step (one plain decoding step of the target), t_verify(n) (one verify
forward of n = k + 1 tokens) and t_draft (one drafted token). They are measured on a TargetEngine
and DraftEngines like the services', at each prompt's context (its prompt plus half the token
budget), once per prompt inside the interleaved rotation, so the machine's load hits them as it hits
the methods.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass, field

import torch

from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock


@dataclass
class StepTimes:
    """Median seconds over the repetitions at one prompt's context."""

    question_id: str
    category: str
    context: int
    t_step: float
    t_verify: dict[int, float]  # tokens in the forward (k + 1) -> seconds
    t_draft: dict[str, float] = field(default_factory=dict)  # proposer -> seconds per drafted token

    def to_dict(self) -> dict:
        return {"question_id": self.question_id, "category": self.category, "context": self.context,
                "t_step": self.t_step, "t_verify": {str(k): v for k, v in self.t_verify.items()},
                "t_draft": dict(self.t_draft)}


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class EngineTimer:
    """Times the engines directly. `drafts` maps a proposer name ("ngram", "draft-model") to a
    DraftEngine; `max_verify` is the largest k + 1 to time."""

    def __init__(self, target: TargetEngine, drafts: dict[str, DraftEngine], max_verify: int,
                 filler_tokens: int, repeats: int = 3):
        self.target, self.drafts = target, drafts
        self.max_verify, self.filler_tokens, self.repeats = max_verify, filler_tokens, repeats

    def measure(self, question_id: str, category: str, prompt_ids: list[int]) -> StepTimes:
        params = SamplingParams()
        context = list(prompt_ids)
        while len(context) < len(prompt_ids) + self.filler_tokens:  # valid ids at a typical length
            context += prompt_ids[: len(prompt_ids) + self.filler_tokens - len(context)]
        limit = self.target.info.max_context - self.max_verify - 1
        context = context[:limit]
        sid = uuid.uuid4().hex
        self.target.start_session(sid, context[:-1], params, sample_first_token=False)
        position = len(context) - 1
        block = lambda n: DraftBlock(token_ids=torch.tensor(context[-n:], dtype=torch.long))  # noqa: E731
        steps: list[float] = []
        verifies: dict[int, list[float]] = {n: [] for n in range(2, self.max_verify + 1)}
        draft_times: dict[str, list[float]] = {name: [] for name in self.drafts}
        try:
            self.target.decode(sid, position, 0, context[-1:])  # commit the last token: cache warm
            position += 1
            self.target.decode(sid, position, 1)  # untimed: from here every decode feeds one token
            self.target.truncate(sid, position)
            for name, engine in self.drafts.items():
                engine.start_session(sid, context, params)
                engine.propose(sid, len(context), [], 1)  # fill the draft's cache
            # One untimed round first: a shape's first forward at this context may build what later
            # ones reuse (a CUDA graph for a new key bucket, ~0.1 s for the 8B shape, against a 6-7 ms
            # step), which a single timed repetition would have counted as the step's cost.
            for repeat in range(self.repeats + 1):
                kept = repeat > 0
                step = _timed(lambda: self.target.decode(sid, position, 1))
                steps += [step] * kept
                self.target.truncate(sid, position)
                for n in verifies:
                    verify = _timed(lambda: self.target.verify(sid, position, block(n - 1)))
                    verifies[n] += [verify] * kept
                    self.target.truncate(sid, position)
                k = self.max_verify - 1
                for name, engine in self.drafts.items():
                    draft = _timed(lambda: engine.propose(sid, len(context), [], k)) / k
                    draft_times[name] += [draft] * kept
        finally:
            self.target.end_session(sid)
            for engine in self.drafts.values():
                engine.end_session(sid)
        return StepTimes(question_id, category, len(context), statistics.median(steps),
                         {1: statistics.median(steps), **{n: statistics.median(v) for n, v in verifies.items()}},
                         {name: statistics.median(v) for name, v in draft_times.items()})


def summarize(times: list[StepTimes]) -> dict:
    """Medians over prompts of the per-prompt medians."""
    if not times:
        return {}
    verify_sizes = sorted({n for t in times for n in t.t_verify})
    proposers = sorted({p for t in times for p in t.t_draft})
    return {
        "prompts": len(times),
        "context_median": statistics.median(t.context for t in times),
        "t_step": statistics.median(t.t_step for t in times),
        "t_verify": {str(n): statistics.median(t.t_verify[n] for t in times if n in t.t_verify)
                     for n in verify_sizes},
        "t_draft": {p: statistics.median(t.t_draft[p] for t in times if p in t.t_draft) for p in proposers},
    }
