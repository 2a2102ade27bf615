"""Attention of the native backend's eager forwards over the slot KV cache, with PyTorch's SDPA.

The cache is [slots, KV heads, ctx + 1, head_dim] per layer (kv_cache.py); a forward's rows attend to
their own slots' first key_len columns under the mask the forward planned (llama_batch.ForwardBatch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from specdec.models.llama_batch import ForwardBatch


def gather_slots(cache: torch.Tensor, b: "ForwardBatch") -> torch.Tensor:
    """The first key_len columns of the batch's slots: [B, KV, L, D] (a view when the slots are a range)."""
    head = cache[:, :, : b.key_len]
    if b.slot_index is None:
        return head[b.first_slot : b.first_slot + b.num_rows]
    return head.index_select(0, b.slot_index)


def attention_in_place(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, b: "ForwardBatch") -> torch.Tensor:
    """Attention of q [tokens, H, D] (each row's T tokens, or with b.packed_index its own tokens only)
    row by row, each over its own slot's keys and values where the cache holds them ([slots, KV,
    ctx + 1, D]), up to the row's own length; returns [tokens, H * D]. On a CPU, gathering the
    rows' slots into one [B, KV, L, D] tensor copied the batch's whole cache every layer: 16 decode
    rows at contexts of 250-400 took 143 ms a step against 112 ms for the same rows in one slot range
    (a view). Row by row it is the masked batched arithmetic, the padding left out. A row of one token
    (a decode) attends to every key up to its own length, so it needs no mask (SDPA converts one each call)."""
    out, first = [], 0
    for i, (slot, key_len, num_tokens) in enumerate(zip(b.slots, b.row_key_lens, b.row_tokens)):
        width = num_tokens if b.packed_index is not None else b.width
        q_row = q[first : first + width].transpose(0, 1)[None]  # [1, H, width, D]
        first += width
        mask = None if b.mask is None or num_tokens == 1 else b.mask[i : i + 1, :, :width, :key_len]
        row = F.scaled_dot_product_attention(
            q_row, keys[slot : slot + 1, :, :key_len], values[slot : slot + 1, :, :key_len],
            attn_mask=mask, is_causal=b.is_causal, enable_gqa=q.shape[1] != keys.shape[1])  # [1, H, width, D]
        out.append(row[0].transpose(0, 1).reshape(width, -1))
    return torch.cat(out)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [B, H, T, D] over keys/values [B, KV, L, D] with the H / KV query heads that share
    a KV head stacked as one longer query block [B, KV, G * T, D]: the arithmetic of repeating the
    keys/values per query head (head h reads KV head h // G, as transformers' repeat_kv) without
    materialising the repeat. mask [B, 1, T, L] or None. Returns [B, H, T, D]."""
    B, H, T, D = q.shape
    kv_heads, L = keys.shape[1], keys.shape[2]
    groups = H // kv_heads
    q = q.reshape(B, kv_heads, groups * T, D)
    if mask is not None:
        mask = mask[:, :, None].expand(B, 1, groups, T, L).reshape(B, 1, groups * T, L)
    # reshape, not view: the memory-efficient kernel may return a transposed layout
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).reshape(B, H, T, D)


def attention_per_token(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: np.ndarray,
                        key_lens: np.ndarray) -> torch.Tensor:
    """q [tokens, H, D]; token i attends alone to the first key_lens[i] keys of slot slots[i], as a
    one-token decode of it would, whatever step it is in (batch-invariant attention where the compiled
    CPU loop does not apply: half precision). Returns [tokens, H * D]."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    out = [F.scaled_dot_product_attention(q[t][None, :, None], keys[s:s + 1, :, :n], values[s:s + 1, :, :n],
                                          enable_gqa=heads != kv_heads).reshape(1, -1)
           for t, (s, n) in enumerate(zip(slots.tolist(), key_lens.tolist()))]
    return torch.cat(out)
