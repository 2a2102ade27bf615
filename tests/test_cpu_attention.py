"""The compiled CPU attention of decode and verify tokens (specdec/models/cpu_attention.py) against SDPA."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models_helpers import random_tokens, reference_logits, relative_error, tiny_dir
from specdec.models import cpu_attention
from specdec.models.llama import LlamaModel

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no compiled loop here (numba missing or failed)")


def sdpa_per_token(q, keys, values, slots, key_lens):
    """The reference: each query token alone through SDPA over its slot's first key_lens keys."""
    rows = []
    for t, (slot, length) in enumerate(zip(slots.tolist(), key_lens.tolist())):
        out = F.scaled_dot_product_attention(q[t][None, :, None], keys[slot : slot + 1, :, :length],
                                             values[slot : slot + 1, :, :length],
                                             enable_gqa=q.shape[1] != keys.shape[1])  # [1, H, 1, D]
        rows.append(out.reshape(1, -1))
    return torch.cat(rows)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_tokens_from_any_slots_match_sdpa(heads, kv_heads):
    """Decode rows and a causal verify row, from scattered slots, grouped-query or not."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, ctx = 16, 64
    keys = torch.randn(5, kv_heads, ctx + 1, dim, generator=gen)
    values = torch.randn(5, kv_heads, ctx + 1, dim, generator=gen)
    # rows: slot 3 decodes at 40, slot 0 verifies 4 tokens from 20, slot 4 decodes at its first key
    slots, key_lens = cpu_attention.query_layout([3, 0, 4], [39, 20, 0], [1, 4, 1])
    assert slots.tolist() == [3, 0, 0, 0, 0, 4] and key_lens.tolist() == [40, 21, 22, 23, 24, 1]
    q = torch.randn(len(slots), heads, dim, generator=gen)
    got = cpu_attention.attend(q, keys, values, slots, key_lens)
    assert got.shape == (len(slots), heads * dim)
    torch.testing.assert_close(got, sdpa_per_token(q, keys, values, slots, key_lens), rtol=0, atol=1e-5)


def test_a_tokens_result_does_not_depend_on_its_batch():
    """The same query at the same slot and length gives the same bits alone and among other rows:
    a token verified in a batch is attended exactly as when decoded alone."""
    gen = torch.Generator().manual_seed(7)
    keys, values = torch.randn(4, 2, 33, 8, generator=gen), torch.randn(4, 2, 33, 8, generator=gen)
    q = torch.randn(5, 4, 8, generator=gen)
    slots, key_lens = cpu_attention.query_layout([1, 2], [10, 27], [4, 1])
    # One build (the serial one, as batch-invariant models use it): on more threads a batch may take
    # the parallel build, promised equal only to float32 rounding.
    batched = cpu_attention.attend(q, keys, values, slots, key_lens, split=False)
    for t in range(5):
        alone = cpu_attention.attend(q[t : t + 1], keys, values, slots[t : t + 1], key_lens[t : t + 1], split=False)
        assert torch.equal(alone[0], batched[t])


def test_the_model_uses_it_for_decodes_and_verifies_and_agrees_with_sdpa(tmp_path, monkeypatch):
    """A decode, a verify and a decode from scattered slots: through the compiled loop (and not for a
    long prefill), the logits equal SDPA's path within float32 rounding and transformers' within the
    backend tests' tolerance. SPECDEC_CPU_ATTENTION=sdpa turns it off."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the loop's setting, on any machine
    path = tiny_dir(tmp_path, "llama3")
    model = LlamaModel(path, num_slots=6, max_context=128)
    assert model.compiled_attention
    calls = []
    original = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda *a: calls.append(len(a[0])) or original(*a))
    prefixes = [random_tokens(30, seed=1), random_tokens(20, seed=2), random_tokens(45, seed=3)]
    new = [random_tokens(1, seed=4), random_tokens(5, seed=5), random_tokens(1, seed=6)]
    slots = [model.allocate() for _ in range(6)]
    compiled, plain = [slots[4], slots[1], slots[5]], [slots[0], slots[2], slots[3]]
    for a, b, prefix in zip(compiled, plain, prefixes):
        model.forward([a, b], [prefix, prefix], [0, 0])  # prefills of 20-45 tokens: SDPA
    assert calls == []
    got = model.forward(compiled, new, [1, 5, 1])
    assert calls == [7] * model.config.num_layers  # every layer, the 7 tokens of the three rows
    model.compiled_attention = False
    want = model.forward(plain, new, [1, 5, 1])
    assert len(calls) == model.config.num_layers
    for row, (g, w) in enumerate(zip(got, want)):
        assert relative_error(g, w) <= 1e-5
        assert relative_error(g, reference_logits(path, prefixes[row] + new[row])[-len(new[row]):]) <= 1e-4
    monkeypatch.setenv("SPECDEC_CPU_ATTENTION", "sdpa")
    assert not LlamaModel(path, num_slots=2, max_context=64).compiled_attention


def test_more_than_two_threads_keep_sdpa(tmp_path, monkeypatch):
    """The loop was measured at one and two threads only: with more, SDPA keeps the attention."""
    model = LlamaModel(tiny_dir(tmp_path, "llama3"), num_slots=2, max_context=64)
    slot = model.allocate()
    model.forward([slot], [random_tokens(20)], [0])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert model._plan([slot], [[5]], [20], [1], [1]).query_key_lens is not None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert model._plan([slot], [[5]], [20], [1], [1]).query_key_lens is None


def scattered_queries(seed, tokens_per_row=(1, 5, 1, 3), heads=9, kv_heads=3, dim=16, ctx=80):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(6, kv_heads, ctx + 1, dim, generator=gen)
    values = torch.randn(6, kv_heads, ctx + 1, dim, generator=gen)
    slots, key_lens = cpu_attention.query_layout([4, 1, 0, 5], [70, 12, 0, 33], list(tokens_per_row))
    return torch.randn(len(slots), heads, dim, generator=gen), keys, values, slots, key_lens


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (6, 1, 16)])  # the default target's shape, and another
def test_the_parallel_builds_bits_do_not_depend_on_its_threads(heads, kv_heads, dim):
    """Each (token, KV head) item runs whole on one thread, so the thread count changes no bit of the
    parallel build's output; the serial build agrees with it to float32 rounding (both call one
    compiled function per item; LLVM may still re-optimise it inlined, so no more is promised)."""
    import numba

    q, keys, values, slots, key_lens = scattered_queries(3, heads=heads, kv_heads=kv_heads, dim=dim)
    outs = []
    for parallel, threads in ((False, 1), (True, 1), (True, numba.config.NUMBA_NUM_THREADS)):
        numba.set_num_threads(threads)
        out = torch.empty_like(q)
        cpu_attention._kernel(parallel)(q.numpy(), keys.numpy(), values.numpy(), slots, key_lens,
                                       np.float32(q.shape[-1] ** -0.5), out.numpy())
        outs.append(out)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert torch.equal(outs[1], outs[2])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[0].view(len(slots), -1), sdpa_per_token(q, keys, values, slots, key_lens),
                               rtol=0, atol=1e-5)


def test_attend_splits_items_over_threads_only_for_several_tokens_on_several_threads(monkeypatch):
    """Two intra-op threads and two tokens or more: the parallel build; a lone decode token (only
    KV-heads items), one thread, split=False or SPECDEC_CPU_ATTENTION=serial: the serial one."""
    builds = {parallel: cpu_attention._kernel(parallel) for parallel in (False, True)}
    used = []

    def recording(parallel=False):
        return lambda *args: used.append(parallel) or builds[parallel](*args)

    q, keys, values, slots, key_lens = scattered_queries(4)
    serial = cpu_attention.attend(q, keys, values, slots, key_lens)
    monkeypatch.setattr(cpu_attention, "_kernel", recording)
    for threads, tokens, split, wanted in ((2, len(slots), True, True), (2, 1, True, False),
                                           (1, len(slots), True, False), (2, len(slots), False, False)):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        got = cpu_attention.attend(q[:tokens], keys, values, slots[:tokens], key_lens[:tokens], split)
        assert used[-1] is wanted
        torch.testing.assert_close(got, serial[:tokens], rtol=0, atol=1e-6)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("SPECDEC_CPU_ATTENTION", "serial")  # the A/B switch
    assert torch.equal(cpu_attention.attend(q, keys, values, slots, key_lens), serial) and used[-1] is False


LOAD_AND_COUNT = """
import os, sys, torch
from specdec.models.llama import LlamaModel
from specdec.models.step_threads import StepThreads
tasks = len(os.listdir("/proc/self/task"))
target = LlamaModel(sys.argv[1], num_slots=2, max_context=64, step_threads=StepThreads(1, 2))
after_target = torch.get_num_threads()
draft = LlamaModel(sys.argv[1], num_slots=2, max_context=64, fused_decode=True)  # as a hosted draft loads
print(after_target, torch.get_num_threads(), len(os.listdir("/proc/self/task")) - tasks)
"""


def test_loading_models_starts_no_threads_on_the_loading_thread(tmp_path):
    """A target whose forwards run on two threads compiles the parallel builds at load. Compiling
    starts numba's threading layer, which set the loading thread's count to numba's; a hosted draft
    loaded next then calibrated on two threads and left an OpenMP team on the loading thread beside the
    model thread's, and libgomp stopped spin-waiting between products: the target's one-token step in
    its service went from 16 to 22 ms. In a fresh process: the count stays 1 and no thread starts."""
    import subprocess
    import sys

    path = tiny_dir(tmp_path, "llama3")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    done = subprocess.run([sys.executable, "-c", LOAD_AND_COUNT, str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1", "0"]


def test_models_on_several_threads_split_their_attention_unless_batch_invariant(tmp_path, monkeypatch):
    from specdec.models.step_threads import StepThreads

    path = tiny_dir(tmp_path, "llama3")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not LlamaModel(path, num_slots=2, max_context=64).split_attention
    assert LlamaModel(path, num_slots=2, max_context=64, step_threads=StepThreads(1, 2)).split_attention
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert LlamaModel(path, num_slots=2, max_context=64).split_attention
    # Its one-token steps must give a verify's bits, and the two builds only agree to float32 rounding.
    assert not LlamaModel(path, num_slots=2, max_context=64, batch_invariant=True).split_attention
