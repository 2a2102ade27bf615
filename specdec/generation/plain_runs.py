"""Runs of plain decoding, each streamed from the target as one call (TargetAPI.decode_stream).

The loop decodes plainly in runs whose length it knows in advance: the whole budget without a draft,
the retry interval after a draft failure, the steps to the adaptive policy's next probe. A run is
one streamed call: the target starts each step while the last token travels, so a plain token
costs no round trip. A run the loop leaves before its end (a stop, a switch to speculation) is
cancelled; the target may then have committed a step more than was read, so the caller truncates.
"""

from __future__ import annotations

from typing import AsyncIterator, Collection

from specdec.engine.api import InnerDraft, TargetAPI


class PlainRuns:
    def __init__(self, target: TargetAPI, inner_draft: InnerDraft | None = None):
        self.target = target
        # The target drafts inside each step (TargetAPI.decode_stream), so a step of the run may
        # commit several tokens.
        self.inner_draft = inner_draft
        self._stream: AsyncIterator[list[int]] | None = None
        self._left = 0  # tokens the open run will still produce
        # The last step opened its run: it paid the stream's opening and a whole round trip, which
        # the run's later steps overlap (the target starts each while the last token travels).
        self.opened_run = False

    async def next(self, session_id: str, position: int, run: int, stop_token_ids: Collection[int]) -> list[int] | None:
        """The next step's tokens: of the open run, or of a new one of `run` steps from `position`.
        None: the target ended the open run early (another call of the session came first); close
        it, truncate to `position`, and ask again."""
        self.opened_run = self._stream is None
        if self._stream is None:
            extra = {"inner_draft": self.inner_draft} if self.inner_draft else {}
            self._stream = self.target.decode_stream(session_id, position, run, stop_token_ids=sorted(stop_token_ids),
                                                     **extra)
            self._left = run
        tokens = await anext(self._stream, None)
        if tokens is None:
            return None
        self._left -= len(tokens)
        if self._left <= 0 or tokens and tokens[-1] in stop_token_ids:
            await self._stream.aclose()  # done: the target ended it, nothing is left to undo
            self._stream, self._left = None, 0
        return tokens

    @property
    def left(self) -> int:
        """Tokens the open run will still produce (0: none open)."""
        return self._left

    async def close(self) -> bool:
        """End the open run, if any; True if it ended before its last step (the target may hold a
        step more than was read: truncate it to the caller's position)."""
        stream, self._stream = self._stream, None
        left, self._left = self._left, 0
        if stream is None:
            return False
        await stream.aclose()
        return left > 0
