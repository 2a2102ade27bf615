"""Static-shape forward of the native backend, captured once per shape and replayed as a CUDA graph.

Decode and verify steps of a large model on a GPU are launch-bound in eager mode: a step of the
Llama-3-8B shape is some 400 small kernels, and the host needs longer to launch them than the GPU
needs to stream the weights (../shared/docs/MODELS.md: transformers eager 21 ms against a 3.7 ms
floor). A CUDA graph launches the whole forward at once, but it replays fixed shapes and fixed
addresses, so this module runs the same layers as LlamaModel._forward with three changes:

- shapes come from buckets: rows padded up to 1, 2, 4, 8, 16 or 32, tokens per row 1..9 (a decode,
  up to a verify of 8 drafted tokens), keys attended padded up to a multiple of 256 or the whole slot
  (attention and the slot gather read every padded column: finer buckets waste less at many rows); a forward outside the buckets (a prefill, a long verify) runs eagerly as before;
- every per-forward index (tokens, positions, cache write index, slots) lives in one static device
  buffer, filled by a single host-to-device copy before the replay; rope tables and the attention mask
  are computed from it inside the graph;
- padded rows and padded tokens write their keys/values into the cache's scratch column (slot 0's for
  padded rows), which no mask ever admits, and their outputs are dropped.

A shape is captured on its first use unless warm_up captured it at startup. Services warm up every
shape up to a context (--graph-warmup-context): a lazy capture costs ~0.2 s for the 8B shape, and an
adaptive draft length that tries each length 1..8 at each new key bucket paid dozens of them inside
the first requests (docs/BENCHMARKS.md, "The adaptive draft length on a GPU").

The output head runs outside the graph on the rows whose logits were asked for, as in eager mode.
On a CPU the same static-shape code runs without capture: tests check it against the normal forward.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.models.llama_batch import ForwardBatch, host_indices

if TYPE_CHECKING:
    from specdec.models.llama import LlamaModel

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
MAX_TOKENS_PER_ROW = 9  # a verify of 8 drafted tokens
GRAPH_CHUNKS = 4  # up to this many graphed pieces replace an eager forward (GraphRunner.fits_in_pieces)
KEY_BUCKET = 256  # a capture of the 8B shape takes ~0.2 s, so many buckets are cheap


@dataclass(frozen=True)
class Shape:
    rows: int  # B, padded
    width: int  # T, tokens per row, padded
    key_len: int  # L, keys attended per row, padded


@dataclass
class GraphStats:
    captured: int = 0
    capture_seconds: float = 0.0
    replays: int = 0
    eager_fallbacks: int = 0
    shapes: list[str] = field(default_factory=list)


class StaticForward:
    """One shape's static input buffer and output, and its captured graph (None: run it eagerly)."""

    def __init__(self, model: "LlamaModel", shape: Shape, layers=None):
        self.model, self.shape = model, shape
        self.layers = layers or model._layers  # (x [B * T, hidden], ForwardBatch) -> x: the layer stack
        B, T = shape.rows, shape.width
        kv_heads = model.config.num_kv_heads
        self.num_static = (2 + kv_heads) * B * T + B
        # tokens | positions | write index | slots | (then, outside the graph) the rows to score
        self.inputs = torch.zeros(self.num_static + B * T, dtype=torch.long, device=model.device)
        n = B * T
        self.tokens = self.inputs[:n]
        self.positions = self.inputs[n : 2 * n]
        self.write_index = self.inputs[2 * n : 2 * n + n * kv_heads]
        self.slot_index = self.inputs[2 * n + n * kv_heads : 2 * n + n * kv_heads + B]
        self.key_columns = torch.arange(shape.key_len, device=model.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # [B * T, hidden], the graph's output

    def run(self) -> torch.Tensor:
        """The forward over the static buffers: final-normed hidden states of every token [B * T, hidden]."""
        m, s = self.model, self.shape
        positions = self.positions
        mask = (self.key_columns <= positions.view(s.rows, s.width, 1))[:, None]  # [B, 1, T, L]
        batch = ForwardBatch(
            num_rows=s.rows, width=s.width, key_len=s.key_len, tokens=self.tokens,
            cos=m._cos[positions][:, None], sin=m._sin[positions][:, None], write_index=self.write_index,
            slot_index=self.slot_index, first_slot=0, mask=mask, is_causal=False, logit_rows=None,
        )
        with m.attention_backends(eager=False):
            x = self.layers(F.embedding(self.tokens, m.weights.embed), batch)
        return m._norm(x, m.weights.final_norm)

    def capture(self, pool) -> None:
        """Warm up on a side stream (cuBLAS and the allocator settle), then record the forward.
        The buffers hold dummy inputs meanwhile: every write goes to slot 0's scratch column."""
        m = self.model
        kv_heads, ctx = m.config.num_kv_heads, m.cache.max_context
        self.inputs.zero_()
        scratch = torch.arange(kv_heads, device=m.device) * (ctx + 1) + ctx
        self.write_index.copy_(scratch.repeat(self.shape.rows * self.shape.width))
        side = torch.cuda.Stream(device=m.device)
        side.wait_stream(torch.cuda.current_stream(m.device))
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream(m.device).wait_stream(side)
        settle_devices()
        self.graph = torch.cuda.CUDAGraph()
        # Our own capture stream: torch.cuda.graph's default one is created once, on whichever device
        # was current then, and capturing a cuda:1 model on a cuda:0 stream fails.
        # No garbage collection inside the capture: collecting another model's captured graphs (a
        # GraphRunner and its model form a cycle) destroys them, which CUDA refuses while a stream
        # captures, and the capture is invalidated (GPU tests, models of earlier tests; seen on an H200).
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                self.hidden = self.run()
        finally:
            if collecting:
                gc.enable()

    def __call__(self, host_inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of every token, and the device copy of the rows to score."""
        # A fresh pageable host tensor: CUDA stages it before the copy returns, so nothing on the
        # host side can be overwritten while the copy is still queued.
        self.inputs[: host_inputs.numel()].copy_(host_inputs, non_blocking=True)
        logit_rows = self.inputs[self.num_static : host_inputs.numel()]
        if self.graph is None:
            return self.run(), logit_rows
        self.graph.replay()
        return self.hidden, logit_rows


def settle_devices() -> None:
    """Before a capture: let every device in use finish its work. torch.cuda.graph synchronizes only
    the current device before it collects garbage; a model on another device freed by that
    collection (a draft on cuda:1 dropped while cuda:0 captures) with work of its own still queued
    failed the capture with cudaErrorStreamCaptureInvalidated (2 x H200: the two GPU tests below in
    pytest's order, 4 runs of 4 on two machines; none once both devices were synchronized first).
    A device with no memory reserved is skipped: synchronizing it would create a CUDA context there."""
    for index in range(torch.cuda.device_count()):
        if torch.cuda.memory_reserved(index) > 0:
            torch.cuda.synchronize(index)


class GraphRunner:
    """Routes a forward to the StaticForward of its bucket (captured lazily on first use), or returns
    None so that the caller runs it eagerly. capture=False runs the static path without graphs.
    compile_layers: the layer stack of compiled_layers.py, compiled with torch.compile where graphs are
    captured (its first use of a token count compiles, inside the capture's warm-up), run uncompiled
    otherwise."""

    def __init__(self, model: "LlamaModel", capture: bool, compile_layers: bool = False):
        self.model, self.capture = model, capture
        self.layers = None
        if compile_layers:
            from specdec.models.compiled_layers import CompiledLayers

            self.layers = CompiledLayers(model, compile=capture)
        self.forwards: dict[Shape, StaticForward] = {}
        self.stats = GraphStats()
        ctx = model.cache.max_context
        self.key_buckets = list(range(KEY_BUCKET, ctx + 1, KEY_BUCKET)) + [ctx + 1]
        # One memory pool for every graph: only one forward runs at a time, and a graph's output is
        # copied out (index_select below) right after its own replay, before another graph can reuse
        # that memory for its intermediates.
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def warm_up(self, max_rows: int, max_keys: int) -> int:
        """Capture now every shape a step of up to max_rows rows, 1..MAX_TOKENS_PER_ROW tokens per row and
        up to max_keys keys can take (row buckets, key buckets); returns how many were new."""
        top_rows = ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, min(max(1, max_rows), ROW_BUCKETS[-1]))]
        rows = [r for r in ROW_BUCKETS if r <= top_rows]
        keys = self.key_buckets[: bisect.bisect_left(self.key_buckets, max(1, max_keys)) + 1]
        before = len(self.forwards)
        with torch.cuda.device(self.model.device) if self.capture else contextlib.nullcontext():
            for key_len in keys:
                for width in range(1, MAX_TOKENS_PER_ROW + 1):
                    for num_rows in rows:
                        shape = Shape(num_rows, width, key_len)
                        if shape not in self.forwards:
                            self._build(shape)
        return len(self.forwards) - before

    piece = MAX_TOKENS_PER_ROW  # tokens per row of one graphed piece (LlamaModel._in_pieces)

    def fits_in_pieces(self, lengths: list[int], num_logits: list[int]) -> bool:
        """A few tokens more than a graphed step (a draft catching up on plainly decoded tokens, a new
        turn's few tokens), with each row's logits all in its last piece: worth running as graphed
        pieces. On an H200 a first eager forward of a new width costs 55-1000 ms, every later one
        7-9 ms, and the same 10-40 tokens as graphed pieces of 9 cost 3.5-9 ms (1B shape)."""
        C = self.piece
        if not lengths or not C < max(lengths) <= C * GRAPH_CHUNKS:
            return False
        return all(n <= length - C * ((length - 1) // C) for length, n in zip(lengths, num_logits))

    def shape_for(self, starts: list[int], lengths: list[int]) -> Shape | None:
        rows, width = len(lengths), max(lengths)
        if width > MAX_TOKENS_PER_ROW or rows > ROW_BUCKETS[-1]:
            return None
        keys = max(s + n for s, n in zip(starts, lengths))
        return Shape(ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, rows)], width,
                     self.key_buckets[bisect.bisect_left(self.key_buckets, keys)])

    def forward(self, slots: list[int], token_ids, starts: list[int], lengths: list[int],
                num_logits: list[int]) -> torch.Tensor | None:
        """Final-normed hidden states of the rows to score [N, hidden], or None: not a static shape, so
        the caller runs the forward eagerly."""
        shape = self.shape_for(starts, lengths)
        if shape is None:
            self.stats.eager_fallbacks += 1
            return None
        # A graph replays on the current stream of the current device: make that the model's device
        # (a draft on cuda:1 in a process whose current device is cuda:0).
        with torch.cuda.device(self.model.device) if self.capture else contextlib.nullcontext():
            static = self.forwards.get(shape) or self._build(shape)
            hidden, logit_rows = static(self._host_inputs(shape, slots, token_ids, starts, lengths, num_logits))
        self.stats.replays += 1
        return hidden.index_select(0, logit_rows)

    def _build(self, shape: Shape) -> StaticForward:
        static = StaticForward(self.model, shape, self.layers)
        if self.capture:
            started = time.perf_counter()
            static.capture(self.pool)
            self.stats.captured += 1
            self.stats.capture_seconds += time.perf_counter() - started
            self.stats.shapes.append(f"{shape.rows}x{shape.width}x{shape.key_len}")
        self.forwards[shape] = static
        return static

    def _host_inputs(self, shape: Shape, slots, token_ids, starts, lengths, num_logits) -> torch.Tensor:
        """The static buffer's contents, then the flat indices of the rows to score, on the host."""
        tokens, positions, write_index, slot_t, logit_rows = host_indices(
            slots, token_ids, starts, lengths, num_logits, shape.rows, shape.width,
            self.model.config.num_kv_heads, self.model.cache.max_context)
        return torch.cat((tokens.view(-1), positions.view(-1), write_index.view(-1), slot_t,
                          torch.tensor(logit_rows, dtype=torch.long)))


def use_cuda_graphs(setting: bool | None, device: str | torch.device) -> bool:
    """--cuda-graphs: None (not given) means on for a CUDA device; never on elsewhere."""
    is_cuda = torch.device(device).type == "cuda"
    return is_cuda if setting is None else (setting and is_cuda)
