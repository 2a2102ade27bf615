"""A draft session's live proposals: the drafted blocks whose verify outcome the caller has not
applied yet (draft.proto's file comment is the protocol).

Live proposals form a chain: each one's span starts where its parent's ends. Sequential drafting
keeps one (the block being verified); pipelined drafting adds speculative children, each drafted on
the assumption that its parent is fully accepted and the target's next token equals the draft's own
guess, which sits at the child's first span position. A message naming a proposal discards its
descendants (a miss drops the speculative child with its guess); a message naming one that is no
longer live is refused, so a lost or late message can never build on tokens the draft discarded.

The chain is bounded: past `max_live` the oldest proposal is settled (its tokens count as
committed, the caller can no longer roll back into it). A caller that keeps verifying hits names
only the newest ones, so settling the oldest costs it nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import EpochMismatch, InvalidArgument, PositionMismatch

DEFAULT_MAX_LIVE_PROPOSALS = 4  # one being verified, its speculative child, and slack for a deeper pipeline


@dataclass(frozen=True)
class LiveProposal:
    epoch: int
    start: int  # first position of the span: the first drafted token, or the guess of a speculative one
    end: int  # one past the last drafted token
    speculative: bool = False
    guessed_token_id: int | None = None  # a speculative proposal's guess at `start`; None: no guess


@dataclass
class ProposalChain:
    """The live proposals of one session, oldest first, and the epoch counter."""

    session_id: str
    max_live: int = DEFAULT_MAX_LIVE_PROPOSALS
    live: list[LiveProposal] = field(default_factory=list)
    issued: int = 0  # the newest epoch handed out; epochs increase and are never 0

    @property
    def latest_epoch(self) -> int:
        """The newest live proposal's epoch, 0 if none (what a refusal reports)."""
        return self.live[-1].epoch if self.live else 0

    def index_of(self, parent_epoch: int) -> int:
        """Where the live proposal `parent_epoch` sits; EpochMismatch if it is not live."""
        for index, proposal in enumerate(self.live):
            if proposal.epoch == parent_epoch:
                return index
        raise EpochMismatch(self.session_id, expected=parent_epoch, actual=self.latest_epoch,
                            live=[p.epoch for p in self.live])

    def check_keep(self, parent_epoch: int, keep_position: int, speculative: bool,
                   append_token_ids: tuple[int, ...] | list[int], length: int) -> LiveProposal:
        """Validate a message built on a live parent (`length`: the draft's whole sequence, for
        the refusal); return the parent."""
        return self.check_keep_on(self.live[self.index_of(parent_epoch)], keep_position, speculative,
                                  append_token_ids, length)

    def check_keep_on(self, parent: LiveProposal, keep_position: int, speculative: bool,
                      append_token_ids: tuple[int, ...] | list[int], length: int) -> LiveProposal:
        """check_keep for a given parent (also an alternative branch, specdec.engine.alternatives)."""
        if speculative:
            if append_token_ids:
                raise InvalidArgument("a speculative Propose appends no tokens: it assumes the parent's "
                                      f"full acceptance and guesses the next token, got {list(append_token_ids)}")
            if keep_position != parent.end:
                raise InvalidArgument(
                    f"a speculative Propose keeps the whole parent: keep_position must be {parent.end} "
                    f"(the end of epoch {parent.epoch}'s span), got {keep_position}")
        elif not parent.start <= keep_position <= parent.end:
            raise PositionMismatch(
                self.session_id, expected=keep_position, actual=length,
                detail=f"keep_position must lie in epoch {parent.epoch}'s span [{parent.start}, {parent.end}]")
        return parent

    def drop_after(self, parent_epoch: int) -> None:
        """Discard every proposal built on `parent_epoch` (it stays live)."""
        del self.live[self.index_of(parent_epoch) + 1:]

    def clear(self) -> None:
        self.live.clear()

    def new_epoch(self) -> int:
        self.issued += 1
        return self.issued

    def add(self, start: int, end: int, speculative: bool = False,
            guessed_token_id: int | None = None) -> tuple[LiveProposal, int | None]:
        """Record a new newest proposal; return it and, when the oldest had to be settled to stay
        within max_live, the position up to which tokens are now committed."""
        proposal = LiveProposal(self.new_epoch(), start, end, speculative, guessed_token_id)
        return proposal, self.append(proposal)

    def append(self, proposal: LiveProposal) -> int | None:
        """Make an issued proposal the newest live one (an adopted alternative); see add()."""
        self.live.append(proposal)
        settled_to = None
        while len(self.live) > self.max_live:
            self.live.pop(0)
            settled_to = self.live[0].start
        return settled_to
