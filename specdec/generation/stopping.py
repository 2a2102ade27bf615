"""When to stop: EOS tokens, stop sequences (text), and the token budget.

A block of several tokens arrives per cycle, so a stop can fall inside it; check() says how many of
the new tokens to keep, and the caller rolls both caches back to that point.
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"


class StopChecker:
    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop_sequences: Sequence[str] = (),
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        if stop_sequences and detokenize is None:
            raise ValueError("stop sequences need a detokenizer")
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_sequences = [s for s in stop_sequences if s]
        self.detokenize = detokenize
        self.generated: list[int] = []

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def check(self, new_tokens: Sequence[int]) -> tuple[int, FinishReason | None]:
        """Return (how many of new_tokens to keep, why generation ends or None)."""
        for i, token in enumerate(new_tokens):
            self.generated.append(token)
            if token in self.eos_token_ids:
                return i + 1, FinishReason.EOS
            if self.stop_sequences and self._ends_with_stop():
                return i + 1, FinishReason.STOP_SEQUENCE
            if self.remaining <= 0:
                return i + 1, FinishReason.LENGTH
        return len(new_tokens), None

    def _ends_with_stop(self) -> bool:
        # Only the tail can newly contain a stop string; decoding a bounded tail keeps this O(1).
        longest = max(len(s) for s in self.stop_sequences)
        tail = self.detokenize(self.generated[-(longest + 8):])
        return any(s in tail for s in self.stop_sequences)


def trim_at_stop(text: str, stop_sequences: Sequence[str]) -> str:
    """The text a client sees: everything before the first stop sequence (which is not shown)."""
    cuts = [text.find(s) for s in stop_sequences if s and s in text]
    return text[: min(cuts)] if cuts else text
