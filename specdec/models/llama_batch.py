"""How one eager forward of the native Llama backend (llama.py) lays out its tokens: the index tensors
built once on the host per forward and shared by every layer (ForwardBatch), and the rotary tables.

Rows are right-padded to the longest; each token's position is its slot's length plus its offset in the
row. Padded tokens take their row's last real position (so their attention is well defined) and write
their keys/values into the cache's scratch column, which no mask admits. Rows of different lengths are
packed: only the real tokens go through the projections, and attention alone sees the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specdec.models import cpu_attention
from specdec.models.llama_config import LlamaConfig


@dataclass
class ForwardBatch:
    """Index tensors describing one batched forward; built once, used by every layer."""

    num_rows: int
    width: int  # padded tokens per row (T)
    key_len: int  # keys attended per row: the longest row's new length (L)
    tokens: torch.Tensor  # [B * T] token ids, pads are 0
    cos: torch.Tensor  # [B * T, 1, head_dim]
    sin: torch.Tensor  # [B * T, 1, head_dim], sign of rotate-half folded in
    write_index: torch.Tensor  # [B * T * kv_heads] flat index into a layer's [slots*kv_heads*(ctx+1), D]
    slot_index: torch.Tensor | None  # [B] slots to gather; None when the rows are a contiguous slot range
    first_slot: int
    mask: torch.Tensor | None  # [B, 1, T, L] bool, True = attend; None when nothing needs masking
    is_causal: bool  # a single fresh prefill: SDPA's own causal mask is exact
    logit_rows: torch.Tensor | None  # [N] flat token indices whose logits are returned (None: all)
    # Host-side, for attention slot by slot (attention_in_place): each row's slot and keys (start + length).
    slots: tuple[int, ...] = ()
    row_key_lens: tuple[int, ...] = ()
    row_tokens: tuple[int, ...] = ()  # each row's own tokens (the rest of the width is padding)
    # Rows of different lengths (a verify among decodes): the flat [B * T] positions of the real
    # tokens [N]. Every per-token tensor above then holds the N real tokens only, and attention alone
    # sees the padded [B, T] layout (see LlamaModel._attention). None: every row is T tokens long.
    packed_index: torch.Tensor | None = None
    # CPU decode and verify steps (cpu_attention.py): each query token's slot and key count, host-side.
    query_slots: np.ndarray | None = None
    query_key_lens: np.ndarray | None = None


def plan_batch(
    slots: list[int], rows: Sequence[Sequence[int]], starts: list[int], lengths: list[int], num_logits: list[int],
    *, kv_heads: int, max_context: int, cos: torch.Tensor, sin: torch.Tensor, device: torch.device,
    batch_invariant: bool, compiled_attention: bool,
) -> ForwardBatch:
    """The ForwardBatch of rows (token ids) appended to slots whose current lengths are starts;
    num_logits[i]: how many of row i's last tokens are scored. cos / sin: rope_tables' rows.
    compiled_attention: decode and verify tokens may attend through cpu_attention's compiled loop."""
    B, T = len(rows), max(lengths)
    tokens, positions, write_index, slot_t, logit_rows = host_indices(
        slots, rows, starts, lengths, num_logits, B, T, kv_heads, max_context)
    key_len = max(s + n for s, n in zip(starts, lengths))
    single_decode = B == 1 and T == 1
    # Batch-invariant: every forward masks explicitly, so that on CUDA every token goes through the
    # one kernel allowed (SDPA's causal flag and an unmasked decode may pick others).
    fresh_prefill = B == 1 and starts[0] == 0 and not batch_invariant
    mask = None
    if not (single_decode or fresh_prefill) or batch_invariant:
        mask = (torch.arange(key_len) <= positions[:, :, None])[:, None]  # [B, 1, T, L]
    contiguous = slots == list(range(slots[0], slots[0] + B))
    tokens, positions, write_index = tokens.view(-1), positions.view(-1), write_index.view(B * T, -1)
    logit_index = torch.tensor(logit_rows, dtype=torch.long)
    packed = None
    if sum(lengths) < B * T:
        # Only the real tokens go through the projections and the MLP: padded, one verify of 5
        # tokens among 15 decodes cost a CPU step 281 ms against 100 ms for the decodes alone
        # (docs/BENCHMARKS.md, round 28). The cache's write index, rope tables and the logit rows
        # follow the packing; attention runs row by row on each row's own tokens (in place, on a
        # CPU) or scatters q into the padded layout and gathers the real tokens back.
        real = (torch.arange(T) < torch.as_tensor(lengths)[:, None]).view(-1)  # [B * T]
        packed = real.nonzero().squeeze(1)
        tokens, positions, write_index = tokens[packed], positions[packed], write_index[packed]
        logit_index = (real.cumsum(0) - 1)[logit_index]  # a real token's flat index -> its packed one
    query_slots = query_key_lens = None
    # Batch-invariant on a CPU: every token attends alone (the compiled loop, else SDPA token by
    # token), so that no kernel tiles its queries by the step's width or threads.
    if (compiled_attention and T <= cpu_attention.MAX_QUERY_TOKENS
            and torch.get_num_threads() <= cpu_attention.MAX_THREADS) or (batch_invariant and device.type == "cpu"):
        query_slots, query_key_lens = cpu_attention.query_layout(slots, starts, lengths)
    positions = positions.to(device)
    return ForwardBatch(
        num_rows=B, width=T, key_len=key_len, tokens=tokens.to(device),
        cos=cos[positions][:, None], sin=sin[positions][:, None],
        write_index=write_index.reshape(-1).to(device), slot_index=None if contiguous else slot_t.to(device),
        first_slot=slots[0], mask=None if mask is None else mask.to(device),
        is_causal=fresh_prefill and T > 1, logit_rows=logit_index.to(device),
        slots=tuple(slots), row_key_lens=tuple(s + n for s, n in zip(starts, lengths)), row_tokens=tuple(lengths),
        packed_index=None if packed is None else packed.to(device),
        query_slots=query_slots, query_key_lens=query_key_lens,
    )


def host_indices(
    slots: Sequence[int], rows: Sequence[Sequence[int]], starts: Sequence[int], lengths: Sequence[int],
    num_logits: Sequence[int], num_rows: int, width: int, kv_heads: int, ctx: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The host-side indices of a forward over num_rows x width tokens (rows past len(rows) are padding:
    token 0 at position 0 of slot 0, written to the scratch column like every pad). Returns tokens and
    positions [num_rows, width], write_index [num_rows, width, kv_heads] (the flat index of (slot,
    kv_head, column) in a layer's [slots, KV, ctx + 1, D] viewed as [-1, D]), the slots [num_rows] and
    the flat indices of the tokens whose logits are returned."""
    tokens = torch.zeros(num_rows, width, dtype=torch.long)
    positions = torch.zeros(num_rows, width, dtype=torch.long)  # rope / mask position of every token
    write_pos = torch.full((num_rows, width), ctx, dtype=torch.long)  # cache column; pads -> scratch column
    logit_rows: list[int] = []
    for i, (row, start, n, k) in enumerate(zip(rows, starts, lengths, num_logits)):
        tokens[i, :n] = torch.as_tensor(row, dtype=torch.long)
        positions[i] = torch.arange(start, start + width).clamp_(max=start + n - 1)
        write_pos[i, :n] = positions[i, :n]
        logit_rows.extend(range(i * width + n - k, i * width + n))
    slot_t = torch.zeros(num_rows, dtype=torch.long)
    slot_t[: len(slots)] = torch.as_tensor(slots, dtype=torch.long)
    write_index = (slot_t[:, None, None] * kv_heads + torch.arange(kv_heads)) * (ctx + 1) + write_pos[:, :, None]
    return tokens, positions, write_index, slot_t, logit_rows


def rope_tables(cfg: LlamaConfig, length: int, dtype: torch.dtype, device: torch.device):
    """cos and sign-folded sin for positions 0..length-1: [length, head_dim] each."""
    inv_freq = cfg.rope_inv_freq()  # [D / 2], float32
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq  # [length, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    half = cfg.head_dim // 2
    # rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1] * half + [1] * half
    sign = torch.cat((-torch.ones(half), torch.ones(half)))
    return emb.cos().to(dtype).to(device), (emb.sin() * sign).to(dtype).to(device)
