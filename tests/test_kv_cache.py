"""The slot pool on its own: allocation, O(1) truncate, fork, budgets, context checks."""

import pytest
import torch

from specdec.errors import CacheFull, ContextOverflow, InvalidArgument
from specdec.models.kv_cache import SlotKVCache


def make_cache(num_slots=3, max_context=16, **kwargs) -> SlotKVCache:
    return SlotKVCache(
        num_layers=2, num_kv_heads=2, head_dim=4, max_context=max_context, num_slots=num_slots, **kwargs
    )


def test_allocate_until_full_then_free_and_reuse():
    cache = make_cache(num_slots=2)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free_slots == 0
    with pytest.raises(CacheFull, match="all 2 KV cache slots are in use"):
        cache.allocate()
    cache.free(a)
    cache.free(a)  # idempotent
    assert cache.num_free_slots == 1
    assert cache.allocate() == a and cache.length(a) == 0


def test_unallocated_and_unknown_slots_are_rejected():
    cache = make_cache()
    with pytest.raises(InvalidArgument, match="not allocated"):
        cache.length(0)
    with pytest.raises(InvalidArgument, match="does not exist"):
        cache.free(7)


def test_truncate_moves_only_the_length():
    cache = make_cache()
    slot = cache.allocate()
    cache.advance([slot], [10])
    cache.kv[:, :, slot, :, :10] = 1.0
    cache.truncate(slot, 4)
    assert cache.length(slot) == 4
    assert bool((cache.kv[:, :, slot, :, 4:10] == 1.0).all())  # stale entries stay until overwritten
    with pytest.raises(InvalidArgument, match="truncate to 0..4"):
        cache.truncate(slot, 5)


def test_fork_copies_the_prefix_only():
    cache = make_cache()
    src, dst = cache.allocate(), cache.allocate()
    cache.advance([src], [8])
    cache.kv[:, :, src, :, :8] = torch.arange(8.0)[:, None]
    cache.fork(src, dst, 5)
    assert cache.length(dst) == 5 and cache.length(src) == 8
    assert torch.equal(cache.kv[:, :, dst, :, :5], cache.kv[:, :, src, :, :5])
    assert bool((cache.kv[:, :, dst, :, 5:8] == 0).all())
    with pytest.raises(InvalidArgument):
        cache.fork(src, dst, 9)


def test_budget_decides_the_number_of_slots():
    per_slot = SlotKVCache.bytes_per_slot(2, 2, 4, 16, torch.float32)
    assert per_slot == 2 * 2 * 2 * 17 * 4 * 4
    cache = make_cache(num_slots=None, budget_bytes=3 * per_slot + 5)
    assert cache.num_slots == 3
    with pytest.raises(InvalidArgument, match="holds no slot"):
        make_cache(num_slots=None, budget_bytes=per_slot - 1)


def test_check_append_refuses_overflow_and_duplicates():
    cache = make_cache(max_context=16)
    a, b = cache.allocate(), cache.allocate()
    cache.advance([a], [14])
    assert cache.check_append([a, b], [2, 16]) == [14, 0]
    with pytest.raises(ContextOverflow, match="at most 2 more fit"):
        cache.check_append([a], [3])
    with pytest.raises(InvalidArgument, match="once per forward"):
        cache.check_append([a, a], [1, 1])
