"""Continuous batching on the draft: the Propose work of many sessions drafted together.

run_propose_batch(engine, works) does what engine.propose does one session at a time: each item's
accept/rollback message is checked and applied on its own (a bad item gets its own exception and
never fails the others), then every proposal is drafted at once. A proposer with propose_batch
(the draft model) runs step t of every proposal still drafting in one forward, each row sampled
with its own parameters at its own position, so the blocks equal the sequential ones; any other
proposer (n-gram lookup: no forward to share) drafts one session after the other. A session named
twice runs its items in order, in successive sub-batches. Runs on the one model thread.

A speculative item's alternatives (specdec.engine.alternatives) are rows of the same two passes:
the guess pass ranks the next tokens of the main branch and of each rejected_last branch, the block
pass drafts every branch after its guess, each on its own forked cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from specdec.engine.alternatives import REJECTED_LAST
from specdec.engine.api import Proposal
from specdec.engine.batch import split_by_session
from specdec.engine.draft import DraftEngine
from specdec.proposers.base import NextTokens, Proposer
from specdec.types import DraftBlock


@dataclass(frozen=True)
class ProposeWork:
    """engine.propose(...) as an item of a batch."""

    session_id: str
    keep_position: int
    append_token_ids: tuple[int, ...]
    num_draft_tokens: int
    parent_epoch: int = 0
    speculative: bool = False
    alternatives: tuple[str, ...] = ()  # kinds of alternative branches (speculative only)
    stop_below: float = 0.0  # confidence stop of the main block (DraftModelProposer.propose); 0: none


Result = Union[Proposal, Exception]


def run_propose_batch(engine: DraftEngine, works: Sequence[ProposeWork]) -> list[Result]:
    """Run every Propose; item i's proposal (or exception) is at index i."""
    results: list[Result | None] = [None] * len(works)
    for group in split_by_session([w.session_id for w in works]):
        begun = []
        for index in group:
            w = works[index]
            try:
                state = engine.begin_propose(w.session_id, w.keep_position, w.append_token_ids,
                                             w.num_draft_tokens, w.parent_epoch, w.speculative, w.alternatives)
            except Exception as exc:  # noqa: BLE001 - the item's own error, returned to its caller
                results[index] = exc
                continue
            begun.append((index, state))
        begun = _place_guesses(engine, works, begun, results)
        rows = []  # (item, state, branch number or None): the main block, then each branch's
        for index, state in begun:
            rows.append((index, state, None, (state.proposer_state, state.tokens)))
            rows += [(index, state, b, (branch.proposer_state, branch.tokens))
                     for b, branch in enumerate(state.pending.branches)]
        blocks = draft_all(engine.proposer, [(proposer_state, tokens, _block_length(works[i], state, branch), state.params,
                                              works[i].stop_below if branch is None else 0.0)
                                             for i, state, branch, (proposer_state, tokens) in rows])
        by_item: dict[int, list] = {}
        for (index, state, branch, _), block in zip(rows, blocks):
            by_item.setdefault(index, []).append(block)
        for index, state in begun:
            block, *branch_blocks = by_item[index]
            if isinstance(block, Exception):
                engine.abort_propose(state)
                results[index] = block
            else:
                results[index] = engine.finish_propose(state, block, branch_blocks)
    return results  # type: ignore[return-value]


def _block_length(work: ProposeWork, state, branch: int | None) -> int:
    """A speculative main branch without a guess (only its alternatives had one) drafts nothing."""
    if branch is None and work.speculative and state.pending.guessed_token_id is None:
        return 0
    return work.num_draft_tokens


def _place_guesses(engine: DraftEngine, works: Sequence[ProposeWork], begun: list, results: list) -> list:
    """Speculative items first draft one token, their guess of the target's next token, in one
    batched pass (with the rankings their alternatives guess from); the blocks after the guesses
    are drafted with everything else. Returns the items left to draft (an item without a guess is
    finished empty here, one whose guess failed gets its exception)."""
    speculative = [(i, s) for i, s in begun if works[i].speculative]
    if not speculative:
        return begun
    # A second_guess branch ranks from the main row (the same context); a rejected_last branch
    # needs a row of its own, one token shorter.
    rows = []  # (item number in `speculative`, branch number or None, (proposer state, tokens, params))
    for n, (_, state) in enumerate(speculative):
        rows.append((n, None, (state.proposer_state, state.tokens, state.params)))
        rows += [(n, b, (branch.proposer_state, branch.tokens, state.params))
                 for b, branch in enumerate(state.pending.branches) if branch.kind == REJECTED_LAST]
    ranked = any(s.pending.branches for _, s in speculative)
    guesses = guess_all(engine.proposer, [request for _, _, request in rows], num_ranked=2 if ranked else 1)
    per_item: list[list] = [[None] * (1 + len(s.pending.branches)) for _, s in speculative]
    for (n, branch, _), guess in zip(rows, guesses):
        per_item[n][0 if branch is None else 1 + branch] = guess
    settled = set()
    for (index, state), (guess, *branch_guesses) in zip(speculative, per_item):
        if isinstance(guess, Exception):
            engine.abort_propose(state)
            results[index] = guess
            settled.add(index)
        elif not engine.place_guess(state, guess, branch_guesses):
            results[index] = engine.finish_propose(state, DraftBlock.empty())
            settled.add(index)
    return [(i, s) for i, s in begun if i not in settled]


def guess_all(proposer: Proposer, requests: Sequence[tuple], num_ranked: int) -> list[NextTokens | None | Exception]:
    """Each request's (proposer state, tokens, params) next tokens: ranked where the proposer can
    rank, else its own next token alone. None: the proposer has no next token there."""
    rank = getattr(proposer, "rank_batch", None)
    if rank is not None and num_ranked > 1:
        return rank(requests, num_ranked)
    out: list[NextTokens | None | Exception] = []
    for block in draft_all(proposer, [(state, tokens, 1, params) for state, tokens, params in requests]):
        if isinstance(block, Exception) or block.num_tokens == 0:
            out.append(block if isinstance(block, Exception) else None)
        else:
            out.append(NextTokens(int(block.token_ids[0]), (int(block.token_ids[0]),)))
    return out


def draft_all(proposer: Proposer, requests: Sequence[tuple]) -> list[DraftBlock | Exception]:
    """proposer.propose for each request (its arguments, a fifth one being a confidence stop that
    only a batching proposer takes: one without confidences cannot stop early), batched where the
    proposer can."""
    batched = getattr(proposer, "propose_batch", None)
    if batched is not None:
        return batched(requests)
    blocks: list[DraftBlock | Exception] = []
    for request in requests:
        try:
            blocks.append(proposer.propose(*request[:4]))
        except Exception as exc:  # noqa: BLE001
            blocks.append(exc)
    return blocks
