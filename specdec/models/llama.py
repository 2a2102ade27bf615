"""Native Llama-family backend (Llama 2/3, Mistral without sliding window, Qwen2, SmolLM).

One forward serves any mix of rows: a prefill, a one-token decode and a (k+1)-token verify of different
sessions go through the layers together. Rows are right-padded to the longest; each token's position is
its slot's length plus its offset in the row. Every layer writes the new keys/values into the slots
first and then attends over each slot's prefix under a mask "key position <= query position", which is
causal inside the new tokens, full over the cached prefix and blind past the row's own length. Padded
tokens get the position of their row's last real token (so their attention is well defined) and write
their keys/values into the cache's scratch column, which no mask ever admits.

Activations are kept 2-D, [tokens, hidden], so every projection is one matmul (linear_kernels.py picks
the kernel) and residual adds fuse into it. Only the rows whose logits were asked for go through the
final norm and the lm_head: with a 49k vocabulary the lm_head is the largest single matmul of a small
model. The per-forward index tensors (llama_batch.ForwardBatch) are built once on the host and shared by all layers.
With cuda_graphs, decode and verify shapes go through cuda_graphs.py instead: the same layers on
static, bucketed shapes, replayed as CUDA graphs; anything else (prefills) runs here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.errors import InvalidArgument
from specdec.models import cpu_attention, cpu_decode, cpu_linear, kernel_calibration
from specdec.models.base import ModelInfo
from specdec.models.batch_invariant import FixedRowsLinear, rows_for
from specdec.models.kv_cache import SlotKVCache
from specdec.models.linear_kernels import choose_linear
from specdec.models.llama_batch import ForwardBatch, plan_batch, rope_tables
from specdec.models.llama_config import LlamaConfig
from specdec.models.llama_weights import LayerWeights, load_weights
from specdec.models.slot_attention import attention_in_place, attention_per_token, gather_slots, grouped_attention
from specdec.models.step_threads import StepThreads, threads_for

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LlamaModel:
    """The CausalLM protocol (specdec.models.base) over a native Llama-family forward.

    path: a Hugging Face directory (config.json + safetensors). max_context: tokens per slot (default:
    the model's limit capped at 2048). The pool is num_slots slots, or as many as kv_budget_bytes holds.
    linear_kernel: "auto" | "dense" | "dense-nt" | "onednn" | "hybrid" | "loop" (linear_kernels.py; "auto" is
    right outside benchmarks).
    head_token_ids: a reduced output head (a draft's most frequent tokens): logits then cover only
    these ids, in this order; inputs still take the whole vocabulary.
    cuda_graphs: decode and verify shapes through the static-shape forward of cuda_graphs.py, captured
    as CUDA graphs on a CUDA device (on a CPU the static path runs uncaptured: tests use that).
    compile_layers (with cuda_graphs): the static path's layers as torch.compile'd pieces
    (compiled_layers.py), compiled on a CUDA device on each token count's first use; on a CPU the
    same pieces run uncompiled. Off by default: each new token count costs a compilation.
    graph_warmup_context (with cuda_graphs): capture every decode and verify shape of up to num_slots
    rows and this many keys now, instead of on first use (0: all on first use).
    fused_decode: on a CPU in float32, forwards of up to cpu_decode.MAX_TOKENS tokens run as one
    compiled loop (cpu_decode.py); a draft's option (its bits differ from this path's); needs numba,
    a model without biases, and at most two intra-op threads; SPECDEC_CPU_DECODE=eager turns it off.
    batch_invariant: every row of a forward computes exactly what it computes alone, whatever else
    the step holds (batch_invariant.py): every product on chunks of a fixed row count, and on CUDA one
    attention kernel for every step. Not with compile_layers (inductor picks kernels per shape); the
    fused CPU loop is not used. batch_invariant_rows: the rows of a product chunk (None: rows_for(device),
    or with the "loop" kernel unpadded chunks of up to cpu_linear.MAX_ROWS).
    Any fixed count is invariant; it trades a narrow step's padding against a wide step's weight reads.
    step_threads (CPU): intra-op threads by a forward's token count (step_threads.py); None: every
    forward on the process's threads. Not with batch_invariant (a kernel may split its sums by threads).
    """

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        num_slots: int | None = 8,
        max_context: int | None = None,
        kv_budget_bytes: int | None = None,
        name: str | None = None,
        linear_kernel: str = "auto",
        head_token_ids: torch.Tensor | None = None,
        cuda_graphs: bool = False,
        compile_layers: bool = False,
        graph_warmup_context: int = 0,
        fused_decode: bool = False,
        batch_invariant: bool = False,
        batch_invariant_rows: int | None = None,
        step_threads: StepThreads | None = None,
    ):
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        if batch_invariant and compile_layers:
            raise InvalidArgument("batch_invariant cannot be combined with compile_layers: the compiled "
                                  "layers pick their kernels per step shape, so a row's bits depend on the batch")
        path = Path(path)
        self.config = cfg = LlamaConfig.load(path)
        max_context = max_context or default_max_context(cfg.max_position_embeddings)
        cfg.check_context(max_context)
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        if compile_layers and self.device.type == "cuda" and linear_kernel == "auto":
            # The compiled one-row products stream [out, in] weights at ~90% of copy bandwidth, [in, out]
            # ones at ~70% (scripts/bench_gpu_step.py, H200).
            linear_kernel = "dense-nt"
        self.linear = choose_linear(self.device, self.dtype, linear_kernel)
        self.batch_invariant = batch_invariant
        # Batch-invariant: the residual stream runs padded to whole product chunks through the layers, so
        # that only the attention's output needs padding (one kernel a layer, not six; a graphed decode
        # step is mostly launches).
        self.pad_rows = (batch_invariant_rows or rows_for(self.device)) if batch_invariant else 0
        if batch_invariant and batch_invariant_rows is None and self.linear.name == "loop":
            # Its rows are invariant by themselves up to MAX_ROWS: chunks of up to that many, no padding.
            self.linear.calibrate = False  # the loop for every chunk: its rows keep their bits up to MAX_ROWS
            self.linear, self.pad_rows = FixedRowsLinear(self.linear, cpu_linear.MAX_ROWS, pad=False), 0
        elif batch_invariant:
            self.linear = FixedRowsLinear(self.linear, self.pad_rows)
        self.head_token_ids = head_token_ids
        self.step_threads = None if batch_invariant else step_threads
        self.weights = load_weights(path, cfg, self.dtype, self.device, self.linear, head_token_ids)
        if getattr(self.linear, "calibrate", False):
            products = [(layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down) for layer in self.weights.layers]
            self.linear.loop_rows = kernel_calibration.loop_rows(self.linear, [w for ws in products for w in ws])
        self.cache = SlotKVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_context,
            num_slots=None if kv_budget_bytes else num_slots, budget_bytes=kv_budget_bytes,
            dtype=self.dtype, device=self.device,
        )
        self._cos, self._sin = rope_tables(cfg, max_context + 1, self.dtype, self.device)
        # Grouped-query attention as one query block per KV head (no repeated keys/values), so that
        # SDPA can take its memory-efficient kernel with a mask on CUDA; on CPU the measured kernels
        # stay as they are.
        self.group_queries = self.device.type == "cuda"
        # On a CPU, rows whose slots are not one range attend slot by slot in place (attention_in_place)
        # instead of gathering the batch's keys and values into one tensor every layer.
        self.attend_in_place = self.device.type == "cpu"
        # On a CPU, float32 decode and verify tokens attend through a compiled loop (cpu_attention.py)
        # at up to two intra-op threads; SPECDEC_CPU_ATTENTION=sdpa keeps SDPA (an A/B switch).
        self.compiled_attention = (self.device.type == "cpu" and self.dtype == torch.float32
                                   and os.environ.get("SPECDEC_CPU_ATTENTION", "auto") != "sdpa"
                                   and cpu_attention.available())
        # Forwards on more than one thread split their attention over the threads, but not batch-invariant
        # ones: the two builds only promise to agree to float32 rounding (cpu_attention.py).
        self.split_attention = (self.compiled_attention and not batch_invariant
                                and max(torch.get_num_threads(), self.step_threads.wide if self.step_threads else 1) > 1
                                and cpu_attention.prepare_parallel())  # compiled now, not in a session's first step
        # Half precision on CUDA: RMSNorm as one fused kernel (normalise in float32 inside it, scale, round
        # once) instead of four (cast, normalise, cast back, scale): a decode step is mostly small
        # kernels at a few microseconds each. It rounds once where transformers rounds twice.
        self.fuse_norm = self.device.type == "cuda"
        self.fused = cpu_decode.for_model(self, path, head_token_ids) if fused_decode and not batch_invariant else None
        self.graphs = None
        if cuda_graphs:
            from specdec.models.cuda_graphs import GraphRunner

            self.graphs = GraphRunner(self, capture=self.device.type == "cuda", compile_layers=compile_layers)
        # The eager path packs ragged rows (_plan); the graphs' static shapes pad every row to a bucket.
        self.packs_ragged_rows = self.graphs is None
        self.info = ModelInfo(
            name=name or str(path), architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_context=max_context, dtype=dtype, device=str(self.device), backend="native",
            batch_invariant=batch_invariant,
        )
        if self.graphs is not None and graph_warmup_context > 0:
            started = time.perf_counter()
            new = self.graphs.warm_up(self.num_slots, min(graph_warmup_context, max_context))
            log.info("CUDA graphs: %d step shapes ready in %.1f s (up to %d rows, %d tokens of context)",
                     new, time.perf_counter() - started, self.num_slots, graph_warmup_context)

    # Slots: the cache does the bookkeeping -----------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def num_free_slots(self) -> int:
        return self.cache.num_free_slots

    def allocate(self) -> int:
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    def length(self, slot: int) -> int:
        return self.cache.length(slot)

    def truncate(self, slot: int, length: int) -> None:
        self.cache.truncate(slot, length)

    @torch.inference_mode()
    def fork(self, src: int, dst: int, length: int) -> None:
        self.cache.fork(src, dst, length)

    # Forward -----------------------------------------------------------------------------------------

    def forward(
        self,
        slots: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        num_logits: Sequence[int] | None = None,
        extra_head_ids: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Logits [num_logits[i], head] per row. With a reduced head, extra_head_ids[i] (token ids
        outside it, e.g. the session's own context) adds their scores as further columns, in order."""
        logits, hidden = self.forward_packed(slots, token_ids, num_logits)
        num_logits = [len(row) for row in token_ids] if num_logits is None else list(num_logits)
        # Tensors made under inference_mode refuse in-place edits outside it; callers (samplers that
        # mask logits) get ordinary tensors. The copy is a few rows of the vocabulary.
        rows = list(logits.clone().split(num_logits))
        if extra_head_ids is not None:
            extra_head_rows = [None if ids is None or not len(ids) else self.head_rows(ids) for ids in extra_head_ids]
            rows = self._add_extra_head(rows, hidden.split(num_logits), extra_head_rows)
        return rows

    def forward_packed(self, slots: Sequence[int], token_ids: Sequence[Sequence[int]],
                       num_logits: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with every row's logits in one tensor [sum(num_logits), head], rows in order, and
        the final hidden states they came from [sum(num_logits), hidden]: what a caller scoring extra
        columns for many rows at once (the draft proposer's batched steps) multiplies itself."""
        lengths = [len(row) for row in token_ids]
        with threads_for(self.step_threads, sum(lengths)):
            return self._forward(list(slots), token_ids, lengths, list(lengths if num_logits is None else num_logits))

    @torch.inference_mode()
    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The full output head's rows of these token ids [len(ids), hidden] (a copy): with a reduced
        head, what scores them as extra columns (forward's extra_head_rows)."""
        source = self.weights.full_head
        if source is None:
            raise InvalidArgument("extra head rows need a reduced head (head_token_ids)")
        return source.index_select(0, ids.to(source.device))

    @torch.inference_mode()
    def _add_extra_head(self, rows: list[torch.Tensor], hidden: Sequence[torch.Tensor],
                        extra_head_rows: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        if self.weights.full_head is None:
            raise InvalidArgument("extra head rows need a reduced head (head_token_ids)")
        out = []
        for logits, h, head_rows in zip(rows, hidden, extra_head_rows):
            if head_rows is not None and len(head_rows):
                logits = torch.cat((logits, F.linear(h, head_rows).float()), dim=-1)  # [n, head + extra]
            out.append(logits)
        return out

    @torch.inference_mode()
    def _forward(
        self, slots: list[int], token_ids: Sequence[Sequence[int]], lengths: list[int], num_logits: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is not None and self.graphs.fits_in_pieces(lengths, num_logits):
            return self._in_pieces(slots, token_ids, lengths, num_logits, self.graphs.piece)
        starts = self._check(slots, token_ids, lengths, num_logits)
        if (self.fused is not None and sum(lengths) <= cpu_decode.MAX_TOKENS
                and torch.get_num_threads() <= cpu_attention.MAX_THREADS):
            logits, h = self.fused.forward_rows(slots, token_ids, starts, lengths, num_logits)
            self.cache.advance(slots, lengths)
            return logits, h
        h = None
        if self.graphs is not None:
            h = self.graphs.forward(slots, token_ids, starts, lengths, num_logits)  # None: not a static shape
        if h is None:
            batch = self._plan(slots, token_ids, starts, lengths, num_logits)
            with self.attention_backends(eager=True):
                x = self._layers(F.embedding(batch.tokens, self.weights.embed), batch)  # [B * T, hidden]
            h = self._norm(x.index_select(0, batch.logit_rows), self.weights.final_norm)
        logits = self.linear(h, self.weights.lm_head).float()  # [N, vocab]
        self.cache.advance(slots, lengths)
        return logits, h

    def attention_backends(self, eager: bool):
        """The SDPA backends of a forward on CUDA. Eager forwards (prefills, shapes outside the graphs):
        not cuDNN's, which builds a plan for every new shape, and a prefill's shape is its prompt's
        length, so each new length paid 0.7-1.0 s (a draft catch-up of 150 tokens on an H200: 680 ms the
        first time, 70 ms warm; 150 ms and 22 ms without cuDNN). The captured graphs keep it: their
        shapes are fixed and planned once, at capture, and there it is the fastest (docs/BENCHMARKS.md).
        Batch-invariant: the memory-efficient kernel everywhere, graphs and eager alike, so that a token
        attends through the same kernel whichever kind of step computes it; a query's output from it
        does not depend on the step's rows, tokens per row or key bucket (scripts/probe_batch_invariance.py:
        the math backend's does)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self.batch_invariant:
            return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
        if not eager:
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _in_pieces(self, slots: list[int], token_ids: Sequence[Sequence[int]], lengths: list[int],
                   num_logits: list[int], piece: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward as successive graphed pieces of up to `piece` tokens per row (the KV cache
        carries each piece's keys into the next, as in chunked prefill); a row's logits come from its
        last piece (GraphRunner.fits_in_pieces). Returns what _forward returns, rows in order."""
        self._check(slots, token_ids, lengths, num_logits)  # the whole forward, before any piece commits
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for start in range(0, max(lengths), piece):
            rows = [i for i, length in enumerate(lengths) if length > start]
            last = [lengths[i] <= start + piece for i in rows]
            counts = [num_logits[i] if done else 0 for i, done in zip(rows, last)]
            logits, h = self._forward([slots[i] for i in rows], [token_ids[i][start:start + piece] for i in rows],
                                      [min(piece, lengths[i] - start) for i in rows], counts)
            for i, done, row_logits, row_h in zip(rows, last, logits.split(counts), h.split(counts)):
                if done:
                    out[i] = (row_logits, row_h)
        ordered = [out[i] for i in range(len(lengths))]
        return torch.cat([row[0] for row in ordered]), torch.cat([row[1] for row in ordered])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32 or self.fuse_norm:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one call; fp32: the same order as below
        # Normalise in float32 and cast back before the weight, the order transformers uses, so half
        # precision rounds the same way.
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight

    def _layers(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        if self.pad_rows:  # zero rows: no real row reads them (products are row by row, attention drops them)
            x = F.pad(x, (0, 0, 0, -tokens % self.pad_rows))
        for index, layer in enumerate(self.weights.layers):
            x = self._attention(x, layer, index, batch)
            x = self._mlp(x, layer)
        return x[:tokens]

    def _attention(self, x: torch.Tensor, w: LayerWeights, index: int, b: ForwardBatch) -> torch.Tensor:
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self._norm(x, w.attn_norm)
        qkv = self.linear(h, w.wqkv, w.bqkv)
        if self.pad_rows:  # the real tokens on (the padding rows of the stream stop here)
            qkv = qkv[: b.tokens.shape[0]]
        qkv = qkv.view(-1, heads + 2 * kv_heads, head_dim)  # [B * T, H + 2 KV, D]
        # RoPE on q and k in one go; rotate_half(x) = roll(x, D/2) with the sign folded into sin.
        qk = qkv[:, : heads + kv_heads]
        qk = qk * b.cos + qk.roll(head_dim // 2, dims=-1) * b.sin  # [B * T, H + KV, D]
        keys, values = self.cache.layer(index)  # [slots, KV, ctx + 1, D]
        keys.view(-1, head_dim).index_copy_(0, b.write_index, qk[:, heads:].reshape(-1, head_dim))
        values.view(-1, head_dim).index_copy_(0, b.write_index, qkv[:, heads + kv_heads :].reshape(-1, head_dim))
        q = qk[:, :heads]  # [tokens, H, D]
        if b.query_key_lens is not None:
            if self.compiled_attention:
                out = cpu_attention.attend(q, keys, values, b.query_slots, b.query_key_lens, self.split_attention)
            else:
                out = attention_per_token(q, keys, values, b.query_slots, b.query_key_lens)  # [tokens, H * D]
        elif self.attend_in_place and b.slots and (b.slot_index is not None or b.packed_index is not None):
            out = attention_in_place(q, keys, values, b)  # [tokens, H * D]
        else:
            if b.packed_index is not None:  # the real tokens into the padded layout
                q = q.new_zeros(b.num_rows * b.width, heads, head_dim).index_copy_(0, b.packed_index, q)
            q = q.reshape(b.num_rows, b.width, heads, head_dim).transpose(1, 2)  # [B, H, T, D]
            keys, values = gather_slots(keys, b), gather_slots(values, b)  # [B, KV, L, D]
            if self.group_queries and heads != kv_heads and not b.is_causal:
                out = grouped_attention(q, keys, values, b.mask)
            else:
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=b.mask, is_causal=b.is_causal, enable_gqa=heads != kv_heads
                )  # [B, H, T, D]
            out = out.transpose(1, 2).reshape(-1, heads * head_dim)  # [B * T, H * D]
            if b.packed_index is not None:
                out = out.index_select(0, b.packed_index)  # [N, H * D]: the padding's outputs dropped
        x = self.linear.add(x, out, w.wo)  # residual fused
        return x if w.bo is None else x + w.bo

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        h = self._norm(x, w.mlp_norm)
        gate_up = self.linear(h, w.w_gate_up, w.b_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [B * T, I] each
        x = self.linear.add(x, F.silu(gate) * up, w.w_down)  # SwiGLU, residual fused
        return x if w.b_down is None else x + w.b_down

    def _check(
        self, slots: list[int], rows: Sequence[Sequence[int]], lengths: list[int], num_logits: list[int]
    ) -> list[int]:
        """Validate a forward's arguments; return the slots' current lengths."""
        if not rows or len(slots) != len(rows) or len(num_logits) != len(rows):
            raise InvalidArgument(
                f"slots, token_ids and num_logits must be non-empty and of equal length; got "
                f"{len(slots)}, {len(rows)}, {len(num_logits)}"
            )
        for row, n, k in zip(rows, lengths, num_logits):
            if n == 0 or not 0 <= k <= n:
                raise InvalidArgument(f"each row needs >= 1 token and 0 <= num_logits <= its length; got {n}, {k}")
            if min(row) < 0 or max(row) >= self.config.vocab_size:
                raise InvalidArgument(f"token ids must be in 0..{self.config.vocab_size - 1}")
        return self.cache.check_append(slots, lengths)

    def _plan(
        self, slots: list[int], rows: Sequence[Sequence[int]], starts: list[int], lengths: list[int],
        num_logits: list[int],
    ) -> ForwardBatch:
        return plan_batch(slots, rows, starts, lengths, num_logits, kv_heads=self.config.num_kv_heads,
                          max_context=self.cache.max_context, cos=self._cos, sin=self._sin, device=self.device,
                          batch_invariant=self.batch_invariant, compiled_attention=self.compiled_attention)


def default_max_context(max_position_embeddings: int) -> int:
    """Tokens per slot when the caller names none: the model's limit, capped so 8 slots fit in memory."""
    return min(max_position_embeddings, 2048)
