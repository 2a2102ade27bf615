"""Continuous batching on the draft: the Propose work of many sessions drafted together.

run_propose_batch(engine, works) does what engine.propose does one session at a time: each item's
accept/rollback message is checked and applied on its own (a bad item gets its own exception and
never fails the others), then every proposal is drafted at once. A proposer with propose_batch
(the draft model) runs step t of every proposal still drafting in one forward, each row sampled
with its own parameters at its own position, so the blocks equal the sequential ones; any other
proposer (n-gram lookup: no forward to share) drafts one session after the other. A session named
twice runs its items in order, in successive sub-batches. Runs on the one model thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from specdec.engine.api import Proposal
from specdec.engine.batch import split_by_session
from specdec.engine.draft import DraftEngine
from specdec.proposers.base import Proposer
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
                                             w.num_draft_tokens, w.parent_epoch, w.speculative)
            except Exception as exc:  # noqa: BLE001 - the item's own error, returned to its caller
                results[index] = exc
                continue
            begun.append((index, state))
        begun = _place_guesses(engine, works, begun, results)
        requests = [(s.proposer_state, s.tokens, works[i].num_draft_tokens, s.params) for i, s in begun]
        for (index, state), block in zip(begun, draft_all(engine.proposer, requests)):
            if isinstance(block, Exception):
                engine.abort_propose(state)
                results[index] = block
            else:
                results[index] = engine.finish_propose(state, block)
    return results  # type: ignore[return-value]


def _place_guesses(engine: DraftEngine, works: Sequence[ProposeWork], begun: list, results: list) -> list:
    """Speculative items first draft one token, their guess of the target's next token, in one
    batched pass; the blocks after the guesses are drafted with everything else. Returns the items
    left to draft (an item without a guess is finished empty here, one whose guess failed gets
    its exception)."""
    speculative = [(i, s) for i, s in begun if works[i].speculative]
    if not speculative:
        return begun
    guesses = draft_all(engine.proposer, [(s.proposer_state, s.tokens, 1, s.params) for _, s in speculative])
    settled = set()
    for (index, state), guess in zip(speculative, guesses):
        if isinstance(guess, Exception):
            engine.abort_propose(state)
            results[index] = guess
            settled.add(index)
        elif not engine.place_guess(state, guess):
            results[index] = engine.finish_propose(state, DraftBlock.empty())
            settled.add(index)
    return [(i, s) for i, s in begun if i not in settled]


def draft_all(proposer: Proposer, requests: Sequence[tuple]) -> list[DraftBlock | Exception]:
    """proposer.propose for each request (its arguments), batched where the proposer can."""
    batched = getattr(proposer, "propose_batch", None)
    if batched is not None:
        return batched(requests)
    blocks: list[DraftBlock | Exception] = []
    for request in requests:
        try:
            blocks.append(proposer.propose(*request))
        except Exception as exc:  # noqa: BLE001
            blocks.append(exc)
    return blocks
