"""The static path's compiled layer stack (specdec.models.compiled_layers).

On CPU the pieces run uncompiled (compile_layers=True on a CPU device) and must give the normal
forward's logits, with both weight layouts; the gpu tests compile and capture them for real.
"""

from __future__ import annotations

import pytest
import torch

from models_helpers import random_tokens, relative_error, tiny_dir
from specdec.models.compiled_layers import COMPILE_OPTIONS
from specdec.models.llama import LlamaModel
from test_cuda_graphs import script


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-compiled")


def pair(path, device="cpu", dtype="float32", linear_kernel="auto"):
    """The normal forward, and the static path through the compiled layer stack."""
    make = lambda **kw: LlamaModel(path, device=device, dtype=dtype, num_slots=6, max_context=300,  # noqa: E731
                                   linear_kernel=linear_kernel, **kw)
    return make(), make(cuda_graphs=True, compile_layers=True)


@pytest.mark.parametrize("linear_kernel", ["auto", "dense-nt"])
@pytest.mark.parametrize("case", ["llama3", "qwen2", "llama"])
def test_split_layers_equal_the_normal_forward(root, case, linear_kernel):
    normal, split = pair(tiny_dir(root, case), linear_kernel=linear_kernel)
    want, got = script(normal), script(split)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=1e-5 * w.abs().max().item())
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    assert split.graphs.stats.replays == 5 + 3 and not split.graphs.layers.compile  # + the 20-token prefill's pieces


def test_compile_options_name_inductor_settings():
    """A misspelt or renamed option would fail only at the first compilation, on a GPU."""
    import torch._inductor.config as inductor_config

    for name in COMPILE_OPTIONS:
        group, _, option = name.rpartition(".")
        assert hasattr(getattr(inductor_config, group) if group else inductor_config, option), name


def test_off_by_default(root):
    model = LlamaModel(tiny_dir(root, "llama3"), num_slots=2, max_context=64, cuda_graphs=True)
    assert model.graphs.layers is None


# ---- CUDA: compiled and captured -------------------------------------------------------------------


def decode_and_verify(model: LlamaModel) -> list[torch.Tensor]:
    """A prefill (eager), decodes replayed at new positions, then a two-row verify + decode: two token
    counts, so two compilations of each piece."""
    slot, other = model.allocate(), model.allocate()
    # Prefills longer than graphed pieces cover (36 tokens): eager, so that only two shapes compile.
    out = model.forward([slot], [random_tokens(40)], [1]) + model.forward([other], [random_tokens(38, seed=1)], [1])
    out += [model.forward([slot], [[t]])[0] for t in random_tokens(4, seed=2)]
    out += model.forward([slot, other], [[1, 2, 3, 4, 5], [6]])
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "linear_kernel"), [("float32", "dense"), ("bfloat16", "auto")])
def test_cuda_compiled_layers_equal_eager(root, dtype, linear_kernel):
    eager, compiled = pair(tiny_dir(root, "llama3"), device="cuda", dtype=dtype, linear_kernel=linear_kernel)
    want, got = decode_and_verify(eager), decode_and_verify(compiled)
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    for g, w in zip(got, want):
        assert relative_error(g.cpu(), w.cpu()) <= tolerance
    stats = compiled.graphs.stats
    assert stats.captured == 2 and stats.replays == 5 and compiled.graphs.layers.compile
