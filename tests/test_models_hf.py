"""The transformers fallback backend, the loader, and native == transformers on the real default model."""

import pytest
import torch

from models_helpers import random_tokens, reference_logits, relative_error, tiny_dir
from specdec.errors import CacheFull, ContextOverflow, InvalidArgument
from specdec.models.hf_backend import HFModel
from specdec.models.loader import load_model

TOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-hf")


@pytest.mark.parametrize("case", ["llama", "qwen2", "mistral"])
def test_hf_backend_equals_native_on_a_mixed_batch(root, case):
    path = tiny_dir(root, case)
    models = [load_model(path, backend, num_slots=4, max_context=96) for backend in ("native", "hf")]
    prefixes = [random_tokens(20, seed=1), random_tokens(7, seed=2), []]
    new = [random_tokens(1, seed=3), random_tokens(5, seed=4), random_tokens(12, seed=5)]
    outputs = []
    for model in models:
        slots = [model.allocate() for _ in prefixes]
        for slot, prefix in zip(slots, prefixes):
            if prefix:
                model.forward([slot], [prefix], [1])
        outputs.append(model.forward(slots, new, [1, 5, 1]))
        assert [model.length(s) for s in slots] == [21, 12, 12]
    for native_row, hf_row in zip(*outputs):
        assert native_row.shape == hf_row.shape
        assert relative_error(native_row, hf_row) <= TOL


def test_hf_prefill_decode_truncate_fork(root):
    path = tiny_dir(root, "llama")
    tokens, other = random_tokens(30), random_tokens(6, seed=1)
    model = HFModel(path, num_slots=2, max_context=64)
    slot = model.allocate()
    got = [model.forward([slot], [tokens[:20]])[0]] + [model.forward([slot], [[t]])[0] for t in tokens[20:]]
    assert relative_error(torch.cat(got), reference_logits(path, tokens)) <= TOL
    branch = model.allocate()
    model.fork(slot, branch, 11)
    model.truncate(slot, 11)
    assert model.length(slot) == model.length(branch) == 11
    a, b = model.forward([slot], [other])[0], model.forward([branch], [other])[0]
    assert torch.equal(a, b)
    assert relative_error(a, reference_logits(path, tokens[:11] + other)[11:]) <= TOL


def test_hf_slots_and_context_limits(root):
    model = HFModel(tiny_dir(root, "llama"), num_slots=1, max_context=8)
    slot = model.allocate()
    with pytest.raises(CacheFull):
        model.allocate()
    with pytest.raises(ContextOverflow):
        model.forward([slot], [random_tokens(9)])
    model.forward([slot], [random_tokens(8)], [1])
    with pytest.raises(InvalidArgument):
        model.truncate(slot, 9)
    model.free(slot)
    assert model.allocate() == slot and model.length(slot) == 0


def test_loader_rejects_what_it_cannot_load(root, tmp_path):
    with pytest.raises(InvalidArgument, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(InvalidArgument, match="backend"):
        load_model(tiny_dir(root, "llama"), backend="vllm")
    model = load_model(tiny_dir(root, "smollm"), backend="auto", max_context=32)
    assert (model.info.backend, model.info.architecture, model.info.max_context) == ("native", "llama", 32)


def test_native_equals_transformers_on_the_default_target(default_target_dir):
    """SmolLM2-135M-Instruct, fp32: a prefill, decodes and a verify against one transformers forward."""
    from transformers import AutoModelForCausalLM

    path = default_target_dir
    tokens = random_tokens(120, vocab=49152, seed=11)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].float()
    del reference
    model = load_model(path, "native", num_slots=2, max_context=256)
    slot = model.allocate()
    got = [model.forward([slot], [tokens[:100]], [100])[0]]
    got += [model.forward([slot], [[t]])[0] for t in tokens[100:110]]
    got.append(model.forward([slot], [tokens[110:]])[0])
    got = torch.cat(got)
    assert relative_error(got, want) <= TOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_hf_logits_are_ordinary_tensors(root):
    model = HFModel(tiny_dir(root, "llama"), num_slots=1, max_context=16)
    logits = model.forward([model.allocate()], [[1, 2, 3]], [2])[0]
    logits[:, 0] = float("-inf")
    assert logits.shape == (2, 256) and not logits.is_inference()
