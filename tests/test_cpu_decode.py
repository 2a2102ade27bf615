"""A draft's decode step as one compiled loop (specdec/models/cpu_decode.py) against the PyTorch path
and transformers: the same logits within float32 rounding, the same cache left behind, and only
where it was asked for."""

import pytest
import torch

from models_helpers import random_tokens, reference_logits, relative_error, tiny_dir
from specdec.models import cpu_decode
from specdec.models.llama import LlamaModel

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no compiled loop here (numba missing or failed)")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the services' setting, on any machine


@pytest.mark.parametrize("case", ["llama3", "smollm", "llama-tied"])
def test_decode_and_catch_up_rows_match_the_pytorch_path_and_transformers(tmp_path, case):
    """Rows of 1, 5 and 3 tokens (a draft step and catch-ups after a verify; nine tokens, so eight of
    them in the products' blocks of four and one left over) from scattered slots: the logits of
    every asked-for token equal the PyTorch path's within float32 rounding, and transformers' within
    the backend tests' tolerance; the keys and values written are the same, so a later step (here a
    long one, through PyTorch) continues from either alike."""
    path = tiny_dir(tmp_path, case)
    fused = LlamaModel(path, num_slots=5, max_context=128, fused_decode=True)
    plain = LlamaModel(path, num_slots=5, max_context=128)
    assert fused.fused is not None and plain.fused is None
    prefixes = [random_tokens(30, seed=1), random_tokens(17, seed=2), random_tokens(9, seed=7)]
    new = [random_tokens(1, seed=3), random_tokens(5, seed=4), random_tokens(3, seed=8)]
    slots = [4, 1, 2]
    for model in (fused, plain):
        for _ in range(5):
            model.allocate()
        model.forward(slots, prefixes, [0, 0, 0])  # prefills: PyTorch in both
    calls = []
    forward_rows = fused.fused.forward_rows
    fused.fused.forward_rows = lambda *a: calls.append(a[1]) or forward_rows(*a)
    got = fused.forward(slots, new, [1, 5, 3])
    want = plain.forward(slots, new, [1, 5, 3])
    assert calls == [new]
    for row, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        assert relative_error(g, w) <= 1e-5
        reference = reference_logits(path, prefixes[row] + new[row])[-len(new[row]):]
        assert relative_error(g, reference) <= 1e-4
    assert torch.allclose(fused.cache.kv, plain.cache.kv, rtol=0, atol=1e-5)
    tail = random_tokens(20, seed=5)  # more than MAX_TOKENS: PyTorch's path in both
    assert relative_error(fused.forward([4], [tail], [1])[0], plain.forward([4], [tail], [1])[0]) <= 1e-5
    assert len(calls) == 1


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_blocked_product_at_every_leftover(accumulate):
    """From BLOCKED_FROM tokens the loop's matrix product works tokens in blocks of four against pairs
    of weight rows: below it, at it and at every leftover past it (tokens not a multiple of four, an
    odd number of rows), it gives x @ w.T, added or stored."""
    generator = torch.Generator().manual_seed(0)
    for tokens in range(1, cpu_decode.BLOCKED_FROM + 6):
        for rows in (1, 6, 7):
            x = torch.randn(tokens, 33, generator=generator)
            w = torch.randn(rows, 33, generator=generator)
            out = torch.randn(tokens, rows, generator=generator)
            want = out + x @ w.T if accumulate else x @ w.T
            cpu_decode._linear(x.numpy(), w.numpy(), out.numpy(), accumulate)
            assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), (tokens, rows)


def test_a_reduced_head_and_the_sessions_own_tokens(tmp_path):
    """A draft's served head: the reduced rows from the loop, the context ids outside it scored from
    the loop's final hidden state, as the PyTorch path scores them."""
    path = tiny_dir(tmp_path, "smollm")
    head = torch.arange(0, 200, 2)
    fused = LlamaModel(path, num_slots=2, max_context=64, head_token_ids=head, fused_decode=True)
    plain = LlamaModel(path, num_slots=2, max_context=64, head_token_ids=head)
    extra = [torch.tensor([201, 7, 255])]
    for model in (fused, plain):
        model.forward([model.allocate()], [random_tokens(12, seed=6)], [0])
    got = fused.forward([0], [[9]], [1], extra_head_ids=extra)[0]
    want = plain.forward([0], [[9]], [1], extra_head_ids=extra)[0]
    assert got.shape == (1, 103) and relative_error(got, want) <= 1e-5


def test_only_where_asked_and_able(tmp_path, monkeypatch):
    """A target never takes it (its decode and verify steps must give a token the same bits); nor a
    model with biases, a third intra-op thread, or SPECDEC_CPU_DECODE=eager."""
    assert LlamaModel(tiny_dir(tmp_path, "llama3"), num_slots=1, max_context=32).fused is None
    assert LlamaModel(tiny_dir(tmp_path, "qwen2"), num_slots=1, max_context=32, fused_decode=True).fused is None
    model = LlamaModel(tiny_dir(tmp_path, "llama3"), num_slots=1, max_context=32, fused_decode=True)
    model.forward([model.allocate()], [random_tokens(5)], [0])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    model.fused.forward_rows = lambda *a: pytest.fail("the loop ran at three threads")
    model.forward([0], [[1]], [1])
    monkeypatch.setenv("SPECDEC_CPU_DECODE", "eager")
    assert LlamaModel(tiny_dir(tmp_path, "llama3"), num_slots=1, max_context=32, fused_decode=True).fused is None
