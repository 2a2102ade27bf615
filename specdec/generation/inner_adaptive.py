"""The adaptive draft length of drafts made inside the target (DecodeStream's adaptive_draft_length).

The coordinator's per-session policy (adaptive.py: per-position acceptance, the target's step cost by
tokens verified, the draft's cost per token, and a draft model's confidence stop for each block) run
per stream inside the target, on what that stream's steps measure. Plain steps are one-token steps of
the same stream: the policy's exploring steps and its switched-off runs, re-probed now and then.

Inside the target the policy sees model time only: a step's time outside the models (batching, the
event loop) is the same for a plain and a drafted step, and no round trip differs between them (the
coordinator's policy counts its RPCs; there are none here). The goodput trimming still caps every
draft (specdec.engine.inner_length.DraftLength, whose cap this keeps).

As in the coordinator, a stream starts from what earlier streams of the same drafter measured
(shared_estimates.py), and adds its own every absorb_every drafted steps.
"""

from __future__ import annotations

from typing import Callable

from specdec.engine.inner_length import DraftLength
from specdec.generation.adaptive import DraftLengthPolicy
from specdec.generation.shared_estimates import SharedEstimates, SharingPolicy
from specdec.types import DraftBlock, VerifyOutcome


class AdaptiveDraftLength(DraftLength):
    def __init__(self, max_tokens: int, limit: Callable[[], int | None] = lambda: None,
                 shared: SharedEstimates | None = None):
        super().__init__(max_tokens, limit)
        # Starts at the coordinator's default start (4) or lower, up to max_tokens, or from `shared`.
        self.policy = DraftLengthPolicy(min(4, max_tokens), max_tokens)
        self.sharing = SharingPolicy(shared, self.policy) if shared is not None else None

    def wanted(self, confidences: bool) -> tuple[int, float]:
        k = self.policy.next_k()
        return k, self.policy.stop_below() if confidences and k else 0.0

    def verified(self, block: DraftBlock, outcome: VerifyOutcome, draft_s: float, verify_s: float,
                 steady: bool = True) -> None:
        k = outcome.num_drafted  # what the target verified, after its trimming
        self.policy.observe_cycle(k, outcome.num_accepted, draft_s * k / max(block.num_tokens, 1), verify_s,
                                  confidences=tuple(block.confidences[:k]), steady=steady)
        if self.sharing is not None:
            self.sharing.share()

    def plain(self, step_s: float) -> None:
        self.policy.observe_plain(step_s)
