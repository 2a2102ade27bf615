"""Pipelined drafting: the draft drafts block i+1 while the target verifies block i.

PEARL's post-verify (Liu et al. 2024), AMUSD, SwiftSpec. While Verify(P) is in flight, a speculative
Propose asks the draft to assume P fully accepted and the target's next token equal to the draft's
own guess g, and to draft block S after g (draft.proto: parent_epoch=P, keep_position=end(P),
speculative=true). When the outcome of P arrives:
  - hit (every token of P accepted, and the bonus token == g): S goes to Verify at once, with no
    draft round trip on the critical path;
  - miss: the next cycle's ordinary Propose names P as its parent and applies P's outcome, which
    discards S and g on the draft (its KV cache is cut back to the kept length).

Why this is lossless: verification only needs, for each token it verifies, the exact distribution
the draft sampled it from, and that the draft's randomness is independent of the target's at the
verified positions. The draft samples with counter-based randomness keyed on (seed, position,
stream) (specdec.sampling.rng), so S, drafted on the prefix "committed + P + g", is exactly the block
a sequential Propose would draft after committing g there; it is used only when the target did
commit that very prefix. A guess that turned out wrong never reaches the target. So a pipelined run
commits the same tokens as a sequential one (and, in greedy or Gumbel-coupled mode, as plain
decoding); only the timing changes.

Multi-outcome (LoopSettings.pipeline_branches > 1): the speculative Propose also drafts alternatives
for other outcomes of P (a second bonus guess, all but P's last token accepted with a guessed
recovered token; specdec.engine.alternatives) in the same batched pass. The branch whose guess the
target committed at its position is the hit, by the same argument: it was drafted on exactly the
committed sequence. The next message names it, which makes the draft adopt it and drop the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from specdec.engine.alternatives import alternatives_for
from specdec.engine.api import Proposal
from specdec.engine.cycle_cost import beside_verify
from specdec.generation.stats import SpeculationStats
from specdec.generation.stopping import StopChecker
from specdec.types import VerifyOutcome

if TYPE_CHECKING:  # the loop imports this module; the type alone goes the other way
    from specdec.generation.loop import SpeculativeLoop
    from specdec.generation.session import SessionCursor

log = logging.getLogger(__name__)

FULL_ACCEPT_GAIN = 0.1  # weight of the newest cycle in the full-acceptance average (about the last 10)


def matching_branch(parent: Proposal, outcome: VerifyOutcome, child: Proposal | None) -> Proposal | None:
    """The speculative branch (the child or one of its alternatives) that is valid after `outcome`:
    the target committed exactly its guess at its guess position, so the branch was drafted on the
    committed sequence. A main or second_guess branch needs the parent verified and accepted in
    full (not trimmed by a loaded target), a rejected_last one all of it but its last token."""
    if child is None:
        return None
    committed_at = parent.position + outcome.num_accepted  # where the target's next token sits
    for branch in (child, *child.alternatives):
        if (branch.guessed_token_id is not None and branch.position - 1 == committed_at
                and outcome.next_token == branch.guessed_token_id):
            return branch
    return None


def is_hit(parent: Proposal, outcome: VerifyOutcome, child: Proposal | None) -> bool:
    return matching_branch(parent, outcome, child) is not None


def miss_kind(parent: Proposal, outcome: VerifyOutcome, child: Proposal) -> str:
    """Why a speculative child was discarded; the kinds a multi-outcome draft would aim at are
    "wrong_guess" (a second bonus guess) and "rejected_last" (a branch for all-but-last accepted)."""
    k = parent.block.num_tokens
    if outcome.num_drafted < k:
        return "trimmed"  # the loaded target verified fewer tokens than drafted
    if outcome.num_accepted < k:
        return "rejected_last" if outcome.num_accepted == k - 1 else "rejected"
    if child.guessed_token_id is None:
        return "no_guess"  # the proposer had no next token (an n-gram without a match)
    return "wrong_guess"


class PipelinedDrafting:
    """One generation's pipelined cycles; SpeculativeLoop calls speculate() instead of its
    sequential _speculate when LoopSettings.pipelining is on."""

    def __init__(self, loop: "SpeculativeLoop"):
        self.loop = loop
        self.ready: Proposal | None = None  # a hit's speculative block, not verified yet
        # Recent share of verified blocks accepted whole: a hit needs one, so it bounds the hit rate.
        # Observed on every cycle, speculative or not, so the gate reopens by itself. Starts at 1:
        # pipeline until the session shows it does not pay.
        self.full_accept_rate = 1.0
        self.alternatives = alternatives_for(loop.settings.pipeline_branches)
        # --pipelining auto: speculative drafts only while they pay for what they add to the verify
        # beside them (pipeline_price.py; the route's, shared by its turns); a request that asks for
        # pipelining always gets it.
        self.price = loop.settings.pipeline_price
        self._priced: bool | None = None

    async def speculate(
        self, cursor: "SessionCursor", k: int, stats: SpeculationStats, stop: StopChecker
    ) -> list[int] | None:
        """One cycle: verify a block (the ready one after a hit, else a freshly proposed one) while
        the draft drafts its speculative child. None: the draft failed (the loop decodes plainly)."""
        loop = self.loop
        started = time.perf_counter()
        proposal, self.ready = self.ready, None
        if proposal is not None and proposal.position != cursor.position:
            proposal = None  # something else was committed since (a plain step): the draft must catch up
        drafted_ahead = proposal is not None
        if proposal is None:
            proposal = await loop._propose_or_fall_back(cursor, k)
            if proposal is None:
                return None
        drafted_at = time.perf_counter()
        stats.draft_seconds += drafted_at - started
        if self.price is not None and not drafted_ahead:
            self.price.proposed(drafted_at - started)
        self._priced = None  # the price's choice for this cycle, if the other gates asked it
        child_k = self._child_length(cursor, stop, proposal)
        outcome, child = await asyncio.gather(
            self._verify(cursor, proposal),
            self._propose_child(cursor, proposal, child_k) if child_k > 0 else _none(),
        )
        verified_at = time.perf_counter()
        stats.verify_seconds += verified_at - drafted_at
        # The draft forwards this cycle paid for: its own block's (none after a hit) and the child's,
        # one more for the guess (so the policy prices a drafted token, not a verified one).
        draft_steps = (0 if drafted_ahead else proposal.block.num_tokens) + _child_steps(child)
        new_tokens = loop._apply_outcome(cursor, proposal, outcome, stats, drafted_at - started,
                                         verified_at - drafted_at, draft_steps=draft_steps,
                                         pipelined=(drafted_ahead, child_k > 0))
        if proposal.block.num_tokens:
            whole = float(outcome.num_accepted == proposal.block.num_tokens)
            self.full_accept_rate += FULL_ACCEPT_GAIN * (whole - self.full_accept_rate)
        # Only cycles the price decided are its samples: a block the other gates or the budget left
        # without a child (hard text, a shorter block, the answer's end) would bias "alone".
        if self.price is not None and self._priced is not None and (child_k > 0 or not self._priced):
            self.price.verified(verified_at - drafted_at, beside=child_k > 0,
                                hit=is_hit(proposal, outcome, child) if child_k > 0 else None)
        if child is not None:
            branch = matching_branch(proposal, outcome, child)
            hit = branch is not None
            stats.record_pipeline(hit, None if hit else miss_kind(proposal, outcome, child),
                                  branch.kind if hit else None)
            loop.observer.pipelined(hit, branch.kind if hit else None)
            if hit:
                self._take_child(cursor, proposal, branch)
            else:
                self._drop_child(cursor, proposal, len(new_tokens))
        return new_tokens

    def _child_length(self, cursor: "SessionCursor", stop: StopChecker, parent: Proposal) -> int:
        """Tokens to draft speculatively after `parent` and the guess; 0: no speculative call."""
        if parent.block.num_tokens == 0:
            # A proposer that drafted nothing here (an n-gram lookup without a match) has no guess for
            # this very position either: the speculative call could only miss, so save its round trip.
            return 0
        if self.full_accept_rate < self.loop.settings.pipeline_min_full_accept:
            return 0  # too few blocks are accepted whole for a speculative draft to pay
        if self.price is not None:
            self._priced = self.price.draft_beside()
            if not self._priced:
                return 0  # it slows the verify beside it more than its hits save
        # As if drafted after the parent's verify: the parent's tokens and the bonus come first.
        return self.loop._draft_length(cursor, stop, ahead=parent.block.num_tokens + 1)

    async def _verify(self, cursor: "SessionCursor", proposal: Proposal) -> VerifyOutcome:
        with self.loop.observer.step("verify"):
            return await self.loop.target.verify(cursor.session_id, cursor.position, proposal.block, proposal.epoch)

    async def _propose_child(self, cursor: "SessionCursor", parent: Proposal, k: int) -> Proposal | None:
        """The speculative Propose; a failure only costs this cycle's pipelining (the next ordinary
        Propose names the parent, which the refused or failed call left live)."""
        try:
            with self.loop.observer.step("propose_speculative"), beside_verify():
                alternatives = self.alternatives
                stop_below = self.loop.policy.stop_below() if self.loop.policy else 0.0
                return await self.loop.draft.propose(
                    cursor.session_id, parent.position + parent.block.num_tokens, (), k, parent.epoch,
                    speculative=True, **({"alternatives": alternatives} if alternatives else {}),
                    **({"stop_below": stop_below} if stop_below else {}),
                )
        except Exception as exc:  # noqa: BLE001 - pipelining is an optimisation; the cycle goes on
            log.info("speculative draft failed for session %s: %s", cursor.session_id, exc)
            return None

    def _take_child(self, cursor: "SessionCursor", parent: Proposal, child: Proposal) -> None:
        """The draft's sequence is now the committed one (ending in the guess) plus the child's
        block (the valid branch's); the next message names it, so the draft adopts that branch."""
        self.ready = child
        cursor.draft_tokens = cursor.tokens + child.block.token_ids.tolist()
        # Where this cycle's tokens start, not the committed length: a stop inside them cuts the
        # committed sequence back, and the draft's known-committed prefix must stay within it.
        cursor.draft_committed = parent.position
        cursor.draft_epoch = child.epoch

    @staticmethod
    def _drop_child(cursor: "SessionCursor", parent: Proposal, num_committed: int) -> None:
        """What the loop believes the draft holds stays the parent's sequence: the next Propose
        names the parent, so the draft discards the child (and its guess) itself."""
        before = cursor.position - num_committed
        cursor.draft_tokens = cursor.tokens[:before] + parent.block.token_ids.tolist()
        cursor.draft_committed = before
        cursor.draft_epoch = parent.epoch


def _child_steps(child: Proposal | None) -> int:
    """Draft forwards of a speculative Propose: the guess's, then its longest branch's tokens (the
    branches are drafted in the same batched passes)."""
    branches = (child, *child.alternatives) if child is not None else ()
    guessed = [branch.block.num_tokens for branch in branches if branch.guessed_token_id is not None]
    return 1 + max(guessed) if guessed else 0


async def _none() -> None:
    return None
