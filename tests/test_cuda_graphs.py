"""The static-shape forward behind CUDA graphs (specdec.models.cuda_graphs).

On CPU the static path runs uncaptured (LlamaModel(cuda_graphs=True) on a CPU device) and must give
the normal forward's logits; the tests marked gpu capture real graphs and run on a CUDA device only.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from models_helpers import random_tokens, reference_logits, relative_error, tiny_dir
from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.errors import InvalidArgument
from specdec.generation.equality import compare_outputs
from specdec.generation.loop import generate
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.cuda_graphs import MAX_TOKENS_PER_ROW, Shape, use_cuda_graphs
from specdec.models.llama import LlamaModel
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingParams

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-graphs")


def pair(path, device="cpu", dtype="float32", max_context=300, num_slots=6):
    """The same weights twice: the normal forward, and the static-shape one."""
    make = lambda graphs: LlamaModel(path, device=device, dtype=dtype, num_slots=num_slots,  # noqa: E731
                                     max_context=max_context, cuda_graphs=graphs)
    return make(False), make(True)


def script(model: LlamaModel) -> list[torch.Tensor]:
    """Prefills (eager in both), then decodes and verifies of 1-3 rows at scattered slots and
    positions, a truncation (rollback) and a batch that crosses a key-length bucket."""
    slots = [model.allocate() for _ in range(4)]
    out = []
    for i, slot in enumerate(slots):
        out += model.forward([slot], [random_tokens(20 + 37 * i, seed=i)], [1])
    out += model.forward([slots[2]], [[5]])  # 1 row, 1 token
    out += model.forward([slots[3], slots[0]], [[7, 8, 9, 10, 11], [12]])  # verify + decode, padded width
    model.truncate(slots[3], model.length(slots[3]) - 3)  # rejected draft tokens
    out += model.forward([slots[1], slots[3], slots[2]], [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11], [4]], [1, 9, 1])
    out += model.forward([slots[0]], [random_tokens(MAX_TOKENS_PER_ROW, seed=9)])
    long_row = random_tokens(130, seed=7)  # a prefill continued past 256 tokens: eager, then bucket 512
    out += model.forward([slots[3]], [long_row], [1])
    out += model.forward([slots[3], slots[1]], [[1, 2, 3], [4]])
    return out


@pytest.mark.parametrize("case", ["llama3", "qwen2", "llama-tied"])
def test_static_path_equals_the_normal_forward(root, case):
    normal, static = pair(tiny_dir(root, case))
    want, got = script(normal), script(static)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=1e-5 * w.abs().max().item())
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    stats = static.graphs.stats
    # The 20-token prefill ran as graphed pieces of 9, 9 and 2 tokens; the 4 longer ones eagerly.
    assert stats.replays == 5 + 3 and stats.eager_fallbacks == 4
    assert stats.captured == 0  # no capture on a CPU
    assert [static.length(s) for s in range(4)] == [normal.length(s) for s in range(4)]


def test_a_few_tokens_past_a_graphed_step_run_as_graphed_pieces(root):
    """10-36 tokens per row (a draft catching up, a new turn): pieces of up to 9 tokens through the
    graphed path, the KV cache carrying each into the next, the logits from each row's last piece;
    the same logits as one forward. Logits asked beyond the last piece, or more tokens: eager."""
    normal, static = pair(tiny_dir(root, "llama3"))
    for model in (normal, static):
        slots = [model.allocate() for _ in range(3)]
        for i, slot in enumerate(slots):
            model.forward([slot], [random_tokens(40 + 11 * i, seed=i)], [1])
    rows = [random_tokens(n, seed=10 + n) for n in (10, 36, 23)]
    want = normal.forward([0, 1, 2], rows, [1, 9, 5])
    before = static.graphs.stats.replays
    got = static.forward([0, 1, 2], rows, [1, 9, 5])  # 36 = 4 x 9: its 9 logits are its last piece
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=0, atol=1e-5 * w.abs().max().item())
    assert static.graphs.stats.replays - before == 4
    assert [static.length(s) for s in range(3)] == [normal.length(s) for s in range(3)]
    eager = static.graphs.stats.eager_fallbacks
    static.forward([0], [random_tokens(12, seed=1)], [6])  # 6 logits, the last piece has 3 tokens
    static.forward([1], [random_tokens(37, seed=2)], [1])  # more than 4 pieces
    assert static.graphs.stats.eager_fallbacks == eager + 2
    # A forward that does not fit is refused whole, before any piece commits.
    static.forward([2], [random_tokens(290 - static.length(2), seed=3)], [1])  # eager: the slot at 290 of 300
    with pytest.raises(InvalidArgument, match="context"):
        static.forward([2], [random_tokens(20, seed=4)], [1])
    assert static.length(2) == 290


def test_static_path_equals_transformers(root):
    path = tiny_dir(root, "llama3")
    tokens = random_tokens(40)
    _, model = pair(path)
    slot = model.allocate()
    got = [model.forward([slot], [tokens[:30]])[0]]
    got += [model.forward([slot], [[t]])[0] for t in tokens[30:32]]
    got.append(model.forward([slot], [tokens[32:]])[0])  # an 8-token verify, static path
    assert relative_error(torch.cat(got), reference_logits(path, tokens)) <= 1e-4
    assert model.graphs.stats.replays == 3


def test_grouped_query_attention_equals_repeated_keys(root):
    """The CUDA attention layout (query heads stacked per KV head) against SDPA's own GQA."""
    path = tiny_dir(root, "qwen2")
    normal, grouped = pair(path)
    grouped.group_queries = True
    want, got = script(normal), script(grouped)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=1e-5 * w.abs().max().item())


def test_buckets(root):
    _, model = pair(tiny_dir(root, "llama"), max_context=500)
    runner = model.graphs
    assert runner.key_buckets == [256, 501]
    assert pair(tiny_dir(root, "llama"), max_context=512)[1].graphs.key_buckets == [256, 512, 513]
    assert runner.shape_for([0, 10, 250], [1, 5, 2]) == Shape(rows=4, width=5, key_len=256)
    assert runner.shape_for([0, 10, 300], [1, 5, 2]) == Shape(rows=4, width=5, key_len=501)
    assert runner.shape_for([490], [9]) == Shape(1, 9, 501)
    assert runner.shape_for([0], [MAX_TOKENS_PER_ROW + 1]) is None  # a prefill: eager
    assert runner.shape_for([0] * 33, [1] * 33) is None


def test_warm_up_builds_every_step_shape_so_that_no_step_builds_one(root):
    """Rows 1..num_slots (bucketed), 1..MAX_TOKENS_PER_ROW tokens, keys up to the warm-up context."""
    path = tiny_dir(root, "llama")
    make = lambda warmup: LlamaModel(path, num_slots=3, max_context=500, cuda_graphs=True,  # noqa: E731
                                     graph_warmup_context=warmup)
    model = make(300)  # key buckets 256 and 501 (the whole slot); rows 1, 2 and 4 (3 slots)
    assert len(model.graphs.forwards) == 2 * MAX_TOKENS_PER_ROW * 3
    assert {s.key_len for s in model.graphs.forwards} == {256, 501}
    assert {s.rows for s in model.graphs.forwards} == {1, 2, 4}
    assert model.graphs.warm_up(3, 300) == 0  # nothing left to build
    slots = [model.allocate() for _ in range(3)]
    for i, slot in enumerate(slots):
        model.forward([slot], [random_tokens(100 + 90 * i, seed=i)], [1])  # prefills: eager
    built = len(model.graphs.forwards)
    for width in range(1, MAX_TOKENS_PER_ROW + 1):
        model.forward(slots, [random_tokens(width, seed=width)] * 3, [1] * 3)  # up to 371 keys
        model.forward(slots[:1], [random_tokens(width, seed=width)], [1])
    assert len(model.graphs.forwards) == built and model.graphs.stats.replays == 2 * MAX_TOKENS_PER_ROW
    assert len(make(0).graphs.forwards) == 0  # 0: every shape on its first use
    assert len(make(200).graphs.forwards) == MAX_TOKENS_PER_ROW * 3  # the 256 bucket only
    assert len(make(10_000).graphs.forwards) == 2 * MAX_TOKENS_PER_ROW * 3  # capped at the slot


def test_switch_defaults_to_cuda_only():
    assert use_cuda_graphs(None, "cuda:1") and not use_cuda_graphs(None, "cpu")
    assert not use_cuda_graphs(True, "cpu") and not use_cuda_graphs(False, "cuda")


def test_eager_forwards_on_cuda_leave_out_cudnn_attention(root):
    """cuDNN's attention plans every new shape (0.7-1.0 s on an H200), and an eager forward's shape is a
    prompt's length: eager forwards on a CUDA device choose among the other backends; the captured
    graphs (fixed shapes) and CPU forwards are left alone. Checked on the flags, which needs no GPU."""
    model, _ = pair(tiny_dir(root, "llama3"))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with model.attention_backends(eager=True):  # on a CPU: nothing changes
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    model.device = torch.device("cuda")
    with model.attention_backends(eager=True):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def speculative_equals_plain(target_path, draft_path, device, dtype, prompts, k=4, new_tokens=40,
                             batch_invariant=False):
    """Greedy speculative output (graph-path target and draft) against plain decoding of the same
    target; returns the outputs and the target model."""
    target = LlamaModel(target_path, device=device, dtype=dtype, num_slots=4, max_context=256, cuda_graphs=True,
                        batch_invariant=batch_invariant)
    draft = LlamaModel(draft_path, device=device, dtype=dtype, num_slots=4, max_context=256, cuda_graphs=True)
    target_engine, draft_engine = TargetEngine(target), DraftEngine(DraftModelProposer(draft))
    outputs = []
    for prompt in prompts:
        results = []
        for proposer in (None, LocalDraft(draft_engine)):
            stop = StopChecker(new_tokens, ())

            async def emit(tokens):
                pass

            results.append(asyncio.run(generate(LocalTarget(target_engine), proposer, uuid.uuid4().hex, prompt,
                                                SamplingParams(), stop, emit, LoopSettings(num_draft_tokens=k))))
        outputs.append([r.token_ids for r in results])
    return outputs, target


PROMPTS = [[1, 5, 9, 12, 5, 9], [3, 3, 3, 7, 200, 31, 44, 3, 3], [17]]


def test_speculative_output_equals_plain_decoding_on_the_static_path(root):
    outputs, target = speculative_equals_plain(tiny_dir(root, "llama"), tiny_dir(root, "llama", seed=1),
                                               "cpu", "float32", PROMPTS)
    assert all(plain == speculative for plain, speculative in outputs)
    assert target.graphs.stats.replays > 0


# ---- CUDA: real capture ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["llama3", "qwen2"])
def test_cuda_graphs_equal_eager(root, case, dtype):
    eager, graphs = pair(tiny_dir(root, case), device="cuda", dtype=dtype)
    want, got = script(eager), script(graphs)
    tolerance = 1e-4 if dtype == "float32" else 2e-2  # bf16: a few units in the last place
    for g, w in zip(got, want):
        assert relative_error(g.cpu(), w.cpu()) <= tolerance
    # The script's 5 graphed steps, and its 20-token prefill as pieces of 9, 9, 2 (one shape more)
    assert graphs.graphs.stats.captured == 6 and graphs.graphs.stats.replays == 8


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_graphs_on_a_device_that_is_not_the_current_one(root):
    """A draft on cuda:1 while the process's current device is cuda:0 (the benchmark's layout)."""
    eager, graphs = pair(tiny_dir(root, "llama3"), device="cuda:1")
    want, got = script(eager), script(graphs)
    for g, w in zip(got, want):
        assert relative_error(g.cpu(), w.cpu()) <= 1e-4
    assert graphs.graphs.stats.captured == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_captured_at_warm_up_equal_eager(root):
    """Graphs captured back to back at startup share one memory pool: each must still replay right."""
    path = tiny_dir(root, "llama3")
    eager = LlamaModel(path, device="cuda", num_slots=6, max_context=300)
    graphs = LlamaModel(path, device="cuda", num_slots=6, max_context=300, cuda_graphs=True,
                        graph_warmup_context=300)
    assert graphs.graphs.stats.captured == 2 * MAX_TOKENS_PER_ROW * 4  # keys 256, 301; rows 1, 2, 4, 8
    want, got = script(eager), script(graphs)
    for g, w in zip(got, want):
        assert relative_error(g.cpu(), w.cpu()) <= 1e-4
    assert graphs.graphs.stats.captured == 2 * MAX_TOKENS_PER_ROW * 4  # no step captured a new shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_track_the_cache(root):
    """The same shape replayed at new positions and slots: every replay reads fresh inputs."""
    path = tiny_dir(root, "llama3")
    eager, graphs = pair(path, device="cuda")
    for model in (eager, graphs):
        slot = model.allocate()
        model.forward([slot], [random_tokens(30)], [0])
    tokens = random_tokens(20, seed=3)
    want = torch.cat([eager.forward([0], [[t]])[0] for t in tokens])
    got = torch.cat([graphs.forward([0], [[t]])[0] for t in tokens])
    assert relative_error(got.cpu(), want.cpu()) <= 1e-4
    # The 30-token prefill ran as graphed pieces of 9, 9, 9 and 3 (two shapes), then 20 decodes (one).
    assert graphs.graphs.stats.captured == 3 and graphs.graphs.stats.replays == 4 + 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_speculative_output_equals_plain_decoding(root, dtype):
    """Exact in fp32; in bf16 under the equality rule (a divergence must be a numerical tie)."""
    path = tiny_dir(root, "llama")
    outputs, target = speculative_equals_plain(path, tiny_dir(root, "llama", seed=1), "cuda", dtype, PROMPTS)
    assert target.graphs.stats.captured > 0
    if dtype == "float32":
        assert all(plain == speculative for plain, speculative in outputs)
        return
    rescorer = LlamaModel(path, device="cuda", dtype=dtype, num_slots=1, max_context=256)

    def next_logits(prefix):
        slot = rescorer.allocate()
        try:
            return rescorer.forward([slot], [prefix], [1])[0][0]
        finally:
            rescorer.free(slot)

    for prompt, (plain, speculative) in zip(PROMPTS, outputs):
        assert compare_outputs(prompt, speculative, plain, next_logits, tie_threshold=0.1).passed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_batch_invariant_speculative_output_equals_plain_decoding_exactly(root, dtype):
    """With --batch-invariant a verify computes each position as a one-token decode does, bit for bit:
    half-precision output equals plain decoding token for token, with no near-tie allowance."""
    outputs, target = speculative_equals_plain(tiny_dir(root, "llama"), tiny_dir(root, "llama", seed=1), "cuda",
                                               dtype, PROMPTS + [random_tokens(40, seed=s) for s in range(5)],
                                               batch_invariant=True)
    assert target.info.batch_invariant and target.graphs.stats.replays > 0
    assert all(plain == speculative for plain, speculative in outputs)
