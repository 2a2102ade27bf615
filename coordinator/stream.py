"""The messages of one Generate stream: replayed tokens, the turn's blocks once recorded, the end.

A block goes out only when its Redis write is done, so a client never holds a token that a
resumed session could contradict; a block whose write was refused is never sent (the turn says
why). Text is detokenized incrementally; when a stop sequence ends the turn, the text ends with
that stop sequence (whatever the last token adds after it is not sent).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import AsyncIterator, Sequence

from specdec.errors import SpecDecError
from specdec.generation.stats import SpeculationStats
from specdec.generation.stopping import FinishReason
from specdec.models.tokenizer import StreamDecoder

from coordinator.requests import Pool
from coordinator.turn import Block, Finished, Turn

_STATS_FIELDS = {f.name for f in fields(SpeculationStats)}


class StreamInterrupted(SpecDecError):
    """The coordinator stopped the stream (shutdown); the session is resumable (maps to UNAVAILABLE)."""


@dataclass(frozen=True)
class FinalInfo:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stats: SpeculationStats
    pool: Pool
    proposer: str
    num_draft_tokens: int


@dataclass(frozen=True)
class StreamMessage:
    session_id: str
    token_ids: list[int]
    text: str
    position: int  # committed length after token_ids
    final: FinalInfo | None = None


def stats_from_dict(values: dict) -> SpeculationStats:
    return SpeculationStats(**{k: v for k, v in values.items() if k in _STATS_FIELDS})


class TextStream:
    """Incremental text of a turn, cut at the end of the first stop sequence."""

    def __init__(self, decoder: StreamDecoder, stop_sequences: Sequence[str]):
        self.decoder = decoder
        self.stop_sequences = [s for s in stop_sequences if s]
        self._keep = max((len(s) for s in self.stop_sequences), default=1) - 1
        self._tail = ""  # the last characters sent: a stop sequence may straddle two messages
        self._closed = False

    def prime(self, token_ids: Sequence[int]) -> None:
        """Tokens whose text the client already has (a resumed stream)."""
        self._sent(self.decoder.push(list(token_ids)))

    def push(self, token_ids: Sequence[int]) -> str:
        return self._cut(self.decoder.push(list(token_ids)))

    def flush(self) -> str:
        return self._cut(self.decoder.flush())

    def _cut(self, piece: str) -> str:
        if self._closed:
            return ""
        window = self._tail + piece
        ends = [window.find(s) + len(s) for s in self.stop_sequences if s in window]
        if ends:
            piece = window[len(self._tail): min(ends)]
            self._closed = True
        self._sent(piece)
        return piece

    def _sent(self, piece: str) -> None:
        self._tail = (self._tail + piece)[-self._keep:] if self._keep else ""


class TurnStream:
    def __init__(self, session_id: str, text: TextStream, turn_start: int, position: int, pool: Pool,
                 num_draft_tokens: int):
        self.session_id = session_id
        self.text = text
        self.turn_start = turn_start
        self.position = position  # committed length the client knows of
        self.pool = pool
        self.num_draft_tokens = num_draft_tokens

    def replay(self, token_ids: Sequence[int]) -> StreamMessage | None:
        """Committed tokens the client missed (already recorded)."""
        if not token_ids:
            return None
        self.position += len(token_ids)
        return StreamMessage(self.session_id, list(token_ids), self.text.push(token_ids), self.position)

    async def follow(self, turn: Turn) -> AsyncIterator[StreamMessage]:
        while True:
            item = await turn.queue.get()
            if isinstance(item, Block):
                try:
                    await item.recorded
                except Exception:  # noqa: BLE001 - not recorded, so not sent; the turn reports why
                    continue
                self.position = item.position
                yield StreamMessage(self.session_id, item.token_ids, self.text.push(item.token_ids), item.position)
            elif isinstance(item, Finished):
                if item.interrupted:
                    raise StreamInterrupted(
                        f"the coordinator is shutting down; resume session {self.session_id!r} "
                        f"from position {self.position}"
                    )
                yield self.final(item.reason, item.stats, item.proposer)
                return
            else:
                raise item.error

    def final(self, reason: FinishReason, stats: SpeculationStats, proposer: str) -> StreamMessage:
        drafted = self.pool is Pool.SPECULATIVE and proposer not in ("", "none")
        info = FinalInfo(reason, self.turn_start, self.position - self.turn_start, stats, self.pool,
                         proposer if drafted else "", self.num_draft_tokens if drafted else 0)
        return StreamMessage(self.session_id, [], self.text.flush(), self.position, info)
