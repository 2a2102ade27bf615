"""A small model's decode step on a CPU as one compiled loop (numba): the draft's per-operator floor.

A draft step of the default draft (3 layers of width 256, a 4,096-row head) took about 1.3 ms in
PyTorch, for about 0.2 ms of arithmetic: 7 matrix products, 7 norms and 3 attention calls at 10-60
microseconds each, most of it the operators' own overhead and MKL's slow small-matrix paths on this
AMD CPU (a [1, 256] x [256, 512] product: 9.8 us in MKL, 5.4 us as a compiled loop). A draft step
is paid k times a cycle, so that overhead was 8-10% of a speculative cycle and half of the draft's
cost ratio (docs/DISTILLATION.md, "Cost on the CPU").

Here the whole forward of a few tokens (a draft step, a draft's catch-up after a verify) is one call:
the embedding, each layer's norm, q/k/v projection, rotary embedding, the cache write, attention
(cpu_attention's loop), the output projection with its residual, the MLP, and the head for the rows
whose logits are asked for. Each product reads a weight row once for all the tokens of the call.
The arithmetic is float32 with sums reassociated for vectorisation, so results differ from the
PyTorch path in the last bits: right for a draft, whose numbers only decide what it proposes (it
sends the distribution it sampled from, so verification is exact whatever they are), and wrong for
a target, whose decode and verify steps must give a token the same bits (so only drafts ask for it).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specdec.models import cpu_attention
from specdec.models.linear_kernels import DenseNTLinear
from specdec.models.llama_weights import load_weights

log = logging.getLogger(__name__)

# More tokens than this in one forward (a prefill) go through PyTorch's batched products, which reuse
# each weight across a long block far better than this loop.
MAX_TOKENS = 16
# From this many tokens in one call _linear_loop works in blocks (a 16-row draft step: 20% faster).
BLOCKED_FROM = 8
_attend = None  # cpu_attention's compiled loop, called from _forward_loop (set by _kernel)
# numba's disk cache keys _forward_loop on this file alone: the default cache directory changes with
# every kernel file (cpu_attention.default_cache_dir), so a change to cpu_attention's loop is seen here.
_linear = None  # _linear_loop compiled
_rms_norm = None  # _rms_norm_loop compiled


def _linear_loop(x, w, out, accumulate):  # pragma: no cover - compiled
    # out[n, o] (+)= x[n] . w[o]; x [N, I], w [O, I] (rows contiguous). From BLOCKED_FROM tokens on,
    # tokens in blocks of four go against pairs of weight rows, eight sums held at once, so each
    # weight value loaded serves four tokens and each token value two rows: one sum at a time was
    # bound by those loads, and a 16-row draft step took 20% longer. Below that, and for leftover
    # tokens, one sum at a time: for few tokens it measured as fast or faster (BENCHMARKS.md, round 34).
    n_tokens, width = x.shape
    blocked_tokens = n_tokens - n_tokens % 4 if n_tokens >= BLOCKED_FROM else 0
    if blocked_tokens:
        for o in range(0, w.shape[0] - 1, 2):
            for n in range(0, blocked_tokens, 4):
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                for i in range(width):
                    w0, w1 = w[o, i], w[o + 1, i]
                    x0, x1, x2, x3 = x[n, i], x[n + 1, i], x[n + 2, i], x[n + 3, i]
                    a0 += x0 * w0
                    a1 += x1 * w0
                    a2 += x2 * w0
                    a3 += x3 * w0
                    b0 += x0 * w1
                    b1 += x1 * w1
                    b2 += x2 * w1
                    b3 += x3 * w1
                if accumulate:
                    out[n, o] += a0
                    out[n + 1, o] += a1
                    out[n + 2, o] += a2
                    out[n + 3, o] += a3
                    out[n, o + 1] += b0
                    out[n + 1, o + 1] += b1
                    out[n + 2, o + 1] += b2
                    out[n + 3, o + 1] += b3
                else:
                    out[n, o] = a0
                    out[n + 1, o] = a1
                    out[n + 2, o] = a2
                    out[n + 3, o] = a3
                    out[n, o + 1] = b0
                    out[n + 1, o + 1] = b1
                    out[n + 2, o + 1] = b2
                    out[n + 3, o + 1] = b3
    # The tokens not in a block; and every token's product with a last, odd weight row.
    for o in range(w.shape[0]):
        first = blocked_tokens if o < w.shape[0] - w.shape[0] % 2 else 0
        for n in range(first, n_tokens):
            acc = np.float32(0.0)
            for i in range(width):
                acc += x[n, i] * w[o, i]
            if accumulate:
                out[n, o] += acc
            else:
                out[n, o] = acc


def _rms_norm_loop(x, weight, eps, out):  # pragma: no cover - compiled
    for n in range(x.shape[0]):
        total = np.float32(0.0)
        for i in range(x.shape[1]):
            total += x[n, i] * x[n, i]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(x.shape[1]) + eps)
        for i in range(x.shape[1]):
            out[n, i] = x[n, i] * inv * weight[i]


def _forward_loop(tokens, slots, key_lens, logit_rows, embed, attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down,
                  final_norm, head, cos, sin, kv, eps, heads, kv_heads, hidden_out, logits_out):  # pragma: no cover
    # tokens/slots [N]; key_lens [N] (each token's position + 1, cpu_attention.query_layout); logit_rows [M]
    # (indices into N); weights stacked per layer, [out, in];
    # kv [layers, 2, slots, KV, ctx + 1, D]; hidden_out [M, hidden]; logits_out [M, head rows].
    n_tokens, hidden = tokens.shape[0], embed.shape[1]
    dim = cos.shape[1]
    half = dim // 2
    inter = w_down.shape[2]
    x = np.empty((n_tokens, hidden), dtype=np.float32)
    for n in range(n_tokens):
        x[n] = embed[tokens[n]]
    h = np.empty_like(x)
    qkv = np.empty((n_tokens, wqkv.shape[1]), dtype=np.float32)
    q = np.empty((n_tokens, heads, dim), dtype=np.float32)
    attn = np.empty((n_tokens, heads, dim), dtype=np.float32)
    gate_up = np.empty((n_tokens, 2 * inter), dtype=np.float32)
    act = np.empty((n_tokens, inter), dtype=np.float32)
    scale = np.float32(dim ** -0.5)
    for layer in range(wqkv.shape[0]):
        _rms_norm(x, attn_norm[layer], eps, h)
        _linear(h, wqkv[layer], qkv, False)
        for n in range(n_tokens):
            p = key_lens[n] - 1
            for head_index in range(heads + kv_heads):  # rotary: x * cos + roll(x, D / 2) * sign-folded sin
                base = head_index * dim
                for d in range(dim):
                    rotated = (qkv[n, base + d] * cos[p, d]
                               + qkv[n, base + (d + half) % dim] * sin[p, d])
                    if head_index < heads:
                        q[n, head_index, d] = rotated
                    else:
                        kv[layer, 0, slots[n], head_index - heads, p, d] = rotated
            for kv_head in range(kv_heads):
                base = (heads + kv_heads + kv_head) * dim
                for d in range(dim):
                    kv[layer, 1, slots[n], kv_head, p, d] = qkv[n, base + d]
        _attend(q, kv[layer, 0], kv[layer, 1], slots, key_lens, scale, attn)
        _linear(attn.reshape((n_tokens, heads * dim)), wo[layer], x, True)
        _rms_norm(x, mlp_norm[layer], eps, h)
        _linear(h, w_gate_up[layer], gate_up, False)
        for n in range(n_tokens):
            for i in range(inter):
                gate = gate_up[n, i]
                act[n, i] = gate / (np.float32(1.0) + np.exp(-gate)) * gate_up[n, inter + i]
        _linear(act, w_down[layer], x, True)
    picked = np.empty((logit_rows.shape[0], hidden), dtype=np.float32)
    for m in range(logit_rows.shape[0]):
        picked[m] = x[logit_rows[m]]
    _rms_norm(picked, final_norm, eps, hidden_out)
    _linear(hidden_out, head, logits_out, False)


@functools.cache
def _kernel():
    """_forward_loop compiled (or loaded from numba's disk cache), or None without numba."""
    global _attend, _linear, _rms_norm
    _attend = cpu_attention._kernel()
    if _attend is None:
        return None
    import numba

    jit = functools.partial(numba.njit, nogil=True, cache=True, fastmath=cpu_attention.FASTMATH, boundscheck=False)
    _linear, _rms_norm = jit(_linear_loop), jit(_rms_norm_loop)
    forward = jit(_forward_loop)
    try:
        _warm_up(forward)
    except Exception as exc:  # noqa: BLE001 - a broken numba install must not stop a model loading
        log.warning("the compiled CPU decode step did not compile (%r); decode steps stay on PyTorch", exc)
        return None
    return forward


def _warm_up(forward) -> None:
    """Compile now, at model load, with the argument types of a real call."""
    f32 = np.float32
    ones = np.ones((1, 4), dtype=f32)
    forward(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64),
            ones, ones, np.ones((1, 12, 4), f32), np.ones((1, 4, 4), f32), ones, np.ones((1, 8, 4), f32),
            np.ones((1, 4, 4), f32), np.ones(4, f32), ones, np.ones((2, 4), f32), np.ones((2, 4), f32),
            np.zeros((1, 2, 1, 1, 2, 4), f32), f32(1e-5), 1, 1, np.empty((1, 4), f32), np.empty((1, 1), f32))


def available() -> bool:
    return _kernel() is not None


class FusedDecode:
    """A model's weights laid out for _forward_loop: each layer's matrices stacked, [out, in]."""

    def __init__(self, embed: torch.Tensor, layers: list[dict[str, torch.Tensor]], final_norm: torch.Tensor,
                 head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, eps: float,
                 heads: int, kv_heads: int):
        stack = lambda name: torch.stack([layer[name] for layer in layers]).numpy()  # noqa: E731 - [layers, ...]
        self.attn_norm, self.wqkv, self.wo = stack("attn_norm"), stack("wqkv"), stack("wo")
        self.mlp_norm, self.w_gate_up, self.w_down = stack("mlp_norm"), stack("w_gate_up"), stack("w_down")
        self.embed, self.final_norm = embed.numpy(), final_norm.contiguous().numpy()
        self.head = head.contiguous().numpy()  # [head rows, hidden]
        self.cos, self.sin, self.kv = cos.numpy(), sin.numpy(), kv.numpy()  # the model's own: no copies
        self.eps, self.heads, self.kv_heads = np.float32(eps), heads, kv_heads

    def forward_rows(self, slots: Sequence[int], rows: Sequence[Sequence[int]], starts: Sequence[int],
                     lengths: Sequence[int], num_logits: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaModel._forward's contract: rows[i] appended to slots[i] (holding starts[i] tokens);
        the logits and final hidden of each row's last num_logits[i] tokens, rows in order."""
        tokens = np.fromiter((t for row in rows for t in row), dtype=np.int64, count=sum(lengths))
        token_slots, key_lens = cpu_attention.query_layout(slots, starts, lengths)
        ends = np.cumsum(lengths)
        logit_rows = np.concatenate([np.arange(end - k, end, dtype=np.int64) for end, k in zip(ends, num_logits)])
        return self.forward(tokens, token_slots, key_lens, logit_rows)

    def forward(self, tokens: np.ndarray, slots: np.ndarray, key_lens: np.ndarray,
                logit_rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens[i] at position key_lens[i] - 1 of slots[i] (rows packed one after another, each
        row's tokens in order); returns (logits [M, head rows], final hidden [M, hidden]) of the tokens
        logit_rows names."""
        hidden = torch.empty(len(logit_rows), self.embed.shape[1])
        logits = torch.empty(len(logit_rows), self.head.shape[0])
        _kernel()(tokens, slots, key_lens, logit_rows, self.embed, self.attn_norm, self.wqkv, self.wo,
                  self.mlp_norm, self.w_gate_up, self.w_down, self.final_norm, self.head, self.cos, self.sin,
                  self.kv, self.eps, self.heads, self.kv_heads, hidden.numpy(), logits.numpy())
        return logits, hidden


def for_model(model, path: Path, head_token_ids: torch.Tensor | None) -> FusedDecode | None:
    """The loop's weights for a native LlamaModel (specdec.models.llama) that can take it: CPU, float32,
    no biases, numba present, SPECDEC_CPU_DECODE not "eager". The layers are read again in [out, in]
    layout (the model's own may be in oneDNN's blocked one); embedding, rotary tables and the KV cache
    are the model's own."""
    cfg = model.config
    if (model.device.type != "cpu" or model.dtype != torch.float32 or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias
            or os.environ.get("SPECDEC_CPU_DECODE", "auto") == "eager" or not available()):
        return None
    plain = load_weights(path, cfg, model.dtype, model.device, DenseNTLinear(), head_token_ids)
    layers = [dict(attn_norm=w.attn_norm, wqkv=w.wqkv, wo=w.wo, mlp_norm=w.mlp_norm, w_gate_up=w.w_gate_up,
                   w_down=w.w_down) for w in plain.layers]
    return FusedDecode(model.weights.embed, layers, plain.final_norm, plain.lm_head, model._cos, model._sin,
                       model.cache.kv, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads)
