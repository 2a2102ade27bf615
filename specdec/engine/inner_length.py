"""How many tokens each step of a stream drafts inside the target (specdec.engine.inner_draft).

Two rules, chosen by the DecodeStream request:

- fixed (adaptive_draft_length false): the requested length, cut by the goodput trimming under
  load: a draft is no longer than what the trimmer kept of the stream's last draft, or, after a
  plain step, what it says a draft of the session would keep now (its draft_limits);
- adaptive: the coordinator's per-session policy (specdec.generation.adaptive), run here per
  stream on what this stream's steps measured: per-position acceptance, the target's step cost by
  tokens verified (fitted), the draft's cost per token, and, for a draft model, the confidence stop
  that ends each block where its own text stops paying. Plain steps are one-token steps of the same
  stream (the policy's exploring steps and its switched-off runs, re-probed now and then). The
  trimming still caps it under load.

Inside the target the policy sees model time only: a step's time outside the models (batching, the
event loop) is the same for a plain and a drafted step, and no round trip differs between them (the
coordinator's policy counts its RPCs; there are none here). A step whose draft first caught up on
more than one token (the stream's first, a step after a plain one) is not a steady drafting cost.
The draft only chooses what to propose, so either rule leaves the output plain decoding's.
"""

from __future__ import annotations

from typing import Callable

from specdec.generation.adaptive import DraftLengthPolicy
from specdec.types import DraftBlock, VerifyOutcome


class DraftLength:
    def __init__(self, max_tokens: int, limit: Callable[[], int | None] = lambda: None, adaptive: bool = False):
        self.max_tokens, self.limit = max_tokens, limit
        # Starts at the coordinator's default start (4) or lower, up to max_tokens.
        self.policy = DraftLengthPolicy(min(4, max_tokens), max_tokens) if adaptive else None
        self._kept: int | None = None  # the last draft's trimmed length, when trimmed

    def next(self, room: int, confidences: bool = False) -> tuple[int, float]:
        """(tokens the next draft may have, 0: a plain step; the confidence product below which a
        draft model stops, 0: none). confidences: the drafter reports them (a draft model)."""
        kept, self._kept = self._kept, None
        trimmed = kept if kept is not None else self.limit()
        allowed = min(room, self.max_tokens if trimmed is None else trimmed)
        if self.policy is None:
            return min(self.max_tokens, allowed), 0.0
        wanted = self.policy.next_k()
        stop_below = self.policy.stop_below() if confidences and wanted else 0.0
        return min(wanted, allowed), stop_below

    def kept(self, asked: int, planned: int, drafted: int, outcome: VerifyOutcome) -> None:
        """A step verified a draft: asked for `asked` tokens, planned `planned` by the trimmer before
        drafting, drafted `drafted`; the outcome tells what the trimmer kept after drafting. A trimmed
        length is the next draft's limit (a draft model's confidence stop is not a trim)."""
        trimmed = planned < asked or outcome.num_drafted < drafted
        self._kept = outcome.num_drafted if trimmed else None

    def verified(self, block: DraftBlock, outcome: VerifyOutcome, draft_s: float, verify_s: float,
                 steady: bool = True) -> None:
        """What the step measured: the block drafted, its outcome, model seconds of the draft pass
        and of the target's step."""
        if self.policy is not None:
            k = outcome.num_drafted
            self.policy.observe_cycle(k, outcome.num_accepted, draft_s * k / max(block.num_tokens, 1), verify_s,
                                      confidences=tuple(block.confidences[:k]), steady=steady)

    def plain(self, step_s: float) -> None:
        """A plain step of the stream: its model seconds."""
        if self.policy is not None:
            self.policy.observe_plain(step_s)
