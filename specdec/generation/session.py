"""What the speculative loop (loop.py) is given and gives back: its settings, the cursor on a session
(the committed sequence and what the draft holds), the observer hooks a coordinator hangs its spans
and metrics on, and a finished turn's result. Apart from the loop so that the modules around it
(pipelining, the draft's opening and feed, the coordinator) name these without importing the loop."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Awaitable, Callable, ContextManager

from specdec.engine.api import InnerDraft
from specdec.engine.cycle_cost import CycleCost
from specdec.generation.pipeline_price import PipelinePrice
from specdec.generation.shared_estimates import SharedEstimates
from specdec.generation.stats import SpeculationStats
from specdec.generation.stopping import FinishReason
from specdec.sampling.params import SamplingParams
from specdec.types import VerifyOutcome

TokenSink = Callable[[list[int]], Awaitable[None]]


@dataclass
class LoopSettings:
    num_draft_tokens: int = 4  # the draft length, or the starting one when adaptive
    retry_draft_after: int = 8  # plain cycles before speculation is tried again after a draft failure
    adaptive: bool = False  # adapt the draft length to measured acceptance and costs (adaptive.py)
    max_draft_tokens: int = 8  # the longest draft adaptation may choose
    pipelining: bool = False  # draft the next block while the target verifies (pipeline.py)
    # Pipelining only while the session's recent share of wholly accepted blocks (an upper bound on
    # the hit rate) is at least this; 0: always. Misses cost draft work that may share the hardware.
    pipeline_min_full_accept: float = 0.0
    # Pipelining only while speculative drafts save more (hits x a Propose's time) than they add to
    # the verify beside them (pipeline_price.py: a draft sharing the target's device slows it); the
    # coordinator shares one per route. None: always.
    pipeline_price: PipelinePrice | None = None
    # Branches per speculative draft: 1 the main one (all accepted, the draft's own bonus guess); 2
    # adds a second bonus guess; 3 also all-but-last accepted (specdec.engine.alternatives).
    pipeline_branches: int = 1
    # Plain decoding streamed (TargetAPI.decode_stream): a run of plain steps, as long as the loop
    # knows it will decode plainly, is one call whose next step the target starts while the last
    # token travels, instead of one round trip per token. False: one Decode call per token.
    stream_plain: bool = True
    # While the adaptive length has switched speculation off, hand the draft the plainly decoded
    # tokens in the background every this many tokens, so that the probe ending the plain run does
    # not prefill them on its critical path (draft_feed.py). 0: off (the default: no gain measured yet).
    feed_draft_every: int = 0
    # Drafts made inside the target (specdec.engine.inner_draft): streamed plain steps draft and verify
    # in the step, no draft call and no round trip per cycle. For a loop without a draft (--draft
    # target:ngram or target:model); None: off.
    inner_draft: InnerDraft | None = None
    # Earlier turns' estimates on this route (shared_estimates.py): an adaptive length starts from
    # them and adds its own. None: every turn learns from nothing.
    shared_estimates: SharedEstimates | None = None


@dataclass
class SessionCursor:
    """What the loop knows of a session: the committed sequence and what the draft holds."""

    session_id: str
    params: SamplingParams
    tokens: list[int]  # the committed sequence (prompt and everything generated)
    max_context: int
    draft_tokens: list[int] = field(default_factory=list)  # the draft's sequence as last reported
    draft_committed: int = 0  # the draft's known-committed prefix length
    draft_epoch: int = 0
    draft_ready: bool = False  # the draft holds a session for this cursor
    # What the target said when the session started (StartSession with drafts_elsewhere): 0, a draft
    # from elsewhere would be cut to nothing under its load now, so start plain (no draft session).
    target_draft_limit: int | None = None
    # The draft's StartSession, sent beside the target's prefill (draft_opening.py); None: none pending.
    draft_opening: asyncio.Task | None = None

    @property
    def position(self) -> int:
        return len(self.tokens)


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason
    stats: SpeculationStats


class LoopObserver:
    """Hooks around the loop for tracing and metrics; this default observes nothing.

    cycle() encloses one whole cycle, emit included, and step() each service call inside it
    ("propose", "verify", "decode", "truncate"), so a tracer can make them parent and children."""

    def cycle(self, index: int, position: int) -> ContextManager[object]:
        return contextlib.nullcontext()

    def step(self, name: str) -> ContextManager[object]:
        return contextlib.nullcontext()

    def verified(self, outcome: VerifyOutcome, proposer: str) -> None:
        """A drafted block came back from verification."""

    def fell_back(self, error: Exception) -> None:
        """The draft failed; the next cycles decode plainly."""

    def fed_draft(self) -> None:
        """Speculation being off, plainly decoded tokens went to the draft in the background."""

    def pipelined(self, hit: bool, branch: str | None = None) -> None:
        """A pipelined cycle's speculative block was confirmed (hit; branch: which kind, "main",
        "second_guess" or "rejected_last") or discarded (miss)."""

    def cycle_cost(self, cost: CycleCost) -> None:
        """Where the cycle's time went (called at its end, inside cycle())."""
