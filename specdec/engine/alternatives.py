"""Multi-outcome pipelining: alternative branches drafted beside a speculative proposal.

A speculative proposal S assumes its parent P fully accepted and the target's next token equal to
the draft's own guess g1 (the main branch). Where the verify outcome of P is likely to be something
else, the draft can cover it with alternatives, drafted in the same batched pass as S:
  - second_guess:  all of P accepted, the bonus token is g2, the draft's best token other than g1;
  - rejected_last: all of P but its last token d accepted, the recovered token is r, the draft's
                   best token other than d (the guess sits at d's position).
Each alternative is drafted on exactly the sequence the target commits in that outcome, so its
block is the one a sequential Propose would draft there (the draft's randomness is keyed by
position): verification stays lossless whichever branch goes on.

An alternative is live only until the session's next message: a message naming it adopts it (the
session continues on the branch's sequence and cache, forked from the session's when drafted), any
other message discards it and frees its cache. So a session holds at most len(ALTERNATIVE_KINDS)
alternatives, on top of its bounded chain (specdec.engine.branches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specdec.engine.branches import LiveProposal
from specdec.errors import InvalidArgument

MAIN = "main"
SECOND_GUESS = "second_guess"
REJECTED_LAST = "rejected_last"
ALTERNATIVE_KINDS = (SECOND_GUESS, REJECTED_LAST)  # the order pipeline_branches = 2, 3 adds them in


def alternatives_for(num_branches: int) -> tuple[str, ...]:
    """The alternative kinds of a `pipeline_branches` setting (1: the main branch only)."""
    if not 1 <= num_branches <= 1 + len(ALTERNATIVE_KINDS):
        raise InvalidArgument(f"pipeline branches must be in [1, {1 + len(ALTERNATIVE_KINDS)}], got {num_branches}")
    return ALTERNATIVE_KINDS[:num_branches - 1]


def check_kinds(kinds: Sequence[str], speculative: bool) -> tuple[str, ...]:
    kinds = tuple(kinds)
    if kinds and not speculative:
        raise InvalidArgument(f"alternatives {list(kinds)} need a speculative Propose: they are branches "
                              "beside its main branch")
    unknown = [k for k in kinds if k not in ALTERNATIVE_KINDS]
    if unknown or len(set(kinds)) != len(kinds):
        raise InvalidArgument(f"alternatives must be distinct kinds among {list(ALTERNATIVE_KINDS)}, got {list(kinds)}")
    return kinds


@dataclass
class PendingBranch:
    """An alternative between its fork and its drafted block."""

    kind: str
    tokens: list[int]  # the branch's sequence: the outcome's committed prefix, then its guess, then its block
    proposer_state: object  # forked from the session's
    start: int  # the guess's position
    excluded: int | None = None  # rejected_last: the rejected draft token, which the guess must differ from
    guessed_token_id: int | None = None


@dataclass
class Alternative:
    """A drafted alternative, live until the session's next message."""

    live: LiveProposal
    parent_epoch: int
    kind: str
    tokens: list[int]
    proposer_state: object


def can_branch(proposer: object) -> bool:
    """A proposer drafts alternatives if it can rank its next tokens and fork its per-session state."""
    return all(hasattr(proposer, name) for name in ("rank_batch", "fork", "adopt"))
