"""The static-shape layers as torch.compile'd pieces (opt-in: LlamaModel(compile_layers=True)).

Under a CUDA graph a decode step costs its kernels' GPU time. The eager layer is ~25 kernels (norms,
RoPE, two cache writes, two slot gathers, SDPA, reshapes, three products, SwiGLU); at the Llama-3-8B
shape, decode at context 512, 2.2 ms of a 6.4 ms graph went to kernels other than the products,
1.1 ms of it to SDPA (cuDNN, 19 us a layer for 4 query rows) and the two gathers. Per layer here:

- _pre_attention: RMSNorm, the qkv product, RoPE, both cache writes, the grouped-query layout;
- _attention: scores, softmax and weighted sum read each row's slot in place (no gathered copy);
- _post_attention: output product + residual, RMSNorm, gate/up, SwiGLU, down + residual.

Inductor fuses these into ~12 kernels a layer. With coordinate-descent tuning it also turns a one-row
product into a Triton reduction (gpt-fast's recipe; torch/_inductor/decomposition.py, mm) that
streams weights stored [out, in] (the "dense-nt" linear kernel) at ~90% of copy bandwidth, against
~70% for [in, out]. The pre/post pieces compile once per token count (B * T), the attention piece
once per (token count, key bucket); each compiled piece serves every layer. The attention mask is
built once per forward. Measured (docs/BENCHMARKS.md, scripts/bench_gpu_step.py): the 8B decode
step from 6.4 ms to 4.5-4.8 ms on an H200 (six compilations; without checking all tuning
directions 4.5-5.9 ms, see COMPILE_OPTIONS); ~25-65 s to compile the first shape.

compile=False runs the same functions eagerly (CPU tests check them against the normal forward).
Compilation happens on the first call of each shape, in the graph runner's warm-up before capture.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.errors import InvalidArgument

if TYPE_CHECKING:
    from specdec.models.llama import LlamaModel
    from specdec.models.llama_batch import ForwardBatch

# Inductor settings for these pieces only (not global): tuned one-row reductions, no inductor graphs
# (cuda_graphs.py captures the whole forward itself). Coordinate descent alone moves one field (block
# size, warps) at a time and stops at the first configuration that no single move improves; which one
# that is depends on noise in its timings (8B decode step 4.5-5.9 ms over eight compilations on an
# H200). Checking all directions once it stops (every combination of neighbouring values) gave
# 4.5-4.8 ms over six, at ~25-65 s of compilation instead of ~15-20 (docs/BENCHMARKS.md).
COMPILE_OPTIONS = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True,
                   "triton.cudagraphs": False}
# One compiled entry per (model, token count[, key bucket]): raise Dynamo's per-function limit of 8
# while compiling (guards are evaluated only outside graph replays, so many entries cost nothing).
RECOMPILE_LIMIT = 256


class Products:
    """The matrix products of the compiled pieces: a plain product plus a separate add, which inductor
    fuses (addmm would stay a cuBLAS call). out_in: weights stored [out, in] ("dense-nt")."""

    def __init__(self, out_in: bool):
        self.out_in = out_in

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, w) if self.out_in else torch.mm(x, w)
        return y if bias is None else y + bias

    def add(self, residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return residual + self(x, w)


def _pre_attention(
    x: torch.Tensor, norm: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None, cos: torch.Tensor,
    sin: torch.Tensor, kv: torch.Tensor, write_index: torch.Tensor, rows: int, heads: int, kv_heads: int,
    eps: float, linear,
) -> torch.Tensor:
    """x [B * T, hidden]; kv: this layer's cache flat, [2 * slots * KV * (ctx + 1), D] (keys, then
    values), written in place at write_index [B * T * KV]. Returns the rotated queries as grouped
    attention wants them, [B, KV, G * T, D] (query head h reads KV head h // G, as
    slot_attention.grouped_attention). The cache is passed flat, not as a view made here: a write through a
    view of an input compiled to a copy of the whole layer cache."""
    head_dim = cos.shape[-1]
    h = F.rms_norm(x, (x.shape[-1],), norm, eps)
    qkv = linear(h, wqkv, bqkv).view(-1, heads + 2 * kv_heads, head_dim)  # [B * T, H + 2 KV, D]
    qk = qkv[:, : heads + kv_heads]
    qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin  # [B * T, H + KV, D]
    half = kv.shape[0] // 2
    kv.index_put_((write_index,), qk[:, heads:].reshape(-1, head_dim))
    kv.index_put_((write_index + half,), qkv[:, heads + kv_heads :].reshape(-1, head_dim))
    width = x.shape[0] // rows
    q = qk[:, :heads].reshape(rows, width, heads, head_dim).transpose(1, 2)  # [B, H, T, D]
    return q.reshape(rows, kv_heads, (heads // kv_heads) * width, head_dim).contiguous()


def _attention(q: torch.Tensor, kv: torch.Tensor, slot_index: torch.Tensor, mask: torch.Tensor,
               columns: int) -> torch.Tensor:
    """Attention of each row over its slot, read in place.

    q [B, KV, G * T, D]; kv: this layer's cache flat (see _pre_attention), columns = ctx + 1 per
    slot; slot_index [B]; mask [B, 1, G * T, L] additive (0 / -inf). Returns [B, KV, G * T, D].
    Written as broadcast products and sums rather than matmuls: compiled, the slot lookup becomes an
    indexed load inside the score and value reductions, so no gathered copy of the keys/values is made
    (a matmul would need one). Scores, softmax and the weighted sum run in float32."""
    kv_heads, head_dim = q.shape[1], q.shape[3]
    cache = kv.view(2, -1, kv_heads, columns, head_dim)
    keys = cache[0].index_select(0, slot_index)[:, :, None, : mask.shape[-1]].float()  # [B, KV, 1, L, D]
    values = cache[1].index_select(0, slot_index)[:, :, None, : mask.shape[-1]].float()
    scores = (q.float()[:, :, :, None] * keys).sum(-1) * head_dim**-0.5 + mask  # [B, KV, G * T, L]
    weights = scores.softmax(-1)
    return (weights[..., None] * values).sum(-2).to(q.dtype)  # [B, KV, G * T, D]


def _post_attention(
    x: torch.Tensor, attn: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None, norm: torch.Tensor,
    w_gate_up: torch.Tensor, b_gate_up: torch.Tensor | None, w_down: torch.Tensor, b_down: torch.Tensor | None,
    heads: int, eps: float, linear,
) -> torch.Tensor:
    """x [B * T, hidden] (the residual stream); attn [B, KV, G * T, D] from _attention. Returns the next x."""
    rows, head_dim = attn.shape[0], attn.shape[3]
    attn = attn.reshape(rows, heads, -1, head_dim).transpose(1, 2).reshape(-1, heads * head_dim)  # [B * T, H * D]
    x = linear.add(x, attn, wo)
    if bo is not None:
        x = x + bo
    h = F.rms_norm(x, (x.shape[-1],), norm, eps)
    gate, up = linear(h, w_gate_up, b_gate_up).chunk(2, dim=-1)  # [B * T, I] each
    x = linear.add(x, F.silu(gate) * up, w_down)
    return x if b_down is None else x + b_down


class CompiledLayers:
    """The layer stack for StaticForward.run: three compiled pieces per layer."""

    def __init__(self, model: "LlamaModel", compile: bool, options: dict | None = None):
        self.model = model
        self.compile = compile
        self.compiled_shapes: set[tuple[int, int]] = set()  # (B * T, L) seen, i.e. compiled
        # Uncompiled: the model's own kernels (the normal forward's products, e.g. oneDNN on a CPU).
        self.linear = model.linear
        self.pieces = _pre_attention, _attention, _post_attention
        if compile:
            if model.linear.name not in ("dense", "dense-nt"):
                raise InvalidArgument(
                    f"compiled layers need the dense or dense-nt linear kernel, not {model.linear.name}")
            self.linear = Products(out_in=model.linear.name == "dense-nt")
            settings = dict(fullgraph=True, dynamic=False, options=COMPILE_OPTIONS if options is None else options)
            self.pieces = tuple(torch.compile(piece, **settings) for piece in self.pieces)

    def __call__(self, x: torch.Tensor, b: "ForwardBatch") -> torch.Tensor:
        """x [B * T, hidden] embeddings -> the last layer's output; b.mask [B, 1, T, L] bool."""
        m, cfg = self.model, self.model.config
        heads, kv_heads, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        pre, attend, post = self.pieces
        mask = _additive_grouped_mask(b.mask, heads // kv_heads)  # [B, 1, G * T, L]
        first = self.compile and (x.shape[0], b.key_len) not in self.compiled_shapes
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT) if first else contextlib.nullcontext():
            for index, w in enumerate(m.weights.layers):
                kv = m.cache.kv[index].view(-1, cfg.head_dim)  # [2 * slots * KV * (ctx + 1), D]
                q = pre(x, w.attn_norm, w.wqkv, w.bqkv, b.cos, b.sin, kv, b.write_index, b.num_rows, heads, kv_heads,
                        eps, self.linear)  # [B, KV, G * T, D]
                attn = attend(q, kv, b.slot_index, mask, m.cache.max_context + 1)
                x = post(x, attn, w.wo, w.bo, w.mlp_norm, w.w_gate_up, w.b_gate_up, w.w_down, w.b_down, heads, eps,
                         self.linear)
        self.compiled_shapes.add((x.shape[0], b.key_len))
        return x


def _additive_grouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """mask [B, 1, T, L] bool (True = attend) -> [B, 1, G * T, L] float32 of 0 / -inf, built once per
    forward rather than once per layer."""
    B, _, T, L = mask.shape
    grouped = mask[:, :, None].expand(B, 1, groups, T, L).reshape(B, 1, groups * T, L)
    return torch.zeros(grouped.shape, device=mask.device).masked_fill_(~grouped, float("-inf"))
