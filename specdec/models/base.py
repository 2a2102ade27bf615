"""The interface every model backend implements, so engines never know which backend they drive.

A backend owns a pool of KV cache *slots*. A slot holds the keys/values of one token sequence; its
*length* is how many tokens it holds. forward() appends tokens to each slot at its current length
and returns logits; truncate() moves the length back in O(1) (stale entries are overwritten later,
gpt-fast style); fork() copies a prefix into another slot (a speculative branch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what the user asked for (path or registry name)
    architecture: str  # e.g. "llama", "qwen2", "mistral"
    vocab_size: int  # rows of the output logits
    max_context: int  # tokens a slot can hold
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu" | "cuda:0" ...
    backend: str  # "native" | "hf"
    # Every row of a batched forward computes what it computes alone (specdec.models.batch_invariant).
    batch_invariant: bool = False


class CausalLM(Protocol):
    info: ModelInfo
    # True: a batched forward computes only each row's own tokens, so its cost grows with the tokens
    # fed; False: every row is padded to the widest (the goodput trimmer prices drafts by this).
    packs_ragged_rows: bool

    @property
    def num_slots(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    def allocate(self) -> int:
        """Return a free slot of length 0; raise specdec.errors.CacheFull when none is left."""

    def free(self, slot: int) -> None:
        """Return a slot to the pool (idempotent)."""

    def length(self, slot: int) -> int: ...

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens (length <= current length). O(1)."""

    def fork(self, src: int, dst: int, length: int) -> None:
        """Make slot dst hold the first `length` tokens of slot src."""

    def forward(
        self,
        slots: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        num_logits: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """Append token_ids[i] to slots[i] (rows may differ in length and position) in one batch.

        Returns one float32 tensor per row of shape [num_logits[i], vocab]: the logits after each of
        the row's last num_logits[i] tokens (default: all of them). Prefill asks for 1, a verify of
        k drafted tokens for k + 1. Raises ContextOverflow if a slot would pass max_context.
        """
