"""The native Llama-family backend against transformers, and its slot semantics, on tiny random models."""

import pytest
import torch

from models_helpers import TINY_CASES, random_tokens, reference_logits, relative_error, tiny_dir
from specdec.errors import CacheFull, ContextOverflow, InvalidArgument
from specdec.models.llama import LlamaModel
from specdec.models.llama_config import UnsupportedModel
from specdec.models.loader import load_model, native_support

TOL = 1e-4  # fp32: the two implementations differ only in summation order


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def native(path, **kwargs) -> LlamaModel:
    kwargs.setdefault("num_slots", 4)
    kwargs.setdefault("max_context", 128)
    return LlamaModel(path, **kwargs)


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_prefill_then_decode_equals_transformers(root, case):
    path = tiny_dir(root, case)
    tokens = random_tokens(48)
    want = reference_logits(path, tokens)
    model = native(path)
    slot = model.allocate()
    got = [model.forward([slot], [tokens[:30]])[0]]  # prefill, all logits
    got += [model.forward([slot], [[t]])[0] for t in tokens[30:40]]  # one-token decodes
    got.append(model.forward([slot], [tokens[40:]])[0])  # an 8-token verify
    got = torch.cat(got)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert relative_error(got, want) <= TOL
    assert model.length(slot) == 48


def test_truncate_then_refeed_equals_fresh_prefill(root):
    path = tiny_dir(root, "llama3")
    tokens, other = random_tokens(40), random_tokens(10, seed=1)
    model = native(path)
    slot = model.allocate()
    model.forward([slot], [tokens], [1])
    model.truncate(slot, 17)
    got = model.forward([slot], [other])[0]
    assert model.length(slot) == 27
    fresh = model.allocate()
    want = model.forward([fresh], [tokens[:17] + other])[0][17:]
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    assert relative_error(got, reference_logits(path, tokens[:17] + other)[17:]) <= TOL


def test_rows_of_different_lengths_run_only_their_own_tokens(root):
    """A verify among decodes: padded, every row would run the verify's width through the projections
    and the MLP (on a CPU one verify of 5 tokens among 15 decodes cost 281 ms a step against 100 ms)."""
    model = native(tiny_dir(root, "qwen2"), num_slots=4)
    slots = [model.allocate() for _ in range(3)]
    for slot in slots:
        model.forward([slot], [random_tokens(12, seed=slot)], [0])
    ragged = model._plan(slots, [[1], [2, 3, 4, 5, 6], [7]], [12, 12, 12], [1, 5, 1], [1, 5, 1])
    assert ragged.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7] and ragged.packed_index.tolist() == [0, 5, 6, 7, 8, 9, 10]
    assert ragged.logit_rows.tolist() == list(range(7)) and ragged.write_index.numel() == 7 * model.config.num_kv_heads
    even = model._plan(slots, [[1, 2], [3, 4], [5, 6]], [12, 12, 12], [2, 2, 2], [1, 1, 1])
    assert even.packed_index is None and even.tokens.numel() == 6


@pytest.mark.parametrize("slot_order, in_place", [("contiguous", True), ("scattered", True), ("scattered", False),
                                                  ("contiguous", False)])
def test_mixed_batch_equals_rows_run_alone(root, slot_order, in_place, monkeypatch):
    """A prefill, a decode, a k+1 verify and a continued prefill in one forward, at different positions.
    Rows of different lengths run packed (only their own tokens through the projections and the MLP)
    and attend slot by slot in place on a CPU (in_place), or scattered into the padded layout and
    gathered into one tensor or viewed as a slot range (as on a GPU)."""
    import specdec.models.llama as llama

    attended_in_place = []
    original = llama.attention_in_place
    monkeypatch.setattr(llama, "attention_in_place", lambda *a: attended_in_place.append(1) or original(*a))
    path = tiny_dir(root, "qwen2")
    model = native(path, num_slots=8)
    model.attend_in_place = in_place
    prefixes = [[], random_tokens(25, seed=2), random_tokens(9, seed=3), random_tokens(40, seed=4)]
    new = [random_tokens(17, seed=5), random_tokens(1, seed=6), random_tokens(6, seed=7), random_tokens(3, seed=8)]
    num_logits = [1, 1, 6, 2]
    slots = [model.allocate() for _ in range(8)]
    batched = slots[:4] if slot_order == "contiguous" else [slots[5], slots[0], slots[7], slots[2]]
    alone = [s for s in slots if s not in batched]
    for slot_a, slot_b, prefix in zip(batched, alone, prefixes):
        if prefix:
            model.forward([slot_a, slot_b], [prefix, prefix], [0, 0])
    attended_in_place.clear()
    got = model.forward(batched, new, num_logits)
    assert bool(attended_in_place) == in_place
    for row, (slot, tokens, k) in enumerate(zip(alone, new, num_logits)):
        want = model.forward([slot], [tokens], [k])[0]
        assert got[row].shape == (k, 256)
        assert relative_error(got[row], want) <= 1e-5
        assert relative_error(got[row], reference_logits(path, prefixes[row] + tokens)[-k:]) <= TOL
    assert [model.length(s) for s in batched] == [len(p) + len(n) for p, n in zip(prefixes, new)]


def test_fork_gives_identical_continuations_and_leaves_the_source(root):
    path = tiny_dir(root, "smollm")
    model = native(path)
    tokens, tail = random_tokens(30), random_tokens(5, seed=9)
    src, dst, fresh = model.allocate(), model.allocate(), model.allocate()
    model.forward([src, fresh], [tokens, tokens], [0, 0])
    model.fork(src, dst, 22)
    assert model.length(dst) == 22 and model.length(src) == 30
    branch = model.forward([dst], [tail])[0]
    # The branch's writes went to dst only: the source continues as if no fork happened.
    assert torch.equal(model.forward([src], [tail])[0], model.forward([fresh], [tail])[0])
    model.truncate(src, 22)
    assert torch.equal(model.forward([src], [tail])[0], branch)


def test_slots_run_out_then_free_and_allocate(root):
    model = native(tiny_dir(root, "llama"), num_slots=2)
    a, _ = model.allocate(), model.allocate()
    with pytest.raises(CacheFull, match="free a session"):
        model.allocate()
    model.free(a)
    assert model.num_free_slots == 1 and model.allocate() == a


def test_context_overflow_leaves_the_slot_unchanged(root):
    with pytest.raises(InvalidArgument, match="max_position_embeddings 512"):
        native(tiny_dir(root, "llama"), max_context=1024)
    model = native(tiny_dir(root, "llama"), max_context=32)
    slot = model.allocate()
    model.forward([slot], [random_tokens(30)], [1])
    with pytest.raises(ContextOverflow, match="max_context 32"):
        model.forward([slot], [[1, 2, 3]])
    assert model.length(slot) == 30
    assert model.forward([slot], [[1, 2]])[0].shape == (2, 256)


def test_bad_arguments_are_invalid(root):
    model = native(tiny_dir(root, "llama"))
    slot = model.allocate()
    with pytest.raises(InvalidArgument):
        model.forward([slot], [[]])
    with pytest.raises(InvalidArgument, match="token ids"):
        model.forward([slot], [[256]])
    with pytest.raises(InvalidArgument, match="once per forward"):
        model.forward([slot, slot], [[1], [2]])
    assert model.forward([slot], [[1, 2]], [0])[0].shape == (0, 256)


def test_sharded_checkpoint_loads_like_a_single_file(root):
    tokens = random_tokens(12)
    sharded = tiny_dir(root, "llama", shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = native(sharded), native(tiny_dir(root, "llama"))
    assert torch.equal(a.forward([a.allocate()], [tokens])[0], b.forward([b.allocate()], [tokens])[0])


def test_sliding_window_is_refused_where_it_would_apply(root):
    path = tiny_dir(root, "mistral", sliding_window=16)
    with pytest.raises(UnsupportedModel, match="max_context <= 16"):
        native(path, max_context=64)
    model = native(path, max_context=16)  # the window never applies: exact
    tokens = random_tokens(16)
    assert relative_error(model.forward([model.allocate()], [tokens])[0], reference_logits(path, tokens)) <= TOL


def test_unsupported_rope_falls_back_to_transformers_with_auto(root):
    path = tiny_dir(root, "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "rope type 'dynamic'" in native_support(path)
    with pytest.raises(UnsupportedModel):
        load_model(path, "native")
    assert load_model(path, "auto", max_context=64).info.backend == "hf"


def test_half_precision_and_kv_budget(root):
    path = tiny_dir(root, "llama")
    tokens = random_tokens(20)
    model = load_model(path, dtype="bfloat16", max_context=64, kv_budget_bytes=3 * 2 * 2 * 2 * 65 * 16 * 2)
    assert model.num_slots == 3 and model.info.dtype == "bfloat16"
    got = model.forward([model.allocate()], [tokens])[0]
    assert got.dtype == torch.float32
    assert relative_error(got, reference_logits(path, tokens)) < 0.05  # bf16 keeps ~3 significant digits


def test_logits_are_ordinary_tensors(root):
    """Samplers may mask logits in place; inference-mode tensors would refuse that."""
    model = native(tiny_dir(root, "llama"))
    logits = model.forward([model.allocate()], [[1, 2, 3]], [2])[0]
    logits[:, 0] = float("-inf")
    assert not logits.is_inference()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mixed_batch_equals_transformers(root):
    path = tiny_dir(root, "qwen2")
    tokens = random_tokens(40)
    model = native(path, device="cuda")
    a, b = model.allocate(), model.allocate()
    model.forward([b], [tokens[:20]], [0])
    verify, prefill = model.forward([b, a], [tokens[20:25], tokens], [5, 40])
    want = reference_logits(path, tokens)
    assert relative_error(prefill.cpu(), want) <= TOL
    assert relative_error(verify.cpu(), want[20:25]) <= TOL


def test_matmul_reductions_switch_sets_torchs_flags_and_refuses_unknown_values(root, monkeypatch):
    """SPECDEC_MATMUL_REDUCTIONS=full (an A/B switch for GPU runs): half-precision matrix products
    reduce in float32; the default leaves PyTorch's flags alone; anything else is refused by name."""
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    path = tiny_dir(root, "llama")
    try:
        monkeypatch.setenv("SPECDEC_MATMUL_REDUCTIONS", "default")
        load_model(path, num_slots=1, max_context=32)
        assert (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction) == before
        monkeypatch.setenv("SPECDEC_MATMUL_REDUCTIONS", "full")
        load_model(path, num_slots=1, max_context=32)
        assert not matmul.allow_bf16_reduced_precision_reduction and not matmul.allow_fp16_reduced_precision_reduction
        monkeypatch.setenv("SPECDEC_MATMUL_REDUCTIONS", "fp32")
        with pytest.raises(InvalidArgument, match=r"SPECDEC_MATMUL_REDUCTIONS must be one of \('default', 'full'\)"):
            load_model(path, num_slots=1, max_context=32)
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = before
