"""A preallocated pool of KV cache slots, one slot per token sequence (gpt-fast style, plus slots).

All keys and values live in one tensor allocated up front, so memory use is known at start-up and a
forward never allocates cache memory. A slot is one sequence; its length is a plain integer, so
truncation (speculative rollback) is O(1): only the length moves and stale entries are overwritten by
later writes. Each slot has one extra column at index max_context, a scratch position where padded
tokens of a batched forward write their keys/values: shapes stay static and no real entry is touched.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.errors import CacheFull, ContextOverflow, InvalidArgument


class SlotKVCache:
    """Keys/values for `num_slots` sequences of up to `max_context` tokens each."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_context: int,
        num_slots: int | None = None,
        budget_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if max_context < 1:
            raise InvalidArgument(f"max_context must be >= 1, got {max_context}")
        if num_slots is None:
            if budget_bytes is None:
                raise InvalidArgument("give num_slots or budget_bytes")
            num_slots = self.slots_for_budget(budget_bytes, num_layers, num_kv_heads, head_dim, max_context, dtype)
        if num_slots < 1:
            raise InvalidArgument(f"num_slots must be >= 1, got {num_slots}")
        self.max_context = max_context
        self.num_slots = num_slots
        # [layers, k/v, slots, kv_heads, max_context + 1 (scratch), head_dim]. Zeros, not empty: attention
        # multiplies masked-out values by a zero weight, and 0 * NaN from uninitialised memory is NaN.
        self.kv = torch.zeros(
            (num_layers, 2, num_slots, num_kv_heads, max_context + 1, head_dim), dtype=dtype, device=device
        )
        self._lengths = [0] * num_slots
        self._allocated = [False] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, max_context: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * num_kv_heads * (max_context + 1) * head_dim * element

    @classmethod
    def slots_for_budget(
        cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, max_context: int,
        dtype: torch.dtype,
    ) -> int:
        per_slot = cls.bytes_per_slot(num_layers, num_kv_heads, head_dim, max_context, dtype)
        slots = budget_bytes // per_slot
        if slots < 1:
            raise InvalidArgument(
                f"a KV budget of {budget_bytes} bytes holds no slot: one slot of {max_context} tokens "
                f"needs {per_slot} bytes; raise the budget or lower max_context"
            )
        return int(slots)

    # Slot bookkeeping --------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFull(
                f"all {self.num_slots} KV cache slots are in use; free a session first "
                f"or start the service with more slots (or a larger KV budget)"
            )
        slot = self._free.pop()
        self._allocated[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check_range(slot)
        if self._allocated[slot]:
            self._allocated[slot] = False
            self._lengths[slot] = 0
            self._free.append(slot)

    def length(self, slot: int) -> int:
        self._check_allocated(slot)
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        current = self.length(slot)
        if not 0 <= length <= current:
            raise InvalidArgument(f"slot {slot} holds {current} tokens; truncate to 0..{current}, not {length}")
        self._lengths[slot] = length

    def fork(self, src: int, dst: int, length: int) -> None:
        if not 0 <= length <= self.length(src):
            raise InvalidArgument(
                f"slot {src} holds {self._lengths[src]} tokens; fork 0..{self._lengths[src]}, not {length}"
            )
        self._check_allocated(dst)
        if src != dst:
            # One copy over all layers, keys and values: [layers, 2, kv_heads, length, head_dim].
            self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]
        self._lengths[dst] = length

    # Used by the forward pass ------------------------------------------------------------------------

    def check_append(self, slots: Sequence[int], num_new: Sequence[int]) -> list[int]:
        """Validate an append of num_new[i] tokens to slots[i]; return the slots' current lengths."""
        if len(set(slots)) != len(slots):
            raise InvalidArgument(f"a slot may appear once per forward; got slots {list(slots)}")
        starts = []
        for slot, n in zip(slots, num_new):
            start = self.length(slot)
            if start + n > self.max_context:
                raise ContextOverflow(
                    f"slot {slot} holds {start} tokens; appending {n} would pass max_context "
                    f"{self.max_context} (at most {self.max_context - start} more fit)"
                )
            starts.append(start)
        return starts

    def advance(self, slots: Sequence[int], num_new: Sequence[int]) -> None:
        for slot, n in zip(slots, num_new):
            self._lengths[slot] += n

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer, each [slots, kv_heads, max_context + 1, head_dim]."""
        return self.kv[index, 0], self.kv[index, 1]

    def _check_range(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"slot {slot} does not exist; slots are 0..{self.num_slots - 1}")

    def _check_allocated(self, slot: int) -> None:
        self._check_range(slot)
        if not self._allocated[slot]:
            raise InvalidArgument(f"slot {slot} is not allocated; call allocate() first")
