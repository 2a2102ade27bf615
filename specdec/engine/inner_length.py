"""How many tokens each step of a stream drafts inside the target (specdec.engine.inner_draft).

DraftLength is the fixed rule (adaptive_draft_length false): the requested length, cut by the goodput
trimming under load: a draft is no longer than what the trimmer kept of the stream's last draft, or,
after a plain step, what it says a draft of the session would keep now (its draft_limits).

The adaptive rule (specdec.generation.inner_adaptive, built by the target service for a request with
adaptive_draft_length) is a DraftLength whose wanted length comes from the coordinator's per-session
policy, run per stream on what that stream's steps measure; it learns from verified() and plain(),
which the fixed rule ignores. The trimming caps either. The draft only chooses what to propose, so
either rule leaves the output plain decoding's.
"""

from __future__ import annotations

from typing import Callable

from specdec.types import DraftBlock, VerifyOutcome


# Why a stream's step decoded plainly (the target's specdec_target_stream_plain_steps metric): the
# goodput trimming's limit was 0 ("trimmer"), the length rule chose 0 ("length_rule": the adaptive
# policy switched off or re-measuring a plain step), both, or the budget left no room ("budget").
# The drafters add "no_draft" (prompt lookup found nothing), "draft_stopped" (the draft model stopped
# before its first token: its confidence stop, or a stop token) and "failed" (the draft failed).
PLAIN_REASONS = ("trimmer", "length_rule", "both", "budget", "no_draft", "draft_stopped", "failed")


def why_plain(room: int, allowed: int, wanted: int) -> str | None:
    """The reason next() decodes plainly, None when it drafts. Under load on one GPU a hosted batch
    sat plain for whole waves, and whether the trimming or the streams' own rules held it there was
    not recorded (docs/BENCHMARKS.md, round 41)."""
    if min(allowed, wanted) > 0:
        return None
    if room <= 0:
        return "budget"
    if wanted <= 0:
        return "both" if allowed <= 0 else "length_rule"
    return "trimmer"


class DraftLength:
    def __init__(self, max_tokens: int, limit: Callable[[], int | None] = lambda: None):
        self.max_tokens, self.limit = max_tokens, limit
        self._kept: int | None = None  # the last draft's trimmed length, when trimmed
        self.plain_reason: str | None = None  # why next() last said 0 (PLAIN_REASONS), None: it drafts

    def next(self, room: int, confidences: bool = False) -> tuple[int, float]:
        """(tokens the next draft may have, 0: a plain step; the confidence product below which a
        draft model stops, 0: none). confidences: the drafter reports them (a draft model)."""
        kept, self._kept = self._kept, None
        trimmed = kept if kept is not None else self.limit()
        allowed = min(room, self.max_tokens if trimmed is None else trimmed)
        wanted, stop_below = self.wanted(confidences)
        self.plain_reason = why_plain(room, allowed, wanted)
        return min(wanted, allowed), stop_below

    def wanted(self, confidences: bool) -> tuple[int, float]:
        """The rule's own choice before the trimming's cap: here, always the requested length."""
        return self.max_tokens, 0.0

    def kept(self, asked: int, planned: int, drafted: int, outcome: VerifyOutcome) -> None:
        """A step verified a draft: asked for `asked` tokens, planned `planned` by the trimmer before
        drafting, drafted `drafted`; the outcome tells what the trimmer kept after drafting. A trimmed
        length is the next draft's limit (a draft model's confidence stop is not a trim)."""
        trimmed = planned < asked or outcome.num_drafted < drafted
        self._kept = outcome.num_drafted if trimmed else None

    def verified(self, block: DraftBlock, outcome: VerifyOutcome, draft_s: float, verify_s: float,
                 steady: bool = True) -> None:
        """What a drafted step measured: the block drafted, its outcome, model seconds of the draft
        pass and of the target's step. steady=False: the draft first caught up on more than the last
        step's next token (a prefill, not a steady draft's cost)."""

    def plain(self, step_s: float) -> None:
        """A plain step of the stream: its model seconds."""
