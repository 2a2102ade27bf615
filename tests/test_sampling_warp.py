"""warp_logits: temperature, top-k, top-p in Hugging Face's order; greedy as a one-hot."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.sampling.params import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams
from specdec.sampling.warp import greedy_token, warp_logits, warp_rows
from sampling_helpers import single_torch_thread  # noqa: F401 (autouse fixture)

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.5, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.6),
    SamplingParams(temperature=1.3, top_k=3, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=1),
]


def _hf_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' own warpers, chained as generate() chains them (a test oracle)."""
    generation = pytest.importorskip("transformers.generation.logits_process")
    scores = logits.clone()
    scores = generation.TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = generation.TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = generation.TopPLogitsWarper(params.top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_matches_transformers_warpers(params):
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = warp_logits(logits, params)
    theirs = _hf_reference(logits, params)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    generator = torch.Generator().manual_seed(1)
    for top_p in (0.05, 0.3, 0.6, 0.9, 0.99):
        logits = torch.randn(30, generator=generator) * 2
        full = torch.softmax(logits, dim=-1).double()
        kept = warp_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
        order = torch.argsort(full, descending=True)
        mass_before = torch.cumsum(full[order], 0) - full[order]
        expected = torch.zeros(30, dtype=torch.bool)
        expected[order[mass_before < top_p]] = True  # include tokens until the mass reaches top_p
        assert torch.equal(kept, expected), top_p
        assert float(full[kept].sum()) >= top_p


def test_tiny_top_p_keeps_exactly_the_most_probable_token():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_k_keeps_ties_with_the_kth_score():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, True, True, False]


def test_top_k_is_applied_before_top_p():
    # After top-k=2 the survivors are renormalised to 0.625 / 0.375, so top-p=0.6 keeps one token;
    # top-p on the full distribution (0.5 < 0.6) would have kept two.
    logits = torch.log(torch.tensor([0.3, 0.5, 0.2]))
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_greedy_is_a_one_hot_at_the_first_argmax():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [9.0, 0.0, 0.0, 9.0]])
    probs = warp_logits(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.5))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert greedy_token(logits[0]) == 1 and greedy_token(logits[1]) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_float_dtype_gives_float32_probabilities(dtype):
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    probs = warp_logits(logits, SamplingParams(temperature=0.8, top_k=10, top_p=0.9))
    assert probs.dtype == torch.float32 and probs.shape == (2, 3, 40)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert (probs > 0).sum(-1).ge(1).all()


def test_logits_that_are_minus_infinity_stay_impossible():
    logits = torch.tensor([float("-inf"), 1.0, 0.5, float("-inf")])
    probs = warp_logits(logits, SamplingParams(temperature=2.0, top_p=0.999))
    assert probs[0] == 0 and probs[3] == 0 and probs[1] > probs[2] > 0


def test_rows_with_mixed_parameters_equal_one_row_at_a_time_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    extra = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.3, top_p=0.5)]
    params = (SETTINGS + extra) * 3
    logits = torch.randn(len(params), 64, generator=generator) * 2.5
    together = warp_rows(logits, params)
    for row, row_params in enumerate(params):
        assert torch.equal(together[row], warp_logits(logits[row], row_params)), row_params


def test_the_temperature_range_keeps_the_scaled_logits_finite():
    """At both ends of the allowed range, large logits and masked (-inf) ones still give a distribution;
    outside it the request is refused (the scaling is float32: 1e-300 rounds to 0 there)."""
    logits = torch.tensor([[900.0, 899.0, -900.0, float("-inf")]])
    for temperature in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        probs = warp_logits(logits, SamplingParams(temperature=temperature, top_k=3).validate())
        assert torch.isfinite(probs).all() and probs[0, 3] == 0 and abs(float(probs.sum()) - 1) < 1e-6
    for temperature in (-1.0, 1e-300, MIN_TEMPERATURE / 2, MAX_TEMPERATURE * 2, 1e300, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument, match="temperature must be >= 0 and finite"):
            SamplingParams(temperature=temperature).validate()
